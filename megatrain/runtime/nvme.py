"""NVMe tier: file-backed tile storage with asynchronous large-block reads and writes.

Each tile (one layer's FP32 masters, its AdamW moments, or a deferred gradient tile) is one file
in the NVMe directory, preallocated at setup to its size rounded up to :data:`ALIGN` bytes and
reading as zeros (the files are scratch: one left there by an earlier run is emptied). A
read or write moves a whole tile between that file and a page-aligned host buffer, split into
blocks of ``block_bytes`` that a :class:`concurrent.futures.ThreadPoolExecutor` issues with
``os.preadv`` / ``os.pwritev`` (which release the GIL), so several blocks are in flight at once
and the caller gets a :class:`NvmeRequest` to wait on.

Why this mechanism. The libraries built for this (DeepSpeed's ``async_io`` op, NVIDIA KvikIO /
cuFile) ship no wheel usable here (DeepSpeed's aio op compiles against libaio at install time;
KvikIO needs CUDA), and both do in spirit what this module does: ``O_DIRECT`` file descriptors so
the page cache neither doubles host memory nor hides the device's rate, aligned buffers, large
blocks, and a pool of threads (DeepSpeed's ``aio_thread_count``, KvikIO's ``KVIKIO_NTHREADS``) to
keep the device queue deep. ``O_DIRECT`` needs the buffer address, the file offset and the length
to be multiples of the logical block size; every buffer here starts on a page and every tile is
padded to :data:`ALIGN` (4096) bytes, which covers 512-byte and 4K-sector devices.

Fallback. Some file systems (tmpfs, some overlay and network mounts) refuse ``O_DIRECT``. The
store probes it once at setup with an aligned write and read of a scratch file; if refused it
uses buffered I/O, sets :attr:`NvmeStore.direct` to ``False`` and
:attr:`NvmeStore.fallback_reason` to the OS error, and logs a warning. Results are identical;
only the rate (and the page cache's use of host memory) differs.

Errors (all :class:`NvmeError`, naming the file): the directory is missing or not writable; the
file system has less free space than the tiles need (checked with ``shutil.disk_usage``, then
``os.posix_fallocate`` reserves the blocks so "disk full" cannot happen mid-training); a tile's
file is missing or shorter than its size when read (truncated); a read or write moves fewer bytes
than asked.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatrain.errors import MegatrainError
from megatrain.runtime.host import page_aligned_empty

log = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment in bytes of every buffer address, file offset and transfer length (O_DIRECT)."""

DEFAULT_BLOCK_BYTES = 8 << 20
"""Bytes per ``preadv``/``pwritev`` call: large enough that per-call overhead is small, small
enough that one tile spreads over several threads (DeepSpeed's aio default block is 1 MiB; NVMe
sequential rates saturate from about 1 MiB requests at queue depth >= 4)."""


class NvmeError(MegatrainError, OSError):
    """An NVMe tile file cannot be created, read or written. The message names the file, what
    went wrong (missing, truncated, disk full, short transfer) and what to do."""


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed ``uint8`` host tensor of ``align_up(nbytes)`` bytes whose address is page-aligned,
    usable as an ``O_DIRECT`` buffer. (On CUDA the caller may page-lock it with the backend's
    ``host_pin``; on the CPU it stays pageable.)"""
    return page_aligned_empty(align_up(max(nbytes, 1)))


class NvmeRequest:
    """An in-flight tile transfer: the futures of its blocks. :meth:`wait` blocks until every
    block is done and re-raises the first error (an :class:`NvmeError` naming the file)."""

    def __init__(self, futures: list[cf.Future], kind: str, key: str):
        self._futures = futures
        self.kind = kind
        self.key = key

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        for f in self._futures:
            f.result()

    def __repr__(self) -> str:
        return f"NvmeRequest({self.kind}:{self.key}, done={self.done()})"


@dataclass(frozen=True, slots=True)
class _Tile:
    path: str
    nbytes: int  # the caller's size
    padded: int  # on disk: align_up(nbytes)


class NvmeStore:
    """Tiles in files under ``directory``, one file per key.

    Args:
        directory: an existing, writable directory on the NVMe file system.
        sizes: key -> tile size in bytes (> 0). Keys become file names (``<key>.tile``) and must
            be plain names (letters, digits, ``._-``).
        workers: threads issuing blocks (>= 1).
        block_bytes: bytes per system call, a multiple of :data:`ALIGN`.
        direct: try ``O_DIRECT`` (default); ``False`` forces buffered I/O.

    Raises:
        NvmeError: the directory is missing or not writable, or has less free space than
            ``sum(align_up(size))`` bytes (the message names the first file that does not fit
            and the bytes needed and free).
        ValueError: a size or key is invalid.
    """

    def __init__(self, directory: str | os.PathLike, sizes: Mapping[str, int], *, workers: int = 4,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, direct: bool = True):
        if workers < 1:
            raise ValueError(f"workers={workers}: need at least one I/O thread")
        if block_bytes <= 0 or block_bytes % ALIGN:
            raise ValueError(f"block_bytes={block_bytes} must be a positive multiple of {ALIGN}")
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise NvmeError(f"NVMe directory {self.directory!r} does not exist; create it on the NVMe "
                            "file system or pass another nvme_dir")
        if not os.access(self.directory, os.W_OK):
            raise NvmeError(f"NVMe directory {self.directory!r} is not writable; fix its permissions "
                            "or pass another nvme_dir")
        self.block_bytes = block_bytes
        self.tiles: dict[str, _Tile] = {}
        for key, n in sizes.items():
            if not key or not all(c.isalnum() or c in "._-" for c in key) or key.startswith("."):
                raise ValueError(f"tile key {key!r}: use letters, digits, '.', '_' or '-' only")
            if n <= 0:
                raise ValueError(f"tile {key!r} has size {n}; a tile needs at least one byte")
            self.tiles[key] = _Tile(os.path.join(self.directory, f"{key}.tile"), n, align_up(n))
        self.direct, self.fallback_reason = (self._probe_direct() if direct else (False, "direct=False"))
        if not self.direct and direct:
            log.warning("NVMe directory %s refuses O_DIRECT (%s); using buffered I/O, which goes "
                        "through the page cache", self.directory, self.fallback_reason)
        self._fds: dict[str, int] = {}
        self._mapped: set[str] = set()
        self._preallocate()
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="megatrain-nvme")

    @property
    def total_bytes(self) -> int:
        """Bytes the tiles take on disk (each padded to :data:`ALIGN`)."""
        return sum(t.padded for t in self.tiles.values())

    def _flags(self, extra: int) -> int:
        return os.O_RDWR | extra | (os.O_DIRECT if self.direct else 0)

    def _probe_direct(self) -> tuple[bool, str | None]:
        if not hasattr(os, "O_DIRECT"):
            return False, "this OS has no O_DIRECT"
        probe = os.path.join(self.directory, ".megatrain-odirect-probe")
        buf = aligned_buffer(ALIGN)
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            try:
                os.pwritev(fd, [buf.numpy()], 0)
                os.preadv(fd, [buf.numpy()], 0)
            finally:
                os.close(fd)
        except OSError as e:
            return False, f"{type(e).__name__}: {e}"
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass
        return True, None

    def _preallocate(self) -> None:
        free = shutil.disk_usage(self.directory).free
        need = self.total_bytes
        if need > free:
            first = next(iter(self.tiles.values())).path if self.tiles else self.directory
            raise NvmeError(f"NVMe tiles need {need} bytes in {self.directory!r} (first file {first!r}) "
                            f"but the file system has {free} bytes free; free {need - free} bytes, "
                            "use a larger disk, or give the plan more host memory")
        for key, t in self.tiles.items():
            try:
                # Scratch: a file left by an earlier run is emptied, so every tile reads as zeros
                # (posix_fallocate's blocks read as zeros), as fresh Adam moments are.
                fd = os.open(t.path, self._flags(os.O_CREAT | os.O_TRUNC), 0o600)
            except OSError as e:
                raise NvmeError(f"cannot create NVMe tile file {t.path!r}: {e}") from e
            try:
                os.posix_fallocate(fd, 0, t.padded)
            except OSError as e:
                os.close(fd)
                raise NvmeError(f"cannot reserve {t.padded} bytes for NVMe tile file {t.path!r}: {e} "
                                "(disk full? free space on that file system or use another nvme_dir)") from e
            self._fds[key] = fd

    def _tile(self, key: str, buf: torch.Tensor) -> _Tile:
        t = self.tiles.get(key)
        if t is None:
            raise KeyError(f"no NVMe tile {key!r}; known tiles: {sorted(self.tiles)[:8]}...")
        if buf.dtype != torch.uint8 or not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError(f"tile {key!r}: the buffer must be a contiguous CPU uint8 tensor "
                             "(use aligned_buffer)")
        if buf.numel() < t.padded:
            raise ValueError(f"tile {key!r}: buffer of {buf.numel()} bytes is smaller than the tile's "
                             f"{t.padded} bytes on disk; allocate it with aligned_buffer({t.nbytes})")
        if self.direct and buf.data_ptr() % ALIGN:
            raise ValueError(f"tile {key!r}: O_DIRECT needs a {ALIGN}-byte aligned buffer; allocate "
                             "it with aligned_buffer")
        return t

    def _blocks(self, t: _Tile):
        for off in range(0, t.padded, self.block_bytes):
            yield off, min(self.block_bytes, t.padded - off)

    def _check_file(self, t: _Tile) -> None:
        try:
            size = os.stat(t.path).st_size
        except FileNotFoundError:
            raise NvmeError(f"NVMe tile file {t.path!r} is missing (deleted while training?); "
                            "its state is lost: resume from the last checkpoint") from None
        if size < t.padded:
            raise NvmeError(f"NVMe tile file {t.path!r} is truncated: {size} bytes on disk, "
                            f"{t.padded} expected; resume from the last checkpoint")

    def _io(self, fn, fd: int, t: _Tile, view, off: int, what: str) -> None:
        done = 0
        n = len(view)
        while done < n:  # a transfer may be split by the kernel; a zero return means end of file
            try:
                got = fn(fd, [view[done:]], off + done)
            except OSError as e:
                raise NvmeError(f"{what} of NVMe tile file {t.path!r} at offset {off + done} failed: "
                                f"{e}") from e
            if got <= 0:
                raise NvmeError(f"{what} of NVMe tile file {t.path!r} stopped at offset {off + done} "
                                f"of {t.padded} bytes (truncated file?)")
            done += got

    def write(self, key: str, buf: torch.Tensor) -> NvmeRequest:
        """Start writing ``buf[:tile padded size]`` to tile ``key``; returns at once."""
        t = self._tile(key, buf)
        mv = memoryview(buf.numpy())
        fd = self._fds[key]
        futs = [self._pool.submit(self._io, os.pwritev, fd, t, mv[o:o + n], o, "write")
                for o, n in self._blocks(t)]
        return NvmeRequest(futs, "write", key)

    def read(self, key: str, buf: torch.Tensor) -> NvmeRequest:
        """Start reading tile ``key`` into ``buf``; returns at once. Raises :class:`NvmeError` now
        if the tile's file is missing or truncated."""
        t = self._tile(key, buf)
        self._check_file(t)
        mv = memoryview(buf.numpy())
        fd = self._fds[key]
        futs = [self._pool.submit(self._io, os.preadv, fd, t, mv[o:o + n], o, "read")
                for o, n in self._blocks(t)]
        return NvmeRequest(futs, "read", key)

    def read_foreign(self, key: str, nbytes: int) -> torch.Tensor:
        """A new ``uint8[nbytes]`` tensor of the file ``<key>.tile`` in this store's directory that
        another process's store made (not one of :attr:`tiles`, and not truncated or reserved here:
        it is that store's scratch): under data parallel, another rank's moments
        (``HostState.read_moment``). Read with buffered I/O, which Linux keeps coherent with that
        process's ``O_DIRECT`` writes. Raises :class:`NvmeError` naming the file when it is missing
        or shorter than ``nbytes``."""
        t = _Tile(os.path.join(self.directory, f"{key}.tile"), nbytes, align_up(nbytes))
        self._check_file(t)
        out = aligned_buffer(nbytes)
        fd = os.open(t.path, os.O_RDONLY)
        try:
            self._io(os.preadv, fd, t, memoryview(out.numpy())[:t.padded], 0, "read")
        finally:
            os.close(fd)
        return out[:nbytes]

    def write_tensor(self, key: str, src: torch.Tensor, staging: torch.Tensor | None = None) -> None:
        """Write any contiguous CPU tensor (``src.nbytes`` <= the tile's size) to tile ``key`` and
        wait, through ``staging`` (an :func:`aligned_buffer`; one is made if ``None``)."""
        t = self.tiles[key]
        staging = aligned_buffer(t.nbytes) if staging is None else staging
        staging[:src.nbytes].copy_(src.contiguous().view(-1).view(torch.uint8))
        self.write(key, staging).wait()

    def read_tensor(self, key: str, dst: torch.Tensor, staging: torch.Tensor | None = None) -> None:
        """Read tile ``key`` into the contiguous CPU tensor ``dst`` and wait."""
        t = self.tiles[key]
        staging = aligned_buffer(t.nbytes) if staging is None else staging
        self.read(key, staging).wait()
        dst.view(-1).view(torch.uint8).copy_(staging[:dst.nbytes])

    def map_tile(self, key: str) -> torch.Tensor:
        """Tile ``key``'s file mapped (``MAP_SHARED``) as a ``uint8`` tensor of its padded size:
        writes go to the file through the page cache, which the kernel writes back and may
        reclaim, so the bytes need not fit in memory. The store's ``O_DIRECT`` reads and writes of
        the file stay coherent with it (the kernel writes dirty cached pages back before a direct
        read and drops them after a direct write); :meth:`sync` forces the write-back."""
        t = self.tiles[key]
        self._mapped.add(key)
        return torch.from_file(t.path, shared=True, size=t.padded, dtype=torch.uint8)

    def is_mapped(self, key: str) -> bool:
        """Whether :meth:`map_tile` mapped tile ``key``."""
        return key in self._mapped

    def sync(self, key: str) -> None:
        """Write tile ``key``'s dirty cached pages (from a :meth:`map_tile` mapping) to the disk
        and wait (``fsync``).

        Raises:
            NvmeError: the write-back failed (a full or failing disk), naming the file.
        """
        try:
            os.fsync(self._fds[key])
        except OSError as e:
            raise NvmeError(f"cannot write NVMe tile file {self.tiles[key].path!r} back to disk: {e}") from e

    def close(self, remove: bool = False) -> None:
        """Wait for in-flight transfers, close the files and, with ``remove``, delete them."""
        self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if remove:
            for t in self.tiles.values():
                try:
                    os.unlink(t.path)
                except FileNotFoundError:
                    pass

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
