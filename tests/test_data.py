"""Tests for megatrain.data: loading, BPE tokenizer, encoding, windows and batches.

Corpora are built in tmp_path from real standard-library files, so no expected
outputs are hard-coded: the tests check properties that hold for any text.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrain.data import (
    DEFAULT_MAX_BYTES,
    EOT_TOKEN,
    TokenDataset,
    default_corpus_dir,
    encode_documents,
    load_documents,
    load_tokenizer,
    prepare_lm_data,
    train_bpe_tokenizer,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = ["textwrap.py", "json/__init__.py", "json/decoder.py", "string.py", "shlex.py"]


def _read(rel: str) -> str:
    return (STDLIB / rel).read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def real_docs() -> list[str]:
    return [_read(rel) for rel in SOURCES]


@pytest.fixture(scope="module")
def tokenizer(real_docs):
    return train_bpe_tokenizer(real_docs, vocab_size=512)


@pytest.fixture()
def corpus_dir(tmp_path: Path) -> Path:
    """A small tree of real text plus files that must be skipped."""
    root = tmp_path / "corpus"
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__pycache__").mkdir()
    (root / "lib" / "site-packages").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "b_textwrap.py").write_text(_read("textwrap.py"), encoding="utf-8")
    (root / "a_json.py").write_text(_read("json/__init__.py"), encoding="utf-8")
    (root / "pkg" / "a_decoder.py").write_text(_read("json/decoder.py"), encoding="utf-8")
    (root / "pkg" / "sub" / "notes.md").write_text(_read("string.py"), encoding="utf-8")
    (root / "pkg" / "guide.rst").write_text(_read("shlex.py"), encoding="utf-8")
    (root / "readme.TXT").write_text("upper-case suffix — still text ✓\n", encoding="utf-8")
    # Skipped: wrong suffix, not UTF-8, blank, excluded directories.
    (root / "data.json").write_text('{"a": 1}', encoding="utf-8")
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    (root / "pkg" / "__init__.py").write_text("\n", encoding="utf-8")
    (root / "pkg" / "__pycache__" / "x.py").write_text("cached = 1\n", encoding="utf-8")
    (root / "lib" / "site-packages" / "third.py").write_text("third = 1\n", encoding="utf-8")
    (root / ".hidden" / "secret.md").write_text("hidden\n", encoding="utf-8")
    return root


def _expected_dir_docs(root: Path) -> list[str]:
    keep = [
        root / "a_json.py",
        root / "b_textwrap.py",
        root / "pkg" / "a_decoder.py",
        root / "pkg" / "guide.rst",
        root / "pkg" / "sub" / "notes.md",
        root / "readme.TXT",
    ]
    keep.sort(key=lambda p: p.relative_to(root).parts)
    return [p.read_text(encoding="utf-8") for p in keep]


# ---------------------------------------------------------------- loading


def test_default_corpus_dir_is_stdlib():
    d = default_corpus_dir()
    assert d == Path(sysconfig.get_paths()["stdlib"])
    assert d.is_dir()
    assert (d / "os.py").is_file()


def test_default_corpus_loads_real_text_within_budget():
    docs = load_documents(None, max_bytes=200_000)
    assert docs and all(isinstance(d, str) and d for d in docs)
    assert sum(len(d.encode("utf-8")) for d in docs) <= 200_000
    assert DEFAULT_MAX_BYTES > 0


def test_directory_loading_selects_sorts_and_skips(corpus_dir):
    docs = load_documents(corpus_dir, max_bytes=None)
    assert docs == _expected_dir_docs(corpus_dir)
    assert load_documents(str(corpus_dir), max_bytes=None) == docs  # str works too


def test_max_bytes_truncates_last_document(corpus_dir):
    full = _expected_dir_docs(corpus_dir)
    limit = len(full[0].encode("utf-8")) + 1000
    docs = load_documents(corpus_dir, max_bytes=limit)
    assert len(docs) == 2
    assert docs[0] == full[0]
    assert full[1].startswith(docs[1]) and len(docs[1]) > 900
    assert limit - 3 <= sum(len(d.encode("utf-8")) for d in docs) <= limit


def test_max_bytes_never_splits_a_character(tmp_path):
    f = tmp_path / "accents.txt"
    f.write_text("é" * 100, encoding="utf-8")  # 2 bytes per character
    for limit in (2, 3, 7, 200, 500):
        assert load_documents(f, max_bytes=limit) == ["é" * min(limit // 2, 100)]
    with pytest.raises(ValueError, match="no non-empty"):
        load_documents(f, max_bytes=1)


def test_single_text_file_is_one_document(tmp_path):
    text = _read("textwrap.py")
    f = tmp_path / "one.txt"
    f.write_text(text, encoding="utf-8")
    assert load_documents(f, max_bytes=None) == [text]


def test_jsonl_loading(tmp_path):
    texts = [_read("textwrap.py"), _read("string.py"), "short line ✓"]
    f = tmp_path / "docs.jsonl"
    lines = [json.dumps({"body": t, "id": i}) for i, t in enumerate(texts)]
    f.write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n", encoding="utf-8")
    assert load_documents(f, text_field="body", max_bytes=None) == texts
    budget = len(texts[0].encode("utf-8"))
    assert load_documents(f, text_field="body", max_bytes=budget) == texts[:1]


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "fine"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 3") as e:
        load_documents(f)
    assert "'text'" in str(e.value)


def test_jsonl_missing_or_wrong_field(tmp_path):
    f = tmp_path / "nofield.jsonl"
    f.write_text('{"text": "ok"}\n{"content": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"nofield\.jsonl.*line 2.*'text'"):
        load_documents(f)
    g = tmp_path / "notstr.jsonl"
    g.write_text('{"text": 5}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 1.*must be a string"):
        load_documents(g)


def test_loading_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_documents(missing)
    bad = tmp_path / "table.csv"
    bad.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"table\.csv.*\.jsonl"):
        load_documents(bad)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "image.png").write_bytes(b"\x89PNG")
    with pytest.raises(FileNotFoundError, match="empty"):
        load_documents(empty)
    with pytest.raises(ValueError, match="max_bytes"):
        load_documents(tmp_path, max_bytes=0)


# ---------------------------------------------------------------- tokenizer


def test_bpe_training_is_deterministic(real_docs, tokenizer):
    again = train_bpe_tokenizer(real_docs, vocab_size=512)
    assert again.to_str() == tokenizer.to_str()
    a = encode_documents(tokenizer, real_docs)
    b = encode_documents(again, real_docs)
    assert np.array_equal(a, b)


def test_bpe_vocab_and_special_token(tokenizer):
    assert 257 < tokenizer.get_vocab_size() <= 512
    eot = tokenizer.token_to_id(EOT_TOKEN)
    assert eot is not None
    assert tokenizer.encode(EOT_TOKEN).ids == [eot]
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(["abc"], vocab_size=256)


def test_bpe_learns_merges(real_docs, tokenizer):
    text = real_docs[0]
    n_tokens = len(tokenizer.encode(text).ids)
    assert n_tokens < 0.6 * len(text.encode("utf-8"))


def test_round_trip_on_real_documents(real_docs, tokenizer):
    for doc in real_docs:
        assert tokenizer.decode(tokenizer.encode(doc).ids) == doc


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_on_arbitrary_text(tokenizer, text):
    # Byte-level BPE must reproduce any Unicode, including unseen characters.
    if EOT_TOKEN in text:
        return
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_save_and_load_tokenizer(tmp_path, real_docs, tokenizer):
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tokenizer.save(str(path))
    for p in (path, path.parent):
        loaded = load_tokenizer(p)
        assert loaded.encode(real_docs[1]).ids == tokenizer.encode(real_docs[1]).ids
    with pytest.raises(FileNotFoundError, match="missing"):
        load_tokenizer(tmp_path / "missing.json")
    junk = tmp_path / "junk.json"
    junk.write_text('{"not": "a tokenizer"}', encoding="utf-8")
    with pytest.raises(ValueError, match="junk"):
        load_tokenizer(junk)


def test_encode_documents_separates_with_eot(real_docs, tokenizer):
    ids = encode_documents(tokenizer, real_docs, batch_size=2)
    assert ids.dtype == np.int64 and ids.ndim == 1
    eot = tokenizer.token_to_id(EOT_TOKEN)
    ends = np.flatnonzero(ids == eot)
    assert len(ends) == len(real_docs) and ends[-1] == len(ids) - 1
    starts = np.concatenate([[0], ends[:-1] + 1])
    for doc, s, e in zip(real_docs, starts, ends):
        assert tokenizer.decode(ids[s:e].tolist()) == doc
    assert ids.min() >= 0 and ids.max() < tokenizer.get_vocab_size()
    with pytest.raises(ValueError, match="</s>"):
        encode_documents(tokenizer, real_docs, eot_token="</s>")


# ---------------------------------------------------------------- dataset


def _unique_dataset(n_tokens=1000, seq_len=10, **kw) -> TokenDataset:
    # Distinct token values make every window identifiable by its first token.
    return TokenDataset(np.arange(n_tokens, dtype=np.int64), seq_len, **kw)


def _window_ids(batch: dict, seq_len: int) -> list[int]:
    return (batch["input_ids"][:, 0] // seq_len).tolist()


def test_windows_and_split_partition():
    ds = _unique_dataset(1005, 10, val_fraction=0.05, seed=3)
    assert ds.num_windows == 100 and ds.tokens.shape == (1000,)
    train, val = set(ds.train_indices.tolist()), set(ds.val_indices.tolist())
    assert len(val) == 5 and train.isdisjoint(val)
    assert train | val == set(range(100))
    assert len(ds) == ds.num_train_windows == 95
    # Deterministic for a seed; the holdout is not simply the tail.
    again = _unique_dataset(1005, 10, val_fraction=0.05, seed=3)
    assert np.array_equal(again.val_indices, ds.val_indices)
    other = _unique_dataset(1005, 10, val_fraction=0.05, seed=4)
    assert not np.array_equal(other.val_indices, ds.val_indices)


def test_at_least_one_validation_window():
    ds = _unique_dataset(30, 10, val_fraction=0.01)
    assert ds.num_val_windows == 1 and ds.num_train_windows == 2


def test_batches_shape_dtype_labels():
    ds = _unique_dataset(1000, 10)
    batch = next(ds.batches(4, seed=0))
    assert set(batch) == {"input_ids", "labels"}
    for t in batch.values():
        assert t.dtype == torch.int64 and t.shape == (4, 10)
    assert torch.equal(batch["input_ids"], batch["labels"])
    assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()
    # Each row is exactly one contiguous window of the stream.
    for row in batch["input_ids"]:
        assert row[0] % 10 == 0 and torch.equal(row, torch.arange(row[0], row[0] + 10))


def test_batches_epochs_are_shuffled_permutations():
    ds = _unique_dataset(1000, 10, val_fraction=0.1)  # 90 train windows
    bs = 8
    per_epoch = 90 // bs
    it = ds.batches(bs, seed=7)
    epochs = []
    for _ in range(3):
        seen = [w for _ in range(per_epoch) for w in _window_ids(next(it), 10)]
        assert len(seen) == len(set(seen)) == per_epoch * bs  # no repeats in an epoch
        assert set(seen) <= set(ds.train_indices.tolist())
        epochs.append(seen)
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != sorted(epochs[0])
    # Same seed, same stream; different seed, different stream.
    it2 = ds.batches(bs, seed=7)
    assert [w for _ in range(per_epoch) for w in _window_ids(next(it2), 10)] == epochs[0]
    it3 = ds.batches(bs, seed=8)
    assert [w for _ in range(per_epoch) for w in _window_ids(next(it3), 10)] != epochs[0]


def test_val_split_batches_and_eval_batches():
    ds = _unique_dataset(1000, 10, val_fraction=0.2)  # 20 val windows
    val = set(ds.val_indices.tolist())
    for _ in range(10):
        assert set(_window_ids(next(ds.batches(3, split="val")), 10)) <= val
    first = [_window_ids(b, 10) for b in ds.eval_batches(4)]
    second = [_window_ids(b, 10) for b in ds.eval_batches(4)]
    assert first == second and len(first) == 5
    assert [w for b in first for w in b] == sorted(val)
    limited = list(ds.eval_batches(4, max_batches=2))
    assert len(limited) == 2 and all(b["input_ids"].shape == (4, 10) for b in limited)
    with pytest.raises(ValueError, match="split"):
        ds.batches(2, split="test")


def test_too_small_corpus_errors():
    with pytest.raises(ValueError, match="too small"):
        TokenDataset(np.arange(15), 10)
    ds = _unique_dataset(40, 10, val_fraction=0.25)  # 3 train, 1 val
    with pytest.raises(ValueError, match="one batch"):
        ds.batches(4)  # raised at call time, not on first next()
    with pytest.raises(ValueError, match="one batch"):
        ds.eval_batches(2)
    with pytest.raises(ValueError, match="val_fraction"):
        TokenDataset(np.arange(100), 10, val_fraction=0.0)


# ---------------------------------------------------------------- pipeline


def test_prepare_lm_data_on_directory(corpus_dir, tmp_path):
    tok, ds = prepare_lm_data(corpus_dir, vocab_size=400, seq_len=32, seed=1)
    assert tok.get_vocab_size() <= 400
    assert ds.seq_len == 32 and ds.tokens.dtype == np.int64
    assert ds.tokens.max() < tok.get_vocab_size()
    expected = encode_documents(tok, _expected_dir_docs(corpus_dir))
    assert np.array_equal(ds.tokens, expected[: ds.num_windows * 32])
    batch = next(ds.batches(4, seed=0))
    assert batch["input_ids"].shape == (4, 32)

    tok2, ds2 = prepare_lm_data(corpus_dir, vocab_size=400, seq_len=32, seed=1)
    assert tok2.to_str() == tok.to_str() and np.array_equal(ds2.tokens, ds.tokens)
    assert np.array_equal(ds2.val_indices, ds.val_indices)

    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    tok3, ds3 = prepare_lm_data(corpus_dir, tokenizer_path=path, vocab_size=999, seq_len=32)
    assert tok3.get_vocab_size() == tok.get_vocab_size()
    assert np.array_equal(ds3.tokens, ds.tokens)


def test_prepare_lm_data_too_small(tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_text("just a few words\n", encoding="utf-8")
    with pytest.raises(ValueError, match="too small"):
        prepare_lm_data(f, seq_len=64)
