"""Planning for several GPUs and nodes: interconnect and network presets, attaching them to a
HardwareSpec, and one rank's plan for ``G`` GPUs per node x ``M`` nodes with the choice of where the
persistent host state lives.

Method. Every rank runs the same schedule on its own micro-batches (``Plan.data_parallel`` =
``G x M``), so the solver plans one rank (:func:`megatrain.planner.solve.solve`) and the topology is
added to its plan afterwards (``Plan.nodes``, ``Plan.host_state``, and ``Plan.optimizer_shards = G``:
the lowering then adds the ALL_REDUCEs and ALL_GATHERs). What the ranks share is host memory: a node
holds one copy of the FP32 masters and Adam moments for its ``G`` GPUs (or ``1 / M`` of it,
sharded), and each rank its own buffers
(:func:`megatrain.planner.cost.node_memory`). The solver sees one rank's share of the node: a spec
whose host memory and pinned cap are :func:`megatrain.planner.cost.rank_host_budgets`, within which
one rank's breakdown (whole state included) fits exactly when the node does. The plan is then
lowered with its topology, verified against that share, and simulated on the node's rates: the
ALL_REDUCE on the COMM stream (hierarchical ring, :func:`megatrain.planner.cost.all_reduce_time`;
on one node, whose ranks share one copy and each step only its shard, a REDUCE_SCATTER at half the
bytes, ``Plan.gradient_reduction``, :func:`megatrain.planner.cost.reduce_scatter_time`; with a
state sharded across nodes a hierarchical REDUCE_SCATTER over every rank, each of which steps
``1 / (G x M)``), each rank's ``1 / G`` of every optimizer update at ``1 / G`` of the host
bandwidth, and with a sharded state a weight all-gather before every H2D.

Host state across nodes (issue 16, part 2). Replicate (a full copy per node, no weight traffic)
when that fits the node's host memory; else shard (ZeRO-3 style, Rajbhandari et al. 2020,
arXiv:1910.02054: each node holds and updates ``1 / M``, the weights are all-gathered over the
network before each use) when that fits; else no plan fits. :class:`HostStateChoice` records the
bytes needed and available and the network time sharding adds per step. The runtime runs both
(``"shard"``: :mod:`megatrain.runtime.distributed`, tested on CPU with gloo only).

Not modelled: the ``G`` ranks' H2D copies reading one host DRAM at once (each at its PCIe link's
rate, up to ``G x 53 GB/s`` on a DGX H100 against 614 GB/s of DRAM).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from megatrain.errors import ConfigError, PlanError
from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph
# The link presets are hardware presets, with the others in ir/hardware.py; re-exported here.
from megatrain.ir.hardware import INTERCONNECTS, NETWORKS, HardwareSpec, Link
from megatrain.ir.plan import Plan
from megatrain.ir.schedule import OpKind
from megatrain.planner.solve.request import Solution
from megatrain.units import human_bytes


def _link(table: dict[str, Link], name: str | Link, what: str, flag: str) -> Link:
    if isinstance(name, Link):
        return name
    key = name.strip().lower().replace("_", "-")
    try:
        return table[key]
    except KeyError:
        raise ConfigError(f"no {what} preset named {name!r}; valid names are {sorted(table)} ({flag})") from None


def with_topology(hw: HardwareSpec, interconnect: str | Link | None = None,
                  network: str | Link | None = None) -> HardwareSpec:
    """``hw`` with an intra-node interconnect (a name of :data:`INTERCONNECTS` or a :class:`Link`)
    and/or an inter-node network (a name of :data:`NETWORKS` or a Link) attached: their rates and
    latencies replace ``intra_node_bytes_per_s`` / ``intra_node_latency_s`` and
    ``network_bytes_per_s`` / ``network_latency_s``; the name records them.

    Raises:
        ConfigError: an unknown preset name (the message lists the valid ones).
    """
    update: dict = {}
    names = []
    if interconnect is not None:
        link = _link(INTERCONNECTS, interconnect, "interconnect", "--interconnect")
        # The legacy field would contradict the new rate (HardwareSpec refuses two different ones).
        update.update(intra_node_bytes_per_s=link.bytes_per_s, intra_node_latency_s=link.latency_s,
                      allreduce_bytes_per_s=0.0)
        names.append(link.name)
    if network is not None:
        link = _link(NETWORKS, network, "network", "--network")
        update.update(network_bytes_per_s=link.bytes_per_s, network_latency_s=link.latency_s)
        names.append(link.name)
    if not update:
        return hw
    return HardwareSpec.model_validate({**hw.model_dump(), **update, "name": f"{hw.name} + {' + '.join(names)}"})


@dataclass(frozen=True, slots=True)
class HostStateChoice:
    """Where a node keeps the persistent host state, and why.

    Attributes:
        mode: ``"replicate"`` (a full copy per node) or ``"shard"`` (``1 / nodes`` per node).
        nodes: the nodes of the plan, >= 1; ``"shard"`` needs more than one.
        need_bytes: host bytes one node needs in this mode (:attr:`NodeMemory.total`).
        have_bytes: host bytes one node has (``HardwareSpec.host_memory_bytes``).
        network_s_per_step: seconds of weight all-gathers over the network one step adds on each
            rank's H2D path (``cost.weight_gather_time`` of every H2D op); 0 when replicated.
        reason: one sentence with those numbers, and for ``"shard"`` why replicating did not fit.
    """

    mode: Literal["replicate", "shard"]
    nodes: int
    need_bytes: int
    have_bytes: int
    network_s_per_step: float
    reason: str

    def __post_init__(self) -> None:
        if self.mode not in ("replicate", "shard"):
            raise PlanError(f"HostStateChoice.mode={self.mode!r}: use 'replicate' or 'shard'")
        if self.nodes < 1 or (self.mode == "shard" and self.nodes == 1):
            raise PlanError(f"HostStateChoice: mode {self.mode!r} with nodes={self.nodes}; sharding needs >= 2 nodes")
        if self.need_bytes > self.have_bytes:
            raise PlanError(f"HostStateChoice: {self.mode} needs {human_bytes(self.need_bytes)} per node but the node "
                            f"has {human_bytes(self.have_bytes)}; a choice must fit")
        if self.mode == "replicate" and self.network_s_per_step != 0:
            raise PlanError("HostStateChoice: a replicated state moves no weights over the network; "
                            f"network_s_per_step={self.network_s_per_step} must be 0")


@dataclass(frozen=True, slots=True)
class TopologySolution:
    """One rank's solved plan for ``gpus_per_node x nodes`` GPUs, with the node's memory.

    Attributes:
        solution: the rank's Solution: its ``plan`` carries the topology (``data_parallel``,
            ``nodes``, ``host_state``), ``schedule`` is that plan lowered (with its ALL_REDUCEs)
            and verified, ``timeline`` its simulated step on the node's rates, ``memory`` the
            rank's breakdown (the whole persistent state counted, as for one GPU).
        node: the host bytes of one node (:func:`cost.node_memory`).
        host_state: the replicate-or-shard choice and its reason.
        hardware: the node spec the step was simulated on (interconnect and network attached).
    """

    solution: Solution
    node: cost.NodeMemory
    host_state: HostStateChoice
    hardware: HardwareSpec

    @property
    def plan(self) -> Plan:
        return self.solution.plan

    @property
    def ranks(self) -> int:
        return self.plan.data_parallel

    @property
    def fits(self) -> bool:
        """GPU memory per rank and host memory (and its pinned cap) per node all hold."""
        mem, hw = self.solution.memory, self.hardware
        return mem.gpu_peak <= hw.gpu_memory_bytes and self.node.fits(hw)

    @property
    def global_tokens_per_s(self) -> float:
        """Tokens per second of all ranks together: each rank's simulated rate x ranks (they run the
        same schedule in lockstep, joined by the collectives)."""
        return self.solution.timeline.tokens_per_s * self.ranks


def _first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line.split("; ")[0].rstrip(".")


def _with_shared_cast(graph: LayerGraph, plan: Plan, hw: HardwareSpec, view: HardwareSpec,
                      carries_updates: bool) -> "tuple[Plan, object, object] | None":
    """``plan`` with a BF16 staging tile per layer shared by the node's ranks (``Plan.cast_once``
    and ``Plan.shared_cast``: each rank casts ``1 / G`` of each layer once per step, the tiles
    held once per node), lowered, verified against one rank's share of the node with those tiles
    counted once (:func:`megatrain.planner.cost.rank_host_budgets`) and simulated on ``hw``:
    ``(plan, schedule, timeline)``, or None where it does not apply (FP32, one GPU per node, a
    sharded state) or does not fit. The solver plans one rank, which sees only tiles of its own
    (a tile per layer is 2 bytes per parameter per rank, more than 8 ranks' share of a node
    holds for a 120B model), so the planner tries the shared tiles here."""
    from megatrain.errors import ScheduleError
    from megatrain.planner.lower import lower
    from megatrain.planner.simulate import simulate
    from megatrain.planner.verify import verify

    if plan.compute_dtype != "bfloat16" or plan.optimizer_shards == 1 or plan.host_state != "replicate" \
            or plan.shared_cast:
        return None
    cand = dataclasses.replace(plan, cast_once=True, shared_cast=True)
    host, pinned = cost.rank_host_budgets(graph, cand, hw)
    if host <= 0 or pinned < 0:
        return None
    share = view.model_copy(update={"host_memory_bytes": host, "pinned_memory_cap_bytes": min(pinned, host)})
    schedule = lower(graph, cand, carries_updates=carries_updates)
    try:
        verify(schedule, graph, share)
    except ScheduleError:  # the node's memory does not hold the tiles besides the ranks' buffers
        return None
    return cand, schedule, simulate(schedule, graph, hw)


def data_parallel_plan(plan: Plan, ranks: int, nodes: int, shards: int, host_state: str,
                       shared_staging: bool = True) -> Plan:
    """One rank's ``plan`` for ``ranks`` ranks on ``nodes`` nodes: every rank runs it on its own
    micro-batches and the lowering adds the collectives. ``shards``: the ranks of a node that
    share one host copy and split its optimizer steps (``Plan.optimizer_shards``; 1 where each
    rank keeps a copy). ``host_state``: ``"replicate"`` or ``"shard"`` across the nodes.

    The fields it sets, the one place they are decided for several ranks (``solve_topology``
    and ``megatrain.planner.front.plan``): the gradients cross D2H in FP32 (the host sums the
    ranks', which BF16 would round); a REDUCE_SCATTER where every rank steps only its shard of
    one copy (``Plan.update_shards`` = ``ranks``), else an ALL_REDUCE; and the node's ranks that
    share a copy share its BF16 staging tiles too, each casting its shard (``Plan.shared_cast``,
    1/G of the casts' host traffic), where a tile per layer is cast once a step
    (``Plan.cast_once``) and ``shared_staging`` (False where the host state the plan will share
    was made without those tiles).
    """
    plan = dataclasses.replace(plan, data_parallel=ranks, nodes=nodes, host_state=host_state,
                               optimizer_shards=shards, gradient_reduction="all_reduce",
                               d2h_dtype="float32" if ranks > 1 and plan.gradient_dtype != "float32"
                               else plan.d2h_dtype)
    if plan.update_shards == ranks > 1:
        plan = dataclasses.replace(plan, gradient_reduction="reduce_scatter")
    return dataclasses.replace(plan, shared_cast=plan.cast_once and shards > 1 and host_state == "replicate"
                               and shared_staging)


def solve_topology(graph: LayerGraph, hw: HardwareSpec, global_batch: int, *, gpus_per_node: int, nodes: int,
                   compute_dtype: Literal["bfloat16", "float32"] = "bfloat16", clip_gradients: bool = False,
                   method: Literal["milp", "enumerate"] = "milp", optimizer_name: str = "adamw", limits=None,
                   host_state: Literal["replicate", "shard"] | None = None) -> TopologySolution:
    """Plan ``graph`` for ``gpus_per_node`` GPUs on each of ``nodes`` nodes of ``hw`` training
    ``global_batch`` sequences per step together (module docstring, "Method").

    ``global_batch`` is split evenly: each rank plans ``global_batch / (gpus_per_node x nodes)``.
    The host state is replicated when that fits the node's host memory, else sharded when that
    fits (module docstring, "Host state across nodes"); ``host_state`` tries only that mode. The
    persistent state counts host optimizer ``optimizer_name``'s state bytes (``Plan.optimizer_name``).
    ``limits``: the solver's ``SolveLimits`` (a fixed micro-batch size, say).

    Raises:
        PlanError: a count below 1, a global batch the ranks cannot split evenly, or no plan fits
            in either mode (the message gives each mode's reason).
        ConfigError: ``hw`` lacks the intra-node bandwidth (``gpus_per_node > 1``) or the network
            bandwidth (``nodes > 1``) (attach them with :func:`with_topology`).
    """
    from megatrain.planner.lower import lower
    from megatrain.planner.simulate import simulate
    from megatrain.planner.solve import InfeasibleRequestError, SolveRequest, solve
    from megatrain.planner.verify import verify

    if gpus_per_node < 1 or nodes < 1:
        raise PlanError(f"gpus_per_node={gpus_per_node}, nodes={nodes}: both must be >= 1")
    ranks = gpus_per_node * nodes
    if global_batch % ranks:
        raise PlanError(f"global batch {global_batch} does not split over {gpus_per_node} GPUs x {nodes} nodes = "
                        f"{ranks} ranks; use a multiple of {ranks} (each rank trains its own micro-batches)")
    # Fail on a missing rate before solving, with the message that names the flag to pass.
    trainable = [layer for layer in graph.layers if layer.trainable_numel]
    if trainable:
        cost.all_reduce_time(trainable[0], hw, Plan(data_parallel=ranks, nodes=nodes))
    state = cost.persistent_state_bytes(graph, Plan(optimizer_name=optimizer_name))
    failures: list[str] = []
    for mode in (host_state,) if host_state else ("replicate", "shard") if nodes > 1 else ("replicate",):
        topo = Plan(data_parallel=ranks, nodes=nodes, host_state=mode, compute_dtype=compute_dtype,
                    optimizer_shards=gpus_per_node, optimizer_name=optimizer_name)
        host, pinned = cost.rank_host_budgets(graph, topo, hw)
        held = -(-state // (nodes if mode == "shard" else 1))
        if host <= state or pinned < 0:
            what = "a full copy of the masters and moments" if mode == "replicate" else f"1/{nodes} of the masters and moments"
            failures.append(f"{mode}: {what}, {human_bytes(held)}, leaves no host memory of the node's "
                            f"{human_bytes(hw.host_memory_bytes)} for {gpus_per_node} ranks' buffers")
            continue
        view = hw.model_copy(update={"name": f"{hw.name}, one of {gpus_per_node} ranks per node ({mode})",
                                     "host_memory_bytes": host, "pinned_memory_cap_bytes": min(pinned, host)})
        try:
            # data_parallel_plan sends FP32 gradients from every rank of several: plan its slots so.
            sol = solve(SolveRequest(graph, view, global_batch // ranks, compute_dtype, clip_gradients=clip_gradients,
                                     optimizer_name=optimizer_name, d2h_dtype="float32" if ranks > 1 else None,
                                     **({} if limits is None else {"limits": limits})), method)
        except InfeasibleRequestError as e:
            r = e.requirements
            if r.gpu_memory_bytes > hw.gpu_memory_bytes:  # the GPU is the obstacle, whatever the host
                failures.append(f"{mode}: {_first_sentence(str(e))}")
            else:
                what = "a full copy of the masters and moments" if mode == "replicate" else f"1/{nodes} of them"
                floor = held + cost.gather_buffer_bytes(graph, topo) + cost.gather_scratch_bytes(graph, topo) + gpus_per_node * max(0, r.host_floor_bytes - state)
                failures.append(f"{mode}: {what}, {human_bytes(held)}, and {gpus_per_node} ranks' smallest buffers "
                                f"need at least {human_bytes(floor)} of the node's {human_bytes(hw.host_memory_bytes)}")
            continue
        plan = data_parallel_plan(sol.plan, ranks, nodes, gpus_per_node, mode)
        plan.check_against(sol.graph)
        schedule = lower(sol.graph, plan, carries_updates=sol.schedule.carries_updates)
        verify(schedule, sol.graph, view)
        timeline = simulate(schedule, sol.graph, hw)
        shared = _with_shared_cast(sol.graph, plan, hw, view, sol.schedule.carries_updates)
        if shared is not None and shared[2].step_time_s < timeline.step_time_s:
            plan, schedule, timeline = shared
        mem = cost.memory_breakdown(sol.graph, plan, hw, schedule)
        node = cost.node_memory(sol.graph, plan, mem)
        gathers = [op for op in schedule.ops if op.kind is OpKind.H2D]
        network_s = sum(cost.weight_gather_time(sol.graph.layers[op.layer], hw, plan) for op in gathers)
        need = (f"{human_bytes(node.persistent)} of masters and moments + {gpus_per_node} ranks x "
                f"{human_bytes(node.per_rank)} of buffers"
                + (f" + {human_bytes(node.gather_buffers + node.gather_scratch)} of gather buffers"
                   if node.gather_buffers else "")
                + (f" + {human_bytes(node.shared_staging)} of BF16 staging tiles the node's ranks share"
                   if node.shared_staging else "")
                + f" = {human_bytes(node.total)} of the node's {human_bytes(hw.host_memory_bytes)}")
        if mode == "replicate":
            reason = f"replicate: a full copy on each node fits: {need}; no weights cross the network"
        else:
            per_gather = max((cost.weight_gather_bytes(sol.graph.layers[op.layer], plan) for op in gathers), default=0)
            why = (f"replicating does not fit ({failures[0].removeprefix('replicate: ')})" if failures
                   else "asked for (host_state='shard')")
            reason = (f"shard: {why}; 1/{nodes} of "
                      f"the state per node fits: {need}, for "
                      f"{network_s:.4g} s of weight all-gathers over the network per step ({len(gathers)} gathers, "
                      f"up to {human_bytes(per_gather)} each, at {hw.network_bytes_per_s / 1e9:g} GB/s per node)")
        choice = HostStateChoice(mode, nodes, node.total, hw.host_memory_bytes, network_s, reason)
        solution = dataclasses.replace(sol, plan=plan, schedule=schedule, timeline=timeline, memory=mem)
        return TopologySolution(solution, node, choice, hw)
    raise PlanError(f"no plan fits {gpus_per_node} GPUs per node x {nodes} nodes of {hw.name}: "
                    + "; ".join(failures) + ". Fix: more nodes (sharding holds 1/nodes of the state each), "
                    "nodes with more host memory, or an NVMe tier on one GPU (megatrain plan --nvme)")


__all__ = ["Link", "INTERCONNECTS", "NETWORKS", "with_topology", "HostStateChoice", "TopologySolution",
           "data_parallel_plan", "solve_topology"]
