"""GPU busy or issue-bound: the CUDA backend records, per GPU op, when its issue began and ended and
the issuing thread's CPU seconds meanwhile, and the measured Timeline splits each GPU stream's op
time into the part after the issue ended (the GPU busy with work all queued) and before (the GPU
may have waited for the issuing thread), with the issuing thread's busy and blocked seconds. The
logic on the CPU, through the fake CUDA layers: FakeCuda runs an op's work as it is issued (every op
issue-bound), AsyncFakeCuda on stream threads after a delay (the GPU busy after the issue)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

import megatrain
from megatrain.ir.hardware import preset
from megatrain.ir.schedule import Stream
from megatrain.planner.timeline import OpRecord, Timeline, measured_timeline
from megatrain.runtime.cuda import CUDABackend
from megatrain.testing import AsyncFakeCuda, FakeCuda

from conftest import random_batch, tiny_llama

HW = preset("H100_SXM")
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def test_the_gpu_busy_after_the_issue_counts_as_gpu_busy():
    """AsyncFakeCuda's compute stream sleeps 0.2 s before the op's work, as a GPU still busy with
    earlier kernels: the issue ends at once, the op's end marker 0.2 s later. All of that is GPU
    time after the issue (gpu_busy_s), none of it issue-bound."""
    fake = AsyncFakeCuda(delay=lambda label: 0.2 if label == "busy" else 0.0)
    try:
        be = CUDABackend(fake, record=True)
        be.launch(Stream.COMPUTE, lambda: None, [], label="busy")
        be.synchronize()
        (t,) = be.last_run
    finally:
        fake.close()
    assert t.issue_start_s <= t.issued_s <= t.end_s and t.issue_cpu_s >= 0
    r = OpRecord(0, "FWD:L0:m0:s0", Stream.COMPUTE, t.start_s, t.end_s, t.issue_start_s, t.issued_s, t.issue_cpu_s)
    assert r.gpu_busy_s >= 0.2 and r.issue_bound_s < 0.05 and r.gpu_busy_s + r.issue_bound_s == pytest.approx(
        r.duration_s)


def test_an_issuing_thread_held_by_the_gil_counts_as_blocked():
    """A host op holds the GIL (the builtin sum over a range is one C call, as DeepSpeed's
    adam_update) while a GPU op is being issued: its issue lasts the host op's call, and the issuing
    thread spends that time off a core, which the record shows as issue wall time without CPU time.
    FakeCuda runs the op's work on the issuing thread at issue, so the whole op is issue-bound."""
    go, done, held = threading.Event(), threading.Event(), []

    def host_op() -> None:
        go.wait()
        t0 = time.perf_counter()
        sum(range(3_000_000))  # holds the GIL throughout
        held.append(time.perf_counter() - t0)
        done.set()

    def issue() -> None:  # the op's Python on the issuing thread, until the host op finished
        go.set()
        x = torch.zeros(1)
        while not done.is_set():
            x.add_(1)  # releases the GIL in torch's dispatcher, as a launch does

    be = CUDABackend(FakeCuda(), record=True)
    be.launch(Stream.HOST, host_op, [], label="OPT")
    be.launch(Stream.COMPUTE, issue, [], label="FWD")
    be.synchronize()
    be.close()
    t = next(t for t in be.last_run if t.stream is Stream.COMPUTE)
    wall = t.issued_s - t.issue_start_s
    assert wall >= held[0] * 0.999
    assert wall - t.issue_cpu_s >= held[0] * 0.5, "the issuing thread ran on a core while the GIL was held"
    assert t.issued_s >= t.end_s, "FakeCuda's end marker is recorded as the issue ends"


def test_measured_timeline_splits_gpu_busy_from_issue_bound():
    """A training step on the CUDA backend over FakeCuda: every GPU op has issue times; the ops run
    as issued, so none of their time is GPU time after the issue and all of it issue-bound, the
    issuing thread's busy time covers them, and the JSON round-trips with the new fields."""
    torch.manual_seed(0)
    trainer = megatrain.compile(tiny_llama(layers=2), seq_len=16, micro_batch_size=2, micro_batches=2,
                                optimizer=dict(lr=1e-3))
    be = CUDABackend(adapter=FakeCuda(), record=True)
    trainer.backend = trainer.executor.backend = be
    trainer.step(random_batch(4, 16, 96, seed=0))
    tl = measured_timeline(be, trainer.schedule, trainer.graph, HW)
    for r in tl.records:
        assert (r.issued_s is None) == (r.stream in (Stream.HOST, Stream.CAST))
    gpu = {r.stream for r in tl.records if r.issued_s is not None}
    assert Stream.COMPUTE in gpu and set(tl.gpu_busy_s) == set(tl.issue_bound_s) == set(tl.issue_busy_s) == gpu
    for s in gpu:
        assert tl.gpu_busy_s[s] == 0.0
        assert tl.issue_bound_s[s] == pytest.approx(tl.busy_s[s])
        assert tl.issue_busy_s[s] >= tl.busy_s[s] and 0.0 <= tl.issue_blocked_s[s] <= tl.issue_busy_s[s]
    assert tl.gpu_busy_fraction[Stream.COMPUTE] == 0.0 and tl.issue_bound_fraction[Stream.COMPUTE] > 0
    assert Timeline.from_json(tl.to_json()) == tl
    trace = tl.to_chrome_trace()
    issue = [e for e in trace["traceEvents"] if e.get("cat") == "issue"]
    assert len(issue) == sum(r.issued_s is not None for r in tl.records)


def test_timeline_sums_the_split_per_stream():
    """from_records with issue times: per op, GPU-busy is the run after the issue ended, issue-bound
    the run before it; per stream their sums add up to busy_s; the issuing thread's busy seconds are
    the issue spans and its blocked seconds their time without CPU. Ops without issue times (host
    ops) are left out of them."""
    trainer = megatrain.compile(tiny_llama(layers=2), seq_len=16, micro_batch_size=2, micro_batches=1,
                                optimizer=dict(lr=1e-3))
    sched, g = trainer.schedule, trainer.graph
    recs, issue = [], {}
    t = 10.0  # any origin
    for i, op in enumerate(sched.ops):
        recs.append((i, op.stream, t, t + 1.0))
        if op.stream is Stream.COMPUTE:
            issue[i] = (t - 0.5, t + 0.25, 0.5)  # issued for 0.75 s, 0.5 s of it on a core; the GPU ran on 0.75 s
        t += 1.0
    tl = Timeline.from_records(sched, g, recs, HW, issue=issue)
    n = sum(op.stream is Stream.COMPUTE for op in sched.ops)
    assert tl.gpu_busy_s == {Stream.COMPUTE: pytest.approx(0.75 * n)}
    assert tl.issue_bound_s == {Stream.COMPUTE: pytest.approx(0.25 * n)}
    assert tl.issue_busy_s == {Stream.COMPUTE: pytest.approx(0.75 * n)}
    assert tl.issue_blocked_s == {Stream.COMPUTE: pytest.approx(0.25 * n)}
    assert tl.busy_s[Stream.COMPUTE] == pytest.approx(tl.gpu_busy_s[Stream.COMPUTE] + tl.issue_bound_s[Stream.COMPUTE])
    first = next(r for r in tl.records if r.issued_s is not None)
    assert first.issue_start_s == pytest.approx(first.start_s - 0.5)  # shifted with the records
    with pytest.raises(ValueError, match="give all three"):
        OpRecord(0, "FWD:L0:m0:s0", Stream.COMPUTE, 0.0, 1.0, issued_s=0.5)
    with pytest.raises(ValueError, match="the end not before the start"):
        OpRecord(0, "FWD:L0:m0:s0", Stream.COMPUTE, 0.0, 1.0, 0.5, 0.25, 0.0)


def test_timelines_written_before_the_issue_times_still_load():
    """The measured and predicted timelines of the first GPU session (bench/results/) have no issue
    times: they load, with empty splits, and write back as they were plus the empty fields."""
    doc = json.loads((RESULTS / "2026-11-27-h100-step-timelines.json").read_text())
    for kind in ("measured", "predicted"):
        tl = Timeline.from_json(json.dumps(doc[kind]))
        assert tl.gpu_busy_s == tl.issue_bound_s == tl.issue_busy_s == tl.issue_blocked_s == {}
        assert all(r.issued_s is None and r.gpu_busy_s is None for r in tl.records)
        back = json.loads(tl.to_json())
        assert {k: v for k, v in back.items() if k not in ("gpu_busy_s", "issue_bound_s", "issue_busy_s",
                                                           "issue_blocked_s", "records")} == \
            {k: v for k, v in doc[kind].items() if k != "records"}
        assert Timeline.from_json(tl.to_json()) == tl
