"""The verifier: a Schedule's invariants against its LayerGraph, as a list of rule functions.

``verify`` runs the functions in ``RULES`` in order over one shared :class:`_Context` (after
tinygrad's ``uop/spec.py``, whose verifier is its rules as data). Happens-before is the DAG's
dependencies plus program order on each in-order stream. It is computed once as ancestor bitsets
(Python ints) in list order, which the rules then query:

- ``order``: every dependency names an earlier op (the list is a topological order, so the DAG
  together with in-order streams is acyclic and cannot deadlock);
- ``weights``: a compute op's slot was last filled with its layer's weights by an H2D that happens
  before it, and every other H2D into that slot happens before that copy or after the op;
- ``gradients``: a slot's gradients are copied out (D2H) after all its micro-batches' local
  backwards and before any later copy or (with per-micro-batch passes) local backward overwrites
  the slot; a host gradient tile is read by its layer's optimizer step (or, with per-micro-batch
  passes, by the ACC of the micro-batch it holds) before another D2H overwrites it; accumulators
  are written by their layer's ACCs in micro-batch order, micro-batch 0's first;
- ``coverage``: every (layer, micro-batch) runs its forward and local backward exactly once (no
  local backward for a layer with no gradient to compute: ``LayerGraph.has_gradients``; and
  its recompute at most once); every layer with trainable parameters is updated exactly once, after
  all its micro-batches -- in the same step (optimizer DURING_BACKWARD), or at the start of the next
  step's schedule or an ``"update"`` schedule (NEXT_FORWARD), where the update comes before every
  copy of that layer's weights and reads a gradient tile (or accumulator) no op of this schedule
  overwrote first; with per-micro-batch passes every (trainable layer, micro-batch) is accumulated
  exactly once, and an update reads the accumulator after the last ACC;
- ``data``: a compute op or checkpoint copy reads each checkpoint from the op that last put it on
  the GPU (its forward, its recompute, or its reload), which happens before it; a reload happens
  after the offload it reads back; a local backward runs after the local backwards that produce its
  output gradients; with per-micro-batch passes, which keep one micro-batch's offloaded checkpoints
  in pinned memory, a layer's offload comes after the reloads of the micro-batches before it;
- ``staging``: with a BF16 plan, each H2D reads a staging tile that a CAST of its layer filled, with
  no optimizer step of that layer between the CAST and the copy (the tile holds the current
  master's cast), and no other CAST overwrites the tile before the copy ends; a layer whose master
  lives on NVMe (``Plan.nvme_masters``) copies from its own tile, which keeps its cast between
  steps, and after an OPT of it only from the CAST out of its I/O buffer that follows that OPT;
- ``collectives``: under data parallel each layer's step gradients are reduced once across the
  ranks before its optimizer step, the global batch's supervised tokens (the loss's divisor) are
  summed (COUNT_REDUCE) before the loss layer's first local backward, and the collectives form one
  chain, so every rank issues them in one order;
- ``layout``: the buffer layout lowering recorded (``Schedule.layout``) fits the graph, the plan and
  the ops: shards and slices tile their layer's elements, pinned regions start on pages and do not
  overlap, and every op's layer fits the slot and buffers it names;
- ``budget``: slot, ring and staging indices stay within what the plan allocates, and each op's
  layer fits the slot and host gradient tile it uses, as the cost model sizes them; given a
  HardwareSpec, the cost model's peak GPU memory, pinned host memory and host memory stay within
  its capacities.

Errors name the op, the rule and the fix, and print the schedule with a marker at the failing op
(as ``_format_pipeline_order(..., error_step_number)`` does in ``torch.distributed.pipelining``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, NoReturn

from megatrain.errors import ScheduleError
from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph
from megatrain.ir.hardware import HardwareSpec
from megatrain.ir.liveness import BATCH, Liveness, liveness
from megatrain.ir.plan import OptimizerPlacement
from megatrain.ir.schedule import COMPUTE_KINDS, OpKind, Schedule, gradient_tiles
from megatrain.units import human_bytes


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


def verify(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec | None = None) -> None:
    """Raise ScheduleError naming the first broken invariant; return None when all hold.

    The rules in ``RULES`` run in order, each raising at the first op that breaks it, with the op,
    the rule and the fix, and the schedule printed around the op with a marker. With ``hw`` the
    memory budget is checked too (:func:`megatrain.planner.cost.memory_breakdown`).

    Raises:
        ScheduleError: the schedule is for another graph, or breaks a rule.
    """
    if schedule.n_layers != len(graph.layers):
        raise ScheduleError(f"schedule is for {schedule.n_layers} layers, graph has {len(graph.layers)}")
    c = _Context(schedule, graph)
    for rule in RULES:
        rule(c)
    if hw is not None:
        _check_memory(schedule, graph, hw)


class _Context:
    """What the rules share, computed once per schedule: happens-before, ops by kind and index."""

    def __init__(self, schedule: Schedule, graph: LayerGraph):
        self.schedule, self.graph, self.plan, self.ops = schedule, graph, schedule.plan, schedule.ops
        plan, ops = self.plan, self.ops
        self.accumulator_of = gradient_tiles(graph)  # per-micro-batch passes: each trainable layer's accumulator
        self.staging_numels = cost.staging_tile_numels(graph, plan) or (0,) * plan.staging_ring
        self.deferred = plan.optimizer is OptimizerPlacement.NEXT_FORWARD
        self.accumulating = plan.accumulates_on_host
        self.last = len(ops) - 1 if ops else 0
        self.by_kind: dict[OpKind, list[int]] = defaultdict(list)
        self.at: dict[tuple[OpKind, int, int], list[int]] = defaultdict(list)
        for i, op in enumerate(ops):
            self.by_kind[op.kind].append(i)
            if op.mb is not None:
                self.at[(op.kind, op.layer, op.mb)].append(i)
        self.h2d_by_slot: dict[int, list[int]] = defaultdict(list)
        for i in self.by_kind[OpKind.H2D]:
            self.h2d_by_slot[ops[i].slot].append(i)
        self.opt_by_layer: dict[int, list[int]] = defaultdict(list)
        for i in self.by_kind[OpKind.OPT]:
            self.opt_by_layer[ops[i].layer].append(i)
        self._anc: list[int] | None = None
        self._liveness: Liveness | None = None

    def fail(self, i: int, rule: str, what: str, fix: str) -> NoReturn:
        """Raise the ScheduleError of op ``i`` breaking ``rule``, with the schedule around it, marked."""
        raise ScheduleError(f"op #{i} {self.ops[i]!r} breaks rule '{rule}': {what}. Fix: {fix}.\n"
                            + self.schedule.format(marker=i, context=12))

    def before(self, a: int, b: int) -> bool:
        """Whether op ``a`` happens before op ``b``."""
        if self._anc is None:  # after rule 'order', so every dependency names an earlier op
            self._anc = happens_before(self.schedule)
        return bool((self._anc[b] >> a) & 1)

    @property
    def liveness(self) -> Liveness:
        if self._liveness is None:
            self._liveness = liveness(self.schedule, self.graph)
        return self._liveness


def _check_order(c: _Context) -> None:
    """Rule ``order``: every dependency names an earlier op, and every op a layer of the graph."""
    ops, graph, fail = c.ops, c.graph, c.fail
    for i, op in enumerate(ops):
        for d in op.deps:
            if not 0 <= d < i:
                fail(i, "order", f"dependency {d} is not an earlier op", "list ops in a topological order")
        if not 0 <= op.layer < len(graph.layers):
            fail(i, "order", f"layer {op.layer} does not exist", "lower against this graph")


def _check_budget(c: _Context) -> None:
    """Rule ``budget`` (per op): slot, ring, staging, accumulator and pinned-copy indices within the plan,
    each op's layer fitting the slot and tiles it uses (and micro-batches within the plan: ``coverage``)."""
    ops, plan, graph, fail = c.ops, c.plan, c.graph, c.fail
    n_slots = plan.slots + len(plan.resident)
    n_accumulators = len(c.accumulator_of)
    slot_sizes = cost.slot_numels(graph, plan.slots, plan.resident)
    tile_numels = cost.gradient_tile_numels(graph, plan)
    staging_numels = c.staging_numels
    n_copies = plan.micro_batches if plan.layer_by_layer else 1
    for i, op in enumerate(ops):
        if op.slot is not None and not 0 <= op.slot < n_slots:
            fail(i, "budget", f"slot {op.slot} outside the plan's {n_slots} slots", "raise Plan.slots")
        if op.acc is not None and not 0 <= op.acc < n_accumulators:
            fail(i, "budget", f"accumulator {op.acc} outside the {n_accumulators} trainable layers",
                 "use schedule.gradient_tiles for each layer's accumulator")
        if op.ring is not None and not 0 <= op.ring < plan.grad_ring:
            fail(i, "budget", f"ring tile {op.ring} outside the plan's {plan.grad_ring}", "raise Plan.grad_ring")
        # (An ALL_GATHER's tile is a gather tile: rule 'collectives' bounds it by cost.GATHER_BUFFERS.)
        if op.tile is not None and op.kind is not OpKind.ALL_GATHER and not 0 <= op.tile < len(staging_numels):
            fail(i, "budget", f"staging tile {op.tile} outside the plan's {len(staging_numels)}",
                 "raise Plan.staging_ring")
        if op.copy is not None and not 0 <= op.copy < n_copies:
            fail(i, "budget", f"pinned checkpoint copy c{op.copy} outside the plan's {n_copies} (one per micro-batch "
                 "layer by layer, one reused copy with per-micro-batch passes: cost.pinned_buffers)",
                 "offload micro-batch m into copy m layer by layer, else into copy 0")
        if op.mb is not None and not 0 <= op.mb < plan.micro_batches:
            fail(i, "coverage", f"micro-batch {op.mb} outside the plan's {plan.micro_batches}",
                 "lower with the same plan")
        layer = graph.layers[op.layer]
        if op.slot is not None and (layer.numel > slot_sizes[op.slot][0]
                                    or layer.trainable_numel > slot_sizes[op.slot][1]):
            fail(i, "budget", f"layer {op.layer} ({layer.numel:,} elements, {layer.trainable_numel:,} trainable) does "
                 f"not fit slot {op.slot}, sized {slot_sizes[op.slot][0]:,} / {slot_sizes[op.slot][1]:,} "
                 "(cost.slot_numels: streaming slots for the widest non-resident layer, a resident layer's for it)",
                 "put a resident layer only in its own slot")
        if op.kind is OpKind.CAST and plan.compute_dtype != "float32" and layer.numel > staging_numels[op.tile]:
            fail(i, "budget", f"layer {op.layer} ({layer.numel:,} elements) does not fit staging tile t{op.tile} of "
                 f"{staging_numels[op.tile]:,} (cost.staging_tile_numels)", "with Plan.cast_once cast layer k "
                 "into tile k")
        if op.kind is OpKind.D2H and op.ring is not None and 0 <= op.ring < plan.grad_ring \
                and layer.trainable_numel > tile_numels[op.ring]:
            fail(i, "budget", f"layer {op.layer}'s {layer.trainable_numel:,} gradients do not fit host tile "
                 f"r{op.ring} of {tile_numels[op.ring]:,} (cost.gradient_tile_numels sizes each tile for the layers "
                 "the lowering gives it)", "assign ring tiles as lower.py does (D2H number k of a step takes tile "
                 "k % grad_ring; with NEXT_FORWARD a layer's own tile, schedule.gradient_tiles)")


def _check_weights(c: _Context) -> None:
    """Rule ``weights``: a compute op's slot holds its layer's weights, copied before it and not
    overwritten while it runs."""
    ops, fail, before, h2d_by_slot = c.ops, c.fail, c.before, c.h2d_by_slot
    for i, op in enumerate(ops):
        if op.kind not in COMPUTE_KINDS:
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


def _check_gradients(c: _Context) -> None:
    """Rule ``gradients``: gradients leave each slot before it is overwritten; host tiles and accumulators
    are read by the right op before they are overwritten."""
    ops, plan, graph, fail, before, by_kind = c.ops, c.plan, c.graph, c.fail, c.before, c.by_kind
    h2d_by_slot, accumulator_of, schedule = c.h2d_by_slot, c.accumulator_of, c.schedule
    deferred, accumulating = c.deferred, c.accumulating
    d2h_of: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in by_kind[OpKind.D2H]:
        d2h_of[(ops[i].layer, ops[i].slot)].append(i)
    bwd_by_slot: dict[int, list[int]] = defaultdict(list)
    at_bwd: dict[tuple[int, int], int] = {}
    for i in by_kind[OpKind.BWD]:
        bwd_by_slot[ops[i].slot].append(i)
        at_bwd.setdefault((ops[i].layer, ops[i].mb), i)
    first_out: dict[int, int] = {}  # local backward -> the D2H that copies its gradients out
    for i in by_kind[OpKind.BWD]:
        op = ops[i]
        if graph.layers[op.layer].trainable_numel == 0:
            continue
        outs = [d for d in d2h_of[(op.layer, op.slot)] if before(i, d)]
        if not outs:
            fail(i, "gradients", f"its gradients in slot s{op.slot} are never copied out",
                 f"add a D2H:L{op.layer}:s{op.slot} after it")
        d = min(outs)
        first_out[i] = d
        for h in h2d_by_slot[op.slot]:
            if before(i, h) and not before(d, h):
                fail(h, "gradients", f"it may overwrite slot s{op.slot} before #{d} {ops[d]!r} copies "
                     f"layer {op.layer}'s gradients out", f"make it depend on #{d}")
        for j in bwd_by_slot[op.slot]:
            # Layer by layer, the micro-batches of one visit accumulate in the slot on purpose.
            same_visit = plan.layer_by_layer and ops[j].layer == op.layer
            if j != i and not same_visit and before(i, j) and not before(d, j):
                fail(j, "gradients", f"it writes slot s{op.slot}'s gradients before #{d} {ops[d]!r} copies "
                     f"out those of #{i} {op!r}", f"make it depend on #{d}")
    d2h_by_ring: dict[int, list[int]] = defaultdict(list)
    for i in by_kind[OpKind.D2H]:
        if ops[i].ring is not None:  # a D2H into a gradient I/O buffer (gbuf): rule 'nvme'
            d2h_by_ring[ops[i].ring].append(i)
    acc_at: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i in by_kind[OpKind.ACC]:
        acc_at[(ops[i].layer, ops[i].mb)].append(i)
    if by_kind[OpKind.ACC] and not accumulating:
        fail(by_kind[OpKind.ACC][0], "gradients", "only per-micro-batch passes accumulate gradients on "
             "the host", "drop the ACC ops, or lower with layer_by_layer=False and several micro-batches")
    for i in by_kind[OpKind.ACC]:
        op = ops[i]
        if op.acc != accumulator_of.get(op.layer):
            fail(i, "gradients", f"it adds into accumulator {op.acc}, not layer {op.layer}'s",
                 f"add into accumulator a{accumulator_of.get(op.layer)} (schedule.gradient_tiles)")
    # Ring tiles are read by the ACCs with per-micro-batch passes, else by DURING_BACKWARD updates.
    ring_readers = by_kind[OpKind.ACC] if accumulating else [] if deferred else by_kind[OpKind.OPT]
    for i in ring_readers:
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
        if op.kind is OpKind.ACC:
            b = at_bwd.get((op.layer, op.mb))
            if b is None or first_out.get(b) != w:
                fail(i, "gradients", f"tile r{op.ring} holds the gradients #{w} {ops[w]!r} copied, which are "
                     f"not those of micro-batch {op.mb}'s local backward of layer {op.layer}",
                     "make it depend on the D2H that follows that local backward")
    for i in by_kind[OpKind.OPT]:
        op = ops[i]
        if accumulating != (op.acc is not None):
            src = f"ring tile r{op.ring}" if op.ring is not None else f"accumulator a{op.acc}"
            why = ("per-micro-batch passes sum the gradients in accumulators" if accumulating
                   else "only per-micro-batch passes have accumulators")
            fail(i, "gradients", f"it steps from {src}, but {why}",
                 f"read {'accumulator a' if accumulating else 'ring tile r'}<k>")
        if accumulating:
            if op.acc != accumulator_of.get(op.layer):
                fail(i, "gradients", f"it reads accumulator {op.acc}, not layer {op.layer}'s",
                     f"read accumulator {accumulator_of.get(op.layer)} (schedule.gradient_tiles)")
            accs = [a for mb in range(plan.micro_batches) for a in acc_at[(op.layer, mb)]]
            if deferred:  # the previous step's accumulator: no ACC of this schedule may overwrite it first
                for a in accs:
                    if not before(i, a):
                        fail(a, "gradients", f"it may overwrite layer {op.layer}'s accumulator before the "
                             f"deferred update #{i} {op!r} reads the previous step's gradients",
                             f"make it depend on #{i}")
            else:
                for a in accs:
                    if not before(a, i):
                        fail(i, "gradients", f"it reads layer {op.layer}'s accumulator before #{a} {ops[a]!r} "
                             "adds into it", f"make it depend on #{a}")
            continue
        if deferred and op.ring is not None:  # the tile the previous step left: nothing here may overwrite it first
            for d in d2h_by_ring[op.ring]:
                if not before(i, d):
                    fail(d, "gradients", f"it may overwrite host gradient tile r{op.ring}, which holds layer "
                         f"{op.layer}'s previous gradients, before #{i} {op!r} reads them",
                         f"make it depend on #{i}")
                if ops[d].layer != op.layer:
                    fail(d, "gradients", f"it writes tile r{op.ring}, which layer {op.layer}'s deferred update "
                         "reads; with NEXT_FORWARD every layer keeps a tile of its own",
                         "use schedule.gradient_tiles for the tile of each layer")
    if accumulating and schedule.mode == "train":
        for layer in range(len(graph.layers)):
            if graph.layers[layer].trainable_numel == 0:
                continue
            prev = None
            for mb in range(plan.micro_batches):
                got = acc_at.get((layer, mb), [])
                if len(got) != 1:
                    fail(got[1] if got else len(ops) - 1, "coverage", f"layer {layer}'s gradients of "
                         f"micro-batch {mb} are accumulated {len(got)} times, expected once", "lower the schedule again")
                if prev is not None and not before(prev, got[0]):
                    fail(got[0], "gradients", f"it adds into layer {layer}'s accumulator before #{prev} "
                         f"{ops[prev]!r} (micro-batch 0 overwrites it, the others add in order)",
                         f"make it depend on #{prev}")
                prev = got[0]
    if deferred and not accumulating:
        owner: dict[int, int] = {}
        for d in by_kind[OpKind.D2H]:
            if ops[d].ring is not None and owner.setdefault(ops[d].ring, ops[d].layer) != ops[d].layer:
                fail(d, "gradients", f"tile r{ops[d].ring} also receives layer {owner[ops[d].ring]}'s "
                     "gradients; with NEXT_FORWARD each layer's gradients wait in a tile of their own "
                     "until the next step", "use schedule.gradient_tiles for the tile of each layer")


def _check_staging(c: _Context) -> None:
    """Rule ``staging``: a BF16 copy reads the staging tile its layer's CAST filled, with no update in
    between; FP32 copies read the master rows, and with the host state sharded across nodes every
    copy reads its gather tile (``Plan.staged``; rule ``collectives`` checks the gather)."""
    ops, plan, fail, before, by_kind, opt_by_layer = c.ops, c.plan, c.fail, c.before, c.by_kind, c.opt_by_layer
    ctx = c  # the loop below names a CAST c
    direct = ("a float32 plan copies the master rows directly" if plan.compute_dtype == "float32" else
              "a plan with host_state='shard' copies each layer from the gather tile its ALL_GATHER filled, in the "
              "compute dtype")
    if plan.staged:
        cast_by_tile: dict[int, list[int]] = defaultdict(list)
        for i in by_kind[OpKind.CAST]:
            cast_by_tile[ops[i].tile].append(i)
        for h in by_kind[OpKind.H2D]:
            casts = [d for d in ops[h].deps if ops[d].kind is OpKind.CAST]
            if ops[h].layer in plan.nvme_masters:
                _check_kept_tile(ctx, h, casts, cast_by_tile)
                continue
            if len(casts) != 1 or ops[casts[0]].layer != ops[h].layer:
                fail(h, "staging", f"a {plan.compute_dtype} copy must read a staging tile that one CAST of "
                     f"layer {ops[h].layer} filled, and it depends on {len(casts)} CASTs of that layer",
                     f"make it depend on one CAST:L{ops[h].layer}:t<k>")
            c = casts[0]
            if ops[h].tile != ops[c].tile:
                fail(h, "staging", f"it names staging tile t{ops[h].tile}, but the CAST it reads, #{c} {ops[c]!r}, "
                     f"fills tile t{ops[c].tile}", f"name tile t{ops[c].tile}")
            for other in cast_by_tile[ops[c].tile]:
                if other != c and not before(other, c) and not before(h, other):
                    fail(other, "staging", f"it may overwrite staging tile t{ops[c].tile} before #{h} "
                         f"{ops[h]!r} has read it", f"make it depend on #{h}")
            # The tile must hold the current master: no update of the layer between the cast and
            # the copy (a copy that re-reads an earlier cast, with cast_once, must not cross one).
            for o in opt_by_layer[ops[h].layer]:
                if not before(o, c) and not before(h, o):
                    fail(h, "staging", f"it reads the cast #{c} {ops[c]!r}, but #{o} {ops[o]!r} may update the "
                         "master in between, so the copy may send stale weights",
                         f"cast layer {ops[h].layer} again after #{o} and copy from that cast")
    elif by_kind[OpKind.CAST]:
        fail(by_kind[OpKind.CAST][0], "staging", direct, "drop the CAST ops (lower the plan again)")
    else:
        for h in by_kind[OpKind.H2D]:
            if ops[h].tile is not None:
                fail(h, "staging", f"{direct}, but it names staging tile t{ops[h].tile}",
                     f"write H2D:L{ops[h].layer}:s{ops[h].slot}")


def _check_kept_tile(c: _Context, h: int, casts: list[int], cast_by_tile: dict[int, list[int]]) -> None:
    """Part of rule ``staging``: H2D ``h`` of a layer whose master is on NVMe (``Plan.nvme_masters``)
    reads the layer's own staging tile, which keeps the BF16 cast of its current master between
    steps (filled at compile and by the CAST from the I/O buffer after each OPT of the layer). If an
    OPT of the layer may come before the copy in this schedule, the copy depends on a CAST of the
    layer after that OPT; no CAST of the tile may run while the copy reads it."""
    ops, fail, before, layer = c.ops, c.fail, c.before, c.ops[h].layer
    if ops[h].tile != layer:
        fail(h, "staging", f"layer {layer}'s master is on NVMe, so its copies read its own staging tile t{layer} "
             f"(cast_once), not t{ops[h].tile}", f"name tile t{layer}")
    for o in c.opt_by_layer.get(layer, []):
        if before(h, o):
            continue
        if not any(ops[d].layer == layer and before(o, d) for d in casts):
            fail(h, "staging", f"#{o} {ops[o]!r} may update layer {layer}'s master before this copy, and the copy "
                 "depends on no CAST of the layer after it, so it may send the old weights",
                 f"make it depend on the CAST:L{layer}:t{layer}:b<k> after #{o}")
    for other in cast_by_tile[layer]:
        if not before(other, h) and not before(h, other):
            fail(other, "staging", f"it may overwrite staging tile t{layer} while #{h} {ops[h]!r} reads it",
                 f"make it depend on #{h}")


def _check_coverage(c: _Context) -> None:
    """Rule ``coverage``: each (layer, micro-batch) runs its forward and local backward once, its
    recompute at most once."""
    ops, plan, graph, fail, schedule, at = c.ops, c.plan, c.graph, c.fail, c.schedule, c.at
    M, n, last = plan.micro_batches, len(graph.layers), c.last
    # An update schedule runs the deferred optimizer steps, and the NVMe transfers of their moments
    # (and masters, whose new BF16 copy a CAST from the I/O buffer keeps in the layer's staging tile).
    update_kinds = (OpKind.OPT, OpKind.NVME_READ, OpKind.NVME_WRITE, OpKind.ALL_GATHER)

    def updates(op) -> bool:
        return op.kind in update_kinds or (op.kind is OpKind.CAST and op.buf is not None)
    if schedule.mode == "update" and not all(updates(op) for op in ops):
        fail(next(i for i, op in enumerate(ops) if not updates(op)), "coverage",
             "an update schedule runs the deferred optimizer steps and nothing else", "lower with mode='update'")
    fwd_layers = range(n - 1) if schedule.mode == "train" else range(n) if schedule.mode == "eval" else ()
    for layer in range(n):
        for mb in range(M):
            want_fwd = 1 if layer in fwd_layers else 0
            want_bwd = 1 if schedule.mode == "train" and (layer == n - 1 or graph.has_gradients(layer)) else 0
            for kind, want in ((OpKind.FWD, want_fwd), (OpKind.BWD, want_bwd), (OpKind.RECOMPUTE, None)):
                got = at.get((kind, layer, mb), [])
                if (want is None and len(got) > (1 if schedule.mode == "train" else 0)) or \
                        (want is not None and len(got) != want):
                    fail(got[1] if len(got) > 1 else got[0] if got else last, "coverage",
                         f"{kind.value} of layer {layer}, micro-batch {mb} runs {len(got)} times, expected "
                         f"{'at most one' if want is None else want}", "lower the schedule again")


def _check_data(c: _Context) -> None:
    """Rule ``data``: every checkpoint read comes after the op that put that generation on the GPU
    (:mod:`megatrain.ir.liveness`); reloads after their offloads; gradients after their producers."""
    ops, graph, fail, before, at = c.ops, c.graph, c.fail, c.before, c.at
    producer_layer = {vid: v.producer for vid, v in enumerate(graph.values)}
    live = c.liveness
    for i, op in enumerate(ops):
        for key, k in live.reads[i].items():
            name = graph.values[key[0]].name
            if k is None:
                fail(i, "data", f"checkpoint {name!r} (micro-batch {key[1]}) is read before any op "
                     "puts it on the GPU", f"run FWD of layer {producer_layer[key[0]]} first")
            src = live.generations[k].producer
            if src != BATCH and not before(src, i):
                fail(i, "data", f"it reads {name!r} from #{src} {ops[src]!r}, which does not happen "
                     "before it", f"make it depend on #{src}")
        if op.kind is OpKind.RELOAD:
            off = at.get((OpKind.OFFLOAD, op.layer, op.mb), [])
            if not off or not before(off[0], i):
                fail(i, "data", f"it reloads layer {op.layer}'s checkpoints (micro-batch {op.mb}) that no "
                     "earlier OFFLOAD copied out", f"make it depend on OFFLOAD:L{op.layer}:m{op.mb}:c{op.copy}")
            if ops[off[0]].copy != op.copy:
                fail(i, "data", f"it reads pinned copy c{op.copy}, but #{off[0]} {ops[off[0]]!r} wrote micro-batch "
                     f"{op.mb}'s checkpoints into c{ops[off[0]].copy}", f"read copy c{ops[off[0]].copy}")
        if op.kind is OpKind.OFFLOAD:
            # A pinned copy holds one micro-batch's checkpoints at a time (per-micro-batch passes
            # reuse one): an offload into it comes after the reloads of what it held.
            for m in range(op.mb):
                for o in at.get((OpKind.OFFLOAD, op.layer, m), []):
                    if ops[o].copy != op.copy:
                        continue
                    for r in at.get((OpKind.RELOAD, op.layer, m), []):
                        if not before(r, i):
                            fail(i, "data", f"it overwrites layer {op.layer}'s pinned checkpoint copy c{op.copy} "
                                 f"before #{r} {ops[r]!r} reads micro-batch {m}'s back", f"make it depend on #{r}")
    for (kind, layer, mb), (i, *_) in at.items():
        if kind is not OpKind.BWD:
            continue
        for vid in graph.layers[layer].outputs:
            val = graph.values[vid]
            if not val.requires_grad:
                continue
            for c in val.consumers:
                j = at[(OpKind.BWD, c, mb)][0]
                if not before(j, i):
                    fail(i, "data", f"the gradient of {val.name!r} from #{j} {ops[j]!r} does not "
                         "arrive before it", f"make it depend on #{j}")


def _check_updates(c: _Context) -> None:
    """Rule ``coverage`` of updates: each trainable layer is updated once, after all its micro-batches
    (or, carried, before every copy of its weights)."""
    ops, graph, fail, before, by_kind, schedule, at = c.ops, c.graph, c.fail, c.before, c.by_kind, c.schedule, c.at
    opt_by_layer, deferred, M, n, last = c.opt_by_layer, c.deferred, c.plan.micro_batches, len(graph.layers), c.last
    if schedule.mode == "train" or schedule.mode == "update":
        carried = schedule.mode == "update" or schedule.carries_updates
        for layer in range(n):
            trainable = graph.layers[layer].trainable_numel > 0
            opts = opt_by_layer.get(layer, [])
            want = 1 if trainable and (not deferred or carried) else 0
            if len(opts) != want:
                fail(opts[want] if len(opts) > want else last, "coverage", f"layer {layer} is updated "
                     f"{len(opts)} times in this {schedule.mode} schedule, expected {want}",
                     "one OPT per trainable layer" + (" at the start of each step after the first, with "
                                                      "lower(..., carries_updates=True)" if deferred else ""))
            for o in opts:
                if carried:
                    for h in by_kind[OpKind.H2D] + by_kind[OpKind.CAST]:
                        if ops[h].layer == layer and not before(o, h):
                            fail(h, "coverage", f"it reads layer {layer}'s master weights before the deferred "
                                 f"update #{o} {ops[o]!r} writes them", f"make it depend on #{o}")
                    continue
                for mb in range(M):
                    b = at[(OpKind.BWD, layer, mb)][0]
                    if not before(b, o):
                        fail(o, "coverage", f"it updates layer {layer} before micro-batch {mb}'s "
                             f"local backward #{b}", f"make it depend on #{b}")
    elif by_kind[OpKind.OPT] or by_kind[OpKind.D2H] or by_kind[OpKind.BWD] or by_kind[OpKind.ACC]:
        fail(min(by_kind[OpKind.OPT] + by_kind[OpKind.D2H] + by_kind[OpKind.BWD] + by_kind[OpKind.ACC]), "coverage",
             "an eval schedule computes no gradients and updates nothing", "lower with mode='eval'")

def _check_nvme(c: _Context) -> None:
    """Rule ``nvme``: for a layer whose Adam moments live on NVMe (``Plan.nvme_moments``), each OPT
    happens after an NVME_READ of the layer and before an NVME_WRITE of it (the read before the use,
    the write after the last modification), and no two NVMe transfers of one file of a layer are
    unordered (in flight at once). No NVMe op names a layer whose moments (``buf``) or gradient
    tile (``gbuf``) are not on NVMe.

    I/O buffers (``Op.buf``, below ``cost.nvme_buffers``' count): such a layer's moments have no
    rows in host memory, so its OPT names the buffer they are in, and only such an OPT names one.
    Each buffer is used in turns, one layer a turn: an NVME_READ fills it, then only that layer's
    OPT and NVME_WRITE use it, and the next NVME_READ into it happens after every use of the turn
    before (else it would overwrite moments an OPT is stepping or a write is saving).

    Gradient I/O buffers (``Op.gbuf``, below ``cost.nvme_gradient_buffers``' count), layers of
    ``Plan.nvme_gradients``: their D2H and their carried OPT name a gradient buffer, never a ring
    tile (and no other layer's do). Each buffer is used in turns as above, a turn filled by a D2H
    (then used by that layer's NVME_WRITE, which must be there: the next step's OPT reads the
    file) or by an NVME_READ (then used by that layer's OPT, which reads what the read filled);
    every use happens after the fill, and the next fill after every use of the turn before (the
    write after the tile is complete, the tile reused only after it was written or stepped).

    Masters (``Plan.nvme_masters``): the CAST of such a layer, and only of such a layer, names the
    I/O buffer it casts from (a use of the buffer's turn); after each OPT of the layer a CAST of it
    happens, and the NVME_WRITE after that OPT waits for the CAST."""
    ops, fail, before, by_kind = c.ops, c.fail, c.before, c.by_kind
    on_nvme, grads_on_nvme = c.plan.nvme_moments, c.plan.nvme_gradients
    io = sorted(by_kind[OpKind.NVME_READ] + by_kind[OpKind.NVME_WRITE])
    for i in io:
        if ops[i].buf is not None and ops[i].layer not in on_nvme:
            fail(i, "nvme", f"layer {ops[i].layer}'s moments are not on NVMe (Plan.nvme_moments)",
                 "drop the op or add the layer to Plan.nvme_moments")
        if ops[i].gbuf is not None and ops[i].layer not in grads_on_nvme:
            fail(i, "nvme", f"layer {ops[i].layer}'s gradient tile is not on NVMe (Plan.nvme_gradients)",
                 "drop the op or add the layer to Plan.nvme_gradients")
    by_file: dict[tuple[int, bool], list[int]] = defaultdict(list)  # (layer, gradient file?) -> its transfers
    for i in io:
        by_file[(ops[i].layer, ops[i].gbuf is not None)].append(i)
    for mine in by_file.values():
        for a, b in zip(mine, mine[1:]):
            if not before(a, b):
                fail(b, "nvme", f"it may run while #{a} {ops[a]!r} moves the same file", f"make it depend on #{a}")
    for layer in sorted(on_nvme):
        mine = by_file.get((layer, False), [])
        for o in c.opt_by_layer.get(layer, []):
            reads = [i for i in mine if ops[i].kind is OpKind.NVME_READ and before(i, o)]
            if not reads:
                fail(o, "nvme", f"it steps layer {layer} whose moments are on NVMe, but no NVME_READ of the layer "
                     "happens before it", "lower the plan again (lower adds the reads)")
            writes = [i for i in mine if ops[i].kind is OpKind.NVME_WRITE and before(o, i)]
            if not writes:
                fail(o, "nvme", f"its update of layer {layer}'s moments is never written back to NVMe",
                     "add an NVME_WRITE that depends on it")
            late = [i for i in mine if ops[i].kind is OpKind.NVME_WRITE and not before(o, i)
                    and not before(i, reads[-1])]
            if late:
                fail(late[0], "nvme", f"it writes layer {layer}'s moments while OPT #{o} may be changing them",
                     f"make it depend on #{o}")
    masters = c.plan.nvme_masters
    for i in by_kind[OpKind.CAST]:
        if (ops[i].buf is not None) != (ops[i].layer in masters):
            where, rule = (("on NVMe", "must cast from the I/O buffer (b<k>) its OPT stepped")
                           if ops[i].layer in masters else ("in host memory", "casts from the master row, naming "
                                                                               "no I/O buffer"))
            fail(i, "nvme", f"layer {ops[i].layer}'s master is {where} (Plan.nvme_masters), so its CAST {rule}",
                 "lower the plan again (add_nvme_io places the CAST after the OPT)")
    for layer in sorted(masters):
        mine = by_file.get((layer, False), [])
        for o in c.opt_by_layer.get(layer, []):
            cast = [i for i in by_kind[OpKind.CAST] if ops[i].layer == layer and before(o, i)]
            if not cast:
                fail(o, "nvme", f"it updates layer {layer}'s master in I/O buffer b{ops[o].buf}, but no CAST after it "
                     f"writes the new BF16 copy into staging tile t{layer}, which every copy of the layer reads",
                     "lower the plan again (add_nvme_io adds the CAST)")
            for w in mine:
                if ops[w].kind is OpKind.NVME_WRITE and before(o, w) and not before(cast[0], w):
                    fail(w, "nvme", f"it writes layer {layer}'s master back before #{cast[0]} {ops[cast[0]]!r} has "
                         "cast it from the buffer", f"make it depend on #{cast[0]}")
    for o in by_kind[OpKind.OPT]:
        if (ops[o].buf is not None) != (ops[o].layer in on_nvme):
            where, rule = (("on NVMe", "must name an") if ops[o].layer in on_nvme else ("in host memory", "names no"))
            fail(o, "nvme", f"layer {ops[o].layer}'s moments are {where}, so its OPT {rule} I/O buffer",
                 "lower the plan again (add_nvme_io names the buffers)")
    for i in sorted(by_kind[OpKind.OPT] + by_kind[OpKind.D2H]):
        if ops[i].acc is None and (ops[i].gbuf is not None) != (ops[i].layer in grads_on_nvme):
            where, rule = (("on NVMe", "must name a") if ops[i].layer in grads_on_nvme
                           else ("in host memory", "names no"))
            fail(i, "nvme", f"layer {ops[i].layer}'s gradient tile is {where} (Plan.nvme_gradients), so its "
                 f"{ops[i].kind.value} {rule} gradient I/O buffer (g<k>)", "lower the plan again (add_nvme_io names "
                 "the gradient buffers)")
    _check_turns(c, "buf", sorted(i for i in io + by_kind[OpKind.OPT] + by_kind[OpKind.CAST] if ops[i].buf is not None),
                 cost.nvme_buffers(c.graph, c.plan)[0], "I/O buffer b", "moments", (OpKind.NVME_READ,),
                 "cost.nvme_buffers")
    gio = sorted(i for i in io + by_kind[OpKind.OPT] + by_kind[OpKind.D2H] if ops[i].gbuf is not None)
    _check_turns(c, "gbuf", gio, cost.nvme_gradient_buffers(c.graph, c.plan)[0], "gradient I/O buffer g",
                 "gradient tile", (OpKind.NVME_READ, OpKind.D2H), "cost.nvme_gradient_buffers")


def _check_turns(c: _Context, field: str, users: list[int], pool: int, name: str, what: str,
                 fillers: tuple[OpKind, ...], source: str) -> None:
    """Part of rule ``nvme``: the ops naming buffer ``field`` use each buffer in turns (see
    :func:`_check_nvme`): a filler opens a turn after every use of the one before; a use belongs
    to the layer that filled the buffer and happens after the fill; a turn a D2H opened ends with
    the layer's NVME_WRITE (its gradients reach the file), and an OPT reads a turn a read opened."""
    ops, fail, before = c.ops, c.fail, c.before
    turn: dict[int, list[int]] = {}  # buffer -> the ops of its current turn, its filler first

    def close(b: int) -> None:
        first = ops[turn[b][0]]
        if first.kind is OpKind.D2H and not any(ops[u].kind is OpKind.NVME_WRITE for u in turn[b]):
            fail(turn[b][0], "nvme", f"the gradients it puts in {name}{b} are never written to layer "
                 f"{first.layer}'s NVMe file, which the next step's update reads", "add an NVME_WRITE of the "
                 "buffer that depends on it")

    for i in sorted(users):
        b = getattr(ops[i], field)
        if not 0 <= b < pool:
            fail(i, "nvme", f"it names {name}{b}, but the plan has {pool} ({source})",
                 "lower the plan again (add_nvme_io hands out cost.NVME_BUFFERS in turn)")
        if ops[i].kind in fillers:
            for u in turn.get(b, []):
                if not before(u, i):
                    fail(i, "nvme", f"it fills {name}{b} while #{u} {ops[u]!r} may still use it",
                         f"make it depend on #{u}")
            if b in turn:
                close(b)
            turn[b] = [i]
            continue
        if b not in turn or ops[turn[b][0]].layer != ops[i].layer:
            held = f"layer {ops[turn[b][0]].layer}'s {what}" if b in turn else "nothing read yet"
            fail(i, "nvme", f"{name}{b} holds {held}, not layer {ops[i].layer}'s",
                 f"name the buffer its {' or '.join(k.value for k in fillers)} filled")
        f = turn[b][0]
        if not before(f, i):
            fail(i, "nvme", f"it uses {name}{b} before #{f} {ops[f]!r} filled it", f"make it depend on #{f}")
        if ops[i].kind is OpKind.OPT and ops[f].kind is not OpKind.NVME_READ:
            fail(i, "nvme", f"it steps from {name}{b}, which #{f} {ops[f]!r} filled with this step's gradients, "
                 "not the previous step's that its NVME_READ brings back", "read the layer's gradient file first")
        turn[b].append(i)
    for b in turn:
        close(b)


def _check_collectives(c: _Context) -> None:
    """Rule ``collectives`` (data parallel): a train schedule of a plan with ``data_parallel > 1``
    has one ALL_REDUCE (a REDUCE_SCATTER where ``Plan.gradient_reduction`` is ``"reduce_scatter"``,
    and only there) per layer whose step gradients reach the host, reading what the layer's
    last D2H (or last ACC, with host accumulation) wrote and happening after it; the layer's OPT
    in the schedule happens after it; one COUNT_REDUCE of the loss layer happens before every
    local backward of that layer; and the collectives form one chain (each after the one
    before it), so every rank, running this same schedule, issues the collectives in list order:
    none can overtake another and leave two ranks waiting in different collectives (a deadlock).
    Other schedules have none."""
    ops, fail, before, by_kind = c.ops, c.fail, c.before, c.by_kind
    # Plan.gradient_reduction picks the kind: a REDUCE_SCATTER leaves each rank only its optimizer
    # shard reduced, which is what its OPT reads only when the plan shares one copy on one node.
    want = OpKind.REDUCE_SCATTER if c.plan.gradient_reduction == "reduce_scatter" else OpKind.ALL_REDUCE
    for i in by_kind[OpKind.ALL_REDUCE] + by_kind[OpKind.REDUCE_SCATTER]:
        if ops[i].kind is not want:
            fail(i, "collectives", f"the plan has gradient_reduction={c.plan.gradient_reduction!r}, so the "
                 f"gradients are reduced by {want.value}, not {ops[i].kind.value}", "lower the plan again")
    reduces = sorted(by_kind[OpKind.ALL_REDUCE] + by_kind[OpKind.REDUCE_SCATTER])
    counts = by_kind[OpKind.COUNT_REDUCE]
    if c.plan.data_parallel == 1 or c.schedule.mode != "train":
        if reduces or counts:
            fail(min(reduces + counts), "collectives", f"the plan has data_parallel={c.plan.data_parallel} and the "
                 f"schedule is {c.schedule.mode!r}, so nothing is reduced across ranks", "drop the op")
        _check_gathers(c)
        _check_chain(c, by_kind[OpKind.ALL_GATHER])
        return
    _check_count(c, counts)
    last: dict[int, int] = {}
    for i in sorted(by_kind[OpKind.D2H] + by_kind[OpKind.ACC]):
        last[ops[i].layer] = i
    mine: dict[int, list[int]] = defaultdict(list)
    for i in reduces:
        mine[ops[i].layer].append(i)
    for layer, src in sorted(last.items()):
        got = mine.get(layer, [])
        if len(got) != 1:
            at = got[1] if got else src
            fail(at, "collectives", f"layer {layer}'s step gradients need exactly one {want.value}, found {len(got)}",
                 "lower the plan again (lower adds one after the last D2H or ACC)")
        r = got[0]
        s = ops[src]
        reads = ("acc", s.acc) if s.kind is OpKind.ACC else ("ring", s.ring)
        if not before(src, r) or getattr(ops[r], reads[0]) != reads[1]:
            fail(r, "collectives", f"it must reduce what #{src} {s!r} wrote ({reads[0]} {reads[1]}) after it",
                 f"make it depend on #{src} and name that {reads[0]}")
        for o in c.opt_by_layer.get(layer, []):
            if o > src and not before(r, o):
                fail(o, "collectives", f"it steps layer {layer} before its gradients were reduced across ranks "
                     f"(#{r})", f"make it depend on #{r}")
    for layer in sorted(set(mine) - set(last)):
        fail(mine[layer][0], "collectives", f"layer {layer} has no gradients on the host in this schedule",
             "drop the op")
    _check_gathers(c)
    _check_chain(c, reduces + counts + by_kind[OpKind.ALL_GATHER])


def _check_count(c: _Context, counts: list[int]) -> None:
    """Part of rule ``collectives`` (data-parallel train schedules): one COUNT_REDUCE, of the loss
    layer, which every local backward of that layer (each seeds its loss with ``1 / N``, ``N`` the
    global batch's supervised tokens the COUNT_REDUCE sums over the ranks) happens after."""
    ops, fail = c.ops, c.fail
    loss_layer = len(c.graph.layers) - 1
    bwds = [i for i in c.by_kind[OpKind.BWD] if ops[i].layer == loss_layer]
    if len(counts) != 1:
        fail(counts[1] if counts else bwds[0], "collectives", f"a data-parallel step needs exactly one COUNT_REDUCE "
             f"(the global batch's supervised tokens, which the loss is divided by), found {len(counts)}",
             f"lower the plan again (lower puts COUNT_REDUCE:L{loss_layer} first)")
    k = counts[0]
    if ops[k].layer != loss_layer:
        fail(k, "collectives", f"it names layer {ops[k].layer}, but the loss layer, whose backward reads the count, "
             f"is {loss_layer}", f"write COUNT_REDUCE:L{loss_layer}")
    for b in bwds:
        if not c.before(k, b):
            fail(b, "collectives", f"it seeds the loss with 1 / (the global batch's supervised tokens) before #{k} "
                 f"{ops[k]!r} summed them over the ranks", f"make it depend on #{k}")


def _check_chain(c: _Context, collectives: list[int]) -> None:
    """Part of rule ``collectives``: the collectives form one chain, each after the one before it."""
    ops, fail, before = c.ops, c.fail, c.before
    comm = sorted(collectives)
    for a, b in zip(comm, comm[1:]):
        if not before(a, b):
            fail(b, "collectives", f"it may run before #{a} {ops[a]!r}, so ranks could issue the collectives in "
                 "different orders and wait on each other forever", f"make it depend on #{a}")


def _check_gathers(c: _Context) -> None:
    """Part of rule ``collectives`` (plans with ``optimizer_shards > 1``): each OPT, which steps
    only this rank's shard of the layer, is followed by one ALL_GATHER of the layer that happens
    after it, and every later H2D or CAST of the layer (a read of its master) happens after that
    gather, so no rank reads a master that another rank's shard step is still writing."""
    ops, fail, before = c.ops, c.fail, c.before
    gathers = c.by_kind[OpKind.ALL_GATHER]
    if c.plan.host_state == "shard":
        _check_weight_gathers(c)
        return
    for g in gathers:
        if ops[g].tile is not None:
            fail(g, "collectives", f"it gathers into gather tile t{ops[g].tile}, but the plan has host_state="
                 f"{c.plan.host_state!r}: every node holds whole masters, so nothing is gathered into a tile",
                 f"write ALL_GATHER:L{ops[g].layer}")
    if c.plan.optimizer_shards == 1:
        if gathers:
            fail(gathers[0], "collectives", "the plan has optimizer_shards=1: each rank steps whole tiles of its "
                 "own, so there is nothing to gather", "drop the op")
        return
    mine: dict[int, list[int]] = defaultdict(list)
    for g in gathers:
        mine[ops[g].layer].append(g)
    readers: dict[int, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        if op.kind in (OpKind.H2D, OpKind.CAST):
            readers[op.layer].append(i)
    if c.plan.shared_cast:
        _check_shared_casts(c, mine, readers)
        return
    for layer, steps in sorted(c.opt_by_layer.items()):
        got = mine.pop(layer, [])
        if len(got) != len(steps):
            fail(got[len(steps)] if len(got) > len(steps) else steps[-1], "collectives",
                 f"layer {layer} has {len(steps)} sharded OPT(s) and {len(got)} ALL_GATHER(s); each OPT needs one "
                 "after it", "lower the plan again (lower adds one after each OPT)")
        for o, g in zip(steps, got):
            if not before(o, g):
                fail(g, "collectives", f"it gathers layer {layer}'s shards before OPT #{o} wrote them",
                     f"make it depend on #{o}")
            for r in readers[layer]:
                if r > o and not before(g, r):
                    fail(r, "collectives", f"it reads layer {layer}'s master while other ranks may still be stepping "
                         f"their shards of it (OPT #{o})", f"make it depend on ALL_GATHER #{g}")
    for layer, got in sorted(mine.items()):
        fail(got[0], "collectives", f"layer {layer} has no OPT in this schedule", "drop the op")


def _check_shared_casts(c: _Context, mine: dict[int, list[int]], readers: dict[int, list[int]]) -> None:
    """Part of rule ``collectives`` (``Plan.shared_cast``): each rank CASTs only its shard into the
    node's staging tile of the layer, so every H2D that reads a CAST waits for an ALL_GATHER of the
    layer (a barrier of the node's ranks) that happens after that CAST: the tile is whole only once
    every rank's CAST is done. Each OPT is followed by a gather of its layer that happens after it,
    every later H2D waits for that gather and every later CAST happens after the OPT (a CAST reads
    only this rank's shard, which its own OPT wrote; the other ranks' shards are covered by the
    gather that follows the CAST); and every gather follows an OPT or a CAST of its layer."""
    ops, fail, before = c.ops, c.fail, c.before
    covered: set[int] = set()
    for layer, steps in sorted(c.opt_by_layer.items()):
        for o in steps:
            g = next((g for g in mine.get(layer, []) if g > o), None)
            if g is None or not before(o, g):
                fail(o, "collectives", f"layer {layer}'s sharded OPT needs an ALL_GATHER of the layer after it",
                     "lower the plan again (lower adds one after each OPT)")
            covered.add(g)
            for r in readers[layer]:
                if r > o and ops[r].kind is OpKind.H2D and not before(g, r):
                    fail(r, "collectives", f"it reads layer {layer}'s staging tile while other ranks may still be "
                         f"stepping their shards of it (OPT #{o})", f"make it depend on ALL_GATHER #{g}")
                if r > o and ops[r].kind is OpKind.CAST and not before(o, r):
                    fail(r, "collectives", f"it casts this rank's shard of layer {layer} while OPT #{o} may still "
                         "step it", f"make it depend on #{o}")
    for h in c.by_kind[OpKind.H2D]:
        layer = ops[h].layer
        for cast in (d for d in ops[h].deps if ops[d].kind is OpKind.CAST):
            g = next((g for g in mine.get(layer, []) if before(cast, g) and before(g, h)), None)
            if g is None:
                fail(h, "collectives", f"it reads the node's shared staging tile t{ops[h].tile}, which CAST #{cast} "
                     f"{ops[cast]!r} filled with this rank's shard only (Plan.shared_cast), before an ALL_GATHER "
                     "of the layer after that CAST: other ranks may not have cast theirs yet",
                     f"make it depend on an ALL_GATHER:L{layer} that depends on #{cast}")
            covered.add(g)
    for layer, got in sorted(mine.items()):
        for g in got:
            if g not in covered:
                fail(g, "collectives", f"it follows no OPT or shared CAST of layer {layer}", "drop the op")


def _check_weight_gathers(c: _Context) -> None:
    """Part of rule ``collectives`` (``Plan.host_state == "shard"``): no node holds a whole master,
    so every read of one (an H2D; a CAST in schedules that cast) depends on exactly one ALL_GATHER of its layer
    with a gather tile (``t`` in ``[0, cost.GATHER_BUFFERS)``), and reads that tile; that gather
    happens after every earlier OPT of the layer (the node's shards are stepped before they are
    gathered) and before every later one (no shard changes while it is read); a later gather into the same tile happens after every read of the earlier one (a
    tile is not overwritten while read); and every gather has a reader."""
    ops, fail, before = c.ops, c.fail, c.before
    gathers = c.by_kind[OpKind.ALL_GATHER]
    for g in gathers:
        if ops[g].tile is None or not 0 <= ops[g].tile < cost.GATHER_BUFFERS:
            fail(g, "collectives", f"the plan shards the host state across {c.plan.nodes} nodes, so a gather "
                 f"fills one of the node's {cost.GATHER_BUFFERS} gather tiles, and it names "
                 + ("none" if ops[g].tile is None else f"t{ops[g].tile}"),
                 f"write ALL_GATHER:L{ops[g].layer}:t<k> with k < {cost.GATHER_BUFFERS} (lower the plan again)")
    read_by: dict[int, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        if not ((op.kind is OpKind.H2D and op.tile is None) or op.kind is OpKind.CAST):
            continue
        mine = [d for d in op.deps if ops[d].kind is OpKind.ALL_GATHER and ops[d].layer == op.layer]
        if len(mine) != 1:
            fail(i, "collectives", f"it reads layer {op.layer}'s weights, which no node holds whole (host_state "
                 f"'shard'), so it must depend on one ALL_GATHER of the layer, and it depends on {len(mine)}",
                 f"make it depend on one ALL_GATHER:L{op.layer}:t<k> just before it (lower the plan again)")
        g = mine[0]
        read_by[g].append(i)
        for o in c.opt_by_layer.get(op.layer, []):
            if o < g and not before(o, g):
                fail(g, "collectives", f"it gathers layer {op.layer}'s slices while OPT #{o} may still be stepping "
                     "this rank's shard of them", f"make it depend on #{o}")
            if o > g and not before(g, o):
                fail(o, "collectives", f"it steps layer {op.layer}'s shard while #{g} {ops[g]!r} may still be "
                     "gathering the node's slice of it", f"make it depend on #{g}")
    by_tile: dict[int, list[int]] = defaultdict(list)
    for g in gathers:
        if g not in read_by:
            fail(g, "collectives", "nothing reads the gather tile it fills", "drop the op")
        by_tile[ops[g].tile].append(g)
    for turn in by_tile.values():
        for a, b in zip(turn, turn[1:]):
            for r in read_by[a]:
                if not before(r, b):
                    fail(b, "collectives", f"it may overwrite gather tile t{ops[b].tile} while #{r} {ops[r]!r} "
                         f"still reads what #{a} {ops[a]!r} gathered", f"make it depend on #{r}")


def _check_layout(c: _Context) -> None:
    """Rule ``layout``: the schedule's :class:`~megatrain.ir.layout.BufferLayout` (when lowering
    recorded one) fits the graph, the plan and the ops. Each layer's optimizer shards tile its
    trainable elements in rank order (``Plan.update_shards`` of them) within its host gradient tile
    (``reduced_numel``: at least the trainable elements, equal chunks for a reduce-scatter); its
    node slices tile its master tile with ``Plan.host_state == "shard"`` (else each is the whole
    tile), as its cast shards do with ``Plan.shared_cast``. The pinned arena's regions each start on
    a page, do not overlap and end within the arena, one per (kind, key); every op's layer fits the
    slot, ring, staging, offload, gradient and NVMe I/O buffer it names; a sliced state's gather
    tiles and scratch hold its widest layer."""
    layout, graph, plan, ops, fail = c.schedule.layout, c.graph, c.plan, c.ops, c.fail
    if layout is None:
        return

    def broken(what: str, fix: str = "lower the plan again (megatrain.planner.lower records the layout)") -> NoReturn:
        raise ScheduleError(f"schedule breaks rule 'layout': {what}. Fix: {fix}.")

    if len(layout.layers) != len(graph.layers):
        broken(f"it lays out {len(layout.layers)} layers and the graph has {len(graph.layers)}")
    for li, (span, layer) in enumerate(zip(layout.layers, graph.layers)):
        _check_tiling(broken, f"layer {li}'s optimizer shards", span.optimizer_shards, plan.update_shards,
                      layer.trainable_numel, True)
        _check_tiling(broken, f"layer {li}'s cast shards", span.cast_shards, plan.optimizer_shards, layer.numel,
                      plan.shared_cast)
        _check_tiling(broken, f"layer {li}'s node slices", span.node_slices, plan.nodes, layer.numel,
                      plan.host_state == "shard")
        chunk = span.optimizer_shards[0][1] - span.optimizer_shards[0][0] if span.optimizer_shards else 0
        if span.reduced_numel < layer.trainable_numel or (
                plan.gradient_reduction == "reduce_scatter" and span.reduced_numel != plan.update_shards * chunk):
            broken(f"layer {li}'s gradient tile holds {span.reduced_numel:,} elements for its "
                   f"{layer.trainable_numel:,} trainable ones in shards of {chunk:,}")
    if len(layout.slots) != plan.slots + len(plan.resident):
        broken(f"it has {len(layout.slots)} GPU slots and the plan {plan.slots} streaming and "
               f"{len(plan.resident)} resident ones")
    end, seen = 0, set()
    for t in layout.pinned.tiles:
        if t.offset % cost.HOST_PAGE_BYTES or t.offset < end or t.nbytes < 0 or (t.kind, t.key) in seen:
            broken(f"pinned region {t.kind} {t.key!r} at byte {t.offset:,} starts off a page, inside the region "
                   f"before it (which ends at {end:,}), or again")
        end, seen = t.offset + cost.page_up(t.nbytes), seen | {(t.kind, t.key)}
    if end > layout.pinned.nbytes:
        broken(f"the pinned regions end at byte {end:,}, past the arena's {layout.pinned.nbytes:,}")
    region = {(t.kind, t.key): t.nbytes for t in layout.pinned.tiles}
    staged = plan.staged and not plan.shared_cast  # shared tiles are the node's (HostState.staging)
    for i, op in enumerate(ops):
        layer = graph.layers[op.layer]
        need: list[tuple[str, object, int]] = []
        if op.slot is not None and 0 <= op.slot < len(layout.slots) and (
                layer.numel > layout.slots[op.slot][0] or layer.trainable_numel > layout.slots[op.slot][1]):
            fail(i, "layout", f"layer {op.layer} ({layer.numel:,} elements) does not fit slot {op.slot} of "
                 f"{layout.slots[op.slot][0]:,}", "lower the plan again")
        if op.kind is OpKind.D2H and op.ring is not None:
            need.append(("ring", op.ring, layer.trainable_numel * plan.gradient_itemsize))
        if op.kind in (OpKind.D2H, OpKind.NVME_READ, OpKind.NVME_WRITE) and op.gbuf is not None:
            need.append(("nvme_gradients", op.gbuf, layer.trainable_numel * plan.gradient_itemsize))
        if op.kind in (OpKind.CAST, OpKind.H2D) and op.tile is not None and staged:
            need.append(("staging", op.tile, layer.numel * cost.STAGING_ITEMSIZE))
        if op.kind is OpKind.OFFLOAD:
            need += [("offload", (v, op.copy), graph.values[v].nbytes) for v in graph.checkpoints(op.layer)]
        for kind, key, nbytes in need:
            if region.get((kind, key), -1) < nbytes:
                fail(i, "layout", f"it needs {nbytes:,} bytes in pinned {kind} region {key!r}, and the layout "
                     f"gives {region.get((kind, key), 'none')}", "lower the plan again")
        if op.buf is not None:  # an NVMe I/O buffer: NVME_READ, NVME_WRITE, OPT, CAST
            count, nbytes = layout.nvme_buffers
            want = cost.nvme_bytes(layer, op.layer in plan.nvme_masters, plan)
            if not 0 <= op.buf < count or nbytes < want:
                fail(i, "layout", f"it uses NVMe I/O buffer b{op.buf} for {want:,} bytes, and the layout has "
                     f"{count} of {nbytes:,}", "lower the plan again")
    if plan.host_state == "shard":
        widest = max((lay.numel for lay in graph.layers), default=0) * plan.compute_itemsize
        slice_max = max((hi - lo for span in layout.layers for lo, hi in span.node_slices), default=0)
        if layout.gather_buffers[0] != cost.GATHER_BUFFERS or layout.gather_buffers[1] < widest \
                or layout.gather_scratch_bytes < (plan.nodes + 1) * slice_max * plan.compute_itemsize:
            broken(f"a sliced host state needs {cost.GATHER_BUFFERS} gather tiles of {widest:,} bytes and a "
                   f"scratch of {plan.nodes + 1} node slices, and the layout gives {layout.gather_buffers} "
                   f"and {layout.gather_scratch_bytes:,} bytes")


def _check_tiling(broken: Callable[[str], NoReturn], what: str, spans: tuple[tuple[int, int], ...], count: int,
                  numel: int, split: bool) -> None:
    """``spans`` are ``count`` ``[lo, hi)`` that tile ``[0, numel)`` in order (``split``), or each ``[0, numel)``."""
    if len(spans) != count:
        broken(f"{what} are {len(spans)}, and the plan has {count}")
    if not split:
        if any(s != (0, numel) for s in spans):
            broken(f"{what} {list(spans)} are not each the whole [0, {numel})")
        return
    at = 0
    for lo, hi in spans:
        if lo != at or hi < lo:
            broken(f"{what} {list(spans)} do not tile [0, {numel}) in order: one starts at {lo}, not {at}")
        at = hi
    if at != numel:
        broken(f"{what} {list(spans)} end at {at}, not at {numel}")


RULES: list[Callable[[_Context], None]] = [_check_order, _check_budget, _check_weights, _check_gradients,
                                           _check_staging, _check_coverage, _check_data, _check_updates,
                                           _check_nvme, _check_collectives, _check_layout]
"""The verifier's rules, in the order they run (``order`` first: the others index by dependency)."""


def _check_memory(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec) -> None:
    mem = cost.memory_breakdown(graph, schedule.plan, hw, schedule)
    fixes = {"GPU memory": "lower micro_batch_size, offload or recompute checkpoints, or use fewer slots or "
                           "resident layers",
             "pinned host memory": "use fewer gradient or staging tiles, or fewer offloaded checkpoints",
             "host memory": "use a machine with more host memory, or put optimizer state on NVMe "
                            "(Plan.nvme_moments; megatrain plan --nvme, megatrain train --nvme-dir)"}
    for what, need, have in mem.budgets(hw):  # the one definition of "fits"
        if need > have:
            fix = fixes[what]
            raise ScheduleError(f"schedule breaks rule 'budget': it needs {human_bytes(need)} of {what} at "
                                f"its peak, and {hw.name!r} has {human_bytes(have)}. Fix: {fix}.\n"
                                + mem.format())


__all__ = ["RULES", "happens_before", "verify"]
