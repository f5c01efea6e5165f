"""megatrain's host optimizer step beside DeepSpeedCPUAdam and torch's fused AdamW, same tiles, same threads.

One run, interleaved: every round times each case once (each round in a shuffled order), on
tiles whose working set is ``HOST_TILE_L3_MULTIPLE`` x the L3
(``megatrain.runtime.measure.host_tile_numel``; ``--numel`` overrides), all on one thread with an
intra-op team of ``--threads`` (default: the host workers' budget, ``cost.host_worker_threads`` of
this machine's cores; ``set_thread_team``, as the CUDA backend's workers run). Every case steps
the same tensors, laid out as megatrain's host state lays out a layer (:func:`kernel_times` says
why). Each round times every case by wall seconds and by this process's CPU seconds, which leave
out the time other jobs of a shared machine hold the cores. A case's rate is its median round (of
wall seconds); a ratio is the median over the rounds of the two cases' rates in that round, so that
a slow spell, which hits the cases of one round alike, cancels: ``ratios`` of wall seconds,
``cpu_ratios`` of CPU seconds. ``rate_spread``, ``ratio_spread`` and ``cpu_ratio_spread`` give the
lowest, the quartiles and the highest over the rounds, and ``dram_bytes_per_param`` each case's
host memory traffic.

Cases (parameters updated per second unless said otherwise):

- ``megatrain``: :class:`megatrain.runtime.host_kernels.HostAdamW` with the kernel the executor runs
  (``$MEGATRAIN_HOST_ADAM``; torch's fused AdamW by default), FP32 gradients;
- ``megatrain_deepspeed_kernel``: the same step on DeepSpeed's kernel (skipped without DeepSpeed);
- ``deepspeed_cpu_adam``: ``deepspeed.ops.adam.DeepSpeedCPUAdam.step()`` (skipped without DeepSpeed);
- ``torch_fused_adamw``: ``torch.optim.AdamW(fused=True).step()``;
- ``megatrain_bf16_grads``: megatrain's step from a BF16 gradient tile (widened chunk by chunk in
  the cache), and ``before_bf16_grads``: what the OPT did before, widen the whole tile into an FP32
  scratch, then torch's fused AdamW;
- ``cast``: a CAST, FP32 to BF16 (elements/s);
- end to end, the step and the BF16 copy of the new master that the next H2D reads:
  ``megatrain_step_and_cast`` (``HostAdamW.step(cast_into=)``: each stepped chunk cast while in
  the cache), ``megatrain_bf16_grads_step_and_cast`` (the same from BF16 gradients),
  ``megatrain_then_cast`` (the step, then a CAST of the whole tile: what the runtime's schedule
  runs today, the CAST being an op of its own) and ``deepspeed_cpu_adam_then_cast``
  (``DeepSpeedCPUAdam.step()``, then that cast).

The target (``target``) is ``megatrain_step_and_cast_over_deepspeed_cpu_adam_then_cast`` >= 1.0
(``met``: of CPU seconds; ``met_wall``: of wall seconds). With FP32 gradients ``megatrain`` and
``deepspeed_cpu_adam`` run the same C++ op on the same bytes, so their ratio is 1 but for the
Python around the op and the machine's noise; megatrain's step is faster only where it moves fewer
bytes, and the fused copy saves the cast's read of the master (30 bytes per parameter against 34).
The comparison is of the host's work for a BF16 H2D, as megatrain runs it; a DeepSpeed that copies
FP32 masters to the GPU and casts them there moves 4 bytes per parameter over PCIe instead of 2.
``call_us_1024_elements`` is each AdamW case's time per call on a 1024-element tile, where the
Python around the kernel shows (the best of seven batches of calls).

The issuing thread (``issuing_thread``): a host op runs on a host worker while the main thread
issues GPU work, so a kernel that holds the Python GIL freezes issue for its whole call (DeepSpeed's
``adam_update`` does; torch's ops release it). Each case of :data:`STALL_CASES` and each other host
op the CUDA backend's workers run (ACC, Lion, NVMe write and read: :func:`host_op_cases`) runs on a
worker thread with the budget's team while the main thread ticks (:func:`issue_stall`): the call's
time, the issuing thread's longest stall and its stalled fraction. The target (``stall_target``):
the default kernel's (``megatrain``) stalled fraction < 5%. Then two before/after pairs
of the host workers: ``host_streams``, the same OPT and CAST work on two threads at once each with
a team of all the cores (before) and through the CUDA backend's HOST and CAST workers over the
fake CUDA layer (after: one op at a time under one lock, each with the budget's team), wall
seconds; and ``wait``, the CPU seconds a host worker burns per second it waits for a GPU op, on
the asynchronous fake CUDA layer that spins on an event made without ``blocking=True`` as CUDA's
default scheduling does (before) and sleeps on a blocking one (after). Each kernel's step, plain
and with ``cast_into``, is also checked against ``torch.optim.AdamW`` on a small tile
(``exactness``, relative error, bound 1e-5). Prints the JSON and writes it with ``--out``.

Usage::

    .venv/bin/python bench/host_optimizer.py [--numel N] [--threads T] [--rounds 31] [--out r.json]
    .venv/bin/python bench/host_optimizer.py --dry-run   # small tiles, two rounds: what the test runs
"""

from __future__ import annotations

import argparse
import array
import bisect
import datetime
import itertools
import json
import os
import random
import statistics
import sys
import threading
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # appended: an installed megatrain wins, a plain checkout still imports

import torch  # noqa: E402

from megatrain.planner import cost  # noqa: E402
from megatrain.ir.hardware import cpu_name  # noqa: E402
from megatrain.runtime.host import page_aligned_empty  # noqa: E402
from megatrain.runtime.host_kernels import (CHUNK_ELEMENTS, HostAdamW, deepspeed_installed, run_on_team,  # noqa: E402
                                            set_thread_team)
from megatrain.runtime.measure import host_cores, host_tile_numel, l3_cache  # noqa: E402

ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
EXACT_RTOL = 1e-5
TARGET = "megatrain_step_and_cast_over_deepspeed_cpu_adam_then_cast"
TARGET_WHAT = ("end to end, what the GPU needs from the host per parameter: the AdamW step from FP32 gradients and "
               "the BF16 copy of the new master that the next H2D reads; megatrain fuses the copy into its step "
               "(HostAdamW.step cast_into), DeepSpeedCPUAdam.step has no such output and is followed by the cast. "
               "met: the median of the per-round ratios of CPU seconds (not counting time the machine's other "
               "jobs took the cores) >= 1; met_wall: the same of wall seconds. megatrain's runtime schedule still "
               "runs the CAST as an op of its own (megatrain_then_cast)")
# Host DRAM traffic per parameter (bytes read + written) of each case, if each tile is read or
# written once per pass and a chunk (or the widened gradients) stays in the cache: master and two
# moments read and written (24), the gradient read (4 FP32, 2 BF16), a separate cast reads the
# master (4) and writes BF16 (2), a fused one writes only; the whole-tile widening writes the FP32
# scratch and reads it back (8).
# megatrain's whole-tile FP32-gradient step sums the stepped tile after it (the finite check): 4 more.
DRAM_BYTES = {"megatrain": 32, "megatrain_in_chunks": 28, "megatrain_deepspeed_kernel": 32, "torch_fused_adamw": 28,
              "deepspeed_cpu_adam": 28,
              "megatrain_bf16_grads": 26, "before_bf16_grads": 34, "cast": 6,
              "megatrain_step_and_cast": 30, "megatrain_bf16_grads_step_and_cast": 28,
              "megatrain_then_cast": 38, "deepspeed_cpu_adam_then_cast": 34}


def _deepspeed_adam(params: list[torch.Tensor]):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"], adamw_mode=True)


def kernel_cases(numel: int) -> dict[str, Callable[[], Any]]:
    """Each case (the module docstring lists them) as a function that runs it once on the calling
    thread's team.

    Every case steps the same tensors, laid out as ``megatrain.runtime.host.HostState`` lays out a
    layer (one page-aligned mapping holding the master row and the two moment rows; the gradient
    tiles and the BF16 staging copy mappings of their own): measured here, the same kernel ran up
    to 20% slower or faster on tensors allocated apart, by where their addresses fell, more than
    the differences measured. The master moves a little each step (the same AdamW steps whichever
    case takes them); the rates do not depend on its values."""
    g = torch.Generator().manual_seed(0)
    block = page_aligned_empty(3 * numel * 4).view(torch.float32)
    p, m, v = block[:numel], block[numel:2 * numel], block[2 * numel:]
    p.copy_(torch.randn(numel, generator=g))
    grad = page_aligned_empty(numel * 4).view(torch.float32).copy_(torch.randn(numel, generator=g) * 1e-3)
    grad_bf16 = page_aligned_empty(numel * 2).view(torch.bfloat16).copy_(grad)
    out = page_aligned_empty(numel * 2).view(torch.bfloat16)  # the BF16 staging copy the next H2D reads
    scratch = torch.empty(numel)  # the whole-tile FP32 scratch the OPT widened into before

    def host_step(kernel: str | None, gradient: torch.Tensor, widen: bool = False,
                  cast: str | None = None) -> Callable[[], None]:
        """megatrain's step; ``cast``: ``"fused"`` (``cast_into``) or ``"after"`` (a CAST of the
        whole tile once the step is done, as the runtime's schedule runs it today)."""
        adam, step = HostAdamW(kernel), torch.zeros(())

        def run() -> None:
            if widen:  # what the OPT of a BF16 tile did before: widen the whole tile, then step it
                scratch.copy_(gradient)
            adam.step(p, scratch if widen else gradient, m, v, step, cast_into=out if cast == "fused" else None,
                      **ADAMW)
            if cast == "after":
                out.copy_(p)
        return run

    def peer(make: Callable[[list[torch.nn.Parameter]], Any], step: Any, cast: bool = False) -> Callable[[], None]:
        """A torch optimizer (``make([param])``) stepping the shared tiles: its state set to them."""
        param = torch.nn.Parameter(p)  # shares p's storage
        param.grad = grad
        opt = make([param])
        opt.state[param].update(step=step, exp_avg=m, exp_avg_sq=v)

        def run() -> None:
            opt.step()
            if cast:  # the BF16 copy of the new master that the next H2D reads
                out.copy_(p)
        return run

    def torch_fused(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, fused=True, **ADAMW)

    def in_chunks() -> Callable[[], None]:
        """megatrain's FP32-gradient step through the public ``HostAdamW.step``, one call per chunk
        of :data:`CHUNK_ELEMENTS` x the team's threads, so that each call's finite-check sum reads
        its chunk of the master while it is still in the cache: the whole-tile call (``megatrain``)
        sums the tile after stepping it, a second read of the master from DRAM (32 bytes per
        parameter, not 28). On the first GPU host (16-core Xeon, 2026-11-27) the whole-tile call ran
        at 0.85x ``DeepSpeedCPUAdam.step`` on the same kernel. Each chunk keeps its own step count
        (all equal), as one tile's would be."""
        adam = HostAdamW(None)
        chunk = CHUNK_ELEMENTS * torch.get_num_threads()
        bounds = [(lo, min(lo + chunk, numel)) for lo in range(0, numel, chunk)]
        steps = [torch.zeros(()) for _ in bounds]

        def run() -> None:
            for (lo, hi), step in zip(bounds, steps):
                adam.step(p[lo:hi], grad[lo:hi], m[lo:hi], v[lo:hi], step, **ADAMW)
        return run

    cases: dict[str, Callable[[], Any]] = {
        "megatrain": host_step(None, grad),
        "megatrain_in_chunks": in_chunks(),
        "torch_fused_adamw": peer(torch_fused, torch.zeros(())),
        "megatrain_bf16_grads": host_step(None, grad_bf16),
        "before_bf16_grads": host_step("torch", grad_bf16, widen=True),
        "cast": lambda: out.copy_(p),
        "megatrain_step_and_cast": host_step(None, grad, cast="fused"),
        "megatrain_bf16_grads_step_and_cast": host_step(None, grad_bf16, cast="fused"),
        "megatrain_then_cast": host_step(None, grad, cast="after"),
    }
    if deepspeed_installed():
        cases["megatrain_deepspeed_kernel"] = host_step("deepspeed", grad)
        cases["deepspeed_cpu_adam"] = peer(_deepspeed_adam, 0)
        cases["deepspeed_cpu_adam_then_cast"] = peer(_deepspeed_adam, 0, cast=True)
    return cases


def kernel_times(cases: dict[str, Callable[[], Any]], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Each case's wall seconds (``"wall"``) and this process's CPU seconds (``"cpu"``, all its
    threads: the team's) in each of ``rounds`` interleaved rounds, on the calling thread's team."""
    for fn in cases.values():
        fn()  # warm: pages faulted in, the team started, DeepSpeed's op loaded
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in cases}
    names, order = list(cases), random.Random(0)
    for _ in range(rounds):
        # Each round in an order of its own: measured here, a fixed order (or a rotation of one,
        # which keeps each case's predecessor) favoured some cases by up to a third.
        order.shuffle(names)
        for name in names:
            c0, t0 = time.process_time(), time.perf_counter()
            cases[name]()
            t1, c1 = time.perf_counter(), time.process_time()
            times[name]["wall"].append(t1 - t0)
            times[name]["cpu"].append(c1 - c0)
    return times


# -- the issuing thread's stalls --------------------------------------------------------------------------

STALL_CASES = ("megatrain", "megatrain_bf16_grads", "megatrain_step_and_cast", "cast", "torch_fused_adamw",
               "megatrain_deepspeed_kernel", "deepspeed_cpu_adam")
"""The cases whose stall of the issuing thread is measured (those of DeepSpeed where installed),
besides the other host ops (:func:`host_op_cases`)."""

STALL_REPS = 7
"""Calls of each case while the issuing thread ticks (two in a dry run)."""

STALL_TARGET = 0.05
"""The default kernel's stalled fraction must stay under this (issue 39)."""

STALL_WHAT = ("each case run on a host worker thread (the budget's team) while this process's main thread, the "
              "issuing thread, ticks (a clock read and a one-element add_, which releases the GIL as a kernel "
              "launch does): kernel_s the median call; longest_stall_s the longest gap between ticks during a call "
              "(blocked or preempted); stalled_fraction the time the issuing thread slept (blocked on the GIL: Linux "
              "schedstat's wall less on-CPU less run-queue time) over the calls' time; preempted_fraction the time it "
              "waited for a core the machine's other work held. A kernel that holds the GIL stalls the issuing "
              "thread for its whole call")

STALL_GAP_S = 200e-6
"""A gap between two ticks of the issuing thread longer than this counts in ``gaps_over_stall_gap_s``
(and is the stall where Linux's scheduler statistics are missing): the time of about 20 kernel
launches from Python (8.9-12 us each on the first GPU host, BENCHMARKS.md); the ticks of a free
thread are a few microseconds apart."""


SCHEDSTAT = "/proc/thread-self/schedstat"
"""Linux: the calling thread's nanoseconds on a CPU and waiting on a run queue (and its time slices)."""

SAMPLE_EVERY = 32
"""Ticks between two reads of the issuing thread's :data:`SCHEDSTAT` (a read costs a few ticks)."""

CALL_GAP_S = 0.005
"""Seconds the worker pauses before each measured call (and after the last), as a host worker
waits on its queue between ops: the issuing thread ticks freely then, and is sampled around each call."""

LONG_SWITCH_INTERVAL_S = 10.0
"""Python's switch interval while :func:`issue_stall` measures (the default is 5 ms): a thread that
waits for the GIL then sleeps until it is released, instead of waking every interval to ask for it
(on a loaded machine each such wake-up waits for a core, which Linux counts as run-queue time, not
sleep). A call that holds the GIL in C ignores the requests either way, and a GIL-releasing one never
makes the issuing thread wait for one: it releases the GIL at every tick."""


def issue_stall(fn: Callable[[], Any], threads: int, reps: int) -> dict:
    """What ``fn`` (a host op) does to the issuing thread: ``fn`` runs ``reps`` times (after one
    warm-up) on a thread of its own with an intra-op team of ``threads`` (``set_thread_team``, as
    the CUDA backend's host workers run their ops), while the calling thread, standing for the
    issuing thread, ticks: each tick reads the clock and dispatches one one-element ``add_``,
    which releases the GIL inside torch's dispatcher as a kernel launch does, so a host op that
    wants the GIL between its calls gets it as it would from the issuing thread.

    The ticking thread is, at any moment, on a CPU, runnable but waiting for one (other work holds
    the cores: a preemption), or asleep; it never sleeps but on the GIL. Linux says how long it
    spent in the first two (:data:`SCHEDSTAT`, read every :data:`SAMPLE_EVERY` ticks), so
    ``stalled_s`` is the time it slept, blocked on the GIL, while the calls ran (between the
    samples around each call, merged where no sample fell between two calls: the ticks outside a
    call do not sleep; the switch interval is :data:`LONG_SWITCH_INTERVAL_S` meanwhile), and
    ``preempted_s`` the time it waited for a core, which on a loaded machine is most of the gaps
    between ticks.

    Returns, over the ``reps`` calls: ``kernel_s`` (the median wall seconds of one call, the
    issuing thread ticking), ``longest_stall_s`` (the longest gap between ticks, or between a
    call's start or end and the nearest tick, while a call ran: blocked or preempted),
    ``stalled_s`` and ``stalled_fraction`` (over the calls' summed time), ``preempted_s`` and
    ``preempted_fraction`` (over the time between the samples around the calls), ``ticks_per_s`` (the issuing thread's ticks per second of the calls).
    Without :data:`SCHEDSTAT` (not Linux) the stall is the gaps longer than
    :data:`STALL_GAP_S` (``"stall_from"`` says which). A kernel that holds the GIL for its whole
    call stalls the issuing thread for about all of it."""
    spans: list[tuple[float, float]] = []
    ready, go, done = threading.Event(), threading.Event(), threading.Event()
    error: list[BaseException] = []

    def worker() -> None:
        try:
            set_thread_team(threads)
            fn()  # warm: this thread's team started, pages faulted in
            ready.set()
            go.wait()  # the issuing thread ticks from now on
            for _ in range(reps):
                time.sleep(CALL_GAP_S)  # as a worker waits on its queue between ops: the issuing thread runs free
                t0 = time.perf_counter()
                fn()
                spans.append((t0, time.perf_counter()))
            time.sleep(CALL_GAP_S)
        except BaseException as e:  # noqa: BLE001 - re-raised on the issuing thread
            error.append(e)
        finally:
            ready.set()
            done.set()

    try:
        fd: int | None = os.open(SCHEDSTAT, os.O_RDONLY)
    except OSError:
        fd = None
    tick = torch.zeros(1)
    ticks, samples = array.array("d"), array.array("d")  # samples: (time, on-CPU s, run-queue s) triples
    clock, add = time.perf_counter, tick.add_

    def sample() -> None:
        if fd is not None:
            # The clock first: pread releases the GIL, and taking it back may wait for a whole call.
            now = clock()
            cpu_ns, wait_ns = os.pread(fd, 64, 0).split()[:2]
            samples.extend((now, int(cpu_ns) * 1e-9, int(wait_ns) * 1e-9))

    t = threading.Thread(target=worker, name="host-op")
    t.start()
    ready.wait()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(LONG_SWITCH_INTERVAL_S)
    try:
        sample()
        go.set()
        k = 0
        while not done.is_set():
            ticks.append(clock())
            add(1)
            k += 1
            if k % SAMPLE_EVERY == 0:
                sample()
        sample()
    finally:
        go.set()
        sys.setswitchinterval(interval)
        t.join()
    if fd is not None:
        os.close(fd)
    if error:
        raise error[0]
    times = samples[0::3]
    longest = gaps_stalled = asleep = waited = total = 0.0
    n_ticks = 0
    windows: list[list[int]] = []  # sample index ranges around the calls, merged where they overlap
    for a, b in spans:
        lo, hi = bisect.bisect_right(ticks, a), bisect.bisect_left(ticks, b)
        inside = [a, *ticks[lo:hi], b]
        gaps = [y - x for x, y in zip(inside, inside[1:])]
        longest = max(longest, max(gaps))
        gaps_stalled += sum(g for g in gaps if g > STALL_GAP_S)
        total += b - a
        n_ticks += hi - lo
        if fd is not None:  # the samples just before and just after the call
            i, j = max(bisect.bisect_right(times, a) - 1, 0), min(bisect.bisect_left(times, b), len(times) - 1)
            if windows and i <= windows[-1][1]:
                windows[-1][1] = max(windows[-1][1], j)  # the ticker had no sample between two calls
            else:
                windows.append([i, j])
    sampled = 0.0  # the windows' time: the calls and the ticks around them up to the nearest samples
    for i, j in windows:
        wall = times[j] - times[i]
        on_cpu, queued = samples[3 * j + 1] - samples[3 * i + 1], samples[3 * j + 2] - samples[3 * i + 2]
        asleep += max(0.0, wall - on_cpu - queued)
        waited += queued
        sampled += wall
    stalled = asleep if fd is not None else gaps_stalled
    return {"kernel_s": statistics.median(b - a for a, b in spans), "longest_stall_s": longest,
            "stalled_s": stalled, "stalled_fraction": stalled / total if total > 0 else 0.0,
            "preempted_s": waited if fd is not None else None,
            "preempted_fraction": waited / sampled if fd is not None and sampled > 0 else None,
            "gaps_over_stall_gap_s": gaps_stalled,
            "stall_from": "schedstat" if fd is not None else "gaps", "ticks_per_s": n_ticks / total if total > 0 else 0.0,
            "reps": reps}


def host_op_cases(numel: int, directory: str) -> dict[str, Callable[[], Any]]:
    """The host ops besides AdamW and the CAST that the CUDA backend's host workers run, each
    making the calls its executor handler makes on a tile of ``numel`` elements: ``acc`` (an ACC
    of the last micro-batch: an FP32 tile added into the layer's accumulator, then its norm),
    ``lion`` (:class:`~megatrain.runtime.host_kernels.HostLion`, FP32 gradients),
    ``nvme_write`` and ``nvme_read`` (an NVME_WRITE and an NVME_READ of the tile's bytes through
    :class:`~megatrain.runtime.nvme.NvmeStore` in ``directory``, block checksums on, and the wait
    for them, as the I/O worker runs them)."""
    import megatrain
    from megatrain.runtime.host_kernels import HostLion
    from megatrain.runtime.nvme import NvmeStore, aligned_buffer

    g = torch.Generator().manual_seed(4)
    tile, acc = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    p, m, step = torch.randn(numel, generator=g), torch.zeros(numel), torch.zeros(())
    lion, lion_cfg = HostLion(), megatrain.Lion(lr=1e-4)
    nbytes = 4 * numel
    store = NvmeStore(directory, {"t": nbytes}, checksums=True)
    buf = aligned_buffer(nbytes)
    buf.view(torch.float32)[:numel].copy_(tile)
    weakref.finalize(buf, store.close, True)  # the store (and its file) lives as long as the cases

    def acc_op() -> None:
        acc.add_(tile)
        torch.linalg.vector_norm(acc)

    return {"acc": acc_op, "lion": lambda: lion.update(p, tile, [m], step, lion_cfg),
            "nvme_write": lambda: store.write("t", buf).wait(), "nvme_read": lambda: store.read("t", buf).wait()}


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


def _per_round(seconds: dict[str, list[float]], a: str, b: str) -> list[float]:
    """``a``'s rate over ``b``'s (on tiles of one size: ``b``'s seconds over ``a``'s) in each round."""
    return [y / x for x, y in zip(seconds[a], seconds[b])]


def _paired(seconds: dict[str, list[float]], a: str, b: str) -> float:
    """Median over the rounds of ``a``'s rate over ``b``'s in the same round."""
    return statistics.median(_per_round(seconds, a, b))


def _spread(xs: list[float]) -> dict[str, float]:
    """The lowest, quartiles (nearest rank) and highest of ``xs``."""
    xs, last = sorted(xs), len(xs) - 1
    return {"min": xs[0], "q25": xs[round(0.25 * last)], "q75": xs[round(0.75 * last)], "max": xs[-1]}


def exactness(numel: int = 4096, steps: int = 5) -> dict:
    """Relative error of each kernel's parameters against ``torch.optim.AdamW`` after ``steps``
    steps, from FP32 and BF16 gradients, plain and with the BF16 copy fused (``cast_into``)."""
    g = torch.Generator().manual_seed(1)
    start = torch.randn(numel, generator=g)
    grads = [torch.randn(numel, generator=g) * 1e-2 for _ in range(steps)]
    want = {}
    for dtype in (torch.float32, torch.bfloat16):  # the reference of BF16 gradients is their widened values
        ref = torch.nn.Parameter(start.clone())
        opt = torch.optim.AdamW([ref], foreach=False, **ADAMW)
        for gr in grads:
            ref.grad = gr.to(dtype).float()
            opt.step()
        want[dtype] = ref.detach()
    out = {}
    for kernel in ["torch"] + (["deepspeed"] if deepspeed_installed() else []):
        for dtype, cast in itertools.product((torch.float32, torch.bfloat16), (False, True)):
            p, m, v, step = start.clone(), torch.zeros(numel), torch.zeros(numel), torch.zeros(())
            copy = torch.empty(numel, dtype=torch.bfloat16) if cast else None
            adam = HostAdamW(kernel)
            for gr in grads:
                adam.step(p, gr.to(dtype), m, v, step, cast_into=copy, **ADAMW)
            name = f"{kernel}_{'bf16' if dtype is torch.bfloat16 else 'fp32'}_grads{'_cast_into' if cast else ''}"
            out[name] = ((p - want[dtype]).norm() / want[dtype].norm()).item()
            if copy is not None and not torch.equal(copy, p.bfloat16()):
                raise AssertionError(f"{name}: the fused BF16 copy is not the cast of the new master")
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
    cases = kernel_cases(numel)
    times = run_on_team(threads, lambda: kernel_times(cases, rounds))
    stalls = {name: issue_stall(cases[name], threads, 2 if dry else STALL_REPS) for name in STALL_CASES if name in cases}
    with tempfile.TemporaryDirectory(prefix="host_optimizer_") as work:
        ops = host_op_cases(numel, work)
        stalls.update({name: issue_stall(fn, threads, 2 if dry else STALL_REPS) for name, fn in ops.items()})
        del ops  # the NVMe store closes (weakref.finalize) before its directory goes
    for name, st in stalls.items():
        st["elements_per_s"] = numel / st["kernel_s"]
    default = HostAdamW().kernel
    wall = {name: t["wall"] for name, t in times.items()}
    cpu = {name: t["cpu"] for name, t in times.items()}
    rates = {name: numel / statistics.median(t) for name, t in wall.items()}
    pairs = [("megatrain", "torch_fused_adamw"), ("megatrain_bf16_grads", "before_bf16_grads"),
             ("megatrain_bf16_grads", "megatrain"), ("cast", "megatrain"),
             ("megatrain_step_and_cast", "megatrain_then_cast"), ("megatrain_in_chunks", "megatrain")]
    if "deepspeed_cpu_adam" in times:
        pairs += [("megatrain", "deepspeed_cpu_adam"), ("megatrain_in_chunks", "deepspeed_cpu_adam"), ("deepspeed_cpu_adam", "torch_fused_adamw"),
                  ("megatrain_step_and_cast", "deepspeed_cpu_adam_then_cast"),
                  ("megatrain_bf16_grads_step_and_cast", "deepspeed_cpu_adam_then_cast")]
    per_round = {f"{a}_over_{b}": _per_round(wall, a, b) for a, b in pairs}
    ratios = {k: statistics.median(x) for k, x in per_round.items()}
    cpu_per_round = {f"{a}_over_{b}": _per_round(cpu, a, b) for a, b in pairs}
    cpu_ratios = {k: statistics.median(x) for k, x in cpu_per_round.items()}
    exact = exactness()
    small = run_on_team(threads, lambda: call_seconds(1024, 200 if dry else 2000))
    return {
        "bench": "host_optimizer", "date": datetime.date.today().isoformat(), "dry_run": dry,
        "machine": {"cpu": cpu_name(), "cores": cores, "l3_bytes": l3},
        "versions": {"torch": torch.__version__, "deepspeed": _deepspeed_version()},
        "megatrain_kernel": default, "threads": threads, "numel": numel,
        "working_set_bytes": 16 * numel, "larger_than_l3": 16 * numel > l3 > 0, "rounds": rounds,
        "rates": rates, "rate_spread": {k: _spread([numel / x for x in t]) for k, t in wall.items()},
        "dram_bytes_per_param": {k: DRAM_BYTES[k] for k in times},
        "ratios": ratios, "ratio_spread": {k: _spread(x) for k, x in per_round.items()},
        "cpu_ratios": cpu_ratios, "cpu_ratio_spread": {k: _spread(x) for k, x in cpu_per_round.items()},
        "target": {"ratio": TARGET, "at_least": 1.0,
                   "cpu_value": cpu_ratios.get(TARGET), "wall_value": ratios.get(TARGET),
                   "met": cpu_ratios[TARGET] >= 1.0 if TARGET in ratios else None,
                   "met_wall": ratios[TARGET] >= 1.0 if TARGET in ratios else None, "what": TARGET_WHAT},
        "issuing_thread": {"stall_gap_s": STALL_GAP_S, "what": STALL_WHAT, "cases": stalls},
        "stall_target": {"case": "megatrain", "kernel": default, "stalled_fraction": stalls["megatrain"]["stalled_fraction"],
                         "at_most": STALL_TARGET, "met": stalls["megatrain"]["stalled_fraction"] < STALL_TARGET},
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
    ap.add_argument("--rounds", type=int, default=31,
                    help="interleaved rounds; medians and quartiles are kept (default 31)")
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
