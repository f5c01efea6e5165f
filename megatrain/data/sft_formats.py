"""Fine-tuning record formats: each record becomes one :class:`Chat` or :class:`Completion`.

Four formats, with the field names their tools document (a ``dataset_info.json`` may rename the
columns and, for sharegpt, the role names: :meth:`SftFormat.from_registry`):

``alpaca`` (LLaMA-Factory, ``data/README.md``)
    ``{"instruction", "input"?, "output", "system"?, "history"?: [[query, response], ...]}``. The
    user turn is ``instruction`` and ``input`` joined by a newline (each only when non-empty); the
    history's pairs come before it as user/assistant turns, and their responses are learned too,
    as in LLaMA-Factory.
``sharegpt`` (LLaMA-Factory)
    ``{"conversations": [{"from", "value"}, ...], "system"?, "tools"?}`` with the roles ``human``,
    ``gpt``, ``observation`` (a tool's result), ``function_call`` (a JSON ``{"name", "arguments"}``
    or a list of them) and ``system`` (first message only). Human and observation turns take the
    odd positions and gpt and function_call turns the even ones, an even number in all, as
    LLaMA-Factory requires; here a record that breaks the rule is an error (LLaMA-Factory drops it).
``messages`` (TRL's conversational language modelling; OpenAI's chat fine-tuning format)
    ``{"messages": [{"role", "content", "tool_calls"?, "weight"?}, ...], "tools"?}``. Messages pass
    to the chat template as they are; an assistant message with OpenAI's ``"weight": 0`` is
    context, not a target.
``prompt_completion`` (TRL)
    ``{"prompt": str, "completion": str}`` (the completion and an end-of-text token are the
    targets, no template), or ``{"prompt": [messages], "completion": [messages], "tools"?}``
    (conversational: the completion's assistant messages are the targets).

Conversions: a function_call turn becomes an assistant message with ``tool_calls`` (the
Hugging Face chat-template convention, ``transformers`` "Tool use" guide) and an observation a
``tool`` message; a tool list given as ``{"name", "description", "parameters"}`` objects (as
LLaMA-Factory stores them) is wrapped as ``{"type": "function", "function": ...}``. List-valued
fields may be JSON text (how a CSV file holds them). Keys whose value is null are dropped, as
``apply_chat_template`` drops them.

Images (sharegpt and messages): an ``images`` column lists image files, in the order the text
refers to them. In sharegpt text each :data:`IMAGE_PLACEHOLDER` (``<image>``, LLaMA-Factory's)
marks where an image goes; in messages content may be a list of parts (TRL's and transformers'
convention) ``{"type": "text", "text"}`` and ``{"type": "image"}`` (the next file of ``images``,
or its own ``"path"``/``"image"``: a local file). The number of placeholders must equal the number
of images (as LLaMA-Factory requires). A message that refers to images becomes a list of parts
``{"type": "image"}`` and ``{"type": "text", "text"}`` (what processors' chat templates read) and
:attr:`Chat.images` holds the files, in order, as given (resolved by the reader against the data
file's directory or the registry's, as LLaMA-Factory resolves them against ``dataset_dir``).

:func:`detect_format` names a record's format from its fields; :func:`to_example` converts one
record and raises :class:`RecordError` naming the fields it expected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from megatrain import bounds

__all__ = ["FORMATS", "IMAGE_PLACEHOLDER", "SFT_FORMATS", "Chat", "Completion", "RecordError", "SftFormat",
           "detect_format", "to_example"]

FormatKind = str
"""A name of :data:`FORMATS` (``SftFormat.kind``)."""

_LLAMA_FACTORY_COLUMNS = {"prompt", "query", "response", "history", "messages", "system", "tools", "images",
                          "videos", "audios", "chosen", "rejected", "kto_tag"}
_TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
         "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}

#: Where an image goes in sharegpt text (LLaMA-Factory's ``IMAGE_PLACEHOLDER``).
IMAGE_PLACEHOLDER = "<image>"

_OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
                "observation_tag": "tool", "system_tag": "system"}

class RecordError(ValueError):
    """A record that is not an example of its format. The message says what is wrong; the reader
    prefixes the file and the record."""


@dataclass(frozen=True, slots=True)
class Chat:
    """A conversation for the chat template.

    Attributes:
        messages: ``{"role", "content", ...}`` dicts as the template reads them.
        train: one flag per message: its tokens are loss targets (only assistant messages).
        tools: JSON schemas of the tools offered (``apply_chat_template(tools=...)``), or None.
    images: the image files of the ``{"type": "image"}`` parts of the messages, in order.
    """

    messages: tuple[dict, ...]
    train: tuple[bool, ...]
    tools: tuple[dict, ...] | None = None
    images: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.train) != len(self.messages):
            raise ValueError(f"{len(self.train)} train flags for {len(self.messages)} messages")
        if len(self.messages) > bounds.MAX_CHAT_MESSAGES:
            raise RecordError(f"the chat has {len(self.messages):,} messages, more than megatrain renders for one "
                              f"record (megatrain.bounds.MAX_CHAT_MESSAGES, {bounds.MAX_CHAT_MESSAGES:,}: splitting a "
                              "chat takes time quadratic in its messages); split it into several records")


@dataclass(frozen=True, slots=True)
class Completion:
    """Plain text: ``prompt`` is context, ``completion`` (and an end-of-text token) the target."""

    prompt: str
    completion: str


@dataclass(frozen=True, slots=True)
class SftFormat:
    """A record format and where its fields are: ``columns`` maps each role of the format to a
    column name (None: not read) and, for sharegpt, ``tags`` name the message keys and roles."""

    kind: FormatKind
    columns: Mapping[str, str | None] = field(default_factory=dict)
    tags: Mapping[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in FORMATS:
            raise ValueError(f"unknown SFT format {self.kind!r}; expected one of {', '.join(SFT_FORMATS)}")
        spec = FORMATS[self.kind]
        object.__setattr__(self, "columns", {**spec.columns, **self.columns})
        object.__setattr__(self, "tags", {**spec.tags, **self.tags} if spec.tags is not None else {})

    @classmethod
    def from_registry(cls, entry: Mapping[str, Any], where: str) -> SftFormat:
        """The format of a LLaMA-Factory ``dataset_info.json`` entry: ``formatting`` (alpaca, the
        default; sharegpt; openai, read as ``messages``), ``columns`` and ``tags``.

        Raises:
            ValueError: an unknown formatting, or ``columns``/``tags`` that are not objects of
                strings (naming ``where``).
        """
        formatting = entry.get("formatting", "alpaca")
        kinds = {f.formatting: f.name for f in FORMATS.values() if f.formatting is not None}
        kind = kinds.get(formatting)
        if kind is None:
            *rest, last = kinds
            raise ValueError(f"{where}: formatting {formatting!r} is not {', '.join(rest)} or {last}")
        maps = {}
        for key in ("columns", "tags"):
            value = entry.get(key, {})
            if not isinstance(value, dict) or not all(v is None or isinstance(v, str) for v in value.values()):
                raise ValueError(f"{where}: {key!r} must be an object of column names, got {value!r}")
            maps[key] = value
        # LLaMA-Factory reads every column it knows for any formatting and uses those the format has.
        if unknown := sorted(set(maps["columns"]) - _LLAMA_FACTORY_COLUMNS):
            raise ValueError(f"{where}: columns {unknown} are not LLaMA-Factory columns (the {formatting} "
                             f"format reads {sorted(FORMATS[kind].columns)})")
        if used := sorted(k for k in ("videos", "audios") if maps["columns"].get(k)):
            raise ValueError(f"{where}: multimodal columns {used} are not supported (images are: the images column)")
        if maps["columns"].get("images") and "images" not in FORMATS[kind].columns:
            raise ValueError(f"{where}: an images column is read with formatting sharegpt or openai (alpaca reads "
                             "text only)")
        if used := sorted(k for k in ("chosen", "rejected", "kto_tag") if maps["columns"].get(k)):
            raise ValueError(f"{where}: columns {used} are preference or KTO data, not supervised fine-tuning")
        if unknown := sorted(set(maps["tags"]) - set(_TAGS)):
            raise ValueError(f"{where}: tags {unknown} are not LLaMA-Factory tags (expected some of {sorted(_TAGS)})")
        if FORMATS[kind].tags is None and any(maps["tags"].get(k) not in (None, v) for k, v in _OPENAI_TAGS.items()):
            raise ValueError(f"{where}: the openai formatting reads OpenAI's role/content messages; for other tags "
                             "use formatting sharegpt with them")
        columns = {k: v for k, v in maps["columns"].items() if k in FORMATS[kind].columns}
        return cls(kind, columns, maps["tags"] if FORMATS[kind].tags is not None else {})

    def expected(self) -> str:
        """The fields this format reads, for error messages."""
        names = {k: v or "-" for k, v in {**self.columns, **self.tags}.items()}
        return FORMATS[self.kind].expected.format(**names)

    def describe(self) -> dict:
        """JSON-able description (kind, columns, tags): part of the SFT store's key."""
        return {"kind": self.kind, "columns": dict(self.columns), "tags": dict(self.tags)}


def detect_format(record: Mapping[str, Any]) -> SftFormat:
    """The format of ``record``, from its fields with non-null values (the first record of a file
    decides for the file).

    ``messages`` or ``conversations`` holding ``{"role", "content"}`` objects: messages; holding
    ``{"from", "value"}`` objects: sharegpt; ``instruction`` and ``output``: alpaca; ``prompt`` and
    ``completion``: prompt/completion.

    Raises:
        RecordError: no format matches (the message lists the fields found and those of each format).
    """
    present = {k for k, v in record.items() if v is not None}
    for key in ("messages", "conversations"):
        if key in present:
            items = _as_list(record[key], key)
            first = items[0] if items and isinstance(items[0], dict) else {}
            for f in FORMATS.values():
                if f.message_keys and f.message_keys <= first.keys():
                    return SftFormat(f.name, {"messages": key})
    for f in FORMATS.values():
        if f.fields and f.fields <= present:
            return SftFormat(f.name)
    formats = "; ".join(SftFormat(k).expected() for k in SFT_FORMATS)
    raise RecordError(f"fields {sorted(present)} match no SFT format; expected one of: {formats}. Name the "
                      "format with --sft-format, or map the columns in a dataset_info.json")


def to_example(record: Mapping[str, Any], fmt: SftFormat) -> Chat | Completion:
    """Convert one record of format ``fmt`` (module docstring).

    Raises:
        RecordError: a field is missing or of the wrong type, a role is unknown or out of place,
            the chat has no assistant turn to learn or starts with one (naming the field and the
            fields ``fmt`` expects).
    """
    try:
        return FORMATS[fmt.kind].convert(record, fmt)
    except RecordError as e:
        raise RecordError(f"{e}; expected {fmt.expected()}") from None


def _get(record: Mapping[str, Any], column: str | None) -> Any:
    return record.get(column) if column else None


def _string(record: Mapping[str, Any], column: str | None, *, required: bool) -> str | None:
    value = _get(record, column)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        got = "missing" if value is None else f"a {type(value).__name__}"
        raise RecordError(f"field {column!r} must be a string, got {got}")
    return value


def _as_list(value: Any, column: str) -> list:
    """A list field. JSON text is parsed: a CSV cell holds a list as text, and ``datasets`` hands
    back items of differing keys (messages with and without ``tool_calls``) as JSON text too."""
    value = _json(value, column)
    if not isinstance(value, list):
        raise RecordError(f"field {column!r} must be a list, got a {type(value).__name__}")
    return [_json(v, column) if isinstance(v, str) and v[:1] in ("{", "[") else v for v in value]


def _json(value: Any, column: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise RecordError(f"field {column!r} is a string that is not JSON ({e.msg})") from None


def _tools(record: Mapping[str, Any], column: str | None) -> tuple[dict, ...] | None:
    value = _get(record, column)
    if value is None or value == "" or value == []:
        return None
    tools = _as_list(value, column)
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise RecordError(f"field {column!r}: tool {i} must be an object (a JSON schema)")
        out.append(t if "function" in t or "type" in t else {"type": "function", "function": t})
    return tuple(out) or None


def _chat(messages: list[dict], train: list[bool], tools, images: tuple[str, ...] = ()) -> Chat:
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise RecordError(f"the chat has no assistant message (roles: {roles}), so nothing to learn")
    if roles[0] == "assistant":
        raise RecordError("the chat starts with an assistant message: a target needs a context before it")
    if not any(train):
        raise RecordError("every assistant message has weight 0, so nothing to learn")
    return Chat(tuple(messages), tuple(train), tools, images)


def _images(record: Mapping[str, Any], column: str | None) -> list[str]:
    """The ``images`` column: a list of file paths (empty when absent)."""
    value = _get(record, column)
    if value is None or value == "":
        return []
    items = _as_list(value, column)
    if not all(isinstance(p, str) and p for p in items):
        raise RecordError(f"field {column!r} must be a list of image file paths (strings)")
    return items


def _image_parts(text: str) -> list[dict]:
    """``text`` with its :data:`IMAGE_PLACEHOLDER` s as ``{"type": "image"}`` parts between text parts."""
    parts: list[dict] = []
    for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _check_image_count(found: int, images: list[str], column: str | None, what: str) -> None:
    if found != len(images):
        raise RecordError(f"the record has {found} {what} and {len(images)} file(s) in field {column!r}; "
                          "each image the text refers to needs one file, in order")


def _alpaca(record: Mapping[str, Any], fmt: SftFormat) -> Chat:
    c = fmt.columns
    messages: list[dict] = []
    system = _string(record, c["system"], required=False)
    if system:
        messages.append({"role": "system", "content": system})
    history = _get(record, c["history"])
    if history is not None:
        for i, pair in enumerate(_as_list(history, c["history"])):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
                raise RecordError(f"field {c['history']!r}: item {i} must be a [query, response] pair of strings")
            messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    parts = [_string(record, c["prompt"], required=True), _string(record, c["query"], required=False)]
    messages.append({"role": "user", "content": "\n".join(p for p in parts if p)})
    messages.append({"role": "assistant", "content": _string(record, c["response"], required=True)})
    return _chat(messages, [m["role"] == "assistant" for m in messages], None)


def _sharegpt(record: Mapping[str, Any], fmt: SftFormat) -> Chat:
    c, t = fmt.columns, fmt.tags
    if _get(record, c["messages"]) is None:
        raise RecordError(f"field {c['messages']!r} is missing")
    items = _as_list(record[c["messages"]], c["messages"])
    role_key, content_key = t["role_tag"], t["content_tag"]
    for i, m in enumerate(items):
        if not (isinstance(m, dict) and isinstance(m.get(role_key), str) and isinstance(m.get(content_key), str)):
            raise RecordError(f"field {c['messages']!r}: message {i + 1} must be an object with string "
                              f"{role_key!r} and {content_key!r}")
    system = _string(record, c["system"], required=False)
    if items and t["system_tag"] and items[0][role_key] == t["system_tag"]:
        system, items = items[0][content_key], items[1:]
    odd, even = (t["user_tag"], t["observation_tag"]), (t["assistant_tag"], t["function_tag"])
    for i, m in enumerate(items):
        allowed = odd if i % 2 == 0 else even
        if m[role_key] not in allowed:
            raise RecordError(f"field {c['messages']!r}: message {i + 1} (after any system message) has "
                              f"{role_key} {m[role_key]!r} where {' or '.join(map(repr, allowed))} must be: "
                              f"{t['user_tag']}/{t['observation_tag']} and {t['assistant_tag']}/"
                              f"{t['function_tag']} turns alternate")
    if len(items) % 2:
        raise RecordError(f"field {c['messages']!r} has {len(items)} turns after any system message; it must end "
                          f"with a {t['assistant_tag']!r} or {t['function_tag']!r} turn (an even number)")
    messages = [{"role": "system", "content": system}] if system else []
    for m in items:
        role, content = m[role_key], m[content_key]
        if role == t["function_tag"]:
            messages.append({"role": "assistant", "tool_calls": _function_calls(content, c["messages"])})
        elif role == t["observation_tag"]:
            messages.append({"role": "tool", "content": content})
        else:
            messages.append({"role": "user" if role == t["user_tag"] else "assistant", "content": content})
    images = _images(record, c["images"])
    if images:  # LLaMA-Factory's placeholders become the parts a processor's chat template reads
        found = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))
        _check_image_count(found, images, c["images"], f"image placeholder(s) {IMAGE_PLACEHOLDER}")
        for m in messages:
            if IMAGE_PLACEHOLDER in (m.get("content") or ""):
                m["content"] = _image_parts(m["content"])
    return _chat(messages, [m["role"] == "assistant" for m in messages], _tools(record, c["tools"]), tuple(images))


def _function_calls(content: str, column: str) -> list[dict]:
    try:
        calls = json.loads(content)
    except json.JSONDecodeError as e:
        raise RecordError(f"field {column!r}: a function_call turn must hold JSON {{\"name\", \"arguments\"}} "
                          f"({e.msg})") from None
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(x, dict) and isinstance(x.get("name"), str) for x in calls):
        raise RecordError(f"field {column!r}: a function_call turn must hold {{\"name\", \"arguments\"}} "
                          "objects (or a list of them)")
    return [{"type": "function", "function": {"name": x["name"], "arguments": x.get("arguments", {})}}
            for x in calls]


def _messages(items: Any, column: str) -> tuple[list[dict], list[bool]]:
    messages, train = [], []
    for i, m in enumerate(_as_list(items, column)):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise RecordError(f"field {column!r}: message {i + 1} must be an object with a string 'role'")
        m = {k: v for k, v in m.items() if v is not None}
        weight = m.pop("weight", 1)
        if weight not in (0, 1):
            raise RecordError(f"field {column!r}: message {i + 1} has weight {weight!r}; OpenAI's weight is 0 or 1")
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = _content_parts(content, column, i)
        elif not (isinstance(content, str) or (content is None and m["role"] == "assistant" and m.get("tool_calls"))):
            raise RecordError(f"field {column!r}: message {i + 1} must have a string 'content', a list of "
                              "{type: text, text} / {type: image} parts (or, from the assistant, 'tool_calls')")
        messages.append(m)
        train.append(m["role"] == "assistant" and weight == 1)
    return messages, train


def _content_parts(content: list, column: str, i: int) -> list[dict]:
    """Message ``i``'s list of content parts: text parts and image parts (``{"type": "image"}``,
    with the file, if the part names one, under ``"path"``; nulls dropped, as ``datasets`` fills
    a part's missing keys with them)."""
    parts = []
    for part in content:
        part = _json(part, column)
        part = {k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            path = next((part[k] for k in ("path", "image") if isinstance(part.get(k), str)), None)
            if path is None and any(k in part for k in ("url", "base64", "image")):
                raise RecordError(f"field {column!r}: message {i + 1} has an image part without a local file; give its "
                                  "path as \"path\" or in the images column (nothing is downloaded)")
            parts.append({"type": "image", **({"path": path} if path else {})})
        else:
            raise RecordError(f"field {column!r}: message {i + 1} has a content part {part!r}; expected "
                              "{type: text, text: str} or {type: image}")
    return parts


def _messages_record(record: Mapping[str, Any], fmt: SftFormat) -> Chat:
    c = fmt.columns
    if _get(record, c["messages"]) is None:
        raise RecordError(f"field {c['messages']!r} is missing")
    messages, train = _messages(record[c["messages"]], c["messages"])
    column = _images(record, c["images"])
    parts = [p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if p["type"] == "image"]
    bare = [p for p in parts if "path" not in p]
    _check_image_count(len(bare), column, c["images"], "image part(s) without a path ({type: image})")
    files = iter(column)
    images = tuple(p.pop("path") if "path" in p else next(files) for p in parts)
    return _chat(messages, train, _tools(record, c["tools"]), images)


def _prompt_completion(record: Mapping[str, Any], fmt: SftFormat) -> Chat | Completion:
    c = fmt.columns
    prompt, completion = _get(record, c["prompt"]), _get(record, c["completion"])
    if isinstance(prompt, str) and isinstance(completion, str):
        return Completion(prompt, completion)
    if isinstance(prompt, list) and isinstance(completion, list):
        p_msgs, _ = _messages(prompt, c["prompt"])
        c_msgs, c_train = _messages(completion, c["completion"])
        if any(isinstance(m.get("content"), list) and any(p["type"] == "image" for p in m["content"])
               for m in p_msgs + c_msgs):
            raise RecordError("image parts are read in the sharegpt and messages formats, not prompt/completion: "
                              "give the record as {messages, images}")
        return _chat(p_msgs + c_msgs, [False] * len(p_msgs) + c_train, _tools(record, c["tools"]))
    kinds = [type(v).__name__ if v is not None else "missing" for v in (prompt, completion)]
    raise RecordError(f"fields {c['prompt']!r} and {c['completion']!r} must be two strings or two message "
                      f"lists, got {kinds[0]} and {kinds[1]}")


@dataclass(frozen=True, slots=True)
class FormatSpec:
    """One SFT record format, complete: adding a format is one more of these in :data:`FORMATS`
    (``--sft-format``'s choices, the config's and :data:`SFT_FORMATS` derive from it).

    Attributes:
        name: ``SftFormat.kind`` and the ``--sft-format`` value.
        columns: each role of the format and its default column: LLaMA-Factory's documented defaults
            (data/README.md), with system/history/tools on by default (a column the data lacks is skipped).
        expected: what a record holds, for error messages (``str.format`` over the columns and tags).
        convert: one record of the format to a :class:`Chat` or :class:`Completion`.
        tags: the message keys and role names a format with LLaMA-Factory tags reads (sharegpt), or None.
        formatting: its name as a LLaMA-Factory ``dataset_info.json`` ``formatting``, or None where
            a registry cannot name it.
        message_keys: :func:`detect_format`: the keys of a ``messages``/``conversations`` list's first
            item that make a record this format (empty: not a list format).
        fields: :func:`detect_format`: the fields (non-null) that make a record this format, tried
            after the list formats (empty: none).
    """

    name: str
    columns: Mapping[str, str]
    expected: str
    convert: Callable[[Mapping[str, Any], SftFormat], Chat | Completion]
    tags: Mapping[str, str] | None = None
    formatting: str | None = None
    message_keys: frozenset[str] = frozenset()
    fields: frozenset[str] = frozenset()


FORMATS: dict[str, FormatSpec] = {f.name: f for f in (
    FormatSpec("alpaca", {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                          "history": "history"},
               "alpaca {{{prompt}, {query}?, {response}, {system}?, {history}?: [[query, response], ...]}}",
               _alpaca, formatting="alpaca", fields=frozenset({"instruction", "output"})),
    FormatSpec("sharegpt", {"messages": "conversations", "system": "system", "tools": "tools", "images": "images"},
               ("sharegpt {{{messages}: [{{{role_tag}, {content_tag}}}, ...] with {role_tag} one of "
                "{user_tag}/{assistant_tag}/{observation_tag}/{function_tag}/{system_tag}, {system}?, {tools}?, "
                "{images}?: [image file, ...] (one <image> in the text per file)}}"),
               _sharegpt, tags=_TAGS, formatting="sharegpt", message_keys=frozenset({"from", "value"})),
    FormatSpec("messages", {"messages": "messages", "tools": "tools", "images": "images"},
               ("messages {{{messages}: [{{role, content}}, ...] (content a string or a list of "
                "{{type: text, text}} / {{type: image}} parts), {tools}?, {images}?: [image file, ...]}} "
                "(TRL, OpenAI)"),
               _messages_record, formatting="openai", message_keys=frozenset({"role"})),
    FormatSpec("prompt_completion", {"prompt": "prompt", "completion": "completion", "tools": "tools"},
               "prompt/completion {{{prompt}, {completion}}} (two strings, or two message lists)",
               _prompt_completion, fields=frozenset({"prompt", "completion"})),
)}
"""The SFT record formats, by name, in the order :func:`detect_format` tries them."""

#: The formats :func:`to_example` reads (``--sft-format``; ``auto`` detects one per file).
SFT_FORMATS: tuple[FormatKind, ...] = tuple(FORMATS)
