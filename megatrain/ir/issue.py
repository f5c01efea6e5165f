"""Issue order: which op the one issuing thread hands to its stream next. Shared by the CUDA backend
and the simulator, so that the order predicted is the order run.

Why this exists. On a GPU the Python thread that walks the schedule issues every kernel, and a
GPU op that reads what a host op wrote (an H2D of a staging tile a CAST fills, a D2H into a ring
tile an OPT still reads) may not be enqueued before that host op finished: a CUDA stream can wait
on a CUDA event, not on a host thread. Issuing strictly in list order therefore blocks the thread
on such a host op while the other streams starve (the backward's BWD, D2H, OPT, CAST chain ran one
op after another). Here the thread never waits on a host op while it has anything else to issue.

Method. Ops are offered in the schedule's list order (``add``). An op is *ready* when each of its
host dependencies is done, each of its GPU dependencies was issued (its event exists, so a
stream can wait on it) and each of its fences (``Schedule.issue_after``: ops that must have
finished on the device, so the caching allocator can reuse what they read) is done.
``next(done)`` returns the op to issue now: the ready head of a per-stream pending queue with the
smallest index, else the next offered op if it is ready and its stream has nothing pending, else
None (an offered op that is not ready joins its stream's pending queue, which keeps every stream's
own order the list order). Host-stream ops are always ready: their
worker thread does the waiting. A caller that gets None with ops still pending waits for a host op
to finish, then asks again.

The CUDA backend calls ``next`` with ``done`` reading the host ops' completion flags and querying
the fences' CUDA events; the simulator calls it with ``done`` comparing simulated end times against
the issuing thread's clock (:func:`megatrain.planner.simulate.simulate`). A caller with nothing
ready waits for a host op or for a fence (``waiting_on``).

Launch counts. :class:`DispatchCounter` counts the aten ops a piece of eager PyTorch dispatches
(each is one kernel launch on a GPU, and costs the issuing thread ``hw.launch_overhead_s``); the
tracer counts a layer's forward and its local backward with it on meta tensors.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Hashable, Iterable

from torch.utils._python_dispatch import TorchDispatchMode

from megatrain.ir.schedule import HOST_STREAMS, Stream


class IssueQueue:
    """The issuing thread's pending work; see the module docstring. Op ids are any hashables
    offered in list order (the schedule index in practice); dependencies are ids offered before."""

    def __init__(self) -> None:
        self._stream: dict[Hashable, Stream] = {}
        self._deps: dict[Hashable, tuple[Hashable, ...]] = {}
        self._after: dict[Hashable, tuple[Hashable, ...]] = {}
        self._issued: set[Hashable] = set()
        self._offered: deque[Hashable] = deque()
        self._pending: dict[Stream, deque[Hashable]] = {}
        self._waiting = 0  # ops in the pending queues
        self._order: dict[Hashable, int] = {}

    def add(self, op: Hashable, stream: Stream, deps: Iterable[Hashable], after: Iterable[Hashable] = ()) -> None:
        """Offer ``op`` (the next op in list order) on ``stream``, after ``deps``; with ``after``, also
        after those ops have finished (its fences, GPU ops offered before it).

        Raises:
            ValueError: ``op`` was offered before, or a dependency or fence was never offered.
        """
        if op in self._stream:
            raise ValueError(f"op {op!r} was offered twice to the issue queue; offer each op of a run once")
        deps, after = tuple(deps), tuple(after)
        for d in deps + after:
            if d not in self._stream:
                raise ValueError(f"op {op!r} depends on {d!r}, which was not offered before it: offer ops in "
                                 "a topological (list) order")
        self._order[op] = len(self._order)
        self._stream[op], self._deps[op] = stream, deps
        if after:
            self._after[op] = after
        self._offered.append(op)

    def pending(self) -> bool:
        """Ops offered but not yet issued."""
        return bool(self._offered) or self._waiting > 0

    def pending_ops(self) -> list[Hashable]:
        """The offered ops not yet issued, in list order."""
        ops = [op for q in self._pending.values() for op in q] + list(self._offered)
        return sorted(ops, key=self._order.__getitem__)

    def issued(self, op: Hashable) -> bool:
        return op in self._issued

    def _ready(self, op: Hashable, done: Callable[[Hashable], bool]) -> bool:
        if self._stream[op] in HOST_STREAMS:
            return True
        for d in self._deps[op]:
            if (not done(d)) if self._stream[d] in HOST_STREAMS else (d not in self._issued):
                return False
        return all(a in self._issued and done(a) for a in self._after.get(op, ()))

    def waiting_on(self, done: Callable[[Hashable], bool]) -> list[Hashable]:
        """The fences of the pending queues' heads that are issued and not yet done: what a caller
        with nothing ready can wait for on the device (besides host ops)."""
        return [a for q in self._pending.values() if q for a in self._after.get(q[0], ())
                if a in self._issued and not done(a)]

    def next(self, done: Callable[[Hashable], bool]) -> Hashable | None:
        """The op to issue now (marked issued), or None when no offered op is ready.

        ``done(h)``: whether op ``h`` has finished: a host op (a failed one counts as finished; the
        caller raises its error when it issues the op that depended on it), or a GPU op named as a
        fence.
        """
        best = None
        if self._waiting:  # the issuing thread's common case, nothing pending, skips the scan
            for q in self._pending.values():
                if q and self._ready(q[0], done) and (best is None or self._order[q[0]] < self._order[best]):
                    best = q[0]
        if best is not None:
            self._pending[self._stream[best]].popleft()
            self._waiting -= 1
            self._issued.add(best)
            return best
        while self._offered:
            op = self._offered.popleft()
            q = self._pending.setdefault(self._stream[op], deque())
            if not q and self._ready(op, done):
                self._issued.add(op)
                return op
            q.append(op)
            self._waiting += 1
        return None


class DispatchCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside the ``with`` block (``count``), views included: on a
    GPU each is one call the issuing thread makes (a kernel launch, or a metadata op of similar
    Python and dispatcher cost)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_launches(gm, args, grad_args) -> tuple[int, int]:
    """(aten ops of one forward, aten ops of one local backward: recompute plus backward) of a layer
    template called with ``args`` (tensors of any device, meta included; ``grad_args[k]``: argument
    ``k`` is differentiated): what the issuing thread dispatches per FWD and per BWD op.

    Counted on meta tensors (no memory, any size). Meta has no fused attention kernel, so
    ``scaled_dot_product_attention`` is counted as its math decomposition: an upper estimate, e.g.
    100 ops for a tiny Llama block's forward against 70 on CPU tensors. (Fake CPU tensors would
    pick the fused kernel but count the fake mode's own meta kernels: 114.)"""
    import torch

    from megatrain.ir.devices import retarget

    fn = retarget(gm, torch.device("meta"))
    metas = [torch.empty(a.shape, dtype=a.dtype, device="meta") for a in args]
    with DispatchCounter() as fc, torch.no_grad():
        fn(*metas)
    leaves = [m.requires_grad_(g) if g else m for m, g in zip(metas, grad_args)]
    with DispatchCounter() as bc, torch.enable_grad():
        outs = [o for o in fn(*leaves) if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [m for m, g in zip(leaves, grad_args) if g]
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
    return fc.count, bc.count


__all__ = ["IssueQueue", "DispatchCounter", "count_launches"]
