"""megatrain's host optimizer step beside DeepSpeedCPUAdam and torch's fused AdamW, same tiles, same threads.

One run, interleaved: every round times each case once (each round in a shuffled order), on
tiles whose working set is ``HOST_TILE_L3_MULTIPLE`` x the L3
(``megatrain.runtime.measure.host_tile_numel``; ``--numel`` overrides), all on one thread with an
intra-op team of ``--threads`` (default: the host workers' budget, ``cost.host_worker_threads`` of
this machine's cores; ``set_thread_team``, as the CUDA backend's workers run). Every case steps
tensors of its own. A case's rate is its median round; a ratio is the median over the rounds of the
two cases' rates in that round, so that a slow spell of a shared machine, which hits the cases of
one round alike, cancels.

Cases (parameters updated per second unless said otherwise):

- ``megatrain``: :class:`megatrain.runtime.host_kernels.HostAdamW` with the kernel the executor runs
  (``$MEGATRAIN_HOST_ADAM``; DeepSpeed's where installed), FP32 gradients;
- ``megatrain_torch_kernel``: the same step forced onto torch's kernel;
- ``deepspeed_cpu_adam``: ``deepspeed.ops.adam.DeepSpeedCPUAdam.step()`` (skipped without DeepSpeed);
- ``torch_fused_adamw``: ``torch.optim.AdamW(fused=True).step()``;
- ``megatrain_bf16_grads``: megatrain's step from a BF16 gradient tile (widened chunk by chunk in
  the cache), and ``before_bf16_grads``: what the OPT did before, widen the whole tile into an FP32
  scratch, then torch's fused AdamW;
- ``cast``: a CAST, FP32 to BF16 (elements/s).

``ratios.megatrain_over_deepspeed_cpu_adam`` is the target (>= 1.0); ``call_us_1024_elements`` is
each AdamW case's time per call on a 1024-element tile, where the Python around the kernel shows
(the best of seven batches of calls). Then two before/after pairs of the host workers:
``host_streams``, the same OPT and CAST work on two threads at once each with a team of all the
cores (before) and through the CUDA backend's HOST and CAST workers over the fake CUDA layer
(after: one op at a time under one lock, each with the budget's team), wall seconds; and ``wait``,
the CPU seconds a host worker burns per second it waits for a GPU op, on the asynchronous fake
CUDA layer that spins on an event made without ``blocking=True`` as CUDA's default scheduling does
(before) and sleeps on a blocking one (after). Each kernel's step is also checked against
``torch.optim.AdamW`` on a small tile (``exactness``, relative error, bound 1e-5). Prints the JSON
and writes it with ``--out``.

Usage::

    .venv/bin/python bench/host_optimizer.py [--numel N] [--threads T] [--rounds 15] [--out r.json]
    .venv/bin/python bench/host_optimizer.py --dry-run   # small tiles, two rounds: what the test runs
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # appended: an installed megatrain wins, a plain checkout still imports

import torch  # noqa: E402

from megatrain.planner import cost  # noqa: E402
from megatrain.ir.hardware import cpu_name  # noqa: E402
from megatrain.runtime.host_kernels import HostAdamW, deepspeed_installed, run_on_team, set_thread_team  # noqa: E402
from megatrain.runtime.measure import host_cores, host_tile_numel, l3_cache  # noqa: E402

ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
EXACT_RTOL = 1e-5


def _deepspeed_adam(params: list[torch.Tensor]):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"], adamw_mode=True)


def kernel_times(numel: int, rounds: int) -> dict[str, tuple[int, list[float]]]:
    """Each case's elements and its seconds in each of ``rounds`` interleaved rounds (on the calling
    thread's team); every case steps tensors of its own."""
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=g) * 1e-3
    grad_bf16 = grad.bfloat16()
    start = torch.randn(numel, generator=g)
    scratch = torch.empty(numel)  # the whole-tile FP32 scratch the OPT widened into before

    def tiles() -> tuple[torch.Tensor, ...]:
        return start.clone(), torch.zeros(numel), torch.zeros(numel), torch.zeros(())

    def host_step(kernel: str | None, gradient: torch.Tensor, widen: bool = False) -> Callable[[], None]:
        adam, (p, m, v, step) = HostAdamW(kernel), tiles()

        def run() -> None:
            if widen:  # what the OPT of a BF16 tile did before: widen the whole tile, then step it
                scratch.copy_(gradient)
            adam.step(p, scratch if widen else gradient, m, v, step, **ADAMW)
        return run

    def param() -> torch.nn.Parameter:
        t = torch.nn.Parameter(start.clone())
        t.grad = grad.clone()
        return t

    src, dst = start.clone(), torch.empty(numel, dtype=torch.bfloat16)
    cases: dict[str, Callable[[], Any]] = {
        "megatrain": host_step(None, grad),
        "megatrain_torch_kernel": host_step("torch", grad),
        "torch_fused_adamw": torch.optim.AdamW([param()], fused=True, **ADAMW).step,
        "megatrain_bf16_grads": host_step(None, grad_bf16),
        "before_bf16_grads": host_step("torch", grad_bf16, widen=True),
        "cast": lambda: dst.copy_(src),
    }
    if deepspeed_installed():
        cases["deepspeed_cpu_adam"] = _deepspeed_adam([param()]).step
    for fn in cases.values():
        fn()  # warm: pages faulted in, the team started, DeepSpeed's op loaded
    times: dict[str, list[float]] = {k: [] for k in cases}
    names, order = list(cases), random.Random(0)
    for _ in range(rounds):
        # Each round in an order of its own: measured here, a fixed order (or a rotation of one,
        # which keeps each case's predecessor) favoured some cases by up to a third.
        order.shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: (numel, t) for name, t in times.items()}


def call_seconds(numel: int, calls: int) -> dict[str, float]:
    """Seconds per call of each AdamW case on a tile of ``numel`` elements small enough that the
    call's overhead shows (the best of seven batches of ``calls`` calls), on the calling thread's team."""
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(numel, generator=g) * 1e-3

    def param() -> torch.nn.Parameter:
        t = torch.nn.Parameter(torch.randn(numel, generator=g))
        t.grad = grad.clone()
        return t

    ours, (p, m, v, step) = HostAdamW(), (torch.randn(numel, generator=g), torch.zeros(numel), torch.zeros(numel),
                                          torch.zeros(()))
    cases = {"megatrain": lambda: ours.step(p, grad, m, v, step, **ADAMW),
             "torch_fused_adamw": torch.optim.AdamW([param()], fused=True, **ADAMW).step}
    if deepspeed_installed():
        cases["deepspeed_cpu_adam"] = _deepspeed_adam([param()]).step
    out = {}
    for name, fn in cases.items():
        for _ in range(calls // 10):
            fn()
        batches = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            batches.append((time.perf_counter() - t0) / calls)
        out[name] = min(batches)
    return out


def _paired(times: dict[str, tuple[int, list[float]]], a: str, b: str) -> float:
    """Median over the rounds of ``a``'s rate over ``b``'s in the same round."""
    (na, ta), (nb, tb) = times[a], times[b]
    return statistics.median((na / x) / (nb / y) for x, y in zip(ta, tb))


def exactness(numel: int = 4096, steps: int = 5) -> dict:
    """Relative error of each kernel's parameters against ``torch.optim.AdamW`` after ``steps`` steps."""
    g = torch.Generator().manual_seed(1)
    start = torch.randn(numel, generator=g)
    grads = [torch.randn(numel, generator=g) * 1e-2 for _ in range(steps)]
    ref = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([ref], foreach=False, **ADAMW)
    for gr in grads:
        ref.grad = gr.clone()
        opt.step()
    out = {}
    for kernel in ["torch"] + (["deepspeed"] if deepspeed_installed() else []):
        for dtype in (torch.float32, torch.bfloat16):
            p, m, v, step = start.clone(), torch.zeros(numel), torch.zeros(numel), torch.zeros(())
            want = ref.detach()
            if dtype is torch.bfloat16:  # the reference of BF16 gradients is their widened values
                r2 = torch.nn.Parameter(start.clone())
                o2 = torch.optim.AdamW([r2], foreach=False, **ADAMW)
                for gr in grads:
                    r2.grad = gr.bfloat16().float()
                    o2.step()
                want = r2.detach()
            adam = HostAdamW(kernel)
            for gr in grads:
                adam.step(p, gr.to(dtype), m, v, step, **ADAMW)
            out[f"{kernel}_{'bf16' if dtype is torch.bfloat16 else 'fp32'}_grads"] = \
                ((p - want).norm() / want.norm()).item()
    return out


def host_streams(numel: int, ops: int, threads: int, cores: int) -> dict:
    """Wall seconds of ``ops`` OPTs and ``ops`` CASTs of ``numel`` elements: before, two threads at
    once with a team of ``cores`` each; after, the CUDA backend's HOST and CAST workers (fake CUDA)."""
    from megatrain.ir.schedule import Stream
    from megatrain.runtime.cuda import CUDABackend
    from megatrain.testing import FakeCuda

    g = torch.Generator().manual_seed(2)
    p, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g) * 1e-3
    m, v, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(())
    dst = torch.empty(numel, dtype=torch.bfloat16)
    adam = HostAdamW()

    def opt() -> None:
        adam.step(p, grad, m, v, step, **ADAMW)

    def cast() -> None:
        dst.copy_(p)

    start, ends = threading.Barrier(3), []

    def full_team(f: Callable[[], None]) -> None:
        set_thread_team(cores)
        f()  # warm: this thread's pool started
        start.wait()
        for _ in range(ops):
            f()
        ends.append(time.perf_counter())

    workers = [threading.Thread(target=full_team, args=(f,)) for f in (opt, cast)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    before = max(ends) - t0
    be = CUDABackend(FakeCuda(), host_threads=threads)
    be.launch(Stream.HOST, opt, [])  # start the workers (and their teams) outside the timing
    be.launch(Stream.CAST, cast, [])
    be.synchronize()
    t0 = time.perf_counter()
    for _ in range(ops):
        be.launch(Stream.HOST, opt, [])
        be.launch(Stream.CAST, cast, [])
    be.synchronize()
    after = time.perf_counter() - t0
    be.close()
    return {"ops_each": ops, "numel": numel, "before_two_full_teams_s": before,
            "before_threads": 2 * cores, "after_one_budget_s": after, "after_threads": threads,
            "before_over_after": before / after}


def wait_cpu(wait_s: float) -> dict:
    """CPU seconds per second of waiting of a host worker whose op waits ``wait_s`` for a GPU op."""
    from megatrain.ir.schedule import Stream
    from megatrain.runtime.cuda import CUDABackend
    from megatrain.testing import AsyncFakeCuda

    class Spinning(AsyncFakeCuda):
        """Events made without blocking=True whatever the backend asks: the wait before this change."""

        def event(self, timing: bool, blocking: bool = False):
            return super().event(timing, False)

    out = {}
    for name, cls in (("before_spinning", Spinning), ("after_blocking", AsyncFakeCuda)):
        fake = cls(delay=lambda label: wait_s if label == "D2H" else 0.0)
        cpu: list[float] = []
        try:
            be = CUDABackend(fake)
            d2h = be.launch(Stream.D2H, lambda: None, [], label="D2H")
            be.launch(Stream.HOST, lambda: cpu.append(time.thread_time()), [d2h], label="OPT")
            be.synchronize()
            be.close()
        finally:
            fake.close()
        out[f"{name}_cpu_s_per_s"] = cpu[0] / wait_s
    return out


def run(numel: int | None, threads: int | None, rounds: int, dry: bool) -> dict:
    cores = host_cores()
    threads = threads or cost.host_worker_threads(cores)
    l3 = l3_cache()["total_bytes"]
    numel = numel or ((1 << 20) + 1237 if dry else host_tile_numel(16, l3))
    times = run_on_team(threads, lambda: kernel_times(numel, rounds))
    rates = {name: n / statistics.median(t) for name, (n, t) in times.items()}
    pairs = [("megatrain", "torch_fused_adamw"), ("megatrain_bf16_grads", "before_bf16_grads"),
             ("megatrain_bf16_grads", "megatrain"), ("cast", "megatrain")]
    if "deepspeed_cpu_adam" in times:
        pairs += [("megatrain", "deepspeed_cpu_adam"), ("deepspeed_cpu_adam", "torch_fused_adamw")]
    ratios = {f"{a}_over_{b}": _paired(times, a, b) for a, b in pairs}
    exact = exactness()
    small = run_on_team(threads, lambda: call_seconds(1024, 200 if dry else 2000))
    return {
        "bench": "host_optimizer", "date": datetime.date.today().isoformat(), "dry_run": dry,
        "machine": {"cpu": cpu_name(), "cores": cores, "l3_bytes": l3},
        "versions": {"torch": torch.__version__, "deepspeed": _deepspeed_version()},
        "megatrain_kernel": HostAdamW().kernel, "threads": threads, "numel": numel,
        "working_set_bytes": 16 * numel, "larger_than_l3": 16 * numel > l3 > 0, "rounds": rounds,
        "rates": rates, "ratios": ratios,
        "target": {"megatrain_over_deepspeed_cpu_adam": 1.0,
                   "met": (ratios["megatrain_over_deepspeed_cpu_adam"] >= 1.0 if "deepspeed_cpu_adam" in rates
                           else None)},
        "call_us_1024_elements": {k: t * 1e6 for k, t in small.items()},
        "exactness": {"max_rel_err_vs_torch_adamw": exact, "bound": EXACT_RTOL,
                      "ok": all(e <= EXACT_RTOL for e in exact.values())},
        "host_streams": host_streams(min(numel, 1 << 20 if dry else 1 << 23), 2 if dry else 8, threads, cores),
        "wait": wait_cpu(0.2 if dry else 1.0),
    }


def _deepspeed_version() -> str | None:
    if not deepspeed_installed():
        return None
    from importlib import metadata

    return metadata.version("deepspeed")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, help="elements per tile (default: 4x the L3 over 16 B/param)")
    ap.add_argument("--threads", type=int, help="intra-op threads of every case (default: the host workers' budget)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds; medians are kept (default 15)")
    ap.add_argument("--dry-run", action="store_true", help="a small tile and two rounds (what the test runs)")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    if a.numel is not None and a.numel < 1 or a.threads is not None and a.threads < 1 or a.rounds < 1:
        ap.error("--numel, --threads and --rounds must be >= 1")
    result = run(a.numel, a.threads, 2 if a.dry_run else a.rounds, a.dry_run)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return result


if __name__ == "__main__":
    main()
