"""State-dict entries over a :class:`~megatrain.runtime.host.HostState` that hold no host memory of
their own: rows of a layer's NVMe file (:class:`NvmeRow` and its two kinds) and the parts of a
node's slices of a sliced state (:class:`SlicedRow`). Each has a tensor's ``shape`` and ``dtype``,
``read()``, ``to(dtype)`` and ``copy_(src)``, so a checkpoint saves and loads one row at a time.

They take the host state as ``host`` and use only its public reads, its
:attr:`~megatrain.runtime.host.HostState.tile_layout` and its
:attr:`~megatrain.runtime.host.HostState.nvme_rows` (this module cannot import ``HostState``: the
host state builds these rows).
"""

from __future__ import annotations

from typing import Any

import torch


class NvmeRow:
    """A span of FP32 elements of a layer's NVMe file as a state-dict entry that holds no host
    memory: ``shape``/``dtype`` as the tensor would have, :meth:`read` a new tensor from the file,
    ``copy_(src)`` writes ``src`` into the file (reading the layer's tile, replacing the span,
    writing it back: converting as ``Tensor.copy_`` does), ``to(dtype)`` reads and converts, so a
    checkpoint saves and loads one row at a time. Subclasses say which span. ``host``: the
    :class:`~megatrain.runtime.host.HostState`."""

    __slots__ = ("host", "layer", "start", "numel", "_shape", "what")
    dtype = torch.float32

    def __init__(self, host: Any, layer: int, start: int, numel: int, shape: tuple[int, ...], what: str):
        self.host, self.layer, self.start, self.numel, self._shape, self.what = host, layer, start, numel, shape, what

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    def read(self) -> torch.Tensor:
        return self.host.nvme_rows.read_state(self.layer)[self.start:self.start + self.numel].view(self._shape)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self.read().to(dtype)

    def copy_(self, src: torch.Tensor) -> "NvmeRow":
        tier = self.host.nvme_rows
        state = tier.state_to_write(self.layer)
        state[self.start:self.start + self.numel].view(self._shape).copy_(src)
        tier.commit(self.layer, state)
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
    (:meth:`~megatrain.runtime.host_nvme.NvmeTier.read_moment`), ``copy_(src)`` writes ``src[lo:hi]``
    into this rank's file (every rank loading the same checkpoint writes its own shard: no
    collective)."""

    __slots__ = ("k", "lo")

    def __init__(self, host: Any, layer: int, k: int):
        t = host.graph.layers[layer].trainable_numel
        lo, hi = host.nvme_rows.span(layer)
        super().__init__(host, layer, host.nvme_rows.master_numel(layer) + k * (hi - lo), hi - lo, (t,),
                         host.optimizer.states[k])
        self.k, self.lo = k, lo

    def read(self) -> torch.Tensor:
        return self.host.nvme_rows.read_moment(self.layer, self.k)

    def copy_(self, src: torch.Tensor) -> "NvmeMomentRow":
        tier = self.host.nvme_rows
        state = tier.state_to_write(self.layer)
        state[self.start:self.start + self.numel].copy_(src.reshape(-1)[self.lo:self.lo + self.numel])
        tier.commit(self.layer, state)
        return self


class NvmeMasterRow(NvmeRow):
    """A layer's FP32 master, or one parameter's slice of it, in the layer's NVMe file
    (``Plan.nvme_masters``): ``Trainer.state_dict()["masters"]`` and ``["model"]`` entries. A
    write bumps :attr:`~megatrain.runtime.host_nvme.NvmeTier.master_version`."""

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

    def __init__(self, host: Any, layer: int, kind: int, start: int, shape: tuple[int, ...], fetch: Any):
        self.host, self.layer, self.kind, self.start, self.fetch = host, layer, kind, start, fetch
        self.shape = torch.Size(shape)

    def read(self) -> torch.Tensor:
        n = self.shape.numel()
        return self.fetch(self.layer, self.kind)[self.start:self.start + n].view(self.shape)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self.read().to(dtype)

    def copy_(self, src: torch.Tensor) -> "SlicedRow":
        lo, hi = self.host.tile_layout.slices[self.layer]
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
