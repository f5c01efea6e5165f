"""Files a run writes and the directories it owns: atomic writes (a reader, or the next run after a
crash, sees the old content or the new, never a torn or empty file), clear errors for a full disk,
and a lock that keeps a second process out of a directory while naming the one that holds it.

``filelock`` (which torch depends on) truncates its lock file on every attempt to take it, so it
cannot say who holds a lock; :class:`DirectoryLock` is ``fcntl.flock`` on a file that records the
holder, which the kernel releases however the holder ends (a crash, SIGKILL), leaving no stale
lock to remove by hand.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import socket
import sys
from pathlib import Path
from typing import Callable

from megatrain.errors import MegatrainError

_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
TMP_TAG = ".tmp-"
"""Infix of the temporary files :func:`write_atomic` leaves behind when killed: ``.<name>.tmp-<hex>``."""


def raise_if_full(e: OSError, path: str | os.PathLike, what: str) -> None:
    """Raise :class:`DiskFullError` from ``e`` when ``e``, from writing ``path``, is a full disk
    (or a quota or the file size limit): the message names ``what`` ("metrics.jsonl", "the token
    store"), the free space left and that the same command runs again. Else return: the caller
    re-raises ``e``, whose own words name the path."""
    if e.errno not in _FULL:
        return
    try:
        free = f"{shutil.disk_usage(Path(path).parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    reason = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
              errno.EFBIG: "the file size limit (ulimit -f) was reached"}[e.errno]
    raise DiskFullError(f"cannot write {what} at {path}: {reason} ({free} on its file system); free space (or "
                        "raise the limit) and run the same command again: what was written before is intact") from e


class DiskFullError(MegatrainError, OSError):
    """A write failed because the disk (or a quota, or the file size limit) is full; the message
    names the file, the free space and the fix."""


def write_atomic(path: str | os.PathLike, data: bytes | str, *, what: str | None = None) -> None:
    """Replace ``path`` with ``data`` (``str`` is written as UTF-8) atomically: written to a
    temporary file beside it (``.<name>.tmp-<hex>``), fsynced, renamed over ``path``, and the
    directory fsynced. A crash at any moment leaves the old content or the new one.

    Raises:
        DiskFullError: the disk, a quota or the file size limit is full (the old file is intact).
        OSError: another refusal of the file system (the temporary file is removed).
    """
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}{TMP_TAG}{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(e, OSError):
            raise_if_full(e, path, what or path.name)
        raise


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_leftover(name: str) -> bool:
    """Whether ``name`` is a temporary file :func:`write_atomic` left when killed."""
    return name.startswith(".") and TMP_TAG in name


class LockedError(MegatrainError):
    """Another process holds a :class:`DirectoryLock`; the message names it."""


class DirectoryLock:
    """An exclusive ``flock`` on ``lock_file``, for one process at a time, recording who holds it
    (process id, host, start time, command line) so that another process can say so.

    ``what`` names the locked thing in messages ("output_dir runs/a"). Use as a context manager,
    or :meth:`acquire` and :meth:`release`.
    """

    def __init__(self, lock_file: str | os.PathLike, what: str):
        self.path = Path(lock_file)
        self.what = what
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def holder(self) -> str:
        """Who holds the lock, as its file says ("pid 123 on host h since ..."), or "another process"."""
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                text = f.read().strip()
        except OSError:
            text = ""
        return text or "another process"

    def acquire(self, *, wait: bool = False, on_wait: Callable[[str], None] | None = None) -> None:
        """Take the lock. Held by another process: raise (``wait=False``), or call ``on_wait`` with
        a line naming the holder and block until it is released.

        Raises:
            LockedError: held by another process and ``wait`` is False.
            OSError: the lock file cannot be created (an unwritable directory).
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who = self.holder()
                if not wait:
                    raise LockedError(f"{self.what} is in use by {who}: wait for that run to end (or stop it), "
                                      "or choose another directory") from None
                if on_wait is not None:
                    on_wait(f"waiting for {self.what}, locked by {who}")
                fcntl.flock(fd, fcntl.LOCK_EX)
            started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            command = " ".join(sys.argv)[:300]
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()} since {started} ({command})\n".encode(),
                      0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Let go of the lock (closing the file releases it; the file stays, naming the last holder)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DirectoryLock":
        if not self.held:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# -- hashing and replacing a directory: the one copy of each, for checkpoints and the data stores --

HASH_CHUNK = 8 << 20
"""Bytes :func:`file_sha256` reads at a time."""


def sha256_hex(data: bytes | str) -> str:
    """The sha256 of ``data`` (``str`` hashed as UTF-8), as hex."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of the file at ``path``, as hex. Plain reads into one reused buffer, not a memory
    map: the page cache holds the file, and the process's resident set does not grow by its size."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two paths atomically with Linux's ``renameat2(RENAME_EXCHANGE)``; False where the C
    library, kernel or file system does not offer it.

    Raises:
        OSError: the swap was refused for another reason (its errno and both paths in the message).
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


def replace_directory(tmp: str | os.PathLike, path: str | os.PathLike, *, aside_tag: str = "old",
                      exchange: Callable[[Path, Path], bool] = exchange_paths,
                      ignore_cleanup_errors: bool = False) -> None:
    """Move the finished directory ``tmp`` to ``path`` (beside it, on the same file system),
    replacing what is there, and make the move durable (the parent directory fsynced).

    Where ``path`` exists the two are swapped in one atomic step (``exchange``:
    :func:`exchange_paths`) and the previous directory, now at ``tmp``, removed; where the file
    system cannot swap, the previous one is renamed aside to ``.<name>.<aside_tag>-<pid>-<hex>``,
    ``tmp`` renamed in and the previous one removed. A crash between those two renames leaves no
    directory at ``path``, and both beside it: the caller that cares finds them by ``aside_tag``
    (checkpoints recover the newest complete one). ``ignore_cleanup_errors``: a previous directory
    that cannot be removed is left, not an error (the new one is in place either way).
    """
    tmp, path = Path(tmp), Path(path)
    parent = path.parent
    if not path.exists():
        os.rename(tmp, path)
        fsync_dir(parent)
        return
    if exchange(tmp, path):
        fsync_dir(parent)
        shutil.rmtree(tmp, ignore_errors=ignore_cleanup_errors)  # now the previous directory
        return
    old = parent / f".{path.name}.{aside_tag}-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=ignore_cleanup_errors)
