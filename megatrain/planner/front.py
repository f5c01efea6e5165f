"""The planning front door: :func:`plan` takes a :class:`PlanRequest` (the model, one batch shape,
the hardware, the data-parallel topology and the storage tiers) and returns the
:class:`PlannedModel`: the train schedules that will run, lowered and verified once, with their
memory and predicted step. ``megatrain.compile`` (through ``megatrain.plan_model``),
``megatrain train`` and ``megatrain plan`` all plan here and nowhere else, so the plan
``megatrain plan`` prints and writes (``--out DIR/schedule.json``) is the plan ``megatrain train``
runs (and writes to its ``output_dir/schedule.json``) for the same settings.

The decisions, in order, each made once on the one traced graph:

1. the one-rank plan: the given ``Plan``, the default plan, or the solver's
   (:func:`megatrain.planner.solve.solve`; for several ranks whose links the spec rates,
   :func:`megatrain.planner.topology.solve_topology`, which plans one rank's share of the node;
   on one GPU with an NVMe tier in the spec and no NVMe directory,
   :func:`megatrain.planner.nvme.solve_with_nvme`);
2. data parallel (:func:`megatrain.planner.topology.data_parallel_plan`): the ranks, nodes,
   optimizer shards, gradient reduction, FP32 gradients and shared casts;
3. NVMe placement in a directory (``Storage.nvme_dir``): what the host-memory budget needs
   moved (:func:`megatrain.planner.nvme.place_in_directory`), then data parallel again for the
   placed plan;
4. the host state across nodes (``Topology.host_state``): replicate or shard, ``"auto"`` by
   ``Topology.fits`` (a caller's check of a replicated plan: ``megatrain train``'s host-memory
   preflight) or else the node's memory on the spec.

Then the train schedules are lowered and verified once (the solver's own schedule reused where
it is the one that runs) and the steady step simulated where the spec rates every stream it
uses. Nothing here allocates memory, touches a parameter or reads the process group: the caller
states the topology (``megatrain.plan_model`` reads torchrun's, ``megatrain plan`` takes
``--gpus-per-node``/``--nodes``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import pydantic
import torch
from torch import nn

from megatrain.config import CompileOptions, describe_validation
from megatrain.errors import ConfigError, PlanError
from megatrain.optim import optimizer_spec
from megatrain.models import check_model
from megatrain.planner import cost
from megatrain.planner.cost import MemoryBreakdown, memory_breakdown
from megatrain.ir.graph import LayerGraph, TracedModel
from megatrain.ir.hardware import HardwareSpec, load_hardware
from megatrain.planner.lower import lower
from megatrain.ir.plan import OptimizerPlacement, Plan, default_plan
from megatrain.ir.schedule import Schedule, Stream, gradient_tiles
from megatrain.planner.simulate import simulate
from megatrain.planner.solve import Solution, SolveLimits, SolveRequest, solve
from megatrain.planner.timeline import Timeline
from megatrain.planner.trace import trace
from megatrain.planner.verify import verify


@dataclass(frozen=True, slots=True)
class Topology:
    """Where the ranks are: ``ranks`` processes training one global batch (``torchrun
    --nproc-per-node``), ``ranks_per_node`` of them on each node.

    ``share_host_memory``: the ranks of a node keep one copy of the masters and moments and each
    steps its shard (``Plan.optimizer_shards``); False: each rank keeps and steps a copy.
    ``host_state``: several nodes: ``"replicate"`` (a full copy per node), ``"shard"`` (``1 /
    nodes`` per node, ZeRO-3 style), ``"auto"`` (replicate where ``fits`` says a replicated plan
    fits, else shard; without ``fits``, where the node's memory on the spec holds it), or None
    (the plan's). ``fits``: ``megatrain train``'s check of the replicated planned model (its
    host-memory preflight, agreed by every rank).
    """

    ranks: int = 1
    ranks_per_node: int = 1
    share_host_memory: bool = True
    host_state: Literal["replicate", "shard", "auto"] | None = None
    fits: Callable[["PlannedModel"], bool] | None = field(default=None, compare=False)

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node


@dataclass(frozen=True, slots=True)
class Storage:
    """The storage tiers besides the GPU. ``nvme_dir``: a directory on an NVMe drive whose free
    space may hold some layers' Adam moments, deferred gradient tiles and masters; ``host_memory``:
    the host-memory budget (bytes, or a size such as ``"512GiB"``) the state left in RAM must fit,
    None to put every trainable layer's moments in ``nvme_dir``. ``shared_staging``: False where
    the host state this plan will share (a shape-free trainer's other shapes') was made without
    the node's shared BF16 staging tiles, so the ranks cast into tiles of their own.
    ``reference``: ``"bfloat16"`` to hold a frozen BF16 copy of the weights for a reference model
    (preference and RL training: :class:`megatrain.rl.Reference`), 2 bytes per tile element of
    host memory on each rank, which the solver leaves room for and ``MemoryBreakdown.reference_weights``
    counts; None (the default) for none (a reference precomputed as log-probabilities needs none).
    ``host_reserved``: bytes of ``host_memory`` the run holds beside the plan's state (its data, a
    checkpoint file being read, a model built on the CPU: ``megatrain.train.loop.host_beside_plan``),
    so that the state left in RAM fits the rest."""

    nvme_dir: str | os.PathLike | None = None
    host_memory: int | str | None = None
    shared_staging: bool | None = None
    reference: Literal["bfloat16"] | None = None
    host_reserved: int = 0


@dataclass(frozen=True, slots=True)
class PlanRequest:
    """What to plan: the model at one batch shape, on ``hardware``, over ``topology``, with
    ``storage``.

    Attributes:
        model: the ``nn.Module`` (on any device, ``meta`` included); traced here once.
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step over all ranks.
        micro_batch_size: sequences per micro-batch; None: the solver's choice (needs ``hardware``
            and ``plan=None``). Each rank runs ``global_batch / (ranks x micro_batch_size)``
            micro-batches.
        plan: a ``Plan`` (one rank's), ``"default"``, or None for the solver's plan on
            ``hardware`` (the default plan where there is none).
        hardware: a ``HardwareSpec``, a preset name or a spec JSON file: what the solver plans for
            and the step is predicted on.
        device, compute_dtype, input_names, max_grad_norm, per_token_loss, image_grid_thw,
        images_per_row: as for ``megatrain.compile``.
        optimizer_name: the host optimizer the plan is for (``Plan.optimizer_name``, a name in
            :data:`megatrain.optim.OPTIMIZERS`): its state bytes per parameter are what the solver
            and ``memory`` count. None keeps a given plan's, else ``"adamw"``.
        topology, storage: :class:`Topology` and :class:`Storage`.
        solver: ``"milp"`` or ``"enumerate"`` (``megatrain.planner.solve``).
        templates: ``Plan.templates``: ``"eager"`` or ``"compiled"``; None keeps a given plan's, else
            :data:`DEFAULT_TEMPLATES` for the device.
        cuda_graphs: ``Plan.cuda_graphs``: True, False, or ``"auto"``: on where the step is
            issue-bound on ``hardware`` (:func:`megatrain.planner.graphs.issue_bound`) and the graphs'
            pool fits; None keeps a given plan's, else False. CUDA only.
    """

    model: nn.Module
    seq_len: int
    global_batch: int
    micro_batch_size: int | None = 1
    plan: Plan | Literal["default"] | None = None
    hardware: HardwareSpec | str | os.PathLike | None = None
    device: str = "cpu"
    compute_dtype: str | None = None
    input_names: Sequence[str] = ("input_ids", "labels")
    max_grad_norm: float | None = None
    per_token_loss: bool = True
    image_grid_thw: Sequence[Sequence[int]] | None = None
    images_per_row: int = 1
    optimizer_name: str | None = None
    topology: Topology = Topology()
    storage: Storage = Storage()
    solver: Literal["milp", "enumerate"] = "milp"
    templates: Literal["eager", "compiled"] | None = None
    cuda_graphs: bool | Literal["auto"] | None = None
    on_traced: Callable[[LayerGraph, float], None] | None = field(default=None, compare=False)
    """Called with the traced graph and the seconds tracing took, before anything is solved
    (``megatrain plan``'s progress line)."""


@dataclass(frozen=True, slots=True)
class Schedules:
    """The train schedules of one plan, lowered and verified once.

    ``first``: a step with no update carried in (every step, with optimizer steps during
    backward). With NEXT_FORWARD placement also ``carrying`` (a step that starts with the previous
    step's optimizer steps), ``update`` (those steps alone) and ``tiles`` (each trainable layer's
    gradient tile).
    """

    first: Schedule
    carrying: Schedule | None = None
    update: Schedule | None = None
    tiles: tuple[int, ...] = ()

    @property
    def steady(self) -> Schedule:
        """The schedule every step after the first runs (``carrying`` with NEXT_FORWARD placement)."""
        return self.carrying or self.first

    @classmethod
    def lower(cls, graph: LayerGraph, plan: Plan, steady: Schedule | None = None) -> "Schedules":
        """Lower and verify ``plan``'s train schedules. ``steady``: the steady-state schedule the
        solver already lowered and verified (``Solution.schedule``), used as it is rather than
        lowered a second time."""
        next_forward = plan.optimizer is OptimizerPlacement.NEXT_FORWARD
        if steady is not None and (steady.plan != plan or steady.carries_updates != next_forward
                                   or steady.mode != "train"):
            raise ValueError("Schedules.lower: steady is not the steady train schedule of this plan")

        def lowered(**kw) -> Schedule:
            sched = lower(graph, plan, **kw)
            verify(sched, graph)
            return sched

        if not next_forward:
            return cls(steady or lowered(mode="train"))
        return cls(lowered(mode="train"), steady or lowered(mode="train", carries_updates=True),
                   lowered(mode="update"), tuple(gradient_tiles(graph)))


@dataclass(frozen=True, slots=True, eq=False)
class PlannedModel:
    """A model planned for training: everything that will run, decided once by :func:`plan`
    and turned into a ``Trainer`` by ``megatrain.materialize``. Nothing is allocated yet.

    Attributes:
        model: the ``nn.Module`` as given (on any device, ``meta`` included); ``materialize``
            binds its parameters to the host tiles.
        options: the validated ``CompileOptions`` (one rank's micro-batches).
        traced: the ``TracedModel`` (layer templates and the ``LayerGraph``).
        plan: the ``Plan`` the schedules were lowered from (data parallel and NVMe fields set).
        schedules: the train ``Schedules`` the trainer runs, lowered and verified once; their
            ``steady`` schedule is what ``megatrain plan --out`` and ``megatrain train`` write to
            ``schedule.json``.
        memory: ``cost.MemoryBreakdown`` of the plan on the graph (bytes): host state, pinned
            buffers, GPU peak; what a preflight checks.
        hardware: the ``HardwareSpec`` planned for or predicted on, or None.
        timeline: the predicted steady-state step on ``hardware`` (``Timeline``; its
            ``step_time_s`` in seconds): the solver's when it chose the plan, else simulated once
            here; None without a spec that rates every stream the plan uses.
        solution: the solver's ``Solution`` when it chose the plan (its search statistics), else None.
        nvme: the ``NvmeSolution`` where the solver placed state on the spec's NVMe tier.
        topology: the ``TopologySolution`` where the solver planned the ranks' topology.
        decisions: one line per decision beyond the one-rank plan (NVMe placement, host state),
            what ``megatrain train`` and ``megatrain plan`` print.
        trace_s: seconds the trace took.
    """

    model: nn.Module
    options: CompileOptions
    traced: TracedModel
    plan: Plan
    schedules: Schedules
    memory: MemoryBreakdown
    hardware: HardwareSpec | None = None
    timeline: Timeline | None = None
    solution: Solution | None = None
    nvme: Any = None
    topology: Any = None
    decisions: tuple[str, ...] = ()
    trace_s: float = 0.0

    @property
    def graph(self) -> LayerGraph:
        """The graph the schedules were lowered on: the traced one, always at the micro-batch size
        that runs (where the solver chose the size, the model traced again at it; the solver's
        rescaled graph it chose on is ``solution.graph``)."""
        return self.traced.graph


def plan(request: PlanRequest) -> PlannedModel:
    """Plan ``request``'s model for training, once (module docstring): trace it, decide the plan,
    lower and verify its train schedules, predict the step. Allocates nothing.

    Returns:
        The :class:`PlannedModel`. With a solved plan on one rank its ``schedules.steady`` is the
        solver's own schedule and ``timeline`` the solver's simulation of it.

    Raises:
        ConfigError: an option out of range; ``seq_len`` beyond a Hugging Face model's
            ``max_position_embeddings``; a plan inconsistent with the options;
            ``per_token_loss`` for a model whose loss megatrain cannot count; ``host_state``
            impossible for the topology.
        TraceError / UnsupportedModelError: the model cannot be traced or is not supported.
        PlanError, ScheduleError: the plan does not fit the model (or no plan fits the spec); a
            global batch the ranks and micro-batch size do not split.
    """
    r, topo = request, request.topology
    if topo.ranks < 1 or topo.ranks_per_node < 1 or topo.ranks % topo.ranks_per_node:
        raise ConfigError(f"{topo.ranks} ranks, {topo.ranks_per_node} per node: both >= 1, and the ranks a "
                          "whole number of nodes")
    mbs = r.micro_batch_size
    if mbs is None and (r.plan is not None or r.hardware is None):
        raise ConfigError("micro_batch_size=None asks the solver to choose it: give hardware= and no plan")
    per_rank, split = divmod(r.global_batch, topo.ranks * (mbs or 1))
    if split or per_rank < 1:
        raise PlanError(f"global batch {r.global_batch} does not split over {topo.ranks_per_node} GPUs x "
                        f"{topo.nodes} nodes = {topo.ranks} ranks" + (f" in micro-batches of {mbs}" if mbs else "")
                        + f"; use a multiple of {topo.ranks * (mbs or 1)} (each rank trains its own micro-batches)")
    options = compile_options(r.seq_len, mbs or 1, per_rank if mbs else 1, r.input_names, r.device,
                              r.max_grad_norm, r.per_token_loss)
    check_model(r.model, options.seq_len)
    hw = _hardware(r.hardware)
    _check_reference(r.storage, hw)
    # Traced in the compute dtype (a BF16-built template for BF16 compute), as `megatrain plan` traces.
    dtype = r.plan.compute_dtype if isinstance(r.plan, Plan) else compute_dtype(options, r.compute_dtype)

    def traced_at(micro_batch_size: int) -> TracedModel:
        return trace(r.model, micro_batch_size=micro_batch_size, seq_len=options.seq_len,
                     input_names=options.input_names, param_dtype=getattr(torch, dtype),
                     image_grid_thw=r.image_grid_thw, images_per_row=r.images_per_row)

    t0 = time.perf_counter()
    traced = traced_at(options.micro_batch_size)
    trace_s = time.perf_counter() - t0
    graph = traced.graph
    if r.on_traced is not None:
        r.on_traced(graph, trace_s)
    if options.per_token_loss and traced.count_targets is None:
        raise ConfigError(f"the loss of a global batch is the mean over its supervised tokens, but megatrain cannot "
                          f"count this model's ({graph.meta.get('uncounted_loss_because')}); compile with "
                          "per_token_loss=False to weight each micro-batch's loss equally (the mean of the "
                          "micro-batch losses)")
    _check_host_state(topo)
    reference, hw_state = _reference(graph, r.storage, hw, topo)
    clip = options.max_grad_norm is not None
    if r.optimizer_name is not None:
        optimizer_spec(r.optimizer_name)  # ConfigError naming the known ones
    opt_name = r.optimizer_name or "adamw"
    solution = nvme = topology = None
    p = r.plan
    if p is None and hw is not None:
        rank_batch = options.global_batch if mbs else per_rank
        solution, nvme, topology = _solve(graph, options, hw_state, dtype, r, rank_batch, opt_name)
        p = (nvme or solution).plan
        graph = solution.graph
        if mbs is None:
            options = options.model_copy(update={"micro_batch_size": solution.micro_batch_size,
                                                 "micro_batches": p.micro_batches})
        if graph.micro_batch_size != traced.graph.micro_batch_size:
            # The solver chose the size on the trace rescaled to it (solve.scale_graph), but a template
            # runs at the one shape it was exported at: trace again at the chosen size and lower the
            # solver's plan on that graph, the one the trainer runs. The rescaling over-estimates
            # activations, but the GPU reserve counts the traced tensors, so at the edge of the GPU's
            # memory the plan may not fit the graph that runs: then it is solved again at that size
            # on that graph (the solver's own schedule then runs as it is).
            t0 = time.perf_counter()
            traced = _retraced(traced, traced_at(solution.micro_batch_size))
            trace_s += time.perf_counter() - t0
            graph = traced.graph
            if memory_breakdown(graph, p, hw_state, schedule=Schedules.lower(graph, p).steady).gpu_peak \
                    > hw_state.gpu_memory_bytes:
                at_size = dataclasses.replace(r, micro_batch_size=solution.micro_batch_size)
                solution, nvme, topology = _solve(graph, options, hw_state, dtype, at_size, rank_batch, opt_name)
                p = (nvme or solution).plan
    elif p is None or p == "default":
        p = dataclasses.replace(default_plan(graph, options.micro_batches, clip_gradients=clip), compute_dtype=dtype,
                                optimizer_name=opt_name)
    elif not isinstance(p, Plan):
        raise ConfigError(f"plan={p!r}: give a megatrain Plan, 'default' or None (the solver's)")
    elif r.optimizer_name is not None:
        # The optimizer is the caller's choice; a given plan's field only sizes its state.
        p = dataclasses.replace(p, optimizer_name=r.optimizer_name)
    if p.micro_batches != options.micro_batches:
        raise ConfigError(f"plan.micro_batches={p.micro_batches} but micro_batches={options.micro_batches}")
    if clip and p.optimizer is not OptimizerPlacement.NEXT_FORWARD:
        raise ConfigError(f"max_grad_norm={options.max_grad_norm} needs the global gradient norm before any "
                          f"update, but the plan runs optimizer steps {p.optimizer.value}; use a plan with "
                          "optimizer=OptimizerPlacement.NEXT_FORWARD (or plan=None)")
    decisions: list[str] = []
    if solution is not None:
        decisions.append(_micro_batch_decision(solution, hw_state, chosen=mbs is None))
    if topology is None:
        p = _data_parallel(p, topo, r.storage, host_state=None if topo.host_state == "auto" else topo.host_state)
    if r.storage.nvme_dir is not None:
        from megatrain.planner.nvme import place_in_directory

        memory = solution.memory if solution is not None and topo.ranks == 1 and solution.graph is graph else \
            memory_breakdown(graph, p, hw, schedule=Schedules.lower(graph, p).steady)
        placed = place_in_directory(graph, p, memory, r.storage.host_memory, r.storage.nvme_dir, hw_state,
                                    reserved=r.storage.host_reserved)
        decisions.append(placed.describe(graph, r.storage.nvme_dir,
                                         cast_once_set=placed.cast_once and not p.cast_once))
        p = _data_parallel(dataclasses.replace(p, nvme_moments=placed.moments, nvme_gradients=placed.gradients,
                                               nvme_masters=placed.masters, cast_once=placed.cast_once),
                           topo, r.storage, host_state=None)
    planned = _lowered(r.model, options, traced, graph, p, hw, solution, nvme, topology, topo)
    if topology is None and topo.host_state == "auto" and topo.nodes > 1:
        choice, why = _choose_host_state(planned, topo)
        decisions.append(why)
        if choice != planned.plan.host_state:
            p = _data_parallel(planned.plan, topo, r.storage, host_state=choice)
            planned = _lowered(r.model, options, traced, graph, p, hw, None, None, None, topo)
    if reference:
        from megatrain.units import human_bytes

        planned = dataclasses.replace(planned, memory=dataclasses.replace(planned.memory, reference_weights=reference))
        decisions.append(f"reference model: a frozen BF16 copy of the weights, {human_bytes(reference)} of host memory"
                         + (" per rank" if topo.ranks > 1 else "") + ", held beside the training state")
    planned = _execution(planned, r, hw, decisions)
    # A plan for the CPU backend and no GPU has no GPU reserve (the reserve is CUDA's: its context,
    # workspaces, allocator); with a GPU's spec the plan's memory is that GPU's, reserve included.
    memory = planned.memory.on_cpu() if options.device == "cpu" and hw is None else planned.memory
    return dataclasses.replace(planned, memory=memory, decisions=tuple(decisions), trace_s=trace_s)


DEFAULT_TEMPLATES = {"cpu": "eager", "cuda": "eager"}
"""``Plan.templates`` by device where neither the caller nor a given plan says. The CPU backend
stays eager: compiling costs 50-120 s per template and shape on a 2-core CPU (issue 39, cold cache)
and its kernels are not issue-bound. CUDA stays eager until the GPU session has measured compiled
against eager templates side by side (``bench/gpu_block.py``, in ``bench/gpu_session.sh``'s block
phase); where compiled wins there, this becomes "compiled"."""


def _execution(planned: PlannedModel, r: PlanRequest, hw: HardwareSpec | None, decisions: list[str]) -> PlannedModel:
    """``planned`` with how its compute ops run: ``Plan.templates`` and ``Plan.cuda_graphs`` from
    the request, a given plan, or the defaults (``"auto"`` graphs where the step is issue-bound);
    the schedules carry the plan, and the memory counts the graphs' pool. Appends the CUDA-graph
    decision to ``decisions`` when it was the planner's."""
    p, device = planned.plan, r.device
    given = isinstance(r.plan, Plan)
    if r.templates not in (None, "eager", "compiled"):
        raise ConfigError(f"templates={r.templates!r}: use 'eager' (the traced templates as they are) or 'compiled' "
                          "(torch.compile, once per template), or leave it unset")
    templates = r.templates or (p.templates if given else DEFAULT_TEMPLATES[device])
    graphs = r.cuda_graphs if r.cuda_graphs is not None else (p.cuda_graphs if given else False)
    if graphs not in (True, False, "auto"):
        raise ConfigError(f"cuda_graphs={graphs!r}: use True, False or 'auto' (on where the step is issue-bound)")
    if r.cuda_graphs is True and device != "cuda":  # a given plan's is checked against the backend it runs on
        raise ConfigError(f"cuda_graphs=True on device={device!r}: CUDA graphs capture GPU work; train on "
                          "device='cuda', or leave cuda_graphs off")
    if graphs == "auto":
        if device != "cuda":
            graphs, why = False, "the CPU backend has no CUDA graphs"
        else:
            from megatrain.planner.graphs import issue_bound

            graphs, why = issue_bound(planned.schedules.steady, planned.graph, hw)
        decisions.append(f"CUDA graphs: {'on' if graphs else 'off'}: {why}")
    if (templates, graphs) == (p.templates, p.cuda_graphs):
        return planned
    q = dataclasses.replace(p, templates=templates, cuda_graphs=graphs)
    s = planned.schedules
    schedules = Schedules(*(None if x is None else dataclasses.replace(x, plan=q)
                            for x in (s.first, s.carrying, s.update)), s.tiles)
    memory = planned.memory
    if graphs:
        memory = dataclasses.replace(memory, graph_pool=cost.graph_pool_bytes(planned.graph, schedules.steady))
        if hw is not None and not memory.fits(hw) and planned.memory.fits(hw):
            from megatrain.units import human_bytes

            if r.cuda_graphs == "auto":
                decisions[-1] = (f"CUDA graphs: off: the step is issue-bound, but the graphs' pool and buffers "
                                 f"({human_bytes(memory.graph_pool)}) do not fit beside the plan")
                return _execution(planned, dataclasses.replace(r, cuda_graphs=False), hw, [])
            raise PlanError(f"cuda_graphs=True: the CUDA graphs' memory pool and static buffers "
                            f"({human_bytes(memory.graph_pool)}) do not fit beside the plan on {hw.name} (GPU peak "
                            f"{human_bytes(memory.gpu_peak)} of {human_bytes(hw.gpu_memory_bytes)}); turn cuda_graphs "
                            "off, or plan with a smaller micro-batch")
    return dataclasses.replace(planned, plan=q, schedules=schedules, memory=memory)


def _check_reference(storage: Storage, hw: HardwareSpec | None) -> None:
    """Raise ConfigError for a ``Storage.reference`` this planner does not plan."""
    if storage.reference not in (None, "bfloat16"):
        raise ConfigError(f"reference={storage.reference!r}: use 'bfloat16' (a frozen BF16 copy of the weights on the "
                          "host) or None (reference log-probabilities precomputed before training)")
    if storage.reference is not None and (storage.nvme_dir is not None or (hw is not None and hw.has_nvme)):
        raise ConfigError("a BF16 reference model on the host with an NVMe tier is not planned yet; plan without the "
                          "NVMe tier, or precompute the reference log-probabilities before training")


def _reference(graph: LayerGraph, storage: Storage, hw: HardwareSpec | None,
               topo: Topology) -> tuple[int, HardwareSpec | None]:
    """``(bytes, spec)``: the host bytes of ``storage.reference`` (a frozen BF16 copy of every
    tile element, on each rank) and the spec the training state is planned on: ``hw`` less the
    node's copies of it (the solver and the NVMe placement then leave it room)."""
    if storage.reference is None:
        return 0, hw
    nbytes = 2 * sum(layer.numel for layer in graph.layers)
    if hw is None:
        return nbytes, hw
    left = hw.host_memory_bytes - topo.ranks_per_node * nbytes
    if left <= 0:
        raise PlanError(f"{hw.name}: the BF16 reference weights alone ({topo.ranks_per_node} x {nbytes} bytes) fill its "
                        f"{hw.host_memory_bytes} bytes of host memory; precompute the reference log-probabilities "
                        "instead")
    return nbytes, hw.model_copy(update={"host_memory_bytes": left,
                                         "pinned_memory_cap_bytes": min(hw.pinned_memory_cap_bytes, left)})


def _lowered(model, options, traced, graph, p: Plan, hw, solution, nvme, topology, topo: Topology) -> PlannedModel:
    """The train schedules of ``p``, lowered and verified once (the solver's own steady schedule
    where it is ``p``'s), their memory and the predicted step."""
    # The solver's schedules were lowered on its graph; a model traced again at the chosen size
    # (plan) gets its own.
    own = solution is not None and solution.graph is graph
    if own and nvme is not None and nvme.plan == p:
        # The NVMe search's schedule; its ``memory`` is the plan's with nothing on NVMe, so the
        # breakdown of the plan that runs is taken here.
        schedules = Schedules.lower(graph, p, steady=nvme.schedule)
        return PlannedModel(model, options, traced, p, schedules,
                            memory_breakdown(graph, p, hw, schedule=schedules.steady), hw, nvme.timeline, solution,
                            nvme, topology)
    if own and solution.plan == p and (topo.ranks == 1 or topology is not None):
        schedules = Schedules.lower(graph, p, steady=solution.schedule)
        return PlannedModel(model, options, traced, p, schedules, solution.memory, hw, solution.timeline, solution,
                            nvme, topology)
    schedules = Schedules.lower(graph, p)
    memory = memory_breakdown(graph, p, hw, schedule=schedules.steady)
    timeline = None
    # Data parallel: predicted only where the spec has the links the collectives cross
    # (cost.all_reduce_time: the node's GPUs' interconnect, the network between nodes); NVMe
    # ops only where it has the NVMe tier's rates (a GPU preset has none: megatrain train
    # --hardware H100_SXM --nvme-dir DIR trains without a prediction).
    if hw is not None and hw.has_gpu and hw.peak_flops(p.compute_dtype) > 0 and hw.d2h_bytes_per_s > 0 \
            and _has_links(hw, p.gpus_per_node, p.nodes) \
            and (hw.has_nvme or not (p.nvme_moments or p.nvme_gradients or p.nvme_masters)):
        timeline = simulate(schedules.steady, graph, hw)
    return PlannedModel(model, options, traced, p, schedules, memory, hw, timeline, solution, nvme, topology)


def _retraced(first: TracedModel, again: TracedModel) -> TracedModel:
    """``again`` (the model traced at the solver's micro-batch size), checked to cut into the layers
    of ``first`` (the trace the solver planned on), whose per-layer choices the plan holds."""
    old, new = first.graph.layers, again.graph.layers
    if [lay.params for lay in old] != [lay.params for lay in new]:
        raise PlanError(f"traced again at the solver's micro-batch size {again.graph.micro_batch_size}, the model cuts "
                        f"into {len(new)} layers, not the {len(old)} of its trace at micro-batch size "
                        f"{first.graph.micro_batch_size} that the solver planned on; give micro_batch_size= "
                        "(the solver then plans on a trace at that size)")
    return again


def _has_links(hw: HardwareSpec, gpus_per_node: int, nodes: int) -> bool:
    """The spec rates the links the collectives of ``gpus_per_node x nodes`` ranks cross."""
    return (gpus_per_node == 1 or hw.intra_node_bus_bytes_per_s > 0) and (nodes == 1 or hw.network_bytes_per_s > 0)


def _check_host_state(topo: Topology) -> None:
    if topo.host_state not in (None, "replicate", "shard", "auto"):
        raise ConfigError(f"host_state={topo.host_state!r}: use 'replicate' (a full copy per node), 'shard' "
                          "(1/nodes of it per node) or 'auto'")
    if topo.host_state == "shard" and topo.ranks == 1:
        raise ConfigError("host_state='shard' splits the host state across the nodes of a torch.distributed "
                          "process group, and there is none (or one rank); run under torchrun on several nodes, "
                          "or leave host_state unset")
    if topo.host_state == "shard" and topo.nodes == 1:
        raise ConfigError(f"host_state='shard' with all {topo.ranks} ranks on one node (LOCAL_WORLD_SIZE="
                          f"{topo.ranks_per_node}): sharding splits the host state across nodes; use "
                          "host_state='replicate' on one node")


def _data_parallel(p: Plan, topo: Topology, storage: Storage, host_state: str | None) -> Plan:
    """``p`` (one rank's plan) for ``topo``'s ranks: one plan per rank and an ALL_REDUCE (or
    REDUCE_SCATTER) of every layer's step gradients, FP32 on the host; the ranks of a node share
    one host copy and split its optimizer work where ``share_host_memory``. One rank: ``p``."""
    if topo.ranks == 1:
        return p
    from megatrain.planner.topology import data_parallel_plan

    if p.host_state == "shard" and not topo.share_host_memory:
        raise ConfigError("the plan shards the host state across nodes (Plan.host_state='shard'), whose ranks "
                          "share each node's slice; compile with share_host_memory=True")
    return data_parallel_plan(p, topo.ranks, topo.nodes, topo.ranks_per_node if topo.share_host_memory else 1,
                              host_state or p.host_state, shared_staging=storage.shared_staging is not False)


def _choose_host_state(planned: PlannedModel, topo: Topology) -> tuple[str, str]:
    """``Topology.host_state == "auto"`` on several nodes: replicate where a full copy fits
    (``topo.fits``, else the node's memory on the spec), else shard; and the line that says so."""
    from megatrain.units import human_bytes

    p = planned.plan
    if topo.fits is not None:
        fits, where = topo.fits(planned), "every node's host memory"
    elif planned.hardware is not None:
        node = cost.node_memory(planned.graph, p, planned.memory)
        fits, where = node.fits(planned.hardware), f"{human_bytes(planned.hardware.host_memory_bytes)} per node"
    else:
        fits, where = True, "no spec to check it against"
    if fits:
        return "replicate", f"host state: replicate: every node holds a full copy of the masters and moments ({where})"
    return "shard", (f"host state: shard: a full copy on every node does not fit {where}; each of the {p.nodes} "
                     f"nodes holds 1/{p.nodes} and the layers' weights are gathered before use")


def _micro_batch_decision(solution: Solution, hw: HardwareSpec, chosen: bool) -> str:
    """The decisions line of the solver's micro-batches (``chosen``: the size was the solver's) and
    whether its simulated step is GPU-bound or issue-bound: the seconds its compute ops ran while
    still being issued against those they ran with their work all queued (``Timeline.issue_bound_s``
    and ``gpu_busy_s`` of the step simulated with its issuing thread), issue-bound where the first
    are more. The solver charges the issue time, so where memory allows it picks micro-batches
    large enough to keep the GPU ahead of the thread (:mod:`megatrain.planner.solve`)."""
    tl = simulate(solution.schedule, solution.graph, hw, issue_times=True)
    bound, busy = tl.issue_bound_s.get(Stream.COMPUTE, 0.0), tl.gpu_busy_s.get(Stream.COMPUTE, 0.0)
    size, count = solution.micro_batch_size, solution.plan.micro_batches
    whose = "the solver's size" if chosen else "the given size"
    return (f"micro-batches: {count} of {size} sequence{'s' * (size != 1)} ({whose}); the simulated step is "
            f"{'issue-bound' if bound > busy else 'GPU-bound'}: its compute ops ran {bound:.4g} s of the "
            f"{tl.step_time_s:.4g} s step while still being issued, {busy:.4g} s with their work all queued")


def _solve(graph: LayerGraph, options: CompileOptions, hw: HardwareSpec, dtype: str, r: PlanRequest,
           rank_batch: int, opt_name: str):
    """``(solution, nvme, topology)``: the solver's plan for ``hw``, each rank training
    ``rank_batch`` sequences a step with the host optimizer ``opt_name`` (``nvme`` an ``NvmeSolution``
    where the spec's NVMe tier was searched, ``topology`` a ``TopologySolution`` where the ranks'
    topology was planned; else None)."""
    topo = r.topology
    limits = SolveLimits() if r.micro_batch_size is None else \
        SolveLimits(micro_batch_sizes=(options.micro_batch_size,))
    clip = options.max_grad_norm is not None
    if topo.ranks > 1 and topo.share_host_memory and _has_links(hw, topo.ranks_per_node, topo.nodes):
        from megatrain.planner.topology import solve_topology

        ts = solve_topology(graph, hw, rank_batch * topo.ranks, gpus_per_node=topo.ranks_per_node,
                            nodes=topo.nodes, compute_dtype=dtype, clip_gradients=clip, method=r.solver,
                            limits=limits, host_state=None if topo.host_state == "auto" else topo.host_state,
                            optimizer_name=opt_name)
        return ts.solution, None, ts
    request = SolveRequest(graph, hw, rank_batch, dtype, clip_gradients=clip, limits=limits,
                           optimizer_name=opt_name)
    if topo.ranks == 1 and hw.has_nvme and r.storage.nvme_dir is None:
        from megatrain.planner.nvme import solve_with_nvme

        ns = solve_with_nvme(request, r.solver)
        return ns.solution, ns, None
    return solve(request, r.solver), None, None


def compile_options(seq_len, micro_batch_size, micro_batches, input_names, device, max_grad_norm,
                    per_token_loss) -> CompileOptions:
    """The validated ``CompileOptions``. Raises ConfigError naming each bad setting."""
    try:
        return CompileOptions(seq_len=seq_len, micro_batch_size=micro_batch_size, micro_batches=micro_batches,
                              input_names=tuple(input_names), device=device, max_grad_norm=max_grad_norm,
                              per_token_loss=per_token_loss)
    except pydantic.ValidationError as e:
        raise ConfigError("invalid settings: " + describe_validation(e)) from None


def compute_dtype(options: CompileOptions, dtype: str | None) -> str:
    """The compute dtype: ``dtype``, else BF16 on CUDA and FP32 on the CPU. Raises ConfigError."""
    dtype = dtype or ("bfloat16" if options.device == "cuda" else "float32")
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"compute_dtype={dtype!r}: use 'float32' or 'bfloat16'")
    return dtype


def _hardware(hardware: HardwareSpec | str | None) -> HardwareSpec | None:
    """A HardwareSpec from itself, a spec ``.json`` file or a preset name (None stays None)."""
    if hardware is None or isinstance(hardware, (HardwareSpec, str, os.PathLike)):
        return None if hardware is None else load_hardware(hardware)
    raise ConfigError(f"hardware={hardware!r}: give a HardwareSpec, a preset name or a spec .json file")


__all__ = ["DEFAULT_TEMPLATES", "PlanRequest", "Topology", "Storage", "PlannedModel", "Schedules", "plan",
           "compile_options", "compute_dtype"]
