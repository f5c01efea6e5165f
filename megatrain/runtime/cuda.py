"""The CUDA backend: a schedule's streams as CUDA streams, its cross-stream edges as CUDA events,
and the host streams as worker threads.

Streams. ``Stream.COMPUTE``, ``Stream.H2D`` and ``Stream.D2H`` each map to one
``torch.cuda.Stream``, created at the first op launched on it (nothing CUDA happens at import or
construction: STYLE.md item 8). A CUDA stream is an in-order queue, so an op needs no event for a
dependency on its own stream; the backend drops such waits even when asked.

Events. After every op the backend records a ``torch.cuda.Event`` on the op's stream
(``event.record(stream)``); that event is the op's handle. An op on another GPU stream that
depends on it calls ``stream.wait_event(event)`` before its kernels are enqueued, under the
``torch.cuda.stream(stream)`` context, so the wait is on the GPU and the issuing thread runs on.
Each cross-stream dependency the executor passes is waited on exactly once.

The host workers. ``Stream.HOST`` (AdamW, ACC) and ``Stream.CAST`` (the BF16 staging copies)
each run on one thread fed by an in-order queue, so host ops run in schedule order per stream,
overlapped with the GPU and with the issuing thread, and one stream's ops never queue behind
the other's (their work shares the cores: "One host CPU budget" below). A host op that depends
on GPU ops (the D2H copy of its gradients) calls ``event.synchronize()`` *in its worker*; one
that depends on a host op of the other worker waits for it there too. Its handle is a
future-like :class:`HostOp`.

Waiting without spinning. Every op's event is made with ``blocking=True``
(``cudaEventBlockingSync``), so a worker that synchronises on one sleeps until the GPU reaches it.
CUDA's default (``cudaDeviceScheduleAuto``) spins the waiting thread while the process has fewer
active contexts than cores, so each waiting worker would burn a whole core that the host kernels'
thread teams need. A blocked thread wakes some microseconds after the event; host ops last
milliseconds.

One host CPU budget. The host kernels (AdamW, ACC, CAST) are memory-bound, so two of them at once
only share the DRAM bandwidth that one gets alone, while two full-width OpenMP teams plus the
issuing thread oversubscribe the cores. The HOST and CAST workers therefore run their ops' work
one at a time, each with ``host_threads`` intra-op threads (ATen's OpenMP team size is per
thread: ``torch.set_num_threads`` in a worker sets that worker's team, see
:func:`megatrain.runtime.host_kernels.set_thread_team`), under one lock granted in the order the
ops became ready (a worker waits for its dependencies first): what the simulator models, one
``Resource.HOST`` that the two streams' ops take in turn, the earliest ready first
(:func:`megatrain.planner.time.resource_of`).
A CAST so waits for at most the one host op running, never for the optimizer steps queued behind
it. The I/O and COMM workers (NVMe reads, collectives) wait on devices and peers, not on the
cores, and take no part in it.

Issue order (:class:`megatrain.ir.issue.IssueQueue`, shared with the simulator). A CUDA
stream can wait on a CUDA event, not on a host thread, and enqueuing a GPU op before a host op it
depends on finished would let the GPU read a tile the worker still writes (the staging tile an
H2D copies, the gradient tile a D2H overwrites). Such a GPU op, and the ops after it on its stream,
wait in a per-stream pending queue; ``launch`` never blocks on a host op. Every ``launch`` first
issues the pending ops that became ready (lowest schedule index first), and ``synchronize``
issues the rest as their host dependencies finish. An op's ``fn`` may therefore run after later
ops were launched: it must read what it needs when it runs (the executor keys activations by the
op that produced them for this reason).

Run entry. Work the caller enqueued on its current stream before a run's first launch (the
executor's non-blocking copies of the batch to the GPU) must finish before the run's ops read it:
the first op on each GPU stream in a run waits on one event recorded on the caller's stream at the
run's first launch.

Memory. ``host_pin`` page-locks host memory the caller allocated (page-aligned, whole pages) in
place with ``cudaHostRegister``, exactly its bytes, and unlocks it when the returned handle is
dropped: the executor pins each FP32 master row and one arena of transient host tiles this way
(:mod:`megatrain.runtime.host`). ``host_empty`` (``torch.empty(..., pin_memory=True)``) is kept
for small scratch buffers; its caching host allocator rounds every block up to a power of two,
so nothing a plan sizes goes through it. ``device_empty``
allocates the persistent slots once on the device. Tensors an op allocates inside ``fn`` belong to
its stream in the caching allocator, which hands them out when the op is *issued*; the executor
frees activations on the issuing thread while the GPU may still read them, which is safe because
the allocator reuses a block only for later work on the same stream, and a block read on another
stream (``Tensor.record_stream``: a checkpoint an OFFLOAD copies out, one a RELOAD brought in) only
once that stream has passed the free. So that the allocator finds such blocks free where the cost
model frees them, an op waits in its pending queue until its issue fences (``after``, the
schedule's ``issue_after``: :func:`megatrain.planner.activations.issue_fences`) have finished on the
device; this bounds how far the issuing thread runs ahead of the device exactly where memory
needs it.

Errors. An exception in a host op is kept by its worker; the worker skips the host ops queued
after it (their inputs may depend on the failed update), and ``synchronize()`` drains everything
and raises :class:`HostOpError` naming the op, chained to the original exception. A GPU op whose
host dependency failed raises the same error when it is issued. Any exception from ``launch`` or
``synchronize`` first aborts the run: pending ops are dropped, everything issued is drained, and
the next launch opens a new run with a fresh entry fence; ``abort()`` does the same for a caller
that failed between launches (the executor calls it). ``close()`` stops the workers; an
``atexit`` hook stops and joins any worker still alive when the interpreter exits.

Timing (``record``). Each GPU op is bracketed by two ``torch.cuda.Event(enable_timing=True)``
(start recorded before its kernels, end after); host ops are timed with ``time.perf_counter`` in
the worker. The two clocks meet at the run's entry event: it is synchronized once (the streams
are idle then, since the previous run ended with ``synchronize()``) and the host time read just
after it is its time. ``Event.elapsed_time`` turns the GPU events into seconds after the entry.
A GPU op's bracket starts when the stream reaches its start marker, which on an idle stream is
as soon as it is recorded, so it spans the op's issue as well as its kernels: a GPU that waits
for the issuing thread (Python, launches, the GIL a host op holds) looks busy. So the backend also
records, per GPU op, when the issuing thread began and ended issuing it (host clock) and its CPU
seconds meanwhile: after the issue ended the op's whole work is queued and the GPU is busy with it
until the end marker; before, it may have waited (``megatrain.planner.timeline.Timeline``'s
``gpu_busy_s``, ``issue_bound_s``, ``issue_busy_s`` and ``issue_blocked_s``).

The adapter. Every CUDA call goes through one small object (:class:`TorchCuda`; an op's work is
enqueued with ``run(stream, fn, label)``, a host op's run with ``host_run(fn, label)``), so tests
run the same backend logic on CPU tensors with :class:`megatrain.testing.FakeCuda`, or with
:class:`megatrain.testing.AsyncFakeCuda` (streams as threads, random delays: races show). FakeCuda's
streams run work at once and its events keep the bookkeeping: which stream waited on which event,
that every event waited on was recorded first, that no stream waits on its own events, and that
host dependencies never reach ``wait_event``.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Protocol, Sequence

import torch

from megatrain.errors import MegatrainError
from megatrain.ir.issue import IssueQueue
from megatrain.ir.schedule import HOST_STREAMS, Stream
from megatrain.runtime.host_kernels import set_thread_team
from megatrain.runtime.recording import OpTiming, Recording

GPU_STREAMS = (Stream.COMPUTE, Stream.H2D, Stream.D2H)

FENCE_POLL_S = 100e-6
"""Seconds between polls of an unfinished issue fence while ``synchronize`` has nothing else to
issue: a CUDA event completing notifies no thread, so the blocked pump queries it (a host op
finishing wakes it at once)."""


class HostOpError(MegatrainError, RuntimeError):
    """An op on the host stream raised; the message names the op, ``__cause__`` is its exception."""


# -- the adapter ------------------------------------------------------------------------------------

class CudaApi(Protocol):
    """The CUDA calls the backend makes, in one place so that a fake can stand in on CPU."""

    device: torch.device

    def stream(self) -> Any:
        """A new stream."""

    def current_stream(self) -> Any:
        """The calling thread's current stream."""

    def use_stream(self, stream: Any) -> ContextManager[Any]:
        """Make ``stream`` current for the work enqueued inside the ``with`` block."""

    def run(self, stream: Any, fn: Callable[[], Any], label: str) -> None:
        """Enqueue ``fn``'s work on ``stream`` (``label`` names the op, for fakes that delay or log)."""

    def host_run(self, fn: Callable[[], Any], label: str) -> None:
        """Run host op ``fn`` on the calling (worker) thread. ``fn`` takes the host's shared cores
        (the lock HOST and CAST work under) itself: a delay injected before calling it is a late
        start, during which the other host stream runs."""

    def record_stream(self, t: torch.Tensor) -> None:
        """Mark device tensor ``t`` as used by the work enqueued on the calling thread's current stream
        (``Tensor.record_stream``): the caching allocator then reuses its block only after that
        work, even if ``t`` is freed before."""

    def event(self, timing: bool, blocking: bool = False) -> Any:
        """A new event; ``timing`` makes it usable with ``elapsed_s``; ``blocking``
        (``cudaEventBlockingSync``) makes ``event_synchronize`` put the calling thread to sleep
        until the event completes, where CUDA's default spins on a core."""

    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream`` (it completes when the stream's work before it has)."""

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream``'s later work wait for ``event`` (on the GPU, not the calling thread)."""

    def event_synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event`` completed (spinning unless it was made ``blocking``)."""

    def event_query(self, event: Any) -> bool:
        """Whether ``event`` completed, without blocking."""

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds from ``start`` to ``end`` (both recorded with timing, both complete)."""

    def host_time(self, event: Any) -> float:
        """Block until ``event`` completed; the ``time.perf_counter`` value that matches it."""

    def synchronize(self) -> None:
        """Block until all work on the device finished."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised device memory."""

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised page-locked host memory."""

    def host_register(self, t: torch.Tensor) -> Any:
        """Page-lock ``t``'s bytes in place (page-aligned, whole pages); the handle unpins when dropped."""

    def graph_pool(self) -> Any:
        """A memory pool CUDA graphs can share (``torch.cuda.graph_pool_handle()``)."""

    def capture(self, stream: Any, fn: Callable[[], Any], pool: Any, static: Sequence[torch.Tensor]) -> tuple[Any, Any]:
        """Capture ``fn``'s device work on ``stream`` into a new CUDA graph whose allocations come from
        ``pool``; returns ``(graph, fn's return value)`` (its tensors are the graph's static outputs).
        ``static``: the tensors made outside the capture that ``fn`` may read (static buffers the caller
        refreshes before each replay, persistent slots); a fake checks it, CUDA cannot."""

    def replay(self, graph: Any) -> None:
        """Launch ``graph`` on the calling thread's current stream."""


class TorchCuda:
    """The real adapter: ``torch.cuda``. Constructing it touches no CUDA state."""

    device = torch.device("cuda")  # a name, not a context: torch.device does not initialise CUDA

    def stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream()

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def use_stream(self, stream: torch.cuda.Stream) -> ContextManager[Any]:
        return torch.cuda.stream(stream)

    def run(self, stream: torch.cuda.Stream, fn: Callable[[], Any], label: str) -> None:
        with torch.cuda.stream(stream):
            fn()

    def host_run(self, fn: Callable[[], Any], label: str) -> None:
        fn()

    def record_stream(self, t: torch.Tensor) -> None:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))

    def event(self, timing: bool, blocking: bool = False) -> torch.cuda.Event:
        # Events without timing are cheaper to record and wait on (cudaEventDisableTiming).
        return torch.cuda.Event(enable_timing=timing, blocking=blocking)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def event_synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def event_query(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def elapsed_s(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds

    def host_time(self, event: torch.cuda.Event) -> float:
        event.synchronize()
        return time.perf_counter()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def host_register(self, t: torch.Tensor) -> "Pin":
        # cudaHostRegister locks exactly these pages; the caching host allocator behind
        # pin_memory=True would round the block up to a power of two.
        check_pinnable(t)
        cudart = torch.cuda.cudart()
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if err != cudart.cudaError.success:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed: "
                               f"{cudart.cudaGetErrorString(err)}; lower the plan's pinned memory or raise the "
                               "locked-memory limit (ulimit -l)")
        return Pin(nbytes, lambda: cudart.cudaHostUnregister(ptr), t)

    def graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, stream: torch.cuda.Stream, fn: Callable[[], Any], pool: Any,
                static: Sequence[torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, Any]:
        # torch.cuda.graph synchronises the device and empties the allocator's cache first; the
        # default generator is registered with the capture, so a replay draws from its state then.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = fn()
        return graph, out

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        graph.replay()


class Pin:
    """A page-locked region: unpinned when this handle is dropped, and the memory kept alive until then."""

    def __init__(self, nbytes: int, release: Callable[[], Any], memory: torch.Tensor):
        self.nbytes = nbytes
        weakref.finalize(self, _release_pin, release, memory)


def _release_pin(release: Callable[[], Any], memory: torch.Tensor) -> None:
    release()
    del memory  # freed (by the caller's reference count) only after the pages are unlocked


def check_pinnable(t: torch.Tensor) -> None:
    from megatrain.ir.layout import HOST_PAGE_BYTES

    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or not t.is_contiguous() or t.data_ptr() % HOST_PAGE_BYTES or nbytes % HOST_PAGE_BYTES:
        raise ValueError(f"cannot pin a {t.device.type} tensor of {nbytes} bytes at {t.data_ptr():#x} "
                         f"(contiguous={t.is_contiguous()}): pinning takes contiguous host memory that starts on a "
                         f"{HOST_PAGE_BYTES}-byte page and is whole pages (megatrain.runtime.pages.page_aligned_empty)")


# -- op handles -------------------------------------------------------------------------------------

@dataclass(eq=False, slots=True)
class GpuOp:
    """Handle of an op launched on a GPU stream. Until it is issued (its host dependencies and fences
    done) it waits in the backend's pending queue; ``event`` is recorded right after its work once it
    is. ``issued`` is set then, or when the run is aborted first (``cancelled``); a host worker that
    waits for it waits on the backend's condition, which the issuing thread notifies only for an op
    a worker was handed a dependency on (``watched``). ``complete``: its event is known to have
    completed (a fence the issuing thread waited for)."""

    index: int
    stream: Stream
    label: str
    event: Any = None
    start: Any = None  # the timing event recorded before its work, when recording
    # When recording: the issuing thread's clock when it began and ended issuing the op, and its CPU
    # seconds meanwhile (time.thread_time): the wall time it was not on a core is GIL or core waits.
    issue_t0: float = 0.0
    issue_t1: float = 0.0
    issue_cpu: float = 0.0
    issued: bool = False
    cancelled: bool = False
    watched: bool = False
    complete: bool = False


@dataclass(eq=False, slots=True)
class HostOp:
    """Future-like handle of an op on a host worker (``stream``: Stream.HOST or Stream.CAST)."""

    index: int
    label: str
    stream: Stream = Stream.HOST
    _done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    skipped_after: "HostOp | GpuOp | None" = None  # not run, because this earlier op failed or never ran
    start_s: float = 0.0
    end_s: float = 0.0

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the op finished; raise HostOpError if it (or a host op before it) failed."""
        self._done.wait()
        if self.error is not None:
            raise _host_error(self) from self.error


def _name(op: GpuOp | HostOp) -> str:
    return repr(op.label) if op.label else f"#{op.index}"


def _host_error(op: HostOp) -> HostOpError:
    e = op.error
    if isinstance(op.skipped_after, GpuOp):
        return HostOpError(f"host op {_name(op)} was not run because the run was aborted before GPU op "
                           f"{_name(op.skipped_after)} it waits for was issued")
    if op.skipped_after is not None:
        return HostOpError(f"host op {_name(op)} was not run because host op {_name(op.skipped_after)} "
                           f"before it raised {type(e).__name__}: {e}")
    return HostOpError(f"host op {_name(op)} (launch #{op.index} of the run) raised {type(e).__name__}: {e}. "
                       "The host stream skipped the host ops queued after it, so this step's host work "
                       "(optimizer updates of later layers) is incomplete: fix the cause, then reload the "
                       "state from a checkpoint before training on")


class _Cancelled(Exception):
    """A host op's GPU dependency was never issued: the run was aborted."""


_STOP = object()
_LIVE_WORKERS: "weakref.WeakSet[_HostWorker]" = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    # Idle daemon workers still alive when the interpreter finalises made the process abort
    # ("terminate called without an active exception", exit status 134) in about half the runs of
    # the test suite; stopping and joining them first, while the interpreter is intact, avoids it.
    workers = list(_LIVE_WORKERS)
    for w in workers:
        w.stop()
    for w in workers:
        w.thread.join(timeout=10)


class _FifoLock:
    """A lock granted in the order threads asked for it. ``threading.Lock`` is not: a worker that
    releases it and asks again at once (its next queued op) usually gets it back before a waiting
    thread wakes, so one stream's queue could keep the other waiting for many ops."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket that holds the lock

    def __enter__(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


class _HostWorker:
    """One thread running one host stream's ops in queue order. Holds no reference to the backend,
    so a backend that is garbage-collected stops its workers (``weakref.finalize`` in CUDABackend).
    ``changed`` is notified after every op, so the issuing thread can wait for any host op.
    ``budget``: the lock the workers that share the host's cores run their ops' work under, and the
    intra-op threads each gets (None: torch's default team), or None for a worker outside it."""

    def __init__(self, cuda: CudaApi, stream: Stream, changed: threading.Condition,
                 budget: "tuple[_FifoLock, int | None] | None" = None):
        self._cuda = cuda
        self._changed = changed
        self._budget = budget
        self._queue: queue.Queue = queue.Queue()
        self._failed: HostOp | None = None  # the first failed op, until reported
        self._thread = threading.Thread(target=self._loop, name=f"megatrain-{stream.value}", daemon=True)
        self._thread.start()
        _LIVE_WORKERS.add(self)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def submit(self, op: HostOp, fn: Callable[[], Any], deps: list[GpuOp | HostOp]) -> None:
        self._queue.put((op, fn, deps))

    def drain(self) -> HostOp | None:
        """Wait until every submitted op finished; return (and forget) the first failed one."""
        self._queue.join()
        failed, self._failed = self._failed, None
        return failed

    def stop(self) -> None:
        self._queue.put(_STOP)

    def _loop(self) -> None:
        if self._budget is not None and self._budget[1] is not None:
            set_thread_team(self._budget[1])
        lock = self._budget[0] if self._budget is not None else contextlib.nullcontext()
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                op, fn, deps = item
                if self._failed is not None:
                    op.error, op.skipped_after = self._failed.error, self._failed
                    continue
                try:
                    for d in deps:
                        if isinstance(d, HostOp):  # on the other host stream (this one is in order)
                            d._done.wait()
                            if d.error is not None:
                                op.error, op.skipped_after = d.error, d
                                break
                        else:
                            if not d.issued:  # a pending GPU op has no event yet
                                with self._changed:
                                    while not d.issued:
                                        self._changed.wait()
                            if d.cancelled:
                                op.error, op.skipped_after = _Cancelled(d.label), d
                                break
                            self._cuda.event_synchronize(d.event)
                    else:
                        # The op takes the shared cores inside host_run's call, so a fake CUDA
                        # layer's injected delay (before it calls) is a late start that leaves the
                        # other host stream free, not a slow op holding it back.
                        def work(fn: Callable[[], Any] = fn, op: HostOp = op) -> None:
                            with lock:
                                op.start_s = time.perf_counter()
                                fn()
                                op.end_s = time.perf_counter()

                        self._cuda.host_run(work, op.label)
                    if op.error is not None:
                        self._failed = op
                except BaseException as e:  # noqa: BLE001 - kept and re-raised by synchronize()
                    op.error = e
                    self._failed = op
            finally:
                if item is not _STOP:
                    item[0]._done.set()
                    with self._changed:
                        self._changed.notify_all()
                self._queue.task_done()


# -- the backend ------------------------------------------------------------------------------------

class CUDABackend(Recording):
    """Runs a schedule's ops on CUDA streams and host worker threads; see the module docstring.

    Args:
        adapter: the CUDA calls; :class:`TorchCuda` by default, :class:`FakeCuda` (or
            :class:`megatrain.testing.AsyncFakeCuda`) in CPU tests.
        record: time every op (see ``last_run``); may also be set later as ``backend.record``.
        host_threads: intra-op threads of the HOST and CAST workers, which run their ops' work one
            at a time (see "One host CPU budget" in the module docstring):
            :func:`megatrain.ir.hardware.host_worker_threads` of the host's cores. None: torch's
            default team (the process's thread count), still one op at a time.

    Raises:
        ValueError: ``host_threads`` < 1.
    """

    def __init__(self, adapter: CudaApi | None = None, *, record: bool = False, host_threads: int | None = None):
        if host_threads is not None and host_threads < 1:
            raise ValueError(f"CUDABackend(host_threads={host_threads}): a host worker needs at least one thread; "
                             "pass megatrain.ir.hardware.host_worker_threads(cores, gpus_per_node), or None for "
                             "torch's default")
        self.cuda: CudaApi = adapter if adapter is not None else TorchCuda()
        self.device = self.cuda.device
        self.record = record
        self.host_threads = host_threads
        self._host_lock = _FifoLock()  # one host op's work at a time: HOST and CAST share the cores
        self._streams: dict[Stream, Any] = {}
        self._workers: dict[Stream, _HostWorker] = {}
        self._changed = threading.Condition()
        # The open run: its launches so far, its entry event, the streams that waited on it.
        self._index = 0
        self._entry: Any = None
        self._entry_host_s = 0.0
        self._fenced: set[Stream] = set()
        self._run_records: bool | None = None
        self._launched: list[GpuOp | HostOp] = []
        self._issue = IssueQueue()
        self._fns: dict[int, Callable[[], Any]] = {}
        self._deps: dict[int, list[GpuOp | HostOp]] = {}
        self._graph_pool: Any = None  # made at the first capture

    # -- memory ------------------------------------------------------------------------------------
    def device_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.cuda.empty(shape, dtype)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.cuda.pinned_empty(shape, dtype)

    def host_pin(self, t: torch.Tensor) -> Any:
        return self.cuda.host_register(t)

    def record_use(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            self.cuda.record_stream(t)

    # -- CUDA graphs (Plan.cuda_graphs, megatrain.runtime.graphs) -------------------------------------
    def capture(self, fn: Callable[[], Any], static: Sequence[torch.Tensor] = ()) -> tuple[Any, Any]:
        """Capture ``fn``'s work on the compute stream in a CUDA graph (all graphs share one pool);
        returns ``(graph, fn's outputs)``. Between runs only: an event record, a host op or another
        stream's work must not fall inside a capture.

        Raises:
            RuntimeError: a run is open."""
        if self._run_records is not None:
            raise RuntimeError("CUDABackend.capture during a run: capture between runs (after synchronize())")
        if self._graph_pool is None:
            self._graph_pool = self.cuda.graph_pool()
        return self.cuda.capture(self.stream(Stream.COMPUTE), fn, self._graph_pool, static)

    def replay(self, graph: Any) -> None:
        """Launch ``graph`` on the current stream (inside an op's work: its stream)."""
        self.cuda.replay(graph)

    # -- streams -----------------------------------------------------------------------------------
    def stream(self, stream: Stream) -> Any:
        """The CUDA stream of ``stream`` (created on first use)."""
        if stream in HOST_STREAMS:
            raise ValueError(f"Stream.{stream.name} is a host worker thread, not a CUDA stream")
        s = self._streams.get(stream)
        if s is None:
            s = self._streams[stream] = self.cuda.stream()
        return s

    def _host_worker(self, stream: Stream) -> _HostWorker:
        w = self._workers.get(stream)
        if w is None:
            budget = None
            if stream in (Stream.HOST, Stream.CAST):
                # The issuing thread's team is fixed now, at the size it has, before a worker's
                # set_num_threads changes the process-wide default it would otherwise start from.
                torch.get_num_threads()
                budget = (self._host_lock, self.host_threads)
            w = self._workers[stream] = _HostWorker(self.cuda, stream, self._changed, budget)
            weakref.finalize(self, w.stop)
        return w

    def close(self) -> None:
        """Finish everything launched and stop the host workers (a later host op starts new ones)."""
        try:
            self.synchronize()
        finally:
            for w in self._workers.values():
                w.stop()
                w.thread.join()  # prompt: synchronize() left its queue empty
            self._workers = {}

    # -- launching ---------------------------------------------------------------------------------
    def launch(self, stream: Stream, fn: Callable[[], Any], wait_for: Sequence[Any],
               label: str = "", after: Sequence[Any] = ()) -> GpuOp | HostOp:
        """Run ``fn`` on ``stream`` after the ops whose handles are in ``wait_for``; return its handle.

        Host streams: ``fn`` is queued to the stream's worker, which first waits for the handles
        in ``wait_for``. GPU streams: ``fn`` runs on the calling thread with the stream current,
        after the stream was told to wait for each GPU handle in ``wait_for``, once every host
        handle in ``wait_for`` is done and every GPU op in ``after`` (its issue fences,
        ``Schedule.issue_after``) has finished on the device: now, or at a later ``launch`` or
        ``synchronize`` (the op waits in its stream's pending queue meanwhile, and the ops after it
        on that stream too). This call never blocks on a host op or a fence.

        Raises:
            HostOpError: a host op that a GPU op issued now depends on failed.
            BaseException: whatever an ``fn`` issued now raised (with a note naming its op).
            In both cases the run is aborted first: everything issued is drained, ops not yet
            issued are dropped, and the next launch opens a new run.
        """
        if self._run_records is None:
            self._open_run()
        index = self._index
        self._index += 1
        deps = _unique(wait_for)
        op: GpuOp | HostOp
        op = HostOp(index, label, stream) if stream in HOST_STREAMS else GpuOp(index, stream, label)
        self._launched.append(op)
        self._fns[index], self._deps[index] = fn, deps
        try:
            self._issue.add(index, stream, [h.index for h in deps], [h.index for h in after if h is not None])
            self._pump(block=False)
        except BaseException as e:
            self._abort(e)
            raise
        return op

    def _pump(self, block: bool) -> None:
        """Issue every ready op; with ``block``, until none is pending, waiting for host ops and fences.

        Only the issuing thread touches the issue queue, so issuing takes no lock; the condition
        guards the check-then-wait of a blocked pump against a host op finishing in between. A pump
        blocked on a fence (a GPU op, which notifies nobody) re-polls it every
        :data:`FENCE_POLL_S`, or sooner when a host op finishes."""
        done = self._done
        while True:
            if not block:
                i = self._issue.next(done)
                if i is None:
                    return
            else:
                with self._changed:
                    i = self._issue.next(done)
                    if i is None:
                        if not self._issue.pending():
                            return
                        self._changed.wait(FENCE_POLL_S if self._issue.waiting_on(done) else None)
                        continue
            self._issue_op(self._launched[i])

    def _done(self, i: int) -> bool:
        """Whether launch ``i`` finished: a host op, or a GPU op named as a fence (its event queried)."""
        op = self._launched[i]
        if isinstance(op, HostOp):
            return op._done.is_set()
        if not op.complete and op.event is not None and self.cuda.event_query(op.event):
            op.complete = True
        return op.complete

    def _issue_op(self, op: GpuOp | HostOp) -> None:
        fn, deps = self._fns.pop(op.index), self._deps.pop(op.index)
        if isinstance(op, HostOp):
            for h in deps:
                if isinstance(h, GpuOp) and not h.issued:
                    h.watched = True  # the worker will wait for its issue: notify then
            self._host_worker(op.stream).submit(op, fn, [h for h in deps if h.stream is not op.stream])
            return
        timing = self._run_records
        if timing:
            op.issue_t0, cpu0 = time.perf_counter(), time.thread_time()
        s = self.stream(op.stream)
        if op.stream not in self._fenced:
            self.cuda.wait_event(s, self._entry)
            self._fenced.add(op.stream)
        for h in deps:
            if isinstance(h, HostOp):
                if h.error is not None:  # done (the issue queue checked), but failed
                    raise _host_error(h) from h.error
            elif h.stream is not op.stream:  # the same stream is in order already
                self.cuda.wait_event(s, h.event)
        if timing:
            op.start = self.cuda.event(True)
            self.cuda.record(op.start, s)
        try:
            self.cuda.run(s, fn, op.label)
        except BaseException as e:
            if hasattr(e, "add_note"):  # Python 3.11+
                e.add_note(f"while launching {_name(op)} on the {op.stream.value} stream")
            raise
        # Blocking: a host worker may synchronise on it (module docstring, "Waiting without spinning").
        op.event = self.cuda.event(bool(timing), blocking=True)
        self.cuda.record(op.event, s)
        if timing:
            op.issue_t1, op.issue_cpu = time.perf_counter(), time.thread_time() - cpu0
        op.issued = True
        if op.watched:
            with self._changed:
                self._changed.notify_all()

    def _open_run(self) -> None:
        self._run_records = bool(self.record)
        self._entry = self.cuda.event(self._run_records, blocking=True)  # host_time waits on it
        self.cuda.record(self._entry, self.cuda.current_stream())
        if self._run_records:
            self._entry_host_s = self.cuda.host_time(self._entry)

    # -- finishing ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Issue what is pending, wait for the workers and every stream, end the run, and collect its
        timings. Ends the run also when it raises, so the backend can be used again.

        Raises:
            HostOpError: a host op of the run raised; names the op, chained to its exception.
            BaseException: an op issued now raised, or the device reported an error.
        """
        if self._run_records is None:
            return
        try:
            self._pump(block=True)
        except BaseException as e:
            self._abort(e)
            raise
        failed = self._drain()
        if failed is not None:
            raise _host_error(failed) from failed.error

    def abort(self) -> None:
        """End the open run after an error outside the backend (the executor raised mid-run): drop
        the ops not yet issued, wait for everything issued, and forget the run. Errors the run's
        ops raised meanwhile are dropped: the caller is already raising its own."""
        if self._run_records is not None:
            self._abort(None)

    def _abort(self, error: BaseException | None) -> None:
        with self._changed:
            for op in self._launched:
                if isinstance(op, GpuOp) and not op.issued:
                    op.cancelled = True
                    op.issued = True
            self._changed.notify_all()  # host ops waiting for one stop waiting
        self._issue = IssueQueue()
        self._fns, self._deps = {}, {}
        try:
            self._drain()
        except BaseException as e:  # noqa: BLE001 - the error being raised is the one to report
            if error is not None and hasattr(error, "add_note"):
                error.add_note(f"while draining the aborted run, {type(e).__name__} was also raised: {e}")

    def _drain(self) -> HostOp | None:
        failed = None
        try:
            for w in self._workers.values():
                f = w.drain()
                if failed is None or (f is not None and f.index < failed.index):
                    failed = f
            if self._streams:  # no launch on a GPU stream yet: nothing to wait for, nothing to initialise
                self.cuda.synchronize()
            recorded = bool(self._run_records)
            if recorded and failed is None:
                self._last = tuple(self._timings())
            else:
                self._last = ()
            self._last_recorded = recorded and failed is None
        finally:
            self._index = 0
            self._entry = None
            self._fenced = set()
            self._run_records = None
            self._launched = []
            self._issue = IssueQueue()
            self._fns, self._deps = {}, {}
        return failed

    def _timings(self) -> Iterator[OpTiming]:
        entry, host0 = self._entry, self._entry_host_s
        for op in self._launched:
            if isinstance(op, HostOp):
                yield OpTiming(op.index, op.stream, op.label, op.start_s - host0, op.end_s - host0)
            else:
                yield OpTiming(op.index, op.stream, op.label, self.cuda.elapsed_s(entry, op.start),
                               self.cuda.elapsed_s(entry, op.event), issue_start_s=op.issue_t0 - host0,
                               issued_s=op.issue_t1 - host0, issue_cpu_s=op.issue_cpu)


def _unique(handles: Sequence[Any]) -> list[Any]:
    """The handles without ``None`` (an op already complete) and without repeats, in order."""
    seen: set[int] = set()
    out = []
    for h in handles:
        if h is not None and id(h) not in seen:
            seen.add(id(h))
            out.append(h)
    return out


__all__ = ["CUDABackend", "CudaApi", "TorchCuda", "GpuOp", "HostOp", "HostOpError", "GPU_STREAMS"]
