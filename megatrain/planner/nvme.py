"""The NVMe tier in the planner: NVMe array presets, attaching one to a hardware spec, choosing
per layer what state lives on NVMe, and the step time with its traffic.

What may live on NVMe, per layer (ZeRO-Infinity's "infinity offload", Rajbhandari et al. 2021,
arXiv:2104.07857, offloads the same three to NVMe):

- the host gradient tile that a deferred update waits on (``Plan.optimizer`` NEXT_FORWARD, used
  when gradients are clipped by their global norm): written once after the D2H lands, read once
  before the layer's OPT in the next step;
- the optimizer's FP32 moments (``cost.state_bytes_per_param``: AdamW's two, 8 bytes per trainable
  parameter; Lion's one, 4): read before the layer's OPT, written after it;
- the FP32 master weights (4 bytes per parameter), BF16 compute with ``Plan.cast_once`` only, and
  only of a layer whose moments are on NVMe too (one file, one read and one write per step): the
  OPT steps the master in the I/O buffer and the CAST of the new BF16 copy into the layer's own
  staging tile runs from there, before the write; every H2D reads that tile, so nothing else
  needs the master. With FP32 compute the H2D reads the pinned master row itself, and with a
  shared staging ring each copy casts from it, so masters stay in host memory there.

Choice. :func:`place_on_nvme` moves the least it must: while the plan's host bytes (plus the
NVMe I/O buffers) exceed the host memory, it moves one more layer's tile, gradient tiles first,
then moments, then masters, each kind in the order the step updates the layers
(:func:`update_order`). Every kind costs the same NVMe traffic per byte of host memory freed (one
write and one read per step), so the order of kinds only prefers what frees pinned memory
(gradient tiles) and what leaves the H2D path alone (moments before masters). Moments go before
masters, and every trainable layer's moments before any master, so the masters placed are always
a subset of the moments placed (``Plan.nvme_masters`` requires it). A BF16 plan without
``cast_once`` has no masters to move; :func:`place_with_masters` then sets ``cast_once`` (more
pinned memory: a staging tile per layer instead of a ring) if that is what makes the plan fit.
Within a kind the layers updated first go first: their reads can run ahead and their writes drain
while the later layers compute and update from host memory, where a layer updated last would
leave its write trailing the step. (Planner predictions, dense-120b on an H200 + 4xgen5 without
clipping, 2026-11-25: with 768 GiB of host the step is 58.93 s in this order and 62.58 s moving
the largest layers first, lowest index first among equals; with 1 TiB 53.76 s against 57.41 s.)
The I/O buffers are two pools (one tile per placed layer when there are fewer layers), so a read
of the next layer overlaps the OPT of this one: the gradient tiles' pool of :data:`NVME_BUFFERS`
tiles, pinned (a D2H lands there), each the widest placed gradient tile
(``cost.nvme_gradient_buffers``), and the pageable pool of the moments and masters of
``plan.nvme_buffers`` tiles, each the widest placed layer's file (``cost.nvme_buffers``): the
pools the runtime allocates. Gradient tiles move
only where one waits in a tile of its own between steps (NEXT_FORWARD, layer by layer or one
micro-batch, one rank: ``Plan.nvme_gradients``).

Time. Reads and writes share the drives, so the NVMe I/O stream is busy
``read_bytes / nvme_read_bytes_per_s + write_bytes / nvme_write_bytes_per_s`` per step, and the
predicted step is the larger of the simulated step and that busy time: the I/O stream
overlaps compute and PCIe, and a step can run no faster than its busiest stream. Every transfer
is an op of the lowered schedule (``Plan.nvme_moments`` and ``Plan.nvme_masters``: NVME_READ
before the layer's OPT, NVME_WRITE after; ``Plan.nvme_gradients``: NVME_WRITE after the layer's
D2H, NVME_READ before its carried OPT in the next step; on ``Stream.IO``), so the simulator places
them in its DAG, waits included; the busy-time floor stays as a check of the simulation (it counts
the unpadded bytes, the ops whole 4 KiB blocks). ``megatrain plan`` reports both and the step with
all state in RAM.

Solving. :func:`solve_with_nvme` solves as usual; if no plan fits and the spec has an NVMe tier
(:attr:`HardwareSpec.has_nvme`), it solves again with the NVMe capacity added to the host memory
(the pinned cap unchanged, so pinned buffers stay within the real cap), then places state on NVMe
until the real host memory holds the rest. The placement is searched with the read-ahead
(``Plan.nvme_buffers``, the moments' buffers): the lowering issues the first ``K`` reads at the
start of the step, so with updates during the backward (where the I/O stream would idle through
the forward) more buffers let the NVMe work through the forward too, at ``K`` times the widest
NVMe layer's moments of host memory, which may move more state to NVMe. Each count of
:data:`NVME_BUFFER_CHOICES` is placed, lowered and simulated; the fastest that fits wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from megatrain.errors import ConfigError, PlanError
from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph
# The NVMe array presets are hardware presets, with the others in ir/hardware.py; re-exported here.
from megatrain.ir.hardware import NVME_ARRAYS, PINNED_FRACTION, HardwareSpec, NvmeArray
from megatrain.ir.plan import OptimizerPlacement, Plan
# The placement is below the solver (the solver reports least_host); re-exported here, its documented home.
from megatrain.planner.nvme_place import (KINDS, NVME_BUFFERS, NvmePlacement, least_host, masters_movable,
                                          place_on_nvme, place_with_masters, update_order)
from megatrain.units import GiB, TiB, human_bytes



_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": GiB, "tib": TiB}


def parse_bytes(text: str) -> int:
    """``"512GiB"``, ``"1.5TiB"``, ``"512 GB"`` (decimal), ``"1000000"`` (bytes) -> bytes.

    Raises:
        ConfigError: not a size; the message shows the accepted forms.
    """
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"{text!r} is not a size; write a number and a unit, e.g. 512GiB, 1.5TiB or 768GB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])


def with_nvme(hw: HardwareSpec, nvme: str | NvmeArray | None = None,
              host_memory_bytes: int | None = None) -> HardwareSpec:
    """``hw`` with an NVMe array attached (a name of :data:`NVME_ARRAYS` or an :class:`NvmeArray`)
    and/or its host memory replaced (the pinned cap becomes ``PINNED_FRACTION`` of it, or stays
    if smaller). The name records both.

    Raises:
        ConfigError: unknown array name, or a host memory of 0.
    """
    update: dict = {}
    name = hw.name
    if host_memory_bytes is not None:
        if host_memory_bytes <= 0:
            raise ConfigError(f"host memory {host_memory_bytes} bytes: give a positive size, e.g. 512GiB")
        update["host_memory_bytes"] = host_memory_bytes
        update["pinned_memory_cap_bytes"] = min(hw.pinned_memory_cap_bytes, int(host_memory_bytes * PINNED_FRACTION))
        name += f" + {human_bytes(host_memory_bytes)} host"
    if nvme is not None:
        if isinstance(nvme, str):
            try:
                nvme = NVME_ARRAYS[nvme.strip().lower()]
            except KeyError:
                raise ConfigError(f"no NVMe array preset named {nvme!r}; valid names are {sorted(NVME_ARRAYS)}, "
                                  "or set nvme_capacity_bytes / nvme_read_bytes_per_s / nvme_write_bytes_per_s "
                                  "in a hardware JSON file") from None
        update.update(nvme_capacity_bytes=nvme.capacity_bytes, nvme_read_bytes_per_s=nvme.read_bytes_per_s,
                      nvme_write_bytes_per_s=nvme.write_bytes_per_s)
        name += f" + {nvme.name}"
    update["name"] = name
    return HardwareSpec.model_validate({**hw.model_dump(), **update})


@dataclass(frozen=True, slots=True)
class NvmeSolution:
    """A solved plan (:class:`megatrain.planner.solve.Solution`) with its NVMe placement on ``hardware``.

    ``plan`` is the solver's plan with ``nvme_moments``, ``nvme_gradients`` and ``nvme_masters``
    set to the placement's layers, ``nvme_buffers`` to the read-ahead chosen (and ``cast_once``
    where masters needed it: ``cast_once_set``), and ``schedule``/``timeline`` its lowering
    (NVME_READ/NVME_WRITE ops on the I/O stream, the CASTs of masters from their I/O buffers) and
    simulation on ``hardware`` (the solver's own when nothing went to NVMe). ``memory`` is the
    breakdown of that plan with nothing on NVMe (the solver's, unless ``cast_once`` was set), which
    the placement's host figures start from. ``step_time_s`` is the larger of that simulated step
    and the NVMe I/O stream's busy time (module docstring, "Time"); ``simulated_step_s`` is the
    solver's simulated step with all state in host memory; ``searched`` the
    ``(Plan.nvme_buffers, step_time_s, why not)`` of each read-ahead tried (the step is None where
    the count did not fit)."""

    solution: object
    placement: NvmePlacement
    hardware: HardwareSpec
    plan: Plan
    schedule: object
    timeline: object
    memory: cost.MemoryBreakdown
    cast_once_set: bool = False
    searched: tuple[tuple[int, float | None, str], ...] = ()

    @property
    def simulated_step_s(self) -> float:
        return self.solution.timeline.step_time_s

    @property
    def step_time_s(self) -> float:
        return max(self.timeline.step_time_s, self.placement.io_time_s)

    @property
    def host_total(self) -> int:
        return self.placement.host_total(self.memory)

    @property
    def fits(self) -> bool:
        mem = self.memory
        return (mem.gpu_peak <= self.hardware.gpu_memory_bytes
                and self.host_total <= self.hardware.host_memory_bytes
                and self.placement.host_pinned(mem) <= self.hardware.pinned_memory_cap_bytes
                and self.placement.nvme_bytes <= self.hardware.nvme_capacity_bytes)


NVME_BUFFER_CHOICES = (1, 2, 3, 4, 6, 8)
"""The counts of host I/O buffers (``Plan.nvme_buffers``, the NVMe reads' read-ahead) that
:func:`solve_with_nvme` tries."""


def solve_with_nvme(request, method: str = "milp") -> NvmeSolution:
    """Solve ``request`` (a :class:`~megatrain.planner.solve.SolveRequest`); when no plan fits the
    host memory and the spec has an NVMe tier, solve with the NVMe capacity counted as host memory,
    then search the NVMe read-ahead: for each count of host I/O buffers in
    :data:`NVME_BUFFER_CHOICES` place state on NVMe (:func:`place_on_nvme`, the buffers counted in
    the host memory, so more read-ahead may move more state), lower and simulate, and keep the
    fastest placement that fits (module docstring, "Solving"); where that moves masters too, the
    same for the best plan of each other micro-batch size, keeping the fastest end to end. ``NvmeSolution.searched`` lists what
    each count gave for the plan kept.

    Raises:
        PlanError: no plan fits even with the NVMe tier (InfeasibleRequestError from the solver,
            or :func:`place_on_nvme`'s error for the fewest buffers).
    """
    from dataclasses import replace

    from megatrain.planner.solve import InfeasibleRequestError, solve

    hw = request.hardware
    try:
        sol = solve(request, method)
        return NvmeSolution(sol, NvmePlacement(), hw, sol.plan, sol.schedule, sol.timeline, sol.memory)
    except InfeasibleRequestError:
        if not hw.has_nvme:
            raise
    relaxed = HardwareSpec.model_validate({**hw.model_dump(),
                                           "host_memory_bytes": hw.host_memory_bytes + hw.nvme_capacity_bytes})
    sol = solve(replace(request, hardware=relaxed), method)
    best = _placed(sol, hw)
    if not best.placement.masters:
        return best
    # The relaxed solve counts the NVMe capacity as host memory, so its knobs may hold pinned
    # buffers (a larger micro-batch's offloaded checkpoints, a staging tile per layer) that leave
    # the masters no room in RAM: the best plan of each other micro-batch size, placed the same way,
    # may be faster end to end (dense-120b on an H200 + 512 GiB + 4xgen5: 8 x 1 puts 53 layers'
    # masters on NVMe for 82.9 s a step, 2 x 4 only the moments for 67.4 s; 2026-11-28).
    for size in request.micro_batch_sizes():
        if size == sol.micro_batch_size:
            continue
        try:
            other = solve(replace(request, hardware=relaxed,
                                  limits=replace(request.limits, micro_batch_sizes=(size,))), method)
            found = _placed(other, hw)
        except PlanError:  # InfeasibleRequestError included: this size does not fit even so
            continue
        if found.step_time_s < best.step_time_s:
            best = found
    return best


def _placed(sol, hw: HardwareSpec) -> NvmeSolution:
    """``sol`` (solved with the NVMe capacity counted as host memory) with its state placed on NVMe
    for the fastest NVMe read-ahead (:data:`NVME_BUFFER_CHOICES`), ``searched`` listing each count's.

    Raises:
        PlanError: even the fewest buffers do not fit.
    """
    from dataclasses import replace

    from megatrain.planner.lower import lower
    from megatrain.planner.simulate import simulate, step_time_s

    best: tuple | None = None  # (step_time_s, placement, plan, schedule, memory, base): the fastest so far
    searched: list[tuple[int, float | None, str]] = []
    for count in NVME_BUFFER_CHOICES:
        try:
            base, memory, placement = place_with_masters(sol.graph, replace(sol.plan, nvme_buffers=count),
                                                         sol.memory, hw)
        except PlanError:
            if count == NVME_BUFFER_CHOICES[0]:
                raise  # even the fewest buffers do not fit: no count will
            searched.append((count, None, "does not fit"))
            continue
        plan = replace(base, nvme_moments=placement.moments, nvme_gradients=placement.gradients,
                       nvme_masters=placement.masters)
        schedule = lower(sol.graph, plan, carries_updates=plan.optimizer is OptimizerPlacement.NEXT_FORWARD)
        # Every NVMe transfer (and each master's CAST from its I/O buffer) is an op of the schedule;
        # the step as NvmeSolution.step_time_s counts it.
        step = max(step_time_s(schedule, sol.graph, hw), placement.io_time_s)
        searched.append((count, step, ""))
        if best is None or step < best[0]:
            best = (step, placement, plan, schedule, memory, base)
        if count >= len(placement.moments):
            break  # one buffer per NVMe layer already: more would be the same schedule
    _, placement, plan, schedule, memory, base = best
    return NvmeSolution(sol, placement, hw, plan, schedule, simulate(schedule, sol.graph, hw), memory,
                        cast_once_set=base.cast_once and not sol.plan.cast_once, searched=tuple(searched))


def describe(ns: NvmeSolution) -> list[tuple[str, str, str]]:
    """Rows ``(what, value, note)`` for ``megatrain plan``'s NVMe section."""
    p, hw = ns.placement, ns.hardware
    n = len(ns.solution.graph.layers)
    ahead = [("NVMe read-ahead", f"{ns.plan.nvme_buffers} buffers",
              "host I/O buffers of the moments, chosen by step time: "
              + ", ".join(f"{k}: {why or f'{t:,.4g} s'}" for k, t, why in ns.searched))] if p.moments else []
    return ahead + [
        ("NVMe tier", human_bytes(hw.nvme_capacity_bytes),
         f"read {hw.nvme_read_bytes_per_s / 1e9:.1f} GB/s, write {hw.nvme_write_bytes_per_s / 1e9:.1f} GB/s"),
        ("gradient tiles on NVMe", f"{len(p.gradients)}/{n}", "deferred (clipped) updates' tiles"),
        ("Adam moments on NVMe", f"{len(p.moments)}/{n}", "layers"),
        ("FP32 masters on NVMe", f"{len(p.masters)}/{n}",
         "layers; cast_once set: each keeps its own BF16 staging tile, which H2D reads" if ns.cast_once_set
         else "layers"),
        ("bytes on NVMe", human_bytes(p.nvme_bytes), f"host freed {human_bytes(p.host_freed)}, I/O buffers "
                                                     f"{human_bytes(p.buffer_bytes)}"),
        ("host total", human_bytes(ns.host_total), f"of {human_bytes(hw.host_memory_bytes)}"),
        ("NVMe traffic", f"{(p.read_bytes + p.write_bytes) / 1e9:,.1f} GB", "per step, read + write"),
        ("NVMe I/O busy", f"{p.io_time_s:,.4g} s", "per step"),
        ("step time", f"{ns.step_time_s:,.4g} s", f"simulated with the NVMe ops "
                                                  f"{ns.timeline.step_time_s:,.4g} s; all NVMe traffic "
                                                  f"{p.io_time_s:,.4g} s; all state in RAM {ns.simulated_step_s:,.4g} s"),
        ("slowdown", f"{ns.step_time_s / ns.simulated_step_s:.2f}x", "vs the same plan with all state in host memory"),
    ]


class NvmeLayers(NamedTuple):
    """What a run with an NVMe directory (``megatrain train --nvme-dir``) puts on NVMe: the layers
    whose Adam moments, deferred gradient tiles and FP32 masters live there, and whether the plan
    computes with ``cast_once`` (set where masters needed it)."""

    moments: frozenset[int]
    gradients: frozenset[int]
    masters: frozenset[int] = frozenset()
    cast_once: bool = False

    def describe(self, graph: LayerGraph, nvme_dir, cast_once_set: bool = False) -> str:
        """One line: what went to ``nvme_dir`` and what stays in host memory."""
        layers = graph.layers
        moved = sum(8 * layers[i].trainable_numel for i in self.moments)
        trainable = sum(1 for lay in layers if lay.trainable_numel)
        return (f"NVMe: Adam moments of {len(self.moments)} of {trainable} trainable "
                f"layers in {nvme_dir} ({human_bytes(moved)})"
                + (f": {', '.join(layers[i].name for i in sorted(self.moments))}" if self.moments else "")
                + (f"; deferred gradient tiles of {len(self.gradients)} of {trainable} layers: "
                   f"{', '.join(layers[i].name for i in sorted(self.gradients))}" if self.gradients else "")
                + (f"; FP32 masters of {len(self.masters)} of {trainable} layers: "
                   f"{', '.join(layers[i].name for i in sorted(self.masters))}" if self.masters else "")
                + ("; cast_once set (masters on NVMe need each layer's own BF16 staging tile)"
                   if cast_once_set else "")
                + "; the rest of the state in host memory")


def place_in_directory(graph: LayerGraph, plan: Plan, memory: cost.MemoryBreakdown, host_memory: int | str | None,
                       nvme_dir, hw: HardwareSpec | None = None, reserved: int = 0) -> NvmeLayers:
    """The layers whose Adam moments, deferred gradient tiles and masters a run with the NVMe
    directory ``nvme_dir`` puts there, for ``plan`` (whose breakdown is ``memory``). Without
    ``host_memory``: every trainable layer's moments, nothing else. With it (bytes, or a size:
    :func:`parse_bytes`), those :func:`place_with_masters` moves so that the plan's host bytes fit
    it (none when they fit already): with clipped gradients (the optimizer in the next forward)
    the layers' gradient tiles first, then moments, then (BF16 compute on one rank, ``cast_once``
    set if needed) masters, each largest first. The placement's NVMe tier is ``nvme_dir``'s file
    system (its free space); its rates do not enter the choice. ``reserved``: host bytes the run
    holds beside the plan's (its data, a checkpoint file being read, a model built on the CPU:
    ``megatrain.train.loop.host_beside_plan``), which ``host_memory`` must hold too.

    Raises:
        ConfigError: ``host_memory`` is not a size.
        PlanError: even with every layer's moments on NVMe the plan does not fit ``host_memory``
            (less ``reserved``: the message gives the least ``host_memory`` that fits), or the file
            system has too little free space (the message says what to change).
    """
    import dataclasses
    import shutil

    if host_memory is None:
        return NvmeLayers(frozenset(i for i, layer in enumerate(graph.layers) if layer.trainable_numel), frozenset(),
                          cast_once=plan.cast_once)
    budget = host_memory if isinstance(host_memory, int) else parse_bytes(host_memory)
    if reserved:
        bare = dataclasses.replace(plan, nvme_moments=frozenset(), nvme_gradients=frozenset(), nvme_masters=frozenset())
        least = least_host(graph, bare, memory, hw)[0]
        if least + reserved > budget:
            raise PlanError(f"host_memory {human_bytes(budget)} is too small: with all it can move on NVMe the plan "
                            f"still needs {human_bytes(least)} of host memory, and the run holds "
                            f"{human_bytes(reserved)} beside it (its data, a checkpoint file being read, a model "
                            f"built on the CPU); give host_memory of at least {human_bytes(least + reserved)} "
                            f"(--host-memory {-(-(least + reserved) // 2**20)}MiB)")
        budget -= reserved
    # The choice reads the host memory, its pinned cap and the NVMe capacity; the rates only time
    # the traffic, which no one reads here, so the hardware's are kept if it has them, else 1 B/s.
    base = {} if hw is None else hw.model_dump()
    spec = HardwareSpec.model_validate({
        "name": f"host memory {human_bytes(budget)} + NVMe {nvme_dir}", "gpu_memory_bytes": 0, "bf16_flops": 0,
        "fp32_flops": 0, "h2d_bytes_per_s": 0, "d2h_bytes_per_s": 0, "duplex": False,
        "host_optimizer_params_per_s": 1.0, **base, "host_memory_bytes": budget,
        "pinned_memory_cap_bytes": min(budget, base.get("pinned_memory_cap_bytes", budget)),
        "nvme_capacity_bytes": shutil.disk_usage(nvme_dir).free,
        "nvme_read_bytes_per_s": base.get("nvme_read_bytes_per_s") or 1.0,
        "nvme_write_bytes_per_s": base.get("nvme_write_bytes_per_s") or 1.0})
    bare = dataclasses.replace(plan, nvme_moments=frozenset(), nvme_gradients=frozenset(), nvme_masters=frozenset())
    placed_plan, _, placed = place_with_masters(graph, bare, memory, spec)
    return NvmeLayers(placed.moments, placed.gradients, placed.masters, placed_plan.cast_once)
