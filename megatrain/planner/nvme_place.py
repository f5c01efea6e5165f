"""Placing state on the NVMe tier, below the solver: which layers' gradient tiles, moments and
masters move to NVMe so that a plan fits host memory (:func:`place_on_nvme`, "Choice" in
:mod:`megatrain.planner.nvme`'s docstring) and the least host memory any NVMe tier leaves a plan
(:func:`least_host`, which the solver's requirements report). Solving with an NVMe tier
(:func:`megatrain.planner.nvme.solve_with_nvme`) calls the solver and sits above it; this module
imports nothing of the solver, so the solver may use it. :mod:`megatrain.planner.nvme` re-exports
every name here."""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.errors import PlanError
from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph
from megatrain.ir.hardware import HardwareSpec
from megatrain.ir.plan import OptimizerPlacement, Plan
from megatrain.ir.schedule import OpKind
from megatrain.units import human_bytes

NVME_BUFFERS = cost.NVME_BUFFERS
"""Host I/O buffers per NVMe stream: one being read or written while the OPT uses the other
(defined in the cost model, which sizes them: ``cost.nvme_buffers``)."""


@dataclass(frozen=True, slots=True)
class NvmePlacement:
    """Which layers' state lives on NVMe, and what it costs.

    Attributes:
        gradients, moments, masters: layer indices whose deferred gradient tile / Adam moments /
            FP32 masters live on NVMe.
        nvme_bytes: bytes on NVMe (each tile rounded up to 4096 bytes, the O_DIRECT alignment); under
            data parallel, on one node's drives (every copy of the state its ranks hold).
        host_freed: host bytes the plan no longer holds (of which ``pinned_freed`` were pinned).
        buffer_bytes: host I/O buffers added (of which ``pinned_buffer_bytes`` pinned).
        read_bytes, write_bytes: NVMe traffic of one step (of one node's drives).
        io_time_s: seconds the NVMe I/O stream is busy per step.
    """

    gradients: frozenset[int] = frozenset()
    moments: frozenset[int] = frozenset()
    masters: frozenset[int] = frozenset()
    nvme_bytes: int = 0
    host_freed: int = 0
    pinned_freed: int = 0
    buffer_bytes: int = 0
    pinned_buffer_bytes: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    io_time_s: float = 0.0

    @property
    def empty(self) -> bool:
        return not (self.gradients or self.moments or self.masters)

    def host_total(self, memory: cost.MemoryBreakdown) -> int:
        """Host bytes of the plan with this placement."""
        return memory.host_total - self.host_freed + self.buffer_bytes

    def host_pinned(self, memory: cost.MemoryBreakdown) -> int:
        return memory.host_pinned - self.pinned_freed + self.pinned_buffer_bytes


def _align(n: int) -> int:
    return -(-n // 4096) * 4096


def update_order(graph: LayerGraph, plan: Plan) -> list[int]:
    """The layers of ``graph`` in the order ``plan``'s train step updates them (the position of
    each layer's first OPT in its lowered schedule, with the carried updates of a deferred plan),
    layers without an OPT last: the order :func:`place_on_nvme` moves each kind in."""
    from megatrain.planner.lower import lower

    schedule = lower(graph, plan, carries_updates=plan.optimizer is OptimizerPlacement.NEXT_FORWARD)
    first: dict[int, int] = {}
    for k, op in enumerate(schedule.ops):
        if op.kind is OpKind.OPT:
            first.setdefault(op.layer, k)
    return sorted(range(len(graph.layers)), key=lambda i: first.get(i, len(schedule.ops)))


KINDS = ("gradients", "moments", "masters")
"""What :func:`place_on_nvme` may move, in the order it moves them."""


def place_on_nvme(graph: LayerGraph, plan: Plan, memory: cost.MemoryBreakdown, hw: HardwareSpec,
                  kinds: tuple[str, ...] = KINDS) -> NvmePlacement:
    """The least state to move to NVMe so that ``memory`` (the plan's breakdown) plus the I/O
    buffers fits ``hw.host_memory_bytes`` and the pinned cap (module docstring, "Choice").
    ``memory`` is the breakdown of ``plan`` with nothing on NVMe (``plan.nvme_moments``,
    ``nvme_gradients`` and ``nvme_masters`` empty), so that :meth:`NvmePlacement.host_total` equals
    ``cost.memory_breakdown`` of the placed plan. ``kinds``: which of :data:`KINDS` may move.
    Masters move only where the plan computes in BF16 with ``cast_once`` on one rank, and only of
    trainable layers (their moments move first: ``Plan.nvme_masters`` is within ``nvme_moments``).

    Raises:
        PlanError: even with every movable tile on NVMe the host memory is short, or the NVMe
            tier has less capacity than the tiles need (the message gives the bytes and the fix).
    """
    if memory.host_total <= hw.host_memory_bytes and memory.host_pinned <= hw.pinned_memory_cap_bytes:
        return NvmePlacement()
    if not hw.has_nvme:
        raise PlanError(f"{hw.name}: the plan needs {human_bytes(memory.host_total)} of host memory, "
                        f"{human_bytes(hw.host_memory_bytes)} is there and no NVMe tier is attached; attach one "
                        "(megatrain plan --nvme 4xgen5, or nvme_* fields in the hardware spec)")
    layers = graph.layers
    moves = _moves(graph, plan, kinds, update_order(graph, plan))
    chosen: dict[str, set[int]] = {"gradients": set(), "moments": set(), "masters": set()}
    per_layer: dict[int, list[int]] = {}  # layer -> [moments and masters bytes, gradient bytes] on NVMe
    freed = pinned_freed = 0

    def fits() -> bool:
        buf, pbuf = _buffers(plan, per_layer)
        return (memory.host_total - freed + buf <= hw.host_memory_bytes
                and memory.host_pinned - pinned_freed + pbuf <= hw.pinned_memory_cap_bytes)

    for kind, i, nbytes, pinned in moves:
        if fits():
            break
        chosen[kind].add(i)
        _buffered(per_layer, layers[i], plan, kind, nbytes, pinned)
        freed += nbytes
        pinned_freed += nbytes if pinned else 0
    buf, pbuf = _buffers(plan, per_layer)
    if not fits():
        moved = sorted({kind for kind, *_ in moves}, key=KINDS.index)
        what = ", ".join({"gradients": "gradient tile", "moments": "Adam moment", "masters": "master"}[k]
                         for k in moved) or "nothing movable"
        hint = ("" if masters_movable(plan) or "masters" not in kinds
                else " or compute in bfloat16 (FP32 compute keeps masters in pinned host memory)"
                if plan.compute_dtype != "bfloat16" else
                " or set cast_once (masters go to NVMe only when each layer keeps its own BF16 staging tile)"
                if not plan.cast_once else "")
        raise PlanError(f"{hw.name}: with every {what} on NVMe the plan still needs "
                        f"{human_bytes(memory.host_total - freed + buf)} of host memory, and "
                        f"{human_bytes(hw.host_memory_bytes)} is there; add host memory{hint}")
    placed = [n for kind, i, n, _ in moves if i in chosen[kind]]
    # The node's drives hold (and move each step) every copy of the state on the node: one where
    # its ranks share a copy (their files hold its shards), one per rank where each has its own.
    copies = plan.gpus_per_node // plan.optimizer_shards
    on_disk = copies * sum(_align(n) for n in placed)
    if on_disk > hw.nvme_capacity_bytes:
        raise PlanError(f"{hw.name}: the NVMe tier needs {human_bytes(on_disk)} and has "
                        f"{human_bytes(hw.nvme_capacity_bytes)}; attach a larger array (e.g. --nvme 8xgen5) or "
                        "more host memory")
    # One write and one read of every placed tile per step.
    traffic = copies * sum(placed)
    io = traffic / hw.nvme_read_bytes_per_s + traffic / hw.nvme_write_bytes_per_s
    return NvmePlacement(frozenset(chosen["gradients"]), frozenset(chosen["moments"]), frozenset(chosen["masters"]),
                         nvme_bytes=on_disk, host_freed=freed, pinned_freed=pinned_freed, buffer_bytes=buf,
                         pinned_buffer_bytes=pbuf, read_bytes=traffic, write_bytes=traffic, io_time_s=io)


def _moves(graph: LayerGraph, plan: Plan, kinds: tuple[str, ...], order: list[int]) -> list[tuple[str, int, int, bool]]:
    """What :func:`place_on_nvme` may move, in the order it moves it: ``(kind, layer, host bytes
    freed, whether they were pinned)``, each kind's layers in ``order``."""
    layers = graph.layers
    # Only a tile of its own that waits for the next step can live on NVMe (Plan.nvme_gradients).
    deferred = (plan.optimizer is OptimizerPlacement.NEXT_FORWARD and not plan.accumulates_on_host
                and plan.data_parallel == 1)
    moves: list[tuple[str, int, int, bool]] = []
    if deferred and "gradients" in kinds:
        moves += [("gradients", i, cost.page_up(layers[i].trainable_numel * plan.gradient_itemsize), True)
                  for i in order if layers[i].trainable_numel]
    if "moments" in kinds:
        moves += [("moments", i, layers[i].trainable_numel * cost.state_bytes_per_param(plan), False)
                  for i in order if layers[i].trainable_numel]
    if masters_movable(plan) and "masters" in kinds and "moments" in kinds:
        moves += [("masters", i, layers[i].numel * cost.MASTER_BYTES_PER_ELEMENT, False)
                  for i in order if layers[i].trainable_numel]
    return moves


def _buffered(per_layer: dict[int, list[int]], layer, plan: Plan, kind: str, nbytes: int, pinned: bool) -> None:
    """Add a moved tile to its layer's ``[moments and masters bytes, gradient bytes]`` on NVMe. A
    rank's I/O buffer holds what its file holds: under data parallel its optimizer shard of the
    moments (cost.nvme_bytes); masters and gradient tiles move on one rank only."""
    entry = per_layer.setdefault(layer.index, [0, 0])
    entry[1 if pinned else 0] += (cost.optimizer_numel(layer, plan) * cost.state_bytes_per_param(plan)
                                  if kind == "moments" else nbytes)


def _buffers(plan: Plan, per_layer: dict[int, list[int]]) -> tuple[int, int]:
    """(all, pinned) bytes of the two I/O buffer pools for the layers of ``per_layer``, as
    cost.nvme_buffers (plan.nvme_buffers of them) and cost.nvme_gradient_buffers."""
    pools = []
    for k, count in ((0, plan.nvme_buffers), (1, NVME_BUFFERS)):
        sizes = [_align(entry[k]) for entry in per_layer.values() if entry[k]]
        pools.append(min(count, len(sizes)) * max(sizes, default=0))  # one per layer when fewer
    return pools[0] + pools[1], pools[1]


def least_host(graph: LayerGraph, plan: Plan, memory: cost.MemoryBreakdown,
               hw: HardwareSpec | None = None) -> tuple[int, int]:
    """``(host bytes, of which pinned)`` that ``plan`` (whose breakdown with nothing on NVMe is
    ``memory``) still needs with everything :func:`place_on_nvme` may move on NVMe: the least
    host memory an NVMe tier of any size leaves it. A BF16 plan on one rank without ``cast_once``
    is also counted with it, as :func:`place_with_masters` would set it (a staging tile per layer,
    more pinned memory, and its masters movable); the one with less host memory is returned."""
    from dataclasses import replace

    candidates = [(plan, memory)]
    if plan.compute_dtype == "bfloat16" and not plan.cast_once and plan.data_parallel == 1:
        once = replace(plan, cast_once=True)
        candidates.append((once, cost.memory_breakdown(graph, once, hw)))
    best = None
    for p, mem in candidates:
        per_layer: dict[int, list[int]] = {}
        freed = pinned_freed = 0
        for kind, i, nbytes, pinned in _moves(graph, p, KINDS, list(range(len(graph.layers)))):
            _buffered(per_layer, graph.layers[i], p, kind, nbytes, pinned)
            freed += nbytes
            pinned_freed += nbytes if pinned else 0
        buf, pbuf = _buffers(p, per_layer)
        found = (mem.host_total - freed + buf, mem.host_pinned - pinned_freed + pbuf)
        best = found if best is None or found < best else best
    return best


def masters_movable(plan: Plan) -> bool:
    """Whether ``plan`` can keep masters on NVMe (``Plan.nvme_masters``): BF16 compute with
    ``cast_once``, one rank."""
    return plan.compute_dtype == "bfloat16" and plan.cast_once and plan.data_parallel == 1


def place_with_masters(graph: LayerGraph, plan: Plan, memory: cost.MemoryBreakdown, hw: HardwareSpec,
                       kinds: tuple[str, ...] = KINDS) -> tuple[Plan, cost.MemoryBreakdown, NvmePlacement]:
    """:func:`place_on_nvme`, and where that fails for a BF16 plan on one rank without
    ``cast_once`` (so without movable masters) and ``kinds`` allows masters, again with
    ``cast_once`` set (``memory`` then recomputed: a staging tile per layer replaces the ring).
    Returns the plan the placement is for (``plan``, or it with ``cast_once``; its NVMe fields still
    empty), its breakdown, and the placement.

    Raises:
        PlanError: :func:`place_on_nvme`'s: of the try with ``cast_once`` where one was made (what is
            short even with masters moved), else of the first.
    """
    from dataclasses import replace

    try:
        return plan, memory, place_on_nvme(graph, plan, memory, hw, kinds)
    except PlanError:
        if ("masters" not in kinds or plan.cast_once or plan.compute_dtype != "bfloat16"
                or plan.data_parallel > 1):
            raise
        once = replace(plan, cast_once=True)
    mem = cost.memory_breakdown(graph, once, hw)
    return once, mem, place_on_nvme(graph, once, mem, hw, kinds)  # its error: what is short even with masters moved
