"""The simulator: a backend that runs a Schedule's DAG in virtual time instead of on a GPU.

Method. Discrete-event list scheduling over the same DAG the runtime walks. Each Stream is an
in-order queue on a resource (:func:`megatrain.planner.cost.resource_of`: the GPU, one or two
copy engines, the host, shared by the optimizer and cast workers). An op at the head of its queue is *ready* once all its
dependencies have finished; it starts at ``max(ready time, its stream predecessor's end, its
resource's free time)`` and lasts :func:`megatrain.planner.cost.op_time`. At every step the ready
head with the earliest start (ties: the earlier op in the list) is committed. Starts are
committed in non-decreasing time, so this is an event-driven simulation: an op not yet ready
cannot later claim a resource earlier than a committed one. When two queues share a resource (H2D
and D2H on a non-duplex spec) the resource goes to whichever op can start first, as a single copy
engine serves whichever channel has work.

The issuing thread. On a GPU one Python thread launches every op's kernels, so it is simulated
too, with the runtime's own issue policy (:class:`megatrain.ir.issue.IssueQueue`, the object
the CUDA backend uses): ops are offered in list order; issuing op ``i`` costs the thread
``cost.launch_times()[i]`` (its dispatched aten ops, event records and waits, at
``hw.launch_overhead_s`` / ``hw.backward_launch_s`` each); a GPU op whose host dependency has not
finished by the thread's clock waits in its stream's pending queue while the thread issues other
work, as does a GPU op whose fences (``Schedule.issue_after``: ops that must have finished, so the
caching allocator can reuse what they read) have not ended by the clock; the thread waits only
when nothing it holds is ready (until the next host op or fence ends). A GPU op starts no earlier
than its issue starts; a host op starts once it was handed to its worker. The thread acts
whenever its clock is strictly before every start still to commit, so "done by the clock" is
known when it asks.

Kernel by kernel. A FWD, RECOMPUTE or BWD with a kernel profile (:class:`megatrain.planner.cost.ComputeWork`)
ends when its last kernel does: each runs once the thread has issued it and the kernel before it
has ended, so the op is GPU-bound when the thread keeps ahead and issue-bound (the GPU idling
between kernels) when it falls behind; its end event follows its last launch. Other GPU ops end
no earlier than their issue ends.

Stalls. A host op whose kernel holds the GIL or shares the thread's core (``cost.issue_stall``: a
fraction ``f`` of its time) holds the thread back while it runs: an issue begun before it finishes
later, and each kernel of a compute op issued after it starts later. Where it does so matters: an
OPT's kernel call comes first and its finite check (``param.sum()``, which releases the GIL) last
(``HostAdamW.step``), so an OPT blocks the thread outright for its leading ``f`` (DeepSpeed's CPU
Adam: ``f`` = 0.84 measured, ``hardware.HOST_KERNEL_ISSUE_STALL``; the first H100 step's ``D2H:L0``,
issued as an OPT began, waited until about that point of the OPT) and slows it to ``1 -
hw.host_optimizer_issue_slowdown`` of its speed for the rest (torch's fused AdamW: ``f`` = 0, a
slowdown throughout); a CAST, a torch copy that releases the GIL, slows the thread to ``1 - f`` of
its speed throughout (cores and memory bandwidth shared). So that every such
stall is known when an issue is timed, the thread issues an op only once every op that starts
before that issue would end has been committed (a host op cannot start on the strength of an issue
still under way, and one that stalls the thread is added before the issue it delays).

Copies in flight. Where ``hw`` measured it (``HardwareSpec.issue_slowdown_beside_h2d``, ``c``), the
thread issues at ``1 - c`` of its speed while a copy on the H2D stream (H2D, RELOAD) is in flight: the
probe times the template's forward's launches by wall clock alone and beside copies the same thread
queued, as the runtime queues them (``bench/gpu_probe.py``, ``_forward_beside_h2d``; the host's
memory bandwidth or the doorbell writes shared). The thread's speed is then piecewise constant over
two sets of windows kept apart (:class:`_Thread`): the host ops' (one host resource: they never
overlap) and the copies' (one in-order stream: nor do they), each in start order; the clock walks
both at once, the speed in each piece the product of the two speeds (independent causes; an OPT's
stop stays a stop). A copy's window is its committed ``[start, end)``, known in time by the same
hold-back as a host op's: once an issue is timed, the only op that can still start before it ends is
the op just issued, whose dependants start after its issue ends, and a copy does not slow its own
launch (its window opens after its issue began). One exception, handled: with contention on (below) a
compute op committed beside a running copy moves the copy's end later, and the copy's window with
it; every issue timed so far ended by the compute op's start except, when it starts while still
being issued (an issue-bound forward), its own, which is re-timed with the moved window, its issue
bound with it and the pair's ends again, to a fixed point (a round moves the copy by at most
``1 -`` its share of the bound's move and the bound by about ``c`` x the copy's: a contraction; at
most ``_REBOUND_ROUNDS`` rounds, so the last may leave an error of that order).

Contention. Where ``hw`` measured it (``HardwareSpec.has_contention``), a copy on the H2D stream
(H2D, RELOAD) and an op on the compute stream (FWD, RECOMPUTE, BWD) slow each other: a copy in flight
beside a compute op in flight progresses at its share of its speed alone
(:func:`megatrain.planner.cost.contention_rates`: its time alone over its time at
``h2d_beside_compute_bytes_per_s``), and a compute op's kernels beside a copy at ``1 - s``
(``compute_slowdown_beside_h2d``), each at full speed otherwise; so a copy wholly beside compute
moves its bytes at the rate beside, and a GPU-bound compute op wholly beside copies takes its time
alone / (1 - s). The approximation: a compute op's GPU seconds (its kernels', or its FLOP time) run
from its start as one block, slowed over the overlap, and the op ends at the later of that and its
issue bound (:meth:`megatrain.planner.cost.ComputeWork.issue_bound`, not slowed by these two: the
issuing thread does not wait for the GPU, and a copy slows it only through
``issue_slowdown_beside_h2d``, above), so an issue-bound op absorbs a slowdown of its kernels up to
its idle time; a copy counts as slowed for its partner's whole interval, as the probe measured it
(the copy beside a looping forward, issue gaps included), and is timed whole (its interval alone,
launch too).

Each stream is in order, so at most one op of each class runs at a time; starts are committed in
non-decreasing time, so when an op starting at ``t`` is committed, the op of the other class still
running at ``t`` (if any) started earlier and its own partner has ended, so it has run at full speed
since then: a copy has ``end - t`` seconds of work left, a compute op its GPU seconds until its GPU
end. The pair's ends follow in closed form (:func:`_pair`); the earlier op's end moves later, and
its stream's and resource's free times and a fence's wake-up move with it. That is safe while
nothing committed relies on that end (a dependant, the op after it on its stream or its resource
would start after it, so after ``t``), which non-decreasing starts give, but for one exception: a
compute op starts once its issue begins, so one issued after a host op was committed (the hold-back
commits the host ops that start during an issue first) may start before that host op and beside a
copy it depends on (a CAST refilling the staging tile an H2D reads). An op some committed op relies
on is therefore *frozen*: it keeps its speed alone beside its partner, and so its end (the partner
is still slowed). A later op of the
new op's class starting before the earlier op ends revises it again the same way: O(1) per commit.
With neither field set the contention path is skipped and every time is exactly as without it.
``issue_slowdown_beside_h2d`` is apart from these two (``HardwareSpec.has_issue_contention``): either
may be set without the other.

Deadlock. If ops remain but no queue head has all its dependencies finished, no op can ever
start: the error lists each blocked head and what it waits for (a dependency queued behind it on
its own stream, or behind another blocked head). ``verify`` rules this out for schedules whose
dependencies point to earlier ops; the simulator still checks, as pipelining's
``_simulate_comms_compute`` does.

Cost: O(ops x streams x deps), contention O(1) more per op; a 120-layer model with 8 micro-batches
(about 2,300 ops) takes a few milliseconds. Copies in flight add a window per copy: an issue's clock
walks the windows it overlaps (a bisect to the first), a compute op's bound that walk per kernel, as
the host windows already cost; a re-timed own issue up to ``_REBOUND_ROUNDS`` more bounds.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Callable

from megatrain.errors import ScheduleError
from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph
from megatrain.ir.hardware import HardwareSpec
from megatrain.ir.issue import IssueQueue
from megatrain.ir.schedule import HOST_STREAMS, Schedule, Stream
from megatrain.planner.timeline import Timeline

_INF = float("inf")


def simulate(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec, *, issue_times: bool = False) -> Timeline:
    """Predict when every op of ``schedule`` runs on ``hw``; return the simulated Timeline.

    With ``issue_times`` each GPU op's record also says when the simulated issuing thread began and
    ended issuing it and its launch seconds (the thread's CPU seconds; the rest of the issue's wall
    time a host op held it), as a measured CUDA step's do, so the timeline splits each GPU stream's
    busy time into ``gpu_busy_s`` and ``issue_bound_s`` the same way (:class:`Timeline`). Off by
    default: the solver compares step times only, and a predicted timeline beside a measured one
    (``bench/gpu_probe.py``) keeps the split to the measured.

    Raises:
        ScheduleError: the schedule deadlocks (names the stuck ops and what each waits for), or an
            op depends on an op that does not exist.
        ConfigError: ``hw`` lacks a rate an op needs (a host-only spec cannot time GPU ops).
    """
    records, issue = _run(schedule, graph, hw, issue_times)
    return Timeline.from_records(schedule, graph, records, hw, source="simulated", issue=issue)


def step_time_s(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec) -> float:
    """``simulate(schedule, graph, hw).step_time_s`` (seconds, the same float) without building the
    Timeline around it: its GPU memory curve (``cost.memory_breakdown``, ``cost.activation_liveness``)
    and totals cost about as much as the simulation itself, and the solver compares its candidates by
    step time alone, simulating the one it keeps once more. Raises as :func:`simulate` does."""
    records, _ = _run(schedule, graph, hw, False)
    return Timeline.step_of(records)


def _run(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec, issue_times: bool):
    """The simulation itself: ``(records, issue)`` for :meth:`Timeline.from_records`, one
    ``(op index, stream, start_s, end_s)`` per op and, with ``issue_times``, each GPU op's
    ``(issue_start_s, issued_s, issue_cpu_s)`` (else None)."""
    ops = schedule.ops
    n = len(ops)
    for i, op in enumerate(ops):
        for d in op.deps:
            if not 0 <= d < n:
                raise ScheduleError(f"op #{i} {op!r} depends on op #{d}, which does not exist in this "
                                    f"{n}-op schedule. Fix: lower the schedule again.\n"
                                    + schedule.format(marker=i, context=8))
    works = cost.compute_works(schedule, graph, hw)
    dur = cost.op_times(schedule, graph, hw, works)
    launch = cost.launch_times(schedule, graph, hw, works)
    share = cost.contention_rates(schedule, graph, hw, dur)  # None: no contention measured
    slow = hw.issue_slowdown_beside_h2d  # 0: a copy in flight does not slow the issuing thread
    running = {Stream.COMPUTE: -1, Stream.H2D: -1}  # the last op committed on each contending stream
    gpu_end = [0.0] * n if share is not None else []  # a compute op's GPU seconds end (module docstring)
    bound = [0.0] * n if share is not None else []  # and its issue bound
    # An op whose end a committed op relies on (a dependant, its stream's or resource's next op):
    # contention no longer moves that end (module docstring, "Contention").
    frozen = [False] * n if share is not None else []
    resource_last: dict = {}
    queues: dict[Stream, list[int]] = {s: [] for s in Stream}
    for i, op in enumerate(ops):
        queues[op.stream].append(i)
    resource = {s: cost.resource_of(s, hw) for s in Stream}
    resource_free = {r: 0.0 for r in resource.values()}
    stream_free = {s: 0.0 for s in Stream}
    head = {s: 0 for s in Stream}
    deps = [op.deps for op in ops]
    host = [op.stream in HOST_STREAMS for op in ops]
    start = [0.0] * n
    end = [-1.0] * n  # -1: not finished (not yet committed)
    issued = [_INF] * n  # when the issuing thread started issuing the op
    issued_end = [_INF] * n
    active = [s for s in Stream if queues[s]]
    # The issuing thread: ``clock`` is when it is next free; ``offered`` ops were handed to it;
    # ``pending`` is the op it issues next, held until every op that starts before that issue ends
    # has been committed (one of them may be a host op that stalls the thread, or a copy that slows
    # it: ``thread``).
    iq = IssueQueue()
    clock, offered = 0.0, 0
    pending = -1
    thread = _Thread()
    fenced = {f for i in range(n) for f in schedule.fences(i)}  # ops whose end an issue waits for
    wake: list[float] = []  # heap: end times of committed host ops and fences, for a blocked issuer
    committed = 0

    def done(h: int) -> bool:
        return 0.0 <= end[h] <= clock

    while committed < n:
        best_t, best_i, best_s = 0.0, -1, None
        for s in active:
            i = queues[s][head[s]]
            if issued[i] == _INF:
                continue
            t = max(stream_free[s], issued_end[i] if host[i] else issued[i])
            for d in deps[i]:
                e = end[d]
                if e < 0:
                    break
                if e > t:
                    t = e
            else:
                r = resource_free[resource[s]]
                if r > t:
                    t = r
                if best_s is None or t < best_t or (t == best_t and i < best_i):
                    best_t, best_i, best_s = t, i, s
        # The issuer acts while it is strictly ahead of every op still to start, so each op that is
        # done by its clock (a host op, a fence) has been committed (ops start in non-decreasing time).
        if best_s is None or clock < best_t:
            if pending < 0:
                j = iq.next(done)
                if j is not None:
                    pending = j
                    clock = thread.resume(clock)
                    continue
            if pending >= 0:
                issue_end = thread.clock(clock, launch[pending])
                if best_s is not None and best_t < issue_end:
                    pass  # an op starts while this one is issued: commit it first (below)
                else:
                    issued[pending] = clock
                    issued_end[pending] = clock = issue_end
                    pending = -1
                    continue
            elif offered < n:
                op = ops[offered]
                # A dependency on a later op (no topological order) cannot be offered; the streams
                # then stall on it and the deadlock is reported below.
                iq.add(offered, op.stream, [d for d in op.deps if d < offered and ops[d].stream is not op.stream],
                       [f for f in schedule.fences(offered) if f < offered])
                offered += 1
                continue
            else:
                while wake and wake[0] <= clock:
                    heapq.heappop(wake)
                if wake and (best_s is None or wake[0] < best_t):
                    clock = heapq.heappop(wake)  # wait for the next host op or fence to finish
                    continue
                if best_s is None:
                    raise ScheduleError(_deadlock_message(schedule, queues, head, active, end))
        e = best_t + dur[best_i]
        if not host[best_i]:
            work = works[best_i]
            if work is not None:  # kernel by kernel: the GPU runs each once issued (cost.ComputeWork)
                b = work.issue_bound(issued[best_i], thread.clock if thread.during(issued[best_i], issued_end[best_i])
                                     else None)
                e = max(best_t + work.gpu_s, b)
            else:
                b = issued_end[best_i]  # the GPU cannot finish an op before its last kernel is launched
                if b > e:
                    e = b
            if share is not None and best_s in running:
                copy = running[Stream.H2D]
                rebound = None
                if (slow and best_s is Stream.COMPUTE and copy >= 0 and best_t < end[copy] < issued_end[best_i]
                        and clock == issued_end[best_i]):
                    # Its own issue runs past the running copy's end, which the pair moves later
                    # (module docstring, "Copies in flight"); nothing was issued since it (the hold-back
                    # keeps it so; were it not, the issue would keep its first timing).
                    rebound = _rebound(best_i, thread, issued, issued_end, launch, work)
                copy_end = end[copy] if copy >= 0 else 0.0
                e = _contend(best_i, best_s, best_t, e, b, dur, share, running, gpu_end, bound, end, stream_free,
                             resource_free, resource, ops, fenced, wake, frozen, rebound)
                if slow and copy >= 0 and end[copy] != copy_end:  # the pair moved the copy's end
                    thread.copies.move_end(end[copy])
                if rebound is not None:
                    clock = issued_end[best_i]
        start[best_i], end[best_i] = best_t, e
        if share is not None:
            r = resource[best_s]
            for d in (*deps[best_i], queues[best_s][head[best_s] - 1] if head[best_s] else -1, resource_last.get(r, -1)):
                if d >= 0:
                    frozen[d] = True
            resource_last[r] = best_i
        if host[best_i]:
            heapq.heappush(wake, e)
            for span in cost.issue_stall_spans(ops[best_i].kind, hw, best_t, e):
                thread.host.add(*span)
        else:
            if best_i in fenced:
                heapq.heappush(wake, e)
            if slow and best_s is Stream.H2D:
                thread.copies.add(best_t, e, slow)
        committed += 1
        stream_free[best_s] = e
        resource_free[resource[best_s]] = e
        head[best_s] += 1
        if head[best_s] == len(queues[best_s]):
            active.remove(best_s)
    records = [(i, ops[i].stream, start[i], end[i]) for i in range(n)]
    issue = {i: (issued[i], issued_end[i], launch[i]) for i in range(n) if not host[i]} if issue_times else None
    return records, issue


_REBOUND_ROUNDS = 16
"""Most rounds of re-timing a compute op's own issue beside the copy its pair moves (module
docstring, "Copies in flight"); each shrinks the error by about ``issue_slowdown_beside_h2d`` x the
copy's lost share (0.25 x 0.22 at the 11-27 what-if's factors), so 16 reach rounding."""


def _rebound(i: int, thread: "_Thread", issued: list[float], issued_end: list[float], launch,
             work: cost.ComputeWork | None) -> Callable[[float], float]:
    """For compute op ``i``, started while still being issued beside a running copy: a function from
    the copy's moved end to the op's issue bound, its issue re-timed with the copy's window moved
    there (``issued_end[i]`` rewritten)."""
    def rebound(copy_end: float) -> float:
        thread.copies.move_end(copy_end)
        issued_end[i] = thread.clock(issued[i], launch[i])
        return issued_end[i] if work is None else work.issue_bound(issued[i], thread.clock)
    return rebound


def _contend(i: int, s: Stream, t: float, e: float, b: float, dur, share, running: dict[Stream, int],
             gpu_end: list[float], bound: list[float], end: list[float], stream_free, resource_free, resource,
             ops, fenced: set[int], wake: list[float], frozen: list[bool],
             rebound: Callable[[float], float] | None = None) -> float:
    """Op ``i`` on contending stream ``s`` starts at ``t``, ending at ``e`` alone (``b``: its issue
    bound); pair it with the op of the other class still running at ``t`` (module docstring,
    "Contention"), move that one's end unless it is ``frozen`` (then it keeps its speed alone, and so
    its end), and return op ``i``'s. ``rebound`` (a compute op whose own issue runs past the copy's
    end): its issue bound from the copy's moved end, iterated to a fixed point ("Copies in flight")."""
    compute = s is Stream.COMPUTE
    other = running[Stream.H2D if compute else Stream.COMPUTE]
    running[s] = i
    if compute:  # its GPU seconds (cost.op_times: a ComputeWork's gpu_s)
        gpu_end[i], bound[i] = t + dur[i], b
    if other < 0 or end[other] <= t:
        return e
    kept = 1.0 if frozen[other] else share[other]  # the other op's share of its speed alone
    if compute:  # the copy has run at full speed since its last partner ended
        g, h = gpu_end[i] - t, end[other] - t
        gpu_end[i], e, moved = _pair(t, g, share[i], b, h, kept)
        if rebound is not None:
            for _ in range(_REBOUND_ROUNDS):
                again = rebound(moved)
                if again <= b:
                    break
                b = bound[i] = again
                gpu_end[i], e, moved = _pair(t, g, share[i], b, h, kept)
    else:
        gpu_end[other], moved, e = _pair(t, max(0.0, gpu_end[other] - t), kept, bound[other], e - t, share[i])
    if frozen[other]:
        return e  # its end stays exactly as committed
    st = ops[other].stream
    end[other] = stream_free[st] = resource_free[resource[st]] = moved
    if other in fenced:
        heapq.heappush(wake, moved)  # the stale earlier entry only wakes the issuer early
    return e


def _pair(t: float, g: float, share_g: float, issue_bound: float, h: float,
          share_h: float) -> tuple[float, float, float]:
    """From ``t``, a compute op with ``g`` GPU seconds left (timed alone) that ends no earlier than
    ``issue_bound``, beside a copy with ``h`` seconds left: the kernels run at ``share_g`` of their
    speed while the copy runs, the copy at ``share_h`` of its speed until the compute op ends. Returns
    the compute op's GPU end, its end, and the copy's end."""
    tg, th = g / share_g, h / share_h
    if th <= tg:  # the copy ends first, while the kernels run
        gpu = t + th + (g - share_g * th)
        return gpu, max(gpu, issue_bound), t + th
    gpu = t + tg
    op_end = max(gpu, issue_bound)
    left, beside = h - share_h * tg, op_end - gpu  # the copy's work left; how long it still runs beside the op
    copy = gpu + left / share_h if left <= share_h * beside else op_end + (left - share_h * beside)
    return gpu, op_end, copy


class _Stalls:
    """The windows in which one cause slows the issuing thread, each ``(start, end, fraction)``: the
    thread issues at ``1 - fraction`` of its speed inside one. Windows are added in start order and
    do not overlap (a host op holding the GIL: the host ops share one resource; a copy in flight: the
    copies share one in-order stream), so their ends are in order too."""

    __slots__ = ("windows", "ends")

    def __init__(self) -> None:
        self.windows: list[tuple[float, float, float]] = []
        self.ends: list[float] = []

    def add(self, a: float, b: float, f: float) -> None:
        self.windows.append((a, b, f))
        self.ends.append(b)

    def move_end(self, b: float) -> None:
        """Move the last window's end to ``b`` (a copy the contention path slowed after its commit)."""
        a, _, f = self.windows[-1]
        self.windows[-1] = (a, b, f)
        self.ends[-1] = b

    def resume(self, t: float) -> float:
        """When a thread free at ``t`` can start issuing: after a window that stops it (fraction 1)."""
        for a, b, f in self.windows[bisect.bisect_right(self.ends, t):]:
            if a > t:
                break
            if f >= 1.0:
                t = b
        return t

    def during(self, t0: float, t1: float) -> bool:
        """Whether a window overlaps ``[t0, t1)``."""
        k = bisect.bisect_right(self.ends, t0)
        return k < len(self.windows) and self.windows[k][0] < t1

    def clock(self, t: float, work: float) -> float:
        """When ``work`` seconds of issuing begun at ``t`` are done."""
        for a, b, f in self.windows[bisect.bisect_right(self.ends, t):]:
            if a >= t + work:
                break
            if a > t:
                work -= a - t
                t = a
            if f < 1.0 and (b - t) * (1.0 - f) >= work:
                return t + work / (1.0 - f)
            work -= (b - t) * (1.0 - f)
            t = b
        return t + work


class _Thread:
    """The issuing thread's speed over time (module docstring, "Stalls", "Copies in flight"): the
    host ops' windows (``host``, an OPT's stop or a CAST's slowdown) and the copies' (``copies``),
    each a :class:`_Stalls`; where both hold, the speeds multiply. Only a host window stops the
    thread (``issue_slowdown_beside_h2d`` < 1). With no copy window the clock is ``host``'s own, so a
    spec without the copies' slowdown times every issue exactly as before it."""

    __slots__ = ("host", "copies")

    def __init__(self) -> None:
        self.host = _Stalls()
        self.copies = _Stalls()

    def resume(self, t: float) -> float:
        return self.host.resume(t)

    def during(self, t0: float, t1: float) -> bool:
        return self.host.during(t0, t1) or self.copies.during(t0, t1)

    def clock(self, t: float, work: float) -> float:
        """When ``work`` seconds of issuing begun at ``t`` are done, through both sets of windows."""
        if not self.copies.windows:
            return self.host.clock(t, work)
        hw_, hs = self.host.windows, len(self.host.windows)
        cw, cs = self.copies.windows, len(self.copies.windows)
        i, j = bisect.bisect_right(self.host.ends, t), bisect.bisect_right(self.copies.ends, t)
        while True:
            while i < hs and hw_[i][1] <= t:
                i += 1
            while j < cs and cw[j][1] <= t:
                j += 1
            speed, nxt = 1.0, _INF  # the speed from t to the next window edge
            for k, n, w in ((i, hs, hw_), (j, cs, cw)):
                if k < n:
                    a, b, f = w[k]
                    if a > t:
                        nxt = min(nxt, a)
                    else:
                        speed *= 1.0 - f
                        nxt = min(nxt, b)
            if nxt == _INF:
                return t + work
            if speed > 0.0 and (nxt - t) * speed >= work:
                return t + work / speed
            work -= (nxt - t) * speed
            t = nxt


def _deadlock_message(schedule: Schedule, queues: dict[Stream, list[int]], head: dict[Stream, int],
                      active: list[Stream], end: list[float]) -> str:
    ops = schedule.ops
    heads = {queues[s][head[s]]: s for s in active}
    where = {i: (s, k) for s in active for k, i in enumerate(queues[s]) if k >= head[s]}  # unfinished
    done = sum(1 for e in end if e >= 0)
    lines = [f"schedule deadlocks: {len(ops) - done} of {len(ops)} ops can never start, because the next op "
             "on every stream waits for an op that cannot finish first:"]
    for i, s in sorted(heads.items()):
        waits = []
        for d in ops[i].deps:
            if end[d] >= 0:
                continue
            ds, _ = where[d]
            if d == i:
                why = "itself"
            elif ds is s:
                why = f"queued after it on its own stream, {s.value}"
            elif d in heads:
                why = f"the blocked head of {ds.value}"
            else:
                why = (f"queued on {ds.value} behind the blocked head #{queues[ds][head[ds]]} "
                       f"{ops[queues[ds][head[ds]]]!r}")
            waits.append(f"#{d} {ops[d]!r} ({why})")
        lines.append(f"  {s.value:<7} #{i} {ops[i]!r} waits for " + ", ".join(waits))
    first = min(heads)
    lines.append("Rule: an op may depend only on ops that can finish before it on in-order streams "
                 "(verify's 'order' rule: every dependency is an earlier op in the list). Fix: list the "
                 "ops in a topological order that keeps each stream's order, e.g. lower() the plan "
                 "again, and run verify(schedule, graph) before simulate.")
    lines.append(schedule.format(marker=first, context=8))
    return "\n".join(lines)


__all__ = ["simulate", "step_time_s"]
