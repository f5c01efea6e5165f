"""Packing tokenized documents into fixed-length rows whose loss targets never cross a document.

:func:`best_fit_decreasing` is the bin-packing rule (Johnson et al., "Worst-case performance bounds
for simple one-dimensional packing algorithms", SIAM J. Comput. 3(4), 1974; the rule TRL's
``pack_dataset(strategy="bfd")`` packs SFT examples with). :func:`pack_documents` packs
language-model documents with it (pieces that overlap by one token; labels ``-100`` at piece
starts and padding); :class:`~megatrain.data.sft.SftDataset` packs fine-tuning examples with it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["IGNORE_INDEX", "PackedRows", "best_fit_decreasing", "pack_documents"]

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
    # Pieces were made in (document, start) order, the tie order the rule names.
    bins = best_fit_decreasing([p[0] for p in pieces], seq_len)
    input_ids = np.full((len(bins), seq_len), pad, dtype=np.int64)
    labels = np.full((len(bins), seq_len), IGNORE_INDEX, dtype=np.int64)
    for row, members in enumerate(bins):
        off = 0
        for k in members:
            n, i, start = pieces[k]
            a = arrays[i]
            if start + n <= a.size:
                seg = a[start:start + n]
            else:  # the last piece ends with the end-of-text token
                seg = np.append(a[start:], eot_id)
            input_ids[row, off : off + n] = seg
            labels[row, off + 1 : off + n] = seg[1:]
            off += n
    return PackedRows(
        input_ids=input_ids,
        labels=labels,
        num_documents=len(arrays),
        num_pieces=len(pieces),
        num_tokens=sum(p[0] for p in pieces),
    )


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items of the given lengths into as few bins of ``capacity`` as best-fit decreasing does.

    Items are taken in order of decreasing length (ties: lower index first); each goes into the
    open bin with the least free space that still holds it (ties: the bin opened first), else into
    a new bin. The result depends only on the arguments.

    Args:
        lengths: one positive length per item, each at most ``capacity``.
        capacity: the size of a bin (tokens per row).

    Returns:
        The bins in the order they were opened, each the indices of its items in the order placed.

    Raises:
        ValueError: ``capacity < 1``, or a length not in ``[1, capacity]`` (its index is named).

    Runs in ``O(n log n)`` for the sort plus ``O(n (log n + capacity / 64))`` for the placements:
    the free-space values that some open bin has are the set bits of one integer, so the tightest
    fit is the lowest set bit at or above the item's length; each value keeps its bins in a heap.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    for i, n in enumerate(lengths):
        if not 1 <= n <= capacity:
            raise ValueError(f"item {i} has length {n}, not in [1, capacity={capacity}]")
    bins: list[list[int]] = []
    by_free: dict[int, list[int]] = {}  # free space -> heap of bin numbers
    free_bits = 0  # bit f set iff some open bin has exactly f free
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        above = free_bits >> n
        if above:
            free = n + (above & -above).bit_length() - 1
            heap = by_free[free]
            b = heapq.heappop(heap)
            if not heap:
                del by_free[free]
                free_bits &= ~(1 << free)
        else:
            free, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = free - n
        if left:
            heapq.heappush(by_free.setdefault(left, []), b)
            free_bits |= 1 << left
    return bins
