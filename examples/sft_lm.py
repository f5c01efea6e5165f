"""``make sft``: fine-tune the main job's model on a bundled alpaca-style set, on the CPU.

Starts a new run from the weights of the newest ``runs/train_lm-*/checkpoint`` that ``make train``
left (``--init-from``: fresh AdamW state, its own learning-rate schedule; not a resume) and
trains it with ``--task sft`` on ``examples/data/alpaca_demo.json`` (Python questions with short
answers; loss on the answers only) with the settings of ``examples/sft_lm.yaml``. It is exactly

    megatrain train --config examples/sft_lm.yaml --init-from runs/train_lm-<newest>/checkpoint \\
        --output-dir runs/sft_lm-<date-time> [FLAGS]

and leaves what any ``megatrain train`` run leaves: ``checkpoint/`` (a Hugging Face model with its
tokenizer and the chat template used), ``metrics.jsonl``, ``loss.png``. Flags are
``megatrain train``'s and win over the file::

    python examples/sft_lm.py                                        # after make train
    python examples/sft_lm.py --init-from runs/pretrain/checkpoint --data chats.jsonl

Exits with status 2 and one ``error:`` line when no ``--init-from`` is given and ``runs/`` holds
no finished ``make train`` run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().with_name("sft_lm.yaml")


def newest_pretrained(runs: Path = Path("runs")) -> Path | None:
    """The checkpoint of the newest ``make train`` run under ``runs`` (by the date-time in its name),
    or None when there is none with a saved model (``config.json``)."""
    done = [d / "checkpoint" for d in runs.glob("train_lm-*") if (d / "checkpoint" / "config.json").is_file()]
    return max(done, key=lambda c: c.parent.name, default=None)


def main(argv: list[str] | None = None) -> int:
    from megatrain.cli import main as cli

    argv = list(sys.argv[1:] if argv is None else argv)
    given = {a.split("=")[0] for a in argv}
    defaults = []
    if "--init-from" not in given:
        ckpt = newest_pretrained()
        if ckpt is None:
            print(f"error: no model to fine-tune: {Path('runs').absolute()} holds no finished `make train` run "
                  "(runs/train_lm-*/checkpoint); run `make train` first, or pass --init-from CHECKPOINT",
                  file=sys.stderr)
            return 2
        defaults += ["--init-from", str(ckpt)]
    if "--output-dir" not in given:
        defaults += ["--output-dir", f"runs/sft_lm-{time.strftime('%Y%m%d-%H%M%S')}"]
    return cli(["train", "--config", str(CONFIG), *defaults, *argv])


if __name__ == "__main__":
    sys.exit(main())
