"""Corpus readers: a directory of text files, one text file, ``.jsonl``, ``.parquet``, or a dataset
saved with Hugging Face ``datasets`` (``save_to_disk``).

Records are read through ``datasets``: ``.jsonl`` and ``.parquet`` with
``load_dataset("json"/"parquet", data_files=..., streaming=True)`` (record batches, no Arrow cache
written, memory bounded by a batch) and a saved dataset's Arrow shards with
``Dataset.from_file`` (memory-mapped). A text file is one document, read as bytes (no reader needed).
Each reader yields whole UTF-8 documents under one byte budget (``max_bytes``, in UTF-8 bytes of
document text); every malformed input is an error naming the file and the line (``.jsonl``: the
library's own errors do not say which line, so the file is scanned for it) or column
(``.parquet``, Arrow). Nothing is downloaded: the default corpus is the running interpreter's
standard library (:func:`default_corpus_dir`).
"""

from __future__ import annotations

import itertools
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "DEFAULT_MAX_BYTES",
    "RECORD_SUFFIXES",
    "TEXT_SUFFIXES",
    "corpus_bytes",
    "corpus_files",
    "default_corpus_dir",
    "iter_file_documents",
    "load_documents",
]

#: Suffixes collected from a directory (and accepted as a single-document file).
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")

#: Suffixes of files holding many documents, one per record, each taken from a
#: text field (``.jsonl``) or column (``.parquet``); read alone or in a directory.
RECORD_SUFFIXES = (".jsonl", ".parquet")

#: Default cap on the text collected, in UTF-8 bytes. 3 MB of stdlib source is
#: about 0.9 M tokens at vocab 2048 — more than a 5-minute CPU run consumes —
#: and loading + BPE training + encoding take about 1 s on 2 cores (measured:
#: the whole 32 MB stdlib takes ~10 s and ~1.3 GB of RAM).
DEFAULT_MAX_BYTES = 3_000_000

# Directories never descended into: installed third-party packages are not
# "text nobody here wrote" in a reproducible sense (they vary per machine),
# bytecode caches hold no text, and hidden directories are VCS/tool state.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

_ACCEPTED = (
    "a directory (its *.py, *.txt, *.md, *.rst, *.jsonl, *.parquet files are read "
    "recursively), a single .py/.txt/.md/.rst file (one document), a .jsonl file "
    "(one JSON object per line), a .parquet file (one document per row) or a directory saved "
    "with Hugging Face datasets' save_to_disk (one document per row of its 'train' split)"
)


def default_corpus_dir() -> Path:
    """Return the directory holding the running interpreter's standard library.

    Found through ``sysconfig.get_paths()["stdlib"]``; e.g.
    ``/usr/lib/python3.11``. Its ``*.py``/``*.txt``/``*.rst`` files (about
    30 MB) form the default training corpus.

    Raises:
        FileNotFoundError: the interpreter reports no existing stdlib
            directory (e.g. a frozen/embedded Python).
    """
    path = Path(sysconfig.get_paths()["stdlib"])
    if not path.is_dir():
        raise FileNotFoundError(
            f"standard-library directory {str(path)!r} reported by sysconfig does "
            f"not exist; pass a corpus path explicitly ({_ACCEPTED})"
        )
    return path


def _iter_corpus_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.lower().endswith(TEXT_SUFFIXES + RECORD_SUFFIXES):
                p = Path(dirpath, name)
                if p.is_file():
                    files.append(p)
    # Sort by path components (not by os.walk order, which depends on the
    # filesystem) so the same tree always yields the same document order.
    files.sort(key=lambda p: p.relative_to(root).parts)
    return files


def corpus_bytes(source: str | os.PathLike[str] | None = None) -> int:
    """Size on disk, in bytes, of the files :func:`load_documents` reads from ``source``.

    ``None`` is :func:`default_corpus_dir`. Parquet files count compressed, so
    their text may be larger; nothing is read but directory entries.

    Raises:
        FileNotFoundError: ``source`` does not exist.
    """
    path = default_corpus_dir() if source is None else Path(source)
    if not path.exists():
        raise FileNotFoundError(f"corpus path {str(path)!r} does not exist; expected {_ACCEPTED}")
    from megatrain.files import check_file_or_directory

    check_file_or_directory(path, "corpus path")  # a FIFO would block the read forever
    if path.is_dir():
        return sum(f.stat().st_size for f in corpus_files(path))
    return path.stat().st_size


class ByteBudget:
    """Tracks the remaining byte budget; ``None`` means unlimited."""

    def __init__(self, max_bytes: int | None) -> None:
        self.left = max_bytes

    @property
    def exhausted(self) -> bool:
        return self.left is not None and self.left <= 0

    def take(self, data: bytes) -> str | None:
        """Return the (possibly truncated) document, or None if nothing fits."""
        if self.left is not None:
            if len(data) > self.left:
                # Cutting at a byte offset may split a multi-byte character;
                # "ignore" drops only that partial tail since the rest was
                # valid UTF-8 to begin with.
                data = data[: self.left]
                text = data.decode("utf-8", errors="ignore")
                self.left = 0
                return text or None
            self.left -= len(data)
        return data.decode("utf-8")


def load_documents(
    source: str | os.PathLike[str] | None = None,
    *,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    text_field: str = "text",
    skipped: list[Path] | None = None,
) -> list[str]:
    """Load text documents from a directory, a text file, a ``.jsonl`` or a ``.parquet`` file.

    Args:
        source: ``None`` for :func:`default_corpus_dir`; a directory, read
            recursively in sorted relative-path order, whose ``*.py``,
            ``*.txt``, ``*.md`` and ``*.rst`` files (case-insensitive suffix)
            become one document each and whose ``*.jsonl`` and ``*.parquet``
            files contribute one document per record, as below —
            ``site-packages``, ``dist-packages``, ``__pycache__`` and hidden
            directories are skipped, and text files that are not valid UTF-8
            or are empty are skipped; a ``.py``/``.txt``/``.md``/``.rst`` file,
            which is one document; a ``.jsonl`` file, one document per
            non-blank line taken from ``text_field``; or a ``.parquet`` file,
            one document per row taken from the string column ``text_field``
            (null and empty values are skipped); or a directory saved with
            ``datasets``' ``save_to_disk``, one document per row of its string column
            ``text_field`` (of the ``train`` split for a ``DatasetDict``).
        max_bytes: stop once this many UTF-8 bytes of text are collected.
            Documents are taken whole, except the one that would cross the
            limit, which is truncated (at a character boundary) to fit.
            ``None`` loads everything.
        text_field: key of the document text in each ``.jsonl`` object, and
            name of the text column of a ``.parquet`` file.
        skipped: when given, the text files of a directory skipped because
            they are not UTF-8 (binary or legacy-encoded) are appended to it,
            so that the caller can say so.

    Returns:
        The documents, in a deterministic order, each a non-empty ``str``;
        their total UTF-8 size is at most ``max_bytes``.

    Raises:
        FileNotFoundError: ``source`` does not exist, or a directory holds no
            file with an accepted suffix.
        ValueError: unsupported file suffix; ``max_bytes`` not positive; a
            single text file that is not UTF-8; a ``.jsonl`` line that is not
            a JSON object with a string ``text_field`` (the message names the
            file, the 1-based line number and the field); a ``.parquet`` file
            that cannot be read or has no string column ``text_field`` (the
            message names the file and its columns); or no non-empty document
            was found.
        ImportError: ``datasets`` is not installed (a dependency of megatrain).
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive number of bytes or None, got {max_bytes}")
    path = default_corpus_dir() if source is None else Path(source)
    files = corpus_files(path)
    in_directory = path.is_dir()
    budget = ByteBudget(max_bytes)
    docs: list[str] = []
    for f in files:
        # Stopping as soon as the budget is spent (not before the next document) means records
        # past it are never parsed, so a malformed line beyond max_bytes is no error.
        for text in iter_file_documents(
            f, text_field=text_field, skip_undecodable=in_directory, skipped=skipped
        ):
            taken = budget.take(text.encode("utf-8"))
            if taken:
                docs.append(taken)
            if budget.exhausted:
                break
        if budget.exhausted:
            break
    if not docs:
        raise ValueError(f"no non-empty UTF-8 documents found in {str(path)!r}")
    return docs


def corpus_files(source: str | os.PathLike[str] | None = None) -> list[Path]:
    """The files :func:`load_documents` reads from ``source``, in reading order.

    ``None`` is :func:`default_corpus_dir`; a directory gives its accepted files in sorted
    relative-path order (skipping ``site-packages``, ``dist-packages``, ``__pycache__`` and hidden
    directories); a single file gives itself.

    Raises:
        FileNotFoundError: ``source`` does not exist, or a directory holds no file with an
            accepted suffix.
        ValueError: a single file whose suffix is not accepted.
        megatrain.files.UnsafeFileError: ``source`` is a FIFO, a socket or a device.
    """
    path = default_corpus_dir() if source is None else Path(source)
    if not path.exists():
        raise FileNotFoundError(f"corpus path {str(path)!r} does not exist; expected {_ACCEPTED}")
    from megatrain.files import check_file_or_directory

    check_file_or_directory(path, "corpus path")  # a FIFO would block the read forever
    if path.is_dir():
        saved = _saved_dataset_files(path)
        if saved is not None:
            return saved
        files = _iter_corpus_files(path)
        if not files:
            raise FileNotFoundError(
                f"corpus directory {str(path)!r} contains no *.py, *.txt, *.md, *.rst, "
                f"*.jsonl or *.parquet files (site-packages, __pycache__ and hidden "
                f"directories are skipped); expected {_ACCEPTED}"
            )
        return files
    if not path.name.lower().endswith(TEXT_SUFFIXES + RECORD_SUFFIXES):
        raise ValueError(
            f"unsupported corpus file {str(path)!r} (suffix {path.suffix!r}); "
            f"expected {_ACCEPTED}"
        )
    return [path]


def _saved_dataset_files(path: Path) -> list[Path] | None:
    """The Arrow shards of a dataset saved with ``Dataset.save_to_disk`` (``state.json``) or of the
    ``train`` split of a ``DatasetDict.save_to_disk`` (``dataset_dict.json``), in row order;
    ``None`` when ``path`` is no saved dataset.

    Raises:
        ValueError: a ``DatasetDict`` without a ``train`` split (names its splits), or a
            ``state.json`` that does not list its data files.
        FileNotFoundError: a listed shard is missing.
    """
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        if "train" not in splits:
            raise ValueError(
                f"saved dataset {str(path)!r} has no 'train' split (splits: {splits}); pass the "
                f"directory of the split to train on, e.g. {str(path / splits[0])!r}"
            )
        return _saved_dataset_files(path / "train")
    state = path / "state.json"
    if not (state.is_file() and (path / "dataset_info.json").is_file()):
        return None
    try:
        names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(state)!r} does not list the saved dataset's data files ({e!r}); "
                         f"save it again with datasets' save_to_disk") from e
    files = [path / n for n in names]
    for n, f in zip(names, files):
        if not f.is_file():
            raise FileNotFoundError(f"saved dataset {str(path)!r} lists {n!r} but {str(f)!r} is missing")
    return files


def iter_file_documents(
    path: Path,
    *,
    text_field: str = "text",
    skip_undecodable: bool = False,
    skipped: list[Path] | None = None,
) -> Iterator[str]:
    """Yield the non-empty documents of one corpus file, lazily, in file order.

    A ``.py``/``.txt``/``.md``/``.rst`` file is one document (nothing if it is only whitespace);
    a ``.jsonl`` file gives one per non-blank line (the string ``text_field``); a ``.parquet``
    file, or an ``.arrow`` shard of a saved dataset, one per non-empty value of its string column
    ``text_field``, read one record batch at a time so memory is bounded by a batch, not the file.

    Args:
        path: the file.
        text_field: the ``.jsonl`` key / ``.parquet`` column holding the text.
        skip_undecodable: a text file that is not UTF-8 yields nothing (and is appended to
            ``skipped`` when given) instead of raising: how a directory is read.
        skipped: see ``skip_undecodable``.

    Raises:
        ValueError: a text file that is not UTF-8 (unless skipped); a ``.jsonl`` line that is not
            UTF-8 or not a JSON object with a string ``text_field`` (the message names the file,
            the 1-based line and the field); a ``.parquet`` file that cannot be read or has no
            string column ``text_field``.
        ImportError: ``datasets`` is not installed.
    """
    suffix = path.suffix.lower()
    if suffix == ".arrow":
        yield from _iter_arrow(path, text_field)
    elif suffix == ".parquet":
        yield from _iter_parquet(path, text_field)
    elif suffix == ".jsonl":
        yield from _iter_jsonl(path, text_field)
    else:
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            if not skip_undecodable:
                raise ValueError(f"{str(path)!r} is not valid UTF-8 text: {e}") from e
            # Legacy-encoded or deliberately broken files (the stdlib test suite has some) are
            # not usable text for byte-level BPE.
            if skipped is not None:
                skipped.append(path)
            return
        # bytes.strip (ASCII whitespace), as before the split: empty __init__.py files would
        # add only an end-of-text token.
        if data.strip():
            yield text


def _load_datasets():
    try:
        import datasets
    except ImportError as e:  # a core dependency; only a broken install lacks it
        raise ImportError(
            "reading .jsonl, .parquet and saved Hugging Face datasets needs the `datasets` package: "
            "pip install 'datasets>=5.2'"
        ) from e
    datasets.disable_progress_bars()  # one file of many: the store's own bar reports progress
    return datasets


def _stream(builder: str, path: Path):
    """``datasets.load_dataset(builder, data_files=path, streaming=True)``: record batches read
    lazily from the file (no Arrow cache written, memory bounded by a batch)."""
    return _load_datasets().load_dataset(builder, data_files=str(path), split="train", streaming=True)


def _check_text_column(path: Path, features, text_field: str, fix: str) -> None:
    names = list(features) if features is not None else []
    if text_field not in names:
        raise ValueError(f"{str(path)!r} has no column {text_field!r} (columns: {names}); {fix}")
    dtype = getattr(features[text_field], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise ValueError(
            f"{str(path)!r}: column {text_field!r} has type {dtype or features[text_field]}, not string; {fix}"
        )


def _iter_text_column(rows: Iterator[dict], text_field: str, on_bad) -> Iterator[str]:
    for batch in rows:
        for text in batch[text_field]:
            if text is None or not isinstance(text, str):
                on_bad()
                continue
            if text:
                yield text


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    fix = "name the text column with text_field"
    try:
        ds = _stream("parquet", path)
        features = ds.features
    except Exception as e:  # datasets/pyarrow raise ArrowInvalid, OSError, ValueError, ...
        raise ValueError(f"{str(path)!r} is not a readable Parquet file: {e}") from e
    _check_text_column(path, features, text_field, fix)
    # Null values are no documents (as empty strings are not): skip them.
    yield from _iter_text_column(ds.select_columns([text_field]).iter(batch_size=4096), text_field,
                                 on_bad=lambda: None)


def _iter_arrow(path: Path, text_field: str) -> Iterator[str]:
    """One Arrow shard of a dataset saved with ``save_to_disk``, memory-mapped by
    ``datasets.Dataset.from_file`` (no copy in RAM)."""
    try:
        ds = _load_datasets().Dataset.from_file(str(path))
    except Exception as e:
        raise ValueError(f"{str(path)!r} is not a readable Arrow file of a saved dataset: {e}") from e
    _check_text_column(path, ds.features, text_field, "name the text column with text_field")
    yield from _iter_text_column(ds.select_columns([text_field]).iter(batch_size=4096), text_field,
                                 on_bad=lambda: None)


class _RecordError(ValueError):
    """A bad record, located (file and line): raised as is, never re-wrapped."""


def scan_jsonl(path: Path, expected: str) -> Iterator[tuple[str, object]]:
    """``(where, value)`` for each non-blank line of a JSON Lines file, ``where`` naming the file and
    the 1-based line; a line that is not UTF-8 or not JSON raises a ValueError saying so and that
    each line must be ``expected``. For the errors ``datasets`` reports without a line."""
    # Bytes, decoded line by line: a text-mode file decodes ahead in chunks and would report a
    # bad byte on an earlier line than its own.
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{str(path)!r}, line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _RecordError(f"{where}: not valid UTF-8 ({e})") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise _RecordError(f"{where}: not valid JSON ({e.msg}); each line must be {expected}") from None


def _jsonl_error(path: Path, text_field: str, cause: BaseException | None = None) -> ValueError:
    """The first line of a ``.jsonl`` file that is not an object with a string ``text_field``.

    ``datasets`` reports a bad record without its line (``ArrowInvalid: JSON parse error``, a
    pandas ``ValueError``, or a row of None for a missing field), so on any failure the file is
    scanned with :mod:`json` for the line to name. Returns the error to raise.
    """
    return _first_bad_line(path, text_field) or _RecordError(
        f"{str(path)!r} could not be read as JSON Lines: {str(cause).strip() or type(cause).__name__}")


def _first_bad_line(path: Path, text_field: str, limit: int | None = None) -> ValueError | None:
    """The error for the first of the first ``limit`` lines (all with None) of a ``.jsonl`` file
    that is not a JSON object with a string ``text_field``, or for a file of no records at all
    (``datasets`` raised a bare StopIteration on an empty one); None when they all are."""
    seen = 0
    try:
        for where, obj in itertools.islice(scan_jsonl(path, f"a JSON object with a string field {text_field!r}"),
                                           limit):
            seen += 1
            if not isinstance(obj, dict) or text_field not in obj:
                return _RecordError(f"{where}: JSON value has no field {text_field!r}")
            if not isinstance(obj[text_field], str):
                return _RecordError(
                    f"{where}: field {text_field!r} must be a string, "
                    f"got {type(obj[text_field]).__name__}"
                )
    except _RecordError as e:
        return e
    if not seen:
        return _RecordError(f"{str(path)!r} holds no records (it is empty or only blank lines); each line must be "
                            f"a JSON object with a string field {text_field!r}: fill the file or remove it")
    return None


def check_first_records(path: Path, text_field: str = "text", records: int = 8) -> None:
    """Check the first ``records`` records of a ``.jsonl`` corpus file with :mod:`json` alone (no
    ``datasets``, no torch): the cheap check ``megatrain train`` makes before anything heavy loads.
    Other files pass (their readers check them when the store is built).

    Raises:
        ValueError: a line that is not UTF-8, not JSON, or not an object with a string
            ``text_field`` (naming the file and the 1-based line), as the reader would raise.
    """
    if path.suffix.lower() == ".jsonl":
        error = _first_bad_line(path, text_field, records)
        if error is not None:
            raise error


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    def bad() -> None:
        raise _jsonl_error(path, text_field)

    try:
        ds = _stream("json", path)
        features = ds.features
        if features is None or text_field not in features:
            bad()
        if getattr(features[text_field], "dtype", None) not in ("string", "large_string"):
            bad()
        yield from _iter_text_column(ds.select_columns([text_field]).iter(batch_size=4096), text_field,
                                     on_bad=bad)
    except _RecordError:
        raise
    except Exception as e:  # ArrowInvalid, DatasetGenerationError, UnicodeDecodeError, ...
        raise _jsonl_error(path, text_field, e) from e
