"""The NVMe part of :class:`megatrain.runtime.host.HostState`: which layers keep their optimizer
state rows (and, for some, their FP32 master) in a file each, the files' names and extents, and the
reads and writes of those files outside a schedule's NVMe ops (a checkpoint's rows, the masters'
spill at compile).

A layer of ``moments`` has one file holding, in order, its master (``masters`` only, ``numel``
FP32 elements) and its state rows (``n_states`` rows of this rank's span of the trainable prefix,
:meth:`NvmeTier.span`). A layer of ``gradients`` has a scratch file for its deferred gradient tile,
which only the schedule's NVMe ops use. Every write of a master bumps :attr:`NvmeTier.master_version`,
so whoever keeps a copy of a master (an executor's BF16 staging tiles) knows to refresh it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatrain.errors import ConfigError
from megatrain.ir.graph import LayerGraph
from megatrain.ir.layout import optimizer_shard


def moments_key(layer: int, rank: int | None = None) -> str:
    """The NVMe tile (file ``<key>.tile``) of layer ``layer``'s two Adam moments; under data parallel
    (``rank``: the global rank whose optimizer shard the file holds, :class:`NvmeShards`)
    ``L<layer>.r<rank>.moments``, so the ranks of a node share one directory."""
    return f"L{layer}.moments" if rank is None else f"L{layer}.r{rank}.moments"


def state_key(layer: int) -> str:
    """The NVMe tile (file ``<key>.tile``) of layer ``layer``'s FP32 master and two Adam moments,
    in that order (``Plan.nvme_masters``: one file, so one read and one write per step)."""
    return f"L{layer}.state"


def gradient_key(layer: int) -> str:
    """The NVMe tile (file ``<key>.tile``) of layer ``layer``'s deferred gradient tile
    (``Plan.nvme_gradients``): its step gradients between the D2H and the next step's OPT."""
    return f"L{layer}.grad"


@dataclass(frozen=True, slots=True)
class NvmeShards:
    """Which part of each layer's Adam moments this rank's NVMe files hold under data parallel
    (``Plan.nvme_moments`` with ``data_parallel > 1``): its optimizer shard
    (``layout.optimizer_shard(trainable_numel, ways, index)``: the whole tile where each rank steps a
    copy of its own, ``ways`` 1; its ``1 / ways`` where the node's ``ways`` ranks share one copy),
    in files named by its global ``rank`` (:func:`moments_key`). The node's ranks are global ranks
    ``first .. first + ways - 1`` holding shards ``0 .. ways - 1``, so together the files in one
    node's directory hold every layer's whole moments (every node holds the same state): any rank
    reads a whole row from them without a collective (:class:`~megatrain.runtime.host.NvmeMomentRow`)."""

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


class NvmeTier:
    """The layers of ``graph`` whose state lives in files in ``directory`` (see the module's
    docstring), and the :class:`~megatrain.runtime.nvme.NvmeStore` of those files (:attr:`store`,
    None when no layer is on NVMe). ``n_states``: FP32 state rows per trainable element;
    ``sliced``: whether the host state holds node slices (``Plan.host_state == "shard"``), which
    per-rank files (``shards``) do not run with.

    :attr:`spilled` is the layers of ``masters`` whose master row the host dropped
    (:meth:`spill`): from then on their master is only in the file.

    Raises:
        ConfigError: ``shards`` with masters or gradient tiles on NVMe, or a sliced state;
            ``masters`` not within ``moments``; ``moments`` or ``gradients`` naming a layer with no
            trainable parameters, or given without ``directory``.
        NvmeError: the directory is missing or not writable, or the disk has no room for the files.
    """

    def __init__(self, graph: LayerGraph, n_states: int, sliced: bool, moments: frozenset[int],
                 gradients: frozenset[int], masters: frozenset[int], directory: str | None,
                 shards: NvmeShards | None, gradient_itemsize: int):
        self.graph = graph
        self.n_states = n_states
        self.moments = frozenset(moments)
        self.gradients = frozenset(gradients)
        self.masters = frozenset(masters)
        self.shards = shards
        if shards is not None and (self.masters or self.gradients or sliced):
            raise ConfigError(f"HostState: per-rank NVMe files (nvme_shards) hold Adam moments only, of whole tiles; "
                              f"masters {sorted(self.masters)} or gradient tiles {sorted(self.gradients)} on "
                              "NVMe, or a sliced state, are not run under data parallel: drop them")
        if not self.masters <= self.moments:
            raise ConfigError(f"nvme_masters names layers {sorted(self.masters - self.moments)} whose Adam "
                              "moments are in host memory: a layer's master shares its NVMe file with its moments; "
                              "add them to nvme_moments")
        self.spilled: frozenset[int] = frozenset()
        self._batch: tuple[int, torch.Tensor | None] | None = None  # batched_writes: (layer, its file)
        self.master_version = 0
        for what, layers in (("nvme_moments", self.moments), ("nvme_gradients", self.gradients)):
            bad = sorted(i for i in layers if not 0 <= i < len(graph.layers) or graph.layers[i].trainable_numel == 0)
            if bad:
                raise ConfigError(f"{what} names layers {bad}, which have no trainable parameters in this graph of "
                                  f"{len(graph.layers)} layers; put only trainable layers on NVMe")
        if (self.moments or self.gradients) and directory is None:
            raise ConfigError(f"the Adam moments of layers {sorted(self.moments)} and the gradient tiles of "
                              f"layers {sorted(self.gradients)} go to NVMe but no NVMe directory was given: "
                              "pass nvme_dir= (an existing directory on an NVMe drive)")
        self.store = None
        if self.moments or self.gradients:
            from megatrain.runtime.nvme import NvmeStore  # lazily: only a plan with state on NVMe needs it

            # A rank's file of an empty shard (the last of a small layer) still has a block: the
            # schedule's NVMe ops move it like any other.
            sizes = {self.key(li): max(4, (self.master_numel(li) + n_states * self.numel(li)) * 4)
                     for li in sorted(self.moments)}
            sizes.update({gradient_key(li): graph.layers[li].trainable_numel * gradient_itemsize
                          for li in sorted(self.gradients)})
            self.store = NvmeStore(directory, sizes)

    def key(self, layer: int) -> str:
        """The NVMe tile of a layer of ``moments``: :func:`state_key` when its master is there too,
        else :func:`moments_key` (of this rank under data parallel, ``shards``)."""
        if layer in self.masters:
            return state_key(layer)
        return moments_key(layer, None if self.shards is None else self.shards.rank)

    def span(self, layer: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of the layer's moment rows its file holds: all of them, or under
        data parallel this rank's optimizer shard (:class:`NvmeShards`)."""
        t = self.graph.layers[layer].trainable_numel
        return (0, t) if self.shards is None else self.shards.span(t)

    def numel(self, layer: int) -> int:
        """FP32 elements of each state row in the layer's file (``hi - lo`` of :meth:`span`)."""
        lo, hi = self.span(layer)
        return hi - lo

    def master_numel(self, layer: int) -> int:
        """FP32 elements of master before the state rows in the layer's file (its ``numel`` for a
        layer of ``masters``, else 0)."""
        return self.graph.layers[layer].numel if layer in self.masters else 0

    def path(self, layer: int) -> str:
        """The file of a layer of ``moments``, for error messages."""
        return self.store.tiles[self.key(layer)].path

    def spill(self, layer: int, master: torch.Tensor) -> None:
        """Put the layer's ``master`` row (``float32[numel]``) in its file, zero state rows after it,
        and count the layer as :attr:`spilled`. A row that maps its file is already there: its dirty
        pages are written back (``fsync``) and the mapping dropped. The caller drops its row and
        bumps :attr:`master_version` once for all the layers it spills."""
        if self.store.is_mapped(state_key(layer)):
            # The row is the file's mapping (HostState's blocks): the master is in the file already
            # and the moments after it are the zeros the file was made with.
            self.store.sync(state_key(layer))
        else:
            lay = self.graph.layers[layer]
            state = torch.zeros((lay.numel + self.n_states * lay.trainable_numel,), dtype=torch.float32)
            state[:lay.numel].copy_(master)
            self.store.write_tensor(state_key(layer), state)
        self.spilled = self.spilled | {layer}

    def read_state(self, layer: int) -> torch.Tensor:
        """A new ``float32`` tensor of the layer's file: master (``masters`` only) then the state
        rows (inside :meth:`batched_writes`, with its writes not yet written back). Raises
        NvmeError (naming the file) when it is missing or truncated."""
        if self._batch is not None and self._batch[0] == layer:
            return self._batch[1].clone()
        out = torch.empty((self.master_numel(layer) + self.n_states * self.numel(layer),), dtype=torch.float32)
        self.store.read_tensor(self.key(layer), out)
        return out

    def read_moment(self, layer: int, k: int) -> torch.Tensor:
        """A new ``float32[trainable_numel]``: state row ``k`` of the layer, whole: from this rank's
        file, or under data parallel from the files of the node's ranks (:meth:`NvmeShards.peers`),
        read directly (they share the directory; the caller makes sure no rank is writing them, as
        ``Trainer.save`` does with a barrier). Raises NvmeError naming a file that is missing or
        truncated."""
        t = self.graph.layers[layer].trainable_numel
        if self.shards is None or self.shards.ways == 1:
            s = self.numel(layer)
            return self.read_state(layer)[self.master_numel(layer) + k * s:][:s].clone()
        out = torch.empty((t,), dtype=torch.float32)
        for rank, (lo, hi) in self.shards.peers(t):
            part = self.store.read_foreign(moments_key(layer, rank), max(4, self.n_states * (hi - lo) * 4))
            out[lo:hi].copy_(part.view(torch.float32)[k * (hi - lo):(k + 1) * (hi - lo)])
        return out

    def read_moments(self, layer: int) -> torch.Tensor:
        """A new ``float32[n_states * numel(layer)]``: the layer's state rows in its file, one after
        another."""
        out = torch.empty((self.n_states * self.numel(layer),), dtype=torch.float32)
        if layer in self.masters:
            out.copy_(self.read_state(layer)[self.master_numel(layer):])
        else:
            self.store.read_tensor(self.key(layer), out)
        return out

    def write_moments(self, layer: int, moments: torch.Tensor) -> None:
        """Write the layer's state rows (:meth:`read_moments`'s order) into its file, waited for."""
        if layer in self.masters:
            state = self.read_state(layer)
            state[self.master_numel(layer):].copy_(moments)
            self.store.write_tensor(state_key(layer), state)  # the master is unchanged: no version bump
        else:
            self.store.write_tensor(self.key(layer), moments)

    @contextlib.contextmanager
    def batched_writes(self) -> Iterator[None]:
        """Within it, row writes (:meth:`state_to_write`, :meth:`commit`) of one layer after another
        go into one copy of the layer's file in memory, written back when a row of another layer is
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

    def state_to_write(self, layer: int) -> torch.Tensor:
        """The layer's file contents for a row to change: the batch's copy (:meth:`batched_writes`;
        the previous layer's is written back first), or a new read. Hand it back to :meth:`commit`."""
        if self._batch is None:
            return self.read_state(layer)
        if self._batch[0] != layer:
            self._write_back_batch()
            self._batch = (layer, self.read_state(layer))
        return self._batch[1]

    def commit(self, layer: int, state: torch.Tensor) -> None:
        """Write ``state`` (from :meth:`state_to_write`, changed) to the layer's file now, or,
        inside :meth:`batched_writes`, with the layer's other rows."""
        if self._batch is None:
            self._write_state(layer, state)

    def _write_state(self, layer: int, state: torch.Tensor) -> None:
        self.store.write_tensor(self.key(layer), state)
        if layer in self.masters:
            self.master_version += 1
