"""Data parallel on torch.distributed: ALL_REDUCE (or, on one node sharing one copy, REDUCE_SCATTER)
ops in the schedule, verified, and training with
2 and 4 gloo processes that equals one process training the global batch (FP32, 1e-5)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megatrain
from megatrain.checkpoint import MANIFEST, STATE_DIR
from megatrain.errors import PlanError, ScheduleError
from megatrain.planner.lower import lower
from megatrain.ir.plan import OptimizerPlacement, Plan
from megatrain.ir.schedule import OpKind, Schedule
from megatrain.planner.trace import trace
from megatrain.planner.verify import verify
from megatrain.runtime import executor
from megatrain.runtime.host_kernels import HostAdamW
from megatrain.trainer import Schedules

from conftest import random_batch, tiny_llama
from test_exactness import ADAMW, RTOL, eager_losses, supervised_tokens

S, MBS, VOCAB = 16, 2, 96
OPT = ADAMW  # eps far below the gradients: test_exactness.ADAMW says why

PLANS = {
    "during-backward": Plan(micro_batches=2),
    "host-accumulation": Plan(micro_batches=2, layer_by_layer=False),
    "clipped-deferred": Plan(micro_batches=2, optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=4),
}


@pytest.fixture(scope="module")
def graph():
    return trace(tiny_llama(), micro_batch_size=MBS, seq_len=S, input_names=("input_ids", "labels")).graph


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_layer_is_reduced_once_before_its_step_and_in_one_chain(graph, name):
    plan = dataclasses.replace(PLANS[name], data_parallel=2)
    carries = plan.optimizer is OptimizerPlacement.NEXT_FORWARD
    s = lower(graph, plan, "train", carries_updates=carries)
    verify(s, graph)
    reduces = [i for i, op in enumerate(s.ops) if op.kind is OpKind.ALL_REDUCE]
    assert sorted(s.ops[i].layer for i in reduces) == [i for i, l in enumerate(graph.layers) if l.trainable_numel]
    assert all(reduces[k - 1] in s.ops[reduces[k]].deps for k in range(1, len(reduces)))
    assert all(op.stream.value == "comm" for op in s.ops if op.kind is OpKind.ALL_REDUCE)
    # The global batch's supervised tokens are summed first, before the loss layer's first
    # backward seeds its loss with 1 / their number, and the other collectives come after.
    loss_layer = len(graph.layers) - 1
    first_bwd = next(i for i, op in enumerate(s.ops) if op.kind is OpKind.BWD and op.layer == loss_layer)
    assert [op for op in s.ops if op.kind is OpKind.COUNT_REDUCE] == [s.ops[0]]
    assert repr(s.ops[0]) == f"COUNT_REDUCE:L{loss_layer}"
    assert 0 in s.ops[first_bwd].deps and 0 in s.ops[min(i for i in reduces)].deps
    assert Schedule.from_json(s.to_json()).ops == s.ops
    # one rank: no collectives, as before
    for one in (lower(graph, PLANS[name], "train"), lower(graph, plan, "eval")):
        assert not any(op.kind in (OpKind.ALL_REDUCE, OpKind.COUNT_REDUCE) for op in one.ops)


def _mutated(s: Schedule, fn) -> Schedule:
    return dataclasses.replace(s, ops=tuple(fn(list(s.ops))))


def test_the_verifier_rejects_collectives_out_of_order_or_missing(graph):
    # (Rule 'collectives' also checks that the ALL_REDUCEs form one chain; in lowered schedules
    # their D2Hs already order them, so no one-dependency mutation of them breaks that part.)
    plan = dataclasses.replace(PLANS["during-backward"], data_parallel=2)
    s = lower(graph, plan, "train")
    reduces = [i for i, op in enumerate(s.ops) if op.kind is OpKind.ALL_REDUCE]

    def wrong_tile(ops):  # reduces a gradient tile its layer's D2H did not write
        r = ops[reduces[0]]
        ops[reduces[0]] = dataclasses.replace(r, ring=1 - r.ring)
        return ops

    with pytest.raises(ScheduleError, match="rule 'collectives'.*must reduce what #"):
        verify(_mutated(s, wrong_tile), graph)

    def early_step(ops):  # the OPT after the first ALL_REDUCE stops waiting for it
        o = next(i for i in range(reduces[0], len(ops)) if ops[i].kind is OpKind.OPT)
        ops[o] = dataclasses.replace(ops[o], deps=tuple(d for d in ops[o].deps if d != reduces[0]))
        return ops

    with pytest.raises(ScheduleError, match="rule 'collectives'.*before its gradients were reduced"):
        verify(_mutated(s, early_step), graph)
    with pytest.raises(ScheduleError, match="rule 'collectives'.*nothing is reduced across ranks"):
        verify(dataclasses.replace(s, plan=PLANS["during-backward"]), graph)
    loss_layer = len(graph.layers) - 1
    first_bwd = next(i for i, op in enumerate(s.ops) if op.kind is OpKind.BWD and op.layer == loss_layer)

    def early_seed(ops):  # the loss layer's first backward stops waiting for the global count
        ops[first_bwd] = dataclasses.replace(ops[first_bwd], deps=tuple(d for d in ops[first_bwd].deps if d))
        return ops

    with pytest.raises(ScheduleError, match=rf"op #{first_bwd} .*rule 'collectives'.*seeds the loss with 1 / "
                                            r"\(the global batch's supervised tokens\) before #0 COUNT_REDUCE"):
        verify(_mutated(s, early_seed), graph)

    def no_count(ops):  # the count dropped: every dependency on it, and every index after it, shift
        return [dataclasses.replace(op, deps=tuple(d - 1 for d in op.deps if d)) for op in ops[1:]]

    with pytest.raises(ScheduleError, match="rule 'collectives'.*exactly one COUNT_REDUCE.*found 0"):
        verify(_mutated(s, no_count), graph)
    with pytest.raises(ScheduleError, match="rule 'collectives'.*names layer 0, but the loss layer"):
        verify(_mutated(s, lambda ops: [dataclasses.replace(ops[0], layer=0)] + ops[1:]), graph)


def test_a_node_sharing_one_copy_reduce_scatters_and_the_verifier_holds_the_plan_to_its_choice(graph):
    """Plan.gradient_reduction='reduce_scatter' (one node, optimizer_shards == data_parallel): one
    REDUCE_SCATTER per layer in place of the ALL_REDUCE, on the COMM chain, before the OPT; the
    verifier rejects the other kind, a step that does not wait for it, and the plan refuses it
    where a rank's shard is not all of what the node needs; the choice survives the JSON file."""
    plan = dataclasses.replace(PLANS["during-backward"], data_parallel=2, optimizer_shards=2,
                               gradient_reduction="reduce_scatter")
    s = lower(graph, plan, "train")
    verify(s, graph)
    assert Schedule.from_json(s.to_json()).plan == plan
    scatters = [i for i, op in enumerate(s.ops) if op.kind is OpKind.REDUCE_SCATTER]
    assert sorted(s.ops[i].layer for i in scatters) == [i for i, l in enumerate(graph.layers) if l.trainable_numel]
    assert not any(op.kind is OpKind.ALL_REDUCE for op in s.ops)
    assert all(s.ops[i].stream.value == "comm" for i in scatters)
    comm = [i for i, op in enumerate(s.ops) if op.stream.value == "comm"]
    assert all(comm[k - 1] in s.ops[comm[k]].deps for k in range(1, len(comm)))
    all_reduce = dataclasses.replace(plan, gradient_reduction="all_reduce")
    assert lower(graph, all_reduce, "train").ops == tuple(
        dataclasses.replace(op, kind=OpKind.ALL_REDUCE) if op.kind is OpKind.REDUCE_SCATTER else op for op in s.ops)
    with pytest.raises(ScheduleError, match="rule 'collectives'.*gradient_reduction='all_reduce'.*not REDUCE_SCATTER"):
        verify(dataclasses.replace(s, plan=all_reduce), graph)

    def other_kind(ops):
        ops[scatters[1]] = dataclasses.replace(ops[scatters[1]], kind=OpKind.ALL_REDUCE)
        return ops

    with pytest.raises(ScheduleError, match="rule 'collectives'.*reduced by REDUCE_SCATTER, not ALL_REDUCE"):
        verify(_mutated(s, other_kind), graph)

    def early_step(ops):  # an OPT stops waiting for its layer's REDUCE_SCATTER
        o = next(i for i, op in enumerate(ops) if op.kind is OpKind.OPT and scatters[0] in op.deps)
        ops[o] = dataclasses.replace(ops[o], deps=tuple(d for d in ops[o].deps if d != scatters[0]))
        return ops

    with pytest.raises(ScheduleError, match="rule 'collectives'.*before its gradients were reduced"):
        verify(_mutated(s, early_step), graph)
    for bad in (dict(data_parallel=4, nodes=2, optimizer_shards=2), dict(data_parallel=2), dict(data_parallel=1)):
        with pytest.raises(PlanError, match="gradient_reduction='reduce_scatter'.*use gradient_reduction='all_reduce'"):
            Plan(gradient_reduction="reduce_scatter", **bad)
    with pytest.raises(PlanError, match="gradient_reduction='ring'"):
        Plan(gradient_reduction="ring")


def test_sharded_optimizer_steps_are_gathered_before_any_read_of_the_master(graph):
    """optimizer_shards > 1: one ALL_GATHER per OPT on the COMM chain, before the layer's next H2D
    or CAST; the verifier rejects a read that does not wait for it, a missing gather, and a gather
    without sharding; an update schedule of some pending layers keeps its chain."""
    plan = dataclasses.replace(PLANS["clipped-deferred"], data_parallel=4, optimizer_shards=2)
    s = lower(graph, plan, "train", carries_updates=True)
    verify(s, graph)
    opts = [i for i, op in enumerate(s.ops) if op.kind is OpKind.OPT]
    gathers = [i for i, op in enumerate(s.ops) if op.kind is OpKind.ALL_GATHER]
    assert [s.ops[i].layer for i in gathers] == [s.ops[o].layer for o in opts]
    comm = [i for i, op in enumerate(s.ops) if op.stream.value == "comm"]
    assert all(comm[k - 1] in s.ops[comm[k]].deps for k in range(1, len(comm)))
    g0 = gathers[0]
    reader = next(i for i in range(g0, len(s.ops)) if s.ops[i].layer == s.ops[g0].layer
                  and s.ops[i].kind in (OpKind.H2D, OpKind.CAST))
    assert g0 in s.ops[reader].deps

    def unwaited(ops):
        ops[reader] = dataclasses.replace(ops[reader], deps=tuple(d for d in ops[reader].deps if d != g0))
        return ops

    with pytest.raises(ScheduleError, match="rule 'collectives'.*while other ranks may still be stepping"):
        verify(_mutated(s, unwaited), graph)
    with pytest.raises(ScheduleError, match="rule 'collectives'.*nothing to gather"):
        verify(dataclasses.replace(s, plan=dataclasses.replace(plan, optimizer_shards=1)), graph)
    update = lower(graph, plan, "update")
    verify(update, graph)
    pending = frozenset({0, 2})
    part = update.of_layers(pending)  # what flush() runs when only some updates are pending
    assert [repr(op) for op in part.ops] == ["OPT:L0:r0", "OPT:L2:r2", "ALL_GATHER:L0", "ALL_GATHER:L2"]
    assert [op.deps for op in part.ops] == [(), (), (0,), (1, 2)]  # the gathers' chain goes through L1's
    with pytest.raises(ScheduleError, match="rule 'collectives'.*each OPT needs one"):
        verify(dataclasses.replace(update, ops=tuple(op for op in update.ops if op.kind is not OpKind.ALL_GATHER)),
               graph)


@pytest.mark.parametrize("base", ["during-backward", "host-accumulation", "clipped-deferred"])
def test_shared_casts_are_gathered_before_any_copy_reads_the_node_s_tile(graph, base):
    """Plan.shared_cast: each CAST (of this rank's shard into the node's tile) is followed by an
    ALL_GATHER of its layer that every H2D of that CAST waits for; a deferred OPT's gather is the
    CAST's after it. The verifier rejects an H2D that does not wait for the gather after its CAST,
    a gather that does not wait for the CAST, and the flag where nothing shares a copy."""
    plan = dataclasses.replace(PLANS[base], data_parallel=2, optimizer_shards=2, compute_dtype="bfloat16",
                               cast_once=True, shared_cast=True, gradient_reduction="reduce_scatter")
    carried = plan.optimizer is OptimizerPlacement.NEXT_FORWARD
    for mode in ("train", "eval"):
        s = lower(graph, plan, mode, carries_updates=carried and mode == "train")
        verify(s, graph)
        ops = s.ops
        for h in (i for i, op in enumerate(ops) if op.kind is OpKind.H2D):
            (c,) = [d for d in ops[h].deps if ops[d].kind is OpKind.CAST]
            gathers = [d for d in ops[h].deps if ops[d].kind is OpKind.ALL_GATHER and c in ops[d].deps]
            assert len(gathers) == 1 and ops[gathers[0]].layer == ops[h].layer
        casts = sum(op.kind is OpKind.CAST for op in ops)
        opts = sum(op.kind is OpKind.OPT for op in ops)
        # One gather per CAST, plus one per OPT whose layer is not cast again after it in this schedule.
        assert casts == len(graph.layers) and casts <= sum(op.kind is OpKind.ALL_GATHER for op in ops) <= casts + opts
    h = next(i for i, op in enumerate(s.ops) if op.kind is OpKind.H2D)
    g = next(d for d in s.ops[h].deps if s.ops[d].kind is OpKind.ALL_GATHER)

    def unwaited(ops):
        ops[h] = dataclasses.replace(ops[h], deps=tuple(d for d in ops[h].deps if d != g))
        return ops

    with pytest.raises(ScheduleError, match="rule 'collectives'.*shared staging tile t0.*other ranks may not"):
        verify(_mutated(s, unwaited), graph)
    c = next(d for d in s.ops[h].deps if s.ops[d].kind is OpKind.CAST)

    def early(ops):  # the gather no longer waits for this rank's CAST: it may pass before the shard is in
        ops[g] = dataclasses.replace(ops[g], deps=tuple(d for d in ops[g].deps if d != c))
        return ops

    with pytest.raises(ScheduleError, match="rule 'collectives'.*shared staging tile t0.*other ranks may not"):
        verify(_mutated(s, early), graph)
    with pytest.raises(PlanError, match="shared_cast=True with cast_once=True, optimizer_shards=1"):
        dataclasses.replace(plan, optimizer_shards=1, gradient_reduction="all_reduce")
    with pytest.raises(PlanError, match="shared_cast=True with cast_once=False"):
        dataclasses.replace(plan, cast_once=False)


def test_a_shape_whose_host_state_has_no_shared_staging_tiles_casts_per_rank():
    """Batch shapes share the first shape's host state (shapes.py), whose node mapping does not
    grow: the front door plans a later shape over a state made without staging tiles with per-rank
    casts (``Storage.shared_staging=False``: shared_cast off, lowered so), and materialize refuses
    a plan that would share them rather than lower it again."""
    from megatrain.errors import ConfigError
    from megatrain.planner import front
    from megatrain.runtime.host import HostState

    def planned(shared_staging):
        return front.plan(front.PlanRequest(tiny_llama(), S, 2 * MBS, MBS, plan=Plan(compute_dtype="bfloat16",
                                                                                      cast_once=True),
                                            topology=front.Topology(2, 2),
                                            storage=front.Storage(shared_staging=shared_staging)))

    sharing, own = planned(None), planned(False)
    assert sharing.plan.shared_cast and sharing.memory.shared_staging > 0
    assert own.plan == dataclasses.replace(sharing.plan, shared_cast=False)
    assert own.schedules.first.plan == own.plan and own.memory.shared_staging == 0
    assert sum(op.kind is OpKind.ALL_GATHER for op in own.schedules.first.ops) == sum(
        op.kind is OpKind.OPT for op in own.schedules.first.ops)  # the OPTs' gathers only
    with pytest.raises(ConfigError, match="made without them"):
        megatrain.materialize(sharing, OPT, host=HostState(sharing.traced.graph))


SHARD = Plan(micro_batches=2, optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=4, data_parallel=4, nodes=2,
             optimizer_shards=2, host_state="shard", gradient_reduction="reduce_scatter")


def _master_reads(s: Schedule) -> list[int]:
    return [i for i, op in enumerate(s.ops) if (op.kind is OpKind.H2D and op.tile is None) or op.kind is OpKind.CAST]


@pytest.mark.parametrize("compute_dtype,base", [("float32", "clipped-deferred"), ("bfloat16", "clipped-deferred"),
                                                ("float32", "during-backward"), ("bfloat16", "host-accumulation")])
def test_a_state_sharded_across_nodes_gathers_each_layer_before_every_read_of_its_weights(graph, compute_dtype,
                                                                                          base):
    """host_state='shard': before every read of a layer's master (an FP32 H2D, a BF16 CAST) one
    ALL_GATHER of the layer into one of the GATHER_BUFFERS tiles, which the read depends on; the
    gathers wait for the layer's earlier OPT and for the readers of their tile's last content, and
    are on the COMM chain; eval schedules gather too, update schedules do not."""
    from megatrain.planner import cost

    plan = dataclasses.replace(PLANS[base], compute_dtype=compute_dtype, data_parallel=4, nodes=2, optimizer_shards=2,
                               host_state="shard", gradient_reduction="reduce_scatter")
    carries = plan.optimizer is OptimizerPlacement.NEXT_FORWARD
    s = lower(graph, plan, "train", carries_updates=carries)
    verify(s, graph)
    assert Schedule.from_json(s.to_json()) == s
    reads = _master_reads(s)
    gathers = [i for i, op in enumerate(s.ops) if op.kind is OpKind.ALL_GATHER]
    assert len(gathers) == len(reads) > 0 and {s.ops[g].tile for g in gathers} == set(range(cost.GATHER_BUFFERS))
    for r in reads:
        (g,) = [d for d in s.ops[r].deps if s.ops[d].kind is OpKind.ALL_GATHER]
        assert s.ops[g].layer == s.ops[r].layer and repr(s.ops[g]) == f"ALL_GATHER:L{s.ops[g].layer}:t{s.ops[g].tile}"
    comm = [i for i, op in enumerate(s.ops) if op.stream.value == "comm"]
    assert all(comm[k - 1] in s.ops[comm[k]].deps for k in range(1, len(comm)))
    assert sum(op.kind is OpKind.REDUCE_SCATTER for op in s.ops) == sum(1 for lay in graph.layers if lay.trainable_numel)
    ev = lower(graph, plan, "eval")
    verify(ev, graph)
    assert sum(op.kind is OpKind.ALL_GATHER for op in ev.ops) == len(_master_reads(ev))
    # BF16 copies read the gather tile: no CAST, no staging tile (whatever Plan.staging_ring says).
    assert not any(op.kind is OpKind.CAST or (op.kind is OpKind.H2D and op.tile is not None) for op in s.ops)
    verify(lower(graph, dataclasses.replace(plan, staging_ring=1), "train", carries_updates=carries), graph)
    if carries:
        up = lower(graph, plan, "update")
        verify(up, graph)
        assert not any(op.kind is OpKind.ALL_GATHER for op in up.ops)


def test_the_verifier_rejects_a_read_of_sharded_weights_without_its_gather_and_a_gather_tile_overwritten(graph):
    s = lower(graph, SHARD, "train", carries_updates=True)
    reads = _master_reads(s)
    gathers = [i for i, op in enumerate(s.ops) if op.kind is OpKind.ALL_GATHER]

    def drop(i: int, dep: int):
        def fn(ops):
            ops[i] = dataclasses.replace(ops[i], deps=tuple(d for d in ops[i].deps if d != dep))
            return ops
        return fn

    g0 = next(d for d in s.ops[reads[0]].deps if s.ops[d].kind is OpKind.ALL_GATHER)
    with pytest.raises(ScheduleError, match="rule 'collectives'.*must depend on one ALL_GATHER of the layer, and it "
                                            "depends on 0"):
        verify(_mutated(s, drop(reads[0], g0)), graph)
    # The third gather reuses the first one's tile: it must wait for that tile's reader.
    third = gathers[2]
    assert s.ops[third].tile == s.ops[g0].tile and reads[0] in s.ops[third].deps
    with pytest.raises(ScheduleError, match="rule 'collectives'.*may overwrite gather tile t0 while #"):
        verify(_mutated(s, drop(third, reads[0])), graph)
    # A gather of a layer whose carried OPT ran just before it must wait for that step.
    g, o = next((g, d) for g in gathers for d in s.ops[g].deps if s.ops[d].kind is OpKind.OPT)
    with pytest.raises(ScheduleError, match="rule 'collectives'.*gathers layer .* while OPT #.* may still be stepping"):
        verify(_mutated(s, drop(g, o)), graph)

    def untiled(ops):
        ops[g0] = dataclasses.replace(ops[g0], tile=None)
        return ops

    with pytest.raises(ScheduleError, match="rule 'collectives'.*one of the node's 2 gather tiles, and it names none"):
        verify(_mutated(s, untiled), graph)
    replicated = dataclasses.replace(PLANS["clipped-deferred"], data_parallel=4, optimizer_shards=2)
    r = lower(graph, replicated, "train", carries_updates=True)
    tiled = [i for i, op in enumerate(r.ops) if op.kind is OpKind.ALL_GATHER][0]

    def with_tile(ops):
        ops[tiled] = dataclasses.replace(ops[tiled], tile=0)
        return ops

    with pytest.raises(ScheduleError, match="rule 'collectives'.*host_state='replicate'.*nothing is gathered into a tile"):
        verify(_mutated(r, with_tile), graph)


def test_plans_sharding_across_nodes_reduce_scatter_over_every_rank():
    assert SHARD.update_shards == 4 and Plan(data_parallel=4, nodes=2, optimizer_shards=2).update_shards == 2
    # Sharded across nodes but not every rank of a node stepping a shard: a rank's shard is not all it needs.
    with pytest.raises(PlanError, match="host_state='shard'.*use gradient_reduction='all_reduce'"):
        dataclasses.replace(SHARD, optimizer_shards=1)
    assert dataclasses.replace(SHARD, gradient_reduction="all_reduce").update_shards == 4  # legal, twice the bytes


@pytest.mark.parametrize("numel,trainable,gpus,nodes", [
    (14480, 14480, 2, 2), (3880, 3880, 2, 2), (1000, 600, 2, 3), (100, 0, 2, 2), (17, 17, 4, 2), (40, 40, 1, 8)])
def test_node_slices_tile_a_layer_and_hold_their_ranks_shards(numel, trainable, gpus, nodes):
    """cost.node_slice: the nodes' slices tile [0, numel) in order, each rank's optimizer shard (of
    Plan.update_shards) lies in its node's slice, and the frozen tail belongs to the last node."""
    from megatrain.planner import cost

    plan = Plan(data_parallel=gpus * nodes, nodes=nodes, optimizer_shards=gpus, host_state="shard")
    slices = [cost.node_slice(numel, trainable, plan, n) for n in range(nodes)]
    assert slices[0][0] == 0 and slices[-1][1] == numel
    assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(slices, slices[1:]))
    for r in range(plan.data_parallel):
        lo, hi = cost.optimizer_shard(trainable, plan.update_shards, r)
        node = slices[r // gpus]
        assert lo == hi or node[0] <= lo <= hi <= min(node[1], trainable)
    assert cost.node_slice(numel, trainable, Plan(data_parallel=2, nodes=2), 1) == (0, numel)  # replicated
    with pytest.raises(ValueError, match=f"node {nodes} of a plan with {nodes} nodes"):
        cost.node_slice(numel, trainable, plan, nodes)


def test_a_sliced_host_state_holds_its_node_part_and_a_load_writes_only_that(graph):
    """HostState(slices=...) holds each layer's [lo, hi) of the masters and the moments of its
    trainable part; the nodes' states together are the whole state's bytes, and SlicedRow.copy_
    of a whole row (what a checkpoint load does on every rank) fills exactly each node's part."""
    from megatrain.planner import cost
    from megatrain.runtime.host import EXP_AVG_SQ, MASTER, HostState, SlicedRow

    states = [HostState(graph, slices=[cost.node_slice(lay.numel, lay.trainable_numel, SHARD, n)
                                       for lay in graph.layers], gather_bytes=64) for n in range(2)]
    assert sum(h.nbytes for h in states) == cost.persistent_state_bytes(graph)
    assert all(len(h.gather) == cost.GATHER_BUFFERS and h.gather[0].numel() == 64 for h in states)
    li = next(i for i, lay in enumerate(graph.layers) if lay.trainable_numel)
    lay = graph.layers[li]
    row, moment = torch.randn(lay.numel), torch.randn(lay.trainable_numel)
    for h in states:
        SlicedRow(h, li, MASTER, 0, (lay.numel,), None).copy_(row)
        SlicedRow(h, li, EXP_AVG_SQ, 0, (lay.trainable_numel,), None).copy_(moment)
    assert torch.equal(torch.cat([h.master(li) for h in states]), row)
    assert torch.equal(torch.cat([h.exp_avg_sq(li) for h in states]), moment)
    assert not any(h.exp_avg(li).any() for h in states)
    with pytest.raises(megatrain.errors.ConfigError, match="holds elements .* of its master tile only"):
        states[0].param_view(li, 0)


def _first_step_norm(ref, batch: dict[str, torch.Tensor]) -> float:
    """The global gradient norm one process gets from the whole ``batch`` on a copy of ``ref`` (the
    norm ``clip_grad_norm_`` clips with)."""
    first = copy.deepcopy(ref)
    first(**batch).loss.backward()
    return torch.nn.utils.clip_grad_norm_(first.parameters(), float("inf")).item()


def _global_batches(world: int, k: int, steps: int) -> list[dict[str, torch.Tensor]]:
    return [random_batch(world * k * MBS, S, VOCAB, seed=s % 3) for s in range(steps)]


def _uneven_batches(world: int, k: int, steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Global batches whose rows hold different numbers of targets: each row's labels are -100 on a
    prefix of 0 to all of its tokens (as an SFT prompt's are), and in the first batch the last rank's
    rows have none. Its loss is the mean over the targets of the whole global batch, whichever rank
    holds them; a mean of the ranks' means would differ."""
    out = []
    rows = world * k * MBS
    for s in range(steps):
        b = random_batch(rows, S, VOCAB, seed=(seed + s) % 3)
        prompts = torch.randint(0, S + 1, (rows, 1), generator=torch.Generator().manual_seed(100 * seed + s))
        b["labels"] = b["labels"].masked_fill(torch.arange(S) < prompts, -100)
        if s == 0:
            b["labels"][-k * MBS:] = -100
        out.append(b)
    return out


@contextlib.contextmanager
def _process_group(rank: int, world: int, init_file: str, local_world: int = 1):
    """This spawned process as rank ``rank`` of ``world`` gloo ranks, ``local_world`` per node
    (torchrun's LOCAL_* variables), seeded by its rank: nothing but the broadcast of rank 0's
    weights at compile makes the ranks' models equal."""
    os.environ.update(LOCAL_WORLD_SIZE=str(local_world), LOCAL_RANK=str(rank % local_world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, init_file: str, out: str, k: int, clip: float | None, steps: int,
               layer_by_layer: bool, local_world: int, hidden: int = 32) -> None:
    """One rank: its slice of each global batch (micro-batches rank*k .. rank*k+k-1)."""
    with _process_group(rank, world, init_file, local_world):
        stepped = []  # the elements each of this rank's AdamW calls updated
        real = HostAdamW.step
        HostAdamW.step = lambda self, param, *a, **kw: (stepped.append(param.numel()), real(self, param, *a, **kw))[1]
        model = tiny_llama(hidden=hidden)
        plan = dataclasses.replace(megatrain.ir.plan.Plan(micro_batches=k, layer_by_layer=layer_by_layer),
                                   optimizer=OptimizerPlacement.NEXT_FORWARD if clip else
                                   OptimizerPlacement.DURING_BACKWARD, grad_ring=8 if clip else 2)
        # A spec with the node's interconnect and the network: the step is predicted with the collectives.
        hw = megatrain.preset("H100_SXM").model_copy(update={"intra_node_bytes_per_s": 4.5e11,
                                                             "network_bytes_per_s": 4e11})
        trainer = megatrain.compile(model, seq_len=S, micro_batch_size=MBS, micro_batches=k, optimizer=OPT,
                                    max_grad_norm=clip, plan=plan, hardware=hw)
        assert (trainer.plan.data_parallel, trainer.plan.optimizer_shards, trainer.plan.nodes) == (
            world, local_world, world // local_world)
        # One node whose ranks share one copy: each rank's OPT reads only its shard, so the gradients
        # are reduce-scattered; with copies of their own, or several nodes, all-reduced.
        kind = OpKind.REDUCE_SCATTER if local_world == world else OpKind.ALL_REDUCE
        assert trainer.plan.gradient_reduction == kind.value.lower()
        kinds = {op.kind for op in trainer.planned.schedules.steady.ops}
        assert kind in kinds and not {OpKind.ALL_REDUCE, OpKind.REDUCE_SCATTER} - {kind} & kinds
        assert trainer.planned.timeline is not None and trainer.planned.timeline.step_time_s > 0
        rows = k * MBS
        mine = lambda b: {n: t[rank * rows:(rank + 1) * rows] for n, t in b.items()}  # noqa: E731
        results = []
        for b in _uneven_batches(world, k, steps):
            res = trainer.step(mine(b))
            # (NaN, the mean loss of a micro-batch without targets, as None: NaN != NaN across ranks)
            per_mb = tuple(None if math.isnan(x) else x for x in res.micro_batch_losses)
            results.append((res.loss, per_mb, res.tokens, res.grad_norm, res.supervised_tokens))
        # A global batch without targets: every rank learns it from the COUNT_REDUCE and refuses it;
        # nothing of it is applied (the weights below are those of the steps above).
        refused = None
        try:
            trainer.step(mine({**b, "labels": torch.full_like(b["labels"], -100)}))
        except megatrain.errors.BatchError as e:
            refused = str(e)
        trainer.save(f"{out}.ckpt")  # rank 0 writes it, the others wait; it flushes the last update
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        shared = trainer.host.shared
        tiles = sum(layer.trainable_numel for layer in trainer.graph.layers)
        # Each rank evaluates its rows; every rank gets the loss of all of them.
        val = trainer.evaluate(mine(_uneven_batches(world, k, 1, seed=1)[0]))
        torch.save({"results": results, "state": state, "stepped": sum(stepped), "tiles": tiles,
                    "inode": None if shared is None else shared.inode, "refused": refused,
                    "val": val, "steps": trainer.step_count}, f"{out}.{rank}")


@pytest.mark.parametrize("world,k,clip,layer_by_layer,local_world,hidden", [
    # Width 40: the blocks (14,480 elements) and the head (3,880) are no multiple of 2 shards x 16,
    # so the REDUCE_SCATTER of the accumulators reads their zero padding (cost.reduced_numel).
    (2, 2, None, False, 2, 40),
    (2, 2, 0.5, True, 2, 32),  # 0.5: below the first steps' global norm (0.79), so the clipping acts
    (2, 2, None, False, 1, 32),
    (4, 1, 0.5, True, 2, 32),
], ids=["2-ranks-sharing-a-node-host-accumulation", "2-ranks-sharing-clipped-2-microbatches", "2-ranks-own-copies-host-accumulation",
        "2-nodes-of-2-clipped"])
def test_ranks_train_the_global_batch_as_one_process_does(tmp_path, world, k, clip, layer_by_layer, local_world,
                                                         hidden):
    steps = 4
    out = str(tmp_path / "rank")
    mp.spawn(_rank_main, args=(world, str(tmp_path / "init"), out, k, clip, steps, layer_by_layer, local_world, hidden),
             nprocs=world, join=True)
    torch.manual_seed(0)
    ref = tiny_llama(hidden=hidden)
    batches = _uneven_batches(world, k, steps)
    want = eager_losses(copy.deepcopy(ref), batches, world * k, clip, adamw=OPT)
    ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    for r in ranks:  # every rank reports the global step and holds the same weights
        assert r["results"] == ranks[0]["results"]
        assert all(torch.equal(r["state"][n], ranks[0]["state"][n]) for n in r["state"])
    for step, ((loss, per_mb, tokens, _, supervised), w, b) in enumerate(zip(ranks[0]["results"], want, batches)):
        assert abs(loss - w) <= RTOL * abs(w), f"step {step}: {world} ranks {loss} vs one process {w}"
        assert len(per_mb) == world * k and tokens == world * k * MBS * S
        assert supervised == supervised_tokens(b)
    assert all(x is None for x in ranks[0]["results"][0][1][-k:])  # the last rank's micro-batches: no target
    assert all(r["steps"] == steps and f"no supervised token on all {world} ranks" in r["refused"] for r in ranks)
    if clip:
        # Every rank reports (and clipped with) the global norm of the first step's gradients, which
        # exceeds the bound, so the clipping acted: the same norm one process gets from the whole
        # batch (FP32 sums in another order: within RTOL). With a reduce-scatter each rank holds only
        # its shard reduced: the norm is the ranks' squared shard norms summed.
        norm = _first_step_norm(ref, batches[0])
        got = ranks[0]["results"][0][3]
        assert got > clip and abs(got - norm) <= RTOL * norm, (got, norm)
    eager_losses(ref, batches, world * k, clip, adamw=OPT)  # the same training again, for the weights
    for name, p in ref.named_parameters():
        q = ranks[0]["state"][name]
        err = ((q - p.detach()).norm() / p.detach().norm()).item()
        assert err <= RTOL, f"{name}: relative difference {err:.2e}"
    # Evaluation under data parallel: the token mean over every rank's rows, the same on every rank,
    # as one process computes it on the whole batch with the ranks' weights.
    ref.load_state_dict(ranks[0]["state"], strict=False)
    with torch.no_grad():
        val = ref(**_uneven_batches(world, k, 1, seed=1)[0]).loss.item()
    assert all(r["val"] == ranks[0]["val"] for r in ranks) and abs(ranks[0]["val"] - val) <= RTOL * val
    # One host copy per node, and the node's ranks split every optimizer step between them.
    # (Each parameter starts a tile on 16 elements: the tiles are the parameters and that padding.)
    trainable = ranks[0]["tiles"]
    params = [p.numel() for p in ref.parameters() if p.requires_grad]
    assert sum(params) <= trainable < sum(params) + 16 * len(params)
    nodes = [[ranks[r]["inode"] for r in range(n, n + local_world)] for n in range(0, world, local_world)]
    if local_world == 1:
        assert all(r["inode"] is None for r in ranks)
    else:
        assert all(len(set(node)) == 1 for node in nodes) and len({node[0] for node in nodes}) == len(nodes)
    for node in range(0, world, local_world):
        assert sum(ranks[r]["stepped"] for r in range(node, node + local_world)) == steps * trainable
    if local_world > 1:  # (each rank's share is its shards' sizes: cost.optimizer_shard)
        assert all(r["stepped"] < steps * trainable for r in ranks)
    if world != 4:
        return
    # The checkpoint the four ranks saved (two nodes) loads into one process: the same weights and
    # step count. (Checked in this case only: each load compiles the model once more.)
    torch.manual_seed(1)
    model = tiny_llama()
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=MBS, optimizer=OPT)
    trainer.load(f"{out}.ckpt")
    assert all(torch.equal(p.detach(), ranks[0]["state"][n]) for n, p in model.named_parameters())
    assert trainer.step_count == steps


def _shard_main(rank: int, world: int, init_file: str, out: str, steps: int, ckpt: str) -> None:
    """One rank of two nodes of two with the host state sharded across the nodes: clipped, two
    micro-batches, FP32. It saves a checkpoint of rank 0's initial weights, loads ``ckpt`` (one
    process's), trains, saves a checkpoint and what its node holds."""
    from megatrain.planner import cost

    with _process_group(rank, world, init_file, local_world=2):
        k = 2
        plan = Plan(micro_batches=k, optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=8)
        hw = megatrain.preset("H100_SXM").model_copy(update={"intra_node_bytes_per_s": 4.5e11,
                                                             "network_bytes_per_s": 4e11})
        trainer = megatrain.compile(tiny_llama(hidden=40), seq_len=S, micro_batch_size=MBS, micro_batches=k,
                                    optimizer=OPT, max_grad_norm=0.5, plan=plan, hardware=hw, host_state="shard")
        assert trainer.planned.timeline is not None  # the simulator runs the gathers too
        p = trainer.plan
        assert (p.host_state, p.nodes, p.optimizer_shards, p.gradient_reduction) == ("shard", 2, 2, "reduce_scatter")
        assert all(q.device.type == "meta" for q in trainer.model.parameters())  # no rank keeps whole weights
        trainer.save(f"{out}.init")  # rank 0's initial weights, from the nodes' slices
        trainer.load(ckpt)
        rows = k * MBS
        results = []
        for b in _global_batches(world, k, steps):
            res = trainer.step({n: t[rank * rows:(rank + 1) * rows] for n, t in b.items()})
            results.append((res.loss, res.micro_batch_losses, res.tokens, res.grad_norm))
        trainer.flush()
        dist.barrier()  # the other rank of the node has stepped its shards of the last update too
        host = trainer.host
        node = cost.node_memory(trainer.graph, p, cost.memory_breakdown(trainer.graph, p))
        trainer.save(f"{out}.ckpt")
        masters = [host.master(i).clone() for i in range(len(host.slices))]
        # GPU readiness of the gathers: from here, one more step on the CPU backend and on the
        # asynchronous fake CUDA (streams as threads, random delays before every op: an H2D that
        # read a gather tile too early, or a gather that overwrote one still being read, would
        # change the result) give bitwise the same losses and slices.
        from megatrain.runtime.backend import CPUBackend
        from megatrain.runtime.cuda import CUDABackend
        from megatrain.testing import AsyncFakeCuda
        from test_race_detector import restore

        snap = [b.clone() for b in host.blocks] + [t.clone() for t in host.steps]
        batch = {n: t[rank * rows:(rank + 1) * rows] for n, t in _global_batches(world, k, 1)[0].items()}

        def run(backend):
            dist.barrier()  # no rank restores the shared slices while another still reads them
            restore(trainer, snap, backend)
            dist.barrier()
            losses = trainer.step(batch).micro_batch_losses
            trainer.flush()
            dist.barrier()
            return losses, [b.clone() for b in host.blocks]

        want = run(CPUBackend())
        fake = AsyncFakeCuda(seed=rank, max_delay_s=2e-3)
        got = run(CUDABackend(adapter=fake))
        fake.close()
        asynchronous = got[0] == want[0] and all(torch.equal(x, y) for x, y in zip(got[1], want[1]))
        nbytes, persistent, inode, slices = host.nbytes, node.persistent, host.shared.inode, host.slices
        # BF16: the H2Ds read the gather tiles (BF16, filled by the node's ranks' shares), no CAST.
        # From one process's checkpoint the step's losses are one process's from the same weights
        # (checked by the caller), and the asynchronous fake CUDA's equal the CPU backend's.
        trainer = megatrain.compile(tiny_llama(hidden=40), seq_len=S, micro_batch_size=MBS, micro_batches=k,
                                    optimizer=OPT, max_grad_norm=0.5, host_state="shard",
                                    plan=dataclasses.replace(plan, compute_dtype="bfloat16"))
        ops = trainer.schedules.steady.ops
        direct = not any(op.kind is OpKind.CAST for op in ops) and all(
            op.tile is None for op in ops if op.kind is OpKind.H2D)
        trainer.load(ckpt)
        host = trainer.host
        snap = [b.clone() for b in host.blocks] + [t.clone() for t in host.steps]
        bf16 = run(CPUBackend())
        fake = AsyncFakeCuda(seed=rank + 4, max_delay_s=2e-3)
        got = run(CUDABackend(adapter=fake))
        fake.close()
        bf16_async = got[0] == bf16[0] and all(torch.equal(x, y) for x, y in zip(got[1], bf16[1]))
        torch.save({"results": results, "slices": slices, "masters": masters, "async": asynchronous,
                    "nbytes": nbytes, "persistent": persistent, "inode": inode, "bf16_direct": direct,
                    "bf16_losses": bf16[0], "bf16_async": bf16_async}, f"{out}.{rank}")


def test_two_nodes_sharding_the_host_state_train_the_global_batch_as_one_process_does(tmp_path):
    """Plan.host_state='shard', 4 ranks as 2 nodes x 2 (clipped, 2 micro-batches, FP32): each node
    holds half of the masters and moments, the ranks gather each layer's weights before use, and
    the losses, the clipped global norm and the final weights equal one process training the
    global batch within RTOL. Checkpoints cross world sizes both ways: the ranks start from one
    process's checkpoint, and the one they save (and one of rank 0's initial weights, broadcast at
    compile) loads into one process. A step on the asynchronous fake CUDA equals the CPU backend's
    bitwise."""
    world, k, steps, clip = 4, 2, 2, 0.5
    torch.manual_seed(7)  # other weights than any rank's own initialisation
    start = tiny_llama(hidden=40)
    ref = copy.deepcopy(start)
    megatrain.compile(start, seq_len=S, micro_batch_size=MBS, optimizer=OPT).save(tmp_path / "start")
    out = str(tmp_path / "rank")
    mp.spawn(_shard_main, args=(world, str(tmp_path / "init"), out, steps, str(tmp_path / "start")), nprocs=world,
             join=True)

    def loaded(path) -> dict[str, torch.Tensor]:  # a checkpoint's weights, loaded into one process
        model = tiny_llama(hidden=40)
        megatrain.compile(model, seq_len=S, micro_batch_size=MBS, optimizer=OPT).load(path)
        return {n: q.detach().clone() for n, q in model.named_parameters()}

    torch.manual_seed(0)
    rank0 = tiny_llama(hidden=40)  # rank 0's own initialisation (seeded by its rank)
    assert all(torch.equal(q, dict(rank0.named_parameters())[n]) for n, q in loaded(f"{out}.init").items())
    graph = trace(copy.deepcopy(ref), micro_batch_size=MBS, seq_len=S, input_names=("input_ids", "labels")).graph
    batches = _global_batches(world, k, steps)
    want = eager_losses(copy.deepcopy(ref), batches, world * k, clip, adamw=OPT)
    ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    assert all(r["results"] == ranks[0]["results"] for r in ranks)
    assert all(r["async"] for r in ranks)
    for step, ((loss, per_mb, tokens, _), w) in enumerate(zip(ranks[0]["results"], want)):
        assert abs(loss - w) <= RTOL * abs(w), f"step {step}: {world} ranks {loss} vs one process {w}"
    norm = _first_step_norm(ref, batches[0])
    got = ranks[0]["results"][0][3]
    assert got > clip and abs(got - norm) <= RTOL * norm, (got, norm)
    # The two nodes' slices tile every layer exactly; the ranks of a node share one mapping.
    assert ranks[0]["inode"] == ranks[1]["inode"] != ranks[2]["inode"] == ranks[3]["inode"]
    full = []
    for li, layer in enumerate(graph.layers):
        (a, b), (c, d) = ranks[0]["slices"][li], ranks[2]["slices"][li]
        assert (a, b, c, d) == (0, c, b, layer.numel)
        full.append(torch.cat([ranks[0]["masters"][li], ranks[2]["masters"][li]]))
    eager_losses(ref, batches, world * k, clip, adamw=OPT)  # the same training again, for the weights
    named, saved = dict(ref.named_parameters()), loaded(f"{out}.ckpt")
    for li, layer in enumerate(graph.layers):
        for spec in layer.params:
            q, p = full[li][spec.offset:spec.offset + spec.numel].view(spec.shape), named[spec.name].detach()
            assert torch.equal(saved[spec.name], q)  # the checkpoint holds the nodes' slices, whole
            err = ((q - p).norm() / p.norm()).item()
            assert err <= RTOL, f"{spec.name}: relative difference {err:.2e}"
    # Each node holds about half the state: cost.node_memory's 1/M, up to the 16-element alignment
    # of each of the node's 2 shards per layer (12 bytes per element of masters and moments).
    from megatrain.planner import cost

    slack = len(graph.layers) * 2 * cost.SHARD_ALIGN_ELEMENTS * 12
    for r in (0, 2):
        assert abs(ranks[r]["nbytes"] - ranks[r]["persistent"]) <= slack, (ranks[r]["nbytes"], ranks[r]["persistent"])
    assert ranks[0]["nbytes"] + ranks[2]["nbytes"] == cost.persistent_state_bytes(graph)
    # BF16 from the start checkpoint: no CAST, the H2Ds read the gather tiles, and each rank's
    # first losses are bitwise one process's on its rows (the forward reads the gathered weights,
    # which are the masters cast to BF16 elementwise, wherever the cast ran).
    one = megatrain.compile(tiny_llama(hidden=40), seq_len=S, micro_batch_size=MBS, micro_batches=k, optimizer=OPT,
                            max_grad_norm=clip, plan=Plan(micro_batches=k, optimizer=OptimizerPlacement.NEXT_FORWARD,
                                                          grad_ring=8, compute_dtype="bfloat16"))
    rows = k * MBS
    batch = _global_batches(world, k, 1)[0]
    assert all(r["bf16_direct"] and r["bf16_async"] and r["bf16_losses"] == ranks[0]["bf16_losses"] for r in ranks)
    for r in (0, world - 1):  # a rank of each node (the others' rows are checked the same way)
        one.load(tmp_path / "start")
        mine = one.step({n: t[r * rows:(r + 1) * rows] for n, t in batch.items()}).micro_batch_losses
        assert ranks[r]["bf16_losses"][r * k:(r + 1) * k] == mine, f"rank {r}"  # (every rank reports all)


def _nvme_main(rank: int, world: int, init_file: str, out: str, ckpt: str, nvme_dir: str) -> None:
    """One rank of a node of two sharing one host copy: two trainers of the same weights, one all in
    RAM and one with the Adam moments of layers 1 and 3 in NVMe files (``nvme_dir``, shared by the
    ranks), both loading one process's checkpoint, then taking the same clipped steps."""
    from megatrain.runtime.nvme import align_up
    from megatrain.planner import cost

    with _process_group(rank, world, init_file, local_world=world):
        k, clip, on_nvme = 2, 0.5, frozenset({1, 3})
        plan = Plan(micro_batches=k, optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=8)
        trainers = []
        for moved in (frozenset(), on_nvme):
            trainers.append(megatrain.compile(tiny_llama(), seq_len=S, micro_batch_size=MBS, micro_batches=k,
                                              optimizer=OPT, max_grad_norm=clip,
                                              plan=dataclasses.replace(plan, nvme_moments=moved),
                                              nvme_dir=nvme_dir if moved else None))
        ram, disk = trainers
        assert (disk.plan.optimizer_shards, disk.plan.gradient_reduction, disk.plan.nvme_moments) == (
            2, "reduce_scatter", on_nvme)
        rows = k * MBS
        results: list[list] = [[], []]
        for t, res in zip(trainers, results):
            t.load(ckpt)  # every rank writes its shard of the NVMe layers' moments into its own files
            for b in _global_batches(world, k, 3):
                r = t.step({n: x[rank * rows:(rank + 1) * rows] for n, x in b.items()})
                res.append((r.loss, r.micro_batch_losses, r.grad_norm))
            t.flush()
        disk.save(f"{out}.ckpt")  # rank 0 reads the moments of layers 1 and 3 from both ranks' files
        states = [t.state_dict(flush=False) for t in trainers]
        same_weights = all(torch.equal(states[0]["model"][n], states[1]["model"][n]) for n in states[0]["model"])
        same_moments = all(torch.equal(states[0]["optimizer"][n], megatrain.runtime.host.as_tensor(v))
                           for n, v in states[1]["optimizer"].items())
        files = {}
        for li in on_nvme:
            lo, hi = cost.optimizer_shard(disk.graph.layers[li].trainable_numel, 2, rank)
            path = os.path.join(nvme_dir, f"L{li}.r{rank}.moments.tile")
            files[li] = (os.path.getsize(path), align_up(2 * (hi - lo) * 4), hi - lo)
        torch.save({"results": results, "weights": same_weights, "moments": same_moments, "files": files,
                    "state": {n: p.detach().clone() for n, p in ram.model.named_parameters()},
                    "exp_avg_sq": megatrain.runtime.host.as_tensor(
                        states[1]["optimizer"][f"{disk.graph.layers[3].name}.exp_avg_sq"])}, f"{out}.{rank}")


def test_two_ranks_with_moments_on_nvme_train_bitwise_as_with_them_in_ram_and_checkpoints_cross(tmp_path):
    """Plan.nvme_moments under data parallel: 2 ranks sharing a node (FP32, clipped, 2 micro-batches),
    the moments of layers 1 and 3 in per-rank NVMe files in one directory. Losses, global norms,
    final weights and moments equal the same 2-rank run with everything in RAM bitwise (same
    ranks, same shards, same arithmetic); each rank's files hold its optimizer shard (half a layer);
    the checkpoint of one process (with moments after a step) loads into the ranks, and theirs
    loads into one process all in RAM."""
    torch.manual_seed(7)
    start = megatrain.compile(tiny_llama(), seq_len=S, micro_batch_size=MBS, optimizer=OPT)
    start.step(random_batch(MBS, S, VOCAB, seed=5))  # moments that are not zeros
    start.save(tmp_path / "start")
    (tmp_path / "nvme").mkdir()
    out = str(tmp_path / "rank")
    mp.spawn(_nvme_main, args=(2, str(tmp_path / "init"), out, str(tmp_path / "start"), str(tmp_path / "nvme")),
             nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for r in ranks:
        ram, disk = r["results"]
        assert ram == disk and ram == ranks[0]["results"][0]
        assert r["weights"] and r["moments"]
        assert ram[0][2] > 0.5  # the first step's global norm exceeds the bound: the clipping acts
    sizes = [{li: f for li, f in r["files"].items()} for r in ranks]
    for li in (1, 3):  # each rank's file holds its shard: the two shards make the layer
        assert all(size == want for size, want, _ in (s[li] for s in sizes))
        assert sizes[0][li][2] + sizes[1][li][2] == start.graph.layers[li].trainable_numel
        assert sizes[0][li][2] < start.graph.layers[li].trainable_numel
    model = tiny_llama()
    one = megatrain.compile(model, seq_len=S, micro_batch_size=MBS, optimizer=OPT)
    one.load(f"{out}.ckpt")
    assert all(torch.equal(p.detach(), ranks[0]["state"][n]) for n, p in model.named_parameters())
    got = one.state_dict(flush=False)["optimizer"][f"{one.graph.layers[3].name}.exp_avg_sq"]
    assert torch.equal(got, ranks[0]["exp_avg_sq"]) and got.abs().sum() > 0 and one.step_count == 4


def _async_main(rank: int, world: int, init_file: str, out: str, ckpt: str) -> None:
    """One rank of a node of two: loads the checkpoint one process saved, then takes the same
    clipped steps on the CPU backend and on the CUDA backend over the asynchronous fake CUDA (the
    race detector), from the same state."""
    from megatrain.ir.plan import ActivationPolicy as A
    from megatrain.runtime.backend import CPUBackend
    from megatrain.runtime.cuda import CUDABackend
    from megatrain.testing import AsyncFakeCuda
    from test_race_detector import restore

    with _process_group(rank, world, init_file, local_world=world):
        plan = Plan(micro_batches=2, slots=2, prefetch_distance=1, optimizer=OptimizerPlacement.NEXT_FORWARD,
                    grad_ring=4, activations=(A.OFFLOAD, A.RECOMPUTE, A.OFFLOAD, A.KEEP))
        model = tiny_llama()
        trainer = megatrain.compile(model, seq_len=S, micro_batch_size=MBS, micro_batches=2, optimizer=OPT,
                                    max_grad_norm=0.5, plan=plan)
        trainer.load(ckpt)  # every rank reads it into the node's shared tiles
        saved = torch.load(f"{ckpt}.state")
        loaded = trainer.step_count == 1 and all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
        snap = [b.clone() for b in trainer.host.blocks] + [s.clone() for s in trainer.host.steps]
        rows = 2 * MBS

        def run(backend):
            dist.barrier()  # no rank restores the shared blocks while another still copies them
            restore(trainer, snap, backend)  # every rank writes the same bytes into them
            dist.barrier()
            losses = [trainer.step({n: t[rank * rows:(rank + 1) * rows] for n, t in b.items()}).micro_batch_losses
                      for b in _global_batches(world, 2, 3)]
            trainer.flush()
            return losses, [b.clone() for b in trainer.host.blocks]

        want = run(CPUBackend())
        fake = AsyncFakeCuda(seed=rank, max_delay_s=2e-3)
        got = run(CUDABackend(adapter=fake))
        fake.close()
        result = {"loaded": loaded, "losses": got[0] == want[0],
                  "state": all(torch.equal(x, y) for x, y in zip(got[1], want[1]))}

        # BF16 with a staging tile per layer: the node's ranks share the tiles (Plan.shared_cast),
        # each casting its shard. The same trainer then runs the per-rank casts for comparison.
        trainer = megatrain.compile(tiny_llama(), seq_len=S, micro_batch_size=MBS, micro_batches=2, optimizer=OPT,
                                    max_grad_norm=0.5, plan=dataclasses.replace(plan, compute_dtype="bfloat16",
                                                                                cast_once=True))
        trainer.load(ckpt)
        snap = [b.clone() for b in trainer.host.blocks] + [s.clone() for s in trainer.host.steps]
        cast: list[int] = []  # elements each of this rank's CASTs writes
        real_cast, real_copy = executor.HANDLERS[OpKind.CAST], executor._copy

        def counted(ctx, i, op):
            executor._copy = lambda dst, src: (cast.append(dst.numel()), real_copy(dst, src))[1]
            try:
                return real_cast(ctx, i, op)
            finally:
                executor._copy = real_copy
        executor.HANDLERS[OpKind.CAST] = counted
        shared = run(CPUBackend())
        result["shared_cast"] = (trainer.plan.shared_cast, len(trainer.host.staging), sum(cast))
        fake = AsyncFakeCuda(seed=rank + 2, max_delay_s=2e-3)
        got = run(CUDABackend(adapter=fake))
        fake.close()
        result["bf16_async"] = got[0] == shared[0] and all(torch.equal(x, y) for x, y in zip(got[1], shared[1]))
        own = dataclasses.replace(trainer.plan, shared_cast=False)
        trainer.plan, trainer.schedules = own, Schedules.lower(trainer.graph, own)
        cast.clear()
        alone = run(CPUBackend())
        executor.HANDLERS[OpKind.CAST] = real_cast
        result["own_cast"] = sum(cast)
        result["bf16_own"] = alone[0] == shared[0] and all(torch.equal(x, y) for x, y in zip(alone[1], shared[1]))
        result["bf16_losses"] = shared[0]
        torch.save(result, f"{out}.{rank}")


def test_ranks_on_the_asynchronous_fake_cuda_train_exactly_like_on_the_cpu_backend(tmp_path):
    """GPU readiness of the collectives: with streams as threads and random delays before every op,
    the ALL_REDUCEs (after asynchronous D2Hs) and the ALL_GATHERs (before the next H2D) of two ranks
    sharing a node give bitwise the CPU backend's losses and host state. They start from a
    checkpoint one process saved (a checkpoint loads into any number of ranks)."""
    torch.manual_seed(7)  # other weights than any rank's own initialisation
    model = tiny_llama()
    one = megatrain.compile(model, seq_len=S, micro_batch_size=MBS, optimizer=OPT)
    one.step(random_batch(MBS, S, VOCAB, seed=5))
    one.save(tmp_path / "ckpt")
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, tmp_path / "ckpt.state")
    out = str(tmp_path / "rank")
    mp.spawn(_async_main, args=(2, str(tmp_path / "init"), out, str(tmp_path / "ckpt")), nprocs=2, join=True)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    for r in range(2):
        assert {k: got[r][k] for k in ("loaded", "losses", "state", "bf16_async", "bf16_own")} == dict.fromkeys(
            ("loaded", "losses", "state", "bf16_async", "bf16_own"), True), f"rank {r}"
    # BF16 with a tile per layer: the two ranks share the node's staging tiles, one per layer, and
    # each casts its shard: together exactly the elements one rank casts alone, each fewer. The
    # cast is elementwise, so sharing it changes no bit (bf16_own, bf16_async above).
    (on, tiles, mine), (_, _, theirs) = got[0]["shared_cast"], got[1]["shared_cast"]
    assert on and tiles == 4
    assert got[0]["own_cast"] == got[1]["own_cast"] == mine + theirs and 0 < mine < got[0]["own_cast"]
    assert 0 < theirs < got[0]["own_cast"]
    assert all(math.isfinite(x) for step in got[0]["bf16_losses"] for x in step)


def _hang_main(rank: int, world: int, init_file: str, out: str, how: str) -> None:
    """Both ranks train a step and save; then rank 1 hangs or dies (``how``) and rank 0 steps on."""
    os.environ.update(LOCAL_WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=HANG_TIMEOUT_S))
    torch.set_num_threads(1)
    trainer = megatrain.compile(tiny_llama(), seq_len=S, micro_batch_size=MBS, optimizer=OPT)
    batch = random_batch(MBS, S, VOCAB, seed=rank)
    trainer.step(batch)
    trainer.save(f"{out}.ckpt")
    if rank == 1 and how == "dies":
        os._exit(1)
    if rank == 1 and how == "stops":
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)  # as `kill -STOP`, a debugger or a hung driver: every thread stops
    if rank == 1:
        time.sleep(120)  # hangs (the test kills it)
    start = time.monotonic()
    try:
        trainer.step(batch)
        result = "no error"
    except megatrain.CollectiveError as e:
        result = str(e)
    torch.save({"error": result, "seconds": time.monotonic() - start}, f"{out}.{rank}")
    os._exit(0)  # no destroy_process_group: it would wait for the hung rank


HANG_TIMEOUT_S = 3


def _two_ranks(main, tmp_path, how: str, watch: int) -> dict:
    """Run ``main(rank, 2, init file, out, how)`` on two spawned ranks; once rank ``watch`` is done
    (or ten minutes on), kill both (one may hang or be stopped) and return what ``watch`` saved.

    The wait bounds a rank that never returns, which is what these tests look for; it is not a
    speed target: a spawned rank imports torch and transformers and compiles before its first
    collective, which took over two minutes on a 2-core machine under a load of 10."""
    out = str(tmp_path / "rank")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=main, args=(r, 2, str(tmp_path / "init"), out, how)) for r in range(2)]
    for p in procs:
        p.start()
    procs[watch].join(timeout=600)
    finished = procs[watch].exitcode is not None
    for p in procs:
        p.kill()
    assert finished, f"rank {watch} did not return within 10 minutes: it hangs"
    return torch.load(f"{out}.{watch}")


@pytest.mark.parametrize("how", ["hangs", "dies", "stops"])
def test_a_rank_that_hangs_or_dies_makes_the_others_stop_with_a_clear_error_within_the_timeout(tmp_path, how):
    got = _two_ranks(_hang_main, tmp_path, how, watch=0)
    # The step's first collective, which rank 0 waits in: the sum of the ranks' supervised tokens.
    assert "COUNT_REDUCE:L" in got["error"] and "failed on rank 0 of 2" in got["error"], got["error"]
    assert f"timeout is {HANG_TIMEOUT_S} s" in got["error"] and "restart all of them from the last checkpoint" in got["error"]
    # The rank that stopped is named, from the ranks' heartbeats (the collective's own error names no peer).
    assert "Rank 1 has not begun step 2 (it last began step 1)" in got["error"] or \
        "Rank 1 stopped: no heartbeat for" in got["error"], got["error"]
    if how == "stops":
        assert "Rank 1 stopped: no heartbeat for" in got["error"], got["error"]
    # A hung rank: it waited for the timeout, not for the rank (which sleeps 120 s). A dead one:
    # gloo may see the closed connection at once, or wait for the timeout.
    assert (HANG_TIMEOUT_S if how != "dies" else 0) <= got["seconds"] < 60
    # The checkpoint saved before the hang is complete: its manifest (written last) is there.
    assert (tmp_path / "rank.ckpt" / STATE_DIR / MANIFEST).is_file()


def _patient_main(rank: int, world: int, init_file: str, out: str, how: str) -> None:
    """Rank 0 works for three timeouts (a long save or data preparation) or stops; rank 1 waits."""
    from megatrain.runtime.distributed import Heartbeat, patient_barrier

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=HANG_TIMEOUT_S))
    Heartbeat.start(interval=HANG_TIMEOUT_S / 10)
    if rank == 0:
        if how == "stops":
            import signal

            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3 * HANG_TIMEOUT_S)
    start = time.monotonic()
    try:
        patient_barrier("the wait for rank 0's save")
        result = "no error"
    except megatrain.CollectiveError as e:
        result = str(e)
    torch.save({"error": result, "seconds": time.monotonic() - start}, f"{out}.{rank}")
    os._exit(0)


@pytest.mark.parametrize("how", ["works-long", "stops"])
def test_the_wait_for_rank_0s_long_work_lasts_while_its_heartbeat_goes_on(tmp_path, how):
    """A save or data preparation longer than the collective timeout is waited for (it stopped a
    healthy run); a rank 0 that stops is named within the timeout (it blocked the others)."""
    got = _two_ranks(_patient_main, tmp_path, how, watch=1)
    if how == "works-long":
        assert got["error"] == "no error" and got["seconds"] >= 2 * HANG_TIMEOUT_S
    else:
        assert "the wait for rank 0's save on rank 1: Rank 0 stopped: no heartbeat for" in got["error"], got["error"]
        assert got["seconds"] < 60


# test_train_cli's run, shortened.
RUN_FLAGS = ["--max-steps", "3", "--warmup-steps", "1", "--eval-interval", "2", "--checkpoint-interval", "2",
             "--eps", "1e-6", "--collective-timeout", "60"]


def test_megatrain_train_under_torchrun_trains_as_one_process_does(tmp_path):
    """docs/data-parallel.md's command: two ranks (one node) train the run one process trains; only rank 0
    writes the outputs."""
    from safetensors.torch import load_file

    from megatrain.cli import main
    from test_train_cli import CONFIG_YAML, write_model

    (tmp_path / "run.yaml").write_text(CONFIG_YAML.format(model=write_model(tmp_path / "config.json")))
    run = ["train", "--config", str(tmp_path / "run.yaml"), *RUN_FLAGS, "--output-dir"]
    assert main([*run, str(tmp_path / "one")]) == 0
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run([str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2", "--no-python",
                           str(bin_dir / "megatrain"), *run, str(tmp_path / "two")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = ([json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("one", "two"))
    assert [r["step"] for r in two] == [1, 2, 3]  # one writer
    for a, b in zip(one, two):
        for key in ("loss", "val_loss", "grad_norm"):
            if a[key] is not None:
                assert abs(b[key] - a[key]) <= RTOL * abs(a[key]), (key, a, b)
    w1, w2 = (load_file(tmp_path / d / "checkpoint" / "model.safetensors") for d in ("one", "two"))
    assert w1.keys() == w2.keys()
    for name in w1:
        err = ((w2[name] - w1[name]).norm() / w1[name].norm()).item()
        assert err <= RTOL, f"{name}: relative difference {err:.2e}"
    assert proc.stdout.count("done: step 3") == 1  # rank 0 prints; the other rank is quiet
    assert proc.stdout.count("step 3: saved") == 1, proc.stdout  # also where the progress bar writes
    # One planning front door: `megatrain plan --config` with the run's settings and torchrun's ranks
    # writes the schedule.json each run wrote (the two ranks' plan: ALL_REDUCEs or REDUCE_SCATTERs).
    for ranks, d in ((1, "one"), (2, "two")):
        assert main(["plan", "--config", str(tmp_path / "run.yaml"), "--hardware", "H100_SXM",
                     "--gpus-per-node", str(ranks), "--out", str(tmp_path / f"plan_{d}")]) == 0
        ran = (tmp_path / d / "schedule.json").read_bytes()
        assert (tmp_path / f"plan_{d}" / "schedule.json").read_bytes() == ran, d
        assert Schedule.from_json(ran.decode()).plan.data_parallel == ranks


def test_megatrain_train_refuses_a_global_batch_the_ranks_cannot_split(tmp_path, monkeypatch):
    from megatrain.errors import ConfigError
    from megatrain.train import TrainConfig
    from megatrain.train.loop import train

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="global_batch=8 rows do not split into 3 ranks.*multiple of 6"):
        train(TrainConfig(model=str(tmp_path / "config.json"), output_dir=str(tmp_path / "out"), global_batch=8,
                          micro_batch_size=2))
    assert not (tmp_path / "out").exists()


def test_what_several_ranks_cannot_run_yet_is_refused_before_anything_is_bound(tmp_path):
    from megatrain.errors import ConfigError

    model = tiny_llama()
    own = [p.data_ptr() for p in model.parameters()]
    planned = megatrain.plan_model(model, seq_len=S, micro_batch_size=MBS)
    with pytest.raises(PlanError, match="masters on NVMe run on one rank only: each rank's file would hold its "
                                        "optimizer shard.*keep nvme_moments, which run under data parallel"):
        dataclasses.replace(planned.plan, data_parallel=2, compute_dtype="bfloat16", cast_once=True,
                            nvme_moments=frozenset({1}), nvme_masters=frozenset({1}))
    with pytest.raises(PlanError, match="nvme_gradients.*gradients are reduced in the ring tile.*written out from its "
                                        "I/O buffer before any reduction"):
        dataclasses.replace(planned.plan, data_parallel=2, optimizer=OptimizerPlacement.NEXT_FORWARD,
                            nvme_gradients=frozenset({1}))
    sharded = dataclasses.replace(planned.plan, data_parallel=2, nodes=2, host_state="shard")
    with pytest.raises(ConfigError, match="moments of layers \\[1\\] on NVMe and shards the host state.*not "
                                           "supported: a save reads whole moment rows from one node's files"):
        megatrain.materialize(dataclasses.replace(planned, plan=dataclasses.replace(
            sharded, nvme_moments=frozenset({1}))), OPT, nvme_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="host_state='shard' splits the host state across the nodes.*there is none"):
        megatrain.compile(model, seq_len=S, micro_batch_size=MBS, host_state="shard")
    assert not list(tmp_path.iterdir())  # no NVMe file made
    assert [p.data_ptr() for p in model.parameters()] == own  # the module was not bound to host tiles


def test_all_reduce_time_is_a_ring_all_reduce(graph):
    from megatrain.errors import ConfigError
    from megatrain.planner import cost
    from megatrain.ir.hardware import preset

    layer = next(lay for lay in graph.layers if lay.trainable_numel)
    hw = preset("H100_SXM").model_copy(update={"allreduce_bytes_per_s": 1e9, "op_latency_s": 1e-5})
    # each rank sends and receives 2 (N - 1) / N of the FP32 gradients (4 bytes per parameter)
    want = 2 * 3 / 4 * layer.trainable_numel * 4 / 1e9 + 1e-5
    assert cost.all_reduce_time(layer, hw, Plan(data_parallel=4)) == pytest.approx(want, rel=1e-12)
    assert cost.all_reduce_time(layer, hw, Plan()) == 0.0
    with pytest.raises(ConfigError, match="allreduce_bytes_per_s=0"):
        cost.all_reduce_time(layer, preset("H100_SXM"), Plan(data_parallel=2))
