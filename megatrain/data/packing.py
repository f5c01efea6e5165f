"""Packing tokenized documents into fixed-length rows whose loss targets never cross a document.

See :func:`pack_documents` for the exact rule (best-fit decreasing over pieces that overlap by one
token; labels ``-100`` at piece starts and padding).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["IGNORE_INDEX", "PackedRows", "pack_documents"]

#: Label value a causal-LM loss ignores (``torch.nn.CrossEntropyLoss``'s and
#: Hugging Face's ``ignore_index``).
IGNORE_INDEX = -100


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
