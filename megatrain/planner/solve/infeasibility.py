"""When no plan fits: the least memory that would, and a message that names the obstacle and the fix.

:class:`Requirements` is computed by the search (``Search.requirements``, public as
:func:`megatrain.planner.solve.minimum_requirements`); :func:`infeasible_error` turns it into an
:class:`InfeasibleRequestError` whose message gives the GPU, host and pinned bytes that work, the
layer that is the obstacle (the largest slot, or the layer at the activation peak) and what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.errors import PlanError
from megatrain.optim import OPTIMIZERS
from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph
from megatrain.ir.hardware import HardwareSpec
from megatrain.ir.schedule import COMPUTE_KINDS, Schedule
from megatrain.planner.solve.request import SolveRequest
from megatrain.units import human_bytes


@dataclass(frozen=True, slots=True)
class Requirements:
    """The smallest memory that plans in the search need, and what drives it (bytes).

    ``gpu_memory_bytes`` is the least GPU memory of any plan: at the smallest micro-batch size,
    one streaming slot, prefetch distance 0, no resident layer, one gradient-ring tile (one per
    trainable layer when gradients are clipped layer by layer), one staging tile, and the pass
    structure (``layer_by_layer``) and activation policy (``activations``, a family name or
    ``"keep"``) with the lowest peak. ``host_memory_bytes`` and ``pinned_memory_bytes`` are what
    that plan needs on the host (offloaded checkpoints and accumulators included), so a machine
    with all three fits it. ``host_floor_bytes`` and ``pinned_floor_bytes`` are the least any plan
    needs on the host (nothing offloaded): below them nothing fits, whatever the GPU.

    ``largest_layer`` sizes every weight slot; ``peak_layer`` runs when checkpoints plus working
    memory peak in the least-GPU plan. ``obstacle`` is the layer that keeps the GPU from fitting:
    the largest layer when the fixed allocations alone (one slot, buffers, reserve) exceed the GPU
    (``obstacle_is_slot``), else the peak layer.
    """

    gpu_memory_bytes: int
    host_memory_bytes: int
    pinned_memory_bytes: int
    host_floor_bytes: int
    pinned_floor_bytes: int
    micro_batch_size: int
    activations: str
    layer_by_layer: bool
    memory: cost.MemoryBreakdown
    largest_layer: str
    peak_layer: str
    peak_layer_work_bytes: int
    obstacle: str
    obstacle_is_slot: bool

    def fits(self, hw: HardwareSpec) -> tuple[bool, bool]:
        """(GPU could fit, host could fit) on ``hw``: each against its own least need. Both true
        does not promise a plan: the offload that brings the GPU down needs pinned memory."""
        return (self.gpu_memory_bytes <= hw.gpu_memory_bytes,
                self.host_floor_bytes <= hw.host_memory_bytes
                and self.pinned_floor_bytes <= hw.pinned_memory_cap_bytes)


class InfeasibleRequestError(PlanError):
    """No plan fits; ``requirements`` holds the smallest memory that would."""

    def __init__(self, message: str, requirements: Requirements):
        super().__init__(message)
        self.requirements = requirements


def peak_op_layer(schedule: Schedule, graph: LayerGraph) -> int:
    """Index of the layer of the compute op at which checkpoints + working memory peak (stream
    order; the first such op on a tie)."""
    live = cost.activation_liveness(schedule, graph)
    cur, best, best_layer = live.at_start, -1, 0
    for i, op in enumerate(schedule.ops):
        if op.kind not in COMPUTE_KINDS:
            continue
        cur += live.alloc[i]
        if cur + live.work[i] > best:
            best, best_layer = cur + live.work[i], op.layer
        cur -= live.free[i]
    return best_layer


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def infeasible_error(request: SolveRequest, req: Requirements) -> InfeasibleRequestError:
    """The error for ``request`` when no plan fits: the least memory that works (``req``), then for
    the GPU and the host, whichever cannot fit, what takes the bytes and what to change."""
    hw, g = request.hardware, request.graph
    m = req.memory
    spec = OPTIMIZERS[m.optimizer_name]
    gpu_ok, host_ok = req.fits(hw)
    G, S = request.global_batch, g.seq_len
    hb = human_bytes
    largest = next(layer for layer in g.layers if layer.name == req.largest_layer)
    head = (f"no plan fits a {_count(g.param_count)}-parameter model of {len(g.layers)} layers, global batch "
            f"{G} x {S} tokens, {request.compute_dtype} compute"
            + (", gradients clipped" if request.clip_gradients else "") + f", on {hw.name!r}. Smallest memory "
            f"that works: GPU {req.gpu_memory_bytes} bytes ({hb(req.gpu_memory_bytes)}), host "
            f"{req.host_memory_bytes} bytes ({hb(req.host_memory_bytes)}) of which pinned "
            f"{req.pinned_memory_bytes} bytes ({hb(req.pinned_memory_bytes)}), with "
            + ("every checkpoint kept" if req.activations == "keep" else f"activation policy {req.activations!r}")
            + ("." if req.layer_by_layer else ", each micro-batch in a pass of its own."))
    lines = [head]
    if not gpu_ok:
        slot = m.weight_slots + m.gradient_slots
        if req.obstacle_is_slot:
            why = (f"The obstacle is layer {req.obstacle!r}: its slot alone, with the buffers and reserve, "
                   f"does not fit. Fix: use a GPU with at least {hb(req.gpu_memory_bytes)}, or make the "
                   "layer smaller (a smaller vocabulary for an embedding or LM head; megatrain does not split "
                   "a layer across slots yet).")
        else:
            why = (f"The obstacle is layer {req.obstacle!r}, where checkpoints plus working memory peak. Fix: "
                   "lower the micro-batch size, the global batch or the sequence length (the layer's working "
                   f"memory grows with them), or use a GPU with at least {hb(req.gpu_memory_bytes)}.")
        lines.append(
            f"GPU: needs {hb(req.gpu_memory_bytes)} but has {hb(hw.gpu_memory_bytes)}, even with one weight slot, "
            f"micro-batch size {req.micro_batch_size}, no resident layer and every checkpoint offloaded or "
            f"recomputed (the least memory is with {req.activations!r}): the slot, sized for the largest layer "
            f"{req.largest_layer!r} ({largest.numel:,} elements), takes {hb(slot)} with its gradients; the "
            f"checkpoints and boundary gradients still on the GPU peak at {hb(m.activations_peak)}; layer "
            f"{req.peak_layer!r} needs {hb(req.peak_layer_work_bytes)} of working memory at that peak; buffers "
            f"{hb(m.buffers)}; reserve {hb(m.reserve)}. " + why)
    if not host_ok:
        lines.append(
            f"host: needs {hb(req.host_floor_bytes)} (has {hb(hw.host_memory_bytes)}) and "
            f"{hb(req.pinned_floor_bytes)} pinned (cap {hb(hw.pinned_memory_cap_bytes)}) even with no checkpoint "
            f"offloaded: FP32 master weights {hb(m.master_weights)} and {spec.label} moments {hb(m.adam_moments)} "
            f"({cost.MASTER_BYTES_PER_ELEMENT + spec.state_bytes_per_param} "
            f"bytes per parameter for all {g.param_count:,}; the largest layer is {req.largest_layer!r}), "
            + ("one gradient tile per trainable layer, each at its size, " if request.clip_gradients
               else "one gradient tile ")
            + f"{hb(m.gradient_ring)}, one staging tile {hb(m.staging_ring)}"
            + (f", and FP32 compute pins the master weights ({hb(m.pinned_masters)}; H2D reads them directly)"
               if m.state_pinned else "")
            + f". Fix: a host with at least {hb(req.host_floor_bytes)} and a pinned cap of "
            f"{hb(req.pinned_floor_bytes)}" + (", or compute in bfloat16 so only the rings are pinned"
                                               if m.state_pinned else "")
            + (", or do not clip gradients (the updates then run during the backward and share a ring of "
               "a few tiles)" if request.clip_gradients else "") + ".")
    if gpu_ok and host_ok:
        lines.append(
            f"GPU and host together: the GPU ({hb(hw.gpu_memory_bytes)}) fits only with checkpoints offloaded "
            f"to pinned host memory, and the pinned cap ({hb(hw.pinned_memory_cap_bytes)}) cannot hold them beside "
            "the gradient and staging rings; recomputing instead does not bring the GPU low enough. Fix: raise "
            "the pinned cap or host memory, use a GPU with more memory, or lower the global batch or the "
            "sequence length.")
    return InfeasibleRequestError("\n".join(lines), req)


__all__ = ["Requirements", "InfeasibleRequestError", "peak_op_layer", "infeasible_error"]
