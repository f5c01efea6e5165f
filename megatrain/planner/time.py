"""Time: how long each op takes on a HardwareSpec, the resources the streams run on, and model FLOPs and MFU.

The simulator, the solver's bounds and the CLI call these functions and never re-derive a formula (FlexGen's
``cost_model.py`` shows what goes wrong when each constraint re-derives its own sizes). Bytes a plan
holds are :mod:`megatrain.planner.memory`'s; where they go, :mod:`megatrain.ir.layout`'s.

Op times. Every op costs ``hw.op_latency_s`` plus its work over the rate of the resource it uses:

- ``H2D``: ``layer.numel x plan.compute_itemsize`` bytes over ``h2d_bytes_per_s`` (a BF16 tile a
  CAST has just written: ``h2d_after_cast_bytes_per_s`` where measured). The tile is copied whole,
  alignment padding included, so ``numel`` (not the parameter count) is moved.
- ``D2H``: ``layer.trainable_numel x plan.gradient_itemsize`` bytes over ``d2h_bytes_per_s``
  (FP32 gradients, or BF16 ones where they are exact: :attr:`Plan.gradient_dtype`), after the
  slot's norm on the GPU.
- ``FWD``/``BWD`` (one micro-batch; the local backward includes its recompute), kernel by kernel
  where the layer has a kernel profile (every op its template dispatches, traced:
  :mod:`megatrain.ir.profile`) and ``hw`` the kernel rates (:func:`kernel_time`: matmuls by the
  roofline of their FLOPs and bytes, fused attention at its own rate, element-wise work by its
  bytes, a fixed cost per kernel); the issuing thread's time per dispatched op interleaves with
  them (:class:`ComputeWork`). Otherwise (a graph built by hand, a spec without the rates)
  ``layer.fwd_flops`` / ``layer.bwd_flops`` over the matmul rate of ``plan.compute_dtype`` times
  ``hw.matmul_efficiency``.
- ``OPT``: ``layer.trainable_numel`` over the host AdamW rate (:func:`optimizer_rate`): from FP32
  gradients ``host_optimizer_params_per_s``; from BF16 gradients read from a host tile (widened
  chunk by chunk, :mod:`megatrain.runtime.host_kernels`: 26 bytes of DRAM traffic per parameter
  where the chunks stay in the cache, 34 where they do not, 28 with FP32 gradients)
  ``host_optimizer_bf16_params_per_s``. Both are measured on tiles larger than the last-level cache
  (:func:`megatrain.runtime.measure.measure_hardware`).
- ``RECOMPUTE``: as ``FWD``.
- ``OFFLOAD``/``RELOAD``: the bytes of the layer's outputs that some layer reads (one micro-batch)
  over ``d2h_bytes_per_s`` / ``h2d_bytes_per_s``.
- ``CAST``: ``layer.numel`` FP32 reads and BF16 writes (6 bytes per element) on the host, at the
  measured ``host_cast_elements_per_s`` (:func:`cast_rate`; 2.9-3.4x AdamW's parameter rate at 1
  thread and 1.2-2.0x at 2 on a shared 2-core EPYC VM, not the 28 / 6 = 4.67x that bytes predict).
- ``ACC``: ``layer.trainable_numel`` additions into an FP32 accumulator on the host: the tile
  (``plan.gradient_itemsize``) and the accumulator read, the accumulator written, at AdamW's
  memory-bound rate scaled by bytes (``ADAMW_BYTES_PER_PARAM``; micro-batch 0's copy moves a
  read less and is counted the same).
- ``ALL_REDUCE`` (data parallel): a hierarchical ring all-reduce of the FP32 step gradients over
  ``plan.gpus_per_node`` GPUs per node and ``plan.nodes`` nodes (:func:`all_reduce_time`).
- ``REDUCE_SCATTER`` (``Plan.gradient_reduction == "reduce_scatter"``, one node): a ring
  reduce-scatter of them over the node's GPUs, half the all-reduce's bytes (:func:`reduce_scatter_time`).
- ``COUNT_REDUCE`` (data parallel): the same all-reduce of one int64 count (:func:`count_reduce_time`).

Data parallel (``plan.data_parallel`` ranks on ``plan.nodes`` nodes). The ranks of a node share its
host memory bandwidth (:func:`host_rate`); ``plan.optimizer_shards`` of them share one copy of the
masters and moments (:func:`node_memory`), each rank's OPT stepping its shard of every tile
(:func:`optimizer_numel`). With ``plan.host_state == "shard"`` a node
holds and updates ``1 / nodes`` of the state and every H2D first all-gathers the layer's weights
over the network (:func:`weight_gather_time`).

The issuing thread. One Python thread issues every GPU op (:func:`launch_times`); a host op whose
kernel holds the GIL stops it while that kernel runs (:func:`issue_stall`: DeepSpeed's CPU Adam, whose
binding never releases the GIL, for the OPT's leading 28/32, the finite check's sum after it releasing it;
``hardware.HOST_KERNEL_ISSUE_STALL``). The simulator
(:mod:`megatrain.planner.simulate`) plays it against the GPU.

Contention. A weight copy to the GPU and a layer's compute slow each other where ``hw`` measured it
(``h2d_beside_compute_bytes_per_s``, ``compute_slowdown_beside_h2d``: ``bench/gpu_probe.py``'s
``launch.forward_beside_h2d``; the first H100 step's block forwards took 2.06 ms alone and 2.75
beside an H2D, its copies ran at ~42 GB/s beside forwards against 54 alone). :func:`contention_rates`
gives each op's share of its speed alone while the other runs; the simulator applies it over their
overlap. A copy in flight may also slow the issuing thread (``issue_slowdown_beside_h2d``, the
probe's same-thread forward beside copies it queued), which the simulator applies to the thread's
clock, not here. Op times here are always the times alone.

Resources. Each stream is an in-order queue on one resource; H2D and D2H are separate resources
when ``hw.duplex`` and one shared copy engine otherwise (:func:`resource_of`), which the simulator
serialises. The HOST and CAST streams share one: the runtime runs their work one op at a time,
each with the rank's whole thread budget (:func:`host_worker_threads`), the threads the host rates
are measured with.

FLOPs. Model FLOPs follow PaLM's model FLOPs utilisation (Chowdhery et al. 2022, "PaLM: Scaling
Language Modeling with Pathways", appendix B): the FLOPs of one forward and backward of the model
per token, with recompute not counted, over the step time and the peak rate. The backward is
counted as twice the forward, so model FLOPs = 3 x the sum of the layers' traced forward FLOPs
(which include attention as the kernels compute it) per micro-batch.
"""

from __future__ import annotations

from typing import Callable

from megatrain.errors import ConfigError
from megatrain.ir.enums import IdentityEnum
from megatrain.ir.graph import Layer, LayerGraph
from megatrain.ir.hardware import (ADAMW_BYTES_PER_PARAM, ADAMW_WIDENED_BYTES_PER_PARAM, CAST_BYTES_PER_ELEMENT,
                                   HardwareSpec)
from megatrain.ir.layout import (GRAD_ITEMSIZE, MASTER_BYTES_PER_ELEMENT, cast_shard, nvme_bytes, nvme_gradient_bytes,
                                 node_slice, optimizer_numel, widens_gradients)
from megatrain.ir.plan import Plan
from megatrain.ir.profile import Kernel, KernelKind
from megatrain.ir.schedule import HOST_STREAMS, OP_KINDS, Op, OpKind, Schedule, Stream

ACC_BYTES_PER_ELEMENT = 12
"""An ACC of FP32 gradients reads the ring tile and the accumulator and writes the accumulator
(4 B each); of BF16 gradients 2 B less (:func:`acc_time`)."""

BACKWARD_TO_FORWARD_FLOPS = 2
"""Model FLOPs count a backward as twice the forward (PaLM appendix B; Kaplan et al. 2020)."""


class Resource(IdentityEnum):
    """What an op occupies while it runs; ops on one resource never overlap."""

    GPU = "gpu"  # the SMs, for FWD and BWD
    H2D_ENGINE = "h2d_engine"
    D2H_ENGINE = "d2h_engine"
    COPY_ENGINE = "copy_engine"  # one engine for both directions when the spec is not duplex
    HOST = "host"  # the host optimizer worker
    NVME = "nvme"  # the NVMe drives: reads and writes share them
    COMM = "comm"  # the interconnect the data-parallel collectives use


def resource_of(stream: Stream, hw: HardwareSpec) -> Resource:
    """The resource ``stream``'s ops run on under ``hw``."""
    if stream is Stream.COMPUTE:
        return Resource.GPU
    if stream is Stream.IO:
        return Resource.NVME
    if stream is Stream.COMM:
        return Resource.COMM
    if stream is Stream.HOST or stream is Stream.CAST:
        # Two host workers, one DRAM and one thread budget: AdamW and a cast are memory-bound, so
        # at once they would only share the bandwidth (and oversubscribe the cores); the runtime
        # runs them one at a time (runtime/cuda.py, "One host CPU budget"), and so does the model.
        return Resource.HOST
    if not hw.duplex:
        return Resource.COPY_ENGINE
    return Resource.H2D_ENGINE if stream is Stream.H2D else Resource.D2H_ENGINE


# -- op times --------------------------------------------------------------------------------------

def _rate(hw: HardwareSpec, field: str, value: float, what: str) -> float:
    if value <= 0 and field.startswith("nvme_"):
        raise ConfigError(f"HardwareSpec {hw.name!r} has no NVMe tier ({field}=0), so it cannot time {what}; "
                          "attach one (megatrain.planner.nvme.with_nvme(hw, '4xgen5'), megatrain plan --nvme "
                          "4xgen5) or set nvme_capacity_bytes, nvme_read_bytes_per_s and nvme_write_bytes_per_s "
                          "in a HardwareSpec JSON")
    if value <= 0:
        raise ConfigError(f"HardwareSpec {hw.name!r} has {field}=0, so it cannot time {what}; use a "
                          "preset (megatrain.ir.hardware.preset('H100_SXM')) or "
                          "megatrain.runtime.measure.measure_hardware() on a machine with a GPU")
    return value


def compute_rate(hw: HardwareSpec, compute_dtype: str) -> float:
    """FLOP/s a layer's compute reaches in ``compute_dtype``: the peak matmul rate x efficiency."""
    field = "bf16_flops" if compute_dtype == "bfloat16" else "fp32_flops"
    return _rate(hw, field, hw.peak_flops(compute_dtype), "FWD/BWD ops") * hw.matmul_efficiency


def h2d_bytes(layer: Layer, plan: Plan) -> int:
    """Bytes one H2D weight copy moves: the whole tile, padding included, in the compute dtype."""
    return layer.numel * plan.compute_itemsize


def d2h_bytes(layer: Layer, plan: Plan | None = None) -> int:
    """Bytes one D2H gradient copy moves: the trainable prefix of the tile in the plan's gradient
    dtype (FP32 without a plan)."""
    return layer.trainable_numel * (plan.gradient_itemsize if plan is not None else GRAD_ITEMSIZE)


def h2d_time(layer: Layer, plan: Plan, hw: HardwareSpec, beside_compute: bool = False) -> float:
    """One weight copy to the GPU; with ``plan.host_state == "shard"`` the layer's weights are first
    all-gathered over the network (:func:`weight_gather_time`), which the H2D waits for and is timed
    with: the schedule's gather (an ALL_GATHER with a gather tile, before the H2D or, with BF16
    compute, the CAST) is timed at its launch latency only, so the network time is counted once,
    on the copy's critical path, in the simulator and the topology planner alike. A staged copy
    (``plan.staged``: its source a BF16 tile a CAST has just written) runs at
    ``hw.h2d_after_cast_bytes_per_s`` where that was measured. ``beside_compute``: the copy while the
    GPU computes (:func:`h2d_beside_compute_factor` of its rate)."""
    rate = _rate(hw, "h2d_bytes_per_s", hw.h2d_bytes_per_s, "H2D ops")
    if plan.staged and hw.h2d_after_cast_bytes_per_s > 0:
        rate = hw.h2d_after_cast_bytes_per_s  # its source a tile a CAST has just written
    if beside_compute:
        rate *= h2d_beside_compute_factor(hw)
    return hw.op_latency_s + h2d_bytes(layer, plan) / rate + weight_gather_time(layer, hw, plan)


def h2d_beside_compute_factor(hw: HardwareSpec) -> float:
    """The share of its rate alone a host-to-device copy keeps while the GPU computes:
    ``hw.h2d_beside_compute_bytes_per_s / hw.h2d_bytes_per_s``, 1 where not measured. A staged copy's
    rate (``h2d_after_cast_bytes_per_s``) is scaled by the same share: the probe measured the two
    rates on one tile, not each source."""
    if hw.h2d_beside_compute_bytes_per_s <= 0 or hw.h2d_bytes_per_s <= 0:
        return 1.0
    return hw.h2d_beside_compute_bytes_per_s / hw.h2d_bytes_per_s


D2H_CHECK_KERNELS = 3
"""GPU kernels a D2H runs before its copy, on its own stream: the slot's norm, its finiteness, the
losses' (:func:`megatrain.runtime.executor._d2h`)."""


def d2h_time(layer: Layer, hw: HardwareSpec, plan: Plan | None = None) -> float:
    """One gradient copy to the host, after the norm of the slot it copies (read once at the GPU's
    memory bandwidth, with :data:`D2H_CHECK_KERNELS` kernels, where ``hw`` has the kernel rates)."""
    rate = _rate(hw, "d2h_bytes_per_s", hw.d2h_bytes_per_s, "D2H ops")
    check = (d2h_bytes(layer, plan) / hw.memory_bytes_per_s + D2H_CHECK_KERNELS * hw.kernel_overhead_s
             if hw.has_kernel_rates else 0.0)
    return hw.op_latency_s + check + d2h_bytes(layer, plan) / rate


def fwd_time(layer: Layer, plan: Plan, hw: HardwareSpec) -> float:
    """GPU seconds of one forward of one micro-batch: its kernels' (:func:`compute_work`) where the
    layer has a kernel profile and ``hw`` the kernel rates, else its FLOPs at :func:`compute_rate`."""
    work = compute_work(layer, OpKind.FWD, plan, hw)
    if work is not None:
        return work.gpu_s
    return hw.op_latency_s + layer.fwd_flops / compute_rate(hw, plan.compute_dtype)


def bwd_time(layer: Layer, plan: Plan, hw: HardwareSpec, fresh: bool = True) -> float:
    """GPU seconds of one local backward (recompute plus backward proper) of one micro-batch, as
    :func:`fwd_time`; ``fresh``: it writes the gradient slot (the first micro-batch of a visit)
    rather than adding into it."""
    work = compute_work(layer, OpKind.BWD, plan, hw, fresh)
    if work is not None:
        return work.gpu_s
    return hw.op_latency_s + layer.bwd_flops / compute_rate(hw, plan.compute_dtype)


# -- kernels ---------------------------------------------------------------------------------------

def kernel_time(kernel: Kernel, compute_dtype: str, hw: HardwareSpec) -> float:
    """GPU seconds of one kernel (``hw.has_kernel_rates``): ``hw.kernel_overhead_s`` plus

    - a matmul: the larger of its FLOPs at ``peak x gemm_efficiency`` and its bytes at
      ``memory_bytes_per_s`` (the roofline: Williams, Waterman & Patterson 2009, "Roofline: an
      insightful visual performance model", CACM 52(4)), so a matmul with a small dimension, whose
      operands are large beside its FLOPs, is timed by its bytes;
    - fused attention: its useful FLOPs (half the counted ones under a causal mask) at
      ``attention_flops`` / ``attention_backward_flops`` (FP32 compute: scaled by ``fp32_flops /
      bf16_flops``), or its bytes if more;
    - element-wise work, reductions, copies and casts: bytes at ``memory_bytes_per_s``;
    - a view or an allocation: nothing (0, no overhead).
    """
    kind = kernel.kind
    if kind is KernelKind.NONE:
        return 0.0
    memory = kernel.nbytes / hw.memory_bytes_per_s
    if kind is KernelKind.MEMORY:
        return hw.kernel_overhead_s + memory
    if kind is KernelKind.MATMUL:
        return hw.kernel_overhead_s + max(kernel.flops / (hw.peak_flops(compute_dtype) * hw.gemm_efficiency), memory)
    rate = hw.attention_flops if kind is KernelKind.ATTENTION else hw.attention_backward_flops
    if compute_dtype == "float32" and hw.bf16_flops > 0:
        rate *= hw.fp32_flops / hw.bf16_flops
    useful = kernel.flops / 2 if kernel.causal else kernel.flops
    return hw.kernel_overhead_s + max(useful / rate, memory)


class ComputeWork:
    """One FWD/RECOMPUTE/BWD op as the issuing thread and the GPU see it, kernel by kernel.

    The issuing thread issues the op's dispatched ops in order, each costing it its launch time
    (``hw.launch_overhead_s`` in a forward, ``hw.backward_launch_s`` in a local backward, whose
    recompute and autograd ops are measured together; :attr:`issue_s` in all, the event record and
    waits around them included); the GPU runs each kernel once it was issued and its stream is
    free. Issued from ``I`` on a stream free from ``F``, kernel ``k`` (issued ``C_k`` after ``I``,
    with ``R_k`` GPU seconds of it and the kernels after it) ends the op no earlier than
    ``I + C_k + R_k``, and the op's end event, recorded after its last launch, no earlier than
    ``I + issue_s``, so the op ends at::

        max(F + gpu_s, I + span_s),   span_s = max(issue_s, max_k (C_k + R_k))

    which is GPU-bound (``F + gpu_s``) when the thread keeps ahead and issue-bound otherwise, the
    GPU idling between kernels. A stalled issuing thread (a host op holding the GIL) delays the
    ``C_k`` after the stall: :meth:`end` takes the clock that maps issue seconds to time.
    """

    __slots__ = ("gpu_s", "issue_s", "span_s", "issued", "remaining")

    def __init__(self, issue: list[float], gpu: list[float], pre_s: float, post_s: float):
        # issue[k], gpu[k]: the issuing thread's and the GPU's seconds of dispatched op k.
        issued, remaining = [], []
        c = pre_s
        for a in issue:
            c += a
            issued.append(c)
        r = 0.0
        for g in reversed(gpu):
            r += g
            remaining.append(r)
        remaining.reverse()
        keep = [k for k, g in enumerate(gpu) if g > 0]  # ops without a kernel bound nothing
        self.gpu_s = r
        self.issue_s = c + post_s
        self.issued = tuple(issued[k] for k in keep)
        self.remaining = tuple(remaining[k] for k in keep)
        self.span_s = max(self.issue_s, max((a + b for a, b in zip(self.issued, self.remaining)), default=0.0))

    def end(self, start: float, issue_start: float, clock: Callable[[float, float], float] | None = None) -> float:
        """When the op ends: started on the GPU at ``start`` (its stream free and its dependencies
        done), issued from ``issue_start``; ``clock(t, s)``: when ``s`` seconds of issuing begun at
        ``t`` are done (None: ``t + s``, the thread never stalled)."""
        return max(start + self.gpu_s, self.issue_bound(issue_start, clock))

    def issue_bound(self, issue_start: float, clock: Callable[[float, float], float] | None = None) -> float:
        """The earliest the op can end however soon its stream is free: each kernel's issue plus the
        GPU seconds from it on, and the end event after the last launch (:meth:`end`'s other term)."""
        if clock is None:
            return issue_start + self.span_s
        last = max((clock(issue_start, c) + r for c, r in zip(self.issued, self.remaining)), default=-float("inf"))
        return max(clock(issue_start, self.issue_s), last)


def compute_work(layer: Layer, kind: OpKind, plan: Plan, hw: HardwareSpec, fresh: bool = True,
                 waits: int = 0, grad_inputs: int = 0) -> ComputeWork | None:
    """The :class:`ComputeWork` of a FWD, RECOMPUTE or BWD of ``layer`` (one micro-batch), or None
    where the layer has no kernel profile (built by hand) or ``hw`` lacks the kernel rates
    (``HardwareSpec.has_kernel_rates``): such ops are timed by their FLOPs.

    Besides the template's profile (:attr:`Layer.fwd_profile`, :attr:`Layer.bwd_profile`), the
    executor's own work: before the kernels ``waits`` stream waits and the start event, after them
    the end event (``launch_overhead_s`` each); a BWD first detaches each trainable weight and each
    of its ``grad_inputs`` differentiated inputs as a leaf (one dispatched op each, no kernel) and last writes (``fresh``) or
    adds its weight gradients, in the compute dtype, into the gradient slot (``plan.gradient_itemsize``
    per element; one ``_foreach`` op, memory-bound:
    :func:`megatrain.runtime.executor.local_backward`)."""
    profile = layer.bwd_profile if kind is OpKind.BWD else layer.fwd_profile
    if profile is None or not hw.has_kernel_rates:
        return None
    dtype = plan.compute_dtype
    py = hw.launch_overhead_s
    each = hw.backward_launch_s if kind is OpKind.BWD else py
    issue = [each] * profile.launches
    gpu = [kernel_time(k, dtype, hw) for k in profile.kernels]
    if kind is OpKind.BWD:
        leaves = sum(1 for p in layer.params if p.trainable) + grad_inputs
        issue = [each] * leaves + issue + [each]
        grad_bytes = layer.trainable_numel * (plan.compute_itemsize + plan.gradient_itemsize * (1 if fresh else 2))
        gpu = [0.0] * leaves + gpu + [kernel_time(Kernel("aten._foreach_copy_", KernelKind.MEMORY, 0, grad_bytes),
                                                  dtype, hw) if layer.trainable_numel else 0.0]
    return ComputeWork(issue, gpu, pre_s=(1 + waits) * py, post_s=py)


def opt_time(layer: Layer, hw: HardwareSpec, plan: Plan | None = None) -> float:
    """One rank's host AdamW step over its part of the layer's trainable parameters
    (:func:`optimizer_numel`: all of them for one rank) at its AdamW rate (:func:`optimizer_rate`:
    its share of the host's, from BF16 gradient tiles where the plan has them)."""
    return hw.op_latency_s + optimizer_numel(layer, plan) / optimizer_rate(hw, plan)


def host_rate(hw: HardwareSpec, plan: Plan | None = None) -> float:
    """AdamW parameters/s (FP32 gradients) one rank's host ops run at: the node's
    ``host_optimizer_params_per_s`` over ``plan.gpus_per_node``, the ranks on the node. Those ops
    are memory-bound (:data:`~megatrain.ir.hardware.ADAMW_BYTES_PER_PARAM`; the spec's rate is
    the whole host's, at :func:`host_worker_threads` threads) and the ranks of one node run the
    same schedule at the same time on one DRAM, so each gets an equal share of its bandwidth:
    ``G`` ranks that each step ``1 / G`` of a shared tile take as long as one rank stepping all of
    it, and ``G`` ranks that each step a whole copy of their own take ``G`` times longer."""
    return hw.host_optimizer_params_per_s / (plan.gpus_per_node if plan is not None else 1)


def optimizer_rate(hw: HardwareSpec, plan: Plan | None = None) -> float:
    """Parameters/s of one rank's OPT: :func:`host_rate`, or where the plan's OPTs read BF16
    gradient tiles (:func:`widens_gradients`) the spec's ``host_optimizer_bf16_params_per_s`` over
    the node's ranks. A spec without that rate (0: written before it was measured) gets the
    memory-bound estimate of a many-core host, whose widened chunks go through DRAM: :func:`host_rate`
    x 28 / 34 (``ADAMW_WIDENED_BYTES_PER_PARAM``; a small team's chunks stay in the cache and step
    faster, which a measured rate shows). Those rates are AdamW's, and every host optimizer
    (``plan.optimizer_name``) is timed at them: Lion moves 20 bytes per parameter where AdamW
    moves 28, but its kernel (torch's element-wise ops, several passes over each cache-sized chunk,
    :class:`~megatrain.runtime.host_kernels.HostLion`) stepped at 0.8-1.1x torch's fused AdamW
    rate on this project's 2-core VM (8 Mi-parameter tiles, 1 thread, 2026-11-27), not 28/20 =
    1.4x; the spec measures no rate of its own."""
    if plan is None or not widens_gradients(plan):
        return host_rate(hw, plan)
    if hw.host_optimizer_bf16_params_per_s > 0:
        return hw.host_optimizer_bf16_params_per_s / plan.gpus_per_node
    return host_rate(hw, plan) * ADAMW_BYTES_PER_PARAM / ADAMW_WIDENED_BYTES_PER_PARAM


def cast_rate(hw: HardwareSpec, plan: Plan | None = None) -> float:
    """Elements/s of one rank's CAST (FP32 master to BF16 staging tile): the spec's
    ``host_cast_elements_per_s`` over the node's ranks (sharing its bandwidth as :func:`host_rate`
    does). A spec without it (0: written before it was measured) gets the memory-bound estimate
    from the AdamW rate, 28 / 6 (``ADAMW_BYTES_PER_PARAM`` / ``CAST_BYTES_PER_ELEMENT``)."""
    ranks = plan.gpus_per_node if plan is not None else 1
    if hw.host_cast_elements_per_s > 0:
        return hw.host_cast_elements_per_s / ranks
    return host_rate(hw, plan) * ADAMW_BYTES_PER_PARAM / CAST_BYTES_PER_ELEMENT


def cast_time(layer: Layer, hw: HardwareSpec, plan: Plan | None = None) -> float:
    """One host CAST of the layer's master tile into a BF16 staging tile (each rank casts the whole
    tile for its own GPU, at its share of the host's CAST rate, :func:`cast_rate`); with
    ``plan.shared_cast`` only its shard into the node's shared tile (:func:`cast_shard`, the
    largest: the last rank's, frozen parameters included)."""
    rate = cast_rate(hw, plan)
    numel = layer.numel
    if plan is not None and plan.shared_cast:
        numel = max(hi - lo for lo, hi in (cast_shard(layer.numel, layer.trainable_numel, plan, k)
                                           for k in range(plan.optimizer_shards)))
    return hw.op_latency_s + numel / rate


def acc_time(layer: Layer, hw: HardwareSpec, plan: Plan | None = None) -> float:
    """One host ACC of a micro-batch's gradients of ``layer`` into its accumulator (each rank sums
    its own micro-batches, at its share of the host bandwidth, :func:`host_rate`); a BF16 tile
    moves 2 bytes per element less than an FP32 one."""
    nbytes = ACC_BYTES_PER_ELEMENT - GRAD_ITEMSIZE + (plan.gradient_itemsize if plan is not None else GRAD_ITEMSIZE)
    rate = host_rate(hw, plan) * ADAMW_BYTES_PER_PARAM / nbytes
    return hw.op_latency_s + layer.trainable_numel / rate


def checkpoint_bytes(graph: LayerGraph, layer: int) -> int:
    """Bytes of ``layer``'s outputs that another layer reads, for one micro-batch: what an OFFLOAD
    or RELOAD moves and what offloading them keeps in pinned host memory."""
    return sum(graph.values[vid].nbytes for vid in graph.checkpoints(layer))


def offload_time(graph: LayerGraph, layer: int, hw: HardwareSpec, kind: OpKind, beside_compute: bool = False) -> float:
    """One OFFLOAD (D2H) or RELOAD (H2D) of ``layer``'s checkpoints for one micro-batch;
    ``beside_compute``: a RELOAD while the GPU computes, as :func:`h2d_time`."""
    if kind is OpKind.OFFLOAD:
        rate = _rate(hw, "d2h_bytes_per_s", hw.d2h_bytes_per_s, "OFFLOAD ops")
    else:
        rate = _rate(hw, "h2d_bytes_per_s", hw.h2d_bytes_per_s, "RELOAD ops")
        if beside_compute:
            rate *= h2d_beside_compute_factor(hw)
    return hw.op_latency_s + checkpoint_bytes(graph, layer) / rate


DURATIONS: dict[OpKind, Callable[[LayerGraph, int, Plan, HardwareSpec], float]] = {
    OpKind.H2D: lambda g, i, plan, hw: h2d_time(g.layers[i], plan, hw),
    OpKind.D2H: lambda g, i, plan, hw: d2h_time(g.layers[i], hw, plan),
    OpKind.FWD: lambda g, i, plan, hw: fwd_time(g.layers[i], plan, hw),
    OpKind.RECOMPUTE: lambda g, i, plan, hw: fwd_time(g.layers[i], plan, hw),
    # A layer with no gradient to compute (a frozen vision tower) is given no BWD: none to time.
    OpKind.BWD: lambda g, i, plan, hw: (bwd_time(g.layers[i], plan, hw)
                                        if i == len(g.layers) - 1 or g.has_gradients(i) else 0.0),
    OpKind.OFFLOAD: lambda g, i, plan, hw: offload_time(g, i, hw, OpKind.OFFLOAD),
    OpKind.RELOAD: lambda g, i, plan, hw: offload_time(g, i, hw, OpKind.RELOAD),
    OpKind.OPT: lambda g, i, plan, hw: opt_time(g.layers[i], hw, plan),
    OpKind.CAST: lambda g, i, plan, hw: cast_time(g.layers[i], hw, plan),
    OpKind.ACC: lambda g, i, plan, hw: acc_time(g.layers[i], hw, plan),
    OpKind.NVME_READ: lambda g, i, plan, hw: nvme_time(g.layers[i], hw, OpKind.NVME_READ,
                                                       nvme_bytes(g.layers[i], i in plan.nvme_masters, plan), plan),
    OpKind.NVME_WRITE: lambda g, i, plan, hw: nvme_time(g.layers[i], hw, OpKind.NVME_WRITE,
                                                        nvme_bytes(g.layers[i], i in plan.nvme_masters, plan), plan),
    OpKind.ALL_REDUCE: lambda g, i, plan, hw: all_reduce_time(g.layers[i], hw, plan),
    OpKind.REDUCE_SCATTER: lambda g, i, plan, hw: reduce_scatter_time(g.layers[i], hw, plan),
    # On a node's shared host state the gather moves no bytes: it waits for the other ranks' shards.
    # Sharded across nodes, the leader's host copies into the gather tile (the network time is the H2D's).
    OpKind.ALL_GATHER: lambda g, i, plan, hw: hw.op_latency_s + weight_gather_host_time(g.layers[i], hw, plan),
    OpKind.COUNT_REDUCE: lambda g, i, plan, hw: count_reduce_time(hw, plan),
}
"""The formula of each op kind (module docstring, "Op times"); every op time is looked up here."""


def op_duration(kind: OpKind, graph: LayerGraph, layer: int, plan: Plan, hw: HardwareSpec) -> float:
    """Seconds an op of ``kind`` on layer index ``layer`` takes on its resource under ``hw`` (one
    micro-batch; ``plan`` gives the compute dtype). The simulator (through :func:`op_time`) and the
    solver's bounds both time ops with it, so they cannot disagree on a formula.

    Raises:
        ConfigError: ``hw`` has a rate of 0 that the kind needs (a host-only spec timing GPU ops).
    """
    return DURATIONS[kind](graph, layer, plan, hw)


def op_time(op: Op, graph: LayerGraph, plan: Plan, hw: HardwareSpec) -> float:
    """Seconds ``op`` takes on its resource under ``hw`` (:func:`op_duration` of its kind and layer;
    an NVMe transfer of a gradient tile, ``Op.gbuf``, moves :func:`nvme_gradient_bytes`; a BWD that
    adds into its gradient slot, :func:`fresh_gradients`, moves its gradient bytes once more)."""
    if op.gbuf is not None and op.kind in (OpKind.NVME_READ, OpKind.NVME_WRITE):
        return nvme_time(graph.layers[op.layer], hw, op.kind, nvme_gradient_bytes(graph.layers[op.layer], plan),
                         plan)
    if op.kind is OpKind.BWD and not fresh_gradients(op, plan) and graph.has_gradients(op.layer):
        return bwd_time(graph.layers[op.layer], plan, hw, fresh=False)
    return DURATIONS[op.kind](graph, op.layer, plan, hw)


def fresh_gradients(op: Op, plan: Plan) -> bool:
    """Whether BWD ``op`` writes its gradient slot afresh (the first micro-batch of a layer-by-layer
    visit, every micro-batch of per-micro-batch passes) rather than adding into it, as the executor
    decides (:func:`megatrain.runtime.executor.local_backward`'s ``fresh``)."""
    return op.mb == 0 or not plan.layer_by_layer


def compute_works(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec) -> tuple[ComputeWork | None, ...]:
    """:func:`compute_work` of every op of ``schedule`` (None for other kinds and where it is None),
    with its waits on other GPU streams and its gradient slot write; made once per distinct case."""
    plan, ops = schedule.plan, schedule.ops
    if not hw.has_kernel_rates:
        return (None,) * len(ops)
    cache: dict[tuple, ComputeWork | None] = {}
    out: list[ComputeWork | None] = []
    for op in ops:
        if op.kind not in (OpKind.FWD, OpKind.RECOMPUTE, OpKind.BWD):
            out.append(None)
            continue
        layer = graph.layers[op.layer]
        bwd = op.kind is OpKind.BWD
        waits = _gpu_waits(op, ops)
        fresh = fresh_gradients(op, plan) if bwd else True
        grad_inputs = sum(1 for v in layer.inputs if graph.values[v].requires_grad) if bwd else 0
        profile = layer.bwd_profile if bwd else layer.fwd_profile
        key = (id(profile), bwd, fresh, waits, grad_inputs, layer.trainable_numel,
               sum(1 for p in layer.params if p.trainable))
        work = cache.get(key, False)
        if work is False:
            work = cache[key] = compute_work(layer, op.kind, plan, hw, fresh, waits, grad_inputs)
        out.append(work)
    return tuple(out)


def op_times(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec,
             works: tuple[ComputeWork | None, ...] | None = None) -> tuple[float, ...]:
    """``op_time`` of every op of ``schedule``, computed once per (layer, kind, what an NVMe op
    moves, a fresh gradient slot); a compute op with a :class:`ComputeWork` (``works``, default
    :func:`compute_works`) takes its GPU seconds."""
    works = compute_works(schedule, graph, hw) if works is None else works
    cache: dict[tuple[OpKind, int, bool, bool], float] = {}
    out = []
    for op, work in zip(schedule.ops, works):
        if work is not None:
            out.append(work.gpu_s)
            continue
        key = (op.kind, op.layer, op.gbuf is not None, op.kind is OpKind.BWD and fresh_gradients(op, schedule.plan))
        t = cache.get(key)
        if t is None:
            t = cache[key] = op_time(op, graph, schedule.plan, hw)
        out.append(t)
    return tuple(out)


# -- copy/compute contention -----------------------------------------------------------------------

def contention_rates(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec,
                     dur: tuple[float, ...] | None = None) -> tuple[float, ...] | None:
    """The share of its speed alone each op of ``schedule`` keeps while an op of the other
    contending class runs (the simulator's "Contention", :mod:`megatrain.planner.simulate`), or None
    where ``hw`` measured no contention (``HardwareSpec.has_contention``): a FWD, RECOMPUTE or BWD
    beside a copy on the H2D stream keeps ``1 - hw.compute_slowdown_beside_h2d`` (the probe measured
    a forward; a backward is taken to lose the same share); an H2D or RELOAD beside compute keeps
    its time alone over its time at the rate beside (:func:`h2d_time`, :func:`offload_time` with
    ``beside_compute``: latency and a gather not slowed); other ops 1. ``dur``: the ops' times
    alone (default :func:`op_times`)."""
    if not hw.has_contention:
        return None
    plan, ops = schedule.plan, schedule.ops
    dur = op_times(schedule, graph, hw) if dur is None else dur
    compute = 1.0 - hw.compute_slowdown_beside_h2d
    cache: dict[tuple[OpKind, int], float] = {}
    out = []
    for op, alone in zip(ops, dur):
        if op.kind in (OpKind.FWD, OpKind.RECOMPUTE, OpKind.BWD):
            out.append(compute)
            continue
        if op.kind not in (OpKind.H2D, OpKind.RELOAD):
            out.append(1.0)
            continue
        key = (op.kind, op.layer)
        beside = cache.get(key)
        if beside is None:
            beside = cache[key] = (h2d_time(graph.layers[op.layer], plan, hw, beside_compute=True)
                                   if op.kind is OpKind.H2D else
                                   offload_time(graph, op.layer, hw, OpKind.RELOAD, beside_compute=True))
        out.append(alone / beside if beside > 0 else 1.0)
    return tuple(out)


# -- launches on the issuing thread ----------------------------------------------------------------

D2H_LAUNCHES = 23
"""Aten ops the executor's D2H dispatches: the slot's norm and finiteness (with every micro-batch
loss), the two flag writes and three copies (counted with ``issue.DispatchCounter``)."""

COPY_LAUNCHES = 1
"""An H2D weight copy, and each checkpoint an OFFLOAD or RELOAD copies: one ``copy_``."""

HOST_OP_LAUNCHES = 1
"""A host op costs the issuing thread one queue put; its work runs on a host worker."""


def launch_count(op: Op, graph: LayerGraph, gpu_waits: int = 0) -> int:
    """Calls the issuing thread makes for ``op``: the aten ops its work dispatches (for compute ops
    its kernel profile's, else the layer's ``fwd_launches`` / ``bwd_launches``), plus for GPU ops the event recorded after
    it and ``gpu_waits`` stream waits (its dependencies on other GPU streams)."""
    launches = OP_KINDS[op.kind].launches  # what its kind dispatches (schedule.OpKindSpec.launches)
    if launches is None:
        return HOST_OP_LAUNCHES
    if launches in ("fwd", "bwd"):
        layer = graph.layers[op.layer]
        profile = layer.fwd_profile if launches == "fwd" else layer.bwd_profile
        if profile is not None:
            n = profile.launches
        else:
            n = layer.fwd_launches if launches == "fwd" else layer.bwd_launches
    elif launches == "d2h":
        n = D2H_LAUNCHES
    elif launches == "copy":
        n = COPY_LAUNCHES
    else:  # "checkpoints"
        n = COPY_LAUNCHES * len(graph.checkpoints(op.layer))
    return n + 1 + gpu_waits


def _gpu_waits(op: Op, ops: tuple[Op, ...]) -> int:
    """Stream waits the issuing thread records for ``op``: its dependencies on other GPU streams."""
    return sum(1 for d in op.deps if ops[d].stream is not op.stream and ops[d].stream not in HOST_STREAMS)


def launch_times(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec,
                 works: tuple[ComputeWork | None, ...] | None = None) -> tuple[float, ...]:
    """Seconds the issuing thread spends issuing each op of ``schedule``: a compute op with a
    :class:`ComputeWork` (``works``, default :func:`compute_works`) its ``issue_s``, any other op
    ``launch_count`` x ``hw.launch_overhead_s``."""
    ops = schedule.ops
    works = compute_works(schedule, graph, hw) if works is None else works
    out = []
    for op, work in zip(ops, works):
        if work is not None:
            out.append(work.issue_s)
        else:
            out.append(launch_count(op, graph, _gpu_waits(op, ops)) * hw.launch_overhead_s)
    return tuple(out)


def issue_stall(kind: OpKind, hw: HardwareSpec) -> float:
    """Fraction of a host op's time during which the issuing thread cannot issue: an OPT's
    ``hw.host_optimizer_issue_stall`` (its kernel holds the GIL: the simulator blocks the thread for
    that leading fraction of the OPT, the kernel's call, and not during the finite check's sum after
    it), a CAST's ``hw.host_cast_issue_stall`` (spread over the CAST: a slowdown, the cores and memory
    shared); 0 for other host ops (torch ops, which release the GIL) and GPU ops."""
    if kind is OpKind.OPT:
        return hw.host_optimizer_issue_stall
    if kind is OpKind.CAST:
        return hw.host_cast_issue_stall
    return 0.0


def issue_stall_spans(kind: OpKind, hw: HardwareSpec, start_s: float,
                      end_s: float) -> tuple[tuple[float, float, float], ...]:
    """Where a host op that runs over ``[start_s, end_s)`` (seconds) holds the issuing thread back:
    ``(from_s, to_s, fraction of the thread's speed taken there)`` windows in time order, none where
    it does not. An OPT holds it outright for its leading :func:`issue_stall` share (the GIL-holding
    kernel call comes first, ``HostAdamW.step``'s finite check after it releases the GIL), then slows
    it by ``hw.host_optimizer_issue_slowdown`` for the rest (all of a GIL-releasing kernel's step:
    its threads share the cores and memory bandwidth); a CAST slows it by its share throughout."""
    f = issue_stall(kind, hw)
    if kind is OpKind.OPT:
        mid = start_s + f * (end_s - start_s)
        slow = hw.host_optimizer_issue_slowdown
        return tuple(w for w in ((start_s, mid, 1.0), (mid, end_s, slow)) if w[2] > 0 and w[0] < w[1])
    if f <= 0:
        return ()
    return ((start_s, end_s, f),)


# -- FLOPs and MFU ---------------------------------------------------------------------------------

def tokens_per_step(graph: LayerGraph, plan: Plan) -> int:
    return graph.tokens_per_micro_batch * plan.micro_batches


def model_flops_per_token(graph: LayerGraph) -> float:
    """Model FLOPs of one training token: 3 x the forward FLOPs (forward + 2x for the backward)."""
    fwd = sum(layer.fwd_flops for layer in graph.layers)
    return (1 + BACKWARD_TO_FORWARD_FLOPS) * fwd / graph.tokens_per_micro_batch


def flops_per_step(graph: LayerGraph, plan: Plan, mode: str = "train") -> float:
    """Model FLOPs of one step (recompute not counted); ``mode="eval"`` counts forwards only."""
    fwd = sum(layer.fwd_flops for layer in graph.layers) * plan.micro_batches
    return fwd * (1 + BACKWARD_TO_FORWARD_FLOPS) if mode == "train" else float(fwd)


def mfu(model_flops: float, step_time_s: float, compute_dtype: str, hw: HardwareSpec) -> float:
    """Model FLOPs utilisation: model FLOPs / step time / the peak matmul rate of the dtype.

    0 when either the step time or the peak is 0 (a host-only spec has no peak).
    """
    peak = hw.peak_flops(compute_dtype)
    if step_time_s <= 0 or peak <= 0:
        return 0.0
    return model_flops / step_time_s / peak


def nvme_time(layer: Layer, hw: HardwareSpec, kind: OpKind, nbytes: int | None = None,
              plan: Plan | None = None) -> float:
    """Seconds an NVME_READ or NVME_WRITE of ``layer`` takes on the NVMe tier: ``nbytes`` (default
    :func:`nvme_bytes`, the moments; a gradient tile's is :func:`nvme_gradient_bytes`) over
    ``hw.nvme_read_bytes_per_s`` / ``nvme_write_bytes_per_s`` shared by ``plan.gpus_per_node``
    ranks (the spec's rate is the node's drives'; its ranks run the same schedule at once, each
    moving its own files: an equal share each, as :func:`host_rate` shares the host's memory
    bandwidth), plus the op latency.

    Raises:
        ConfigError: ``hw`` has no NVMe rate (attach an array: ``planner.nvme.with_nvme``).
    """
    if kind is OpKind.NVME_READ:
        rate = _rate(hw, "nvme_read_bytes_per_s", hw.nvme_read_bytes_per_s, "an NVMe read")
    else:
        rate = _rate(hw, "nvme_write_bytes_per_s", hw.nvme_write_bytes_per_s, "an NVMe write")
    share = plan.gpus_per_node if plan is not None else 1
    return (nvme_bytes(layer, plan=plan) if nbytes is None else nbytes) * share / rate + hw.op_latency_s


def _intra_rate(hw: HardwareSpec, what: str) -> float:
    rate = hw.intra_node_bus_bytes_per_s
    if rate <= 0:
        raise ConfigError(f"HardwareSpec {hw.name!r} has intra_node_bytes_per_s=0 and allreduce_bytes_per_s=0, so "
                          f"it cannot time {what} among the GPUs of a node; attach an interconnect "
                          "(megatrain.planner.topology.with_topology(hw, interconnect='nvlink4'), or "
                          "megatrain plan --interconnect) or set intra_node_bytes_per_s")
    return rate


def _network_rate(hw: HardwareSpec, what: str) -> float:
    if hw.network_bytes_per_s <= 0:
        raise ConfigError(f"HardwareSpec {hw.name!r} has network_bytes_per_s=0, so it cannot time {what} "
                          "between nodes; attach a network (megatrain.planner.topology.with_topology(hw, "
                          "network='ndr-8x400g'), or megatrain plan --network) or set network_bytes_per_s")
    return hw.network_bytes_per_s


def all_reduce_time(layer: Layer, hw: HardwareSpec, plan: Plan) -> float:
    """Seconds an ALL_REDUCE of ``layer``'s FP32 step gradients (``B`` = 4 bytes per trainable
    parameter) takes over ``plan.data_parallel`` = ``G`` GPUs per node x ``M`` nodes, as a
    hierarchical ring all-reduce: a reduce-scatter among the node's GPUs, an all-reduce of each
    GPU's ``B / G`` slice between the nodes (the ``G`` slices in parallel, over the node's NICs
    together), an all-gather among the node's GPUs::

        2 (G-1)/G x B / intra  +  2 (M-1)/M x B / network  +  2 (G-1) a_intra + 2 (M-1) a_net + op latency

    ``intra`` is ``hw.intra_node_bus_bytes_per_s`` (NCCL's busbw: a ring reduce-scatter or
    all-gather of ``B`` over ``G`` ranks moves ``(G-1)/G x B`` through each rank's link), ``network``
    ``hw.network_bytes_per_s`` (the node's: ``G`` slices of ``B/G`` share it, so the slice size and
    the per-GPU share cancel), ``a_*`` the per-step latencies. Sources: the ring all-reduce is
    bandwidth-optimal at ``2 (N-1)/N`` of the bytes per rank (Patarasuk & Yuan, "Bandwidth optimal
    all-reduce algorithms for clusters of workstations", JPDC 2009); reduce-scatter + all-reduce +
    all-gather is the hierarchical composition of Thakur, Rabenseifner & Gropp, "Optimization of
    collective communication operations in MPICH" (IJHPCA 2005, section 4), which NCCL's ring and
    tree algorithms follow across nodes; the busbw convention is nccl-tests' doc/PERFORMANCE.md.
    With ``M = 1`` it is the flat ring of ``G`` ranks; 0 for one rank.

    Raises:
        ConfigError: ``G > 1`` and ``hw`` has no intra-node bandwidth, or ``M > 1`` and no network
            bandwidth.
    """
    return _all_reduce_seconds(layer.trainable_numel * GRAD_ITEMSIZE, hw, plan)


COUNT_BYTES = 8
"""Bytes a COUNT_REDUCE sums over the ranks: one int64 count of supervised tokens."""


def count_reduce_time(hw: HardwareSpec, plan: Plan) -> float:
    """Seconds a COUNT_REDUCE takes: the ring all-reduce of :func:`all_reduce_time` over
    :data:`COUNT_BYTES` (latency-bound: its per-step latencies and the op latency); 0 for one rank."""
    return _all_reduce_seconds(COUNT_BYTES, hw, plan)


def _all_reduce_seconds(nbytes: int, hw: HardwareSpec, plan: Plan) -> float:
    if plan.data_parallel == 1:
        return 0.0
    g, m = plan.gpus_per_node, plan.nodes
    t = hw.op_latency_s
    if g > 1:
        t += 2 * (g - 1) / g * nbytes / _intra_rate(hw, "a data-parallel all-reduce") + 2 * (g - 1) * hw.intra_node_latency_s
    if m > 1:
        t += 2 * (m - 1) / m * nbytes / _network_rate(hw, "a data-parallel all-reduce") + 2 * (m - 1) * hw.network_latency_s
    return t


def reduce_scatter_time(layer: Layer, hw: HardwareSpec, plan: Plan) -> float:
    """Seconds a REDUCE_SCATTER of ``layer``'s FP32 step gradients (``B`` = 4 bytes per trainable
    parameter) takes over the ``G = plan.data_parallel`` ranks of one node, or with a state sharded
    across ``M`` nodes (``host_state == "shard"``) over ``G`` GPUs per node x ``M`` nodes (the
    lowering uses it only there: ``Plan.gradient_reduction``), as a ring reduce-scatter: the first
    half of the (hierarchical) ring all-reduce of :func:`all_reduce_time`, so half its bytes and
    steps::

        (G-1)/G x B / intra  +  (G-1) a_intra  +  (M-1)/M x B / network  +  (M-1) a_net  +  op latency

    with ``intra`` = ``hw.intra_node_bus_bytes_per_s`` (nccl-tests' busbw convention,
    doc/PERFORMANCE.md: a reduce-scatter moves ``(G-1)/G x B`` through each rank's link) and
    ``a_intra`` = ``hw.intra_node_latency_s`` per ring step. Sources as :func:`all_reduce_time`'s
    (Patarasuk & Yuan, JPDC 2009; Thakur, Rabenseifner & Gropp, IJHPCA 2005). The padding of the
    tile to equal shards (fewer than ``G x 16`` elements, :func:`optimizer_shard`) is left out.
    0 for one rank.

    Raises:
        ConfigError: ``G > 1`` and ``hw`` has no intra-node bandwidth, ``M > 1`` and no network
            bandwidth, or ``plan.nodes > 1`` with a replicated state (a reduce-scatter over several
            nodes would not give each node's copy the whole tile).
    """
    if plan.data_parallel == 1:
        return 0.0
    if plan.nodes > 1 and plan.host_state != "shard":
        raise ConfigError(f"a reduce-scatter of the gradients over {plan.nodes} nodes: each node's host copy needs "
                          "the whole reduced tile; time an all-reduce (all_reduce_time) instead")
    g, m = plan.gpus_per_node, plan.nodes
    nbytes = layer.trainable_numel * GRAD_ITEMSIZE
    t = hw.op_latency_s
    if g > 1:
        t += (g - 1) / g * nbytes / _intra_rate(hw, "a data-parallel reduce-scatter") + (g - 1) * hw.intra_node_latency_s
    if m > 1:
        t += (m - 1) / m * nbytes / _network_rate(hw, "a data-parallel reduce-scatter") + (m - 1) * hw.network_latency_s
    return t


def weight_gather_bytes(layer: Layer, plan: Plan) -> int:
    """Bytes of ``layer``'s weights a node receives in one all-gather when the host state is sharded:
    the other nodes' ``(M-1)/M`` of the tile, in the compute dtype (each node casts its own slice
    before sending it), rounded up. 0 unless ``plan.host_state == "shard"``."""
    if plan.host_state != "shard":
        return 0
    m = plan.nodes
    return -(-(m - 1) * layer.numel * plan.compute_itemsize // m)


def weight_gather_time(layer: Layer, hw: HardwareSpec, plan: Plan) -> float:
    """Seconds of a ring all-gather of ``layer``'s weights across the ``plan.nodes`` nodes (ZeRO-3
    style, Rajbhandari et al. 2020, arXiv:1910.02054): each node receives :func:`weight_gather_bytes`
    over ``hw.network_bytes_per_s`` in ``M - 1`` steps of ``hw.network_latency_s`` (the ring
    all-gather, Thakur et al. 2005; one gather per node serves its ``G`` GPUs). 0 unless
    ``plan.host_state == "shard"``.

    Raises:
        ConfigError: the plan shards and ``hw`` has no network bandwidth.
    """
    if plan.host_state != "shard":
        return 0.0
    rate = _network_rate(hw, "the all-gather of sharded weights")
    return weight_gather_bytes(layer, plan) / rate + (plan.nodes - 1) * hw.network_latency_s


def weight_gather_host_time(layer: Layer, hw: HardwareSpec, plan: Plan) -> float:
    """Host seconds of one rank's copies in one weight gather (``runtime.distributed.gather_weights``)
    when the host state is sharded: the node's ranks cast their shares of the node's slice
    (:func:`node_slice`, the largest) from the FP32 masters into the compute dtype (4 + itemsize
    bytes per element), then copy their shares of every node's part into the gather tile (2 x
    itemsize bytes per element of the layer): ``1 / G`` of those bytes each, at one rank's share
    of the host bandwidth (:func:`host_rate`). 0 unless ``plan.host_state == "shard"``. With BF16
    this is the only cast of the layer on the node (``Plan.staged`` is False: the H2Ds read the
    gather tile)."""
    if plan.host_state != "shard":
        return 0.0
    item = plan.compute_itemsize
    sliced = max(hi - lo for lo, hi in (node_slice(layer.numel, layer.trainable_numel, plan, n)
                                        for n in range(plan.nodes)))
    nbytes = sliced * (MASTER_BYTES_PER_ELEMENT + item) + layer.numel * 2 * item
    return nbytes / plan.optimizer_shards / (host_rate(hw, plan) * ADAMW_BYTES_PER_PARAM)


__all__ = ["ACC_BYTES_PER_ELEMENT", "BACKWARD_TO_FORWARD_FLOPS", "Resource", "resource_of", "compute_rate",
           "h2d_bytes", "d2h_bytes", "h2d_time", "d2h_time", "fwd_time", "bwd_time", "opt_time", "host_rate",
           "optimizer_rate", "cast_rate", "cast_time", "acc_time", "checkpoint_bytes", "offload_time",
           "op_duration", "op_time", "op_times", "kernel_time", "ComputeWork", "compute_work", "compute_works",
           "fresh_gradients", "issue_stall", "issue_stall_spans", "D2H_LAUNCHES", "COPY_LAUNCHES", "HOST_OP_LAUNCHES",
           "launch_count", "launch_times", "tokens_per_step", "model_flops_per_token", "flops_per_step", "mfu",
           "nvme_time", "all_reduce_time", "COUNT_BYTES", "count_reduce_time", "reduce_scatter_time",
           "weight_gather_bytes", "weight_gather_time", "weight_gather_host_time",
           "h2d_beside_compute_factor", "contention_rates"]
