"""The CPU backend on a busy machine: torch's default threads against megatrain's choice, side by side.

Each measurement is a child process that trains the main job's model (``examples/tiny-llama``:
a 1.38 M-parameter Llama, seq 128, global batch 16 as 2 micro-batches of 8, clipped, packed
``position_ids``: what ``make train`` runs) for ``--warmup`` steps and times ``--steps`` more, and
reports the median step. Three settings of the child:

- ``torch-default``: what a plain ``import torch`` gets: torch's default intra-op threads (one
  per physical core) and OpenMP's default wait policy (threads spin before they sleep);
- ``megatrain``: ``megatrain.runtime.threads``: ``OMP_WAIT_POLICY=PASSIVE`` set before torch is
  imported and :func:`~megatrain.runtime.threads.choose_threads` (``megatrain train``'s choice);
- ``one-thread``: the passive policy and one thread, for reference.

Each runs idle and with one busy process beside it (a Python ``while True: pass``, one core's
worth of load), in turns (``--reps`` rounds of every setting, idle then busy), so that load from
elsewhere falls on all of them alike. The report gives each setting's median step idle and busy,
busy / idle, and the default's step over megatrain's. "Idle" is whatever else the machine runs:
the 1-minute load average before each child is recorded.

    .venv/bin/python bench/cpu_threads.py [--reps 2] [--steps 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "tiny-llama" / "config.json"
SETTINGS = ("torch-default", "megatrain", "one-thread")

CHILD = """
import json, os, statistics, sys, time
setting, steps, warmup, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if setting != "torch-default":
    from megatrain.runtime.threads import prefer_passive_wait
    prefer_passive_wait()
import torch
from megatrain.runtime.threads import choose_threads, wait_policy
if setting == "megatrain":
    choose_threads()
elif setting == "one-thread":
    choose_threads(1)
from transformers import AutoConfig, AutoModelForCausalLM
import megatrain
torch.manual_seed(0)
config = AutoConfig.from_pretrained(model)
tr = megatrain.compile(AutoModelForCausalLM.from_config(config), seq_len=128, micro_batch_size=8, micro_batches=2,
                       max_grad_norm=1.0, input_names=("input_ids", "position_ids", "labels"), plan="default")
ids = torch.randint(0, config.vocab_size, (16, 128), generator=torch.Generator().manual_seed(0))
batch = {"input_ids": ids, "position_ids": torch.arange(128).repeat(16, 1), "labels": ids}
for _ in range(warmup):
    tr.step(batch)
times = []
for _ in range(steps):
    t0 = time.perf_counter()
    tr.step(batch)
    times.append(time.perf_counter() - t0)
print(json.dumps({"threads": torch.get_num_threads(), "wait_policy": wait_policy(),
                  "median_step_s": statistics.median(times), "min_step_s": min(times)}))
"""


def _child(setting: str, steps: int, warmup: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    p = subprocess.run([sys.executable, "-c", CHILD, setting, str(steps), str(warmup), str(MODEL)],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"the {setting} child failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(reps: int, steps: int, warmup: int) -> dict:
    runs = []
    for rep in range(reps):
        for busy in (False, True):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for setting in SETTINGS:
                    load = os.getloadavg()[0]
                    r = _child(setting, steps, warmup)
                    runs.append({"rep": rep, "busy": busy, "setting": setting, "load_before": load, **r})
                    print(f"rep {rep} {'busy' if busy else 'idle'} {setting:>13}: {r['threads']} threads, "
                          f"{r['wait_policy']}, median step {r['median_step_s']:.3f} s (load {load:.1f})", flush=True)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    summary = {}
    for setting in SETTINGS:
        med = {b: statistics.median(r["median_step_s"] for r in runs if r["setting"] == setting and r["busy"] == b)
               for b in (False, True)}
        summary[setting] = {"idle_step_s": med[False], "busy_step_s": med[True], "busy_over_idle": med[True] / med[False]}
    for key in ("idle_step_s", "busy_step_s"):
        summary[f"default_over_megatrain_{key[:-7]}"] = summary["torch-default"][key] / summary["megatrain"][key]
    return {"runs": runs, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="rounds of every setting, idle then busy (default 2)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per child (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--json", type=Path, default=None, help="write the runs and the summary here")
    args = p.parse_args(argv)
    result = measure(args.reps, args.steps, args.warmup)
    s = result["summary"]
    print("\n| setting | idle step (s) | with one busy process (s) | busy / idle |\n| --- | ---: | ---: | ---: |")
    for setting in SETTINGS:
        r = s[setting]
        print(f"| {setting} | {r['idle_step_s']:.3f} | {r['busy_step_s']:.3f} | {r['busy_over_idle']:.2f} |")
    print(f"\ntorch-default / megatrain: {s['default_over_megatrain_idle']:.2f} idle, "
          f"{s['default_over_megatrain_busy']:.2f} busy")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "machine": platform.node(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "reps": args.reps, "steps": args.steps, **result}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
