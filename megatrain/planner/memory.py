"""Memory: how many GPU and host bytes a plan holds, per rank and per node.

The solver, the CLI's report and the runtime's preflight read these totals; the regions they count
are laid out by :mod:`megatrain.ir.layout` (which lowering records in ``Schedule.layout``) and the
activation events come from :mod:`megatrain.planner.activations`.

Memory (bytes). GPU: weight slots, ``numel x compute_itemsize`` each, and gradient slots,
``trainable_numel x plan.gradient_itemsize`` each, sized per slot (:func:`slot_numels`): each of the ``plan.slots``
streaming slots for the widest layer that is not resident, each resident layer's slot for that
layer alone (an embedding or LM head much wider than a block then costs only its own slot); buffers
``sum(layer.buffer_bytes)``; the reserve (:func:`gpu_reserve`: CUDA context, cuBLAS workspaces, the
caching allocator's rounding and per-stream pools, or a measured figure); and, varying over the step,
checkpoints, boundary gradients and the working memory of the running compute op
(:func:`activation_liveness`). Host: 12 bytes per tile element for the FP32 master and the two
Adam moments; with per-micro-batch passes also FP32 gradient accumulators, ``trainable_numel x 4``
per trainable layer (pageable: only the host reads and writes them); with BF16 gradients that the
optimizer reads from a host tile, one FP32 scratch of ``OPT_CHUNK_ELEMENTS`` per host worker thread
(pageable, 2 MiB each; :func:`gradient_scratch_numel`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megatrain.optim import OPTIMIZERS
from megatrain.ir.graph import LayerGraph
from megatrain.ir.hardware import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, HardwareSpec, host_worker_threads
from megatrain.ir.layout import (GRAD_ITEMSIZE, MASTER_BYTES_PER_ELEMENT, gather_buffer_bytes, gather_scratch_bytes,
                                 gradient_scratch_numel, nvme_buffers, pinned_buffers,
                                 pinned_master_bytes, reduced_numel, shared_staging_bytes, slot_numels,
                                 state_bytes_per_param)
from megatrain.ir.plan import Plan
from megatrain.ir.schedule import COMPUTE_KINDS, OpKind, Schedule, Stream
from megatrain.planner.activations import ActivationLiveness, activation_liveness
from megatrain.units import MiB, human_bytes


def dynamic_peaks(schedule: Schedule, live: ActivationLiveness) -> tuple[int, int, int]:
    """(activations peak, working peak, peak of their sum) over the compute ops in stream order."""
    cur = act_peak = dyn_peak = live.at_start
    work_peak = 0
    for i, op in enumerate(schedule.ops):
        if op.stream is not Stream.COMPUTE:
            continue
        cur += live.alloc[i]
        act_peak = max(act_peak, cur)
        work_peak = max(work_peak, live.work[i])
        dyn_peak = max(dyn_peak, cur + live.work[i])
        cur -= live.free[i]
    return act_peak, work_peak, dyn_peak


def pool_peaks(schedule: Schedule, live: ActivationLiveness, working: bool = True) -> dict[Stream, int]:
    """Peak bytes of each CUDA caching-allocator pool over the compute ops in stream order, by the
    accounting of :class:`ActivationLiveness`: the compute stream's (checkpoints it computed,
    boundary gradients, batch inputs and, with ``working``, the running op's working memory) and
    the H2D stream's (checkpoints RELOADs brought back). Their sum is at least the combined
    ``dynamic_peak``; the difference is memory the per-stream pools cannot share."""
    cur = live.at_start
    reloaded = 0
    peaks = {Stream.COMPUTE: cur, Stream.H2D: 0}
    ralloc = live.reload_alloc or (0,) * len(live.alloc)
    rfree = live.reload_free or (0,) * len(live.free)
    for i, op in enumerate(schedule.ops):
        if op.stream is not Stream.COMPUTE:
            continue
        cur += live.alloc[i] - ralloc[i]
        reloaded += ralloc[i]
        peaks[Stream.COMPUTE] = max(peaks[Stream.COMPUTE], cur + (live.work[i] if working else 0))
        peaks[Stream.H2D] = max(peaks[Stream.H2D], reloaded)
        cur -= live.free[i] - rfree[i]
        reloaded -= rfree[i]
    return peaks


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes a plan holds, by purpose, as a CLI prints them (``rows()``, ``format()``).

    Host: ``master_weights`` (FP32) and ``adam_moments`` (the FP32 state rows of the plan's
    optimizer, ``optimizer_name``: AdamW's two moments, Lion's one, :func:`state_bytes_per_param`)
    persist; the gradient
    and staging rings, the offloaded-checkpoint space and the per-layer norms and flags
    (``pinned_norms``) are pinned, each in whole pages (:func:`pinned_buffers`);
    ``gradient_accumulators`` (per-micro-batch passes only) and ``gradient_scratch`` (the FP32
    widening of BF16 gradients for the optimizer, :func:`widens_gradients`) are pageable.
    ``adam_moments`` counts the layers whose moments are in host memory only: those of
    ``Plan.nvme_moments`` live in their NVMe files and pass through the pageable I/O buffers
    (``nvme_buffers``, :func:`nvme_buffers`); likewise ``master_weights`` leaves out the masters of
    ``Plan.nvme_masters`` (their layers' staging tiles, in ``staging_ring``, hold the BF16 copy
    H2D reads). ``state_pinned`` is true
    when the master rows must be pinned too (``pinned_masters`` bytes, :func:`pinned_master_bytes`):
    with FP32 compute the H2D reads the master row directly, and a DMA needs page-locked memory.
    The moments are never pinned. ``host_pinned`` is the bytes the runtime page-locks, exactly.
    ``reference_weights``: a frozen BF16 copy of every weight for a reference model (preference
    and RL training, :class:`megatrain.rl.Reference`; pageable, 2 bytes per tile element), where
    the plan was asked to hold one (``megatrain.planner.front.Storage.reference``), else 0.

    GPU: ``weight_slots``, ``gradient_slots``, ``buffers`` and ``reserve`` are allocated for the
    whole step; ``activations_peak`` (checkpoints, boundary gradients, batch inputs) and
    ``working_peak`` (the running compute op's transients) vary, and ``dynamic_peak`` is the peak
    of their sum at one instant, at most the sum of the two peaks. ``graph_pool``: with
    ``Plan.cuda_graphs``, what the captured graphs hold for the whole step (:func:`graph_pool_bytes`).
    """

    master_weights: int
    adam_moments: int
    gradient_ring: int
    staging_ring: int
    pinned_activations: int
    state_pinned: bool
    pinned_masters: int
    pinned_norms: int
    gradient_accumulators: int
    weight_slots: int
    gradient_slots: int
    buffers: int
    activations_peak: int
    working_peak: int
    dynamic_peak: int
    reserve: int
    gradient_scratch: int = 0
    nvme_buffers: int = 0
    nvme_gradient_buffers: int = 0
    shared_staging: int = 0
    reserve_parts: GpuReserve | None = None
    optimizer_name: str = "adamw"
    graph_pool: int = 0
    reference_weights: int = 0

    @property
    def host_total(self) -> int:
        return (self.master_weights + self.adam_moments + self.gradient_ring + self.staging_ring
                + self.pinned_activations + self.pinned_norms + self.gradient_accumulators
                + self.gradient_scratch + self.nvme_buffers + self.nvme_gradient_buffers + self.shared_staging
                + self.reference_weights)

    @property
    def host_pinned(self) -> int:
        return (self.pinned_masters + self.gradient_ring + self.staging_ring + self.pinned_activations
                + self.pinned_norms + self.nvme_gradient_buffers + self.shared_staging)

    @property
    def gpu_fixed(self) -> int:
        """GPU bytes allocated for the whole step."""
        return self.weight_slots + self.gradient_slots + self.buffers + self.reserve

    @property
    def gpu_peak(self) -> int:
        """GPU bytes at the step's peak: the fixed ones plus the dynamic peak, or with CUDA graphs
        (``graph_pool``) the activations' peak beside the pool where that is larger."""
        return self.gpu_fixed + max(self.dynamic_peak, self.activations_peak + self.graph_pool)

    def budgets(self, hw: HardwareSpec) -> tuple[tuple[str, int, int], ...]:
        """``(what, bytes needed, bytes hw has)`` for each limit a plan must stay within: GPU memory
        at the step's peak, pinned host memory against ``hw``'s cap, and host memory in total.
        The one definition of "fits" (:meth:`fits`, :meth:`host_fits`, the verifier's budget rule)."""
        return (("GPU memory", self.gpu_peak, hw.gpu_memory_bytes),
                ("pinned host memory", self.host_pinned, hw.pinned_memory_cap_bytes),
                ("host memory", self.host_total, hw.host_memory_bytes))

    def fits(self, hw: HardwareSpec) -> bool:
        """Whether every budget (:meth:`budgets`) holds on ``hw``."""
        return all(need <= have for _, need, have in self.budgets(hw))

    def host_fits(self, hw: HardwareSpec) -> bool:
        """Whether the host budgets hold on ``hw`` (host memory and its pinned cap), GPU aside."""
        return all(need <= have for what, need, have in self.budgets(hw) if what != "GPU memory")

    def on_cpu(self) -> "MemoryBreakdown":
        """This breakdown as the CPU backend runs it: no GPU reserve (there is no CUDA context,
        cuBLAS workspace or caching allocator to hold one), so :meth:`rows` lists none."""
        return dataclasses.replace(self, reserve=0, reserve_parts=None)

    def _moments_label(self) -> str:
        spec = OPTIMIZERS[self.optimizer_name]
        return f"{spec.label} moments (FP32 x{len(spec.states)})"

    def rows(self) -> list[tuple[str, str, int]]:
        """``(where, what, bytes)`` rows for a table, totals last in each section."""
        return [
            ("host", "FP32 master weights", self.master_weights),
            ("host", self._moments_label(), self.adam_moments),
            ("host", "gradient ring (pinned)", self.gradient_ring),
            ("host", "BF16 staging ring (pinned)", self.staging_ring),
            ("host", "offloaded checkpoints (pinned)", self.pinned_activations),
            ("host", "FP32 master rows (pinned)", self.pinned_masters),
            ("host", "gradient norms and flags (pinned)", self.pinned_norms),
            ("host", "gradient accumulators (FP32)", self.gradient_accumulators),
            ("host", "gradient widening scratch (FP32)", self.gradient_scratch),
            ("host", "BF16 reference weights (frozen)", self.reference_weights),
            ("host", f"NVMe I/O buffers ({OPTIMIZERS[self.optimizer_name].label} moments)", self.nvme_buffers),
            ("host", "NVMe I/O buffers (gradient tiles, pinned)", self.nvme_gradient_buffers),
            ("host", "BF16 staging tiles shared by the node (pinned)", self.shared_staging),
            ("host", "total", self.host_total),
            ("host", "of which pinned", self.host_pinned),
            ("gpu", "weight slots", self.weight_slots),
            ("gpu", "gradient slots", self.gradient_slots),
            ("gpu", "buffers", self.buffers),
            ("gpu", "checkpoints + boundary grads (peak)", self.activations_peak),
            ("gpu", "working memory (peak)", self.working_peak),
            *([("gpu", "reserve: CUDA context, workspaces, allocator", self.reserve)]
              if self.reserve or self.reserve_parts is not None else []),
            *([("gpu", "CUDA graph pool and static buffers", self.graph_pool)] if self.graph_pool else []),
            ("gpu", "peak", self.gpu_peak),
        ]

    def format(self) -> str:
        """The rows as an aligned text table with binary units."""
        width = max(len(what) for _, what, _ in self.rows())
        return "\n".join(f"{where:<5} {what:<{width}} {human_bytes(b):>10}"
                         for where, what, b in self.rows())


ROUND_LARGE_BYTES = 2 * MiB
"""The CUDA caching allocator rounds a block over 1 MiB it takes from the driver up to 2 MiB
(``kRoundLarge``), and hands out a cached block up to 1 MiB larger than asked rather than split
it (``kSmallSize``), so each tensor of a plan wastes less than this (PyTorch
``c10/cuda/CUDACachingAllocator.cpp``, constants in ``c10/core/AllocatorConfig.h``)."""

SEGMENT_BYTES = 20 * MiB + 2 * MiB
"""What one stream's pools can hold beyond their tensors at the segment level: requests of 1 to 10
MiB are served from 20 MiB segments (``kLargeBuffer``, ``kMinLargeAlloc``) and those up to 1 MiB from
2 MiB ones (``kSmallBuffer``); one partly used segment of each per stream (same source)."""

ALLOCATING_STREAMS = 3
"""Streams whose ops allocate from the caching allocator, each a pool of its own: compute (outputs,
gradients, working memory), H2D (reloaded checkpoints), D2H (gradient norms)."""

SLOT_TENSORS = 2
"""Device tensors per weight slot: the weights and the gradients (:class:`GpuReserve` rounds each)."""

CUBLAS_HANDLES = 2
"""cuBLAS handles that run GEMMs on the compute stream, each with its own workspace (PyTorch keys
workspaces by (handle, stream) and hands each thread its own handle): the issuing thread's (forward
and recompute) and the autograd engine's device thread's (the backward's GEMMs). No other stream
runs a GEMM."""


@dataclass(frozen=True, slots=True)
class GpuReserve:
    """GPU bytes a step needs beyond the plan's own tensors (``MemoryBreakdown.reserve``), by cause.

    ``context``: the CUDA context and loaded kernel modules (``hw.cuda_context_bytes``);
    ``workspaces``: :data:`CUBLAS_HANDLES` cuBLAS/cuBLASLt workspaces (``hw.cublas_workspace_bytes``);
    ``rounding``: the caching allocator's rounding, :data:`ROUND_LARGE_BYTES` per tensor alive at the
    step's busiest instant (``tensors``: slots, buffers, checkpoints, boundary gradients, and the
    running op's intermediates, at most one per aten op it dispatches) plus :data:`SEGMENT_BYTES`
    per :data:`ALLOCATING_STREAMS`; ``pools``: what per-stream pools cannot share (:func:`pool_peaks`:
    their peaks' sum less the combined dynamic peak; 0 without RELOADs). Attention's own buffers
    (the FlashAttention-2 backward's FP32 dq accumulator and softmax sums) are part of each layer's
    working memory (``Layer.work_bytes``), not of this. ``measured``: the spec's
    ``gpu_reserve_bytes`` (a measured figure), which replaces the sum when given.
    """

    context: int
    workspaces: int
    tensors: int
    pools: int
    measured: int | None = None

    @property
    def rounding(self) -> int:
        """:data:`ROUND_LARGE_BYTES` per tensor of ``tensors`` plus :data:`SEGMENT_BYTES` per stream."""
        return ROUND_LARGE_BYTES * self.tensors + SEGMENT_BYTES * ALLOCATING_STREAMS

    @property
    def derived(self) -> int:
        return self.context + self.workspaces + self.rounding + self.pools

    def with_slots(self, extra: int) -> "GpuReserve":
        """The reserve with ``extra`` more weight slots (a weight and a gradient tensor each)."""
        return dataclasses.replace(self, tensors=self.tensors + SLOT_TENSORS * extra)

    @property
    def total(self) -> int:
        return self.measured if self.measured is not None else self.derived

    def describe(self) -> str:
        """One line: the parts (or that the spec's measured figure is used), binary units."""
        if self.measured is not None:
            return f"measured (HardwareSpec.gpu_reserve_bytes); derived would be {human_bytes(self.derived)}"
        return (f"context {human_bytes(self.context)} + cuBLAS workspaces {human_bytes(self.workspaces)} + "
                f"allocator rounding {human_bytes(self.rounding)} + per-stream pools {human_bytes(self.pools)}")


def gpu_reserve(graph: LayerGraph, plan: Plan, schedule: Schedule, hw: HardwareSpec | None = None,
                live: ActivationLiveness | None = None) -> GpuReserve:
    """The GPU reserve of running ``schedule`` (see :class:`GpuReserve`); ``hw`` gives the context and
    workspace sizes (their defaults, :data:`~megatrain.ir.hardware.CUDA_CONTEXT_BYTES` and
    :data:`~megatrain.ir.hardware.CUBLAS_WORKSPACE_BYTES`, without it) or a measured reserve."""
    live = live if live is not None else activation_liveness(schedule, graph)
    layers = graph.layers
    # Tensors alive at once: the slots (weights and gradients), the layers' buffers, the batch
    # inputs, and at each compute op the checkpoints and gradients alive plus its intermediates.
    fixed = SLOT_TENSORS * weight_slot_count(plan) + sum(len(layer.buffers) for layer in layers) + 2
    cur = len(graph.batch_inputs) * plan.micro_batches
    most = cur
    for i, op in enumerate(schedule.ops):
        if op.kind not in COMPUTE_KINDS:
            continue
        cur += live.alloc_n[i] if live.alloc_n else 0
        layer = layers[op.layer]
        most = max(most, cur + (layer.bwd_launches if op.kind is OpKind.BWD else layer.fwd_launches))
        cur -= live.free_n[i] if live.free_n else 0
    _, _, dyn = dynamic_peaks(schedule, live)
    return GpuReserve(
        context=hw.cuda_context_bytes if hw is not None else CUDA_CONTEXT_BYTES,
        workspaces=CUBLAS_HANDLES * (hw.cublas_workspace_bytes if hw is not None else CUBLAS_WORKSPACE_BYTES),
        tensors=fixed + most,
        pools=max(0, sum(pool_peaks(schedule, live).values()) - dyn),
        measured=hw.gpu_reserve_bytes if hw is not None else None)


def graph_pool_bytes(graph: LayerGraph, schedule: Schedule) -> int:
    """GPU bytes the CUDA graphs of ``Plan.cuda_graphs`` hold for the whole step
    (:mod:`megatrain.runtime.graphs`; 0 without them), counted from the compute ops of ``schedule``.

    The graphs share one memory pool, replayed one at a time on the compute stream, so the pool
    holds the largest captured op's intermediates (its ``Layer.work_bytes``) once, plus each graph's
    outputs, which stay allocated between replays (a forward's output values; a local backward's
    input gradients and loss). The static input buffers are shared by position, shape and dtype
    across graphs: at most the widest compute op's inputs and incoming gradients. One graph per
    (template, slot) and kind, and for a local backward per way it treats the slot (written by a
    visit's first micro-batch, added to by the others).

    An upper bound by construction: the intermediates of an op that is not captured (none, with
    graphs on) would come from the caching allocator and are counted in ``working_peak`` too."""
    if not schedule.plan.cuda_graphs:
        return 0
    layers, values = graph.layers, graph.values
    plan = schedule.plan
    keys: set[tuple] = set()
    work = statics = outputs = 0
    for op in schedule.ops:
        if op.kind not in COMPUTE_KINDS:
            continue
        layer = layers[op.layer]
        backward = op.kind is OpKind.BWD
        fresh = op.mb == 0 or not plan.layer_by_layer
        key = (layer.template, op.slot, backward, fresh if backward else None)
        ins = sum(values[v].nbytes for v in layer.inputs)
        outs = sum(values[v].nbytes for v in layer.outputs)
        work = max(work, layer.work_bytes)
        statics = max(statics, ins + (outs if backward else 0))
        if key not in keys:
            keys.add(key)
            outputs += sum(values[v].nbytes for v in layer.inputs if values[v].requires_grad) + 4 if backward \
                else outs
    return work + statics + outputs


def weight_slot_count(plan: Plan) -> int:
    """Streaming slots plus one slot per resident layer."""
    return plan.slots + len(plan.resident)


def slot_bytes(graph: LayerGraph, slots: int, resident: frozenset[int] | set[int],
               compute_itemsize: int, gradient_itemsize: int = GRAD_ITEMSIZE) -> tuple[int, int]:
    """GPU bytes of the weight slots (compute dtype) and of the gradient slots (``gradient_itemsize``:
    the plan's :attr:`Plan.gradient_itemsize`, FP32 by default) of :func:`slot_numels`."""
    sizes = slot_numels(graph, slots, resident)
    return (sum(w for w, _ in sizes) * compute_itemsize, sum(g for _, g in sizes) * gradient_itemsize)


def memory_breakdown(graph: LayerGraph, plan: Plan, hw: HardwareSpec | None = None,
                     schedule: Schedule | None = None) -> MemoryBreakdown:
    """Host and GPU bytes of running ``graph`` under ``plan``.

    The activation peaks depend on the order of the compute ops, which ``schedule`` gives; when
    it is None the plan is lowered here (``lower(graph, plan)``, which raises PlanError for what
    lowering does not implement). ``hw`` supplies the sizes the GPU reserve is derived from, or a
    measured reserve (:func:`gpu_reserve`); without it the defaults are used.
    """
    if schedule is None:
        from megatrain.planner.lower import lower

        schedule = lower(graph, plan)
    layers = graph.layers
    weight_slots, gradient_slots = slot_bytes(graph, plan.slots, plan.resident, plan.compute_itemsize,
                                              plan.gradient_itemsize)
    pinned = pinned_buffers(graph, plan, "train")
    live = activation_liveness(schedule, graph)
    act, work, dyn = dynamic_peaks(schedule, live)
    reserve = gpu_reserve(graph, plan, schedule, hw, live)
    bf16 = plan.compute_dtype == "bfloat16"
    return MemoryBreakdown(
        master_weights=sum(layer.numel for i, layer in enumerate(layers)
                           if i not in plan.nvme_masters) * MASTER_BYTES_PER_ELEMENT,
        adam_moments=sum(layer.trainable_numel for i, layer in enumerate(layers)
                         if i not in plan.nvme_moments) * state_bytes_per_param(plan),
        optimizer_name=plan.optimizer_name,
        gradient_ring=pinned.bytes_of("ring"),
        staging_ring=pinned.bytes_of("staging"),
        pinned_activations=pinned.bytes_of("offload"),
        state_pinned=not bf16,
        pinned_masters=pinned_master_bytes(graph, plan),
        pinned_norms=pinned.bytes_of("norms") + pinned.bytes_of("flags"),
        gradient_accumulators=(sum(reduced_numel(layer.trainable_numel, plan) for layer in layers) * GRAD_ITEMSIZE
                               if plan.accumulates_on_host else 0),
        weight_slots=weight_slots,
        gradient_slots=gradient_slots,
        buffers=sum(layer.buffer_bytes for layer in layers),
        activations_peak=act,
        working_peak=work,
        dynamic_peak=dyn,
        reserve=reserve.total,
        reserve_parts=reserve,
        gradient_scratch=gradient_scratch_numel(graph, plan, host_worker_threads(hw.host_cores, plan.gpus_per_node)
                                                if hw is not None and hw.host_cores else 1) * GRAD_ITEMSIZE,
        nvme_buffers=math.prod(nvme_buffers(graph, plan)),
        nvme_gradient_buffers=pinned.bytes_of("nvme_gradients"),
        shared_staging=shared_staging_bytes(graph, plan),
        graph_pool=graph_pool_bytes(graph, schedule),
    )


@dataclass(frozen=True, slots=True)
class NodeMemory:
    """Host bytes of one node that runs ``ranks`` ranks of a plan (all sizes in bytes).

    ``persistent``: the FP32 masters and Adam moments the node holds, one copy shared by its ranks
    (all of them, or ``1 / nodes`` when the state is sharded); ``per_rank``: what each rank holds on
    its own besides (gradient and staging tiles, offloaded checkpoints, norms and flags, gradient
    accumulators and scratch: :class:`MemoryBreakdown` less its masters and moments);
    ``gather_buffers``: the pinned tiles sharded weights are gathered into; ``shared_staging``:
    the BF16 staging tiles the node's ranks share (``Plan.shared_cast``, counted once per copy, in
    ``shared_pinned`` too); ``gather_scratch``: the weight gathers' pageable send and receive
    buffers (:func:`gather_scratch_bytes`). Pinned: the shared master rows (FP32 compute; none with a sharded state,
    whose H2Ds read the gather tiles), shared staging tiles and gather buffers, plus each rank's own.
    """

    ranks: int
    persistent: int
    per_rank: int
    gather_buffers: int
    shared_pinned: int
    per_rank_pinned: int
    shared_staging: int = 0
    gather_scratch: int = 0

    @property
    def total(self) -> int:
        return (self.persistent + self.gather_buffers + self.gather_scratch + self.shared_staging
                + self.ranks * self.per_rank)

    @property
    def pinned(self) -> int:
        return self.shared_pinned + self.gather_buffers + self.ranks * self.per_rank_pinned

    def budgets(self, hw: HardwareSpec) -> tuple[tuple[str, int, int], ...]:
        """``(what, bytes needed, bytes one node of hw has)`` for host memory and its pinned cap."""
        return (("host memory per node", self.total, hw.host_memory_bytes),
                ("pinned host memory per node", self.pinned, hw.pinned_memory_cap_bytes))

    def fits(self, hw: HardwareSpec) -> bool:
        return all(need <= have for _, need, have in self.budgets(hw))


def node_memory(graph: LayerGraph, plan: Plan, mem: MemoryBreakdown) -> NodeMemory:
    """The :class:`NodeMemory` of ``plan`` (``plan.gpus_per_node`` ranks per node, ``plan.host_state``)
    from one rank's :func:`memory_breakdown` ``mem`` of ``graph``."""
    ways = plan.nodes if plan.host_state == "shard" else 1
    copies = plan.gpus_per_node // plan.optimizer_shards  # groups of ranks that share a copy
    state = mem.master_weights + mem.adam_moments
    gather = gather_buffer_bytes(graph, plan)
    # Plan.shared_cast: the staging tiles are a node's, like the state it shares (one per copy).
    staging = mem.shared_staging
    return NodeMemory(ranks=plan.gpus_per_node, persistent=copies * -(-state // ways),
                      per_rank=mem.host_total - state - staging, gather_buffers=gather,
                      shared_pinned=_shared_pinned_masters(mem.pinned_masters, plan) + copies * staging,
                      per_rank_pinned=mem.host_pinned - mem.pinned_masters - staging, shared_staging=copies * staging,
                      gather_scratch=gather_scratch_bytes(graph, plan))


def _shared_pinned_masters(pinned_masters: int, plan: Plan) -> int:
    """Pinned bytes of a node's shared master rows, from one copy's ``pinned_masters``: one per group
    of ranks sharing a copy; none with a sharded state, whose H2Ds read the (pinned) gather tiles,
    not the master rows (``runtime.host.HostState.master_pins``)."""
    if plan.host_state == "shard":
        return 0
    return plan.gpus_per_node // plan.optimizer_shards * pinned_masters


def persistent_state_bytes(graph: LayerGraph, plan: Plan | None = None) -> int:
    """Bytes of the persistent host state of ``graph``: FP32 masters of every tile element and the
    optimizer state of ``plan``'s optimizer (None: AdamW's two FP32 moments) per trainable
    parameter (``MemoryBreakdown.master_weights + adam_moments``)."""
    return (sum(layer.numel for layer in graph.layers) * MASTER_BYTES_PER_ELEMENT
            + sum(layer.trainable_numel for layer in graph.layers) * state_bytes_per_param(plan))


def rank_host_budgets(graph: LayerGraph, plan: Plan, hw: HardwareSpec) -> tuple[int, int]:
    """``(host bytes, pinned bytes)`` one rank may plan for, counting the full persistent state in
    it as :func:`memory_breakdown` does, such that a rank's breakdown within them is exactly a
    node within ``hw`` (:meth:`NodeMemory.fits`): ``state + (node bytes - node's state) / G`` and
    the same for the pinned masters and cap. Negative when the node's share of the state alone
    exceeds it. ``plan`` gives the topology and compute dtype, and with ``shared_cast`` the node's
    shared staging tiles (:func:`shared_staging_bytes`, counted like the state); its other knobs
    are not read."""
    g, ways = plan.gpus_per_node, (plan.nodes if plan.host_state == "shard" else 1)
    copies = g // plan.optimizer_shards
    state = persistent_state_bytes(graph, plan)
    masters = pinned_master_bytes(graph, plan)
    gather = gather_buffer_bytes(graph, plan)
    staging = shared_staging_bytes(graph, plan)  # a rank's breakdown counts the node's tiles whole, as the state
    scratch = gather_scratch_bytes(graph, plan)
    host = state + staging + (hw.host_memory_bytes - copies * -(-state // ways) - copies * staging - gather
                              - scratch) // g
    pinned = masters + staging + (hw.pinned_memory_cap_bytes - _shared_pinned_masters(masters, plan)
                                  - copies * staging - gather) // g
    return host, pinned


__all__ = ["pool_peaks", "MemoryBreakdown", "ROUND_LARGE_BYTES", "SEGMENT_BYTES", "ALLOCATING_STREAMS",
           "SLOT_TENSORS", "CUBLAS_HANDLES", "GpuReserve", "gpu_reserve", "weight_slot_count", "slot_bytes",
           "memory_breakdown", "NodeMemory", "node_memory", "persistent_state_bytes", "rank_host_budgets",
           "graph_pool_bytes"]
