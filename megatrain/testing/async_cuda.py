"""An asynchronous fake CUDA layer: the CUDA backend's streams as CPU worker threads.

:class:`megatrain.testing.FakeCuda` runs every op at once on the issuing thread, so it checks
the backend's bookkeeping but can never show a race: work on one stream is always done before
work issued later on another. :class:`AsyncFakeCuda` behaves like a GPU instead:

- each stream is a worker thread that runs its queue in order: ``run`` enqueues an op's work,
  ``record`` enqueues an event marker, ``wait_event`` enqueues a wait; nothing runs on the caller;
- an event is a real cross-thread signal (``threading.Event``), set when the stream's worker
  reaches its marker, so a stream that waits on it, or a thread that synchronises on it, waits
  for the work recorded before it on another thread;
- every op's work, GPU or host (``host_run``), starts after a random delay drawn from a seeded
  generator (``max_delay_s``), or after ``delay(label)`` seconds when a delay function is given,
  so a missing dependency lets a consumer run before its producer, and a test sees it;
- device and pinned memory is filled with NaN (integers with their maximum), so a read of memory
  no op wrote yet poisons the result instead of reading a lucky zero;
- a thread that synchronises on an event waits as CUDA makes it wait: asleep for an event made
  with ``blocking=True`` (``cudaEventBlockingSync``), else spinning on the event's flag, as CUDA's
  default scheduling spins a core, so a test can see a waiting thread's CPU time.

A run with a dependency missing then ends in a wrong result or an error; a correct schedule gives
bitwise the results of the CPU backend whatever the delays (tests/test_race_detector.py).

Errors. The first exception a stream's work raises is kept; that stream skips the work queued
after it (still passing its event markers, so no other thread waits forever) and ``synchronize``
raises :class:`AsyncFakeCudaError` from it.

Timing: an event's time is the ``time.perf_counter`` value when its marker ran, so the backend's
measured timelines work unchanged (the replay tool in :mod:`megatrain.testing.replay` uses them).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import queue
import random
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

_STOP = object()
_LIVE: "weakref.WeakSet[AsyncFakeCuda]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    # Stop idle daemon workers while the interpreter is intact (see cuda._stop_workers).
    for fake in list(_LIVE):
        fake.close()


class AsyncFakeCudaError(RuntimeError):
    """Work on a fake stream raised; ``__cause__`` is its exception."""


@dataclass(eq=False)
class AsyncEvent:
    id: int
    timing: bool
    blocking: bool = False
    stream: "AsyncStream | None" = None  # where it was recorded (at the record call)
    time_s: float = 0.0
    fired: threading.Event = field(default_factory=threading.Event)

    @property
    def recorded(self) -> bool:
        return self.stream is not None


class AsyncStream:
    """One in-order queue with its own worker thread."""

    def __init__(self, owner: "AsyncFakeCuda", name: str, seed: int):
        self.name = name
        self._owner = owner
        self._rng = random.Random(seed)
        self._queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        # Items put and items done: the stream has passed everything enqueued before a moment once
        # ``done`` reaches what ``enqueued`` was then (megatrain.testing.allocator reads them).
        self.enqueued = 0
        self.done = 0
        self.thread = threading.Thread(target=self._loop, name=f"fake-{name}", daemon=True)
        self.thread.start()

    def put(self, item: tuple) -> None:
        self.enqueued += 1  # only the issuing thread puts
        self._queue.put(item)

    def join(self) -> None:
        self._queue.join()

    def stop(self) -> None:
        self._queue.put(_STOP)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                what = item[0]
                if what == "record":
                    ev = item[1]
                    ev.time_s = time.perf_counter()
                    ev.fired.set()
                elif what == "wait":
                    item[1].fired.wait()
                elif self.error is None:  # "run": skipped after an error on this stream
                    _, fn, label = item
                    self._owner._sleep(label, self._rng)
                    with self._owner._on(self):
                        fn()
            except BaseException as e:  # noqa: BLE001 - kept and raised by synchronize()
                if self.error is None:
                    self.error = e
            finally:
                if item is not _STOP:
                    self.done += 1
                self._queue.task_done()


class AsyncFakeCuda:
    """A CPU stand-in for :class:`megatrain.runtime.cuda.TorchCuda` whose streams run asynchronously.

    Args:
        seed: seeds the random delays (each stream and the host workers draw from their own
            generator, seeded from it).
        max_delay_s: the random delay before each op's work is uniform in ``[0, max_delay_s)``.
        delay: ``delay(label) -> seconds`` replaces the random delay (labels are the schedule ops'
            reprs, as the executor passes them): a race test slows one producer down on purpose.

    Nothing starts at construction; a stream's thread starts when the backend creates the stream.
    Call ``close()`` (or let ``atexit`` do it) to stop the threads.
    """

    device = torch.device("cpu")

    def __init__(self, seed: int = 0, max_delay_s: float = 1e-3, delay: Callable[[str], float] | None = None):
        self.seed = seed
        self.max_delay_s = max_delay_s
        self.delay = delay
        self.streams: list[AsyncStream] = []
        self.default = AsyncStream.__new__(AsyncStream)  # the caller's stream: work on it is done at once
        self.default.name = "default"
        self._ids = itertools.count()
        self._local = threading.local()
        self._host_rng = random.Random(f"{seed}-host")
        self._host_lock = threading.Lock()
        _LIVE.add(self)

    # -- delays ------------------------------------------------------------------------------------
    def _sleep(self, label: str, rng: random.Random) -> None:
        s = self.delay(label) if self.delay is not None else rng.random() * self.max_delay_s
        if s > 0:
            time.sleep(s)

    @contextlib.contextmanager
    def _on(self, stream: AsyncStream) -> Iterator[None]:
        prev = getattr(self._local, "current", None)
        self._local.current = stream
        try:
            yield
        finally:
            self._local.current = prev

    # -- the CudaApi -------------------------------------------------------------------------------
    def stream(self) -> AsyncStream:
        s = AsyncStream(self, f"stream{len(self.streams)}", hash((self.seed, len(self.streams))))
        self.streams.append(s)
        return s

    def current_stream(self) -> AsyncStream:
        return getattr(self._local, "current", None) or self.default

    @contextlib.contextmanager
    def use_stream(self, stream: AsyncStream) -> Iterator[AsyncStream]:
        raise AsyncFakeCudaError("AsyncFakeCuda runs work only through run(stream, fn, label): a block of "
                                 "work under use_stream would run on the calling thread, out of stream order")
        yield stream  # pragma: no cover

    def run(self, stream: AsyncStream, fn: Callable[[], Any], label: str) -> None:
        stream.put(("run", fn, label))

    def host_run(self, fn: Callable[[], Any], label: str) -> None:
        with self._host_lock:  # the host workers share one generator
            rng = random.Random(self._host_rng.random())
        self._sleep(label, rng)
        fn()

    def record_stream(self, t: torch.Tensor) -> None:
        pass  # no caching allocator here

    def event(self, timing: bool, blocking: bool = False) -> AsyncEvent:
        return AsyncEvent(next(self._ids), timing, blocking)

    def record(self, event: AsyncEvent, stream: AsyncStream) -> None:
        event.stream = stream
        if stream is self.default:  # the caller's work so far ran synchronously
            event.time_s = time.perf_counter()
            event.fired.set()
        else:
            stream.put(("record", event))

    def wait_event(self, stream: AsyncStream, event: AsyncEvent) -> None:
        if not isinstance(event, AsyncEvent) or not event.recorded:
            raise AsyncFakeCudaError(f"stream {stream.name} was asked to wait on {event!r}, which is not a "
                                     "recorded event: on a GPU the wait would return at once (a race)")
        if event.stream is stream:
            raise AsyncFakeCudaError(f"stream {stream.name} waits on its own event {event.id}: an in-order "
                                     "stream never needs that")
        stream.put(("wait", event))

    def event_synchronize(self, event: AsyncEvent) -> None:
        if not event.recorded:
            raise AsyncFakeCudaError(f"synchronising on event {event.id}, which was never recorded")
        if event.blocking:
            event.fired.wait()
            return
        while not event.fired.is_set():  # CUDA's default wait: the thread spins on a core
            pass

    def event_query(self, event: AsyncEvent) -> bool:
        if not event.recorded:
            raise AsyncFakeCudaError(f"querying event {event.id}, which was never recorded")
        return event.fired.is_set()

    def elapsed_s(self, start: AsyncEvent, end: AsyncEvent) -> float:
        if not (start.timing and end.timing and start.fired.is_set() and end.fired.is_set()):
            raise AsyncFakeCudaError(f"elapsed time between events {start.id} and {end.id} needs both "
                                     "recorded with timing=True and complete")
        return end.time_s - start.time_s

    def host_time(self, event: AsyncEvent) -> float:
        self.event_synchronize(event)
        return event.time_s

    def synchronize(self) -> None:
        """Wait for every stream; raise the first error a stream's work raised since the last call."""
        for s in self.streams:
            s.join()
        for s in self.streams:
            if s.error is not None:
                e, s.error = s.error, None
                raise AsyncFakeCudaError(f"work on fake {s.name} raised {type(e).__name__}: {e}") from e

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return _poisoned(shape, dtype)

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return _poisoned(shape, dtype)

    def host_register(self, t: torch.Tensor) -> Any:
        """Page-lock ``t`` in place: on CPU nothing to lock; checked as ``TorchCuda`` checks it (page
        alignment, whole pages), and the handle keeps the memory alive as the real one does."""
        from megatrain.runtime.cuda import Pin, check_pinnable

        check_pinnable(t)
        return Pin(t.numel() * t.element_size(), lambda: None, t)

    def close(self) -> None:
        """Stop the stream threads (after the work queued on them)."""
        for s in self.streams:
            s.stop()
        for s in self.streams:
            s.thread.join(timeout=10)
        self.streams = []


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype)
    if dtype is torch.bool:
        return torch.ones(shape, dtype=dtype)  # True: "finite", the flag a missed write leaves wrong
    return torch.full(shape, torch.iinfo(dtype).max, dtype=dtype)


__all__ = ["AsyncFakeCuda", "AsyncFakeCudaError", "AsyncEvent", "AsyncStream"]
