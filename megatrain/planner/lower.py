"""Lower (LayerGraph, Plan) to a Schedule, as the passes in ``PASSES`` (each a function from the
previous pass's list and the request to a new list): ``order_compute`` (the visits),
``assign_slots``, ``add_copies`` (the ops with their weight, checkpoint and gradient copies),
``add_carried_updates`` (the previous step's optimizer steps at the start of a NEXT_FORWARD step),
then ``add_nvme_io`` (the NVMe tier's reads and writes), ``add_all_reduce`` (data parallel: each
layer's gradients summed over the ranks), ``add_all_gather`` (a node's ranks sharing one host
copy: each OPT's shard made every rank's before the layer is read again; with the host state
sharded across nodes, a gather of the layer's weights into a gather tile before every read) and
``add_count_reduce`` (data parallel: the global batch's supervised tokens, the loss's divisor,
summed over the ranks before the loss layer's first backward).
The finished list then gets its ``Schedule.issue_after`` (:func:`~megatrain.planner.activations.issue_fences`:
what the issuing thread waits for on the device, so the caching allocator holds no more than planned)
and its ``Schedule.layout`` (:func:`~megatrain.ir.layout.buffer_layout`: every buffer's size and each
rank's and node's offsets in a tile, which the runtime allocates from and the verifier checks).

Compute order first. A training step visits layers ``0 .. n-2`` forward, then the last layer
(which computes the loss) once in its local backward, then layers ``n-2 .. 0`` backward. The last
layer never runs a separate forward: its local backward computes the loss on the way. With
``layer_by_layer`` every micro-batch passes through a layer during one visit (L2L, Pudipeddi et al.
2020, arXiv:2002.05645). A layer whose checkpoint policy is RECOMPUTE gets a RECOMPUTE visit in the
backward phase, just before the first local backward that reads its outputs; a run of such layers
is recomputed from the nearest stored checkpoint, producers first (Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost", arXiv:1604.06174, segment recomputation).

Copies are added after the compute order is fixed (as ``_add_unshard_reshard`` does in
``torch.distributed.pipelining``):

- Weights. Each visit needs its layer's weights in a buffer slot. A layer already in a slot (the
  last forward layer at the turn to backward, a resident layer, a layer just recomputed) is not
  copied again. Otherwise the copy goes into a slot that no visit inside the prefetch window uses,
  choosing the slot whose content is next needed farthest in the future (Belady's rule, which
  minimises reloads for a known access sequence). The copy waits for every op that used the
  slot's old content (its computes and, after backward, its gradient copy-out) and for the
  prefetch window. With BF16 compute a CAST op on the host stream first writes the layer's master
  weights as BF16 into a staging tile (a ring of ``plan.staging_ring``), which the H2D names and reads. With
  ``plan.cast_once`` tile ``k`` belongs to layer ``k``: a copy re-reads the CAST already in the
  layer's tile unless an OPT of the layer was emitted since (the master changed), so each layer is
  cast once per step.
- Offloaded checkpoints. After a forward of a layer whose policy is OFFLOAD, an OFFLOAD op copies
  its outputs to pinned host memory; the first op of the visit after the last forward that reads
  them waits for that copy, so the GPU copy is gone one visit later at most. A RELOAD op brings
  them back inside the same prefetch window as the weights of the first local backward that
  reads them, and never before the forward phase ends.
- Gradients leave a slot by D2H into a host gradient tile. With the optimizer placed
  DURING_BACKWARD the tiles form a ring and the layer's OPT reads its tile as soon as it lands.
  With NEXT_FORWARD (global-norm clipping needs every gradient first) each trainable layer has a
  tile of its own, and the OPTs run in the next step's schedule, each on the host stream just
  before its layer's first weight copy (and CAST), so the host optimizer overlaps that step's
  forward (``Schedule.carries_updates``, added by ``add_carried_updates`` once the rest is in
  place); an ``"update"`` schedule runs only those OPTs. A layer of ``Plan.nvme_gradients`` has no
  tile of its own: ``add_nvme_io`` sends its gradients to NVMe after the D2H and reads them back
  before the carried OPT.

Per-micro-batch passes (``layer_by_layer=False`` with several micro-batches): the visit list
above is repeated for each micro-batch, one micro-batch per visit, so only that micro-batch's
checkpoints are alive (and offloaded) at a time; weights are copied again in every pass, except
where the slot still holds them (the first forward of a pass reuses the last backward's slot).
After each local backward a D2H copies the slot's gradients into a ring tile and an ACC on the
host stream adds the tile into the layer's FP32 accumulator (micro-batch 0 overwrites it); the
layer's OPT reads the accumulator after the last ACC (DURING_BACKWARD), or in the next step
(NEXT_FORWARD, the accumulators then hold the gradients until it runs). A local backward into a
slot whose gradients were copied out waits for that D2H (the slot is not reloaded in between).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

from megatrain.errors import PlanError
from megatrain.planner.activations import issue_fences
from megatrain.ir.graph import BATCH_PRODUCER, LayerGraph
from megatrain.ir.layout import GATHER_BUFFERS, NVME_BUFFERS, buffer_layout
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.ir.schedule import Mode, Op, OpKind, Schedule, gradient_tiles


@dataclass(slots=True)
class _Visit:
    layer: int
    kind: OpKind  # FWD, BWD or RECOMPUTE
    mb: int | None = None  # None: every micro-batch (layer by layer); else its pass's micro-batch
    slot: int = -1
    ops: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Slot:
    layer: int | None = None
    users: list[int] = field(default_factory=list)  # op indices that used the current content
    h2d: int | None = None


def lower(graph: LayerGraph, plan: Plan, mode: Mode = "train", *, carries_updates: bool = False) -> Schedule:
    """Lower ``graph`` under ``plan`` to a Schedule of ``mode`` ``"train"``, ``"eval"`` or ``"update"``.

    ``carries_updates`` (train mode with ``OptimizerPlacement.NEXT_FORWARD`` only): the schedule
    starts with the previous step's optimizer steps. An ``"update"`` schedule is those steps alone.

    Raises:
        PlanError: the plan does not fit the graph.
        ValueError: an unknown mode, or ``carries_updates`` where there is nothing to carry.
    """
    if mode not in ("train", "eval", "update"):
        raise ValueError(f"mode must be 'train', 'eval' or 'update', not {mode!r}")
    deferred = plan.optimizer is OptimizerPlacement.NEXT_FORWARD
    if (carries_updates or mode == "update") and not deferred:
        raise ValueError("only plans with OptimizerPlacement.NEXT_FORWARD carry optimizer steps into the "
                         "next schedule")
    if carries_updates and mode != "train":
        raise ValueError(f"a {mode!r} schedule carries no optimizer steps; use mode='update' to run them")
    plan.check_against(graph)
    n = len(graph.layers)
    tiles = gradient_tiles(graph) if deferred or plan.accumulates_on_host else {}
    if mode == "update":
        ops = tuple(add_all_gather(add_nvme_io([_opt(plan, layer, r) for layer, r in tiles.items()], plan), plan))
        return Schedule(ops=ops, plan=plan, n_layers=n, mode="update", layout=buffer_layout(graph, plan, "update"))
    req = _Request(graph, plan, mode, carries_updates, tiles)
    x: list = []
    for lowering_pass in PASSES:
        x = lowering_pass(x, req)
    s = Schedule(ops=tuple(x), plan=plan, n_layers=n, mode=mode,  # type: ignore[arg-type]
                 carries_updates=carries_updates, layout=buffer_layout(graph, plan, mode))
    # What issue waits for on the device, read off the finished op list (activations.issue_fences).
    return dataclasses.replace(s, issue_after=issue_fences(s, graph))


@dataclass(frozen=True, slots=True)
class _Request:
    """What every pass reads: the graph, the plan, the mode, whether the schedule starts with the
    previous step's updates, and each trainable layer's own gradient tile or accumulator."""

    graph: LayerGraph
    plan: Plan
    mode: str
    carries: bool
    tiles: dict[int, int]

    @property
    def train(self) -> bool:
        return self.mode == "train"

    def policy(self, layer: int) -> ActivationPolicy:
        return self.plan.activation(layer) if self.train else ActivationPolicy.KEEP


# -- passes ----------------------------------------------------------------------------------------

def order_compute(_: list, req: _Request) -> list[_Visit]:
    """Pass 1, the compute order: the visits (FWD, RECOMPUTE, BWD of a layer for one micro-batch, or
    for all of them layer by layer), one pass over the layers, or one per micro-batch."""
    if not req.plan.accumulates_on_host:
        return _compute_pass(req, None)
    return [v for mb in range(req.plan.micro_batches) for v in _compute_pass(req, mb)]


def _compute_pass(req: _Request, mb: int | None) -> list[_Visit]:
    """One pass over the layers for micro-batch ``mb`` (None: all of them, layer by layer)."""
    g = req.graph
    n = len(g.layers)
    if not req.train:
        return [_Visit(i, OpKind.FWD, mb) for i in range(n)]
    visits = [_Visit(i, OpKind.FWD, mb) for i in range(n - 1)]
    recomputed: set[int] = set()

    def rebuild_inputs(layer: int) -> None:
        for vid in g.layers[layer].inputs:
            p = g.values[vid].producer
            if (p == BATCH_PRODUCER or p in recomputed or p == n - 1
                    or req.policy(p) is not ActivationPolicy.RECOMPUTE):
                continue
            rebuild_inputs(p)
            recomputed.add(p)
            visits.append(_Visit(p, OpKind.RECOMPUTE, mb))

    for layer in range(n - 1, -1, -1):
        if layer < n - 1 and not g.has_gradients(layer):
            continue  # nothing to differentiate (a frozen vision tower): no local backward at all
        rebuild_inputs(layer)
        visits.append(_Visit(layer, OpKind.BWD, mb))
    return visits


def assign_slots(visits: list[_Visit], req: _Request) -> list[_Visit]:
    """Pass 2: give every visit a buffer slot (resident layers their own, others by Belady's rule)."""
    _assign_slots(visits, req.plan, len(req.graph.layers))
    return visits


def add_copies(visits: list[_Visit], req: _Request) -> list[Op]:
    """Pass 3: the ops, visit by visit, with the copies each needs: weight copies (and CASTs) in the
    prefetch window, checkpoint offloads and reloads, and the gradients' way out (D2H, then ACC or
    the DURING_BACKWARD update)."""
    return _Emitter(visits, req).run()


def add_carried_updates(ops: list[Op], req: _Request) -> list[Op]:
    """Pass 4 (schedules that carry updates): the previous step's OPT of each trainable layer on the
    host stream just before its first weight copy (and CAST), so each copy waits for its own
    layer's update, not for all. Every copy and CAST of the layer then reads the updated master,
    and the layer's gradient copy-out (the first ACC with per-micro-batch passes) waits for the
    update to have read the gradients the previous step left."""
    if not req.carries:
        return ops
    first: dict[int, int] = {}  # layer -> its first H2D or CAST
    for i, op in enumerate(ops):
        if op.kind in (OpKind.H2D, OpKind.CAST) and op.layer in req.tiles:
            first.setdefault(op.layer, i)
    at = sorted(first.values())
    # Old op i moves by the number of OPTs inserted before it (an OPT goes just before op first[l]).
    moved = [0] * (len(ops) + 1)
    for k in at:
        moved[k] += 1
    for i in range(1, len(ops) + 1):
        moved[i] += moved[i - 1]
    new_index = [i + moved[i] for i in range(len(ops))]
    opt_at = {layer: new_index[i] - 1 for layer, i in first.items()}
    starts = {i: layer for layer, i in first.items()}
    # What overwrites the gradients the update reads: the D2H into the layer's own ring tile, or
    # with per-micro-batch passes the first ACC into its accumulator (its D2Hs use the shared ring).
    reader_of_old = (lambda op: op.kind is OpKind.ACC and op.mb == 0) if req.plan.accumulates_on_host \
        else (lambda op: op.kind is OpKind.D2H)
    out: list[Op] = []
    for i, op in enumerate(ops):
        if i in starts:
            out.append(_opt(req.plan, starts[i], req.tiles[starts[i]]))
        deps = {new_index[d] for d in op.deps}
        o = opt_at.get(op.layer)
        if o is not None and (op.kind in (OpKind.H2D, OpKind.CAST) or reader_of_old(op)):
            deps.add(o)
        out.append(dataclasses.replace(op, deps=tuple(sorted(deps))))
    return out


def add_nvme_io(ops: list[Op], req: "_Request | Plan") -> list[Op]:
    """Pass 5 (plans with ``nvme_moments`` or ``nvme_gradients``): the NVMe transfers, on the I/O
    stream.

    Moments (``nvme_moments``): an NVME_READ of each such layer's Adam moments into a host I/O
    buffer before its OPT, which steps them in that buffer (``OPT:L3:r0:b1``), and an NVME_WRITE of
    the buffer after it. The ``K = plan.nvme_buffers`` buffers (``layout.nvme_buffers``) are used in
    turn, and the reads run as far ahead as they allow: the first K reads at the start of the
    schedule (their buffers are empty, and with updates during the backward the I/O stream would
    otherwise idle through the forward), and the read of the (m+K)-th NVMe OPT's moments just
    after the write that empties its buffer, i.e. before the (m+1)-th OPT. So the in-order I/O
    stream is never held by a write that waits for its OPT while a read could run (for K >= 2),
    and the read into a buffer comes after the write that emptied it on that stream. A write
    happens after the last modification (it depends on the OPT) and a read before the use (the
    OPT depends on it); no two transfers of one file are in flight at once.

    Gradient tiles (``nvme_gradients``, deferred updates only): such a layer's D2H lands in a
    pinned gradient I/O buffer (``D2H:L3:s1:g0``) instead of a tile of its own, and an
    NVME_WRITE of it (``NVME_WRITE:L3:g0``) follows at once, since the D2H completes the layer's
    step gradients (one D2H per layer layer by layer; data parallel is refused by the Plan). The
    carried OPT of the next step's schedule (and of an ``"update"`` schedule) reads the tile back
    first: an NVME_READ into a gradient buffer, issued one OPT ahead with the moments' reads, and
    the OPT steps from it (``OPT:L3:g1``). The ``layout.nvme_gradient_buffers`` buffers are handed
    out in turn, reads first, then the D2Hs; whatever fills a buffer (a read, a D2H) depends on the
    op that last used it (the OPT that read it, the NVME_WRITE that emptied it), since those run on
    other streams than the I/O stream's order alone would cover.

    Masters (``nvme_masters``, a subset of ``nvme_moments``, BF16 with ``cast_once``): the layer's
    file holds its master before its moments, so the same read and write move both. The OPT steps
    the master in the buffer; a CAST from the buffer (``CAST:L3:t3:b1``) then writes the new BF16
    copy into the layer's own staging tile, after the last H2D that read the old one; the
    NVME_WRITE waits for it too; every later H2D of the layer depends on it. The layer's other H2Ds
    read the tile as the previous step (or compile) left it, with no CAST of their own."""
    plan = req if isinstance(req, Plan) else req.plan
    if not plan.nvme_moments and not plan.nvme_gradients:
        return ops
    moments, gradients = plan.nvme_moments, plan.nvme_gradients
    pool = min(plan.nvme_buffers, len(moments))  # layout.nvme_buffers' count
    gpool = min(NVME_BUFFERS, len(gradients))  # layout.nvme_gradient_buffers' count
    order = [i for i, op in enumerate(ops) if op.kind is OpKind.OPT and (op.layer in moments or op.layer in gradients)]
    morder = [i for i in order if ops[i].layer in moments]
    buf_of = {i: k % pool for k, i in enumerate(morder)}  # OPT -> moments buffer: the k-th read fills k mod K
    gbuf_of: dict[int, int] = {}  # OPT -> gradient buffer
    for i in order:
        if ops[i].layer in gradients:
            gbuf_of[i] = len(gbuf_of) % gpool
    # Moments: the first K reads at the start, then the (m+K)-th just before the (m+1)-th OPT (after the
    # m-th OPT's write, which empties its buffer). Gradient tiles: one OPT ahead, the first OPT getting its
    # own and the next one's.
    mreads: dict[int, list[int]] = defaultdict(list)  # old index -> OPTs whose moments to read just before it
    for k, i in enumerate(morder):
        mreads[0 if k < pool else morder[k - pool + 1]].append(i)
    greads: dict[int, list[int]] = defaultdict(list)
    gorder = [i for i in order if i in gbuf_of]
    for k, i in enumerate(gorder):
        if k == 0:
            greads[i].append(i)
        if k + 1 < len(gorder):
            greads[i].append(gorder[k + 1])
    new_index: list[int] = []
    read_at: dict[int, list[int]] = defaultdict(list)  # OPT -> its reads (new index)
    last_use: dict[int, int] = {}  # gradient buffer -> the op (new index) that last used it
    next_gbuf = len(gbuf_of)
    cast_at: dict[int, int] = {}  # layer of Plan.nvme_masters -> the CAST (new index) after its OPT
    tile_reader: dict[int, int] = {}  # staging tile -> the H2D (new index) that last read it
    out: list[Op] = []
    for i, op in enumerate(ops):
        for o in mreads.get(i, ()):
            read_at[o].append(len(out))
            out.append(Op(OpKind.NVME_READ, ops[o].layer, buf=buf_of[o]))
        for o in greads.get(i, ()):  # gorder holds only OPTs with a gradient buffer
            g = gbuf_of[o]
            read_at[o].append(len(out))
            out.append(Op(OpKind.NVME_READ, ops[o].layer, gbuf=g, deps=(last_use[g],) if g in last_use else ()))
            last_use[g] = len(out) - 1
        deps = {new_index[d] for d in op.deps}
        write = cast = None
        if op.kind is OpKind.H2D and op.layer in cast_at:
            deps.add(cast_at[op.layer])  # it copies the BF16 cast of the master its OPT made
        if op.kind is OpKind.H2D and op.tile is not None:
            tile_reader[op.tile] = len(out)
        if i in read_at:
            deps.update(read_at[i])
            grads = {"ring": None, "gbuf": gbuf_of[i]} if i in gbuf_of else {}  # the tile comes from NVMe
            op = dataclasses.replace(op, buf=buf_of.get(i), **grads)
            if i in gbuf_of:
                last_use[gbuf_of[i]] = len(out)
            if i in buf_of:
                after = len(out)
                if op.layer in plan.nvme_masters:
                    # The new master is in the buffer only: cast it into the layer's own staging tile
                    # (after the last copy that read the tile's old cast), then write it back.
                    t = op.layer
                    cdeps = (after,) + ((tile_reader[t],) if t in tile_reader else ())
                    cast = Op(OpKind.CAST, op.layer, tile=t, buf=buf_of[i], deps=tuple(sorted(cdeps)))
                    after = len(out) + 1
                write = Op(OpKind.NVME_WRITE, op.layer, buf=buf_of[i],
                           deps=(len(out), after) if after != len(out) else (after,))
        elif op.kind is OpKind.D2H and op.layer in gradients:
            g = next_gbuf % gpool
            next_gbuf += 1
            if g in last_use:
                deps.add(last_use[g])  # the buffer's previous content was read or written out
            op = dataclasses.replace(op, ring=None, gbuf=g)
            write = Op(OpKind.NVME_WRITE, op.layer, gbuf=g, deps=(len(out),))
            last_use[g] = len(out) + 1
        new_index.append(len(out))
        out.append(dataclasses.replace(op, deps=tuple(sorted(deps))))
        if cast is not None:
            cast_at[op.layer] = len(out)
            out.append(cast)
        if write is not None:
            out.append(write)
    return out


def add_all_reduce(ops: list[Op], req: "_Request") -> list[Op]:
    """Pass 6 (train schedules of plans with ``data_parallel > 1``): after the op that completes a
    layer's step gradients on the host (its last D2H, or with host accumulation its last ACC), an
    ALL_REDUCE (or, with ``Plan.gradient_reduction == "reduce_scatter"``, a REDUCE_SCATTER) of that
    tile or accumulator on the COMM stream, which sums it over the ranks (each rank's gradients are
    already of its share of the global batch's loss: its summed token losses over the global count);
    the layer's OPT in this schedule depends on it. Each ALL_REDUCE also depends on the one before
    it, so the collectives run in list order on every rank: each rank lowers the same plan, so
    every rank issues the same collectives in the same order (gloo and NCCL match them by order)."""
    if req.plan.data_parallel == 1 or not req.train:
        return ops
    # Plan.gradient_reduction: on one node whose ranks share one host copy each rank's OPT reads
    # only its shard, so a REDUCE_SCATTER (half the bytes) gives it all it needs.
    kind = OpKind.REDUCE_SCATTER if req.plan.gradient_reduction == "reduce_scatter" else OpKind.ALL_REDUCE
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.kind in (OpKind.D2H, OpKind.ACC):
            last[op.layer] = i
    after = {i: layer for layer, i in last.items()}
    moved = [0] * len(ops)
    shift = 0
    for i in range(len(ops)):
        moved[i] = i + shift
        if i in after:
            shift += 1
    reduce_at: dict[int, int] = {}
    prev: int | None = None
    out: list[Op] = []
    for i, op in enumerate(ops):
        deps = {moved[d] for d in op.deps}
        if op.kind is OpKind.OPT and op.layer in reduce_at:
            deps.add(reduce_at[op.layer])
        out.append(dataclasses.replace(op, deps=tuple(sorted(deps))))
        if i in after:
            src = ops[i]
            where = {"acc": src.acc} if src.kind is OpKind.ACC else {"ring": src.ring}
            chain = {moved[i]} | ({prev} if prev is not None else set())
            reduce_at[op.layer] = prev = len(out)
            out.append(Op(kind, op.layer, deps=tuple(sorted(chain)), **where))
    return out


def add_all_gather(ops: list[Op], req: "_Request | Plan") -> list[Op]:
    """Pass 7 (plans with ``optimizer_shards > 1``): each rank's OPT steps only its shard of the
    layer's tile, so after each OPT an ALL_GATHER of the layer on the COMM stream gives every rank
    the others' updated shards (on the node's shared host state: waits until every rank's OPT of
    the layer is done). It goes just before the first later op that reads the layer's master (its
    H2D or CAST), which then depends on it, or at the end of the schedule when none does (the
    next schedule's reads come after this one ends). With ``Plan.shared_cast`` each CAST (of this
    rank's shard into the node's staging tile) gets an ALL_GATHER of its layer just before the
    first H2D that reads the tile, which every H2D of that CAST waits for; an OPT whose next read
    of the layer is such a CAST has no gather of its own (the CAST's gather follows it). Then every
    COMM op depends on the one before it in the list, so the ranks issue all their collectives in
    one order."""
    plan = req if isinstance(req, Plan) else req.plan
    if plan.host_state == "shard":
        return _chain_comm(_add_weight_gathers(ops))
    if plan.optimizer_shards == 1:
        return ops
    # Each gather: (layer, the ops it waits for, the ops that wait for it), at a list position.
    before: dict[int, list[tuple[int, list[int], list[int]]]] = defaultdict(list)
    cast_gather: dict[int, tuple[int, list[int], list[int]]] = {}  # shared CAST -> its gather
    if plan.shared_cast:
        # Plan.shared_cast: each rank casts only its shard into the node's tile, so the tile is
        # whole only once every rank's CAST is done: a gather (a barrier of the node's ranks)
        # between the CAST and the H2Ds that read it. A CAST needs no barrier before it for the
        # other ranks' H2Ds of the tile's old content: with cast_once a tile is cast again only
        # after an OPT of its layer, which waits for the layer's gradient reduction, which no rank
        # enters before its last H2D of the layer in that step; where the master did not change
        # (a CAST in an eval schedule) the bytes it writes are those already there.
        for c in (i for i, op in enumerate(ops) if op.kind is OpKind.CAST):
            readers = [j for j in range(c + 1, len(ops)) if ops[j].kind is OpKind.H2D and c in ops[j].deps]
            cast_gather[c] = entry = (ops[c].layer, [c], readers)
            before[readers[0] if readers else len(ops)].append(entry)
    for o in (i for i, op in enumerate(ops) if op.kind is OpKind.OPT):
        layer = ops[o].layer
        reader = next((j for j in range(o + 1, len(ops)) if ops[j].layer == layer
                       and ops[j].kind in (OpKind.H2D, OpKind.CAST)), len(ops))
        if reader in cast_gather:
            # The CAST reads only this rank's shard, which its own OPT (earlier on the host
            # stream) wrote; the gather after the CAST covers the other ranks' OPTs too.
            cast_gather[reader][1].append(o)
            continue
        before[reader].append((layer, [o], [reader] if reader < len(ops) else []))
    moved: list[int] = []
    out: list[Op] = []
    extra: dict[int, set[int]] = defaultdict(set)  # old index -> the gathers (new index) it waits for
    for i in range(len(ops) + 1):
        for layer, deps, waiters in before.get(i, []):
            for w in waiters:
                extra[w].add(len(out))
            out.append(Op(OpKind.ALL_GATHER, layer, deps=tuple(sorted(moved[d] for d in deps))))
        if i < len(ops):
            moved.append(len(out))
            out.append(ops[i])
    for i, op in enumerate(ops):
        out[moved[i]] = dataclasses.replace(op, deps=tuple(sorted({moved[d] for d in op.deps} | extra[i])))
    return _chain_comm(out)


def _chain_comm(out: list[Op]) -> list[Op]:
    """Make every COMM op depend on the one before it in the list, so the ranks issue all their
    collectives in one order."""
    prev: int | None = None
    for j, op in enumerate(out):
        if op.stream.value == "comm":
            if prev is not None and prev not in op.deps:
                out[j] = dataclasses.replace(op, deps=tuple(sorted((*op.deps, prev))))
            prev = j
    return out


def _add_weight_gathers(ops: list[Op]) -> list[Op]:
    """``add_all_gather`` for ``Plan.host_state == "shard"``: no node holds a whole master, so every
    read of one (an H2D, in the compute dtype: no CAST, ``Plan.staged``) reads a gather tile
    instead, filled just before by an ``ALL_GATHER:L<layer>:t<b>`` of the layer (gather tiles ``b`` taken in turn, of
    ``layout.GATHER_BUFFERS``), which the reader depends on. The gather depends on the layer's latest
    OPT before it (its node's shards must be stepped first: the executor's gather starts with a
    barrier of the node's ranks, each past its own OPT) and on the readers of the tile's previous
    gather (a tile is not overwritten while an H2D or CAST, of any rank of the node, may still read
    it: the same barrier waits for the other ranks' readers). Update schedules have no reads, so no
    gathers: the next schedule's gathers see their steps."""
    n_tiles = GATHER_BUFFERS
    last_opt: dict[int, int] = {}  # layer -> its latest OPT's new index
    readers: list[list[int]] = [[] for _ in range(n_tiles)]  # gather tile -> readers of its content
    moved: list[int] = []
    out: list[Op] = []
    turn = 0
    for op in ops:
        deps = {moved[d] for d in op.deps}
        reads_master = (op.kind is OpKind.H2D and op.tile is None) or op.kind is OpKind.CAST
        if reads_master:
            b = turn % n_tiles
            turn += 1
            gdeps = set(readers[b]) | ({last_opt[op.layer]} if op.layer in last_opt else set())
            deps.add(len(out))
            out.append(Op(OpKind.ALL_GATHER, op.layer, tile=b, deps=tuple(sorted(gdeps))))
            readers[b] = [len(out)]
        if op.kind is OpKind.OPT:
            last_opt[op.layer] = len(out)
        moved.append(len(out))
        out.append(dataclasses.replace(op, deps=tuple(sorted(deps))))
    return out


def add_count_reduce(ops: list[Op], req: "_Request") -> list[Op]:
    """Pass 8 (train schedules of plans with ``data_parallel > 1``): a ``COUNT_REDUCE`` of the
    loss layer first on the COMM stream, which sums the ranks' supervised-token counts into the
    divisor of the global batch's loss; the loss layer's first local backward (the first op to seed
    the loss with ``1 / N``) depends on it, and so does the next collective in the list, so the
    ranks issue it first. It reads only the labels, known before the step, so it goes first: it
    overlaps the forward phase."""
    if req.plan.data_parallel == 1 or not req.train:
        return ops
    loss_layer = len(req.graph.layers) - 1
    first_bwd = next(i for i, op in enumerate(ops) if op.kind is OpKind.BWD and op.layer == loss_layer)
    first_comm = next((i for i, op in enumerate(ops) if op.stream.value == "comm"), None)
    out = [Op(OpKind.COUNT_REDUCE, loss_layer)]
    for i, op in enumerate(ops):
        deps = {d + 1 for d in op.deps} | ({0} if i in (first_bwd, first_comm) else set())
        out.append(dataclasses.replace(op, deps=tuple(sorted(deps))))
    return out


PASSES = [order_compute, assign_slots, add_copies, add_carried_updates, add_nvme_io, add_all_reduce, add_all_gather,
          add_count_reduce]
"""The lowering, in order: compute order first, then the passes that add copies and optimizer
steps (as ``_add_unshard_reshard`` follows the compute order in ``torch.distributed.pipelining``)."""


class _Emitter:
    """Pass 3's state: ops emitted visit by visit, with what each later copy must wait for."""

    def __init__(self, visits: list[_Visit], req: _Request):
        graph, plan = req.graph, req.plan
        self.g, self.plan, self.mode, self.tiles = graph, plan, req.mode, req.tiles
        self.req = req
        self.n = len(graph.layers)
        self.train = req.train
        self.deferred = plan.optimizer is OptimizerPlacement.NEXT_FORWARD
        self.per_mb = plan.accumulates_on_host
        self.visits = visits
        self.pass_length = len(self.visits) // (plan.micro_batches if self.per_mb else 1)
        self.ops: list[Op] = []
        self.latest: dict[tuple[int, int], int] = {}  # (value, mb) -> op that last produced it on the GPU
        self.bwd: dict[tuple[int, int], int] = {}
        self.offloads: dict[tuple[int, int], int] = {}  # (layer, mb) -> OFFLOAD op
        self.loaded_by: dict[int, int] = {}  # visit index -> H2D op index
        self.slots: dict[int, _Slot] = {}
        self.emitted_loads = 0
        self.emitted_reloads: set[int] = set()
        self.staging_next = 0
        self.staging_reader: dict[int, int] = {}  # staging tile -> H2D that last read it
        self.staged: dict[int, int] = {}  # cast_once: layer -> CAST in its tile, while its master is unchanged
        self.ring_next = 0
        self.ring_last_opt: dict[int, int] = {}  # ring tile -> the OPT (or ACC) that last read it
        self.slot_d2h: dict[int, int] = {}  # slot -> the D2H that last copied its gradients out
        self.acc: dict[tuple[int, int], int] = {}  # (layer, mb) -> ACC op

    def copy_of(self, mb: int) -> int:
        """The pinned copy of a layer's checkpoints that micro-batch ``mb`` is offloaded into: one per
        micro-batch layer by layer; per-micro-batch passes reuse copy 0 (each pass's offload waits
        for the previous pass's reload: the verifier's 'data' rule), as layout.pinned_buffers sizes it."""
        return mb if self.plan.layer_by_layer else 0

    def policy(self, layer: int) -> ActivationPolicy:
        return self.req.policy(layer)

    def mbs(self, v: _Visit) -> range:
        """The micro-batches a visit runs."""
        return range(self.plan.micro_batches) if v.mb is None else range(v.mb, v.mb + 1)

    # -- emission --------------------------------------------------------------------------------
    def emit(self, op: Op) -> int:
        self.ops.append(op)
        return len(self.ops) - 1

    def run(self) -> list[Op]:
        plan, g = self.plan, self.g
        gates = self._offload_gates()
        self.emit_loads(plan.prefetch_distance)
        for i, v in enumerate(self.visits):
            self.emit_loads(i)  # a visit's own load, if the window did not already bring it
            self.emit_reloads_for(i)
            st = self.slots[v.slot]
            h = self.loaded_by[i]
            for mb in self.mbs(v):
                deps = {h}
                if not v.ops:
                    deps.update(self.offloads[key] for key in gates.get(i, ()))
                layer = g.layers[v.layer]
                for vid in layer.inputs:
                    if g.values[vid].producer != BATCH_PRODUCER:
                        deps.add(self.latest[(vid, mb)])
                if v.kind is OpKind.BWD:
                    for vid in layer.outputs:
                        if g.values[vid].requires_grad:
                            deps.update(self.bwd[(c, mb)] for c in g.values[vid].consumers)
                    if v.ops:
                        deps.add(self.bwd[(v.layer, mb - 1)])  # gradients accumulate in the slot in order
                    out = self.slot_d2h.get(v.slot)
                    if out is not None and out > h:
                        deps.add(out)  # the slot was not reloaded since its gradients were copied out
                k = self.emit(Op(v.kind, v.layer, mb=mb, slot=v.slot, deps=tuple(sorted(deps))))
                v.ops.append(k)
                st.users.append(k)
                if v.kind is OpKind.BWD:
                    self.bwd[(v.layer, mb)] = k
                else:
                    for vid in layer.outputs:
                        self.latest[(vid, mb)] = k
                if v.kind is OpKind.FWD and self.policy(v.layer) is ActivationPolicy.OFFLOAD:
                    self.offloads[(v.layer, mb)] = self.emit(Op(OpKind.OFFLOAD, v.layer, mb=mb, copy=self.copy_of(mb),
                                                                deps=(k,)))
            if v.kind is OpKind.BWD and g.layers[v.layer].trainable_numel > 0:
                if self.per_mb:
                    self.emit_accumulation(v, st)
                else:
                    self.emit_gradient_out(v, st)
            self.emit_loads(i + plan.prefetch_distance + 1)
        return self.ops

    def emit_gradient_out(self, v: _Visit, st: _Slot) -> None:
        deps = {v.ops[-1]}
        if self.deferred:  # the layer's own tile; its OPT runs in the next schedule (add_carried_updates)
            r = self.tiles[v.layer]
            st.users.append(self.emit(Op(OpKind.D2H, v.layer, slot=v.slot, ring=r, deps=tuple(sorted(deps)))))
            return
        r = self.ring_next % self.plan.grad_ring
        self.ring_next += 1
        if r in self.ring_last_opt:
            deps.add(self.ring_last_opt[r])
        d = self.emit(Op(OpKind.D2H, v.layer, slot=v.slot, ring=r, deps=tuple(sorted(deps))))
        st.users.append(d)
        self.ring_last_opt[r] = self.emit(Op(OpKind.OPT, v.layer, ring=r, deps=(d,)))
        self.staged.pop(v.layer, None)  # the master changes: a later copy casts again

    def emit_accumulation(self, v: _Visit, st: _Slot) -> None:
        """Per-micro-batch passes: D2H into a ring tile, ACC into the layer's accumulator, and after
        the last micro-batch the OPT (DURING_BACKWARD) that reads the accumulator."""
        layer, mb = v.layer, v.mb
        r = self.ring_next % self.plan.grad_ring
        self.ring_next += 1
        deps = {v.ops[-1]}
        if r in self.ring_last_opt:
            deps.add(self.ring_last_opt[r])  # the ACC that read the tile's old content
        d = self.emit(Op(OpKind.D2H, layer, slot=v.slot, ring=r, deps=tuple(sorted(deps))))
        st.users.append(d)
        self.slot_d2h[v.slot] = d
        deps = {d}
        if mb > 0:
            deps.add(self.acc[(layer, mb - 1)])
        a = self.acc[(layer, mb)] = self.emit(Op(OpKind.ACC, layer, mb=mb, ring=r, acc=self.tiles[layer],
                                                 deps=tuple(sorted(deps))))
        self.ring_last_opt[r] = a
        if mb == self.plan.micro_batches - 1 and not self.deferred:
            self.emit(Op(OpKind.OPT, layer, acc=self.tiles[layer], deps=(a,)))
            self.staged.pop(layer, None)  # the master changes: a later copy casts again

    def emit_loads(self, upto: int) -> None:
        visits, plan = self.visits, self.plan
        while self.emitted_loads < len(visits) and self.emitted_loads <= upto:
            j = self.emitted_loads
            v = visits[j]
            st = self.slots.setdefault(v.slot, _Slot())
            if st.layer == v.layer:
                self.loaded_by[j] = st.h2d  # still there: no copy
            else:
                deps = set(st.users)
                window = j - plan.prefetch_distance - 1
                if window >= 0:
                    deps.update(visits[window].ops)
                # A layer whose master is on NVMe (Plan.nvme_masters, cast_once) keeps its BF16 copy
                # in its own staging tile between steps: the CAST after its OPT (add_nvme_io) fills it.
                kept = v.layer in plan.nvme_masters
                cast = self.emit_cast(v.layer) if plan.staged and not kept else None
                if cast is not None:
                    deps.add(cast)
                tile = self.ops[cast].tile if cast is not None else v.layer if kept else None
                h = self.emit(Op(OpKind.H2D, v.layer, slot=v.slot, tile=tile, deps=tuple(sorted(deps))))
                if tile is not None:
                    self.staging_reader[tile] = h
                st.layer, st.users, st.h2d = v.layer, [], h
                self.loaded_by[j] = h
            self.emitted_loads += 1

    def emit_cast(self, layer: int) -> int:
        """The CAST an H2D of ``layer`` reads: a new one, or with ``cast_once`` the one still in
        the layer's own tile."""
        if self.plan.cast_once:
            if layer in self.staged:
                return self.staged[layer]
            t = layer
        else:
            t = self.staging_next % self.plan.staging_ring
            self.staging_next += 1
        deps = set()
        if t in self.staging_reader:
            deps.add(self.staging_reader[t])  # the H2D that read the tile's old content
        c = self.emit(Op(OpKind.CAST, layer, tile=t, deps=tuple(sorted(deps))))
        if self.plan.cast_once:
            self.staged[layer] = c
        return c

    # -- offloaded checkpoints ---------------------------------------------------------------------
    def _offloaded(self) -> list[int]:
        return [p for p in range(self.n - 1) if self.policy(p) is ActivationPolicy.OFFLOAD]

    def _offload_gates(self) -> dict[int, list[tuple[int, int]]]:
        """visit index -> (offloaded layer, micro-batch) pairs whose OFFLOADs its first op waits for."""
        fwd_visit = {(v.layer, v.mb): i for i, v in enumerate(self.visits) if v.kind is OpKind.FWD}
        passes = [None] if not self.per_mb else range(self.plan.micro_batches)
        gates: dict[int, list[tuple[int, int]]] = {}
        for p in self._offloaded():
            for pas in passes:
                readers = [fwd_visit[(c, pas)] for vid in self.g.layers[p].outputs
                           for c in self.g.values[vid].consumers if (c, pas) in fwd_visit]
                gate = gates.setdefault(max(readers + [fwd_visit[(p, pas)]]) + 1, [])
                gate.extend((p, mb) for mb in (range(self.plan.micro_batches) if pas is None else (pas,)))
        return gates

    def emit_reloads_for(self, upto: int) -> None:
        """RELOADs for the backward visits whose prefetch window has opened by visit ``upto``."""
        if not self.train:
            return
        d = self.plan.prefetch_distance
        for j in range(upto, min(upto + d + 1, len(self.visits))):
            if j in self.emitted_reloads:
                continue
            # No reload starts before the last forward visit of its pass (the forward phase) ends.
            turn = self.n - 2 + (self.visits[j].mb or 0) * self.pass_length
            after = max(j - d - 1, turn)
            if after >= upto or after < 0:
                continue  # its window has not opened yet (or there is no forward phase)
            self.emitted_reloads.add(j)
            v = self.visits[j]
            for vid in self.g.layers[v.layer].inputs:
                p = self.g.values[vid].producer
                if p == BATCH_PRODUCER or self.policy(p) is not ActivationPolicy.OFFLOAD:
                    continue
                for mb in self.mbs(v):
                    key = (vid, mb)
                    if self.ops[self.latest[key]].kind is OpKind.RELOAD:
                        continue  # already back for an earlier reader
                    deps = {self.offloads[(p, mb)], *self.visits[after].ops}
                    r = self.emit(Op(OpKind.RELOAD, p, mb=mb, copy=self.copy_of(mb), deps=tuple(sorted(deps))))
                    for out in self.g.checkpoints(p):
                        self.latest[(out, mb)] = r


def _opt(plan: Plan, layer: int, k: int) -> Op:
    """A deferred (NEXT_FORWARD) update of ``layer`` from its own gradient tile or accumulator ``k``."""
    if plan.accumulates_on_host:
        return Op(OpKind.OPT, layer, acc=k)
    return Op(OpKind.OPT, layer, ring=k)


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


# gradient_tiles is imported here by callers of the IR that predate its move to schedule.py.
__all__ = ["PASSES", "add_carried_updates", "add_copies", "assign_slots", "lower", "order_compute"]
