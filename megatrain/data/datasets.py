"""Row datasets with a held-out split and seeded, resumable batching, and the one-call pipeline.

:class:`TokenDataset` cuts one token stream into fixed windows; :class:`PackedDataset` serves
rows made by :func:`~megatrain.data.packing.pack_documents`. :func:`prepare_lm_data` runs
load -> tokenizer -> encode -> windows.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer

from megatrain.data.packing import PackedRows
from megatrain.data.sources import DEFAULT_MAX_BYTES, load_documents
from megatrain.data.tokenizer import EOT_TOKEN, encode_documents, load_tokenizer, train_bpe_tokenizer

__all__ = ["DEFAULT_SEQ_LEN", "PackedDataset", "TokenDataset", "prepare_lm_data"]

logger = logging.getLogger(__name__)

#: Default window length in tokens.
DEFAULT_SEQ_LEN = 256


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
