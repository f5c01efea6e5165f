"""The bundled GRPO example (``examples/grpo_arithmetic.yaml``) over several seeds: its curve.

Each seed is a child process, ``megatrain train --config examples/grpo_arithmetic.yaml --seed N
--threads 1`` (``--jobs`` at a time), and the report gives, per seed, the mean reward (with the
example's exact-match reward: the exact-match accuracy) of each ``--window`` steps, the wall and
CPU seconds of the child (``os.wait4``: its own user + system time, what a loaded machine does not
inflate as much as wall time) and the 1-minute load average when it started.

    .venv/bin/python bench/grpo_seeds.py [--seeds 0,1,2,3] [--steps 300] [--window 20] [--jobs 2] [--json out.json]

Extra ``megatrain train`` flags after ``--`` go to every child (``-- --lr 3e-3``).
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

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "grpo_arithmetic.yaml"


def _shown(path: str) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        pending, running = list(seeds), {}
        while pending or running:
            while pending and len(running) < args.jobs:
                seed = pending.pop(0)
                out = Path(tmp) / f"seed{seed}"
                cmd = [sys.executable, "-m", "megatrain.cli", "train", "--config", args.config, "--seed", str(seed),
                       "--max-steps", str(args.steps), "--threads", "1", "--output-dir", str(out), *extra]
                p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                running[p.pid] = (p, seed, out, time.perf_counter(), os.getloadavg()[0])
            pid, status, usage = os.wait4(-1, 0)
            if pid not in running:
                continue
            p, seed, out, t0, load = running.pop(pid)
            wall = time.perf_counter() - t0
            err = p.stderr.read()
            if os.waitstatus_to_exitcode(status) != 0:
                print(err, file=sys.stderr)
                raise SystemExit(f"seed {seed} failed")
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            r = [row["reward_mean"] for row in rows]
            w = args.window
            results[seed] = {"wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
                             "load_1min": load, "reward_by_window": [round(sum(r[a:a + w]) / len(r[a:a + w]), 3)
                                                                     for a in range(0, len(r), w)],
                             "reward_per_step": [round(x, 4) for x in r]}
            print(f"seed {seed}: {wall:.1f} s wall, {results[seed]['cpu_s']} s CPU (load {load:.1f}); mean reward per "
                  f"{w} steps: {results[seed]['reward_by_window']}", flush=True)
    report = {"date": datetime.date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs", "config": _shown(args.config), "steps": args.steps, "extra_flags": extra,
              "window": args.window, "seeds": {str(s): results[s] for s in seeds}}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
