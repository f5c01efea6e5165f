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

Safety. The directory may be shared scratch space, so nothing in it is trusted: every file is
opened with ``O_NOFOLLOW`` (a symlink planted under a tile's name is refused, never followed to
overwrite another file), a new file is created exclusively (``O_EXCL``), and one left by an
earlier run is reused only if it is a regular file with one link owned by this user; all are mode
0600. Each block of a tile carries a checksum (xxHash's XXH3-64, computed by the I/O threads as
they write and checked as they read; the ``xxhash`` package, which ``datasets`` depends on), kept
in memory: a tile overwritten on disk by anything but this store (another process, a failing
drive) is an error at its next read, not a silently different run. ``bench/nvme_io.py`` measures
what the checks cost (2026-11-27, this project's shared 2-core VM, /tmp on ext4, two runs: 14% and
-1% of the write rate, 7% and -1% of the read rate; not reliably under the 5% that would make them
free), so they are an option, on by default: ``checksums=False`` (``megatrain train
--nvme-checksums false``) turns them off.

Errors (all :class:`NvmeError`, naming the file): the directory is missing or not writable; the
file system has less free space than the tiles need (checked with ``shutil.disk_usage``, counting
the blocks of this store's files from an earlier run, which are emptied and reused, then
``os.posix_fallocate`` reserves the blocks so "disk full" cannot happen mid-training); a file that
is a symlink, not a regular file, or someone else's; a tile's file is missing or shorter than its
size when read (truncated) or changed on disk (a checksum differs); a read or write moves fewer
bytes than asked.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import mmap
import os
import secrets
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from megatrain.errors import MegatrainError
from megatrain.runtime.pages import page_aligned_empty

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


def _sum(view) -> int:
    """XXH3-64 of a block: about 11 GB/s from memory on one core of this project's 2-core VM,
    and ``xxhash`` releases the GIL, so the I/O threads hash in parallel."""
    import xxhash

    return xxhash.xxh3_64_intdigest(view)


@functools.lru_cache(maxsize=8)
def _zero_sum(n: int) -> int:
    """The checksum of ``n`` zero bytes: a block as ``posix_fallocate`` leaves it."""
    return _sum(bytes(n))


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
        checksums: checksum every block written and check it when read (default; see the module
            docstring). The attribute of that name may be switched later: blocks written while it
            is off are not checked.

    Raises:
        NvmeError: the directory is missing or not writable, or has less free space than
            ``sum(align_up(size))`` bytes less what this store's files from an earlier run hold
            (the message names the first file that does not fit and the bytes needed and free);
            a tile's name is taken by a symlink, a directory or another user's file.
        ValueError: a size or key is invalid.
    """

    def __init__(self, directory: str | os.PathLike, sizes: Mapping[str, int], *, workers: int = 4,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, direct: bool = True, checksums: bool = True):
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
        self._mapped: dict[str, mmap.mmap | None] = {}  # key -> its mapping until sync() checksums it
        self.checksums = checksums
        # Each tile's block checksums (None: unknown, after a failed write), from the zeros of
        # posix_fallocate on.
        self._sums: dict[str, list[int | None]] = {}
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
        # A new name, created exclusively: nothing planted in the directory is opened.
        probe = os.path.join(self.directory, f".megatrain-odirect-probe-{secrets.token_hex(8)}")
        buf = aligned_buffer(ALIGN)
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT, 0o600)
        except OSError as e:
            return False, f"{type(e).__name__}: {e}"
        try:
            os.pwritev(fd, [buf.numpy()], 0)
            os.preadv(fd, [buf.numpy()], 0)
        except OSError as e:
            return False, f"{type(e).__name__}: {e}"
        finally:
            os.close(fd)
            os.unlink(probe)
        return True, None

    def _open(self, t: _Tile) -> tuple[int, int]:
        """A tile's file, opened without following a symlink: created exclusively where new, else
        this store's file of an earlier run (a regular file with one link, owned by this user),
        emptied. Returns ``(fd, bytes its earlier blocks held)``."""
        try:
            return os.open(t.path, self._flags(os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW), 0o600), 0
        except FileExistsError:
            pass
        except OSError as e:
            raise NvmeError(f"cannot create NVMe tile file {t.path!r}: {e}") from e
        try:
            fd = os.open(t.path, self._flags(os.O_NOFOLLOW))
        except OSError as e:  # ELOOP: a symlink; EISDIR: a directory
            raise NvmeError(f"NVMe tile file {t.path!r} exists and cannot be reused ({e}): a symlink or a "
                            "directory is never followed; remove it or use another nvme_dir") from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
            os.close(fd)
            raise NvmeError(f"NVMe tile file {t.path!r} exists and is not a file this user made (mode "
                            f"{stat.filemode(st.st_mode)}, {st.st_nlink} links, owner uid {st.st_uid}, this user "
                            f"{os.geteuid()}); remove it or use another nvme_dir")
        old = st.st_blocks * 512
        # Scratch: a file left by an earlier run is emptied, so every tile reads as zeros
        # (posix_fallocate's blocks read as zeros), as fresh Adam moments are.
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 0)
        return fd, old

    def _preallocate(self) -> None:
        try:
            self._reserve()
        except BaseException:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            raise

    def _reserve(self) -> None:
        reused = 0
        for key, t in self.tiles.items():  # first every file emptied, so its old blocks count as free
            self._fds[key], old = self._open(t)
            reused += old
        free = shutil.disk_usage(self.directory).free
        need = self.total_bytes
        if need > free:
            first = next(iter(self.tiles.values())).path if self.tiles else self.directory
            raise NvmeError(f"NVMe tiles need {need} bytes in {self.directory!r} (first file {first!r}) "
                            f"but the file system has {free} bytes free (with the {reused} bytes of this "
                            f"store's files from an earlier run); free {need - free} bytes, use a larger disk, "
                            "or give the plan more host memory")
        for key, t in self.tiles.items():
            try:
                os.posix_fallocate(self._fds[key], 0, t.padded)
            except OSError as e:
                raise NvmeError(f"cannot reserve {t.padded} bytes for NVMe tile file {t.path!r}: {e} "
                                "(disk full? free space on that file system or use another nvme_dir)") from e
            self._sums[key] = [_zero_sum(n) for _, n in self._blocks(t)]

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

    def _write_block(self, key: str, b: int, fd: int, t: _Tile, view, off: int) -> None:
        sums = self._sums[key]
        sums[b] = None  # until the block is on disk whole
        self._io(os.pwritev, fd, t, view, off, "write")
        if self.checksums:
            sums[b] = _sum(view)

    def _read_block(self, key: str, b: int, fd: int, t: _Tile, view, off: int) -> None:
        self._io(os.preadv, fd, t, view, off, "read")
        want = self._sums[key][b]
        if self.checksums and want is not None and _sum(view) != want:
            raise NvmeError(f"NVMe tile file {t.path!r} changed on disk since this run wrote it (the checksum of "
                            f"the {len(view)} bytes at offset {off} differs): another process overwrote it, or "
                            "the drive returned bad data; its state is lost: resume from the last checkpoint")

    def write(self, key: str, buf: torch.Tensor) -> NvmeRequest:
        """Start writing ``buf[:tile padded size]`` to tile ``key``; returns at once. ``buf`` must
        not change until the request is done."""
        t = self._tile(key, buf)
        mv = memoryview(buf.numpy())
        fd = self._fds[key]
        futs = [self._pool.submit(self._write_block, key, b, fd, t, mv[o:o + n], o)
                for b, (o, n) in enumerate(self._blocks(t))]
        return NvmeRequest(futs, "write", key)

    def read(self, key: str, buf: torch.Tensor) -> NvmeRequest:
        """Start reading tile ``key`` into ``buf``; returns at once. Raises :class:`NvmeError` now
        if the tile's file is missing or truncated, and from :meth:`NvmeRequest.wait` if a block's
        checksum differs from the one written (naming the file and offset)."""
        t = self._tile(key, buf)
        self._check_file(t)
        mv = memoryview(buf.numpy())
        fd = self._fds[key]
        futs = [self._pool.submit(self._read_block, key, b, fd, t, mv[o:o + n], o)
                for b, (o, n) in enumerate(self._blocks(t))]
        return NvmeRequest(futs, "read", key)

    def read_foreign(self, key: str, nbytes: int) -> torch.Tensor:
        """A new ``uint8[nbytes]`` tensor of the file ``<key>.tile`` in this store's directory that
        another process's store made (not one of :attr:`tiles`, and not truncated or reserved here:
        it is that store's scratch): under data parallel, another rank's moments
        (``NvmeTier.read_moment``). Read with buffered I/O, which Linux keeps coherent with that
        process's ``O_DIRECT`` writes. Its checksums live in that process: this read is not checked.
        Raises :class:`NvmeError` naming the file when it is missing, a symlink or shorter than
        ``nbytes``."""
        t = _Tile(os.path.join(self.directory, f"{key}.tile"), nbytes, align_up(nbytes))
        self._check_file(t)
        out = aligned_buffer(nbytes)
        try:
            fd = os.open(t.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise NvmeError(f"cannot open NVMe tile file {t.path!r} of another rank: {e}") from e
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
        read and drops them after a direct write); :meth:`sync` forces the write-back and takes the
        tile's checksums (until then a read of it is not checked). The mapping is of the file this
        store opened, never of whatever the path names by then."""
        t = self.tiles[key]
        mapping = mmap.mmap(self._fds[key], t.padded, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._mapped[key] = mapping
        self._sums[key] = [None] * len(self._sums[key])
        return torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive while it lives

    def is_mapped(self, key: str) -> bool:
        """Whether :meth:`map_tile` mapped tile ``key``."""
        return key in self._mapped

    def sync(self, key: str) -> None:
        """Write tile ``key``'s dirty cached pages (from a :meth:`map_tile` mapping) to the disk
        and wait (``fsync``); then take its checksums from the mapping, and let go of it.

        Raises:
            NvmeError: the write-back failed (a full or failing disk), naming the file.
        """
        try:
            os.fsync(self._fds[key])
        except OSError as e:
            raise NvmeError(f"cannot write NVMe tile file {self.tiles[key].path!r} back to disk: {e}") from e
        mapping = self._mapped.get(key)
        if mapping is not None:
            if self.checksums:
                view = memoryview(mapping)
                self._sums[key] = [_sum(view[o:o + n]) for o, n in self._blocks(self.tiles[key])]
                view.release()
            self._mapped[key] = None

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
