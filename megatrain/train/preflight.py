"""The host-memory preflight: the planned model's host bytes plus the data pipeline's and a
checkpoint shard's, against what the machine has, before anything large is allocated."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from megatrain.errors import ConfigError, PlanError
from megatrain.units import GiB, MiB, gib, human_bytes

if TYPE_CHECKING:
    from megatrain.train.config import TrainConfig
    from megatrain.trainer import PlannedModel

DATA_BYTES_PER_TEXT_BYTE = 40
"""Host bytes per byte of a tokenizer's training sample (estimate, for the preflight): the sample's
documents as ``str`` and BPE training on them. The in-memory pipeline this replaced (documents,
BPE, token arrays, packed rows) measured about 1.3 GB of RAM for the 32 MB standard-library
corpus, i.e. ~40x: an upper bound for the sample alone."""

STORE_READER_BYTES = 64 * MiB
"""Host bytes reading the token store may add to the process, whatever the corpus's size: the
window reader maps only the pages of the batch it copies and unmaps them after
(``megatrain.data.StoreWindows``). ``bench/data_rss.py`` measured +6.3 MB of RSS over a whole
epoch of a 1 GB corpus (352 M tokens) and +0.5 MB at 100 MB
(``bench/results/2026-11-24-cpu-data-rss-*.json``); 64 MiB is that with a tenfold margin for
page tables and the batch's index arrays."""

BATCH_BYTES_PER_TOKEN = 32
"""Host bytes per token of a global batch while it is read: int64 ``input_ids`` and ``labels``
(16 bytes) and the gather index and staging copy of the same size."""


def preflight_host_memory(planned: PlannedModel, *, data_bytes: int, checkpoint_bytes: int = 0,
                          built_bytes: int = 0, available: tuple[int, str] | None) -> int:
    """Check that the planned run fits in host memory before anything large is allocated; return
    its bytes.

    Needed: ``planned.memory.host_total`` (FP32 master weights, two Adam moments, gradient and
    staging rings, pinned activations: the breakdown of the very plan that will run), plus
    ``data_bytes`` (the token store's reader and a batch, and a tokenizer's training sample:
    :func:`data_pipeline_bytes`; not the corpus, which stays on disk), plus ``checkpoint_bytes``
    (the largest safetensors file loaded, whose pages are mapped while it is read), plus ``built_bytes`` (a model built on the
    CPU, held until ``materialize`` moves it into the host tiles). Data parallel: per node, whose
    ``plan.gpus_per_node`` ranks each check before any allocates: the master weights and the
    moments in host memory count once per copy (once where the node's ranks share one,
    ``plan.optimizer_shards``; once per rank where each has its own), everything else (rings, the
    NVMe I/O buffers of moments on NVMe, data) once per rank of the node; with
    ``plan.host_state == "shard"`` the node holds ``1 / nodes`` of the weights and moments and its
    gather tiles (``cost.node_memory``).

    Args:
        available: ``(bytes, source)`` from :func:`available_host_memory`, read before the model
            was built; None skips the check.

    Raises:
        PlanError: the run needs more than is available; the message gives both in GiB, what the
            bytes are for, and what to change.
    """
    from megatrain.planner.cost import node_memory

    mem = planned.memory
    ranks = planned.plan.gpus_per_node  # the node's ranks, all in this node's memory
    copies = ranks // planned.plan.optimizer_shards  # of the host state: each shared by optimizer_shards ranks
    # The cost model's node: the state once per copy (1/nodes of it when sharded across nodes), a
    # shared cast's tiles and the gather tiles once, the rest once per rank.
    needed = node_memory(planned.graph, planned.plan, mem).total + ranks * (data_bytes + checkpoint_bytes + built_bytes)
    if available is None or needed <= available[0]:
        return needed
    parts = [f"FP32 master weights {gib(mem.master_weights)}", f"Adam moments {gib(mem.adam_moments)}",
             f"gradient ring {gib(mem.gradient_ring)}"]
    if ranks > 1:
        parts.append(f"the node's {ranks} ranks " + ("share the weights and moments" if copies == 1 else
                                                     f"hold {copies} copies of the weights and moments")
                     + (f" (1/{planned.plan.nodes} of them: host_state 'shard')"
                        if planned.plan.host_state == "shard" else "")
                     + f", the rest counts {ranks} times")
    if mem.staging_ring:
        parts.append(f"staging ring {gib(mem.staging_ring)}")
    if mem.pinned_activations:
        parts.append(f"pinned activations {gib(mem.pinned_activations)}")
    _refuse(needed, parts, data_bytes, checkpoint_bytes, built_bytes, available, planned.graph.param_count,
            clip_hint=mem.gradient_ring > 0.1 * needed,
            nvme_hint=not (planned.plan.nvme_moments or planned.plan.nvme_masters or planned.plan.nvme_gradients))


def preflight_cpu_build(meta_model, *, clip: bool, data_bytes: int, checkpoint_bytes: int = 0,
                        available: tuple[int, str] | None, optimizer: str = "adamw", nvme: bool = False) -> int:
    """The bound checked before a model is built on the CPU (to be traced and planned there):
    building it is itself an allocation of 4 bytes per parameter, too large to attempt when the
    run cannot fit. Returns the bytes counted.

    Counts, from ``meta_model``'s parameters (a model on the ``meta`` device: nothing traced, no
    memory), what :func:`preflight_host_memory` will count at least: FP32 master weights and the
    state of host optimizer ``optimizer`` (``cost.MASTER_BYTES_PER_ELEMENT`` + its spec's
    ``state_bytes_per_param`` per parameter: 8 for AdamW's two moments, 4 for Lion's one), with ``clip`` a gradient tile per layer (``cost.GRAD_ITEMSIZE`` per parameter),
    the built FP32 model, ``data_bytes`` and ``checkpoint_bytes``. With ``nvme`` (an NVMe
    directory, where the placement may move the moments, gradient tiles and masters) only the last
    three. The exact check of the planned model follows the build.

    Raises:
        PlanError: as :func:`preflight_host_memory`.
    """
    from megatrain.optim import optimizer_spec
    from megatrain.planner import cost

    n = sum(p.numel() for p in meta_model.parameters())
    master, moments = n * cost.MASTER_BYTES_PER_ELEMENT, n * optimizer_spec(optimizer).state_bytes_per_param
    grads = n * cost.GRAD_ITEMSIZE if clip else 0
    if nvme:  # a lower bound: what the placement may move is not counted
        master = moments = grads = 0
    built = n * BUILT_BYTES_PER_PARAMETER
    needed = master + moments + grads + built + data_bytes + checkpoint_bytes
    if available is None or needed <= available[0]:
        return needed
    parts = [f"FP32 master weights {gib(master)}", f"{optimizer_spec(optimizer).label} moments {gib(moments)}"]
    if nvme:
        parts = ["at least what NVMe cannot hold"]
    if grads:
        parts.append(f"gradient tiles {gib(grads)}")
    _refuse(needed, parts, data_bytes, checkpoint_bytes, built, available, n, clip_hint=grads > 0.1 * needed,
            nvme_hint=False)  # (the CPU backend builds the model in host memory whatever NVMe holds)


BUILT_BYTES_PER_PARAMETER = 4
"""A model built on the CPU in FP32 (the CPU backend traces the model it runs), until ``materialize``
moves its parameters into the host tiles."""


def _refuse(needed: int, parts: list[str], data_bytes: int, checkpoint_bytes: int, built_bytes: int,
            available: tuple[int, str], params: int, *, clip_hint: bool, nvme_hint: bool):
    have, where = available
    parts = parts + [f"data and tokenizer about {gib(data_bytes)}"]
    if checkpoint_bytes:
        parts.append(f"largest checkpoint shard {gib(checkpoint_bytes)}")
    if built_bytes:
        parts.append(f"the model built on the CPU {gib(built_bytes)}")
    clip = (" or max_grad_norm: null (clipping keeps every gradient, 4 more bytes per parameter),"
            if clip_hint else "")
    raise PlanError(
        f"not enough host memory: this run needs about {gib(needed)} ({', '.join(parts)}) but "
        f"{gib(have)} is available ({where}). Each parameter takes 12 bytes of host state "
        f"({params / 1e9:,.2f}B parameters here): train a smaller model,{clip} "
        + ("put optimizer state on NVMe (--nvme-dir DIR, with --host-memory SIZE for what stays in RAM; "
           "megatrain plan --nvme says what moves), " if nvme_hint else "")
        + (f"or give host_memory of at least {human_bytes(needed)} (--host-memory {math.ceil(needed / MiB)}MiB)"
           if where.startswith("host_memory") else
           f"free host memory, or use a machine with at least {math.ceil(needed / GiB):,} GiB available"))


SFT_LAYOUT_BYTES_PER_DATA_BYTE = 1.0
"""Host bytes an SFT set's row layout takes per byte of its files: about 40 bytes per example in
arrays (length, split, place in the epoch and in the packed rows) and about 100 more while
best-fit decreasing packs them (Python lists), at one example per 150 bytes of data or more
(``examples/data/alpaca_demo.json``, short records, has 167 bytes a record)."""


def data_pipeline_bytes(cfg: TrainConfig, tokenizer_sample: int = 0) -> int:
    """Host bytes of the data pipeline for the preflight: :data:`STORE_READER_BYTES`, a global
    batch (:data:`BATCH_BYTES_PER_TOKEN` per token), and ``tokenizer_sample`` bytes of text that
    train a BPE (:data:`DATA_BYTES_PER_TEXT_BYTE` each; 0 when the tokenizer is given). The corpus
    itself is tokenised into the on-disk store and read through a memory map, so its size does not
    count; the store's build runs in worker processes, each bounded by a batch of documents
    (``megatrain.data.store``), and ends before the model's host state is allocated. With
    ``task: sft`` the SFT store is built streaming, one example at a time, and the row layout adds
    :data:`SFT_LAYOUT_BYTES_PER_DATA_BYTE`.

    Raises:
        ConfigError: the data path does not exist or holds no corpus file (checked here, before the
            model is built).
    """
    from megatrain.data import corpus_bytes
    from megatrain.data.sft_sources import sft_data_bytes

    try:
        if cfg.task == "dpo" and cfg.data is not None:  # the pairs are read into memory (megatrain.train.rl_tasks)
            from megatrain.data.preference import resolve_preference_data

            text = sum(s.nbytes() for s in resolve_preference_data(cfg.data))
        elif cfg.task in ("sft", "grpo") and cfg.data is not None:
            text = sft_data_bytes(cfg.data)
        else:
            text = corpus_bytes(cfg.data)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data: {e}") from None
    sample = min(text, tokenizer_sample)
    layout = int(text * SFT_LAYOUT_BYTES_PER_DATA_BYTE) if cfg.task == "sft" else 0
    return (STORE_READER_BYTES + cfg.global_batch * cfg.seq_len * BATCH_BYTES_PER_TOKEN
            + sample * DATA_BYTES_PER_TEXT_BYTE + layout)


def largest_safetensors(directory: Path | None) -> int:
    if directory is None:
        return 0
    return max((f.stat().st_size for f in directory.glob("*.safetensors")), default=0)


def checkpoint_bytes(graph) -> int:
    """Bytes one checkpoint of ``graph``'s model takes on disk: FP32 weights and two FP32 Adam
    moments per trainable parameter (buffers, configs and the tokenizer are small beside them)."""
    return sum(4 * layer.numel + 8 * layer.trainable_numel for layer in graph.layers)


def preflight_disk(out: Path, graph) -> int:
    """Check that ``out``'s file system has room for a checkpoint now, rather than at the first save
    hours later; return the bytes one takes. A save writes the new checkpoint beside the last one
    before it replaces it, so the free space must hold a whole checkpoint.

    Raises:
        PlanError: less space is free than one checkpoint takes; the message gives both and what to
            change.
    """
    import shutil

    from megatrain.units import human_bytes

    need = checkpoint_bytes(graph)
    where = out
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        raise PlanError(f"not enough disk space for a checkpoint: one takes about {human_bytes(need)} (FP32 weights "
                        f"and two Adam moments per parameter), and {where}'s file system has {human_bytes(free)} "
                        f"free; free {human_bytes(need - free)} there or set output_dir (--output-dir) on a larger disk")
    return need
