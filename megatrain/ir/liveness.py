"""Checkpoint liveness: which copy of each checkpoint on the GPU every op reads, and who reads it.

A checkpoint ``(value id, micro-batch)`` is on the GPU in *generations*: a generation begins at the
op that puts the value there -- the FWD or RECOMPUTE that computes it, the RELOAD that copies it
back, or, for a batch input, the step's start (:data:`BATCH`) -- and each later op that reads the
value reads the generation in force at its place in the list, until the next generation begins.
Readers are the compute ops (FWD, BWD, RECOMPUTE), which read their layer's inputs, and the
OFFLOADs, which read their layer's checkpoints (:meth:`LayerGraph.checkpoints`).

One walk over the list in issue order serves every consumer, so the rule is written once:

- the cost model (:func:`megatrain.planner.activations.activation_liveness`) frees a generation's bytes
  after its last reader;
- the executor drops a generation once its last reader has run (an op's work may run after later
  ops were launched, so it keys reads by generation, never by what a dictionary holds);
- the verifier's ``data`` rule checks that every reader happens after its generation's producer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from megatrain.ir.graph import BATCH_PRODUCER, LayerGraph
from megatrain.ir.schedule import OP_KINDS, OpKind, Schedule

BATCH = -1
"""Producer of a batch input's generation: it is on the device before the run's first op."""

Key = tuple[int, int]
"""A checkpoint: ``(value id, micro-batch)``."""


@dataclass(frozen=True, slots=True)
class Generation:
    """One stay of checkpoint ``key`` on the GPU: put there by op ``producer`` (or :data:`BATCH`)
    and read by ops ``readers`` (indices, in list order; empty when nothing reads it)."""

    key: Key
    producer: int
    readers: tuple[int, ...]

    @property
    def last_reader(self) -> int | None:
        """The last op that reads this generation (None: nobody does)."""
        return self.readers[-1] if self.readers else None


@dataclass(frozen=True, slots=True)
class Liveness:
    """Every generation of a schedule's checkpoints, and what each op reads.

    ``reads[i]`` maps each checkpoint op ``i`` reads to the index of its generation in
    ``generations``, or to None when no op put that checkpoint on the GPU before op ``i`` in the list
    (a schedule the verifier refuses). ``generations`` are in the order they begin.
    """

    generations: tuple[Generation, ...]
    reads: tuple[dict[Key, int | None], ...]


def reads_of(graph: LayerGraph, kind: OpKind, layer: int) -> tuple[int, ...]:
    """Ids of the values an op of ``kind`` on ``layer`` reads on the GPU: a compute op's inputs, an
    OFFLOAD's checkpoints (``OpKindSpec.gpu_reads``; none for other kinds)."""
    return _values(graph, OP_KINDS[kind].gpu_reads, layer)


def writes_of(graph: LayerGraph, kind: OpKind, layer: int) -> tuple[int, ...]:
    """Ids of the values an op of ``kind`` on ``layer`` puts on the GPU: a FWD's or RECOMPUTE's
    outputs (the loss too, which no op reads), a RELOAD's checkpoints (``OpKindSpec.gpu_writes``)."""
    return _values(graph, OP_KINDS[kind].gpu_writes, layer)


def _values(graph: LayerGraph, which: str | None, layer: int) -> tuple[int, ...]:
    if which == "inputs":
        return graph.layers[layer].inputs
    if which == "outputs":
        return graph.layers[layer].outputs
    if which == "checkpoints":
        return graph.checkpoints(layer)
    return ()


_RECENT: dict[tuple[int, int, int], tuple[tuple, LayerGraph, Liveness]] = {}
_RECENT_SIZE = 8
_RECENT_LOCK = threading.Lock()


def liveness(schedule: Schedule, graph: LayerGraph) -> Liveness:
    """The generations of ``schedule``'s checkpoints, in one walk over its ops in list order.

    Batch inputs of every micro-batch begin a generation each at the step's start.

    The answers for the last few ``(schedule.ops, graph)`` pairs are kept (both are immutable, and
    the pair is matched by identity): lowering (its issue fences), the memory model and a
    Timeline's memory curve each ask for the same schedule's, and the solver asks for thousands.
    """
    key = (id(schedule.ops), schedule.plan.micro_batches, id(graph))
    hit = _RECENT.get(key)
    if hit is not None and hit[0] is schedule.ops and hit[1] is graph:
        return hit[2]
    live = _walk(schedule, graph)
    with _RECENT_LOCK:  # a planner and an executor may ask from two threads
        if len(_RECENT) >= _RECENT_SIZE:
            del _RECENT[next(iter(_RECENT))]  # the oldest
        _RECENT[key] = (schedule.ops, graph, live)
    return live


def _walk(schedule: Schedule, graph: LayerGraph) -> Liveness:
    producers: list[tuple[Key, int]] = []
    readers: list[list[int]] = []
    current: dict[Key, int] = {}

    def begin(key: Key, producer: int) -> None:
        current[key] = len(producers)
        producers.append((key, producer))
        readers.append([])

    for mb in range(schedule.plan.micro_batches):
        for vid, v in enumerate(graph.values):
            if v.producer == BATCH_PRODUCER:
                begin((vid, mb), BATCH)
    reads: list[dict[Key, int | None]] = []
    for i, op in enumerate(schedule.ops):
        r: dict[Key, int | None] = {}
        for vid in reads_of(graph, op.kind, op.layer):
            key = (vid, op.mb)
            gen = current.get(key)
            r[key] = gen
            if gen is not None:
                readers[gen].append(i)
        reads.append(r)
        for vid in writes_of(graph, op.kind, op.layer):
            begin((vid, op.mb), i)
    gens = tuple(Generation(key, p, tuple(rs)) for (key, p), rs in zip(producers, readers))
    return Liveness(gens, tuple(reads))


__all__ = ["BATCH", "Generation", "Liveness", "liveness", "reads_of", "writes_of"]
