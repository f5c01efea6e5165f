"""Data pipeline for causal language-model training: text → BPE tokens → batches.

Everything runs locally with nothing downloaded. The default corpus is the
source tree of the running interpreter's standard library (real text that is
always present); a user may instead point at a directory of text files, a
single text file, or a ``.jsonl`` file.

Typical use::

    tokenizer, data = prepare_lm_data(seq_len=256)
    for step, batch in zip(range(num_steps), data.batches(8, seed=0)):
        loss = model(**batch).loss   # input_ids, labels: LongTensor[8, 256]

Units: ``max_bytes`` counts UTF-8 bytes of document text; ``seq_len`` and all
lengths of token arrays count tokens.
"""

from __future__ import annotations

import json
import logging
import os
import sysconfig
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_SEQ_LEN",
    "EOT_TOKEN",
    "TEXT_SUFFIXES",
    "TokenDataset",
    "default_corpus_dir",
    "encode_documents",
    "load_documents",
    "load_tokenizer",
    "prepare_lm_data",
    "train_bpe_tokenizer",
]

logger = logging.getLogger(__name__)

#: End-of-text special token appended after every document.
EOT_TOKEN = "<|endoftext|>"

#: Suffixes collected from a directory (and accepted as a single-document file).
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")

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
    "a directory (its *.py, *.txt, *.md, *.rst files are read recursively), "
    "a single .py/.txt/.md/.rst file (one document), or a .jsonl file "
    "(one JSON object per line)"
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
            if name.lower().endswith(TEXT_SUFFIXES):
                p = Path(dirpath, name)
                if p.is_file():
                    files.append(p)
    # Sort by path components (not by os.walk order, which depends on the
    # filesystem) so the same tree always yields the same document order.
    files.sort(key=lambda p: p.relative_to(root).parts)
    return files


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
) -> list[str]:
    """Load text documents from a directory, a text file, or a ``.jsonl`` file.

    Args:
        source: ``None`` for :func:`default_corpus_dir`; a directory, whose
            ``*.py``, ``*.txt``, ``*.md`` and ``*.rst`` files (recursive,
            case-insensitive suffix) become one document each, in sorted
            relative-path order — ``site-packages``, ``dist-packages``,
            ``__pycache__`` and hidden directories are skipped, and files that
            are not valid UTF-8 or are empty are skipped; a ``.py``/``.txt``/
            ``.md``/``.rst`` file, which is one document; or a ``.jsonl`` file,
            one document per non-blank line taken from ``text_field``.
        max_bytes: stop once this many UTF-8 bytes of text are collected.
            Documents are taken whole, except the one that would cross the
            limit, which is truncated (at a character boundary) to fit.
            ``None`` loads everything.
        text_field: key of the document text in each ``.jsonl`` object.

    Returns:
        The documents, in a deterministic order, each a non-empty ``str``;
        their total UTF-8 size is at most ``max_bytes``.

    Raises:
        FileNotFoundError: ``source`` does not exist, or a directory holds no
            file with an accepted suffix.
        ValueError: unsupported file suffix; ``max_bytes`` not positive; a
            single text file that is not UTF-8; a ``.jsonl`` line that is not
            a JSON object with a string ``text_field`` (the message names the
            file, the 1-based line number and the field); or no non-empty
            document was found.
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
                f"corpus directory {str(path)!r} contains no *.py, *.txt, *.md or *.rst "
                f"files (site-packages, __pycache__ and hidden directories are skipped); "
                f"expected {_ACCEPTED}"
            )
        for f in files:
            if budget.exhausted:
                break
            data = f.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                # Legacy-encoded or deliberately broken files (the stdlib
                # test suite has some) are not usable text for byte-level BPE.
                continue
            if not data.strip():
                continue  # empty __init__.py files would add only an EOT token
            text = budget.take(data)
            if text:
                docs.append(text)
    else:
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            docs = _load_jsonl(path, budget, text_field)
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


def encode_documents(
    tokenizer: Tokenizer,
    docs: Sequence[str],
    *,
    eot_token: str = EOT_TOKEN,
    batch_size: int = 1024,
) -> np.ndarray:
    """Tokenize documents into one stream, with ``eot_token`` after each.

    Documents are encoded ``batch_size`` at a time with the tokenizer's
    parallel batch encoder and without the tokenizer's own special tokens
    (a BOS added per encode call would otherwise appear mid-stream).

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
    eot = _eot_id(tokenizer, eot_token)
    # encode_batch_fast skips offset tracking we never use; same ids.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    eot_arr = np.array([eot], dtype=np.int64)
    # Per-document arrays rather than one list of Python ints: ~8 bytes per
    # token instead of ~36 while the stream is built.
    pieces: list[np.ndarray] = []
    docs = list(docs)
    for start in range(0, len(docs), batch_size):
        for enc in encode(docs[start : start + batch_size], add_special_tokens=False):
            pieces.append(np.asarray(enc.ids, dtype=np.int64))
            pieces.append(eot_arr)
    if not pieces:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(pieces)


# --------------------------------------------------------------------------
# Windows and batches
# --------------------------------------------------------------------------


class TokenDataset:
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

        num_val = min(max(1, round(val_fraction * num_windows)), num_windows - 1)
        perm = np.random.default_rng(seed).permutation(num_windows)
        self.val_indices = np.sort(perm[:num_val]).astype(np.int64)
        self.train_indices = np.sort(perm[num_val:]).astype(np.int64)

    def __len__(self) -> int:
        """Number of training windows."""
        return len(self.train_indices)

    @property
    def num_train_windows(self) -> int:
        return len(self.train_indices)

    @property
    def num_val_windows(self) -> int:
        return len(self.val_indices)

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
                f"window(s) of {self.seq_len} tokens, batch_size={batch_size}. Use more "
                f"text (max_bytes), a shorter seq_len or a smaller batch."
            )

    def _batch(self, window_ids: np.ndarray) -> dict[str, torch.Tensor]:
        # Fancy indexing copies, so the tensor owns fresh memory; labels are a
        # separate copy so a caller masking labels in place (-100) cannot
        # corrupt input_ids.
        x = torch.from_numpy(self._windows[window_ids])
        return {"input_ids": x, "labels": x.clone()}

    def batches(
        self, batch_size: int, *, seed: int = 0, split: str = "train"
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield shuffled batches endlessly, epoch after epoch.

        Each epoch visits the split's windows in a fresh order from
        ``np.random.default_rng((seed, epoch))``, so a run is reproducible
        from ``seed`` alone. Batches are always full: the
        ``len(split) % batch_size`` windows left at the end of an epoch are
        skipped that epoch (they land elsewhere in the next permutation).

        Args:
            batch_size: windows per batch.
            seed: shuffle seed.
            split: ``"train"`` or ``"val"``.

        Yields:
            ``{"input_ids": LongTensor[batch_size, seq_len],
            "labels": LongTensor[batch_size, seq_len]}`` with equal values
            (CPU tensors, dtype ``torch.int64``).

        Raises:
            ValueError (immediately, not on first ``next``): unknown split,
            ``batch_size < 1``, or the split has fewer than ``batch_size``
            windows.
        """
        idx = self._split_indices(split)
        self._check_batch(batch_size, split, idx)
        return self._endless(idx, batch_size, seed)

    def _endless(
        self, idx: np.ndarray, batch_size: int, seed: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        n_full = len(idx) // batch_size * batch_size
        epoch = 0
        while True:
            order = idx[np.random.default_rng((seed, epoch)).permutation(len(idx))]
            for start in range(0, n_full, batch_size):
                yield self._batch(order[start : start + batch_size])
            epoch += 1

    def eval_batches(
        self, batch_size: int, max_batches: int | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield validation batches in a fixed order (ascending window index).

        Only full batches are produced, so every batch has the same shape;
        the last ``num_val_windows % batch_size`` windows are not used.

        Args:
            batch_size: windows per batch.
            max_batches: stop after this many batches; ``None`` for all
                ``num_val_windows // batch_size`` of them.

        Yields:
            ``{"input_ids": LongTensor[batch_size, seq_len],
            "labels": LongTensor[batch_size, seq_len]}``; the same sequence
            on every call.

        Raises:
            ValueError (immediately): ``batch_size < 1``, ``max_batches < 1``,
            or fewer than ``batch_size`` validation windows.
        """
        idx = self.val_indices
        self._check_batch(batch_size, "val", idx)
        n = len(idx) // batch_size
        if max_batches is not None:
            if max_batches < 1:
                raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
            n = min(n, max_batches)
        return (self._batch(idx[i * batch_size : (i + 1) * batch_size]) for i in range(n))


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
