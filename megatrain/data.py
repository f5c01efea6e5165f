"""Data pipeline for causal language-model training: text → BPE tokens → batches.

Everything runs locally with nothing downloaded. The default corpus is the
source tree of the running interpreter's standard library (real text that is
always present); a user may instead point at a directory of documents, a
single text file, a ``.jsonl`` file or a Parquet file (``pyarrow``, the
``data`` extra).

Two ways to cut token streams into rows:

- :class:`TokenDataset` cuts one stream into fixed windows, documents
  running across window boundaries (GPT-style; the main job uses it)::

      tokenizer, data = prepare_lm_data(seq_len=256)
      for step, batch in zip(range(num_steps), data.batches(8, seed=0)):
          loss = model(**batch).loss   # input_ids, labels: LongTensor[8, 256]

- :func:`pack_documents` + :class:`PackedDataset` pack whole documents into
  rows so that no loss target crosses a document boundary (``megatrain
  train`` uses it)::

      docs = tokenize_documents(tokenizer, load_documents(path))
      data = PackedDataset(pack_documents(docs, 256, eot_id=eot), seed=0)

Units: ``max_bytes`` counts UTF-8 bytes of document text; ``seq_len`` and all
lengths of token arrays count tokens.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import sysconfig
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_SEQ_LEN",
    "EOT_CANDIDATES",
    "EOT_TOKEN",
    "IGNORE_INDEX",
    "RECORD_SUFFIXES",
    "TEXT_SUFFIXES",
    "PackedDataset",
    "PackedRows",
    "TokenDataset",
    "corpus_bytes",
    "default_corpus_dir",
    "encode_documents",
    "find_eot_token",
    "load_documents",
    "load_tokenizer",
    "pack_documents",
    "prepare_lm_data",
    "tokenize_documents",
    "train_bpe_tokenizer",
]

logger = logging.getLogger(__name__)

#: End-of-text special token appended after every document.
EOT_TOKEN = "<|endoftext|>"

#: Suffixes collected from a directory (and accepted as a single-document file).
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")

#: Suffixes of files holding many documents, one per record, each taken from a
#: text field (``.jsonl``) or column (``.parquet``); read alone or in a directory.
RECORD_SUFFIXES = (".jsonl", ".parquet")

#: End-of-sequence tokens :func:`find_eot_token` looks for, in this order: this
#: package's BPE, GPT-2/Qwen, Llama 3, Llama 2/Mistral, Gemma.
EOT_CANDIDATES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>")

#: Label value a causal-LM loss ignores (``torch.nn.CrossEntropyLoss``'s and
#: Hugging Face's ``ignore_index``).
IGNORE_INDEX = -100

#: Default cap on the text collected, in UTF-8 bytes. 3 MB of stdlib source is
#: about 0.9 M tokens at vocab 2048 — more than a 5-minute CPU run consumes —
#: and loading + BPE training + encoding take about 1 s on 2 cores (measured:
#: the whole 32 MB stdlib takes ~10 s and ~1.3 GB of RAM).
DEFAULT_MAX_BYTES = 3_000_000

#: Default window length in tokens.
DEFAULT_SEQ_LEN = 256

# Directories never descended into: installed third-party packages are not
# "text nobody here wrote" in a reproducible sense (they vary per machine),
# bytecode caches hold no text, and hidden directories are VCS/tool state.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

_ACCEPTED = (
    "a directory (its *.py, *.txt, *.md, *.rst, *.jsonl, *.parquet files are read "
    "recursively), a single .py/.txt/.md/.rst file (one document), a .jsonl file "
    "(one JSON object per line) or a .parquet file (one document per row)"
)

_MIN_VOCAB = 257  # 256 byte-level symbols + the end-of-text token


# --------------------------------------------------------------------------
# Loading text
# --------------------------------------------------------------------------


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
    if path.is_dir():
        return sum(f.stat().st_size for f in _iter_corpus_files(path))
    return path.stat().st_size


class _Budget:
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
            (null and empty values are skipped; needs ``pyarrow``).
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
        ImportError: a ``.parquet`` file without ``pyarrow`` installed.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive number of bytes or None, got {max_bytes}")
    path = default_corpus_dir() if source is None else Path(source)
    if not path.exists():
        raise FileNotFoundError(f"corpus path {str(path)!r} does not exist; expected {_ACCEPTED}")

    budget = _Budget(max_bytes)
    docs: list[str] = []

    if path.is_dir():
        files = _iter_corpus_files(path)
        if not files:
            raise FileNotFoundError(
                f"corpus directory {str(path)!r} contains no *.py, *.txt, *.md, *.rst, "
                f"*.jsonl or *.parquet files (site-packages, __pycache__ and hidden "
                f"directories are skipped); expected {_ACCEPTED}"
            )
        for f in files:
            if budget.exhausted:
                break
            if f.suffix.lower() in RECORD_SUFFIXES:
                docs.extend(_load_records(f, budget, text_field))
                continue
            data = f.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                # Legacy-encoded or deliberately broken files (the stdlib
                # test suite has some) are not usable text for byte-level BPE.
                if skipped is not None:
                    skipped.append(f)
                continue
            if not data.strip():
                continue  # empty __init__.py files would add only an EOT token
            text = budget.take(data)
            if text:
                docs.append(text)
    else:
        suffix = path.suffix.lower()
        if suffix in RECORD_SUFFIXES:
            docs = _load_records(path, budget, text_field)
        elif suffix in TEXT_SUFFIXES:
            data = path.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{str(path)!r} is not valid UTF-8 text: {e}") from e
            text = budget.take(data) if data.strip() else None
            if text:
                docs.append(text)
        else:
            raise ValueError(
                f"unsupported corpus file {str(path)!r} (suffix {path.suffix!r}); "
                f"expected {_ACCEPTED}"
            )

    if not docs:
        raise ValueError(f"no non-empty UTF-8 documents found in {str(path)!r}")
    return docs


def _load_records(path: Path, budget: _Budget, text_field: str) -> list[str]:
    if path.suffix.lower() == ".parquet":
        return _load_parquet(path, budget, text_field)
    return _load_jsonl(path, budget, text_field)


def _load_parquet(path: Path, budget: _Budget, text_field: str) -> list[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"reading {str(path)!r} needs pyarrow, which megatrain does not install by "
            f"default: pip install 'megatrain[data]' (or pyarrow)"
        ) from e
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{str(path)!r} is not a readable Parquet file: {e}") from e
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise ValueError(
            f"{str(path)!r} has no column {text_field!r} (columns: {schema.names}); "
            f"name the text column with text_field"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(
            f"{str(path)!r}: column {text_field!r} has type {kind}, not string; name a "
            f"string column with text_field"
        )
    docs: list[str] = []
    # Record batches of the one column bound memory to a batch, not the file.
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if budget.exhausted:
                return docs
            if text:
                taken = budget.take(text.encode("utf-8"))
                if taken:
                    docs.append(taken)
    return docs


def _load_jsonl(path: Path, budget: _Budget, text_field: str) -> list[str]:
    docs: list[str] = []
    lineno = 0
    try:
        with path.open("r", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if budget.exhausted:
                    break
                if not line.strip():
                    continue  # tolerate blank lines, e.g. a trailing newline
                where = f"{str(path)!r}, line {lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{where}: not valid JSON ({e.msg}); each line must be a JSON "
                        f"object with a string field {text_field!r}"
                    ) from e
                if not isinstance(obj, dict) or text_field not in obj:
                    raise ValueError(f"{where}: JSON value has no field {text_field!r}")
                text = obj[text_field]
                if not isinstance(text, str):
                    raise ValueError(
                        f"{where}: field {text_field!r} must be a string, "
                        f"got {type(text).__name__}"
                    )
                if text:
                    taken = budget.take(text.encode("utf-8"))
                    if taken:
                        docs.append(taken)
    except UnicodeDecodeError as e:
        raise ValueError(f"{str(path)!r}, line {lineno + 1}: not valid UTF-8 ({e})") from e
    return docs


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_bpe_tokenizer(
    docs: Iterable[str],
    vocab_size: int = 2048,
    *,
    min_frequency: int = 2,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``docs`` with the ``tokenizers`` library.

    The pre-tokenizer is GPT-2's ByteLevel (no prefix space, so decoding is
    an exact inverse of encoding); the initial alphabet holds all 256 byte
    symbols, so any text — including characters never seen in training —
    encodes without unknown tokens. ``<|endoftext|>`` is a special token with
    id 0. No normalizer or post-processor is set: ``encode`` adds nothing.

    Training is deterministic: the same ``docs`` and arguments give the same
    vocabulary and merges (ties between equally frequent pairs are broken by
    the pair itself, not by hash order), so no seed is needed.

    Args:
        docs: documents to learn merges from (iterated once).
        vocab_size: final vocabulary size including the 256 byte symbols and
            the special token; at least 257. Fewer tokens result if the corpus
            has too few pairs occurring ``min_frequency`` times.
        min_frequency: a pair must occur at least this often to be merged.

    Returns:
        A ``tokenizers.Tokenizer``; ``get_vocab_size() <= vocab_size``.

    Raises:
        ValueError: ``vocab_size < 257`` or ``min_frequency < 1``.
    """
    if vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"vocab_size must be at least {_MIN_VOCAB} (256 bytes + {EOT_TOKEN}), got {vocab_size}"
        )
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load a serialized ``tokenizers`` tokenizer.

    Args:
        path: a ``tokenizer.json`` file (as written by ``Tokenizer.save`` or
            shipped with Hugging Face models), or a directory containing one.

    Returns:
        The ``tokenizers.Tokenizer``.

    Raises:
        FileNotFoundError: no such file (or no ``tokenizer.json`` in the
            directory).
        ValueError: the file is not a valid tokenizer JSON.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"tokenizer file {str(p)!r} does not exist; expected a tokenizer.json "
            f"file or a directory containing one"
        )
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a bare Exception
        raise ValueError(f"{str(p)!r} is not a valid tokenizers JSON file: {e}") from e


def _eot_id(tokenizer: Tokenizer, eot_token: str) -> int:
    eot = tokenizer.token_to_id(eot_token)
    if eot is None:
        raise ValueError(
            f"tokenizer has no token {eot_token!r} to mark document ends; pass the "
            f"tokenizer's end-of-sequence token as eot_token (e.g. '</s>')"
        )
    return eot


def find_eot_token(tokenizer: Tokenizer, candidates: Sequence[str] = EOT_CANDIDATES) -> str:
    """The first of ``candidates`` that is a token of ``tokenizer``.

    Raises:
        ValueError: none is; the message lists the candidates and says to
            name the tokenizer's end-of-sequence token explicitly.
    """
    for token in candidates:
        if tokenizer.token_to_id(token) is not None:
            return token
    raise ValueError(
        f"the tokenizer has none of the end-of-sequence tokens {list(candidates)}; "
        f"name its end-of-sequence token (eot_token) explicitly"
    )


def tokenize_documents(
    tokenizer: Tokenizer, docs: Sequence[str], *, batch_size: int = 1024
) -> list[np.ndarray]:
    """Tokenize each document on its own, without any special token.

    Documents are encoded ``batch_size`` at a time with the tokenizer's
    parallel batch encoder and ``add_special_tokens=False`` (a BOS added per
    encode call would otherwise appear mid-row once documents are packed).

    Returns:
        One ``np.ndarray[int64]`` of token ids per document, in order.
    """
    # encode_batch_fast skips offset tracking we never use; same ids.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    # Per-document arrays rather than lists of Python ints: ~8 bytes per
    # token instead of ~36.
    out: list[np.ndarray] = []
    docs = list(docs)
    for start in range(0, len(docs), batch_size):
        for enc in encode(docs[start : start + batch_size], add_special_tokens=False):
            out.append(np.asarray(enc.ids, dtype=np.int64))
    return out


def encode_documents(
    tokenizer: Tokenizer,
    docs: Sequence[str],
    *,
    eot_token: str = EOT_TOKEN,
    batch_size: int = 1024,
) -> np.ndarray:
    """Tokenize documents into one stream, with ``eot_token`` after each.

    Documents are encoded as by :func:`tokenize_documents`.

    Args:
        tokenizer: any ``tokenizers.Tokenizer`` that has ``eot_token``.
        docs: the documents.
        eot_token: the token appended after every document.
        batch_size: documents per ``encode_batch`` call (bounds peak memory).

    Returns:
        ``np.ndarray`` of dtype ``int64``, shape ``[N]`` where ``N`` is the
        sum of the documents' token counts plus ``len(docs)``.

    Raises:
        ValueError: the tokenizer has no ``eot_token``.
    """
    eot_arr = np.array([_eot_id(tokenizer, eot_token)], dtype=np.int64)
    pieces: list[np.ndarray] = []
    for ids in tokenize_documents(tokenizer, docs, batch_size=batch_size):
        pieces.append(ids)
        pieces.append(eot_arr)
    if not pieces:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(pieces)


# --------------------------------------------------------------------------
# Packing documents into rows
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class PackedRows:
    """Rows made by :func:`pack_documents`.

    Attributes:
        input_ids: ``np.ndarray[int64]`` of shape ``[rows, seq_len]``.
        labels: the same shape: ``input_ids`` where a position is a loss
            target, :data:`IGNORE_INDEX` (-100) at the first position of
            every piece and at padding.
        num_documents: documents packed.
        num_pieces: pieces they were cut into (``>= num_documents``).
        num_tokens: document tokens placed, each document's end-of-text
            token and the tokens repeated at splits included.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    num_documents: int
    num_pieces: int
    num_tokens: int

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def padding_fraction(self) -> float:
        """Fraction of the rows' positions that are padding."""
        return 1.0 - self.num_tokens / max(1, self.input_ids.size)


def pack_documents(
    docs: Sequence[np.ndarray | Sequence[int]],
    seq_len: int,
    *,
    eot_id: int,
    pad_id: int | None = None,
) -> PackedRows:
    """Pack tokenized documents into rows of ``seq_len`` tokens for a causal LM.

    The rule, precisely:

    1. **Boundaries.** Every document (its token ids, without special tokens)
       gets one end-of-text token ``eot_id`` appended; call its length,
       end-of-text included, ``L``.
    2. **Splitting.** A document with ``L <= seq_len`` is one piece. A longer
       one is split into pieces of ``seq_len`` tokens that overlap by one
       token: piece ``k`` starts at token ``k * (seq_len - 1)`` and the last
       piece holds what is left (between 2 and ``seq_len`` tokens). The
       repeated token is there only as context for the next piece's first
       target; it is never a target twice.
    3. **Packing.** Pieces are placed whole into rows, best-fit decreasing:
       in order of decreasing length (ties: corpus order), each goes into the
       row with the least free space that still holds it, else into a new
       row; within a row, pieces sit back to back in the order placed. The
       rest of a row is padding, ``pad_id`` (default ``eot_id``). The result
       depends only on the inputs.
    4. **Labels.** ``labels`` equals ``input_ids`` except that it is
       ``-100`` (:data:`IGNORE_INDEX`) at the first position of every piece
       and at every padding position.

    Hugging Face causal LMs shift inside their loss: the logits at position
    ``t`` are scored against ``labels[t + 1]``. So with rule 4, the first
    token of a document is never predicted from the document before it in
    the row (no cross-document target), padding is never predicted, and
    every other token of every document, its end-of-text token included, is
    a target exactly once. Each row has at least one target.

    Attention is not masked at boundaries: the trainer feeds ``input_ids``
    and ``labels`` only, so a document attends to the documents before it in
    its row, as in GPT-style packing; only the targets respect boundaries.

    Args:
        docs: one sequence of token ids per document (empty ones are skipped).
        seq_len: tokens per row, at least 2 (one context and one target).
        eot_id: the end-of-text token id.
        pad_id: the id written at padding positions (never a target).

    Returns:
        :class:`PackedRows`.

    Raises:
        ValueError: ``seq_len < 2``, or no non-empty document.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (one context and one target token), got {seq_len}")
    pad = eot_id if pad_id is None else pad_id
    arrays = [np.asarray(d, dtype=np.int64).reshape(-1) for d in docs]
    arrays = [a for a in arrays if a.size]
    if not arrays:
        raise ValueError("no non-empty document to pack")

    # Pieces as (length, document, start in the document + end-of-text).
    pieces: list[tuple[int, int, int]] = []
    for i, a in enumerate(arrays):
        total = a.size + 1
        start = 0
        while True:
            n = min(seq_len, total - start)
            pieces.append((n, i, start))
            if start + n >= total:
                break
            start += seq_len - 1
    pieces.sort(key=lambda p: (-p[0], p[1], p[2]))

    # Best fit: ``open_rows`` is sorted by (free space, row), so the first
    # entry with free >= n is the tightest row, the oldest among equals. A
    # row with fewer than 2 free positions can take no piece and is closed.
    placements: list[tuple[int, int, int, int, int]] = []  # row, offset, length, doc, start
    open_rows: list[tuple[int, int]] = []
    rows = 0
    for n, i, start in pieces:
        k = bisect.bisect_left(open_rows, (n, -1))
        if k < len(open_rows):
            free, row = open_rows.pop(k)
        else:
            free, row = seq_len, rows
            rows += 1
        placements.append((row, seq_len - free, n, i, start))
        if free - n >= 2:
            bisect.insort(open_rows, (free - n, row))

    input_ids = np.full((rows, seq_len), pad, dtype=np.int64)
    labels = np.full((rows, seq_len), IGNORE_INDEX, dtype=np.int64)
    for row, off, n, i, start in placements:
        a = arrays[i]
        end = start + n
        if end <= a.size:
            seg = a[start:end]
        else:  # the last piece ends with the end-of-text token
            seg = np.append(a[start:], eot_id)
        input_ids[row, off : off + n] = seg
        labels[row, off + 1 : off + n] = seg[1:]
    return PackedRows(
        input_ids=input_ids,
        labels=labels,
        num_documents=len(arrays),
        num_pieces=len(pieces),
        num_tokens=sum(p[0] for p in pieces),
    )


# --------------------------------------------------------------------------
# Rows and batches
# --------------------------------------------------------------------------


class _SplitRows:
    """A held-out split of equal-length rows and the batching both datasets share.

    Subclasses set ``seq_len``, call :meth:`_split` with their row count, and
    build one batch from row indices in :meth:`_batch`.
    """

    _noun = "row"
    seq_len: int
    train_indices: np.ndarray
    val_indices: np.ndarray

    def _split(self, num_rows: int, val_fraction: float, seed: int) -> None:
        num_val = min(max(1, round(val_fraction * num_rows)), num_rows - 1)
        perm = np.random.default_rng(seed).permutation(num_rows)
        self.val_indices = np.sort(perm[:num_val]).astype(np.int64)
        self.train_indices = np.sort(perm[num_val:]).astype(np.int64)

    def _batch(self, row_ids: np.ndarray) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def __len__(self) -> int:
        """Number of training rows."""
        return len(self.train_indices)

    def _split_indices(self, split: str) -> np.ndarray:
        if split == "train":
            return self.train_indices
        if split in ("val", "validation"):
            return self.val_indices
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")

    def _check_batch(self, batch_size: int, split: str, idx: np.ndarray) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(idx) < batch_size:
            raise ValueError(
                f"corpus too small for one batch: the {split} split has {len(idx)} "
                f"{self._noun}(s) of {self.seq_len} tokens, batch_size={batch_size}. Use more "
                f"text (max_bytes), a shorter seq_len or a smaller batch."
            )

    def batches_per_epoch(self, batch_size: int, split: str = "train") -> int:
        """Full batches of ``batch_size`` rows in one pass over ``split``."""
        return len(self._split_indices(split)) // batch_size

    def batches(
        self, batch_size: int, *, seed: int = 0, split: str = "train", start: int = 0
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield shuffled batches endlessly, epoch after epoch.

        Each epoch visits the split's rows in a fresh order from
        ``np.random.default_rng((seed, epoch))``, so a run is reproducible
        from ``seed`` alone. Batches are always full: the
        ``len(split) % batch_size`` rows left at the end of an epoch are
        skipped that epoch (they land elsewhere in the next permutation).

        Args:
            batch_size: rows per batch.
            seed: shuffle seed.
            split: ``"train"`` or ``"val"``.
            start: begin with batch number ``start`` (0-based, counting
                across epochs) of that sequence, without producing the
                earlier ones: how a resumed run continues where it stopped.

        Yields:
            ``{"input_ids": LongTensor[batch_size, seq_len],
            "labels": LongTensor[batch_size, seq_len]}`` (CPU tensors, dtype
            ``torch.int64``).

        Raises:
            ValueError (immediately, not on first ``next``): unknown split,
            ``batch_size < 1``, ``start < 0``, or the split has fewer than
            ``batch_size`` rows.
        """
        idx = self._split_indices(split)
        self._check_batch(batch_size, split, idx)
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        return self._endless(idx, batch_size, seed, start)

    def _endless(
        self, idx: np.ndarray, batch_size: int, seed: int, start: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        per_epoch = len(idx) // batch_size
        epoch, first = divmod(start, per_epoch)
        while True:
            order = idx[np.random.default_rng((seed, epoch)).permutation(len(idx))]
            for b in range(first, per_epoch):
                yield self._batch(order[b * batch_size : (b + 1) * batch_size])
            first = 0
            epoch += 1

    def eval_batches(
        self, batch_size: int, max_batches: int | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield validation batches in a fixed order (ascending row index).

        Only full batches are produced, so every batch has the same shape;
        the last ``num_val % batch_size`` rows are not used.

        Args:
            batch_size: rows per batch.
            max_batches: stop after this many batches; ``None`` for all
                ``num_val // batch_size`` of them.

        Yields:
            ``{"input_ids": LongTensor[batch_size, seq_len],
            "labels": LongTensor[batch_size, seq_len]}``; the same sequence
            on every call.

        Raises:
            ValueError (immediately): ``batch_size < 1``, ``max_batches < 1``,
            or fewer than ``batch_size`` validation rows.
        """
        idx = self.val_indices
        self._check_batch(batch_size, "val", idx)
        n = len(idx) // batch_size
        if max_batches is not None:
            if max_batches < 1:
                raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
            n = min(n, max_batches)
        return (self._batch(idx[i * batch_size : (i + 1) * batch_size]) for i in range(n))


class TokenDataset(_SplitRows):
    """Fixed-length training windows cut from a token stream, with a held-out split.

    The stream is cut into ``num_windows = len(tokens) // seq_len``
    non-overlapping windows of exactly ``seq_len`` tokens (the trailing
    remainder is dropped). Documents run across window boundaries, separated
    by the end-of-text token, as in GPT-style pre-training.

    Each batch's ``labels`` equal its ``input_ids``: Hugging Face causal-LM
    models (e.g. ``LlamaForCausalLM``) shift labels inside their loss, so
    token ``t`` is predicted from tokens ``< t`` within the window.

    Validation split: ``max(1, round(val_fraction * num_windows))`` windows
    are chosen by a permutation seeded with ``seed`` and held out; the rest
    are training windows. Windows are drawn from across the whole corpus
    (rather than its tail) so validation text has the same mix as training
    text — with the sorted stdlib corpus, the tail would be a handful of
    modules only. The two sets are disjoint and cover all windows.

    Batching (:meth:`batches`, :meth:`eval_batches`) is as for every row
    dataset here; each batch's ``labels`` is a copy of its ``input_ids``.

    Attributes:
        tokens: ``np.ndarray[int64]`` of shape ``[num_windows * seq_len]``.
        seq_len: tokens per window.
        num_windows: total number of windows.
        train_indices / val_indices: sorted ``np.ndarray[int64]`` of window
            indices in each split.

    Raises:
        ValueError: ``seq_len < 1``; ``val_fraction`` not in ``(0, 1)``; or
            fewer than two windows (one for training, one for validation) —
            the message gives the token count and what is needed.
    """

    _noun = "window"

    def __init__(
        self,
        tokens: np.ndarray | Sequence[int],
        seq_len: int,
        *,
        val_fraction: float = 0.05,
        seed: int = 0,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        num_windows = len(tokens) // seq_len
        if num_windows < 2:
            raise ValueError(
                f"corpus too small: {len(tokens)} tokens make {num_windows} window(s) of "
                f"seq_len={seq_len}; need at least {2 * seq_len} tokens (one training and "
                f"one validation window). Use more text (max_bytes) or a shorter seq_len."
            )
        self.seq_len = seq_len
        self.num_windows = num_windows
        self.tokens = tokens[: num_windows * seq_len].copy()
        self._windows = self.tokens.reshape(num_windows, seq_len)
        self._split(num_windows, val_fraction, seed)

    @property
    def num_train_windows(self) -> int:
        return len(self.train_indices)

    @property
    def num_val_windows(self) -> int:
        return len(self.val_indices)

    def _batch(self, window_ids: np.ndarray) -> dict[str, torch.Tensor]:
        # Fancy indexing copies, so the tensor owns fresh memory; labels are a
        # separate copy so a caller masking labels in place (-100) cannot
        # corrupt input_ids.
        x = torch.from_numpy(self._windows[window_ids])
        return {"input_ids": x, "labels": x.clone()}


class PackedDataset(_SplitRows):
    """Rows from :func:`pack_documents`, with a held-out split.

    Validation split: ``max(1, round(val_fraction * rows))`` rows chosen by a
    permutation seeded with ``seed``; the rest train. Batches carry the
    packed ``labels`` (``-100`` at piece starts and padding), not a copy of
    ``input_ids``.

    Attributes:
        packed: the :class:`PackedRows`.
        seq_len: tokens per row.
        num_rows: total rows.
        train_indices / val_indices: sorted row indices of each split.

    Raises:
        ValueError: ``val_fraction`` not in ``(0, 1)``, or fewer than two
            rows (one for training, one for validation).
    """

    def __init__(self, packed: PackedRows, *, val_fraction: float = 0.05, seed: int = 0) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        rows = packed.input_ids.shape[0]
        if rows < 2:
            raise ValueError(
                f"corpus too small: its {packed.num_tokens} tokens pack into {rows} row(s) of "
                f"seq_len={packed.seq_len}; need at least 2 (one training and one validation "
                f"row). Use more text (max_bytes) or a shorter seq_len."
            )
        self.packed = packed
        self.seq_len = packed.seq_len
        self.num_rows = rows
        self._split(rows, val_fraction, seed)

    @property
    def num_train_rows(self) -> int:
        return len(self.train_indices)

    @property
    def num_val_rows(self) -> int:
        return len(self.val_indices)

    def fingerprint(self) -> str:
        """sha256 (hex) of the rows, labels and split: equal iff the batches are equal."""
        h = hashlib.sha256()
        for a in (self.packed.input_ids, self.packed.labels, self.train_indices, self.val_indices):
            h.update(np.ascontiguousarray(a).tobytes())
            h.update(str(a.shape).encode())
        return h.hexdigest()

    def _batch(self, row_ids: np.ndarray) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.from_numpy(self.packed.input_ids[row_ids]),
            "labels": torch.from_numpy(self.packed.labels[row_ids]),
        }


# --------------------------------------------------------------------------
# Glue
# --------------------------------------------------------------------------


def prepare_lm_data(
    source: str | os.PathLike[str] | None = None,
    *,
    tokenizer_path: str | os.PathLike[str] | None = None,
    vocab_size: int = 2048,
    seq_len: int = DEFAULT_SEQ_LEN,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    val_fraction: float = 0.05,
    seed: int = 0,
    text_field: str = "text",
    eot_token: str = EOT_TOKEN,
) -> tuple[Tokenizer, TokenDataset]:
    """Load text, get a tokenizer, encode, and window it: the whole pipeline.

    With defaults this reads 3 MB of the interpreter's stdlib source, trains
    a 2048-token byte-level BPE on it and returns ~0.9 M tokens as 256-token
    windows; about 1 s on a 2-core CPU.

    Args:
        source: corpus, as for :func:`load_documents` (``None``: the stdlib).
        tokenizer_path: a ``tokenizer.json`` (or directory holding one) to use
            instead of training; ``vocab_size`` is then ignored and
            ``eot_token`` must be in its vocabulary.
        vocab_size: vocabulary size of the trained BPE tokenizer.
        seq_len: tokens per window.
        max_bytes: UTF-8 bytes of text to read (``None``: all).
        val_fraction: fraction of windows held out for validation.
        seed: seed of the train/validation split.
        text_field: document field for ``.jsonl`` sources.
        eot_token: token appended after each document.

    Returns:
        ``(tokenizer, dataset)``: the ``tokenizers.Tokenizer`` (its
        ``get_vocab_size()`` bounds every id in the dataset) and the
        :class:`TokenDataset`.

    Raises:
        FileNotFoundError, ValueError: see :func:`load_documents`,
        :func:`load_tokenizer`, :func:`train_bpe_tokenizer`,
        :func:`encode_documents` and :class:`TokenDataset`.
    """
    t0 = time.perf_counter()
    docs = load_documents(source, max_bytes=max_bytes, text_field=text_field)
    t1 = time.perf_counter()
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path)
    else:
        tokenizer = train_bpe_tokenizer(docs, vocab_size)
    t2 = time.perf_counter()
    tokens = encode_documents(tokenizer, docs, eot_token=eot_token)
    t3 = time.perf_counter()
    dataset = TokenDataset(tokens, seq_len, val_fraction=val_fraction, seed=seed)
    logger.info(
        "data: %d docs, %.2f MB text (%.1fs); tokenizer vocab %d (%.1fs); "
        "%d tokens (%.1fs); %d train + %d val windows of %d",
        len(docs),
        sum(len(d.encode("utf-8")) for d in docs) / 1e6,
        t1 - t0,
        tokenizer.get_vocab_size(),
        t2 - t1,
        len(tokens),
        t3 - t2,
        dataset.num_train_windows,
        dataset.num_val_windows,
        seq_len,
    )
    return tokenizer, dataset
