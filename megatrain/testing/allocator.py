"""Device memory as the CUDA caching allocator holds it, on the asynchronous fake CUDA layer.

On a GPU an op's Python runs on the issuing thread when the op is issued, possibly long before the
device runs it: its tensors are allocated from the caching allocator then, and a tensor the issuing
thread drops is freed then. The allocator reuses a freed block at once for later work on the
stream that made it, but a block other streams used (``Tensor.record_stream``) only once each of
those streams has passed the point where it was freed (PyTorch ``c10/cuda/CUDACachingAllocator.cpp``:
``insert_events`` records an event on each such stream at the free, ``process_events`` returns the
block to its pool when they have completed, checked at every allocation). Memory the allocator
holds is therefore what is live plus what was freed but is still waiting for another stream.

:class:`IssueTimeFakeCuda` runs the CUDA backend that way on a CPU: an op's work runs on the issuing
thread inside ``run`` (in issue order, a topological order of the schedule, so values are those of
the synchronous :class:`~megatrain.testing.FakeCuda`), while each stream's thread of
:class:`~megatrain.testing.AsyncFakeCuda` only waits out the op's delay (``delay(label)``, the
device's time for it), its events and its cross-stream waits, so the device lags the issuing thread
as a GPU does. :class:`CachingAllocatorModel` follows every tensor storage the work makes (a
``TorchDispatchMode`` while it runs), the streams it is used on (``record_stream`` through the
adapter) and when it is freed (a finalizer on the storage), and reports, per pool (the stream whose
work made a block, the only stream the allocator hands it to again), the peak of the bytes the
allocator could not hand out again: ``peak_held`` (live plus freed but waiting for another stream)
over the tensors that outlive the op that made them, checkpoints and boundary gradients, sampled
after each op's allocations and before its frees, the moment the cost model's activation peak
describes (:func:`megatrain.planner.cost.activation_liveness`,
:func:`~megatrain.planner.cost.pool_peaks`). Working memory that an op frees before it returns is
not counted (its bound, ``Layer.work_bytes``, is measured elsewhere).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatrain.testing.async_cuda import AsyncFakeCuda, AsyncStream


@dataclass(eq=False)
class _Block:
    nbytes: int
    stream: AsyncStream  # the stream whose work made it: its pool
    uses: set = field(default_factory=set)  # other streams it was used on (record_stream)
    waits: dict = field(default_factory=dict)  # once freed: stream -> items it must have done
    freed: bool = False


class CachingAllocatorModel:
    """Bytes the CUDA caching allocator holds, per pool (the stream whose work made a block: the
    allocator hands a freed block only to later allocations on that stream), for tensors that outlive
    the op that made them; see the module docstring. ``held(stream)`` is the current figure,
    ``peak_held[stream]`` its largest sample."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, _Block] = {}  # by storage address
        self._waiting: list[_Block] = []  # freed, until their streams pass the free
        self._new: list[_Block] = []  # made by the op now running
        self.peak_held: dict[AsyncStream, int] = {}

    def made(self, storage: torch.UntypedStorage, stream: AsyncStream) -> None:
        """A new storage, made by work on ``stream``; followed until it is freed."""
        block = _Block(storage.nbytes(), stream)
        with self._lock:
            self._live[storage.data_ptr()] = block
            self._new.append(block)
        weakref.finalize(storage, self._free, storage.data_ptr(), block)

    def use(self, t: torch.Tensor, stream: AsyncStream) -> None:
        """``t`` is read by work on ``stream`` (``Tensor.record_stream``)."""
        block = self._live.get(t.untyped_storage().data_ptr())
        if block is not None and stream is not block.stream:
            block.uses.add(stream)

    def _free(self, ptr: int, block: _Block) -> None:
        with self._lock:
            block.freed = True
            if self._live.get(ptr) is block:
                del self._live[ptr]
            if block.uses:  # the allocator's events at the free: each stream's work enqueued so far
                block.waits = {s: s.enqueued for s in block.uses}
                self._waiting.append(block)

    def held(self, stream: AsyncStream) -> int:
        """Bytes of ``stream``'s pool live, or freed but not yet reusable, after returning every block
        whose streams have passed their frees (as the allocator does before each allocation)."""
        with self._lock:
            self._waiting = [b for b in self._waiting if any(s.done < n for s, n in b.waits.items())]
            return sum(b.nbytes for b in (*self._live.values(), *self._waiting) if b.stream is stream)

    @contextlib.contextmanager
    def op(self, stream: AsyncStream) -> Iterator[None]:
        """Follow the storages the work inside makes on ``stream``. The sample is what ``stream``'s
        pool held when the op started plus what the op made and kept: the moment after its
        allocations and before its frees (working memory it made and freed again is not counted)."""
        before = self.held(stream)
        self._new = []
        with _Allocations(self, stream):
            yield
        with self._lock:
            kept = sum(b.nbytes for b in self._new if not b.freed)
            self._new = []
        self.peak_held[stream] = max(self.peak_held.get(stream, 0), before + kept)


class _Allocations(TorchDispatchMode):
    """Hands every storage an aten op creates on this thread to the model: an output whose storage is
    none of the inputs' (a view or an in-place result shares one)."""

    def __init__(self, model: CachingAllocatorModel, stream: AsyncStream):
        super().__init__()
        self.model, self.stream = model, stream

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    self.model.made(t.untyped_storage(), self.stream)
        return out


class IssueTimeFakeCuda(AsyncFakeCuda):
    """:class:`AsyncFakeCuda` whose op work runs on the issuing thread at ``run``, as an op's Python
    does on a GPU, while its streams only wait out each op's delay; ``memory`` follows what the
    caching allocator holds (:class:`CachingAllocatorModel`). See the module docstring.

    The device starts a run only once something waits for it (an event query or synchronisation,
    by the issuing thread or a host worker, or ``synchronize``), so the issuing thread gets as far
    ahead as the schedule lets it: what a GPU much slower than the issuing thread shows, made
    deterministic.

    Args:
        delay: ``delay(label) -> seconds`` the device spends on the op (``label``: the op's repr,
            as the executor passes it); host ops run at once on their worker.
    """

    def __init__(self, delay: Callable[[str], float] = lambda label: 0.0):
        super().__init__(max_delay_s=0.0, delay=delay)
        self.memory = CachingAllocatorModel()
        self._go = threading.Event()

    def run(self, stream: AsyncStream, fn: Callable[[], Any], label: str) -> None:
        with self._on(stream), self.memory.op(stream):
            fn()
        super().run(stream, _nothing, label)  # the device's time for it

    def host_run(self, fn: Callable[[], Any], label: str) -> None:
        fn()

    def record_stream(self, t: torch.Tensor) -> None:
        self.memory.use(t, self.current_stream())

    def _sleep(self, label: str, rng: Any) -> None:
        self._go.wait()
        super()._sleep(label, rng)

    def event_query(self, event: Any) -> bool:
        self._go.set()
        return super().event_query(event)

    def event_synchronize(self, event: Any) -> None:
        self._go.set()
        super().event_synchronize(event)

    def synchronize(self) -> None:
        self._go.set()
        try:
            super().synchronize()
        finally:
            self._go.clear()  # the next run starts held again


def _nothing() -> None:
    pass


__all__ = ["CachingAllocatorModel", "IssueTimeFakeCuda"]
