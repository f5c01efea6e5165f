"""Solve for a Plan: choose the knobs that minimise the simulated step time within memory.

Method. Branch and bound over a small enumeration, with the simulator as the objective.

1. Knobs. The small integer knobs are enumerated exhaustively: micro-batch size (a divisor of the
   global batch; the number of micro-batches follows), streaming weight slots ``1..max_slots``,
   prefetch distance ``0..slots-1`` and host gradient ring ``1..max_grad_ring``; the BF16 staging
   ring is 2 (double-buffered) where host memory allows and 1 otherwise. It has no op of its own in
   the schedule, so it costs pinned memory and no time.
2. Resident layers. For each (micro-batch size, slots, prefetch distance) the GPU memory left after
   the streaming slots, buffers, reserve and the activation peak is filled with resident layers: a
   0/1 knapsack whose value per layer is the H2D seconds residency saves (the copies the lowering
   issues for it without residency, less the one a resident layer still needs, times
   :func:`cost.h2d_time`) and whose weight is the GPU bytes of one more weight and gradient slot.
   The knapsack is a plain-data function ``(values, weights, capacity) -> chosen indices``, as in
   ``torch/_functorch/_activation_checkpointing/knapsack.py``: :func:`greedy_knapsack` (by value
   per byte) for :func:`solve_enumerate`, :func:`milp_knapsack` (``scipy.optimize.milp``, HiGHS) for
   :func:`solve_milp`; the two are swapped and compared under one signature.
3. Bounds. Every candidate gets a lower bound on its step time: the longest path through its
   schedule lowered for one micro-batch, with each compute op standing for the visit's ``M``
   micro-batches (:func:`_lower_bound`), timed by the cost model's op times. The simulator respects
   every edge of that path, so it can never beat the bound; with duplex copies it adds no other
   wait and the bound is the simulated step time, so one simulation confirms the optimum. With one
   shared copy engine the engine's busy time is a second bound and a few more candidates are
   simulated.
4. Search. Candidates are simulated in order of their bound (ties: fewer ops first); the search
   stops when the next bound is not below the best simulated time (within ``limits.rtol``), so
   the result is the enumeration's optimum, or after ``limits.max_simulations`` simulations, when
   :attr:`Solution.bound_s` says how far from proven it is. The default plan's knobs (two slots,
   distance one, ring two, no resident layer, one micro-batch) are always a candidate, so a solved
   plan never simulates slower than the default one when that fits.

Memory. GPU and host bytes come from :func:`cost.memory_breakdown`, evaluated once per micro-batch
size at one slot, one ring tile and one staging tile; a candidate's bytes scale the slot and ring
terms by their counts, which is how the cost model defines them (count x per-unit bytes). The
chosen plan's breakdown is then recomputed exactly from its own schedule.

Micro-batch sizes. A graph traced at one micro-batch size is rescaled by :func:`scale_graph`;
a request may instead give traced graphs per size (``SolveRequest.graphs``).

Extending. Only plans that :func:`megatrain.planner.lower.lower` accepts today are produced:
every checkpoint KEEP, ``layer_by_layer=True``, optimizer steps DURING_BACKWARD. Activation offload
or recompute per layer and per-micro-batch passes are to be further fields of :class:`_Knobs`,
enumerated in :func:`_knob_grid` and passed on by :func:`_plan`. The bound follows the lowered
pattern, so new ops (an activation D2H/H2D) only need their stream in ``_STREAM_INDEX`` and a
duration in :func:`_lower_bound`; per-micro-batch passes break its "a visit's ops run back to back"
premise and need the pattern lowered with every micro-batch. Their memory is not a function of
slot and ring counts alone (offload moves checkpoint bytes to pinned host memory, and the
activation peak then depends on the policy), so :func:`_scaled_memory` must take the activation
terms from a breakdown per activation policy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Mapping, Sequence

from megatrain.errors import PlanError
from megatrain.planner import cost
from megatrain.planner.graph import Layer, LayerGraph, Value
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.lower import lower
from megatrain.planner.plan import OptimizerPlacement, Plan
from megatrain.planner.schedule import OpKind, Schedule
from megatrain.planner.simulate import simulate
from megatrain.planner.timeline import Timeline

GiB = 1 << 30

DEFAULT_STAGING_RING = 2
"""BF16 staging tiles: one being read by the H2D in flight, one being filled for the next copy."""


# -- micro-batch scaling ---------------------------------------------------------------------------

def scale_graph(graph: LayerGraph, micro_batch_size: int) -> LayerGraph:
    """``graph`` (traced for micro-batches of ``graph.micro_batch_size``) for ``micro_batch_size``.

    With ``k = micro_batch_size / graph.micro_batch_size`` (an integer), each layer's
    ``fwd_flops``, ``bwd_flops`` and ``work_bytes`` and the ``nbytes`` of every value whose shape
    has a dimension equal to the traced micro-batch size (the batch dimension, wherever it is) are
    multiplied by ``k``, and that dimension (the first one of that size) with them. Parameters,
    buffers and values without such a dimension (a ``(seq, seq)`` mask, the scalar loss) are kept.

    Exact, for a fixed ``seq_len``, for everything computed per token (projections, MLPs, norms,
    embeddings, the LM head and loss) and for attention, whose cost is per sequence. It
    over-estimates values and work that do not depend on the batch but have a dimension of the
    traced size, such as rotary tables of shape ``(1, seq, head_dim)`` traced at micro-batch 1;
    these are small, and over-estimating memory costs a little batch size where under-estimating
    costs an out-of-memory error. Trace at micro-batch size 1 for the most uses.

    Raises:
        ValueError: ``micro_batch_size`` is not a positive multiple of ``graph.micro_batch_size``.
    """
    b0 = graph.micro_batch_size
    if micro_batch_size == b0:
        return graph
    if micro_batch_size < 1 or micro_batch_size % b0:
        raise ValueError(f"scale_graph: micro_batch_size={micro_batch_size} is not a positive multiple of "
                         f"the traced micro-batch size {b0}; trace the model at micro_batch_size=1 or pass "
                         "a traced graph for this size in SolveRequest.graphs")
    k = micro_batch_size // b0

    def scale_value(v: Value) -> Value:
        if b0 not in v.shape:
            return v
        d = v.shape.index(b0)
        shape = v.shape[:d] + (v.shape[d] * k,) + v.shape[d + 1:]
        return replace(v, shape=shape, nbytes=v.nbytes * k)

    layers = tuple(replace(layer, fwd_flops=layer.fwd_flops * k, bwd_flops=layer.bwd_flops * k,
                           work_bytes=layer.work_bytes * k) for layer in graph.layers)
    return LayerGraph(layers=layers, values=tuple(scale_value(v) for v in graph.values),
                      batch_inputs=graph.batch_inputs, loss=graph.loss, micro_batch_size=micro_batch_size,
                      seq_len=graph.seq_len, meta=dict(graph.meta, scaled_from_micro_batch_size=b0))


# -- request and solution --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SolveLimits:
    """The ranges a solver searches and when it stops.

    Attributes:
        max_slots: streaming weight slots are tried from 1 to this.
        max_grad_ring: host gradient tiles are tried from 1 to this.
        micro_batch_sizes: sizes to try (each must divide the global batch); None for every divisor.
        rtol: stop once no unexplored candidate's lower bound is below ``best x (1 - rtol)``; 0
            proves the optimum of the enumeration under the simulator.
        max_simulations: most candidates simulated; the search stops there, and
            ``Solution.bound_s`` tells how far from proven the answer is.
    """

    max_slots: int = 4
    max_grad_ring: int = 3
    micro_batch_sizes: tuple[int, ...] | None = None
    rtol: float = 0.0
    max_simulations: int = 64

    def __post_init__(self) -> None:
        if self.max_slots < 1 or self.max_grad_ring < 1:
            raise PlanError(f"SolveLimits(max_slots={self.max_slots}, max_grad_ring={self.max_grad_ring}): "
                            "both must be >= 1")
        if not 0.0 <= self.rtol < 1.0:
            raise PlanError(f"SolveLimits.rtol={self.rtol}: use a fraction in [0, 1)")
        if self.max_simulations < 1:
            raise PlanError(f"SolveLimits.max_simulations={self.max_simulations}: at least one is needed")
        if self.micro_batch_sizes is not None and (not self.micro_batch_sizes
                                                   or min(self.micro_batch_sizes) < 1):
            raise PlanError(f"SolveLimits.micro_batch_sizes={self.micro_batch_sizes}: give positive sizes "
                            "or None for every divisor of the global batch")


GraphSource = Mapping[int, LayerGraph] | Callable[[int], LayerGraph]


@dataclass(frozen=True, slots=True)
class SolveRequest:
    """What to plan for, as plain data.

    Attributes:
        graph: the model traced for some micro-batch size (1 is best: :func:`scale_graph` derives
            every other size from it) and a fixed ``seq_len``.
        hardware: the GPU and host to plan for.
        global_batch: sequences per optimizer step (micro-batch size x micro-batches).
        compute_dtype: ``"bfloat16"`` or ``"float32"``, the dtype the GPU computes in.
        limits: the search ranges and stopping rule.
        graphs: optional traced graphs by micro-batch size (a mapping or a callable), used instead
            of rescaling ``graph`` for the sizes they cover.
    """

    graph: LayerGraph
    hardware: HardwareSpec
    global_batch: int
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    limits: SolveLimits = SolveLimits()
    graphs: GraphSource | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise PlanError(f"SolveRequest.global_batch={self.global_batch}: at least one sequence per step")
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise PlanError(f"SolveRequest.compute_dtype={self.compute_dtype!r}: use 'bfloat16' or 'float32'")
        if not self.hardware.has_gpu:
            raise PlanError(f"hardware {self.hardware.name!r} has no GPU rates (a host-only spec): plan with a "
                            "preset such as preset('H100_SXM') or a spec measured on a GPU machine")

    def micro_batch_sizes(self) -> tuple[int, ...]:
        """The sizes the solver tries, descending: divisors of the global batch it has a graph for."""
        G = self.global_batch
        sizes = self.limits.micro_batch_sizes or tuple(d for d in range(1, G + 1) if G % d == 0)
        bad = [s for s in sizes if G % s]
        if bad:
            raise PlanError(f"SolveLimits.micro_batch_sizes {bad} do not divide the global batch {G}; "
                            "every micro-batch must be full")
        have = [s for s in sizes if self._has_graph(s)]
        if not have:
            raise PlanError(f"no micro-batch size in {sorted(sizes)} can be planned from a graph traced at "
                            f"micro_batch_size={self.graph.micro_batch_size}; trace at micro_batch_size=1")
        return tuple(sorted(set(have), reverse=True))

    def _has_graph(self, size: int) -> bool:
        if callable(self.graphs) or (self.graphs is not None and size in self.graphs):
            return True
        return size % self.graph.micro_batch_size == 0

    def graph_for(self, micro_batch_size: int) -> LayerGraph:
        """The LayerGraph for micro-batches of ``micro_batch_size`` (given, or by scale_graph)."""
        g = None
        if callable(self.graphs):
            g = self.graphs(micro_batch_size)
        elif self.graphs is not None:
            g = self.graphs.get(micro_batch_size)
        if g is None:
            return scale_graph(self.graph, micro_batch_size)
        if g.micro_batch_size != micro_batch_size or g.seq_len != self.graph.seq_len:
            raise PlanError(f"SolveRequest.graphs gave a graph for micro_batch_size={g.micro_batch_size}, "
                            f"seq_len={g.seq_len} when asked for {micro_batch_size}, {self.graph.seq_len}")
        return g


@dataclass(frozen=True, slots=True)
class Solution:
    """A solved plan with its prediction.

    Attributes:
        plan: the chosen Plan (lower it with ``graph``).
        micro_batch_size: sequences per micro-batch; ``plan.micro_batches`` of them make the step.
        graph: the LayerGraph at ``micro_batch_size`` the plan was lowered and simulated with.
        schedule: ``lower(graph, plan)``, verified by the caller if it wishes.
        timeline: the simulated step (``timeline.step_time_s`` in seconds).
        memory: host and GPU bytes of the plan (``cost.memory_breakdown`` of ``schedule``).
        method: ``"enumerate"`` or ``"milp"``.
        candidates: knob combinations that fit in memory and got a lower bound.
        simulated: how many of them were lowered and simulated.
        bound_s: the smallest lower bound among candidates not simulated (``inf`` when none is
            left): the enumeration's optimum is at least ``min(bound_s, timeline.step_time_s)``.
        solve_time_s: wall time of the solve, in seconds.
    """

    plan: Plan
    micro_batch_size: int
    graph: LayerGraph
    schedule: Schedule
    timeline: Timeline
    memory: cost.MemoryBreakdown
    method: str
    candidates: int
    simulated: int
    bound_s: float
    solve_time_s: float

    @property
    def step_time_s(self) -> float:
        return self.timeline.step_time_s

    @property
    def optimality_gap(self) -> float:
        """How much faster the best unexplored candidate could be, as a fraction of the step (0: none)."""
        t = self.timeline.step_time_s
        return max(0.0, 1.0 - self.bound_s / t) if t > 0 else 0.0


# -- knapsacks (one signature) ---------------------------------------------------------------------

Knapsack = Callable[[Sequence[float], Sequence[int], int], frozenset[int]]


def greedy_knapsack(values: Sequence[float], weights: Sequence[int], capacity: int) -> frozenset[int]:
    """Items by value per unit of weight (ties: lower index), each taken while it fits.

    Optimal when every weight is equal (the case for resident layers, whose slots are all sized for
    the largest layer), within one item's value otherwise. Items of value <= 0 are never taken.
    """
    order = sorted((i for i, v in enumerate(values) if v > 0),
                   key=lambda i: (-values[i] / max(weights[i], 1), i))
    chosen, left = [], capacity
    for i in order:
        if weights[i] <= left:
            chosen.append(i)
            left -= weights[i]
    return frozenset(chosen)


def milp_knapsack(values: Sequence[float], weights: Sequence[int], capacity: int) -> frozenset[int]:
    """The 0/1 knapsack solved by ``scipy.optimize.milp`` (HiGHS branch and cut), optimal to HiGHS's
    tolerances (totals closer than about 1e-6 of the largest value are not told apart).

    Items with equal value and weight (the identical blocks of a transformer) form one integer
    variable, how many of them to take, and the lowest indices of a group are taken, as
    :func:`greedy_knapsack` breaks ties; this also shrinks a 96-block model to a handful of
    variables. Items of value <= 0 are never taken. Trivial instances (nothing fits, or everything
    does) are answered without calling HiGHS.

    Raises:
        PlanError: HiGHS reports no optimal solution (it should not for a knapsack).
    """
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    items = [i for i, v in enumerate(values) if v > 0 and weights[i] <= capacity]
    if not items:
        return frozenset()
    if sum(weights[i] for i in items) <= capacity:
        return frozenset(items)
    groups: dict[tuple[float, int], list[int]] = {}
    for i in items:
        groups.setdefault((values[i], weights[i]), []).append(i)
    keys = list(groups)
    v = np.array([k[0] for k in keys], dtype=float)
    w = np.array([k[1] for k in keys], dtype=float)
    count = np.array([len(groups[k]) for k in keys], dtype=float)
    res = milp(c=-v / v.max(), integrality=np.ones(len(keys)), bounds=Bounds(0, count),
               constraints=LinearConstraint(w[None, :], ub=float(capacity)),
               options={"mip_rel_gap": 0.0})
    if res.status != 0 or res.x is None:
        raise PlanError(f"scipy.optimize.milp (HiGHS) found no optimal resident-layer selection: {res.message}. "
                        "Fix: use solve(request, method='enumerate')")
    chosen: list[int] = []
    for k, x in zip(keys, res.x):
        chosen.extend(sorted(groups[k])[:int(round(x))])
    return frozenset(chosen)


# -- infeasibility ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Requirements:
    """The smallest memory any plan in the search needs, and what drives it (bytes).

    Computed at the smallest micro-batch size, one streaming slot, prefetch distance 0, no resident
    layer, one gradient-ring tile and one staging tile; GPU and host needs are independent of each
    other (no knob trades one for the other today), so together they are feasible.

    ``largest_layer`` sizes every weight slot; ``peak_layer`` runs when checkpoints plus working
    memory peak. ``obstacle`` is the layer that keeps the GPU from fitting: the largest layer when
    the fixed allocations alone (one slot, buffers, reserve) exceed the GPU
    (``obstacle_is_slot``), else the peak layer.
    """

    gpu_memory_bytes: int
    host_memory_bytes: int
    pinned_memory_bytes: int
    micro_batch_size: int
    memory: cost.MemoryBreakdown
    largest_layer: str
    peak_layer: str
    peak_layer_work_bytes: int
    obstacle: str
    obstacle_is_slot: bool

    def fits(self, hw: HardwareSpec) -> tuple[bool, bool]:
        """(GPU fits, host fits) on ``hw``."""
        return (self.gpu_memory_bytes <= hw.gpu_memory_bytes,
                self.host_memory_bytes <= hw.host_memory_bytes
                and self.pinned_memory_bytes <= hw.pinned_memory_cap_bytes)


class InfeasibleRequestError(PlanError):
    """No plan fits; ``requirements`` holds the smallest memory that would."""

    def __init__(self, message: str, requirements: Requirements):
        super().__init__(message)
        self.requirements = requirements


def _peak_op_layer(schedule: Schedule, graph: LayerGraph) -> int:
    """Layer of the compute op at which checkpoints + working memory peak (stream order)."""
    live = cost.activation_liveness(schedule, graph)
    cur, best, best_layer = live.at_start, -1, 0
    for i, op in enumerate(schedule.ops):
        if op.kind not in (OpKind.FWD, OpKind.BWD):
            continue
        cur += live.alloc[i]
        if cur + live.work[i] > best:
            best, best_layer = cur + live.work[i], op.layer
        cur -= live.free[i]
    return best_layer


def minimum_requirements(request: SolveRequest) -> Requirements:
    """The least GPU, host and pinned host memory a plan for ``request`` needs (see Requirements)."""
    mbs = min(request.micro_batch_sizes())
    g = request.graph_for(mbs)
    return _requirements(request, mbs, g, *_unit(request, mbs, g))


def _unit(request: SolveRequest, mbs: int, g: LayerGraph) -> tuple[Schedule, cost.MemoryBreakdown]:
    """Schedule and bytes of the smallest plan at ``mbs``: one slot, distance 0, one tile per ring."""
    plan = _plan(request, mbs, _Knobs(slots=1, prefetch_distance=0, grad_ring=1, staging_ring=1))
    sched = lower(g, plan)
    return sched, cost.memory_breakdown(g, plan, request.hardware, sched)


def _requirements(request: SolveRequest, mbs: int, g: LayerGraph, sched: Schedule,
                  mem: cost.MemoryBreakdown) -> Requirements:
    largest = max(g.layers, key=lambda layer: (layer.numel, -layer.index))
    peak = g.layers[_peak_op_layer(sched, g)]
    slot = mem.gpu_fixed > request.hardware.gpu_memory_bytes
    return Requirements(gpu_memory_bytes=mem.gpu_peak, host_memory_bytes=mem.host_total,
                        pinned_memory_bytes=mem.host_pinned, micro_batch_size=mbs, memory=mem,
                        largest_layer=largest.name, peak_layer=peak.name, peak_layer_work_bytes=peak.work_bytes,
                        obstacle=largest.name if slot else peak.name, obstacle_is_slot=slot)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _infeasible(request: SolveRequest, req: Requirements) -> InfeasibleRequestError:
    hw, g = request.hardware, request.graph
    m = req.memory
    gpu_ok, host_ok = req.fits(hw)
    G, S = request.global_batch, g.seq_len
    largest = next(layer for layer in g.layers if layer.name == req.largest_layer)
    head = (f"no plan fits a {_count(g.param_count)}-parameter model of {len(g.layers)} layers, global batch "
            f"{G} x {S} tokens, {request.compute_dtype} compute, on {hw.name!r}. Smallest memory that works: "
            f"GPU {req.gpu_memory_bytes} bytes ({cost.human_bytes(req.gpu_memory_bytes)}), host {req.host_memory_bytes} "
            f"bytes ({cost.human_bytes(req.host_memory_bytes)}) of which pinned {req.pinned_memory_bytes} bytes "
            f"({cost.human_bytes(req.pinned_memory_bytes)}).")
    lines = [head]
    if not gpu_ok:
        slot = m.weight_slots + m.gradient_slots
        if req.obstacle_is_slot:
            why = (f"The obstacle is layer {req.obstacle!r}: its slot alone, with the buffers and reserve, "
                   f"does not fit. Fix: use a GPU with at least {cost.human_bytes(req.gpu_memory_bytes)}, or make the "
                   "layer smaller (a smaller vocabulary for an embedding or LM head; megatrain does not split "
                   "a layer across slots yet).")
        else:
            why = (f"The obstacle is layer {req.obstacle!r}, where checkpoints plus working memory peak. Fix: "
                   "lower the global batch or the sequence length (checkpoints of every sequence stay on the "
                   f"GPU until the backward), or use a GPU with at least {cost.human_bytes(req.gpu_memory_bytes)}; "
                   "activation offload and recompute (not lowered yet) will lower this.")
        lines.append(
            f"GPU: needs {cost.human_bytes(req.gpu_memory_bytes)} but has {cost.human_bytes(hw.gpu_memory_bytes)}, even with one "
            f"weight slot, micro-batch size {req.micro_batch_size} and no resident layer: the slot, sized for "
            f"the largest layer {req.largest_layer!r} ({largest.numel:,} elements), takes {cost.human_bytes(slot)} with "
            f"its gradients; the checkpoints and boundary gradients of the {G} sequence{'s' if G != 1 else ''} peak at "
            f"{cost.human_bytes(m.activations_peak)}; layer {req.peak_layer!r} needs {cost.human_bytes(req.peak_layer_work_bytes)} "
            f"of working memory at that peak; buffers {cost.human_bytes(m.buffers)}; reserve {cost.human_bytes(m.reserve)}. " + why)
    if not host_ok:
        lines.append(
            f"host: needs {cost.human_bytes(req.host_memory_bytes)} (has {cost.human_bytes(hw.host_memory_bytes)}) and "
            f"{cost.human_bytes(req.pinned_memory_bytes)} pinned (cap {cost.human_bytes(hw.pinned_memory_cap_bytes)}): FP32 master "
            f"weights {cost.human_bytes(m.master_weights)} and Adam moments {cost.human_bytes(m.adam_moments)} (12 bytes per "
            f"parameter for all {g.param_count:,}; the largest layer is {req.largest_layer!r}), one gradient "
            f"tile {cost.human_bytes(m.gradient_ring)}, one staging tile {cost.human_bytes(m.staging_ring)}"
            + (", and FP32 compute pins the master weights and moments (H2D reads them directly)"
               if m.state_pinned else "")
            + f". Fix: a host with at least {cost.human_bytes(req.host_memory_bytes)} and a pinned cap of "
            f"{cost.human_bytes(req.pinned_memory_bytes)}" + (", or compute in bfloat16 so only the rings are pinned"
                                                    if m.state_pinned else "") + ".")
    return InfeasibleRequestError("\n".join(lines), req)


# -- the search ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Knobs:
    """The enumerated knobs of one candidate besides the micro-batch size.

    New knobs (a per-layer ActivationPolicy, ``layer_by_layer=False``) go here and into
    :func:`_knob_grid`, once :func:`lower` implements them.
    """

    slots: int
    prefetch_distance: int
    grad_ring: int
    staging_ring: int
    resident: frozenset[int] = frozenset()


def _plan(request: SolveRequest, micro_batch_size: int, k: _Knobs) -> Plan:
    return Plan(micro_batches=request.global_batch // micro_batch_size, slots=k.slots,
                prefetch_distance=k.prefetch_distance, grad_ring=k.grad_ring, resident=k.resident,
                activations=(), layer_by_layer=True, optimizer=OptimizerPlacement.DURING_BACKWARD,
                compute_dtype=request.compute_dtype, staging_ring=k.staging_ring)


def _knob_grid(limits: SolveLimits) -> list[tuple[int, int]]:
    """(slots, prefetch distance) pairs; rings and residents are chosen per pair."""
    return [(s, d) for s in range(1, limits.max_slots + 1) for d in range(s)]


def _scaled_memory(base: cost.MemoryBreakdown, weight_slots: int, grad_ring: int,
                   staging_ring: int) -> cost.MemoryBreakdown:
    """``base`` (one weight slot, one ring tile, one staging tile) with the counts of a candidate.

    The cost model defines these terms as count x per-unit bytes (``cost.memory_breakdown``), and
    the activation terms depend only on the order of compute ops, which no knob here changes.
    """
    return replace(base, weight_slots=base.weight_slots * weight_slots,
                   gradient_slots=base.gradient_slots * weight_slots,
                   gradient_ring=base.gradient_ring * grad_ring, staging_ring=base.staging_ring * staging_ring)


@dataclass(slots=True)
class _SizeOption:
    """Everything about one micro-batch size the search reuses."""

    size: int
    micro_batches: int
    graph: LayerGraph
    base: cost.MemoryBreakdown  # one slot, one ring tile, one staging tile
    fwd: tuple[float, ...]  # seconds of all micro-batches' forwards of each layer
    bwd: tuple[float, ...]


_STREAM_INDEX = {OpKind.H2D: 0, OpKind.FWD: 1, OpKind.BWD: 1, OpKind.D2H: 2, OpKind.OPT: 3}


@dataclass(frozen=True, slots=True)
class _Pattern:
    """The schedule of a candidate's knobs at one micro-batch, as flat arrays for the bound.

    ``lower`` with ``micro_batches=1`` gives every op of a layer visit once, with the same
    dependencies the full schedule has between visits (see :func:`_lower_bound`); which copies it
    issues depends on slots, distance, residents and ring only, not on sizes or micro-batches.
    """

    kinds: tuple[OpKind, ...]
    layers: tuple[int, ...]
    deps: tuple[tuple[int, ...], ...]

    def copies(self, n_layers: int) -> list[int]:
        """H2D copies per layer."""
        c = [0] * n_layers
        for kind, layer in zip(self.kinds, self.layers):
            if kind is OpKind.H2D:
                c[layer] += 1
        return c


def _pattern(graph: LayerGraph, k: _Knobs) -> _Pattern:
    sched = lower(graph, Plan(micro_batches=1, slots=k.slots, prefetch_distance=k.prefetch_distance,
                              grad_ring=k.grad_ring, resident=k.resident))
    return _Pattern(tuple(op.kind for op in sched.ops), tuple(op.layer for op in sched.ops),
                    tuple(op.deps for op in sched.ops))


@dataclass(slots=True)
class _Times:
    """Per-layer op times (seconds) that do not depend on the micro-batch size."""

    h2d: tuple[float, ...]
    d2h: tuple[float, ...]
    opt: tuple[float, ...]


def _lower_bound(p: _Pattern, size: _SizeOption, t: _Times, duplex: bool) -> float:
    """A step time no schedule of this candidate can beat: the longest path of its pattern.

    The pattern's compute op of a visit stands for the visit's ``M`` compute ops, which run back to
    back on the in-order compute stream, so it lasts their sum (``M x`` the op time at this
    micro-batch size); everything the full schedule makes wait on a visit (copies into its slot,
    the prefetch window, its gradient copy) waits on the visit's last op, so it waits on the whole
    group here. Every op then starts no earlier than the latest end of its dependencies and of the
    op before it on its stream, which the simulator also respects. With duplex copies each stream
    has a resource of its own, the simulator adds no other wait, and the bound is the simulated
    step time; with one shared copy engine the engine's total busy time is a second bound.
    """
    n = len(p.kinds)
    end = [0.0] * n
    stream_end = [0.0, 0.0, 0.0, 0.0]
    h_sum = d_sum = 0.0
    fwd, bwd, h2d, d2h, opt = size.fwd, size.bwd, t.h2d, t.d2h, t.opt
    for i in range(n):
        kind, layer = p.kinds[i], p.layers[i]
        s = _STREAM_INDEX[kind]
        start = stream_end[s]
        for d in p.deps[i]:
            if end[d] > start:
                start = end[d]
        if kind is OpKind.FWD:
            dur = fwd[layer]
        elif kind is OpKind.BWD:
            dur = bwd[layer]
        elif kind is OpKind.H2D:
            dur = h2d[layer]
            h_sum += dur
        elif kind is OpKind.D2H:
            dur = d2h[layer]
            d_sum += dur
        else:
            dur = opt[layer]
        end[i] = stream_end[s] = start + dur
    bound = max(stream_end)
    return bound if duplex else max(bound, h_sum + d_sum)


@dataclass(order=True, slots=True)
class _Candidate:
    key: tuple
    option: _SizeOption = field(compare=False)
    knobs: _Knobs = field(compare=False)
    bound: float = field(compare=False)
    memory: cost.MemoryBreakdown = field(compare=False)


def _fits(mem: cost.MemoryBreakdown, hw: HardwareSpec) -> bool:
    return (mem.gpu_peak <= hw.gpu_memory_bytes and mem.host_total <= hw.host_memory_bytes
            and mem.host_pinned <= hw.pinned_memory_cap_bytes)


def _search(request: SolveRequest, knapsack: Knapsack, method: str) -> Solution:
    t_start = time.perf_counter()
    hw, limits = request.hardware, request.limits
    sizes = request.micro_batch_sizes()
    units = {}  # the smallest size's unit plan also gives the minimum requirements
    smallest = sizes[-1]
    g_small = request.graph_for(smallest)
    units[smallest] = (g_small, *_unit(request, smallest, g_small))
    need = _requirements(request, smallest, *units[smallest])
    if not all(need.fits(hw)):
        raise _infeasible(request, need)

    probe = Plan(compute_dtype=request.compute_dtype)
    layers: tuple[Layer, ...] = request.graph.layers
    n = len(layers)
    times = _Times(h2d=tuple(cost.h2d_time(layer, probe, hw) for layer in layers),
                   d2h=tuple(cost.d2h_time(layer, hw) for layer in layers),
                   opt=tuple(cost.opt_time(layer, hw) for layer in layers))

    options: list[_SizeOption] = []
    for mbs in sizes:
        M = request.global_batch // mbs
        g = request.graph_for(mbs) if mbs not in units else units[mbs][0]
        base = units[mbs][2] if mbs in units else _unit(request, mbs, g)[1]
        if base.gpu_peak > hw.gpu_memory_bytes:
            continue  # not even one slot fits beside this size's activations
        options.append(_SizeOption(mbs, M, g, base,
                                   fwd=tuple(M * cost.fwd_time(layer, probe, hw) for layer in g.layers),
                                   bwd=tuple(M * cost.bwd_time(layer, probe, hw) for layer in g.layers)))

    # Host memory does not depend on the micro-batch size or the slots (no checkpoint is offloaded).
    host_choices: list[tuple[int, int]] = []
    base0 = options[0].base
    for ring in range(1, limits.max_grad_ring + 1):
        for staging in (DEFAULT_STAGING_RING, 1):
            m = _scaled_memory(base0, 1, ring, staging)
            if m.host_total <= hw.host_memory_bytes and m.host_pinned <= hw.pinned_memory_cap_bytes:
                host_choices.append((ring, staging))
                break

    patterns: dict[_Knobs, _Pattern] = {}

    def pattern(k: _Knobs) -> _Pattern:
        k = replace(k, staging_ring=1)  # no op reads the staging ring
        if k not in patterns:
            patterns[k] = _pattern(request.graph, k)
        return patterns[k]

    chosen: dict[tuple, frozenset[int]] = {}
    candidates: list[_Candidate] = []
    seen: set[tuple] = set()

    def add(opt: _SizeOption, k: _Knobs) -> None:
        if (opt.size, k) in seen:
            return
        mem = _scaled_memory(opt.base, k.slots + len(k.resident), k.grad_ring, k.staging_ring)
        if not _fits(mem, hw):
            return
        seen.add((opt.size, k))
        lb = _lower_bound(pattern(k), opt, times, hw.duplex)
        # Ties: fewer ops (cheaper to simulate, less latency), more overlap, fewer bytes.
        key = (lb, opt.micro_batches, -k.prefetch_distance, -k.grad_ring, k.slots, -len(k.resident))
        candidates.append(_Candidate(key, opt, k, lb, mem))

    for opt in options:
        slot_bytes = opt.base.weight_slots + opt.base.gradient_slots
        for slots, distance in _knob_grid(limits):
            fixed = _scaled_memory(opt.base, slots, 1, 1).gpu_peak
            if fixed > hw.gpu_memory_bytes:
                continue
            spare = hw.gpu_memory_bytes - fixed
            # Every resident layer costs one more slot sized for the largest layer, so the spare
            # memory in slots decides the knapsack's answer.
            room = min(spare // slot_bytes, n) if slot_bytes else n
            key = (slots, distance, room)
            if key not in chosen:
                p0 = pattern(_Knobs(slots, distance, 1, 1))
                saved = [(c - 1) * times.h2d[i] for i, c in enumerate(p0.copies(n))]
                chosen[key] = knapsack(saved, [slot_bytes] * n, room * slot_bytes)
            resident = chosen[key]
            for ring, staging in host_choices:
                add(opt, _Knobs(slots, distance, ring, staging, resident))
    # The default plan's knobs: the solver never does worse than Plan() where Plan() fits.
    default = Plan()
    for opt in options:
        if (opt.micro_batches == 1 and default.slots <= limits.max_slots
                and default.grad_ring <= limits.max_grad_ring):
            add(opt, _Knobs(default.slots, default.prefetch_distance, default.grad_ring, default.staging_ring))

    if not candidates:  # every size's fixed memory passed minimum_requirements, so this is a bug
        raise _infeasible(request, need)
    candidates.sort()

    best: tuple[float, _Candidate, Schedule, Timeline] | None = None
    simulated = 0
    bound = math.inf
    for c in candidates:
        # 1e-9: the bound and the simulator add the same durations in different orders.
        if best is not None and c.bound >= best[0] * (1.0 - max(limits.rtol, 1e-9)):
            bound = c.bound
            break
        if simulated >= limits.max_simulations:
            bound = c.bound
            break
        plan = _plan(request, c.option.size, c.knobs)
        sched = lower(c.option.graph, plan)
        tl = simulate(sched, c.option.graph, hw)
        simulated += 1
        if best is None or tl.step_time_s < best[0]:
            best = (tl.step_time_s, c, sched, tl)
    assert best is not None
    _, c, sched, tl = best
    plan = sched.plan
    mem = cost.memory_breakdown(c.option.graph, plan, hw, sched)
    if mem != c.memory or not _fits(mem, hw):
        raise PlanError(f"internal: the solver predicted {c.memory} for {plan} but the cost model gives {mem}; "
                        "cost.memory_breakdown's slot and ring terms are no longer count x per-unit bytes "
                        "(update megatrain.planner.solve._scaled_memory)")
    return Solution(plan=plan, micro_batch_size=c.option.size, graph=c.option.graph, schedule=sched,
                    timeline=tl, memory=mem, method=method, candidates=len(candidates), simulated=simulated,
                    bound_s=bound, solve_time_s=time.perf_counter() - t_start)


# -- public solvers --------------------------------------------------------------------------------

def solve_enumerate(request: SolveRequest) -> Solution:
    """Exhaustive search with bounds; resident layers chosen greedily by H2D seconds saved per byte.

    Raises:
        InfeasibleRequestError (a PlanError): no plan fits; the message gives the smallest GPU and
            host memory that would work and the layer that is the obstacle.
    """
    return _search(request, greedy_knapsack, "enumerate")


def solve_milp(request: SolveRequest) -> Solution:
    """The same search with resident layers chosen by a 0/1 knapsack MILP (scipy.optimize.milp).

    Raises:
        InfeasibleRequestError (a PlanError): as :func:`solve_enumerate`.
    """
    return _search(request, milp_knapsack, "milp")


SOLVERS: dict[str, Callable[[SolveRequest], Solution]] = {"milp": solve_milp, "enumerate": solve_enumerate}


def solve(request: SolveRequest, method: Literal["milp", "enumerate"] = "milp") -> Solution:
    """Solve ``request`` with ``method`` (``"milp"`` or ``"enumerate"``).

    Raises:
        PlanError: unknown method, or no plan fits (InfeasibleRequestError, with the minima).
    """
    try:
        solver = SOLVERS[method]
    except KeyError:
        raise PlanError(f"unknown solver method {method!r}; use one of {sorted(SOLVERS)}") from None
    return solver(request)


__all__ = [
    "SolveLimits", "SolveRequest", "Solution", "Requirements", "InfeasibleRequestError", "scale_graph",
    "greedy_knapsack", "milp_knapsack", "minimum_requirements", "solve_enumerate", "solve_milp", "solve",
    "SOLVERS",
]
