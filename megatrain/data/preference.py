"""Preference data (``megatrain train --task dpo``): each record becomes a pair of examples, the
chosen and the rejected response to one prompt, read through ``datasets`` as SFT data is
(:mod:`megatrain.data.sft_sources`) and converted by the SFT formats' own readers
(:mod:`megatrain.data.sft_formats`), so that a chosen or rejected response is tokenised exactly as
the same record's answer would be for SFT (``apply_chat_template``, targets only on the response).

Formats, as their tools document them:

``trl`` (TRL's preference datasets, ``docs/source/dataset_formats.md``)
    ``{"prompt", "chosen", "rejected"}``: three strings (standard: ``prompt + chosen`` and
    ``prompt + rejected`` plus an end-of-text token, no template), or three message lists
    (conversational: the prompt's messages, then the chosen or rejected assistant messages); or,
    without ``prompt`` (TRL's implicit prompt), ``chosen`` and ``rejected`` whole conversations
    whose longest common prefix of messages is the prompt (TRL's ``extract_prompt``).
``alpaca`` (LLaMA-Factory ranking, ``data/README.md``)
    ``{"instruction", "input"?, "chosen", "rejected", "system"?, "history"?}`` with ``chosen`` and
    ``rejected`` strings.
``sharegpt`` (LLaMA-Factory ranking)
    ``{"conversations": [...], "chosen": {"from", "value"}, "rejected": {"from", "value"},
    "system"?, "tools"?}``: the conversation ends with a human turn; chosen and rejected are the
    gpt (or function_call) turn after it.

A ``dataset_info.json`` entry with ``"ranking": true`` is LLaMA-Factory preference data: its
``formatting`` (alpaca, the default, or sharegpt), ``columns`` (``prompt``, ``query``, ``chosen``,
``rejected``, ``system``, ``history``, ``messages``, ``tools``) and ``tags`` name the fields. A file
is read as the format its first record has (``chosen`` and ``rejected`` with ``instruction``:
alpaca; with ``conversations`` of ``from``/``value`` turns: sharegpt; otherwise trl).

Only the last assistant turn of each side is a target (the DPO loss compares the two responses;
earlier turns are the same in both). A record without a chosen or rejected response, with an empty
one (nothing but whitespace), or whose two sides do not share their context is a
:class:`~megatrain.data.sft_formats.RecordError` naming the file and record.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatrain.data.sft_formats import Chat, Completion, RecordError, SftFormat, to_example
from megatrain.data.sft_sources import (REGISTRY_FILE, SftSource, entry_path, entry_source, iter_rows, read_registry,
                                        record_where, resolve_sft_data)

__all__ = ["PREFERENCE_FORMATS", "PreferenceFormat", "detect_preference_format", "iter_pairs",
           "resolve_preference_data", "to_pair"]

PreferenceKind = Literal["trl", "alpaca", "sharegpt"]
PREFERENCE_FORMATS: tuple[PreferenceKind, ...] = ("trl", "alpaca", "sharegpt")

_COLUMNS = {
    "trl": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
    "alpaca": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected",
               "system": "system", "history": "history"},
    "sharegpt": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "system": "system",
                 "tools": "tools"},
}
_EXPECTED = {
    "trl": "TRL preference {prompt?, chosen, rejected} (three strings, three message lists, or chosen/rejected "
           "whole conversations)",
    "alpaca": "LLaMA-Factory alpaca ranking {instruction, input?, chosen, rejected, system?, history?}",
    "sharegpt": "LLaMA-Factory sharegpt ranking {conversations: [...ending with a human turn], chosen: "
                "{from: gpt, value}, rejected: {from: gpt, value}, system?, tools?}",
}


@dataclass(frozen=True, slots=True)
class PreferenceFormat:
    """A preference record format and where its fields are (``columns``: role -> column name;
    ``tags``: sharegpt's message keys and roles, as :class:`~megatrain.data.sft_formats.SftFormat`)."""

    kind: PreferenceKind
    columns: Mapping[str, str | None] = field(default_factory=dict)
    tags: Mapping[str, str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in PREFERENCE_FORMATS:
            raise ValueError(f"unknown preference format {self.kind!r}; expected one of {PREFERENCE_FORMATS}")
        object.__setattr__(self, "columns", {**_COLUMNS[self.kind], **self.columns})

    @classmethod
    def from_registry(cls, entry: Mapping[str, Any], where: str) -> PreferenceFormat:
        """The format of a LLaMA-Factory ``dataset_info.json`` entry with ``"ranking": true``.

        Raises:
            ValueError: not a ranking entry; a formatting other than alpaca or sharegpt; columns
                or tags that are not objects of strings (naming ``where``).
        """
        if not entry.get("ranking"):
            raise ValueError(f"{where} is not preference data (no \"ranking\": true); --task dpo reads chosen and "
                             "rejected responses")
        formatting = entry.get("formatting", "alpaca")
        if formatting not in ("alpaca", "sharegpt"):
            raise ValueError(f"{where}: ranking data with formatting {formatting!r}; LLaMA-Factory's ranking "
                             "formats are alpaca and sharegpt")
        maps = {}
        for key in ("columns", "tags"):
            value = entry.get(key, {})
            if not isinstance(value, dict) or not all(v is None or isinstance(v, str) for v in value.values()):
                raise ValueError(f"{where}: {key!r} must be an object of column names, got {value!r}")
            maps[key] = value
        unknown = sorted(set(maps["columns"]) - set(_COLUMNS[formatting]) - {"images", "videos", "audios"})
        if unknown:
            raise ValueError(f"{where}: columns {unknown} are not read by ranking data of formatting {formatting} "
                             f"(it reads {sorted(_COLUMNS[formatting])})")
        if used := sorted(k for k in ("images", "videos", "audios") if maps["columns"].get(k)):
            raise ValueError(f"{where}: multimodal columns {used} are not supported for preference data")
        return cls(formatting, maps["columns"], maps["tags"])

    def expected(self) -> str:
        return _EXPECTED[self.kind]

    def describe(self) -> dict:
        return {"kind": self.kind, "columns": dict(self.columns), "tags": dict(self.tags)}


def detect_preference_format(record: Mapping[str, Any]) -> PreferenceFormat:
    """The format of ``record`` (module docstring).

    Raises:
        RecordError: neither a ``chosen`` nor a ``rejected`` field (one without the other is
            :func:`to_pair`'s error, naming the missing one).
    """
    present = {k for k, v in record.items() if v is not None}
    if not {"chosen", "rejected"} & present:
        raise RecordError(f"fields {sorted(present)} hold no 'chosen' and 'rejected' responses; expected one of: "
                          + "; ".join(_EXPECTED.values()))
    if "instruction" in present:
        return PreferenceFormat("alpaca")
    conv = record.get("conversations")
    if conv is not None:
        return PreferenceFormat("sharegpt")
    return PreferenceFormat("trl")


def _side(record: Mapping[str, Any], column: str | None, side: str) -> Any:
    value = record.get(column) if column else None
    if value is None:
        raise RecordError(f"field {column!r} (the {side} response) is missing")
    if isinstance(value, str) and value[:1] in ("[", "{"):
        try:
            value = json.loads(value)  # a CSV cell holds a list as text
        except json.JSONDecodeError:
            pass
    return value


def _text(value: Any) -> str:
    """The text of a response: a string, a message's content or value, or a list of messages'."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content", value.get("value"))
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        return content if isinstance(content, str) else ("x" if value.get("tool_calls") else "")
    if isinstance(value, list):
        return "".join(_text(m) for m in value)
    return ""


def _check_nonempty(value: Any, column: str | None, side: str) -> None:
    if not _text(value).strip():
        raise RecordError(f"field {column!r}: the {side} response is empty; a DPO pair compares two responses, "
                          "each with at least one token besides the end of text: drop the record or fill it in")


def to_pair(record: Mapping[str, Any], fmt: PreferenceFormat) -> tuple[Chat | Completion, Chat | Completion]:
    """``(chosen, rejected)`` examples of one preference record (module docstring), each what the
    SFT readers make of the prompt and that response.

    Raises:
        RecordError: a response is missing or empty; fields of the wrong type; TRL's implicit-prompt
            conversations with no common prefix (naming the field and the fields ``fmt`` expects).
    """
    try:
        return _to_pair(record, fmt)
    except RecordError as e:
        raise RecordError(f"{e}; expected {fmt.expected()}") from None


def _to_pair(record, fmt):
    c = fmt.columns
    chosen, rejected = _side(record, c["chosen"], "chosen"), _side(record, c["rejected"], "rejected")
    _check_nonempty(chosen, c["chosen"], "chosen")
    _check_nonempty(rejected, c["rejected"], "rejected")
    if fmt.kind == "alpaca":
        sft = SftFormat("alpaca", {"prompt": c["prompt"], "query": c.get("query"), "response": "__response",
                                   "system": c.get("system"), "history": c.get("history")})
        return tuple(to_example({**record, "__response": side}, sft) for side in (chosen, rejected))
    if fmt.kind == "sharegpt":
        sft = SftFormat("sharegpt", {"messages": "__conversation", "system": c.get("system"),
                                     "tools": c.get("tools"), "images": None}, fmt.tags)
        conv = record.get(c["messages"])
        if isinstance(conv, str):
            conv = json.loads(conv)
        if not isinstance(conv, list):
            raise RecordError(f"field {c['messages']!r} must be a list of turns")
        for side, name in ((chosen, c["chosen"]), (rejected, c["rejected"])):
            if not isinstance(side, Mapping):
                raise RecordError(f"field {name!r} must be one turn {{from, value}} (the response after the "
                                  "conversation)")
        return tuple(to_example({**record, "__conversation": [*conv, dict(side)]}, sft) for side in (chosen, rejected))
    prompt = record.get(c["prompt"]) if c.get("prompt") else None
    pc = SftFormat("prompt_completion", {"prompt": "__prompt", "completion": "__completion", "tools": "tools"})
    if prompt is None:  # TRL's implicit prompt: the common prefix of the two conversations
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise RecordError(f"no {c['prompt']!r} field: chosen and rejected must then be whole conversations "
                              "(message lists) sharing their prompt, as TRL's implicit-prompt format")
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if n == 0:
            raise RecordError("chosen and rejected conversations share no leading message, so there is no prompt "
                              "(TRL's extract_prompt finds none); give a 'prompt' field")
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        _check_nonempty(chosen, c["chosen"], "chosen")
        _check_nonempty(rejected, c["rejected"], "rejected")
    return tuple(to_example({**record, "__prompt": prompt, "__completion": side}, pc) for side in (chosen, rejected))


def resolve_preference_data(data: str) -> list[SftSource]:
    """The preference datasets ``data`` names: files, saved datasets and directories as
    :func:`~megatrain.data.sft_sources.resolve_sft_data` resolves them, or a ``dataset_info.json``
    registry's ``"ranking": true`` entries (``DIR``: all of them; ``NAME,NAME@DIR``: those named).
    Each source's ``format`` is a :class:`PreferenceFormat` (None: detected from its first record).

    Raises:
        FileNotFoundError: a path or a registry's ``file_name`` does not exist.
        ValueError: an entry that is not ranking data or has an unknown formatting or columns; a
            hub-only entry; weights (``a:2``: mixing is for SFT data).
    """
    names, at, directory = data.rpartition("@")
    registry = Path(directory if at else data)
    if not at and not (registry.is_dir() and (registry / REGISTRY_FILE).is_file()):
        if any(":" in item and not Path(item).exists() for item in data.split(",")):
            raise ValueError(f"data {data!r}: mixing weights (NAME:W) apply to SFT data, not preference data")
        return resolve_sft_data(data)
    f = registry / REGISTRY_FILE
    info = read_registry(registry)
    wanted = [n.strip() for n in names.split(",")] if at else [k for k, v in info.items() if v.get("ranking")]
    if not wanted:
        raise ValueError(f"{str(f)!r} has no preference entries (\"ranking\": true) for --task dpo")
    out = []
    for name in wanted:
        if name not in info:
            raise ValueError(f"dataset {name!r} is not in {str(f)!r} (it lists: {', '.join(sorted(info))})")
        entry, where = info[name], f"{str(f)!r}, dataset {name!r}"
        fmt = PreferenceFormat.from_registry(entry, where)
        file_name = entry.get("file_name")
        if not isinstance(file_name, str) or not file_name:
            raise ValueError(f"{where} has no file_name (a local file or directory): megatrain downloads nothing "
                             "at run time")
        path = entry_path(registry, file_name, where)  # inside the registry's directory (issue 44)
        out.append(entry_source(registry, name, path, where, fmt, split=entry.get("split", "train")))
    return out


def iter_pairs(source: SftSource) -> Iterator[tuple[Chat | Completion, Chat | Completion, Callable[[], str]]]:
    """``(chosen, rejected, where)`` for each record of ``source`` in file order (``where()`` names
    the record).

    Raises:
        ValueError: a file ``datasets`` cannot read; a record that is no preference pair
            (:class:`~megatrain.data.sft_formats.RecordError` naming the file and record); no record.
    """
    fmt = source.format if isinstance(source.format, PreferenceFormat) else None
    n = 0
    for path, i, row in iter_rows(source):
        try:
            if fmt is None:
                fmt = detect_preference_format(row)
            chosen, rejected = to_pair(row, fmt)
        except RecordError as e:
            raise RecordError(f"{record_where(path, i)}: {e}") from None
        n += 1
        yield chosen, rejected, (lambda p=path, k=i: record_where(p, k))
    if n == 0:
        raise ValueError(f"preference dataset {source.name!r} holds no records")
