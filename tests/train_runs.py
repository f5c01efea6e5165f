"""``megatrain train`` in this process for the failure-path tests (tests/test_guard.py,
tests/test_run_dir.py): a tiny Llama (2 layers, hidden 32, vocab 320) on 20 KB of this Python's
standard library, seq_len 32, as tests/test_train_cli.py runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import megatrain.runtime.measure

TINY = dict(model_type="llama", vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
RUN = """\
model: {model}
max_bytes: 20000
seq_len: 32
global_batch: 4
micro_batch_size: 2
eval_batches: 2
threads: 1
"""


def write_run(d: Path, **settings) -> Path:
    """``d`` with the tiny model's config.json and a run.yaml of :data:`RUN` plus ``settings``."""
    (d / "config.json").write_text(json.dumps(TINY))
    (d / "run.yaml").write_text(RUN.format(model=d / "config.json")
                                + "".join(f"{k}: {v}\n" for k, v in settings.items()))
    return d


def quick_probe(monkeypatch) -> None:
    """The MFU peak's matmul timing, 0.02 s instead of 0.3 s per run (again after ``monkeypatch.undo()``)."""
    monkeypatch.setattr(megatrain.runtime.measure, "MATMUL_SECONDS", 0.02)


@pytest.fixture(autouse=True)
def quick_matmul_probe(monkeypatch):
    quick_probe(monkeypatch)


def error_line(err: str) -> str:
    """The one ``error:`` line of a failed run's stderr (and no traceback)."""
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith(("train:", "[transformers]"))]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]
