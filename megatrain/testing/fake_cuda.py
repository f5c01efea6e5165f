"""A synchronous fake CUDA for CPU tests: the CUDA backend's stream, event and pinning logic checked
on CPU tensors.

:class:`FakeCuda` implements :class:`megatrain.runtime.cuda.CudaApi`: its streams run work at once
on the issuing thread and its events keep the bookkeeping (which stream waited on which event, that
every event waited on was recorded first, that no stream waits on its own events, and that host
dependencies never reach ``wait_event``, and that no thread synchronises on an event made without
``blocking=True``, which on a GPU would spin a core), so misuse that would be a race, a wasted
wait or a busy wait on a GPU raises :class:`FakeCudaError` at once. For races that need real concurrency see
:class:`megatrain.testing.AsyncFakeCuda`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from megatrain.runtime.cuda import check_pinnable, Pin
from megatrain.testing.fake_graph import FakeGraph


class FakeCudaError(AssertionError):
    """The backend used the (fake) CUDA API in a way that would be a bug, or a wasted wait, on a GPU."""


@dataclass(eq=False)
class FakeStream:
    name: str
    recorded: int = 0  # events recorded on it so far


@dataclass(eq=False)
class FakeEvent:
    id: int
    timing: bool
    blocking: bool = False  # cudaEventBlockingSync: a thread synchronising on it sleeps instead of spinning
    stream: FakeStream | None = None  # where it was recorded
    seq: int = 0  # its position among the events recorded on that stream (1-based)
    time_s: float = 0.0

    @property
    def recorded(self) -> bool:
        return self.stream is not None


class FakeCuda:
    """A CPU stand-in for :class:`TorchCuda`: work runs at once on CPU tensors, bookkeeping is kept.

    Streams and events are plain records. ``log`` lists every call in order as tuples:
    ``("record", stream, event)``, ``("wait", stream, event)``, ``("run", stream)`` when work is
    issued on a stream, ``("event_sync", event, thread name)``, ``("sync",)``. Misuse that would be
    a bug on a GPU raises :class:`FakeCudaError` at once: waiting on (or synchronising, or timing)
    an event never recorded — on a GPU ``cudaStreamWaitEvent`` on such an event returns at once, a
    silent race —, a stream waiting on its own event, which an in-order stream never needs, and a
    thread synchronising on an event made without ``blocking=True``, which with CUDA's default
    scheduling spins that thread on a core until the GPU gets there.
    ``strict=False`` keeps the log but raises nothing.
    """

    device = torch.device("cpu")

    def __init__(self, strict: bool = True):
        self.strict = strict
        self.log: list[tuple] = []
        self.empty_calls: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.pinned_calls: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.registered: dict[int, int] = {}  # live host_register regions: address -> bytes
        self.pin_log: list[tuple] = []  # ("register", address, bytes), ("unregister", address)
        self.default = FakeStream("default")
        self.streams: list[FakeStream] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._local = threading.local()

    def _log(self, *entry) -> None:
        with self._lock:
            self.log.append(entry)

    def _fail(self, msg: str) -> None:
        if self.strict:
            raise FakeCudaError(msg)

    def stream(self) -> FakeStream:
        s = FakeStream(f"stream{len(self.streams)}")
        self.streams.append(s)
        return s

    def current_stream(self) -> FakeStream:
        return getattr(self._local, "current", self.default)

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        prev = self.current_stream()
        self._local.current = stream
        self._log("run", stream)
        try:
            yield stream
        finally:
            self._local.current = prev

    def run(self, stream: FakeStream, fn: Callable[[], Any], label: str) -> None:
        with self.use_stream(stream):
            fn()

    def host_run(self, fn: Callable[[], Any], label: str) -> None:
        fn()

    def record_stream(self, t: torch.Tensor) -> None:
        pass  # no caching allocator here

    def event(self, timing: bool, blocking: bool = False) -> FakeEvent:
        return FakeEvent(next(self._ids), timing, blocking)

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        with self._lock:
            stream.recorded += 1
            event.stream, event.seq, event.time_s = stream, stream.recorded, time.perf_counter()
            self.log.append(("record", stream, event))

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        if not isinstance(event, FakeEvent):
            self._fail(f"stream {stream.name} was asked to wait on {event!r}, which is not an event "
                       "(a host op's handle must be waited on by the issuing thread)")
        elif not event.recorded:
            self._fail(f"stream {stream.name} waits on event {event.id}, which was never recorded")
        elif event.stream is stream:
            self._fail(f"stream {stream.name} waits on its own event {event.id}: an in-order stream "
                       "never needs that")
        self._log("wait", stream, event)

    def event_synchronize(self, event: FakeEvent) -> None:
        if not event.recorded:
            self._fail(f"synchronising on event {event.id}, which was never recorded")
        elif not event.blocking:
            self._fail(f"thread {threading.current_thread().name!r} synchronises on event {event.id}, made without "
                       "blocking=True: with CUDA's default scheduling the thread would spin a core until the GPU "
                       "reaches the event; make events that a thread waits on with blocking=True")
        self._log("event_sync", event, threading.current_thread().name)

    def event_query(self, event: FakeEvent) -> bool:
        """Complete once recorded: work here runs at once."""
        if not event.recorded:
            self._fail(f"querying event {event.id}, which was never recorded")
        return event.recorded

    def elapsed_s(self, start: FakeEvent, end: FakeEvent) -> float:
        if not (start.timing and end.timing and start.recorded and end.recorded):
            self._fail(f"elapsed time between events {start.id} and {end.id} needs both recorded with "
                       "timing=True")
        return end.time_s - start.time_s

    def host_time(self, event: FakeEvent) -> float:
        self.event_synchronize(event)
        return event.time_s  # fake work is done when issued, so the event's time is its host time

    def synchronize(self) -> None:
        self._log("sync")

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.empty_calls.append((tuple(shape), dtype))
        return torch.empty(shape, dtype=dtype)

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.pinned_calls.append((tuple(shape), dtype))
        return torch.empty(shape, dtype=dtype)

    def host_register(self, t: torch.Tensor) -> Pin:
        """Logs ``("register", address, bytes)`` in ``pin_log``; raises what ``TorchCuda`` would (and a region that
        overlaps one still registered, which ``cudaHostRegister`` refuses)."""
        check_pinnable(t)
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        with self._lock:
            for p, n in self.registered.items():
                if p < ptr + nbytes and ptr < p + n:
                    self._fail(f"host_register of {nbytes} bytes at {ptr:#x} overlaps the region of {n} bytes at "
                               f"{p:#x} still registered")
            self.registered[ptr] = nbytes
            self.pin_log.append(("register", ptr, nbytes))
        return Pin(nbytes, lambda: self._unregister(ptr), t)

    # -- CUDA graphs (megatrain.testing.fake_graph) ------------------------------------------------
    def graph_pool(self) -> object:
        return object()

    def capture(self, stream: FakeStream, fn: Callable[[], Any], pool: Any,
                static: Sequence[torch.Tensor]) -> tuple[FakeGraph, Any]:
        """Records ``fn``'s aten ops (:class:`~megatrain.testing.fake_graph.FakeGraph`); logs
        ``("capture", stream)``. Raises FakeCudaError for a read of a tensor that is neither made in
        the capture nor in ``static`` (a forgotten copy-in), or a host read of a device value."""
        self._log("capture", stream)
        with self.use_stream(stream):
            return FakeGraph.capture(fn, static, FakeCudaError)

    def replay(self, graph: FakeGraph) -> None:
        """Runs the recorded ops again; logs ``("replay", current stream)``."""
        self._log("replay", self.current_stream())
        graph.replay()

    def _unregister(self, ptr: int) -> None:
        with self._lock:
            self.registered.pop(ptr)
            self.pin_log.append(("unregister", ptr))

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked now: live ``host_register`` regions plus every ``pinned_empty``."""
        return sum(self.registered.values()) + sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in self.pinned_calls)


__all__ = ["FakeCuda", "FakeCudaError", "FakeEvent", "FakeStream"]
