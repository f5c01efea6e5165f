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
   lowering (:func:`.bounds.quick_bound`): each resource's busy time (compute with the recomputes, H2D
   with every layer copied once and the reloads, D2H with the gradients and offloads, the host
   with the optimizer steps and one CAST per layer), and a flow-shop path: the forward of layer
   ``k`` cannot start before the first ``k + 1`` copies (and casts) are done, the rest of the
   compute follows, and after the local backward of layer ``l`` its gradients and those of every
   earlier layer still have to be copied out and applied. The pattern bound (:func:`.bounds.pattern_bound`)
   is the longest path through the candidate's schedule lowered for one micro-batch, each op
   standing for its ``M`` micro-batches; the simulator respects every edge of that path, so it
   can never beat it. With duplex copies and no per-micro-batch edge between streams (no offload)
   the simulator adds no other wait and the bound is the simulated step time, unless the issuing
   thread holds the GPU back: a compute op of a traced layer is timed in the bounds by its GPU
   seconds (``cost.op_duration``), and in the simulator kernel by kernel against the thread's launch
   cost (``cost.ComputeWork``), so an issue-bound candidate simulates slower than its bound and a
   GPU-bound one (larger micro-batches: launches per token fall) at it. So that small,
   issue-bound micro-batches are not left to simulate on their GPU seconds alone, both bounds also
   charge the issuing thread, each launch at its least (:mod:`.bounds`): the quick bound its busy
   time over the compute ops' launches, the pattern bound each op's end after the launches before
   it on its stream (a compute op ending a span after its issue began) and the thread's total
   launch time. Per-micro-batch
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

Layout. One strategy per file behind one signature, ``(SolveRequest) -> Solution`` (Checkmate's
``core/solvers/strategy_*.py``), dispatched by name from :data:`SOLVERS`:

- ``request.py``: SolveRequest, SolveLimits, Solution, scale_graph (plain data in and out).
- ``families.py``: the activation-policy families (item 2).
- ``bounds.py``: op durations by kind (``cost.op_duration``) and the two lower bounds (item 5).
- ``knapsack.py``: resident layers, greedy or MILP, one signature (item 3).
- ``infeasibility.py``: Requirements, InfeasibleRequestError and its message.
- ``search.py``: the best-first search every strategy runs (item 6).
- ``strategy_enumerate.py``, ``strategy_milp.py``: the strategies.
"""

from __future__ import annotations

from typing import Callable, Literal

from megatrain.errors import PlanError
from megatrain.planner.solve.infeasibility import InfeasibleRequestError, Requirements
from megatrain.planner.solve.knapsack import greedy_knapsack, milp_knapsack
from megatrain.planner.solve.request import Solution, SolveLimits, SolveRequest, scale_graph
from megatrain.planner.solve.search import minimum_requirements
from megatrain.planner.solve.strategy_enumerate import solve_enumerate
from megatrain.planner.solve.strategy_milp import solve_milp

SOLVERS: dict[str, Callable[[SolveRequest], Solution]] = {"milp": solve_milp, "enumerate": solve_enumerate}
"""The strategies by name, each ``(SolveRequest) -> Solution``."""


def solve(request: SolveRequest, method: Literal["milp", "enumerate"] = "milp") -> Solution:
    """Solve ``request`` with the strategy ``method`` (a key of :data:`SOLVERS`).

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
