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
import torch

import megatrain.cli
import megatrain.runtime.measure
from megatrain.examples import sft_lm, train_lm

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

    # make sft on this model: a new run from its weights on the bundled alpaca set, loss on the answers.
    sft = tmp_path / "sft"
    rc = sft_lm.main(["--init-from", str(ckpt), "--output-dir", str(sft), "--max-steps", "4", "--warmup-steps", "1",
                      "--sample-tokens", "0"])
    text = capsys.readouterr().out
    assert rc == 0, text[-3000:]
    assert "(init_from: a new run from step 0 with fresh AdamW state; not a resume)" in text
    assert re.search(r"^data: 168 SFT examples from .*alpaca_demo\.json \(alpaca, 168\)", text, re.M), text[:3000]
    rows = [json.loads(line) for line in (sft / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(0 < r["supervised_tokens"] < r["tokens"] for r in rows), rows  # the answers, not the prompts
    tuned = AutoModelForCausalLM.from_pretrained(sft / "checkpoint")
    assert AutoTokenizer.from_pretrained(sft / "checkpoint").chat_template  # the template it was trained with
    assert any(not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), model.state_dict().values()))


def test_make_sft_fine_tunes_the_newest_make_train_model(monkeypatch, tmp_path, capsys):
    recipe = re.search(r"^sft:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert recipe.strip() == "$(PY) examples/sft_lm.py $(ARGS)"
    calls = []
    monkeypatch.setattr(megatrain.cli, "main", lambda argv: calls.append(argv) or 0)
    monkeypatch.chdir(tmp_path)
    assert sft_lm.main([]) == 2  # no make train run yet: one error line saying what to do
    assert "run `make train` first, or pass --init-from" in capsys.readouterr().err and not calls
    for name in ("train_lm-20261127-090000", "train_lm-20261127-100000", "train_lm-20261127-110000"):
        (tmp_path / "runs" / name / "checkpoint").mkdir(parents=True)
    for name in ("train_lm-20261127-090000", "train_lm-20261127-100000"):  # the newest has no model yet
        (tmp_path / "runs" / name / "checkpoint" / "config.json").write_text("{}")
    assert sft_lm.main(["--max-steps", "7"]) == 0
    argv = calls[0]
    assert argv[:3] == ["train", "--config", str(ROOT / "examples" / "sft_lm.yaml")]
    assert argv[argv.index("--init-from") + 1] == str(Path("runs/train_lm-20261127-100000/checkpoint"))
    assert argv[argv.index("--output-dir") + 1].startswith("runs/sft_lm-") and argv[-2:] == ["--max-steps", "7"]
    sft_lm.main(["--init-from", "x"])
    assert calls[1].count("--init-from") == 1 and "x" in calls[1]


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
