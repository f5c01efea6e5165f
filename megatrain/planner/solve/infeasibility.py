"""When no plan fits: the least memory that would, and a message that names the obstacle and the fix.

:class:`Requirements` is computed by the search (``Search.requirements``, public as
:func:`megatrain.planner.solve.minimum_requirements`); :func:`infeasible_error` turns it into an
:class:`InfeasibleRequestError` whose message gives the GPU, host and pinned bytes that work, the
layer that is the obstacle (the largest slot, or the layer at the activation peak) and what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatrain.errors import PlanError
from megatrain.optim import OPTIMIZERS
from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph
from megatrain.ir.hardware import PINNED_FRACTION, HardwareSpec
from megatrain.ir.schedule import COMPUTE_KINDS, Schedule
from megatrain.planner.solve.request import SolveRequest
from megatrain.units import GiB, human_bytes


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

    ``host_on_gpu_bytes`` and ``pinned_on_gpu_bytes`` are the least host memory of those plans
    (each activation policy at its deepest, every checkpoint kept, both pass structures) that fit
    the request's GPU, None where none does: what a larger host needs on this GPU.
    ``nvme_host_bytes`` and ``nvme_pinned_bytes`` are what the floor's plan still needs on the host
    with everything an NVMe tier may hold moved there (:func:`megatrain.planner.nvme.least_host`).

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
    host_on_gpu_bytes: int | None = None
    pinned_on_gpu_bytes: int | None = None
    nvme_host_bytes: int | None = None
    nvme_pinned_bytes: int | None = None

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


def _host_flag(host: int, pinned: int) -> str:
    """The ``--host-memory`` that gives ``host`` bytes and a pinned cap of ``pinned`` (the cap is
    :data:`~megatrain.ir.hardware.PINNED_FRACTION` of it), rounded up to a whole GiB."""
    need = max(host, math.ceil(pinned / PINNED_FRACTION))
    return f"--host-memory {math.ceil(need / GiB)}GiB"


def infeasible_error(request: SolveRequest, req: Requirements) -> InfeasibleRequestError:
    """The error for ``request`` when no plan fits: the least memory any plan needs (``req``), then
    for the GPU and the host, whichever cannot fit, what takes the bytes, and last every change that
    would fit on its own, each with its size (in binary units: GiB, TiB)."""
    hw, g = request.hardware, request.graph
    m = req.memory
    spec = OPTIMIZERS[m.optimizer_name]
    gpu_ok, host_ok = req.fits(hw)
    G, S = request.global_batch, g.seq_len
    hb = human_bytes
    largest = next(layer for layer in g.layers if layer.name == req.largest_layer)
    policy = "every checkpoint kept" if req.activations == "keep" else f"activation policy {req.activations!r}"
    head = (f"no plan fits a {_count(g.param_count)}-parameter model of {len(g.layers)} layers, global batch "
            f"{G} x {S} tokens, {request.compute_dtype} compute"
            + (", gradients clipped" if request.clip_gradients else "")
            + f", on {hw.name!r} (GPU {hb(hw.gpu_memory_bytes)}, host {hb(hw.host_memory_bytes)} with a pinned cap "
            f"of {hb(hw.pinned_memory_cap_bytes)}). The least GPU memory any plan needs is {hb(req.gpu_memory_bytes)} "
            f"(micro-batch size {req.micro_batch_size}, {policy}"
            + ("" if req.layer_by_layer else ", each micro-batch in a pass of its own")
            + f"; that plan needs a host of {hb(req.host_memory_bytes)}, {hb(req.pinned_memory_bytes)} pinned); the "
            f"least host memory any plan needs is {hb(req.host_floor_bytes)}, {hb(req.pinned_floor_bytes)} pinned "
            "(nothing offloaded).")
    lines = [head]
    fixes: list[str] = []
    if not gpu_ok:
        slot = m.weight_slots + m.gradient_slots
        if req.obstacle_is_slot:
            why = (f"The obstacle is layer {req.obstacle!r}: its slot alone, with the buffers and reserve, "
                   "does not fit.")
            fixes.append("make the layer smaller (a smaller vocabulary for an embedding or LM head; megatrain does "
                         "not split a layer across slots yet)")
        else:
            why = f"The obstacle is layer {req.obstacle!r}, where checkpoints plus working memory peak."
            fixes.append("a shorter sequence (the layer's working memory grows with it)")
            if req.layer_by_layer:
                fixes.append("a smaller global batch (layer by layer, every micro-batch's checkpoints are on the "
                             "GPU at once)")
        fixes.insert(0, f"a GPU with at least {hb(req.gpu_memory_bytes)}")
        lines.append(
            f"GPU: needs at least {hb(req.gpu_memory_bytes)} and has {hb(hw.gpu_memory_bytes)}, even with one weight "
            f"slot, micro-batch size {req.micro_batch_size}, no resident layer and every checkpoint offloaded or "
            f"recomputed (the least memory is with {req.activations!r}): the slot, sized for the largest layer "
            f"{req.largest_layer!r} ({largest.numel:,} elements), takes {hb(slot)} with its gradients; the "
            f"checkpoints and boundary gradients still on the GPU peak at {hb(m.activations_peak)}; layer "
            f"{req.peak_layer!r} needs {hb(req.peak_layer_work_bytes)} of working memory at that peak; buffers "
            f"{hb(m.buffers)}; reserve {hb(m.reserve)}. " + why)
    if not host_ok:
        lines.append(
            f"host: needs at least {hb(req.host_floor_bytes)} (has {hb(hw.host_memory_bytes)}) and "
            f"{hb(req.pinned_floor_bytes)} pinned (cap {hb(hw.pinned_memory_cap_bytes)}), with no checkpoint "
            f"offloaded: FP32 master weights {hb(m.master_weights)} and {spec.label} moments {hb(m.adam_moments)} "
            f"({cost.MASTER_BYTES_PER_ELEMENT + spec.state_bytes_per_param} "
            f"bytes per parameter for all {g.param_count:,}; the largest layer is {req.largest_layer!r}), "
            + ("one gradient tile per trainable layer, each at its size, " if request.clip_gradients
               else "one gradient tile ")
            + f"{hb(m.gradient_ring)}, one staging tile {hb(m.staging_ring)}"
            + (f", and FP32 compute pins the master weights ({hb(m.pinned_masters)}; H2D reads them directly)"
               if m.state_pinned else "") + ".")
        if gpu_ok and req.host_on_gpu_bytes is not None:
            fixes.append(f"a host with at least {hb(req.host_on_gpu_bytes)} and a pinned cap of "
                         f"{hb(req.pinned_on_gpu_bytes)} (megatrain plan "
                         f"{_host_flag(req.host_on_gpu_bytes, req.pinned_on_gpu_bytes)})")
        if req.nvme_host_bytes is not None and not hw.has_nvme:
            moved = f"{spec.label} moments" + (
                ", the clipped gradients' tiles" if request.clip_gradients else "") + (
                " and, with BF16 compute, FP32 masters" if request.compute_dtype == "bfloat16" else "")
            enough = (req.nvme_host_bytes <= hw.host_memory_bytes
                      and req.nvme_pinned_bytes <= hw.pinned_memory_cap_bytes)
            fixes.append(
                f"an NVMe tier for {moved}: megatrain plan --nvme 4xgen5 (or 4xgen4, 8xgen4, 8xgen5), "
                + ("on this host" if enough else
                   f"with a host of at least {hb(req.nvme_host_bytes)} and a pinned cap of "
                   f"{hb(req.nvme_pinned_bytes)} ({_host_flag(req.nvme_host_bytes, req.nvme_pinned_bytes)})")
                + "; megatrain train --nvme-dir DIR --host-memory SIZE trains so")
        if m.state_pinned:
            fixes.append("compute in bfloat16, so that only the rings are pinned")
    if not gpu_ok and not host_ok:  # neither alone is enough: the least-GPU plan's two sizes together
        fixes = [f"a GPU with at least {hb(req.gpu_memory_bytes)} and a host with at least "
                 f"{hb(req.host_memory_bytes)} and a pinned cap of {hb(req.pinned_memory_bytes)}"]
    if gpu_ok and host_ok:
        lines.append(
            f"GPU and host together: the GPU ({hb(hw.gpu_memory_bytes)}) fits only with checkpoints offloaded "
            f"to pinned host memory, and the pinned cap ({hb(hw.pinned_memory_cap_bytes)}) cannot hold them beside "
            "the gradient and staging rings; recomputing instead does not bring the GPU low enough.")
        fixes += ["more host memory, for a higher pinned cap (megatrain plan --host-memory SIZE)",
                  "a GPU with more memory", "a smaller global batch or a shorter sequence"]
    fixes.append("a smaller model")
    lines.append("Fix, any one of: " + "; ".join(f"({chr(ord('a') + k)}) {f}" for k, f in enumerate(fixes)) + ".")
    return InfeasibleRequestError("\n".join(lines), req)


__all__ = ["Requirements", "InfeasibleRequestError", "peak_op_layer", "infeasible_error"]
