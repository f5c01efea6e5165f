"""Backends: the CUDA backend's stream/event/worker logic on CPU through FakeCuda, the measured
Timeline on both backends, and the same checks on a real GPU behind ``requires_cuda``."""

from __future__ import annotations

import copy
import dataclasses
import re
import sys
import threading
import time
from collections import Counter

import pytest
import torch

import megatrain
from megatrain.errors import ConfigError
from megatrain.ir.hardware import preset
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.ir.schedule import HOST_STREAMS, Stream
from megatrain.planner.timeline import Timeline, measured_timeline
from megatrain.runtime.backend import CPUBackend, make_backend
from megatrain.runtime.cuda import GPU_STREAMS, CUDABackend, GpuOp, HostOp, HostOpError, TorchCuda
from megatrain.runtime.host import HostState
from megatrain.testing import AsyncFakeCuda, FakeCuda, FakeCudaError, FakeEvent

from conftest import BackendWrapper, random_batch, requires_cuda, tiny_llama

ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
HW = preset("H100_SXM")  # only names the timeline and sizes its memory curve; times are measured
SEQ, MBS, VOCAB = 16, 2, 96


def noop() -> None:
    return None


def compile_pair(plan: Plan | None = None, micro_batches: int = 2, seed: int = 0):
    """Two trainers of the same tiny Llama, both compiled on the CPU backend."""
    torch.manual_seed(seed)
    model = tiny_llama(layers=2)
    twin = copy.deepcopy(model)
    kw = dict(seq_len=SEQ, micro_batch_size=MBS, micro_batches=micro_batches, optimizer=ADAMW, plan=plan)
    return megatrain.compile(model, **kw), megatrain.compile(twin, **kw)


def compile_one(plan: Plan | None = None, micro_batches: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    return megatrain.compile(tiny_llama(layers=2), seq_len=SEQ, micro_batch_size=MBS, micro_batches=micro_batches,
                             optimizer=ADAMW, plan=plan)


def use_backend(trainer, backend) -> None:
    # The executor reads its backend at run time and allocates its slots on the first run, so
    # swapping it before the first step runs the whole step through ``backend``.
    trainer.backend = trainer.executor.backend = backend


def batches(n: int, micro_batches: int = 2):
    return [random_batch(MBS * micro_batches, SEQ, VOCAB, seed=s) for s in range(n)]


class Spy(BackendWrapper):
    """Wraps a backend for the executor: labels each launch with its schedule op (as the executor
    should; ``labels=False`` passes none, as it does today), logs when each op's ``fn`` starts and
    ends and on which thread, records which fake events each GPU launch waited on, and replaces
    the ``fn`` of launch ``fail_at`` with one that raises ``error``. ``host_delay`` slows every host
    op, so that a GPU op issued before its host dependency finished is caught, not missed by luck."""

    def __init__(self, inner, fake: FakeCuda | None = None, labels: bool = True, fail_at: int | None = None,
                 error: BaseException | None = None, host_delay: float = 0.0):
        super().__init__(inner)
        self.fake, self.labels = fake, labels
        self.host_delay = host_delay
        self.fail_at, self.error = fail_at, error
        self.schedule = None
        self.k = 0
        self.lock = threading.Lock()
        self.log: list[tuple[str, int, str]] = []
        self.handles: dict[int, object] = {}
        self.waits: dict[int, list[FakeEvent]] = {}
        self.mark = 0  # fake.log entries before it belong to GPU ops already started

    record = property(lambda self: self.inner.record)

    def launch(self, stream, fn, wait_for, label="", after=()):
        k = self.k
        self.k += 1
        op = self.schedule.ops[k]
        assert op.stream is stream, f"launch #{k} on {stream} but the schedule's op #{k} is {op!r}"

        if k == self.fail_at:
            def fn():
                raise self.error

        def run():
            with self.lock:
                self.log.append(("start", k, threading.current_thread().name))
                if self.fake and stream not in HOST_STREAMS:
                    # GPU ops are issued one at a time on the issuing thread, each right after its
                    # waits: the waits logged since the last GPU op started are this op's.
                    n = len(self.fake.log)
                    self.waits[k] = [e[2] for e in self.fake.log[self.mark:n] if e[0] == "wait"]
                    self.mark = n
            if stream in HOST_STREAMS:
                time.sleep(self.host_delay)
            fn()
            with self.lock:
                self.log.append(("end", k, threading.current_thread().name))

        h = self.inner.launch(stream, run, wait_for, label=repr(op) if self.labels else "", after=after)
        self.handles[k] = h
        return h

    def synchronize(self):
        self.k = 0
        self.inner.synchronize()

    def abort(self):
        self.k = 0
        self.inner.abort()

    def position(self, what: str, k: int) -> int:
        return next(i for i, e in enumerate(self.log) if e[0] == what and e[1] == k)


def test_public_surface():
    import megatrain.runtime.backend as backend_mod
    import megatrain.runtime.cuda as cuda_mod

    assert sorted(backend_mod.__all__) == ["Backend", "CPUBackend", "OpTiming", "make_backend"]
    import megatrain.testing as testing_mod

    assert sorted(cuda_mod.__all__) == ["CUDABackend", "CudaApi", "GPU_STREAMS", "GpuOp", "HostOp", "HostOpError",
                                        "TorchCuda"]
    # The fakes are test doubles: they live in megatrain.testing, not in the runtime.
    assert sorted(testing_mod.__all__) == ["AsyncEvent", "AsyncFakeCuda", "AsyncFakeCudaError", "AsyncStream",
                                           "CachingAllocatorModel", "FakeCuda", "FakeCudaError", "FakeEvent",
                                           "FakeGraph", "FakeStream", "IssueTimeFakeCuda", "SlowTorchCuda"]


# -- construction: nothing CUDA until the first launch ---------------------------------------------

def test_construction_creates_no_stream_event_or_thread():
    before = set(threading.enumerate())  # compared as sets: other tests' workers may exit meanwhile
    fake = FakeCuda()
    be = CUDABackend(adapter=fake, record=True)
    assert fake.log == [] and fake.streams == [] and fake.empty_calls == []
    assert set(threading.enumerate()) - before == set(), "the host worker starts at the first host op"
    be.launch(Stream.COMPUTE, noop, [])
    assert len(fake.streams) == 1 and set(threading.enumerate()) - before == set()
    be.launch(Stream.HOST, noop, [])
    assert set(threading.enumerate()) - before == {be._workers[Stream.HOST].thread}
    be.close()
    assert be._workers == {} and not any(t.name == "megatrain-host" and t not in before and t.is_alive()
                                          for t in threading.enumerate())


def test_default_adapter_is_torch_cuda_and_touches_nothing_on_a_cpu_machine():
    # On a CPU-only torch any CUDA call raises, so constructing proves nothing CUDA ran.
    be = CUDABackend()
    assert isinstance(be.cuda, TorchCuda) and be.device == torch.device("cuda")
    be.synchronize()  # nothing launched: nothing to wait for, and no CUDA initialisation


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_make_backend_cuda_without_a_gpu_raises_config_error():
    with pytest.raises(ConfigError, match="is_available"):
        make_backend("cuda")


def test_make_backend_cuda_returns_the_cuda_backend_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    be = make_backend("cuda", record=True)
    assert isinstance(be, CUDABackend) and isinstance(be.cuda, TorchCuda) and be.record
    assert be._streams == {} and be._workers == {}
    assert isinstance(make_backend("cpu"), CPUBackend)


# -- events and waits ---------------------------------------------------------------------------------

def test_each_stream_gets_one_lazy_stream_and_ops_are_recorded_in_order():
    fake = FakeCuda()
    be = CUDABackend(adapter=fake)
    hs = [be.launch(s, noop, []) for s in (Stream.COMPUTE, Stream.H2D, Stream.COMPUTE, Stream.D2H, Stream.H2D)]
    assert len(fake.streams) == 3
    assert {be.stream(s) for s in GPU_STREAMS} == set(fake.streams)
    for s in GPU_STREAMS:
        seqs = [h.event.seq for h in hs if h.stream is s]
        assert seqs == sorted(seqs) and all(h.event.stream is be.stream(s) for h in hs if h.stream is s)
    with pytest.raises(ValueError, match="host worker"):
        be.stream(Stream.HOST)
    be.synchronize()


def test_cross_stream_deps_are_waited_once_and_same_stream_deps_not_at_all():
    fake = FakeCuda()  # strict: a wait on an own-stream event would raise
    be = CUDABackend(adapter=fake)
    a = be.launch(Stream.COMPUTE, noop, [])
    b = be.launch(Stream.H2D, noop, [])
    n0 = len(fake.log)
    be.launch(Stream.COMPUTE, noop, [a, b, b, None])
    waits = [e for e in fake.log[n0:] if e[0] == "wait"]
    assert waits == [("wait", be.stream(Stream.COMPUTE), b.event)]
    be.synchronize()


def test_first_op_of_each_stream_in_a_run_waits_for_the_callers_stream_once():
    fake = FakeCuda()
    be = CUDABackend(adapter=fake)
    for _ in range(2):  # two runs: the fence is set up again after synchronize
        n0 = len(fake.log)
        for s in (Stream.COMPUTE, Stream.COMPUTE, Stream.H2D, Stream.H2D):
            be.launch(s, noop, [])
        entry = [e for e in fake.log[n0:] if e[0] == "wait"]
        assert [e[1] for e in entry] == [be.stream(Stream.COMPUTE), be.stream(Stream.H2D)]
        assert all(e[2].stream is fake.default for e in entry)
        be.synchronize()


def test_fake_cuda_refuses_waits_that_would_be_bugs_on_a_gpu():
    fake = FakeCuda()
    s, t = fake.stream(), fake.stream()
    ev = fake.event(False)
    with pytest.raises(FakeCudaError, match="never recorded"):
        fake.wait_event(s, ev)
    fake.record(ev, s)
    with pytest.raises(FakeCudaError, match="its own event"):
        fake.wait_event(s, ev)
    fake.wait_event(t, ev)
    with pytest.raises(FakeCudaError, match="not an event"):
        fake.wait_event(t, HostOp(0, "OPT:L0:r0"))
    with pytest.raises(FakeCudaError, match="timing"):
        fake.elapsed_s(ev, ev)
    lax = FakeCuda(strict=False)
    lax.wait_event(lax.stream(), lax.event(False))
    assert lax.log[-1][0] == "wait"


# -- the host worker -----------------------------------------------------------------------------------

def test_host_op_waits_for_its_gpu_deps_on_the_worker_thread():
    fake = FakeCuda()
    be = CUDABackend(adapter=fake)
    g = be.launch(Stream.D2H, noop, [])
    h = be.launch(Stream.HOST, noop, [g])
    be.synchronize()
    syncs = [e for e in fake.log if e[0] == "event_sync"]
    assert syncs == [("event_sync", g.event, "megatrain-host")]
    assert isinstance(h, HostOp) and h.done() and h.error is None


def test_gpu_op_depending_on_a_host_op_waits_pending_and_the_issuing_thread_runs_on():
    fake = FakeCuda()
    be = CUDABackend(adapter=fake)
    gate = threading.Event()
    h = be.launch(Stream.HOST, lambda: gate.wait(10), [])
    seen = []
    copy = be.launch(Stream.H2D, lambda: seen.append(("h2d", h.done())), [h])
    after = be.launch(Stream.H2D, lambda: seen.append(("h2d after", h.done())), [])  # behind it: stream order
    be.launch(Stream.COMPUTE, lambda: seen.append(("compute", h.done())), [])  # other streams run on
    assert seen == [("compute", False)], "launch must not block on a host op, nor pass the pending copy"
    assert not copy.issued and copy.event is None and not after.issued
    timer = threading.Timer(0.05, gate.set)
    timer.start()
    be.synchronize()  # issues the pending copies once the host op is done
    timer.join()
    assert seen == [("compute", False), ("h2d", True), ("h2d after", True)]
    assert not any(e[0] == "wait" and not isinstance(e[2], FakeEvent) for e in fake.log)


def test_pending_op_is_issued_at_a_later_launch_once_its_host_dep_is_done():
    be = CUDABackend(adapter=FakeCuda())
    gate = threading.Event()
    h = be.launch(Stream.CAST, gate.wait, [])
    seen = []
    be.launch(Stream.H2D, lambda: seen.append("h2d"), [h])
    gate.set()
    h._done.wait(10)
    be.launch(Stream.COMPUTE, lambda: seen.append("compute"), [])
    assert seen == ["h2d", "compute"], "a ready pending op goes before the newly launched one"
    be.synchronize()


def test_cast_waits_for_the_running_optimizer_step_only_not_those_queued_behind_it():
    be = CUDABackend(adapter=FakeCuda())
    gate, running, order = threading.Event(), threading.Event(), []
    be.launch(Stream.HOST, lambda: (running.set(), gate.wait(10), order.append("OPT:L3")), [], label="OPT:L3:r0")
    for layer in (2, 1):
        be.launch(Stream.HOST, lambda layer=layer: order.append(f"OPT:L{layer}"), [], label=f"OPT:L{layer}:r0")
    # OPT:L3 holds the cores before the CAST asks for them (on a loaded machine the HOST worker's
    # thread may otherwise reach the lock after the CAST worker's).
    assert running.wait(30), "OPT:L3 never ran"
    cast = be.launch(Stream.CAST, lambda: order.append("CAST:L1"), [], label="CAST:L1:t0")
    # Until the CAST's worker has asked for the cores (its ticket is the second): on a loaded
    # machine its thread may take a while to run at all.
    deadline = time.monotonic() + 30
    while be._host_lock._next < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert be._host_lock._next == 2, "the CAST's worker never asked for the host's cores"
    time.sleep(0.05)
    assert not cast.done(), "the host kernels share the cores: a CAST waits for the host op running"
    gate.set()
    be.synchronize()
    # The CAST asked for the cores while OPT:L3 ran; the OPTs queued behind it asked later.
    assert order == ["OPT:L3", "CAST:L1", "OPT:L2", "OPT:L1"]


def test_host_and_cast_work_never_overlaps_and_each_worker_runs_its_own_thread_team():
    # The simulator puts HOST and CAST on one resource (cost.resource_of): the runtime must not
    # overlap them either, and each worker's kernels run with host_threads threads whatever the
    # issuing thread's team is.
    fake = AsyncFakeCuda(seed=3, max_delay_s=2e-3)
    main_threads = torch.get_num_threads()
    teams, spans = {}, []

    def work(name):
        def run():
            t0 = time.perf_counter()
            teams[name] = torch.get_num_threads()
            time.sleep(2e-3)
            spans.append((t0, time.perf_counter()))
        return run
    try:
        be = CUDABackend(adapter=fake, host_threads=3)
        for k in range(12):
            d2h = be.launch(Stream.D2H, noop, [], label=f"D2H:L{k}:s0")
            be.launch(Stream.HOST, work(f"OPT{k}"), [d2h], label=f"OPT:L{k}:r0")
            be.launch(Stream.CAST, work(f"CAST{k}"), [], label=f"CAST:L{k}:t0")
        be.synchronize()
        be.close()
    finally:
        fake.close()
    assert set(teams.values()) == {3} and len(teams) == 24
    assert torch.get_num_threads() == main_threads, "a worker's team size must not leak into the issuing thread"
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "host kernels overlapped"


def test_host_threads_must_be_positive():
    with pytest.raises(ValueError, match="at least one thread"):
        CUDABackend(adapter=FakeCuda(), host_threads=0)


def test_a_worker_waiting_for_the_gpu_sleeps_instead_of_spinning():
    # AsyncFakeCuda makes a thread that synchronises on an event without blocking=True spin, as
    # CUDA's default scheduling does; a blocking event puts it to sleep. The worker's CPU time
    # while the D2H it waits for takes WAIT_S: asleep it wakes once (well under a millisecond of
    # CPU), spinning it burns the core for as much of WAIT_S as the scheduler gives it.
    wait_s = 0.5
    fake = AsyncFakeCuda(delay=lambda label: wait_s if label.startswith("D2H") else 0.0)
    cpu = []
    try:
        be = CUDABackend(adapter=fake)
        d2h = be.launch(Stream.D2H, noop, [], label="D2H:L0:s0")
        # The worker thread starts here: its CPU time so far is this wait (and its start-up).
        be.launch(Stream.HOST, lambda: cpu.append(time.thread_time()), [d2h], label="OPT:L0:r0")
        be.synchronize()
        be.close()
    finally:
        fake.close()
    assert cpu[0] < 0.1 * wait_s, f"the worker used {cpu[0]:.3f} s of CPU while waiting {wait_s} s for the GPU"


def test_fake_cuda_refuses_a_thread_synchronising_on_a_spinning_event():
    fake = FakeCuda()
    s = fake.stream()
    spin, sleep = fake.event(False), fake.event(False, blocking=True)
    fake.record(spin, s)
    fake.record(sleep, s)
    with pytest.raises(FakeCudaError, match="blocking=True"):
        fake.event_synchronize(spin)
    fake.event_synchronize(sleep)


def test_cast_waits_for_its_host_dependency_on_the_other_worker():
    be = CUDABackend(adapter=FakeCuda())
    order = []
    opt = be.launch(Stream.HOST, lambda: (time.sleep(0.02), order.append("opt")), [], label="OPT:L1:r0")
    be.launch(Stream.CAST, lambda: order.append("cast"), [opt], label="CAST:L1:t0")
    be.synchronize()
    assert order == ["opt", "cast"]


def test_host_op_error_surfaces_from_synchronize_naming_the_op():
    fake = FakeCuda()
    be = CUDABackend(adapter=fake)
    ran = []
    be.launch(Stream.HOST, lambda: ran.append("first"), [])

    def boom():
        raise ValueError("tile has NaNs")

    be.launch(Stream.HOST, boom, [], label="OPT:L1:r0")
    after = be.launch(Stream.HOST, lambda: ran.append("after"), [], label="OPT:L0:r1")
    with pytest.raises(HostOpError, match=r"'OPT:L1:r0'.*ValueError: tile has NaNs") as info:
        be.synchronize()
    assert isinstance(info.value.__cause__, ValueError)
    assert ran == ["first"], "host ops queued after a failed one are skipped"
    with pytest.raises(HostOpError, match=r"'OPT:L0:r1' was not run because host op 'OPT:L1:r0'"):
        after.wait()
    # The error was reported once; the backend runs again.
    be.launch(Stream.HOST, lambda: ran.append("next run"), [])
    be.synchronize()
    assert ran == ["first", "next run"]


def test_gpu_op_whose_host_dep_failed_raises_and_leaves_the_backend_usable():
    be = CUDABackend(adapter=FakeCuda())
    gate = threading.Event()
    h = be.launch(Stream.CAST, lambda: (gate.wait(10), 1 / 0), [], label="CAST:L2:t0")
    ran = []
    be.launch(Stream.H2D, lambda: ran.append(1), [h])  # pending
    be.launch(Stream.HOST, lambda: ran.append("opt"), [], label="OPT:L0:r0")
    gate.set()
    with pytest.raises(HostOpError, match="CAST:L2:t0.*ZeroDivisionError"):
        be.synchronize()
    assert 1 not in ran
    be.synchronize()  # already reported and drained: nothing left to raise
    be.launch(Stream.H2D, lambda: ran.append(2), [])
    be.synchronize()
    assert ran[-1] == 2


def test_gpu_op_error_aborts_the_run_so_the_next_one_is_fenced_afresh():
    fake = FakeCuda()
    be = CUDABackend(adapter=fake)
    gate = threading.Event()
    h = be.launch(Stream.HOST, gate.wait, [], label="OPT:L0:r0")
    pending = be.launch(Stream.H2D, noop, [h], label="H2D:L0:s0")

    def bad():
        raise RuntimeError("injected failure")

    timer = threading.Timer(0.05, gate.set)  # the abort drains the host op: let it end
    timer.start()
    with pytest.raises(RuntimeError, match="injected failure"):
        be.launch(Stream.COMPUTE, bad, [], label="FWD:L1:m0:s1")
    timer.join()
    assert h.done() and pending.cancelled, "the run was drained (host op waited for) and its pending ops dropped"
    n0 = len(fake.log)
    be.launch(Stream.COMPUTE, noop, [])
    waits = [e for e in fake.log[n0:] if e[0] == "wait"]
    assert len(waits) == 1 and waits[0][2].stream is fake.default, "a new run: the entry fence again"
    be.synchronize()


def test_gpu_op_error_names_the_op():
    be = CUDABackend(adapter=FakeCuda())

    def bad():
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch") as info:
        be.launch(Stream.COMPUTE, bad, [], label="FWD:L1:m0:s1")
    if sys.version_info >= (3, 11):  # exception notes are new in 3.11
        assert any("FWD:L1:m0:s1" in n and "compute" in n for n in info.value.__notes__)
    be.synchronize()


# -- the real executor through the fake CUDA layer ----------------------------------------------------

_K, _OFF, _RE = ActivationPolicy.KEEP, ActivationPolicy.OFFLOAD, ActivationPolicy.RECOMPUTE
PLANS = [None, Plan(micro_batches=2, slots=1, prefetch_distance=0, grad_ring=1),
         Plan(micro_batches=2, slots=2, prefetch_distance=1, resident=frozenset({0, 3})),
         # Checkpoints offloaded and recomputed; updates deferred into the next step's forward.
         Plan(micro_batches=2, slots=3, prefetch_distance=2, activations=(_OFF, _RE, _OFF, _K),
              optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=4),
         # Per-micro-batch passes: ACCs on the host worker, one pinned checkpoint copy reused.
         Plan(micro_batches=2, layer_by_layer=False, slots=2, prefetch_distance=1, grad_ring=1,
              activations=(_OFF, _RE, _K, _K))]


@pytest.mark.parametrize("plan", PLANS, ids=["default", "one-slot-one-tile", "resident", "offload-recompute-deferred",
                                             "per-micro-batch"])
def test_fake_cuda_backend_trains_exactly_like_the_cpu_backend(plan):
    ref, got = compile_pair(plan)
    fake = FakeCuda()
    use_backend(got, CUDABackend(adapter=fake))
    allocated = -1
    for b in batches(3):
        a, c = ref.step(b), got.step(b)
        assert c.micro_batch_losses == a.micro_batch_losses  # exactly: same ops, same order, same data
        if c.step == 1:
            allocated = len(fake.empty_calls)
    for i, (x, y) in enumerate(zip(ref.host.blocks, got.host.blocks)):
        assert torch.equal(x, y), f"layer {i}: master weights or moments differ"
    assert allocated > 0, "the slots are allocated through the backend on the first step"
    assert len(fake.empty_calls) == allocated, "nothing is allocated on the device in the steady state"


def test_waits_and_blocks_match_the_schedules_cross_stream_edges():
    trainer = compile_one(Plan(micro_batches=2, slots=1, prefetch_distance=0, grad_ring=1))
    fake = FakeCuda()
    spy = Spy(CUDABackend(adapter=fake), fake, host_delay=0.005)
    spy.schedule = trainer.schedule
    use_backend(trainer, spy)
    ops = trainer.schedule.ops
    host_deps_checked = 0
    for b in batches(2):
        fake.log.clear()
        spy.log.clear()
        spy.mark = 0
        trainer.step(b)
        ev_of = {id(h.event): d for d, h in spy.handles.items() if isinstance(h, GpuOp)}
        for k, op in enumerate(ops):
            cross = [d for d in op.deps if ops[d].stream is not op.stream]
            if op.stream in HOST_STREAMS:
                assert spy.log[spy.position("start", k)][2] == f"megatrain-{op.stream.value}"
                continue
            want = Counter(d for d in cross if ops[d].stream not in HOST_STREAMS)
            waited = Counter(ev_of[id(e)] for e in spy.waits[k] if e.stream is not fake.default)
            assert waited == want, f"op #{k} {op!r} waited on ops {sorted(waited.elements())}, deps say {dict(want)}"
            for d in cross:
                if ops[d].stream in HOST_STREAMS:
                    assert spy.position("end", d) < spy.position("start", k), \
                        f"{op!r} ran before its host dependency {ops[d]!r} finished"
                    host_deps_checked += 1
        # The run-entry fence: one wait per GPU stream the schedule uses.
        fences = [e for k in spy.waits for e in spy.waits[k] if e.stream is fake.default]
        assert len(fences) == len({op.stream for op in ops} - HOST_STREAMS)
        # Host ops waited for their GPU deps in the worker, once per edge.
        synced = Counter(ev_of[id(e[1])] for e in fake.log if e[0] == "event_sync" and e[2].startswith("megatrain-"))
        want_sync = Counter(d for op in ops if op.stream in HOST_STREAMS for d in op.deps
                            if ops[d].stream not in HOST_STREAMS)
        assert synced == want_sync
    assert host_deps_checked > 0, "the one-tile plan makes a gradient copy wait for the previous optimizer step"


@pytest.mark.parametrize("labels", [True, False], ids=["labelled", "unlabelled"])
def test_host_op_error_in_a_step_names_the_failing_op(labels):
    trainer = compile_one()
    ops = trainer.schedule.ops
    first_opt = next(k for k, op in enumerate(ops) if op.stream is Stream.HOST)
    later = next(op.layer for op in ops[first_opt + 1:] if op.stream is Stream.HOST)
    spy = Spy(CUDABackend(adapter=FakeCuda()), labels=labels, fail_at=first_opt,
              error=FloatingPointError("overflow in exp_avg_sq"))
    spy.schedule = trainer.schedule
    use_backend(trainer, spy)
    before = trainer.host.blocks[later].clone()
    name = re.escape(repr(repr(ops[first_opt]))) if labels else f"#{first_opt}"
    want = rf"host op {name} \(launch #{first_opt} .*FloatingPointError: overflow"
    with pytest.raises(megatrain.StepError, match=want) as info:  # Trainer.step says what the failure left
        trainer.step(batches(1)[0])
    assert isinstance(info.value.__cause__, HostOpError)
    assert isinstance(info.value.__cause__.__cause__, FloatingPointError)
    assert torch.equal(trainer.host.blocks[later], before), "host ops after the failed one must not run"


# -- measured timelines -------------------------------------------------------------------------------

def check_timeline(tl: Timeline, schedule, tol: float = 0.0) -> None:
    ops = schedule.ops
    assert tl.source == "measured" and len(tl.records) == len(ops)
    assert [r.op for r in tl.records] == [repr(op) for op in ops]
    for r in tl.records:
        assert 0.0 <= r.start_s <= r.end_s and r.stream is ops[r.index].stream
    for s in Stream:
        recs = sorted((r for r in tl.records if r.stream is s), key=lambda r: r.index)
        for a, b in zip(recs, recs[1:]):
            assert b.start_s >= a.end_s, f"{a.op} and {b.op} overlap on {s.value}"
    for r in tl.records:
        for d in ops[r.index].deps:
            dep = tl.records[d]
            assert r.start_s >= dep.end_s - tol, f"{r.op} started before its dependency {dep.op} ended"
    assert tl.step_time_s == pytest.approx(max(r.end_s for r in tl.records))


def test_fake_cuda_backend_records_a_measured_timeline():
    trainer = compile_one()
    be = CUDABackend(adapter=FakeCuda(), record=True)
    spy = Spy(be)
    spy.schedule = trainer.schedule
    use_backend(trainer, spy)
    trainer.step(batches(1)[0])
    tl = measured_timeline(be, trainer.schedule, trainer.graph, HW)
    check_timeline(tl, trainer.schedule)
    assert tl.busy_s[Stream.HOST] > 0 and tl.busy_s[Stream.COMPUTE] > 0
    assert Timeline.from_json(tl.to_json()) == tl
    # Labels tie the records to the schedule: a schedule with other ops at the same indices is refused.
    shuffled = dataclasses.replace(trainer.schedule, ops=trainer.schedule.ops[::-1])
    with pytest.raises(ValueError, match="labelled 'H2D:L0:s0'"):
        measured_timeline(be, shuffled, trainer.graph, HW)
    # So is one of another length (the last run is now an evaluation).
    use_backend(trainer, be)
    trainer.evaluate(random_batch(MBS, SEQ, VOCAB, seed=9))
    with pytest.raises(ValueError, match="schedule that ran"):
        measured_timeline(be, trainer.schedule, trainer.graph, HW)


def test_timeline_needs_recording():
    trainer = compile_one()
    be = CUDABackend(adapter=FakeCuda())
    use_backend(trainer, be)
    trainer.step(batches(1)[0])
    assert be.last_records == ()
    with pytest.raises(ValueError, match="record = True"):
        measured_timeline(be, trainer.schedule, trainer.graph, HW)
    be.record = True
    trainer.step(batches(1)[0])
    assert len(be.last_records) == len(trainer.schedule.ops)


def test_cpu_backend_records_a_measured_timeline():
    trainer = compile_one()
    be = CPUBackend(record=True)
    use_backend(trainer, be)
    trainer.step(batches(1)[0])
    tl = measured_timeline(be, trainer.schedule, trainer.graph, HW)
    check_timeline(tl, trainer.schedule)
    recs = sorted(tl.records, key=lambda r: r.start_s)
    assert [r.index for r in recs] == list(range(len(recs))), "the CPU backend runs ops one after another"
    be.record = False
    trainer.step(batches(1)[0])
    with pytest.raises(ValueError, match="record"):
        measured_timeline(be, trainer.schedule, trainer.graph, HW)


# -- host memory: one block per layer, only the master rows pinned --------------------------------

def test_host_state_pins_only_the_master_rows():
    trainer = compile_one()
    fake = FakeCuda()
    be = CUDABackend(adapter=fake)
    host = HostState(trainer.graph)
    assert fake.pinned_bytes == 0, "nothing is pinned before a plan asks for it"
    host.master_pins.pin(be)
    page = 4096
    rows = [-(-layer.numel * 4 // page) * page for layer in trainer.graph.layers]
    assert sorted(fake.registered.values()) == sorted(rows) and host.master_pins.nbytes == sum(rows)
    assert set(fake.registered) == {b.data_ptr() for b in host.blocks}, "each pin starts at its master row"
    assert all(b.is_contiguous() and b.data_ptr() % page == 0 for b in host.blocks)
    assert fake.pinned_calls == [] and fake.empty_calls == [] and fake.log == []
    host.master_pins.pin(be)  # idempotent
    assert len(fake.pin_log) == len(rows)
    host.master_pins.release()
    assert fake.pinned_bytes == 0 and fake.registered == {}


# -- on a real GPU ---------------------------------------------------------------------------------------

@requires_cuda
def test_cuda_pinned_host_blocks_are_page_aligned():  # CPU twin: test_host_state_pins_only_the_master_rows
    trainer = compile_one()
    host = HostState(trainer.graph)
    host.master_pins.pin(CUDABackend())
    for i, b in enumerate(host.blocks):
        layer = trainer.graph.layers[i]
        assert b.is_pinned() and b.is_contiguous() and b.shape == (layer.numel + 2 * layer.trainable_numel,)
        assert b.data_ptr() % 4096 == 0, f"layer {i}'s block is not page-aligned"


@requires_cuda
def test_cuda_host_op_reads_what_a_gpu_op_wrote():  # CPU twin: test_host_op_waits_for_its_gpu_deps_on_the_worker_thread
    be = CUDABackend()
    src = torch.zeros(1 << 20, device="cuda")
    dst = be.host_empty((1 << 20,), torch.float32).zero_()
    seen = []

    def fill():
        torch.cuda._sleep(50_000_000)  # keep the GPU busy so a missing wait would read zeros
        src.fill_(3.0)

    c = be.launch(Stream.COMPUTE, fill, [])
    d = be.launch(Stream.D2H, lambda: dst.copy_(src, non_blocking=True), [c])
    be.launch(Stream.HOST, lambda: seen.append(float(dst.min())), [d])
    be.synchronize()
    assert seen == [3.0]
    be.close()


@requires_cuda
def test_cuda_backend_trains_like_the_cpu_backend_and_allocates_nothing_new():  # CPU twin: the fake exactness test
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    twin = copy.deepcopy(model)
    kw = dict(seq_len=SEQ, micro_batch_size=MBS, micro_batches=2, optimizer=ADAMW)
    ref = megatrain.compile(model, **kw)
    # FP32 on both sides (strict FP32 on the GPU); the exactness tests proper, each precision against
    # eager on the same device, are in tests/test_gpu_exactness.py.
    got = megatrain.compile(twin, device="cuda", compute_dtype="float32", **kw)
    assert isinstance(got.backend, CUDABackend)
    segments = []
    for b in batches(4):
        a, c = ref.step(b).loss, got.step(b).loss
        assert c == pytest.approx(a, rel=1e-4)
        segments.append(torch.cuda.memory_stats()["segment.all.allocated"])
    assert segments[1] == segments[-1], f"cudaMalloc calls grew in the steady state: {segments}"


@requires_cuda
def test_cuda_backend_records_a_measured_timeline():  # CPU twin: test_fake_cuda_backend_records_a_measured_timeline
    torch.manual_seed(0)
    trainer = megatrain.compile(tiny_llama(layers=2), seq_len=SEQ, micro_batch_size=MBS, micro_batches=2,
                                optimizer=ADAMW, device="cuda")
    trainer.backend.record = True
    trainer.step(batches(1)[0])
    tl = measured_timeline(trainer.backend, trainer.schedule, trainer.graph, HW)
    # Host and GPU clocks meet at the run's entry event; allow the launch latency between them.
    check_timeline(tl, trainer.schedule, tol=1e-3)
