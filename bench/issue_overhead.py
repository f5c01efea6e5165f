"""The issuing thread's cost per op, this tree beside a baseline revision, measured side by side in one run.

On a GPU one Python thread walks the schedule: for every schedule op the executor builds the op's
work and hands it to the CUDA backend, which queues it, records and waits on events, and launches
it; the op's own kernels (a layer's ~100 forward aten ops) come on top. This script times the first
part, what megatrain adds per schedule op, with the op's work skipped, so no kernel cost hides it:

- ``executor``: ``Executor.run`` of the schedule of a traced tiny Llama (``--layers`` blocks, default
  plan, 2 micro-batches) on the real :class:`~megatrain.runtime.cuda.CUDABackend` over a null CUDA
  adapter (streams, events and waits are records; each op's work is not run): seconds of the
  issuing thread per schedule op, handlers, launch, issue queue and event bookkeeping included.
- ``replay``: :func:`megatrain.testing.replay.replay` of the same schedule on its fake CUDA layer
  (streams as threads) with every op and launch time zero: the backend's issue path, its host
  workers and the fake's threads per op.

And, this tree only, the other part: ``launch``, the issuing thread's seconds per dispatched aten op
of a template-like op (a small Llama block's forward and local backward,
:func:`megatrain.runtime.measure.measure_launch_overhead`, what ``measure_hardware()`` now puts in
``HardwareSpec.launch_overhead_s``) beside the same figure for ``x.add_(1)``, the op the figure
came from before; on the CPU with one intra-op thread, so the figure is dispatch plus tiny CPU
kernels (on a GPU the kernels run on the device).

Method. The baseline is ``git archive <--baseline> megatrain`` unpacked into a temporary directory
and imported through ``PYTHONPATH``. Each trial runs each tree in a fresh process, alternating
(baseline, current, baseline, ...), so both see the same machine load; each process reports the
median of ``--runs`` timed runs after two warm-up runs. The result is the median over ``--trials``
and the ratio baseline / current (> 1: the current tree is faster). JSON to ``--out`` or stdout.

Usage::

    .venv/bin/python bench/issue_overhead.py [--baseline main] [--trials 5] [--runs 40] [--layers 8] [--out f.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# -- the worker: runs in the tree under test (this one, or the baseline through PYTHONPATH) --------------

class NullCuda:
    """A CUDA adapter whose calls cost (almost) nothing and whose ops do no work: what is left of a
    run is megatrain's own Python per op."""

    def __init__(self):
        import torch

        self.device = torch.device("cpu")

    def stream(self):
        return object()

    def current_stream(self):
        return None

    def use_stream(self, stream):
        return contextlib.nullcontext(stream)

    def run(self, stream, fn, label):
        pass

    def host_run(self, fn, label):
        pass

    def record_stream(self, t):
        pass

    def event(self, timing):
        return [False]

    def record(self, event, stream):
        event[0] = True

    def wait_event(self, stream, event):
        pass

    def event_synchronize(self, event):
        pass

    def event_query(self, event):
        return event[0]

    def elapsed_s(self, start, end):
        return 0.0

    def host_time(self, event):
        return time.perf_counter()

    def synchronize(self):
        pass

    def empty(self, shape, dtype):
        import torch

        return torch.empty(shape, dtype=dtype)

    pinned_empty = empty

    def host_register(self, t):
        return None


def _median_per_op(run, ops: int, runs: int) -> float:
    """Median CPU seconds of the calling thread per op (``time.thread_time``: on a loaded machine the
    time the thread is descheduled would swamp wall-clock figures)."""
    for _ in range(2):
        run()
    times = []
    for _ in range(runs):
        t0 = time.thread_time()
        run()
        times.append((time.thread_time() - t0) / ops)
    return statistics.median(times)


def worker(layers: int, runs: int, launch: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import megatrain
    from megatrain.ir.hardware import preset
    from megatrain.runtime.cuda import CUDABackend
    from megatrain.testing.replay import replay

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    trainer = megatrain.compile(LlamaForCausalLM(cfg), seq_len=8, micro_batch_size=1, micro_batches=2)
    ex, schedule = trainer.executor, trainer.schedule
    ex.backend = CUDABackend(adapter=NullCuda())
    ids = torch.randint(0, 64, (1, 8))
    mbs = [{"input_ids": ids, "labels": ids}] * 2
    out = {"ops": len(schedule.ops), "torch": torch.__version__, "megatrain": megatrain.__file__,
           "executor_s_per_op": _median_per_op(lambda: ex.run(schedule, mbs), len(schedule.ops), runs)}
    # Every op and launch free: what the replay measures is the backend and the fake's threads.
    hw = preset("H100_SXM").model_copy(update=dict(
        op_latency_s=0.0, launch_overhead_s=0.0, bf16_flops=1e30, fp32_flops=1e30, h2d_bytes_per_s=1e30,
        d2h_bytes_per_s=1e30, host_optimizer_params_per_s=1e30))
    out["replay_s_per_op"] = _median_per_op(lambda: replay(schedule, trainer.graph, hw), len(schedule.ops),
                                            max(3, runs // 4))
    if launch:
        from megatrain.runtime.measure import measure_launch_overhead

        # One intra-op thread: on a shared 2-core machine the CPU kernels' thread pool would wait for
        # cores far longer than a GPU launch takes (on a GPU no CPU kernel runs).
        torch.set_num_threads(1)
        out["launch_template_s_per_op"] = measure_launch_overhead("cpu", clock=time.thread_time)
        x = torch.zeros(1)
        out["launch_add_s_per_op"] = _median_per_op(lambda: [x.add_(1.0) for _ in range(1000)], 1000, runs)
    return out


# -- the driver -------------------------------------------------------------------------------------------

def _baseline_tree(rev: str, into: Path) -> Path:
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev, "megatrain"], check=True,
                          capture_output=True).stdout
    archive = into / "baseline.tar"
    archive.write_bytes(data)
    with tarfile.open(archive) as t:
        t.extractall(into, filter="data")
    return into


def _run_worker(pythonpath: str | None, args: argparse.Namespace, launch: bool) -> dict:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--layers", str(args.layers),
           "--runs", str(args.runs)] + (["--launch"] if launch else [])
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if res.returncode:
        raise RuntimeError(f"worker failed ({'baseline' if pythonpath else 'current'}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="main", help="git revision to compare with (default: main)")
    p.add_argument("--trials", type=int, default=5, help="process pairs, alternating (default 5)")
    p.add_argument("--runs", type=int, default=40, help="timed runs per process (default 40)")
    p.add_argument("--layers", type=int, default=8, help="blocks of the tiny Llama (default 8)")
    p.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.layers, args.runs, args.launch)))
        return {}
    keys = ("executor_s_per_op", "replay_s_per_op")
    with tempfile.TemporaryDirectory() as tmp:
        base_path = str(_baseline_tree(args.baseline, Path(tmp)))
        base, cur = [], []
        for k in range(args.trials):
            base.append(_run_worker(base_path, args, launch=False))
            cur.append(_run_worker(None, args, launch=k == 0))
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs", "baseline": args.baseline, "ops_per_run": cur[0]["ops"],
              "layers": args.layers, "trials": args.trials, "runs": args.runs}
    for key in keys:
        b, c = statistics.median(r[key] for r in base), statistics.median(r[key] for r in cur)
        result[key] = {"baseline_us": b * 1e6, "current_us": c * 1e6, "baseline_over_current": b / c,
                       "baseline_all_us": [r[key] * 1e6 for r in base], "current_all_us": [r[key] * 1e6 for r in cur]}
    for key in ("launch_template_s_per_op", "launch_add_s_per_op"):
        result[key.replace("_s_", "_us_")] = cur[0][key] * 1e6
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
