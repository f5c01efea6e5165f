"""Where :class:`~megatrain.runtime.host.HostState`'s tiles come from, and the tiles beside its
blocks that data parallel and sliced states add.

:class:`HostMemory` hands out page-aligned byte tensors: private ones, or carved one after another
from a node's :class:`megatrain.runtime.distributed.SharedHostMemory`, which every rank of the node
maps and carves in the same order, so the same tile is at the same offset in every rank (the
blocks first, then :class:`NodeTiles`).

:class:`NodeTiles` are a sliced state's gather tiles and gather scratch, which the schedule's
ALL_GATHERs fill with whole layers, and ``Plan.shared_cast``'s BF16 staging tiles, one per layer,
which each rank's CAST fills with its shard and its H2Ds read whole.
"""

from __future__ import annotations

from typing import Any

import torch

from megatrain.ir.graph import LayerGraph
from megatrain.ir.layout import GATHER_BUFFERS, STAGING_ITEMSIZE
from megatrain.runtime.host_layout import staging_bytes
from megatrain.runtime.pages import PAGE_ALIGN, page_aligned_empty, whole_pages


class HostMemory:
    """Page-aligned host memory from ``shared`` (a ``SharedHostMemory``, or None for private
    allocations, pageable)."""

    def __init__(self, shared: Any):
        self.shared = shared

    def take(self, nbytes: int) -> torch.Tensor:
        """``uint8[nbytes]`` starting on a page: the next ``nbytes`` of the shared mapping, or a new
        private allocation."""
        return page_aligned_empty(nbytes) if self.shared is None else self.shared.take(nbytes, PAGE_ALIGN)


class NodeTiles:
    """The tiles a host state of ``graph`` carves from ``memory`` after its blocks:

    - :attr:`gather`: ``layout.GATHER_BUFFERS`` tiles of ``gather_bytes`` each (``uint8``) when
      ``sliced``, else none;
    - :attr:`gather_scratch`: the weight gathers' send and receive buffers of ``scratch_bytes``
      (``layout.gather_scratch_bytes``) when ``sliced`` and nonzero, else None;
    - :attr:`staging`: with ``staging``, a BF16 tile of ``numel`` elements per layer, in whole pages
      (:attr:`staging_rows`, ``uint8``: what is pinned); else none.
    """

    def __init__(self, memory: HostMemory, graph: LayerGraph, sliced: bool, gather_bytes: int,
                 scratch_bytes: int, staging: bool):
        self.gather: list[torch.Tensor] = []
        if sliced:
            size = whole_pages(gather_bytes)
            self.gather = [memory.take(size)[:gather_bytes] for _ in range(GATHER_BUFFERS)]
        # Shared by the node's ranks so that each casts and copies its share
        # (runtime.distributed.gather_weights).
        self.gather_scratch = (memory.take(whole_pages(scratch_bytes))[:scratch_bytes]
                               if sliced and scratch_bytes else None)
        self.staging_rows: list[torch.Tensor] = [memory.take(staging_bytes(lay.numel))
                                                 for lay in graph.layers] if staging else []
        self.staging: list[torch.Tensor] = [row[:lay.numel * STAGING_ITEMSIZE].view(torch.bfloat16)
                                            for row, lay in zip(self.staging_rows, graph.layers)]
