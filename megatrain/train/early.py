"""The checks ``megatrain train`` makes before it imports torch or transformers.

Importing torch, transformers and ``datasets`` and resolving the model take tens of seconds on a
busy 2-core machine (22-32 s at a load of 10 in the issue that asked for this), so a missing file
or a malformed first record used to be reported that late. :func:`check_inputs` runs first,
reading only files and JSON: every path the settings name, the model's config.json, the hardware
spec, the data's files and suffixes, and the first :data:`FIRST_RECORDS` records of each JSON Lines
(and small JSON) data file. Each check is the one the run makes later, called early (the readers'
own functions: ``corpus_files``, ``corpus.sft_sources``, ``check_first_records``,
``read_model_config``, ``load_hardware``), so the two cannot disagree; the errors are the same
``ConfigError`` lines. What needs the libraries (a config's values as transformers reads them, a
tokenizer's vocabulary, Parquet and Arrow files, every record) is checked where it is today.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatrain.errors import ConfigError
from megatrain.train.config import TrainConfig

FIRST_RECORDS = 8
"""Records read from the start of each JSON Lines (and small JSON) data file before torch loads."""


def check_inputs(cfg: TrainConfig) -> None:
    """Check what ``cfg`` names on disk, cheaply, in the order a user fixes things: the output
    directory, the model and ``init_from``, the other files, then the data.

    Raises:
        ConfigError: ``output_dir`` not writable; no such model, preset or file; a config.json that
            is not a JSON object with a ``model_type``; an ``init_from`` without a config.json; a
            missing tokenizer, chat template, hardware spec or NVMe directory; missing data, a
            data file of an unknown suffix, or a malformed record among the first
            :data:`FIRST_RECORDS` of a JSON Lines file (naming the file and line).
    """
    from megatrain.planner.presets import read_model_config
    from megatrain.train.rundir import check_writable

    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun rank 0 alone writes (and probes) output_dir
        check_writable(Path(cfg.output_dir))
    read_model_config(cfg.model)
    if cfg.init_from is not None and not (Path(cfg.init_from) / "config.json").is_file():
        raise ConfigError(f"init_from {cfg.init_from} is not a directory with a config.json; give a megatrain "
                          "checkpoint (a run's output_dir/checkpoint) or a Hugging Face weights directory")
    for field in ("tokenizer", "chat_template", "nvme_dir"):
        value = getattr(cfg, field)
        if value is not None and not Path(value).exists():
            raise ConfigError(f"{field} {value} does not exist; give an existing path (--{field.replace('_', '-')})")
    if cfg.hardware is not None:
        from megatrain.ir.hardware import load_hardware

        load_hardware(cfg.hardware)
    try:
        _check_data(cfg)
    except (OSError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"data: {e}") from None


def _check_data(cfg: TrainConfig) -> None:
    if cfg.task in ("dpo", "grpo"):  # preference pairs and prompts are read (through datasets) before the plan
        return
    if cfg.task == "sft":
        from megatrain.data.sft_sources import check_first_records
        from megatrain.train.corpus import sft_sources

        for source in sft_sources(cfg):
            check_first_records(source, FIRST_RECORDS)
        return
    from megatrain.data.sources import check_first_records, corpus_files

    for path in corpus_files(cfg.data):
        if path.suffix.lower() == ".jsonl":
            check_first_records(path, cfg.text_field, FIRST_RECORDS)
