"""Tests for the plan solvers: optimality against the default plan, monotonicity, agreement of
the MILP and enumeration, residency, infeasibility with minima that work, and the lower bound."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphs import chain_graph, chain_graphs, hardware_specs, spec
from megatrain.errors import PlanError
from megatrain.planner import cost, solve as solve_mod
from megatrain.planner.hardware import preset
from megatrain.planner.lower import lower
from megatrain.planner.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.planner.presets import MODEL_PRESETS, dense_decoder_param_count
from megatrain.planner.simulate import simulate
from megatrain.planner.solve import (InfeasibleRequestError, SolveLimits, SolveRequest, greedy_knapsack,
                                     milp_knapsack, minimum_requirements, scale_graph, solve, solve_enumerate,
                                     solve_milp)
from megatrain.planner.verify import verify

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
batches = st.sampled_from([1, 2, 4, 6])
dtypes = st.sampled_from(["float32", "bfloat16"])


def fits(mem, hw) -> bool:
    return (mem.gpu_peak <= hw.gpu_memory_bytes and mem.host_total <= hw.host_memory_bytes
            and mem.host_pinned <= hw.pinned_memory_cap_bytes)


def check_solution(sol, request) -> None:
    """What every solution satisfies: lowerable, verified, within memory, as predicted."""
    plan, hw = sol.plan, request.hardware
    assert plan.layer_by_layer and plan.optimizer is OptimizerPlacement.DURING_BACKWARD
    assert all(plan.activation(i) is ActivationPolicy.KEEP for i in range(len(sol.graph.layers)))
    assert plan.micro_batches * sol.micro_batch_size == request.global_batch
    assert plan.compute_dtype == request.compute_dtype
    sched = lower(sol.graph, plan)
    verify(sched, sol.graph)
    assert sched == sol.schedule
    assert sol.memory == cost.memory_breakdown(sol.graph, plan, hw, sched)
    assert fits(sol.memory, hw)
    assert sol.timeline.step_time_s == pytest.approx(simulate(sched, sol.graph, hw).step_time_s, rel=1e-12)
    assert 1 <= sol.simulated <= sol.candidates


def tight_hw(graph, global_batch, dtype, frac, **kw):
    """A spec whose GPU memory is ``frac`` of the way from the minimum to everything resident."""
    base = spec(**kw)
    need = minimum_requirements(SolveRequest(graph, base, global_batch, dtype))
    slot = need.memory.weight_slots + need.memory.gradient_slots
    roomy = need.gpu_memory_bytes + (len(graph.layers) + 3) * slot
    return spec(**kw, gpu_memory_bytes=int(need.gpu_memory_bytes + frac * (roomy - need.gpu_memory_bytes)))


# -- scaling ---------------------------------------------------------------------------------------

def test_scale_graph_equals_a_graph_built_for_the_larger_micro_batch():
    g1 = chain_graph(4, numel=[100, 200, 300, 400], fwd_flops=[1, 2, 3, 4], act_bytes=4096, work_bytes=[5, 6, 7, 8],
                     buffer_bytes=64, micro_batch_size=1, seq_len=16)
    g4 = chain_graph(4, numel=[100, 200, 300, 400], fwd_flops=[4, 8, 12, 16], act_bytes=4 * 4096,
                     work_bytes=[20, 24, 28, 32], buffer_bytes=64, micro_batch_size=4, seq_len=16)
    s = scale_graph(g1, 4)
    assert s.layers == g4.layers and s.values == g4.values and s.micro_batch_size == 4
    assert scale_graph(g1, 1) is g1
    assert scale_graph(scale_graph(g1, 2), 4).values == s.values
    with pytest.raises(ValueError, match="not a positive multiple"):
        scale_graph(scale_graph(g1, 2), 3)


def test_scale_graph_of_a_traced_llama_matches_tracing_at_that_size():
    from conftest import tiny_llama
    from megatrain.planner.trace import trace

    model = tiny_llama(layers=2, device="meta")
    g1 = trace(model, micro_batch_size=1, seq_len=8).graph
    g3 = trace(model, micro_batch_size=3, seq_len=8).graph
    s3 = scale_graph(g1, 3)
    for a, b in zip(s3.layers, g3.layers):
        assert (a.fwd_flops, a.bwd_flops) == (b.fwd_flops, b.bwd_flops)  # exact: per token and per sequence
        assert a.work_bytes >= b.work_bytes  # batch-independent rotary work is over-counted, never under
    for a, b in zip(s3.values, g3.values):
        assert a.nbytes >= b.nbytes
        if b.requires_grad or b.producer == -1:  # residual stream and batch inputs scale exactly
            assert a.nbytes == b.nbytes


# -- knapsacks -------------------------------------------------------------------------------------

@FAST
@given(st.lists(st.tuples(st.floats(0, 100), st.integers(1, 20)), min_size=0, max_size=9), st.integers(0, 60))
def test_milp_knapsack_is_optimal_and_greedy_is_optimal_for_equal_weights(items, capacity):
    values, weights = [v for v, _ in items], [w for _, w in items]
    best = max((sum(values[i] for i in c) for r in range(len(items) + 1)
                for c in itertools.combinations(range(len(items)), r)
                if sum(weights[i] for i in c) <= capacity), default=0.0)
    tol = 1e-6 * max(values, default=0.0)  # HiGHS's optimality tolerance, relative to the largest value
    got = milp_knapsack(values, weights, capacity)
    assert sum(weights[i] for i in got) <= capacity
    assert sum(values[i] for i in got) == pytest.approx(best, rel=0, abs=tol)
    equal = [7] * len(values)
    g, m = greedy_knapsack(values, equal, capacity), milp_knapsack(values, equal, capacity)
    assert sum(values[i] for i in g) == pytest.approx(best_equal := sum(values[i] for i in m), rel=0, abs=tol)
    assert best_equal <= sum(values[i] for i in g) + tol


def test_knapsacks_break_ties_alike():
    assert greedy_knapsack([1.0] * 6, [1] * 6, 3) == milp_knapsack([1.0] * 6, [1] * 6, 3) == {0, 1, 2}
    assert greedy_knapsack([0.0, -1.0, 2.0], [1, 1, 1], 3) == milp_knapsack([0.0, -1.0, 2.0], [1, 1, 1], 3) == {2}


# -- the bound the search prunes with --------------------------------------------------------------

@FAST
@given(chain_graphs(max_layers=6), hardware_specs(), st.integers(1, 3), st.data())
def test_lower_bound_never_exceeds_the_simulated_step_and_equals_it_with_duplex_copies(g, hw, M, data):
    slots = data.draw(st.integers(1, 4))
    k = solve_mod._Knobs(slots, data.draw(st.integers(0, slots - 1)), data.draw(st.integers(1, 3)), 1,
                         frozenset(data.draw(st.sets(st.integers(0, len(g.layers) - 1), max_size=3))))
    req = SolveRequest(g, hw, M, "float32")
    plan = solve_mod._plan(req, 1, k)
    probe = Plan(compute_dtype="float32")
    size = solve_mod._SizeOption(1, M, g, None, fwd=tuple(M * cost.fwd_time(x, probe, hw) for x in g.layers),
                                 bwd=tuple(M * cost.bwd_time(x, probe, hw) for x in g.layers))
    times = solve_mod._Times(tuple(cost.h2d_time(x, probe, hw) for x in g.layers),
                             tuple(cost.d2h_time(x, hw) for x in g.layers),
                             tuple(cost.opt_time(x, hw) for x in g.layers))
    bound = solve_mod._lower_bound(solve_mod._pattern(g, k), size, times, hw.duplex)
    step = simulate(lower(g, plan), g, hw).step_time_s
    assert bound <= step * (1 + 1e-9)
    if hw.duplex:
        assert bound == pytest.approx(step, rel=1e-9)


# -- solver properties -----------------------------------------------------------------------------

@FAST
@given(chain_graphs(max_layers=6), hardware_specs(), batches, dtypes)
def test_solved_plan_is_never_slower_than_the_default_plan(g, hw, G, dtype):
    req = SolveRequest(g, hw, G, dtype)
    sol = solve(req, "enumerate")
    check_solution(sol, req)
    default = Plan(compute_dtype=dtype)
    gG = scale_graph(g, G)
    sched = lower(gG, default)
    if fits(cost.memory_breakdown(gG, default, hw, sched), hw):
        assert sol.step_time_s <= simulate(sched, gG, hw).step_time_s * (1 + 1e-9)


@FAST
@given(chain_graphs(max_layers=6), hardware_specs(), batches, st.floats(0.0, 1.0),
       st.sampled_from(["h2d", "d2h", "gpu", "host_opt"]), st.floats(1.0, 10.0))
def test_more_bandwidth_memory_or_optimizer_speed_never_makes_the_predicted_step_slower(g, hw, G, frac, what, factor):
    kw = {f: getattr(hw, f) for f in ("bf16_flops", "fp32_flops", "h2d_bytes_per_s", "d2h_bytes_per_s",
                                      "host_optimizer_params_per_s", "matmul_efficiency", "duplex", "op_latency_s")}
    slow = tight_hw(g, G, "bfloat16", frac, **kw)
    change = {"h2d": {"h2d_bytes_per_s": hw.h2d_bytes_per_s * factor},
              "d2h": {"d2h_bytes_per_s": hw.d2h_bytes_per_s * factor},
              "gpu": {"gpu_memory_bytes": int(slow.gpu_memory_bytes * factor)},
              "host_opt": {"host_optimizer_params_per_s": hw.host_optimizer_params_per_s * factor}}[what]
    fast = slow.model_copy(update=change)
    t_slow = solve(SolveRequest(g, slow, G)).step_time_s
    t_fast = solve(SolveRequest(g, fast, G)).step_time_s
    assert t_fast <= t_slow * (1 + 1e-9)


@FAST
@given(chain_graphs(max_layers=8), hardware_specs(), batches, st.floats(0.0, 1.0), dtypes)
def test_milp_and_enumeration_agree(g, hw, G, frac, dtype):
    kw = {f: getattr(hw, f) for f in ("bf16_flops", "fp32_flops", "h2d_bytes_per_s", "d2h_bytes_per_s",
                                      "host_optimizer_params_per_s", "matmul_efficiency", "duplex", "op_latency_s")}
    req = SolveRequest(g, tight_hw(g, G, dtype, frac, **kw), G, dtype)
    a, b = solve_enumerate(req), solve_milp(req)
    check_solution(a, req)
    check_solution(b, req)
    assert a.method == "enumerate" and b.method == "milp"
    assert b.step_time_s == pytest.approx(a.step_time_s, rel=0.01)


def test_a_model_that_nearly_fits_is_made_mostly_resident():
    # H2D-bound: 1 MiB of FP32 weights per layer at 1 GB/s against 10 kFLOP at 1 GFLOP/s, and
    # gradients leave 10x faster, so every copy saved shortens the step.
    n = 12
    g = chain_graph(n, numel=1 << 18, fwd_flops=10**4)
    need = minimum_requirements(SolveRequest(g, spec(), 2, "float32"))
    slot = need.memory.weight_slots + need.memory.gradient_slots
    hw = spec(gpu_memory_bytes=need.gpu_memory_bytes + (n - 1) * slot, d2h_bytes_per_s=1e10)  # n slots
    req = SolveRequest(g, hw, 2, "float32")
    sol = solve(req)
    check_solution(sol, req)
    # Resident, or still in a streaming slot at the turn to backward: about every layer is copied once.
    assert len(sol.plan.resident) >= n // 2
    assert sum(op.kind.value == "H2D" for op in sol.schedule.ops) <= n + 1
    streamed = solve(SolveRequest(g, hw.model_copy(update={"gpu_memory_bytes": need.gpu_memory_bytes + slot}),
                                  2, "float32"))
    assert not streamed.plan.resident
    assert sol.step_time_s < 0.7 * streamed.step_time_s


def test_larger_micro_batches_are_chosen_when_they_fit_and_smaller_when_memory_is_tight():
    g = chain_graph(6, numel=1 << 12, fwd_flops=10**6, act_bytes=1 << 16, work_bytes=1 << 20)
    roomy = solve(SolveRequest(g, spec(op_latency_s=1e-5), 8, "float32"))
    assert roomy.micro_batch_size == 8  # fewest ops, least latency
    need8 = cost.memory_breakdown(scale_graph(g, 8), Plan(compute_dtype="float32", slots=1, prefetch_distance=0,
                                                           grad_ring=1), spec()).gpu_peak
    tight = solve(SolveRequest(g, spec(op_latency_s=1e-5, gpu_memory_bytes=need8 - 1), 8, "float32"))
    assert tight.micro_batch_size < 8
    check_solution(tight, SolveRequest(g, spec(op_latency_s=1e-5, gpu_memory_bytes=need8 - 1), 8, "float32"))


def test_given_graphs_replace_scaling_for_their_sizes():
    g = chain_graph(3, act_bytes=4096)
    heavy = chain_graph(3, act_bytes=10**12, micro_batch_size=2)  # does not fit: size 2 must be skipped
    req = SolveRequest(g, spec(), 2, "float32", graphs={2: heavy})
    sol = solve(req)
    assert sol.micro_batch_size == 1
    assert req.graph_for(2) is heavy and req.graph_for(1) is g
    with pytest.raises(PlanError, match="micro_batch_size=2"):
        SolveRequest(g, spec(), 4, "float32", graphs=lambda m: heavy).graph_for(4)


def test_limits_restrict_the_search():
    g = chain_graph(5, numel=1 << 16, fwd_flops=10**6)
    req = SolveRequest(g, spec(), 4, "bfloat16", limits=SolveLimits(max_slots=1, max_grad_ring=1,
                                                                       micro_batch_sizes=(2,)))
    sol = solve(req)
    assert (sol.plan.slots, sol.plan.prefetch_distance, sol.plan.grad_ring, sol.micro_batch_size) == (1, 0, 1, 2)
    with pytest.raises(PlanError, match="do not divide"):
        solve(replace(req, limits=SolveLimits(micro_batch_sizes=(3,))))
    with pytest.raises(PlanError, match="unknown solver"):
        solve(req, "annealing")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="max_simulations"):
        SolveLimits(max_simulations=0)


# -- infeasibility ---------------------------------------------------------------------------------

MINIMA = re.compile(r"GPU (\d+) bytes .*host (\d+) bytes .*pinned (\d+) bytes")


@pytest.mark.parametrize("case", ["activations", "slot", "host", "pinned_fp32"])
def test_infeasible_request_names_minima_and_obstacle_and_the_minima_work(case):
    numel = [1 << 10] * 5
    if case == "slot":
        numel[3] = 1 << 24  # a 16M-element layer: its slot alone does not fit
    g = chain_graph(5, numel=numel, act_bytes=1 << 20, work_bytes=[0, 0, 5 << 20, 0, 0])
    dtype = "float32" if case == "pinned_fp32" else "bfloat16"
    hw = {"activations": spec(gpu_memory_bytes=8 << 20), "slot": spec(gpu_memory_bytes=8 << 20),
          "host": spec(host_memory_bytes=10_000, pinned_memory_cap_bytes=10_000),
          "pinned_fp32": spec(pinned_memory_cap_bytes=20_000)}[case]
    req = SolveRequest(g, hw, 4, dtype)
    with pytest.raises(PlanError) as info:
        solve(req)
    err = info.value
    assert isinstance(err, InfeasibleRequestError)
    msg = str(err)
    gpu, host, pinned = map(int, MINIMA.search(msg).groups())
    need = err.requirements
    assert (gpu, host, pinned) == (need.gpu_memory_bytes, need.host_memory_bytes, need.pinned_memory_bytes)
    if case in ("activations", "slot"):
        assert "GPU: needs" in msg and "host: needs" not in msg
        assert f"obstacle is layer {need.obstacle!r}" in msg
        assert need.obstacle == ("layers.3" if case == "slot" else "layers.2")
        assert need.obstacle_is_slot == (case == "slot")
    else:
        assert "host: needs" in msg and "GPU: needs" not in msg
        assert "12 bytes per parameter" in msg
        if case == "pinned_fp32":
            assert "compute in bfloat16" in msg
    # The minima are enough: exactly at them a plan fits, one byte less GPU memory and none does.
    at_min = spec(gpu_memory_bytes=gpu, host_memory_bytes=host, pinned_memory_cap_bytes=pinned)
    sol = solve(replace(req, hardware=at_min))
    check_solution(sol, replace(req, hardware=at_min))
    assert sol.memory.gpu_peak == gpu and sol.memory.host_total == host
    with pytest.raises(PlanError):
        solve(replace(req, hardware=spec(gpu_memory_bytes=gpu - 1, host_memory_bytes=host,
                                         pinned_memory_cap_bytes=pinned)))


# -- scale and surface -----------------------------------------------------------------------------

def test_a_120_layer_graph_solves_in_seconds():
    # 120B parameters in 120 layers, shaped like dense-120b blocks at seq 4096 in BF16 (100 MB checkpoints
    # per sequence).
    g = chain_graph(120, numel=1_000_000_000, fwd_flops=8_900_000_000_000, act_bytes=100_663_296,
                    work_bytes=2_923_000_000)
    req = SolveRequest(g, preset("H200"), 8, "bfloat16")
    sol = solve(req)
    check_solution(sol, req)
    assert sol.solve_time_s < 5.0, f"solve took {sol.solve_time_s:.2f} s"
    assert sol.timeline.bottleneck.value == "compute"


def test_dense_120b_preset_has_115_to_125_billion_parameters():
    n = dense_decoder_param_count(MODEL_PRESETS["dense-120b"])
    assert 115e9 <= n <= 125e9
    # The arithmetic agrees with the published sizes of the other presets.
    assert dense_decoder_param_count(MODEL_PRESETS["llama-3-8b"]) == 8_030_261_248
    assert dense_decoder_param_count(MODEL_PRESETS["llama-2-7b"]) == 6_738_415_616


def test_public_surface():
    assert sorted(solve_mod.__all__) == sorted([
        "SolveLimits", "SolveRequest", "Solution", "Requirements", "InfeasibleRequestError", "scale_graph",
        "greedy_knapsack", "milp_knapsack", "minimum_requirements", "solve_enumerate", "solve_milp", "solve",
        "SOLVERS"])
