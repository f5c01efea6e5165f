"""Persistent host state: one contiguous block per layer holding FP32 master weights and the
optimizer's FP32 state rows (:class:`megatrain.optim.OptimizerSpec`: AdamW's two moments, 12 bytes
per parameter in all; Lion's one, 8; 4 for a layer whose moments live on the NVMe tier, none for
one whose master lives there too, see :class:`HostState`).

:class:`HostState` owns the blocks and reads and writes their rows; it is composed of one part per
concern, each in its own module and understandable alone:

- :mod:`megatrain.runtime.host_layout`: which elements of each layer it holds (whole, or a node's
  slice) and the bytes of each block (:class:`~megatrain.runtime.host_layout.TileLayout`,
  :func:`~megatrain.runtime.host_layout.shared_nbytes`);
- :mod:`megatrain.runtime.host_nvme`: the layers whose state rows (and masters) are in files, their
  names, spans and reads and writes (:class:`~megatrain.runtime.host_nvme.NvmeTier`, ``nvme_rows``);
- :mod:`megatrain.runtime.host_shared`: private or node-shared memory, and the gather and staging
  tiles beside the blocks (:class:`~megatrain.runtime.host_shared.NodeTiles`);
- :mod:`megatrain.runtime.host_pins`: the page-locks of the master rows and staging tiles;
- :mod:`megatrain.runtime.host_rows`: the state-dict rows over NVMe files and node slices.

Binding the user's module to the blocks is :mod:`megatrain.runtime.host_binding`'s, and the
pinned arena of a plan's transient buffers :mod:`megatrain.runtime.pinned_arena`'s; every name
those modules define is importable from here too, as before.

Pinned memory. Only what DMA reads or writes is page-locked, at exact sizes: each block is
ordinary (pageable) memory that starts on a page, and with FP32 compute, where H2D reads the
master row directly, ``HostState.master_pins`` (:class:`~megatrain.runtime.host_pins.RowPins`)
page-locks that row alone (rounded up to whole pages) through the backend's ``host_pin``
(``cudaHostRegister`` on CUDA); the moments are never copied to or from the GPU and stay pageable.
The gradient and staging tiles, offloaded checkpoints and per-layer norms and flags live in one
:class:`PinnedArena` laid out by ``Schedule.layout.pinned`` (:func:`megatrain.ir.layout.pinned_buffers`)
and pinned whole. So the bytes the runtime pins are the planner's ``memory_breakdown(...).host_pinned``,
exactly; ``torch.empty(..., pin_memory=True)`` would instead round every block up to a power of
two (PyTorch's caching host allocator), pinning up to twice the plan's figure.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from megatrain.errors import ConfigError
from megatrain.ir.graph import LayerGraph
from megatrain.ir.layout import MASTER_BYTES_PER_ELEMENT, page_up
from megatrain.optim import ADAMW, OptimizerSpec
# Re-exported from the parts, so that every name is importable from here as before.
from megatrain.runtime.host_binding import (FullMasters, bind_module, materialize_buffers,  # noqa: F401
                                            unbind_parameters, unbind_spilled)
from megatrain.runtime.host_layout import TileLayout, block_bytes, shared_nbytes
from megatrain.runtime.host_nvme import (NvmeShards, NvmeTier, gradient_key, moments_key,  # noqa: F401
                                         state_key)
from megatrain.runtime.host_pins import RowPins
from megatrain.runtime.host_rows import (EXP_AVG, EXP_AVG_SQ, MASTER, NvmeMasterRow,  # noqa: F401
                                         NvmeMomentRow, NvmeRow, SlicedRow, as_tensor)
from megatrain.runtime.host_shared import HostMemory, NodeTiles
# Re-exported: megatrain.runtime.host.page_aligned_empty is where tests and bench/ import it from.
from megatrain.runtime.pages import PAGE_ALIGN, page_aligned_empty, whole_pages  # noqa: F401
from megatrain.runtime.pinned_arena import PinnedArena  # noqa: F401


class HostState:
    """FP32 tiles for every layer: ``blocks[i]`` is a flat float32 tensor of
    ``numel + n_states * trainable_numel`` elements: the master row (every parameter, frozen ones
    included), then the optimizer's state rows of the trainable prefix only, one per name of
    ``optimizer.states`` (:class:`megatrain.optim.OptimizerSpec`; AdamW's ``exp_avg`` and
    ``exp_avg_sq``, Lion's ``exp_avg``), FP32 (frozen parameters, ``requires_grad=False``, are
    laid out after it and have no optimizer state). Page-aligned, contiguous and pageable until
    ``master_pins.pin``. The sections below say "moments" for these rows, and give AdamW's.

    NVMe tier. The layers of ``nvme_moments`` keep their moments in a file each in ``nvme_dir``
    (``<dir>/L<i>.moments.tile``: ``exp_avg`` then ``exp_avg_sq``, FP32, zeros at first) instead:
    their block is the master row alone (``numel`` elements), so :attr:`nbytes` is
    ``8 * trainable_numel`` bytes lower for each. A schedule's NVME_READ brings them into a host
    I/O buffer for the layer's OPT and its NVME_WRITE takes them back (the executor's pool,
    ``layout.nvme_buffers``); outside a run, :meth:`read_moments` and :meth:`write_moments` move them
    between the file and the caller. ``nvme`` is the :class:`~megatrain.runtime.nvme.NvmeStore`
    (None without NVMe layers). The layers of ``nvme_gradients`` (``Plan.nvme_gradients``) get a
    scratch file each for their deferred gradient tile (``<dir>/L<i>.grad.tile``,
    ``trainable_numel * gradient_itemsize`` bytes), which only the schedule's NVMe ops use.
    Under data parallel (``nvme_shards``, :class:`NvmeShards`) each rank's file holds the moments
    of its optimizer shard only, ``<dir>/L<i>.r<rank>.moments.tile`` (``nvme_rows.span``), so the
    node's ranks share one directory; ``read_moments`` / ``write_moments`` move that shard, and
    :class:`NvmeMomentRow` whole rows.

    Masters on NVMe. The layers of ``nvme_masters`` (a subset of ``nvme_moments``) keep their
    master too in their file, before the moments (``<dir>/L<i>.state.tile``: master, ``exp_avg``,
    ``exp_avg_sq``, FP32). Their block holds the master row only until :meth:`spill_masters` (after
    :func:`bind_module` initialised it) writes it to the file and drops it: from then on the block
    is empty, :attr:`nbytes` is ``4 * numel`` lower again, :meth:`master` raises, and
    :meth:`read_master` and the state-dict rows :meth:`master_row` / :meth:`param_row`
    (:class:`NvmeMasterRow`, which also write) go through the file. Every write of such a master
    bumps ``nvme_rows.master_version``, so whoever keeps a copy of it (an executor's BF16 staging tiles)
    knows to refresh it.

    Data parallel. ``shared``: a :class:`megatrain.runtime.distributed.SharedHostMemory` of at least
    :meth:`shared_nbytes` to carve the blocks from (the ranks of a node share it), or None for
    private memory. ``writer``: False on the ranks that map a shared copy another rank fills.

    Slices (``Plan.host_state == "shard"``). ``slices[i] = (lo, hi)``: this node holds only
    elements ``[lo, hi)`` of layer ``i``'s master tile, and the moments of ``[lo, min(hi,
    trainable_numel))`` (``layout.node_slice``); its block is those rows alone, and :meth:`master`,
    :meth:`exp_avg`, :meth:`exp_avg_sq` return them (indexed from ``lo``). None (the default) is
    every layer whole, ``(0, numel)``: one code path for both. A sliced state also carves
    ``layout.GATHER_BUFFERS`` gather tiles of ``gather_bytes`` each (:attr:`gather`, ``uint8``) after
    the blocks, which the schedule's ALL_GATHERs fill with whole layers for the H2D or CAST to read;
    no parameter of the module can be a view of a master it does not hold (:meth:`param_view`
    raises). ``scratch_bytes``: the weight gathers' send and receive buffers
    (:attr:`gather_scratch`, ``layout.gather_scratch_bytes``), shared like the tiles.

    ``staging`` (``Plan.shared_cast``): a BF16 staging tile per layer after the blocks
    (:attr:`staging`, ``[numel]`` each), shared by the node's ranks like the blocks, which each
    rank's CAST fills with its shard and its H2Ds read whole (``staging_pins`` pins them).

    Parts. Each concern is an attribute, which callers use directly: :attr:`tile_layout`
    (:class:`~megatrain.runtime.host_layout.TileLayout`: ``slices``, ``sliced``, ``extent``),
    :attr:`nvme_rows` (:class:`~megatrain.runtime.host_nvme.NvmeTier`: the files' ``key``, ``span``,
    ``master_numel``, ``read_state``, ``read_moment``, ``spilled``, ``master_version``),
    :attr:`node_tiles` (:class:`~megatrain.runtime.host_shared.NodeTiles`), and :attr:`master_pins`
    and :attr:`staging_pins` (:class:`~megatrain.runtime.host_pins.RowPins`: ``pin(backend)``,
    ``release()``, ``nbytes``).

    Raises:
        ConfigError: ``nvme_moments`` or ``nvme_gradients`` without ``nvme_dir``, or naming a layer
            with no trainable parameters; ``nvme_masters`` not within ``nvme_moments``.
        NvmeError: the directory is missing or not writable, or the disk has no room for the files.
    """

    def __init__(self, graph: LayerGraph, nvme_moments: frozenset[int] = frozenset(), nvme_dir: str | None = None,
                 shared: Any = None, writer: bool = True, nvme_gradients: frozenset[int] = frozenset(),
                 gradient_itemsize: int = 4, nvme_masters: frozenset[int] = frozenset(),
                 slices: "list[tuple[int, int]] | None" = None, gather_bytes: int = 0,
                 staging: bool = False, scratch_bytes: int = 0, nvme_shards: NvmeShards | None = None,
                 optimizer: OptimizerSpec = ADAMW):
        self.graph = graph
        self.optimizer = optimizer
        self.n_states = len(optimizer.states)  # FP32 state rows per trainable element
        self.shared = shared
        self.tile_layout = TileLayout.of(graph, slices)
        # Data parallel: the ``runtime.distributed.DataParallelHost`` these tiles were set up with
        # (``materialize``), which later trainers over them (one per batch shape) reuse.
        self.data_parallel: Any = None
        self.nvme_rows = NvmeTier(graph, self.n_states, self.sliced, nvme_moments, nvme_gradients, nvme_masters,
                                  nvme_dir, nvme_shards, gradient_itemsize)
        # The tier's sets and store under the names callers read (all fixed once built).
        self.nvme_moments = self.nvme_rows.moments
        self.nvme_gradients = self.nvme_rows.gradients
        self.nvme_masters = self.nvme_rows.masters
        self.nvme_shards = nvme_shards
        self.nvme = self.nvme_rows.store
        # The order of the takes is the layout of a node's shared mapping: blocks, then NodeTiles.
        memory = HostMemory(shared)
        self.blocks: list[torch.Tensor] = []
        self._rows: list[torch.Tensor | None] = []  # each master row's bytes, whole pages (None: on NVMe)
        for li in range(len(graph.layers)):
            self._take_block(memory, li, writer)
        self.node_tiles = NodeTiles(memory, graph, self.sliced, gather_bytes, scratch_bytes, staging)
        self.gather = self.node_tiles.gather
        self.gather_scratch = self.node_tiles.gather_scratch
        self.staging = self.node_tiles.staging
        # Adam's step count per layer, a tensor because the fused kernel reads it as one.
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in graph.layers]
        # FP32 compute's H2Ds read the master rows (whole pages; None: on NVMe), or a sliced state's
        # gather tiles; the moments are never copied to the GPU and stay pageable. BF16 compute reads
        # the staging tiles instead (the executor releases these pins then).
        self.master_pins = RowPins(self.gather if self.sliced else self._rows)
        # Plan.shared_cast: each rank registers the node's one copy of the staging tiles in its own process.
        self.staging_pins = RowPins(self.node_tiles.staging_rows)

    def _take_block(self, memory: HostMemory, li: int, writer: bool) -> None:
        """Carve layer ``li``'s block (:mod:`megatrain.runtime.host_layout`) and append it and its
        master row's bytes to :attr:`blocks` and ``_rows``."""
        n, t = self.tile_layout.extent(li)
        t = 0 if li in self.nvme_moments else t
        row = page_up(n * MASTER_BYTES_PER_ELEMENT)
        if li in self.nvme_masters and self.shared is None:
            # The master row until spill_masters is the file's own first bytes, mapped: the
            # initialisation writes it through the page cache, which the kernel writes back
            # and reclaims, so a state larger than host memory never is all in it at compile.
            raw = self.nvme.map_tile(state_key(li))
        else:
            raw = memory.take(block_bytes(n, self.n_states * t))
        block = raw[:(n + self.n_states * t) * 4].view(torch.float32)
        if writer and t:
            # The mapping reads as zeros already; writing them faults its pages in now, as an
            # allocation would, rather than at the first read (a checkpoint save, say).
            block[n:].zero_()
        self.blocks.append(block)
        self._rows.append(raw[:row])

    # Pass-throughs that callers outside megatrain.runtime (the trainer, checkpoint, rl and product
    # modules, tests) still use; the runtime itself reads tile_layout and nvme_rows directly.
    shared_nbytes = staticmethod(shared_nbytes)

    @property
    def sliced(self) -> bool:
        """Whether this state holds node slices (``Plan.host_state == "shard"``)."""
        return self.tile_layout.sliced

    @property
    def slices(self) -> list[tuple[int, int]]:
        """``[lo, hi)`` of each layer's master tile this state holds (``TileLayout.slices``)."""
        return list(self.tile_layout.slices)

    def batched_nvme_writes(self) -> contextlib.AbstractContextManager[None]:
        """:meth:`NvmeTier.batched_writes`: within it, a layer's NVMe rows are written back once."""
        return self.nvme_rows.batched_writes()

    def spill_masters(self) -> None:
        """Write the master rows of ``nvme_masters`` (as :func:`bind_module` left them) to their
        files, zero moments after them, and drop the rows (:class:`HostState`, "Masters on NVMe").
        A row that maps its file (private host state: every one) is already there: its dirty
        pages are written back (``fsync``) and the mapping dropped.
        The module's parameters of those layers must no longer view them: :func:`unbind_spilled`
        makes them ``meta`` (``materialize`` calls both). Idempotent."""
        for li in sorted(self.nvme_masters - self.nvme_rows.spilled):
            self.nvme_rows.spill(li, self.master(li))
            self.blocks[li] = torch.empty((0,), dtype=torch.float32)
            self._rows[li] = None
        self.nvme_rows.master_version += 1

    def master(self, layer: int) -> torch.Tensor:
        """``float32[hi - lo]``: the layer's FP32 master weights (frozen parameters included) this
        state holds, elements ``[lo, hi)`` of its tile (``slices[layer]``; the whole tile unless
        sliced), a view. Raises ValueError for a layer whose master lives on NVMe (use
        :meth:`read_master`)."""
        if layer in self.nvme_rows.spilled:
            raise ValueError(f"layer {self.graph.layers[layer].name!r} keeps its FP32 master on NVMe "
                             f"({self.nvme_rows.path(layer)}), not in host memory: read it with "
                             "HostState.read_master, or read and write it through master_row / param_row")
        return self.blocks[layer][:self.tile_layout.extent(layer)[0]]

    def read_master(self, layer: int) -> torch.Tensor:
        """A new ``float32[numel]`` tensor: the layer's master, from host memory or its NVMe file."""
        if layer in self.nvme_rows.spilled:
            return self.nvme_rows.read_state(layer)[:self.graph.layers[layer].numel]
        return self.master(layer).clone()

    def exp_avg(self, layer: int) -> torch.Tensor:
        """``float32[trainable_numel]``: AdamW's first moment of the layer's trainable prefix (a view).
        Raises ValueError for a layer whose moments live on NVMe (use :meth:`read_moments`)."""
        return self._moment(layer, 0)

    def exp_avg_sq(self, layer: int) -> torch.Tensor:
        """``float32[trainable_numel]``: AdamW's second moment of the layer's trainable prefix (a view).
        Raises ValueError for a layer whose moments live on NVMe (use :meth:`read_moments`)."""
        return self._moment(layer, 1)

    def _moment(self, layer: int, k: int) -> torch.Tensor:
        if not 0 <= k < self.n_states:
            raise ValueError(f"{self.optimizer.name} keeps {self.n_states} state rows per parameter "
                             f"{self.optimizer.states}, so there is no row {k}; use HostState.state_rows")
        if layer in self.nvme_moments:
            raise ValueError(f"layer {self.graph.layers[layer].name!r} keeps its Adam moments on NVMe "
                             f"({self.nvme_rows.path(layer)}), not in host memory: read them with "
                             "HostState.read_moments and write them with write_moments")
        n, t = self.tile_layout.extent(layer)
        return self.blocks[layer][n + k * t:n + (k + 1) * t]

    def state_rows(self, layer: int) -> list[torch.Tensor]:
        """The optimizer's state rows of the layer's trainable prefix, ``float32[trainable_numel]``
        views in the order of ``optimizer.states`` (AdamW: ``exp_avg``, ``exp_avg_sq``). Raises
        ValueError for a layer whose moments live on NVMe (use :meth:`read_moments`)."""
        return [self._moment(layer, k) for k in range(self.n_states)]

    def read_moments(self, layer: int) -> torch.Tensor:
        """A new ``float32[n_states * trainable_numel]`` tensor: the layer's optimizer state rows one
        after another (AdamW: ``exp_avg`` then ``exp_avg_sq``), from host memory or from its NVMe
        file. Raises NvmeError (naming the file) when the file is missing or truncated. (Of the
        moment rows this state holds, ``slices``.)"""
        if layer in self.nvme_moments:
            return self.nvme_rows.read_moments(layer)
        t = self.tile_layout.extent(layer)[1]
        out = torch.empty((self.n_states * t,), dtype=torch.float32)
        for k, row in enumerate(self.state_rows(layer)):
            out[k * t:(k + 1) * t].copy_(row)
        return out

    def write_moments(self, layer: int, moments: torch.Tensor) -> None:
        """Set the layer's optimizer state rows from ``moments`` (``float32[n_states *
        trainable_numel]``, in :meth:`read_moments`'s order), in host memory or in its NVMe file
        (written through, waited for)."""
        t = self.tile_layout.extent(layer)[1]
        if tuple(moments.shape) != (self.n_states * t,) or moments.dtype != torch.float32:
            raise ValueError(f"layer {self.graph.layers[layer].name!r}: moments must be "
                             f"float32[{self.n_states * t}], not {moments.dtype} {list(moments.shape)}")
        if layer in self.nvme_moments:
            self.nvme_rows.write_moments(layer, moments)
        else:
            for k, row in enumerate(self.state_rows(layer)):
                row.copy_(moments[k * t:(k + 1) * t])

    def moment_row(self, layer: int, k: int) -> "torch.Tensor | NvmeMomentRow":
        """State row ``k`` (of ``optimizer.states``; AdamW 0: ``exp_avg``, 1: ``exp_avg_sq``) of the
        layer as a state-dict entry: the
        view of its row in host memory, or an :class:`NvmeMomentRow` that reads and writes the file."""
        return NvmeMomentRow(self, layer, k) if layer in self.nvme_moments else self._moment(layer, k)

    def master_row(self, layer: int) -> "torch.Tensor | NvmeMasterRow":
        """The layer's master as a state-dict entry: the view of its row in host memory, or an
        :class:`NvmeMasterRow` over the whole master in its NVMe file."""
        if layer in self.nvme_rows.spilled:
            return NvmeMasterRow(self, layer, 0, self.graph.layers[layer].numel,
                                 (self.graph.layers[layer].numel,), "master")
        return self.master(layer)

    def param_row(self, layer: int, index: int) -> "torch.Tensor | NvmeMasterRow":
        """Parameter ``index`` of the layer as a state-dict entry: :meth:`param_view`, or for a layer
        whose master is on NVMe an :class:`NvmeMasterRow` over the parameter's slice of the file."""
        if layer in self.nvme_rows.spilled:
            spec = self.graph.layers[layer].params[index]
            return NvmeMasterRow(self, layer, spec.offset, spec.numel, tuple(spec.shape), spec.name)
        return self.param_view(layer, index)

    def param_view(self, layer: int, index: int) -> torch.Tensor:
        """Parameter ``index`` of ``layer`` as a view of its master tile. Raises ConfigError on a
        sliced state, which holds no whole tile."""
        if self.sliced:
            raise ConfigError(f"layer {self.graph.layers[layer].name!r}: this node holds elements {self.slices[layer]} "
                              "of its master tile only (Plan.host_state='shard'), so no parameter is a view of it; "
                              "read the weights from a checkpoint (Trainer.save), or train with host_state='replicate'")
        spec = self.graph.layers[layer].params[index]
        return self.master(layer)[spec.offset:spec.offset + spec.numel].view(spec.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the persistent FP32 state in host memory: every master row, and the moment rows of
        the layers not on NVMe (the planner's ``memory_breakdown``'s ``master_weights + adam_moments``); of a
        sliced state, its slices' (``node_memory``'s ``persistent`` for this node, within the
        shards' 64-byte alignment), without the gather tiles."""
        return sum(b.numel() * b.element_size() for b in self.blocks)
