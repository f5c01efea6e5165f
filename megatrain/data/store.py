"""Out-of-core token store: a corpus tokenised once into a memory-mapped file, reused across runs.

A store is a directory of three files (format version 1):

``tokens.bin``
    Every document's token ids followed by the end-of-text id, documents in corpus order
    (:func:`~megatrain.data.sources.corpus_files`, then file order), as little-endian
    ``uint16`` when the vocabulary has at most 65,536 tokens, else ``uint32``: one flat array of
    ``num_tokens`` ids that ``mmap`` reads without loading it.
``offsets.npy``
    ``int64[num_documents + 1]``: document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``, its
    end-of-text token included; ``offsets[0] == 0`` and ``offsets[-1] == num_tokens``.
``manifest.json``
    A :class:`StoreManifest`: what was tokenised (a fingerprint of the source files: relative
    paths, sizes, modification times), with what (the sha256 of the tokenizer's JSON, the
    end-of-text id), the dtype, the counts and the sha256 of both files.

The layout is the one large training frameworks use: Megatron-LM's indexed dataset
(``megatron/core/datasets/indexed_dataset.py``: a ``.bin`` of token ids and an ``.idx`` of
document pointers) and nanoGPT's ``data/openwebtext/prepare.py`` (one ``uint16`` memmap).

Building (:func:`build_token_store`): the source's files are cut into contiguous runs of about
equal size; spawned worker processes tokenise runs into shard files, and the parent concatenates
the shards in corpus order while hashing them, so the store's bytes do not depend on the number
of workers. Everything is written into a temporary directory beside the target and renamed into
place, so a store is either complete or absent; a crash leaves only the temporary directory,
which the next build of that directory removes. One process at a time checks or builds a store
(a lock file beside it); the workers die with the process that spawned them.

A byte budget (``max_bytes``) takes the corpus's first ``max_bytes`` UTF-8 bytes of document text
exactly as :func:`~megatrain.data.sources.load_documents` does (the document crossing the budget is
cut at a character boundary); since where the budget runs out is known only by reading in order,
such a build is one task in this process. Budgets are for samples; a whole corpus
(``max_bytes=None``) is tokenised in parallel.

Reuse (:func:`cached_token_store`): the store directory is reused when its manifest's key (source
fingerprint, tokenizer sha256, end-of-text token, text field, byte budget, format version) matches and the
store verifies (sizes, and by default the sha256 of both files); a store that fails to verify is
rebuilt, never used.

Reading: :class:`~megatrain.data.windows.StoreWindows`.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import mmap
import os
import shutil
import signal
import time
import uuid
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError
from tokenizers import Tokenizer

from megatrain.data.sources import ByteBudget, corpus_files, default_corpus_dir, iter_file_documents
from megatrain.data.tokenizer import find_eot_token
from megatrain.errors import MegatrainError
from megatrain.files import DirectoryLock, file_sha256, raise_if_full, replace_directory, sha256_hex
from megatrain.units import MiB

__all__ = [
    "CorruptStoreError",
    "StoreError",
    "StoreManifest",
    "TokenStore",
    "build_token_store",
    "cached_token_store",
    "open_token_store",
    "store_key",
]

logger = logging.getLogger(__name__)

FORMAT = "megatrain-token-store"
VERSION = 1
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.npy"
MANIFEST_FILE = "manifest.json"

# Shards are contiguous runs of files of about this many source bytes (at most; at least 1 MiB):
# 16 per worker balance the load, and at 16 MiB or less the progress bar moves every 10 s or so
# per worker (tokenising runs at 1-2 MB/s per core here); per-shard costs (a task, two files)
# stay negligible.
_MAX_SHARD_BYTES = 16 * MiB
_SHARDS_PER_WORKER = 16
_MIN_SHARD_BYTES = MiB
# Documents per encode_batch call and the text they may hold: bounds a worker's memory to a
# batch, not its shard. An Encoding keeps each token's string, ids and masks: measured here, a
# batch of 1 MiB of stdlib text (~0.3 M tokens) peaks at +47 MB, one of 8 MiB at +377 MB.
_ENCODE_DOCS = 512
_ENCODE_CHARS = MiB
_HASH_CHUNK = 8 * MiB
_SKIPPED_EXAMPLES = 10


class StoreError(MegatrainError, ValueError):
    """A token store cannot be built from its source (empty corpus, no end-of-text token)."""


class CorruptStoreError(StoreError):
    """A token store on disk is incomplete, altered or of another format; it must be rebuilt."""


class StoreManifest(BaseModel):
    """``manifest.json`` of a token store: the JSON boundary, validated on read.

    Hashes are lowercase hex sha256. Sizes in bytes; counts in tokens or documents.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["megatrain-token-store"]
    version: Literal[1]
    key: str
    """:func:`store_key` of the source, tokenizer and options the store was built from."""
    source: str
    """Absolute path of the corpus (a directory or one file)."""
    source_files: int
    source_bytes: int
    """Size on disk of the source files read."""
    source_sha256: str
    """sha256 of the listing of the source files: relative path, size and mtime (ns) of each."""
    tokenizer_sha256: str
    """sha256 of ``Tokenizer.to_str()``."""
    vocab_size: int
    """``Tokenizer.get_vocab_size()`` (added tokens included): every id is below it."""
    eot_token: str
    eot_id: int
    text_field: str
    max_bytes: int | None = None
    """The byte budget the store was cut to (None: the whole corpus). A default, so that manifests
    written before the field existed still validate (their key is unchanged: see :func:`store_key`)."""
    dtype: Literal["uint16", "uint32"]
    num_documents: int
    num_tokens: int
    text_bytes: int | None = None
    """UTF-8 bytes of the document text tokenised (None in manifests written before the field)."""
    skipped_files: int
    """Text files of a directory skipped because they are not UTF-8."""
    skipped_examples: list[str]
    """The first (at most 10) of them, so the manifest stays small on any corpus."""
    tokens_sha256: str
    offsets_sha256: str
    build_seconds: float


# --------------------------------------------------------------------------
# Keys and fingerprints
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Source:
    """The resolved corpus: its root, its files in reading order and their fingerprint."""

    root: Path
    files: tuple[Path, ...]
    in_directory: bool
    sizes: tuple[int, ...]
    sha256: str

    @classmethod
    def resolve(cls, source: str | os.PathLike[str] | None) -> _Source:
        root = (default_corpus_dir() if source is None else Path(source)).absolute()
        files = tuple(corpus_files(root))
        stats = [f.stat() for f in files]
        base = root if root.is_dir() else root.parent
        listing = [[f.relative_to(base).as_posix(), s.st_size, s.st_mtime_ns] for f, s in zip(files, stats)]
        return cls(
            root=root,
            files=files,
            in_directory=root.is_dir(),
            sizes=tuple(s.st_size for s in stats),
            sha256=sha256_hex(json.dumps(listing, separators=(",", ":"))),
        )


def store_key(source_sha256: str, tokenizer_sha256: str, eot_token: str, text_field: str,
              max_bytes: int | None = None) -> str:
    """sha256 naming what a store holds: equal keys mean equal ``tokens.bin``.

    Args:
        source_sha256: :attr:`StoreManifest.source_sha256` (the file listing's hash).
        tokenizer_sha256: sha256 of the tokenizer's JSON.
        eot_token: the end-of-text token appended after each document.
        text_field: the ``.jsonl`` key / ``.parquet`` column read.
        max_bytes: the byte budget, or None for the whole corpus (then left out of the hashed
            list, so whole-corpus stores keep the key they had before budgets existed).
    """
    key: list = [FORMAT, VERSION, source_sha256, tokenizer_sha256, eot_token, text_field]
    if max_bytes is not None:
        key.append(max_bytes)
    return sha256_hex(json.dumps(key))


def little_endian(dtype: str | np.dtype) -> np.dtype:
    """``dtype`` little-endian: the file's byte order on every machine."""
    return np.dtype(dtype).newbyteorder("<")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every token id of a vocabulary of ``vocab_size``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


_dtype_for = token_dtype  # its earlier name, which tests/test_data_store.py reads


# --------------------------------------------------------------------------
# Opening a store
# --------------------------------------------------------------------------


class TokenStore:
    """An open token store: its manifest and a read-only memory map of its tokens.

    Nothing is read at construction beyond the manifest and the ``.npy`` header of the offsets;
    pages of ``tokens`` are read on access. Use as a context manager or call :meth:`close`.

    Attributes:
        path: the store directory.
        manifest: its :class:`StoreManifest`.
        tokens: ``np.ndarray`` of the manifest's dtype, shape ``[num_tokens]``, read-only, backed
            by the map.
        origin: how it came to be open: ``"opened"``, ``"reused"``, ``"built"`` or
            ``"rebuilt (<reason>)"``, for a caller to report.
    """

    def __init__(self, path: Path, manifest: StoreManifest, *, origin: str = "opened") -> None:
        self.path = path
        self.manifest = manifest
        self.origin = origin
        self._fh = open(path / TOKENS_FILE, "rb")
        # A shared read-only map of a file we never write: the kernel reads pages on demand and
        # can drop them at any time, and madvise(DONTNEED) only unmaps them from this process.
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_RANDOM"):
            # Windows are read at random: no read-ahead and no mapping of neighbouring pages.
            self._mm.madvise(mmap.MADV_RANDOM)
        self.tokens = np.frombuffer(self._mm, dtype=little_endian(manifest.dtype))
        self._offsets: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def num_documents(self) -> int:
        return self.manifest.num_documents

    @property
    def eot_id(self) -> int:
        return self.manifest.eot_id

    @property
    def offsets(self) -> np.ndarray:
        """``int64[num_documents + 1]`` document starts, memory-mapped (see the module docstring)."""
        if self._offsets is None:
            self._offsets = np.load(self.path / OFFSETS_FILE, mmap_mode="r")
        return self._offsets

    def document(self, i: int) -> np.ndarray:
        """Token ids of document ``i`` (its end-of-text token last), as ``int64[n]`` (a copy).

        Raises:
            IndexError: ``i`` is not in ``[0, num_documents)``.
        """
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} out of range: the store holds {self.num_documents}")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b].astype(np.int64)

    def release(self) -> None:
        """Unmap every page of the token map from this process (the page cache keeps the data).

        This keeps pages a reader has finished with out of the process's resident set, so that
        reading the whole corpus does not grow it; a later read maps them again. The whole map,
        not the ranges read: a fault may map more than the page it needs (the page-cache folio
        around it, up to megabytes on recent kernels), and ``MADV_DONTNEED`` on an empty range
        costs only the page-table walk of what is mapped. A no-op where ``madvise`` is missing.
        """
        if hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED)
        # else (e.g. Windows): pages stay resident until the OS trims the working set

    def close(self) -> None:
        """Close the map and the file. ``tokens`` must not be used afterwards."""
        self.tokens = np.empty(0, dtype=self.manifest.dtype)
        self._offsets = None
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view of the map; it is closed when that view dies
        self._fh.close()

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        m = self.manifest
        return (f"TokenStore({str(self.path)!r}, {m.num_documents:,} documents, {m.num_tokens:,} "
                f"{m.dtype} tokens, vocab {m.vocab_size:,})")


def _read_manifest(path: Path) -> StoreManifest:
    f = path / MANIFEST_FILE
    if not f.is_file():
        raise CorruptStoreError(f"token store {str(path)!r} has no {MANIFEST_FILE} (an interrupted "
                                f"build, or not a store); rebuild it")
    try:
        return StoreManifest.model_validate_json(f.read_bytes())
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise CorruptStoreError(f"token store {str(path)!r}: {MANIFEST_FILE} is not a version-{VERSION} "
                                f"manifest ({where}: {first['msg']}); rebuild it") from None


def open_token_store(
    path: str | os.PathLike[str], *, verify: Literal["full", "size"] = "full"
) -> TokenStore:
    """Open the store in ``path`` after checking it is the store its manifest describes.

    Args:
        path: the store directory.
        verify: ``"full"`` checks file sizes, the offsets' shape and ends, and the sha256 of
            ``tokens.bin`` and ``offsets.npy`` (a read of both files: 4.9 s for the 704 MB
            ``tokens.bin`` of a 1 GB corpus on a loaded 2-core machine, ``bench/data_rss.py``);
            ``"size"`` checks all but the hashes (instant, but a flipped byte goes unseen).

    Returns:
        The open :class:`TokenStore`.

    Raises:
        CorruptStoreError: a file is missing, the manifest is malformed or of another version,
            a size or a hash does not match; the message names the file and says to rebuild.
        ValueError: ``verify`` is neither ``"full"`` nor ``"size"``.
    """
    if verify not in ("full", "size"):
        raise ValueError(f"verify must be 'full' or 'size', got {verify!r}")
    path = Path(path)
    m = _read_manifest(path)
    tokens, offsets = path / TOKENS_FILE, path / OFFSETS_FILE

    def corrupt(what: str) -> CorruptStoreError:
        return CorruptStoreError(f"token store {str(path)!r}: {what}; it must be rebuilt "
                                 f"(delete the directory or build it again)")

    for f in (tokens, offsets):
        if not f.is_file():
            raise corrupt(f"{f.name} is missing")
    want = m.num_tokens * np.dtype(m.dtype).itemsize
    if tokens.stat().st_size != want:
        raise corrupt(f"{TOKENS_FILE} holds {tokens.stat().st_size:,} bytes, the manifest's "
                      f"{m.num_tokens:,} {m.dtype} tokens need {want:,}")
    try:
        off = np.load(offsets, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise corrupt(f"{OFFSETS_FILE} is not a readable .npy file ({e})") from None
    if off.dtype != np.int64 or off.shape != (m.num_documents + 1,):
        raise corrupt(f"{OFFSETS_FILE} is {off.dtype}{list(off.shape)}, the manifest needs "
                      f"int64[{m.num_documents + 1}]")
    if int(off[0]) != 0 or int(off[-1]) != m.num_tokens:
        raise corrupt(f"{OFFSETS_FILE} runs from {int(off[0])} to {int(off[-1])}, not 0 to {m.num_tokens}")
    del off
    if verify == "full":
        for f, expected in ((tokens, m.tokens_sha256), (offsets, m.offsets_sha256)):
            if file_sha256(f) != expected:
                raise corrupt(f"{f.name} does not match the sha256 in {MANIFEST_FILE}")
    return TokenStore(path, m)


# --------------------------------------------------------------------------
# Building a store
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Task:
    """One shard: a contiguous run of source files, tokenised into ``out``."""

    index: int
    files: tuple[str, ...]
    nbytes: int
    out: str
    text_field: str
    in_directory: bool
    eot_id: int
    dtype: str
    max_bytes: int | None = None
    """A byte budget over the whole corpus: only with a single task (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class _Shard:
    index: int
    num_documents: int
    num_tokens: int
    skipped: tuple[str, ...]
    text_bytes: int


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer_json: str, parent: int) -> None:
    global _WORKER_TOKENIZER
    _die_with_parent(parent)
    # The parent decides what an interrupt does (it terminates the pool); Ctrl-C reaches the whole
    # process group, and a worker's KeyboardInterrupt would only add a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Each worker is one of N processes: its encode_batch must not start N threads of its own.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = Tokenizer.from_str(tokenizer_json)


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel SIGKILL this worker when the process that spawned it dies
    (``prctl(PR_SET_PDEATHSIG)``), so a build killed with SIGKILL leaves no worker tokenising its
    shard for minutes. Elsewhere a no-op."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    pr_set_pdeathsig = 1
    prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(1)


def _run_task(task: _Task, tokenizer: Tokenizer | None = None) -> _Shard:
    """Tokenise one shard: ``<out>.bin`` (ids, end-of-text after each document) and ``<out>.len``."""
    tok = tokenizer if tokenizer is not None else _WORKER_TOKENIZER
    assert tok is not None, "_init_worker sets the worker's tokenizer"
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # same ids, no offsets
    skipped: list[Path] = []
    lengths: list[int] = []
    num_tokens = 0
    text_bytes = 0
    budget = ByteBudget(task.max_bytes)
    with open(task.out + ".bin", "wb") as out:
        batch: list[str] = []
        chars = 0

        def flush() -> None:
            nonlocal num_tokens, chars
            flat: list[int] = []
            for enc in encode(batch, add_special_tokens=False):
                flat.extend(enc.ids)
                flat.append(task.eot_id)
                lengths.append(len(enc.ids) + 1)
            out.write(np.asarray(flat, dtype=little_endian(task.dtype)).data)  # tofile would lose a full disk's errno
            num_tokens += len(flat)
            batch.clear()
            chars = 0

        for name in task.files:
            for text in iter_file_documents(Path(name), text_field=task.text_field,
                                            skip_undecodable=task.in_directory, skipped=skipped):
                data = text.encode("utf-8")
                if task.max_bytes is not None:
                    # load_documents' rule, so a budgeted store holds what it reads
                    text = budget.take(data)
                    if not text:
                        break
                    data = text.encode("utf-8")
                text_bytes += len(data)
                batch.append(text)
                chars += len(text)
                if len(batch) >= _ENCODE_DOCS or chars >= _ENCODE_CHARS:
                    flush()
                if budget.exhausted:
                    break
            if budget.exhausted:
                break
        if batch:
            flush()
    with open(task.out + ".len", "wb") as f:
        f.write(np.asarray(lengths, dtype=np.int64).data)
    return _Shard(task.index, len(lengths), num_tokens, tuple(str(p) for p in skipped), text_bytes)


def _plan_tasks(src: _Source, workers: int, tmp: Path, max_bytes: int | None = None, **common) -> list[_Task]:
    total = sum(src.sizes)
    if max_bytes is not None:
        # One task reads in corpus order until the budget is spent (module docstring).
        return [_Task(0, tuple(str(f) for f in src.files), min(total, max_bytes), str(tmp / "shard000000"),
                      max_bytes=max_bytes, **common)]
    target = int(min(_MAX_SHARD_BYTES, max(_MIN_SHARD_BYTES, total // max(1, workers * _SHARDS_PER_WORKER))))
    tasks: list[_Task] = []
    run: list[str] = []
    run_bytes = 0
    for f, size in zip(src.files, src.sizes):
        run.append(str(f))
        run_bytes += size
        if run_bytes >= target:
            tasks.append(_Task(len(tasks), tuple(run), run_bytes, str(tmp / f"shard{len(tasks):06d}"), **common))
            run, run_bytes = [], 0
    if run:
        tasks.append(_Task(len(tasks), tuple(run), run_bytes, str(tmp / f"shard{len(tasks):06d}"), **common))
    return tasks


def _tokenise(tasks: list[_Task], tokenizer: Tokenizer, workers: int, progress: bool) -> list[_Shard]:
    from tqdm.auto import tqdm

    bar = tqdm(total=sum(t.nbytes for t in tasks), unit="B", unit_scale=True, unit_divisor=1024,
               desc="tokenising", disable=not progress, delay=2.0)  # no bar for a build of seconds
    shards: list[_Shard | None] = [None] * len(tasks)
    try:
        if workers <= 1:
            for t in tasks:
                shards[t.index] = _run_task(t, tokenizer)
                bar.update(t.nbytes)
        else:
            # spawn, not fork: the parent has torch's and tokenizers' thread pools running, and a
            # forked child of a threaded process may deadlock (tokenizers warns and disables its
            # parallelism after fork for that reason). multiprocessing's Pool, not
            # concurrent.futures': on an error or an interrupt terminate() stops the workers now,
            # where the executor's shutdown waits for each to finish its shard.
            pool = get_context("spawn").Pool(workers, initializer=_init_worker,
                                             initargs=(tokenizer.to_str(), os.getpid()))
            try:
                for shard in pool.imap_unordered(_run_task, tasks):
                    shards[shard.index] = shard
                    bar.update(tasks[shard.index].nbytes)
                pool.close()
            except BaseException:
                pool.terminate()
                raise
            finally:
                pool.join()
    finally:
        bar.close()
    return [s for s in shards if s is not None]


def _merge(tasks: list[_Task], shards: list[_Shard], tmp: Path, dtype: np.dtype) -> tuple[str, str]:
    """Concatenate the shards into ``tokens.bin`` and ``offsets.npy``; return their sha256."""
    num_docs = sum(s.num_documents for s in shards)
    h = hashlib.sha256()
    with open(tmp / TOKENS_FILE, "wb") as out:
        for t in tasks:
            with open(t.out + ".bin", "rb") as fh:
                while chunk := fh.read(_HASH_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            os.unlink(t.out + ".bin")
        out.flush()
        os.fsync(out.fileno())
    offsets = np.lib.format.open_memmap(tmp / OFFSETS_FILE, mode="w+", dtype=np.int64, shape=(num_docs + 1,))
    offsets[0] = 0
    pos, base = 1, 0
    for t in tasks:
        lengths = np.fromfile(t.out + ".len", dtype=np.int64)
        ends = base + np.cumsum(lengths)
        offsets[pos : pos + len(lengths)] = ends
        if len(lengths):
            base = int(ends[-1])
        pos += len(lengths)
        os.unlink(t.out + ".len")
    offsets.flush()
    del offsets
    if base != sum(s.num_tokens for s in shards) or base * dtype.itemsize != (tmp / TOKENS_FILE).stat().st_size:
        raise RuntimeError("token store build: shard lengths and shard files disagree (a bug)")
    return h.hexdigest(), file_sha256(tmp / OFFSETS_FILE)


def build_token_store(
    source: str | os.PathLike[str] | None,
    tokenizer: Tokenizer,
    path: str | os.PathLike[str],
    *,
    eot_token: str | None = None,
    text_field: str = "text",
    max_bytes: int | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> TokenStore:
    """Tokenise ``source`` into a new store at ``path`` (replacing any store there).

    Args:
        source: the corpus, as for :func:`~megatrain.data.sources.load_documents` (``None``:
            the interpreter's standard library).
        tokenizer: any ``tokenizers.Tokenizer``; documents are encoded without special tokens.
        path: the store directory; its parent is created if missing.
        eot_token: the token appended after each document; ``None`` takes the first of
            :data:`~megatrain.data.tokenizer.EOT_CANDIDATES` the tokenizer has.
        text_field: the ``.jsonl`` key / ``.parquet`` column holding the text.
        max_bytes: take only the first this many UTF-8 bytes of document text, as
            :func:`~megatrain.data.sources.load_documents` does (tokenised in this process: see
            the module docstring); None (the default) reads the whole corpus in parallel.
        workers: tokenising processes; ``None`` is the number of cores this process may run on,
            at most one per shard; ``1`` tokenises in this process (with the tokenizer's own
            threads). Builds of one store take turns (a lock file beside it, ``.<name>.lock``,
            which a process that waits names in a warning); a build removes the temporary
            directories a killed build left beside ``path``. The workers are killed with this
            process (SIGKILL included, on Linux) and stopped at once by an error or an interrupt.
        progress: show a tqdm bar of source bytes tokenised (on stderr).

    Returns:
        The open :class:`TokenStore` (``origin == "built"``).

    Raises:
        FileNotFoundError, ValueError, ImportError: as
            :func:`~megatrain.data.sources.load_documents` for the source (a malformed record
            names its file and line).
        StoreError: the tokenizer lacks ``eot_token`` (or every candidate end-of-text token), or
            the source holds no non-empty document.
        ValueError: ``max_bytes`` is not positive.
    """
    path = Path(path).absolute()
    with _locked(path):
        return _build(_Source.resolve(source), tokenizer, path, eot_token=eot_token, text_field=text_field,
                      max_bytes=max_bytes, workers=workers, progress=progress)


def _locked(path: Path) -> DirectoryLock:
    """The lock of the store at ``path`` (``.<name>.lock`` beside it), taken: one process checks,
    builds or replaces a store at a time; another that wants it waits, saying for whom (and then
    reuses what the first built). Readers of a built store need no lock: a rebuild renames a new
    directory into place, and a reader's open memory maps keep the files they map."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = DirectoryLock(path.parent / f".{path.name}.lock", f"the token store {path}")
    lock.acquire(wait=True, on_wait=logger.warning)
    return lock


def _resolve_eot(tokenizer: Tokenizer, eot_token: str | None) -> tuple[str, int]:
    if eot_token is None:
        try:
            eot_token = find_eot_token(tokenizer)
        except ValueError as e:
            raise StoreError(str(e)) from None
    eot_id = tokenizer.token_to_id(eot_token)
    if eot_id is None:
        raise StoreError(f"the tokenizer has no token {eot_token!r} to end documents with; pass its "
                         f"end-of-sequence token as eot_token")
    return eot_token, eot_id


def _default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use, not the machine's
    except AttributeError:
        return os.cpu_count() or 1


def _build(src: _Source, tokenizer: Tokenizer, path: Path, *, eot_token: str | None, text_field: str,
           max_bytes: int | None, workers: int | None, progress: bool) -> TokenStore:
    t0 = time.perf_counter()
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive number of bytes or None, got {max_bytes}")
    eot_token, eot_id = _resolve_eot(tokenizer, eot_token)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab)
    tok_sha = sha256_hex(tokenizer.to_str())
    n_workers = _default_workers() if workers is None else workers
    if n_workers < 1:
        raise ValueError(f"workers must be >= 1 or None, got {workers}")

    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*path.parent.glob(f".{path.name}.tmp-*"), *path.parent.glob(f".{path.name}.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)  # left by a build that was killed (the caller holds the lock)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        tasks = _plan_tasks(src, n_workers, tmp, text_field=text_field, in_directory=src.in_directory,
                            eot_id=eot_id, dtype=dtype.name, max_bytes=max_bytes)
        shards = _tokenise(tasks, tokenizer, min(n_workers, len(tasks)), progress)
        num_docs = sum(s.num_documents for s in shards)
        if num_docs == 0:
            raise StoreError(f"no non-empty UTF-8 documents found in {str(src.root)!r}")
        tokens_sha, offsets_sha = _merge(tasks, shards, tmp, dtype)
        manifest = StoreManifest(
            format=FORMAT, version=VERSION,
            key=store_key(src.sha256, tok_sha, eot_token, text_field, max_bytes),
            source=str(src.root), source_files=len(src.files), source_bytes=sum(src.sizes),
            source_sha256=src.sha256, tokenizer_sha256=tok_sha, vocab_size=vocab,
            eot_token=eot_token, eot_id=eot_id, text_field=text_field, max_bytes=max_bytes, dtype=dtype.name,
            num_documents=num_docs, num_tokens=sum(s.num_tokens for s in shards),
            text_bytes=sum(s.text_bytes for s in shards),
            skipped_files=sum(len(s.skipped) for s in shards),
            skipped_examples=[p for s in shards for p in s.skipped][:_SKIPPED_EXAMPLES],
            tokens_sha256=tokens_sha, offsets_sha256=offsets_sha,
            build_seconds=round(time.perf_counter() - t0, 3),
        )
        with open(tmp / MANIFEST_FILE, "w", encoding="utf-8") as fh:
            fh.write(manifest.model_dump_json(indent=1))
            fh.flush()
            os.fsync(fh.fileno())
        replace_directory(tmp, path, ignore_cleanup_errors=True)
    except OSError as e:  # a full disk says so, with the space left, not "25013 requested and 0 written"
        raise_if_full(e, path, "the token store")
        raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("token store %s: %d documents, %d tokens (%.1f s)", path, manifest.num_documents,
                manifest.num_tokens, manifest.build_seconds)
    return TokenStore(path, manifest, origin="built")


def cached_token_store(
    source: str | os.PathLike[str] | None,
    tokenizer: Tokenizer,
    path: str | os.PathLike[str],
    *,
    eot_token: str | None = None,
    text_field: str = "text",
    max_bytes: int | None = None,
    workers: int | None = None,
    progress: bool = True,
    verify: Literal["full", "size"] = "full",
) -> TokenStore:
    """The store at ``path`` if it holds ``source`` tokenised by ``tokenizer``, else a new one.

    The store is reused when its manifest's key equals the key of the arguments (the source's
    file listing with sizes and modification times, the tokenizer's JSON, the end-of-text token,
    the text field and the byte budget) and it verifies (:func:`open_token_store` with ``verify``). Otherwise it
    is rebuilt in place, and :attr:`TokenStore.origin` says why: ``"rebuilt (source changed)"``,
    ``"rebuilt (tokenizer changed)"``, ``"rebuilt (options changed)"`` or
    ``"rebuilt (corrupt: ...)"`` (also logged as a warning). A corrupt store is never used.

    Arguments and errors as for :func:`build_token_store` and :func:`open_token_store`.
    """
    path = Path(path).absolute()
    with _locked(path):
        src = _Source.resolve(source)
        eot_token, _ = _resolve_eot(tokenizer, eot_token)
        tok_sha = sha256_hex(tokenizer.to_str())
        key = store_key(src.sha256, tok_sha, eot_token, text_field, max_bytes)
        reason = None
        # An empty directory (a fresh tempfile.mkdtemp, a mkdir'd cache) holds no store yet: built, not corrupt.
        if path.exists() and not (path.is_dir() and not any(path.iterdir())):
            try:
                m = _read_manifest(path)
            except CorruptStoreError as e:
                reason = f"corrupt: {e}"
            else:
                if m.key == key:
                    try:
                        store = open_token_store(path, verify=verify)
                    except CorruptStoreError as e:
                        reason = f"corrupt: {e}"
                    else:
                        store.origin = "reused"
                        return store
                elif m.source_sha256 != src.sha256:
                    reason = "source changed"
                elif m.tokenizer_sha256 != tok_sha:
                    reason = "tokenizer changed"
                else:
                    reason = "options changed"
            if reason.startswith("corrupt"):
                logger.warning("token store %s is not usable, rebuilding it: %s", path, reason)
        store = _build(src, tokenizer, path, eot_token=eot_token, text_field=text_field, max_bytes=max_bytes,
                       workers=workers, progress=progress)
        store.origin = "built" if reason is None else f"rebuilt ({reason})"
        return store
