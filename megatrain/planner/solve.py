"""Solve for a Plan: choose the knobs that minimise the simulated step time within memory.

Method. Best-first branch and bound over a structured enumeration, with the simulator as the
objective and two lower bounds to prune with.

1. Knobs. Enumerated exhaustively: micro-batch size (a divisor of the global batch; the number of
   micro-batches follows) and, with several micro-batches, the pass structure: layer by layer
   (every micro-batch through a layer while its weights are on the GPU: one weight load per pass,
   every micro-batch's checkpoints alive at once) or per-micro-batch passes (weights loaded in every
   pass, one micro-batch's checkpoints alive, gradients summed in host accumulators of 4 bytes per
   trainable parameter); streaming weight slots ``1..max_slots`` and prefetch distance
   ``0..slots-1``. The host gradient ring is the largest in ``1..max_grad_ring`` that host memory
   allows (one more tile only removes a wait of a D2H on an optimizer step), and one tile per
   trainable layer when the request clips gradients (below). The BF16 staging ring is 2 (a CAST
   fills one tile while the H2D in flight reads the other) where pinned memory allows, else 1; and
   where pinned memory allows, also a tile per layer (``Plan.cast_once``: each layer cast once per
   step, for 2 bytes per parameter pinned), which the simulator keeps only when it is faster (ties
   go to the ring).
2. Activation policy per layer: KEEP the output checkpoint on the GPU, OFFLOAD it to pinned host
   memory after the forward and back before the local backward, or RECOMPUTE it in the backward
   phase. The 3^n choices are searched in structured families, each a nested chain of policies
   indexed by a depth ``j``: the policy covers the first ``j`` layers that have a checkpoint,
   earliest first, and keeps the rest.

   - ``offload``: every covered checkpoint is offloaded (activation checkpoint offload as in
     ZeRO-Infinity, Rajbhandari et al. 2021, arXiv:2104.07857).
   - ``alternate``: every other covered checkpoint is recomputed from the kept one before it. A
     run of one recompute needs no extra weight copy (the layer's weights stay in their slot for
     its own local backward, which comes next), and halves the covered memory for one extra
     forward of half the covered layers.
   - ``alternate+offload``: the same with the others offloaded: the least memory for half the
     copy traffic of ``offload`` (recompute and offload combined as in Beaumont et al. 2021,
     "Efficient Combination of Rematerialization and Offloading for Training DNNs", NeurIPS).
   - ``segments`` and ``segments+offload`` (deep models): one checkpoint stored every
     ``k = round(sqrt(n))`` layers and the others recomputed segment by segment (Chen et al. 2016,
     "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174): about ``2 sqrt(n)``
     checkpoints alive, and no pinned memory in the kept variant.

   Earliest first, because with layer-by-layer streaming the checkpoint of layer ``p`` is read
   by the local backward of its consumer about ``2 (n - p)`` visits after it is written: the
   earliest are held longest, all of them are alive at the turn to backward (where the memory of
   a step peaks), and their round trip to the host has the most compute to hide behind, while the
   last layers' checkpoints are read right after the turn, so offloading them would put a round
   trip on the critical path.

   For each family, micro-batch size, slot count and prefetch distance the least depth that fits
   is taken. Offloading more cannot make a step faster: with duplex copies an offload adds ops and
   dependencies to the DAG and never shortens its longest path, which is what the simulator
   computes; and offloading more to pay for resident layers does not pay either, because a
   resident slot holds the compute-dtype weights and the FP32 gradients of the largest layer, so
   the reloads that free it move more H2D bytes than residency saves (at most one compute-dtype
   copy of a layer per step). Recomputing more to pay for resident layers could pay when copies
   are the bottleneck; it is not searched.

   Why not a MILP over per-layer binaries, as Checkmate does for rematerialisation (Jain et al.
   2020, "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization",
   arXiv:1910.02653)? A MILP needs each choice's time as a linear term, such as its bytes over a
   copy engine's rate; but whether an offload costs anything depends on where it is (its round
   trip hides behind compute only with enough visits between the forward and the backward), and
   whether a recompute needs another weight copy depends on the slots, both of which the
   lowering and the simulator decide. The families are few, each candidate is timed by the
   simulator itself, and nesting makes the least depth that fits a bisection.

   The exact memory of a policy is ``cost.memory_breakdown`` of its lowered schedule. The least
   depth is found from a floor (every kept checkpoint of every micro-batch is alive when the
   first local backward starts, beside that op's working memory), then by galloping and bisection
   over exact evaluations, which assumes memory falls with depth (an offload or recompute only
   shortens a checkpoint's lifetime). Pinned host memory bounds the depth of offloading families
   from above.
3. Resident layers. For each candidate the GPU memory left after the streaming slots, buffers,
   reserve and the activation peak is filled with resident layers: a 0/1 knapsack whose value per
   layer is the H2D seconds residency saves (the copies the lowering issues for it without
   residency, less the one a resident layer still needs, times :func:`cost.h2d_time`) and whose
   weight is the GPU bytes of one more weight and gradient slot. The knapsack is a plain-data
   function ``(values, weights, capacity) -> chosen indices``, as in
   ``torch/_functorch/_activation_checkpointing/knapsack.py``: :func:`greedy_knapsack` (by value
   per byte) for :func:`solve_enumerate`, :func:`milp_knapsack` (``scipy.optimize.milp``, HiGHS)
   for :func:`solve_milp`; the two are swapped and compared under one signature.
4. Optimizer placement. A request that clips gradients by their global norm needs every gradient
   before any update, so its plans place the optimizer steps in the next step's forward
   (``OptimizerPlacement.NEXT_FORWARD``), with one host gradient tile per trainable layer; the
   objective is then the steady-state step, the schedule that starts with the previous step's
   updates (``lower(..., carries_updates=True)``). Otherwise updates run DURING_BACKWARD.
5. Bounds. Every candidate has two lower bounds on its step time. The cheap one needs no
   lowering (:func:`_quick_bound`): each resource's busy time (compute with the recomputes, H2D
   with every layer copied once and the reloads, D2H with the gradients and offloads, the host
   with the optimizer steps and one CAST per layer), and a flow-shop path: the forward of layer
   ``k`` cannot start before the first ``k + 1`` copies (and casts) are done, the rest of the
   compute follows, and after the local backward of layer ``l`` its gradients and those of every
   earlier layer still have to be copied out and applied. The pattern bound (:func:`_lower_bound`)
   is the longest path through the candidate's schedule lowered for one micro-batch, each op
   standing for its ``M`` micro-batches; the simulator respects every edge of that path, so it
   can never beat it. With duplex copies and no per-micro-batch edge between streams (no offload)
   the simulator adds no other wait and the bound is the simulated step time. Per-micro-batch
   passes break the pattern's premise that a visit's micro-batches run back to back, so their
   candidates are simulated on the cheap bound alone, with the D2H copies and host accumulations
   of every micro-batch in its busy times.
6. Search. One priority queue holds micro-batch sizes not yet evaluated (keyed by the cheap
   bound with every checkpoint kept), families not yet searched at a size and distance (keyed by
   the cheap bound of the floor's depth, which no deeper policy of the family beats), candidates
   (cheap bound) and refined candidates (pattern bound); the lowest key is expanded, refined or
   simulated, the most refined first among equals. The search stops when the lowest key is
   not below the best simulated time (within ``limits.rtol``), so the result is the enumeration's
   optimum, or after ``limits.max_simulations`` simulations, when :attr:`Solution.bound_s` says
   how far from proven it is. The default plan's knobs (two slots, distance one, ring two, every
   checkpoint kept, one micro-batch) are always a candidate, so a solved plan never simulates
   slower than the default plan when that fits.

Memory. GPU and host bytes come from :func:`cost.memory_breakdown`, evaluated once per
micro-batch size, activation policy and (for offloading policies) prefetch distance, whose
reload windows move the reloaded checkpoints' lifetimes; a candidate's bytes scale the slot and
staging terms by their counts, which is how the cost model defines them (count x per-unit bytes),
and take the gradient tiles' bytes from :func:`cost.gradient_ring_bytes` (each tile is sized to the
widest layer that uses it: with clipping, one tile per trainable layer at its own size).
The chosen plan's breakdown is then recomputed exactly from its own schedule, and the schedule is
verified against the hardware (``verify(schedule, graph, hw)``).

Micro-batch sizes. A graph traced at one micro-batch size is rescaled by :func:`scale_graph`;
a request may instead give traced graphs per size (``SolveRequest.graphs``).

When per-micro-batch passes win. They copy every streamed layer in each pass, so layer by layer is
faster whenever both fit; they fit where layer by layer does not when the GPU cannot hold every
micro-batch's checkpoints and pinned memory cannot hold every micro-batch's offloaded copies, and
then beat recomputation when the copies hide behind compute (a fast host link, large
micro-batches).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Mapping, Sequence

from megatrain.errors import PlanError
from megatrain.planner import cost
from megatrain.planner.graph import LayerGraph, Value
from megatrain.planner.hardware import HardwareSpec
from megatrain.planner.lower import lower
from megatrain.planner.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.planner.schedule import COMPUTE_KINDS, OpKind, Schedule
from megatrain.planner.simulate import simulate
from megatrain.planner.timeline import Timeline
from megatrain.planner.verify import verify

GiB = 1 << 30

DEFAULT_STAGING_RING = 2
"""BF16 staging tiles: one being read by the H2D in flight, one being filled for the next copy."""

CAST_ONCE = 0
"""The search's staging count for ``Plan.cast_once`` (a tile per layer, each layer cast once per step)."""

KEEP, OFFLOAD, RECOMPUTE = ActivationPolicy.KEEP, ActivationPolicy.OFFLOAD, ActivationPolicy.RECOMPUTE


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
        per_micro_batch_passes: also try per-micro-batch passes (``Plan.layer_by_layer=False``)
            at sizes with several micro-batches; False searches layer-by-layer plans only.
    """

    max_slots: int = 4
    max_grad_ring: int = 3
    micro_batch_sizes: tuple[int, ...] | None = None
    rtol: float = 0.0
    max_simulations: int = 64
    per_micro_batch_passes: bool = True

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
        clip_gradients: the run clips gradients by their global norm, so no layer may be updated
            before every gradient is known: plans place the optimizer steps in the next step's
            forward (``OptimizerPlacement.NEXT_FORWARD``, one host gradient tile per trainable
            layer) and are timed by their steady-state step.
    """

    graph: LayerGraph
    hardware: HardwareSpec
    global_batch: int
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    limits: SolveLimits = SolveLimits()
    graphs: GraphSource | None = field(default=None, compare=False)
    clip_gradients: bool = False

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
        schedule: the steady-state step's schedule, verified against the hardware:
            ``lower(graph, plan)``, or with ``OptimizerPlacement.NEXT_FORWARD`` (a request that
            clips gradients) ``lower(graph, plan, carries_updates=True)``, which starts with the
            previous step's optimizer steps (the first step after compiling runs
            ``lower(graph, plan)``).
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

    Optimal when every weight is equal (resident blocks of one size), within one item's value
    otherwise (an embedding or LM head's slot is sized for it, not for a block). Items of value <= 0 are never taken.
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


# -- activation policy families --------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Family:
    """A nested chain of activation policies indexed by depth (module docstring, item 2).

    The first ``depth`` layers that have a checkpoint are covered, earliest first: every
    ``period``-th covered layer (an anchor) is ``stored`` (KEEP or OFFLOAD), the others are
    RECOMPUTE; uncovered layers KEEP. ``period == 1`` covers with ``stored`` alone.
    """

    name: str
    stored: ActivationPolicy
    period: int

    def policy(self, eligible: Sequence[int], n_layers: int, depth: int) -> tuple[ActivationPolicy, ...]:
        """One policy per layer, or ``()`` (KEEP everywhere, the Plan's canonical form)."""
        out = [KEEP] * n_layers
        for rank, layer in enumerate(eligible[:depth]):
            out[layer] = self.stored if rank % self.period == self.period - 1 else RECOMPUTE
        return tuple(out) if any(a is not KEEP for a in out) else ()

    def removed(self, eligible: Sequence[int], checkpoint_bytes: Sequence[int]) -> list[int]:
        """``removed[j]``: checkpoint bytes (one micro-batch) not kept on the GPU at depth ``j``."""
        out = [0]
        for rank, layer in enumerate(eligible):
            gone = not (rank % self.period == self.period - 1 and self.stored is KEEP)
            out.append(out[-1] + (checkpoint_bytes[layer] if gone else 0))
        return out

    def offloaded(self, eligible: Sequence[int], checkpoint_bytes: Sequence[int]) -> list[int]:
        """``offloaded[j]``: checkpoint bytes (one micro-batch) offloaded at depth ``j``."""
        out = [0]
        for rank, layer in enumerate(eligible):
            moved = rank % self.period == self.period - 1 and self.stored is OFFLOAD
            out.append(out[-1] + (checkpoint_bytes[layer] if moved else 0))
        return out


def _families(n_eligible: int) -> tuple[_Family, ...]:
    """The families searched; segments of ``round(sqrt(n))`` only where they differ from pairs."""
    families = [_Family("offload", OFFLOAD, 1), _Family("alternate", KEEP, 2),
                _Family("alternate+offload", OFFLOAD, 2)]
    k = round(math.sqrt(n_eligible))
    if k >= 3:
        families += [_Family("segments", KEEP, k), _Family("segments+offload", OFFLOAD, k)]
    return tuple(families)


def _eligible(graph: LayerGraph) -> list[int]:
    """Layers whose policy matters: they run a forward (not the last) and another layer reads them."""
    return [p for p in range(len(graph.layers) - 1) if cost.checkpoint_bytes(graph, p) > 0]


def _describe(policy: Sequence[ActivationPolicy]) -> str:
    if not policy:
        return "every checkpoint kept"
    off = sum(a is OFFLOAD for a in policy)
    rec = sum(a is RECOMPUTE for a in policy)
    return f"{off} checkpoints offloaded and {rec} recomputed"


# -- infeasibility ---------------------------------------------------------------------------------

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


def _peak_op_layer(schedule: Schedule, graph: LayerGraph) -> int:
    """Layer of the compute op at which checkpoints + working memory peak (stream order)."""
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


def minimum_requirements(request: SolveRequest) -> Requirements:
    """The least GPU, host and pinned host memory plans for ``request`` need (see Requirements)."""
    return _Search(request, greedy_knapsack).requirements()


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
    hb = cost.human_bytes
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
            f"offloaded: FP32 master weights {hb(m.master_weights)} and Adam moments {hb(m.adam_moments)} (12 "
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


# -- the search ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Knobs:
    """The knobs of one candidate besides the micro-batch size."""

    slots: int
    prefetch_distance: int
    grad_ring: int
    staging_ring: int
    resident: frozenset[int] = frozenset()
    activations: tuple[ActivationPolicy, ...] = ()


def _placement(request: SolveRequest) -> OptimizerPlacement:
    return OptimizerPlacement.NEXT_FORWARD if request.clip_gradients else OptimizerPlacement.DURING_BACKWARD


def _plan(request: SolveRequest, micro_batch_size: int, k: _Knobs, layer_by_layer: bool = True) -> Plan:
    return Plan(micro_batches=request.global_batch // micro_batch_size, slots=k.slots,
                prefetch_distance=k.prefetch_distance, grad_ring=k.grad_ring, resident=k.resident,
                activations=k.activations, layer_by_layer=layer_by_layer, optimizer=_placement(request),
                compute_dtype=request.compute_dtype, staging_ring=max(k.staging_ring, 1),
                cast_once=k.staging_ring == CAST_ONCE)


def _scaled_memory(unit: cost.MemoryBreakdown, weight_slots: int, gradient_ring: int,
                   staging_ring: int) -> cost.MemoryBreakdown:
    """``unit`` (one weight slot, one ring tile, one staging tile) with the slot and staging counts
    of a candidate and its gradient tiles' bytes (``gradient_ring``, from
    :func:`cost.gradient_ring_bytes`: the tiles are sized per layer, so not count x unit).

    The cost model defines the slot and staging terms as count x per-unit bytes (``cost.memory_breakdown``).
    The activation terms (GPU peaks, pinned offload space) are those of the unit's own activation
    policy and micro-batch size: they depend on the order of compute ops and reloads, which the
    policy and the prefetch distance set and no count here changes.
    """
    return replace(unit, weight_slots=unit.weight_slots * weight_slots,
                   gradient_slots=unit.gradient_slots * weight_slots,
                   gradient_ring=gradient_ring, staging_ring=unit.staging_ring * staging_ring)


@dataclass(slots=True)
class _SizeOption:
    """Everything about one micro-batch size (and pass structure) the search reuses; times in
    seconds, one micro-batch."""

    size: int
    micro_batches: int
    graph: LayerGraph
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    offload: tuple[float, ...]
    reload: tuple[float, ...]
    checkpoints: tuple[int, ...]  # cost.checkpoint_bytes per layer
    layer_by_layer: bool = True  # False: per-micro-batch passes

    @property
    def key(self) -> tuple[int, bool]:
        return (self.size, self.layer_by_layer)

    @property
    def alive(self) -> int:
        """Micro-batches whose checkpoints are alive (and offloaded) at once."""
        return self.micro_batches if self.layer_by_layer else 1


def _size_option(size: int, micro_batches: int, graph: LayerGraph, compute_dtype: str,
                 hw: HardwareSpec) -> _SizeOption:
    probe = Plan(compute_dtype=compute_dtype)
    n = len(graph.layers)
    return _SizeOption(size, micro_batches, graph,
                       fwd=tuple(cost.fwd_time(layer, probe, hw) for layer in graph.layers),
                       bwd=tuple(cost.bwd_time(layer, probe, hw) for layer in graph.layers),
                       offload=tuple(cost.offload_time(graph, i, hw, OpKind.OFFLOAD) for i in range(n)),
                       reload=tuple(cost.offload_time(graph, i, hw, OpKind.RELOAD) for i in range(n)),
                       checkpoints=tuple(cost.checkpoint_bytes(graph, i) for i in range(n)))


@dataclass(slots=True)
class _Times:
    """Per-layer op times (seconds) that do not depend on the micro-batch size."""

    h2d: tuple[float, ...]
    d2h: tuple[float, ...]
    opt: tuple[float, ...]
    cast: tuple[float, ...]
    acc: tuple[float, ...]
    trainable: tuple[bool, ...]


def _times(graph: LayerGraph, compute_dtype: str, hw: HardwareSpec) -> _Times:
    probe = Plan(compute_dtype=compute_dtype)
    layers = graph.layers
    return _Times(h2d=tuple(cost.h2d_time(layer, probe, hw) for layer in layers),
                  d2h=tuple(cost.d2h_time(layer, hw) for layer in layers),
                  opt=tuple(cost.opt_time(layer, hw) for layer in layers),
                  cast=tuple(cost.cast_time(layer, hw) for layer in layers),
                  acc=tuple(cost.acc_time(layer, hw) for layer in layers),
                  trainable=tuple(layer.trainable_numel > 0 for layer in layers))


def _quick_bound(size: _SizeOption, t: _Times, policy: Sequence[ActivationPolicy], *, deferred: bool,
                 bf16: bool, duplex: bool) -> float:
    """A step time no schedule with this micro-batch size and activation policy can beat, from op
    times alone (module docstring, item 5); it holds for any slots, distance, rings and residents.

    Premises, all from the lowering: every layer's weights are copied at least once, the first
    copies in layer order (each after its CAST with BF16; the first after a carried update of
    layer 0); the compute stream runs the forwards ``0..n-2``, then the local backwards
    ``n-1..0`` with the recomputes among them (those of the last layer's inputs may run before
    its local backward, as soon as their weights are in a slot), one op per micro-batch; each
    trainable layer's D2H follows its local backward, in backward order, and with
    DURING_BACKWARD its optimizer step follows its D2H, in the same order. Per-micro-batch passes
    keep every premise for their first pass and last micro-batch (their first forward of layer
    ``k`` waits for ``k + 1`` copies and the rest of the step follows it; the last micro-batch's
    D2H and update of each layer follow its last local backward), and add a D2H and an ACC per
    micro-batch to the busy times.
    """
    n, M = len(t.h2d), size.micro_batches
    passes = 1 if size.layer_by_layer else M
    fwd, bwd = size.fwd, size.bwd
    rec = [p for p, a in enumerate(policy) if a is RECOMPUTE and p < n - 1]
    off = [p for p, a in enumerate(policy) if a is OFFLOAD and p < n - 1]
    trainable = [i for i in range(n) if t.trainable[i]]
    backward = M * (sum(bwd) + sum(fwd[p] for p in rec))
    compute = M * sum(fwd[:n - 1]) + backward
    h2d = sum(t.h2d) + M * sum(size.reload[p] for p in off)
    d2h = passes * sum(t.d2h[i] for i in trainable) + M * sum(size.offload[p] for p in off)
    host = sum(t.opt[i] for i in trainable) + (sum(t.cast) if bf16 else 0.0)
    if not size.layer_by_layer:
        host += M * sum(t.acc[i] for i in trainable)
    bound = max(compute, h2d, d2h, host, 0.0 if duplex else h2d + d2h)
    # Flow shop: the forward of layer k waits for the copies of layers 0..k, and the rest of the
    # forward and the whole backward phase follow it; the turn's local backward (layer n-1) waits
    # for the copy of layer n-1 too, and every local backward follows it (recomputes of its own
    # inputs may run before it, so they are not counted there).
    first_opt = t.opt[0] if deferred and t.trainable[0] else 0.0
    fwd_after = [0.0] * (n + 1)
    for k in range(n - 2, -1, -1):
        fwd_after[k] = fwd_after[k + 1] + M * fwd[k]
    copies = first_opt + (t.cast[0] if bf16 else 0.0)
    casts = first_opt
    forward_end = turn = 0.0
    for k in range(n):
        copies += t.h2d[k]
        ready = copies
        if bf16:
            casts += t.cast[k]
            ready = max(ready, casts + t.h2d[k])
        if k < n - 1:
            forward_end = max(forward_end, ready + fwd_after[k])
        else:
            turn = ready
    bound = max(bound, forward_end + backward, turn + M * sum(bwd))
    # Tails: after the local backward of layer l, its D2H and those of every earlier trainable
    # layer, then the last optimizer step; or its optimizer step and those of every earlier layer.
    if trainable:
        last_opt = 0.0 if deferred else t.opt[trainable[0]]
        done = max(forward_end, turn)  # lower bound of the end of the local backward of layer l
        d2h_left = sum(t.d2h[i] for i in trainable)
        opt_left = sum(t.opt[i] for i in trainable)
        for layer in range(n - 1, -1, -1):
            done += M * bwd[layer]
            if not t.trainable[layer]:
                continue
            bound = max(bound, done + d2h_left + last_opt)
            if not deferred:
                bound = max(bound, done + t.d2h[layer] + opt_left)
            d2h_left -= t.d2h[layer]
            opt_left -= t.opt[layer]
    return bound


_STREAM_INDEX = {OpKind.H2D: 0, OpKind.RELOAD: 0, OpKind.FWD: 1, OpKind.BWD: 1, OpKind.RECOMPUTE: 1,
                 OpKind.D2H: 2, OpKind.OFFLOAD: 2, OpKind.OPT: 3, OpKind.CAST: 4, OpKind.ACC: 3}
"""Index of each op kind's stream (Stream.H2D, COMPUTE, D2H, HOST, CAST) in the bound's arrays."""

_PER_MICRO_BATCH = ({(kind, OpKind.RELOAD) for kind in COMPUTE_KINDS}
                    | {(OpKind.OFFLOAD, OpKind.FWD), (OpKind.RELOAD, OpKind.OFFLOAD)})
"""(op kind, dependency kind) pairs where micro-batch ``m``'s op waits only for micro-batch ``m``'s
dependency (a checkpoint's copy); every other edge waits for a whole visit, or is within the compute
stream, which runs a visit's micro-batches back to back."""

_PER_VISIT_ONCE = frozenset({OpKind.H2D, OpKind.D2H, OpKind.OPT, OpKind.CAST})
"""Kinds issued once per visit or layer; the others once per micro-batch."""


@dataclass(frozen=True, slots=True)
class _Pattern:
    """The schedule of a candidate's knobs at one micro-batch, as flat arrays for the bound.

    ``lower`` with ``micro_batches=1`` gives every op of a layer visit once, with the same
    dependencies the full schedule has between visits (see :func:`_lower_bound`); which copies it
    issues depends on the activation policy, slots, distance, residents and rings only, not on
    sizes or micro-batches. ``deps`` are the dependencies on a whole visit, ``mb_deps`` those that
    hold micro-batch by micro-batch (:data:`_PER_MICRO_BATCH`).
    """

    kinds: tuple[OpKind, ...]
    layers: tuple[int, ...]
    deps: tuple[tuple[int, ...], ...]
    mb_deps: tuple[tuple[int, ...], ...]

    def copies(self, n_layers: int) -> list[int]:
        """H2D weight copies per layer."""
        c = [0] * n_layers
        for kind, layer in zip(self.kinds, self.layers):
            if kind is OpKind.H2D:
                c[layer] += 1
        return c


def _pattern(graph: LayerGraph, plan: Plan) -> _Pattern:
    """The pattern of ``plan`` (its steady-state schedule, at one micro-batch)."""
    sched = lower(graph, replace(plan, micro_batches=1),
                  carries_updates=plan.optimizer is OptimizerPlacement.NEXT_FORWARD)
    ops = sched.ops
    kinds = tuple(op.kind for op in ops)
    deps, mb_deps = [], []
    for op in ops:
        whole, per = [], []
        for d in op.deps:
            (per if (op.kind, kinds[d]) in _PER_MICRO_BATCH else whole).append(d)
        deps.append(tuple(whole))
        mb_deps.append(tuple(per))
    return _Pattern(kinds, tuple(op.layer for op in ops), tuple(deps), tuple(mb_deps))


def _lower_bound(p: _Pattern, size: _SizeOption, t: _Times, duplex: bool) -> float:
    """A step time no schedule of this candidate can beat: the longest path of its pattern.

    Each pattern op stands for its ``r`` micro-batch copies (``r = M`` for compute ops, offloads and
    reloads, 1 otherwise), of ``u`` seconds each, and its end is a lower bound of the last copy's
    end: the first copy starts no earlier than the ends of the op before it on its stream and of
    its whole-visit dependencies, and the ``r`` copies run one after another on one resource, so
    the last ends at least ``r x u`` later; and the last copy waits for the last copy of each
    per-micro-batch dependency, so it ends at least ``u`` after that. The simulator respects all of
    these. With duplex copies and ``M = 1`` (or no per-micro-batch edge, as with every checkpoint
    kept) each stream has a resource of its own, the simulator adds no other wait, and the bound is
    the simulated step time; with one shared copy engine the engine's total busy time is a second
    bound.
    """
    n = len(p.kinds)
    M = size.micro_batches
    end = [0.0] * n
    stream_end = [0.0, 0.0, 0.0, 0.0, 0.0]
    copy_busy = host_busy = 0.0
    fwd, bwd, off, rel = size.fwd, size.bwd, size.offload, size.reload
    h2d, d2h, opt, cast = t.h2d, t.d2h, t.opt, t.cast
    kinds, layers, deps, mb_deps = p.kinds, p.layers, p.deps, p.mb_deps
    for i in range(n):
        kind, layer = kinds[i], layers[i]
        s = _STREAM_INDEX[kind]
        if kind is OpKind.FWD or kind is OpKind.RECOMPUTE:
            u = fwd[layer]
        elif kind is OpKind.BWD:
            u = bwd[layer]
        elif kind is OpKind.H2D:
            u = h2d[layer]
        elif kind is OpKind.D2H:
            u = d2h[layer]
        elif kind is OpKind.OPT:
            u = opt[layer]
        elif kind is OpKind.CAST:
            u = cast[layer]
        elif kind is OpKind.ACC:  # not in patterns today: they are lowered with one micro-batch
            u = t.acc[layer]
        elif kind is OpKind.OFFLOAD:
            u = off[layer]
        else:
            u = rel[layer]
        r = 1 if kind in _PER_VISIT_ONCE else M
        start = stream_end[s]
        for d in deps[i]:
            if end[d] > start:
                start = end[d]
        e = start + r * u
        for d in mb_deps[i]:
            if end[d] + u > e:
                e = end[d] + u
        end[i] = stream_end[s] = e
        if s == 0 or s == 2:
            copy_busy += r * u
        elif s >= 3:
            host_busy += r * u  # the optimizer and cast workers share the host (cost.resource_of)
    bound = max(max(stream_end), host_busy)
    return bound if duplex else max(bound, copy_busy)


def _fits(mem: cost.MemoryBreakdown, hw: HardwareSpec) -> bool:
    return (mem.gpu_peak <= hw.gpu_memory_bytes and mem.host_total <= hw.host_memory_bytes
            and mem.host_pinned <= hw.pinned_memory_cap_bytes)


def _host_fits(mem: cost.MemoryBreakdown, hw: HardwareSpec) -> bool:
    return mem.host_total <= hw.host_memory_bytes and mem.host_pinned <= hw.pinned_memory_cap_bytes


@dataclass(frozen=True, slots=True)
class _Candidate:
    """Knobs whose residents the knapsack has yet to choose (``resident is None``) or chosen."""

    option: _SizeOption
    policy: tuple[ActivationPolicy, ...]
    slots: int
    distance: int
    grad_ring: int
    staging_ring: int
    resident: frozenset[int] | None = None


@dataclass(frozen=True, slots=True)
class _Group:
    """Work not yet done at one micro-batch size: with ``family`` None, evaluating every checkpoint
    kept (and making the groups below); else searching ``family``'s depths at ``distance`` for the
    slot counts ``slots`` (those where every checkpoint kept does not fit)."""

    option: _SizeOption
    family: _Family | None = None
    distance: int = 0
    slots: tuple[int, ...] = ()


# Queue levels: among equal bounds the most refined item goes first, so that a simulation can end
# the search before more candidates are lowered or more depths searched.
_SIMULATE, _REFINE, _EXPAND = 0, 1, 2


class _Search:
    """One solve: caches of memory units, patterns and bounds, and the best-first queue."""

    def __init__(self, request: SolveRequest, knapsack: Knapsack):
        self.request, self.knapsack = request, knapsack
        self.hw, self.limits = request.hardware, request.limits
        g = request.graph
        self.n = len(g.layers)
        self.eligible = _eligible(g)
        self.families = _families(len(self.eligible))
        self.deferred = request.clip_gradients
        self.ring = max(1, sum(1 for layer in g.layers if layer.trainable_numel > 0))  # NEXT_FORWARD tiles
        self.bf16 = request.compute_dtype == "bfloat16"
        self.times = _times(g, request.compute_dtype, self.hw)
        self.options: dict[int, _SizeOption] = {}
        self.units: dict[tuple, tuple[Schedule, cost.MemoryBreakdown]] = {}
        self.rings: dict[tuple, int] = {}
        self.patterns: dict[_Knobs, _Pattern] = {}
        self.quick: dict[tuple, float] = {}
        self.depths: dict[tuple, int | None] = {}
        self.removed: dict[tuple, list[int]] = {}
        self.residents: dict[tuple, frozenset[int]] = {}
        self.queue: list = []
        self.seq = 0
        self.candidates = 0
        self.seen: set = set()

    # -- per size ----------------------------------------------------------------------------------
    def option(self, size: int, layer_by_layer: bool = True) -> _SizeOption:
        key = (size, layer_by_layer)
        if key not in self.options:
            r = self.request
            if layer_by_layer:
                self.options[key] = _size_option(size, r.global_batch // size, r.graph_for(size), r.compute_dtype,
                                                 self.hw)
            else:  # the same graph and times, another pass structure
                self.options[key] = replace(self.option(size), layer_by_layer=False)
        return self.options[key]

    def unit(self, opt: _SizeOption, policy: tuple[ActivationPolicy, ...],
             distance: int) -> tuple[Schedule, cost.MemoryBreakdown]:
        """Schedule and bytes of ``policy`` at ``opt``'s size, per one slot, ring tile and staging tile.

        Lowered with ``distance + 1`` slots; only offloading policies depend on the distance (it
        places the reloads), so the others are evaluated once, at distance 0.
        """
        d = distance if OFFLOAD in policy else 0
        key = (opt.key, policy, d)
        if key not in self.units:
            slots = d + 1
            plan = Plan(micro_batches=opt.micro_batches, slots=slots, prefetch_distance=d, grad_ring=1,
                        staging_ring=1, activations=policy, compute_dtype=self.request.compute_dtype,
                        layer_by_layer=opt.layer_by_layer)
            sched = lower(opt.graph, plan)
            m = cost.memory_breakdown(opt.graph, plan, self.hw, sched)
            self.units[key] = (sched, replace(m, weight_slots=m.weight_slots // slots,
                                              gradient_slots=m.gradient_slots // slots))
        return self.units[key]

    def ring_bytes(self, opt: _SizeOption, grad_ring: int) -> int:
        """Pinned bytes of ``grad_ring`` host gradient tiles at ``opt`` (:func:`cost.gradient_ring_bytes`)."""
        key = (opt.key, grad_ring)
        if key not in self.rings:
            plan = Plan(micro_batches=opt.micro_batches, grad_ring=grad_ring, layer_by_layer=opt.layer_by_layer,
                        optimizer=_placement(self.request))
            self.rings[key] = cost.gradient_ring_bytes(opt.graph, plan)
        return self.rings[key]

    def cast_once_bytes(self, opt: _SizeOption) -> int:
        """Pinned bytes of one staging tile per layer, each at its size (``Plan.cast_once``)."""
        plan = Plan(compute_dtype="bfloat16", cast_once=True)
        return sum(cost.page_up(w * cost.STAGING_ITEMSIZE) for w in cost.staging_tile_numels(opt.graph, plan))

    def scaled(self, opt: _SizeOption, unit: cost.MemoryBreakdown, slots: int, grad_ring: int,
               staging_ring: int, resident: frozenset[int] = frozenset()) -> cost.MemoryBreakdown:
        """``unit`` with a candidate's streaming slots, resident layers (a slot each, at its own
        size: :func:`cost.slot_bytes`), gradient tiles and staging tiles."""
        m = _scaled_memory(unit, slots, self.ring_bytes(opt, grad_ring), staging_ring)
        if staging_ring == CAST_ONCE:
            m = replace(m, staging_ring=self.cast_once_bytes(opt))
        if not resident:
            return m
        w, g = cost.slot_bytes(opt.graph, slots, resident, 2 if self.bf16 else 4)
        return replace(m, weight_slots=w, gradient_slots=g)

    def gpu_fits(self, unit: cost.MemoryBreakdown, slots: int, cap: int | None = None) -> bool:
        cap = self.hw.gpu_memory_bytes if cap is None else cap
        return _scaled_memory(unit, slots, unit.gradient_ring, 1).gpu_peak <= cap  # GPU terms only

    def host_choices(self, opt: _SizeOption, unit: cost.MemoryBreakdown) -> list[tuple[int, int]]:
        """(gradient ring, staging ring) pairs to try: the largest ring with each staging ring,
        the second only if it allows a larger ring (a tile more of either only removes waits)."""
        rings = [self.ring] if self.deferred and opt.layer_by_layer else list(range(self.limits.max_grad_ring, 0, -1))
        out: list[tuple[int, int]] = []
        for staging in (DEFAULT_STAGING_RING, 1):
            for ring in rings:
                if _host_fits(self.scaled(opt, unit, 1, ring, staging), self.hw):
                    out.append((ring, staging))
                    break
        if len(out) == 2 and (out[0][0] >= out[1][0] or not self.bf16):
            out = out[:1]
        if self.bf16:  # a staging tile per layer, each layer cast once per step (staging 0: Plan.cast_once)
            for ring in rings:
                if _host_fits(self.scaled(opt, unit, 1, ring, CAST_ONCE), self.hw):
                    out.append((ring, CAST_ONCE))
                    break
        return out

    def per_mb_sizes(self, size: int) -> bool:
        """Whether per-micro-batch passes are searched at micro-batch size ``size``."""
        return self.limits.per_micro_batch_passes and self.request.global_batch // size > 1

    def ring_floor(self, opt: _SizeOption) -> int:
        """The fewest host gradient tiles: one per trainable layer with NEXT_FORWARD layer by layer
        (the tiles hold the gradients until the next step), else one (accumulators hold them)."""
        return self.ring if self.deferred and opt.layer_by_layer else 1

    def quick_bound(self, opt: _SizeOption, policy: tuple[ActivationPolicy, ...]) -> float:
        key = (opt.key, policy)
        if key not in self.quick:
            self.quick[key] = _quick_bound(opt, self.times, policy, deferred=self.deferred, bf16=self.bf16,
                                           duplex=self.hw.duplex)
        return self.quick[key]

    # -- depths ------------------------------------------------------------------------------------
    def floor_depth(self, opt: _SizeOption, family: _Family, slots: int, cap: int | None = None) -> int | None:
        """The least depth whose floor fits: no shallower policy of ``family`` can fit.

        Floor: when the first local backward starts, every kept checkpoint of every micro-batch is
        alive (its readers' local backwards are still to come) beside that op's working memory,
        and no compute op runs with less than its own working memory.
        """
        key = (opt.size, family)
        if key not in self.removed:
            self.removed[key] = family.removed(self.eligible, opt.checkpoints)
        removed = self.removed[key]
        layers = opt.graph.layers
        work = max(layer.work_bytes for layer in layers)
        total = sum(opt.checkpoints[p] for p in self.eligible)
        _, keep = self.unit(opt, (), 0)
        room = (self.hw.gpu_memory_bytes if cap is None else cap) - _scaled_memory(keep, slots, 0, 1).gpu_fixed
        if work > room:
            return None
        for depth, gone in enumerate(removed):
            if opt.alive * (total - gone) + layers[-1].work_bytes <= room:
                return depth
        return None

    def host_depth(self, opt: _SizeOption, family: _Family) -> int:
        """The deepest depth of ``family`` whose offloaded checkpoints fit in host and pinned memory
        beside the smallest rings: ``cost.memory_breakdown`` keeps the offloaded checkpoints of
        every micro-batch alive at once in pinned memory (``M x`` their bytes layer by layer, ``1 x``
        per micro-batch pass), and nothing else on the host depends on the activation policy. A
        bound to search within; candidates are checked exactly."""
        top = len(self.eligible)
        if family.stored is not OFFLOAD:
            return top
        _, keep = self.unit(opt, (), 0)
        base = self.scaled(opt, keep, 1, self.ring_floor(opt), 1)
        room = min(self.hw.host_memory_bytes - base.host_total, self.hw.pinned_memory_cap_bytes - base.host_pinned)
        moved = family.offloaded(self.eligible, opt.checkpoints)
        return max((j for j in range(top + 1) if opt.alive * moved[j] <= room), default=-1)

    def least_depth(self, opt: _SizeOption, family: _Family, distance: int, slots: int,
                    cap: int | None = None) -> int | None:
        """The least depth of ``family`` whose exact GPU memory fits with ``slots`` slots in ``cap``
        bytes (default: the GPU's)."""
        key = (opt.key, family, distance, slots, cap)
        if key in self.depths:
            return self.depths[key]
        top = self.host_depth(opt, family) if cap is None else len(self.eligible)

        def fits(depth: int) -> bool:
            policy = family.policy(self.eligible, self.n, depth)
            return self.gpu_fits(self.unit(opt, policy, distance)[1], slots, cap)

        found = None
        lo = self.floor_depth(opt, family, slots, cap)
        if lo is not None and lo <= top:
            if fits(lo):
                found = lo
            else:  # gallop up from the floor, then bisect
                step, hi = 1, None
                while lo < top:
                    probe = min(top, lo + step)
                    if fits(probe):
                        hi = probe
                        break
                    lo, step = probe, step * 2
                if hi is not None:
                    while hi - lo > 1:
                        mid = (lo + hi) // 2
                        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
                    found = hi
        self.depths[key] = found
        return found

    # -- the queue ---------------------------------------------------------------------------------
    def push(self, bound: float, level: int, order: tuple, item) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (bound, level, order, self.seq, item))

    def order(self, opt: _SizeOption, policy: tuple, distance: int, ring: int, staging: int, slots: int,
              resident: int = 0) -> tuple:
        # Ties: fewer micro-batches (fewer ops, less latency), layer by layer (fewer copies), fewer
        # checkpoints moved or recomputed, more overlap, larger rings, fewer slots, more residents.
        changed = sum(a is not KEEP for a in policy)
        return (opt.micro_batches, not opt.layer_by_layer, changed, -distance, -ring, -staging, slots, -resident)

    def add_candidate(self, c: _Candidate) -> None:
        _, unit = self.unit(c.option, c.policy, c.distance)
        mem = self.scaled(c.option, unit, c.slots, c.grad_ring, c.staging_ring, c.resident or frozenset())
        if not _fits(mem, self.hw):
            return
        key = (c.option.key, c.policy, c.slots, c.distance, c.grad_ring, c.staging_ring, c.resident)
        if key in self.seen:
            return
        self.seen.add(key)
        self.candidates += 1
        self.push(self.quick_bound(c.option, c.policy), _REFINE,
                  self.order(c.option, c.policy, c.distance, c.grad_ring, c.staging_ring, c.slots), c)

    def add_knobs(self, opt: _SizeOption, policy: tuple, distance: int, slots: int) -> None:
        _, unit = self.unit(opt, policy, distance)
        for ring, staging in self.host_choices(opt, unit):
            self.add_candidate(_Candidate(opt, policy, slots, distance, ring, staging))

    def start(self, sizes: Sequence[int]) -> None:
        """A group per micro-batch size, and the default plan's knobs."""
        for size in sizes:
            for layer_by_layer in (True, False) if self.per_mb_sizes(size) else (True,):
                opt = self.option(size, layer_by_layer)
                self.push(self.quick_bound(opt, ()), _EXPAND, self.order(opt, (), 0, 0, 0, 0), _Group(opt))
        # The default plan's knobs: the solver never does worse than Plan() where Plan() fits.
        default = Plan()
        G = self.request.global_batch
        if (G in sizes and default.slots <= self.limits.max_slots
                and (self.deferred or default.grad_ring <= self.limits.max_grad_ring)):
            ring = self.ring if self.deferred else default.grad_ring
            self.add_candidate(_Candidate(self.option(G), (), default.slots, default.prefetch_distance, ring,
                                          default.staging_ring, frozenset()))

    def expand(self, group: _Group) -> None:
        opt = group.option
        if group.family is not None:
            for slots in group.slots:
                depth = self.least_depth(opt, group.family, group.distance, slots)
                if depth is None:
                    break  # more slots leave less room for checkpoints
                self.add_knobs(opt, group.family.policy(self.eligible, self.n, depth), group.distance, slots)
            return
        _, keep = self.unit(opt, (), 0)
        max_slots = self.limits.max_slots
        for distance in range(max_slots):
            short = []  # slot counts at this distance where every checkpoint kept does not fit
            for slots in range(distance + 1, max_slots + 1):
                if self.gpu_fits(keep, slots):
                    self.add_knobs(opt, (), distance, slots)
                else:
                    short.append(slots)
            if not short or not self.eligible:
                continue
            for family in self.families:
                depth = self.floor_depth(opt, family, short[0])
                if depth is None or depth > self.host_depth(opt, family):
                    continue
                policy = family.policy(self.eligible, self.n, depth)
                self.push(self.quick_bound(opt, policy), _EXPAND, self.order(opt, policy, distance, 0, 0, short[0]),
                          _Group(opt, family, distance, tuple(short)))

    def knobs(self, c: _Candidate) -> _Knobs:
        k = _Knobs(c.slots, c.distance, c.grad_ring, c.staging_ring, frozenset(), c.policy)
        if c.resident is not None:
            return replace(k, resident=c.resident)
        _, unit = self.unit(c.option, c.policy, c.distance)
        spare = self.hw.gpu_memory_bytes - self.scaled(c.option, unit, c.slots, c.grad_ring, c.staging_ring).gpu_peak
        # Every resident layer costs one more slot sized for that layer (cost.slot_numels), so its
        # weight is its own weights and gradients. The streaming slots stay sized for the widest
        # layer here; residents can only narrow them, so the choice is within memory.
        itemsize = 2 if self.bf16 else 4
        weights = [layer.numel * itemsize + layer.trainable_numel * cost.GRAD_ITEMSIZE
                   for layer in c.option.graph.layers]
        room = max(spare, 0)
        key = (c.policy, c.slots, c.distance, room, c.option.layer_by_layer)
        if key not in self.residents:
            # Per-micro-batch passes repeat the pattern's copies in every pass (the pattern, one
            # micro-batch, is lowered layer by layer, whose NEXT_FORWARD ring has a tile per layer;
            # the ring does not change the copies).
            passes = 1 if c.option.layer_by_layer else c.option.micro_batches
            pk = k if passes == 1 or not self.deferred else replace(k, grad_ring=self.ring)
            copies = [x * passes for x in self.pattern(pk).copies(self.n)]
            saved = [(x - 1) * self.times.h2d[i] for i, x in enumerate(copies)]
            self.residents[key] = self.knapsack(saved, weights, room)
        return replace(k, resident=self.residents[key])

    def pattern(self, k: _Knobs) -> _Pattern:
        if k not in self.patterns:
            self.patterns[k] = _pattern(self.request.graph, _plan(self.request, self.request.global_batch, k))
        return self.patterns[k]

    # -- run ---------------------------------------------------------------------------------------
    def requirements(self) -> Requirements:
        """Minimum memory at the smallest micro-batch size (see :class:`Requirements`)."""
        size = min(self.request.micro_batch_sizes())
        passes = [self.option(size)] + ([self.option(size, False)] if self.per_mb_sizes(size) else [])
        top = len(self.eligible)
        options = [("keep", ())] + [(f.name, f.policy(self.eligible, self.n, top)) for f in self.families]
        rows, keeps = [], []
        for p, opt in enumerate(passes):
            for i, (name, policy) in enumerate(options):
                sched, unit = self.unit(opt, policy, 0)
                mem = self.scaled(opt, unit, 1, self.ring_floor(opt), 1)
                # Ties: layer by layer (fewer copies), then the simpler policy.
                rows.append(((mem.gpu_peak, mem.host_total, p, i), name, opt, sched, mem))
                if i == 0:
                    keeps.append(mem)
        (_, _, _, i), name, opt, sched, mem = min(rows, key=lambda row: row[0])
        if i > 0:  # the shallowest depth of that family with the same peak offloads the least
            family = self.families[i - 1]
            depth = self.least_depth(opt, family, 0, 1, cap=mem.gpu_peak)
            if depth is not None:
                sched, unit = self.unit(opt, family.policy(self.eligible, self.n, depth), 0)
                mem = self.scaled(opt, unit, 1, self.ring_floor(opt), 1)
        keep = min(keeps, key=lambda m: (m.host_total, m.host_pinned))
        g = opt.graph
        largest = max(g.layers, key=lambda layer: (layer.numel, -layer.index))
        peak = g.layers[_peak_op_layer(sched, g)]
        slot = mem.gpu_fixed > self.hw.gpu_memory_bytes
        return Requirements(gpu_memory_bytes=mem.gpu_peak, host_memory_bytes=mem.host_total,
                            pinned_memory_bytes=mem.host_pinned, host_floor_bytes=keep.host_total,
                            pinned_floor_bytes=keep.host_pinned, micro_batch_size=size, activations=name,
                            layer_by_layer=opt.layer_by_layer,
                            memory=mem, largest_layer=largest.name, peak_layer=peak.name,
                            peak_layer_work_bytes=peak.work_bytes, obstacle=largest.name if slot else peak.name,
                            obstacle_is_slot=slot)

    def run(self, method: str) -> Solution:
        t_start = time.perf_counter()
        hw, limits, request = self.hw, self.limits, self.request
        sizes = request.micro_batch_sizes()
        # Fail fast without a lowering per family: the host needs at least what every checkpoint
        # kept needs, and the GPU at least the floor of the deepest policy of some family.
        small = self.option(sizes[-1])
        _, keep = self.unit(small, (), 0)
        passes = [small] + ([self.option(sizes[-1], False)] if self.per_mb_sizes(sizes[-1]) else [])
        if (not any(_host_fits(self.scaled(o, self.unit(o, (), 0)[1], 1, self.ring_floor(o), 1), hw)
                    for o in passes)
                or (not self.gpu_fits(keep, 1)
                    and all(self.floor_depth(small, f, 1) is None for f in self.families))):
            raise _infeasible(request, self.requirements())
        self.start(sizes)
        best: tuple[float, _SizeOption, Schedule, Timeline] | None = None
        simulated = 0
        bound = math.inf
        while self.queue:
            key, level, _, _, item = self.queue[0]
            # 1e-9: the bounds and the simulator add the same durations in different orders.
            if best is not None and key >= best[0] * (1.0 - max(limits.rtol, 1e-9)):
                bound = key
                break
            if level == _SIMULATE and simulated >= limits.max_simulations:
                bound = key
                break
            heapq.heappop(self.queue)
            if level == _EXPAND:
                self.expand(item)
            elif level == _REFINE:
                k = self.knobs(item)
                if (item.option.key, k) in self.seen:
                    continue
                self.seen.add((item.option.key, k))
                lb = _lower_bound(self.pattern(k), item.option, self.times, hw.duplex) \
                    if item.option.layer_by_layer else key
                self.push(max(key, lb), _SIMULATE, self.order(item.option, k.activations, k.prefetch_distance,
                                                              k.grad_ring, k.staging_ring, k.slots,
                                                              len(k.resident)), (item.option, k))
            else:
                opt, k = item
                plan = _plan(request, opt.size, k, opt.layer_by_layer)
                sched = lower(opt.graph, plan, carries_updates=self.deferred)
                tl = simulate(sched, opt.graph, hw)
                simulated += 1
                if best is None or tl.step_time_s < best[0]:
                    best = (tl.step_time_s, opt, sched, tl)
        if best is None:
            raise _infeasible(request, self.requirements())
        _, opt, sched, tl = best
        plan = sched.plan
        _, unit = self.unit(opt, plan.activations, plan.prefetch_distance)
        staging = CAST_ONCE if plan.cast_once else plan.staging_ring
        predicted = self.scaled(opt, unit, plan.slots, plan.grad_ring, staging, plan.resident)
        mem = cost.memory_breakdown(opt.graph, plan, hw, sched)
        if mem != predicted or not _fits(mem, hw):
            raise PlanError(f"internal: the solver predicted {predicted} for {plan} but the cost model gives {mem}; "
                            "cost.memory_breakdown's slot and ring terms are no longer count x per-unit bytes, or "
                            "its activation terms depend on more than the policy and prefetch distance (update "
                            "megatrain.planner.solve._scaled_memory)")
        verify(sched, opt.graph, hw)
        return Solution(plan=plan, micro_batch_size=opt.size, graph=opt.graph, schedule=sched, timeline=tl,
                        memory=mem, method=method, candidates=self.candidates, simulated=simulated,
                        bound_s=bound, solve_time_s=time.perf_counter() - t_start)


# -- public solvers --------------------------------------------------------------------------------

def solve_enumerate(request: SolveRequest) -> Solution:
    """Exhaustive search with bounds; resident layers chosen greedily by H2D seconds saved per byte.

    Raises:
        InfeasibleRequestError (a PlanError): no plan fits; the message gives the smallest GPU and
            host memory that would work and the layer that is the obstacle.
    """
    return _Search(request, greedy_knapsack).run("enumerate")


def solve_milp(request: SolveRequest) -> Solution:
    """The same search with resident layers chosen by a 0/1 knapsack MILP (scipy.optimize.milp).

    Raises:
        InfeasibleRequestError (a PlanError): as :func:`solve_enumerate`.
    """
    return _Search(request, milp_knapsack).run("milp")


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
