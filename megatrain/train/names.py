"""The names of what ``megatrain train`` writes in a run's ``output_dir``: the lowest floor of
``megatrain.train``, read by the config (its saved copy), the model source (a run's checkpoint) and
the run directory (:mod:`megatrain.train.rundir`, which re-exports them), so none of those imports
another for a file name."""

CHECKPOINT_DIR = "checkpoint"
METRICS_FILE = "metrics.jsonl"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CONFIG_FILE = "train_config.json"
PLOT_FILE = "loss.png"
SCHEDULE_FILE = "schedule.json"
"""The steady-state train schedule the run executes (``Schedule.save``): byte for byte what
``megatrain plan --config`` with the run's settings writes to ``--out DIR/schedule.json``."""
STORE_DIR = "tokens"
"""The run's token store (``megatrain.data.cached_token_store``) unless ``data_cache`` puts it elsewhere."""
STATE_KEY = "megatrain_train"
STATE_VERSION = 1

LOCK_FILE = ".megatrain.lock"
"""The lock file of ``output_dir`` (:class:`megatrain.files.DirectoryLock`): one run at a time, naming the holder."""
NVME_LOCK_FILE = ".megatrain-nvme.lock"
"""The lock file of ``nvme_dir``: one run at a time keeps its tile files there (a name of its own, so
that an ``nvme_dir`` that is also the ``output_dir`` takes both locks)."""

RUN_FILES = (CONFIG_FILE, TOKENIZER_FILE, METRICS_FILE, PLOT_FILE, SCHEDULE_FILE, CHECKPOINT_DIR, STORE_DIR)
"""What ``megatrain train`` writes in ``output_dir`` (besides the hidden files of :func:`megatrain.train.rundir._is_leftover`)."""
