"""The pinned arena of a plan's transient host buffers: the gradient and staging tiles, offloaded
checkpoints and per-layer norms and flags, laid out by ``Schedule.layout.pinned``
(:func:`megatrain.ir.layout.pinned_buffers`) in one page-aligned region and pinned whole, so the
bytes the runtime pins are the planner's ``memory_breakdown(...).host_pinned``, exactly
(``torch.empty(..., pin_memory=True)`` would round every block up to a power of two).
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain.ir.layout import PinnedLayout
from megatrain.runtime.pages import page_aligned_empty


class PinnedArena:
    """One page-aligned host region holding a :class:`~megatrain.ir.layout.PinnedLayout`'s
    tiles, pinned whole through ``backend.host_pin`` (``layout.nbytes`` bytes, exactly).

    ``view(kind, key, dtype)`` is the tile as a 1-D ``dtype`` tensor of ``nbytes // itemsize``
    elements. The pin is released when the arena is dropped.
    """

    def __init__(self, layout: PinnedLayout, backend: Any):
        self.layout = layout
        self.memory = page_aligned_empty(layout.nbytes)
        self._tiles = {(t.kind, t.key): t for t in layout.tiles}
        self._pin = backend.host_pin(self.memory) if layout.nbytes else None

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def has(self, kind: str, key: Any) -> bool:
        return (kind, key) in self._tiles

    def view(self, kind: str, key: Any, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The tile ``(kind, key)`` as ``dtype``. Raises KeyError naming it when the layout has none."""
        t = self._tiles.get((kind, key))
        if t is None:
            raise KeyError(f"the pinned arena has no {kind} tile {key!r}: its layout was made for another "
                           "plan or mode (Schedule.layout.pinned)")
        return self.memory[t.offset:t.offset + t.nbytes].view(dtype)

