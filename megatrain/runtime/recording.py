"""What every backend shares: counting a run's launches and timing them. The timed ops of the last
finished run (:attr:`Recording.last_run`) become a measured Timeline in the planner
(:func:`megatrain.planner.timeline.measured_timeline`): the runtime imports no planner module.

Its own module so that :mod:`megatrain.runtime.backend` (the protocol and the CPU backend) and
:mod:`megatrain.runtime.cuda` (the CUDA backend) both build on it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.ir.schedule import Stream


@dataclass(frozen=True, slots=True)
class OpTiming:
    """When one launched op ran, in seconds on one clock per run (any origin).

    ``start_s`` and ``end_s`` bracket the op on its stream: on a GPU stream from the marker recorded
    before its kernels to the one after them, so an op whose issue is slower than its kernels
    lasts about as long as its issue. The CUDA backend also records, for a GPU op, when the issuing
    thread began and ended issuing it (``issue_start_s``, ``issued_s``: every kernel enqueued) and
    that thread's CPU seconds meanwhile (``issue_cpu_s``: the rest of the issue it was off a core,
    waiting for the GIL or for a core); None elsewhere (host ops, the CPU backend)."""

    index: int
    stream: Stream
    label: str
    start_s: float
    end_s: float
    issue_start_s: float | None = None
    issued_s: float | None = None
    issue_cpu_s: float | None = None


class Recording:
    """What both backends share: counting a run's launches and keeping their timings."""

    record: bool = False
    _last: tuple[OpTiming, ...] = ()
    _last_recorded: bool = False

    @property
    def last_records(self) -> tuple[OpTiming, ...]:
        """The timed ops of the last finished run, in launch order (empty when it was not recorded)."""
        return self._last

    @property
    def last_run(self) -> tuple[OpTiming, ...]:
        """The timed ops of the last finished run, in launch order.

        Raises:
            ValueError: the last run was not recorded (``record`` was off at its first launch, or
                it failed).
        """
        if not self._last_recorded:
            raise ValueError(f"{type(self).__name__} did not record the last run: set backend.record = True "
                             "before the step (it is read at the run's first launch), then read it after it")
        return self._last


__all__ = ["OpTiming"]
