"""Tests for the simulator and the Timeline it returns."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs import chain_graph, chain_graphs, hardware_specs, spec
from megatrain.errors import ScheduleError
from megatrain.planner import cost
from megatrain.ir.hardware import PRESETS, HardwareSpec, preset
from megatrain.planner.lower import lower
from megatrain.ir.plan import Plan
from megatrain.ir.schedule import Op, OpKind, Schedule, Stream
from megatrain.planner.simulate import simulate, step_time_s
from megatrain.planner.timeline import Timeline
from megatrain.planner.verify import verify


def run(graph, plan, hw, mode="train"):
    s = lower(graph, plan, mode)
    verify(s, graph)
    return s, simulate(s, graph, hw)


def overlaps(a, b) -> bool:
    return a.start_s < b.end_s and b.start_s < a.end_s


def check_invariants(schedule, tl, hw, graph):
    """Properties every simulated timeline has, whatever the graph and spec."""
    recs = tl.records
    eps = 1e-12 * max(1.0, tl.step_time_s)
    assert [r.index for r in recs] == list(range(len(schedule.ops)))
    for r, op in zip(recs, schedule.ops):
        assert r.op == repr(op) and r.stream is op.stream
        for d in op.deps:
            assert r.start_s >= recs[d].end_s - eps, f"{r.op} starts before its dependency {recs[d].op} ends"
    by_resource = {}
    for r in recs:
        by_resource.setdefault(cost.resource_of(r.stream, hw), []).append(r)
    for res, rs in by_resource.items():
        rs.sort(key=lambda r: (r.start_s, r.index))
        for a, b in zip(rs, rs[1:]):
            assert b.start_s >= a.end_s - eps, f"{a.op} and {b.op} overlap on {res.value}"
    for s in Stream:  # in-order queues run in list order
        rs = [r for r in recs if r.stream is s]
        assert all(a.end_s <= b.start_s + eps for a, b in zip(rs, rs[1:]))
    busiest = max(tl.busy_s.values())
    # The issuing thread may leave gaps (a host op starts once it was handed over), at most its own time.
    total = sum(r.duration_s for r in recs) + sum(cost.launch_times(schedule, graph, hw))
    assert busiest - eps <= tl.step_time_s <= total + eps
    assert tl.bottleneck is max(Stream, key=lambda s: tl.busy_s[s])


# -- hand-checked cases ----------------------------------------------------------------------------

def test_one_layer_step_is_the_sum_of_its_chain():
    g = chain_graph(1, numel=1000, fwd_flops=10**6)
    s, tl = run(g, Plan(slots=1, prefetch_distance=0), spec())
    assert [repr(o) for o in s.ops] == ["H2D:L0:s0", "BWD:L0:m0:s0", "D2H:L0:s0:r0", "OPT:L0:r0"]
    layer, plan, hw = g.layers[0], s.plan, spec()
    expect = (cost.h2d_time(layer, plan, hw) + cost.bwd_time(layer, plan, hw) + cost.d2h_time(layer, hw)
              + cost.opt_time(layer, hw))
    assert tl.step_time_s == pytest.approx(expect)
    assert tl.source == "simulated" and tl.hardware == "test"
    assert tl.tokens_per_step == 16 and tl.tokens_per_s == pytest.approx(16 / expect)
    check_invariants(s, tl, hw, g)


def test_bottleneck_flips_between_compute_and_copy():
    g = chain_graph(8, numel=1 << 16, fwd_flops=10**7)  # 256 KiB of FP32 weights, 10 MFLOP forward
    fast_copy = spec(h2d_bytes_per_s=1e12, d2h_bytes_per_s=1e12, fp32_flops=1e9)
    slow_copy = spec(h2d_bytes_per_s=1e8, d2h_bytes_per_s=1e12, fp32_flops=1e12)
    _, compute_bound = run(g, Plan(), fast_copy)
    _, copy_bound = run(g, Plan(), slow_copy)
    assert compute_bound.bottleneck is Stream.COMPUTE
    assert copy_bound.bottleneck is Stream.H2D
    assert compute_bound.busy_fraction[Stream.COMPUTE] > 0.9
    assert copy_bound.busy_fraction[Stream.H2D] > 0.9
    slow_opt = spec(host_optimizer_params_per_s=1e3)
    _, host_bound = run(g, Plan(), slow_opt)
    assert host_bound.bottleneck is Stream.HOST


def test_prefetch_overlaps_copy_with_compute():
    # Copy and compute of a layer take about as long: 1 MiB at 1 GB/s ~ 1 ms, 1 MFLOP at 1 GFLOP/s.
    g = chain_graph(6, numel=1 << 18, fwd_flops=10**6)
    hw = spec()
    s_none, none = run(g, Plan(slots=1, prefetch_distance=0), hw)
    s_pre, pre = run(g, Plan(slots=2, prefetch_distance=1), hw)
    check_invariants(s_none, none, hw, g)
    check_invariants(s_pre, pre, hw, g)
    assert pre.step_time_s < 0.85 * none.step_time_s
    # Without prefetch nothing overlaps the copies: every H2D runs while compute idles.
    h2d = [r for r in none.records if r.stream is Stream.H2D]
    fc = [r for r in none.records if r.stream is Stream.COMPUTE]
    assert not any(overlaps(a, b) for a in h2d for b in fc)


def test_non_duplex_serialises_h2d_and_d2h():
    # Big gradients and weights in the backward: D2H of one layer and H2D of the next overlap on a
    # duplex link, and queue behind each other on one copy engine.
    g = chain_graph(6, numel=1 << 18, fwd_flops=10**5)
    duplex, simplex = spec(duplex=True), spec(duplex=False)
    s, tl_duplex = run(g, Plan(slots=3, prefetch_distance=2), duplex)
    _, tl_simplex = run(g, Plan(slots=3, prefetch_distance=2), simplex)
    copies = lambda tl, k: [r for r in tl.records if r.stream is k]  # noqa: E731
    pairs = lambda tl: [(a, b) for a in copies(tl, Stream.H2D) for b in copies(tl, Stream.D2H)]  # noqa: E731
    assert any(overlaps(a, b) for a, b in pairs(tl_duplex))
    assert not any(overlaps(a, b) for a, b in pairs(tl_simplex))
    assert tl_simplex.step_time_s > tl_duplex.step_time_s
    check_invariants(s, tl_simplex, simplex, g)


def test_gpu_memory_curve_peak_matches_hand_value_and_cost_model():
    g = chain_graph(3, numel=1024, act_bytes=4096, work_bytes=100)
    plan = Plan(micro_batches=2)
    s, tl = run(g, plan, spec())
    # See test_cost.test_activation_peak_by_hand for the terms.
    assert tl.gpu_peak_bytes == 16384 + 512 + 5 * 4096 + 100
    assert tl.gpu_peak_bytes == cost.memory_breakdown(g, plan, spec(), s).gpu_peak
    assert tl.gpu_memory[0] == (0.0, 16384 + 512)
    assert tl.gpu_memory[-1][1] == 16384  # everything but the fixed allocations is freed
    times = [t for t, _ in tl.gpu_memory]
    assert times == sorted(times) and times[-1] <= tl.step_time_s
    # FP32 compute pins the master rows (not the moments) as well as the gradient ring, and the
    # per-layer norms and flags take a page each (every row and tile here is whole pages).
    assert tl.pinned_peak_bytes == 3 * 1024 * 4 + 2 * 1024 * 4 + 2 * cost.HOST_PAGE_BYTES
    assert tl.pinned_peak_bytes == cost.memory_breakdown(g, plan, spec(), s).host_pinned
    assert tl.pinned_memory[-1] == (tl.step_time_s, tl.pinned_peak_bytes)


def test_eval_schedule_simulates():
    g = chain_graph(4, fwd_flops=10**6)
    s, tl = run(g, Plan(micro_batches=2), spec(), mode="eval")
    assert {r.kind for r in tl.records} == {OpKind.H2D, OpKind.FWD}
    assert tl.model_flops_per_step == cost.flops_per_step(g, s.plan, "eval")
    check_invariants(s, tl, spec(), g)


# -- deadlocks -------------------------------------------------------------------------------------

def _hand_schedule(*ops: Op) -> Schedule:
    return Schedule(ops=tuple(ops), plan=Plan(slots=2), n_layers=2)


def test_deadlock_on_a_dependency_behind_it_in_its_own_stream():
    g = chain_graph(2)
    s = _hand_schedule(Op(OpKind.H2D, 0, slot=0), Op(OpKind.FWD, 0, mb=0, slot=0, deps=(0, 3)),
                       Op(OpKind.H2D, 1, slot=1), Op(OpKind.BWD, 1, mb=0, slot=1, deps=(2,)))
    with pytest.raises(ScheduleError) as e:
        simulate(s, g, spec())
    msg = str(e.value)
    assert "2 of 4 ops can never start" in msg
    assert "#1 FWD:L0:m0:s0 waits for #3 BWD:L1:m0:s1 (queued after it on its own stream, compute)" in msg
    assert "--> " in msg and "Fix:" in msg


def test_deadlock_across_streams_names_every_stuck_head():
    g = chain_graph(2)
    # H2D:L1 waits for FWD:L1, which waits for H2D:L1: a cycle through two queues.
    s = _hand_schedule(Op(OpKind.H2D, 0, slot=0), Op(OpKind.FWD, 0, mb=0, slot=0, deps=(0,)),
                       Op(OpKind.H2D, 1, slot=1, deps=(3,)), Op(OpKind.FWD, 1, mb=0, slot=1, deps=(2,)))
    with pytest.raises(ScheduleError) as e:
        simulate(s, g, spec())
    msg = str(e.value)
    assert "h2d     #2 H2D:L1:s1 waits for #3 FWD:L1:m0:s1 (the blocked head of compute)" in msg
    assert "compute #3 FWD:L1:m0:s1 waits for #2 H2D:L1:s1 (the blocked head of h2d)" in msg
    # H2D:L0 waits for FWD:L1, which is queued behind FWD:L0, which waits for H2D:L0.
    s = _hand_schedule(Op(OpKind.H2D, 0, slot=0, deps=(2,)), Op(OpKind.FWD, 0, mb=0, slot=0, deps=(0,)),
                       Op(OpKind.FWD, 1, mb=0, slot=1))
    with pytest.raises(ScheduleError) as e:
        simulate(s, g, spec())
    assert ("#0 H2D:L0:s0 waits for #2 FWD:L1:m0:s1 (queued on compute behind the blocked head #1 "
            "FWD:L0:m0:s0)") in str(e.value)


def test_dependency_on_a_missing_op_is_an_error():
    s = _hand_schedule(Op(OpKind.H2D, 0, slot=0, deps=(5,)))
    with pytest.raises(ScheduleError, match=r"op #0 H2D:L0:s0 depends on op #5, which does not exist"):
        simulate(s, chain_graph(2), spec())


# -- Timeline --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_timeline():
    g = chain_graph(4, numel=1 << 14, fwd_flops=10**6, act_bytes=2048, work_bytes=512)
    s = lower(g, Plan(micro_batches=2, compute_dtype="bfloat16"))
    return s, g, simulate(s, g, spec())


def test_timeline_json_round_trip(small_timeline, tmp_path):
    _, _, tl = small_timeline
    back = Timeline.from_json(tl.to_json())
    assert back == tl
    tl.save(tmp_path / "t.json")
    assert Timeline.load(tmp_path / "t.json") == tl
    assert json.loads(tl.to_json())["version"] == 1
    assert Timeline.from_json(back.to_json(indent=1)).to_json() == tl.to_json()


def test_from_records_rebuilds_a_timeline(small_timeline):
    s, g, tl = small_timeline
    shift = 123.0  # measured clocks have an arbitrary origin
    recs = [(r.index, r.stream.value, r.start_s + shift, r.end_s + shift) for r in reversed(tl.records)]
    back = Timeline.from_records(s, g, recs, spec(), source="simulated")
    assert back.step_time_s == pytest.approx(tl.step_time_s)
    assert back.gpu_peak_bytes == tl.gpu_peak_bytes and back.bottleneck is tl.bottleneck
    assert Timeline.from_records(s, g, recs, spec()).source == "measured"
    with pytest.raises(ValueError, match=r"missing ops \[0\]"):
        Timeline.from_records(s, g, recs[:-1], spec())
    k = next(i for i, op in enumerate(s.ops) if op.stream is not Stream.HOST)
    bad = [(i, Stream.HOST if i == k else st_, a, b) for i, st_, a, b in recs]
    with pytest.raises(ValueError, match=f"op #{k} .* says stream 'host'"):
        Timeline.from_records(s, g, bad, spec())


def test_chrome_trace_has_one_event_per_op(small_timeline):
    s, _, tl = small_timeline
    trace = json.loads(json.dumps(tl.to_chrome_trace()))  # plain JSON types only
    events = trace["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(s.ops)
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(threads.values()) == sorted(st_.value for st_ in Stream)
    for e, op in zip(sorted(xs, key=lambda e: e["args"]["index"]), s.ops):
        assert e["name"] == repr(op) and e["cat"] == op.kind.value
        assert threads[e["tid"]] == op.stream.value
        assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e["pid"], int)
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"GPU memory", "pinned host memory"}
    assert max(e["args"]["bytes"] for e in counters if e["name"] == "GPU memory") == tl.gpu_peak_bytes
    last_end = max(e["ts"] + e["dur"] for e in xs)
    assert last_end == pytest.approx(tl.step_time_s * 1e6)


def test_save_png(small_timeline, tmp_path):
    pytest.importorskip("matplotlib")
    _, _, tl = small_timeline
    path = tmp_path / "t.png"
    tl.save_png(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# -- real graph and scale --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_graph():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatrain.planner.trace import trace

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return trace(model, micro_batch_size=1, seq_len=128).graph


def test_traced_llama_on_presets(llama_graph):
    g = llama_graph
    plan = Plan(micro_batches=2, compute_dtype="bfloat16")
    for name in ("H100_SXM", "RTX_4090"):
        hw = preset(name)
        s, tl = run(g, plan, hw)
        check_invariants(s, tl, hw, g)
        assert 0 < tl.mfu < 1
        assert tl.tokens_per_step == 2 * 128
        assert tl.model_flops_per_step == pytest.approx(3 * sum(la.fwd_flops for la in g.layers) * 2)
        m = cost.memory_breakdown(g, plan, hw, s)
        assert tl.gpu_peak_bytes == m.gpu_peak
        assert m.master_weights == 4 * sum(la.numel for la in g.layers)
        # A tiny model on a big GPU is issue-bound: the one issuing thread launches every kernel
        # in turn, so the step takes at least its launches, and little more.
        issue = sum(cost.launch_times(s, g, hw))
        assert issue <= tl.step_time_s < issue + 0.01
    # The same schedule is slower on the slower GPU and link.
    s = lower(g, plan)
    assert simulate(s, g, preset("RTX_4090")).step_time_s > simulate(s, g, preset("H100_SXM")).step_time_s


def _calls(fn):
    """``fn()`` and the Python and C function calls it made (``sys.setprofile``): the work a walk
    does, counted the same on any machine and under any load."""
    import sys

    n = 0

    def count(frame, event, arg):
        nonlocal n
        if event in ("call", "c_call"):
            n += 1

    sys.setprofile(count)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, n


def test_simulating_120_layers_8_micro_batches_scales_linearly():
    """The simulator's work grows about linearly with the ops: 4x the layers (4x the ops) makes
    under 6x the calls (a linear walk 4x, with its heaps' log factor a little more; a quadratic one
    16x). Work is counted, not timed: a wall-clock bound failed on a loaded machine (2,628 ops took
    19x the time of 648); the seconds are bench/plan_scale.py's."""
    def run(n_layers: int):
        g = chain_graph(n_layers, numel=1 << 20, fwd_flops=10**11, act_bytes=1 << 20, work_bytes=1 << 22)
        s = lower(g, Plan(micro_batches=8, compute_dtype="bfloat16"))
        tl, calls = _calls(lambda: simulate(s, g, preset("H200")))
        return g, s, tl, calls

    _, small, _, c_small = run(30)
    g, s, tl, c_big = run(120)
    assert len(s.ops) > 2000 and len(s.ops) >= 3.9 * len(small.ops)
    assert c_big < 6 * c_small, f"{len(s.ops)} ops made {c_big:,} calls, {len(small.ops)} ops {c_small:,}"
    check_invariants(s, tl, preset("H200"), g)


# -- properties ------------------------------------------------------------------------------------

@st.composite
def plans(draw, n_layers: int) -> Plan:
    slots = draw(st.integers(1, 3))
    resident = draw(st.sets(st.integers(0, n_layers - 1), max_size=min(2, n_layers)))
    return Plan(micro_batches=draw(st.integers(1, 3)), slots=slots,
                prefetch_distance=draw(st.integers(0, slots - 1)), grad_ring=draw(st.integers(1, 3)),
                resident=frozenset(resident), compute_dtype=draw(st.sampled_from(["float32", "bfloat16"])))


@st.composite
def cases(draw):
    g = draw(chain_graphs(max_layers=6))
    return g, draw(plans(len(g.layers))), draw(hardware_specs())


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(cases())
def test_lowered_schedules_never_deadlock_and_respect_the_dag(case):
    g, plan, hw = case
    s, tl = run(g, plan, hw)
    check_invariants(s, tl, hw, g)
    assert tl.gpu_peak_bytes == cost.memory_breakdown(g, plan, hw, s).gpu_peak
    # What the solver compares its candidates by: the same float, without the Timeline around it.
    assert step_time_s(s, g, hw) == tl.step_time_s


@PROPERTY
@given(cases(), st.sampled_from(["h2d", "d2h", "copies", "gpu", "host", "all"]), st.floats(1.0, 100.0))
def test_faster_hardware_never_slows_the_step(case, what, factor):
    g, plan, hw = case
    s = lower(g, plan)
    fields = {"h2d": ["h2d_bytes_per_s"], "d2h": ["d2h_bytes_per_s"],
              "copies": ["h2d_bytes_per_s", "d2h_bytes_per_s"], "gpu": ["bf16_flops", "fp32_flops"],
              "host": ["host_optimizer_params_per_s"]}
    names = fields.get(what) or [f for v in fields.values() for f in v]
    faster = hw.model_copy(update={f: getattr(hw, f) * factor for f in set(names)})
    before = simulate(s, g, hw).step_time_s
    after = simulate(s, g, faster).step_time_s
    assert after <= before * (1 + 1e-9)


# -- the issuing thread ---------------------------------------------------------------------------------

def test_issue_bound_step_takes_at_least_every_launch():
    g = chain_graph(3, numel=1000, fwd_flops=10)  # compute and copies take microseconds
    hw = spec(launch_overhead_s=1e-3)
    s, tl = run(g, Plan(micro_batches=2), hw)
    launch = cost.launch_times(s, g, hw)
    assert all(t > 0 for t in launch)
    assert sum(launch) <= tl.step_time_s <= sum(launch) + sum(r.duration_s for r in tl.records)
    check_invariants(s, tl, hw, g)
    assert run(g, Plan(micro_batches=2), spec())[1].step_time_s < 0.1 * tl.step_time_s


@pytest.mark.parametrize("launch", [1e-3, 0.0])
def test_issue_times_split_each_gpu_stream_as_a_measured_step_does(launch):
    """``issue_times=True`` gives each GPU op the simulated thread's issue: the same step, with each
    GPU stream's busy time split into issue-bound and GPU-busy seconds; host ops have none. Launches
    of 1 ms against microseconds of work leave every GPU op running while it is still being issued
    (ends with its issue); free launches leave none."""
    g = chain_graph(3, numel=1000, fwd_flops=10)
    hw = spec(launch_overhead_s=launch)
    s = lower(g, Plan(micro_batches=2))
    plain, tl = simulate(s, g, hw), simulate(s, g, hw, issue_times=True)
    assert [(r.start_s, r.end_s) for r in tl.records] == [(r.start_s, r.end_s) for r in plain.records]
    assert plain.issue_bound_s == plain.gpu_busy_s == {}
    launches = cost.launch_times(s, g, hw)
    for r in tl.records:
        host = r.stream in (Stream.HOST, Stream.CAST)
        assert (r.issued_s is None) == host
        if not host:
            assert r.issue_start_s <= r.start_s and r.issue_cpu_s == launches[r.index]
            assert r.issued_s - r.issue_start_s >= r.issue_cpu_s - 1e-12  # the rest: a host op held the thread
    gpu = {r.stream for r in tl.records if r.issued_s is not None}
    for st_ in gpu:
        assert tl.gpu_busy_s[st_] + tl.issue_bound_s[st_] == pytest.approx(tl.busy_s[st_], abs=1e-12)
    if launch:
        assert tl.issue_bound_s[Stream.COMPUTE] == pytest.approx(tl.busy_s[Stream.COMPUTE])
    else:
        assert sum(tl.issue_bound_s.values()) == 0.0

def test_gpu_op_gated_by_a_slow_host_op_does_not_hold_back_other_streams():
    # CAST:L0 is slow; H2D:L0 waits for it in the issuing thread's pending queue, while the
    # independent H2D:L1 (listed after it, on the same stream: it must wait, stream order) and
    # a FWD on the compute stream (given nothing to wait for) are issued at once.
    g = chain_graph(3, numel=1000)
    hw = spec(launch_overhead_s=1e-6, host_optimizer_params_per_s=1e3)
    s = Schedule(ops=(Op(OpKind.CAST, 0, tile=0), Op(OpKind.H2D, 0, slot=0, tile=0, deps=(0,)),
                      Op(OpKind.H2D, 1, slot=1), Op(OpKind.FWD, 0, mb=0, slot=2)),
                 plan=Plan(slots=3, prefetch_distance=2, compute_dtype="bfloat16", staging_ring=1), n_layers=3)
    tl = simulate(s, g, hw)
    rec = tl.records
    cast_end = rec[0].end_s
    assert cast_end > 0.2  # 1000 elements at 1e3 x 28/6 elements/s
    assert rec[3].end_s < 0.01, "the compute stream was not held back by the host op"
    assert rec[1].start_s >= cast_end and rec[2].start_s >= rec[1].end_s, "h2d keeps its list order"


# -- kernel by kernel ---------------------------------------------------------------------------------

def _kernel_by_kernel(issue, gpu, start, issue_start, clock=lambda t, s: t + s):
    """The oracle: kernel k is issued once the thread has spent ``issue[:k+1]`` (its clock mapping
    issue seconds to time), runs once issued and once the kernel before it ended."""
    t, c = start, 0.0
    for a, g in zip(issue, gpu):
        c += a
        if g > 0:
            t = max(t, clock(issue_start, c)) + g
    return max(t, clock(issue_start, c))  # the end event, recorded after the last launch


@given(st.lists(st.tuples(st.floats(0, 1e-3), st.floats(0, 1e-3)), min_size=1, max_size=40),
       st.floats(0, 1e-2), st.floats(0, 1e-2))
@settings(max_examples=200, deadline=None)
def test_compute_work_ends_when_its_last_kernel_does(kernels, ready, issued):
    issue, gpu = [a for a, _ in kernels], [g for _, g in kernels]
    work = cost.ComputeWork(issue, gpu, pre_s=0.0, post_s=0.0)
    start = max(ready, issued)  # the simulator starts a GPU op no earlier than its issue
    assert work.gpu_s == pytest.approx(sum(gpu))
    assert work.issue_s == pytest.approx(sum(issue))
    assert work.end(start, issued) == pytest.approx(_kernel_by_kernel(issue, gpu, start, issued), abs=1e-12)
    # GPU-bound and issue-bound are its two limits; their sum bounds it above.
    assert max(start + sum(gpu), issued + sum(issue)) <= work.end(start, issued) + 1e-12
    assert work.end(start, issued) <= start + sum(gpu) + sum(issue) + 1e-12


def test_compute_work_follows_a_stalled_issuing_thread():
    issue, gpu = [1.0] * 4, [0.5] * 4

    def stalled(t, s):  # the thread stops for 10 s after 2 s of issuing
        return t + s + (10.0 if s > 2.0 else 0.0)

    work = cost.ComputeWork(issue, gpu, pre_s=0.0, post_s=0.0)
    assert work.end(0.0, 0.0) == pytest.approx(4.5)
    assert work.end(0.0, 0.0, stalled) == pytest.approx(_kernel_by_kernel(issue, gpu, 0.0, 0.0, stalled))
    assert work.end(0.0, 0.0, stalled) == pytest.approx(14.5)


def _opt_then_fwd(stall: float):
    from graphs import kernel_spec, with_profiles
    from megatrain.ir.profile import Kernel, KernelKind

    mem = [Kernel("aten.add", KernelKind.MEMORY, nbytes=10**4)] * 100  # 10 us each on the GPU
    g = with_profiles(chain_graph(2, numel=10**6), mem, mem)
    # 1e6 parameters at 1e7 params/s: a 0.1 s host step; 100 ops at 1 ms each: 0.1 s of issuing.
    hw = kernel_spec(launch_overhead_s=1e-3, host_optimizer_params_per_s=1e7, host_optimizer_issue_stall=stall)
    s = Schedule(ops=(Op(OpKind.OPT, 0, ring=0), Op(OpKind.FWD, 1, mb=0, slot=0)),
                 plan=Plan(slots=1, prefetch_distance=0), n_layers=2)
    return s, g, hw, simulate(s, g, hw)


def test_a_host_op_that_holds_the_gil_stalls_the_issuing_thread():
    """DeepSpeed's CPU Adam holds the GIL for its whole call (hardware.HOST_KERNEL_ISSUE_STALL): a
    forward issued while it runs waits for it; torch's fused AdamW releases the GIL and stalls nothing."""
    # Times from the step's start (the OPT's, once it was handed to its worker). The forward's issue
    # (its start event, 100 ops and its end event, 1 ms each: 0.102 s) begins with the step.
    _, _, _, free = _opt_then_fwd(0.0)
    _, _, _, held = _opt_then_fwd(1.0)
    _, _, _, half = _opt_then_fwd(0.5)
    for tl in (free, held, half):
        assert tl.records[0].start_s == 0.0 and tl.records[0].end_s == pytest.approx(0.1)
    assert free.records[1].end_s == pytest.approx(0.102)
    assert held.records[1].end_s == pytest.approx(0.1 + 0.102)  # every launch waits for the step
    assert half.records[1].end_s == pytest.approx(0.1 + (0.102 - 0.05))  # held for the step's first half


def _opt_then_short_fwd(stall: float, cast: bool = False, slowdown: float = 0.0):
    """A host step (0.1 s; an OPT, or a CAST when ``cast``) and a forward issued as it begins, whose
    issue (its start event, 10 ops and its end event, 1 ms each: 12 ms) is far shorter than the step;
    ``slowdown``: the OPT's ``host_optimizer_issue_slowdown``."""
    from graphs import kernel_spec, with_profiles
    from megatrain.ir.profile import Kernel, KernelKind

    mem = [Kernel("aten.add", KernelKind.MEMORY, nbytes=10**4)] * 10
    g = with_profiles(chain_graph(2, numel=10**6), mem, mem)
    # 1e6 elements at 1e7 params/s (OPT) or elements/s (CAST): 0.1 s each.
    hw = kernel_spec(launch_overhead_s=1e-3, host_optimizer_params_per_s=1e7, host_cast_elements_per_s=1e7,
                     host_optimizer_issue_stall=stall, host_cast_issue_stall=stall,
                     host_optimizer_issue_slowdown=slowdown)
    first = Op(OpKind.CAST, 0, tile=0) if cast else Op(OpKind.OPT, 0, ring=0)
    plan = Plan(slots=1, prefetch_distance=0, compute_dtype="bfloat16" if cast else "float32")
    s = Schedule(ops=(first, Op(OpKind.FWD, 1, mb=0, slot=0)), plan=plan, n_layers=2)
    return simulate(s, g, hw)


def test_an_opt_blocks_issue_for_its_kernel_call_then_frees_it():
    """An OPT's GIL-holding kernel call comes first and its finite check's sum (which releases the GIL)
    last (HostAdamW.step), so a fraction f of an OPT blocks the thread for the OPT's first f of its
    time and not after; a CAST's fraction (cores and memory shared) slows it throughout instead. The
    two differ for an issue shorter than the step: blocked, it waits f x 0.1 s, then runs at full
    speed; slowed, it runs at 1 - f of its speed from the start."""
    issue, step = 0.012, 0.1
    for f in (0.25, 0.5, 0.875):
        opt, cast = _opt_then_short_fwd(f), _opt_then_short_fwd(f, cast=True)
        assert opt.records[0].end_s == pytest.approx(step) and cast.records[0].end_s == pytest.approx(step)
        assert opt.records[1].end_s == pytest.approx(f * step + issue)  # after the call, at full speed
        assert cast.records[1].end_s == pytest.approx(issue / (1 - f))  # at 1 - f of its speed all along
    # A whole-call hold (f = 1) is the same either way: nothing is issued until the step ends.
    assert _opt_then_short_fwd(1.0).records[1].end_s == pytest.approx(step + issue)
    assert _opt_then_short_fwd(1.0, cast=True).records[1].end_s == pytest.approx(step + issue)


def test_an_opt_that_releases_the_gil_slows_issue_after_its_call():
    """The rest of an OPT after its GIL-holding call (all of torch's fused AdamW, f = 0) slows the
    thread to 1 - s of its speed (``host_optimizer_issue_slowdown``: the kernel's threads share the
    cores and memory bandwidth): the 12 ms issue runs at 1 - s from the end of the call on."""
    issue, step = 0.012, 0.1
    for f, s in ((0.0, 0.2), (0.0, 0.5), (0.5, 0.2), (0.8, 0.3)):
        tl = _opt_then_short_fwd(f, slowdown=s)
        assert tl.records[0].end_s == pytest.approx(step)
        assert tl.records[1].end_s == pytest.approx(f * step + issue / (1 - s))
        assert tl.records[1].end_s > _opt_then_short_fwd(f).records[1].end_s  # later than without the slowdown
    # An issue that outlasts the slowed part finishes the rest at full speed: f = 0.9 leaves 10 ms
    # slowed by half (5 ms of issuing), then 7 ms at full speed.
    assert _opt_then_short_fwd(0.9, slowdown=0.5).records[1].end_s == pytest.approx(0.1 + 0.007)
    # A whole-call hold leaves nothing to slow.
    assert _opt_then_short_fwd(1.0, slowdown=0.5).records[1].end_s == pytest.approx(step + issue)


@given(chain_graphs(max_layers=5), st.integers(1, 3), st.floats(0, 1), st.floats(0, 1),
       st.sampled_from([1e-6, 1e-4]), st.sampled_from([0.0, 0.3, 0.9]))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_kernel_timelines_keep_every_invariant(g, micro_batches, opt_stall, cast_stall, launch, opt_slowdown):
    from graphs import kernel_spec, with_profiles
    from megatrain.ir.profile import Kernel, KernelKind

    fwd = [Kernel("aten.mm", KernelKind.MATMUL, flops=10**6, nbytes=10**4), Kernel("aten.view", KernelKind.NONE),
           Kernel("aten.add", KernelKind.MEMORY, nbytes=10**5)]
    bwd = fwd + [Kernel("aten.mm", KernelKind.MATMUL, flops=2 * 10**6, nbytes=10**4, autograd=True)]
    g = with_profiles(g, fwd, bwd)
    hw = kernel_spec(launch_overhead_s=launch, host_optimizer_issue_stall=opt_stall,
                     host_cast_issue_stall=cast_stall, host_optimizer_issue_slowdown=opt_slowdown)
    s, tl = run(g, Plan(micro_batches=micro_batches, compute_dtype="bfloat16"), hw)
    check_invariants(s, tl, hw, g)
    works = cost.compute_works(s, g, hw)
    for r, w in zip(tl.records, works):
        if w is not None:
            assert r.duration_s >= w.gpu_s - 1e-12  # a compute op never runs faster than its kernels


# -- copy/compute contention ------------------------------------------------------------------------

def _beside(*ops: Op, n_layers: int = 3) -> Schedule:
    return Schedule(ops=ops, plan=Plan(slots=3, prefetch_distance=2), n_layers=n_layers)


# 4 MiB FP32 tiles: an H2D takes 4.194304 ms alone at spec()'s 1 GB/s; a forward of 1e6 FLOPs 1 ms at
# 1 GFLOP/s, of 1e8 FLOPs 100 ms.
_TILE = 1 << 20
_ALONE = _TILE * 4 / 1e9


@pytest.mark.parametrize("copy_first", [False, True])
def test_a_forward_beside_an_h2d_takes_longer_by_the_slowdown(copy_first):
    """Both start at 0; the forward (1 ms alone) runs wholly beside the copy, at 1 - s of its speed;
    the copy runs at half its rate while the forward runs, at full rate after it. Either op may be
    committed first (list order breaks the tie), with the same times."""
    s, beside = 0.2, 0.5e9
    g = chain_graph(2, numel=_TILE, fwd_flops=10**6)
    hw = spec(compute_slowdown_beside_h2d=s, h2d_beside_compute_bytes_per_s=beside)
    fwd, h2d = Op(OpKind.FWD, 0, mb=0, slot=0), Op(OpKind.H2D, 1, slot=1)
    tl = simulate(_beside(*((h2d, fwd) if copy_first else (fwd, h2d)), n_layers=2), g, hw)
    rec = {r.op: r for r in tl.records}
    f, c = rec[repr(fwd)], rec[repr(h2d)]
    assert f.start_s == c.start_s == 0.0
    assert f.duration_s == pytest.approx(1e-3 / (1 - s), rel=1e-12)
    # While the forward runs the copy moves 0.5 GB/s x 1.25 ms; the rest of its bytes at 1 GB/s.
    assert c.duration_s == pytest.approx(f.duration_s + (_ALONE - f.duration_s * beside / 1e9), rel=1e-12)
    # Without the two fields: the times alone.
    plain = {r.op: r for r in simulate(_beside(fwd, h2d, n_layers=2), g, spec()).records}
    assert plain[repr(fwd)].duration_s == pytest.approx(1e-3) and plain[repr(h2d)].duration_s == pytest.approx(_ALONE)


@pytest.mark.parametrize("copy_first", [False, True])
def test_an_h2d_beside_compute_moves_its_bytes_at_the_rate_beside(copy_first):
    """Two copies back to back beside one long forward (100 ms alone): each takes bytes / the rate
    beside, the second revising the forward the first already slowed; the forward loses s of its speed
    for the time the copies ran."""
    s, beside = 0.2, 0.5e9
    g = chain_graph(3, numel=_TILE, fwd_flops=10**8)
    hw = spec(compute_slowdown_beside_h2d=s, h2d_beside_compute_bytes_per_s=beside)
    fwd, h1, h2 = Op(OpKind.FWD, 0, mb=0, slot=0), Op(OpKind.H2D, 1, slot=1), Op(OpKind.H2D, 2, slot=2)
    tl = simulate(_beside(*((h1, h2, fwd) if copy_first else (fwd, h1, h2))), g, hw)
    rec = {r.op: r for r in tl.records}
    copy_s = _TILE * 4 / beside
    assert rec[repr(h1)].duration_s == pytest.approx(copy_s, rel=1e-12)
    assert rec[repr(h2)].start_s == pytest.approx(copy_s, rel=1e-12)
    assert rec[repr(h2)].duration_s == pytest.approx(copy_s, rel=1e-12)
    assert rec[repr(fwd)].duration_s == pytest.approx(0.1 + 2 * copy_s * s, rel=1e-12)
    assert tl.step_time_s == pytest.approx(rec[repr(fwd)].end_s)


def test_an_issue_bound_forward_absorbs_a_kernel_slowdown_up_to_its_idle_time():
    """The slowdown applies to a compute op's kernels, not to the issuing thread: a forward with 10 ms
    of kernels issued over 20 ms ends with its issue beside a copy unless its kernels, slowed, take
    longer than that (module docstring, "Contention")."""
    from graphs import kernel_spec, with_profiles
    from megatrain.ir.profile import Kernel, KernelKind

    mem = [Kernel("aten.add", KernelKind.MEMORY, nbytes=10**5)] * 100  # 100 us each on the GPU
    g = with_profiles(chain_graph(2, numel=1 << 24), mem, mem)  # a 64 MiB tile: a copy of 67 ms
    fwd, h2d = Op(OpKind.FWD, 0, mb=0, slot=0), Op(OpKind.H2D, 1, slot=1)
    took = {}
    for slowdown in (0.0, 0.4, 0.6):
        hw = kernel_spec(launch_overhead_s=2e-4, compute_slowdown_beside_h2d=slowdown,
                         h2d_beside_compute_bytes_per_s=0.5e9)
        copy, f = simulate(_beside(h2d, fwd, n_layers=2), g, hw).records  # the copy issued first, 0.4 ms
        assert copy.start_s == 0.0 and copy.end_s > f.end_s and f.start_s == pytest.approx(4e-4)
        took[slowdown] = f.duration_s
    issue = 102 * 2e-4  # its start event, 100 ops and its end event
    assert took[0.0] == pytest.approx(issue) and took[0.4] == pytest.approx(issue)  # 10 ms / 0.6 < 20.4 ms
    assert took[0.6] == pytest.approx(0.01 / 0.4)  # 25 ms of slowed kernels > 20.4 ms of issue


def test_contention_at_its_defaults_leaves_every_time_as_it_was():
    """A spec written before the two fields, or with them at their defaults, has no contention; one
    whose rates beside equal its rates alone runs the contention path and gives the same times."""
    hw = spec()
    old = json.loads(hw.model_dump_json())
    del old["h2d_beside_compute_bytes_per_s"], old["compute_slowdown_beside_h2d"]
    assert HardwareSpec.model_validate(old) == hw and not hw.has_contention
    assert hw.h2d_beside_compute_bytes_per_s == 0 and hw.compute_slowdown_beside_h2d == 0
    assert all(not p.has_contention for p in PRESETS.values())
    assert cost.contention_rates(lower(chain_graph(2), Plan()), chain_graph(2), hw) is None


@PROPERTY
@given(cases(), st.booleans())
def test_contention_with_rates_beside_equal_to_alone_changes_nothing(case, kernels):
    g, plan, hw = case
    if kernels:
        from graphs import with_profiles
        from megatrain.ir.profile import Kernel, KernelKind

        fwd = [Kernel("aten.mm", KernelKind.MATMUL, flops=10**6, nbytes=10**4),
               Kernel("aten.add", KernelKind.MEMORY, nbytes=10**5)]
        g = with_profiles(g, fwd, fwd + [Kernel("aten.mm", KernelKind.MATMUL, flops=2 * 10**6, nbytes=10**4)])
        hw = hw.model_copy(update={"memory_bytes_per_s": 1e9, "attention_flops": 1e9, "attention_backward_flops": 1e9,
                                   "launch_overhead_s": 1e-5})
    s = lower(g, plan)
    same = hw.model_copy(update={"h2d_beside_compute_bytes_per_s": hw.h2d_bytes_per_s})
    assert same.has_contention and set(cost.contention_rates(s, g, same)) <= {1.0}
    a, b = simulate(s, g, hw), simulate(s, g, same)
    for x, y in zip(a.records, b.records):
        assert x.start_s == pytest.approx(y.start_s, rel=1e-9, abs=1e-15)
        assert x.end_s == pytest.approx(y.end_s, rel=1e-9, abs=1e-15)


def test_contention_never_moves_an_end_a_committed_op_relies_on():
    """Hypothesis found it (2026-12-03): a compute op starts once its issue begins, so one issued after
    a CAST was committed can start before it, beside the H2D whose staging tile that CAST refills;
    moving the H2D's end then put it after the CAST's start. Such a copy keeps its end (it is frozen:
    module docstring, "Contention"), and the compute op beside it is still timed beside it."""
    from megatrain.ir.plan import OptimizerPlacement

    g = chain_graph(5, numel=[16, 64, 16, 16, 16], trainable=[True, False, False, False, False], fwd_flops=0,
                    act_bytes=4)
    plan = Plan(micro_batches=1, slots=2, prefetch_distance=1, layer_by_layer=True,
                optimizer=OptimizerPlacement.DURING_BACKWARD, compute_dtype="bfloat16")
    hw = spec(h2d_bytes_per_s=1198191.0, d2h_bytes_per_s=1e6, duplex=False, host_optimizer_params_per_s=685715.0,
              kernel_overhead_s=2e-6, bf16_flops=1e6, fp32_flops=1e6, op_latency_s=1e-5, launch_overhead_s=1e-5,
              gpu_reserve_bytes=0)
    contended = hw.model_copy(update={"h2d_beside_compute_bytes_per_s": 0.5 * hw.h2d_bytes_per_s})
    s, tl = run(g, plan, contended)
    check_invariants(s, tl, contended, g)
    _, alone = run(g, plan, hw)
    slower = [r.op for r, a in zip(tl.records, alone.records) if r.duration_s > a.duration_s * (1 + 1e-9)]
    assert any(op.startswith("H2D") for op in slower)  # contention still slows the copies it can


@PROPERTY
@given(cases(), st.floats(0, 0.9), st.floats(0.05, 1.0))
def test_contended_timelines_keep_every_invariant(case, slowdown, beside):
    """With contention every invariant holds, and copies and compute ops never run faster than alone."""
    g, plan, hw = case
    hw = hw.model_copy(update={"compute_slowdown_beside_h2d": slowdown,
                               "h2d_beside_compute_bytes_per_s": beside * hw.h2d_bytes_per_s})
    s, tl = run(g, plan, hw)
    check_invariants(s, tl, hw, g)
    alone = cost.op_times(s, g, hw)
    eps = 1e-12 * max(1.0, tl.step_time_s)
    for r, t in zip(tl.records, alone):
        if r.stream in (Stream.COMPUTE, Stream.H2D):
            assert r.duration_s >= t * (1 - 1e-9) - eps


# -- copies in flight slow the issuing thread -------------------------------------------------------

def _copy_then_fwd(issue_slowdown: float, tile: int, **overrides) -> Timeline:
    """An H2D of a ``tile``-element FP32 tile (issued first, 2 launches: 0.4 ms) and a forward issued
    right after it, issue-bound: its start event, 100 element-wise ops and its end event at 0.2 ms
    each (20.4 ms of issue) against 100 x 100 us of kernels."""
    from graphs import kernel_spec, with_profiles
    from megatrain.ir.profile import Kernel, KernelKind

    mem = [Kernel("aten.add", KernelKind.MEMORY, nbytes=10**5)] * 100
    g = with_profiles(chain_graph(2, numel=tile), mem, mem)
    hw = kernel_spec(launch_overhead_s=2e-4, issue_slowdown_beside_h2d=issue_slowdown, **overrides)
    return simulate(_beside(Op(OpKind.H2D, 1, slot=1), Op(OpKind.FWD, 0, mb=0, slot=0), n_layers=2), g, hw,
                    issue_times=True)


_FWD_ISSUE = 102 * 2e-4


@pytest.mark.parametrize("c", [0.0, 0.2, 0.5])
def test_a_forward_issued_beside_a_copy_in_flight_issues_at_1_minus_c_of_its_speed(c):
    """The copy (64 MiB: 67 ms) is in flight for the forward's whole issue, so its 20.4 ms of launches
    take 20.4 / (1 - c) ms, and the issue-bound forward ends with them; the copy itself is not slowed
    (that is compute_slowdown's and h2d_beside_compute's, unset here), nor its own launch."""
    copy, f = _copy_then_fwd(c, 1 << 24).records
    assert copy.start_s == 0.0 and copy.duration_s == pytest.approx((1 << 24) * 4 / 1e9, rel=1e-12)
    assert copy.issued_s - copy.issue_start_s == pytest.approx(4e-4, rel=1e-12)
    assert f.issue_start_s == pytest.approx(4e-4, rel=1e-12) and copy.end_s > f.end_s
    assert f.issued_s - f.issue_start_s == pytest.approx(_FWD_ISSUE / (1 - c), rel=1e-12)
    assert f.end_s == pytest.approx(f.issued_s, rel=1e-12)  # issue-bound: 10 ms of kernels


@pytest.mark.parametrize("c", [0.2, 0.5])
def test_only_the_launches_while_the_copy_is_in_flight_are_slowed(c):
    """A 4 MiB copy (4.19 ms) ends while the forward is issued: the launches over the overlap ``O``
    take their time / (1 - c), so ``O (1 - c)`` seconds of launching were done in it and the rest at
    full speed after it: the issue takes 20.4 ms + c x O."""
    copy, f = _copy_then_fwd(c, 1 << 20).records
    overlap = copy.end_s - f.issue_start_s
    assert copy.end_s == pytest.approx(_ALONE, rel=1e-12) and 0 < overlap < _FWD_ISSUE
    assert f.issued_s - f.issue_start_s == pytest.approx(_FWD_ISSUE + c * overlap, rel=1e-12)


def _copy_host_fwd(kind: OpKind, stall: float, c: float) -> Timeline:
    """A copy (134 ms, issued first: 2 launches of 1 ms), a host op of 0.1 s (a CAST, or an OPT:
    handed over in 1 launch) and a short forward (its start event, 10 ops and its end event, 1 ms
    each: 12 ms), issued in that order."""
    from graphs import kernel_spec, with_profiles
    from megatrain.ir.profile import Kernel, KernelKind

    cast = kind is OpKind.CAST
    mem = [Kernel("aten.add", KernelKind.MEMORY, nbytes=10**4)] * 10
    g = with_profiles(chain_graph(3, numel=[10**6, 1 << (26 if cast else 25), 10**6]), mem, mem)
    hw = kernel_spec(launch_overhead_s=1e-3, host_optimizer_params_per_s=1e7, host_cast_elements_per_s=1e7,
                     host_optimizer_issue_stall=stall, host_cast_issue_stall=stall, issue_slowdown_beside_h2d=c)
    host = Op(OpKind.CAST, 0, tile=0) if cast else Op(OpKind.OPT, 0, ring=0)
    plan = Plan(slots=3, prefetch_distance=2, compute_dtype="bfloat16" if cast else "float32")
    s = Schedule(ops=(Op(OpKind.H2D, 1, slot=1), host, Op(OpKind.FWD, 2, mb=0, slot=2)), plan=plan, n_layers=3)
    return simulate(s, g, hw, issue_times=True)


@pytest.mark.parametrize("kind", [OpKind.CAST, OpKind.OPT])
def test_a_copy_in_flight_and_a_host_op_stall_combine(kind):
    """Where a CAST slows the thread (to 1 - f) while a copy is in flight (1 - c), the thread issues at
    (1 - f)(1 - c) of its speed; where an OPT's kernel call stops it, it waits, then issues at 1 - c.
    The host op's hand-over, issued beside the copy, takes its 1 ms / (1 - c)."""
    f, c = 0.5, 0.2
    copy, host, fwd = _copy_host_fwd(kind, f, c).records
    assert copy.start_s == 0.0 and copy.issued_s == pytest.approx(2e-3) and copy.end_s > fwd.issued_s
    assert host.start_s == pytest.approx(2e-3 + 1e-3 / (1 - c)) and host.duration_s == pytest.approx(0.1)
    if kind is OpKind.CAST:
        assert fwd.issue_start_s == pytest.approx(host.start_s) and fwd.issued_s < host.end_s
        assert fwd.issued_s - fwd.issue_start_s == pytest.approx(12e-3 / ((1 - f) * (1 - c)))
        alone = _copy_host_fwd(kind, f, 0.0).records[2]
        assert alone.issued_s - alone.issue_start_s == pytest.approx(12e-3 / (1 - f))
    else:
        assert fwd.issue_start_s == pytest.approx(host.start_s + f * 0.1)  # the GIL-holding call, then free
        assert fwd.issued_s - fwd.issue_start_s == pytest.approx(12e-3 / (1 - c))


@pytest.mark.parametrize("c", [0.25, 0.5])
def test_a_copy_the_pair_slows_slows_the_forward_it_slows_for_longer(c):
    """With contention too, the forward committed beside the copy moves the copy's end later (0.5 GB/s
    beside it), while the forward is still being issued: its issue is re-timed over the copy's new
    end, so it takes 20.4 ms + c x its overlap with the copy as the timeline has it."""
    copy, f = _copy_then_fwd(c, 1 << 20, h2d_beside_compute_bytes_per_s=0.5e9).records
    t = f.start_s
    assert t == pytest.approx(4e-4) and copy.end_s == pytest.approx(t + (_ALONE - t) / 0.5, rel=1e-12)
    overlap = copy.end_s - f.issue_start_s
    assert f.issued_s - f.issue_start_s == pytest.approx(_FWD_ISSUE + c * overlap, rel=1e-12)
    assert f.end_s == pytest.approx(f.issued_s, rel=1e-12)


def test_issue_slowdown_at_its_default_leaves_every_time_as_it_was():
    """A spec written before the field reads as 0, no preset sets it, and it is apart from the
    copy/compute contention's ``has_contention``."""
    hw = spec()
    old = json.loads(hw.model_dump_json())
    del old["issue_slowdown_beside_h2d"]
    assert HardwareSpec.model_validate(old) == hw and hw.issue_slowdown_beside_h2d == 0
    assert not hw.has_issue_contention and all(not p.has_issue_contention for p in PRESETS.values())
    one = spec(issue_slowdown_beside_h2d=0.1)
    assert one.has_issue_contention and not one.has_contention
    with pytest.raises(ValueError):
        spec(issue_slowdown_beside_h2d=1.0)


@PROPERTY
@given(cases(), st.booleans(), st.sampled_from([0.0, 0.3]), st.floats(0, 1), st.floats(0, 1))
def test_issue_slowdown_0_times_every_op_as_the_host_windows_alone(case, kernels, slowdown, opt, cast):
    """At 0 the simulator keeps no copy window and its thread is the host ops' windows alone, as before
    the field (compared against that structure: every record exactly equal), whatever else is set."""
    from unittest import mock

    from megatrain.planner import simulate as simulate_module

    class HostOnly(simulate_module._Stalls):  # the issuing thread as it was: one set of windows
        host = property(lambda self: self)
        copies = property(lambda self: pytest.fail("a copy window at issue_slowdown_beside_h2d = 0"))

    g, plan, hw = case
    if kernels:
        g, hw = _kernels(g, hw)
    hw = hw.model_copy(update={"compute_slowdown_beside_h2d": slowdown, "h2d_beside_compute_bytes_per_s":
                               0.5 * hw.h2d_bytes_per_s if slowdown else 0.0,
                               "host_optimizer_issue_stall": opt, "host_cast_issue_stall": cast})
    s = lower(g, plan)
    got = simulate(s, g, hw, issue_times=True)
    with mock.patch.object(simulate_module, "_Thread", HostOnly):
        want = simulate(s, g, hw, issue_times=True)
    assert got.records == want.records


def _kernels(g, hw):
    from graphs import with_profiles
    from megatrain.ir.profile import Kernel, KernelKind

    fwd = [Kernel("aten.mm", KernelKind.MATMUL, flops=10**6, nbytes=10**4),
           Kernel("aten.add", KernelKind.MEMORY, nbytes=10**5)]
    g = with_profiles(g, fwd, fwd + [Kernel("aten.mm", KernelKind.MATMUL, flops=2 * 10**6, nbytes=10**4)])
    return g, hw.model_copy(update={"memory_bytes_per_s": 1e9, "attention_flops": 1e9,
                                    "attention_backward_flops": 1e9, "launch_overhead_s": 1e-5})


@PROPERTY
@given(cases(), st.booleans(), st.floats(0, 0.9), st.sampled_from([0.0, 0.3]), st.floats(0, 1))
def test_timelines_with_copies_slowing_the_thread_keep_every_invariant(case, kernels, c, slowdown, opt):
    """Every invariant holds; no issue takes less wall time than its launches, nor, beside copies, less
    than its launches plus ``c`` x its overlap with them (at least that share was done at 1 - c)."""
    g, plan, hw = case
    if kernels:
        g, hw = _kernels(g, hw)
    hw = hw.model_copy(update={"issue_slowdown_beside_h2d": c, "compute_slowdown_beside_h2d": slowdown,
                               "h2d_beside_compute_bytes_per_s": 0.5 * hw.h2d_bytes_per_s if slowdown else 0.0,
                               "host_optimizer_issue_stall": opt})
    s, tl = run(g, plan, hw)
    check_invariants(s, tl, hw, g)
    timed = simulate(s, g, hw, issue_times=True)
    copies = [r for r in timed.records if r.stream is Stream.H2D]
    for r in timed.records:
        if r.issued_s is None:
            continue
        wall = r.issued_s - r.issue_start_s
        beside = sum(max(0.0, min(r.issued_s, x.end_s) - max(r.issue_start_s, x.start_s))
                     for x in copies if x.index != r.index)
        assert wall >= r.issue_cpu_s + c * beside - 1e-9 * max(1.0, tl.step_time_s)
