"""Timeline: when each op of a schedule ran, predicted by the simulator or measured on a GPU.

Both sources fill the same type through :meth:`Timeline.from_records`, which takes one
``(op index, stream, start, end)`` record per op and derives everything else (step time,
throughput, MFU, per-stream busy time, the bottleneck, memory over time) with the cost model's
formulas, so a predicted and a measured timeline are compared field by field.

GPU busy or issue-bound. A measured GPU op's record brackets it from its start marker to its end
marker; on a stream that was idle the start marker completes as it is issued, so the bracket holds
the op's issue as well as its kernels, and a GPU waiting on the issuing thread (Python, launches,
a GIL a host op holds) counts as busy in ``busy_s``. The CUDA backend also records when each GPU
op's issue ended: from then on its whole work is queued and the GPU busy with it. So a measured
CUDA timeline splits each GPU stream's ``busy_s`` into ``gpu_busy_s`` (after the issue ended: a
lower bound of the GPU's busy time) and ``issue_bound_s`` (before: the GPU ran what was issued and
may have waited for the rest), and says the issuing thread's seconds issuing each stream's ops
(``issue_busy_s``) and, of those, off a core (``issue_blocked_s``: the GIL or a core taken). A
kernel-level union of GPU busy time needs a profiler (``bench/gpu_probe.py``'s profiled step).

Outputs: versioned JSON (pydantic models at the boundary, round-trips exactly), a Chrome trace /
Perfetto JSON dict (``to_chrome_trace``; open it at ui.perfetto.dev or chrome://tracing), and a
PNG (``save_png``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Literal, Mapping, Sequence

import pydantic

from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph
from megatrain.ir.hardware import HardwareSpec
from megatrain.ir.schedule import OP_KINDS, OpKind, Schedule, Stream

TIMELINE_FORMAT_VERSION = 1

Source = Literal["simulated", "measured"]


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One op's run: ``op`` is its repr (``FWD:L3:m0:s1``), times in seconds from the step's start.

    A measured GPU op also says when the issuing thread began and ended issuing it
    (``issue_start_s``, ``issued_s``: its kernels all enqueued; the start may precede the step's
    first op) and that thread's CPU seconds meanwhile (``issue_cpu_s``); None where unknown (host
    ops, the CPU backend, a simulated step unless ``simulate(..., issue_times=True)`` timed its
    issuing thread, a timeline written before they were recorded)."""

    index: int
    op: str
    stream: Stream
    start_s: float
    end_s: float
    issue_start_s: float | None = None
    issued_s: float | None = None
    issue_cpu_s: float | None = None

    def __post_init__(self) -> None:
        if not self.end_s >= self.start_s:
            raise ValueError(f"op #{self.index} {self.op}: ends at {self.end_s} s before it starts at "
                             f"{self.start_s} s")
        known = [x is not None for x in (self.issue_start_s, self.issued_s, self.issue_cpu_s)]
        if any(known) and not (all(known) and self.issued_s >= self.issue_start_s and self.issue_cpu_s >= 0):
            raise ValueError(f"op #{self.index} {self.op}: issue from {self.issue_start_s} to {self.issued_s} s with "
                             f"{self.issue_cpu_s} CPU s; give all three, the end not before the start, the CPU "
                             "seconds >= 0 (or none)")

    @property
    def gpu_busy_s(self) -> float | None:
        """The part of the op's run after its issue ended, when its whole work was queued on the
        stream and the GPU busy with it (None without issue times): a lower bound of its GPU time."""
        if self.issued_s is None:
            return None
        return max(0.0, self.end_s - max(self.start_s, self.issued_s))

    @property
    def issue_bound_s(self) -> float | None:
        """The part of the op's run before its issue ended: the GPU ran what was issued so far and
        may have waited for the rest (None without issue times)."""
        if self.issued_s is None:
            return None
        return max(0.0, min(self.issued_s, self.end_s) - self.start_s)

    @property
    def kind(self) -> OpKind:
        return OpKind(self.op.split(":", 1)[0])

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class Timeline:
    """A step's ops in time, with the statistics derived from them.

    Attributes:
        source: ``"simulated"`` (from :func:`megatrain.planner.simulate.simulate`) or ``"measured"``.
        hardware: the HardwareSpec's name the timeline was made with.
        compute_dtype: the plan's compute dtype (what ``mfu`` is relative to).
        records: one per op, in schedule order; times are shifted so the first op starts at 0.
        step_time_s: from the first op's start to the last op's end.
        tokens_per_step, tokens_per_s: tokens of the step (all micro-batches) and the throughput.
        model_flops_per_step: PaLM model FLOPs (``cost.flops_per_step``), recompute not counted.
        mfu: model FLOPs utilisation against the spec's peak for ``compute_dtype``.
        busy_s: per stream, the sum of its ops' durations.
        bottleneck: the busiest stream. Without duplex copies H2D and D2H share one engine, whose
            load is ``busy_s[H2D] + busy_s[D2H]``; the bottleneck names a single stream still.
        gpu_memory: ``(t, bytes)`` points of a step function: allocated GPU bytes from time ``t``
            (fixed allocations and reserve, checkpoints and boundary gradients alive, working
            memory of the running compute op).
        pinned_memory: the same for pinned host memory (rings, pinned state, offload space).
        gpu_peak_bytes, pinned_peak_bytes: the curves' maxima.
        gpu_busy_s, issue_bound_s: per GPU stream whose ops have issue times (a measured CUDA step,
            or a simulated one with ``issue_times``),
            the sums of :attr:`OpRecord.gpu_busy_s` (the GPU certainly busy: the op's work all
            queued) and :attr:`OpRecord.issue_bound_s` (the op's run while it was still being
            issued: the GPU waited for the issuing thread for part of it); they add up to
            ``busy_s``. Empty otherwise.
        issue_busy_s, issue_blocked_s: per GPU stream likewise, the issuing thread's seconds
            issuing its ops and, of those, the seconds it was off a core (waiting for the GIL a
            host op held, or for a core the machine's other work held).
    """

    source: Source
    hardware: str
    compute_dtype: str
    records: tuple[OpRecord, ...]
    step_time_s: float
    tokens_per_step: int
    tokens_per_s: float
    model_flops_per_step: float
    mfu: float
    busy_s: dict[Stream, float] = field(hash=False)
    bottleneck: Stream
    gpu_memory: tuple[tuple[float, int], ...]
    pinned_memory: tuple[tuple[float, int], ...]
    gpu_peak_bytes: int
    pinned_peak_bytes: int
    gpu_busy_s: dict[Stream, float] = field(default_factory=dict, hash=False)
    issue_bound_s: dict[Stream, float] = field(default_factory=dict, hash=False)
    issue_busy_s: dict[Stream, float] = field(default_factory=dict, hash=False)
    issue_blocked_s: dict[Stream, float] = field(default_factory=dict, hash=False)

    @property
    def busy_fraction(self) -> dict[Stream, float]:
        """Per stream, the fraction of the step it is busy (1.0 for a stream that never idles)."""
        return self._fraction(self.busy_s)

    @property
    def gpu_busy_fraction(self) -> dict[Stream, float]:
        """Per GPU stream with issue times, the fraction of the step the GPU was certainly busy on
        it (``gpu_busy_s`` over the step)."""
        return self._fraction(self.gpu_busy_s)

    @property
    def issue_bound_fraction(self) -> dict[Stream, float]:
        """Per GPU stream with issue times, the fraction of the step its ops ran while still being issued."""
        return self._fraction(self.issue_bound_s)

    def _fraction(self, seconds: dict[Stream, float]) -> dict[Stream, float]:
        t = self.step_time_s
        return {s: (b / t if t > 0 else 0.0) for s, b in seconds.items()}

    # -- construction ------------------------------------------------------------------------------
    @staticmethod
    def step_of(records: Sequence[tuple[int, Stream | str, float, float]]) -> float:
        """The step time (seconds) :meth:`from_records` gives ``records``: the last end after the
        first start."""
        t0 = min((r[2] for r in records), default=0.0)
        return max((float(r[3]) - t0 for r in records), default=0.0)

    @classmethod
    def from_records(cls, schedule: Schedule, graph: LayerGraph,
                     records: Iterable[tuple[int, Stream | str, float, float]], hw: HardwareSpec,
                     source: Source = "measured", *,
                     issue: Mapping[int, tuple[float, float, float]] | None = None) -> "Timeline":
        """Build a Timeline from one ``(op index, stream, start_s, end_s)`` per op of ``schedule``,
        and for the ops in ``issue`` their ``(issue_start_s, issued_s, issue_cpu_s)`` (see
        :class:`OpRecord`; on the records' clock).

        Times may have any origin (they are shifted so the earliest start is 0). Raises
        ValueError when an op is missing, repeated, out of range or on the wrong stream.
        """
        issue = issue or {}
        ops = schedule.ops
        rows = sorted((int(i), Stream(s), float(a), float(b)) for i, s, a, b in records)
        seen = [r[0] for r in rows]
        if seen != list(range(len(ops))):
            missing = sorted(set(range(len(ops))) - set(seen))
            extra = sorted({i for i in seen if not 0 <= i < len(ops) or seen.count(i) > 1})
            raise ValueError(f"a timeline needs exactly one record per op of the {len(ops)}-op schedule; "
                             f"missing ops {missing[:10]}, unknown or repeated {extra[:10]}")
        t0 = min((r[2] for r in rows), default=0.0)
        recs = []
        for i, s, a, b in rows:
            if s is not ops[i].stream:
                raise ValueError(f"record for op #{i} {ops[i]!r} says stream {s.value!r}, but the op "
                                 f"runs on {ops[i].stream.value!r}")
            if i in issue:
                i0, i1, cpu = issue[i]
                recs.append(OpRecord(i, repr(ops[i]), s, a - t0, b - t0, i0 - t0, i1 - t0, cpu))
            else:
                recs.append(OpRecord(i, repr(ops[i]), s, a - t0, b - t0))
        step = cls.step_of(rows)
        busy = {s: 0.0 for s in Stream}
        gpu_busy: dict[Stream, float] = {}
        issue_bound: dict[Stream, float] = {}
        issue_busy: dict[Stream, float] = {}
        issue_blocked: dict[Stream, float] = {}
        for r in recs:
            busy[r.stream] += r.duration_s
            if r.issued_s is not None:
                wall = r.issued_s - r.issue_start_s
                for d, x in ((gpu_busy, r.gpu_busy_s), (issue_bound, r.issue_bound_s), (issue_busy, wall),
                             (issue_blocked, max(0.0, wall - r.issue_cpu_s))):
                    d[r.stream] = d.get(r.stream, 0.0) + x
        bottleneck = max(Stream, key=lambda s: busy[s])  # first of equals: compute, h2d, d2h, host
        plan = schedule.plan
        mem = cost.memory_breakdown(graph, plan, hw, schedule)
        gpu = _gpu_curve(recs, cost.activation_liveness(schedule, graph), mem.gpu_fixed)
        pinned = ((0.0, mem.host_pinned), (step, mem.host_pinned))
        tokens = cost.tokens_per_step(graph, plan)
        flops = cost.flops_per_step(graph, plan, schedule.mode)
        return cls(source=source, hardware=hw.name, compute_dtype=plan.compute_dtype,
                   records=tuple(recs), step_time_s=step, tokens_per_step=tokens,
                   tokens_per_s=tokens / step if step > 0 else 0.0, model_flops_per_step=flops,
                   mfu=cost.mfu(flops, step, plan.compute_dtype, hw), busy_s=busy,
                   bottleneck=bottleneck, gpu_memory=gpu, pinned_memory=pinned,
                   gpu_peak_bytes=max(b for _, b in gpu), pinned_peak_bytes=max(b for _, b in pinned),
                   gpu_busy_s=gpu_busy, issue_bound_s=issue_bound, issue_busy_s=issue_busy,
                   issue_blocked_s=issue_blocked)

    # -- JSON --------------------------------------------------------------------------------------
    def to_json(self, indent: int | None = None) -> str:
        return _TimelineModel.from_timeline(self).model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Timeline":
        """Load a timeline written by ``to_json``. Raises pydantic.ValidationError on bad JSON."""
        return _TimelineModel.model_validate_json(text).to_timeline()

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Timeline":
        return cls.from_json(Path(path).read_text())

    # -- views -------------------------------------------------------------------------------------
    def to_chrome_trace(self) -> dict:
        """The timeline in Chrome trace event format (also read by Perfetto).

        One thread per stream, one complete (``"X"``) event per op with microsecond ``ts``/``dur``,
        and counter (``"C"``) events for GPU and pinned host memory in bytes.
        """
        pid = 1
        tids = {s: k + 1 for k, s in enumerate(Stream)}
        events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                               "args": {"name": f"megatrain step ({self.source}, {self.hardware})"}}]
        for s, tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": s.value}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        issue_tid = len(tids) + 1  # the issuing thread's lane: when it issued each GPU op
        if any(r.issued_s is not None for r in self.records):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": issue_tid,
                           "args": {"name": "issuing thread"}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": issue_tid,
                           "args": {"sort_index": 0}})
        for r in self.records:
            events.append({"name": r.op, "cat": r.kind.value, "ph": "X", "pid": pid, "tid": tids[r.stream],
                           "ts": r.start_s * 1e6, "dur": r.duration_s * 1e6, "args": {"index": r.index}})
            if r.issued_s is not None:
                events.append({"name": r.op, "cat": "issue", "ph": "X", "pid": pid, "tid": issue_tid,
                               "ts": r.issue_start_s * 1e6, "dur": (r.issued_s - r.issue_start_s) * 1e6,
                               "args": {"index": r.index, "cpu_us": r.issue_cpu_s * 1e6}})
        for name, curve in (("GPU memory", self.gpu_memory), ("pinned host memory", self.pinned_memory)):
            for t, b in curve:
                events.append({"name": name, "ph": "C", "pid": pid, "tid": 0, "ts": t * 1e6,
                               "args": {"bytes": b}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"step_time_s": self.step_time_s, "mfu": self.mfu,
                              "bottleneck": self.bottleneck.value, "source": self.source}}

    def save_png(self, path: str | os.PathLike, title: str | None = None) -> None:
        """Draw one lane per stream (ops coloured by kind) above the memory curves."""
        # Figure + FigureCanvasAgg, not pyplot: no global backend switch, no GUI, thread-safe.
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
            from matplotlib.patches import Patch
        except ImportError as e:
            raise ImportError("Timeline.save_png needs matplotlib, which megatrain does not install by "
                              "default: pip install matplotlib (or use to_chrome_trace())") from e

        scale, unit = (1.0, "s") if self.step_time_s >= 10 else (1e3, "ms")
        colors = {kind: spec.colour for kind, spec in OP_KINDS.items()}
        fig = Figure(figsize=(12, 6.5), layout="constrained")
        FigureCanvasAgg(fig)
        lanes, mem = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
        streams = list(Stream)
        for y, s in enumerate(streams):
            recs = [r for r in self.records if r.stream is s]
            if recs:
                lanes.broken_barh([(r.start_s * scale, r.duration_s * scale) for r in recs], (y - 0.4, 0.8),
                                  facecolors=[colors[r.kind] for r in recs], edgecolor="black", linewidth=0.2)
        lanes.set_yticks(range(len(streams)),
                         [f"{s.value}\n{self.busy_fraction.get(s, 0.0):.0%} busy" for s in streams])
        lanes.set_ylim(len(streams) - 0.5, -1.3)  # inverted, with a free band on top for the legend
        lanes.legend(handles=[Patch(color=c, label=k.value) for k, c in colors.items()],
                     loc="upper center", ncols=(len(colors) + 1) // 2, fontsize="small", frameon=False)
        lanes.set_title(title or (f"{self.source} step on {self.hardware}: "
                                  f"{self.step_time_s * scale:.3g} {unit}, {self.tokens_per_s:,.0f} tokens/s, "
                                  f"MFU {self.mfu:.1%}, bottleneck {self.bottleneck.value}"))
        gib = 2.0 ** 30

        def step_xy(curve):
            return [t * scale for t, _ in curve], [b / gib for _, b in curve]

        x, y = step_xy(self.gpu_memory)
        mem.step(x, y, where="post", color="tab:red", label=f"GPU (peak {self.gpu_peak_bytes / gib:.3g} GiB)")
        mem.set_ylabel("GPU memory (GiB)")
        mem.set_xlabel(f"time ({unit})")
        host = mem.twinx()
        x, y = step_xy(self.pinned_memory)
        host.step(x, y, where="post", color="tab:gray", linestyle="--",
                  label=f"pinned host (peak {self.pinned_peak_bytes / gib:.3g} GiB)")
        host.set_ylabel("pinned host memory (GiB)")
        mem.set_ylim(bottom=0)
        host.set_ylim(bottom=0)
        handles = mem.get_legend_handles_labels()[0] + host.get_legend_handles_labels()[0]
        mem.legend(handles=handles, loc="lower right", fontsize="small")
        mem.set_xlim(0, max(self.step_time_s * scale, 1e-12))
        fig.savefig(path, dpi=110)


def measured_timeline(backend, schedule: Schedule, graph: LayerGraph, hw: HardwareSpec) -> Timeline:
    """The last finished run of ``backend`` (a :class:`megatrain.runtime.backend.Backend` whose
    ``record`` was on during it) as a measured Timeline of ``schedule`` (``source="measured"``):
    the backend's timed ops (``backend.last_run``: op index, stream, start and end in seconds, and
    for a CUDA backend's GPU ops when their issue began and ended and its CPU seconds) with the
    memory curves and MFU of this planner's cost model.

    Raises:
        ValueError: the run was not recorded, or it is not a run of ``schedule`` (another number
            of ops, or an op whose label is not the schedule's op at that index).
    """
    recs = backend.last_run
    ops = schedule.ops
    if len(recs) != len(ops):
        raise ValueError(f"the last run launched {len(recs)} ops, but the schedule has {len(ops)}: pass "
                         "the schedule that ran (train and eval schedules differ)")
    for r in recs:
        if r.label and r.label != repr(ops[r.index]):
            raise ValueError(f"launch #{r.index} was labelled {r.label!r}, but op #{r.index} of the schedule "
                             f"is {ops[r.index]!r}: pass the schedule that ran")
    issue = {r.index: (r.issue_start_s, r.issued_s, r.issue_cpu_s) for r in recs if r.issued_s is not None}
    return Timeline.from_records(schedule, graph, [(r.index, r.stream, r.start_s, r.end_s) for r in recs], hw,
                                 source="measured", issue=issue)


def _gpu_curve(recs: list[OpRecord], live: cost.ActivationLiveness,
               fixed: int) -> tuple[tuple[float, int], ...]:
    """Allocated GPU bytes over time: every change comes from a compute op's start or end."""
    cur = fixed + live.at_start
    curve = [(0.0, cur)]
    compute = sorted((r for r in recs if r.stream is Stream.COMPUTE), key=lambda r: (r.start_s, r.index))
    for r in compute:
        cur += live.alloc[r.index] + live.work[r.index]
        curve.append((r.start_s, cur))
        cur -= live.free[r.index] + live.work[r.index]
        curve.append((r.end_s, cur))
    return tuple(curve)


class _RecordModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    index: int
    op: str
    stream: Stream
    start_s: float
    end_s: float
    # Optional, so that timelines written before they were recorded load (bench/results/).
    issue_start_s: float | None = None
    issued_s: float | None = None
    issue_cpu_s: float | None = None


class _TimelineModel(pydantic.BaseModel):
    """JSON boundary of a Timeline."""

    model_config = pydantic.ConfigDict(extra="forbid")
    version: Literal[1] = TIMELINE_FORMAT_VERSION
    source: Literal["simulated", "measured"]
    hardware: str
    compute_dtype: Literal["float32", "bfloat16"]
    step_time_s: float
    tokens_per_step: int
    tokens_per_s: float
    model_flops_per_step: float
    mfu: float
    busy_s: dict[Stream, float]
    bottleneck: Stream
    gpu_peak_bytes: int
    pinned_peak_bytes: int
    gpu_memory: list[tuple[float, int]]
    pinned_memory: list[tuple[float, int]]
    records: list[_RecordModel]
    gpu_busy_s: dict[Stream, float] = {}
    issue_bound_s: dict[Stream, float] = {}
    issue_busy_s: dict[Stream, float] = {}
    issue_blocked_s: dict[Stream, float] = {}

    @classmethod
    def from_timeline(cls, t: Timeline) -> "_TimelineModel":
        return cls(source=t.source, hardware=t.hardware, compute_dtype=t.compute_dtype,
                   step_time_s=t.step_time_s, tokens_per_step=t.tokens_per_step, tokens_per_s=t.tokens_per_s,
                   model_flops_per_step=t.model_flops_per_step, mfu=t.mfu, busy_s=dict(t.busy_s),
                   bottleneck=t.bottleneck, gpu_peak_bytes=t.gpu_peak_bytes,
                   pinned_peak_bytes=t.pinned_peak_bytes, gpu_memory=list(t.gpu_memory),
                   pinned_memory=list(t.pinned_memory),
                   records=[_RecordModel(index=r.index, op=r.op, stream=r.stream, start_s=r.start_s,
                                         end_s=r.end_s, issue_start_s=r.issue_start_s, issued_s=r.issued_s,
                                         issue_cpu_s=r.issue_cpu_s) for r in t.records],
                   gpu_busy_s=dict(t.gpu_busy_s), issue_bound_s=dict(t.issue_bound_s),
                   issue_busy_s=dict(t.issue_busy_s), issue_blocked_s=dict(t.issue_blocked_s))

    def to_timeline(self) -> Timeline:
        return Timeline(source=self.source, hardware=self.hardware, compute_dtype=self.compute_dtype,
                        records=tuple(OpRecord(r.index, r.op, r.stream, r.start_s, r.end_s, r.issue_start_s,
                                               r.issued_s, r.issue_cpu_s) for r in self.records),
                        step_time_s=self.step_time_s, tokens_per_step=self.tokens_per_step,
                        tokens_per_s=self.tokens_per_s, model_flops_per_step=self.model_flops_per_step,
                        mfu=self.mfu, busy_s={s: self.busy_s.get(s, 0.0) for s in Stream},
                        bottleneck=self.bottleneck, gpu_memory=tuple(self.gpu_memory),
                        pinned_memory=tuple(self.pinned_memory), gpu_peak_bytes=self.gpu_peak_bytes,
                        pinned_peak_bytes=self.pinned_peak_bytes, gpu_busy_s=dict(self.gpu_busy_s),
                        issue_bound_s=dict(self.issue_bound_s), issue_busy_s=dict(self.issue_busy_s),
                        issue_blocked_s=dict(self.issue_blocked_s))


__all__ = ["Timeline", "OpRecord", "TIMELINE_FORMAT_VERSION", "measured_timeline"]
