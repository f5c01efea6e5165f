"""Lower bounds on a candidate's step time, from op durations alone (no simulation).

:func:`quick_bound` needs no lowering: each resource's busy time and a flow-shop path over the
layers, for a micro-batch size and activation policy (any slots, distance, rings, residents).
:func:`pattern_bound` is the longest path through the candidate's schedule lowered for one
micro-batch (:func:`lower_pattern`), each op standing for its micro-batches; the simulator
respects every edge of that path, so it never beats it (:mod:`megatrain.planner.solve`, item 5).

Every op time is :func:`megatrain.planner.cost.op_duration` of its kind (:func:`durations`), and
every op's stream is ``OpKind.stream``: the bounds re-derive neither.

The issuing thread. One thread issues every op, in each stream's list order, from the step's
start (:mod:`megatrain.planner.simulate`), and no op ends before its issue does; a compute op with a
kernel profile ends no earlier than ``span_s`` after its issue began (:class:`cost.ComputeWork`).
So the thread's total launch time is a busy time like a stream's, and an op's end is bounded by
the launches of the ops before it on its stream too. Each launch is taken at its least
(:func:`issue_floors`: no stream waits, no differentiated inputs, a fresh gradient slot), and the
step's first op may start one host-op launch after the thread does (a CAST or carried OPT first:
its worker gets it once it is issued), which the bounds give back (:func:`issue_slack`). With
free launches both terms vanish and the bounds are what they were without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph
from megatrain.ir.hardware import HardwareSpec
from megatrain.planner.lower import lower
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.ir.schedule import COMPUTE_KINDS, HOST_STREAMS, OP_KINDS, Op, OpKind, Stream

OFFLOAD, RECOMPUTE = ActivationPolicy.OFFLOAD, ActivationPolicy.RECOMPUTE

SIZE_KINDS = tuple(kind for kind, spec in OP_KINDS.items() if spec.bounds == "size")
"""Op kinds whose duration grows with the micro-batch size: compute, and checkpoint copies
(``OpKindSpec.bounds``, as the two classes below)."""

STEP_KINDS = tuple(kind for kind, spec in OP_KINDS.items() if spec.bounds == "step")
"""Op kinds whose duration is the layer's alone (weights, gradients, optimizer state)."""

IO_KINDS = tuple(kind for kind, spec in OP_KINDS.items() if spec.bounds == "untimed")
"""Op kinds the bounds do not time: the solver's candidates keep all state in host memory, and
:mod:`megatrain.planner.nvme` moves some of it to NVMe after the solve (the NVMe rates may be 0);
the solver plans one rank (data-parallel collectives are added to its plan afterwards)."""


def durations(graph: LayerGraph, kinds: Sequence[OpKind], compute_dtype: str,
              hw: HardwareSpec) -> dict[OpKind, tuple[float, ...]]:
    """Seconds of one op of each of ``kinds`` on every layer of ``graph`` (one micro-batch, in
    ``compute_dtype``): :func:`cost.op_duration`, indexed ``[kind][layer]``. Gradient ops as a
    plan of one micro-batch runs them (``Plan.gradient_dtype``); :meth:`StepTimes.gradient_times`
    gives them for other pass structures."""
    probe = Plan(compute_dtype=compute_dtype)
    n = len(graph.layers)
    return {kind: tuple(cost.op_duration(kind, graph, i, probe, hw) for i in range(n)) for kind in kinds}


@dataclass(slots=True)
class StepTimes:
    """Per-layer op times (seconds) that do not depend on the micro-batch size (:data:`STEP_KINDS`),
    and which layers are trainable."""

    times: Mapping[OpKind, tuple[float, ...]]
    trainable: tuple[bool, ...]
    # D2H of FP32 gradients and OPT from FP32 ones: where the probe's BF16 gradients
    # (``Plan.gradient_dtype`` of one micro-batch) are not what a pass structure sends.
    d2h_fp32: tuple[float, ...] = ()
    opt_fp32: tuple[float, ...] = ()

    def gradient_times(self, size: "SizeOption") -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(D2H, OPT) times per layer for the bounds of ``size``'s pass structure. D2H as its plans
        run it: layer by layer with several micro-batches the slot sums in FP32 (FP32 D2H), else
        BF16 where the compute is BF16 (``Plan.gradient_dtype``). OPT the faster of stepping from
        FP32 and from BF16 gradient tiles (``cost.optimizer_rate``: either may be, by the spec's
        measured rates), so that a bound below every plan's step stays one."""
        if not self.d2h_fp32:
            return self.d2h, self.opt
        multi_l2l = size.micro_batches > 1 and size.layer_by_layer
        return (self.d2h_fp32 if multi_l2l else self.d2h), tuple(map(min, self.opt, self.opt_fp32))

    @property
    def h2d(self) -> tuple[float, ...]:
        return self.times[OpKind.H2D]

    @property
    def d2h(self) -> tuple[float, ...]:
        return self.times[OpKind.D2H]

    @property
    def opt(self) -> tuple[float, ...]:
        return self.times[OpKind.OPT]

    @property
    def cast(self) -> tuple[float, ...]:
        return self.times[OpKind.CAST]

    @property
    def acc(self) -> tuple[float, ...]:
        return self.times[OpKind.ACC]


def step_times(graph: LayerGraph, compute_dtype: str, hw: HardwareSpec) -> StepTimes:
    """The :class:`StepTimes` of ``graph`` in ``compute_dtype`` on ``hw``."""
    fp32 = Plan(compute_dtype=compute_dtype, d2h_dtype="float32")
    return StepTimes(durations(graph, STEP_KINDS, compute_dtype, hw),
                     tuple(layer.trainable_numel > 0 for layer in graph.layers),
                     tuple(cost.d2h_time(layer, hw, fp32) for layer in graph.layers),
                     tuple(cost.opt_time(layer, hw, fp32) for layer in graph.layers))


@dataclass(slots=True)
class SizeOption:
    """Everything about one micro-batch size (and pass structure) the search reuses: its graph,
    the durations of :data:`SIZE_KINDS` (seconds, one micro-batch) and each layer's checkpoint
    bytes (:func:`cost.checkpoint_bytes`, one micro-batch)."""

    size: int
    micro_batches: int
    graph: LayerGraph
    times: Mapping[OpKind, tuple[float, ...]]
    checkpoints: tuple[int, ...]
    layer_by_layer: bool = True  # False: per-micro-batch passes
    # Per compute kind and layer, (issue seconds, span seconds) at their least (issue_floors); empty: free
    issue: Mapping[OpKind, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    issue_slack_s: float = 0.0  # issue_slack of the spec

    @property
    def key(self) -> tuple[int, bool]:
        return (self.size, self.layer_by_layer)

    @property
    def alive(self) -> int:
        """Micro-batches whose checkpoints are alive (and offloaded) at once."""
        return self.micro_batches if self.layer_by_layer else 1

    @property
    def fwd(self) -> tuple[float, ...]:
        return self.times[OpKind.FWD]

    @property
    def bwd(self) -> tuple[float, ...]:
        return self.times[OpKind.BWD]

    @property
    def offload(self) -> tuple[float, ...]:
        return self.times[OpKind.OFFLOAD]

    @property
    def reload(self) -> tuple[float, ...]:
        return self.times[OpKind.RELOAD]


def size_option(size: int, micro_batches: int, graph: LayerGraph, compute_dtype: str,
                hw: HardwareSpec) -> SizeOption:
    """The :class:`SizeOption` of ``graph`` (traced or scaled for micro-batches of ``size``),
    layer by layer."""
    return SizeOption(size, micro_batches, graph, durations(graph, SIZE_KINDS, compute_dtype, hw),
                      tuple(cost.checkpoint_bytes(graph, i) for i in range(len(graph.layers))),
                      issue=issue_floors(graph, compute_dtype, hw), issue_slack_s=issue_slack(hw))


def issue_floors(graph: LayerGraph, compute_dtype: str,
                 hw: HardwareSpec) -> dict[OpKind, tuple[tuple[float, float], ...]]:
    """Per compute kind (FWD, RECOMPUTE, BWD) and layer of ``graph`` (one micro-batch), the least
    ``(issue_s, span_s)`` of an op: the issuing thread's seconds launching it, and the seconds from
    the start of its issue to its end. With a kernel profile both are :class:`cost.ComputeWork`'s
    (:func:`cost.compute_work` with no stream waits, no differentiated inputs and a fresh gradient
    slot, which only shorten them; the probe's gradient dtype, BF16 where exact, is the narrowest);
    without, the op ends no earlier than its issue, ``cost.launch_count`` launches with no waits.
    Empty where launching is free."""
    if hw.launch_overhead_s <= 0 and hw.backward_launch_s <= 0:
        return {}
    probe = Plan(compute_dtype=compute_dtype)
    last = len(graph.layers) - 1
    out = {}
    for kind in (OpKind.FWD, OpKind.RECOMPUTE, OpKind.BWD):
        row = []
        for i, layer in enumerate(graph.layers):
            if kind is OpKind.BWD and i < last and not graph.has_gradients(i):
                row.append((0.0, 0.0))  # no local backward is lowered (as cost.op_duration: none to time)
                continue
            work = cost.compute_work(layer, kind, probe, hw)
            if work is not None:
                row.append((work.issue_s, work.span_s))
            else:
                t = cost.launch_count(Op(kind, i, mb=0, slot=0), graph) * hw.launch_overhead_s
                row.append((t, t))
        out[kind] = tuple(row)
    return out


def issue_slack(hw: HardwareSpec) -> float:
    """How long after the issuing thread starts the step's first op may start: a host op first (a
    CAST, a carried OPT) starts once issued, one host-op launch in; a GPU op first starts with its
    issue. The bounds' issue terms are times from the thread's start, less this."""
    return cost.HOST_OP_LAUNCHES * hw.launch_overhead_s


def quick_bound(size: SizeOption, t: StepTimes, policy: Sequence[ActivationPolicy], *, deferred: bool,
                bf16: bool, duplex: bool) -> float:
    """A step time no schedule with this micro-batch size and activation policy can beat, from op
    times alone (:mod:`megatrain.planner.solve`, item 5); it holds for any slots, distance, rings
    and residents.

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
    micro-batch to the busy times. The issuing thread is busy for at least the forwards' and local
    backwards' launches (``size.issue``), less ``size.issue_slack_s`` (recomputes not counted: whether
    one runs depends on its readers' local backwards, which the lowering decides).
    """
    n, M = len(t.h2d), size.micro_batches
    passes = 1 if size.layer_by_layer else M
    fwd, bwd, recompute = size.fwd, size.bwd, size.times[OpKind.RECOMPUTE]
    rec = [p for p, a in enumerate(policy) if a is RECOMPUTE and p < n - 1]
    off = [p for p, a in enumerate(policy) if a is OFFLOAD and p < n - 1]
    trainable = [i for i in range(n) if t.trainable[i]]
    d2h_t, opt_t = t.gradient_times(size)
    backward = M * (sum(bwd) + sum(recompute[p] for p in rec))
    compute = M * sum(fwd[:n - 1]) + backward
    h2d = sum(t.h2d) + M * sum(size.reload[p] for p in off)
    d2h = passes * sum(d2h_t[i] for i in trainable) + M * sum(size.offload[p] for p in off)
    host = sum(opt_t[i] for i in trainable) + (sum(t.cast) if bf16 else 0.0)
    if not size.layer_by_layer:
        host += M * sum(t.acc[i] for i in trainable)
    bound = max(compute, h2d, d2h, host, 0.0 if duplex else h2d + d2h)
    if size.issue:  # the issuing thread launches every forward and local backward (module docstring)
        issue = M * (sum(a for a, _ in size.issue[OpKind.FWD][:n - 1]) + sum(a for a, _ in size.issue[OpKind.BWD]))
        bound = max(bound, issue - size.issue_slack_s)
    # Flow shop: the forward of layer k waits for the copies of layers 0..k, and the rest of the
    # forward and the whole backward phase follow it; the turn's local backward (layer n-1) waits
    # for the copy of layer n-1 too, and every local backward follows it (recomputes of its own
    # inputs may run before it, so they are not counted there).
    first_opt = opt_t[0] if deferred and t.trainable[0] else 0.0
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
        last_opt = 0.0 if deferred else opt_t[trainable[0]]
        done = max(forward_end, turn)  # lower bound of the end of the local backward of layer l
        d2h_left = sum(d2h_t[i] for i in trainable)
        opt_left = sum(opt_t[i] for i in trainable)
        for layer in range(n - 1, -1, -1):
            done += M * bwd[layer]
            if not t.trainable[layer]:
                continue
            bound = max(bound, done + d2h_left + last_opt)
            if not deferred:
                bound = max(bound, done + d2h_t[layer] + opt_left)
            d2h_left -= d2h_t[layer]
            opt_left -= opt_t[layer]
    return bound


STREAMS = tuple(Stream)
"""The streams in a fixed order: the bound's per-stream arrays are indexed by position here."""

_STREAM_INDEX = {kind: STREAMS.index(kind.stream) for kind in OpKind}
"""Position in :data:`STREAMS` of each op kind's stream (``OpKind.stream``, the schedule's one mapping)."""

_PER_MICRO_BATCH = ({(kind, OpKind.RELOAD) for kind in COMPUTE_KINDS}
                    | {(OpKind.OFFLOAD, OpKind.FWD), (OpKind.RELOAD, OpKind.OFFLOAD)})
"""(op kind, dependency kind) pairs where micro-batch ``m``'s op waits only for micro-batch ``m``'s
dependency (a checkpoint's copy); every other edge waits for a whole visit, or is within the compute
stream, which runs a visit's micro-batches back to back."""

_PER_VISIT_ONCE = frozenset(kind for kind, spec in OP_KINDS.items() if "mb" not in spec.required)
"""Kinds issued once per visit or layer (an op names no micro-batch); the others once per micro-batch."""


@dataclass(frozen=True, slots=True)
class Pattern:
    """The schedule of a candidate's knobs at one micro-batch, as flat arrays for the bound.

    ``lower`` with ``micro_batches=1`` gives every op of a layer visit once, with the same
    dependencies the full schedule has between visits (see :func:`pattern_bound`); which copies it
    issues depends on the activation policy, slots, distance, residents and rings only, not on
    sizes or micro-batches. ``deps`` are the dependencies on a whole visit, ``mb_deps`` those that
    hold micro-batch by micro-batch (:data:`_PER_MICRO_BATCH`).
    """

    kinds: tuple[OpKind, ...]
    layers: tuple[int, ...]
    deps: tuple[tuple[int, ...], ...]
    mb_deps: tuple[tuple[int, ...], ...]
    launches: tuple[int, ...] = ()  # cost.launch_count of each op with no stream waits (the least)

    def copies(self, n_layers: int) -> list[int]:
        """H2D weight copies per layer."""
        c = [0] * n_layers
        for kind, layer in zip(self.kinds, self.layers):
            if kind is OpKind.H2D:
                c[layer] += 1
        return c


def lower_pattern(graph: LayerGraph, plan: Plan) -> Pattern:
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
    return Pattern(kinds, tuple(op.layer for op in ops), tuple(deps), tuple(mb_deps),
                   tuple(cost.launch_count(op, graph) for op in ops))


def pattern_bound(p: Pattern, size: SizeOption, t: StepTimes, hw: HardwareSpec) -> float:
    """A step time no schedule of this candidate can beat: the longest path of its pattern.

    Each pattern op stands for its ``r`` micro-batch copies (``r = M`` for compute ops, offloads and
    reloads, 1 otherwise), of ``u`` seconds each (:func:`cost.op_duration` of its kind and layer),
    and its end is a lower bound of the last copy's end: the first copy starts no earlier than the
    ends of the op before it on its stream and of its whole-visit dependencies, and the ``r``
    copies run one after another on one resource, so the last ends at least ``r x u`` later; and
    the last copy waits for the last copy of each per-micro-batch dependency, so it ends at least
    ``u`` after that. The simulator respects all of these. Each resource's total busy time is a
    bound too (:func:`cost.resource_of`: the two host workers share one, and without duplex
    copies H2D and D2H share one engine). With duplex copies and ``M = 1`` (or no per-micro-batch
    edge, as with every checkpoint kept) each stream has a resource of its own, the simulator adds
    no other wait, and the bound is the simulated step time, unless compute ops are issue-bound
    (a traced layer's op is its GPU seconds here, its kernels against the issuing thread in the
    simulator).

    The issuing thread (module docstring). Per stream, the thread begins issuing an op's first copy
    no earlier than ``A``, the least launch seconds of the copies before it on that stream; copy
    ``k`` of ``r`` (``a`` seconds to launch, ending no earlier than ``s`` after its issue began and
    ``u`` after the copy before it) ends by ``A + (k - 1) a + s + (r - k) u``, the latest of which
    is ``A + s + (r - 1) max(a, u)``. ``s`` is the compute op's ``span_s`` (:func:`issue_floors`), a
    launch for any other GPU op (it ends no earlier than its issue), the launch and the op for a
    host op (its worker gets it once issued). The thread's total launch seconds bound the step too.
    All of these count from the thread's start, less ``size.issue_slack_s`` (:func:`issue_slack`).
    """
    n = len(p.kinds)
    M = size.micro_batches
    end = [0.0] * n
    stream_end = [0.0] * len(STREAMS)
    resources = list(cost.Resource)
    resource = [resources.index(cost.resource_of(s, hw)) for s in STREAMS]
    busy = [0.0] * len(resources)
    d2h_t, opt_t = t.gradient_times(size)
    unit = {**t.times, **size.times, OpKind.D2H: d2h_t, OpKind.OPT: opt_t}
    kinds, layers, deps, mb_deps = p.kinds, p.layers, p.deps, p.mb_deps
    works, launched = size.issue, bool(size.issue) and bool(p.launches)
    py, slack = hw.launch_overhead_s, size.issue_slack_s
    issued = [-slack] * len(STREAMS)  # per stream: the least launch seconds before its next op
    for i in range(n):
        kind = kinds[i]
        s = _STREAM_INDEX[kind]
        u = unit[kind][layers[i]]
        r = 1 if kind in _PER_VISIT_ONCE else M
        start = stream_end[s]
        for d in deps[i]:
            if end[d] > start:
                start = end[d]
        e = start + r * u
        for d in mb_deps[i]:
            if end[d] + u > e:
                e = end[d] + u
        if launched:
            work = works.get(kind)
            a, span = work[layers[i]] if work is not None else (p.launches[i] * py,) * 2
            if STREAMS[s] in HOST_STREAMS:
                span = a + u
            e = max(e, issued[s] + span + (r - 1) * max(a, u))
            issued[s] += r * a
        end[i] = stream_end[s] = e
        busy[resource[s]] += r * u
    thread = sum(issued) + slack * (len(STREAMS) - 1) if launched else 0.0  # every launch, less the slack
    return max(max(stream_end), max(busy), thread)


__all__ = ["SIZE_KINDS", "STEP_KINDS", "IO_KINDS", "STREAMS", "durations", "StepTimes", "step_times", "SizeOption",
           "size_option", "issue_floors", "issue_slack", "quick_bound", "Pattern", "lower_pattern", "pattern_bound"]
