"""Page-locking a list of host rows through a backend's ``host_pin`` (``cudaHostRegister`` on
CUDA), at their exact sizes: :class:`~megatrain.runtime.host.HostState` pins its master rows (or a
sliced state's gather tiles) for FP32 H2D copies (``HostState.master_pins``) and the node's shared
staging tiles (``Plan.shared_cast``, ``HostState.staging_pins``) with one :class:`RowPins` each.
"""

from __future__ import annotations

from typing import Any

import torch


class RowPins:
    """The pins of one list of ``rows``, made by one backend. ``rows`` is the host state's own list,
    not a copy, so :meth:`pin` takes its rows as they are then (``None`` where a master was spilled
    to NVMe at compile). :meth:`pin` is idempotent for that backend; pinning for another releases the previous pins
    first. A pin is released when it is dropped (:meth:`release`, or a new :meth:`pin`)."""

    def __init__(self, rows: "list[torch.Tensor | None]") -> None:
        self.rows = rows
        self._pins: list[Any] = []
        self._by: Any = None

    def pin(self, backend: Any) -> None:
        """Page-lock every row of :attr:`rows` through ``backend.host_pin`` (``None``: a row there is
        none of, which stays unpinned)."""
        if self._by is backend:
            return
        self.release()
        self._pins = [None if row is None else backend.host_pin(row) for row in self.rows]
        self._by = backend

    def release(self) -> None:
        """Drop every pin."""
        self._pins = []
        self._by = None

    @property
    def nbytes(self) -> int:
        """Bytes of :attr:`rows` (as they are now, ``uint8``) pinned now: 0 when nothing is, or on a
        backend whose ``host_pin`` pins nothing (returns None)."""
        return sum(r.numel() for r, pin in zip(self.rows, self._pins) if pin is not None)
