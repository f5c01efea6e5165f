"""``megatrain train``: train a causal LM from a config file and flags, with checkpoints, metrics and
clean failures.

One run (:func:`train`) is a visible sequence of stages, each a function of this module::

    TrainConfig           YAML or JSON file, then flags on top, validated by pydantic
    resolve_model         a config.json | a directory of Hugging Face weights | a megatrain checkpoint
    trace on meta         the model is built on the meta device: no parameter memory yet
    preflight_host_memory the plan's host bytes + data + a checkpoint shard against MemAvailable,
                          before anything large is allocated
    data                  documents -> tokenizer -> rows packed by megatrain.data.pack_documents
    compile               allocates and initialises the host tiles
    weights or resume     Trainer.load_hf_weights, or Trainer.load for an exact resume
    loop                  LR schedule, step, non-finite policy, evaluation, checkpoints,
                          metrics.jsonl, progress bar, SIGINT / SIGTERM
    loss.png              the loss curve (matplotlib, the ``plot`` extra)

Files in ``output_dir``: ``train_config.json`` (the resolved config of the latest start),
``tokenizer.json``, ``metrics.jsonl`` (one JSON object per step, see :data:`METRIC_FIELDS`),
``checkpoint/`` (Hugging Face layout plus ``megatrain_state/``, replaced atomically at every save,
with copies of ``tokenizer.json`` and a ``tokenizer_config.json`` naming its special tokens, which the
checkpoint's config and generation config use too), ``loss.png``. Resume by passing
``output_dir/checkpoint`` as the model (the run's other settings then come from its
``train_config.json``), or by running the same command again: the weights, Adam moments and steps,
RNG states, the step number and the data position come back, so the resumed run takes the same
batches at the same learning rates as an uninterrupted one.

Re-running a failed run. Whatever stopped a run (a kill before the first checkpoint, ``nonfinite:
stop``, a second SIGINT, a crash, a full disk), the same command runs again: an ``output_dir``
holding this run (:data:`RUN_IDENTITY`) resumes from its checkpoint, or starts over when it has none
(:func:`_check_output_dir`). A partial last line of ``metrics.jsonl`` is dropped.

Model checks, before anything is built: a causal decoder-only model, and ``seq_len`` within its
``max_position_embeddings`` (``megatrain.models``); ``output_dir`` writable.

MFU (model FLOPs utilisation) is ``megatrain.planner.cost.model_flops_per_token(graph)`` x tokens/s
over a peak matmul rate. On the CPU backend there is no GPU peak to divide by: the peak is this
CPU's FP32 matmul rate, measured once at start-up by timing ``torch.mm`` of two 1024 x 1024 FP32
matrices for about 0.3 s with the training's thread count (:func:`measure_matmul_flops`); a
hardware spec's GPU peak would not describe the processor doing the work. With ``device="cuda"``
the peak is the ``hardware`` spec's rate for the plan's compute dtype, or measured on the GPU the
same way when no spec is given. Tokens count padding, as model-FLOPs accounting usually does.

Predicted step time: ``megatrain.planner.simulate.simulate`` of the trainer's steady-state train
schedule (with clipping, the one that also runs the previous step's deferred optimizer steps) on
the ``hardware`` spec, when one with non-zero GPU rates is given (a preset such as ``H100_SXM``, or
a spec file); otherwise ``predicted_step_s`` is null. On the CPU backend it is the step the spec's
GPU is predicted to take, next to the step this machine measured.

Non-finite steps: ``Trainer.step`` does not apply a step whose loss or gradient is NaN or infinite
(``StepResult.applied``); ``nonfinite: skip`` logs it and goes on, ``nonfinite: stop`` raises
without saving. SIGINT and SIGTERM finish the current step, save a checkpoint and return.

Errors are megatrain.errors types; the CLI prints ``error: <message>`` and exits 2.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import pydantic
from pydantic import Field

from megatrain.errors import CheckpointError, ConfigError, MegatrainError, PlanError

__all__ = [
    "DATA_BYTES_PER_TEXT_BYTE",
    "METRIC_FIELDS",
    "ModelSource",
    "TrainConfig",
    "TrainResult",
    "available_host_memory",
    "load_hardware_spec",
    "load_train_config",
    "lr_at",
    "measure_matmul_flops",
    "preflight_host_memory",
    "resolve_model",
    "save_loss_plot",
    "train",
]

GiB = 1 << 30
MiB = 1 << 20

CHECKPOINT_DIR = "checkpoint"
METRICS_FILE = "metrics.jsonl"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")
CONFIG_FILE = "train_config.json"
PLOT_FILE = "loss.png"
STATE_KEY = "megatrain_train"
STATE_VERSION = 1

METRIC_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "predicted_step_s",
                 "measured_step_s", "applied", "val_loss", "host_rss_mib")
"""Keys of every ``metrics.jsonl`` row. ``step`` is 1-based; ``loss`` the mean micro-batch loss;
``lr`` the learning rate the step used; ``grad_norm`` the global L2 norm of the gradients before
clipping; ``tokens_per_s`` tokens of the step (padding included) over ``measured_step_s``, the
step's wall time in seconds; ``mfu`` model FLOPs utilisation (module docstring); ``predicted_step_s``
the simulator's step time on the ``hardware`` spec, seconds, or null; ``applied`` false when the
update was not applied (non-finite loss or gradient); ``val_loss`` the validation loss when this
step evaluated, else null; ``host_rss_mib`` this process's resident set size in MiB. Non-finite
floats are written as null (JSON has no NaN)."""

DATA_BYTES_PER_TEXT_BYTE = 40
"""Host bytes the data pipeline may hold per byte of text read (estimate, for the preflight): the
documents as ``str``, BPE training, per-document token arrays and the packed rows with labels.
megatrain.data measured about 1.3 GB of RAM for the 32 MB standard-library corpus, i.e. ~40x."""

MATMUL_N = 1024
MATMUL_SECONDS = 0.3


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

class TrainConfig(pydantic.BaseModel):
    """Everything ``megatrain train`` needs; each field is also a flag (``seq_len`` -> ``--seq-len``).

    Paths in a config file are relative to the file's directory, paths in flags to the working
    directory. Optional fields take ``null`` in a file and ``none`` on the command line.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: str = Field(description="a Hugging Face config.json (or a directory holding only one) to train "
                                   "from scratch; a directory of safetensors weights with its config.json to "
                                   "start from them; or a megatrain checkpoint directory (with "
                                   "megatrain_state/) to resume exactly")
    output_dir: str = Field(description="where metrics.jsonl, checkpoint/, tokenizer.json and loss.png go; "
                                        "empty, or holding this run (same model, data, seq_len, global_batch "
                                        "and seed), which then resumes from its checkpoint or starts over")
    data: str | None = Field(None, description="a directory of .txt/.py/.md/.rst, .jsonl and .parquet files, "
                                               "or one such file (default: this Python's standard library)")
    text_field: str = Field("text", description="the text field of .jsonl records and text column of "
                                                ".parquet files")
    max_bytes: int | None = Field(3_000_000, gt=0, description="UTF-8 bytes of text to read (null: all)")
    tokenizer: str | None = Field(None, description="a tokenizers JSON file (default: the model directory's "
                                                    "tokenizer.json, else a byte-level BPE trained on the "
                                                    "data with the model's vocab_size)")
    eot_token: str | None = Field(None, description="the tokenizer's end-of-text token (default: the first of "
                                                    "<|endoftext|>, <|end_of_text|>, </s>, <eos> it has)")
    seq_len: int = Field(1024, ge=2, description="tokens per packed row")
    global_batch: int = Field(8, gt=0, description="rows per optimizer step")
    micro_batch_size: int = Field(1, gt=0, description="rows per micro-batch; global_batch must be a "
                                                       "multiple of it")
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    warmup_steps: int = Field(100, ge=0, description="steps of linear warm-up to lr")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine decays to lr x this at the last step")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW second-moment decay")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the global gradient L2 norm to this "
                                                               "(null: no clipping)")
    max_steps: int = Field(1000, gt=0, description="optimizer steps of the whole run (a resumed run counts "
                                                   "the steps before it)")
    eval_interval: int = Field(100, ge=0, description="evaluate every this many steps and at the end "
                                                      "(0: only at the end)")
    eval_batches: int = Field(8, gt=0, description="validation micro-batches per evaluation")
    checkpoint_interval: int = Field(500, ge=0, description="save output_dir/checkpoint every this many steps "
                                                            "and at the end (0: only at the end)")
    nonfinite: Literal["skip", "stop"] = Field("stop", description="a step whose loss or gradient is NaN or "
                                                                   "infinite is never applied; then skip it "
                                                                   "and go on, or stop (exit 2, nothing saved)")
    hardware: str | None = Field(None, description="a hardware preset (H100_SXM, H200, GH200, A100_80GB, "
                                                   "RTX_4090) or HardwareSpec JSON file: the simulator's "
                                                   "predicted step, and the MFU peak on a GPU")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where layers compute")
    val_fraction: float = Field(0.05, gt=0, lt=1, description="fraction of packed rows held out for validation")
    seed: int = Field(0, description="seed of the initialisation, the validation split and the batch order")
    threads: int | None = Field(None, gt=0, description="torch CPU threads (null: torch's default)")

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> "TrainConfig":
        if self.global_batch % self.micro_batch_size:
            raise ValueError(f"global_batch={self.global_batch} is not a multiple of micro_batch_size="
                             f"{self.micro_batch_size}; change one of them")
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} exceeds max_steps={self.max_steps}; lower "
                             "warmup_steps")
        return self

    @property
    def micro_batches(self) -> int:
        return self.global_batch // self.micro_batch_size


def _describe(e: pydantic.ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            parts.append(f"{loc} is required: give --{loc.replace('_', '-')} or '{loc}:' in the config file")
        elif loc:
            parts.append(f"{loc}={err.get('input')!r}: {msg}")
        else:
            parts.append(msg)
    return "; ".join(parts)


def load_train_config(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None, *,
                      saved_run: bool = False) -> TrainConfig:
    """The config from a YAML (``.yaml``/``.yml``) or JSON (``.json``) file with ``overrides`` on top.

    Args:
        path: the config file, a mapping of TrainConfig fields; None for flags only. Relative
            paths in it (``model``, ``data``, ``tokenizer``, ``hardware``, ``output_dir``) are relative
            to the file's directory; a ``model`` or ``hardware`` naming no file there stays as it is
            (a preset name).
        overrides: field values that replace the file's (the CLI's flags); the string ``"none"`` or
            ``"null"`` sets an optional field to None.
        saved_run: when ``output_dir`` holds a run's ``train_config.json``, its settings are the
            defaults under the file and the flags (``megatrain train`` sets this, so a resume needs
            only ``--model`` and ``--output-dir``).

    Raises:
        ConfigError: the file is missing, not YAML/JSON, not a mapping, or a field is unknown,
            missing or out of range (the message names the field and the file).
    """
    values: dict[str, Any] = {}
    where = "flags"
    if path is not None:
        p = Path(path)
        where = f"{p} and flags"
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        text = p.read_text()
        suffix = p.suffix.lower()
        try:
            if suffix in (".yaml", ".yml"):
                import yaml

                loaded = yaml.safe_load(text)
            elif suffix == ".json":
                loaded = json.loads(text)
            else:
                raise ConfigError(f"config file {p}: suffix {p.suffix!r} is neither .yaml, .yml nor .json")
        except (ValueError, ImportError) as e:  # json.JSONDecodeError is a ValueError
            raise ConfigError(f"config file {p} is not valid {suffix[1:].upper()}: {e}") from None
        except Exception as e:  # yaml.YAMLError, imported lazily
            if type(e).__module__.startswith("yaml"):
                raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
            raise
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of fields, not a {type(loaded).__name__}")
        values.update(_relative_to(p.parent, loaded))
    optional = {name for name, f in TrainConfig.model_fields.items() if _allows_none(f.annotation)}
    for k, v in (overrides or {}).items():
        if k in optional and isinstance(v, str) and v.strip().lower() in ("none", "null"):
            v = None
        values[k] = v
    if saved_run and isinstance(values.get("output_dir"), str):
        saved = Path(values["output_dir"]) / CONFIG_FILE
        if saved.is_file():  # the run in output_dir: its settings are the defaults
            try:
                run = json.loads(saved.read_bytes().decode("utf-8"))
            except ValueError as e:
                raise ConfigError(f"{saved} is not valid JSON ({e}); delete it or choose another output_dir") from None
            if isinstance(run, dict):
                values = {**{k: v for k, v in run.items() if k in TrainConfig.model_fields}, **values}
                where += f" on top of {saved}"
    try:
        return TrainConfig.model_validate(values)
    except pydantic.ValidationError as e:
        raise ConfigError(f"invalid train config ({where}): {_describe(e)}") from None


_PATH_FIELDS = ("model", "data", "tokenizer", "hardware", "output_dir")


def _relative_to(base: Path, loaded: dict) -> dict:
    out = dict(loaded)
    for k in _PATH_FIELDS:
        v = out.get(k)
        if isinstance(v, str) and v and not Path(v).is_absolute():
            p = base / v
            if k in ("data", "tokenizer", "output_dir") or p.exists():
                out[k] = str(p)
    return out


def _allows_none(annotation) -> bool:
    return type(None) in getattr(annotation, "__args__", ())


# ---------------------------------------------------------------------------------------------
# The learning-rate schedule
# ---------------------------------------------------------------------------------------------

def lr_at(step: int, *, lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of the 0-based step ``step``: linear warm-up, then cosine decay.

    Steps ``0 .. warmup_steps - 1`` ramp linearly to ``lr`` (``lr * (step + 1) / warmup_steps``);
    from step ``warmup_steps`` to the last step ``max_steps - 1`` a half cosine goes from ``lr``
    to ``lr * min_lr_ratio``; later steps stay there. A pure function of the step, so a resumed
    run continues the schedule exactly.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    floor = lr * min_lr_ratio
    span = max_steps - 1 - warmup_steps
    frac = min(1.0, (step - warmup_steps) / span) if span > 0 else 0.0
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ModelSource:
    """What ``TrainConfig.model`` names.

    ``kind``: ``"config"`` (train from scratch), ``"weights"`` (a Hugging Face safetensors
    directory) or ``"checkpoint"`` (a megatrain checkpoint to resume). ``directory``: the model
    directory, None for a bare config file or preset. ``config``: the transformers config, with
    ``tie_word_embeddings=False`` (megatrain trains tied embeddings as two matrices); ``tied``:
    whether the original config tied them.
    """

    kind: Literal["config", "weights", "checkpoint"]
    directory: Path | None
    config: Any
    tied: bool


def resolve_model(spec: str) -> ModelSource:
    """Classify and load ``TrainConfig.model``.

    Raises:
        ConfigError: no such file, directory or preset; a directory without config.json; a
            config.json transformers cannot read (not UTF-8, not JSON, an unknown model_type).
        UnsupportedModelError: not a causal decoder (``megatrain.models.check_causal_decoder``).
    """
    from megatrain.checkpoint import INDEX_FILE, STATE_DIR
    from megatrain.planner.presets import MODEL_PRESETS, load_model_config

    p = Path(spec)
    directory = None
    if p.is_dir():
        directory = p
        config_file = p / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model directory {p} has no config.json; point model at a Hugging Face "
                              "config.json, a weights directory or a megatrain checkpoint")
        if (p / STATE_DIR).is_dir():
            kind = "checkpoint"
        elif (p / INDEX_FILE).is_file() or any(p.glob("*.safetensors")):
            kind = "weights"
        else:
            kind = "config"
    elif p.is_file():
        config_file, kind = p, "config"
    elif spec in MODEL_PRESETS:
        config_file, kind = None, "config"
    else:
        raise ConfigError(f"model {spec!r} is neither a file, a directory nor a preset "
                          f"({sorted(MODEL_PRESETS)}); give a Hugging Face config.json, a weights directory "
                          "or a megatrain checkpoint")
    config = load_model_config(spec if config_file is None else config_file)
    from megatrain.models import check_causal_decoder

    check_causal_decoder(config, str(config_file or spec))
    tied = False
    if config_file is not None:
        raw = json.loads(config_file.read_bytes().decode("utf-8"))  # load_model_config parsed it already
        if "tie_word_embeddings" in raw:
            tied = bool(raw["tie_word_embeddings"])
        else:
            from transformers import AutoConfig

            tied = bool(AutoConfig.for_model(raw["model_type"]).tie_word_embeddings)
    return ModelSource(kind=kind, directory=directory, config=config, tied=tied)


def _load_weights(trainer, source: ModelSource, echo) -> None:
    """Copy the weights of a ``"weights"`` source into the trainer; tied embeddings are copied into
    the (untied) output embedding."""
    if not source.tied:
        trainer.load_hf_weights(source.directory)
        return
    loaded = trainer.load_hf_weights(source.directory, strict=False)
    model = trainer.model
    out_w = model.get_output_embeddings().weight
    out_name = next(n for n, p in model.named_parameters() if p is out_w)
    if set(loaded.missing) - {out_name} or loaded.unexpected:
        raise CheckpointError(f"{source.directory}: cannot load weights: missing {list(loaded.missing)}, "
                              f"unexpected {list(loaded.unexpected)}; names must be the model's own "
                              "state_dict names")
    if out_name in loaded.missing:
        import torch

        with torch.no_grad():
            out_w.copy_(model.get_input_embeddings().weight)
    echo(f"note: {source.directory} ties its input and output embeddings; megatrain trains them as two "
         f"matrices, both starting from the input embedding")


# ---------------------------------------------------------------------------------------------
# Host memory preflight
# ---------------------------------------------------------------------------------------------

def available_host_memory() -> tuple[int, str] | None:
    """``(bytes, where it was read)`` of host memory available to a new allocation, or None.

    Reads ``MemAvailable`` in ``/proc/meminfo`` (Linux), else ``psutil.virtual_memory().available``
    when psutil is installed.
    """
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available), "psutil.virtual_memory().available"


def preflight_host_memory(graph, plan, *, data_bytes: int, checkpoint_bytes: int = 0,
                          available: tuple[int, str] | None) -> int:
    """Check that a run fits in host memory before anything large is allocated; return its bytes.

    Needed: ``megatrain.planner.cost.memory_breakdown(graph, plan).host_total`` (FP32 master
    weights, two Adam moments, gradient and staging rings, pinned activations), plus
    ``data_bytes`` (text, tokenizer, token ids and packed rows: see
    :data:`DATA_BYTES_PER_TEXT_BYTE`), plus ``checkpoint_bytes`` (the largest safetensors file
    loaded, whose pages are mapped while it is read).

    Args:
        available: ``(bytes, source)`` from :func:`available_host_memory`; None skips the check.

    Raises:
        PlanError: the run needs more than is available; the message gives both in GiB, what the
            bytes are for, and what to change.
    """
    from megatrain.planner.cost import memory_breakdown

    mem = memory_breakdown(graph, plan)
    needed = mem.host_total + data_bytes + checkpoint_bytes
    if available is None or needed <= available[0]:
        return needed
    have, where = available
    parts = [f"FP32 master weights {_gib(mem.master_weights)}", f"Adam moments {_gib(mem.adam_moments)}",
             f"gradient ring {_gib(mem.gradient_ring)}"]
    if mem.staging_ring:
        parts.append(f"staging ring {_gib(mem.staging_ring)}")
    if mem.pinned_activations:
        parts.append(f"pinned activations {_gib(mem.pinned_activations)}")
    parts.append(f"data and tokenizer about {_gib(data_bytes)}")
    if checkpoint_bytes:
        parts.append(f"largest checkpoint shard {_gib(checkpoint_bytes)}")
    clip = (" or max_grad_norm: null (clipping keeps every gradient, 4 more bytes per parameter),"
            if mem.gradient_ring > 0.1 * needed else "")
    raise PlanError(
        f"not enough host memory: this run needs about {_gib(needed)} ({', '.join(parts)}) but "
        f"{_gib(have)} is available ({where}). Each parameter takes 12 bytes of host state "
        f"({graph.param_count / 1e9:,.2f}B parameters here): train a smaller model, lower max_bytes,{clip} "
        f"free host memory, or use a machine with at least {math.ceil(needed / GiB):,} GiB available")


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def _data_bytes(cfg: TrainConfig) -> int:
    from megatrain.data import corpus_bytes

    try:
        text = corpus_bytes(cfg.data)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data: {e}") from None
    if cfg.max_bytes is not None:
        text = min(text, cfg.max_bytes)
    return text * DATA_BYTES_PER_TEXT_BYTE


def _largest_safetensors(directory: Path | None) -> int:
    if directory is None:
        return 0
    return max((f.stat().st_size for f in directory.glob("*.safetensors")), default=0)


# ---------------------------------------------------------------------------------------------
# Hardware: the MFU peak and the predicted step
# ---------------------------------------------------------------------------------------------

def load_hardware_spec(name_or_path: str):
    """A HardwareSpec from a preset name or a JSON file written by ``HardwareSpec.save``.

    Raises:
        ConfigError: no such preset, or the file is not a valid spec.
    """
    from megatrain.planner.hardware import HardwareSpec, preset

    path = Path(name_or_path)
    if path.is_file():
        try:
            return HardwareSpec.load(path)
        except pydantic.ValidationError as e:
            raise ConfigError(f"{path} is not a valid HardwareSpec: {e}") from None
    return preset(name_or_path)


def measure_matmul_flops(device: str = "cpu", dtype=None, *, n: int = MATMUL_N,
                         seconds: float | None = None) -> float:
    """FLOP/s of ``torch.mm`` on two ``n x n`` matrices of ``dtype`` (default FP32) on ``device``.

    Times repeated products for about ``seconds`` (default :data:`MATMUL_SECONDS`, 0.3 s) after
    one warm-up product, with the current
    ``torch.get_num_threads()``; counts ``2 n^3`` FLOPs per product. Uses a private generator, so
    the global torch RNG (and with it the model's initialisation) is untouched.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    seconds = MATMUL_SECONDS if seconds is None else seconds
    g = torch.Generator().manual_seed(0)
    a = torch.rand(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.rand(n, n, generator=g).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.mm(a, b)
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        reps += 1
        if reps % 4 == 0:
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return 2.0 * n ** 3 * reps / elapsed


# ---------------------------------------------------------------------------------------------
# Metrics, RSS and the loss plot
# ---------------------------------------------------------------------------------------------

def _host_rss_bytes() -> int | None:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _read_metrics(path: Path) -> list[dict]:
    """The rows of ``metrics.jsonl``. A run killed while writing leaves a partial last line: it is
    dropped (its step runs again on resume). A bad line elsewhere is a ConfigError."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_bytes().decode("utf-8", errors="replace").splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break  # the partial last line of a killed run
            raise ConfigError(f"{path}: line {i + 1} is not JSON ({line[:60]!r}); the file was changed after "
                              "the run wrote it: fix or delete that line") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ConfigError(f"{path}: line {i + 1} is not a metrics row with a 'step'; fix or delete it")
        rows.append(row)
    return rows


def save_loss_plot(rows: list[dict], path: str | os.PathLike, *, title: str = "") -> None:
    """Draw training loss (applied steps) and validation loss against the step as a PNG.

    Raises:
        ImportError: matplotlib is not installed (the ``plot`` extra).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the loss plot needs matplotlib: pip install 'megatrain[plot]'") from e
    # Figure + FigureCanvasAgg, not pyplot: no global backend switch, no GUI.
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    train = [(r["step"], r["loss"]) for r in rows if r.get("applied") and r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    skipped = [r["step"] for r in rows if not r.get("applied")]
    for s in skipped:
        ax.axvline(s, color="tab:red", alpha=0.3, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title + (f" ({len(skipped)} skipped steps in red)" if skipped else ""), fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------

class _StopOnSignal:
    """While active, SIGINT and SIGTERM only record a request to stop after the current step; a
    second signal interrupts at once (KeyboardInterrupt). Only the main thread can install
    handlers; elsewhere signals keep their handlers."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum, _frame) -> None:
        if self.name is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.name = signal.Signals(signum).name

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TrainResult:
    """How a run ended. ``step``: the last step taken (1-based; the resumed-from step if none was);
    ``skipped_steps``: steps not applied (non-finite), over the whole run; ``stopped_by``: the
    signal's name when SIGINT/SIGTERM ended it early, else None; ``loss`` / ``val_loss``: the last
    ones (None when not finite or never evaluated); ``checkpoint``: the last checkpoint written."""

    step: int
    skipped_steps: int
    stopped_by: str | None
    loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    output_dir: Path


RUN_FILES = (CONFIG_FILE, TOKENIZER_FILE, METRICS_FILE, PLOT_FILE, CHECKPOINT_DIR)
"""What ``megatrain train`` writes in ``output_dir`` (besides the hidden directories of a save)."""

RUN_IDENTITY = ("model", "data", "seq_len", "global_batch", "seed")
"""Settings that make an output_dir's run another run: re-running with them unchanged continues it."""


def _is_save_leftover(name: str) -> bool:
    from megatrain.checkpoint import _OLD_TAG, _TMP_TAG

    return name.startswith(f".{CHECKPOINT_DIR}.") and (_TMP_TAG in name or _OLD_TAG in name)


def _check_output_dir(out: Path, source: ModelSource, cfg: TrainConfig, echo) -> tuple[bool, ModelSource]:
    """Refuse to mix two runs in one directory, and let a run be re-run with the same command.

    Returns ``(resuming, source)``: resuming the run that lives in ``out`` (from its
    ``checkpoint/``), with the source to load. ``out`` holding a run with the same
    :data:`RUN_IDENTITY` settings (its ``train_config.json``) is that run again: with a complete
    checkpoint it resumes from it; without one (killed before the first save, ``nonfinite: stop``,
    a crash) its files are removed and it starts over. Then ``out`` must be writable.
    """
    from megatrain.checkpoint import _is_complete, _recover

    ckpt = out / CHECKPOINT_DIR
    here = source.kind == "checkpoint" and source.directory.resolve() == ckpt.resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {out} is a file; set output_dir (--output-dir) to a directory")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not here:
        saved = _saved_settings(out)
        foreign = [n for n in held if n not in RUN_FILES and not _is_save_leftover(n)]
        if saved is None or foreign:
            _recover(ckpt)
            hint = (f", or resume the run in it with --model {ckpt}" if _is_complete(ckpt) else "")
            raise ConfigError(f"output_dir {out} is not empty and holds no megatrain run of its own (it holds "
                              f"{', '.join(held[:5])}{' ...' if len(held) > 5 else ''}); choose another "
                              f"output_dir{hint}")
        differ = [f"{k}={saved.get(k)!r} there, {getattr(cfg, k)!r} now" for k in RUN_IDENTITY
                  if saved.get(k) != getattr(cfg, k)]
        if differ:
            raise ConfigError(f"output_dir {out} holds another run ({'; '.join(differ)}); choose another "
                              f"output_dir, or continue that run with its settings (see {out / CONFIG_FILE})")
        _recover(ckpt)
        if _is_complete(ckpt):
            echo(f"resume: {out} holds this run with a checkpoint; continuing from {ckpt}")
            source, here = resolve_model(str(ckpt)), True
        else:
            import shutil

            echo(f"note: {out} holds this run, stopped before its first complete checkpoint; starting it again")
            for name in held:
                p = out / name
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    _check_writable(out)
    return here, source


def _saved_settings(out: Path) -> dict | None:
    try:
        saved = json.loads((out / CONFIG_FILE).read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def _check_writable(out: Path) -> None:
    """Create ``out`` and a file in it (then remove what was made): before data and compile."""
    made = [p for p in (out, *out.parents) if not p.exists()]
    probe = out / f".megatrain-write-test-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output_dir {out} is not writable ({e.strerror or e}): set output_dir "
                          "(--output-dir) to a directory you can write") from None
    finally:
        for p in made:  # deepest first; left as it was
            if p.is_dir():
                p.rmdir()


def _prepare_data(cfg: TrainConfig, source: ModelSource, echo):
    """Documents -> tokenizer -> packed rows. Returns ``(tokenizer, dataset, eot_token)``."""
    from megatrain import data as D

    try:
        t0 = time.perf_counter()
        skipped: list[Path] = []
        docs = D.load_documents(cfg.data, max_bytes=cfg.max_bytes, text_field=cfg.text_field, skipped=skipped)
        if skipped:
            echo(f"note: data: skipped {len(skipped)} file{'s' if len(skipped) > 1 else ''} that are not UTF-8 "
                 f"text ({', '.join(str(p) for p in skipped[:3])}{', ...' if len(skipped) > 3 else ''})")
        vocab = source.config.vocab_size
        if cfg.tokenizer is not None:
            tokenizer, origin = D.load_tokenizer(cfg.tokenizer), cfg.tokenizer
        elif source.directory is not None and (source.directory / TOKENIZER_FILE).is_file():
            tokenizer = D.load_tokenizer(source.directory / TOKENIZER_FILE)
            origin = str(source.directory / TOKENIZER_FILE)
        else:
            if vocab < 257:
                raise ConfigError(f"the model's vocab_size is {vocab}, below the 257 tokens of a byte-level BPE "
                                  "(256 bytes + end-of-text); raise vocab_size or give a tokenizer")
            tokenizer, origin = D.train_bpe_tokenizer(docs, vocab_size=vocab), f"byte-level BPE trained here"
        if tokenizer.get_vocab_size() > vocab:
            raise ConfigError(f"the tokenizer ({origin}) has {tokenizer.get_vocab_size()} tokens but the model's "
                              f"vocab_size is {vocab}: token ids would index past the embedding; use a "
                              "matching tokenizer or raise vocab_size")
        eot = cfg.eot_token or D.find_eot_token(tokenizer)
        eot_id = tokenizer.token_to_id(eot)
        if eot_id is None:
            raise ConfigError(f"the tokenizer ({origin}) has no token {eot!r}; set eot_token to its "
                              "end-of-sequence token")
        token_docs = D.tokenize_documents(tokenizer, docs)
        n_text = sum(len(d.encode("utf-8")) for d in docs)
        del docs
        packed = D.pack_documents(token_docs, cfg.seq_len, eot_id=eot_id)
        del token_docs
        dataset = D.PackedDataset(packed, val_fraction=cfg.val_fraction, seed=cfg.seed)
        dataset.batches(cfg.global_batch)  # raises now when one batch does not fit
        dataset.eval_batches(cfg.micro_batch_size, 1)
    except (OSError, ValueError, ImportError) as e:
        if isinstance(e, MegatrainError):
            raise
        raise ConfigError(f"data: {e}") from None
    echo(f"data: {packed.num_documents:,} documents, {n_text / 1e6:.2f} MB of text -> {packed.num_tokens:,} "
         f"tokens in {dataset.num_train_rows:,} training + {dataset.num_val_rows:,} validation rows of "
         f"{cfg.seq_len} ({packed.padding_fraction:.1%} padding); tokenizer: {origin}, vocab "
         f"{tokenizer.get_vocab_size():,}, end-of-text {eot!r} ({time.perf_counter() - t0:.1f} s)")
    return tokenizer, dataset, eot


def _match_special_tokens(model, tokenizer, eot: str, seq_len: int) -> dict:
    """Make the model's config and generation config name the tokenizer's special tokens, and
    return the ``tokenizer_config.json`` that lets ``transformers.AutoTokenizer`` load the checkpoint.

    The end-of-text token the data were packed with is the end of sequence; the beginning of
    sequence is the tokenizer's own (``<|begin_of_text|>``, ``<s>``, ``<bos>``) or, as with GPT-2's
    byte-level BPE, the end-of-text token too. A config's default ids (often 1 and 2) would
    otherwise make generation stop on the wrong token.
    """
    bos = next((t for t in BOS_CANDIDATES if tokenizer.token_to_id(t) is not None), eot)
    ids = {"bos_token_id": tokenizer.token_to_id(bos), "eos_token_id": tokenizer.token_to_id(eot)}
    for cfg in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if cfg is not None:
            for k, v in ids.items():
                setattr(cfg, k, v)
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(gen, "pad_token_id", None) is None:
        gen.pad_token_id = ids["eos_token_id"]  # packed rows have no padding token; generate() needs one
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eot,
            "model_max_length": seq_len}


def _train_state(cfg: TrainConfig, step: int, skipped: int, fingerprint: str, tokenizer_sha: str) -> dict:
    return {STATE_KEY: {
        "version": STATE_VERSION, "step": step, "batches_consumed": step, "skipped_steps": skipped,
        "data_fingerprint": fingerprint, "tokenizer_sha256": tokenizer_sha, "seq_len": cfg.seq_len,
        "global_batch": cfg.global_batch, "seed": cfg.seed,
        "lr_schedule": {"lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "max_steps": cfg.max_steps,
                        "min_lr_ratio": cfg.min_lr_ratio},
    }}


def _check_resume(state: dict, cfg: TrainConfig, where: Path, fingerprint: str) -> None:
    for key in ("seq_len", "global_batch", "seed"):
        if state[key] != getattr(cfg, key):
            raise ConfigError(f"{where} was trained with {key}={state[key]} but this run has {key}="
                              f"{getattr(cfg, key)}; resuming needs the same {key} (the data position counts "
                              "batches of that shape and order)")
    if state["data_fingerprint"] != fingerprint:
        raise ConfigError(f"{where}: the packed data differ from the checkpoint's (sha256 "
                          f"{state['data_fingerprint'][:12]} there, {fingerprint[:12]} now); resume with the same "
                          "data, max_bytes, text_field, tokenizer, val_fraction and seed")
    if state["step"] >= cfg.max_steps:
        raise ConfigError(f"{where} is at step {state['step']}, and max_steps is {cfg.max_steps}: nothing to do; "
                          "raise max_steps to train on")


def _evaluate(trainer, dataset, cfg: TrainConfig) -> float:
    losses = [trainer.evaluate(b) for b in dataset.eval_batches(cfg.micro_batch_size, cfg.eval_batches)]
    return sum(losses) / len(losses)


def _meta_model(cfg: TrainConfig, source: ModelSource, echo):
    """The model on the meta device, traced; PlanError before anything large exists when the run
    cannot fit in host memory."""
    import torch

    from megatrain.planner.cost import human_bytes
    from megatrain.planner.plan import default_plan
    from megatrain.planner.presets import build_meta_model
    from megatrain.planner.trace import trace

    model = build_meta_model(source.config, dtype=torch.float32)
    graph = trace(model, micro_batch_size=cfg.micro_batch_size, seq_len=cfg.seq_len).graph
    # The plan compile will choose: clipping keeps one host gradient tile per layer.
    plan = default_plan(graph, cfg.micro_batches, clip_gradients=cfg.max_grad_norm is not None)
    # On the CPU backend the model is built on the CPU before compile moves it (_compile_and_load).
    built = 4 * graph.param_count if cfg.device == "cpu" else 0
    needed = preflight_host_memory(graph, plan, data_bytes=_data_bytes(cfg),
                                   checkpoint_bytes=_largest_safetensors(source.directory) + built,
                                   available=available_host_memory())
    echo(f"model: {type(model).__name__}, {graph.param_count / 1e6:,.2f} M parameters in {len(graph.layers)} "
         f"layers; host memory needed about {human_bytes(needed)}")
    return model


def _compile_and_load(cfg: TrainConfig, model, source: ModelSource, fingerprint: str, echo):
    """Compile (allocating and initialising the host tiles), then load weights or resume. Returns
    ``(trainer, start step, skipped steps so far)``."""
    import torch

    import megatrain

    torch.manual_seed(cfg.seed)
    if cfg.device == "cpu":
        # Models branch on the device type while they are traced (Mixtral's expert histogram takes
        # an int32 input except on the CPU, where histc has no integer kernel): a model built on the
        # meta device would be traced for a GPU. On the CPU backend build it on the CPU (4 bytes a
        # parameter for the moment compile moves it into the host tiles; the preflight counts them).
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(source.config, dtype=torch.float32)
    optimizer = megatrain.AdamW(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                weight_decay=cfg.weight_decay)
    trainer = megatrain.compile(model, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                                micro_batches=cfg.micro_batches, optimizer=optimizer, device=cfg.device,
                                max_grad_norm=cfg.max_grad_norm)
    if source.kind == "weights":
        _load_weights(trainer, source, echo)
        echo(f"weights: loaded from {source.directory}")
        return trainer, 0, 0
    if source.kind == "config":
        return trainer, 0, 0
    state = trainer.load(source.directory).get(STATE_KEY)
    if state is None:
        raise CheckpointError(f"{source.directory}: a megatrain checkpoint without `megatrain train` state "
                              "(no data position to resume from); copy its config.json and model*.safetensors "
                              "into a new directory to start from its weights")
    _check_resume(state, cfg, source.directory, fingerprint)
    now = {"lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "max_steps": cfg.max_steps,
           "min_lr_ratio": cfg.min_lr_ratio}
    changed = [f"{k}={now[k]} (was {v})" for k, v in state["lr_schedule"].items() if now.get(k) != v]
    if changed:
        echo(f"warning: resuming with {', '.join(changed)}: the learning-rate schedule differs from the run's "
             f"from step {state['step'] + 1} on (a resume needs only --model and --output-dir; the run's other "
             "settings come from its train_config.json)")
    saved = trainer.optimizer.model_copy(update={"lr": optimizer.lr})
    if saved != optimizer:
        echo(f"note: the checkpoint's AdamW settings were {saved.model_dump()}; going on with this config's "
             f"{optimizer.model_dump()}")
    trainer.set_optimizer(optimizer)  # the schedule sets lr before every step
    echo(f"resume: step {state['step']} of {source.directory}")
    return trainer, int(state["step"]), int(state["skipped_steps"])


@dataclass(frozen=True, slots=True)
class _Rates:
    """What turns a step's measured time into MFU, and the simulator's prediction (seconds or None)."""

    flops_per_token: float
    peak_flops: float
    predicted_step_s: float | None

    def mfu(self, tokens_per_s: float) -> float:
        return self.flops_per_token * tokens_per_s / self.peak_flops


def _rates(cfg: TrainConfig, trainer, hw, cpu_peak: float | None, echo) -> _Rates:
    import torch

    from megatrain.planner import cost

    dtype = trainer.plan.compute_dtype
    if cpu_peak is not None:
        peak, what = cpu_peak, f"this CPU's measured FP32 matmul rate, {cpu_peak / 1e9:,.1f} GFLOP/s"
    elif hw is not None and hw.peak_flops(dtype) > 0:
        peak, what = hw.peak_flops(dtype), f"{hw.name}'s {dtype} peak"
    else:
        peak = measure_matmul_flops(cfg.device, getattr(torch, dtype))
        what = f"this GPU's measured {dtype} matmul rate, {peak / 1e12:,.1f} TFLOP/s"
    predicted = None
    if hw is not None:
        if hw.has_gpu and hw.peak_flops(dtype) > 0 and hw.d2h_bytes_per_s > 0:
            from megatrain.planner.simulate import simulate

            # The steady-state step: with clipping it also runs the previous step's deferred updates.
            steady = trainer.schedules.carrying or trainer.schedules.first
            predicted = simulate(steady, trainer.graph, hw).step_time_s
            echo(f"predicted step on {hw.name}: {predicted:.4g} s (simulated)")
        else:
            echo(f"note: {hw.name} has no GPU rates; predicted_step_s is null")
    rates = _Rates(cost.model_flops_per_token(trainer.graph), peak, predicted)
    echo(f"MFU peak: {what}; {rates.flops_per_token / 1e6:,.2f} MFLOPs per token")
    return rates


def train(cfg: TrainConfig, *, echo: Callable[[str], None] = print) -> TrainResult:
    """Run ``cfg`` to ``max_steps``, or until SIGINT/SIGTERM or a non-finite step with
    ``nonfinite="stop"``.

    ``echo`` prints one line (the progress bar goes to stderr). SIGINT and SIGTERM finish the
    current step, save ``output_dir/checkpoint`` and return normally (``stopped_by`` says which);
    a second signal interrupts at once (KeyboardInterrupt).

    Raises:
        ConfigError: a bad setting, model, data or tokenizer; an output_dir holding another run; a
            checkpoint whose data or shapes differ from this run's.
        PlanError: the run does not fit in the host memory available (before anything large is
            allocated).
        TraceError / UnsupportedModelError: the model cannot be traced, or uses what megatrain does
            not support (named in the message).
        CheckpointError: a corrupt, incomplete or mismatched checkpoint or weights (naming the file
            and tensor).
        MegatrainError: with ``nonfinite="stop"``, a step whose loss or gradient was not finite
            (naming the step); nothing is saved.
    """
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    hw = load_hardware_spec(cfg.hardware) if cfg.hardware else None
    source = resolve_model(cfg.model)
    from megatrain.models import check_positions

    check_positions(source.config, cfg.seq_len, cfg.model)
    resuming_here, source = _check_output_dir(out, source, cfg, echo)
    if source.tied and source.kind == "config":
        echo("note: the config ties input and output embeddings; megatrain trains them as two matrices")
    model = _meta_model(cfg, source, echo)
    tokenizer, dataset, eot = _prepare_data(cfg, source, echo)
    fingerprint = dataset.fingerprint()
    cpu_peak = measure_matmul_flops("cpu") if cfg.device == "cpu" else None
    trainer, start, skipped = _compile_and_load(cfg, model, source, fingerprint, echo)
    rates = _rates(cfg, trainer, hw, cpu_peak, echo)
    tokenizer_config = _match_special_tokens(trainer.model, tokenizer, eot, cfg.seq_len)

    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(cfg.model_dump_json(indent=1) + "\n")
    tokenizer_json = tokenizer.to_str()
    (out / TOKENIZER_FILE).write_text(tokenizer_json)
    metrics_path = out / METRICS_FILE
    # Rows a crashed run wrote after its last checkpoint are run again: drop them.
    kept = [r for r in _read_metrics(metrics_path) if r["step"] <= start] if resuming_here else []
    metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    ckpt_path = out / CHECKPOINT_DIR
    last_saved: int | None = start if resuming_here else None
    tokenizer_sha = hashlib.sha256(tokenizer_json.encode()).hexdigest()

    def save(step: int) -> None:
        nonlocal last_saved
        try:
            trainer.save(ckpt_path, extra_state=_train_state(cfg, step, skipped, fingerprint, tokenizer_sha))
        except CheckpointError as e:
            after = (f"the same command resumes from step {last_saved}" if last_saved is not None
                     else "the same command starts the run again")
            raise CheckpointError(f"step {step}: {e}; then {after}") from e.__cause__
        # Outside the atomic save, so it may be missing after a crash; the resume then trains the same
        # BPE again (deterministic) and the data fingerprint check catches any difference.
        (ckpt_path / TOKENIZER_FILE).write_text(tokenizer_json)
        (ckpt_path / TOKENIZER_CONFIG_FILE).write_text(json.dumps(tokenizer_config, indent=1) + "\n")
        last_saved = step

    from tqdm import tqdm

    step, loss, val_loss = start, None, None
    batches = dataset.batches(cfg.global_batch, seed=cfg.seed, start=start)
    n_layers = len(trainer.graph.layers)
    with _StopOnSignal() as stop, open(metrics_path, "a", buffering=1) as metrics, \
            tqdm(total=cfg.max_steps, initial=start, desc="train", unit="step", file=sys.stderr,
                 dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 10.0) as bar:
        while step < cfg.max_steps and stop.name is None:
            lr = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                       min_lr_ratio=cfg.min_lr_ratio)
            trainer.set_lr(lr)
            res = trainer.step(next(batches))
            step += 1
            loss = res.loss
            mfu = rates.mfu(res.tokens_per_second)
            row = {"step": step, "loss": _finite(res.loss), "lr": lr, "grad_norm": _finite(res.grad_norm),
                   "tokens_per_s": res.tokens_per_second, "mfu": mfu, "predicted_step_s": rates.predicted_step_s,
                   "measured_step_s": res.seconds, "applied": bool(res.applied), "val_loss": None,
                   "host_rss_mib": None}
            if not res.applied:
                skipped += 1
                msg = _nonfinite_message(step, res, n_layers)
                if cfg.nonfinite == "stop":
                    metrics.write(json.dumps(row) + "\n")
                    raise MegatrainError(
                        f"{msg}; stopping without saving (nonfinite: stop). "
                        + (f"The last checkpoint, {ckpt_path}, holds step {last_saved}: the same command "
                           "resumes from it" if last_saved is not None
                           else "No checkpoint was saved: the same command starts the run again")
                        + "; add a lower --lr or --max-grad-norm, or --nonfinite skip")
                bar.write(f"warning: {msg}; skipped (nonfinite: skip)")
            if cfg.eval_interval and step % cfg.eval_interval == 0 or step == cfg.max_steps:
                val_loss = _evaluate(trainer, dataset, cfg)
                row["val_loss"] = _finite(val_loss)
                bar.write(f"step {step}: validation loss {val_loss:.4f}")
            rss = _host_rss_bytes()
            row["host_rss_mib"] = rss / MiB if rss is not None else None
            metrics.write(json.dumps(row) + "\n")
            if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
                save(step)
                bar.write(f"step {step}: saved {ckpt_path}")
            bar.set_postfix_str(f"loss {res.loss:.4f}, {res.tokens_per_second:,.0f} tok/s, MFU {mfu:.2%}",
                                refresh=False)
            bar.update(1)
        if stop.name is not None:
            if last_saved != step:
                save(step)
            bar.write(f"{stop.name}: stopped after step {step}; saved {ckpt_path}. The same command resumes "
                      "from it")

    rows = _read_metrics(metrics_path)
    try:
        save_loss_plot(rows, out / PLOT_FILE, title=f"{Path(cfg.model).name}: {step} steps, "
                                                    f"seq_len {cfg.seq_len} x global batch {cfg.global_batch}")
    except ImportError as e:
        echo(f"note: no {PLOT_FILE}: {e}")
    echo(f"done: step {step}, train loss {_fmt(loss)}, validation loss {_fmt(val_loss)}, {skipped} skipped "
         f"steps; {out}")
    applied = [r for r in rows if r["applied"]]
    return TrainResult(step=step, skipped_steps=skipped, stopped_by=stop.name,
                       loss=applied[-1]["loss"] if applied else None, val_loss=_finite(val_loss),
                       checkpoint=ckpt_path if last_saved is not None else None, output_dir=out)


def _nonfinite_message(step: int, res, n_layers: int) -> str:
    bad_loss = not math.isfinite(res.loss)
    if bad_loss or len(res.skipped_layers) >= n_layers:
        effect = "the update was not applied"
    else:  # optimizer steps during backward: the layers whose gradients came first were updated
        effect = (f"the update was not applied to {len(res.skipped_layers)} of {n_layers} layers (without "
                  "max_grad_norm each layer is updated as its gradient arrives)")
    return (f"step {step}: the {'loss' if bad_loss else 'gradient'} is not finite (loss {res.loss}, gradient "
            f"norm {res.grad_norm}); {effect}")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
