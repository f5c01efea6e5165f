"""The main job end to end on real text, shortened to fit the suite."""

from __future__ import annotations

import re

from megatrain.examples.train_lm import MIN_LR_RATIO, main
from megatrain.train import lr_at


def test_learning_rate_warms_up_then_decays_to_a_tenth_at_the_last_step():
    # The example runs megatrain train's schedule: the last step taken (total - 1) is at the floor.
    peak, warm, total = 1e-3, 10, 100
    lrs = [lr_at(s, lr=peak, warmup_steps=warm, max_steps=total, min_lr_ratio=MIN_LR_RATIO) for s in range(total + 1)]
    assert lrs[0] == peak / warm and lrs[warm - 1] == peak and lrs[warm] == peak
    assert all(a >= b for a, b in zip(lrs[warm:], lrs[warm + 1:]))
    assert abs(lrs[total - 1] - 0.1 * peak) < 1e-12 and abs(lrs[total] - 0.1 * peak) < 1e-12


def test_short_run_on_stdlib_text_lowers_validation_loss(capsys):
    rc = main(["--steps", "60", "--max-bytes", "400000", "--vocab-size", "512", "--layers", "2",
               "--hidden-size", "64", "--seq-len", "64", "--micro-batch-size", "4", "--micro-batches", "2",
               "--warmup", "10", "--eval-batches", "4", "--eval-every", "0"])
    out = capsys.readouterr().out
    assert rc == 0
    m = re.search(r"validation loss ([\d.]+) \(step 0: ([\d.]+), ratio", out)
    assert m, out[-2000:]
    final, start = float(m.group(1)), float(m.group(2))
    assert final < 0.85 * start, f"validation loss {start} -> {final}"


def test_user_text_file_and_tokenizer_are_accepted(tmp_path, capsys):
    import sysconfig
    from pathlib import Path

    from megatrain.data import load_documents, train_bpe_tokenizer

    src = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((src / name).read_text() for name in ("textwrap.py", "difflib.py", "argparse.py"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    tok = train_bpe_tokenizer(load_documents(corpus), vocab_size=300)
    tok.save(str(tmp_path / "tokenizer.json"))
    rc = main(["--data", str(corpus), "--tokenizer", str(tmp_path / "tokenizer.json"), "--steps", "3",
               "--layers", "1", "--hidden-size", "32", "--seq-len", "32", "--micro-batch-size", "2",
               "--micro-batches", "1", "--eval-batches", "1", "--eval-every", "0", "--warmup", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "vocab 300" in out and "validation loss" in out
