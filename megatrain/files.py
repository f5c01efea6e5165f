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
import stat
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
            text = read_regular(self.path, 4096).decode("utf-8", errors="replace").strip()
        except OSError:
            text = ""
        return text or "another process"

    def acquire(self, *, wait: bool = False, on_wait: Callable[[str], None] | None = None) -> None:
        """Take the lock. Held by another process: raise (``wait=False``), or call ``on_wait`` with
        a line naming the holder and block until it is released.

        Raises:
            LockedError: held by another process and ``wait`` is False.
            UnsafeFileError: the lock file is a symlink, a hard link, a FIFO or not a file
                (:func:`open_lock_file`); nothing was written to it.
            OSError: the lock file cannot be created (an unwritable directory).
        """
        fd, ours = open_lock_file(self.path, self.what)
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
            if ours:  # another user's lock file in a shared directory locks as well, unwritten
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


# ---------------------------------------------------------------------------------------------
# Opening what another user may have planted: lock files, and paths a data registry names
# ---------------------------------------------------------------------------------------------


class UnsafeFileError(MegatrainError, OSError):
    """A path megatrain would open or read is not what its name promises: a lock file that is a
    symlink, a hard link to another file, a FIFO or a device; a path a data registry names that
    resolves outside the registry's directory. The message names the path and the fix; nothing was
    written through it."""


_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO opens at once (and is refused)


def open_lock_file(path: str | os.PathLike, what: str) -> tuple[int, bool]:
    """Open the lock file ``path`` as the NVMe tiles are opened: created exclusively (mode 0644)
    where new; else opened without following a symlink or blocking on a FIFO, and accepted only as
    a regular file with one link (a hard link planted under the lock's name would let a write
    through it change its target). Returns ``(fd, ours)``: ``ours`` when this user owns the file,
    and then ``fd`` is open for reading and writing; another user's lock file (a shared
    ``data_cache``) is opened read-only, which ``flock`` locks as well, and must not be written.

    Raises:
        UnsafeFileError: a symlink, a hard link, a FIFO, a directory or a device (naming it, what it
            locks and the fix: remove it).
        OSError: the file cannot be created or opened (an unwritable directory).
    """
    path = os.fspath(path)
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o644), True
    except FileExistsError:
        pass

    def refuse(why: str) -> UnsafeFileError:
        return UnsafeFileError(f"the lock file of {what}, {path}, {why}; megatrain never opens a lock through a "
                               f"link: remove it (rm {path}) and run again")

    try:
        fd = os.open(path, os.O_RDONLY | _NO_FOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise refuse("is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse(f"is not a regular file ({stat.filemode(st.st_mode)})")
        if st.st_nlink != 1:
            raise refuse(f"has {st.st_nlink} hard links (a file linked under the lock's name)")
        if st.st_uid != os.geteuid():
            return fd, False
        wfd = os.open(path, os.O_RDWR | _NO_FOLLOW)
        wst = os.fstat(wfd)
        if (wst.st_dev, wst.st_ino) != (st.st_dev, st.st_ino) or wst.st_nlink != 1:  # replaced in between
            os.close(wfd)
            raise refuse("changed while it was opened")
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return wfd, True


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """Up to ``limit`` bytes of the regular file ``path``, opened without following a symlink or
    blocking on a FIFO.

    Raises:
        OSError: no such file, a symlink (ELOOP), or not a regular file (EINVAL).
    """
    fd = os.open(path, os.O_RDONLY | _NO_FOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        return os.read(fd, limit)
    finally:
        os.close(fd)


def resolve_inside(root: str | os.PathLike, name: str | os.PathLike, what: str) -> Path:
    """``root / name`` where it resolves (``..`` folded, symlinks followed) inside ``root``: a path
    a file in ``root`` names (a data registry's ``file_name``) reads nothing outside it. A path the
    user gives on the command line is not checked: this is for paths that come from a file.

    Raises:
        UnsafeFileError: ``name`` is absolute, climbs out with ``..``, or is (or passes through) a
            symlink to outside ``root``; the message names ``what``, where it resolves and the fix.
    """
    path = Path(root) / name
    real, base = path.resolve(), Path(root).resolve()
    if real != base and base not in real.parents:
        raise UnsafeFileError(f"{what}: {os.fspath(name)!r} resolves to {real}, outside {os.fspath(root)!r}; a path "
                              f"read from a file there must stay inside it: move the data into {os.fspath(root)!r}, "
                              "or give its path on the command line (--data PATH)")
    return path


def open_regular(path: str | os.PathLike, what: str):
    """``path`` opened for binary reading, when it is a regular file (symlinks followed): a FIFO, a
    device or a directory is refused at once instead of a read that blocks forever (a FIFO) or
    never ends (``/dev/zero``). Returns a file object (close it, or use it in ``with``).

    Raises:
        UnsafeFileError: not a regular file (naming ``what``, the path and its kind).
        OSError: no such file, or not readable (its own message names the path).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else \
                f"not a regular file ({stat.filemode(mode)})"
            raise UnsafeFileError(f"{what} {os.fspath(path)!r} is {kind}; give a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_file_or_directory(path: str | os.PathLike, what: str) -> None:
    """Refuse an existing ``path`` that is neither a regular file nor a directory (a FIFO, a socket,
    a device), which reading would block on or never finish (symlinks are followed).

    Raises:
        UnsafeFileError: naming ``what``, the path and its kind.
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing: the caller says so in its own words
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else \
            f"a device ({stat.filemode(mode)})"
        raise UnsafeFileError(f"{what} {os.fspath(path)!r} is {kind}, not a file or a directory; give a file or a "
                              "directory")
