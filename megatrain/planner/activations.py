"""Activation liveness: when a schedule's checkpoints, boundary gradients and working memory take
and give back GPU bytes, per op, and the issue fences lowering derives from it.

Both the memory model (:mod:`megatrain.planner.memory`: activation peaks, the caching allocator's
pools) and lowering (:func:`issue_fences`, ``Schedule.issue_after``) read it, so it sits below both:
it imports neither, and lowering no longer imports the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.ir.graph import Layer, LayerGraph
from megatrain.ir.liveness import BATCH, liveness
from megatrain.ir.schedule import COMPUTE_KINDS, OpKind, Schedule, Stream



# -- memory ----------------------------------------------------------------------------------------

def working_bytes(layer: Layer, kind: OpKind) -> int:
    """Transient GPU bytes while a compute op of ``kind`` runs on ``layer``.

    ``work_bytes`` bounds a local backward (every intermediate its forward creates may be held for
    the backward proper). A forward under no_grad frees intermediates sooner, but the bound is
    used for both: the runtime may run the forward with grad enabled, and an over-estimate here
    costs a little batch size where an under-estimate costs an out-of-memory error.
    """
    return layer.work_bytes if kind in COMPUTE_KINDS else 0


@dataclass(frozen=True, slots=True)
class ActivationLiveness:
    """When checkpoint and boundary-gradient bytes are allocated and freed, per op of a schedule.

    Every event belongs to a compute op, and compute ops run in list order on one in-order
    stream, so GPU activation memory is a function of that order alone. Bytes in ``alloc[i]``
    are taken when op ``i`` starts and those in ``free[i]`` given back when it ends; ``work[i]``
    is held only while it runs; ``at_start`` (the batch inputs) is held from the step's start.

    Liveness, per (value, micro-batch). A checkpoint is on the GPU in generations: from the start
    of the FWD or RECOMPUTE that produces it, or from a RELOAD that copies it back, to the end of
    the last compute op that reads it before the next generation begins (a value nobody reads,
    until its producer ends). A RELOAD's bytes are counted from the start of the compute op after
    the last compute op it waits for (it cannot start earlier). A generation an OFFLOAD copies out
    stays until the compute op just before the first compute op that waits for that OFFLOAD (the
    lowering makes one wait, so the copy is known done by then), or the step's end. The gradient of
    a value that requires grad, from the start of the first consumer's local backward (which
    produces it) to the end of its producer's local backward. A batch input from the step's start
    to the end of its last reader (or the step's end). Values the last layer produces inside its
    local backward (the loss) are part of that op's working memory.

    Pools. ``reload_alloc`` and ``reload_free`` are the part of ``alloc`` and ``free`` that RELOADs
    put on the GPU: the CUDA caching allocator keeps a pool per stream and hands a block only to
    the stream that made it, so the H2D stream's reloaded checkpoints and the compute stream's
    memory never share blocks (:func:`pool_peaks`). ``alloc_n`` and ``free_n`` count the tensors
    (one per generation or gradient) behind ``alloc`` and ``free``: the allocator rounds each
    (:func:`gpu_reserve`).
    """

    at_start: int
    alloc: tuple[int, ...]
    free: tuple[int, ...]
    work: tuple[int, ...]
    reload_alloc: tuple[int, ...] = ()
    reload_free: tuple[int, ...] = ()
    alloc_n: tuple[int, ...] = ()
    free_n: tuple[int, ...] = ()


def activation_liveness(schedule: Schedule, graph: LayerGraph) -> ActivationLiveness:
    """The allocation events of checkpoints, boundary gradients and working memory. The
    generations of the checkpoints and their readers come from
    :func:`megatrain.ir.liveness.liveness`, the walk the executor frees memory by too."""
    ops = schedule.ops
    n = len(ops)
    alloc, free, work = [0] * n, [0] * n, [0] * n
    ralloc, rfree = [0] * n, [0] * n
    nalloc, nfree = [0] * n, [0] * n
    bwd: dict[tuple[int, int], int] = {}
    for i, op in enumerate(ops):
        if op.kind in COMPUTE_KINDS:
            work[i] = working_bytes(graph.layers[op.layer], op.kind)
        if op.kind is OpKind.BWD:
            bwd[(op.layer, op.mb)] = i
    at_start = 0
    for g, alloc_at, end in _generation_spans(schedule, graph):
        nbytes = graph.values[g.key[0]].nbytes
        reloaded = g.producer != BATCH and ops[g.producer].kind is OpKind.RELOAD
        if alloc_at < 0:
            at_start += nbytes
        elif alloc_at < n:
            alloc[alloc_at] += nbytes
            ralloc[alloc_at] += nbytes if reloaded else 0
            nalloc[alloc_at] += 1
        if end >= 0 and end < n and alloc_at >= 0:
            nfree[end] += 1
        if end >= 0 and end < n:
            free[end] += nbytes
            rfree[end] += nbytes if reloaded else 0
    for mb in range(schedule.plan.micro_batches):
        for v in graph.values:
            q = bwd.get((v.producer, mb))
            grads_from = [bwd[(c, mb)] for c in v.consumers if (c, mb) in bwd]
            if v.requires_grad and q is not None and grads_from:
                first = min(grads_from)
                alloc[first] += v.nbytes
                free[max(q, first)] += v.nbytes
                nalloc[first] += 1
                nfree[max(q, first)] += 1
    return ActivationLiveness(at_start, tuple(alloc), tuple(free), tuple(work), tuple(ralloc), tuple(rfree),
                              tuple(nalloc), tuple(nfree))


def _generation_spans(schedule: Schedule, graph: LayerGraph):
    """``(generation, alloc_at, end)`` for each checkpoint generation (:func:`liveness`): the compute
    op whose start it is counted from (-1: the step's start) and the op at whose end it is freed,
    by the rules of :class:`ActivationLiveness`."""
    ops = schedule.ops
    n = len(ops)
    on_gpu = [op.kind in COMPUTE_KINDS for op in ops]  # the compute stream's ops, computed once
    compute = [i for i in range(n) if on_gpu[i]]
    after = [len(ops)] * (n + 1)  # after[i]: first compute op at or after i
    for i in range(n - 1, -1, -1):
        after[i] = i if on_gpu[i] else after[i + 1]
    before = [-1] * n  # before[i]: last compute op before i
    for i in range(1, n):
        before[i] = i - 1 if on_gpu[i - 1] else before[i - 1]
    waiters: dict[int, int] = {}  # non-compute op -> first compute op that lists it as a dependency
    for i, op in enumerate(ops):
        if on_gpu[i]:
            for d in op.deps:
                if not on_gpu[d]:
                    waiters.setdefault(d, i)
    last_compute = compute[-1] if compute else -1
    for g in liveness(schedule, graph).generations:
        if g.producer == BATCH:
            alloc_at = -1
        elif ops[g.producer].kind is OpKind.RELOAD:
            waits = [d for d in ops[g.producer].deps if on_gpu[d]]
            alloc_at = after[max(waits) + 1] if waits else -1  # it cannot start earlier
        else:
            alloc_at = g.producer
        end = max((r for r in g.readers if on_gpu[r]), default=alloc_at)
        for o in g.readers:
            if not on_gpu[o]:  # an OFFLOAD: the copy is known done before its first waiter
                w = waiters.get(o)
                end = max(end, before[w] if w is not None else last_compute)
        yield g, alloc_at, end


def allocation_stream(kind: OpKind) -> Stream | None:
    """The stream whose CUDA caching-allocator pool an op of ``kind`` allocates device memory from
    while it is issued: compute ops allocate their outputs, boundary gradients and working memory on
    the compute stream, a RELOAD the checkpoints it copies back on the H2D stream; other ops
    allocate nothing a plan sizes (None)."""
    if kind in COMPUTE_KINDS:
        return Stream.COMPUTE
    return Stream.H2D if kind is OpKind.RELOAD else None


def issue_fences(schedule: Schedule, graph: LayerGraph) -> tuple[tuple[int, ...], ...]:
    """For each op of ``schedule``, the ops that must have *finished* on the device before the issuing
    thread issues it (``Schedule.issue_after``), so that the CUDA caching allocator never holds more
    than :func:`activation_liveness` counts; empty tuples for most ops, and ``()`` for a schedule that
    needs no fence.

    Why. The allocator hands out memory when an op is issued, not when it runs, and takes a block
    back when the issuing thread drops the tensor; a block another stream read
    (``Tensor.record_stream``: a checkpoint an OFFLOAD copies out on the D2H stream, one a RELOAD
    brought in on the H2D stream and compute reads) is reused only once that stream has passed the
    point where it was freed (PyTorch ``c10/cuda/CUDACachingAllocator.cpp``: ``insert_events`` when
    a block with stream uses is freed, ``process_events`` before each allocation). An issuing
    thread far ahead of the device finds every such block still taken and asks for new memory,
    however early the cost model freed it: with unbounded run-ahead a forward pass of offloaded
    checkpoints holds all of them at once.

    Rule. A checkpoint generation read on a stream ``s`` other than the one that allocated it
    (:func:`allocation_stream` of its producer: compute for a FWD or RECOMPUTE, H2D for a RELOAD)
    is dropped at its last reader ``f`` (list order, as the executor drops it) and freed by the cost
    model after op ``m``. The first op after both that allocates on the producer's stream, ``j``, is
    where the cost model first reuses the bytes, so ``j`` waits for the last op of ``s`` at or before
    ``f`` (that op's completion implies every earlier one's on the in-order stream). Later
    allocations need no wait of their own: ``j`` was issued before them. Allocations never wait for
    their own stream: the allocator reuses a block on the stream that made it in stream order.
    """
    ops = schedule.ops
    n = len(ops)
    pool = [allocation_stream(op.kind) for op in ops]
    nxt: dict[Stream, list[int]] = {}
    for s in (Stream.COMPUTE, Stream.H2D):  # nxt[s][i]: first op at or after i that allocates on stream s
        a = [n] * (n + 1)
        for i in range(n - 1, -1, -1):
            a[i] = i if pool[i] is s else a[i + 1]
        nxt[s] = a
    last: dict[Stream, list[int]] = {}  # last[s][i]: the last op of stream s at or before i (-1: none)
    for s in (Stream.COMPUTE, Stream.H2D, Stream.D2H):
        a, prev = [], -1
        for op in ops:
            prev = len(a) if op.stream is s else prev
            a.append(prev)
        last[s] = a
    after: dict[int, dict[Stream, int]] = {}
    for g, _, end in _generation_spans(schedule, graph):
        if g.producer == BATCH or not g.readers:
            continue
        home = pool[g.producer]
        f = g.readers[-1]
        j = nxt[home][max(f, end) + 1]
        if j == n:
            continue
        for s in {ops[r].stream for r in g.readers} - {home}:
            fence = after.setdefault(j, {})
            fence[s] = max(fence.get(s, -1), last[s][f])
    if not after:
        return ()  # no fences (Schedule.issue_after's "none" form)
    return tuple(tuple(sorted(after[i].values())) if i in after else () for i in range(n))


__all__ = ["working_bytes", "ActivationLiveness", "activation_liveness", "allocation_stream", "issue_fences"]
