"""Backends: where the executor's ops run, and how streams and events map onto the machine.

The executor walks a Schedule and hands each op to ``Backend.launch`` with the events of its
dependencies on other streams; a backend decides nothing about order. ``CPUBackend`` runs each op
at once on the calling thread (the "device" is the CPU, slots are ordinary tensors, events are
unnecessary); a CUDA backend implements the same interface with one CUDA stream per
:class:`~megatrain.planner.schedule.Stream`, a CUDA event per launched op, and a host worker
thread for the optimizer stream.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch

from megatrain.planner.schedule import Stream


class Backend(Protocol):
    """What the executor needs from a machine."""

    device: torch.device

    def device_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised memory on the compute device (weight slots, gradient slots)."""

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised host memory that the copy engines read and write (pinned on CUDA)."""

    def launch(self, stream: Stream, fn: Callable[[], Any], wait_for: Sequence[Any]) -> Any:
        """Run ``fn`` on ``stream`` after the events in ``wait_for``; return this op's event."""

    def synchronize(self) -> None:
        """Block until everything launched has finished."""


class CPUBackend:
    """Runs every op immediately on the calling thread. Streams and events are no-ops."""

    device = torch.device("cpu")

    def device_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def launch(self, stream: Stream, fn: Callable[[], Any], wait_for: Sequence[Any]) -> None:
        fn()
        return None

    def synchronize(self) -> None:
        return None


def make_backend(device: str) -> Backend:
    """The backend for ``device`` ("cpu" or "cuda"). Raises ConfigError for what is not available."""
    from megatrain.errors import ConfigError

    if device == "cpu":
        return CPUBackend()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device='cuda' was asked for, but torch.cuda.is_available() is False: "
                              "install a CUDA build of torch or use device='cpu'")
        raise ConfigError("the CUDA backend is not implemented yet; use device='cpu'")
    raise ConfigError(f"device={device!r}: use 'cpu' or 'cuda'")
