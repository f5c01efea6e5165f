"""Tokenizers: train a byte-level BPE, load a ``tokenizer.json``, encode documents.

All through the Hugging Face ``tokenizers`` library. Encoded documents are ``np.ndarray[int64]``
of token ids, one per document (:func:`tokenize_documents`) or one stream with an end-of-text
token after each document (:func:`encode_documents`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "EOT_CANDIDATES",
    "EOT_TOKEN",
    "encode_documents",
    "find_eot_token",
    "load_tokenizer",
    "tokenize_documents",
    "train_bpe_tokenizer",
]

#: End-of-text special token appended after every document.
EOT_TOKEN = "<|endoftext|>"

#: End-of-sequence tokens :func:`find_eot_token` looks for, in this order: this
#: package's BPE, GPT-2/Qwen, Llama 3, Llama 2/Mistral, Gemma.
EOT_CANDIDATES = (EOT_TOKEN, "<|end_of_text|>", "</s>", "<eos>")

_MIN_VOCAB = 257  # 256 byte-level symbols + the end-of-text token

MAX_WORD_CHARS = 256
"""Runs of non-whitespace characters longer than this are cut into pieces of this length before
BPE training: the trainer's work per merge grows with the longest pre-tokenized word, so one line
of a few MB without whitespace (a minified file, a base64 blob) made it quadratic (1 MB: 30 s,
2 MB: 340 s); cut, 1 MB trains in 1.5 s. Words of natural text and code are far shorter."""

_LONG_RUN = re.compile(r"\S{%d,}" % (MAX_WORD_CHARS + 1))


def bounded_words(docs: Iterable[str]) -> Iterator[str]:
    """``docs`` as texts for BPE training with no run of non-whitespace characters longer than
    :data:`MAX_WORD_CHARS`: a document without such a run as it is, one with one in pieces (the
    text around it, and the run in :data:`MAX_WORD_CHARS`-character slices). The pieces' text is
    the document's, in order; only the merges across the cuts are not counted."""
    for doc in docs:
        start = 0
        for m in _LONG_RUN.finditer(doc):
            if m.start() > start:
                yield doc[start:m.start()]
            run = m.group()
            yield from (run[i:i + MAX_WORD_CHARS] for i in range(0, len(run), MAX_WORD_CHARS))
            start = m.end()
        if start == 0:
            yield doc
        elif start < len(doc):
            yield doc[start:]


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
    the pair itself, not by hash order), so no seed is needed. Runs of more than
    :data:`MAX_WORD_CHARS` characters without whitespace are cut first
    (:func:`bounded_words`), which keeps training linear in the text.

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
    tok.train_from_iterator(bounded_words(docs), trainer=trainer)
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
