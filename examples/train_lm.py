"""The main job: ``megatrain train`` with the settings of ``examples/train_lm.yaml``.

A 1.38 M-parameter Llama (``examples/tiny-llama/config.json``) trained from scratch on the source
of this interpreter's standard library (real text nobody here wrote; nothing is downloaded),
tokenised with a byte-level BPE trained on it, on the CPU. ``make train`` runs this; so does the
console script ``megatrain-train-lm``. It is exactly

    megatrain train --config examples/train_lm.yaml --output-dir runs/train_lm-<date-time> \\
        --data-cache runs/token-cache [FLAGS]

so it leaves what any ``megatrain train`` run leaves in its output directory: ``checkpoint/`` (a
Hugging Face model directory with its tokenizer), ``metrics.jsonl`` and ``loss.png``, and prints
where they are and a greedy sample. Flags are ``megatrain train``'s and win over the file::

    python examples/train_lm.py                                   # a few minutes on 2 CPU cores
    python examples/train_lm.py --data notes/ --max-steps 1000    # your text
    python examples/train_lm.py --templates compiled              # layer templates compiled once (inductor)
    megatrain-train-lm --model smollm2-135m --seq-len 512         # a preset, from scratch

The token store is kept in ``runs/token-cache`` (reused while the data and tokenizer are
unchanged); every run gets a new output directory unless ``--output-dir`` is given.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().with_name("train_lm.yaml")


def main(argv: list[str] | None = None) -> int:
    from megatrain.cli import main as cli

    argv = list(sys.argv[1:] if argv is None else argv)
    given = {a.split("=")[0] for a in argv}
    defaults = []
    if "--output-dir" not in given:
        defaults += ["--output-dir", f"runs/train_lm-{time.strftime('%Y%m%d-%H%M%S')}"]
    if "--data-cache" not in given:
        defaults += ["--data-cache", "runs/token-cache"]
    return cli(["train", "--config", str(CONFIG), *defaults, *argv])


if __name__ == "__main__":
    sys.exit(main())
