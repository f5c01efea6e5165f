"""Tests for megatrain.data.store and .windows: the memory-mapped token store and its window reader.

Corpora are copies of standard-library sources in tmp dirs (the real stdlib is never touched);
the oracle for the store's contents is the in-memory pipeline (load_documents + encode_documents).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from megatrain.data import (
    IGNORE_INDEX,
    encode_documents,
    load_documents,
    tokenize_documents,
    train_bpe_tokenizer,
)
from megatrain.data import store as S
from megatrain.data import windows as W
from megatrain.data.store import (
    CorruptStoreError,
    StoreError,
    StoreManifest,
    build_token_store,
    cached_token_store,
    open_token_store,
)
from megatrain.data.windows import StoreWindows

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_bpe_tokenizer(load_documents(STDLIB / "json", max_bytes=None), vocab_size=512)


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    """A copy of stdlib ``json`` (5 files) plus a .jsonl and a non-UTF-8 file to skip."""
    root = tmp_path / "corpus"
    shutil.copytree(STDLIB / "json", root, ignore=shutil.ignore_patterns("__pycache__"))
    lines = [json.dumps({"text": f"record {i}: " + "x = 1\n" * i}) for i in range(1, 20)]
    (root / "records.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    return root


@pytest.fixture()
def built(corpus, tokenizer, tmp_path):
    with build_token_store(corpus, tokenizer, tmp_path / "store", workers=1, progress=False) as store:
        yield store


def _expected_tokens(corpus: Path, tokenizer: Tokenizer) -> np.ndarray:
    return encode_documents(tokenizer, load_documents(corpus, max_bytes=None))


# ---------------------------------------------------------------- building


def test_store_holds_exactly_the_in_memory_stream(built, corpus, tokenizer):
    assert np.array_equal(built.tokens.astype(np.int64), _expected_tokens(corpus, tokenizer))
    docs = tokenize_documents(tokenizer, load_documents(corpus, max_bytes=None))
    m = built.manifest
    assert m.num_documents == len(docs) and built.num_documents == len(docs)
    assert m.num_tokens == sum(len(d) + 1 for d in docs)
    assert m.dtype == "uint16" and built.tokens.dtype == np.uint16
    assert m.eot_token == "<|endoftext|>" and m.eot_id == tokenizer.token_to_id("<|endoftext|>")
    assert m.skipped_files == 1 and m.skipped_examples == [str(corpus.absolute() / "latin1.txt")]
    assert m.source_files == 7 and built.origin == "built"
    assert m.max_bytes is None
    assert m.text_bytes == sum(len(d.encode("utf-8")) for d in load_documents(corpus, max_bytes=None))
    for i in (0, 3, len(docs) - 1):
        assert np.array_equal(built.document(i), np.append(docs[i], m.eot_id))
    assert built.offsets[0] == 0 and built.offsets[-1] == m.num_tokens
    with pytest.raises(IndexError, match="out of range"):
        built.document(len(docs))
    assert not built.tokens.flags.writeable


def test_store_files_and_manifest_are_complete(built):
    names = sorted(p.name for p in built.path.iterdir())
    assert names == ["manifest.json", "offsets.npy", "tokens.bin"]
    m = StoreManifest.model_validate_json((built.path / "manifest.json").read_text())
    assert m == built.manifest
    assert (built.path / "tokens.bin").stat().st_size == 2 * m.num_tokens
    # No temporary left behind; the lock file stays (it names the last builder).
    assert [p.name for p in built.path.parent.glob(".store.*")] == [".store.lock"]


def test_parallel_build_is_byte_identical_to_serial(corpus, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(S, "_MIN_SHARD_BYTES", 4096)  # several shards from a small corpus
    serial = build_token_store(corpus, tokenizer, tmp_path / "serial", workers=1, progress=False)
    parallel = build_token_store(corpus, tokenizer, tmp_path / "parallel", workers=2, progress=False)
    tasks = S._plan_tasks(S._Source.resolve(corpus), 2, tmp_path, text_field="text", in_directory=True,
                          eot_id=0, dtype="uint16")
    assert len(tasks) >= 3
    for name in ("tokens.bin", "offsets.npy"):
        assert (serial.path / name).read_bytes() == (parallel.path / name).read_bytes()
    a = serial.manifest.model_dump(exclude={"build_seconds"})
    b = parallel.manifest.model_dump(exclude={"build_seconds"})
    assert a == b


@pytest.mark.parametrize("budget", [1, 4321, 20_000, 10**9])
def test_a_byte_budget_takes_what_load_documents_takes(corpus, tokenizer, tmp_path, budget):
    # 4321 and 20,000 end inside a document (cut at a character boundary), 10**9 past the corpus.
    store = build_token_store(corpus, tokenizer, tmp_path / "s", max_bytes=budget, workers=2, progress=False)
    docs = load_documents(corpus, max_bytes=budget)
    assert np.array_equal(store.tokens.astype(np.int64), encode_documents(tokenizer, docs))
    assert store.manifest.max_bytes == budget
    assert store.manifest.text_bytes == sum(len(d.encode("utf-8")) for d in docs) <= budget


def test_a_changed_byte_budget_rebuilds_and_no_budget_keeps_the_old_key(corpus, tokenizer, tmp_path):
    assert cached_token_store(corpus, tokenizer, tmp_path / "s", max_bytes=5000, progress=False).origin == "built"
    again = cached_token_store(corpus, tokenizer, tmp_path / "s", max_bytes=5000, progress=False)
    assert again.origin == "reused"
    whole = cached_token_store(corpus, tokenizer, tmp_path / "s", workers=1, progress=False)
    assert whole.origin == "rebuilt (options changed)"
    m = whole.manifest
    assert m.key == S.store_key(m.source_sha256, m.tokenizer_sha256, m.eot_token, m.text_field)
    with pytest.raises(ValueError, match="max_bytes must be a positive"):
        build_token_store(corpus, tokenizer, tmp_path / "t", max_bytes=0, progress=False)


def test_single_jsonl_file_source(tmp_path, tokenizer):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "alpha beta"}\n\n{"text": "gamma"}\n', encoding="utf-8")
    store = build_token_store(f, tokenizer, tmp_path / "s", workers=1, progress=False)
    assert store.num_documents == 2
    assert np.array_equal(store.tokens.astype(np.int64), _expected_tokens(f, tokenizer))


def test_vocabularies_beyond_uint16_are_stored_as_uint32(tmp_path):
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    f = tmp_path / "a.txt"
    f.write_text("w69999 w0 w65536 w12\n", encoding="utf-8")
    store = build_token_store(f, tok, tmp_path / "s", workers=1, progress=False)
    assert store.manifest.dtype == "uint32" and store.tokens.dtype == np.uint32
    assert store.tokens.tolist() == [70001, 2, 65538, 14, 0]
    assert S._dtype_for(1 << 16) == np.uint16 and S._dtype_for((1 << 16) + 1) == np.uint32


def test_malformed_record_names_file_and_line_and_leaves_no_store(corpus, tokenizer, tmp_path):
    (corpus / "z_bad.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"z_bad\.jsonl', line 2: field 'text' must be a string"):
        build_token_store(corpus, tokenizer, tmp_path / "s", workers=1, progress=False)
    assert not (tmp_path / "s").exists()
    assert not list(tmp_path.glob(".s.tmp-*"))


def test_malformed_record_in_a_worker_is_reported_the_same(corpus, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(S, "_MIN_SHARD_BYTES", 4096)
    (corpus / "z_bad.jsonl").write_text('{"text": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"z_bad\.jsonl', line 2: not valid JSON"):
        build_token_store(corpus, tokenizer, tmp_path / "s", workers=2, progress=False)
    assert not (tmp_path / "s").exists()


def test_empty_corpus_and_missing_end_of_text_are_errors(tmp_path, tokenizer):
    root = tmp_path / "empty"
    root.mkdir()
    (root / "a.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(StoreError, match="no non-empty UTF-8 documents found"):
        build_token_store(root, tokenizer, tmp_path / "s", workers=1, progress=False)
    tok = Tokenizer(models.WordLevel(vocab={"a": 0, "<unk>": 1}, unk_token="<unk>"))
    (root / "b.txt").write_text("a a\n", encoding="utf-8")
    with pytest.raises(StoreError, match="end-of-sequence token"):
        build_token_store(root, tok, tmp_path / "s", workers=1, progress=False)
    with pytest.raises(StoreError, match="no token '</eot>'"):
        build_token_store(root, tok, tmp_path / "s", eot_token="</eot>", workers=1, progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_token_store(tmp_path / "nope", tokenizer, tmp_path / "s", workers=1, progress=False)


def test_a_crashed_build_s_temporary_directory_is_removed(corpus, tokenizer, tmp_path):
    stale = tmp_path / ".s.tmp-deadbeef"
    stale.mkdir()
    (stale / "tokens.bin").write_bytes(b"\0" * 10)
    build_token_store(corpus, tokenizer, tmp_path / "s", workers=1, progress=False)
    assert not stale.exists()


# ---------------------------------------------------------------- reuse and corruption


def test_unchanged_source_and_tokenizer_reuse_the_store(corpus, tokenizer, tmp_path):
    first = cached_token_store(corpus, tokenizer, tmp_path / "s", workers=1, progress=False)
    assert first.origin == "built"
    stamp = (tmp_path / "s" / "tokens.bin").stat().st_mtime_ns
    again = cached_token_store(corpus, tokenizer, tmp_path / "s", workers=1, progress=False)
    assert again.origin == "reused"
    assert (tmp_path / "s" / "tokens.bin").stat().st_mtime_ns == stamp
    assert again.manifest == first.manifest
    # The same tokenizer loaded from its file hashes the same.
    tokenizer.save(str(tmp_path / "tok.json"))
    loaded = Tokenizer.from_file(str(tmp_path / "tok.json"))
    assert cached_token_store(corpus, loaded, tmp_path / "s", progress=False).origin == "reused"


def test_changed_source_or_tokenizer_rebuilds(corpus, tokenizer, tmp_path):
    cached_token_store(corpus, tokenizer, tmp_path / "s", workers=1, progress=False)
    f = corpus / "records.jsonl"
    f.write_text(f.read_text() + '{"text": "one more"}\n', encoding="utf-8")
    store = cached_token_store(corpus, tokenizer, tmp_path / "s", workers=1, progress=False)
    assert store.origin == "rebuilt (source changed)"
    assert np.array_equal(store.tokens.astype(np.int64), _expected_tokens(corpus, tokenizer))
    other = train_bpe_tokenizer(load_documents(corpus, max_bytes=None), vocab_size=300)
    store = cached_token_store(corpus, other, tmp_path / "s", workers=1, progress=False)
    assert store.origin == "rebuilt (tokenizer changed)"
    assert np.array_equal(store.tokens.astype(np.int64), _expected_tokens(corpus, other))
    (corpus / "records.jsonl").unlink()  # so that another text field reads the same text
    assert cached_token_store(corpus, other, tmp_path / "s", progress=False).origin == "rebuilt (source changed)"
    store = cached_token_store(corpus, other, tmp_path / "s", text_field="body", workers=1, progress=False)
    assert store.origin == "rebuilt (options changed)"


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "verify", "message"),
    [
        (lambda p: _flip_byte(p / "tokens.bin", 101), "full", "tokens.bin does not match the sha256"),
        (lambda p: _flip_byte(p / "offsets.npy", -3), "full", "offsets.npy"),
        (lambda p: os.truncate(p / "tokens.bin", 64), "size", "tokens.bin holds 64 bytes"),
        (lambda p: (p / "tokens.bin").unlink(), "size", "tokens.bin is missing"),
        (lambda p: (p / "manifest.json").unlink(), "size", "no manifest.json"),
        (lambda p: (p / "manifest.json").write_text("{not json"), "size", "is not a version-1 manifest"),
        (lambda p: (p / "manifest.json").write_text(
            (p / "manifest.json").read_text().replace('"version": 1', '"version": 7')), "size",
         r"version: Input should be 1"),
        (lambda p: (p / "offsets.npy").write_bytes(b"garbage"), "size", "offsets.npy is not a readable"),
    ],
)
def test_a_damaged_store_is_detected_and_rebuilt(corpus, tokenizer, tmp_path, damage, verify, message, caplog):
    path = tmp_path / "s"
    good = cached_token_store(corpus, tokenizer, path, workers=1, progress=False).manifest
    damage(path)
    with pytest.raises(CorruptStoreError, match=message):
        open_token_store(path, verify=verify)
    store = cached_token_store(corpus, tokenizer, path, workers=1, progress=False, verify=verify)
    assert store.origin.startswith("rebuilt (corrupt: ")
    assert "not usable, rebuilding" in caplog.text
    assert store.manifest.tokens_sha256 == good.tokens_sha256
    assert open_token_store(path).manifest.model_dump(exclude={"build_seconds"}) == good.model_dump(
        exclude={"build_seconds"})


def test_size_verification_misses_a_flipped_byte_full_verification_does_not(built):
    _flip_byte(built.path / "tokens.bin", 11)
    open_token_store(built.path, verify="size").close()
    with pytest.raises(CorruptStoreError, match="must be rebuilt"):
        open_token_store(built.path)
    with pytest.raises(ValueError, match="verify must be"):
        open_token_store(built.path, verify="fast")


# ---------------------------------------------------------------- permutation


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), a=st.integers(0, 2**32), b=st.integers(0, 100))
def test_feistel_permutation_is_a_bijection_with_its_inverse(n, a, b):
    p = W._Permutation(n, (a, b))
    image = p(np.arange(n))
    assert np.array_equal(np.sort(image), np.arange(n))
    assert np.array_equal(p.inverse(image), np.arange(n))


def test_feistel_permutation_shuffles_and_depends_on_its_key():
    n = 10_000
    a = W._Permutation(n, (0, 1))(np.arange(n))
    b = W._Permutation(n, (0, 2))(np.arange(n))
    assert (a == np.arange(n)).mean() < 0.01  # about 1/n fixed points for a random permutation
    assert (a == b).mean() < 0.01
    # Positions spread over the whole range: first 100 outputs are not clustered.
    assert np.ptp(a[:100]) > n // 2
    with pytest.raises(IndexError):
        W._Permutation(5, (0,))(np.array([5]))


# ---------------------------------------------------------------- windows


def test_windows_are_slices_of_the_stream_with_document_starts_masked(built):
    data = StoreWindows(built, 32, val_fraction=0.1, seed=1)
    assert data.num_windows == built.num_tokens // 32
    assert data.num_train_rows + data.num_val_rows == data.num_windows and len(data) == data.num_train_rows
    ids = data.windows("train", np.arange(4), seed=5)
    batch = data.read(ids)
    x, y = batch["input_ids"], batch["labels"]
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    stream = built.tokens.astype(np.int64)
    for row, w in enumerate(ids):
        assert np.array_equal(x[row].numpy(), stream[w * 32 : (w + 1) * 32])
    after_eot = np.zeros_like(x.numpy(), dtype=bool)
    after_eot[:, 1:] = x.numpy()[:, :-1] == built.eot_id
    assert np.array_equal(y.numpy(), np.where(after_eot, IGNORE_INDEX, x.numpy()))
    unmasked = StoreWindows(built, 32, val_fraction=0.1, seed=1, mask_document_starts=False)
    assert np.array_equal(unmasked.read(ids)["labels"].numpy(), x.numpy())


def test_split_is_disjoint_and_covers_and_each_epoch_visits_every_training_window(built):
    data = StoreWindows(built, 16, val_fraction=0.2, seed=3)
    train = data.windows("train", np.arange(data.num_train_rows), seed=9, epoch=2)
    val = data.windows("eval", np.arange(data.num_val_rows))
    assert len(set(train.tolist())) == data.num_train_rows
    assert set(train.tolist()).isdisjoint(val.tolist())
    assert set(train.tolist()) | set(val.tolist()) == set(range(data.num_windows))
    # Another epoch or seed: the same windows in another order.
    other = data.windows("train", np.arange(data.num_train_rows), seed=9, epoch=3)
    assert set(other.tolist()) == set(train.tolist()) and not np.array_equal(other, train)
    # The split depends on the constructor's seed only.
    assert set(StoreWindows(built, 16, val_fraction=0.2, seed=3).windows(
        "eval", np.arange(data.num_val_rows)).tolist()) == set(val.tolist())
    assert set(StoreWindows(built, 16, val_fraction=0.2, seed=4).windows(
        "eval", np.arange(data.num_val_rows)).tolist()) != set(val.tolist())


def test_batches_resume_exactly_across_epochs(built):
    data = StoreWindows(built, 64, seed=0)
    per_epoch = data.batches_per_epoch(8)
    n = 2 * per_epoch + 3
    run = [b for _, b in zip(range(n), data.batches(8, seed=7))]
    for start in (1, per_epoch - 1, per_epoch, per_epoch + 2):
        resumed = [b for _, b in zip(range(n - start), data.batches(8, seed=7, start=start))]
        for a, b in zip(run[start:], resumed):
            assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(a["labels"], b["labels"])
    reopened = StoreWindows(open_token_store(built.path), 64, seed=0)
    first = next(reopened.batches(8, seed=7))
    assert np.array_equal(first["input_ids"], run[0]["input_ids"])
    assert not np.array_equal(next(data.batches(8, seed=8))["input_ids"], run[0]["input_ids"])
    assert data.fingerprint() == reopened.fingerprint() != StoreWindows(built, 64, seed=1).fingerprint()


def test_eval_batches_are_fixed_and_full(built):
    data = StoreWindows(built, 32, val_fraction=0.1)
    a = list(data.eval_batches(4))
    b = list(data.eval_batches(4, max_batches=2))
    assert len(a) == data.num_val_rows // 4 and len(b) == 2
    assert all(x["input_ids"].shape == (4, 32) for x in a)
    assert np.array_equal(a[1]["input_ids"], b[1]["input_ids"])
    assert len(list(zip(range(3), data.batches(2, split="val")))) == 3


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda s: StoreWindows(s, 1), "seq_len must be >= 2"),
        (lambda s: StoreWindows(s, 32, val_fraction=1.0), "val_fraction"),
        (lambda s: StoreWindows(s, s.num_tokens), "corpus too small"),
        (lambda s: StoreWindows(s, 32).batches(0), "batch_size must be >= 1"),
        (lambda s: StoreWindows(s, 32).batches(10**6), "corpus too small for one batch"),
        (lambda s: StoreWindows(s, 32).batches(2, split="test"), "split must be"),
        (lambda s: StoreWindows(s, 32).batches(2, start=-1), "start must be >= 0"),
        (lambda s: StoreWindows(s, 32).eval_batches(2, max_batches=0), "max_batches"),
    ],
)
def test_window_errors(built, make, message):
    with pytest.raises(ValueError, match=message):
        make(built)


def _mapping_rss_kib(path: Path) -> int | None:
    """Resident KiB of this process's mappings of ``path`` (Linux ``/proc/self/smaps``)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    total, inside = 0, False
    for line in smaps.read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_reading_an_epoch_leaves_no_store_pages_resident(tmp_path, tokenizer, monkeypatch):
    corpus = tmp_path / "c"
    shutil.copytree(STDLIB / "email", corpus, ignore=shutil.ignore_patterns("__pycache__"))
    store = build_token_store(corpus, tokenizer, tmp_path / "s", workers=1, progress=False)
    tokens_file = (tmp_path / "s" / "tokens.bin").resolve()
    if _mapping_rss_kib(tokens_file) is None:
        pytest.skip("needs /proc/self/smaps (Linux)")
    size_kib = tokens_file.stat().st_size // 1024
    assert size_kib > 256  # large enough that holding it would show
    data = StoreWindows(store, 128)
    for _, _batch in zip(range(data.batches_per_epoch(8)), data.batches(8)):
        pass
    assert _mapping_rss_kib(tokens_file) <= 8  # a page or two at most, not the file

    # The same epoch without releasing pages holds most of the file: the check above measures.
    monkeypatch.setattr(S.TokenStore, "release", lambda self: None)
    for _, _batch in zip(range(data.batches_per_epoch(8)), data.batches(8)):
        pass
    assert _mapping_rss_kib(tokens_file) > size_kib // 2


def test_the_rss_bench_runs_on_a_tiny_corpus(tmp_path):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "data_rss.py"
    spec = importlib.util.spec_from_file_location("data_rss", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    rc = bench.main(["--gb", "0.002", "--workers", "1", "--vocab", "300", "--seq-len", "64", "--train-steps", "4",
                     "--warmup", "2", "--sample-every", "2", "--scan", "20", "--dir", str(tmp_path / "w"),
                     "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0 and r["ok"]
    assert r["build"]["origin"] == "built" and r["reuse"]["origin"] == "reused"
    assert r["corpus"]["bytes"] >= 2_000_000 and r["scan"]["batches"] == 20
    assert r["rss_growth_bytes"] < 200 * 10**6
