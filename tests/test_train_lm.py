"""The main job (``make train``) is ``megatrain train`` with ``examples/train_lm.yaml``: end to end on
real text, shortened to fit the suite, and what it leaves is a Hugging Face model that loads and
generates what the run printed."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest

import megatrain.cli
import megatrain.runtime.measure
from megatrain.examples import train_lm

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _quick_matmul_probe(monkeypatch):
    monkeypatch.setattr(megatrain.runtime.measure, "MATMUL_SECONDS", 0.02)


def test_make_train_runs_megatrain_train_with_the_examples_config(monkeypatch, tmp_path):
    recipe = re.search(r"^train:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert recipe.strip() == "$(PY) examples/train_lm.py $(ARGS)"
    calls = []
    monkeypatch.setattr(megatrain.cli, "main", lambda argv: calls.append(argv) or 0)
    assert train_lm.main(["--max-steps", "7"]) == 0
    argv = calls[0]
    assert argv[:3] == ["train", "--config", str(ROOT / "examples" / "train_lm.yaml")]
    assert argv[argv.index("--output-dir") + 1].startswith("runs/train_lm-")
    assert argv[argv.index("--data-cache") + 1] == "runs/token-cache" and argv[-2:] == ["--max-steps", "7"]
    # A given output directory or store is the user's.
    train_lm.main(["--output-dir", str(tmp_path), "--data-cache=" + str(tmp_path / "c")])
    assert "runs/token-cache" not in calls[1] and calls[1].count("--output-dir") == 1


def test_the_main_job_learns_and_leaves_a_model_that_generates_what_it_printed(tmp_path, capsys, monkeypatch):
    """40 steps of the main job's model on 400 KB of the standard library. The validation loss
    must fall below 85% of ln(vocab), the loss of the uniform prediction a fresh model starts near;
    the checkpoint loads with transformers' Auto classes and its greedy continuation of the printed
    prompt is the printed sample. With a load average of 9 on this machine the run says it is
    oversubscribed, at the start and in the progress line."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import megatrain.runtime.threads

    monkeypatch.setattr(megatrain.runtime.threads, "load_average", lambda: 9.0)

    out = tmp_path / "run"
    rc = train_lm.main(["--output-dir", str(out), "--data-cache", str(tmp_path / "tokens"), "--max-bytes", "400000",
                        "--max-steps", "40", "--warmup-steps", "5", "--eval-interval", "0", "--eval-batches", "4",
                        "--sample-tokens", "12"])
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 0, text[-3000:]
    busy = f"load 9.0 on {os.cpu_count()} CPU{'s' if os.cpu_count() > 1 else ''}: oversubscribed"
    assert re.search(rf"^threads: \d+ torch intra-op threads? \(.*\), OpenMP wait policy \w+.*; {busy}: steps slow",
                     text, re.M), text[:2000]
    assert "MFU " in captured.err and f", {busy}]" in captured.err  # the progress bar's last line
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    vocab = json.loads((ROOT / "examples" / "tiny-llama" / "config.json").read_text())["vocab_size"]
    assert rows[-1]["val_loss"] < 0.85 * math.log(vocab), rows[-1]
    ckpt = out / "checkpoint"
    assert f"model directory: {ckpt} " in text and f"metrics: {out / 'metrics.jsonl'}; loss curve: {out / 'loss.png'}" \
        in text and (out / "loss.png").stat().st_size > 0
    line = next(ln for ln in text.splitlines() if ln.startswith("sample (greedy): "))
    prompt, completion = (ast.literal_eval(s) for s in line[len("sample (greedy): "):].split(" -> "))
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True) == completion
    assert gen.shape[1] > ids.shape[1]


def test_user_text_file_and_tokenizer_are_accepted(tmp_path, capsys):
    import sysconfig

    from megatrain.data import load_documents, train_bpe_tokenizer

    src = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((src / name).read_text() for name in ("textwrap.py", "difflib.py", "argparse.py"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    tok = train_bpe_tokenizer(load_documents(corpus), vocab_size=300)
    tok.save(str(tmp_path / "tokenizer.json"))
    rc = train_lm.main(["--data", str(corpus), "--tokenizer", str(tmp_path / "tokenizer.json"), "--max-steps", "3",
                        "--warmup-steps", "1", "--eval-batches", "1", "--output-dir", str(tmp_path / "o"),
                        "--data-cache", str(tmp_path / "tokens"), "--sample-tokens", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and "vocab 300" in out and "validation loss" in out and "sample" not in out
    assert "cut the corpus" not in out  # max_bytes is null: all of the corpus
