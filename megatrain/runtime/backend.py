"""Backends: where the executor's ops run, and how streams and events map onto the machine.

The executor walks a Schedule and hands each op to ``Backend.launch`` with the handles of its
dependencies on other streams; a backend decides nothing about order. ``CPUBackend`` runs each op
at once on the calling thread (the "device" is the CPU, slots are ordinary tensors, events are
unnecessary). :class:`megatrain.runtime.cuda.CUDABackend` implements the same interface with one
CUDA stream per :class:`~megatrain.ir.schedule.Stream`, a CUDA event per launched op, and a
host worker thread for the optimizer stream.

A *run* is everything launched between two ``synchronize()`` calls; the executor runs one
schedule per run and launches its ops in list order, so the k-th launch of a run is op k of the
schedule. With ``record`` on, a backend times every op of a run, and after ``synchronize()``
``last_run`` holds the timed ops; :func:`megatrain.planner.timeline.measured_timeline` turns
them into the same Timeline the simulator predicts (``source="measured"``), so predicted and
measured steps compare field by field.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, Sequence

import torch

from megatrain.ir.schedule import Stream
from megatrain.runtime.recording import OpTiming, Recording


class Backend(Protocol):
    """What the executor needs from a machine."""

    device: torch.device
    record: bool  # time every op of the next run (read at a run's first launch)

    def device_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised memory on the compute device (weight slots, gradient slots)."""

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised host memory that the copy engines read and write (pinned on CUDA)."""

    def host_pin(self, t: torch.Tensor) -> Any:
        """Page-lock the memory of the contiguous host tensor ``t`` in place, exactly its bytes (its
        first byte on a page, its size whole pages: ``cost.HOST_PAGE_BYTES``), so DMA can read and
        write it; return a handle that releases the pin when dropped (None where nothing is pinned)."""

    def launch(self, stream: Stream, fn: Callable[[], Any], wait_for: Sequence[Any], label: str = "",
               after: Sequence[Any] = ()) -> Any:
        """Run ``fn`` on ``stream`` after the ops whose handles are in ``wait_for``; return this op's handle.
        ``after``: handles of GPU ops that must have finished on the device before this op is issued
        (its issue fences, ``Schedule.issue_after``; nothing to wait for where ops run at once).

        ``label`` names the op in errors and is checked against the schedule by ``measured_timeline``
        (pass ``repr(op)``). A ``None`` in ``wait_for`` stands for an op already complete.
        """

    def record_use(self, tensors: Sequence[torch.Tensor]) -> None:
        """Called from an op's work: ``tensors`` (device memory another op made, perhaps on another
        stream: a checkpoint an OFFLOAD copies out, one a RELOAD brought in) are read by this op, so
        the allocator must not reuse their memory before this op's work on its stream has ended,
        even when they are freed earlier (``Tensor.record_stream``; nothing to do where ops run
        at once)."""

    def synchronize(self) -> None:
        """Block until everything launched has finished; this ends the run (also when it raises)."""

    def abort(self) -> None:
        """End the open run after the caller failed mid-run: wait for what was started, drop the
        rest, so the next launch opens a new run. A no-op without an open run."""

    @property
    def last_run(self) -> "tuple[OpTiming, ...]":
        """The timed ops of the last finished run (needs ``record`` on during the run; ValueError
        where it was not recorded)."""


class CPUBackend(Recording):
    """Runs every op immediately on the calling thread. Streams and events are no-ops.

    With ``record`` on, each op is timed with ``time.perf_counter`` around ``fn``; ops never
    overlap, so the measured Timeline shows the serial CPU step (useful on CI and as the
    reference the CUDA timeline's shape is compared with).
    """

    device = torch.device("cpu")

    def __init__(self, record: bool = False):
        self.record = record
        self._index = 0
        self._run_records: bool | None = None  # None: no run open
        self._pending: list[OpTiming] = []

    def device_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def host_pin(self, t: torch.Tensor) -> None:
        return None  # no DMA on the CPU backend

    def launch(self, stream: Stream, fn: Callable[[], Any], wait_for: Sequence[Any], label: str = "",
               after: Sequence[Any] = ()) -> None:
        if self._run_records is None:
            self._run_records = self.record
        index = self._index
        self._index += 1
        if not self._run_records:
            fn()
            return None
        t0 = time.perf_counter()
        fn()
        self._pending.append(OpTiming(index, stream, label, t0, time.perf_counter()))
        return None

    def record_use(self, tensors: Sequence[torch.Tensor]) -> None:
        pass  # ops ran to completion already

    def abort(self) -> None:
        self._pending = []
        self._index = 0
        self._run_records = None

    def synchronize(self) -> None:
        self._last, self._last_recorded = tuple(self._pending), bool(self._run_records)
        self._pending = []
        self._index = 0
        self._run_records = None


def make_backend(device: str, record: bool = False, host_threads: int | None = None) -> Backend:
    """The backend for ``device`` ("cpu" or "cuda"). Raises ConfigError for what is not available.

    ``record`` turns on per-op timing (see ``Backend.last_run``). ``host_threads``: the intra-op
    threads of the CUDA backend's host workers (``CUDABackend``; the CPU backend runs host ops on
    the calling thread, with its team). Nothing CUDA is created here: the CUDA backend makes its
    streams, events and worker thread at the first launch.
    """
    from megatrain.errors import ConfigError

    if device == "cpu":
        return CPUBackend(record=record)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device='cuda' was asked for, but torch.cuda.is_available() is False: "
                              "install a CUDA build of torch or use device='cpu'")
        from megatrain.runtime.cuda import CUDABackend

        return CUDABackend(record=record, host_threads=host_threads)
    raise ConfigError(f"device={device!r}: use 'cpu' or 'cuda'")


__all__ = ["Backend", "CPUBackend", "OpTiming", "make_backend"]
