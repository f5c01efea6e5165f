"""Tests for planning several GPUs and nodes (megatrain.planner.topology): presets, the solve of one
rank's plan for G GPUs per node x M nodes, and the replicate-or-shard choice of the host state.

The predictions are checked as relations that follow from the cost functions (cost.py), not as
seconds: one rank as today, the optimizer work split over a node's ranks, the network's share of
the all-reduce, and host memory that holds a sharded state but not a replicated one.
"""

from __future__ import annotations

import dataclasses

import pytest

from graphs import chain_graph
from megatrain.errors import ConfigError, PlanError
from megatrain.planner import cost
from megatrain.ir.hardware import H100_SXM, HardwareSpec
from megatrain.ir.schedule import OpKind, Stream
from megatrain.planner.solve import SolveRequest, solve
from megatrain.planner.topology import (
    INTERCONNECTS, NETWORKS, HostStateChoice, Link, solve_topology, with_topology,
)
from megatrain.units import MiB

# A small model whose step is all weight traffic: 8 layers of 4M parameters (366 MiB of masters
# and moments), little compute per token.
GRAPH = chain_graph(8, numel=4_000_000, fwd_flops=10**8, act_bytes=1 << 14)
STATE = cost.persistent_state_bytes(GRAPH)


def node(network: str = "400g-1nic", host_mib: int | None = None) -> HardwareSpec:
    hw = with_topology(H100_SXM, "nvlink4", network)
    if host_mib is None:
        return hw
    return hw.model_copy(update={"host_memory_bytes": host_mib * MiB, "pinned_memory_cap_bytes": host_mib * MiB * 9 // 10})


def busy(ts, stream: Stream) -> float:
    return ts.solution.timeline.busy_s.get(stream, 0.0)


def test_presets_attach_with_their_sources_and_unknown_names_are_refused():
    hw = with_topology(H100_SXM, "NVLink4", "ndr-8x400g")
    assert hw.intra_node_bytes_per_s == 450e9 and hw.network_bytes_per_s == 400e9
    assert hw.intra_node_latency_s == INTERCONNECTS["nvlink4"].latency_s
    assert "NVLink 4" in hw.name and "InfiniBand" in hw.name
    assert HardwareSpec.model_validate_json(hw.model_dump_json()) == hw  # JSON round trip
    assert NETWORKS["400g-1nic"].bytes_per_s == 50e9 and INTERCONNECTS["pcie5"].bytes_per_s < 64e9
    for link in [*INTERCONNECTS.values(), *NETWORKS.values()]:
        assert "GB/s" in link.source and "estimate" in link.source  # rates sourced, latencies marked
    assert with_topology(H100_SXM) is H100_SXM
    with pytest.raises(ConfigError, match=r"no network preset named 'ib'.*'400g-1nic', 'ndr-8x400g'.*--network"):
        with_topology(H100_SXM, network="ib")
    with pytest.raises(ConfigError, match="bytes_per_s"):
        Link("broken", 0.0, 0.0, "none")
    # A spec that set the legacy all-reduce rate gets the preset's intra-node rate instead, not a clash.
    legacy = H100_SXM.model_copy(update={"allreduce_bytes_per_s": 1e9})
    assert with_topology(legacy, "pcie5").intra_node_bus_bytes_per_s == 40e9


def test_one_gpu_on_one_node_is_todays_plan():
    hw = node()
    ts = solve_topology(GRAPH, hw, 16, gpus_per_node=1, nodes=1, compute_dtype="float32")
    today = solve(SolveRequest(GRAPH, hw, 16, "float32"))
    assert ts.plan == today.plan and ts.plan.data_parallel == 1
    assert ts.solution.timeline.step_time_s == today.timeline.step_time_s
    assert ts.global_tokens_per_s == today.timeline.tokens_per_s
    assert ts.node.total == today.memory.host_total and ts.host_state.mode == "replicate"
    assert not any(op.kind is OpKind.ALL_REDUCE for op in ts.solution.schedule.ops)


def test_eight_gpus_of_a_node_split_the_optimizer_and_share_one_copy():
    hw = node()
    one = solve_topology(GRAPH, hw, 16, gpus_per_node=1, nodes=1, compute_dtype="float32")
    eight = solve_topology(GRAPH, hw, 16, gpus_per_node=8, nodes=1, compute_dtype="float32")
    plan = eight.plan
    assert (plan.data_parallel, plan.nodes, plan.gpus_per_node) == (8, 1, 8)
    assert eight.solution.plan.micro_batches * eight.solution.micro_batch_size == 2  # 16 sequences / 8 ranks
    # Each rank updates 1/8 of every tile: 8x less optimizer work than a rank that updated them all
    # (what each rank did with a copy of its own) on the same shared host bandwidth.
    layer = GRAPH.layers[0]
    assert cost.optimizer_numel(layer, plan) * 8 == layer.trainable_numel
    whole = layer.trainable_numel / cost.host_rate(hw, plan)
    split = cost.opt_time(layer, hw, plan) - hw.op_latency_s
    assert whole == pytest.approx(8 * split, rel=1e-12)
    # The node's DRAM still does one update of the model per step: the host stream is as busy as
    # with one GPU, for the same global batch.
    assert busy(eight, Stream.HOST) == pytest.approx(busy(one, Stream.HOST), rel=1e-9)
    # One copy of the state for the node, buffers per rank.
    assert eight.node.persistent == STATE == one.node.persistent
    assert eight.node.total == STATE + 8 * eight.node.per_rank
    # Compute per rank is 1/8 (2 of the 16 sequences), the all-reduce runs over NVLink only.
    assert busy(eight, Stream.COMPUTE) < busy(one, Stream.COMPUTE) / 2
    n_layers = sum(1 for layer in GRAPH.layers if layer.trainable_numel)
    ops = eight.solution.schedule.ops
    # One node whose ranks share one copy, each stepping its shard: the gradients are reduce-scattered.
    assert plan.gradient_reduction == "reduce_scatter"
    assert sum(op.kind is OpKind.REDUCE_SCATTER for op in ops) == n_layers
    assert not any(op.kind is OpKind.ALL_REDUCE for op in ops)
    # The COMM stream: the sum of the ranks' supervised tokens (COUNT_REDUCE), the reduce-scatters, and
    # the node barriers after the shards' updates (ALL_GATHER).
    want = cost.count_reduce_time(hw, plan)
    want += sum(cost.reduce_scatter_time(layer, hw, plan) for layer in GRAPH.layers if layer.trainable_numel)
    want += sum(cost.op_duration(OpKind.ALL_GATHER, GRAPH, op.layer, plan, hw) for op in ops
                if op.kind is OpKind.ALL_GATHER)
    assert busy(eight, Stream.COMM) == pytest.approx(want, rel=1e-9)


def test_a_single_400g_nic_between_two_nodes_costs_eight_times_the_wire_time_of_eight():
    slow = solve_topology(GRAPH, node("400g-1nic"), 16, gpus_per_node=1, nodes=2, compute_dtype="float32")
    fast = solve_topology(GRAPH, node("ndr-8x400g"), 16, gpus_per_node=1, nodes=2, compute_dtype="float32")
    # (COUNT_REDUCE is an all-reduce too, of one count: its 8 bytes scale with the wire as well)
    ops = sum(op.kind in (OpKind.ALL_REDUCE, OpKind.COUNT_REDUCE) for op in slow.solution.schedule.ops)
    fixed = ops * (H100_SXM.op_latency_s + 2 * NETWORKS["400g-1nic"].latency_s)  # same latencies in both
    assert busy(slow, Stream.COMM) - fixed == pytest.approx(8 * (busy(fast, Stream.COMM) - fixed), rel=1e-9)
    assert slow.solution.timeline.step_time_s > fast.solution.timeline.step_time_s


@pytest.mark.parametrize("network", ["400g-1nic", "ndr-8x400g"])
def test_replicate_does_not_fit_shard_does_and_its_gradients_are_reduce_scattered(network):
    # 300 MiB of host memory per node: the 366 MiB state cannot be replicated, half of it fits.
    hw = node(network, host_mib=300)
    ts = solve_topology(GRAPH, hw, 16, gpus_per_node=1, nodes=2, compute_dtype="bfloat16")
    choice, plan = ts.host_state, ts.plan
    assert choice.mode == plan.host_state == "shard" and ts.fits
    assert choice.need_bytes == ts.node.total <= choice.have_bytes == 300 * MiB
    assert ts.node.persistent == -(-STATE // 2)
    assert choice.reason.startswith("shard: replicating does not fit (a full copy of the masters and moments, "
                                    "366.21 MiB, leaves no host memory of the node's 300.00 MiB")
    assert "1/2 of the state per node fits" in choice.reason and f"{choice.network_s_per_step:.4g} s" in choice.reason
    # The added network time is the all-gather before every weight copy, from the cost model.
    h2d = [op for op in ts.solution.schedule.ops if op.kind is OpKind.H2D]
    assert choice.network_s_per_step == pytest.approx(
        sum(cost.weight_gather_time(ts.solution.graph.layers[op.layer], hw, plan) for op in h2d), rel=1e-12)
    assert choice.network_s_per_step > 0
    # Each node updates its half: the host stream does half the optimizer work of a replicated node.
    rep = solve_topology(GRAPH, node(network), 16, gpus_per_node=1, nodes=2, compute_dtype="bfloat16")
    assert rep.host_state.mode == "replicate" and rep.host_state.network_s_per_step == 0
    assert busy(ts, Stream.HOST) < 0.6 * busy(rep, Stream.HOST)
    # Each rank steps only its shard of the state spread over the nodes (Plan.update_shards), so the
    # gradients are reduce-scattered over every rank: half an all-reduce's bytes and steps over the
    # network (2 x reduce-scatter = all-reduce + one op latency), and the COMM stream is busy with
    # them, the gathers and the sum of the ranks' supervised tokens (COUNT_REDUCE).
    ops = ts.solution.schedule.ops
    assert plan.gradient_reduction == "reduce_scatter" and not any(op.kind is OpKind.ALL_REDUCE for op in ops)
    scatters = [ts.solution.graph.layers[op.layer] for op in ops if op.kind is OpKind.REDUCE_SCATTER]
    assert len(scatters) == sum(1 for layer in GRAPH.layers if layer.trainable_numel)
    for layer in scatters:
        assert 2 * cost.reduce_scatter_time(layer, hw, plan) - hw.op_latency_s == pytest.approx(
            cost.all_reduce_time(layer, hw, plan), rel=1e-12)
    want = cost.count_reduce_time(hw, plan) + sum(cost.reduce_scatter_time(layer, hw, plan) for layer in scatters)
    want += sum(cost.op_duration(OpKind.ALL_GATHER, ts.solution.graph, op.layer, plan, hw) for op in ops
                if op.kind is OpKind.ALL_GATHER)
    assert busy(ts, Stream.COMM) == pytest.approx(want, rel=1e-9)


def test_no_plan_fits_when_neither_choice_does_and_the_message_says_why():
    with pytest.raises(PlanError, match=r"no plan fits 1 GPUs per node x 2 nodes.*replicate: a full copy.*"
                                        r"shard: 1/2 of the masters and moments, 183.11 MiB, leaves no host memory"
                                        r".*Fix: more nodes"):
        solve_topology(GRAPH, node(host_mib=150), 16, gpus_per_node=1, nodes=2)
    with pytest.raises(PlanError, match="global batch 12 does not split over 8 GPUs x 1 nodes"):
        solve_topology(GRAPH, node(), 12, gpus_per_node=8, nodes=1)
    with pytest.raises(ConfigError, match="network_bytes_per_s=0.*--network"):
        solve_topology(GRAPH, with_topology(H100_SXM, "nvlink4"), 16, gpus_per_node=8, nodes=2)


def test_host_state_choice_is_validated():
    ok = HostStateChoice("shard", 2, 10, 20, 0.5, "why")
    assert dataclasses.replace(ok, mode="replicate", network_s_per_step=0.0).mode == "replicate"
    for bad, match in [(dict(mode="mirror"), "use 'replicate' or 'shard'"), (dict(nodes=1), "needs >= 2 nodes"),
                       (dict(need_bytes=30), "a choice must fit"),
                       (dict(mode="replicate"), "moves no weights over the network")]:
        with pytest.raises(PlanError, match=match):
            dataclasses.replace(ok, **bad)


def test_plan_topology_fields_are_validated_and_round_trip_through_schedule_json():
    from megatrain.planner.lower import lower
    from megatrain.ir.plan import Plan
    from megatrain.ir.schedule import Schedule

    plan = Plan(data_parallel=8, nodes=2, host_state="shard")
    assert plan.gpus_per_node == 4
    s = lower(chain_graph(3), plan)
    back = Schedule.from_json(s.to_json())
    assert back.plan == plan and back.ops == s.ops
    for bad, match in [(dict(data_parallel=6, nodes=4), "nodes must be >= 1 and divide data_parallel"),
                       (dict(nodes=0), "nodes must be >= 1"), (dict(host_state="split"), "use 'replicate'"),
                       (dict(host_state="shard"), "with nodes=1")]:
        with pytest.raises(PlanError, match=match):
            Plan(**bad)


def test_a_node_s_ranks_share_its_bf16_staging_tiles_each_casting_its_shard():
    """BF16 on 8 GPUs of one node: the planner gives the node one BF16 staging tile per layer,
    which its ranks share (Plan.shared_cast), counted once in the node's memory; each rank casts
    1/8 of each layer once per step, so the cast stream is 1/8 as busy as when each rank casts
    every layer into tiles of its own, and the step is no slower."""
    from megatrain.planner.lower import lower
    from megatrain.planner.simulate import simulate

    ts = solve_topology(GRAPH, node(), 16, gpus_per_node=8, nodes=1)
    plan = ts.plan
    assert plan.cast_once and plan.shared_cast and plan.compute_dtype == "bfloat16"
    tiles = sum(cost.page_up(layer.numel * 2) for layer in GRAPH.layers)
    assert ts.solution.memory.shared_staging == ts.node.shared_staging == tiles
    assert ts.node.total == STATE + tiles + 8 * ts.node.per_rank
    own = dataclasses.replace(plan, shared_cast=False)
    alone = simulate(lower(GRAPH, own), GRAPH, ts.hardware)
    shared_cast = busy(ts, Stream.CAST) - len(GRAPH.layers) * ts.hardware.op_latency_s
    own_cast = alone.busy_s[Stream.CAST] - len(GRAPH.layers) * ts.hardware.op_latency_s
    assert shared_cast == pytest.approx(own_cast / 8, rel=1e-3)  # 4M elements split in aligned shards
    assert ts.solution.timeline.step_time_s <= alone.step_time_s
