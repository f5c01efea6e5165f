"""Lower (LayerGraph, Plan) to a Schedule.

The compute order is fixed first: a training step visits layers ``0 .. n-2`` forward, then the
last layer (which computes the loss) once in its local backward, then layers ``n-2 .. 0`` backward.
The last layer never runs a separate forward: its local backward computes the loss on the way.
With ``layer_by_layer`` every micro-batch passes through a layer during one visit.

Copies are added after the compute order is fixed (as ``_add_unshard_reshard`` does in
``torch.distributed.pipelining``): each visit needs its layer's weights in a buffer slot. A layer
already in a slot (the last forward layer at the turn to backward, or a resident layer) is not
copied again. Otherwise the copy goes into a slot that no visit inside the prefetch window uses,
choosing the slot whose content is next needed farthest in the future (Belady's rule, which
minimises reloads for a known access sequence). The copy waits for every op that used the slot's
old content (its computes and, after backward, its gradient copy-out) and for the prefetch window.
Gradients leave a slot by D2H into a host gradient tile of a ring; the optimizer step of that layer
reads the tile and frees it for the D2H that reuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatrain.errors import PlanError
from megatrain.planner.graph import BATCH_PRODUCER, LayerGraph
from megatrain.planner.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.planner.schedule import Op, OpKind, Schedule


@dataclass(slots=True)
class _Visit:
    layer: int
    kind: OpKind  # FWD or BWD
    slot: int = -1
    ops: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Slot:
    layer: int | None = None
    users: list[int] = field(default_factory=list)  # op indices that used the current content
    h2d: int | None = None


def lower(graph: LayerGraph, plan: Plan, mode: str = "train") -> Schedule:
    """Lower ``graph`` under ``plan`` to a Schedule of ``mode`` ``"train"`` or ``"eval"``.

    Raises:
        PlanError: the plan does not fit the graph, or asks for something this lowering does not
            implement yet (activation offload or recompute, per-micro-batch passes, optimizer steps
            deferred to the next forward).
    """
    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be 'train' or 'eval', not {mode!r}")
    plan.check_against(graph)
    unsupported = [i for i in range(len(graph.layers)) if plan.activation(i) is not ActivationPolicy.KEEP]
    if unsupported:
        raise PlanError(f"layers {unsupported} ask for activation offload/recompute, which this "
                        "lowering does not implement yet; use ActivationPolicy.KEEP")
    if not plan.layer_by_layer and plan.micro_batches > 1:
        raise PlanError("per-micro-batch passes (layer_by_layer=False) with several micro-batches "
                        "are not implemented yet; use layer_by_layer=True")
    if plan.optimizer is not OptimizerPlacement.DURING_BACKWARD:
        raise PlanError(f"optimizer placement {plan.optimizer.value!r} is not implemented yet")

    n = len(graph.layers)
    if mode == "train":
        visits = [_Visit(i, OpKind.FWD) for i in range(n - 1)] + \
                 [_Visit(i, OpKind.BWD) for i in range(n - 1, -1, -1)]
    else:
        visits = [_Visit(i, OpKind.FWD) for i in range(n)]
    _assign_slots(visits, plan, n)

    ops: list[Op] = []
    fwd: dict[tuple[int, int], int] = {}  # (layer, mb) -> FWD op index
    bwd: dict[tuple[int, int], int] = {}
    loaded_by: dict[int, int] = {}  # visit index -> H2D op index
    slots: dict[int, _Slot] = {}
    ring_last_opt: dict[int, int] = {}
    ring_next = 0
    emitted_loads = 0  # visits whose load decision has been emitted

    def emit(op: Op) -> int:
        ops.append(op)
        return len(ops) - 1

    def emit_loads(upto: int) -> None:
        nonlocal emitted_loads
        while emitted_loads < len(visits) and emitted_loads <= upto:
            j = emitted_loads
            v = visits[j]
            st = slots.setdefault(v.slot, _Slot())
            if st.layer == v.layer:
                loaded_by[j] = st.h2d  # still there: no copy
            else:
                deps = set(st.users)
                window = j - plan.prefetch_distance - 1
                if window >= 0:
                    deps.update(visits[window].ops)
                h = emit(Op(OpKind.H2D, v.layer, slot=v.slot, deps=tuple(sorted(deps))))
                st.layer, st.users, st.h2d = v.layer, [], h
                loaded_by[j] = h
            emitted_loads += 1

    emit_loads(plan.prefetch_distance)
    M = plan.micro_batches
    for i, v in enumerate(visits):
        emit_loads(i)  # a visit's own load, if the window did not already bring it
        layer = graph.layers[v.layer]
        st = slots[v.slot]
        h = loaded_by[i]
        for mb in range(M):
            deps = {h}
            for vid in layer.inputs:
                p = graph.values[vid].producer
                if p != BATCH_PRODUCER:
                    deps.add(fwd[(p, mb)])
            if v.kind is OpKind.BWD:
                for vid in layer.outputs:
                    val = graph.values[vid]
                    if val.requires_grad:
                        deps.update(bwd[(c, mb)] for c in val.consumers)
                if mb > 0:
                    deps.add(bwd[(v.layer, mb - 1)])  # gradients accumulate in the slot in order
            k = emit(Op(v.kind, v.layer, mb=mb, slot=v.slot, deps=tuple(sorted(deps))))
            (fwd if v.kind is OpKind.FWD else bwd)[(v.layer, mb)] = k
            v.ops.append(k)
            st.users.append(k)
        if v.kind is OpKind.BWD and layer.trainable_numel > 0:
            r = ring_next % plan.grad_ring
            ring_next += 1
            deps = {v.ops[-1]}
            if r in ring_last_opt:
                deps.add(ring_last_opt[r])
            d = emit(Op(OpKind.D2H, v.layer, slot=v.slot, ring=r, deps=tuple(sorted(deps))))
            st.users.append(d)
            ring_last_opt[r] = emit(Op(OpKind.OPT, v.layer, ring=r, deps=(d,)))
        emit_loads(i + plan.prefetch_distance + 1)
    return Schedule(ops=tuple(ops), plan=plan, n_layers=n, mode=mode)


def _assign_slots(visits: list[_Visit], plan: Plan, n_layers: int) -> None:
    """Give every visit a slot: resident layers their own, others by Belady's rule."""
    resident_slot = {layer: plan.slots + k for k, layer in enumerate(sorted(plan.resident))}
    content: list[int | None] = [None] * plan.slots
    last_use: list[int] = [-(1 << 60)] * plan.slots  # never used
    next_use: dict[int, list[int]] = {}
    for i, v in enumerate(visits):
        next_use.setdefault(v.layer, []).append(i)

    def next_after(layer: int | None, i: int) -> float:
        if layer is None:
            return float("inf")
        later = [j for j in next_use[layer] if j > i]
        return later[0] if later else float("inf")

    for i, v in enumerate(visits):
        if v.layer in resident_slot:
            v.slot = resident_slot[v.layer]
            continue
        if v.layer in content:
            s = content.index(v.layer)
        else:
            window_start = i - plan.prefetch_distance
            free = [s for s in range(plan.slots) if last_use[s] < window_start]
            if not free:
                raise PlanError(f"no buffer slot is free for layer {v.layer} at visit {i}: {plan.slots} "
                                f"slots cannot hold a prefetch window of {plan.prefetch_distance}")
            s = max(free, key=lambda s: (next_after(content[s], i), -s))
            content[s] = v.layer
        v.slot = s
        last_use[s] = i
