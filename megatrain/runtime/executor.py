"""The executor: walks a Schedule's ops in order and runs each on its backend.

Layers run through stateless templates: one ``fx.GraphModule`` per kind of layer, called with the
layer's weights bound as views of the buffer slot they were copied into (no copy at bind). A local
backward recomputes the layer's forward from its saved input checkpoint with gradients on, then
calls ``torch.autograd.grad`` for the layer's trainable weights (each a leaf of its own: a detached
view of the slot) and its differentiable inputs, and writes each weight's gradient into its slice
of the gradient slot; no autograd graph outlives the op. (A single flat leaf over the slot would
cost, per parameter, a zero-filled tile and a tile-sized sum in ``slice_backward``.)

The executor decides nothing: which slot, which ring or staging tile, which order, what is
offloaded or recomputed -- all come from the Schedule. What it derives mechanically is when a
checkpoint on the GPU is no longer read (after the last op in the list that reads it before the
op that next puts it there), so it can be dropped, and which staging tile an H2D reads (the one
its CAST dependency filled).

Gradient norms. Each D2H first takes the L2 norm of the slot's gradients on the device and copies
it to the host with them, and flags the layer when that norm or a micro-batch loss of the step is
not finite. With per-micro-batch passes the step's gradients exist only once the last ACC has
summed them on the host, so that ACC replaces the norm with the accumulator's and keeps the flag
of the last D2H (which has seen every loss) only if that norm is finite. A host optimizer step is
skipped once any layer of the step was flagged (host ops run in order, so the flag is seen by
every later one). With the optimizer placed NEXT_FORWARD the
updates wait for the next schedule; the caller then knows the global norm, and passes the
clipping scale (or drops the updates) with :meth:`Executor.set_update`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.optim.adamw import adamw

from megatrain.config import AdamW
from megatrain.planner import cost
from megatrain.planner.graph import LayerGraph
from megatrain.planner.hardware import strict_fp32
from megatrain.planner.schedule import COMPUTE_KINDS, Op, OpKind, Schedule
from megatrain.planner.trace import TracedModel, retarget
from megatrain.runtime.backend import Backend
from megatrain.runtime.host import HostState, PinnedArena

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class _Buffers:
    """Transient memory a plan sizes: weight and gradient slots on the device; host gradient and
    staging tiles, views of the pinned arena (each at its own size, ``cost.pinned_buffers``); and
    the pageable accumulators."""

    weights: list[torch.Tensor]
    grads: list[torch.Tensor]
    ring: list[torch.Tensor]
    staging: list[torch.Tensor]
    accumulators: list[torch.Tensor]  # per trainable layer (lower.gradient_tiles), per-micro-batch passes


@dataclass
class StepOutput:
    """What one schedule run produced.

    ``losses[mb]``: micro-batch ``mb``'s loss (a float). ``layer_norms``: the L2 norm of each
    trainable layer's step gradients (FP32, before clipping) by layer index. ``finite``: every loss
    and every gradient norm of the run was finite. ``updates_skipped``: layers whose optimizer
    step was skipped because of a non-finite value.
    """

    losses: list[float] = field(default_factory=list)
    layer_norms: dict[int, float] = field(default_factory=dict)
    finite: bool = True
    updates_skipped: list[int] = field(default_factory=list)

    @property
    def grad_norm(self) -> float:
        """Global L2 norm over all gradients of the run (``torch.nn.utils.clip_grad_norm_``'s)."""
        if not self.layer_norms:
            return 0.0
        return float(torch.linalg.vector_norm(torch.tensor(list(self.layer_norms.values()), dtype=torch.float32)))


class Executor:
    """Runs schedules of one traced model on one backend, against one host state."""

    def __init__(self, traced: TracedModel, host: HostState, backend: Backend, optimizer: AdamW,
                 buffers: dict[str, torch.Tensor]):
        self.graph: LayerGraph = traced.graph
        self.host = host
        self.backend = backend
        self.optimizer = optimizer
        dev = backend.device
        self.templates = [retarget(gm, dev) for gm in traced.templates]
        self.layer_buffers = [[buffers[name].to(dev) for name in layer.buffers] for layer in self.graph.layers]
        self._buffers: _Buffers | None = None
        self._buffer_key: tuple | None = None
        self._arena: PinnedArena | None = None
        self._host_acts: dict[tuple[int, int], torch.Tensor] = {}  # offloaded checkpoints: views of the arena
        n = len(self.graph.layers)
        self._norms_dev = backend.device_empty((n,), torch.float32)
        self._flags_dev = backend.device_empty((n,), torch.bool)
        # Host copies of the norms and flags (True: the layer's values were finite), in the arena.
        self._norms: torch.Tensor | None = None
        self._flags: torch.Tensor | None = None
        self._skip = False  # a non-finite value was seen: later optimizer steps of the run are skipped
        self._skipped: list[int] = []
        # Layers whose optimizer step ran in the current (or last) run, in order: after a run that
        # raised, the caller reads which updates were applied (Trainer keeps its state consistent).
        self.updated: list[int] = []
        self._grad_scale: torch.Tensor | None = None  # for carried (NEXT_FORWARD) updates
        self._carried_optimizer: AdamW | None = None
        # Per schedule (by identity, holding it alive): which generation of each checkpoint each op
        # reads and how many ops read each generation.
        self._generations: dict[int, tuple[Schedule, _Generations]] = {}
        # Per schedule (likewise): its pinned layout and slot sizes, so a step does not re-derive them.
        self._sizing: dict[int, tuple[Schedule, cost.PinnedLayout, tuple]] = {}

    # -- memory ----------------------------------------------------------------------------------
    def _ensure_buffers(self, schedule: Schedule) -> _Buffers:
        """The buffers ``schedule`` uses, made when the last ones do not serve it.

        Pinned host memory is exactly ``cost.memory_breakdown(graph, plan).host_pinned``: the
        master rows with FP32 compute (:meth:`HostState.pin_masters`) and one arena laid out by
        ``cost.pinned_buffers`` for the schedule's mode; an arena that already holds every tile
        the schedule needs (a train arena serves eval and update schedules) is kept.

        Raises:
            RuntimeError: a schedule that reads gradients an earlier one left in the host tiles
                (carried updates) needs a new arena, which would not hold them.
        """
        plan = schedule.plan
        if id(schedule) not in self._sizing:
            self._sizing[id(schedule)] = (schedule, cost.pinned_buffers(self.graph, plan, schedule.mode),
                                          cost.slot_numels(self.graph, plan.slots, plan.resident))
        _, layout, sizes = self._sizing[id(schedule)]  # each slot at its own size
        arena_ok = self._arena is not None and self._arena.layout.covers(layout)
        key = (sizes, plan.compute_dtype)
        if self._buffers is None or self._buffer_key != key or not arena_ok:
            be = self.backend
            dtype = _DTYPES[plan.compute_dtype]
            accumulators = self._buffers.accumulators if self._buffers is not None else []
            if not arena_ok:
                if self._arena is not None and (schedule.mode == "update" or schedule.carries_updates) \
                        and not plan.accumulates_on_host:
                    raise RuntimeError(f"a {schedule.mode} schedule that carries optimizer steps reads the gradients "
                                       "the previous schedule left in the host tiles, but its plan needs another "
                                       "pinned layout; run carried updates with the plan that made them")
                self._buffers = self._arena = self._norms = self._flags = None  # let the old go first
                self._host_acts = {}
                self._arena = PinnedArena(layout, be)
            arena = self._arena
            if plan.compute_dtype == "float32":
                self.host.pin_masters(be)  # H2D reads the master rows directly
            else:
                self.host.unpin_masters()
            self._buffers = None  # let the old device buffers go before the new ones are made
            lay = arena.layout
            self._buffers = _Buffers(
                weights=[be.device_empty((width,), dtype) for width, _ in sizes],
                grads=[be.device_empty((gwidth,), torch.float32) for _, gwidth in sizes],
                ring=[arena.view("ring", t.key, torch.float32) for t in lay.tiles if t.kind == "ring"],
                staging=[arena.view("staging", t.key, dtype) for t in lay.tiles if t.kind == "staging"],
                accumulators=accumulators)
            if arena.has("norms", 0):
                self._norms = arena.view("norms", 0, torch.float32)
                self._flags = arena.view("flags", 0, torch.bool)
            self._buffer_key = key
        if plan.accumulates_on_host and schedule.mode != "eval" and not self._buffers.accumulators:
            # Pageable: only host ops (ACC, OPT) touch them. Kept across schedules, since with
            # NEXT_FORWARD they hold the gradients the next schedule's updates read.
            self._buffers.accumulators = [torch.empty((layer.trainable_numel,), dtype=torch.float32)
                                          for layer in self.graph.layers if layer.trainable_numel > 0]
        return self._buffers

    def set_update(self, clip_scale: float | None, optimizer: AdamW | None = None) -> None:
        """How to run the optimizer steps a NEXT_FORWARD schedule carries: the gradients are
        multiplied by ``clip_scale`` (``torch.nn.utils.clip_grad_norm_``'s clamped coefficient), or
        used as they are when None, with the AdamW settings of the step that made them
        (``optimizer``; None for the current ones)."""
        self._grad_scale = None if clip_scale is None else torch.tensor(1.0 / clip_scale, dtype=torch.float32)
        self._carried_optimizer = optimizer

    # -- running ---------------------------------------------------------------------------------
    def run(self, schedule: Schedule, micro_batches: Sequence[dict[str, torch.Tensor]]) -> StepOutput:
        """Run ``schedule`` on ``micro_batches`` (one dict of input tensors per micro-batch)."""
        g = self.graph
        M = schedule.plan.micro_batches
        if schedule.mode != "update" and len(micro_batches) != M:
            raise ValueError(f"schedule expects {M} micro-batches, got {len(micro_batches)}")
        bufs = self._ensure_buffers(schedule)
        dev = self.backend.device
        if id(schedule) not in self._generations:
            self._generations[id(schedule)] = (schedule, _generations(schedule, g))
        acts = _Activations(self._generations[id(schedule)][1])
        grads: dict[tuple[int, int], torch.Tensor] = {}
        for mb, batch in enumerate(micro_batches):
            for name in g.batch_inputs:
                acts.put((g.value_by_name(name).id, mb), _BATCH, batch[name].to(dev, non_blocking=True))
        out = StepOutput(losses=[0.0] * M)
        loss_tensors: dict[int, torch.Tensor] = {}
        events: list[Any] = [None] * len(schedule.ops)
        self._skip = False
        self._skipped = []
        self.updated = []
        trained: list[int] = []
        try:
            for i, op in enumerate(schedule.ops):
                waits = [events[d] for d in op.deps
                         if schedule.ops[d].stream is not op.stream and events[d] is not None]
                view = acts.view(i)
                k = op.kind
                if k is OpKind.H2D:
                    fn = self._h2d(op, bufs)
                elif k is OpKind.FWD or k is OpKind.RECOMPUTE:
                    fn = self._fwd(op.layer, op.mb, bufs.weights[op.slot], view, loss_tensors,
                                   schedule.plan.compute_dtype)
                elif k is OpKind.BWD:
                    # Layer by layer a visit's micro-batches accumulate in the slot; per-micro-batch
                    # passes accumulate on the host (ACC), so every local backward starts the slot afresh.
                    fresh = op.mb == 0 or not schedule.plan.layer_by_layer
                    fn = self._bwd(op.layer, op.mb, bufs, op.slot, view, grads, loss_tensors, M,
                                   schedule.plan.compute_dtype, fresh)
                    fn = _then(fn, _drop_grads(grads, [(vid, op.mb) for vid in g.layers[op.layer].outputs]))
                elif k is OpKind.D2H:
                    trained.append(op.layer)
                    fn = self._d2h(op, bufs, loss_tensors)
                elif k is OpKind.OPT:
                    carried = schedule.mode == "update" or schedule.carries_updates
                    fn = self._opt(op.layer, bufs.accumulators[op.acc] if op.acc is not None else bufs.ring[op.ring],
                                   carried)
                elif k is OpKind.ACC:
                    fn = self._acc(op, bufs, last=op.mb == M - 1)
                elif k is OpKind.OFFLOAD:
                    fn = self._offload(op, view)
                elif k is OpKind.RELOAD:
                    fn = self._reload(op, view)
                elif k is OpKind.CAST:
                    fn = self._cast(op, bufs)
                else:  # pragma: no cover - OpKind is closed
                    raise AssertionError(k)
                if acts.touches(i):
                    fn = _then(fn, view.release)
                events[i] = self.backend.launch(op.stream, fn, waits, label=repr(op))
        except BaseException:
            # The backend drains and closes the run, so the next run opens a fresh entry fence
            # instead of racing this run's leftovers (its pending ops are dropped).
            self.backend.abort()
            raise
        self.backend.synchronize()
        for mb, t in loss_tensors.items():
            out.losses[mb] = float(t)
        out.layer_norms = {li: float(self._norms[li]) for li in trained}
        out.finite = (all(bool(self._flags[li]) for li in trained)
                      and all(math.isfinite(x) for x in out.losses))
        out.updates_skipped = list(self._skipped)
        return out

    def _h2d(self, op: Op, bufs: _Buffers):
        numel = self.graph.layers[op.layer].numel
        src = bufs.staging[op.tile][:numel] if op.tile is not None else self.host.master(op.layer)
        return _copy(bufs.weights[op.slot][:numel], src)

    def _cast(self, op: Op, bufs: _Buffers):
        master = self.host.master(op.layer)
        return _copy(bufs.staging[op.tile][:master.numel()], master)

    def _bind(self, layer: int, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[p.offset:p.offset + p.numel].view(p.shape) for p in self.graph.layers[layer].params]

    def _precision(self, compute_dtype: str):
        """FP32 compute is strict IEEE FP32 (TF32 off for the op, the caller's setting restored after:
        :func:`~megatrain.planner.hardware.strict_fp32`), the precision ``HardwareSpec.measure()``
        times FP32 in and eager FP32 training on the CPU computes in. BF16 compute runs the
        FP32-traced templates under ``torch.autocast``: matmuls in BF16 with FP32 accumulation,
        reductions and norms in FP32, as eager autocast training does; the weights arrive in BF16
        already, so autocast's weight casts are no-ops."""
        if compute_dtype == "float32":
            return strict_fp32()
        return torch.autocast(self.backend.device.type, dtype=_DTYPES[compute_dtype])

    def _fwd(self, li: int, mb: int, slot: torch.Tensor, acts, loss_tensors, compute_dtype: str):
        """A forward (or a recompute: the same computation in the backward phase)."""
        layer = self.graph.layers[li]
        tmpl = self.templates[layer.template]
        bufs = self.layer_buffers[li]
        loss_id = self.graph.loss

        def run() -> None:
            ins = [acts[(v, mb)] for v in layer.inputs]
            _read_here(ins)
            with torch.no_grad(), self._precision(compute_dtype):
                outs = tmpl(*self._bind(li, slot[:layer.numel]), *bufs, *ins)
            for vid, t in zip(layer.outputs, outs):
                if vid == loss_id:
                    loss_tensors[mb] = t.detach()
                else:
                    acts[(vid, mb)] = t
        return run

    def _bwd(self, li: int, mb: int, bufs: _Buffers, s: int, acts, grads, loss_tensors, M: int,
             compute_dtype: str, fresh: bool):
        g = self.graph
        layer = g.layers[li]
        tmpl = self.templates[layer.template]
        lbufs = self.layer_buffers[li]
        gslot = bufs.grads[s]
        # Where each trainable parameter's gradient goes, and the alignment padding between them,
        # which a fresh backward zeroes so the D2H norm and the optimizer see zeros there.
        trained = [p for p in layer.params if p.trainable]
        gviews = [gslot[p.offset:p.offset + p.numel].view(p.shape) for p in trained]
        gaps = [gslot[a:b] for a, b in _padding(trained, layer.trainable_numel)]

        def run() -> None:
            with torch.enable_grad(), self._precision(compute_dtype):
                # Each trainable parameter is a leaf of its own (a detached view of the slot), so its
                # gradient lands in a tensor of its size; a flat leaf would gather them through
                # slice_backward, one zero-filled and one summed full tile per parameter.
                weights = self._bind(li, bufs.weights[s])
                leaves = []
                for k, p in enumerate(layer.params):
                    if p.trainable:
                        weights[k] = weights[k].detach().requires_grad_(True)
                        leaves.append(weights[k])
                ins = []
                diff = []
                for vid in layer.inputs:
                    x = acts[(vid, mb)]
                    _read_here((x,))
                    if g.values[vid].requires_grad:
                        x = x.detach().requires_grad_(True)
                        diff.append((vid, x))
                    ins.append(x)
                outs = tmpl(*weights, *lbufs, *ins)
                roots, seeds = [], []
                for vid, t in zip(layer.outputs, outs):
                    if vid == g.loss:
                        loss_tensors[mb] = t.detach()
                        roots.append(t)
                        # Step loss is the mean over micro-batches, as in eager accumulation of loss / M.
                        seeds.append(torch.full_like(t, 1.0 / M))
                    elif (vid, mb) in grads and t.requires_grad:
                        roots.append(t)
                        seeds.append(grads[(vid, mb)])
                wrt = leaves + [x for _, x in diff]
                # No gradient reaches the layer: its weights' gradients are zero (written when fresh).
                res = torch.autograd.grad(roots, wrt, seeds, allow_unused=True) if roots and wrt else [None] * len(wrt)
            pgrads, res = res[:len(leaves)], res[len(leaves):]
            # Gradients of BF16 weights are BF16; the FP32 slot takes them exactly (copy_/add_ cast).
            got = [(v, gp) for v, gp in zip(gviews, pgrads) if gp is not None]
            if fresh:
                missing = [v for v, gp in zip(gviews, pgrads) if gp is None]  # the loss does not use it
                if missing or gaps:
                    torch._foreach_zero_(missing + gaps)
                if got:
                    torch._foreach_copy_([v for v, _ in got], [gp for _, gp in got])
            elif got:
                torch._foreach_add_([v for v, _ in got], [gp for _, gp in got])
            for (vid, _), gx in zip(diff, res):
                if gx is None:
                    continue
                key = (vid, mb)
                grads[key] = grads[key] + gx if key in grads else gx
        return run

    def _d2h(self, op: Op, bufs: _Buffers, loss_tensors: dict[int, torch.Tensor]):
        li = op.layer
        n = self.graph.layers[li].trainable_numel
        gslot, tile = bufs.grads[op.slot][:n], bufs.ring[op.ring][:n]

        def run() -> None:
            norm = torch.linalg.vector_norm(gslot)
            ok = torch.isfinite(norm)
            if loss_tensors:  # every micro-batch's loss is known before any gradient leaves the GPU
                ok = ok & torch.isfinite(torch.stack(list(loss_tensors.values()))).all()
            self._norms_dev[li] = norm
            self._flags_dev[li] = ok
            self._norms[li:li + 1].copy_(self._norms_dev[li:li + 1], non_blocking=True)
            self._flags[li:li + 1].copy_(self._flags_dev[li:li + 1], non_blocking=True)
            tile.copy_(gslot, non_blocking=True)
        return run

    def _acc(self, op: Op, bufs: _Buffers, last: bool):
        li = op.layer
        tile = bufs.ring[op.ring][:self.graph.layers[li].trainable_numel]
        acc = bufs.accumulators[op.acc]

        def run() -> None:
            if op.mb == 0:
                acc.copy_(tile)
            else:
                acc.add_(tile)
            if last:
                norm = torch.linalg.vector_norm(acc)
                self._norms[li] = norm
                self._flags[li] = bool(self._flags[li]) and bool(torch.isfinite(norm))
        return run

    def _opt(self, li: int, ring_tile: torch.Tensor, carried: bool):
        layer = self.graph.layers[li]
        n = layer.trainable_numel
        h = self.host
        cfg = (self._carried_optimizer or self.optimizer) if carried else self.optimizer
        scale = self._grad_scale if carried else None

        def run() -> None:
            # Carried updates were checked by the caller, who drops them when a value was not finite.
            if not carried and (self._skip or not bool(self._flags[li])):
                self._skip = True
                self._skipped.append(li)
                return
            adamw(
                [h.master(li)[:n]], [ring_tile[:n]], [h.exp_avg(li)[:n]], [h.exp_avg_sq(li)[:n]], [],
                [h.steps[li]], fused=True, grad_scale=scale, amsgrad=False, beta1=cfg.betas[0],
                beta2=cfg.betas[1], lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.eps, maximize=False)
            self.updated.append(li)
        return run

    def _host_keys(self, op: Op) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(checkpoint, pinned region) keys of an OFFLOAD or RELOAD: the op names its pinned copy."""
        return [((vid, op.mb), (vid, op.copy)) for vid in self.graph.checkpoints(op.layer)]

    def _offload(self, op: Op, acts):
        keys = self._host_keys(op)
        arena = self._arena

        def run() -> None:
            for key, hkey in keys:
                src = acts[key]
                _read_here((src,))
                region = arena.view("offload", hkey)
                nbytes = src.numel() * src.element_size()
                if nbytes > region.numel():
                    raise RuntimeError(
                        f"checkpoint {self.graph.values[key[0]].name!r} of micro-batch {key[1]} has {nbytes} bytes "
                        f"but the trace gave it {region.numel()} (its pinned region, cost.pinned_buffers): the "
                        "batch shape or dtype differs from the traced one; compile with the shapes you train on")
                dst = self._host_acts[hkey] = region[:nbytes].view(src.dtype).view(src.shape)
                dst.copy_(src, non_blocking=True)
        return run

    def _reload(self, op: Op, acts):
        keys = self._host_keys(op)
        dev = self.backend.device

        def run() -> None:
            for key, hkey in keys:
                acts[key] = self._host_acts[hkey].to(dev, non_blocking=True, copy=True)
        return run


def _read_here(tensors) -> None:
    """Tell the CUDA caching allocator that ``tensors`` are used on the current stream, so that
    memory made on one stream and freed after a read on another (a checkpoint offloaded by the D2H
    stream, one reloaded by the H2D stream and read by compute) is not reused before that read
    ends (``Tensor.record_stream``). Nothing to do for CPU tensors."""
    for t in tensors:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


def _padding(params, end: int) -> list[tuple[int, int]]:
    """The [start, stop) element ranges of a tile's prefix ``[0, end)`` that no parameter in
    ``params`` (ascending offsets) covers: the alignment padding between and after them."""
    gaps, pos = [], 0
    for p in params:
        if p.offset > pos:
            gaps.append((pos, p.offset))
        pos = p.offset + p.numel
    if end > pos:
        gaps.append((pos, end))
    return gaps


def _copy(dst: torch.Tensor, src: torch.Tensor):
    def run() -> None:
        dst.copy_(src, non_blocking=True)
    return run


_BATCH = -1
"""Generation of a batch input: it is on the device before the run's first op."""


@dataclass(frozen=True, slots=True)
class _Generations:
    """Which generation of each (value, micro-batch) checkpoint each op reads, and how many ops read
    each generation. A generation is named by the op that put it on the device (a FWD or RECOMPUTE
    that computed it, a RELOAD that copied it back), or ``_BATCH``."""

    reads: tuple[dict[tuple[int, int], int], ...]
    readers: dict[tuple[tuple[int, int], int], int]


def _generations(schedule: Schedule, g: LayerGraph) -> _Generations:
    current: dict[tuple[int, int], int] = {}
    for mb in range(schedule.plan.micro_batches):
        for name in g.batch_inputs:
            current[(g.value_by_name(name).id, mb)] = _BATCH
    readers: dict[tuple[tuple[int, int], int], int] = {(key, gen): 0 for key, gen in current.items()}
    reads: list[dict[tuple[int, int], int]] = []
    for i, op in enumerate(schedule.ops):
        layer = g.layers[op.layer]
        read_vids: tuple[int, ...] = ()
        if op.kind in COMPUTE_KINDS:
            read_vids = layer.inputs
        elif op.kind is OpKind.OFFLOAD:
            read_vids = g.checkpoints(op.layer)
        r = {}
        for vid in read_vids:
            key = (vid, op.mb)
            r[key] = current[key]
            readers[(key, current[key])] += 1
        reads.append(r)
        w: tuple[int, ...] = ()
        if op.kind in (OpKind.FWD, OpKind.RECOMPUTE):
            w = tuple(v for v in layer.outputs if v != g.loss)
        elif op.kind is OpKind.RELOAD:
            w = g.checkpoints(op.layer)
        for vid in w:
            current[(vid, op.mb)] = i
            readers[((vid, op.mb), i)] = 0
    return _Generations(tuple(reads), readers)


class _Activations:
    """The checkpoints on the device during one run, by generation.

    An op's ``fn`` may run later than its launch (a GPU op waiting for a host op in the backend's
    pending queue) and on another thread (a fake CUDA stream's worker), so each op reads the
    generation the schedule's list order gives it, never whatever the dictionary holds when it
    runs, and a generation is dropped when the last of its readers has run, not when the last
    reader was launched. A read of a generation that is not there (its producer has not run: a
    dependency is missing) raises at once.
    """

    def __init__(self, gens: _Generations):
        self._gens = gens
        self._left = dict(gens.readers)
        self._live: dict[tuple[tuple[int, int], int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def put(self, key: tuple[int, int], gen: int, t: torch.Tensor) -> None:
        with self._lock:
            if self._left.get((key, gen), 0) > 0:
                self._live[(key, gen)] = t

    def get(self, key: tuple[int, int], i: int) -> torch.Tensor:
        gen = self._gens.reads[i][key]
        try:
            return self._live[(key, gen)]
        except KeyError:
            raise RuntimeError(f"op #{i} reads value {key[0]} of micro-batch {key[1]} as op #{gen} put it on the "
                               "device, but that op has not run yet: the schedule lacks a dependency (or a "
                               "backend ran an op before its dependencies)") from None

    def touches(self, i: int) -> bool:
        return bool(self._gens.reads[i])

    def view(self, i: int) -> "_ActivationsView":
        return _ActivationsView(self, i)

    def release(self, i: int) -> None:
        with self._lock:
            for key, gen in self._gens.reads[i].items():
                k = (key, gen)
                self._left[k] -= 1
                if self._left[k] == 0:
                    self._live.pop(k, None)


class _ActivationsView:
    """``acts[(value, mb)]`` as op ``i`` sees it: reads its generation, writes generation ``i``."""

    __slots__ = ("_acts", "_i")

    def __init__(self, acts: _Activations, i: int):
        self._acts, self._i = acts, i

    def __getitem__(self, key: tuple[int, int]) -> torch.Tensor:
        return self._acts.get(key, self._i)

    def __setitem__(self, key: tuple[int, int], t: torch.Tensor) -> None:
        self._acts.put(key, self._i, t)

    def release(self) -> None:
        self._acts.release(self._i)


def _then(fn, after):
    """``fn`` then ``after``, as one op's work (run wherever and whenever the backend runs it)."""
    def run() -> None:
        fn()
        after()
    return run


def _drop_grads(grads: dict, keys: list[tuple[int, int]]):
    """After a local backward: the gradients of its outputs were read for the last time."""
    def run() -> None:
        for key in keys:
            grads.pop(key, None)
    return run
