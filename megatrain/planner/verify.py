"""The verifier: one function that checks a Schedule's invariants against its LayerGraph.

Happens-before is the DAG's dependencies plus program order on each in-order stream. It is
computed once as ancestor bitsets (Python ints) in list order, which the rules then query:

- ``order``: every dependency names an earlier op (the list is a topological order, so the DAG
  together with in-order streams is acyclic and cannot deadlock);
- ``weights``: a compute op's slot was last filled with its layer's weights by an H2D that happens
  before it, and every other H2D into that slot happens before that copy or after the op;
- ``gradients``: a slot's gradients are copied out (D2H) after all its micro-batches' local
  backwards and before any later copy overwrites the slot; a host gradient tile is read by its
  layer's optimizer step before another D2H overwrites it;
- ``coverage``: every (layer, micro-batch) runs its forward and local backward exactly once, and
  every layer with trainable parameters is updated exactly once, after all its micro-batches;
- ``data``: a forward happens after the forwards that produce its inputs; a local backward after
  the local backwards that produce its output gradients;
- ``budget``: slot and ring indices stay within what the plan allocates.

Errors name the op, the rule and the fix, and print the schedule with a marker at the failing op
(as ``_format_pipeline_order(..., error_step_number)`` does in ``torch.distributed.pipelining``).
"""

from __future__ import annotations

from collections import defaultdict

from megatrain.errors import ScheduleError
from megatrain.planner.graph import BATCH_PRODUCER, LayerGraph
from megatrain.planner.schedule import OpKind, Schedule


def happens_before(schedule: Schedule) -> list[int]:
    """``anc[i]``: bitset of ops that happen before op ``i`` (deps and stream order, transitively)."""
    anc: list[int] = []
    last_on_stream: dict = {}
    for i, op in enumerate(schedule.ops):
        a = 0
        preds = list(op.deps)
        prev = last_on_stream.get(op.stream)
        if prev is not None:
            preds.append(prev)
        for d in preds:
            if 0 <= d < i:
                a |= anc[d] | (1 << d)
        anc.append(a)
        last_on_stream[op.stream] = i
    return anc


def verify(schedule: Schedule, graph: LayerGraph) -> None:
    """Raise ScheduleError naming the first broken invariant; return None when all hold."""
    ops = schedule.ops
    plan = schedule.plan

    def fail(i: int, rule: str, what: str, fix: str) -> None:
        raise ScheduleError(f"op #{i} {ops[i]!r} breaks rule '{rule}': {what}. Fix: {fix}.\n"
                            + schedule.format(marker=i, context=12))

    if schedule.n_layers != len(graph.layers):
        raise ScheduleError(f"schedule is for {schedule.n_layers} layers, graph has {len(graph.layers)}")
    n_slots = plan.slots + len(plan.resident)
    for i, op in enumerate(ops):
        for d in op.deps:
            if not 0 <= d < i:
                fail(i, "order", f"dependency {d} is not an earlier op", "list ops in a topological order")
        if not 0 <= op.layer < len(graph.layers):
            fail(i, "order", f"layer {op.layer} does not exist", "lower against this graph")
        if op.slot is not None and not 0 <= op.slot < n_slots:
            fail(i, "budget", f"slot {op.slot} outside the plan's {n_slots} slots", "raise Plan.slots")
        if op.ring is not None and not 0 <= op.ring < plan.grad_ring:
            fail(i, "budget", f"ring tile {op.ring} outside the plan's {plan.grad_ring}", "raise Plan.grad_ring")
        if op.mb is not None and not 0 <= op.mb < plan.micro_batches:
            fail(i, "coverage", f"micro-batch {op.mb} outside the plan's {plan.micro_batches}",
                 "lower with the same plan")

    anc = happens_before(schedule)

    def before(a: int, b: int) -> bool:
        return bool((anc[b] >> a) & 1)

    by_kind: dict[OpKind, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        by_kind[op.kind].append(i)
    h2d_by_slot: dict[int, list[int]] = defaultdict(list)
    for i in by_kind[OpKind.H2D]:
        h2d_by_slot[ops[i].slot].append(i)

    # weights
    for i, op in enumerate(ops):
        if op.kind not in (OpKind.FWD, OpKind.BWD):
            continue
        copies = h2d_by_slot[op.slot]
        earlier = [h for h in copies if before(h, i)]
        if not earlier:
            fail(i, "weights", f"no H2D into slot s{op.slot} happens before it",
                 f"add an H2D:L{op.layer}:s{op.slot} and a dependency on it")
        loader = max(earlier)
        if ops[loader].layer != op.layer:
            fail(i, "weights", f"slot s{op.slot} holds layer {ops[loader].layer}'s weights (#{loader} "
                 f"{ops[loader]!r}) when it runs", f"copy layer {op.layer} into the slot first")
        for h in copies:
            if h != loader and not before(h, loader) and not before(i, h):
                fail(i, "weights", f"#{h} {ops[h]!r} may overwrite slot s{op.slot} while it reads it",
                     f"make #{h} depend on #{i}")

    # gradients
    d2h_of: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in by_kind[OpKind.D2H]:
        d2h_of[(ops[i].layer, ops[i].slot)].append(i)
    for i in by_kind[OpKind.BWD]:
        op = ops[i]
        if graph.layers[op.layer].trainable_numel == 0:
            continue
        outs = [d for d in d2h_of[(op.layer, op.slot)] if before(i, d)]
        if not outs:
            fail(i, "gradients", f"its gradients in slot s{op.slot} are never copied out",
                 f"add a D2H:L{op.layer}:s{op.slot} after it")
        d = min(outs)
        for h in h2d_by_slot[op.slot]:
            if before(i, h) and not before(d, h):
                fail(h, "gradients", f"it may overwrite slot s{op.slot} before #{d} {ops[d]!r} copies "
                     f"layer {op.layer}'s gradients out", f"make it depend on #{d}")
    opt_by_layer: dict[int, list[int]] = defaultdict(list)
    for i in by_kind[OpKind.OPT]:
        opt_by_layer[ops[i].layer].append(i)
    d2h_by_ring: dict[int, list[int]] = defaultdict(list)
    for i in by_kind[OpKind.D2H]:
        d2h_by_ring[ops[i].ring].append(i)
    for i in by_kind[OpKind.OPT]:
        op = ops[i]
        writers = [d for d in d2h_by_ring[op.ring] if before(d, i)]
        if not writers or ops[max(writers)].layer != op.layer:
            fail(i, "gradients", f"host gradient tile r{op.ring} does not hold layer {op.layer}'s "
                 "gradients when it runs", f"make it depend on D2H:L{op.layer}:*:r{op.ring}")
        w = max(writers)
        for d in d2h_by_ring[op.ring]:
            if d != w and not before(d, w) and not before(i, d):
                fail(d, "gradients", f"it may overwrite host gradient tile r{op.ring} before #{i} "
                     f"{op!r} reads it", f"make it depend on #{i}")

    # coverage and data
    M = plan.micro_batches
    n = len(graph.layers)
    fwd_at: dict[tuple[int, int], list[int]] = defaultdict(list)
    bwd_at: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in by_kind[OpKind.FWD]:
        fwd_at[(ops[i].layer, ops[i].mb)].append(i)
    for i in by_kind[OpKind.BWD]:
        bwd_at[(ops[i].layer, ops[i].mb)].append(i)
    last = len(ops) - 1 if ops else 0
    fwd_layers = range(n - 1) if schedule.mode == "train" else range(n)
    for layer in range(n):
        for mb in range(M):
            want_fwd = 1 if layer in fwd_layers else 0
            want_bwd = 1 if schedule.mode == "train" else 0
            for table, want, kind in ((fwd_at, want_fwd, "FWD"), (bwd_at, want_bwd, "BWD")):
                got = table.get((layer, mb), [])
                if len(got) != want:
                    at = got[1] if len(got) > 1 else last
                    fail(at, "coverage", f"{kind} of layer {layer}, micro-batch {mb} runs {len(got)} "
                         f"times, expected {want}", "lower the schedule again")
    for (layer, mb), (i,) in fwd_at.items():
        for vid in graph.layers[layer].inputs:
            p = graph.values[vid].producer
            if p != BATCH_PRODUCER and not before(fwd_at[(p, mb)][0], i):
                fail(i, "data", f"its input {graph.values[vid].name!r} comes from a forward of layer "
                     f"{p} that does not happen before it", f"make it depend on #{fwd_at[(p, mb)][0]}")
    for (layer, mb), (i,) in bwd_at.items():
        for vid in graph.layers[layer].inputs:
            p = graph.values[vid].producer
            if p != BATCH_PRODUCER and not before(fwd_at[(p, mb)][0], i):
                fail(i, "data", f"its checkpoint {graph.values[vid].name!r} is not computed before it",
                     f"make it depend on #{fwd_at[(p, mb)][0]}")
        for vid in graph.layers[layer].outputs:
            val = graph.values[vid]
            if not val.requires_grad:
                continue
            for c in val.consumers:
                j = bwd_at[(c, mb)][0]
                if not before(j, i):
                    fail(i, "data", f"the gradient of {val.name!r} from #{j} {ops[j]!r} does not "
                         "arrive before it", f"make it depend on #{j}")
    if schedule.mode == "train":
        for layer in range(n):
            trainable = graph.layers[layer].trainable_numel > 0
            opts = opt_by_layer.get(layer, [])
            if len(opts) != (1 if trainable else 0):
                at = opts[1] if len(opts) > 1 else last
                fail(at, "coverage", f"layer {layer} is updated {len(opts)} times in the step, expected "
                     f"{1 if trainable else 0}", "one OPT per trainable layer")
            for o in opts:
                for mb in range(M):
                    b = bwd_at[(layer, mb)][0]
                    if not before(b, o):
                        fail(o, "coverage", f"it updates layer {layer} before micro-batch {mb}'s "
                             f"local backward #{b}", f"make it depend on #{b}")
    elif by_kind[OpKind.OPT] or by_kind[OpKind.D2H] or by_kind[OpKind.BWD]:
        fail(min(by_kind[OpKind.OPT] + by_kind[OpKind.D2H] + by_kind[OpKind.BWD]), "coverage",
             "an eval schedule computes no gradients and updates nothing", "lower with mode='eval'")
