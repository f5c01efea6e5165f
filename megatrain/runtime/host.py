"""Persistent host state: one contiguous block per layer holding FP32 master weights and the
optimizer's FP32 state rows (:class:`megatrain.optim.OptimizerSpec`: AdamW's two moments, 12 bytes
per parameter in all; Lion's one, 8; 4 for a layer whose moments live on the NVMe tier, none for
one whose master lives there too, see :class:`HostState`), plus binding the user's module to it,
and the pinned arena of a plan's transient host buffers.

After binding, every parameter of the user's module is a view into its layer's master tile, so
the module holds no storage of its own, ``model.state_dict()`` reads the trained weights, and host
memory is not doubled. (A layer whose master lives on NVMe has no tile to view: its parameters
become ``meta`` tensors, :func:`unbind_spilled`, and ``Trainer.state_dict()`` reads its weights.)

Pinned memory. Only what DMA reads or writes is page-locked, at exact sizes: each block is
ordinary (pageable) memory that starts on a page, and with FP32 compute, where H2D reads the
master row directly, :meth:`HostState.pin_masters` page-locks that row alone (rounded up to whole
pages) through the backend's ``host_pin`` (``cudaHostRegister`` on CUDA); the moments are never
copied to or from the GPU and stay pageable. The gradient and staging tiles, offloaded
checkpoints and per-layer norms and flags live in one :class:`PinnedArena` laid out by
``Schedule.layout.pinned`` (:func:`megatrain.ir.layout.pinned_buffers`) and pinned whole. So the
bytes the runtime pins are the planner's ``memory_breakdown(...).host_pinned``, exactly;
``torch.empty(..., pin_memory=True)`` would instead round every block up to a power of two
(PyTorch's caching host allocator), pinning up to twice the plan's figure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megatrain.errors import ConfigError, UnsupportedModelError
from megatrain.optim import ADAMW, OptimizerSpec
from megatrain.ir.layout import (GATHER_BUFFERS, MASTER_BYTES_PER_ELEMENT, STAGING_ITEMSIZE,
                                 PinnedLayout, optimizer_shard, page_up)
from megatrain.ir.graph import LayerGraph
# Re-exported: megatrain.runtime.host.page_aligned_empty is where tests and bench/ import it from.
from megatrain.runtime.pages import PAGE_ALIGN, page_aligned_empty, whole_pages

def _block_bytes(numel: int, moments: int) -> int:
    """Bytes of a layer's block mapping: its master row of ``numel`` elements (rounded up to whole
    pages, so the row can be pinned alone) and ``moments`` FP32 elements of Adam moments (0 for a
    layer whose moments are on NVMe), rounded up to whole pages."""
    size = max((numel + moments) * 4, page_up(numel * MASTER_BYTES_PER_ELEMENT))
    return -(-size // PAGE_ALIGN) * PAGE_ALIGN


def _staging_bytes(numel: int) -> int:
    """Bytes of a shared BF16 staging tile of ``numel`` elements in the mapping: whole pages."""
    return whole_pages(numel * STAGING_ITEMSIZE)


def moments_key(layer: int, rank: int | None = None) -> str:
    """The NVMe tile (file ``<key>.tile``) of layer ``layer``'s two Adam moments; under data parallel
    (``rank``: the global rank whose optimizer shard the file holds, :class:`NvmeShards`)
    ``L<layer>.r<rank>.moments``, so the ranks of a node share one directory."""
    return f"L{layer}.moments" if rank is None else f"L{layer}.r{rank}.moments"


@dataclass(frozen=True, slots=True)
class NvmeShards:
    """Which part of each layer's Adam moments this rank's NVMe files hold under data parallel
    (``Plan.nvme_moments`` with ``data_parallel > 1``): its optimizer shard
    (``layout.optimizer_shard(trainable_numel, ways, index)``: the whole tile where each rank steps a
    copy of its own, ``ways`` 1; its ``1 / ways`` where the node's ``ways`` ranks share one copy),
    in files named by its global ``rank`` (:func:`moments_key`). The node's ranks are global ranks
    ``first .. first + ways - 1`` holding shards ``0 .. ways - 1``, so together the files in one
    node's directory hold every layer's whole moments (every node holds the same state): any rank
    reads a whole row from them without a collective (:class:`NvmeMomentRow`)."""

    rank: int
    ways: int
    index: int
    first: int

    def __post_init__(self) -> None:
        if not (self.ways >= 1 and 0 <= self.index < self.ways and self.first <= self.rank):
            raise ConfigError(f"NvmeShards(rank={self.rank}, ways={self.ways}, index={self.index}, "
                              f"first={self.first}): the shard index is in [0, ways) and the node's first rank is "
                              "at most this rank")

    def span(self, trainable_numel: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of the layer's moment rows this rank's file holds."""
        return optimizer_shard(trainable_numel, self.ways, self.index)

    def peers(self, trainable_numel: int) -> list[tuple[int, tuple[int, int]]]:
        """``(global rank, [lo, hi))`` of each of the node's files that together hold the whole rows."""
        if self.ways == 1:
            return [(self.rank, (0, trainable_numel))]
        return [(self.first + k, optimizer_shard(trainable_numel, self.ways, k)) for k in range(self.ways)]


def state_key(layer: int) -> str:
    """The NVMe tile (file ``<key>.tile``) of layer ``layer``'s FP32 master and two Adam moments,
    in that order (``Plan.nvme_masters``: one file, so one read and one write per step)."""
    return f"L{layer}.state"


def gradient_key(layer: int) -> str:
    """The NVMe tile (file ``<key>.tile``) of layer ``layer``'s deferred gradient tile
    (``Plan.nvme_gradients``): its step gradients between the D2H and the next step's OPT."""
    return f"L{layer}.grad"


class HostState:
    """FP32 tiles for every layer: ``blocks[i]`` is a flat float32 tensor of
    ``numel + n_states * trainable_numel`` elements: the master row (every parameter, frozen ones
    included), then the optimizer's state rows of the trainable prefix only, one per name of
    ``optimizer.states`` (:class:`megatrain.optim.OptimizerSpec`; AdamW's ``exp_avg`` and
    ``exp_avg_sq``, Lion's ``exp_avg``), FP32 (frozen parameters, ``requires_grad=False``, are
    laid out after it and have no optimizer state). Page-aligned, contiguous and pageable until
    :meth:`pin_masters`. The sections below say "moments" for these rows, and give AdamW's.

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
    of its optimizer shard only, ``<dir>/L<i>.r<rank>.moments.tile`` (:meth:`nvme_span`), so the
    node's ranks share one directory; ``read_moments`` / ``write_moments`` move that shard, and
    :class:`NvmeMomentRow` whole rows.

    Masters on NVMe. The layers of ``nvme_masters`` (a subset of ``nvme_moments``) keep their
    master too in their file, before the moments (``<dir>/L<i>.state.tile``: master, ``exp_avg``,
    ``exp_avg_sq``, FP32). Their block holds the master row only until :meth:`spill_masters` (after
    :func:`bind_module` initialised it) writes it to the file and drops it: from then on the block
    is empty, :attr:`nbytes` is ``4 * numel`` lower again, :meth:`master` raises, and
    :meth:`read_master` and the state-dict rows :meth:`master_row` / :meth:`param_row`
    (:class:`NvmeMasterRow`, which also write) go through the file. Every write of such a master
    bumps :attr:`master_version`, so whoever keeps a copy of it (an executor's BF16 staging tiles)
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
    rank's CAST fills with its shard and its H2Ds read whole (:meth:`pin_staging` pins them).

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
        self.sliced = slices is not None
        self.slices = list(slices) if slices is not None else [(0, lay.numel) for lay in graph.layers]
        if len(self.slices) != len(graph.layers) or any(
                not 0 <= lo <= hi <= lay.numel for (lo, hi), lay in zip(self.slices, graph.layers)):
            raise ConfigError(f"HostState slices {self.slices} do not fit the graph's {len(graph.layers)} layers "
                              f"of {[lay.numel for lay in graph.layers]} elements: give one [lo, hi) within each "
                              "layer's tile (layout.node_slice)")
        # Data parallel: the ``runtime.distributed.DataParallelHost`` these tiles were set up with
        # (``materialize``), which later trainers over them (one per batch shape) reuse.
        self.data_parallel: Any = None
        self.nvme_moments = frozenset(nvme_moments)
        self.nvme_gradients = frozenset(nvme_gradients)
        self.nvme_masters = frozenset(nvme_masters)
        self.nvme_shards = nvme_shards
        if nvme_shards is not None and (self.nvme_masters or self.nvme_gradients or self.sliced):
            raise ConfigError(f"HostState: per-rank NVMe files (nvme_shards) hold Adam moments only, of whole tiles; "
                              f"masters {sorted(self.nvme_masters)} or gradient tiles {sorted(self.nvme_gradients)} on "
                              "NVMe, or a sliced state, are not run under data parallel: drop them")
        if not self.nvme_masters <= self.nvme_moments:
            raise ConfigError(f"nvme_masters names layers {sorted(self.nvme_masters - self.nvme_moments)} whose Adam "
                              "moments are in host memory: a layer's master shares its NVMe file with its moments; "
                              "add them to nvme_moments")
        self.spilled: frozenset[int] = frozenset()  # nvme_masters layers whose master row was dropped
        self._batch: tuple[int, torch.Tensor | None] | None = None  # batched_nvme_writes: (layer, its file)
        self.master_version = 0  # bumped by every write of a master on NVMe
        for what, layers in (("nvme_moments", self.nvme_moments), ("nvme_gradients", self.nvme_gradients)):
            bad = sorted(i for i in layers if not 0 <= i < len(graph.layers) or graph.layers[i].trainable_numel == 0)
            if bad:
                raise ConfigError(f"{what} names layers {bad}, which have no trainable parameters in this graph of "
                                  f"{len(graph.layers)} layers; put only trainable layers on NVMe")
        if (self.nvme_moments or self.nvme_gradients) and nvme_dir is None:
            raise ConfigError(f"the Adam moments of layers {sorted(self.nvme_moments)} and the gradient tiles of "
                              f"layers {sorted(self.nvme_gradients)} go to NVMe but no NVMe directory was given: "
                              "pass nvme_dir= (an existing directory on an NVMe drive)")
        self.nvme = None
        if self.nvme_moments or self.nvme_gradients:
            from megatrain.runtime.nvme import NvmeStore  # lazily: only a plan with state on NVMe needs it

            # A rank's file of an empty shard (the last of a small layer) still has a block: the
            # schedule's NVMe ops move it like any other.
            sizes = {self.nvme_key(li): max(4, (self.nvme_master_numel(li) + self.n_states * self.nvme_numel(li)) * 4)
                     for li in sorted(self.nvme_moments)}
            sizes.update({gradient_key(li): graph.layers[li].trainable_numel * gradient_itemsize
                          for li in sorted(self.nvme_gradients)})
            self.nvme = NvmeStore(nvme_dir, sizes)
        self.blocks: list[torch.Tensor] = []
        self._rows: list[torch.Tensor | None] = []  # each master row's bytes, whole pages (None: on NVMe)
        for li, layer in enumerate(graph.layers):
            n, t = self._extent(li)
            t = 0 if li in self.nvme_moments else t
            row = page_up(n * MASTER_BYTES_PER_ELEMENT)
            size = _block_bytes(n, self.n_states * t)
            if li in self.nvme_masters and shared is None:
                # The master row until spill_masters is the file's own first bytes, mapped: the
                # initialisation writes it through the page cache, which the kernel writes back
                # and reclaims, so a state larger than host memory never is all in it at compile.
                raw = self.nvme.map_tile(state_key(li))
            else:
                raw = page_aligned_empty(size) if shared is None else shared.take(size, PAGE_ALIGN)
            block = raw[:(n + self.n_states * t) * 4].view(torch.float32)
            if writer and t:
                # The mapping reads as zeros already; writing them faults its pages in now, as an
                # allocation would, rather than at the first read (a checkpoint save, say).
                block[n:].zero_()
            self.blocks.append(block)
            self._rows.append(raw[:row])
        self.gather: list[torch.Tensor] = []
        if self.sliced:
            size = whole_pages(gather_bytes)
            self.gather = [(page_aligned_empty(size) if shared is None else shared.take(size, PAGE_ALIGN))[:gather_bytes]
                           for _ in range(GATHER_BUFFERS)]
        # The weight gathers' send and receive buffers (layout.gather_scratch_bytes), shared by the
        # node's ranks so that each casts and copies its share (runtime.distributed.gather_weights).
        self.gather_scratch = ((page_aligned_empty(whole_pages(scratch_bytes)) if shared is None
                                else shared.take(whole_pages(scratch_bytes), PAGE_ALIGN))[:scratch_bytes]
                               if self.sliced and scratch_bytes else None)
        # Plan.shared_cast: a BF16 staging tile per layer after the blocks, in the node's shared
        # mapping, into which each rank casts its shard (its own H2Ds read the whole tile).
        # Whole pages each (``_staging_rows``, what is pinned), viewed as ``numel`` BF16 elements.
        self._staging_rows: list[torch.Tensor] = [
            page_aligned_empty(_staging_bytes(lay.numel)) if shared is None
            else shared.take(_staging_bytes(lay.numel), PAGE_ALIGN) for lay in graph.layers] if staging else []
        self.staging: list[torch.Tensor] = [row[:lay.numel * STAGING_ITEMSIZE].view(torch.bfloat16)
                                            for row, lay in zip(self._staging_rows, graph.layers)]
        self._staging_pins: list[Any] = []
        self._staging_pinned_by: Any = None
        # Adam's step count per layer, a tensor because the fused kernel reads it as one.
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in graph.layers]
        self._pins: list[Any] = []
        self._pinned_by: Any = None

    @staticmethod
    def shared_nbytes(graph: LayerGraph, slices: "list[tuple[int, int]] | None" = None, gather_bytes: int = 0,
                      staging: bool = False, scratch_bytes: int = 0,
                      nvme_moments: frozenset[int] = frozenset(), optimizer: OptimizerSpec = ADAMW) -> int:
        """Bytes of shared memory the blocks of ``graph`` take (every layer's moments in them but
        those of ``nvme_moments``, which are in the ranks' NVMe files; of ``slices`` only, with the
        gather tiles of ``gather_bytes`` each), with ``staging`` a BF16 staging tile per layer too
        (``Plan.shared_cast``), and with ``slices`` the gathers' scratch of ``scratch_bytes``
        (``layout.gather_scratch_bytes``): each rounded up to whole pages. ``optimizer``: the spec whose
        state rows the blocks hold."""
        k = len(optimizer.states)
        if slices is None:
            tiles = sum(_staging_bytes(lay.numel) for lay in graph.layers) if staging else 0
            return tiles + sum(_block_bytes(lay.numel, 0 if li in nvme_moments else k * lay.trainable_numel)
                               for li, lay in enumerate(graph.layers))
        tiles = GATHER_BUFFERS * whole_pages(gather_bytes)
        tiles += whole_pages(scratch_bytes) if scratch_bytes else 0
        return tiles + sum(_block_bytes(hi - lo, k * max(0, min(hi, lay.trainable_numel) - lo))
                           for (lo, hi), lay in zip(slices, graph.layers))

    def _extent(self, layer: int) -> tuple[int, int]:
        """(master elements, moment elements per moment) this state holds of ``layer``."""
        lo, hi = self.slices[layer]
        return hi - lo, max(0, min(hi, self.graph.layers[layer].trainable_numel) - lo)

    def nvme_key(self, layer: int) -> str:
        """The NVMe tile of a layer of ``nvme_moments``: :func:`state_key` when its master is there
        too, else :func:`moments_key` (of this rank under data parallel, ``nvme_shards``)."""
        if layer in self.nvme_masters:
            return state_key(layer)
        return moments_key(layer, None if self.nvme_shards is None else self.nvme_shards.rank)

    def nvme_span(self, layer: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of the layer's moment rows its NVMe file holds: all of them, or
        under data parallel this rank's optimizer shard (:class:`NvmeShards`)."""
        t = self.graph.layers[layer].trainable_numel
        return (0, t) if self.nvme_shards is None else self.nvme_shards.span(t)

    def nvme_numel(self, layer: int) -> int:
        """FP32 elements of each moment row in the layer's NVMe file and I/O buffer (``hi - lo`` of
        :meth:`nvme_span`)."""
        lo, hi = self.nvme_span(layer)
        return hi - lo

    def nvme_master_numel(self, layer: int) -> int:
        """FP32 elements of master before the moments in the layer's NVMe file (its ``numel`` for a
        layer of ``nvme_masters``, else 0) and in the I/O buffer its NVME_READ fills."""
        return self.graph.layers[layer].numel if layer in self.nvme_masters else 0

    def spill_masters(self) -> None:
        """Write the master rows of ``nvme_masters`` (as :func:`bind_module` left them) to their
        files, zero moments after them, and drop the rows (:class:`HostState`, "Masters on NVMe").
        A row that maps its file (private host state: every one) is already there: its dirty
        pages are written back (``fsync``) and the mapping dropped.
        The module's parameters of those layers must no longer view them: :func:`unbind_spilled`
        makes them ``meta`` (``materialize`` calls both). Idempotent."""
        for li in sorted(self.nvme_masters - self.spilled):
            if self.nvme.is_mapped(state_key(li)):
                # The row is the file's mapping (__init__): the master is in the file already and
                # the moments after it are the zeros the file was made with.
                self.nvme.sync(state_key(li))
            else:
                lay = self.graph.layers[li]
                state = torch.zeros((lay.numel + self.n_states * lay.trainable_numel,), dtype=torch.float32)
                state[:lay.numel].copy_(self.master(li))
                self.nvme.write_tensor(state_key(li), state)
            self.blocks[li] = torch.empty((0,), dtype=torch.float32)
            self._rows[li] = None
            self.spilled = self.spilled | {li}
        self.master_version += 1

    def master(self, layer: int) -> torch.Tensor:
        """``float32[hi - lo]``: the layer's FP32 master weights (frozen parameters included) this
        state holds, elements ``[lo, hi)`` of its tile (``slices[layer]``; the whole tile unless
        sliced), a view. Raises ValueError for a layer whose master lives on NVMe (use
        :meth:`read_master`)."""
        if layer in self.spilled:
            raise ValueError(f"layer {self.graph.layers[layer].name!r} keeps its FP32 master on NVMe "
                             f"({self.nvme.tiles[state_key(layer)].path}), not in host memory: read it with "
                             "HostState.read_master, or read and write it through master_row / param_row")
        return self.blocks[layer][:self._extent(layer)[0]]

    def read_state(self, layer: int) -> torch.Tensor:
        """A new ``float32`` tensor of the layer's NVMe file: master (``nvme_masters`` only) then
        ``exp_avg`` and ``exp_avg_sq`` (inside :meth:`batched_nvme_writes`, with its writes not yet
        written back). Raises NvmeError (naming the file) when it is missing or truncated."""
        if self._batch is not None and self._batch[0] == layer:
            return self._batch[1].clone()
        out = torch.empty((self.nvme_master_numel(layer) + self.n_states * self.nvme_numel(layer),),
                          dtype=torch.float32)
        self.nvme.read_tensor(self.nvme_key(layer), out)
        return out

    def read_moment(self, layer: int, k: int) -> torch.Tensor:
        """A new ``float32[trainable_numel]``: moment ``k`` (0: ``exp_avg``, 1: ``exp_avg_sq``) of a
        layer of ``nvme_moments``, whole: from this rank's file, or under data parallel from the
        files of the node's ranks (:meth:`NvmeShards.peers`), read directly (they share the
        directory; the caller makes sure no rank is writing them, as ``Trainer.save`` does with a
        barrier). Raises NvmeError naming a file that is missing or truncated."""
        t = self.graph.layers[layer].trainable_numel
        if self.nvme_shards is None or self.nvme_shards.ways == 1:
            s = self.nvme_numel(layer)
            return self.read_state(layer)[self.nvme_master_numel(layer) + k * s:][:s].clone()
        out = torch.empty((t,), dtype=torch.float32)
        for rank, (lo, hi) in self.nvme_shards.peers(t):
            part = self.nvme.read_foreign(moments_key(layer, rank), max(4, self.n_states * (hi - lo) * 4))
            out[lo:hi].copy_(part.view(torch.float32)[k * (hi - lo):(k + 1) * (hi - lo)])
        return out

    @contextlib.contextmanager
    def batched_nvme_writes(self) -> Iterator[None]:
        """Within it, writes of NVMe rows (:class:`NvmeRow` ``copy_``) of one layer after another go
        into one copy of the layer's file in memory, written back when a row of another layer is
        written and at the end: one read and one write of a layer's file for all its rows, instead
        of one of each per row (a checkpoint load writes a layer's master, its parameters and its
        moments row by row: at 120B scale, gigabytes per row). Holds at most one layer's file in
        memory. Nested uses join the outer one."""
        if self._batch is not None:
            yield
            return
        self._batch = (-1, None)
        try:
            yield
        finally:
            self._write_back_batch()
            self._batch = None

    def _write_back_batch(self) -> None:
        """Write the batch's staged layer (if any) to its file and leave the batch empty."""
        staged, self._batch = self._batch, (-1, None)
        if staged[1] is not None:
            self._write_state(*staged)

    def _state_to_write(self, layer: int) -> torch.Tensor:
        """The layer's file contents for an :class:`NvmeRow` to change: the batch's copy
        (:meth:`batched_nvme_writes`; the previous layer's is written back first), or a new read."""
        if self._batch is None:
            return self.read_state(layer)
        if self._batch[0] != layer:
            self._write_back_batch()
            self._batch = (layer, self.read_state(layer))
        return self._batch[1]

    def _write_state(self, layer: int, state: torch.Tensor) -> None:
        self.nvme.write_tensor(self.nvme_key(layer), state)
        if layer in self.nvme_masters:
            self.master_version += 1

    def read_master(self, layer: int) -> torch.Tensor:
        """A new ``float32[numel]`` tensor: the layer's master, from host memory or its NVMe file."""
        if layer in self.spilled:
            return self.read_state(layer)[:self.graph.layers[layer].numel]
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
                             f"({self.nvme.tiles[self.nvme_key(layer)].path}), not in host memory: read them with "
                             "HostState.read_moments and write them with write_moments")
        n, t = self._extent(layer)
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
        t = self.nvme_numel(layer) if layer in self.nvme_moments else self._extent(layer)[1]
        out = torch.empty((self.n_states * t,), dtype=torch.float32)
        if layer in self.nvme_masters:
            out.copy_(self.read_state(layer)[self.nvme_master_numel(layer):])
        elif layer in self.nvme_moments:
            self.nvme.read_tensor(self.nvme_key(layer), out)
        else:
            for k, row in enumerate(self.state_rows(layer)):
                out[k * t:(k + 1) * t].copy_(row)
        return out

    def write_moments(self, layer: int, moments: torch.Tensor) -> None:
        """Set the layer's optimizer state rows from ``moments`` (``float32[n_states *
        trainable_numel]``, in :meth:`read_moments`'s order), in host memory or in its NVMe file
        (written through, waited for)."""
        t = self._extent(layer)[1]
        if tuple(moments.shape) != (self.n_states * t,) or moments.dtype != torch.float32:
            raise ValueError(f"layer {self.graph.layers[layer].name!r}: moments must be "
                             f"float32[{self.n_states * t}], not {moments.dtype} {list(moments.shape)}")
        if layer in self.nvme_masters:
            state = self.read_state(layer)
            state[self.nvme_master_numel(layer):].copy_(moments)
            self.nvme.write_tensor(state_key(layer), state)  # the master is unchanged: no version bump
        elif layer in self.nvme_moments:
            self.nvme.write_tensor(self.nvme_key(layer), moments)
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
        if layer in self.spilled:
            return NvmeMasterRow(self, layer, 0, self.graph.layers[layer].numel,
                                 (self.graph.layers[layer].numel,), "master")
        return self.master(layer)

    def param_row(self, layer: int, index: int) -> "torch.Tensor | NvmeMasterRow":
        """Parameter ``index`` of the layer as a state-dict entry: :meth:`param_view`, or for a layer
        whose master is on NVMe an :class:`NvmeMasterRow` over the parameter's slice of the file."""
        if layer in self.spilled:
            spec = self.graph.layers[layer].params[index]
            return NvmeMasterRow(self, layer, spec.offset, spec.numel, tuple(spec.shape), spec.name)
        return self.param_view(layer, index)

    @property
    def nbytes(self) -> int:
        """Bytes of the persistent FP32 state in host memory: every master row, and the moment rows of
        the layers not on NVMe (the planner's ``memory_breakdown``'s ``master_weights + adam_moments``); of a
        sliced state, its slices' (``node_memory``'s ``persistent`` for this node, within the
        shards' 64-byte alignment), without the gather tiles."""
        return sum(b.numel() * b.element_size() for b in self.blocks)

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of master rows pinned now: ``layout.pinned_master_bytes`` of an FP32 plan on a backend
        that pins (the CPU backend pins nothing), or 0."""
        return sum(r.numel() for r, pin in zip(self.gather if self.sliced else self._rows, self._pins) if pin is not None)

    def pin_masters(self, backend: Any) -> None:
        """Page-lock every layer's master row, rounded up to whole pages, through
        ``backend.host_pin`` (so FP32 H2D copies read them by DMA); the moments stay pageable.
        Idempotent for one backend; pinning for another backend releases the previous pins."""
        if self._pinned_by is backend:
            return
        self.unpin_masters()
        # A sliced state's H2Ds read the gather tiles, not the master rows; a master on NVMe has no row.
        self._pins = [None if row is None else backend.host_pin(row)
                      for row in (self.gather if self.sliced else self._rows)]
        self._pinned_by = backend

    def pin_staging(self, backend: Any) -> None:
        """Page-lock the shared staging tiles (``Plan.shared_cast``) through ``backend.host_pin``, so
        this rank's H2Ds read them by DMA (each rank registers the node's one copy in its own
        process). Idempotent for one backend; pinning for another releases the previous pins."""
        if self._staging_pinned_by is not backend:
            self._staging_pins = []
            self._staging_pins = [backend.host_pin(row) for row in self._staging_rows]
            self._staging_pinned_by = backend

    def unpin_masters(self) -> None:
        """Release the pins of :meth:`pin_masters` (BF16 compute reads staging tiles instead)."""
        self._pins = []
        self._pinned_by = None

    def param_view(self, layer: int, index: int) -> torch.Tensor:
        """Parameter ``index`` of ``layer`` as a view of its master tile. Raises ConfigError on a
        sliced state, which holds no whole tile."""
        if self.sliced:
            raise ConfigError(f"layer {self.graph.layers[layer].name!r}: this node holds elements {self.slices[layer]} "
                              "of its master tile only (Plan.host_state='shard'), so no parameter is a view of it; "
                              "read the weights from a checkpoint (Trainer.save), or train with host_state='replicate'")
        spec = self.graph.layers[layer].params[index]
        return self.master(layer)[spec.offset:spec.offset + spec.numel].view(spec.shape)


class NvmeRow:
    """A span of FP32 elements of a layer's NVMe file as a state-dict entry that holds no host
    memory: ``shape``/``dtype`` as the tensor would have, :meth:`read` a new tensor from the file,
    ``copy_(src)`` writes ``src`` into the file (reading the layer's tile, replacing the span,
    writing it back: converting as ``Tensor.copy_`` does), ``to(dtype)`` reads and converts, so a
    checkpoint saves and loads one row at a time. Subclasses say which span."""

    __slots__ = ("host", "layer", "start", "numel", "_shape", "what")
    dtype = torch.float32

    def __init__(self, host: HostState, layer: int, start: int, numel: int, shape: tuple[int, ...], what: str):
        self.host, self.layer, self.start, self.numel, self._shape, self.what = host, layer, start, numel, shape, what

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    def read(self) -> torch.Tensor:
        return self.host.read_state(self.layer)[self.start:self.start + self.numel].view(self._shape)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self.read().to(dtype)

    def copy_(self, src: torch.Tensor) -> "NvmeRow":
        state = self.host._state_to_write(self.layer)
        state[self.start:self.start + self.numel].view(self._shape).copy_(src)
        if self.host._batch is None:  # else written back with the layer's other rows
            self.host._write_state(self.layer, state)
        return self

    def is_floating_point(self) -> bool:
        return True

    def same(self, other: Any) -> bool:
        """Whether ``other`` is this span of this host state (loading it into itself copies nothing)."""
        return (isinstance(other, NvmeRow) and other.host is self.host and other.layer == self.layer
                and other.start == self.start and other.numel == self.numel)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.host.graph.layers[self.layer].name!r}, {self.what})"


class NvmeMomentRow(NvmeRow):
    """One Adam moment row (``k`` 0: ``exp_avg``, 1: ``exp_avg_sq``), ``float32[trainable_numel]``,
    of a layer whose moments live on NVMe (``Trainer.state_dict()["optimizer"]``). Under data
    parallel (``HostState.nvme_shards``) this rank's file holds its optimizer shard ``[lo, hi)``
    only: :meth:`read` assembles the whole row from the node's files
    (:meth:`HostState.read_moment`), ``copy_(src)`` writes ``src[lo:hi]`` into this rank's file
    (every rank loading the same checkpoint writes its own shard: no collective)."""

    __slots__ = ("k", "lo")

    def __init__(self, host: HostState, layer: int, k: int):
        t = host.graph.layers[layer].trainable_numel
        lo, hi = host.nvme_span(layer)
        super().__init__(host, layer, host.nvme_master_numel(layer) + k * (hi - lo), hi - lo, (t,),
                         host.optimizer.states[k])
        self.k, self.lo = k, lo

    def read(self) -> torch.Tensor:
        return self.host.read_moment(self.layer, self.k)

    def copy_(self, src: torch.Tensor) -> "NvmeMomentRow":
        state = self.host._state_to_write(self.layer)
        state[self.start:self.start + self.numel].copy_(src.reshape(-1)[self.lo:self.lo + self.numel])
        if self.host._batch is None:  # else written back with the layer's other rows
            self.host._write_state(self.layer, state)
        return self


class NvmeMasterRow(NvmeRow):
    """A layer's FP32 master, or one parameter's slice of it, in the layer's NVMe file
    (``Plan.nvme_masters``): ``Trainer.state_dict()["masters"]`` and ``["model"]`` entries. A
    write bumps :attr:`HostState.master_version`."""

    __slots__ = ()


MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2
"""The rows of a layer's block, as :class:`SlicedRow` names them."""


class SlicedRow:
    """Elements ``[start, start + prod(shape))`` of layer ``layer``'s row ``kind`` (:data:`MASTER`,
    :data:`EXP_AVG` or :data:`EXP_AVG_SQ`: the whole tile's row, not a node's slice) of a sliced
    host state (``Plan.host_state == "shard"``), as a state-dict entry (``Trainer.state_dict()``)
    of ``shape`` and ``dtype`` FP32: ``copy_(src)`` writes the part of ``src`` that lies in this
    node's slice (every node's ranks, each reading the same file, write their own part: a load
    needs no collective); :meth:`read` returns the whole row's part, from ``fetch(layer, kind)``
    (the node leaders' slices gathered to global rank 0 while ``Trainer.save`` runs)."""

    __slots__ = ("host", "layer", "kind", "start", "shape", "fetch")
    dtype = torch.float32

    def __init__(self, host: HostState, layer: int, kind: int, start: int, shape: tuple[int, ...], fetch: Any):
        self.host, self.layer, self.kind, self.start, self.fetch = host, layer, kind, start, fetch
        self.shape = torch.Size(shape)

    def read(self) -> torch.Tensor:
        n = self.shape.numel()
        return self.fetch(self.layer, self.kind)[self.start:self.start + n].view(self.shape)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self.read().to(dtype)

    def copy_(self, src: torch.Tensor) -> "SlicedRow":
        lo, hi = self.host.slices[self.layer]
        mine = self.host.master(self.layer) if self.kind == MASTER else self.host._moment(self.layer, self.kind - 1)
        hi = lo + mine.numel()  # a moment row ends at the trainable prefix
        a, b = max(lo, self.start), min(hi, self.start + self.shape.numel())
        if a < b:
            mine[a - lo:b - lo].copy_(src.reshape(-1)[a - self.start:b - self.start])
        return self

    def is_floating_point(self) -> bool:
        return True

    def same(self, other: Any) -> bool:
        """Whether ``other`` is this part of this host state (loading it into itself copies nothing)."""
        return (isinstance(other, SlicedRow) and other.host is self.host and other.layer == self.layer
                and other.kind == self.kind and other.start == self.start and other.shape == self.shape)

    def __repr__(self) -> str:
        return (f"SlicedRow({self.host.graph.layers[self.layer].name!r}, "
                f"{(('master',) + self.host.optimizer.states)[self.kind]}, start={self.start}, "
                f"shape={list(self.shape)})")


def as_tensor(x: "torch.Tensor | NvmeRow | SlicedRow") -> torch.Tensor:
    """``x`` itself, or the tensor an :class:`NvmeRow` reads from its file, or a :class:`SlicedRow`
    from the nodes' slices."""
    return x.read() if isinstance(x, (NvmeRow, SlicedRow)) else x


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


class FullMasters:
    """Whole FP32 master rows of every layer of ``graph`` (``rows[i]``: ``float32[numel]``, private,
    zero padding), without moments: what global rank 0 initialises the module into
    (:func:`bind_module` takes it as a host) when the host state is sliced across nodes
    (``Plan.host_state == "shard"``), before each row is sent to the nodes' slices. 4 bytes per
    parameter, held until the caller drops it."""

    def __init__(self, graph: LayerGraph):
        self.graph = graph
        self.rows = [page_aligned_empty(lay.numel * 4).view(torch.float32) for lay in graph.layers]

    def param_view(self, layer: int, index: int) -> torch.Tensor:
        spec = self.graph.layers[layer].params[index]
        return self.rows[layer][spec.offset:spec.offset + spec.numel].view(spec.shape)


def materialize_buffers(model: nn.Module) -> None:
    """Materialise ``model``'s meta-device buffers on the CPU and initialise them by their modules'
    own initialisation (the rotary tables of a model built on ``meta``), writing no parameter
    elsewhere than in the module's own tensors: a rank whose parameters are not bound
    (a sliced host state) still runs its layers with real buffers.

    Raises:
        UnsupportedModelError: a meta module has no initialisation megatrain can call.
    """
    needs_init: dict[str, nn.Module] = {}
    if _meta_buffers(model, needs_init):
        _initialise(model, needs_init)


def unbind_parameters(model: nn.Module) -> None:
    """Replace every parameter of ``model`` (each of its names, so ties stay tied) by one of the same
    shape, dtype and ``requires_grad`` on the ``meta`` device, which holds no memory: with a sliced
    host state no rank keeps a whole copy of the weights; the trained ones are read from a
    checkpoint (``Trainer.save``)."""
    fresh: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if id(p) not in fresh:
            fresh[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                        requires_grad=p.requires_grad)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, fresh[id(p)])


def bind_module(model: nn.Module, host: "HostState | FullMasters", writer: bool = True) -> None:
    """Move every parameter of ``model`` into its master tile and make it a view of the tile.

    Parameters on the ``meta`` device are initialised in place by the model's own initialisation:
    a Hugging Face model's ``_init_weights(module)``, otherwise ``module.reset_parameters()``.
    Buffers on ``meta`` are materialised on the CPU and initialised the same way.

    ``writer=False`` (a rank of a node whose shared host state another rank fills): the parameters
    become views of the tiles and nothing is written to them; meta buffers are initialised first,
    while the parameters are still the module's own.

    Raises:
        UnsupportedModelError: a meta module has no initialisation megatrain can call.
    """
    needs_init: dict[str, nn.Module] = {}
    fresh: list[tuple[int, int]] = []
    if not writer and _meta_buffers(model, needs_init):
        _initialise(model, needs_init)  # the parameters are still the module's own: nothing shared is written
    # Every name of each parameter: a tied one (lm_head.weight is model.embed_tokens.weight) is
    # rebound under all of them to the one view, so the module stays tied.
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for li, layer in enumerate(host.graph.layers):
        for pi, spec in enumerate(layer.params):
            mod_name, _, attr = spec.name.rpartition(".")
            mod = model.get_submodule(mod_name)
            old = getattr(mod, attr)
            view = host.param_view(li, pi)
            if not writer:
                pass
            elif old.device.type == "meta":
                # NaN marks "not initialised yet", so an init that skips a parameter is caught.
                view.fill_(float("nan"))
                needs_init[mod_name] = mod
                fresh.append((li, pi))
            else:
                with torch.no_grad():
                    view.copy_(old)
            bound = nn.Parameter(view, requires_grad=old.requires_grad)
            for alias in aliases.get(id(old), [spec.name]):
                owner, _, name = alias.rpartition(".")
                setattr(model.get_submodule(owner), name, bound)
    if not writer:
        return
    _meta_buffers(model, needs_init)
    if needs_init:
        _initialise(model, needs_init)
    for li, pi in fresh:
        if torch.isnan(host.param_view(li, pi)).any():
            spec = host.graph.layers[li].params[pi]
            raise UnsupportedModelError(
                f"parameter {spec.name!r} was built on the meta device and its module's "
                "initialisation did not set it: give the module reset_parameters() (or handle it "
                "in the model's _init_weights), or build the model on the CPU")


def unbind_spilled(model: nn.Module, host: HostState) -> None:
    """Make the parameters of ``model`` that viewed a master row :meth:`HostState.spill_masters`
    dropped into ``meta`` tensors of their shape (under every name, tied ones included), so that
    nothing reads a stale or freed copy: their weights are read through ``Trainer.state_dict()``
    (:class:`NvmeMasterRow`), and the trainer's forward reads the BF16 staging tiles."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for li in sorted(host.spilled):
        for spec in host.graph.layers[li].params:
            mod_name, _, attr = spec.name.rpartition(".")
            old = getattr(model.get_submodule(mod_name), attr)
            if old.device.type == "meta":
                continue
            bound = nn.Parameter(torch.empty(tuple(spec.shape), dtype=torch.float32, device="meta"),
                                 requires_grad=old.requires_grad)
            for alias in aliases.get(id(old), [spec.name]):
                owner, _, name = alias.rpartition(".")
                setattr(model.get_submodule(owner), name, bound)


def _meta_buffers(model: nn.Module, needs_init: dict[str, nn.Module]) -> bool:
    """Materialise ``model``'s meta-device buffers on the CPU (uninitialised) and add their
    modules to ``needs_init``; whether there were any."""
    found = False
    for name, mod in model.named_modules():
        for bname, buf in list(mod._buffers.items()):
            # Not to_empty(): that would also re-allocate the parameters bound to tiles.
            if buf is not None and buf.device.type == "meta":
                mod._buffers[bname] = torch.empty_like(buf, device="cpu")
                needs_init[name] = mod
                found = True
    return found


def _initialise(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    hf_init = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for name, mod in modules.items():
            if hf_init is not None:
                hf_init(mod)
            elif hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
            else:
                raise UnsupportedModelError(
                    f"module {name or type(model).__name__!r} ({type(mod).__name__}) was built on the "
                    "meta device and has no reset_parameters() to initialise it: give it one, or build "
                    "the model on the CPU")
