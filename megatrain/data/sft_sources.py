"""Where fine-tuning records come from: files, saved datasets and ``dataset_info.json`` registries.

``data`` (``megatrain train --data``) names one or more datasets, comma-separated, each optionally
with a mixing weight after a colon (``a.json:2,b.jsonl``):

- a ``.json`` (a JSON array of records, or JSON Lines), ``.jsonl``, ``.parquet``, ``.csv`` or
  ``.arrow`` file, read with ``datasets.load_dataset(<builder>, data_files=..., streaming=True)``
  (records stream from the file: no Arrow cache is written and memory is bounded by a batch); a
  JSON file ``datasets`` refuses (``on_mixed_types=None``: a field of more than one type, which it
  would otherwise change) is read from there on with :mod:`json`, each value as written;
- a directory saved with ``datasets``' ``save_to_disk`` (its ``train`` split), read with
  ``datasets.load_from_disk`` (memory-mapped);
- ``NAME@DIR`` (``a,b:2@data/``): the entries ``NAME`` of ``DIR/dataset_info.json``, a registry as
  LLaMA-Factory documents it (``data/README.md``): ``file_name`` (a file or a directory of files
  of one type, relative to ``DIR``), ``formatting`` (alpaca, sharegpt or openai), ``columns``,
  ``tags``, ``split`` and ``num_samples``; ``DIR`` alone is every entry of it;
- any other directory: each data file in it (not its subdirectories), in sorted order.

Entries that only name a hub or remote location (``hf_hub_url``, ``ms_hub_url``, ``om_hub_url``,
``script_url``, ``cloud_file_name``) are refused: nothing is downloaded at run time. Preference
(``ranking``) entries are refused: they are not supervised fine-tuning data.

Each dataset's format is its registry entry's, ``--sft-format``, or detected from its first record
(:func:`~megatrain.data.sft_formats.detect_format`). :func:`iter_examples` yields the examples;
a malformed record is one error naming the file, the record (1-based; for ``.jsonl`` also the
line) and the fields its format expects.

Image files a record names (its ``images`` column, :mod:`~megatrain.data.sft_formats`) are resolved
as LLaMA-Factory resolves them against ``dataset_dir``: relative to the registry's ``DIR`` for its
entries, else to the data file's directory (a saved dataset's parent directory); absolute paths
stay as they are.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from megatrain.data.sources import scan_jsonl
from megatrain.bounds import MAX_NUM_SAMPLES, check_json_depth
from megatrain.files import check_file_or_directory, resolve_inside
from megatrain.data.sft_formats import SFT_FORMATS, Chat, Completion, RecordError, SftFormat, detect_format, to_example

__all__ = ["REGISTRY_FILE", "SFT_SUFFIXES", "SftSource", "entry_files", "entry_path", "entry_source", "iter_examples",
           "iter_rows", "read_registry", "record_where", "resolve_sft_data", "sft_data_bytes"]

#: The registry file of a data directory (LLaMA-Factory's name for it).
REGISTRY_FILE = "dataset_info.json"

#: File suffixes read as SFT data, and the ``datasets`` builder of each.
SFT_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}

_HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


@dataclass(frozen=True, slots=True)
class SftSource:
    """One dataset of a run.

    Attributes:
        name: the registry entry's name, else the path as given.
        files: the data files in reading order, or the one directory of a saved dataset.
        builder: the ``datasets`` builder (json, parquet, csv, arrow), or ``"saved"``.
        format: the record format; None: detected from the first record.
        split: the split of a saved ``DatasetDict``.
        weight: the mixing weight from ``data`` (None: none given).
        num_samples: the registry's ``num_samples`` (None: every example once).
        media_dir: the directory image paths are relative to (a registry's ``DIR``); None: each
            data file's own directory.
    """

    name: str
    files: tuple[Path, ...]
    builder: str
    format: SftFormat | None = None
    split: str = "train"
    weight: float | None = None
    num_samples: int | None = None
    media_dir: Path | None = None

    def fingerprint(self) -> dict:
        """What the examples depend on: the format and every data file's path, size and mtime."""
        files = []
        for f in self.files:
            for p in sorted(f.rglob("*")) if f.is_dir() else [f]:
                if p.is_file():
                    st = p.stat()
                    files.append([str(p.absolute()), st.st_size, st.st_mtime_ns])
        return {"name": self.name, "builder": self.builder, "split": self.split, "files": files,
                "format": self.format.describe() if self.format else "auto"}

    def nbytes(self) -> int:
        return sum(size for _, size, _ in self.fingerprint()["files"])


def resolve_sft_data(data: str, *, sft_format: str = "auto") -> list[SftSource]:
    """The datasets ``data`` names (module docstring).

    Args:
        data: the ``--data`` value.
        sft_format: ``auto`` (each file's format from its first record) or one of
            :data:`~megatrain.data.sft_formats.SFT_FORMATS`, for files (a registry names its own).

    Raises:
        FileNotFoundError: a path, a registry or a registry's ``file_name`` does not exist.
        megatrain.files.UnsafeFileError: a path that is a FIFO, a socket or a device; a registry's
            ``file_name`` (or a file in the directory it names) that resolves outside the
            registry's directory: ``..``, an absolute path, a symlink.
        ValueError: an unknown suffix, name, formatting, column or weight; a hub-only or
            preference entry; ``sft_format`` given with a registry; a directory with no data.
    """
    if sft_format != "auto" and sft_format not in SFT_FORMATS:
        raise ValueError(f"sft_format {sft_format!r} is not auto or one of {', '.join(SFT_FORMATS)}")
    if Path(data).exists():
        return _resolve_path(Path(data), None, sft_format)
    names, at, directory = data.rpartition("@")
    if at:
        return _resolve_registry(Path(directory), _weighted(names, data), sft_format)
    out: list[SftSource] = []
    for item, weight in _weighted(data, data):
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"SFT data {item!r} does not exist; expected a .json/.jsonl/.parquet/.csv/"
                                    f".arrow file, a directory saved with datasets' save_to_disk, a directory with "
                                    f"a {REGISTRY_FILE}, or NAME[,NAME...]@DIR naming entries of DIR/{REGISTRY_FILE}")
        out += _resolve_path(path, weight, sft_format)
    return out


def _weighted(spec: str, whole: str) -> list[tuple[str, float | None]]:
    out = []
    for item in spec.split(","):
        item = item.strip()
        name, colon, w = item.rpartition(":")
        if not colon or Path(item).exists():
            name, w = item, None
        else:
            try:
                w = float(w)
            except ValueError:
                raise ValueError(f"data {whole!r}: {item!r} has weight {w!r}, not a number") from None
            if not (math.isfinite(w) and w > 0):
                raise ValueError(f"data {whole!r}: the weight of {name!r} must be a positive number, got {w}")
        if not name:
            raise ValueError(f"data {whole!r}: an empty dataset name or path")
        out.append((name, w))
    return out


def _saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _data_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir()
                  if p.is_file() and p.suffix.lower() in SFT_SUFFIXES and not p.name.startswith(".")
                  and p.name != REGISTRY_FILE)


def _builder(path: Path) -> str:
    builder = SFT_SUFFIXES.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"SFT data file {str(path)!r} has suffix {path.suffix!r}; expected one of "
                         f"{', '.join(SFT_SUFFIXES)}")
    return builder


def _resolve_path(path: Path, weight: float | None, sft_format: str) -> list[SftSource]:
    fmt = None if sft_format == "auto" else SftFormat(sft_format)  # type: ignore[arg-type]
    check_file_or_directory(path, "SFT data")  # a FIFO was read as a directory ("Not a directory")
    if path.is_file():
        return [SftSource(str(path), (path,), _builder(path), fmt, weight=weight)]
    if _saved_dataset(path):
        return [SftSource(str(path), (path,), "saved", fmt, weight=weight)]
    if (path / REGISTRY_FILE).is_file():
        if weight is not None:
            raise ValueError(f"data {str(path)!r}: a weight applies to one dataset; give the registry's entries "
                             f"with weights as NAME:W,NAME:W@{path}")
        return _resolve_registry(path, None, sft_format)
    files = _data_files(path)
    if not files:
        raise FileNotFoundError(f"SFT data directory {str(path)!r} has no {REGISTRY_FILE}, is no dataset saved with "
                                f"datasets' save_to_disk, and holds no {'/'.join(SFT_SUFFIXES)} files")
    return [SftSource(str(f), (f,), _builder(f), fmt, weight=weight) for f in files]


def read_registry(directory: Path) -> dict[str, dict]:
    """The entries of ``directory``'s ``dataset_info.json`` (name -> entry), for SFT and preference
    data alike.

    Raises:
        FileNotFoundError: there is no such file.
        ValueError: it is not UTF-8 JSON, or not an object of entry objects.
    """
    registry = directory / REGISTRY_FILE
    if not registry.is_file():
        raise FileNotFoundError(f"no {REGISTRY_FILE} in {str(directory)!r} to look dataset names up in")
    try:
        info = json.loads(registry.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(registry)!r} is not valid JSON: {e}") from None
    if not isinstance(info, dict) or not all(isinstance(v, dict) for v in info.values()):
        raise ValueError(f"{str(registry)!r} must be a JSON object of dataset entries (name: {{file_name, ...}})")
    return info


def entry_path(directory: Path, file_name: str, where: str) -> Path:
    """A registry entry's ``file_name`` as a path inside ``directory`` (``files.resolve_inside``:
    nothing outside the registry's directory is read) that exists.

    Raises:
        UnsafeFileError: it resolves outside ``directory``.
        FileNotFoundError: it does not exist.
    """
    path = resolve_inside(directory, file_name, f"{where}: file_name")
    if not path.exists():
        raise FileNotFoundError(f"{where}: file_name {file_name!r} does not exist ({str(path)!r})")
    return path


def entry_files(directory: Path, path: Path, where: str) -> list[Path]:
    """The data files of a registry entry's ``path`` (itself, or the data files of a directory),
    each inside ``directory`` (a symlink in it to outside is refused: ``UnsafeFileError``)."""
    if not path.is_dir():
        return [path]
    return [resolve_inside(directory, f.relative_to(directory), f"{where}: file") for f in _data_files(path)]


def _resolve_registry(directory: Path, wanted: list[tuple[str, float | None]] | None,
                      sft_format: str) -> list[SftSource]:
    registry = directory / REGISTRY_FILE
    if registry.is_file() and sft_format != "auto":
        raise ValueError(f"sft_format={sft_format} names the format of data files; the entries of {str(registry)!r} "
                         "name their own (formatting, columns): drop --sft-format")
    info = read_registry(directory)
    if wanted is None:
        wanted = [(name, None) for name in info]
        if not wanted:
            raise ValueError(f"{str(registry)!r} lists no datasets")
    out = []
    for name, weight in wanted:
        if name not in info:
            raise ValueError(f"dataset {name!r} is not in {str(registry)!r} (it lists: {', '.join(sorted(info))})")
        out.append(_entry(directory, name, info[name], weight, len(wanted) == len(info) and weight is None))
    return out


def _entry(directory: Path, name: str, entry: dict, weight: float | None, every: bool) -> SftSource:
    where = f"{str(directory / REGISTRY_FILE)!r}, dataset {name!r}"
    if entry.get("ranking"):
        raise ValueError(f"{where} is preference data (ranking: true), for reward modelling or DPO, not supervised "
                         "fine-tuning" + (f"; name the SFT datasets: --data NAME,NAME@{directory}" if every else ""))
    file_name = entry.get("file_name")
    if not isinstance(file_name, str) or not file_name:
        hub = {k: entry[k] for k in _HUB_KEYS if k in entry}
        if hub:
            k, v = next(iter(hub.items()))
            raise ValueError(
                f"{where} is only on a hub or remote store ({k}: {v!r}), and megatrain downloads nothing at run "
                f"time: download it once (e.g. datasets.load_dataset({v!r}, split='train').to_json('{name}.jsonl')), "
                f"put the file in {str(directory)!r} and give the entry \"file_name\": \"{name}.jsonl\""
                + (f"; or name only the local datasets: --data NAME,NAME@{directory}" if every else ""))
        raise ValueError(f"{where} has no file_name (a file or directory in {str(directory)!r})")
    path = entry_path(directory, file_name, where)
    fmt = SftFormat.from_registry(entry, where)
    split = entry.get("split", "train")
    num_samples = entry.get("num_samples")
    if num_samples is not None and not (isinstance(num_samples, int) and not isinstance(num_samples, bool)
                                        and num_samples > 0):  # JSON true is no count (it was taken as 1)
        raise ValueError(f"{where}: num_samples must be a positive integer, got {num_samples!r}")
    if num_samples is not None and num_samples > MAX_NUM_SAMPLES:
        raise ValueError(f"{where}: num_samples {num_samples:,} is more than megatrain samples from a dataset "
                         f"({MAX_NUM_SAMPLES:,}, megatrain.bounds.MAX_NUM_SAMPLES: an epoch's index alone would take "
                         f"{8 * num_samples / 2**30:,.0f} GiB); give a smaller one")
    return entry_source(directory, name, path, where, fmt, split=split, weight=weight, num_samples=num_samples)


def entry_source(directory: Path, name: str, path: Path, where: str, fmt, *, split: str = "train",
                 weight: float | None = None, num_samples: int | None = None) -> SftSource:
    """The source of a registry entry whose ``file_name`` resolved to ``path`` (:func:`entry_path`):
    a dataset saved with ``save_to_disk``, or the data files of a file or directory, all of one type,
    each inside ``directory``. ``fmt`` is the entry's record format (an SFT or preference format;
    None: detected); ``where`` names the entry in errors. Shared by SFT and preference registries.

    Raises:
        FileNotFoundError: a directory that holds no data files.
        ValueError: a directory of mixed file types; a ``split`` other than ``train`` of data files.
        UnsafeFileError: a data file that resolves outside ``directory``.
    """
    if path.is_dir() and _saved_dataset(path):
        return SftSource(name, (path,), "saved", fmt, split, weight, num_samples, directory)
    files = entry_files(directory, path, where)
    if not files:
        raise FileNotFoundError(f"{where}: directory {str(path)!r} holds no {'/'.join(SFT_SUFFIXES)} files")
    builders = {_builder(f) for f in files}
    if len(builders) > 1:
        raise ValueError(f"{where}: directory {str(path)!r} mixes file types ({sorted(builders)}); give each type "
                         "its own dataset")
    if split != "train":
        raise ValueError(f"{where}: split {split!r}: data files have only a 'train' split (a split applies to a "
                         "dataset saved with save_to_disk)")
    return SftSource(name, tuple(files), builders.pop(), fmt, split, weight, num_samples, directory)


def sft_data_bytes(data: str) -> int:
    """Bytes on disk of the files ``data`` names (for the host-memory preflight).

    Raises: as :func:`resolve_sft_data`.
    """
    return sum(s.nbytes() for s in resolve_sft_data(data))


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------


def _datasets():
    try:
        import datasets
    except ImportError as e:  # a core dependency; only a broken install lacks it
        raise ImportError("reading SFT data needs the `datasets` package: pip install 'datasets>=5.2'") from e
    datasets.disable_progress_bars()
    # Its JSON reader logs each file it refuses before raising; megatrain reads that file itself
    # (:func:`iter_rows`) and reports what was wrong in its one error line.
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    return datasets


def record_where(path: Path, index: int) -> str:
    """``'file', record N`` (1-based); for JSON Lines also the line (blank lines hold no record)."""
    where = f"{str(path)!r}, record {index + 1}"
    if path.suffix.lower() == ".jsonl" or (path.suffix.lower() == ".json" and not _is_json_array(path)):
        with path.open("rb") as fh:
            seen = 0
            for lineno, raw in enumerate(fh, start=1):
                if raw.strip():
                    if seen == index:
                        return f"{where} (line {lineno})"
                    seen += 1
    return where


def _is_json_array(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(4096).lstrip()[:1] == b"["


def _unreadable(path: Path, builder: str, cause: Exception) -> ValueError:
    """The error for a file that could not be read: for a .json array, the parser's position
    (``datasets`` reports none); else the reader's own message, with the file. (A JSON file
    ``datasets`` refuses is read with :func:`_json_records`, which names the line.)"""
    if isinstance(cause, UnicodeDecodeError):
        return ValueError(f"{str(path)!r} is not valid UTF-8 ({cause})")
    if isinstance(cause, json.JSONDecodeError):
        return ValueError(f"{str(path)!r}, line {cause.lineno} column {cause.colno}: not valid JSON ({cause.msg})")
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return ValueError(f"{str(path)!r} could not be read as {builder} by datasets: {first}")


def iter_rows(source: SftSource) -> Iterator[tuple[Path, int, dict]]:
    """``(file, index in the file, record)`` for every record, in order."""
    ds = _datasets()
    if source.builder == "saved":
        path = source.files[0]
        try:
            saved = ds.load_from_disk(str(path))
        except Exception as e:  # FileNotFoundError, ArrowInvalid, ... from a damaged directory
            raise ValueError(f"{str(path)!r} could not be read by datasets.load_from_disk: {e}") from None
        if isinstance(saved, ds.DatasetDict):
            if source.split not in saved:
                raise ValueError(f"saved dataset {str(path)!r} has no {source.split!r} split (splits: "
                                 f"{sorted(saved)}); set the registry entry's \"split\"")
            saved = saved[source.split]
        for i, row in enumerate(saved):
            yield path, i, row
        return
    for path in source.files:
        if source.builder == "json":  # a parser recursing into a deep record crashed the process
            check_json_depth(path)
        i = 0
        try:
            kwargs = {"features": _csv_as_text(path, ds)} if source.builder == "csv" else {}
            if source.builder == "json":
                # datasets' default ("use_json") keeps a field whose type varies between records by
                # encoding it as JSON text: in a .json array that text is never decoded (every
                # string of the field gains quotes, 42 becomes "42"), in JSON Lines a string that
                # parses as JSON is decoded ("0" becomes 0). Refused instead, and read below.
                kwargs["on_mixed_types"] = None
            rows = iter(ds.load_dataset(source.builder, data_files=str(path), split="train", streaming=True, **kwargs))
            while True:
                try:
                    row = next(rows)
                except StopIteration:
                    break
                yield path, i, row
                i += 1
        except Exception as e:  # ArrowInvalid, ArrowTypeError, DatasetGenerationError, UnicodeDecodeError, ...
            if source.builder != "json":
                raise _unreadable(path, source.builder, e) from None
            # A file datasets refuses (a field of more than one type, a malformed line) is read
            # from where it stopped with json, which keeps each value's type as written, so
            # to_example names the record and field of the wrong type, or the line that is not
            # JSON; a file whose every record is an example (text content in some messages, a
            # list of parts in others) is read exactly.
            yield from itertools.islice(_json_records(path), i, None)


def _json_records(path: Path) -> Iterator[tuple[Path, int, dict]]:
    """``(file, index in the file, record)`` for each record of a JSON or JSON Lines file, read with
    :mod:`json`: each value as written.

    Raises:
        ValueError: a line (or file) that is not UTF-8 or not JSON; a record that is not an object.
    """
    if path.suffix.lower() == ".jsonl" or (path.suffix.lower() == ".json" and not _is_json_array(path)):
        values = (obj for _, obj in scan_jsonl(path, "one JSON object, one example"))
    else:
        try:
            values = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _unreadable(path, "json", e) from None
        if not isinstance(values, list):
            raise ValueError(f"{str(path)!r} holds a JSON {type(values).__name__}; a .json file of SFT data "
                             "is an array of objects, one per example")
    for i, obj in enumerate(values):
        if not isinstance(obj, dict):
            raise ValueError(f"{record_where(path, i)}: not a JSON object")
        yield path, i, obj


def _csv_as_text(path: Path, ds):
    """Features reading every column of a CSV file as a string: a cell is text (pandas would
    make "42" an int, which no format's text field takes)."""
    import csv

    with path.open(newline="", encoding="utf-8") as fh:
        header = next(csv.reader(fh), [])
    return ds.Features({name: ds.Value("string") for name in header})


def iter_examples(source: SftSource) -> Iterator[tuple[Chat | Completion, Callable[[], str], str]]:
    """``(example, where, format)`` for each record of ``source`` in file order: ``where()`` names
    the record (``'file', record N``; computed only when called) and ``format`` is the format read.

    Raises:
        ValueError: a file ``datasets`` cannot read (the first malformed line of a JSON file); a
            record that is not an example of the format (:class:`~megatrain.data.sft_formats.RecordError`,
            naming the file, the record and the fields expected); no record at all.
        ImportError: ``datasets`` is missing.
    """
    yield from _examples(source, iter_rows(source))


def _examples(source: SftSource, rows: Iterator[tuple[Path, int, dict]]
              ) -> Iterator[tuple[Chat | Completion, Callable[[], str], str]]:
    """:func:`iter_examples` of ``rows`` (``(file, index in the file, record)``, as :func:`_rows` gives)."""
    fmt = source.format
    n = 0
    for path, i, row in rows:
        try:
            if fmt is None:
                fmt = detect_format(row)
            example = to_example(row, fmt)
        except RecordError as e:
            raise RecordError(f"{record_where(path, i)}: {e}") from None
        if isinstance(example, Chat) and example.images:
            base = source.media_dir if source.media_dir is not None else path.parent
            example = replace(example, images=tuple(str(base / p) for p in example.images))
        n += 1
        yield example, (lambda p=path, k=i: record_where(p, k)), fmt.kind
    if n == 0:
        raise ValueError(f"SFT dataset {source.name!r} holds no records (an empty file?); give it records or leave "
                         "it out of the data")


FIRST_RECORDS_MAX_JSON_BYTES = 16 * 2**20
"""A ``.json`` array is parsed whole by :mod:`json`, so :func:`check_first_records` reads only
arrays up to this size; larger ones are checked when the store is built."""


def check_first_records(source: SftSource, records: int = 8) -> None:
    """Check the first ``records`` records of each JSON or JSON Lines file of ``source`` as
    :func:`iter_examples` would (format detected from the first, each an example of it), reading
    them with :mod:`json` alone (no ``datasets``, no torch): the cheap check ``megatrain train``
    makes before anything heavy loads. Other files, and ``.json`` arrays over
    :data:`FIRST_RECORDS_MAX_JSON_BYTES`, are checked when the store is built.

    Raises:
        ValueError: a line that is not UTF-8 or not JSON; a record that is not an example of the
            format (:class:`~megatrain.data.sft_formats.RecordError`, naming the file and record).
    """
    if source.builder != "json" or any(p.suffix.lower() == ".json" and _is_json_array(p)
                                       and p.stat().st_size > FIRST_RECORDS_MAX_JSON_BYTES for p in source.files):
        return  # (an empty dataset is an error only when every file was read)

    def rows() -> Iterator[tuple[Path, int, dict]]:
        for path in source.files:
            yield from itertools.islice(_json_records(path), records)

    try:
        for _ in _examples(source, rows()):
            pass
    except RecursionError:  # json's own limit, on a record nested about 1,000 levels deep
        for path in source.files:
            check_json_depth(path)
        raise


def sources_key(sources: list[SftSource]) -> str:
    """sha256 of the sources' fingerprints (files, sizes, mtimes, formats)."""
    return hashlib.sha256(json.dumps([s.fingerprint() for s in sources]).encode()).hexdigest()
