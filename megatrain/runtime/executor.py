"""The executor: walks a Schedule's ops in order and runs each on its backend.

The walk is a dispatch table over a run context (tinygrad's ``pm_exec`` over ``ExecContext`` in
``engine/realize.py``): for op ``i``, ``HANDLERS[op.kind](ctx, i, op)`` returns the work to launch,
and the backend runs it on the op's stream after its dependencies. :class:`_RunContext` holds what
one run reads and writes besides the op itself: the buffers, the checkpoints on the device by
generation, the boundary gradients, the losses, the handles of launched ops and which optimizer
steps ran or were skipped.

Layers run through stateless templates: one ``fx.GraphModule`` per kind of layer, called with the
layer's weights bound as views of the buffer slot they were copied into (no copy at bind). A local
backward recomputes the layer's forward from its saved input checkpoint with gradients on, then
calls ``torch.autograd.grad`` for the layer's trainable weights (each a leaf of its own: a detached
view of the slot) and its differentiable inputs, and writes each weight's gradient into its slice
of the gradient slot; no autograd graph outlives the op. (A single flat leaf over the slot would
cost, per parameter, a zero-filled tile and a tile-sized sum in ``slice_backward``.)

How a compute op calls its template (the plan says; :meth:`Executor.template_of`): as traced, or
with ``Plan.templates == "compiled"`` compiled once per template by ``torch.compile``
(:mod:`megatrain.runtime.templates`; :meth:`Executor.compile_templates` compiles what a schedule
needs before its first run, said and timed), and with ``Plan.cuda_graphs`` as the replay of a CUDA
graph of that call per template, slot and variant (:mod:`megatrain.runtime.graphs`). A local
backward's device work is :func:`backward_body` in all three: it reads no host value but the loss's
seed, which a graph takes from a static buffer.

Random ops. A layer whose template draws random numbers (``Layer.draws_random``: dropout) has its
forward of each micro-batch record the state of its device's default generator just before the
template runs (:class:`DeviceRng`: ``torch.get_rng_state()`` on the CPU,
``torch.cuda.get_rng_state(device)`` on CUDA, read when the op is issued: CUDA's Philox seed and
offset live on the host and advance as kernels are enqueued, which is what
``torch.utils.checkpoint``'s ``preserve_rng_state`` relies on too). Every recompute of that forward
(a RECOMPUTE op, the recompute inside the local backward) runs with that state restored and then
puts the caller's state back (:func:`replaying_rng`), so it draws the forward's masks and the
global stream advances by the forward draws only, as in eager training. A local backward with no
forward before it (the last layer's, whose forward it is) draws from the stream as the forward
would. Layers without random ops pay nothing.

The executor decides nothing: which slot, ring tile, staging tile, accumulator or pinned copy an op
uses, and in which order, are fields of the op (:class:`~megatrain.ir.schedule.Op`); when a
checkpoint on the GPU is read for the last time comes from
:func:`megatrain.ir.liveness.liveness`, the same function the cost model frees memory by.

Gradient dtype. The gradient slots, the D2H and the host gradient tiles hold
``plan.gradient_dtype``: FP32, or BF16 where the plan says so (BF16 compute, one micro-batch's
gradients per slot: the gradient autograd returns for a BF16 weight is a BF16 value, so BF16 holds
it exactly in half the bytes). The host widens BF16 gradients to FP32 where it reads them: ACC adds
them into the FP32 accumulator, and OPT copies them into an FP32 scratch first (fused AdamW takes
FP32 gradients for FP32 masters); the norms are computed in FP32 on the device. Every value is then
the one an FP32 slot would have carried, so BF16 and FP32 gradients give bitwise the same steps.

Gradient norms. Each D2H first takes the L2 norm of the slot's gradients on the device and copies
it to the host with them, and flags the layer when that norm or a micro-batch loss of the step is
not finite. With per-micro-batch passes the step's gradients exist only once the last ACC has
summed them on the host, so that ACC replaces the norm with the accumulator's and keeps the flag
of the last D2H (which has seen every loss) only if that norm is finite. A host optimizer step is
skipped once any layer of the step was flagged (host ops run in order, so the flag is seen by
every later one).

Deferred updates. With the optimizer placed NEXT_FORWARD a step's optimizer steps run in the next
schedule. :class:`DeferredUpdates` (``Executor.deferred``) is the one place that says which
layers' updates are still owed, with which clipping scale and AdamW settings: the caller, who knows
the global norm, sets it with :meth:`Executor.defer` after a step, and every run that carries
updates takes the layers it updated off it, also when the run fails part-way.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from megatrain.optim import AdamW
from megatrain.errors import ConfigError
from megatrain.optim import spec_of
from megatrain.ir.graph import LayerGraph, TracedModel, retarget
from megatrain.ir.hardware import strict_fp32
from megatrain.ir.layout import BufferLayout, buffer_layout
from megatrain.ir.liveness import BATCH, Liveness, liveness
from megatrain.ir.schedule import Op, OpKind, Schedule
from megatrain.runtime.backend import Backend
from megatrain.runtime.distributed import collective, sum_over_ranks
from megatrain.runtime.host import HostState, PinnedArena, gradient_key
from megatrain.runtime.loss import loss_weights
from megatrain.runtime.host_kernels import host_kernel
from megatrain.runtime.graphs import TemplateGraphs, check_backend, module_tensors
from megatrain.runtime.nvme import NvmeError, aligned_buffer
from megatrain.runtime.templates import (CompileReport, TemplateCompile, announce, compile_error, compile_template,
                                         inductor_counts, inductor_cache_dir, stderr_echo)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class _Buffers:
    """Transient memory a plan sizes: weight and gradient slots on the device; host gradient and
    staging tiles, views of the pinned arena (each at its own size, ``BufferLayout.pinned``); and
    the pageable accumulators."""

    weights: list[torch.Tensor]
    grads: list[torch.Tensor]
    ring: list[torch.Tensor]
    staging: list[torch.Tensor]
    # One per trainable layer (schedule.gradient_tiles) with per-micro-batch passes: Op.acc indexes it.
    accumulators: list[torch.Tensor]
    # The pinned gradient I/O buffers of Plan.nvme_gradients (layout.nvme_gradient_buffers, in the
    # arena; Op.gbuf indexes them), in the gradient dtype: a D2H lands there, an NVME_WRITE empties
    # one to the layer's file, an NVME_READ fills one for the carried OPT.
    nvme_gradients: list[torch.Tensor] = field(default_factory=list)


@dataclass
class StepOutput:
    """What one schedule run produced.

    ``losses[mb]``: micro-batch ``mb``'s loss as the last layer returns it (a float): its summed
    token loss where the loss is counted (``TracedModel.count_targets``), else the model's own.
    ``targets[mb]``: its supervised tokens (None where the loss is not counted). ``supervised_tokens``:
    the whole global batch's (every rank's, summed by the schedule's COUNT_REDUCE), None where the
    loss is not counted; when it is 0 no optimizer step of this batch ran (carried ones did).
    ``layer_norms``: the L2 norm of each trainable layer's step gradients (FP32, before clipping) by
    layer index. ``finite``: every loss and every gradient norm of the run was finite.
    ``updates_skipped``: layers whose optimizer step was skipped because of a non-finite value (or a
    batch without targets). ``nonfinite_updates``: layers whose optimizer step in this run (a
    carried one too) left a NaN or infinite value in their master.
    """

    losses: list[float] = field(default_factory=list)
    targets: list[int | None] = field(default_factory=list)
    supervised_tokens: int | None = None
    layer_norms: dict[int, float] = field(default_factory=dict)
    finite: bool = True
    updates_skipped: list[int] = field(default_factory=list)
    nonfinite_updates: list[int] = field(default_factory=list)

    @property
    def grad_norm(self) -> float:
        """Global L2 norm over all gradients of the run (``torch.nn.utils.clip_grad_norm_``'s)."""
        if not self.layer_norms:
            return 0.0
        return float(torch.linalg.vector_norm(torch.tensor(list(self.layer_norms.values()), dtype=torch.float32)))


@dataclass(frozen=True, slots=True)
class DeferredUpdates:
    """The optimizer steps a NEXT_FORWARD step leaves to the next schedule that carries updates (or
    to an ``"update"`` schedule): which ``layers`` are still owed, the clipping scale their
    gradients are multiplied by (``torch.nn.utils.clip_grad_norm_``'s clamped coefficient; None:
    used as they are) and the AdamW settings of the step that made them (None: the current ones)."""

    layers: frozenset[int] = frozenset()
    clip_scale: float | None = None
    optimizer: AdamW | None = None


@dataclass(frozen=True, slots=True)
class TokenHead:
    """A run whose loss layer returns per-token values instead of its loss (``Executor.run(...,
    head=)``; :mod:`megatrain.rl` makes them): layer ``layer`` runs ``template`` (its template with
    the LM head's summed cross-entropy replaced by per-token log-probabilities,
    :func:`megatrain.planner.trace.token_logprobs.logprobs_template`, retargeted to the device).

    ``keep(mb, t)``, in a forward (an eval schedule): gets micro-batch ``mb``'s per-token output
    ``t`` (detached) and returns the 0-dim tensor the run reports as its loss. ``seed(mb, t)``, in
    the layer's local backward (a train schedule): gets ``t`` as autograd recorded it and returns
    ``(loss, seed)``: the micro-batch's 0-dim loss (its term of the global batch's loss) and
    ``dloss/dt``, which seeds the layer's backward in place of the loss weight. The layer-local
    backward and the schedule are the same as for the model's own loss."""

    layer: int
    template: Any
    keep: Callable[[int, torch.Tensor], torch.Tensor] | None = None
    seed: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass(frozen=True, slots=True)
class DeviceRng:
    """The default random number generator of ``device``, whose state a recompute replays.

    ``get()`` returns a copy of its state (a CPU ``uint8`` tensor: the Mersenne Twister state on the
    CPU, Philox seed and offset on CUDA) and ``set(state)`` restores it. On CUDA the state is read
    on the host when the op is issued, without synchronizing (``torch.cuda.get_rng_state``); other
    device types go through ``torch.get_device_module(type)``, as ``torch.utils.checkpoint`` does.
    Nothing is touched at construction (no CUDA initialisation).
    """

    device: torch.device

    def _module(self):
        if self.device.type == "cpu":
            return None
        mod = torch.get_device_module(self.device.type)
        if not hasattr(mod, "get_rng_state") or not hasattr(mod, "set_rng_state"):
            raise RuntimeError(f"device {self.device}: torch.{self.device.type} has no get_rng_state/set_rng_state, "
                               "so megatrain cannot replay the random draws (dropout) of a layer's forward in its "
                               "recompute; set the dropout probabilities to 0 or train on cpu or cuda")
        return mod

    def get(self) -> torch.Tensor:
        mod = self._module()
        return torch.get_rng_state() if mod is None else mod.get_rng_state(self.device)

    def set(self, state: torch.Tensor) -> None:
        mod = self._module()
        if mod is None:
            torch.set_rng_state(state)
        else:
            mod.set_rng_state(state, self.device)


@contextlib.contextmanager
def replaying_rng(rng: DeviceRng, state: torch.Tensor | None) -> Iterator[None]:
    """Run the ``with`` block with ``rng`` in ``state`` (a forward's, from ``rng.get()``), then put
    the caller's state back, so the block redraws the forward's random numbers and the caller's
    stream does not advance. ``state`` None: the block draws from the caller's stream."""
    if state is None:
        yield
        return
    caller = rng.get()
    rng.set(state)
    try:
        yield
    finally:
        rng.set(caller)


class Executor:
    """Runs schedules of one traced model on one backend, against one host state.

    ``deferred`` holds the updates still owed (:class:`DeferredUpdates`); ``updated`` lists the
    layers whose optimizer step ran in the current (or last) run, in order, so that after a run
    that raised the caller knows which updates were applied.
    """

    def __init__(self, traced: TracedModel, host: HostState, backend: Backend, optimizer: AdamW,
                 buffers: dict[str, torch.Tensor], *, per_token_loss: bool = True):
        self.graph: LayerGraph = traced.graph
        # How the micro-batch losses combine (megatrain.runtime.loss: per_token_loss needs
        # traced.count_targets); the targets are counted on the host, from the labels, before the step.
        self.per_token_loss = per_token_loss
        self._count_targets = None if traced.count_targets is None else retarget(traced.count_targets, "cpu")
        self.host = host
        self.backend = backend
        self.optimizer = optimizer
        spec = spec_of(optimizer)
        if spec is not host.optimizer:
            raise ConfigError(f"the optimizer settings are {spec.name}'s but the host state holds "
                              f"{host.optimizer.name}'s state rows {host.optimizer.states}: make the HostState with "
                              f"optimizer=optimizer_spec({spec.name!r})")
        # The spec's host kernel (AdamW's: $MEGATRAIN_HOST_ADAM, torch's fused AdamW by default).
        self.opt_kernel = host_kernel(spec)
        dev = backend.device
        self.templates = [retarget(gm, dev) for gm in traced.templates]
        # Eval schedules run random templates with dropout off, as the model's eval mode does.
        self.eval_templates = [None if gm is None else retarget(gm, dev) for gm in traced.eval_templates]
        self.layer_buffers = [[buffers[name].to(dev) for name in layer.buffers] for layer in self.graph.layers]
        self.rng = DeviceRng(torch.device(dev))  # replayed for layers that draw random numbers (dropout)
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
        self.deferred = DeferredUpdates()
        self.updated: list[int] = []
        # Layers whose OPT stepped NVMe state in an I/O buffer that no NVME_WRITE has saved yet, in
        # the current (or last) run: after a run that raised, their files are behind.
        self.unsaved: set[int] = set()
        # Per schedule (by identity, holding it alive): what its run reads per op (_IssueInfo).
        self._issue_info: dict[int, _IssueInfo] = {}
        # Views of the device slots by (slot tensor, layer), made once per buffers: a layer's weights
        # bound in a slot, and its gradient slices and padding there (see _bind, _grad_views).
        self._views: dict[tuple[str, int, int], tuple[torch.Tensor, Any]] = {}
        # Per schedule (likewise): its buffer layout (``Schedule.layout``, or for a schedule built
        # by hand the one lowering would record), so a step does not re-derive it.
        self._layouts: dict[int, tuple[Schedule, BufferLayout]] = {}
        # Data parallel (``materialize`` sets them): the gloo groups of the host collectives
        # (``runtime.distributed.Groups``; None: the default group), and this rank's optimizer
        # shard among the ``Plan.update_shards`` ranks that split each layer (its node's, or with a
        # state sharded across nodes every rank).
        self.groups = None
        self.shard_index = 0
        # The NVMe tier's host I/O buffers (BufferLayout.nvme_buffers; Op.buf indexes them): the moments of
        # a layer in Plan.nvme_moments, between its NVME_READ and NVME_WRITE. Page-aligned for
        # O_DIRECT, pageable (the moments never go to the GPU), kept across schedules.
        self._nvme_pool: list[torch.Tensor] = []
        # (arena, NvmeTier.master_version) whose staging tiles hold the BF16 casts of the masters on
        # NVMe (Plan.nvme_masters): between steps those tiles are the only copy H2D reads.
        self._staged: tuple[Any, int] | None = None
        # Plan.templates == "compiled": each template object's compiled callable (by id; the
        # templates are held by self), the call signatures already compiled (warmed), and what
        # each compile_templates did. ``echo`` says what is compiled before it is, and how long it took.
        self._compiled: dict[int, Callable[..., Any]] = {}
        self._warm: set[tuple] = set()
        self.compile_reports: list[CompileReport] = []
        self.echo: Callable[[str], None] = stderr_echo
        # Plan.cuda_graphs: the captured compute ops (made by the first run that needs them).
        self.graphs: TemplateGraphs | None = None

    # -- memory ----------------------------------------------------------------------------------
    def allocate(self, schedule: Schedule) -> None:
        """Make the GPU slots and the pinned host buffers ``schedule`` runs on now, not at its first
        run, so that running out of memory is a compile-time error (``materialize`` calls it on a
        GPU backend). The buffers are those of :meth:`_ensure_buffers`.

        Raises:
            torch.OutOfMemoryError / RuntimeError: the device or the pinned allocation failed."""
        self._ensure_buffers(schedule)

    def release_device(self) -> int:
        """Free the GPU weight and gradient slots (the bulk of the device memory a trainer holds
        between steps), so that another user of the card (a colocated rollout engine) can take
        it; the next run, or :meth:`allocate`, makes them again. Host buffers (the pinned arena,
        the accumulators, with any gradients a deferred update still needs) are kept. Returns the
        bytes freed (0 when none were held); the caller empties the device allocator's cache."""
        if self._buffers is None:
            return 0
        freed = sum(t.numel() * t.element_size() for t in self._buffers.weights + self._buffers.grads)
        self._buffers.weights, self._buffers.grads = [], []
        self._views = {}
        self._buffer_key = None  # the next _ensure_buffers makes the slots again, keeping the arena
        return freed

    def layout(self, schedule: Schedule) -> BufferLayout:
        """``schedule``'s buffer layout: the one lowering recorded (``Schedule.layout``), or for a
        schedule built by hand (no layout) the one lowering would record for this executor's graph."""
        if id(schedule) not in self._layouts:
            self._layouts[id(schedule)] = (schedule, schedule.layout if schedule.layout is not None
                                           else buffer_layout(self.graph, schedule.plan, schedule.mode))
        return self._layouts[id(schedule)][1]

    def _ensure_buffers(self, schedule: Schedule) -> _Buffers:
        """The buffers ``schedule`` uses, made when the last ones do not serve it.

        Every size comes from the schedule's :class:`~megatrain.ir.layout.BufferLayout`
        (:meth:`layout`). Pinned host memory is exactly the planner's
        ``memory_breakdown(graph, plan).host_pinned``: the master rows with FP32 compute
        (``HostState.master_pins``) and one arena laid out as ``layout.pinned`` says; an arena
        that already holds every tile the schedule needs (a train arena serves eval and update
        schedules) is kept; with ``Plan.nvme_gradients`` it holds their pinned gradient I/O buffers
        too. The GPU slots are ``layout.slots`` wide; the NVMe tier's moments I/O buffers
        (``layout.nvme_buffers``, pageable) are made when the plan has NVMe layers and kept while
        large enough.

        Raises:
            RuntimeError: a schedule that reads gradients an earlier one left in the host tiles
                (carried updates) needs a new arena, which would not hold them.
        """
        plan = schedule.plan
        buffers = self.layout(schedule)
        layout, sizes = buffers.pinned, buffers.slots  # each slot at its own size
        arena_ok = self._arena is not None and self._arena.layout.covers(layout)
        key = (sizes, plan.compute_dtype, plan.gradient_dtype)
        if self._buffers is None or self._buffer_key != key or not arena_ok:
            be = self.backend
            dtype = _DTYPES[plan.compute_dtype]
            gdtype = _DTYPES[plan.gradient_dtype]
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
            if not plan.staged:
                self.host.master_pins.pin(be)  # H2D reads the master rows (or a sliced state's gather tiles) directly
            else:
                self.host.master_pins.release()
                if plan.shared_cast:
                    self.host.staging_pins.pin(be)  # the node's shared tiles, which this rank's H2Ds read
            self._buffers = None  # let the old device buffers go before the new ones are made
            self._views = {}
            lay = arena.layout
            self._buffers = _Buffers(
                weights=[be.device_empty((width,), dtype) for width, _ in sizes],
                grads=[be.device_empty((gwidth,), gdtype) for _, gwidth in sizes],
                ring=[arena.view("ring", t.key, gdtype) for t in lay.tiles if t.kind == "ring"],
                staging=[arena.view("staging", t.key, dtype) for t in lay.tiles if t.kind == "staging"],
                accumulators=accumulators,
                nvme_gradients=[arena.view("nvme_gradients", t.key, gdtype) for t in lay.tiles
                                if t.kind == "nvme_gradients"])
            if arena.has("norms", 0):
                self._norms = arena.view("norms", 0, torch.float32)
                self._flags = arena.view("flags", 0, torch.bool)
            self._buffer_key = key
        if plan.accumulates_on_host and schedule.mode != "eval" and not self._buffers.accumulators:
            # Pageable: only host ops (ACC, OPT) touch them. Kept across schedules, since with
            # NEXT_FORWARD they hold the gradients the next schedule's updates read.
            self._buffers.accumulators = [torch.empty((span.reduced_numel,), dtype=torch.float32)
                                          for layer, span in zip(self.graph.layers, buffers.layers)
                                          if layer.trainable_numel > 0]
        count, nbytes = buffers.nvme_buffers
        if count and (len(self._nvme_pool) < count or self._nvme_pool[0].numel() < nbytes):
            self._nvme_pool = []  # let the old go first
            self._nvme_pool = [aligned_buffer(nbytes) for _ in range(count)]
        return self._buffers

    def _refresh_staging(self) -> None:
        """Cast the masters on NVMe (``NvmeTier.spilled``) from their files into their layers' own
        staging tiles when the tiles are new (a new arena: the first run, another layout) or a
        master was written outside a run (compile, a checkpoint load: ``NvmeTier.master_version``).
        A run keeps them current itself (the CAST after each such layer's OPT), so this reads
        nothing between ordinary steps.

        Raises:
            NvmeError: a file is missing or truncated (naming it)."""
        tier = self.host.nvme_rows
        if not tier.spilled or not self._buffers.staging:
            return
        if self._staged is not None and self._staged[0] is self._arena and self._staged[1] == tier.master_version:
            return
        io = self._nvme_pool[0]  # no run is in flight: the pool is free
        for li in sorted(tier.spilled):
            n = self.graph.layers[li].numel
            tier.store.read(tier.key(li), io).wait()
            self._buffers.staging[li][:n].copy_(io.view(torch.float32)[:n])
        self._staged = (self._arena, tier.master_version)

    # -- templates -------------------------------------------------------------------------------
    def template_of(self, li: int, evaluate: bool, compiled: bool) -> Callable[..., Any]:
        """What a compute op of layer ``li`` calls: its template, or with ``evaluate`` its eval-mode
        template where it has one (dropout off); with ``compiled`` that template compiled once
        (:func:`megatrain.runtime.templates.compile_template`) and shared by every layer using it."""
        k = self.graph.layers[li].template
        gm = self.templates[k]
        if evaluate and k < len(self.eval_templates) and self.eval_templates[k] is not None:
            gm = self.eval_templates[k]
        if not compiled:
            return gm
        fn = self._compiled.get(id(gm))
        if fn is None:
            fn = self._compiled[id(gm)] = compile_template(gm)
        return fn

    def layout_key(self, li: int) -> tuple:
        """What a captured op of layer ``li`` depends on besides its template and slots: where each
        parameter sits in the slot and which are trained, and the layer's buffers (by identity)."""
        layer = self.graph.layers[li]
        return (tuple((p.offset, p.shape, p.trainable) for p in layer.params),
                tuple(id(b) for b in self.layer_buffers[li]))

    def compile_templates(self, schedule: Schedule, why: str = "") -> CompileReport | None:
        """Compile, now, every template call ``schedule``'s compute ops will make that is not compiled
        yet (``Plan.templates == "compiled"``; else nothing): each template's no-grad forward (FWD,
        RECOMPUTE; an eval schedule's random layers their eval templates) and its forward and
        backward with gradients (BWD, for each pattern of trained weights and differentiable inputs
        among its layers), by calling it once that way on example tensors of the layer's shapes, as
        :func:`_fwd` and :func:`local_backward` call it. The device's generator is left as it was.
        Says what it compiles and why before (``echo``), and how long it took after; the report is
        appended to ``compile_reports``. ``run`` calls it for a schedule it has not seen.

        Returns:
            The :class:`~megatrain.runtime.templates.CompileReport`, or None when nothing was compiled.

        Raises:
            UnsupportedModelError: a template cannot be compiled whole; names it, its layers and the
                node where Dynamo stopped.
        """
        if schedule.plan.templates != "compiled":
            return None
        todo: dict[tuple, tuple[int, bool, bool]] = {}  # call signature -> (layer, backward, evaluate)
        for op in schedule.ops:
            if op.kind not in (OpKind.FWD, OpKind.RECOMPUTE, OpKind.BWD):
                continue
            li = op.layer
            layer = self.graph.layers[li]
            evaluate = schedule.mode == "eval" and layer.draws_random
            backward = op.kind is OpKind.BWD
            fn = self.template_of(li, evaluate, True)
            sig = (id(fn), backward) + ((tuple(p.trainable for p in layer.params),
                                         tuple(self.graph.values[v].requires_grad for v in layer.inputs))
                                        if backward else ())
            if sig not in self._warm:
                todo.setdefault(sig, (li, backward, evaluate))
        if not todo:
            return None
        names: dict[int, list[str]] = {}
        for layer in self.graph.layers:
            names.setdefault(layer.template, []).append(layer.name)
        compiling = {self.graph.layers[li].template: names[self.graph.layers[li].template] for li, _, _ in todo.values()}
        self.echo(announce(compiling, why or f"for the plan's templates='compiled' ({schedule.mode} schedule)"))
        seconds: dict[int, float] = {}
        counts: dict[int, list[int]] = {}
        t_all = time.perf_counter()
        with replaying_rng(self.rng, self.rng.get()):  # the warm-up's random draws leave no trace
            for sig, (li, backward, evaluate) in todo.items():
                k = self.graph.layers[li].template
                before = inductor_counts()
                t0 = time.perf_counter()
                try:
                    self._warm_up(li, backward, evaluate, schedule.plan)
                except Exception as e:
                    gm = self.templates[k]
                    raise compile_error(e, gm, k, names[k]) from e
                seconds[k] = seconds.get(k, 0.0) + time.perf_counter() - t0
                after = inductor_counts()
                c = counts.setdefault(k, [0, 0])
                c[0] += after[0] - before[0]
                c[1] += after[1] - before[1]
                self._warm.add(sig)
        report = CompileReport(tuple(TemplateCompile(k, tuple(names[k]), seconds[k], counts[k][0], counts[k][1])
                                     for k in sorted(seconds)), time.perf_counter() - t_all, inductor_cache_dir())
        self.compile_reports.append(report)
        self.echo(report.describe())
        return report

    def _warm_up(self, li: int, backward: bool, evaluate: bool, plan) -> None:
        """Call layer ``li``'s compiled template once as a FWD (no grad) or, ``backward``, as a local
        backward does, on zeros of its weights', inputs' and gradients' shapes (compiling it)."""
        layer = self.graph.layers[li]
        dev = self.backend.device
        dtype = _DTYPES[plan.compute_dtype]
        weights = [torch.zeros(p.shape, dtype=dtype, device=dev) for p in layer.params]
        ins = [torch.zeros(self.graph.values[v].shape, dtype=getattr(torch, self.graph.values[v].dtype), device=dev)
               for v in layer.inputs]
        lbufs = self.layer_buffers[li]
        fn = self.template_of(li, evaluate, True)
        if not backward:
            with torch.no_grad(), self._precision(plan.compute_dtype):
                fn(*weights, *lbufs, *ins)
            return
        gdtype = _DTYPES[plan.gradient_dtype]
        gviews = [torch.zeros(p.shape, dtype=gdtype, device=dev) for p in layer.params if p.trainable]
        seeds = [None if v == self.graph.loss else
                 torch.ones(self.graph.values[v].shape, dtype=getattr(torch, self.graph.values[v].dtype), device=dev)
                 for v in layer.outputs]
        with torch.enable_grad(), self._precision(plan.compute_dtype):
            backward_body(self, li, fn, weights, lbufs, ins, seeds, 1.0, gviews, [], True)

    # -- deferred updates ------------------------------------------------------------------------
    def defer(self, layers: frozenset[int], clip_scale: float | None, optimizer: AdamW | None) -> None:
        """Owe the optimizer steps of ``layers`` to the next schedule that carries updates, each
        from gradients multiplied by ``clip_scale`` (None: as they are), with AdamW ``optimizer``
        (None: the settings current when they run). Replaces what was owed before."""
        self.deferred = DeferredUpdates(frozenset(layers), clip_scale, optimizer)

    def drop_deferred(self) -> None:
        """Forget the updates still owed without running them (after loading a checkpoint)."""
        self.deferred = DeferredUpdates()

    # -- running ---------------------------------------------------------------------------------
    def targets(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> list[int | None]:
        """The supervised tokens of each micro-batch (``LongTensor`` inputs on the host, by name), as
        the model's loss counts them: the labels that are not -100 after its shift
        (``TracedModel.count_targets``); None for each where the loss is not counted."""
        if self._count_targets is None:
            return [None] * len(micro_batches)
        with torch.no_grad():
            return [int(self._count_targets(*(mb[name].cpu() for name in self.graph.batch_inputs)))
                    for mb in micro_batches]

    def run(self, schedule: Schedule, micro_batches: Sequence[dict[str, torch.Tensor]],
            targets: Sequence[int | None] | None = None, *, head: TokenHead | None = None,
            weights: Sequence[torch.Tensor] | None = None) -> StepOutput:
        """Run ``schedule`` on ``micro_batches`` (one dict of input tensors per micro-batch).

        ``targets``: the supervised tokens of each micro-batch (:meth:`targets`, which counts them
        when not given). Each micro-batch's loss is seeded with its weight in the global batch's
        loss (:func:`megatrain.runtime.loss.loss_weights`), from the global count: this rank's
        alone, or the ranks' sum that the schedule's COUNT_REDUCE makes. When a counted global
        batch has no target the step's optimizer steps are skipped (its gradients are zero, and an
        AdamW step on zeros would still move the weights).

        A schedule that carries updates (an ``"update"`` schedule, or a train schedule with
        ``carries_updates``) takes each layer whose update ran off ``deferred``, also when it raises.

        ``head``: the loss layer returns per-token values that the head keeps (eval) or seeds
        (train) instead of the loss (:class:`TokenHead`); each micro-batch's loss is then the
        head's. ``weights``: each layer's weights are read from these host rows (``numel``
        elements, any float dtype: a frozen reference model's BF16 copy) instead of its master
        row, by its H2Ds and CASTs (for an eval schedule: nothing updates them).

        Raises:
            ValueError: ``micro_batches`` (or ``targets``) is not the plan's number of micro-batches.
            Exception: whatever an op or the backend raised; the backend's run is closed first
                (``Backend.abort``), so the next run starts afresh.
        """
        g = self.graph
        M = schedule.plan.micro_batches
        if schedule.mode != "update" and len(micro_batches) != M:
            raise ValueError(f"schedule expects {M} micro-batches, got {len(micro_batches)}")
        targets = self.targets(micro_batches) if targets is None else list(targets)
        if len(targets) != len(micro_batches):
            raise ValueError(f"{len(targets)} target counts for {len(micro_batches)} micro-batches")
        bufs = self._ensure_buffers(schedule)
        self._refresh_staging()
        dev = self.backend.device
        info = self._issue_info.get(id(schedule))
        if info is None:
            self.compile_templates(schedule)  # Plan.templates == "compiled": said and timed, never in a step
            info = self._issue_info[id(schedule)] = _IssueInfo.of(schedule, g)
        if schedule.plan.cuda_graphs and self.graphs is None:
            check_backend(self.backend)
            self.graphs = TemplateGraphs(self.backend)
        ctx = _RunContext(self, schedule, bufs, _Activations(info.live), targets)
        ctx.head, ctx.source = head, weights
        self.updated = ctx.updated
        self.unsaved = ctx.unsaved
        if ctx.graphs is not None and ctx.graphs.wanted:
            # Before this run's first op: between runs, and a capture that fails leaves this batch untouched.
            self._capture()
        for mb, batch in enumerate(micro_batches):
            for name in g.batch_inputs:
                ctx.acts.put_batch((g.value_by_name(name).id, mb), batch[name].to(dev, non_blocking=True))
        done = False
        try:
            try:
                events, launch = ctx.events, self.backend.launch
                for i, op in enumerate(schedule.ops):
                    fn = HANDLERS[op.kind](ctx, i, op)
                    if info.touches[i]:
                        fn = _then(fn, ctx.acts.view(i).release)
                    waits = [events[d] for d in info.waits[i]]
                    if info.after[i]:  # issue fences: only a few ops have them (Schedule.issue_after)
                        events[i] = launch(info.streams[i], fn, waits, label=info.labels[i],
                                           after=[events[f] for f in info.after[i]])
                    else:
                        events[i] = launch(info.streams[i], fn, waits, label=info.labels[i])
            except BaseException:
                # The backend drains and closes the run, so the next run opens a fresh entry fence
                # instead of racing this run's leftovers (its pending ops are dropped).
                self.backend.abort()
                raise
            self.backend.synchronize()
            done = True
        finally:
            if not done and ctx.graphs is not None:
                ctx.graphs.wanted.clear()  # captured after a run that completes
            if ctx.recast:
                # Masters on NVMe changed: other executors over this host state (other batch shapes)
                # re-cast their staging tiles; this one's CASTs did, unless the run failed part-way.
                self.host.nvme_rows.master_version += 1
                if done:
                    self._staged = (self._arena, self.host.nvme_rows.master_version)
            if ctx.carried:
                d = self.deferred
                self.deferred = DeferredUpdates(d.layers - set(ctx.updated), d.clip_scale, d.optimizer)
        out = StepOutput(losses=[0.0] * M, targets=targets, supervised_tokens=ctx.supervised)
        for mb, t in ctx.losses.items():
            out.losses[mb] = float(t)
        out.layer_norms = {li: float(self._norms[li]) for li in ctx.trained}
        out.finite = (all(bool(self._flags[li]) for li in ctx.trained)
                      and all(math.isfinite(x) for x in out.losses))
        out.updates_skipped = list(ctx.skipped)
        out.nonfinite_updates = list(ctx.nonfinite)
        return out

    def _capture(self) -> None:
        """Capture the compute ops the last run noted for CUDA graphs (``Plan.cuda_graphs``), before
        the next run starts; said before and timed after (``echo``)."""
        n = len(self.graphs.wanted)
        self.echo(f"capturing {n} CUDA graph{'s' * (n != 1)} of compute ops (Plan.cuda_graphs; one per template, "
                  "slot and variant, after its first eager run) ...")
        t0 = time.perf_counter()
        loss = self.graph.values[self.graph.loss]
        with replaying_rng(self.rng, self.rng.get()):  # a captured random op leaves no trace
            self.graphs.capture_wanted(loss.shape, getattr(torch, loss.dtype))
        self.echo(f"captured {n} CUDA graph{'s' * (n != 1)} in {time.perf_counter() - t0:.1f} s "
                  f"({len(self.graphs.captured)} in all)")

    def _bind(self, layer: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """The layer's weights as views of ``flat`` (a new list; the views of a slot are made once)."""
        return list(self._view("weights", flat, layer, lambda: tuple(
            flat[p.offset:p.offset + p.numel].view(p.shape) for p in self.graph.layers[layer].params)))

    def _grad_views(self, layer: int, gslot: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
        """Where each trainable parameter's gradient goes in gradient slot ``gslot``, and the alignment
        padding between them (which a fresh backward zeroes so the D2H norm and the optimizer see
        zeros there)."""
        def make():
            trained = [p for p in self.graph.layers[layer].params if p.trainable]
            return (tuple(gslot[p.offset:p.offset + p.numel].view(p.shape) for p in trained),
                    [gslot[a:b] for a, b in _padding(trained, self.graph.layers[layer].trainable_numel)])
        return self._view("grads", gslot, layer, make)

    def _view(self, kind: str, base: torch.Tensor, layer: int, make: Callable[[], Any]) -> Any:
        # Keyed by the tensor's identity; the entry holds the tensor, so the id cannot be reused
        # while the entry lives (new buffers clear the cache: _ensure_buffers).
        hit = self._views.get((kind, id(base), layer))
        if hit is None:
            hit = self._views[(kind, id(base), layer)] = (base, make())
        return hit[1]

    def _precision(self, compute_dtype: str):
        """FP32 compute is strict IEEE FP32 (TF32 off for the op, the caller's setting restored after:
        :func:`~megatrain.ir.hardware.strict_fp32`), the precision ``megatrain.runtime.measure.measure_hardware()``
        times FP32 in and eager FP32 training on the CPU computes in. BF16 compute runs templates
        traced with BF16 parameters (``graph.meta["param_dtype"]``, what ``compile`` traces) as
        they are, with no autocast: the model's own code in BF16, its FP32 upcasts (norms, the
        loss) included, as FSDP2's and DeepSpeed's mixed precision run it. Templates traced in FP32
        run under ``torch.autocast`` instead: matmuls in BF16 with FP32 accumulation, the rest
        in FP32; the weights arrive in BF16 already, so autocast's weight casts are no-ops."""
        if compute_dtype == "float32":
            return strict_fp32()
        if self.graph.meta.get("param_dtype") == compute_dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.backend.device.type, dtype=_DTYPES[compute_dtype])


# -- one run -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _IssueInfo:
    """What the issuing thread reads per op of one schedule, worked out once and kept per schedule:
    the liveness of its checkpoints, and per op its stream, label (its repr), the dependencies on
    other streams it waits for (an own-stream one is stream order), its issue fences
    (``Schedule.issue_after``) and whether it reads checkpoints."""

    schedule: Schedule  # held alive: Executor._issue_info is keyed by its id
    live: Liveness
    streams: tuple[Any, ...]
    labels: tuple[str, ...]
    waits: tuple[tuple[int, ...], ...]
    after: tuple[tuple[int, ...], ...]
    touches: tuple[bool, ...]

    @classmethod
    def of(cls, schedule: Schedule, graph: LayerGraph) -> "_IssueInfo":
        ops = schedule.ops
        streams = tuple(op.stream for op in ops)
        live = liveness(schedule, graph)
        return cls(schedule, live, streams, tuple(repr(op) for op in ops),
                   tuple(tuple(d for d in op.deps if streams[d] is not streams[i]) for i, op in enumerate(ops)),
                   tuple(schedule.fences(i) for i in range(len(ops))), tuple(bool(r) for r in live.reads))


class _RunContext:
    """What one run of a schedule reads and writes besides the op: the executor (templates, host
    state, norms and flags), the schedule, its buffers, the checkpoints on the device by
    generation, the boundary gradients ``grads[(value, mb)]``, the losses by micro-batch, the
    backend handle of every launched op, and the run's record of optimizer steps.

    Handlers run on the issuing thread and return work that the backend runs later, perhaps on
    another thread (a host worker): the work reads what it needs when it runs.
    """

    def __init__(self, ex: Executor, schedule: Schedule, bufs: _Buffers, acts: "_Activations",
                 targets: list[int | None]):
        plan = schedule.plan
        self.ex, self.schedule, self.bufs, self.acts = ex, schedule, bufs, acts
        self.graph = ex.graph
        self.layers = ex.layout(schedule).layers
        self.micro_batches = plan.micro_batches
        self.compute_dtype = plan.compute_dtype
        self.layer_by_layer = plan.layer_by_layer
        self.compiled = plan.templates == "compiled"
        self.graphs = ex.graphs if plan.cuda_graphs else None
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}
        # The generator state each random layer's forward started from, by (layer, mb): its
        # recomputes replay it; the local backward (the last reader) drops it.
        self.rng_states: dict[tuple[int, int], torch.Tensor] = {}
        self.events: list[Any] = [None] * len(schedule.ops)
        self.trained: list[int] = []  # layers whose gradients a D2H copied out, in order
        self.updated: list[int] = []  # layers whose optimizer step ran, in order (host worker)
        self.unsaved: set[int] = set()  # layers stepped in an NVMe I/O buffer whose NVME_WRITE has not completed
        self.recast = False  # a CAST from an I/O buffer ran: a master on NVMe changed
        self.skipped: list[int] = []  # layers whose optimizer step was skipped (a non-finite value)
        self.skip = False  # a non-finite value was seen: later optimizer steps of the run are skipped
        self.nonfinite: list[int] = []  # layers whose optimizer step left a non-finite master
        # Carried (NEXT_FORWARD) updates run with the clipping and AdamW settings of the step that
        # made their gradients, as ``deferred`` says.
        self.carried = schedule.mode == "update" or schedule.carries_updates
        d = ex.deferred
        self.carried_optimizer = d.optimizer or ex.optimizer
        self.carried_scale = None if d.clip_scale is None else torch.tensor(1.0 / d.clip_scale, dtype=torch.float32)
        # The loss of the global batch: this rank's targets, and (once known) the global batch's,
        # from which each micro-batch's weight (the seed of its loss). A COUNT_REDUCE sums the ranks'
        # counts; without one the global batch is this rank's. (An update schedule has no batch.)
        self.targets = targets
        self.head: TokenHead | None = None  # Executor.run's head and weights
        self.source: Sequence[torch.Tensor] | None = None
        self.counted = None not in targets
        self.supervised: int | None = None
        self.weights: list[float] = []
        if schedule.mode != "update" and not any(op.kind is OpKind.COUNT_REDUCE for op in schedule.ops):
            self.count(sum(targets) if self.counted else None)

    def count(self, supervised: int | None) -> None:
        """The global batch has ``supervised`` targets (None: not counted): set each micro-batch's
        weight; skip this step's optimizer steps when there are none (zero gradients, but AdamW
        would still move the weights)."""
        plan = self.schedule.plan
        self.supervised = supervised
        self.weights = loss_weights(self.targets, supervised, plan.micro_batches * plan.data_parallel,
                                    per_token=self.ex.per_token_loss)
        if supervised == 0:
            self.skip = True


Work = Callable[[], None]
Handler = Callable[[_RunContext, int, Op], Work]


def _h2d(ctx: _RunContext, i: int, op: Op) -> Work:
    """Copy a layer's weights into its slot: from the staging tile the op names (BF16; with
    ``Plan.shared_cast`` the node's shared tile of the layer), else from the FP32 master rows, or
    with a sliced host state (``Plan.host_state == "shard"``) from the gather tile its ALL_GATHER
    filled."""
    numel = ctx.graph.layers[op.layer].numel
    src = _staging(ctx, op)[:numel] if op.tile is not None else _master_source(ctx, i, op)
    return _copy(ctx.bufs.weights[op.slot][:numel], src)


def _cast(ctx: _RunContext, i: int, op: Op) -> Work:
    """Cast the layer's master tile into the staging tile the op names: from its master row (or, on
    a sliced host state, the gather tile its ALL_GATHER filled); with ``Plan.shared_cast`` only this
    rank's shard of it (``LayerLayout.cast_shards``) into the node's shared tile, which the ALL_GATHER after
    the node's CASTs makes whole; or (``op.buf``, ``Plan.nvme_masters``) from the I/O buffer where
    its OPT just stepped it."""
    if op.buf is not None:
        master = ctx.ex._nvme_pool[op.buf].view(torch.float32)[:ctx.graph.layers[op.layer].numel]
        copy = _copy(ctx.bufs.staging[op.tile][:master.numel()], master)

        def run() -> None:
            ctx.recast = True
            copy()
        return run
    master = _master_source(ctx, i, op)
    lo, hi = ctx.layers[op.layer].cast_shards[ctx.ex.shard_index] if ctx.schedule.plan.shared_cast \
        else (0, ctx.graph.layers[op.layer].numel)
    return _copy(_staging(ctx, op)[lo:hi], master[lo:hi])


def _staging(ctx: _RunContext, op: Op) -> torch.Tensor:
    """The staging tile ``op`` (a CAST or BF16 H2D) names: the node's shared tile of its layer with
    ``Plan.shared_cast`` (``HostState.staging``), else this rank's pinned arena tile."""
    if not ctx.schedule.plan.shared_cast:
        return ctx.bufs.staging[op.tile]
    staging = ctx.ex.host.staging
    if not staging:
        raise ConfigError(f"{op!r}: the plan shares the node's staging tiles (Plan.shared_cast), but this host "
                          "state has none (it was made for another plan); compile the trainer with this plan")
    return staging[op.tile]


def _master_source(ctx: _RunContext, i: int, op: Op) -> torch.Tensor:
    """The whole master tile of ``op.layer`` that op ``i`` (an FP32 H2D or a CAST) reads: the host
    state's row, or on a sliced host state the gather tile of the ALL_GATHER it depends on (in the
    compute dtype; rule 'collectives' checks there is exactly one)."""
    host = ctx.ex.host
    if ctx.source is not None:
        return ctx.source[op.layer]
    if not host.tile_layout.sliced:
        return host.master(op.layer)
    ops = ctx.schedule.ops
    gather = next(ops[d] for d in op.deps if ops[d].kind is OpKind.ALL_GATHER and ops[d].layer == op.layer)
    return _gather_tile(ctx, gather)


def _gather_tile(ctx: _RunContext, op: Op) -> torch.Tensor:
    """The node-shared gather tile ``op.tile`` as ``op.layer``'s ``numel`` elements of the compute dtype."""
    dtype = _DTYPES[ctx.compute_dtype]
    numel = ctx.graph.layers[op.layer].numel
    return ctx.ex.host.gather[op.tile][:numel * dtype.itemsize].view(dtype)


def _fwd(ctx: _RunContext, i: int, op: Op) -> Work:
    """A forward (or a recompute: the same computation in the backward phase). A forward of a layer
    that draws random numbers records the generator state it starts from; a recompute replays it.
    An eval schedule runs such a layer's eval-mode template (dropout off, ``TracedModel.eval_templates``).
    With ``Plan.cuda_graphs`` the template runs as the replay of its (template, slot) graph
    (:class:`megatrain.runtime.graphs.TemplateGraphs`), the same computation on static buffers."""
    ex, li, mb = ctx.ex, op.layer, op.mb
    layer = ctx.graph.layers[li]
    head = ctx.head if ctx.head is not None and ctx.head.layer == li else None
    evaluate = ctx.schedule.mode == "eval" and layer.draws_random
    tmpl = ex.template_of(li, evaluate, ctx.compiled) if head is None else head.template
    lbufs = ex.layer_buffers[li]
    weights = ex._bind(li, ctx.bufs.weights[op.slot])
    loss_id = ctx.graph.loss
    acts = ctx.acts.view(i)
    recompute = op.kind is OpKind.RECOMPUTE
    dtype = ctx.compute_dtype
    graphs = ctx.graphs
    key = None if graphs is None else ("fwd", id(tmpl), id(ctx.bufs.weights[op.slot]), ex.layout_key(li))

    def call(ins: Sequence[torch.Tensor], seeds=(), loss_seed=None) -> tuple[torch.Tensor, ...]:
        with torch.no_grad(), ex._precision(dtype):
            return tuple(tmpl(*weights, *lbufs, *ins))

    def run() -> None:
        ins = [acts[(v, mb)] for v in layer.inputs]
        ex.backend.record_use(ins)
        if ctx.compiled:
            ins = [x.contiguous() for x in ins]  # the strides the compiled template was warmed with
        state = None
        if layer.draws_random and not evaluate:  # nothing recomputes an eval forward
            # Read when the op runs (is issued, on CUDA): the stream has advanced by every earlier forward.
            if recompute:
                state = ctx.rng_states.get((li, mb))
                if state is None:
                    raise RuntimeError(f"op #{i} ({op!r}) recomputes layer {layer.name!r}, which draws random "
                                       f"numbers, but no forward of micro-batch {mb} recorded its generator state "
                                       "before it: the schedule lacks the forward (or ran it after the recompute)")
            else:
                ctx.rng_states[(li, mb)] = ex.rng.get()
        with replaying_rng(ex.rng, state):
            outs = call(ins) if graphs is None or head is not None else graphs.run(key, call, ins,
                                                               static=[*weights, *lbufs, *module_tensors(tmpl)],
                                                               what=f"{op!r} (layer {layer.name!r})")
        for vid, t in zip(layer.outputs, outs):
            if vid == loss_id:
                ctx.losses[mb] = t.detach() if head is None else head.keep(mb, t.detach())
            else:
                acts[(vid, mb)] = t
    return run


def _bwd(ctx: _RunContext, i: int, op: Op) -> Work:
    """A local backward. Layer by layer a visit's micro-batches accumulate in the slot; per-micro-batch
    passes accumulate on the host (ACC), so there every local backward starts the slot afresh."""
    mb = op.mb
    work = local_backward(ctx.ex, op.layer, mb, ctx.bufs.weights[op.slot], ctx.bufs.grads[op.slot],
                          ctx.acts.view(i), ctx.grads, ctx.losses, lambda: ctx.weights[mb], ctx.compute_dtype,
                          fresh=mb == 0 or not ctx.layer_by_layer, rng_states=ctx.rng_states, compiled=ctx.compiled,
                          graphs=ctx.graphs, head=ctx.head if ctx.head is not None and ctx.head.layer == op.layer else None)
    done = [(vid, mb) for vid in ctx.graph.layers[op.layer].outputs]

    def drop() -> None:  # the gradients of its outputs were read for the last time
        for key in done:
            ctx.grads.pop(key, None)
    return _then(work, drop)


def local_backward(ex: Executor, li: int, mb: int, wslot: torch.Tensor, gslot: torch.Tensor, acts, grads: dict,
                   losses: dict, weight: Callable[[], float], compute_dtype: str, fresh: bool,
                   rng_states: dict[tuple[int, int], torch.Tensor] | None = None, compiled: bool = False,
                   graphs: Any = None, head: TokenHead | None = None) -> Work:
    """The work of layer ``li``'s local backward for micro-batch ``mb``: recompute its forward from
    ``acts[(input, mb)]`` with weights bound to ``wslot``, then write (``fresh``) or add the weight
    gradients into ``gslot`` (FP32, or BF16 when ``fresh``: the plan's gradient dtype) and add the
    input gradients into ``grads[(input, mb)]``; the loss goes into ``losses[mb]``, seeded with
    ``weight()``, read when the work runs (after the COUNT_REDUCE it depends on): the micro-batch's
    factor in the global batch's loss (:func:`megatrain.runtime.loss.loss_weights`).

    A layer that draws random numbers recomputes with the generator state its forward recorded in
    ``rng_states[(li, mb)]`` (taken off it: nothing recomputes the forward after its backward),
    the caller's state put back after; without one (no forward ran: the last layer, whose forward
    this is) it draws from the generator's stream as a forward would. ``compiled``: run the
    layer's compiled template (``Plan.templates``); ``graphs``: the executor's
    :class:`~megatrain.runtime.graphs.TemplateGraphs` (``Plan.cuda_graphs``), which replays the
    computation of :func:`backward_body` captured on static buffers (the loss's seed among them,
    filled with ``weight()`` before the replay). ``head`` (of layer ``li``): its template runs, and
    its ``seed`` gives the loss and the seed of the per-token output (never in a CUDA graph: the
    seed is the loss's function of the per-token values, made on the fly)."""
    g = ex.graph
    layer = g.layers[li]
    tmpl = ex.template_of(li, False, compiled) if head is None else head.template
    lbufs = ex.layer_buffers[li]
    gviews, gaps = ex._grad_views(li, gslot)
    weights = ex._bind(li, wslot)
    outputs = layer.outputs

    def body(ins: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor | None],
             loss_seed: float | torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with torch.enable_grad(), ex._precision(compute_dtype):
            return backward_body(ex, li, tmpl, weights, lbufs, ins, seeds, loss_seed, gviews, gaps, fresh,
                                 head_seed=None if head is None else lambda t: head.seed(mb, t))

    def run() -> None:
        state = rng_states.pop((li, mb), None) if rng_states is not None and layer.draws_random else None
        ins = []
        for vid in layer.inputs:
            x = acts[(vid, mb)]
            ex.backend.record_use((x,))
            ins.append(x.contiguous() if compiled else x)
        seeds = [None if vid == g.loss else grads.get((vid, mb)) for vid in outputs]
        with replaying_rng(ex.rng, state):
            if graphs is None or head is not None:
                res = body(ins, seeds, weight())
            else:
                key = ("bwd", id(tmpl), id(wslot), id(gslot), fresh, ex.layout_key(li),
                       tuple(s is not None for s in seeds))
                res = graphs.run(key, body, ins, seeds, loss_seed=weight() if g.loss in outputs else None,
                                 static=[wslot, gslot, *lbufs, *module_tensors(tmpl)],
                                 what=f"the local backward of layer {layer.name!r}")
        loss, gxs = res[0], res[1:]
        if loss is not None:
            losses[mb] = loss
        for vid, gx in zip((v for v in layer.inputs if g.values[v].requires_grad), gxs):
            if gx is None:
                continue
            key = (vid, mb)
            grads[key] = grads[key] + gx if key in grads else gx
    return run


def backward_body(ex: Executor, li: int, tmpl: Callable, weights: Sequence[torch.Tensor],
                  lbufs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor | None],
                  loss_seed: float | torch.Tensor, gviews: Sequence[torch.Tensor], gaps: Sequence[torch.Tensor],
                  fresh: bool, head_seed: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
                  ) -> tuple[torch.Tensor | None, ...]:
    """The device computation of layer ``li``'s local backward, with gradients on: run ``tmpl`` on
    ``weights`` (views of the slot; each trainable one made a leaf of its own), ``lbufs`` and
    ``ins`` (the differentiable ones made leaves), then ``torch.autograd.grad`` of the outputs
    seeded with ``seeds`` (one per output of the layer: its incoming gradient, or None where none
    arrives) and of the loss seeded with ``loss_seed`` (a float, or a tensor of the loss's shape and
    dtype holding it), written (``fresh``: padding ``gaps`` and unused weights zeroed) or added into
    ``gviews``. Returns ``(loss or None, gradient of each differentiable input or None)``. Reads no
    host value but ``loss_seed`` when it is a float, so that it can be captured in a CUDA graph.
    ``head_seed`` (a :class:`TokenHead`'s, for the loss layer's per-token output ``t``): returns
    ``(loss, dloss/dt)``, the loss reported and the seed of ``t`` in place of ``loss_seed``.

    Each trainable parameter is a leaf of its own, so its gradient lands in a tensor of its size; a
    flat leaf would gather them through ``slice_backward``, one zero-filled and one summed full tile
    per parameter."""
    g = ex.graph
    layer = g.layers[li]
    weights = list(weights)
    leaves = []
    for k, p in enumerate(layer.params):
        if p.trainable:
            weights[k] = weights[k].detach().requires_grad_(True)
            leaves.append(weights[k])
    xs, diff = [], []
    for vid, x in zip(layer.inputs, ins):
        if g.values[vid].requires_grad:
            x = x.detach().requires_grad_(True)
            diff.append(x)
        xs.append(x)
    outs = tmpl(*weights, *lbufs, *xs)
    loss = None
    roots, grad_outs = [], []
    for vid, t, seed in zip(layer.outputs, outs, seeds):
        if vid == g.loss and head_seed is not None:
            loss, head_grad = head_seed(t)  # the loss is a function of the per-token values
            roots.append(t)
            grad_outs.append(head_grad)
        elif vid == g.loss:
            loss = t.detach()
            roots.append(t)
            # The gradient of the global batch's loss, of which this loss is loss_seed x.
            grad_outs.append(torch.full_like(t, loss_seed) if isinstance(loss_seed, float) else loss_seed)
        elif seed is not None and t.requires_grad:
            roots.append(t)
            grad_outs.append(seed)
    wrt = leaves + diff
    # No gradient reaches the layer: its weights' gradients are zero (written when fresh).
    res = torch.autograd.grad(roots, wrt, grad_outs, allow_unused=True) if roots and wrt else [None] * len(wrt)
    pgrads, res = res[:len(leaves)], res[len(leaves):]
    # Gradients of BF16 weights are BF16 (autograd returns a leaf's gradient in its dtype): an FP32
    # slot takes them exactly (copy_/add_ cast), and so does a BF16 one, written fresh only.
    got = [(v, gp) for v, gp in zip(gviews, pgrads) if gp is not None]
    if fresh:
        missing = [v for v, gp in zip(gviews, pgrads) if gp is None]  # the loss does not use it
        if missing or gaps:
            torch._foreach_zero_(missing + list(gaps))
        if got:
            torch._foreach_copy_([v for v, _ in got], [gp for _, gp in got])
    elif got:
        torch._foreach_add_([v for v, _ in got], [gp for _, gp in got])
    return (loss, *res)


def _d2h(ctx: _RunContext, i: int, op: Op) -> Work:
    ex, li = ctx.ex, op.layer
    ctx.trained.append(li)
    n = ctx.graph.layers[li].trainable_numel
    # A layer of Plan.nvme_gradients lands in the gradient I/O buffer its NVME_WRITE then empties.
    tile = ctx.bufs.ring[op.ring] if op.gbuf is None else ctx.bufs.nvme_gradients[op.gbuf]
    gslot, tile = ctx.bufs.grads[op.slot][:n], tile[:n]
    losses = ctx.losses

    def run() -> None:
        # In FP32 from BF16 gradients too (widened inside the reduction, no FP32 copy of the slot).
        norm = torch.linalg.vector_norm(gslot, dtype=torch.float32)
        ok = torch.isfinite(norm)
        if losses:  # every micro-batch's loss is known before any gradient leaves the GPU
            ok = ok & torch.isfinite(torch.stack(list(losses.values()))).all()
        ex._norms_dev[li] = norm
        ex._flags_dev[li] = ok
        ex._norms[li:li + 1].copy_(ex._norms_dev[li:li + 1], non_blocking=True)
        ex._flags[li:li + 1].copy_(ex._flags_dev[li:li + 1], non_blocking=True)
        tile.copy_(gslot, non_blocking=True)
    return run


def _acc(ctx: _RunContext, i: int, op: Op) -> Work:
    """Add ring tile ``op.ring`` into accumulator ``op.acc`` (micro-batch 0 overwrites it); the last
    micro-batch's takes the step's gradient norm from the accumulator. A BF16 tile is widened on
    the way: the copy and the FP32 sum read it as FP32 (exact), as an FP32 tile of the same values."""
    ex, li = ctx.ex, op.layer
    tile = ctx.bufs.ring[op.ring][:ctx.graph.layers[li].trainable_numel]
    acc = ctx.bufs.accumulators[op.acc][:tile.numel()]  # longer for a reduce-scatter (LayerLayout.reduced_numel)
    last = op.mb == ctx.micro_batches - 1

    def run() -> None:
        if op.mb == 0:
            acc.copy_(tile)
        else:
            acc.add_(tile)
        if last:
            norm = torch.linalg.vector_norm(acc)
            ex._norms[li] = norm
            ex._flags[li] = bool(ex._flags[li]) and bool(torch.isfinite(norm))
    return run


def _opt(ctx: _RunContext, i: int, op: Op) -> Work:
    """Host optimizer step (``HostState.optimizer``'s kernel: AdamW, Lion) of one layer from the
    gradient tile or accumulator the op names (with
    ``Plan.update_shards > 1``, of this rank's shard of it, ``LayerLayout.optimizer_shards``; a sliced host
    state holds the layer from its slice's start on), on its
    moments in host memory or, for a layer on NVMe, in the I/O buffer ``op.buf`` (under data
    parallel it holds this rank's shard only, ``NvmeTier.span``), through the executor's
    host kernel (:class:`~megatrain.runtime.host_kernels.HostAdamW` or ``HostLion``: BF16 gradients
    in a tile are widened exactly, chunk by chunk, in its FP32 scratch)."""
    ex, li = ctx.ex, op.layer
    lo, hi = ctx.layers[li].optimizer_shards[ex.shard_index]
    h = ex.host
    base = h.tile_layout.slices[li][0]  # a sliced host state holds the layer from element ``base`` on
    grads = (ctx.bufs.accumulators[op.acc] if op.acc is not None else ctx.bufs.ring[op.ring] if op.ring is not None
             else ctx.bufs.nvme_gradients[op.gbuf])  # gbuf: a gradient tile its NVME_READ brought back
    mbase = base  # where the moment rows start in the layer's elements
    if op.buf is not None:  # moments (after the master) on NVMe: its NVME_READ filled this I/O buffer
        # Under data parallel the file (and so the buffer) holds this rank's shard only: from mbase on.
        m, (mbase, top) = h.nvme_rows.master_numel(li), h.nvme_rows.span(li)
        s = top - mbase
        state = ex._nvme_pool[op.buf][:(m + h.n_states * s) * 4].view(torch.float32)
        master = state[:m] if m else h.master(li)
        rows = [state[m + k * s:m + (k + 1) * s] for k in range(h.n_states)]
    else:
        master = h.master(li)
        rows = h.state_rows(li)
    carried = ctx.carried
    cfg = ctx.carried_optimizer if carried else ex.optimizer
    scale = ctx.carried_scale if carried else None

    def run() -> None:
        # Carried updates were checked by the caller, who drops them when a value was not finite.
        if not carried and (ctx.skip or not bool(ex._flags[li])):
            ctx.skip = True
            ctx.skipped.append(li)
            return
        new = master[lo - base:hi - base]
        total = ex.opt_kernel.update(new, grads[lo:hi], [r[lo - mbase:hi - mbase] for r in rows], h.steps[li],
                                     cfg, grad_scale=scale)
        # Finite gradients can still step a master to inf or NaN (lr x weight_decay > 2 flips
        # and grows it every step; moments that overflow), so the guard checks the result. A sum
        # propagates NaN and inf (one that overflows, weights near 3e38 / numel, counts too); the
        # kernel sums each chunk while it is in the cache (a separate read of the row cost about
        # 13% of the fused AdamW step's time on a 2-core CPU).
        if not bool(torch.isfinite(total)):
            ctx.nonfinite.append(li)
            ctx.skip = True  # with updates during backward: the later layers are not updated
        if op.buf is not None:
            ctx.unsaved.add(li)  # until its NVME_WRITE completes
        ctx.updated.append(li)
    return run


def _host_keys(ctx: _RunContext, op: Op) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(checkpoint, pinned region) keys of an OFFLOAD or RELOAD: the op names its pinned copy."""
    return [((vid, op.mb), (vid, op.copy)) for vid in ctx.graph.checkpoints(op.layer)]


def _offload(ctx: _RunContext, i: int, op: Op) -> Work:
    ex, g = ctx.ex, ctx.graph
    keys = _host_keys(ctx, op)
    arena = ex._arena
    acts = ctx.acts.view(i)

    def run() -> None:
        for key, hkey in keys:
            src = acts[key]
            ex.backend.record_use((src,))
            region = arena.view("offload", hkey)
            nbytes = src.numel() * src.element_size()
            if nbytes > region.numel():
                raise RuntimeError(
                    f"checkpoint {g.values[key[0]].name!r} of micro-batch {key[1]} has {nbytes} bytes "
                    f"but the trace gave it {region.numel()} (its pinned region, Schedule.layout.pinned): the "
                    "batch shape or dtype differs from the traced one; compile with the shapes you train on")
            dst = ex._host_acts[hkey] = region[:nbytes].view(src.dtype).view(src.shape)
            dst.copy_(src, non_blocking=True)
    return run


def _reload(ctx: _RunContext, i: int, op: Op) -> Work:
    ex = ctx.ex
    keys = _host_keys(ctx, op)
    dev = ex.backend.device
    acts = ctx.acts.view(i)

    def run() -> None:
        for key, hkey in keys:
            acts[key] = ex._host_acts[hkey].to(dev, non_blocking=True, copy=True)
    return run


def _nvme_io(read: bool) -> Handler:
    """The handler of NVME_READ (``read``) or NVME_WRITE: move layer ``op.layer``'s two Adam moments
    (after its master with ``Plan.nvme_masters``; ``op.buf``: I/O buffer of the executor's pool)
    or its deferred gradient tile (``op.gbuf``: a
    pinned gradient I/O buffer of the arena) between its NVMe file (``HostState.nvme``) and that
    buffer, on the I/O stream, and wait. The OPT that steps them in the buffer depends on the read;
    the moments' write depends on the OPT, a gradient tile's write on the D2H that filled the
    buffer. A failed transfer raises NvmeError naming the op and the file."""
    def handler(ctx: _RunContext, i: int, op: Op) -> Work:
        moments = op.buf is not None
        store, key = ctx.ex.host.nvme, ctx.ex.host.nvme_rows.key(op.layer) if moments else gradient_key(op.layer)
        if store is None or key not in store.tiles:
            what = "Adam moments" if moments else "gradient tile"
            raise ConfigError(f"op #{i} {op!r}: the schedule keeps layer {op.layer}'s {what} on NVMe, but "
                              "the host state has no NVMe file for it (it was made for another plan); compile "
                              "the trainer with this plan")
        buf = ctx.ex._nvme_pool[op.buf] if moments else ctx.bufs.nvme_gradients[op.gbuf].view(torch.uint8)
        move = store.read if read else store.write

        def run() -> None:
            try:
                move(key, buf).wait()
            except NvmeError as e:
                raise NvmeError(f"op #{i} {op!r}: {e}") from e
            if moments and not read:
                ctx.unsaved.discard(op.layer)
        return run
    return handler


def _reduced_tile(ctx: _RunContext, op: Op, numel: int) -> tuple[torch.Tensor, Any]:
    """The first ``numel`` elements of the step gradients a collective op reduces (the ring tile or
    accumulator it names) and the gloo group of every rank it reduces in (None: the default)."""
    tile = ctx.bufs.accumulators[op.acc] if op.acc is not None else ctx.bufs.ring[op.ring]
    return tile[:numel], None if ctx.ex.groups is None else ctx.ex.groups.world


def _require_fp32(tile: torch.Tensor) -> None:
    if tile.dtype != torch.float32:
        raise RuntimeError("data-parallel gradients must be FP32 on the host (Plan.d2h_dtype='float32')")


def _all_reduce(ctx: _RunContext, i: int, op: Op) -> Work:
    """Sum layer ``op.layer``'s step gradients (the ring tile or accumulator the op names) over the
    ``plan.data_parallel`` ranks of the default ``torch.distributed`` process group: each rank's
    are the gradient of its share of the global batch's loss (its summed token losses over the
    global count, :mod:`megatrain.runtime.loss`), so their sum is the gradient of that loss. Then
    recompute the layer's gradient norm from the reduced tile and AND the finite flags over the
    ranks, so every rank clips with the global norm and skips the same updates. Runs on the COMM
    host worker, in list order (rule 'collectives')."""
    ex, li = ctx.ex, op.layer
    tile, group = _reduced_tile(ctx, op, ctx.graph.layers[li].trainable_numel)

    def run() -> None:
        import torch.distributed as dist

        _require_fp32(tile)
        with collective(repr(op)):
            dist.all_reduce(tile, op=dist.ReduceOp.SUM, group=group)
        norm = torch.linalg.vector_norm(tile)
        flag = torch.tensor([1.0 if bool(ex._flags[li]) and bool(torch.isfinite(norm)) else 0.0])
        with collective(repr(op) + " (its finite flags)"):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        ex._norms[li] = norm
        ex._flags[li] = bool(flag.item())
    return run


def _reduce_scatter(ctx: _RunContext, i: int, op: Op) -> Work:
    """Sum layer ``op.layer``'s step gradients (the ring tile or accumulator the op names, each
    rank's of its share of the global batch's loss, as :func:`_all_reduce` sums them) over
    the ``plan.data_parallel`` ranks (of one node, or of every node when the state is sharded
    across them), but only on this rank's optimizer shard ``[lo, hi)`` (``LayerLayout.optimizer_shards``
    of ``Plan.update_shards``), the only part its OPT reads
    (``Plan.gradient_reduction == "reduce_scatter"``): ``torch.distributed.reduce_scatter_single``
    of the tile's first ``shards x per`` elements (equal chunks; ``LayerLayout.reduced_numel`` made the
    tile that long; the padding past the layer's parameters is zeroed first, so the collective sums
    only zeros there, whose results no one reads) into a scratch of ``per``, then into
    ``tile[lo:hi]``. Then the layer's global gradient norm: the shard's sum of
    squares, summed over the ranks in FLOAT64 (the square of an FP32 norm overflows FP32 above
    ~1.8e19, and float64 adds the ranks' partial squares with far less rounding than the FP32 norm
    carries), its square root rounded to FP32; the finite flags ANDed over the ranks as ALL_REDUCE
    does, so every rank clips and skips alike. Runs on the COMM host worker, in list order (rule
    'collectives')."""
    ex, li = ctx.ex, op.layer
    plan = ctx.schedule.plan
    n = ctx.graph.layers[li].trainable_numel
    shards = plan.update_shards
    span = ctx.layers[li]
    full = span.reduced_numel
    per = full // shards
    lo, hi = span.optimizer_shards[ex.shard_index]
    tile, group = _reduced_tile(ctx, op, full)

    def run() -> None:
        import torch.distributed as dist

        _require_fp32(tile)
        tile[n:].zero_()  # a wider layer's gradients may be there (ring tiles are shared)
        mine = torch.empty((per,), dtype=torch.float32)
        with collective(repr(op)):
            dist.reduce_scatter_single(mine, tile, op=dist.ReduceOp.SUM, group=group)
        shard = tile[lo:hi]
        shard.copy_(mine[:hi - lo])
        local = torch.linalg.vector_norm(shard, dtype=torch.float64)
        both = torch.stack([local * local, torch.tensor(0.0 if bool(ex._flags[li]) and bool(torch.isfinite(local))
                                                         else 1.0, dtype=torch.float64)])
        with collective(repr(op) + " (its squared norms and finite flags)"):
            dist.all_reduce(both, op=dist.ReduceOp.SUM, group=group)
        norm = both[0].sqrt()
        ex._norms[li] = norm.to(torch.float32)
        ex._flags[li] = bool(both[1].item() == 0) and bool(torch.isfinite(norm))
    return run


def _all_gather(ctx: _RunContext, i: int, op: Op) -> Work:
    """Give every rank of the node the shards of layer ``op.layer`` the others' OPTs stepped: on the
    node's shared host state they are in place already, so this waits until every rank of the node
    has reached it, and so finished its OPT of the layer (a barrier of the node's group; runs on the
    COMM host worker, in list order). With a gather tile (``op.tile``, ``Plan.host_state ==
    "shard"``): the layer's whole weights from every node's slice into that node-shared tile, in
    the compute dtype (``runtime.distributed.gather_weights``), for the H2D or CAST that depends on it."""
    ex = ctx.ex
    if op.tile is not None:
        if not ex.host.tile_layout.sliced or ex.host.data_parallel is None:
            raise ConfigError(f"op #{i} {op!r} gathers a sharded layer, but this host state holds whole tiles (it "
                              "was made for another plan); compile the trainer with this plan")
        from megatrain.runtime.distributed import gather_weights

        lo_hi = list(ctx.layers[op.layer].node_slices)
        dst = _gather_tile(ctx, op)

        def gather() -> None:
            with collective(repr(op)):
                gather_weights(ex.host, op.layer, lo_hi, dst, ex.host.data_parallel)
        return gather
    group = None if ex.groups is None else ex.groups.node

    def run() -> None:
        import torch.distributed as dist

        with collective(repr(op)):
            dist.barrier(group=group)
    return run


def _count_reduce(ctx: _RunContext, i: int, op: Op) -> Work:
    """Sum this rank's supervised tokens over the ranks (the gloo group of every rank): the divisor
    of the global batch's loss, which the loss layer's local backwards (after this op) seed their
    losses with. A loss that is not counted sums nothing, but every rank still takes part."""
    local = sum(ctx.targets) if ctx.counted else 0
    group = None if ctx.ex.groups is None else ctx.ex.groups.world

    def run() -> None:
        with collective(repr(op)):
            n = int(sum_over_ranks([local], torch.int64, group)[0])
        ctx.count(n if ctx.counted else None)
    return run


HANDLERS: dict[OpKind, Handler] = {
    OpKind.H2D: _h2d, OpKind.CAST: _cast, OpKind.FWD: _fwd, OpKind.RECOMPUTE: _fwd, OpKind.BWD: _bwd,
    OpKind.D2H: _d2h, OpKind.ACC: _acc, OpKind.OPT: _opt, OpKind.OFFLOAD: _offload, OpKind.RELOAD: _reload,
    OpKind.NVME_READ: _nvme_io(read=True), OpKind.NVME_WRITE: _nvme_io(read=False), OpKind.ALL_REDUCE: _all_reduce,
    OpKind.REDUCE_SCATTER: _reduce_scatter, OpKind.ALL_GATHER: _all_gather, OpKind.COUNT_REDUCE: _count_reduce,
}
"""How each op kind runs: ``HANDLERS[op.kind](ctx, i, op)`` returns the work the backend launches."""
assert set(HANDLERS) == set(OpKind), "every op kind needs a handler"


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


def _copy(dst: torch.Tensor, src: torch.Tensor) -> Work:
    def run() -> None:
        dst.copy_(src, non_blocking=True)
    return run


class _Activations:
    """The checkpoints on the device during one run, by generation (:mod:`megatrain.ir.liveness`).

    An op's work may run later than its launch (a GPU op waiting for a host op in the backend's
    pending queue) and on another thread (a fake CUDA stream's worker), so each op reads the
    generation the schedule's list order gives it, never whatever the dictionary holds when it
    runs, and a generation is dropped when the last of its readers has run, not when the last
    reader was launched. A read of a generation that is not there (its producer has not run: a
    dependency is missing) raises at once.
    """

    def __init__(self, live: Liveness):
        self._live_info = live
        self._gen_of: dict[tuple[tuple[int, int], int], int] = {
            (gen.key, gen.producer): k for k, gen in enumerate(live.generations)}
        self._left = [len(gen.readers) for gen in live.generations]
        self._live: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def put(self, key: tuple[int, int], producer: int, t: torch.Tensor) -> None:
        k = self._gen_of.get((key, producer))
        with self._lock:
            if k is not None and self._left[k] > 0:
                self._live[k] = t

    def put_batch(self, key: tuple[int, int], t: torch.Tensor) -> None:
        self.put(key, BATCH, t)

    def get(self, key: tuple[int, int], i: int) -> torch.Tensor:
        k = self._live_info.reads[i][key]
        try:
            return self._live[k]
        except KeyError:
            gen = self._live_info.generations[k]
            raise RuntimeError(f"op #{i} reads value {key[0]} of micro-batch {key[1]} as op #{gen.producer} put it on "
                               "the device, but that op has not run yet: the schedule lacks a dependency (or a "
                               "backend ran an op before its dependencies)") from None

    def view(self, i: int) -> "_ActivationsView":
        return _ActivationsView(self, i)

    def release(self, i: int) -> None:
        with self._lock:
            for k in self._live_info.reads[i].values():
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


def _then(fn: Work, after: Work) -> Work:
    """``fn`` then ``after``, as one op's work (run wherever and whenever the backend runs it)."""
    def run() -> None:
        fn()
        after()
    return run


__all__ = ["DeferredUpdates", "DeviceRng", "Executor", "HANDLERS", "StepOutput", "TokenHead", "backward_body",
           "local_backward", "replaying_rng"]
