"""A run's directory: the files ``megatrain train`` writes in ``output_dir``, which run an
``output_dir`` holds (continue it, start it over, or refuse another), and the resumable state
saved in each checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from megatrain.errors import ConfigError

if TYPE_CHECKING:
    from megatrain.files import DirectoryLock
    from megatrain.train.config import TrainConfig
    from megatrain.train.model import ModelSource

# The file names live on the floor below (train/names.py: train/config.py and train/model.py read
# them too, and this module imports those); re-exported here, where the run directory is described.
from megatrain.train.names import (CHECKPOINT_DIR, CONFIG_FILE, LOCK_FILE, METRICS_FILE, NVME_LOCK_FILE, PLOT_FILE,
                                   RUN_FILES, SCHEDULE_FILE, STATE_KEY, STATE_VERSION, STORE_DIR,
                                   TOKENIZER_CONFIG_FILE, TOKENIZER_FILE)

RUN_IDENTITY = ("model", "init_from", "task", "data", "seq_len", "global_batch", "seed")
"""Settings that make an output_dir's run another run: re-running with them unchanged continues it."""


def _is_leftover(name: str) -> bool:
    """Hidden files a run leaves in ``output_dir``: lock files, and what a kill leaves of a
    checkpoint save, a token store build or an atomic write (each cleans its own up next time)."""
    from megatrain.checkpoint import is_save_leftover
    from megatrain.files import is_leftover

    return (name in (LOCK_FILE, NVME_LOCK_FILE) or is_leftover(name)
            or name.startswith(f".{STORE_DIR}.")  # the token store's lock and build directories
            or is_save_leftover(name, CHECKPOINT_DIR))


def check_output_dir(out: Path, source: ModelSource, cfg: TrainConfig, echo,
                     lock: DirectoryLock | None = None) -> tuple[bool, ModelSource, dict | None]:
    """Refuse to mix two runs in one directory, and let a run be re-run with the same command.

    Returns ``(resuming, source, finished)``: resuming the run that lives in ``out`` (from its
    ``checkpoint/``), with the source to load; ``finished``: that run's saved state when its
    checkpoint is at ``max_steps`` already (nothing to do), else None. ``out`` holding a run with
    the same :data:`RUN_IDENTITY` settings (its ``train_config.json``) is that run again: with a
    complete checkpoint it resumes from it; without one (killed before the first save,
    ``nonfinite: stop``, a crash) its files are removed and it starts over, all but its token
    store (:data:`STORE_DIR`), which verifies itself when opened and is reused. A ``checkpoint/``
    that is there but incomplete is never removed: the error says what it lacks and what to do.
    ``lock`` (the run's lock of ``out``) is taken before anything of a run there is read for
    resuming or removed. Then ``out`` must be writable.

    Raises:
        ConfigError: ``out`` is a file, holds something else or another run, or is not writable.
        CheckpointError: ``out/checkpoint`` is incomplete (naming what it lacks).
        LockedError: another process holds ``lock`` (naming it).
    """
    from megatrain.checkpoint import recover_checkpoint
    from megatrain.checkpoint_format import describe_incomplete, is_complete
    from megatrain.errors import CheckpointError
    from megatrain.train.model import resolve_model

    ckpt = out / CHECKPOINT_DIR
    here = source.kind == "checkpoint" and source.directory.resolve() == ckpt.resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {out} is a file; set output_dir (--output-dir) to a directory")
    held = sorted(p.name for p in out.iterdir() if not _is_leftover(p.name)) if out.is_dir() else []
    # A run that failed after building its token store but before writing anything else (too
    # little text for a batch, say) left only the store: as good as empty, and kept for reuse.
    ours = bool(held) and held != [STORE_DIR] and not here
    if ours:
        saved = _saved_settings(out)
        foreign = [n for n in held if n not in RUN_FILES]
        if saved is None or foreign:
            recover_checkpoint(ckpt)
            hint = (f", or resume the run in it with --model {ckpt}" if is_complete(ckpt) else "")
            raise ConfigError(f"output_dir {out} is not empty and holds no megatrain run of its own (it holds "
                              f"{', '.join(held[:5])}{' ...' if len(held) > 5 else ''}); choose another "
                              f"output_dir{hint}")
        # A setting missing from a run saved before it existed had its default then.
        was = {k: saved.get(k, type(cfg).model_fields[k].default) for k in RUN_IDENTITY}
        differ = [f"{k}={was[k]!r} there, {getattr(cfg, k)!r} now" for k in RUN_IDENTITY if was[k] != getattr(cfg, k)]
        if differ:
            raise ConfigError(f"output_dir {out} holds another run ({'; '.join(differ)}); choose another "
                              f"output_dir, or continue that run with its settings (see {out / CONFIG_FILE})")
    if lock is not None and out.is_dir():
        lock.acquire()
    if ours or here:
        recover_checkpoint(ckpt)
        if is_complete(ckpt):
            state = saved_train_state(ckpt)
            if state is not None and int(state.get("step", 0)) >= cfg.max_steps:
                return True, source, state
            if not here:
                echo(f"resume: {out} holds this run with a checkpoint; continuing from {ckpt}")
                source, here = resolve_model(str(ckpt)), True
        elif any(p.name not in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE) for p in ckpt.iterdir()) \
                if ckpt.is_dir() else ckpt.exists():
            raise CheckpointError(
                f"{ckpt} is not a complete checkpoint: {describe_incomplete(ckpt)}. It may hold trained weights, so "
                "it is left as it is. To resume from it, put the missing files back (from the copy it came from) and "
                "run the same command; to start the run over, move it away (or delete it) and run the same command; "
                "to start a new run from its weights, copy its config.json and model*.safetensors into a new "
                "directory and give that as --model, with another --output-dir")
        elif not here:
            import shutil

            echo(f"note: {out} holds this run, stopped before its first complete checkpoint; starting it again")
            for name in held:
                if name == STORE_DIR:
                    continue
                p = out / name
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    check_writable(out)
    return here, source, None


def saved_train_state(ckpt: Path) -> dict | None:
    """The ``megatrain train`` state (:func:`train_state`) of the complete checkpoint ``ckpt``,
    read from its ``trainer_state.json`` without loading anything; None where it has none."""
    from megatrain.checkpoint_format import STATE_DIR, TRAINER_STATE

    try:
        ts = json.loads((ckpt / STATE_DIR / TRAINER_STATE).read_bytes())
    except (OSError, ValueError):
        return None
    state = ts.get("extra_state", {}).get(STATE_KEY) if isinstance(ts, dict) else None
    return state if isinstance(state, dict) else None


def _saved_settings(out: Path) -> dict | None:
    try:
        saved = json.loads((out / CONFIG_FILE).read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def check_writable(out: Path) -> None:
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


def train_state(cfg: TrainConfig, step: int, skipped: int, fingerprint: str, tokenizer_sha: str,
                guard: dict | None = None) -> dict:
    """What a checkpoint keeps of the run (``guard``: ``Guard.state()``, the spike window and the
    skipped steps in a row)."""
    return {STATE_KEY: {
        **(guard or {}),
        "version": STATE_VERSION, "step": step, "batches_consumed": step, "skipped_steps": skipped,
        "data_fingerprint": fingerprint, "tokenizer_sha256": tokenizer_sha, "seq_len": cfg.seq_len,
        "global_batch": cfg.global_batch, "seed": cfg.seed,
        "lr_schedule": {"lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "max_steps": cfg.max_steps,
                        "min_lr_ratio": cfg.min_lr_ratio},
    }}


def check_resume(state: dict, cfg: TrainConfig, where: Path, fingerprint: str) -> None:
    for key in ("seq_len", "global_batch", "seed"):
        if state[key] != getattr(cfg, key):
            raise ConfigError(f"{where} was trained with {key}={state[key]} but this run has {key}="
                              f"{getattr(cfg, key)}; resuming needs the same {key} (the data position counts "
                              "batches of that shape and order)")
    if state["data_fingerprint"] != fingerprint:
        raise ConfigError(f"{where}: the training windows differ from the checkpoint's (sha256 "
                          f"{state['data_fingerprint'][:12]} there, {fingerprint[:12]} now); resume with the same "
                          "data, max_bytes, text_field, tokenizer, eot_token, val_fraction and seed")
    if state["step"] >= cfg.max_steps:
        raise ConfigError(f"{where} is at step {state['step']}, and max_steps is {cfg.max_steps}: nothing to do in "
                          "a new output_dir; raise max_steps to train on")
