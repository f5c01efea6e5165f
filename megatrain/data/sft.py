"""Supervised fine-tuning data: JSONL examples -> token rows with loss only on the answer.

A ``.jsonl`` file holds one example per non-blank line, either

- ``{"prompt": str, "completion": str}``: the prompt's tokens are context, the completion's
  tokens and an end-of-text token after them are targets; or
- ``{"messages": [{"role": str, "content": str}, ...]}``: a chat, rendered with the tokenizer's
  chat template when it has one (the Jinja template of its ``tokenizer_config.json``, rendered
  as ``transformers``' ``apply_chat_template`` renders it), else as ``<|role|>\\n`` + content +
  end-of-text per message; the tokens of ``assistant`` turns are targets, the rest context.

Each example becomes one row of ``seq_len`` tokens (:func:`tokenize_sft`): its tokens, cut at
``seq_len``, then padding with the end-of-text id (``attention_mask`` 0 there); ``labels`` are the token ids at targets and
:data:`~megatrain.data.packing.IGNORE_INDEX` (-100) elsewhere (context, padding). Hugging Face
causal LMs shift labels inside their loss, so a target token is predicted from the tokens
before it. Rows are padded, not packed: no row holds two examples, so no attention crosses one.

Chat templates: the text of turn ``k`` is the render of ``messages[:k + 1]`` minus the render of
``messages[:k]`` (with ``add_generation_prompt`` when turn ``k`` is the assistant's, so the
assistant header stays context), the method of TRL's and torchtune's assistant-only masks; a
template whose renders are not prefixes of each other cannot be split this way and is an error.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from megatrain.data.packing import IGNORE_INDEX

__all__ = ["SftDataset", "SftRows", "read_sft_examples", "render_chat", "tokenize_sft"]

Segments = list[tuple[str, bool]]
"""An example as text pieces, each with whether its tokens are targets."""


def render_chat(messages: list[dict], chat_template: str | None, eot_token: str, *,
                where: str = "messages") -> Segments:
    """Split a chat into ``(text, is_assistant)`` pieces (see the module docstring).

    Raises:
        ValueError: a message is not ``{"role": str, "content": str}``; the chat has no
            assistant turn; the template fails or is not prefix-stable (naming ``where``).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {i} must be an object with string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the chat has no 'assistant' message, so nothing to learn")
    if chat_template is None:
        return [(f"<|{m['role']}|>\n{m['content']}{eot_token}", m["role"] == "assistant") for m in messages]
    render = _compile_template(chat_template, eot_token)
    out: Segments = []
    done = ""
    for k, m in enumerate(messages):
        assistant = m["role"] == "assistant"
        try:
            head = render(messages[:k], assistant) if k or assistant else ""
            full = render(messages[: k + 1], False)
        except Exception as e:  # jinja2 raises its own types and the template's raise_exception
            raise ValueError(f"{where}: the chat template failed on message {k}: {e}") from None
        if not (head.startswith(done) and full.startswith(head)):
            raise ValueError(f"{where}: the chat template's render of the first {k} messages is not a prefix "
                             f"of the render of {k + 1}; assistant tokens cannot be told apart with it")
        if head != done:
            out.append((head[len(done):], False))
        out.append((full[len(head):], assistant))
        done = full
    return out


def _compile_template(source: str, eot_token: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    # As transformers renders chat templates (trim_blocks, lstrip_blocks, a sandbox).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               eos_token=eot_token, bos_token="")

    return render


def read_sft_examples(path: str | Path, *, chat_template: str | None = None,
                      eot_token: str = "<|endoftext|>") -> Iterator[Segments]:
    """Yield each example of the ``.jsonl`` file ``path`` as :data:`Segments`, in file order.

    Raises:
        ValueError: not a ``.jsonl`` file; a line that is not UTF-8, not JSON, or not an object
            with string ``prompt`` and ``completion`` or a ``messages`` list (the message names the
            file and the 1-based line); a chat as :func:`render_chat` rejects it.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if path.suffix.lower() != ".jsonl":
        raise ValueError(f"SFT data must be a .jsonl file of {{'prompt', 'completion'}} or {{'messages'}} "
                         f"records, got {str(path)!r}")
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file {str(path)!r} does not exist")
    # Bytes, decoded line by line: a text-mode file decodes ahead in chunks and would report a bad
    # byte on an earlier line than its own.
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{str(path)!r}, line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not valid UTF-8 ({e})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if isinstance(obj, dict) and "messages" in obj:
                yield render_chat(obj["messages"], chat_template, eot_token, where=where)
            elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str) \
                    and isinstance(obj.get("completion"), str):
                yield [(obj["prompt"], False), (obj["completion"] + eot_token, True)]
            else:
                raise ValueError(f"{where}: an SFT record needs string fields 'prompt' and 'completion', "
                                 "or a 'messages' list")


@dataclass(frozen=True, slots=True)
class SftRows:
    """Tokenised examples. ``input_ids``, ``labels``, ``attention_mask``: ``int64[num_rows,
    seq_len]`` (the mask is 1 on the example's tokens, 0 on the padding after them); ``truncated``:
    examples longer than ``seq_len`` (cut at the end)."""

    input_ids: np.ndarray
    labels: np.ndarray
    truncated: int
    attention_mask: np.ndarray

    @property
    def num_target_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def tokenize_sft(tokenizer: Tokenizer, examples: Iterator[Segments], seq_len: int, *, pad_id: int) -> SftRows:
    """Encode each example's pieces (no special tokens added), cut at ``seq_len``, pad with
    ``pad_id``; labels as in the module docstring.

    Raises:
        ValueError: ``seq_len < 2``; no example; an example with no target token left after the cut
            (its position, 0-based, is named).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    ids_rows: list[np.ndarray] = []
    label_rows: list[np.ndarray] = []
    lengths: list[int] = []
    truncated = 0
    for n, segments in enumerate(examples):
        ids: list[int] = []
        labels: list[int] = []
        for text, target in segments:
            enc = tokenizer.encode(text, add_special_tokens=False).ids
            ids += enc
            labels += enc if target else [IGNORE_INDEX] * len(enc)
        if len(ids) > seq_len:
            truncated += 1
            ids, labels = ids[:seq_len], labels[:seq_len]
        if all(x == IGNORE_INDEX for x in labels):
            raise ValueError(f"example {n}: no completion or assistant token within seq_len={seq_len} "
                             "(the prompt fills the row); raise seq_len or shorten the prompt")
        pad = seq_len - len(ids)
        lengths.append(len(ids))
        ids_rows.append(np.asarray(ids + [pad_id] * pad, dtype=np.int64))
        label_rows.append(np.asarray(labels + [IGNORE_INDEX] * pad, dtype=np.int64))
    if not ids_rows:
        raise ValueError("no SFT examples found (the file holds only blank lines)")
    mask = (np.arange(seq_len)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
    return SftRows(np.stack(ids_rows), np.stack(label_rows), truncated, mask)


class SftDataset:
    """:class:`SftRows` with a held-out split and seeded, resumable batches.

    Split: ``num_val = min(max(1, round(val_fraction * rows)), rows - 1)`` rows chosen by a
    permutation seeded with ``seed``. Batch ``b`` of :meth:`batches` is row positions
    ``[b * batch_size, (b + 1) * batch_size)`` of epoch ``b // per_epoch``'s permutation, seeded by
    ``(seed, epoch)``: it depends only on the seeds and ``b``, so a resumed run takes the batches
    of one that never stopped. The API is :class:`~megatrain.data.StoreWindows`'s.

    Raises:
        ValueError: ``val_fraction`` not in ``(0, 1)``; fewer than two examples.
    """

    def __init__(self, rows: SftRows, *, val_fraction: float = 0.05, seed: int = 0) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        n = rows.input_ids.shape[0]
        if n < 2:
            raise ValueError(f"SFT data too small: {n} example(s); need at least 2 (one training and one "
                             "validation example)")
        self.rows = rows
        self.seq_len = rows.input_ids.shape[1]
        num_val = min(max(1, round(val_fraction * n)), n - 1)
        perm = np.random.default_rng(seed).permutation(n)
        self.val_indices = np.sort(perm[:num_val])
        self.train_indices = np.sort(perm[num_val:])
        self.num_train_rows, self.num_val_rows = n - num_val, num_val

    def fingerprint(self) -> str:
        """sha256 (hex) of the rows, labels and split: equal iff the batches are equal."""
        h = hashlib.sha256()
        for a in (self.rows.input_ids, self.rows.labels, self.train_indices, self.val_indices):
            h.update(np.ascontiguousarray(a).tobytes())
            h.update(str(a.shape).encode())
        return h.hexdigest()

    def _indices(self, split: str) -> np.ndarray:
        if split == "train":
            return self.train_indices
        if split in ("val", "validation"):
            return self.val_indices
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")

    def _check(self, batch_size: int, idx: np.ndarray, split: str) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(idx) < batch_size:
            raise ValueError(f"SFT data too small for one batch: the {split} split has {len(idx)} example(s), "
                             f"batch_size={batch_size}. Use more examples or a smaller batch.")

    def _batch(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        # The mask makes StepResult.tokens (and so tokens/s) count the examples' tokens, not the
        # padding; with right padding and causal attention it changes no logit of a real token.
        return {"input_ids": torch.from_numpy(self.rows.input_ids[ids]),
                "attention_mask": torch.from_numpy(self.rows.attention_mask[ids]),
                "labels": torch.from_numpy(self.rows.labels[ids])}

    def batches_per_epoch(self, batch_size: int, split: str = "train") -> int:
        return len(self._indices(split)) // batch_size

    def batches(self, batch_size: int, *, seed: int = 0, split: str = "train",
                start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Endless shuffled batches from batch number ``start`` (see the class docstring).

        Raises:
            ValueError (immediately): unknown split, ``batch_size < 1``, ``start < 0``, too few rows.
        """
        idx = self._indices(split)
        self._check(batch_size, idx, split)
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")

        def endless():
            per_epoch = len(idx) // batch_size
            epoch, first = divmod(start, per_epoch)
            while True:
                order = idx[np.random.default_rng((seed, epoch)).permutation(len(idx))]
                for b in range(first, per_epoch):
                    yield self._batch(order[b * batch_size:(b + 1) * batch_size])
                first, epoch = 0, epoch + 1

        return endless()

    def eval_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Validation batches in ascending row order, only full ones; the same on every call."""
        idx = self.val_indices
        self._check(batch_size, idx, "val")
        n = len(idx) // batch_size
        if max_batches is not None:
            if max_batches < 1:
                raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
            n = min(n, max_batches)
        return (self._batch(idx[i * batch_size:(i + 1) * batch_size]) for i in range(n))

    def close(self) -> None:
        """Nothing to release (the rows are in memory); :class:`StoreWindows` has the same call."""
