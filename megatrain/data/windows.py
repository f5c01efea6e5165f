"""Training windows read from a token store without loading it, shuffled by keyed bijections.

:class:`StoreWindows` cuts a :class:`~megatrain.data.store.TokenStore`'s flat stream into fixed
windows of ``seq_len`` tokens. The train/validation split and each epoch's shuffle are keyed
bijections computed per batch (a Feistel network with cycle walking: Black & Rogaway, "Ciphers with Arbitrary Finite Domains", CT-RSA 2002), never a
materialised index, and the pages a batch touched are released after it is copied out
(``madvise(MADV_DONTNEED)``), so the reader's resident memory does not grow with the corpus.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from megatrain.data.packing import IGNORE_INDEX
from megatrain.data.store import TokenStore

__all__ = ["StoreWindows"]

_FEISTEL_ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele, Lea & Flood, OOPSLA 2014): a bijective 64-bit mixer."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class _Permutation:
    """A keyed pseudo-random bijection of ``[0, n)``, evaluated per element in O(1) memory.

    A balanced Feistel network on ``2 * half`` bits (``4**half >= n``, so fewer than 4 values
    per index are visited) with round function ``splitmix64(R ^ k_i)``, restricted to
    ``[0, n)`` by cycle walking: apply the network again until the value is below ``n``.
    A bijection for every key; the round keys come from ``np.random.SeedSequence(key)``.
    """

    def __init__(self, n: int, key: Sequence[int]) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.SeedSequence(list(key)).generate_state(_FEISTEL_ROUNDS, dtype=np.uint64)

    def _rounds(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        with np.errstate(over="ignore"):
            if not inverse:
                for k in self.keys:
                    left, right = right, left ^ (_mix(right ^ k) & self.mask)
            else:
                for k in self.keys[::-1]:
                    left, right = right ^ (_mix(left ^ k) & self.mask), left
        return (left << h) | right

    def _walk(self, i: np.ndarray, inverse: bool) -> np.ndarray:
        i = np.asarray(i, dtype=np.int64)
        if i.size and (i.min() < 0 or i.max() >= self.n):
            raise IndexError(f"permutation of [0, {self.n}) applied to {i.min()}..{i.max()}")
        x = self._rounds(i.astype(np.uint64), inverse)
        out = x >= np.uint64(self.n)
        while out.any():
            x[out] = self._rounds(x[out], inverse)
            out = x >= np.uint64(self.n)
        return x.astype(np.int64)

    def __call__(self, i: np.ndarray) -> np.ndarray:
        return self._walk(i, inverse=False)

    def inverse(self, j: np.ndarray) -> np.ndarray:
        return self._walk(j, inverse=True)


class StoreWindows:
    """Fixed-length training windows read from a :class:`TokenStore`, with a held-out split.

    The stream is cut into ``num_windows = num_tokens // seq_len`` non-overlapping windows (the
    trailing remainder is dropped); documents run across window boundaries, as in GPT-style
    pre-training. ``labels`` equal ``input_ids`` (Hugging Face causal LMs shift inside their
    loss) except that with ``mask_document_starts`` the first token of every document that starts
    inside a window (the token after an end-of-text) is :data:`IGNORE_INDEX`, so no loss target
    is predicted from another document's text, as :func:`~megatrain.data.packing.pack_documents`
    guarantees for packed rows. With ``document_attention`` each batch also has ``position_ids``
    that restart at 0 at every document start inside the window (and at the window's first token):
    Hugging Face causal LMs given ``position_ids`` that restart (and no ``attention_mask``) attend
    only within each document, as their packing without padding does (``DataCollatorWithFlattening``).

    Split: ``num_val = min(max(1, round(val_fraction * num_windows)), num_windows - 1)`` windows
    are held out: window ``w`` is a validation window iff ``S(w) < num_val`` for a bijection ``S``
    keyed by ``seed``. Shuffle: epoch ``e`` takes training position ``i`` to window
    ``S⁻¹(num_val + P_e(i))`` with ``P_e`` a bijection of ``[0, num_train)`` keyed by
    ``(batch seed, e)``. Both are computed per batch (see :class:`_Permutation`), so memory does
    not depend on the corpus; batch ``b`` depends only on the seeds and ``b``, which is how a
    resumed run takes exactly the batches of one that never stopped.

    API: ``batches``, ``eval_batches``, ``batches_per_epoch``, ``fingerprint``, ``num_train_rows``,
    ``num_val_rows``.

    Raises:
        ValueError: ``seq_len < 2``; ``val_fraction`` not in ``(0, 1)``; fewer than two windows.
    """

    def __init__(
        self,
        store: TokenStore,
        seq_len: int,
        *,
        val_fraction: float = 0.05,
        seed: int = 0,
        mask_document_starts: bool = True,
        document_attention: bool = False,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (one context and one target token), got {seq_len}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        num_windows = store.num_tokens // seq_len
        if num_windows < 2:
            raise ValueError(
                f"corpus too small: the store {str(store.path)!r} holds {store.num_tokens:,} tokens, "
                f"{num_windows} window(s) of seq_len={seq_len}; need at least {2 * seq_len} tokens "
                f"(one training and one validation window). Use more text or a shorter seq_len."
            )
        self.store = store
        self.seq_len = seq_len
        self.num_windows = num_windows
        self.val_fraction = val_fraction
        self.seed = seed
        self.mask_document_starts = mask_document_starts
        self.document_attention = document_attention
        self.num_val_rows = min(max(1, round(val_fraction * num_windows)), num_windows - 1)
        self.num_train_rows = num_windows - self.num_val_rows
        self._split = _Permutation(num_windows, (seed, 0))

    def __len__(self) -> int:
        """Number of training windows."""
        return self.num_train_rows

    def fingerprint(self) -> str:
        """sha256 (hex) of the store's tokens hash and the windowing: equal iff the batches are equal."""
        key = [self.store.manifest.tokens_sha256, self.seq_len, self.val_fraction, self.seed,
               self.mask_document_starts]
        if self.document_attention:  # appended only when on: the windows' key before it existed
            key.append("document_attention")
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()

    def _rows(self, split: str) -> int:
        if split == "train":
            return self.num_train_rows
        if split in ("val", "validation"):
            return self.num_val_rows
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")

    def _check_batch(self, batch_size: int, split: str) -> int:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rows = self._rows(split)
        if rows < batch_size:
            raise ValueError(
                f"corpus too small for one batch: the {split} split has {rows} window(s) of "
                f"{self.seq_len} tokens, batch_size={batch_size}. Use more text, a shorter seq_len "
                f"or a smaller batch."
            )
        return rows

    def batches_per_epoch(self, batch_size: int, split: str = "train") -> int:
        """Full batches of ``batch_size`` windows in one pass over ``split``."""
        return self._rows(split) // batch_size

    def windows(self, split: str, positions: np.ndarray, *, seed: int = 0, epoch: int = 0) -> np.ndarray:
        """Window indices (``int64``) at ``positions`` of ``split`` in shuffle ``epoch`` of ``seed``.

        ``positions`` index ``[0, rows of split)``; ``split="eval"`` is the validation split in
        its fixed (unshuffled) order, the one :meth:`eval_batches` reads.
        """
        positions = np.asarray(positions, dtype=np.int64)
        if split == "eval":
            return self._split.inverse(positions)
        rows = self._rows(split)
        tag = 1 if split == "train" else 2
        pos = _Permutation(rows, (seed, tag, epoch))(positions)
        return self._split.inverse(pos + (self.num_val_rows if split == "train" else 0))

    def read(self, windows: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch of ``windows`` (window indices), copied out of the map.

        Returns:
            ``{"input_ids": LongTensor[len(windows), seq_len], "labels": LongTensor[...]}``, CPU,
            and ``"position_ids"`` (same shape, 0 at each document start) with ``document_attention``.
        """
        windows = np.asarray(windows, dtype=np.int64)
        starts = windows * self.seq_len
        x = self.store.tokens[starts[:, None] + np.arange(self.seq_len)].astype(np.int64)
        self.store.release()
        labels = x.copy()
        starts_doc = np.zeros_like(x, dtype=bool)
        starts_doc[:, 1:] = x[:, :-1] == self.store.eot_id
        if self.mask_document_starts:
            labels[starts_doc] = IGNORE_INDEX
        out = {"input_ids": torch.from_numpy(x), "labels": torch.from_numpy(labels)}
        if self.document_attention:
            t = np.arange(self.seq_len, dtype=np.int64)
            last_start = np.maximum.accumulate(np.where(starts_doc, t, 0), axis=1)
            out["position_ids"] = torch.from_numpy(t - last_start)
        return out

    def batches(
        self, batch_size: int, *, seed: int = 0, split: str = "train", start: int = 0
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield shuffled batches endlessly, epoch after epoch.

        Args:
            batch_size: windows per batch.
            seed: shuffle seed (the split's seed is the constructor's).
            split: ``"train"`` or ``"val"``.
            start: begin with batch number ``start`` (0-based, across epochs) without reading the
                earlier ones: a resumed run continues where it stopped.

        Yields:
            ``{"input_ids", "labels"}``: ``LongTensor[batch_size, seq_len]`` each. Every epoch
            has ``rows // batch_size`` full batches; the rest of an epoch's order is skipped.

        Raises:
            ValueError (immediately): unknown split, ``batch_size < 1``, ``start < 0``, or fewer
            than ``batch_size`` windows in the split.
        """
        rows = self._check_batch(batch_size, split)
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        return self._endless(rows, batch_size, seed, split, start)

    def _endless(self, rows: int, batch_size: int, seed: int, split: str,
                 start: int) -> Iterator[dict[str, torch.Tensor]]:
        per_epoch = rows // batch_size
        epoch, first = divmod(start, per_epoch)
        while True:
            for b in range(first, per_epoch):
                pos = np.arange(b * batch_size, (b + 1) * batch_size, dtype=np.int64)
                yield self.read(self.windows(split, pos, seed=seed, epoch=epoch))
            first = 0
            epoch += 1

    def close(self) -> None:
        """Close the store's map (:meth:`TokenStore.close`); no batch may be read afterwards."""
        self.store.close()

    def eval_batches(
        self, batch_size: int, max_batches: int | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Yield validation batches in a fixed order (the validation windows by ascending rank of
        the split's bijection): the same sequence on every call, only full batches.

        Raises:
            ValueError (immediately): ``batch_size < 1``, ``max_batches < 1``, or fewer than
            ``batch_size`` validation windows.
        """
        rows = self._check_batch(batch_size, "val")
        n = rows // batch_size
        if max_batches is not None:
            if max_batches < 1:
                raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
            n = min(n, max_batches)
        return (self.read(self.windows("eval", np.arange(i * batch_size, (i + 1) * batch_size)))
                for i in range(n))
