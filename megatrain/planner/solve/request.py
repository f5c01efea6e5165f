"""What the solvers take and give, as plain data: SolveRequest and SolveLimits in, Solution out.

Every strategy (``strategy_*.py``) is a function ``(SolveRequest) -> Solution``, so a heuristic, an
enumeration and a MILP can be swapped and compared over the same request. :func:`scale_graph`
derives the graph of another micro-batch size from a traced one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Mapping

from megatrain.errors import PlanError
from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph, Value
from megatrain.ir.hardware import HardwareSpec
from megatrain.ir.plan import Plan
from megatrain.ir.schedule import Schedule
from megatrain.planner.timeline import Timeline


# -- micro-batch scaling ---------------------------------------------------------------------------

def scale_graph(graph: LayerGraph, micro_batch_size: int) -> LayerGraph:
    """``graph`` (traced for micro-batches of ``graph.micro_batch_size``) for ``micro_batch_size``.

    With ``k = micro_batch_size / graph.micro_batch_size`` (an integer), each layer's
    ``fwd_flops``, ``bwd_flops`` and ``work_bytes``, its kernel profiles' FLOPs and bytes
    (:meth:`~megatrain.ir.profile.KernelProfile.scaled`) and the ``nbytes`` of every value whose shape
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

    profiles: dict[int, object] = {}  # layers of a template share one profile: scale it once

    def scale_profile(p):
        if p is None:
            return None
        got = profiles.get(id(p))
        if got is None:
            got = profiles[id(p)] = p.scaled(k)
        return got

    layers = tuple(replace(layer, fwd_flops=layer.fwd_flops * k, bwd_flops=layer.bwd_flops * k,
                           work_bytes=layer.work_bytes * k, fwd_profile=scale_profile(layer.fwd_profile),
                           bwd_profile=scale_profile(layer.bwd_profile)) for layer in graph.layers)
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
        optimizer_name: the host optimizer (``Plan.optimizer_name``), whose state bytes per
            parameter the plans' host memory counts.
        d2h_dtype: the weight gradients' dtype in the GPU slots, over D2H and in the host tiles
            whatever the plan's passes (``Plan.d2h_dtype``): ``"float32"`` for a rank of several,
            whose host sums the ranks' gradients (``planner.topology.data_parallel_plan``), so that
            the GPU slots it plans are the ones that rank will hold; None: the plan's own
            (``Plan.gradient_dtype``).
    """

    graph: LayerGraph
    hardware: HardwareSpec
    global_batch: int
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    limits: SolveLimits = SolveLimits()
    graphs: GraphSource | None = field(default=None, compare=False)
    clip_gradients: bool = False
    optimizer_name: str = "adamw"
    d2h_dtype: Literal["float32"] | None = None

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise PlanError(f"SolveRequest.global_batch={self.global_batch}: at least one sequence per step")
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise PlanError(f"SolveRequest.compute_dtype={self.compute_dtype!r}: use 'bfloat16' or 'float32'")
        Plan(optimizer_name=self.optimizer_name)  # an unknown name is a PlanError here
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


__all__ = ["SolveLimits", "SolveRequest", "Solution", "GraphSource", "scale_graph"]
