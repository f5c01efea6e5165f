"""Ops, schedules, lowering and the verifier: round trips, invariants, and mutations it must catch."""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrain.errors import PlanError, ScheduleError
from megatrain.planner.lower import lower
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.ir.schedule import Op, OpKind, Schedule
from megatrain.planner.verify import happens_before, verify

from graphs import chain_graph


@pytest.mark.parametrize("text", ["H2D:L3:s1", "H2D:L3:s1:t0", "FWD:L0:m2:s0", "BWD:L12:m0:s3", "D2H:L4:s1:r0",
                                  "OPT:L7:r1", "OPT:L7:a1", "OFFLOAD:L2:m1:c1", "RELOAD:L2:m1:c0",
                                  "RECOMPUTE:L5:m0:s2", "CAST:L3:t1", "ACC:L3:m1:r0:a2"])
def test_op_repr_parses_back(text):
    op = Op.parse(text, deps=(1, 2))
    assert repr(op) == text and op.deps == (1, 2)
    assert Op.parse(repr(op), op.deps) == op


@pytest.mark.parametrize("text, match", [
    ("XYZ:L1", "unknown op kind"), ("H2D:L1", "H2D:L<int>:s<int>"), ("FWD:L1:s0:m0", "m<int>"),
    ("OPT:Lx:r0", "L<int>"), ("OPT:L1", "ring.*an accumulator.*or a gradient I/O buffer"), ("OPT:L1:r0:a0", "exactly one"),
    ("ACC:L3:m1:r0", r"needs acc.*ACC:L<int>:m<int>:r<int>:a<int>"), ("OFFLOAD:L2:m1", "needs copy"),
    ("H2D:L1:s0:s1", "unexpected 's1'"), ("m0:s1", "unknown op kind"), ("FWD:m0:s1", "no layer"),
])
def test_bad_op_text_is_refused(text, match):
    with pytest.raises(ValueError, match=match):
        Op.parse(text)


def test_op_fields_are_checked():
    with pytest.raises(ValueError, match="needs slot"):
        Op(OpKind.H2D, 1)
    with pytest.raises(ValueError, match="takes no mb"):
        Op(OpKind.OPT, 1, mb=0, ring=0)
    with pytest.raises(ValueError, match="takes no tile"):
        Op(OpKind.FWD, 1, mb=0, slot=0, tile=0)


@given(kind=st.sampled_from(list(OpKind)), layer=st.integers(0, 500), data=st.data())
def test_any_op_round_trips(kind, layer, data):
    spec = kind.spec  # the fields come from the kind's record, so a new kind needs no line here
    index = st.integers(0, 64)
    fields = {name: data.draw(index) for name in spec.required}
    if spec.one_of:
        fields[data.draw(st.sampled_from(spec.one_of))] = data.draw(index)
    for name in spec.optional:
        if name not in spec.one_of and data.draw(st.booleans()):
            fields[name] = data.draw(index)
    op = Op(kind, layer, **fields)
    assert Op.parse(repr(op)) == op


PLANS = [Plan(), Plan(micro_batches=3), Plan(slots=1, prefetch_distance=0, grad_ring=1),
         Plan(slots=4, prefetch_distance=3, grad_ring=3, micro_batches=2),
         Plan(slots=2, prefetch_distance=1, resident=frozenset({0, 5})),
         Plan(micro_batches=3, layer_by_layer=False, activations=(ActivationPolicy.OFFLOAD,) * 6)]


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_lowered_schedules_verify_and_round_trip_json(plan, mode):
    g = chain_graph(6)
    s = lower(g, plan, mode)
    verify(s, g)
    again = Schedule.from_json(s.to_json())
    assert again == s and again.to_json() == s.to_json()


def test_weights_are_loaded_at_most_twice_per_step_and_the_turn_reuses_a_slot():
    g = chain_graph(6)
    s = lower(g, Plan(micro_batches=4), "train")
    loads = [op.layer for op in s.ops if op.kind is OpKind.H2D]
    assert all(loads.count(layer) <= 2 for layer in range(6))
    assert loads.count(5) == 1 and loads.count(4) == 1, "the last layers stay in their slots at the turn"
    assert sum(op.kind is OpKind.FWD and op.layer == 5 for op in s.ops) == 0, "no separate loss forward"
    resident = lower(g, Plan(resident=frozenset({2})), "train")
    assert [op.layer for op in resident.ops if op.kind is OpKind.H2D].count(2) == 1


def test_schedule_dag_with_stream_order_is_acyclic_per_networkx():
    g = chain_graph(5)
    s = lower(g, Plan(micro_batches=2), "train")
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(s)))
    last = {}
    for i, op in enumerate(s.ops):
        dag.add_edges_from((d, i) for d in op.deps)
        if op.stream in last:
            dag.add_edge(last[op.stream], i)
        last[op.stream] = i
    assert nx.is_directed_acyclic_graph(dag)
    anc = happens_before(s)
    for i in range(len(s)):
        assert {j for j in range(len(s)) if (anc[i] >> j) & 1} == nx.ancestors(dag, i)


def _drop_dep(s: Schedule, i: int, dep: int) -> Schedule:
    ops = list(s.ops)
    ops[i] = dataclasses.replace(ops[i], deps=tuple(d for d in ops[i].deps if d != dep))
    return dataclasses.replace(s, ops=tuple(ops))


def _find(s: Schedule, kind: OpKind, layer: int, mb: int | None = None) -> int:
    return next(i for i, op in enumerate(s.ops) if op.kind is kind and op.layer == layer and op.mb == mb)


def test_verifier_catches_an_h2d_that_overwrites_a_slot_in_use():
    g = chain_graph(4)
    s = lower(g, Plan(), "train")
    h = _find(s, OpKind.H2D, 2)
    fwd0 = _find(s, OpKind.FWD, 0, 0)
    bad = _drop_dep(s, h, fwd0)
    with pytest.raises(ScheduleError, match=r"rule 'weights'.*may overwrite slot s0") as e:
        verify(bad, g)
    assert "-->" in str(e.value) and "FWD:L0:m0:s0" in str(e.value)


def test_verifier_catches_gradients_overwritten_before_copy_out():
    g = chain_graph(4)
    s = lower(g, Plan(), "train")
    d2h = _find(s, OpKind.D2H, 2)
    later = next(i for i, op in enumerate(s.ops) if op.kind is OpKind.H2D and d2h in op.deps)
    bad = _drop_dep(s, later, d2h)
    with pytest.raises(ScheduleError, match="rule 'gradients'"):
        verify(bad, g)


def test_verifier_catches_an_update_before_all_micro_batches():
    g = chain_graph(3)
    s = lower(g, Plan(micro_batches=2), "train")
    ops = list(s.ops)
    # Move layer 1's update (and its gradient copy) to depend only on micro-batch 0.
    b0 = _find(s, OpKind.BWD, 1, 0)
    b1 = _find(s, OpKind.BWD, 1, 1)
    ops[b1] = dataclasses.replace(ops[b1], deps=tuple(d for d in ops[b1].deps if d != b0))
    d = next(i for i, op in enumerate(ops) if op.kind is OpKind.D2H and op.layer == 1)
    ops[d] = dataclasses.replace(ops[d], deps=(b0,))
    # Put the D2H before micro-batch 1's backward in issue order.
    reordered = dataclasses.replace(s, ops=tuple(ops))
    with pytest.raises(ScheduleError):
        verify(reordered, g)


def test_verifier_catches_missing_and_duplicate_work():
    g = chain_graph(3)
    s = lower(g, Plan(), "train")
    opt = _find(s, OpKind.OPT, 1)
    without = dataclasses.replace(s, ops=s.ops[:opt] + s.ops[opt + 1:])
    with pytest.raises(ScheduleError):
        verify(without, g)
    twice = dataclasses.replace(s, ops=s.ops + (s.ops[opt],))
    with pytest.raises(ScheduleError, match=r"rule 'coverage'.*updated 2 times"):
        verify(twice, g)


def test_verifier_catches_a_forward_before_its_input():
    g = chain_graph(3)
    s = lower(g, Plan(slots=3, prefetch_distance=2), "eval")
    f1 = _find(s, OpKind.FWD, 1, 0)
    f0 = _find(s, OpKind.FWD, 0, 0)
    ops = list(s.ops)
    ops[f1] = dataclasses.replace(ops[f1], deps=tuple(d for d in ops[f1].deps if d != f0))
    # Issue layer 1's forward first so stream order does not hide the missing edge.
    ops[f0], ops[f1] = ops[f1], ops[f0]
    with pytest.raises(ScheduleError, match="rule 'weights'|rule 'data'|rule 'order'"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)


def test_verifier_catches_deps_pointing_forward():
    g = chain_graph(2)
    s = lower(g, Plan(), "train")
    ops = list(s.ops)
    ops[0] = dataclasses.replace(ops[0], deps=(3,))
    with pytest.raises(ScheduleError, match="rule 'order'"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)


@pytest.mark.parametrize("kw, match", [
    (dict(slots=0), "slot"), (dict(slots=2, prefetch_distance=2), "prefetch_distance"),
    (dict(grad_ring=0), "grad_ring"), (dict(micro_batches=0), "micro_batches"),
    (dict(compute_dtype="float16"), "compute_dtype"),
])
def test_bad_plans_are_refused(kw, match):
    with pytest.raises(PlanError, match=match):
        Plan(**kw)


def test_plan_that_does_not_fit_the_graph_is_refused():
    with pytest.raises(PlanError, match="resident names layers"):
        lower(chain_graph(3), Plan(resident=frozenset({7})))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 12), micro_batches=st.integers(1, 4), slots=st.integers(1, 5), data=st.data(),
       numel=st.lists(st.integers(16, 4096), min_size=12, max_size=12))
def test_every_lowered_schedule_verifies(n, micro_batches, slots, data, numel):
    d = data.draw(st.integers(0, slots - 1))
    resident = frozenset(data.draw(st.sets(st.integers(0, n - 1), max_size=min(3, n))))
    trainable = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    policies = tuple(data.draw(st.lists(st.sampled_from(list(ActivationPolicy)), min_size=n, max_size=n)))
    deferred = data.draw(st.booleans())
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
    per_mb = data.draw(st.booleans()) and micro_batches > 1  # per-micro-batch passes, host accumulation
    g = chain_graph(n, numel=numel[:n], trainable=trainable)
    ring = max(1, sum(trainable)) if deferred and not per_mb else data.draw(st.integers(1, 4))
    plan = Plan(micro_batches=micro_batches, slots=slots, prefetch_distance=d, grad_ring=ring, resident=resident,
                activations=policies, compute_dtype=dtype, staging_ring=data.draw(st.integers(1, 3)),
                optimizer=OptimizerPlacement.NEXT_FORWARD if deferred else OptimizerPlacement.DURING_BACKWARD,
                layer_by_layer=not per_mb)
    passes = micro_batches if per_mb else 1
    modes = [("train", False), ("eval", False)] + ([("train", True), ("update", False)] if deferred else [])
    for mode, carries in modes:
        s = lower(g, plan, mode, carries_updates=carries)
        verify(s, g)
        assert Schedule.from_json(s.to_json()) == s
        count = {}
        for op in s.ops:
            count[(op.kind, op.layer, op.mb)] = count.get((op.kind, op.layer, op.mb), 0) + 1
        for layer in range(n):
            recomputed = mode == "train" and policies[layer] is ActivationPolicy.RECOMPUTE and layer < n - 1
            offloaded = mode == "train" and policies[layer] is ActivationPolicy.OFFLOAD and layer < n - 1
            visits = (mode == "train") + (mode != "update" and layer < n - 1 or mode == "eval") + recomputed
            loads = count.get((OpKind.H2D, layer, None), 0)
            assert loads <= (min(1, visits) if layer in resident else visits * passes)
            accs = [count.get((OpKind.ACC, layer, mb), 0) for mb in range(micro_batches)]
            assert accs == [int(per_mb and mode == "train" and trainable[layer])] * micro_batches
            if dtype == "bfloat16":
                assert count.get((OpKind.CAST, layer, None), 0) == loads, "one CAST per weight copy"
            for mb in range(micro_batches):
                # No third forward: a layer recomputes only when its policy says so, and then once.
                assert count.get((OpKind.RECOMPUTE, layer, mb), 0) <= int(recomputed)
                assert count.get((OpKind.OFFLOAD, layer, mb), 0) == int(offloaded)
                assert count.get((OpKind.RELOAD, layer, mb), 0) <= int(offloaded)


def test_verifier_catches_a_reload_that_does_not_wait_for_its_offload():
    g = chain_graph(5)
    s = lower(g, Plan(activations=(ActivationPolicy.OFFLOAD,) * 5), "train")
    r = _find(s, OpKind.RELOAD, 1, 0)
    ops = list(s.ops)
    o = _find(s, OpKind.OFFLOAD, 3, 0)
    ops[o] = dataclasses.replace(ops[o], layer=1)  # layer 3's checkpoint is never copied out
    with pytest.raises(ScheduleError, match=r"RELOAD:L3:m0:c0 breaks rule 'data'.*no earlier OFFLOAD"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)
    b = _find(s, OpKind.BWD, 2, 0)
    bad = _drop_dep(s, b, r)
    with pytest.raises(ScheduleError, match=r"rule 'data'.*reads 'h1' from #\d+ RELOAD:L1:m0"):
        verify(bad, g)


def test_verifier_checks_the_resources_ops_name():
    """Each op names its staging tile, accumulator and pinned copy; a wrong name is caught."""
    g = chain_graph(5)
    s = lower(g, Plan(micro_batches=2, activations=(ActivationPolicy.OFFLOAD,) * 5), "train")
    ops = list(s.ops)
    r = _find(s, OpKind.RELOAD, 1, 1)
    ops[r] = dataclasses.replace(ops[r], copy=0)  # micro-batch 1 went into copy 1
    with pytest.raises(ScheduleError, match=r"RELOAD:L1:m1:c0 breaks rule 'data': it reads pinned copy c0, but "
                                            r"#\d+ OFFLOAD:L1:m1:c1 wrote"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)
    ops[r] = dataclasses.replace(ops[r], copy=2)
    with pytest.raises(ScheduleError, match=r"RELOAD:L1:m1:c2 breaks rule 'budget': pinned checkpoint copy c2"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)
    h = _find(s, OpKind.H2D, 1)
    ops = list(s.ops)
    ops[h] = dataclasses.replace(ops[h], tile=0)
    with pytest.raises(ScheduleError, match=r"H2D:L1:s\d:t0 breaks rule 'staging': a float32 plan copies the master"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)
    s = lower(g, Plan(compute_dtype="bfloat16", staging_ring=2), "train")
    verify(s, g)
    h = _find(s, OpKind.H2D, 1)
    ops = list(s.ops)
    ops[h] = dataclasses.replace(ops[h], tile=1 - ops[h].tile)
    with pytest.raises(ScheduleError, match=r"rule 'staging': it names staging tile t\d, but the CAST it reads"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)


def test_schedule_files_of_an_older_format_are_refused():
    import json

    import pydantic

    s = lower(chain_graph(3), Plan(), "train")
    doc = json.loads(s.to_json())
    assert doc["version"] == 19
    doc["version"] = 18
    with pytest.raises(pydantic.ValidationError, match="version 18 is not 19.*lower the plan again"):
        Schedule.from_json(json.dumps(doc))


def test_the_plan_in_a_schedule_file_is_the_plan_dataclass_field_by_field():
    import json

    import pydantic

    plan = Plan(micro_batches=2, layer_by_layer=False, compute_dtype="bfloat16", cast_once=True,
                resident=frozenset({2, 0}), nvme_moments=frozenset({1, 3}), nvme_masters=frozenset({3}),
                activations=(ActivationPolicy.KEEP, ActivationPolicy.OFFLOAD, ActivationPolicy.KEEP,
                             ActivationPolicy.KEEP))
    s = lower(chain_graph(4), plan, "train")
    doc = json.loads(s.to_json())
    # Every field, in order; optimizer_name only where it is not AdamW (AdamW's files stay as they were).
    assert list(doc["plan"]) == [f.name for f in dataclasses.fields(Plan) if f.name != "optimizer_name"]
    lion = dataclasses.replace(plan, optimizer_name="lion")
    lion_doc = json.loads(lower(chain_graph(4), lion, "train").to_json())
    assert list(lion_doc["plan"]) == [f.name for f in dataclasses.fields(Plan)] and lion_doc["plan"]["optimizer_name"] == "lion"
    assert Schedule.from_json(json.dumps(lion_doc)).plan == lion
    assert doc["plan"]["resident"] == [0, 2] and doc["plan"]["activations"] == ["keep", "offload", "keep", "keep"]
    assert Schedule.from_json(s.to_json()).plan == plan
    del doc["plan"]["nvme_buffers"]  # a field left out takes the dataclass's default
    assert Schedule.from_json(json.dumps(doc)).plan.nvme_buffers == Plan().nvme_buffers
    doc["plan"]["compute_dtype"] = "float16"  # the dataclass's Literal is the file's
    with pytest.raises(pydantic.ValidationError, match="compute_dtype"):
        Schedule.from_json(json.dumps(doc))
    doc["plan"]["compute_dtype"], doc["plan"]["slot"] = "bfloat16", 3
    with pytest.raises(pydantic.ValidationError, match="slot"):
        Schedule.from_json(json.dumps(doc))


def test_verifier_catches_a_weight_copy_before_the_deferred_update():
    g = chain_graph(4)
    plan = Plan(optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=4)
    s = lower(g, plan, "train", carries_updates=True)
    for layer in range(4):  # each deferred update sits right before its layer's first weight copy
        first_copy = _find(s, OpKind.H2D, layer)
        assert s.ops[first_copy - 1] == Op(OpKind.OPT, layer, ring=layer) and first_copy - 1 in s.ops[first_copy].deps
    h = _find(s, OpKind.H2D, 2)
    bad = _drop_dep(s, h, _find(s, OpKind.OPT, 2))
    with pytest.raises(ScheduleError, match=r"rule 'coverage'.*before the deferred update"):
        verify(bad, g)
    d = _find(s, OpKind.D2H, 1)
    ops = list(s.ops)
    ops[d] = dataclasses.replace(ops[d], ring=2)  # layer 2's tile, read by the next step's OPT:L2
    with pytest.raises(ScheduleError, match=r"rule 'gradients'.*keeps a tile of its own"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)
    with pytest.raises(ScheduleError, match="updated 0 times"):
        verify(dataclasses.replace(lower(g, plan, "train"), carries_updates=True), g)


def test_verifier_catches_a_staging_tile_overwritten_before_its_copy():
    g = chain_graph(4)
    s = lower(g, Plan(compute_dtype="bfloat16", staging_ring=1), "train")
    casts = [i for i, op in enumerate(s.ops) if op.kind is OpKind.CAST]
    second = casts[1]
    first_h2d = next(i for i, op in enumerate(s.ops) if op.kind is OpKind.H2D)
    bad = _drop_dep(s, second, first_h2d)
    with pytest.raises(ScheduleError, match=r"rule 'staging'.*may overwrite staging tile t0"):
        verify(bad, g)


def test_verifier_checks_the_memory_budget_against_a_spec():
    from graphs import spec

    g = chain_graph(4, numel=1 << 20, act_bytes=1 << 20)
    s = lower(g, Plan(), "train")
    verify(s, g, spec())
    with pytest.raises(ScheduleError, match=r"rule 'budget'.*GPU memory"):
        verify(s, g, spec(gpu_memory_bytes=10 << 20))
    with pytest.raises(ScheduleError, match=r"rule 'budget'.*pinned host memory"):
        verify(s, g, spec(pinned_memory_cap_bytes=1 << 20))


def test_offloaded_checkpoints_leave_the_gpu_and_lower_the_activation_peak():
    from megatrain.planner import cost

    g = chain_graph(8, act_bytes=1 << 20)
    keep = cost.memory_breakdown(g, Plan(micro_batches=2))
    off = cost.memory_breakdown(g, Plan(micro_batches=2, activations=(ActivationPolicy.OFFLOAD,) * 8))
    every_other = (ActivationPolicy.KEEP, ActivationPolicy.RECOMPUTE) * 4
    rec = cost.memory_breakdown(g, Plan(micro_batches=2, activations=every_other))
    mib = 1 << 20
    # KEEP: the 7 checkpoints of both micro-batches are on the GPU at the turn, with a gradient.
    assert keep.activations_peak >= 15 * mib
    # OFFLOAD: a few reloaded checkpoints and gradients around the running backward.
    assert off.activations_peak <= 7.5 * mib
    # Every other checkpoint recomputed: 4 of 7 kept, plus a recomputed one and gradients.
    assert rec.activations_peak <= 11.5 * mib
    assert off.pinned_activations == 14 * (1 << 20) and keep.pinned_activations == 0


def test_verifier_catches_a_local_backward_that_overwrites_gradients_not_yet_copied_out():
    """Per-micro-batch passes: layer 1 stays in its slot from micro-batch 0's local backward to
    micro-batch 1's, so the second must wait for the first one's D2H (no reload orders them)."""
    g = chain_graph(2)
    s = lower(g, Plan(micro_batches=2, layer_by_layer=False), "train")
    b0, b1 = _find(s, OpKind.BWD, 1, 0), _find(s, OpKind.BWD, 1, 1)
    assert s.ops[b0].slot == s.ops[b1].slot
    assert not any(op.kind is OpKind.H2D and b0 < i < b1 for i, op in enumerate(s.ops))
    d = next(i for i in s.ops[b1].deps if s.ops[i].kind is OpKind.D2H)
    verify(s, g)
    with pytest.raises(ScheduleError, match=r"BWD:L1:m1:s\d breaks rule 'gradients'.*before #\d+ D2H:L1"):
        verify(_drop_dep(s, b1, d), g)


def test_verifier_catches_an_update_reading_another_layers_accumulator():
    g = chain_graph(3)
    s = lower(g, Plan(micro_batches=2, layer_by_layer=False), "train")
    opt = _find(s, OpKind.OPT, 1)
    ops = list(s.ops)
    ops[opt] = dataclasses.replace(ops[opt], acc=2)
    with pytest.raises(ScheduleError,
                       match=r"OPT:L1:a2 breaks rule 'gradients': it reads accumulator 2, not layer 1's"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)
    ops[opt] = dataclasses.replace(ops[opt], acc=None, ring=0)
    with pytest.raises(ScheduleError, match=r"OPT:L1:r0 breaks rule 'gradients': it steps from ring tile r0, but "
                                            "per-micro-batch passes sum the gradients in accumulators"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)
    acc = _find(s, OpKind.ACC, 1, 0)
    ops = list(s.ops)
    ops[acc] = dataclasses.replace(ops[acc], acc=0)
    with pytest.raises(ScheduleError, match=r"ACC:L1:m0:r\d:a0 breaks rule 'gradients': it adds into accumulator 0"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)


def test_verifier_catches_an_accumulation_of_the_wrong_micro_batch():
    """ACC of micro-batch 0 made to wait for micro-batch 1's D2H instead: the tile then holds
    micro-batch 1's gradients, which would be counted twice."""
    g = chain_graph(2)
    s = lower(g, Plan(micro_batches=2, layer_by_layer=False, grad_ring=1), "train")
    a0, a1 = _find(s, OpKind.ACC, 0, 0), _find(s, OpKind.ACC, 0, 1)
    ops = list(s.ops)
    ops[a0], ops[a1] = dataclasses.replace(ops[a0], mb=1), dataclasses.replace(ops[a1], mb=0)
    with pytest.raises(ScheduleError, match=r"ACC:L0:m1:r0:a0 breaks rule 'gradients'.*not those of micro-batch 1"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)


def test_verifier_rules_are_data_and_each_runs_alone():
    """verify() is its RULES in order; each rule is a function of the shared context, so a rule can
    be run (or tested) on its own and its error marks the failing op in the printed schedule."""
    from megatrain.planner import verify as verify_mod

    assert [r.__name__ for r in verify_mod.RULES] == [
        "_check_order", "_check_budget", "_check_weights", "_check_gradients", "_check_staging",
        "_check_coverage", "_check_data", "_check_updates", "_check_nvme", "_check_collectives", "_check_layout"]
    g = chain_graph(4)
    s = lower(g, Plan(), "train")
    ops = list(s.ops)
    ops[3] = dataclasses.replace(ops[3], deps=(7,))
    bad = dataclasses.replace(s, ops=tuple(ops))
    with pytest.raises(ScheduleError, match=r"(?s)op #3 .* breaks rule 'order'.*-->     3 "):
        verify_mod._check_order(verify_mod._Context(bad, g))
    for rule in verify_mod.RULES:
        rule(verify_mod._Context(s, g))


def test_lowering_is_its_passes_in_order():
    """lower() is PASSES run in order: compute order first, then the passes that add copies and the
    carried updates; running them by hand gives the same schedule."""
    from megatrain.planner import lower as lower_mod
    from megatrain.ir.schedule import gradient_tiles

    assert [p.__name__ for p in lower_mod.PASSES] == ["order_compute", "assign_slots", "add_copies",
                                                      "add_carried_updates", "add_nvme_io", "add_all_reduce",
                                                      "add_all_gather", "add_count_reduce"]
    g = chain_graph(4)
    plan = Plan(micro_batches=2, optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=4,
                compute_dtype="bfloat16", staging_ring=2)
    req = lower_mod._Request(g, plan, "train", True, gradient_tiles(g))
    visits = lower_mod.order_compute([], req)
    assert [(v.kind.value, v.layer) for v in visits] == [("FWD", 0), ("FWD", 1), ("FWD", 2), ("BWD", 3),
                                                         ("BWD", 2), ("BWD", 1), ("BWD", 0)]
    ops = lower_mod.add_copies(lower_mod.assign_slots(visits, req), req)
    assert not any(op.kind is OpKind.OPT for op in ops)  # the carried updates come last
    ops = lower_mod.add_carried_updates(ops, req)
    assert tuple(ops) == lower(g, plan, "train", carries_updates=True).ops
    s = Schedule(ops=tuple(ops), plan=plan, n_layers=4, carries_updates=True)
    verify(s, g)
    for layer in range(4):  # each update just before its layer's first CAST, which waits for it
        o = _find(s, OpKind.OPT, layer)
        assert s.ops[o + 1].kind is OpKind.CAST and s.ops[o + 1].layer == layer and o in s.ops[o + 1].deps


def test_public_surface_of_the_schedule_modules():
    from megatrain.ir import liveness as liveness_mod
    from megatrain.planner import lower as lower_mod
    from megatrain.ir import schedule as schedule_mod
    from megatrain.planner import verify as verify_mod
    from megatrain.runtime import executor as executor_mod

    assert sorted(schedule_mod.__all__) == ["COMPUTE_KINDS", "HOST_STREAMS", "Mode", "OP_KINDS", "Op", "OpKind",
                                            "OpKindSpec", "SCHEDULE_FORMAT_VERSION", "Schedule", "Stream",
                                            "gradient_tiles"]
    assert sorted(lower_mod.__all__) == ["PASSES", "add_carried_updates", "add_copies", "assign_slots", "lower",
                                         "order_compute"]
    assert sorted(verify_mod.__all__) == ["RULES", "happens_before", "verify"]
    assert sorted(liveness_mod.__all__) == ["BATCH", "Generation", "Liveness", "liveness", "reads_of", "writes_of"]
    assert sorted(executor_mod.__all__) == ["DeferredUpdates", "DeviceRng", "Executor", "HANDLERS", "StepOutput",
                                            "TokenHead", "backward_body", "local_backward", "replaying_rng"]
    assert set(executor_mod.HANDLERS) == set(OpKind)  # every op kind runs through the table
    assert not hasattr(schedule_mod, "schedule_json_schema")  # unused: removed


def test_liveness_names_each_generation_and_its_readers():
    """Table-driven: in a 3-layer chain (layer 2 computes the loss), one micro-batch, the output of
    layer 0 is read by FWD:L1 and by BWD:L1; with RECOMPUTE of layer 0 the backward reads a second
    generation, the recompute's."""
    from megatrain.ir.liveness import BATCH, liveness

    g = chain_graph(3)
    for policy, producers in [(ActivationPolicy.KEEP, ["FWD"]), (ActivationPolicy.RECOMPUTE, ["FWD", "RECOMPUTE"])]:
        s = lower(g, Plan(activations=(policy, ActivationPolicy.KEEP, ActivationPolicy.KEEP)), "train")
        live = liveness(s, g)
        out0 = g.layers[0].outputs[0]
        gens = [gen for gen in live.generations if gen.key == (out0, 0)]
        assert [s.ops[gen.producer].kind.value for gen in gens] == producers
        readers = [s.ops[r] for gen in gens for r in gen.readers]
        assert sorted((op.kind.value, op.layer) for op in readers) == [("BWD", 1), ("FWD", 1)]
        assert gens[-1].last_reader == _find(s, OpKind.BWD, 1, 0)
        batch = [gen for gen in live.generations if gen.producer == BATCH]
        assert batch and all(gen.readers for gen in batch)
        for i, reads in enumerate(live.reads):  # every read of a lowered schedule has a generation
            assert all(k is not None and i in live.generations[k].readers for k in reads.values())


def test_liveness_is_kept_for_the_same_ops_and_graph_and_walked_again_for_others():
    # Lowering, the memory model and a Timeline ask for the same schedule's; nothing else may share it.
    from megatrain.ir import liveness as liveness_mod
    from megatrain.ir.liveness import liveness

    g = chain_graph(3)
    keep = lower(g, Plan(), "train")
    recompute = lower(g, Plan(activations=(ActivationPolicy.RECOMPUTE,) + (ActivationPolicy.KEEP,) * 2), "train")
    live = liveness(keep, g)
    assert liveness(dataclasses.replace(keep, issue_after=()), g) is live  # the same ops tuple
    other = liveness(recompute, g)
    assert other != live and liveness(keep, g) is live
    twin = chain_graph(3)  # an equal graph, another object: walked again, the same answer
    assert liveness(keep, twin) is not live and liveness(keep, twin) == live
    for mbs in range(1, 2 * liveness_mod._RECENT_SIZE):
        sched = lower(g, Plan(micro_batches=mbs), "train")
        assert liveness(sched, g) == liveness_mod._walk(sched, g)
    assert len(liveness_mod._RECENT) <= liveness_mod._RECENT_SIZE


def test_the_layout_rule_checks_the_recorded_buffer_layout():
    # Lowering records the layout the runtime allocates from; each corruption of it is refused by name.
    g = chain_graph(3)
    sharded = lower(g, Plan(data_parallel=4, nodes=2, host_state="shard", optimizer_shards=2), "train")
    staged = lower(g, Plan(compute_dtype="bfloat16", staging_ring=2), "train")
    for s in (sharded, staged):
        verify(s, g)
        assert Schedule.from_json(s.to_json()).layout == s.layout
    lay = sharded.layout
    assert [span.optimizer_shards for span in lay.layers] == [((0, 256), (256, 512), (512, 768), (768, 1024))] * 3
    assert [span.node_slices for span in lay.layers] == [((0, 512), (512, 1024))] * 3
    shard = lay.layers[1].optimizer_shards
    one = staged.layout
    t0, t1 = one.pinned.tiles[:2]
    broken = [
        (sharded, dataclasses.replace(lay, layers=(lay.layers[0], dataclasses.replace(
            lay.layers[1], optimizer_shards=((0, shard[0][1] - 1), *shard[1:])), lay.layers[2])), "do not tile"),
        (sharded, dataclasses.replace(lay, layers=lay.layers[:2]), "lays out 2 layers"),
        (sharded, dataclasses.replace(lay, gather_scratch_bytes=0), "gather tiles"),
        (staged, dataclasses.replace(one, pinned=dataclasses.replace(
            one.pinned, tiles=(t0, dataclasses.replace(t1, offset=t0.offset), *one.pinned.tiles[2:]))), "inside"),
        (staged, dataclasses.replace(one, slots=((1, 1),) + one.slots[1:]), "does not fit slot 0"),
        (staged, dataclasses.replace(one, pinned=dataclasses.replace(one.pinned, tiles=tuple(
            dataclasses.replace(t, nbytes=2) if t.kind in ("staging", "ring") else t for t in one.pinned.tiles))),
         "bytes in pinned"),
    ]
    for s, bad, match in broken:
        with pytest.raises(ScheduleError, match=f"rule 'layout'.*{match}"):
            verify(dataclasses.replace(s, layout=bad), g)
