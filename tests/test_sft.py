"""Supervised fine-tuning data: formats read through ``datasets``, chat templates, truncation that
keeps the answer, the SFT store, packing, the ``dataset_info.json`` registry and mixtures.

References are built by hand from the template's definition: the text of each piece, tokenised on
its own (piece boundaries are pre-token boundaries of the byte-level BPE, which each reference
checks by tokenising the whole text too), context or target as the format documents it.
"""

from __future__ import annotations

import copy
import csv
import functools
import json
import re
import sysconfig
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megatrain
from megatrain.data import (
    EOT_TOKEN,
    IGNORE_INDEX,
    ChatTokenizer,
    SftDataset,
    best_fit_decreasing,
    cached_sft_store,
    pack_documents,
    resolve_sft_data,
    train_bpe_tokenizer,
)
from megatrain.data.sft import Encoded
from megatrain.data.sft_formats import Chat, Completion, RecordError
from megatrain.data.sft_sources import iter_examples

from conftest import tiny_llama
from test_exactness import ADAMW, RTOL, eager_losses

STDLIB = Path(sysconfig.get_paths()["stdlib"])
EOT = EOT_TOKEN
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data"


@pytest.fixture(scope="module")
def tokenizer():
    docs = [(STDLIB / rel).read_text(encoding="utf-8") for rel in ("textwrap.py", "json/decoder.py", "string.py")]
    return train_bpe_tokenizer(docs, vocab_size=400)


@pytest.fixture(scope="module")
def chat(tokenizer) -> ChatTokenizer:
    return ChatTokenizer(tokenizer, None, eos_token=EOT)


def reference(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Token ids and targets of ``(text, is_target)`` pieces, each tokenised on its own."""
    ids: list[int] = []
    targets: list[bool] = []
    for text, target in pieces:
        enc = tokenizer.encode(text, add_special_tokens=False).ids
        ids += enc
        targets += [target] * len(enc)
    assert tokenizer.encode("".join(t for t, _ in pieces), add_special_tokens=False).ids == ids, \
        "a piece boundary inside a pre-token: the reference would not be what the whole text tokenises to"
    return ids, targets


def write(path: Path, records: list[dict], kind: str) -> Path:
    """``records`` as a .json array, .jsonl, .parquet, .csv (list fields as JSON text) or a
    directory saved with save_to_disk."""
    if kind == "json":
        path.write_text(json.dumps(records, indent=1))
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n\n" for r in records))  # blank lines hold no record
    elif kind == "parquet":
        datasets.Dataset.from_list(records).to_parquet(str(path))
    elif kind == "saved":
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    elif kind == "csv":
        with path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(records[0]))
            w.writeheader()
            for r in records:
                w.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})
    return path


def turn(role: str, content: str) -> str:
    return f"<|{role}|>\n{content}{EOT}"


ASSISTANT = "<|assistant|>\n"
TOOL_SPEC = {"name": "calc", "description": "Evaluate.", "parameters": {"type": "object"}}
CALL = {"type": "function", "function": {"name": "calc", "arguments": {"x": "6*7"}}}

# name: (records, hand-made pieces of each record, file kinds)
CASES = {
    "alpaca": (
        [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "system": "Be brief.",
          "history": [["Hi.", "Hello."]]},
         {"instruction": "Say yes.", "input": "", "output": "yes", "system": None, "history": None}],
        [[(turn("system", "Be brief.") + turn("user", "Hi.") + ASSISTANT, False), (f"Hello.{EOT}", True),
          (turn("user", "Add the numbers.\n2 and 3") + ASSISTANT, False), (f"5{EOT}", True)],
         [(turn("user", "Say yes.") + ASSISTANT, False), (f"yes{EOT}", True)]],
        ("json", "jsonl", "parquet", "csv", "saved")),
    "sharegpt": (
        [{"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"},
                            {"from": "human", "value": "And 3+3?"}, {"from": "gpt", "value": "6"}],
          "system": "Be brief.", "tools": None},
         {"conversations": [{"from": "system", "value": "Use tools."}, {"from": "human", "value": "Compute 6*7."},
                            {"from": "function_call", "value": json.dumps(CALL["function"])},
                            {"from": "observation", "value": "42"}, {"from": "gpt", "value": "42"}],
          "system": None, "tools": json.dumps([TOOL_SPEC])}],
        [[(turn("system", "Be brief.") + turn("user", "What is 2+2?") + ASSISTANT, False), (f"4{EOT}", True),
          (turn("user", "And 3+3?") + ASSISTANT, False), (f"6{EOT}", True)],
         [(turn("tools", json.dumps([{"type": "function", "function": TOOL_SPEC}])) + turn("system", "Use tools.")
           + turn("user", "Compute 6*7.") + ASSISTANT, False), (json.dumps([CALL]) + EOT, True),
          (turn("tool", "42") + ASSISTANT, False), (f"42{EOT}", True)]],
        ("json", "jsonl", "parquet", "saved")),
    "messages": (  # OpenAI's weight 0 and TRL's tools column
        [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                       {"role": "assistant", "content": "4", "weight": 0}, {"role": "user", "content": "3+3?"},
                       {"role": "assistant", "content": "6"}], "tools": None},
         {"messages": [{"role": "user", "content": "Compute 6*7."}, {"role": "assistant", "tool_calls": [CALL]},
                       {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}],
          "tools": [{"type": "function", "function": TOOL_SPEC}]}],
        [[(turn("system", "Be brief.") + turn("user", "2+2?") + ASSISTANT + f"4{EOT}" + turn("user", "3+3?")
           + ASSISTANT, False), (f"6{EOT}", True)],
         [(turn("tools", json.dumps([{"type": "function", "function": TOOL_SPEC}])) + turn("user", "Compute 6*7.")
           + ASSISTANT, False), (json.dumps([CALL]) + EOT, True), (turn("tool", "42") + ASSISTANT, False),
          (f"42{EOT}", True)]],
        ("json", "jsonl", "saved")),
    "prompt_completion": (
        [{"prompt": "Q: 2+2?\nA:", "completion": " 4"}, {"prompt": "def add(a, b):", "completion": " return a + b"}],
        [[("Q: 2+2?\nA:", False), (f" 4{EOT}", True)], [("def add(a, b):", False), (f" return a + b{EOT}", True)]],
        ("json", "jsonl", "parquet", "csv", "saved")),
    "conversational_prompt_completion": (  # the prompt's assistant turn is context
        [{"prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                     {"role": "user", "content": "3+3?"}],
          "completion": [{"role": "assistant", "content": "6"}]}],
        [[(turn("user", "2+2?") + ASSISTANT + f"4{EOT}" + turn("user", "3+3?") + ASSISTANT, False),
          (f"6{EOT}", True)]],
        ("json", "jsonl", "parquet")),
}
SUFFIX = {"json": ".json", "jsonl": ".jsonl", "parquet": ".parquet", "csv": ".csv", "saved": ""}


@pytest.mark.parametrize("name,kind", [(n, k) for n, (_, _, kinds) in CASES.items() for k in kinds])
def test_each_format_read_through_datasets_gives_the_hand_made_tokens_and_targets(tmp_path, tokenizer, chat,
                                                                                   name, kind):
    records, pieces, _ = CASES[name]
    path = write(tmp_path / f"data{SUFFIX[kind]}", records, kind)
    (source,) = resolve_sft_data(str(path))  # the format is detected from the first record
    got = [(ex, fmt) for ex, _, fmt in iter_examples(source)]
    assert [fmt for _, fmt in got] == [name.replace("conversational_", "")] * len(records)
    for (example, _), want in zip(got, pieces):
        enc = chat.encode(example)
        ids, targets = reference(tokenizer, want)
        assert enc.ids.tolist() == ids
        assert enc.targets.tolist() == targets


def test_a_multi_turn_chats_labels_cover_exactly_its_assistant_turns(tokenizer, chat):
    messages = [{"role": "system", "content": "S."}]
    for i in range(3):
        messages += [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": f"A{i}."}]
    example = Chat(tuple(messages), tuple(m["role"] == "assistant" for m in messages))
    enc = chat.encode(example)
    decoded = lambda mask: tokenizer.decode(enc.ids[mask].tolist(), skip_special_tokens=False)  # noqa: E731
    assert decoded(enc.targets) == f"A0.{EOT}A1.{EOT}A2.{EOT}"
    assert decoded(~enc.targets) == turn("system", "S.") + "".join(turn("user", f"Q{i}?") + ASSISTANT for i in range(3))
    # loss on the last turn only
    last = ChatTokenizer(tokenizer, None, eos_token=EOT, loss="last").encode(example)
    assert last.ids.tolist() == enc.ids.tolist()
    assert tokenizer.decode(last.ids[last.targets].tolist(), skip_special_tokens=False) == f"A2.{EOT}"
    # the same split through a template without generation markers (prefix differences)
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    plain = ChatTokenizer(tokenizer, chatml, eos_token=EOT).encode(example)
    text = tokenizer.decode(plain.ids.tolist(), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nS.<|im_end|>\n<|im_start|>user\nQ0?")
    assert tokenizer.decode(plain.ids[plain.targets].tolist()) == "A0.<|im_end|>\nA1.<|im_end|>\nA2.<|im_end|>\n"


@pytest.mark.parametrize("template, match", [
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", r"took more than 0.5 s"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{{ 'x' }}{% endfor %}{% endfor %}", r"took more than 0.5 s"),
    ("{% for m in messages %}{{ m['content'] * 3000 }}{% endfor %}", r"rendered 60,000 characters for one record, more "
                                                                     r"than any row megatrain trains holds \(1,000"),
])
def test_a_chat_template_is_bounded_in_time_and_output(tokenizer, monkeypatch, template, match):
    """Issue 44, item 7: a template of nested range(99999) loops never finished (and held the run
    past SIGTERM). Rendering one record is bounded in time and in characters (here lowered to
    0.5 s and 1,000 characters to keep the test short)."""
    from megatrain import bounds

    monkeypatch.setattr(bounds, "TEMPLATE_SECONDS", 0.5)
    monkeypatch.setattr(bounds, "MAX_TEMPLATE_CHARS", 1_000)
    example = Chat(({"role": "user", "content": "Q?????????"}, {"role": "assistant", "content": "A........."}),
                   (False, True))
    t0 = time.perf_counter()
    with pytest.raises(RecordError, match=match):
        ChatTokenizer(tokenizer, template, eos_token=EOT).encode(example)
    assert time.perf_counter() - t0 < 5
    ChatTokenizer(tokenizer, None, eos_token=EOT).encode(example)  # a template that renders in time: no error


def test_templates_that_cannot_be_split_are_errors(tokenizer):
    example = Chat(({"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}), (False, True))
    with pytest.raises(RecordError, match="not a prefix"):
        ChatTokenizer(tokenizer, "{{ messages | length }}", eos_token=EOT).encode(example)
    twice = "{% for m in messages %}|{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    with pytest.raises(RecordError, match=r"marks 2 \{% generation %\} block\(s\) for 1 assistant"):
        ChatTokenizer(tokenizer, twice, eos_token=EOT).encode(example)
    with pytest.raises(RecordError, match="chat template failed: TemplateError: no"):
        ChatTokenizer(tokenizer, "{{ raise_exception('no') }}", eos_token=EOT).encode(example)
    # Issue 44, item 10: the error names the template's file.
    with pytest.raises(RecordError, match=r"the chat template \(runs/t.jinja\) failed: TemplateError: no"):
        ChatTokenizer(tokenizer, "{{ raise_exception('no') }}", eos_token=EOT, template_origin="runs/t.jinja").encode(
            example)


def _long_chat(system_words: int, exchanges: int, answer_words: int = 2) -> Chat:
    messages = [{"role": "system", "content": "rule " * system_words}]
    for i in range(exchanges):
        messages += [{"role": "user", "content": f"question {i} " * 5}, {"role": "assistant", "content": f"old {i}"}]
    messages += [{"role": "user", "content": "last question"},
                 {"role": "assistant", "content": "answer " * answer_words}]
    return Chat(tuple(messages), tuple(m["role"] == "assistant" for m in messages))


def _decode(tokenizer, enc: Encoded, mask=None) -> str:
    ids = enc.ids if mask is None else enc.ids[mask]
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def test_truncation_drops_the_system_then_history_then_tokens_and_keeps_the_last_answer(tokenizer, chat):
    answer = f"{'answer ' * 2}{EOT}"
    tail = turn("user", "last question") + ASSISTANT + answer
    # a long system prompt: dropping it is enough, the history stays
    ex = _long_chat(system_words=200, exchanges=2)
    full = chat.encode(ex)
    no_system = chat.encode(Chat(ex.messages[1:], ex.train[1:]))
    enc, trimmed = chat.fit(ex, len(no_system.ids))
    assert trimmed and len(full.ids) > len(no_system.ids) and enc.ids.tolist() == no_system.ids.tolist()
    # a long history: the oldest exchanges go, as few as needed
    ex = _long_chat(system_words=1, exchanges=6)
    keep_two = chat.encode(Chat(ex.messages[9:], ex.train[9:]))  # exchanges 4 and 5, then the last
    enc, trimmed = chat.fit(ex, len(keep_two.ids))
    assert trimmed and _decode(tokenizer, enc).startswith(turn("user", "question 4 " * 5))
    assert _decode(tokenizer, enc, enc.targets) == f"old 4{EOT}old 5{EOT}{answer}"
    # still too long with only the last exchange: its first tokens go, never the answer's
    ex = _long_chat(system_words=1, exchanges=1)
    last = chat.encode(Chat(ex.messages[3:], ex.train[3:]))
    seq_len = len(reference(tokenizer, [(ASSISTANT, False), (answer, True)])[0]) + 1
    enc, trimmed = chat.fit(ex, seq_len)
    assert trimmed and len(enc.ids) == seq_len and enc.ids.tolist() == last.ids[-seq_len:].tolist()
    assert _decode(tokenizer, enc).endswith(ASSISTANT + answer) and _decode(tokenizer, enc, enc.targets) == answer
    assert tail.endswith(_decode(tokenizer, enc))
    # the answer alone does not fit with one token of context: dropped
    assert chat.fit(ex, seq_len - 1 - len(tokenizer.encode(ASSISTANT).ids)) == (None, False)
    # truncation "drop" drops whatever does not fit; what fits is untouched
    assert chat.fit(ex, len(chat.encode(ex).ids) - 1, "drop") == (None, False)
    enc, trimmed = chat.fit(ex, len(chat.encode(ex).ids), "drop")
    assert not trimmed and enc.ids.tolist() == chat.encode(ex).ids.tolist()
    # a completion loses the start of its prompt
    enc, trimmed = chat.fit(Completion("word " * 40, " done"), 8)
    assert trimmed and len(enc.ids) == 8 and _decode(tokenizer, enc, enc.targets) == f" done{EOT}"


def test_the_store_counts_trimmed_and_dropped_and_batches_carry_the_targets(tmp_path, tokenizer, chat):
    records = [{"instruction": f"Say {i}.", "input": "", "output": str(i)} for i in range(10)]
    records[3]["system"] = "rule " * 100          # trimmed: the system message goes
    records[5]["output"] = "answer " * 100        # dropped: the answer alone is longer than seq_len
    path = write(tmp_path / "a.jsonl", records, "jsonl")
    sources = resolve_sft_data(str(path))
    store = cached_sft_store(sources, chat, tmp_path / "store", seq_len=48, progress=False)
    (info,) = store.manifest.datasets
    assert (info.examples, info.trimmed, info.dropped, info.format) == (9, 1, 1, "alpaca")
    kept = [r for i, r in enumerate(records) if i != 5]
    for i, r in enumerate(kept):
        a, b = store.tokens.offsets[i], store.tokens.offsets[i + 1]
        ids, targets = reference(tokenizer, [(turn("user", r["instruction"]) + ASSISTANT, False),
                                             (r["output"] + EOT, True)])
        assert store.tokens.tokens[a:b].tolist() == ids and store.targets[a:b].astype(bool).tolist() == targets
    for packing in (True, False):
        ds = SftDataset(store, 48, packing=packing, val_fraction=0.2, seed=0)
        batch = ds.rows(range(ds.num_train_rows))
        labels = batch["labels"]
        want = sum(len(tokenizer.encode(kept[e]["output"] + EOT).ids) for e in ds.train_examples)
        assert int((labels != IGNORE_INDEX).sum()) == want
        targets = set(tokenizer.decode([t], skip_special_tokens=False) for t in labels[labels != IGNORE_INDEX].tolist())
        assert targets <= set("0123456789") | {EOT}
        assert set(batch) == set(ds.input_names)
    # the same sources and options reuse the store; another seq_len rebuilds it
    again = cached_sft_store(sources, chat, tmp_path / "store", seq_len=48, progress=False)
    assert again.origin == "reused" and again.manifest == store.manifest
    assert cached_sft_store(sources, chat, tmp_path / "store", seq_len=40, progress=False).origin == \
        "rebuilt (options changed)"


def test_a_corrupt_store_is_rebuilt_never_used(tmp_path, chat):
    sources = resolve_sft_data(str(write(tmp_path / "a.jsonl", CASES["alpaca"][0], "jsonl")))
    store = cached_sft_store(sources, chat, tmp_path / "store", seq_len=64, progress=False)
    good = store.targets.copy()
    store.close()
    t = tmp_path / "store" / "targets.bin"
    t.write_bytes(bytes([1 - t.read_bytes()[0]]) + t.read_bytes()[1:])
    again = cached_sft_store(sources, chat, tmp_path / "store", seq_len=64, progress=False)
    assert again.origin.startswith("rebuilt (corrupt:") and "targets.bin does not match" in again.origin
    assert np.array_equal(again.targets, good)


def test_packed_rows_train_exactly_like_the_same_examples_one_per_row(tmp_path, tokenizer, chat):
    """FP32, one micro-batch holding every row: the loss is the mean over the same supervised
    tokens, and per-example attention (position_ids restarting) computes what padding computes."""
    rng = np.random.default_rng(0)
    words = ["def", "return", "value", "x", "list", "index", "loop"]
    records = [{"instruction": " ".join(rng.choice(words, rng.integers(1, 5))), "input": "",
                "output": " ".join(rng.choice(words, rng.integers(1, 4)))} for _ in range(9)]
    store = cached_sft_store(resolve_sft_data(str(write(tmp_path / "a.json", records, "json"))), chat,
                             tmp_path / "store", seq_len=64, progress=False)
    packed = SftDataset(store, 64, packing=True, val_fraction=0.1)
    padded = SftDataset(store, 64, packing=False, val_fraction=0.1)
    assert packed.num_train_rows < padded.num_train_rows == 8
    p_batch, d_batch = packed.rows(range(packed.num_train_rows)), padded.rows(range(padded.num_train_rows))
    assert int((p_batch["labels"] != IGNORE_INDEX).sum()) == int((d_batch["labels"] != IGNORE_INDEX).sum())
    torch.manual_seed(0)
    model = tiny_llama(vocab=tokenizer.get_vocab_size())
    ref = copy.deepcopy(model)
    ref.forward = functools.partial(ref.forward, use_cache=False)  # as eager training runs it
    opt = ADAMW
    trainer = megatrain.compile(model, seq_len=64, micro_batch_size=packed.num_train_rows, optimizer=opt,
                                input_names=packed.input_names)
    got = [trainer.step(p_batch).loss for _ in range(3)]
    want = eager_losses(ref, [d_batch] * 3, 1, adamw=opt)
    for a, b in zip(got, want):
        assert abs(a - b) <= RTOL * abs(b), (got, want)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert ((p - q).norm() / q.norm()).item() <= RTOL, name


def test_packed_rows_restart_positions_at_each_example(tmp_path, chat):
    records = [{"instruction": "x " * n, "input": "", "output": "y"} for n in (1, 3, 5, 7, 9, 11)]
    store = cached_sft_store(resolve_sft_data(str(write(tmp_path / "a.jsonl", records, "jsonl"))), chat,
                             tmp_path / "store", seq_len=64, progress=False)
    ds = SftDataset(store, 64, val_fraction=0.2)
    lengths = np.diff(store.tokens.offsets)
    segments = []
    for r in range(ds.num_train_rows):
        batch = ds.rows([r])
        pos, labels, ids = batch["position_ids"][0], batch["labels"][0], batch["input_ids"][0]
        starts = torch.nonzero(pos == 0).flatten().tolist() + [64]
        assert pos.tolist() == [t - max(s for s in starts if s <= t) for t in range(64)]
        assert all(labels[s] == IGNORE_INDEX for s in starts[:-1])
        used = int((labels != IGNORE_INDEX).nonzero().max()) + 1
        assert all(ids[used:] == store.tokens.eot_id)  # the padding after the last example
        segments += [b - a for a, b in zip(starts, starts[1:]) if b <= used or a < used]
    assert sorted(segments) == sorted(int(lengths[e]) for e in ds.train_examples)


def _bfd_reference(lengths, capacity):
    bins, free = [], []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        fits = [b for b in range(len(bins)) if free[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (free[b], b))
        else:
            b = len(bins)
            bins.append([])
            free.append(capacity)
        bins[b].append(i)
        free[b] -= lengths[i]
    return bins


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40).flatmap(lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), max_size=60))))
def test_best_fit_decreasing_is_the_textbook_rule(case):
    capacity, lengths = case
    assert best_fit_decreasing(lengths, capacity) == _bfd_reference(lengths, capacity)


def test_best_fit_decreasing_refuses_items_that_do_not_fit():
    with pytest.raises(ValueError, match=r"item 1 has length 9, not in \[1, capacity=8\]"):
        best_fit_decreasing([3, 9], 8)
    # pack_documents keeps its rule on top of it: fewer rows than one per document
    rows = pack_documents([np.arange(1, 4)] * 5, 8, eot_id=0)
    assert rows.input_ids.shape == (3, 8)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("kind,text,match", [
    ("jsonl", '{"instruction": "a", "output": "b"}\n\n{"instruction": "a"}\n',
     r"a\.jsonl', record 2 \(line 3\): field 'output' must be a string, got missing; expected alpaca "
     r"\{instruction, input\?, output"),
    ("jsonl", '{"instruction": "a", "output": "b"}\n{oops\n', r"a\.jsonl', line 2: not valid JSON"),
    ("json", '[{"instruction": "a", "output": "b"},\n {"instruction": "a" "output": "b"}]',
     r"a\.json', line 2 column \d+: not valid JSON"),
    ("jsonl", '{"text": "just text"}\n', r"a\.jsonl', record 1 \(line 1\): fields \['text'\] match no SFT format; "
     r"expected one of: alpaca .*sharegpt .*messages .*prompt/completion"),
    ("jsonl", '{"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}\n',
     r"record 1 \(line 1\): field 'conversations': message 2 .* has from 'human' where 'gpt' or 'function_call'"),
    ("jsonl", '{"messages": [{"role": "user", "content": "a"}]}\n',
     r"record 1 \(line 1\): the chat has no assistant message"),
    ("json", '[{"prompt": "a", "completion": ["b"]}]', r"a\.json', record 1: fields 'prompt' and 'completion' must "
     r"be two strings or two message lists, got str and list"),
])
def test_a_malformed_record_is_one_error_naming_the_file_and_record(tmp_path, chat, kind, text, match):
    path = tmp_path / f"a.{kind}"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        cached_sft_store(resolve_sft_data(str(path)), chat, tmp_path / "store", seq_len=64, progress=False)
    assert not (tmp_path / "store").exists()  # a failed build leaves nothing behind


# ---------------------------------------------------------------- the registry and mixtures


def _registry(tmp_path: Path, entries: dict) -> Path:
    d = tmp_path / "reg"
    d.mkdir(exist_ok=True)
    (d / "dataset_info.json").write_text(json.dumps(entries))
    return d


def test_a_registry_resolves_names_files_formatting_columns_and_tags(tmp_path, chat, tokenizer):
    d = tmp_path / "reg"
    d.mkdir()
    write(d / "qa.csv", [{"question": "2+2?", "answer": "4", "ctx": "Be brief."}], "csv")
    write(d / "chats.jsonl", [{"dialog": [{"who": "me", "text": "Hi."}, {"who": "bot", "text": "Hello."}]}], "jsonl")
    (d / "parts").mkdir()
    for i in range(2):
        write(d / "parts" / f"{i}.jsonl", [{"instruction": f"Say {i}.", "output": str(i)}], "jsonl")
    _registry(tmp_path, {
        "qa": {"file_name": "qa.csv", "columns": {"prompt": "question", "response": "answer", "system": "ctx"}},
        "chats": {"file_name": "chats.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"},
                  "tags": {"role_tag": "who", "content_tag": "text", "user_tag": "me", "assistant_tag": "bot"}},
        "parts": {"file_name": "parts", "num_samples": 5},
        "hub": {"hf_hub_url": "org/set"},
        "pairs": {"file_name": "qa.csv", "ranking": True},
    })
    qa, chats, parts = resolve_sft_data(f"qa:2,chats,parts@{d}")
    assert (qa.weight, chats.weight, parts.num_samples, len(parts.files)) == (2.0, None, 5, 2)
    texts = [_decode(tokenizer, chat.encode(ex)) for s in (qa, chats, parts) for ex, _, _ in iter_examples(s)]
    assert texts == [turn("system", "Be brief.") + turn("user", "2+2?") + ASSISTANT + f"4{EOT}",
                     turn("user", "Hi.") + ASSISTANT + f"Hello.{EOT}",
                     turn("user", "Say 0.") + ASSISTANT + f"0{EOT}", turn("user", "Say 1.") + ASSISTANT + f"1{EOT}"]
    for spec, match in [
        (f"hub@{d}", r"dataset 'hub' is only on a hub or remote store \(hf_hub_url: 'org/set'\), and megatrain "
                     r"downloads nothing at run time: download it once"),
        (str(d), r"dataset 'hub' is only on a hub .*; or name only the local datasets: --data NAME,NAME@"),
        (f"pairs@{d}", r"'pairs' is preference data \(ranking: true\)"),
        (f"nope@{d}", r"dataset 'nope' is not in .*dataset_info.json' \(it lists: chats, hub, pairs, parts, qa\)"),
        (f"qa:x@{d}", r"'qa:x' has weight 'x', not a number"),
        (f"qa:-1@{d}", r"the weight of 'qa' must be a positive number"),
        ("missing.jsonl", r"SFT data 'missing.jsonl' does not exist"),
    ]:
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            resolve_sft_data(spec)
    with pytest.raises(ValueError, match="drop --sft-format"):
        resolve_sft_data(f"qa@{d}", sft_format="alpaca")
    bad = _registry(tmp_path, {"x": {"file_name": "qa.csv", "columns": {"promt": "q"}}})
    with pytest.raises(ValueError, match=r"columns \['promt'\] are not LLaMA-Factory columns"):
        resolve_sft_data(f"x@{bad}")
    bad = _registry(tmp_path, {"x": {"file_name": "qa.csv", "formatting": "sharegpt", "tags": {"rol_tag": "r"}}})
    with pytest.raises(ValueError, match=r"tags \['rol_tag'\] are not LLaMA-Factory tags"):
        resolve_sft_data(f"x@{bad}")
    bad = _registry(tmp_path, {"x": {"file_name": "qa.csv", "formatting": "openai", "tags": {"role_tag": "from"}}})
    with pytest.raises(ValueError, match="for other tags use formatting sharegpt"):
        resolve_sft_data(f"x@{bad}")


def test_a_registry_reads_nothing_outside_its_directory(tmp_path):
    """Issue 44, item 2: a ``file_name`` that climbs out (``..``), is absolute (``/``: a file at the
    root of the file system was read) or is a symlink to outside, and a symlinked file in a
    directory entry, are refused naming where they resolve; the same file given on the command
    line trains."""
    from megatrain.files import UnsafeFileError

    outside = tmp_path / "outside"
    outside.mkdir()
    record = [{"instruction": "Say 1.", "output": "1"}]
    write(outside / "x.json", record, "json")
    d = _registry(tmp_path, {})
    (d / "link.json").symlink_to(outside / "x.json")
    (d / "parts").mkdir()
    write(d / "parts" / "0.json", record, "json")
    (d / "parts" / "1.json").symlink_to(outside / "x.json")
    write(d / "in.json", record, "json")
    _registry(tmp_path, {"up": {"file_name": "../outside/x.json"}, "root": {"file_name": "/"},
                         "link": {"file_name": "link.json"}, "parts": {"file_name": "parts"},
                         "in": {"file_name": "in.json"}})
    for name, resolves in [("up", outside / "x.json"), ("root", Path("/")), ("link", outside / "x.json"),
                           ("parts", outside / "x.json")]:
        with pytest.raises(UnsafeFileError, match=rf"dataset '{name}': file(_name)?: '.*' resolves to "
                                                  rf"{re.escape(str(resolves.resolve()))}, outside .*reg'.*--data PATH"):
            resolve_sft_data(f"{name}@{d}")
    assert [s.name for s in resolve_sft_data(f"in@{d}")] == ["in"]
    (src,) = resolve_sft_data(str(outside / "x.json"))  # named by the user: read
    assert len(list(iter_examples(src))) == 1


def test_a_saved_dataset_dict_and_its_split(tmp_path, chat):
    records = CASES["messages"][0][:1]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records),
                          "extra": datasets.Dataset.from_list(records * 2)}).save_to_disk(str(tmp_path / "reg/saved"))
    _registry(tmp_path, {"dev": {"file_name": "saved", "formatting": "openai", "split": "extra"}})
    (src,) = resolve_sft_data(f"dev@{tmp_path / 'reg'}")
    assert len(list(iter_examples(src))) == 2
    (src,) = resolve_sft_data(str(tmp_path / "reg/saved"))
    assert len(list(iter_examples(src))) == 1  # a saved directory alone: its train split


def test_mixing_weights_and_num_samples_set_each_datasets_share_of_an_epoch(tmp_path, chat):
    a = write(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "completion": " x"} for i in range(30)], "jsonl")
    b = write(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "completion": " y"} for i in range(10)], "jsonl")
    sources = resolve_sft_data(f"{a}:1,{b}:3")
    store = cached_sft_store(sources, chat, tmp_path / "store", seq_len=16, progress=False)

    def share(ds):
        first_b = store.manifest.datasets[0].examples
        return int((ds.train_examples < first_b).sum()), int((ds.train_examples >= first_b).sum())

    plain = SftDataset(store, 16, val_fraction=0.1)  # 4 held out, the rest once each
    val_b = int((plain.val_examples >= 30).sum())
    assert share(plain) == (30 - (4 - val_b), 10 - val_b)
    mixed = SftDataset(store, 16, val_fraction=0.1, weights=[s.weight for s in sources])
    assert share(mixed) == (9, 27)  # 36 examples in the proportion 1:3; b's are repeated
    assert len(set(mixed.train_examples[mixed.train_examples >= 30].tolist())) == share(plain)[1]
    sampled = SftDataset(store, 16, val_fraction=0.1, num_samples=[5, None])
    assert share(sampled)[0] == 5 and sampled.fingerprint() != plain.fingerprint()
    # the same settings give the same batches; a resumed run continues where it stopped
    whole = [b for _, b in zip(range(12), mixed.batches(2, seed=3))]
    tail = [b for _, b in zip(range(7), SftDataset(store, 16, val_fraction=0.1, weights=[1.0, 3.0])
                                     .batches(2, seed=3, start=5))]
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(tail, whole[5:]))
    with pytest.raises(ValueError, match="too small for one batch"):
        mixed.batches(10**6)


def test_the_row_layout_does_not_grow_with_the_examples_tokens(tmp_path, chat):
    """Host memory: the dataset holds a few integers per example; tokens stay in the store's maps."""
    sizes = []
    for words in (1, 20):
        records = [{"prompt": "word " * words + str(i), "completion": " z"} for i in range(50)]
        path = write(tmp_path / f"a{words}.jsonl", records, "jsonl")
        store = cached_sft_store(resolve_sft_data(str(path)), chat, tmp_path / f"s{words}", seq_len=64,
                                 progress=False)
        ds = SftDataset(store, 64, packing=False)
        arrays = [v for v in vars(ds).values() if isinstance(v, np.ndarray)]
        arrays += [a for v in vars(ds).values() if isinstance(v, tuple) for a in v if isinstance(a, np.ndarray)]
        sizes.append((store.tokens.num_tokens, sum(a.nbytes for a in arrays)))
    assert sizes[1][0] > 5 * sizes[0][0] and sizes[1][1] == sizes[0][1] <= 48 * 50


# ---------------------------------------------------------------- the bundled examples


def _readme_sft_commands() -> list[str]:
    from conftest import manual_section

    section = manual_section("Fine-tuning data (`--task sft`)")
    return [line for line in section.splitlines() if "megatrain train" in line and "--data" in line]


def test_every_readme_sft_example_reads_its_bundled_data(monkeypatch, chat):
    monkeypatch.chdir(EXAMPLES.parent.parent)  # the commands run from the repository's root
    commands = _readme_sft_commands()
    formats = set()
    for command in commands:
        flags = dict(re.findall(r"--([\w-]+) (\S+)", command))
        sources = resolve_sft_data(flags["data"], sft_format=flags.get("sft-format", "auto"))
        for source in sources:
            assert all(Path(f).exists() for f in source.files), source
            formats |= {fmt for _, _, fmt in iter_examples(source)}
    assert formats == {"alpaca", "sharegpt", "messages", "prompt_completion"}
    assert len(commands) >= 7


def test_the_runs_chat_template_and_relative_data_specs(tmp_path):
    from types import SimpleNamespace

    from megatrain.train import load_train_config
    from megatrain.train.corpus import run_chat_template

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    cfg = load_train_config(None, {"model": "m", "output_dir": "o", "tokenizer": str(tok / "tokenizer.json")})
    nowhere = SimpleNamespace(directory=None)
    assert run_chat_template(cfg, nowhere) == ("D", str(tok / "tokenizer_config.json"))  # the named default
    (tok / "chat_template.jinja").write_text("J")  # transformers' own file wins
    assert run_chat_template(cfg, nowhere) == ("J", str(tok / "chat_template.jinja"))
    (tmp_path / "mine.jinja").write_text("M")
    run = tmp_path / "run.yaml"
    run.write_text("model: m\noutput_dir: o\ntask: sft\nchat_template: mine.jinja\ndata: a,b:2@data\n")
    cfg = load_train_config(run)
    assert run_chat_template(cfg, nowhere) == ("M", str(tmp_path / "mine.jinja"))  # relative to the file
    assert cfg.data == f"a,b:2@{tmp_path / 'data'}"
    run.write_text("model: m\noutput_dir: o\ntask: sft\ndata: x.json:2,y.jsonl\n")
    assert load_train_config(run).data == f"{tmp_path / 'x.json'}:2,{tmp_path / 'y.jsonl'}"
    assert run_chat_template(load_train_config(None, {"model": "m", "output_dir": "o"}), nowhere) == (None, None)
