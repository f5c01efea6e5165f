"""The table of op kinds (``schedule.OP_KINDS``) is complete and every per-kind table follows it.

A kind added to ``OpKind`` without its record, or without its time formula, handler, colour,
launch count or solver class, fails here; so does a verifier rule that starts checking a kind whose
record does not name the rule.
"""

from __future__ import annotations

import ast
import inspect

import pytest

from graphs import chain_graph, spec
from megatrain.planner import cost, verify as verify_mod
from megatrain.ir.liveness import reads_of, writes_of
from megatrain.planner.nvme import with_nvme
from megatrain.ir.plan import Plan
from megatrain.ir.schedule import _ORDER, _PREFIX, COMPUTE_KINDS, HOST_STREAMS, OP_KINDS, Op, OpKind, _spelling
from megatrain.planner.solve import bounds
from megatrain.planner.topology import with_topology
from megatrain.runtime.executor import HANDLERS


def _example(kind: OpKind) -> Op:
    """An op of ``kind`` naming its required fields and the first of its ``one_of`` fields."""
    spec_ = OP_KINDS[kind]
    fields = spec_.required + spec_.one_of[:1]
    return Op(kind, 1, **{name: i + 1 for i, name in enumerate(fields)})


def test_every_kind_has_one_record_in_enum_order():
    assert list(OP_KINDS) == list(OpKind)
    for kind, spec_ in OP_KINDS.items():
        assert kind.spec is spec_ and kind.stream is spec_.stream


@pytest.mark.parametrize("kind", list(OpKind))
def test_record_fields_are_consistent(kind):
    s = OP_KINDS[kind]
    assert "layer" not in s.required + s.optional  # every op names its layer
    assert set(s.required) <= set(_ORDER) and set(s.optional) <= set(_ORDER)
    assert not set(s.required) & set(s.optional)
    assert set(s.one_of) <= set(s.optional) and len(s.one_of) != 1  # a choice of one is a required field
    # A GPU op says what the issuing thread dispatches for it; a host op costs one queue put.
    assert (s.launches is None) == (s.stream in HOST_STREAMS)
    # Its spelling (in every error about its fields) names every field the record gives.
    for name in s.required + s.optional:
        assert f"{_PREFIX[name]}<int>" in _spelling(kind)
    if s.one_of:  # naming none, or two, of the choice is refused
        for chosen in ((), s.one_of[:2]):
            with pytest.raises(ValueError, match="give exactly one"):
                Op(kind, 3, **{f: 1 for f in s.required + chosen})


def test_every_derived_table_covers_every_kind():
    g = chain_graph(3)
    hw = with_topology(with_nvme(spec(op_latency_s=1e-6), "4xgen5"), interconnect="nvlink4", network="ndr-8x400g")
    plan = Plan(data_parallel=2)
    assert set(HANDLERS) == set(OpKind)  # the executor runs every kind
    for kind in OpKind:
        assert cost.op_duration(kind, g, 1, plan, hw) > 0  # cost._DURATION times every kind
        assert cost.launch_count(_example(kind), g) >= 1
        for duplex in (True, False):  # the simulator's resource of its stream
            assert cost.resource_of(kind.stream, spec(duplex=duplex)) in cost.Resource
        assert reads_of(g, kind, 1) == {"inputs": g.layers[1].inputs, "checkpoints": g.checkpoints(1),
                                        None: ()}[OP_KINDS[kind].gpu_reads]
        assert writes_of(g, kind, 1) == {"outputs": g.layers[1].outputs, "checkpoints": g.checkpoints(1),
                                         None: ()}[OP_KINDS[kind].gpu_writes]
    matplotlib = pytest.importorskip("matplotlib.colors")
    assert all(matplotlib.is_color_like(s.colour) for s in OP_KINDS.values())
    assert len({s.colour for s in OP_KINDS.values()}) == len(OpKind)  # each kind its own colour
    classes = (bounds.SIZE_KINDS, bounds.STEP_KINDS, bounds.IO_KINDS)
    assert sorted(k.value for c in classes for k in c) == sorted(k.value for k in OpKind)


def _kinds_checked_by(fn_name: str, functions: dict[str, ast.FunctionDef], seen: frozenset[str]) -> set[str]:
    """Names of the op kinds ``fn_name`` (and the verify helpers it calls) names: ``OpKind.X``, and
    the compute kinds through ``COMPUTE_KINDS``."""
    kinds: set[str] = set()
    for node in ast.walk(functions[fn_name]):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "OpKind":
            kinds.add(node.attr)
        elif isinstance(node, ast.Name) and node.id == "COMPUTE_KINDS":
            kinds |= {k.name for k in COMPUTE_KINDS}
        elif isinstance(node, ast.Name) and node.id in functions and node.id not in seen | {fn_name}:
            kinds |= _kinds_checked_by(node.id, functions, seen | {fn_name})
    return kinds


def test_records_name_every_verifier_rule_that_checks_their_kind():
    tree = ast.parse(inspect.getsource(verify_mod))
    functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    rules = {rule.__name__.removeprefix("_check_"): rule.__name__ for rule in verify_mod.RULES}
    for kind, s in OP_KINDS.items():
        assert set(s.rules) <= set(rules), f"{kind}: no verifier rule named {set(s.rules) - set(rules)}"
    for rule, fn_name in rules.items():
        for name in _kinds_checked_by(fn_name, functions, frozenset()):
            assert rule in OP_KINDS[OpKind[name]].rules, f"rule {rule!r} checks {name}; add it to its record"
