"""The search behind every strategy: best-first branch and bound over knobs, with the simulator
as the objective (the method, its bounds and its sources: :mod:`megatrain.planner.solve`).

:class:`Search` holds one solve's caches (memory units per size, policy and distance; patterns;
bounds; least depths) and its priority queue; a strategy gives it a knapsack for the resident
layers and calls :meth:`Search.run`. Memory comes from :func:`cost.memory_breakdown` and "fits"
from :meth:`cost.MemoryBreakdown.fits`; op times from :mod:`.bounds`.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

from megatrain.errors import PlanError
from megatrain.planner import cost
from megatrain.planner.lower import lower
from megatrain.planner.nvme_place import least_host
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.ir.schedule import Schedule
from megatrain.planner.simulate import simulate, step_time_s
from megatrain.planner.solve.bounds import (Pattern, SizeOption, lower_pattern, pattern_bound, quick_bound,
                                            size_option, step_times)
from megatrain.planner.solve.families import Family, eligible_layers, families
from megatrain.planner.solve.infeasibility import Requirements, infeasible_error, peak_op_layer
from megatrain.planner.solve.knapsack import Knapsack, greedy_knapsack
from megatrain.planner.solve.request import Solution, SolveRequest
from megatrain.planner.verify import verify

DEFAULT_STAGING_RING = 2
"""BF16 staging tiles: one being read by the H2D in flight, one being filled for the next copy."""

CAST_ONCE = 0
"""The search's staging count for ``Plan.cast_once`` (a tile per layer, each layer cast once per step)."""

KEEP, OFFLOAD = ActivationPolicy.KEEP, ActivationPolicy.OFFLOAD


@dataclass(frozen=True, slots=True)
class Knobs:
    """The knobs of one candidate besides the micro-batch size."""

    slots: int
    prefetch_distance: int
    grad_ring: int
    staging_ring: int
    resident: frozenset[int] = frozenset()
    activations: tuple[ActivationPolicy, ...] = ()


def placement(request: SolveRequest) -> OptimizerPlacement:
    """Where the request's optimizer steps go: the next forward when gradients are clipped by their
    global norm (every gradient is needed before any update), else during the backward."""
    return OptimizerPlacement.NEXT_FORWARD if request.clip_gradients else OptimizerPlacement.DURING_BACKWARD


def plan_for(request: SolveRequest, micro_batch_size: int, k: Knobs, layer_by_layer: bool = True) -> Plan:
    """The Plan of knobs ``k`` at ``micro_batch_size`` for ``request`` (``k.staging_ring ==
    CAST_ONCE`` is ``Plan.cast_once``)."""
    return Plan(micro_batches=request.global_batch // micro_batch_size, slots=k.slots,
                prefetch_distance=k.prefetch_distance, grad_ring=k.grad_ring, resident=k.resident,
                activations=k.activations, layer_by_layer=layer_by_layer, optimizer=placement(request),
                compute_dtype=request.compute_dtype, staging_ring=max(k.staging_ring, 1),
                cast_once=k.staging_ring == CAST_ONCE, optimizer_name=request.optimizer_name,
                d2h_dtype=request.d2h_dtype)


def scaled_memory(unit: cost.MemoryBreakdown, weight_slots: int, gradient_ring: int,
                  staging_ring: int) -> cost.MemoryBreakdown:
    """``unit`` (one weight slot, one ring tile, one staging tile) with the slot and staging counts
    of a candidate and its gradient tiles' bytes (``gradient_ring``, from
    :func:`cost.gradient_ring_bytes`: the tiles are sized per layer, so not count x unit).

    The cost model defines the slot and staging terms as count x per-unit bytes (``cost.memory_breakdown``),
    and the reserve's rounding as a fixed number of tensors per slot (``cost.GpuReserve``).
    The activation terms (GPU peaks, pinned offload space) are those of the unit's own activation
    policy and micro-batch size: they depend on the order of compute ops and reloads, which the
    policy and the prefetch distance set and no count here changes.
    """
    return with_reserve(replace(unit, weight_slots=unit.weight_slots * weight_slots,
                                gradient_slots=unit.gradient_slots * weight_slots,
                                gradient_ring=gradient_ring, staging_ring=unit.staging_ring * staging_ring),
                        weight_slots - 1)


def with_reserve(m: cost.MemoryBreakdown, extra_slots: int) -> cost.MemoryBreakdown:
    """``m`` with ``extra_slots`` more weight slots in its GPU reserve (the allocator rounds each
    slot's tensors: ``cost.GpuReserve.with_slots``)."""
    if m.reserve_parts is None or not extra_slots:
        return m
    parts = m.reserve_parts.with_slots(extra_slots)
    return replace(m, reserve=parts.total, reserve_parts=parts)


@dataclass(frozen=True, slots=True)
class _Candidate:
    """Knobs whose residents the knapsack has yet to choose (``resident is None``) or chosen."""

    option: SizeOption
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

    option: SizeOption
    family: Family | None = None
    distance: int = 0
    slots: tuple[int, ...] = ()


# Queue levels: among equal bounds the most refined item goes first, so that a simulation can end
# the search before more candidates are lowered or more depths searched.
_SIMULATE, _REFINE, _EXPAND = 0, 1, 2


class Search:
    """One solve: caches of memory units, patterns and bounds, and the best-first queue."""

    def __init__(self, request: SolveRequest, knapsack: Knapsack):
        self.request, self.knapsack = request, knapsack
        self.hw, self.limits = request.hardware, request.limits
        g = request.graph
        self.n = len(g.layers)
        self.eligible = eligible_layers(g)
        self.families = families(len(self.eligible))
        self.deferred = request.clip_gradients
        self.ring = max(1, sum(1 for layer in g.layers if layer.trainable_numel > 0))  # NEXT_FORWARD tiles
        self.bf16 = request.compute_dtype == "bfloat16"
        self.times = step_times(g, request.compute_dtype, self.hw)
        self.options: dict[int, SizeOption] = {}
        self.units: dict[tuple, tuple[Schedule, cost.MemoryBreakdown]] = {}
        self.rings: dict[tuple, int] = {}
        self.patterns: dict[Knobs, Pattern] = {}
        self.quick: dict[tuple, float] = {}
        self.depths: dict[tuple, int | None] = {}
        self.removed: dict[tuple, list[int]] = {}
        self.residents: dict[tuple, frozenset[int]] = {}
        self.queue: list = []
        self.seq = 0
        self.candidates = 0
        self.seen: set = set()

    # -- per size ----------------------------------------------------------------------------------
    def option(self, size: int, layer_by_layer: bool = True) -> SizeOption:
        key = (size, layer_by_layer)
        if key not in self.options:
            r = self.request
            if layer_by_layer:
                self.options[key] = size_option(size, r.global_batch // size, r.graph_for(size), r.compute_dtype,
                                                 self.hw)
            else:  # the same graph and times, another pass structure
                self.options[key] = replace(self.option(size), layer_by_layer=False)
        return self.options[key]

    def unit(self, opt: SizeOption, policy: tuple[ActivationPolicy, ...],
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
                        layer_by_layer=opt.layer_by_layer, optimizer_name=self.request.optimizer_name,
                        d2h_dtype=self.request.d2h_dtype)
            sched = lower(opt.graph, plan)
            m = cost.memory_breakdown(opt.graph, plan, self.hw, sched)
            self.units[key] = (sched, with_reserve(replace(m, weight_slots=m.weight_slots // slots,
                                                           gradient_slots=m.gradient_slots // slots), 1 - slots))
        return self.units[key]

    def ring_bytes(self, opt: SizeOption, grad_ring: int) -> int:
        """Pinned bytes of ``grad_ring`` host gradient tiles at ``opt`` (:func:`cost.gradient_ring_bytes`)."""
        key = (opt.key, grad_ring)
        if key not in self.rings:
            plan = Plan(micro_batches=opt.micro_batches, grad_ring=grad_ring, layer_by_layer=opt.layer_by_layer,
                        optimizer=placement(self.request), compute_dtype=self.request.compute_dtype,
                        d2h_dtype=self.request.d2h_dtype)
            self.rings[key] = cost.gradient_ring_bytes(opt.graph, plan)
        return self.rings[key]

    def gradient_itemsize(self, opt: SizeOption) -> int:
        """Bytes per gradient element in the slots and host tiles of ``opt``'s plans
        (``Plan.gradient_itemsize``: BF16 where BF16 compute makes it exact)."""
        return Plan(micro_batches=opt.micro_batches, layer_by_layer=opt.layer_by_layer,
                    compute_dtype=self.request.compute_dtype, d2h_dtype=self.request.d2h_dtype).gradient_itemsize

    def cast_once_bytes(self, opt: SizeOption) -> int:
        """Pinned bytes of one staging tile per layer, each at its size (``Plan.cast_once``)."""
        plan = Plan(compute_dtype="bfloat16", cast_once=True)
        return sum(cost.page_up(w * cost.STAGING_ITEMSIZE) for w in cost.staging_tile_numels(opt.graph, plan))

    def scaled(self, opt: SizeOption, unit: cost.MemoryBreakdown, slots: int, grad_ring: int,
               staging_ring: int, resident: frozenset[int] = frozenset()) -> cost.MemoryBreakdown:
        """``unit`` with a candidate's streaming slots, resident layers (a slot each, at its own
        size: :func:`cost.slot_bytes`), gradient tiles and staging tiles."""
        m = scaled_memory(unit, slots, self.ring_bytes(opt, grad_ring), staging_ring)
        if staging_ring == CAST_ONCE:
            m = replace(m, staging_ring=self.cast_once_bytes(opt))
        if not resident:
            return m
        w, g = cost.slot_bytes(opt.graph, slots, resident, 2 if self.bf16 else 4, self.gradient_itemsize(opt))
        return with_reserve(replace(m, weight_slots=w, gradient_slots=g), len(resident))

    def gpu_fits(self, unit: cost.MemoryBreakdown, slots: int, cap: int | None = None) -> bool:
        cap = self.hw.gpu_memory_bytes if cap is None else cap
        return scaled_memory(unit, slots, unit.gradient_ring, 1).gpu_peak <= cap  # GPU terms only

    def host_choices(self, opt: SizeOption, unit: cost.MemoryBreakdown) -> list[tuple[int, int]]:
        """(gradient ring, staging ring) pairs to try: the largest ring with each staging ring,
        the second only if it allows a larger ring (a tile more of either only removes waits)."""
        rings = [self.ring] if self.deferred and opt.layer_by_layer else list(range(self.limits.max_grad_ring, 0, -1))
        out: list[tuple[int, int]] = []
        for staging in (DEFAULT_STAGING_RING, 1):
            for ring in rings:
                if self.scaled(opt, unit, 1, ring, staging).host_fits(self.hw):
                    out.append((ring, staging))
                    break
        if len(out) == 2 and (out[0][0] >= out[1][0] or not self.bf16):
            out = out[:1]
        if self.bf16:  # a staging tile per layer, each layer cast once per step (staging 0: Plan.cast_once)
            for ring in rings:
                if self.scaled(opt, unit, 1, ring, CAST_ONCE).host_fits(self.hw):
                    out.append((ring, CAST_ONCE))
                    break
        return out

    def per_mb_sizes(self, size: int) -> bool:
        """Whether per-micro-batch passes are searched at micro-batch size ``size``."""
        return self.limits.per_micro_batch_passes and self.request.global_batch // size > 1

    def ring_floor(self, opt: SizeOption) -> int:
        """The fewest host gradient tiles: one per trainable layer with NEXT_FORWARD layer by layer
        (the tiles hold the gradients until the next step), else one (accumulators hold them)."""
        return self.ring if self.deferred and opt.layer_by_layer else 1

    def quick_bound(self, opt: SizeOption, policy: tuple[ActivationPolicy, ...]) -> float:
        key = (opt.key, policy)
        if key not in self.quick:
            self.quick[key] = quick_bound(opt, self.times, policy, deferred=self.deferred, bf16=self.bf16,
                                           duplex=self.hw.duplex)
        return self.quick[key]

    # -- depths ------------------------------------------------------------------------------------
    def floor_depth(self, opt: SizeOption, family: Family, slots: int, cap: int | None = None) -> int | None:
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
        room = (self.hw.gpu_memory_bytes if cap is None else cap) - scaled_memory(keep, slots, 0, 1).gpu_fixed
        if work > room:
            return None
        for depth, gone in enumerate(removed):
            if opt.alive * (total - gone) + layers[-1].work_bytes <= room:
                return depth
        return None

    def host_depth(self, opt: SizeOption, family: Family) -> int:
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

    def least_depth(self, opt: SizeOption, family: Family, distance: int, slots: int,
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

    def order(self, opt: SizeOption, policy: tuple, distance: int, ring: int, staging: int, slots: int,
              resident: int = 0) -> tuple:
        # Ties: fewer micro-batches (fewer ops, less latency), layer by layer (fewer copies), fewer
        # checkpoints moved or recomputed, more overlap, larger rings, fewer slots, more residents.
        changed = sum(a is not KEEP for a in policy)
        return (opt.micro_batches, not opt.layer_by_layer, changed, -distance, -ring, -staging, slots, -resident)

    def add_candidate(self, c: _Candidate) -> None:
        _, unit = self.unit(c.option, c.policy, c.distance)
        mem = self.scaled(c.option, unit, c.slots, c.grad_ring, c.staging_ring, c.resident or frozenset())
        if not mem.fits(self.hw):
            return
        key = (c.option.key, c.policy, c.slots, c.distance, c.grad_ring, c.staging_ring, c.resident)
        if key in self.seen:
            return
        self.seen.add(key)
        self.candidates += 1
        self.push(self.quick_bound(c.option, c.policy), _REFINE,
                  self.order(c.option, c.policy, c.distance, c.grad_ring, c.staging_ring, c.slots), c)

    def add_knobs(self, opt: SizeOption, policy: tuple, distance: int, slots: int) -> None:
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

    def knobs(self, c: _Candidate) -> Knobs:
        k = Knobs(c.slots, c.distance, c.grad_ring, c.staging_ring, frozenset(), c.policy)
        if c.resident is not None:
            return replace(k, resident=c.resident)
        _, unit = self.unit(c.option, c.policy, c.distance)
        spare = self.hw.gpu_memory_bytes - self.scaled(c.option, unit, c.slots, c.grad_ring, c.staging_ring).gpu_peak
        # Every resident layer costs one more slot sized for that layer (cost.slot_numels), so its
        # weight is its own weights and gradients, and the reserve's rounding of the two tensors. The
        # streaming slots stay sized for the widest layer here; residents can only narrow them, so
        # the choice is within memory.
        itemsize = 2 if self.bf16 else 4
        rounded = unit.reserve_parts.with_slots(1).total - unit.reserve if unit.reserve_parts is not None else 0
        weights = [layer.numel * itemsize + layer.trainable_numel * self.gradient_itemsize(c.option) + rounded
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

    def pattern(self, k: Knobs) -> Pattern:
        if k not in self.patterns:
            self.patterns[k] = lower_pattern(self.request.graph, plan_for(self.request, self.request.global_batch, k))
        return self.patterns[k]

    # -- run ---------------------------------------------------------------------------------------
    def least_host_on_gpu(self, passes: list[SizeOption], keeps) -> tuple[int, int] | None:
        """``(host, pinned)`` bytes of the plan that fits this GPU with the least host memory, at
        the smallest micro-batch size, one slot and distance 0: every checkpoint kept where that fits,
        else each family at the shallowest depth that fits (offloading no more than it must); None
        where none fits. What a larger host needs on this GPU."""
        gpu = self.hw.gpu_memory_bytes
        found = [(m.host_total, m.host_pinned) for m, _ in keeps if m.gpu_peak <= gpu]
        for opt in passes:
            for family in self.families:
                depth = self.least_depth(opt, family, 0, 1, cap=gpu)
                if depth is not None:
                    _, unit = self.unit(opt, family.policy(self.eligible, self.n, depth), 0)
                    m = self.scaled(opt, unit, 1, self.ring_floor(opt), 1)
                    found += [(m.host_total, m.host_pinned)] if m.gpu_peak <= gpu else []
        return min(found, default=None)

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
                    keeps.append((mem, opt))
        on_gpu = self.least_host_on_gpu(passes, keeps)
        (_, _, _, i), name, opt, sched, mem = min(rows, key=lambda row: row[0])
        if i > 0:  # the shallowest depth of that family with the same peak offloads the least
            family = self.families[i - 1]
            depth = self.least_depth(opt, family, 0, 1, cap=mem.gpu_peak)
            if depth is not None:
                sched, unit = self.unit(opt, family.policy(self.eligible, self.n, depth), 0)
                mem = self.scaled(opt, unit, 1, self.ring_floor(opt), 1)
        # Floors, each the least over the pass structures: per-micro-batch passes hold accumulators
        # (more host memory) but may pin BF16 gradient tiles where layer by layer pins FP32 ones.
        keep, keep_opt = min(keeps, key=lambda k: (k[0].host_total, k[0].host_pinned))
        keep_plan = plan_for(self.request, size, Knobs(slots=1, prefetch_distance=0, grad_ring=self.ring_floor(keep_opt),
                                                       staging_ring=1), keep_opt.layer_by_layer)
        nvme_host, nvme_pinned = least_host(keep_opt.graph, keep_plan, keep, self.hw)
        g = opt.graph
        largest = max(g.layers, key=lambda layer: (layer.numel, -layer.index))
        peak = g.layers[peak_op_layer(sched, g)]
        slot = mem.gpu_fixed > self.hw.gpu_memory_bytes
        return Requirements(gpu_memory_bytes=mem.gpu_peak, host_memory_bytes=mem.host_total,
                            pinned_memory_bytes=mem.host_pinned, host_floor_bytes=keep.host_total,
                            pinned_floor_bytes=min(m.host_pinned for m, _ in keeps), micro_batch_size=size,
                            activations=name, host_on_gpu_bytes=None if on_gpu is None else on_gpu[0],
                            pinned_on_gpu_bytes=None if on_gpu is None else on_gpu[1], nvme_host_bytes=nvme_host,
                            nvme_pinned_bytes=nvme_pinned,
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
        passes = [small] + ([self.option(sizes[-1], False)] if self.per_mb_sizes(sizes[-1]) else [])
        # Each pass structure on its own: per-micro-batch passes may send BF16 gradients where layer
        # by layer sums them in FP32 (Plan.gradient_dtype), so their slots can be the smaller.
        if (not any(self.scaled(o, self.unit(o, (), 0)[1], 1, self.ring_floor(o), 1).host_fits(hw)
                    for o in passes)
                or all(not self.gpu_fits(self.unit(o, (), 0)[1], 1)
                       and all(self.floor_depth(o, f, 1) is None for f in self.families) for o in passes)):
            raise infeasible_error(request, self.requirements())
        self.start(sizes)
        best: tuple[float, SizeOption, Schedule] | None = None
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
                lb = pattern_bound(self.pattern(k), item.option, self.times, hw) \
                    if item.option.layer_by_layer else key
                self.push(max(key, lb), _SIMULATE, self.order(item.option, k.activations, k.prefetch_distance,
                                                              k.grad_ring, k.staging_ring, k.slots,
                                                              len(k.resident)), (item.option, k))
            else:
                opt, k = item
                plan = plan_for(request, opt.size, k, opt.layer_by_layer)
                sched = lower(opt.graph, plan, carries_updates=self.deferred)
                step = step_time_s(sched, opt.graph, hw)
                simulated += 1
                if best is None or step < best[0]:
                    best = (step, opt, sched)
        if best is None:
            raise infeasible_error(request, self.requirements())
        _, opt, sched = best
        tl = simulate(sched, opt.graph, hw)
        plan = sched.plan
        _, unit = self.unit(opt, plan.activations, plan.prefetch_distance)
        staging = CAST_ONCE if plan.cast_once else plan.staging_ring
        predicted = self.scaled(opt, unit, plan.slots, plan.grad_ring, staging, plan.resident)
        mem = cost.memory_breakdown(opt.graph, plan, hw, sched)
        if mem != predicted or not mem.fits(hw):
            raise PlanError(f"internal: the solver predicted {predicted} for {plan} but the cost model gives {mem}; "
                            "cost.memory_breakdown's slot and ring terms are no longer count x per-unit bytes, or "
                            "its activation terms depend on more than the policy and prefetch distance (update "
                            "megatrain.planner.solve.search.scaled_memory)")
        verify(sched, opt.graph, hw)
        return Solution(plan=plan, micro_batch_size=opt.size, graph=opt.graph, schedule=sched, timeline=tl,
                        memory=mem, method=method, candidates=self.candidates, simulated=simulated,
                        bound_s=bound, solve_time_s=time.perf_counter() - t_start)


def minimum_requirements(request: SolveRequest) -> Requirements:
    """The least GPU, host and pinned host memory plans for ``request`` need (see Requirements)."""
    return Search(request, greedy_knapsack).requirements()


__all__ = ["Knobs", "placement", "plan_for", "scaled_memory", "Search", "minimum_requirements",
           "DEFAULT_STAGING_RING", "CAST_ONCE"]
