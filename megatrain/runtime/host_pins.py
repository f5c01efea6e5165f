"""Page-locking a list of host rows through a backend's ``host_pin`` (``cudaHostRegister`` on
CUDA), at their exact sizes: :class:`~megatrain.runtime.host.HostState` pins its master rows (or a
sliced state's gather tiles) for FP32 H2D copies and the node's shared staging tiles
(``Plan.shared_cast``) with one :class:`RowPins` each.
"""

from __future__ import annotations

from typing import Any

import torch


class RowPins:
    """The pins of one list of rows, made by one backend. :meth:`pin` is idempotent for that
    backend; pinning for another releases the previous pins first. A pin is released when it is
    dropped (:meth:`release`, or a new :meth:`pin`)."""

    def __init__(self) -> None:
        self._pins: list[Any] = []
        self._by: Any = None

    def pin(self, backend: Any, rows: "list[torch.Tensor | None]") -> None:
        """Page-lock every row of ``rows`` (``None``: a row there is none of, which stays unpinned)."""
        if self._by is backend:
            return
        self.release()
        self._pins = [None if row is None else backend.host_pin(row) for row in rows]
        self._by = backend

    def release(self) -> None:
        """Drop every pin."""
        self._pins = []
        self._by = None

    def nbytes(self, rows: "list[torch.Tensor | None]") -> int:
        """Bytes of ``rows`` (the list :meth:`pin` was given, as it is now, ``uint8``) pinned now: 0
        when nothing is, or on a backend whose ``host_pin`` pins nothing (returns None)."""
        return sum(r.numel() for r, pin in zip(rows, self._pins) if pin is not None)
