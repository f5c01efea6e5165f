"""What every backend shares: counting a run's launches, timing them, and turning the timings of
the last finished run into a measured :class:`~megatrain.planner.timeline.Timeline`.

Its own module so that :mod:`megatrain.runtime.backend` (the protocol and the CPU backend) and
:mod:`megatrain.runtime.cuda` (the CUDA backend) both build on it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.ir.graph import LayerGraph
from megatrain.ir.hardware import HardwareSpec
from megatrain.ir.schedule import Schedule, Stream
from megatrain.planner.timeline import Timeline


@dataclass(frozen=True, slots=True)
class OpTiming:
    """When one launched op ran, in seconds on one clock per run (any origin)."""

    index: int
    stream: Stream
    label: str
    start_s: float
    end_s: float


class _Recording:
    """What both backends share: counting a run's launches and turning its timings into a Timeline."""

    record: bool = False
    _last: tuple[OpTiming, ...] = ()
    _last_recorded: bool = False

    @property
    def last_records(self) -> tuple[OpTiming, ...]:
        """The timed ops of the last finished run, in launch order (empty when it was not recorded)."""
        return self._last

    def timeline(self, schedule: Schedule, graph: LayerGraph, hw: HardwareSpec) -> Timeline:
        """The last finished run as a measured Timeline of ``schedule``.

        Raises:
            ValueError: the run was not recorded, or it is not a run of ``schedule`` (another
                number of ops, or an op whose label is not the schedule's op at that index).
        """
        if not self._last_recorded:
            raise ValueError(f"{type(self).__name__} did not record the last run: set backend.record = True "
                             "before the step (it is read at the run's first launch), then call timeline() "
                             "after it")
        recs = self._last
        ops = schedule.ops
        if len(recs) != len(ops):
            raise ValueError(f"the last run launched {len(recs)} ops, but the schedule has {len(ops)}: pass "
                             "the schedule that ran (train and eval schedules differ)")
        for r in recs:
            if r.label and r.label != repr(ops[r.index]):
                raise ValueError(f"launch #{r.index} was labelled {r.label!r}, but op #{r.index} of the schedule "
                                 f"is {ops[r.index]!r}: pass the schedule that ran")
        return Timeline.from_records(schedule, graph, [(r.index, r.stream, r.start_s, r.end_s) for r in recs],
                                     hw, source="measured")


__all__ = ["OpTiming"]
