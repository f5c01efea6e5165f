"""The host-memory preflight: the planned model's host bytes plus the data pipeline's and a
checkpoint shard's, against what the machine has, before anything large is allocated."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from megatrain.errors import ConfigError, PlanError
from megatrain.units import GiB, gib

if TYPE_CHECKING:
    from megatrain.train.config import TrainConfig

DATA_BYTES_PER_TEXT_BYTE = 40
"""Host bytes the data pipeline may hold per byte of text read (estimate, for the preflight): the
documents as ``str``, BPE training, per-document token arrays and the packed rows with labels.
megatrain.data measured about 1.3 GB of RAM for the 32 MB standard-library corpus, i.e. ~40x."""


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
    parts = [f"FP32 master weights {gib(mem.master_weights)}", f"Adam moments {gib(mem.adam_moments)}",
             f"gradient ring {gib(mem.gradient_ring)}"]
    if mem.staging_ring:
        parts.append(f"staging ring {gib(mem.staging_ring)}")
    if mem.pinned_activations:
        parts.append(f"pinned activations {gib(mem.pinned_activations)}")
    parts.append(f"data and tokenizer about {gib(data_bytes)}")
    if checkpoint_bytes:
        parts.append(f"largest checkpoint shard {gib(checkpoint_bytes)}")
    clip = (" or max_grad_norm: null (clipping keeps every gradient, 4 more bytes per parameter),"
            if mem.gradient_ring > 0.1 * needed else "")
    raise PlanError(
        f"not enough host memory: this run needs about {gib(needed)} ({', '.join(parts)}) but "
        f"{gib(have)} is available ({where}). Each parameter takes 12 bytes of host state "
        f"({graph.param_count / 1e9:,.2f}B parameters here): train a smaller model, lower max_bytes,{clip} "
        f"free host memory, or use a machine with at least {math.ceil(needed / GiB):,} GiB available")


def data_pipeline_bytes(cfg: TrainConfig) -> int:
    from megatrain.data import corpus_bytes

    try:
        text = corpus_bytes(cfg.data)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data: {e}") from None
    if cfg.max_bytes is not None:
        text = min(text, cfg.max_bytes)
    return text * DATA_BYTES_PER_TEXT_BYTE


def largest_safetensors(directory: Path | None) -> int:
    if directory is None:
        return 0
    return max((f.stat().st_size for f in directory.glob("*.safetensors")), default=0)
