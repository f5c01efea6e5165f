"""Safetensors files, read and written: a file's headers and tensors opened for reading, and a
writer that hashes and fsyncs every file it writes (for a manifest of sha256 and sizes), in Hugging
Face's layout of sharded weights (``model.safetensors``, or ``model-0000k-of-0000n.safetensors``
shards with ``model.safetensors.index.json``).

Shards are written by ``safetensors.torch.save_file``, one shard in memory at a time (bounded by
``max_shard_bytes``), then hashed and fsynced; JSON files are hashed as they are written.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from megatrain.errors import CheckpointError

__all__ = ["INDEX_FILE", "SINGLE_FILE", "Entry", "StoredTensor", "Written", "open_safetensors", "plan_shards",
           "shard_name", "write_bytes", "write_json", "write_safetensors"]

SINGLE_FILE = "model.safetensors"
"""The weights of a model saved as one file (Hugging Face's name)."""
INDEX_FILE = "model.safetensors.index.json"
"""The index of a model saved in shards: ``{"weight_map": {tensor name: shard file}}`` (Hugging Face's name)."""


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor's header in a safetensors file: the file, its shape and its dtype."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors code: F32, BF16, ...


def open_safetensors(file: Path):
    """``safetensors.safe_open(file, framework="pt")``: a context manager whose ``keys()``,
    ``get_slice(name)`` (header only) and ``get_tensor(name)`` read the file, memory-mapped.

    Raises:
        CheckpointError: ``file`` is missing, or not a readable safetensors file (truncated or corrupt).
    """
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except FileNotFoundError:
        raise CheckpointError(f"{file}: file not found") from None
    except Exception as e:  # safetensors raises its own SafetensorError for a bad header or length
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}); it may be truncated or "
                              "corrupt: write it again") from None


# ---------------------------------------------------------------------------------------------
# Writing files durably
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """A tensor to write: its header fields, and how to produce its data when its shard is written
    (so only that shard is converted and held)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes: its element count times ``dtype``'s item size."""
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Written:
    """A file written: the sha256 of its bytes (hex) and their number."""

    sha256: str
    bytes: int


class _HashingFile:
    """A file opened for exclusive creation whose bytes are hashed as written, and fsynced on close."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "xb")
        self._h = hashlib.sha256()
        self._n = 0

    def write(self, data) -> None:
        self._h.update(data)
        self._f.write(data)
        self._n += memoryview(data).nbytes

    def close(self) -> Written:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return Written(self._h.hexdigest(), self._n)


def write_bytes(path: Path, data: bytes) -> Written:
    """Create ``path`` (it must not exist) holding ``data``, fsynced; its sha256 and size.

    Raises:
        FileExistsError: ``path`` exists. OSError: the write failed (a full disk).
    """
    f = _HashingFile(path)
    f.write(data)
    return f.close()


def write_json(path: Path, obj: Any) -> Written:
    """:func:`write_bytes` of ``obj`` as JSON (indented, keys sorted, a final newline)."""
    return write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def write_safetensors(path: Path, entries: list[Entry], metadata: dict[str, str] | None = None) -> Written:
    """Write ``entries`` as one safetensors file through the ``safetensors`` library.

    The tensors of a shard are views of the same tiles, which ``safetensors`` refuses to store
    (shared storage), so each is copied once; the file is then hashed and fsynced. Transient host
    memory is about one shard (bounded by ``max_shard_bytes``).

    Raises:
        CheckpointError: an entry's source gave another dtype or shape than it announced; ``path``
            exists. OSError or safetensors' ``SafetensorError``: the write failed (a full disk).
    """
    from safetensors.torch import save_file

    tensors = {}
    for e in entries:
        t = e.source()
        if t.dtype != e.dtype or tuple(t.shape) != e.shape:
            raise CheckpointError(f"{path.name}: tensor {e.name!r} is {t.dtype} {list(t.shape)} but was "
                                  f"announced as {e.dtype} {list(e.shape)}")
        tensors[e.name] = t.detach().cpu().clone()
    if path.exists():  # the writer below would overwrite; a shard is only ever written once
        raise CheckpointError(f"{path}: refusing to overwrite an existing file")
    save_file(tensors, str(path), metadata=dict(metadata or {"format": "pt"}))
    del tensors
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
        os.fsync(f.fileno())
    return Written(h.hexdigest(), path.stat().st_size)


def plan_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Greedy in order: a new shard starts when the next tensor would overflow the current one; a
    tensor larger than ``max_bytes`` gets a shard of its own (as Hugging Face does)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def shard_name(stem: str, k: int, n: int) -> str:
    """The file name of shard ``k`` (from 0) of ``n``: ``<stem>.safetensors`` when there is one,
    else ``<stem>-0000<k+1>-of-0000<n>.safetensors``, as Hugging Face names them."""
    return f"{stem}.safetensors" if n == 1 else f"{stem}-{k + 1:05d}-of-{n:05d}.safetensors"
