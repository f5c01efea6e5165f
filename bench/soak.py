"""Soak: does host memory stay flat over a long CPU run of ``megatrain train``?

Runs ``python -m megatrain.cli train`` in a child process on the main job's model and data (the tiny
Llama of ``examples/train_lm.py``: 4 layers, hidden 128, FFN 384, 4 heads, vocab 2048, seq 128,
global batch 16 as 2 micro-batches of 8, on 3 MB of this Python's standard library) for 300 steps,
evaluating and saving a checkpoint every 40 steps, so that evaluation and checkpointing are soaked
too. The child records its resident set size after every step (``host_rss_mib`` in
``metrics.jsonl``, from ``/proc/self/statm``); this script reads it back and reports the RSS at the
end of warm-up (step 50: every code path, the first evaluation and checkpoint included, has run and
the allocators' caches have filled), at the last step, the growth between them, and the peak.
The first evaluation and checkpoint raise RSS once by 10-20 MiB (their buffers stay cached), which
is why warm-up ends after them.

Usage::

    .venv/bin/python bench/soak.py [--steps 300] [--warmup 50] [--threads N] [--json soak.json]
                                    [--max-growth-mib 32]

With ``--max-growth-mib`` the exit code is 1 when the growth after warm-up exceeds it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatrain.ir.hardware import cpu_name

ROOT = Path(__file__).resolve().parents[1]

MODEL = dict(model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
             tie_word_embeddings=False)
CONFIG = dict(max_bytes=3_000_000, seq_len=128, global_batch=16, micro_batch_size=8, lr=3e-3, warmup_steps=30,
              weight_decay=0.1, beta1=0.9, beta2=0.95, max_grad_norm=1.0, eval_interval=40, eval_batches=4,
              checkpoint_interval=40, nonfinite="stop", device="cpu")  # a CPU soak on any machine (device auto: a GPU)


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    return ys[len(ys) // 2] if len(ys) % 2 else (ys[len(ys) // 2 - 1] + ys[len(ys) // 2]) / 2


def soak(steps: int, warmup: int, threads: int | None, workdir: Path) -> dict:
    """Run the child and summarise its per-step RSS; raises RuntimeError when the run fails."""
    (workdir / "config.json").write_text(json.dumps(MODEL))
    cfg = dict(CONFIG, model=str(workdir / "config.json"), output_dir=str(workdir / "out"), max_steps=steps,
               warmup_steps=min(CONFIG["warmup_steps"], steps))
    if threads:
        cfg["threads"] = threads
    (workdir / "soak.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "megatrain.cli", "train", "--config", str(workdir / "soak.json")]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"megatrain train exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (workdir / "out" / "metrics.jsonl").read_text().splitlines()]
    rss = [r["host_rss_mib"] for r in rows]
    if len(rss) != steps or any(x is None for x in rss):
        raise RuntimeError(f"expected {steps} steps with host_rss_mib in metrics.jsonl, got {len(rss)}")
    at_warmup, at_end = rss[warmup - 1], rss[-1]
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core CPU ({cpu_name()})",
        "python": platform.python_version(),
        "command": " ".join(cmd),
        "config": cfg,
        "model": MODEL,
        "steps": steps,
        "warmup_step": warmup,
        "wall_s": round(wall, 1),
        "rss_mib_at_warmup": round(at_warmup, 1),
        "rss_mib_at_end": round(at_end, 1),
        "growth_mib": round(at_end - at_warmup, 1),
        "growth_mib_per_100_steps": round((at_end - at_warmup) / (steps - warmup) * 100, 2),
        # Single samples jitter by ~10 MiB (allocator caches, evaluation and checkpoint buffers):
        # medians of the 20 steps ending at each point are the steadier comparison.
        "rss_mib_median_20_at_warmup": round(_median(rss[max(0, warmup - 20):warmup]), 1),
        "rss_mib_median_20_at_end": round(_median(rss[-20:]), 1),
        "rss_mib_peak": round(max(rss), 1),
        "rss_mib_first_step": round(rss[0], 1),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "val_loss_last": rows[-1]["val_loss"],
        "median_step_s": sorted(r["measured_step_s"] for r in rows)[len(rows) // 2],
        "rss_mib": [round(x, 2) for x in rss],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--warmup", type=int, default=50, help="the step whose RSS is the baseline (default 50)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads of the child")
    p.add_argument("--json", type=Path, default=Path("soak.json"), help="where to write the result")
    p.add_argument("--max-growth-mib", type=float, default=None, help="exit 1 when RSS grows more after warm-up")
    args = p.parse_args(argv)
    if not 1 <= args.warmup < args.steps:
        p.error(f"--warmup ({args.warmup}) must be in [1, --steps ({args.steps}))")
    with tempfile.TemporaryDirectory(prefix="megatrain-soak-") as d:
        result = soak(args.steps, args.warmup, args.threads, Path(d))
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"soak, {result['date']}, {result['machine']}: {result['steps']} steps in {result['wall_s']} s; RSS "
          f"{result['rss_mib_at_warmup']} MiB at step {result['warmup_step']}, {result['rss_mib_at_end']} MiB at "
          f"step {result['steps']} (growth {result['growth_mib']:+} MiB, {result['growth_mib_per_100_steps']:+} MiB "
          f"per 100 steps; medians of 20 steps {result['rss_mib_median_20_at_warmup']} -> "
          f"{result['rss_mib_median_20_at_end']} MiB), peak {result['rss_mib_peak']} MiB; loss "
          f"{result['loss_first']:.3f} -> {result['loss_last']:.3f}; wrote {args.json}")
    if args.max_growth_mib is not None and result["growth_mib"] > args.max_growth_mib:
        print(f"RSS grew {result['growth_mib']} MiB after warm-up, more than --max-growth-mib {args.max_growth_mib}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
