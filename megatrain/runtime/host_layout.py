"""The extents and byte sizes of :class:`~megatrain.runtime.host.HostState`'s tiles: how many master
and state-row elements a host state holds of each layer (all of it, or a node's slice), and how many
bytes each block and staging tile takes, so that a node's shared mapping can be sized
(:func:`shared_nbytes`) before any tile is carved from it.

A layer's block is its master row (``numel`` FP32 elements, frozen parameters included), rounded up
to whole pages so that it can be pinned alone, followed by ``n_states`` FP32 state rows of its
trainable prefix (none for a layer whose state rows are on NVMe); the block is whole pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.errors import ConfigError
from megatrain.ir.graph import LayerGraph
from megatrain.ir.layout import GATHER_BUFFERS, MASTER_BYTES_PER_ELEMENT, STAGING_ITEMSIZE, page_up
from megatrain.optim import ADAMW, OptimizerSpec
from megatrain.runtime.pages import PAGE_ALIGN, whole_pages


def block_bytes(numel: int, moments: int) -> int:
    """Bytes of a layer's block mapping: its master row of ``numel`` elements (rounded up to whole
    pages, so the row can be pinned alone) and ``moments`` FP32 elements of Adam moments (0 for a
    layer whose moments are on NVMe), rounded up to whole pages."""
    size = max((numel + moments) * 4, page_up(numel * MASTER_BYTES_PER_ELEMENT))
    return -(-size // PAGE_ALIGN) * PAGE_ALIGN


def staging_bytes(numel: int) -> int:
    """Bytes of a shared BF16 staging tile of ``numel`` elements in the mapping: whole pages."""
    return whole_pages(numel * STAGING_ITEMSIZE)


@dataclass(frozen=True, slots=True)
class TileLayout:
    """Which elements of each layer of ``graph`` a host state holds: ``slices[i] = (lo, hi)``,
    elements ``[lo, hi)`` of layer ``i``'s master tile and the state rows of ``[lo, min(hi,
    trainable_numel))`` (``layout.node_slice``); ``sliced`` False is every layer whole, ``(0,
    numel)``. Build it with :meth:`of`, which checks the slices.

    Raises:
        ConfigError: a slice that is not within its layer's tile, or not one per layer.
    """

    graph: LayerGraph
    slices: tuple[tuple[int, int], ...]
    sliced: bool

    def __post_init__(self) -> None:
        layers = self.graph.layers
        if len(self.slices) != len(layers) or any(
                not 0 <= lo <= hi <= lay.numel for (lo, hi), lay in zip(self.slices, layers)):
            raise ConfigError(f"HostState slices {list(self.slices)} do not fit the graph's {len(layers)} layers "
                              f"of {[lay.numel for lay in layers]} elements: give one [lo, hi) within each "
                              "layer's tile (layout.node_slice)")

    @classmethod
    def of(cls, graph: LayerGraph, slices: "list[tuple[int, int]] | None") -> "TileLayout":
        """The layout of ``slices`` of ``graph``, or of every layer whole when None."""
        whole = [(0, lay.numel) for lay in graph.layers]
        return cls(graph, tuple(tuple(s) for s in (whole if slices is None else slices)), slices is not None)

    def extent(self, layer: int) -> tuple[int, int]:
        """(master elements, elements per state row) held of ``layer``."""
        lo, hi = self.slices[layer]
        return hi - lo, max(0, min(hi, self.graph.layers[layer].trainable_numel) - lo)


def shared_nbytes(graph: LayerGraph, slices: "list[tuple[int, int]] | None" = None, gather_bytes: int = 0,
                  staging: bool = False, scratch_bytes: int = 0,
                  nvme_moments: frozenset[int] = frozenset(), optimizer: OptimizerSpec = ADAMW) -> int:
    """Bytes of shared memory the blocks of ``graph`` take (every layer's moments in them but those
    of ``nvme_moments``, which are in the ranks' NVMe files; of ``slices`` only, with the gather
    tiles of ``gather_bytes`` each), with ``staging`` a BF16 staging tile per layer too
    (``Plan.shared_cast``), and with ``slices`` the gathers' scratch of ``scratch_bytes``
    (``layout.gather_scratch_bytes``): each rounded up to whole pages. ``optimizer``: the spec whose
    state rows the blocks hold."""
    k = len(optimizer.states)
    if slices is None:
        tiles = sum(staging_bytes(lay.numel) for lay in graph.layers) if staging else 0
        return tiles + sum(block_bytes(lay.numel, 0 if li in nvme_moments else k * lay.trainable_numel)
                           for li, lay in enumerate(graph.layers))
    tiles = GATHER_BUFFERS * whole_pages(gather_bytes)
    tiles += whole_pages(scratch_bytes) if scratch_bytes else 0
    return tiles + sum(block_bytes(hi - lo, k * max(0, min(hi, lay.trainable_numel) - lo))
                       for (lo, hi), lay in zip(slices, graph.layers))
