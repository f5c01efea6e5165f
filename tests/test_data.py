"""Tests for megatrain.data: loading, BPE tokenizer, encoding, packing, and the pipeline to the store.

Corpora are built in tmp_path from real standard-library files, so no expected
outputs are hard-coded: the tests check properties that hold for any text.
"""

from __future__ import annotations

import collections
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrain.data import (
    DEFAULT_MAX_BYTES,
    EOT_TOKEN,
    IGNORE_INDEX,
    StoreWindows,
    cached_token_store,
    corpus_bytes,
    default_corpus_dir,
    encode_documents,
    find_eot_token,
    load_documents,
    load_tokenizer,
    pack_documents,
    tokenize_documents,
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


def test_jsonl_type_change_mid_file_names_the_line(tmp_path):
    """datasets' JSON reader fails on a column that changes type (ArrowInvalid, no line number):
    the error names the file and the first offending line instead."""
    f = tmp_path / "mixed.jsonl"
    f.write_text('{"text": "a"}\n\n{"text": "b"}\n{"text": [1, 2]}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"mixed\.jsonl', line 4: field 'text' must be a string, got list"):
        load_documents(f)


def test_jsonl_errors_name_the_line_past_blank_lines_and_bad_bytes(tmp_path):
    """datasets' row numbers skip blank lines and its errors name no file: ours count file lines."""
    f = tmp_path / "gaps.jsonl"
    f.write_text('{"text": "one"}\n\n\n{"text": "two", "n": 1}\n\n{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"gaps\.jsonl', line 6: JSON value has no field 'text'"):
        load_documents(f)
    g = tmp_path / "ok.jsonl"
    g.write_text('{"text": "one"}\n\n{"text": ""}\n{"text": "two"}\n', encoding="utf-8")
    assert load_documents(g) == ["one", "two"]
    h = tmp_path / "latin1.jsonl"
    h.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl', line 2: not valid UTF-8"):
        load_documents(h)


def test_saved_hf_dataset_directory_is_a_corpus(tmp_path, tokenizer):
    """A directory written by datasets' save_to_disk (a Dataset, or a DatasetDict's 'train' split)
    reads as one document per row, memory-mapped, and builds the same token store as the same
    rows in a .jsonl file."""
    datasets = pytest.importorskip("datasets")
    rows = [_read("textwrap.py"), "", _read("shlex.py"), "short ✓"]
    ds = datasets.Dataset.from_dict({"body": rows, "n": list(range(len(rows)))})
    ds.save_to_disk(str(tmp_path / "saved"))
    want = [r for r in rows if r]
    assert load_documents(tmp_path / "saved", text_field="body", max_bytes=None) == want
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    assert load_documents(tmp_path / "dict", text_field="body", max_bytes=None) == want
    jsonl = tmp_path / "same.jsonl"
    jsonl.write_text("".join(json.dumps({"body": r}) + "\n" for r in rows), encoding="utf-8")
    from_disk = cached_token_store(tmp_path / "saved", tokenizer, tmp_path / "s1", text_field="body",
                                   max_bytes=None, progress=False)
    from_jsonl = cached_token_store(jsonl, tokenizer, tmp_path / "s2", text_field="body", max_bytes=None,
                                    progress=False)
    assert np.array_equal(from_disk.tokens, from_jsonl.tokens) and from_disk.num_documents == len(want)
    with pytest.raises(ValueError, match=r"saved.*no column 'text'.*\['body', 'n'\]"):
        load_documents(tmp_path / "saved")
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "notrain"))
    with pytest.raises(ValueError, match=r"no 'train' split \(splits: \['test'\]\).*notrain/test"):
        load_documents(tmp_path / "notrain")
    shard = next((tmp_path / "saved").glob("*.arrow"))
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=rf"lists '{shard.name}'.*missing"):
        load_documents(tmp_path / "saved", text_field="body")


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


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(alphabet=st.sampled_from("ab \n\u00e9"), max_size=700), max_size=4))
def test_bounded_words_keep_the_text_and_cut_long_runs(docs):
    from megatrain.data.tokenizer import MAX_WORD_CHARS, bounded_words

    pieces = list(bounded_words(docs))
    assert "".join(pieces) == "".join(docs)
    assert all(len(run) <= MAX_WORD_CHARS for p in pieces for run in p.split())


def test_a_line_of_megabytes_without_whitespace_trains_on_bounded_words(monkeypatch):
    """Such a line made BPE training quadratic (2 MB: 340 s): the trainer's work per merge grows
    with the longest word. What reaches the trainer is counted, not timed."""
    from tokenizers import Tokenizer

    from megatrain.data.tokenizer import MAX_WORD_CHARS

    seen = []
    real = Tokenizer.train_from_iterator

    def spy(self, iterator, **kw):
        return real(self, (seen.append(t) or t for t in iterator), **kw)

    monkeypatch.setattr(Tokenizer, "train_from_iterator", spy)
    line = "abcdefghij" * 20_000  # 200 KB, no whitespace
    tok = train_bpe_tokenizer(["some ordinary words here", line], vocab_size=300)
    assert max(len(t) for t in seen) == MAX_WORD_CHARS and "".join(seen[1:]) == line
    assert tok.decode(tok.encode(line).ids) == line  # encoding is not cut: the whole line round-trips


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


# ---------------------------------------------------------------- pipeline


def test_directory_corpus_through_the_token_store(corpus_dir, tmp_path):
    """load -> BPE -> store -> windows on a directory: the store holds the directory's documents
    in path order, each ended by the end-of-text token; a tokenizer saved and loaded reuses it."""
    tok = train_bpe_tokenizer(load_documents(corpus_dir), vocab_size=400)
    assert tok.get_vocab_size() <= 400
    store = cached_token_store(corpus_dir, tok, tmp_path / "store", max_bytes=None, progress=False)
    expected = encode_documents(tok, _expected_dir_docs(corpus_dir))
    assert np.array_equal(store.tokens.astype(np.int64), expected)
    ds = StoreWindows(store, 32, seed=1)
    batch = next(ds.batches(4, seed=0))
    assert batch["input_ids"].shape == (4, 32) and int(batch["input_ids"].max()) < tok.get_vocab_size()

    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    again = cached_token_store(corpus_dir, load_tokenizer(path), tmp_path / "store", progress=False)
    assert again.origin == "reused" and StoreWindows(again, 32, seed=1).fingerprint() == ds.fingerprint()


def test_too_small_corpus_for_the_windows(tmp_path, tokenizer):
    f = tmp_path / "tiny.txt"
    f.write_text("just a few words\n", encoding="utf-8")
    with pytest.raises(ValueError, match="too small"):
        StoreWindows(cached_token_store(f, tokenizer, tmp_path / "s", progress=False), 64)


# ---------------------------------------------------------------- parquet and mixed directories


def _write_parquet(path: Path, **columns) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), path, row_group_size=2)
    return path


def test_parquet_loading_takes_the_text_column(tmp_path):
    texts = [_read("textwrap.py"), None, "", _read("shlex.py"), "short ✓"]
    f = _write_parquet(tmp_path / "docs.parquet", body=texts, n=list(range(5)))
    want = [t for t in texts if t]
    assert load_documents(f, text_field="body", max_bytes=None) == want
    budget = len(want[0].encode("utf-8")) + 10
    docs = load_documents(f, text_field="body", max_bytes=budget)
    assert docs[0] == want[0] and want[1].startswith(docs[1]) and len(docs[1]) == 10
    with pytest.raises(ValueError, match=r"docs\.parquet.*no column 'text'.*\['body', 'n'\]"):
        load_documents(f)
    with pytest.raises(ValueError, match=r"column 'n' has type int64, not string"):
        load_documents(f, text_field="n")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"bad\.parquet.*not a readable Parquet"):
        load_documents(bad)


def test_directory_reads_text_jsonl_and_parquet_files_in_path_order(tmp_path):
    root = tmp_path / "mixed"
    (root / "b").mkdir(parents=True)
    (root / "a.txt").write_text(_read("string.py"), encoding="utf-8")
    (root / "b" / "c.jsonl").write_text(json.dumps({"text": "from jsonl"}) + "\n", encoding="utf-8")
    _write_parquet(root / "b" / "d.parquet", text=["parquet one", "parquet two"])
    (root / "e.csv").write_text("skipped,1\n", encoding="utf-8")
    docs = load_documents(root, max_bytes=None)
    assert docs == [_read("string.py"), "from jsonl", "parquet one", "parquet two"]
    on_disk = sum(f.stat().st_size for f in [root / "a.txt", root / "b" / "c.jsonl", root / "b" / "d.parquet"])
    assert corpus_bytes(root) == on_disk
    with pytest.raises(FileNotFoundError, match="nope"):
        corpus_bytes(tmp_path / "nope")


# ---------------------------------------------------------------- packing


def test_tokenize_documents_matches_the_stream_encoding(real_docs, tokenizer):
    per_doc = tokenize_documents(tokenizer, real_docs, batch_size=2)
    assert len(per_doc) == len(real_docs) and all(a.dtype == np.int64 for a in per_doc)
    eot = tokenizer.token_to_id(EOT_TOKEN)
    stream = np.concatenate([np.append(a, eot) for a in per_doc])
    assert np.array_equal(stream, encode_documents(tokenizer, real_docs))
    assert find_eot_token(tokenizer) == EOT_TOKEN
    bare = train_bpe_tokenizer(real_docs[:1], vocab_size=300)
    assert find_eot_token(bare, ["</s>", EOT_TOKEN]) == EOT_TOKEN
    with pytest.raises(ValueError, match=r"none of the end-of-sequence tokens \['</s>'\]"):
        find_eot_token(bare, ["</s>"])


def test_pack_documents_golden_example():
    # S=6. [1 2 3]+E fits; [10..21]+E (13 tokens) splits with one token of overlap into 6 + 6 + 3;
    # [30]+E and [40..44]+E fit. Best-fit decreasing: the three 6s, then 5, 4, 3 (the tail goes to a
    # new row: the 4-row has 2 left), then 2 into the 4-row.
    docs = [np.arange(1, 4), np.arange(10, 22), np.array([30]), np.arange(40, 45)]
    p = pack_documents(docs, 6, eot_id=0, pad_id=-1)
    E, P, X = 0, -1, IGNORE_INDEX
    assert p.input_ids.tolist() == [
        [10, 11, 12, 13, 14, 15],
        [15, 16, 17, 18, 19, 20],
        [40, 41, 42, 43, 44, E],
        [1, 2, 3, E, 30, E],
        [20, 21, E, P, P, P],
    ]
    assert p.labels.tolist() == [
        [X, 11, 12, 13, 14, 15],
        [X, 16, 17, 18, 19, 20],
        [X, 41, 42, 43, 44, E],
        [X, 2, 3, E, X, E],  # 30 starts a document: never predicted from document [1 2 3]
        [X, 21, E, X, X, X],
    ]
    assert (p.num_documents, p.num_pieces, p.num_tokens) == (4, 6, 27)
    assert p.padding_fraction == pytest.approx(3 / 30)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=25), seq_len=st.integers(2, 12))
def test_packing_targets_are_exactly_the_within_document_pairs(lengths, seq_len):
    # Unique ids per token (>= 1); end-of-text 0; padding -1, so every fact is checkable.
    docs, nxt = [], 1
    for n in lengths:
        docs.append(np.arange(nxt, nxt + n))
        nxt += n
    if not any(lengths):
        with pytest.raises(ValueError, match="no non-empty"):
            pack_documents(docs, seq_len, eot_id=0)
        return
    p = pack_documents(docs, seq_len, eot_id=0, pad_id=-1)
    x, y = p.input_ids, p.labels
    assert x.shape == y.shape and x.shape[1] == seq_len and x.dtype == y.dtype == np.int64
    # Labels are the inputs or ignored; position 0 of a row is never a target anyway.
    assert np.all((y == x) | (y == IGNORE_INDEX)) and np.all(y[:, 0] == IGNORE_INDEX)
    # Padding is a suffix of each row and never a target.
    pad = x == -1
    assert np.all(np.diff(pad.astype(int), axis=1) >= 0) and np.all(y[pad] == IGNORE_INDEX)
    assert pad.sum() == x.size - p.num_tokens
    # Every (context token, target) pair is a pair of neighbours in one document + end-of-text, and
    # each such pair is a target exactly once: no cross-document target, none lost at a split.
    want = collections.Counter()
    for d in docs:
        if d.size:
            seq = np.append(d, 0).tolist()
            want.update(zip(seq, seq[1:]))
    got = collections.Counter()
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        pairs = [(row_x[t - 1], row_y[t]) for t in range(1, seq_len) if row_y[t] != IGNORE_INDEX]
        assert pairs, "a row without a target"
        got.update(pairs)
    assert got == want
    # A document that fits in a row is never split.
    for d in docs:
        if 0 < d.size < seq_len:
            r, c = np.argwhere(x == d[0])[0]
            assert x[r, c : c + d.size + 1].tolist() == np.append(d, 0).tolist()
    # Rows are not wasted: fewer than one row's worth of padding per two rows, plus one row.
    assert pad.sum() <= seq_len * (x.shape[0] // 2 + 1)


def test_pack_documents_rejects_bad_input():
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        pack_documents([np.arange(5)], 1, eot_id=0)
    with pytest.raises(ValueError, match="no non-empty document"):
        pack_documents([np.array([], dtype=np.int64)], 8, eot_id=0)


def test_public_surface_of_megatrain_data_is_pinned():
    import megatrain.data

    assert sorted(megatrain.data.__all__) == sorted([
        "DEFAULT_MAX_BYTES", "EOT_CANDIDATES", "EOT_TOKEN", "IGNORE_INDEX", "RECORD_SUFFIXES", "TEXT_SUFFIXES",
        "ChatProcessor", "ChatTokenizer", "CorruptStoreError", "PackedRows", "SftDataset",
        "SftSource", "SftStore", "StoreError", "StoreManifest", "StoreWindows", "TokenStore",
        "best_fit_decreasing", "build_token_store", "cached_sft_store", "cached_token_store", "corpus_bytes",
        "corpus_files", "default_corpus_dir", "encode_documents", "find_eot_token", "iter_file_documents",
        "load_documents", "load_tokenizer", "open_token_store", "pack_documents", "resolve_sft_data",
        "tokenize_documents", "train_bpe_tokenizer",
    ])
    assert all(hasattr(megatrain.data, name) for name in megatrain.data.__all__)
