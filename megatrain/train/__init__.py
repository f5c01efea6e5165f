"""``megatrain train``: train a causal LM from a config file and flags, with checkpoints, metrics and
clean failures.

One run (:func:`train`, in :mod:`~megatrain.train.run`: :mod:`~megatrain.train.loop`'s, or for ``--task dpo``
and ``grpo`` :mod:`~megatrain.train.rl_tasks`') is a visible sequence of stages, each a
function of a module of this package::

    config      TrainConfig: YAML or JSON file, then flags on top, validated by pydantic
    early       check_inputs, before torch and transformers load (the CLI runs it): output_dir
                writable, the model's config.json, the files named, the data's files and first records
    device      resolve_device: device auto is CUDA where torch sees a GPU, else the CPU; the
                run's first line says which and why
    model       resolve_model: a config.json | Hugging Face weights | a megatrain checkpoint
    rundir      output_dir: this run again (resume or start over), or refuse another run
    plan        the planning front door (megatrain.planner.front.plan), once: trace, solve, data
                parallel, NVMe placement, host state, lower, verify (loop.plan_request: the same
                request `megatrain plan --config` makes; the model on the meta device for CUDA, on
                the CPU built there, after a parameter-count bound)
    preflight   that planned model's host bytes + data + a checkpoint shard against MemAvailable,
                before anything large is allocated
    corpus      tokenizer -> token store (megatrain.data.cached_token_store) -> StoreWindows
                windows; --task sft: the datasets of data -> the SFT store (chat template, answers
                kept, megatrain.data.cached_sft_store) -> packed rows (megatrain.data.SftDataset)
    materialize megatrain.materialize of the same planned model: host tiles, backend, executor
    weights     Trainer.load_hf_weights, or Trainer.load for an exact resume
    loop        lr (warm-up + cosine), step, the guard (guard: skip, roll back, stop), evaluation,
                checkpoints, metrics.jsonl (metrics), progress bar, SIGINT / SIGTERM
    metrics     loss.png, the loss curve (matplotlib, the ``plot`` extra)
    rl_tasks    --task dpo and --task grpo: the same stages up to the weights, then preference pairs
                or prompts, rollouts and rewards, and a loop of their own (train dispatches to it)
    stages      what both runs share: threads, the model source, the NVMe lock, the run files,
                the checkpoint (with its tokenizer or processor), the loss plot. loop.Run holds
                the LM/SFT run's stages as methods (start, plan, prepare_data, materialize,
                open_outputs, train_loop, finish); rl_tasks.RlRun the DPO/GRPO run's

``machine`` holds what this machine offers (host memory, RSS, a matmul rate, a hardware spec).

Files in ``output_dir``: ``train_config.json`` (the resolved config of the latest start),
``tokenizer.json``, ``schedule.json`` (the steady-state train schedule the run executes, as
``megatrain plan --config`` writes it), ``metrics.jsonl`` (one JSON object per step, see :data:`~megatrain.train.metrics.METRIC_FIELDS`),
``checkpoint/`` (Hugging Face layout plus ``megatrain_state/``, replaced atomically at every save,
with copies of ``tokenizer.json`` and a ``tokenizer_config.json`` naming its special tokens, which the
checkpoint's config and generation config use too), ``loss.png``. Resume by passing
``output_dir/checkpoint`` as the model (the run's other settings then come from its
``train_config.json``), or by running the same command again: the weights, Adam moments and steps,
RNG states, the step number and the data position come back, so the resumed run takes the same
batches at the same learning rates as an uninterrupted one. ``init_from`` is the other way to use
a checkpoint: a new run that takes only its weights (and tokenizer), from step 0 with fresh AdamW
state and its own data, batch and schedule (fine-tuning a pretrained checkpoint). At the end the
run prints where the model directory, ``metrics.jsonl`` and ``loss.png`` are and, on the CPU
backend, a greedy continuation of a validation prompt (:mod:`~megatrain.train.sample`).

Threads (CPU backend): :func:`megatrain.runtime.threads.choose_threads` sets torch's intra-op
threads (``threads``, else ``OMP_NUM_THREADS``, else one per available CPU); the CLI asks OpenMP for
the passive wait policy before torch loads, and the progress line says when the machine is
oversubscribed.

Re-running a failed run. Whatever stopped a run (a kill before the first checkpoint, ``nonfinite:
stop``, a signal while the data was prepared, a second SIGINT, a crash, a full disk), the same
command runs again: an ``output_dir`` holding this run (:data:`~megatrain.train.rundir.RUN_IDENTITY`)
resumes from its checkpoint, starts over when it has none, and has nothing to do (exit 0) when it
finished (:func:`~megatrain.train.rundir.check_output_dir`); a ``checkpoint/`` that is there but
incomplete is reported, never removed. One run at a time holds ``output_dir`` (a lock file naming
its process; ``megatrain.files``), and one process at a time builds a token store. Every file of
the run is written atomically, and a partial last line of ``metrics.jsonl`` is dropped.

Model checks, before anything is built: a causal decoder-only model, and ``seq_len`` within its
``max_position_embeddings`` (``megatrain.models``); ``output_dir`` writable.

MFU (model FLOPs utilisation) is ``megatrain.planner.cost.model_flops_per_token(graph)`` x tokens/s
over a peak matmul rate. On the CPU backend there is no GPU peak to divide by: the peak is this
CPU's FP32 matmul rate, measured once at start-up by timing ``torch.mm`` of two 1024 x 1024 FP32
matrices for about 0.3 s with the training's thread count (:func:`~megatrain.runtime.measure.measure_matmul_flops`); a
hardware spec's GPU peak would not describe the processor doing the work. With ``device="cuda"``
the peak is the ``hardware`` spec's rate for the plan's compute dtype, or measured on the GPU the
same way when no spec is given. Tokens count padding, as model-FLOPs accounting usually does.

Predicted step time: the planned model's ``timeline`` (``megatrain.plan_model``), the simulated
steady-state train schedule (with clipping, the one that also runs the previous step's deferred
optimizer steps) on the ``hardware`` spec, when one with non-zero GPU rates is given (a preset
such as ``H100_SXM``, or a spec file); otherwise ``predicted_step_s`` is null. It is simulated once,
when the model is planned (on ``device="cuda"`` it is the solver's own simulation of the plan it
chose for that spec). On the CPU backend it is the step the spec's GPU is predicted to take, next
to the step this machine measured.

Non-finite steps (:mod:`~megatrain.train.guard`): a step whose loss or gradient is NaN or infinite,
whose update left a non-finite weight, or (``loss_spike``) whose loss spikes is not kept: its
deferred update is dropped, or the run rolls back to its last checkpoint and replays the steps
since without it; ``nonfinite: stop`` raises without saving, and ``max_consecutive_skips`` steps
in a row not kept stop the run too. SIGINT and SIGTERM finish the current step, save a checkpoint
and return; before the training loop they interrupt (the CLI exits 130 or 143).

Errors are megatrain.errors types; the CLI prints ``error: <message>`` and exits 2.
"""

from megatrain.lazy import lazy_names
from megatrain.train.config import TrainConfig, load_train_config

# The rest imports torch: loaded on first use (PEP 562), so that the CLI's --help and the config's
# validation need only pydantic.
_LAZY = {
    "TrainResult": "megatrain.train.loop", "train": "megatrain.train.run", "lr_at": "megatrain.train.lr",
    "available_host_memory": "megatrain.runtime.measure", "measure_matmul_flops": "megatrain.runtime.measure",
    "METRIC_FIELDS": "megatrain.train.metrics", "save_loss_plot": "megatrain.train.metrics",
    "ModelSource": "megatrain.train.model", "resolve_model": "megatrain.train.model",
    "DATA_BYTES_PER_TEXT_BYTE": "megatrain.train.preflight", "preflight_host_memory": "megatrain.train.preflight",
    "RUN_FILES": "megatrain.train.rundir", "RUN_IDENTITY": "megatrain.train.rundir",
    "STATE_KEY": "megatrain.train.rundir", "SCHEDULE_FILE": "megatrain.train.rundir",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


__all__ = [
    "DATA_BYTES_PER_TEXT_BYTE",
    "METRIC_FIELDS",
    "ModelSource",
    "TrainConfig",
    "TrainResult",
    "available_host_memory",
    "load_train_config",
    "lr_at",
    "measure_matmul_flops",
    "preflight_host_memory",
    "resolve_model",
    "save_loss_plot",
    "train",
]
