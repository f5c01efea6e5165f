"""Supervised fine-tuning data: examples -> tokens with loss targets -> an on-disk store -> rows.

**Tokens and targets** (:class:`ChatTokenizer`). A chat is rendered by the tokenizer's chat
template through ``transformers``' ``apply_chat_template`` (its Jinja environment, special tokens
and tool handling), with ``bos_token``/``eos_token`` of the run. A template with ``{% generation %}``
markers says which tokens the assistant generates (``return_assistant_tokens_mask``); one run of
marked tokens per assistant message. A template without them is split by prefix differences:
the text of assistant message ``k`` is the render of ``messages[:k + 1]`` minus the render of
``messages[:k]`` with the generation prompt (so the assistant header stays context), the method
of TRL's and torchtune's assistant-only masks; a template whose renders are not prefixes of each
other cannot be split so and is an error (add generation markers to it). The whole render is
tokenised once (no special tokens added) and a token is a target when it overlaps a target's
characters, as ``transformers`` maps its assistant mask. Without a template of its own the
tokenizer gets :data:`DEFAULT_CHAT_TEMPLATE`; the template used is saved with the checkpoint.
Targets: every assistant message (``loss="all"``; OpenAI ``weight: 0`` ones and a conversational
prompt's are context) or only the last one (``loss="last"``). A prompt/completion pair of strings
is ``prompt + completion + eos`` with the completion and ``eos`` as targets, no template.

**Truncation that keeps the answer** (:meth:`ChatTokenizer.fit`). An example longer than
``seq_len`` loses its oldest context first: the system message, then whole exchanges from the
start (each from a user message up to the next), then, still too long, its first tokens, never a
token of its last target turn or after it. When that turn does not fit with one token of context
before it, the example is dropped. ``truncation="drop"`` drops every example that does not fit.
Both are counted (``SftStore.manifest``).

**The store** (:func:`cached_sft_store`). Examples are tokenised once, streaming, into a token store
(:mod:`megatrain.data.store`'s format: ``tokens.bin``, ``offsets.npy`` with one document per
example, ``manifest.json``, opened and verified by :func:`~megatrain.data.store.open_token_store`)
plus ``targets.bin`` (``uint8`` per token, 1 on loss targets) and ``sft.json``
(:class:`SftManifest`); reading maps them, so sets larger than RAM train with flat memory. It is
reused while the data files, formats, tokenizer, template and options are unchanged.

**Rows** (:class:`SftDataset`). With packing, several examples share a row of ``seq_len`` tokens,
placed by best-fit decreasing (:func:`~megatrain.data.packing.best_fit_decreasing`, as TRL's
``pack_dataset(strategy="bfd")``), with ``position_ids`` that restart at 0 at every example so that
attention stays inside it (Hugging Face's packing without padding); the rest of a row is
end-of-text padding, a document of its own. Without packing, each example is a row padded with
an ``attention_mask``. ``labels`` are the token at targets and -100 elsewhere, always at an
example's first token: Hugging Face causal LMs shift labels inside their loss, so no target is
predicted from another example.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import time
import uuid
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from tokenizers import Tokenizer

from megatrain import bounds
from megatrain.data.packing import IGNORE_INDEX, best_fit_decreasing
from megatrain.data.sft_formats import Chat, Completion, RecordError
from megatrain.data.sft_sources import SftSource, iter_examples, sources_key
from megatrain.data.store import (
    MANIFEST_FILE,
    OFFSETS_FILE,
    TOKENS_FILE,
    CorruptStoreError,
    StoreError,
    StoreManifest,
    TokenStore,
    little_endian,
    open_token_store,
    token_dtype,
)
from megatrain.files import file_sha256, replace_directory, sha256_hex

__all__ = ["DEFAULT_CHAT_TEMPLATE", "ChatTokenizer", "SftDataset", "SftManifest", "SftStore", "build_sft_store",
           "cached_sft_store", "open_sft_store"]

#: The chat template of a tokenizer without one: ``<|role|>`` + newline + content + end-of-text per
#: message, the assistant's content and end-of-text inside ``{% generation %}`` markers; tool
#: calls and the tool list as JSON.
DEFAULT_CHAT_TEMPLATE = (
    "{%- if tools %}<|tools|>\n{{ tools | tojson }}{{ eos_token }}{% endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] or '' }}"
    "{% if m['tool_calls'] %}{{ m['tool_calls'] | tojson }}{% endif %}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")

SFT_FORMAT = "megatrain-sft-store"
SFT_VERSION = 1
SFT_FILE = "sft.json"
TARGETS_FILE = "targets.bin"
IMAGES_FILE = "images.jsonl"
_FLUSH_TOKENS = 1 << 20


@dataclass(frozen=True, slots=True)
class Encoded:
    """One example: ``ids`` and ``targets`` (``np.ndarray`` ``int64`` / ``bool``, same length), and
    the files of its images (:class:`~megatrain.data.sft_images.ChatProcessor`)."""

    ids: np.ndarray
    targets: np.ndarray
    images: tuple[str, ...] = ()


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` and a chat template, through ``transformers``' tokenizer.

    Args:
        tokenizer: the run's tokenizer (copied: the wrapper never changes it).
        chat_template: Jinja source; None: :data:`DEFAULT_CHAT_TEMPLATE`.
        eos_token: the end-of-text token (``eos_token`` in templates; ends completions).
        bos_token: ``bos_token`` in templates (None: the end-of-text token).
        loss: ``"all"`` assistant turns are targets, or only the ``"last"``.
        template_origin: where ``chat_template`` came from (its file), named in the errors of its
            render.

    Raises:
        ImportError: ``transformers`` is missing (``pip install 'megatrain[hf]'``).
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, *, eos_token: str,
                 bos_token: str | None = None, loss: Literal["all", "last"] = "all",
                 template_origin: str | None = None) -> None:
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError as e:
            raise ImportError("chat templates are rendered by transformers: pip install 'megatrain[hf]'") from e
        if loss not in ("all", "last"):
            raise ValueError(f"loss must be 'all' or 'last', got {loss!r}")
        self.template = chat_template if chat_template is not None else DEFAULT_CHAT_TEMPLATE
        self.template_name = "the chat template" + (f" ({template_origin})" if template_origin else "")
        self.markers = bool(_GENERATION.search(self.template))
        self.eos_token, self.bos_token, self.loss = eos_token, bos_token or eos_token, loss
        self.hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_str()),
                                          eos_token=eos_token, bos_token=self.bos_token)

    def describe(self) -> str:
        """How the assistant's tokens are found, for the ``data:`` line."""
        return f"assistant tokens by {'generation markers' if self.markers else 'prefix differences'}"

    def key(self) -> list:
        """What the tokens depend on beyond the tokenizer, template and special tokens (nothing
        here; a :class:`~megatrain.data.sft_images.ChatProcessor`'s image settings)."""
        return []

    def encode(self, example: Chat | Completion) -> Encoded:
        """Tokens and targets of the whole example (module docstring).

        Raises:
            RecordError: the template fails, is not prefix-stable, or marks a different number of
                generation blocks than there are assistant messages; no token is a target; the
                chat has images (a text model's data has none).
        """
        if isinstance(example, Completion):
            text = example.prompt + example.completion + self.eos_token
            return self._tokenize(text, [(len(example.prompt), len(text))])
        # One bound for all of the record's renders (_bounded's own is then moot): each of a long
        # chat's prefixes renders in time, and all of them did not.
        with bounds.time_limit(bounds.TEMPLATE_SECONDS, self._slow):
            return self._encode_chat(example)

    def _encode_chat(self, example: Chat) -> Encoded:
        example = self._messages(example)
        train = list(example.train)
        if self.loss == "last":
            last = max(i for i, t in enumerate(train) if t)
            train = [i == last for i in range(len(train))]
        messages = [dict(m) for m in example.messages]
        tools = list(example.tools) if example.tools else None
        if self.markers:
            return self._encode_marked(messages, train, tools)
        text = self._render(messages, tools, False)
        spans = []
        for k, m in enumerate(messages):
            if not train[k]:
                continue
            head = self._render(messages[:k], tools, True)
            full = self._render(messages[:k + 1], tools, False)
            if not (full.startswith(head) and text.startswith(full)):
                raise RecordError(f"the chat template's render of the first {k} messages is not a prefix of the "
                                  f"render of {k + 1}, so the assistant's tokens cannot be told apart; use a "
                                  "template with {% generation %} markers (--chat-template)")
            spans.append((len(head), len(full)))
        return self._tokenize(text, spans)

    def _messages(self, chat: Chat) -> Chat:
        """The chat as the template reads it: a text model's content is a string (text parts joined)."""
        if chat.images:
            raise RecordError(f"the record has {len(chat.images)} image(s), and the model reads text only: fine-tune "
                              "a vision-language model (LLaVA) on it, or drop its images")
        messages = tuple({**m, "content": "".join(p["text"] for p in m["content"])}
                         if isinstance(m.get("content"), list) else m for m in chat.messages)
        return Chat(messages, chat.train, chat.tools)

    def _slow(self) -> RecordError:
        return RecordError(f"{self.template_name} took more than {bounds.TEMPLATE_SECONDS:g} s to render one record "
                           "(a template renders a chat in milliseconds: a loop in it, or a record of thousands "
                           "of messages); fix the template or shorten the record")

    def _bounded(self, render: Callable[[], Any]) -> Any:
        """``render()`` (a template's render) within :data:`megatrain.bounds.TEMPLATE_SECONDS`; its
        errors as a RecordError."""
        try:
            with bounds.time_limit(bounds.TEMPLATE_SECONDS, self._slow):
                return render()
        except RecordError:
            raise
        except Exception as e:  # jinja2's errors and the template's own raise_exception
            raise RecordError(f"{self.template_name} failed: {type(e).__name__}: {e}") from None

    def _render(self, messages: list[dict], tools, generation_prompt: bool) -> str:
        text = self._bounded(lambda: self.hf.apply_chat_template(
            messages, tools=tools, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt))
        if len(text) > bounds.MAX_TEMPLATE_CHARS:
            raise RecordError(f"{self.template_name} rendered {len(text):,} characters for one record, more than any row "
                              f"megatrain trains holds ({bounds.MAX_TEMPLATE_CHARS:,}); fix the template")
        return text

    def _encode_marked(self, messages: list[dict], train: list[bool], tools) -> Encoded:
        out = self._bounded(lambda: self.hf.apply_chat_template(
            messages, tools=tools, chat_template=self.template, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True))
        ids = np.asarray(out["input_ids"], dtype=np.int64)
        mask = np.asarray(out["assistant_masks"], dtype=bool)
        edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
        runs = list(zip(edges[::2], edges[1::2]))
        assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if len(runs) != len(assistant):
            raise RecordError(f"the chat template marks {len(runs)} {{% generation %}} block(s) for "
                              f"{len(assistant)} assistant message(s); it must mark each assistant message once")
        targets = np.zeros(len(ids), dtype=bool)
        for (a, b), k in zip(runs, assistant):
            targets[a:b] = train[k]
        return self._checked(Encoded(ids, targets))

    def _tokenize(self, text: str, char_spans: list[tuple[int, int]]) -> Encoded:
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        targets = np.zeros(len(ids), dtype=bool)
        for a, b in char_spans:
            hit = np.flatnonzero((offsets[:, 0] < b) & (offsets[:, 1] > a))
            if hit.size:  # and the zero-width tokens between (offsets trimmed of whitespace)
                targets[hit[0]:hit[-1] + 1] = True
        return self._checked(Encoded(ids, targets))

    @staticmethod
    def _checked(enc: Encoded) -> Encoded:
        if not enc.targets.any():
            raise RecordError("no token of the assistant turns or completion is a target (they render empty)")
        if enc.targets[0]:
            raise RecordError("the first token is a target: it has no context to be predicted from")
        return enc

    def fit(self, example: Chat | Completion, seq_len: int,
            truncation: Literal["trim", "drop"] = "trim") -> tuple[Encoded | None, bool]:
        """``(encoded, trimmed)``: the example in at most ``seq_len`` tokens, or ``(None, False)``
        when it is dropped (module docstring).

        Raises:
            RecordError: as :meth:`encode`.
        """
        enc = self.encode(example)
        if len(enc.ids) <= seq_len:
            return enc, False
        if truncation == "drop":
            return None, False
        if isinstance(example, Chat):
            enc = self._drop_messages(example, seq_len) or enc
            if len(enc.ids) <= seq_len:
                return enc, True
        last = _last_target_start(enc.targets)
        if len(enc.ids) - (last - 1) > seq_len:  # the last turn and what follows it, plus one token of context
            return None, False
        cut = len(enc.ids) - seq_len
        return Encoded(enc.ids[cut:], enc.targets[cut:]), True

    def _drop_messages(self, chat: Chat, seq_len: int) -> Encoded | None:
        """Of the chat without its system message(s), then without each further leading exchange,
        the longest that fits ``seq_len`` (a binary search: dropping more never renders longer), else
        the shortest of them; None when there is nothing to drop."""
        last_train = max(i for i, t in enumerate(chat.train) if t)
        roles = [m["role"] for m in chat.messages]
        system_end = next((i for i, r in enumerate(roles) if r != "system"), len(roles))
        starts = ([system_end] if system_end else []) + [
            i for i in range(system_end + 1, last_train) if roles[i] == "user"]
        if not starts:
            return None

        def suffix(s: int) -> Encoded:
            return self.encode(Chat(chat.messages[s:], chat.train[s:], chat.tools))

        lo, hi = 0, len(starts) - 1
        best = suffix(starts[hi])
        if len(best.ids) > seq_len:
            return best
        while lo < hi:  # the first start whose suffix fits
            mid = (lo + hi) // 2
            enc = suffix(starts[mid])
            if len(enc.ids) <= seq_len:
                best, hi = enc, mid
            else:
                lo = mid + 1
        return best


def _last_target_start(targets: np.ndarray) -> int:
    """The first position of the last run of targets."""
    t = np.flatnonzero(targets)
    gaps = np.flatnonzero(np.diff(t) > 1)
    return int(t[gaps[-1] + 1] if gaps.size else t[0])


# --------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------


class SftDatasetInfo(BaseModel):
    """Per dataset: what was read and what became of it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    format: str
    """The format read (detected or given)."""
    examples: int
    """Examples stored (after dropping)."""
    trimmed: int
    """Stored examples whose oldest context was cut to fit ``seq_len``."""
    dropped: int
    """Examples not stored: too long to keep their last target turn (or any: ``truncation: drop``)."""


class SftManifest(BaseModel):
    """``sft.json`` of an SFT store: the JSON boundary, validated on read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["megatrain-sft-store"]
    version: Literal[1]
    key: str
    """:func:`sft_store_key` of the sources, tokenizer, template and options."""
    datasets: list[SftDatasetInfo]
    """In the order their examples are stored: dataset ``i``'s are a contiguous range."""
    chat_template: str
    seq_len: int
    truncation: Literal["trim", "drop"]
    loss: Literal["all", "last"]
    num_target_tokens: int
    targets_sha256: str
    num_images: int = 0
    """Image files the examples name; with any, ``images.jsonl`` lists each example's (one JSON
    list a line, in example order)."""
    images_sha256: str | None = None

    @property
    def trimmed(self) -> int:
        return sum(d.trimmed for d in self.datasets)

    @property
    def dropped(self) -> int:
        return sum(d.dropped for d in self.datasets)


class SftStore:
    """An open SFT store: the token store of its examples and a map of their targets.

    Attributes:
        path, manifest (:class:`SftManifest`), tokens (the :class:`~megatrain.data.store.TokenStore`:
        one document per example), targets (``np.ndarray[uint8]``, ``[num_tokens]``, read-only,
        mapped), origin (``"opened"``, ``"reused"``, ``"built"``, ``"rebuilt (<reason>)"``),
        images (each example's image files, in memory; None for a store without images).
    """

    def __init__(self, path: Path, tokens: TokenStore, manifest: SftManifest, *, origin: str = "opened") -> None:
        self.path, self.tokens, self.manifest, self.origin = path, tokens, manifest, origin
        self._fh = open(path / TARGETS_FILE, "rb")
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if tokens.num_tokens else None
        self.targets = np.frombuffer(self._mm, dtype=np.uint8) if self._mm else np.zeros(0, np.uint8)
        self.images: list[list[str]] | None = None
        if manifest.num_images:
            with open(path / IMAGES_FILE, encoding="utf-8") as fh:
                self.images = [json.loads(line) for line in fh]

    @property
    def num_examples(self) -> int:
        return self.tokens.num_documents

    def release(self) -> None:
        """Unmap the pages read so far (see :meth:`TokenStore.release`)."""
        self.tokens.release()
        if self._mm is not None and hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.targets = np.zeros(0, np.uint8)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive; the map closes with it
        self._fh.close()
        self.tokens.close()


def sft_store_key(sources: Sequence[SftSource], chat: ChatTokenizer, seq_len: int,
                  truncation: str) -> str:
    """sha256 naming what an SFT store holds: equal keys mean equal files."""
    key = [SFT_FORMAT, SFT_VERSION, sources_key(list(sources)), sha256_hex(chat.hf.backend_tokenizer.to_str()),
           chat.template, chat.bos_token, chat.eos_token, chat.loss, seq_len, truncation] + chat.key()
    return sha256_hex(json.dumps(key))


def open_sft_store(path: str | os.PathLike[str], *, verify: Literal["full", "size"] = "full") -> SftStore:
    """Open the SFT store at ``path`` after checking it (:func:`~megatrain.data.store.open_token_store`
    for the tokens, the size and sha256 of ``targets.bin``).

    Raises:
        CorruptStoreError: a file is missing, malformed or does not match its manifest.
    """
    path = Path(path)
    f = path / SFT_FILE
    if not f.is_file():
        raise CorruptStoreError(f"{str(path)!r} has no {SFT_FILE}: not an SFT store (or an interrupted build)")
    try:
        manifest = SftManifest.model_validate_json(f.read_bytes())
    except ValidationError as e:
        raise CorruptStoreError(f"{str(f)!r} is not a version-{SFT_VERSION} SFT manifest "
                                f"({e.errors()[0]['msg']}); rebuild it") from None
    tokens = open_token_store(path, verify=verify)
    targets = path / TARGETS_FILE
    try:
        if not targets.is_file() or targets.stat().st_size != tokens.num_tokens:
            raise CorruptStoreError(f"SFT store {str(path)!r}: {TARGETS_FILE} does not hold one byte per token "
                                    f"({tokens.num_tokens:,}); rebuild it")
        if verify == "full" and file_sha256(targets) != manifest.targets_sha256:
            raise CorruptStoreError(f"SFT store {str(path)!r}: {TARGETS_FILE} does not match the sha256 in "
                                    f"{SFT_FILE}; rebuild it")
        images = path / IMAGES_FILE
        if manifest.num_images and (not images.is_file() or verify == "full"
                                    and file_sha256(images) != manifest.images_sha256):
            raise CorruptStoreError(f"SFT store {str(path)!r}: {IMAGES_FILE} is missing or does not match the "
                                    f"sha256 in {SFT_FILE}; rebuild it")
    except CorruptStoreError:
        tokens.close()
        raise
    return SftStore(path, tokens, manifest)


def build_sft_store(sources: Sequence[SftSource], chat: ChatTokenizer, path: str | os.PathLike[str], *,
                    seq_len: int, truncation: Literal["trim", "drop"] = "trim", progress: bool = True) -> SftStore:
    """Read, tokenise and fit every example of ``sources`` into a new store at ``path`` (replacing
    any there), streaming: memory holds an example, 8 bytes per example (its length) and a write
    buffer of about a million tokens.

    Raises:
        RecordError: a malformed record (naming the file, the record and the fields expected).
        ValueError, FileNotFoundError, ImportError: as :func:`~megatrain.data.sft_sources.iter_examples`;
            ``seq_len < 2``.
        StoreError: every example of a dataset was dropped.
    """
    from tqdm.auto import tqdm

    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (one context and one target token), got {seq_len}")
    t0 = time.perf_counter()
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a build that crashed
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    vocab = chat.hf.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab)
    lengths = array("q")
    infos: list[SftDatasetInfo] = []
    num_tokens = num_targets = num_images = 0
    try:
        with open(tmp / TOKENS_FILE, "wb") as tok_out, open(tmp / TARGETS_FILE, "wb") as tgt_out, \
                open(tmp / IMAGES_FILE, "w", encoding="utf-8") as img_out, \
                tqdm(desc="tokenising SFT examples", unit=" examples", disable=not progress, delay=2.0) as bar:
            ids_buf: list[np.ndarray] = []
            tgt_buf: list[np.ndarray] = []
            buffered = 0

            def flush() -> None:
                nonlocal buffered
                if ids_buf:
                    np.concatenate(ids_buf).astype(little_endian(dtype)).tofile(tok_out)
                    np.concatenate(tgt_buf).astype(np.uint8).tofile(tgt_out)
                ids_buf.clear()
                tgt_buf.clear()
                buffered = 0

            for source in sources:
                kept = trimmed = dropped = 0
                fmt = "?"
                for example, where, fmt in iter_examples(source):
                    try:
                        enc, cut = chat.fit(example, seq_len, truncation)
                    except RecordError as e:
                        raise RecordError(f"{where()}: {e}") from None
                    bar.update(1)
                    if enc is None:
                        dropped += 1
                        continue
                    kept += 1
                    trimmed += cut
                    lengths.append(len(enc.ids))
                    ids_buf.append(enc.ids)
                    tgt_buf.append(enc.targets)
                    img_out.write(json.dumps(list(enc.images)) + "\n")
                    num_images += len(enc.images)
                    buffered += len(enc.ids)
                    num_tokens += len(enc.ids)
                    num_targets += int(enc.targets.sum())
                    if buffered >= _FLUSH_TOKENS:
                        flush()
                if kept == 0:
                    raise StoreError(f"SFT dataset {source.name!r}: all {dropped} example(s) were dropped: none keeps "
                                     f"its last answer within seq_len={seq_len}; raise seq_len"
                                     + ("" if truncation == "trim" else " or use truncation trim"))
                infos.append(SftDatasetInfo(name=source.name, format=fmt, examples=kept, trimmed=trimmed,
                                            dropped=dropped))
            flush()
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
        np.save(tmp / OFFSETS_FILE, offsets)
        src_key = sources_key(list(sources))
        key = sft_store_key(sources, chat, seq_len, truncation)
        tokens_manifest = StoreManifest(
            format="megatrain-token-store", version=1, key=key, source=",".join(s.name for s in sources),
            source_files=sum(len(s.fingerprint()["files"]) for s in sources),
            source_bytes=sum(s.nbytes() for s in sources), source_sha256=src_key,
            tokenizer_sha256=sha256_hex(chat.hf.backend_tokenizer.to_str()), vocab_size=vocab,
            eot_token=chat.eos_token, eot_id=chat.hf.convert_tokens_to_ids(chat.eos_token), text_field="sft",
            dtype=dtype.name, num_documents=len(lengths), num_tokens=num_tokens, skipped_files=0,
            skipped_examples=[], tokens_sha256=file_sha256(tmp / TOKENS_FILE),
            offsets_sha256=file_sha256(tmp / OFFSETS_FILE), build_seconds=round(time.perf_counter() - t0, 3))
        if not num_images:
            (tmp / IMAGES_FILE).unlink()
        manifest = SftManifest(format=SFT_FORMAT, version=SFT_VERSION, key=key, datasets=infos,
                               chat_template=chat.template, seq_len=seq_len, truncation=truncation, loss=chat.loss,
                               num_target_tokens=num_targets, targets_sha256=file_sha256(tmp / TARGETS_FILE),
                               num_images=num_images,
                               images_sha256=file_sha256(tmp / IMAGES_FILE) if num_images else None)
        for name, model in ((MANIFEST_FILE, tokens_manifest), (SFT_FILE, manifest)):
            with open(tmp / name, "w", encoding="utf-8") as fh:  # the manifests last: a store is whole or absent
                fh.write(model.model_dump_json(indent=1))
                fh.flush()
                os.fsync(fh.fileno())
        replace_directory(tmp, path, ignore_cleanup_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    store = open_sft_store(path, verify="size")
    store.origin = "built"
    return store


def cached_sft_store(sources: Sequence[SftSource], chat: ChatTokenizer, path: str | os.PathLike[str], *,
                     seq_len: int, truncation: Literal["trim", "drop"] = "trim", progress: bool = True,
                     verify: Literal["full", "size"] = "full") -> SftStore:
    """The store at ``path`` if it holds ``sources`` tokenised by ``chat`` with these options (its
    key matches and it verifies), else a new one; ``origin`` says which and why, as
    :func:`~megatrain.data.store.cached_token_store`'s does.

    Raises: as :func:`build_sft_store`.
    """
    path = Path(path).absolute()
    key = sft_store_key(sources, chat, seq_len, truncation)
    reason = None
    if path.exists():
        try:
            store = open_sft_store(path, verify=verify)
        except CorruptStoreError as e:
            reason = "not an SFT store" if not (path / SFT_FILE).is_file() else f"corrupt: {e}"
        else:
            if store.manifest.key == key:
                store.origin = "reused"
                return store
            reason = ("source changed" if store.tokens.manifest.source_sha256 != sources_key(list(sources))
                      else "tokenizer or template changed" if store.manifest.chat_template != chat.template
                      or store.tokens.manifest.tokenizer_sha256 != sha256_hex(chat.hf.backend_tokenizer.to_str())
                      else "options changed")
            store.close()
    store = build_sft_store(sources, chat, path, seq_len=seq_len, truncation=truncation, progress=progress)
    store.origin = "built" if reason is None else f"rebuilt ({reason})"
    return store


# --------------------------------------------------------------------------
# Rows and batches
# --------------------------------------------------------------------------


class SftDataset:
    """Rows of SFT examples read from an :class:`SftStore`, with a held-out split and seeded,
    resumable batches (the API of :class:`~megatrain.data.StoreWindows`).

    Split: ``num_val = min(max(1, round(val_fraction * n)), n - 1)`` of the ``n`` examples, chosen by
    a permutation seeded with ``seed``, are held out. Mixture: dataset ``i``'s training examples
    ``T_i`` are taken ``c_i`` times per epoch, ``c_i = num_samples[i]`` (default ``|T_i|``); with
    weights, ``c_i = round(w_i / sum(w) * sum(c))`` (unweighted datasets weigh 1), so the mixture
    keeps its size and takes the datasets in the weights' proportions. ``c_i`` over ``|T_i|`` full
    copies and a seeded sample (without replacement) of the rest: the same every epoch.
    Rows: with ``packing`` the epoch's examples are packed by best-fit decreasing into rows of
    ``seq_len`` (validation examples likewise); else one example per row. Batch ``b`` is rows
    ``[b * batch_size, (b + 1) * batch_size)`` of epoch ``b // per_epoch``'s row permutation,
    seeded by ``(seed, epoch)``: a resumed run takes the batches of one that never stopped.

    Batches: packing: ``input_ids``, ``position_ids`` (0 at each example's first token and at the
    padding's), ``labels``; no packing: ``input_ids``, ``attention_mask`` (0 on padding),
    ``labels``. All ``LongTensor[batch_size, seq_len]``; labels -100 off targets and at every
    example's first token. Padding is the end-of-text id. A store with images is read without
    packing (an example's images stay in its row) and ``images`` (a
    :class:`~megatrain.data.sft_images.ChatProcessor`) adds its image inputs by name: each row's
    :meth:`~megatrain.data.sft_images.ChatProcessor.image_inputs`, concatenated over the rows
    along dimension 0 (LLaVA: ``pixel_values`` ``FloatTensor[batch_size, C, H, W]``).

    Raises:
        ValueError: ``val_fraction`` not in ``(0, 1)``; fewer than two examples; an example longer
            than ``seq_len``; weights or num_samples not one per dataset; a dataset with examples
            to take but none left for training; a store with images read with packing or without
            ``images``.
    """

    def __init__(self, store: SftStore, seq_len: int, *, packing: bool = True, val_fraction: float = 0.05,
                 seed: int = 0, weights: Sequence[float | None] | None = None,
                 num_samples: Sequence[int | None] | None = None, images=None) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if store.images is not None and (packing or images is None):
            raise ValueError(f"the SFT store {str(store.path)!r} holds examples with images: read it with "
                             "packing=False (one example per row) and images=<the ChatProcessor that built it>")
        self.images = images if store.images is not None else None
        n = store.num_examples
        if n < 2:
            raise ValueError(f"SFT data too small: {n} example(s); need at least 2 (one training and one "
                             "validation example)")
        self.store, self.seq_len, self.packing = store, seq_len, packing
        self.val_fraction, self.seed = val_fraction, seed
        self.pad_id = store.tokens.eot_id
        self.chat_template = store.manifest.chat_template
        self._offsets = np.asarray(store.tokens.offsets)
        lengths = np.diff(self._offsets)
        if int(lengths.max()) > seq_len:
            raise ValueError(f"the SFT store {str(store.path)!r} holds examples of up to {int(lengths.max())} tokens, "
                             f"more than seq_len={seq_len}")
        k = len(store.manifest.datasets)
        self.weights = list(weights) if weights is not None else [None] * k
        self.num_samples = list(num_samples) if num_samples is not None else [None] * k
        if len(self.weights) != k or len(self.num_samples) != k:
            raise ValueError(f"weights and num_samples need one entry per dataset ({k})")
        num_val = min(max(1, round(val_fraction * n)), n - 1)
        is_val = np.zeros(n, dtype=bool)
        is_val[np.random.default_rng(seed).permutation(n)[:num_val]] = True
        self.val_examples = np.flatnonzero(is_val)
        self.train_examples, self.counts = self._mixture(np.flatnonzero(~is_val))
        self._train = self._layout(self.train_examples, lengths)
        self._val = self._layout(self.val_examples, lengths)
        self.num_train_rows, self.num_val_rows = len(self._train[0]) - 1, len(self._val[0]) - 1
        self.num_train_tokens = int(lengths[self.train_examples].sum())

    def _mixture(self, train: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """The epoch's training examples (with repeats) and how many each dataset gives."""
        bounds = np.cumsum([0] + [d.examples for d in self.store.manifest.datasets])
        parts = [train[(train >= a) & (train < b)] for a, b in zip(bounds[:-1], bounds[1:])]
        counts = [s if s is not None else len(p) for s, p in zip(self.num_samples, parts)]
        if any(w is not None for w in self.weights):
            w = np.asarray([1.0 if x is None else x for x in self.weights])
            counts = [int(round(c)) for c in w / w.sum() * sum(counts)]
        chosen = []
        for i, (part, c) in enumerate(zip(parts, counts)):
            if c and not len(part):
                name = self.store.manifest.datasets[i].name
                raise ValueError(f"SFT dataset {name!r} has no example left for training (all are held out for "
                                 "validation); give it more examples or lower val_fraction")
            if not c:
                continue
            copies, rest = divmod(c, len(part))
            rng = np.random.default_rng((self.seed, 1, i))
            chosen += [part] * copies + [np.sort(rng.choice(part, size=rest, replace=False))]
        return (np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)), counts

    def _layout(self, examples: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ptr, members)``: row ``r`` holds examples ``members[ptr[r]:ptr[r + 1]]``, in row order."""
        if not self.packing:
            return np.arange(len(examples) + 1), examples
        bins = best_fit_decreasing(lengths[examples].tolist(), self.seq_len)
        order = np.asarray([k for b in bins for k in b], dtype=np.int64)
        return np.cumsum([0] + [len(b) for b in bins]), examples[order]

    @property
    def num_trimmed(self) -> int:
        return self.store.manifest.trimmed

    @property
    def num_dropped(self) -> int:
        return self.store.manifest.dropped

    @property
    def input_names(self) -> tuple[str, ...]:
        """The keys of a batch, in the order ``megatrain.compile(input_names=...)`` takes them."""
        if self.packing:
            return ("input_ids", "position_ids", "labels")
        return ("input_ids", "attention_mask", *(self.images.image_keys if self.images else ()), "labels")

    def fingerprint(self) -> str:
        """sha256 (hex) of the store's key and the layout's settings: equal iff the batches are equal."""
        key = [self.store.manifest.key, self.store.tokens.manifest.tokens_sha256, self.store.manifest.targets_sha256,
               self.seq_len, self.packing, self.val_fraction, self.seed, self.weights, self.num_samples]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()

    def _split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        if split == "train":
            return self._train
        if split in ("val", "validation"):
            return self._val
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")

    def _check(self, batch_size: int, split: str) -> int:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        rows = len(self._split(split)[0]) - 1
        if rows < batch_size:
            what = "packed rows" if self.packing else "examples"
            raise ValueError(f"SFT data too small for one batch: the {split} split has {rows} {what} of "
                             f"seq_len={self.seq_len}, batch_size={batch_size}. Use more examples or a smaller batch"
                             + (" (or --sft-packing false: one example per row)" if self.packing else ""))
        return rows

    def rows(self, rows: Sequence[int], split: str = "train") -> dict[str, torch.Tensor]:
        """The batch of row numbers ``rows`` of ``split`` (see the class docstring)."""
        ptr, members = self._split(split)
        s = self.seq_len
        ids = np.full((len(rows), s), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), s), IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros((len(rows), s), dtype=np.int64)
        used = np.zeros(len(rows), dtype=np.int64)
        tokens, targets, off = self.store.tokens.tokens, self.store.targets, self._offsets
        for r, row in enumerate(rows):
            at = 0
            for e in members[ptr[row]:ptr[row + 1]]:
                a, b = int(off[e]), int(off[e + 1])
                n = b - a
                x = tokens[a:b].astype(np.int64)
                ids[r, at:at + n] = x
                labels[r, at:at + n] = np.where(targets[a:b] != 0, x, IGNORE_INDEX)
                labels[r, at] = IGNORE_INDEX
                pos[r, at:at + n] = np.arange(n)
                at += n
            pos[r, at:] = np.arange(s - at)
            used[r] = at
        self.store.release()
        batch = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if self.packing:
            batch["position_ids"] = torch.from_numpy(pos)
        else:
            batch["attention_mask"] = torch.from_numpy((np.arange(s)[None, :] < used[:, None]).astype(np.int64))
        if self.images is not None:
            batch.update(self._image_inputs([int(members[ptr[row]]) for row in rows]))
        return batch

    def _image_inputs(self, examples: list[int]) -> dict[str, torch.Tensor]:
        """The image inputs of the examples' rows, concatenated along dimension 0 per name."""
        per_row = []
        for e in examples:
            try:
                per_row.append(self.images.image_inputs(self.store.images[e]))
            except RecordError as err:
                raise RecordError(f"SFT example {e} of the store {str(self.store.path)!r}: {err}; the store was "
                                  "built when it could be read: restore the file or rebuild the store") from None
        return {k: torch.cat([r[k] for r in per_row if k in r]) for k in dict.fromkeys(k for r in per_row for k in r)}

    def batches_per_epoch(self, batch_size: int, split: str = "train") -> int:
        return (len(self._split(split)[0]) - 1) // batch_size

    def batches(self, batch_size: int, *, seed: int = 0, split: str = "train",
                start: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """Endless shuffled batches from batch number ``start`` (see the class docstring).

        Raises:
            ValueError (immediately): unknown split, ``batch_size < 1``, ``start < 0``, too few rows.
        """
        rows = self._check(batch_size, split)
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")

        def endless():
            per_epoch = rows // batch_size
            epoch, first = divmod(start, per_epoch)
            while True:
                order = np.random.default_rng((seed, epoch)).permutation(rows)
                for b in range(first, per_epoch):
                    yield self.rows(order[b * batch_size:(b + 1) * batch_size], split)
                first, epoch = 0, epoch + 1

        return endless()

    def eval_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Validation batches in row order, only full ones; the same on every call."""
        n = self._check(batch_size, "val") // batch_size
        if max_batches is not None:
            if max_batches < 1:
                raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
            n = min(n, max_batches)
        return (self.rows(range(i * batch_size, (i + 1) * batch_size), "val") for i in range(n))

    def close(self) -> None:
        """Close the store's maps; no batch may be read afterwards."""
        self.store.close()
