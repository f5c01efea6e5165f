"""The stages every ``megatrain train`` task shares, each a function of the run's config: the
CPU threads, the model to start from, the locks of the directories a run writes, the files beside
its metrics, its checkpoint with the tokenizer beside it, and the loss plot. The LM/SFT run
(:class:`megatrain.train.loop.Run`) and the DPO/GRPO run (:mod:`megatrain.train.rl_tasks`) are
built from them, so that a run directory looks and locks the same whatever the task.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from megatrain.files import DirectoryLock, write_atomic
from megatrain.train.model import ModelSource, init_source, is_run_checkpoint, resolve_model
from megatrain.train.rundir import (CONFIG_FILE, NVME_LOCK_FILE, PLOT_FILE, SCHEDULE_FILE, TOKENIZER_CONFIG_FILE,
                                    TOKENIZER_FILE)

if TYPE_CHECKING:
    from megatrain.train.config import TrainConfig

__all__ = ["Checkpoint", "held_locks", "model_source", "nvme_dir_lock", "plot_or_note", "set_threads",
           "write_run_files"]


def set_threads(cfg: TrainConfig, echo: Callable[[str], None], *, load: bool = True) -> None:
    """The CPU backend's intra-op threads (:func:`megatrain.runtime.threads.choose_threads`), said
    in one line, with the other work's share of the CPU where ``load`` and the machine is
    oversubscribed; on CUDA only ``threads`` where given (the host optimizer's threads)."""
    import torch

    from megatrain.runtime.threads import choose_threads, oversubscription

    if cfg.device == "cpu":
        threads = choose_threads(cfg.threads)
        busy = oversubscription() if load else None
        echo(threads.describe() + (f"; {busy}: steps slow down by the CPU share other work takes" if busy else ""))
    elif cfg.threads:
        torch.set_num_threads(cfg.threads)


def model_source(cfg: TrainConfig, out: Path) -> ModelSource:
    """The model a run in ``out`` starts from: ``model`` resolved (a Hugging Face directory or
    preset, or a megatrain checkpoint), its positions checked against ``seq_len``, and with
    ``init_from`` the weights of that directory instead, unless ``model`` is ``out``'s own
    checkpoint (which resumes the run whatever ``init_from`` says).

    Raises:
        ConfigError: an unknown model, or ``seq_len`` beyond its ``max_position_embeddings``.
    """
    from megatrain.models import check_positions

    source = resolve_model(cfg.model)
    check_positions(source.config, cfg.seq_len, cfg.model)
    if cfg.init_from is not None and not is_run_checkpoint(source, out):
        source = init_source(cfg.init_from, source)
    return source


def nvme_dir_lock(cfg: TrainConfig) -> DirectoryLock | None:
    """The lock of ``cfg.nvme_dir`` (None without one), not yet acquired. Two runs on one nvme_dir
    would share its tile files by name (each run's moments overwriting the other's): one run at a
    time, as for output_dir."""
    return DirectoryLock(Path(cfg.nvme_dir) / NVME_LOCK_FILE, f"nvme_dir {cfg.nvme_dir}") \
        if cfg.nvme_dir is not None else None


@contextmanager
def held_locks(output: DirectoryLock | None, nvme: DirectoryLock | None) -> Iterator[None]:
    """Hold a run's locks: ``nvme`` (the nvme_dir's, :func:`nvme_dir_lock`) is acquired here;
    ``output`` (output_dir's) by the caller, when the directory exists. Both are released at the
    end, however the run ends.

    Raises:
        LockedError: another process holds ``nvme`` (naming it).
    """
    try:
        if nvme is not None:
            nvme.acquire()
        yield
    finally:
        for held in (output, nvme):
            if held is not None:
                held.release()


def write_run_files(out: Path, given: TrainConfig, tokenizer_json: str, schedule_json: str | None = None) -> None:
    """The files beside a run's metrics: ``given`` (the settings as given, ``device: auto`` kept, so
    that a resume on another machine chooses again), the steady schedule when there is one, and the
    tokenizer."""
    write_atomic(out / CONFIG_FILE, given.model_dump_json(indent=1) + "\n")
    if schedule_json is not None:
        write_atomic(out / SCHEDULE_FILE, schedule_json)
    write_atomic(out / TOKENIZER_FILE, tokenizer_json)


@dataclass(slots=True)
class Checkpoint:
    """A run's checkpoint directory (``output_dir/checkpoint``), a model directory Hugging Face
    loads: the trainer's weights and resumable state (``megatrain.checkpoint.save_checkpoint``),
    then beside them the run's tokenizer (``tokenizer.json`` and ``tokenizer_config.json``) or a
    vision-language run's whole processor (``processor``: what ``AutoProcessor`` loads). Only the
    ``writes`` rank writes the tokenizer; ``Trainer.save`` coordinates the ranks itself."""

    trainer: Any
    path: Path
    tokenizer_json: str
    tokenizer_config: dict
    processor: Any = None
    writes: bool = True
    last_saved: int | None = field(default=None)
    """The step of the last checkpoint this run wrote or resumed from (None: none yet)."""

    def save(self, step: int, extra_state: dict | None = None, extra_tensors: dict | None = None) -> None:
        """Save the trainer at ``step`` with ``extra_state`` (``megatrain train``'s data position and
        guard) and ``extra_tensors`` (``save_checkpoint``'s: a DPO/GRPO run's sampler state,
        reference and pending rollouts), then the tokenizer beside it.

        Raises:
            CheckpointError: the save failed (naming the file); the last complete checkpoint stays.
        """
        self.trainer.save(self.path, extra_state=extra_state, extra_tensors=extra_tensors)
        # Outside the atomic save, so it may be missing after a crash; the resume then trains the same
        # BPE again (deterministic) and the data fingerprint check catches any difference.
        if self.writes and self.processor is not None:  # its tokenizer, image processor and template
            self.processor.save_pretrained(self.path)
        elif self.writes:
            write_atomic(self.path / TOKENIZER_FILE, self.tokenizer_json)
            write_atomic(self.path / TOKENIZER_CONFIG_FILE, json.dumps(self.tokenizer_config, indent=1) + "\n")
        self.last_saved = step


def plot_or_note(save: Callable[[], None], echo: Callable[[str], None]) -> None:
    """Write the run's loss plot with ``save()``; without matplotlib (the ``plot`` extra) a note
    says why there is none, and the run goes on."""
    try:
        save()
    except ImportError as e:
        echo(f"note: no {PLOT_FILE}: {e}")
