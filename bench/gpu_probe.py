"""One-call GPU readiness probe: measure the machine, run the CUDA tests, time one ~1B step beside
the simulator, and write everything as JSON under one directory.

Why one call. A GPU session of this workplace has 30 minutes of device time and 10 minutes per
command, and a fresh machine each time. This script does, in one command that ends well inside
10 minutes (``--budget-s``, 540 s by default), everything a session needs to calibrate the cost
model and check the CUDA runtime. Each section runs under its own time limit; a section that
raises or runs past its limit is recorded with ``status`` ``"error"`` or ``"timeout"`` and its
message and traceback, and the probe goes on with the next one. Nothing is silently replaced:
where a later section needs a number an earlier one failed to measure, it says so (the spec lists
every field it took from ``--fallback-preset`` instead of a measurement).

Sections, in the order they run (``--sections`` picks a subset):

``environment``
    GPU (``nvidia-smi`` query and ``topo -m``, ``torch.cuda.get_device_properties``), driver, CUDA,
    torch, transformers and other versions, host CPU (``lscpu``, L3 size from sysfs), NUMA nodes
    (``numactl -H`` and ``/sys/devices/system/node``), ``/proc/meminfo``, transparent huge pages,
    ``RLIMIT_MEMLOCK``, and where ``megatrain`` was imported from.
``copies``
    Pinned H2D, D2H and both at once (one copy per direction on two streams) at 256 MiB and
    1 GiB, each the median of several copies timed with CUDA events; the data that arrived is
    checked against the source at a stride. ``duplex``: both at once finish in under 0.75 x the
    sum of the two alone (the rule ``measure_hardware`` uses).
``pinned_alloc``
    For a few sizes, powers of two and not: the wall time of ``torch.empty(pin_memory=True)`` from
    an empty host cache, and what ``torch.cuda.host_memory_stats()`` says the caching host
    allocator took for it (``allocated_bytes.current`` grows by the *rounded* block size: torch
    rounds pinned blocks up to a power of two), ``num_host_alloc`` and ``host_alloc_time``. Then
    the exact-size alternative: ``cudaHostRegister`` of an anonymous ``mmap`` of exactly that many
    bytes (``torch.cuda.cudart()``), its time, and whether torch sees the memory as pinned.
``host_rates``
    Host AdamW through ``megatrain.runtime.host_kernels.HostAdamW`` (the executor's step) with each
    kernel installed (torch's fused; DeepSpeed's CPU Adam where ``deepspeed`` is), from FP32 and
    from BF16 gradients, and CAST (an FP32 -> BF16 ``copy_``, what a CAST op does) at 1, 2, 4, 8 and
    16 threads and at the host workers' budget (``megatrain.ir.hardware.host_worker_threads``), each on a thread of
    its own with that team (``set_thread_team``, as the CUDA backend's workers), capped at the CPU
    count, on tiles whose working set is at least four times the host's total L3 (read from sysfs)
    so the rates are DRAM rates, not cache rates. The spec takes the rates of the kernel megatrain
    runs at the budget.
``launch``
    The issuing thread's seconds per dispatched op of megatrain's own template of the step's block,
    forward and local backward, as the executor runs them (``template_issue``,
    :func:`template_issue_costs`; the spec's ``launch_overhead_s`` and
    ``backward_launch_overhead_s``), beside the same for the stand-in block the first session
    measured (``template_issue_s_per_op``: a small Llama block's forward and local backward over
    its ops as meta tracing counts them, ``megatrain.runtime.measure.measure_launch_overhead``).
    For reference, N tiny in-place adds issued from Python on
    one stream with no synchronisation in between, then one synchronisation; ``issue_s_per_op``
    is the issuing thread's time per launch, ``total_s_per_op`` includes draining the queue. Also
    the cost of one event record plus one cross-stream ``wait_event`` (what the CUDA backend adds
    per op). The adds' result is checked (the tensor must hold N). And the template's forward and a
    layer tile's H2D, each alone and beside the other (``forward_beside_h2d``,
    :func:`_forward_beside_h2d`): the spec's ``h2d_beside_compute_bytes_per_s`` and
    ``compute_slowdown_beside_h2d``, the simulator's copy/compute contention; and the forward's
    launches by the thread that has just queued copies, as the runtime's issuing thread does
    (:func:`_same_thread_beside_h2d`): the spec's ``issue_slowdown_beside_h2d``.
``matmul``
    Square BF16, FP32 with TF32 off, and FP32 with TF32 on (``HardwareSpec.fp32_flops`` is the
    TF32-off rate, the one megatrain's strict FP32 ops get) products on random data, median of 10 after 3 warm-ups, timed with CUDA events;
    relative error of two rows against an FP64 reference on the CPU.
``kernels``
    The simulator's kernel-model rates at the step's shapes (:func:`section_kernels`): element-wise
    memory bandwidth, GPU seconds per kernel, fused causal attention forward and backward, the
    block's matmuls beside the roofline's time, and H2D of a tile a host cast has just written.
``spec``
    A ``HardwareSpec`` built from the sections above, saved as ``spec.json`` and read back with
    ``HardwareSpec.load``. ``sources`` names the measurement behind each field.
``step``
    A ~1.1B Llama (Llama-3.2-1B's blocks: 16 layers, hidden 2048, FFN 8192, 32 heads, 8 KV heads;
    a 32,000-token vocabulary, untied) built on the meta device, ``megatrain.compile(...,
    device="cuda", hardware=spec)``, one warm-up step, then measured steps with the CUDA backend
    recording a timeline (``backend.record``, ``backend.timeline``) beside ``simulate()`` of the
    same schedule on the same spec: step times, per-stream busy fractions, bottlenecks and time per
    op kind, predicted and measured; the measured GPU streams' time split into GPU-busy (each op's
    work all issued) and issue-bound (the op still being issued), and the issuing thread's seconds
    issuing and, of those, off a core (the GIL a host op held, or a core taken), per stream and
    in the summary; the tail after the last compute op and what carrying its optimizer steps
    into the next step could save at most (``tail``). The measured side is the timed step of median step
    time (:func:`median_step`; its row in ``steps`` says ``timeline_kept``): ``timelines.json`` holds it
    and the prediction (``measured``, ``predicted``) and every timed step's timeline (``measured_steps``),
    and ``trace.json`` the two as a Chrome/Perfetto trace (measured pid 1, predicted pid 2).
    ``by_context``: the compute ops' median seconds, measured and predicted, grouped by what ran
    beside them in the measured step (a CAST, an OPT, a copy, nothing: where a gap comes from;
    :func:`by_context`). ``reserve``: the GPU
    reserve the step needed (the allocator's peak reserved bytes plus the context, less the plan's
    own peak) beside the planner's derived one, and the allocator's flush-and-retry count
    (``num_alloc_retries``: nonzero when it ran out of cached blocks and synchronised).
``cuda_tests``
    ``pytest`` in a subprocess over ``tests/``, selecting the tests that need CUDA (marked
    ``cuda``, or skipped with a reason that names CUDA: ``conftest.requires_cuda``), with
    ``--junitxml``; the JSON holds the counts and each failure's message.
``race_detector``
    The CUDA tests of ``tests/test_race_detector.py`` (the detector on real streams) in a pytest
    subprocess of their own, when that file exists (``cuda_tests`` then leaves the file out);
    ``skipped`` when it does not.

The tests run last so that the measurements and the step, which the spec and the simulator need,
are not squeezed by a slow test run; the probe frees its GPU and pinned memory before them.

``--dry-run`` runs every section end to end on the CPU in seconds with tiny sizes and the same
JSON layout: copies between CPU tensors, pageable "pinned" allocations, small tiles, a 256^3
matmul, the step on the CUDA backend through ``FakeCuda`` (``CUDABackend(adapter=FakeCuda())``),
and only ``tests/test_backends.py`` for the CUDA-test selection (those tests skip without CUDA).
Its numbers check the harness, not a machine; the spec's name says so.

Output directory (``--out``; at most 8 files, no sub-folders, so all of it comes back from the
device machine): ``probe.json`` (rewritten after every section, so a killed run leaves what it
finished), ``spec.json``, ``timelines.json``, ``trace.json``, ``junit_cuda.xml``,
``junit_race.xml``.

Usage (see bench/README.md for the device command and the wheels to carry)::

    python bench/gpu_probe.py --out $OUT
    python bench/gpu_probe.py --dry-run --out /tmp/probe
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    # Appended, not prepended: a megatrain on PYTHONPATH or installed wins, and a plain checkout
    # still imports.
    sys.path.append(str(ROOT))

from megatrain.runtime.measure import l3_cache  # noqa: E402 - after the path above, so a plain checkout imports
from megatrain.units import GiB, MiB  # noqa: E402

PROBE_FORMAT_VERSION = 1
SELECT_ENV = "GPU_PROBE_SELECT"
"""Set to ``cuda`` in the pytest subprocesses: this module, loaded as a pytest plugin
(``-p gpu_probe``), then keeps only the tests that need CUDA."""

SECTION_ORDER = ("environment", "copies", "pinned_alloc", "host_rates", "launch", "matmul", "kernels", "spec",
                 "step", "cuda_tests", "race_detector")

DEFAULT_LIMITS_S = {"environment": 30, "copies": 45, "pinned_alloc": 45, "host_rates": 150, "launch": 45,
                    "matmul": 40, "kernels": 40, "spec": 15, "step": 200, "cuda_tests": 180, "race_detector": 90}
"""Per-section wall-clock limits in seconds on a GPU machine (estimates, with room: on an H100
host the measurements take 5-30 s each, the 1B step about a minute with compile, the CUDA tests
about a minute). A section also never gets more than what is left of ``--budget-s``."""

DRY_LIMITS_S = {k: 240 for k in SECTION_ORDER}
"""The dry run's sections take 0.1-30 s on two CPU cores; 240 s keeps a loaded CI machine from
turning slowness into a timeout."""


class SectionTimeout(Exception):
    """A section ran past its time limit (raised in the main thread by SIGALRM)."""


class InjectedFailure(RuntimeError):
    """Raised by ``--inject NAME=error``: lets the tests check that a failing section is recorded."""


# -- running sections ---------------------------------------------------------------------------------

@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise SectionTimeout in the main thread after ``seconds``.

    SIGALRM interrupts Python code between bytecodes and interrupts ``time.sleep``; a long C call
    (one CUDA synchronisation) finishes first, so a limit can be overrun by one such call. The
    subprocess sections also pass their limit to ``subprocess.run``, which kills the child.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise SectionTimeout(f"ran past its limit of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Ctx:
    """What sections share: the options, the output directory and the results so far."""

    args: argparse.Namespace
    out: Path
    dry: bool
    results: dict[str, dict] = field(default_factory=dict)
    spec: Any = None  # the HardwareSpec the spec section built
    sections: tuple[str, ...] = ()  # the sections of this run
    limit_s: float = 0.0  # the running section's limit

    @property
    def cuda(self) -> bool:
        return not self.dry

    def measured(self, section: str) -> dict | None:
        """The result of ``section`` if it ran and succeeded, else None."""
        r = self.results.get(section)
        return r["result"] if r and r.get("status") == "ok" else None


def run_sections(ctx: Ctx, names: list[str], doc: dict, write: Callable[[], None]) -> None:
    deadline = time.monotonic() + ctx.args.budget_s
    limits = dict(DRY_LIMITS_S if ctx.dry else DEFAULT_LIMITS_S)
    limits.update(ctx.args.limit)
    for name in names:
        left = deadline - time.monotonic()
        limit = min(limits[name], left)
        entry: dict[str, Any] = {"limit_s": round(limit, 1)}
        if limit < 1.0:
            entry.update(status="skipped", reason=f"the probe's budget of {ctx.args.budget_s:.0f} s was spent "
                                                  "before this section; raise --budget-s or run fewer --sections")
            ctx.results[name] = entry
            doc["sections"][name] = entry
            write()
            continue
        print(f"[probe] {name} (limit {limit:.0f} s)", flush=True)
        ctx.limit_s = limit
        t0 = time.perf_counter()
        try:
            with time_limit(limit + (5.0 if name in SUBPROCESS_SECTIONS else 0.0)):
                _inject(ctx, name)
                result = SECTIONS[name](ctx)
            if isinstance(result, Skipped):
                entry.update(status="skipped", reason=result.reason)
            else:
                entry.update(status="ok", result=result)
        except SectionTimeout as e:
            entry.update(status="timeout", error=f"section {name!r} {e}", traceback=traceback.format_exc(limit=-8))
        except Exception as e:  # noqa: BLE001 - recorded in the JSON; the probe goes on (module docstring)
            entry.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=-12))
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        ctx.results[name] = entry
        doc["sections"][name] = entry
        print(f"[probe] {name}: {entry['status']} in {entry['seconds']:.1f} s"
              + (f" -- {entry['error']}" if "error" in entry else ""), flush=True)
        try:
            _release_memory(ctx)
        except Exception as e:  # noqa: BLE001 - e.g. a sticky CUDA error the section left; later sections show it
            entry["release_error"] = f"{type(e).__name__}: {e}"
        write()


@dataclass(frozen=True)
class Skipped:
    """A section that had nothing to do here, and why."""

    reason: str


def _inject(ctx: Ctx, name: str) -> None:
    what = ctx.args.inject.get(name)
    if what == "error":
        raise InjectedFailure(f"failure injected into section {name!r} by --inject (a test of the probe)")
    if what == "hang":
        while True:  # until the section's time limit interrupts it
            time.sleep(0.05)


def _release_memory(ctx: Ctx) -> None:
    gc.collect()
    if ctx.cuda:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()  # cached pinned blocks go back to the OS (torch.cuda.graphs does this too)


# -- timing helpers ---------------------------------------------------------------------------------------

def _median_times(fn: Callable[[], Any], *, cuda: bool, reps: int, warmup: int = 1, stream=None) -> list[float]:
    """Seconds per call of ``fn``, one sample per call: CUDA events on ``stream`` (the current
    stream by default) when ``cuda``, else ``time.perf_counter``."""
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        import torch

        s = stream or torch.cuda.current_stream()
        torch.cuda.synchronize()
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            with torch.cuda.stream(s):
                fn()
            b.record(s)
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def _repeat_for(fn: Callable[[], Any], min_s: float, min_reps: int = 3, max_reps: int = 1000) -> list[float]:
    """Host wall time of each call of ``fn``, repeated for at least ``min_s`` and ``min_reps`` calls."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < min_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times



# -- environment ------------------------------------------------------------------------------------------

def _cmd(argv: list[str], timeout: float = 10.0) -> dict:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return {"available": False, "error": f"{argv[0]} not found"}
    except subprocess.TimeoutExpired:
        return {"available": True, "error": f"{' '.join(argv)} took over {timeout:.0f} s"}
    out = {"available": True, "returncode": p.returncode, "stdout": p.stdout[-8000:]}
    if p.returncode:
        out["stderr"] = p.stderr[-2000:]
    return out


NVIDIA_SMI_FIELDS = ("name", "driver_version", "memory.total", "pcie.link.gen.current", "pcie.link.gen.max",
                     "pcie.link.width.current", "pcie.link.width.max", "clocks.sm", "clocks.max.sm", "clocks.mem",
                     "power.limit", "persistence_mode", "compute_mode", "mig.mode.current")


def _meminfo() -> dict:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError as e:
        out["error"] = str(e)
    return out


def _numa_nodes() -> list[dict]:
    nodes = []
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        entry: dict[str, Any] = {"node": node.name}
        with contextlib.suppress(OSError):
            entry["cpulist"] = (node / "cpulist").read_text().strip()
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in (node / "meminfo").read_text().splitlines():
                if "MemTotal" in line:
                    entry["mem_total_bytes"] = int(line.split()[-2]) * 1024
        nodes.append(entry)
    return nodes


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "pydantic", "pydantic-core", "numpy", "scipy", "networkx", "safetensors",
                "accelerate", "pytest", "typing-extensions"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def section_environment(ctx: Ctx) -> dict:
    import resource

    import torch

    import megatrain
    from megatrain.ir.hardware import cpu_name

    env: dict[str, Any] = {"versions": _versions(), "torch_cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                           "megatrain_file": megatrain.__file__, "platform": platform.platform()}
    try:
        import megatrain.examples  # noqa: F401 - the tests' tiny GPT lives there (installed package only)
        env["megatrain_examples_importable"] = True
    except ImportError as e:
        env["megatrain_examples_importable"] = f"no: {e} (bench/README.md's device command links megatrain/examples)"
    git = _cmd(["git", "-C", str(ROOT), "rev-parse", "HEAD"], timeout=5)
    env["git_commit"] = git.get("stdout", "").strip() or git.get("error") or git.get("stderr", "").strip()
    env["cpu"] = {"model": cpu_name(), "os_cpu_count": os.cpu_count(),
                  "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                  "torch_threads": torch.get_num_threads(), "l3": l3_cache()}
    lscpu = _cmd(["lscpu"])
    env["lscpu"] = lscpu.get("stdout") or lscpu.get("error")
    env["numa"] = {"nodes": _numa_nodes()}
    numactl = _cmd(["numactl", "-H"])
    env["numa"]["numactl_H"] = numactl.get("stdout") or numactl.get("error")
    mem = _meminfo()
    keep = ("MemTotal", "MemAvailable", "Hugepagesize", "HugePages_Total", "HugePages_Free", "Mlocked")
    env["memory"] = {k: mem.get(k) for k in keep}
    with contextlib.suppress(OSError):
        env["memory"]["transparent_hugepage"] = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    env["memory"]["rlimit_memlock"] = {"soft": soft, "hard": hard}
    smi = _cmd(["nvidia-smi", f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader"])
    if smi.get("returncode") == 0:
        values = [v.strip() for v in smi["stdout"].strip().splitlines()[0].split(",")]
        env["nvidia_smi"] = dict(zip(NVIDIA_SMI_FIELDS, values))
    else:
        env["nvidia_smi"] = smi
    topo = _cmd(["nvidia-smi", "topo", "-m"])
    env["nvidia_smi_topo"] = topo.get("stdout") or topo.get("error")
    env["cuda_available"] = torch.cuda.is_available()
    if ctx.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False on a GPU run: check the driver and torch's "
                               "CUDA build (env['torch_cuda']), or pass --dry-run")
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": p.name, "total_memory_bytes": int(p.total_memory), "sm_count": p.multi_processor_count,
                      "capability": f"{p.major}.{p.minor}", "l2_cache_bytes": getattr(p, "L2_cache_size", None),
                      "uuid": str(getattr(p, "uuid", "")), "device_count": torch.cuda.device_count()}
        env["allow_tf32_default"] = torch.backends.cuda.matmul.allow_tf32
    else:
        env["gpu"] = None
    return env


# -- copies -----------------------------------------------------------------------------------------------

def section_copies(ctx: Ctx) -> dict:
    import torch

    sizes = [1 * MiB, 4 * MiB] if ctx.dry else [256 * MiB, 1 * GiB]
    reps = 3 if ctx.dry else 5
    rows = []
    for nbytes in sizes:
        rows.append(_copy_rates(ctx, torch, nbytes, reps))
    wrong = [r["bytes"] for r in rows if not r["data_checked"]]
    if wrong:
        raise RuntimeError(f"copies of {wrong} bytes delivered other data than the source (checked at a stride): the "
                           f"rates are of broken copies; rows: {rows}")
    largest = rows[-1]
    return {"method": ("CPU tensors, perf_counter; 'both' runs the two copies one after the other (dry run: "
                       "no GPU)") if ctx.dry else
            ("pinned torch.empty(pin_memory=True) <-> device, copy_(non_blocking=True) on side streams, "
             "CUDA events, median; 'both' = one H2D and one D2H on two streams at once"),
            "sizes": rows, "h2d_bytes_per_s": largest["h2d_bytes_per_s"],
            "d2h_bytes_per_s": largest["d2h_bytes_per_s"], "duplex": largest["duplex"],
            "from_size_bytes": largest["bytes"]}


def _copy_rates(ctx: Ctx, torch, nbytes: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(nbytes % 1000)
    host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda)
    host_src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda)
    dev = "cuda" if ctx.cuda else "cpu"
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dev_src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    s1 = torch.cuda.Stream() if ctx.cuda else None
    s2 = torch.cuda.Stream() if ctx.cuda else None

    def h2d():
        dev_dst.copy_(host_src, non_blocking=True)

    def d2h():
        host_dst.copy_(dev_src, non_blocking=True)

    t_h2d = statistics.median(_median_times(h2d, cuda=ctx.cuda, reps=reps, stream=s1))
    t_d2h = statistics.median(_median_times(d2h, cuda=ctx.cuda, reps=reps, stream=s2))
    stride = max(1, nbytes // 4096)
    h2d_ok = torch.equal(dev_dst[::stride].cpu(), host_src[::stride])
    if ctx.cuda:
        torch.cuda.synchronize()
    d2h_ok = torch.equal(host_dst[::stride], dev_src[::stride].cpu())
    both = []
    for _ in range(reps):
        if ctx.cuda:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            e1, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(s1)
            s2.wait_event(start)
            with torch.cuda.stream(s1):
                h2d()
            with torch.cuda.stream(s2):
                d2h()
            e1.record(s1)
            e2.record(s2)
            e1.synchronize()
            e2.synchronize()
            both.append((start.elapsed_time(e1) / 1e3, start.elapsed_time(e2) / 1e3))
        else:
            t0 = time.perf_counter()
            h2d()
            t1 = time.perf_counter()
            d2h()
            t2 = time.perf_counter()
            both.append((t1 - t0, t2 - t0))
    t_both = statistics.median(max(a, b) for a, b in both)
    t_both_h2d = statistics.median(a for a, _ in both)
    t_both_d2h = statistics.median(b for _, b in both)
    return {"bytes": nbytes, "h2d_s": t_h2d, "d2h_s": t_d2h, "h2d_bytes_per_s": nbytes / t_h2d,
            "d2h_bytes_per_s": nbytes / t_d2h, "both_s": t_both,
            "both_h2d_bytes_per_s": nbytes / t_both_h2d, "both_d2h_bytes_per_s": nbytes / t_both_d2h,
            "both_total_bytes_per_s": 2 * nbytes / t_both,
            # Full duplex finishes both in about the longer one's time; one shared engine needs the sum.
            "duplex": t_both < 0.75 * (t_h2d + t_d2h), "data_checked": bool(h2d_ok and d2h_ok),
            "reps": reps}


# -- pinned allocation ------------------------------------------------------------------------------------

def section_pinned_alloc(ctx: Ctx) -> dict:
    import torch

    if ctx.dry:
        sizes = [1 * MiB, 3 * MiB + 4096]
    else:
        sizes = [64 * MiB, 256 * MiB, 300 * MiB, 1 * GiB, 1 * GiB + 4096]
    stats_fn = getattr(torch.cuda, "host_memory_stats", None) if ctx.cuda else None
    rows = []
    for n in sizes:
        row: dict[str, Any] = {"requested_bytes": n}
        if ctx.cuda:
            torch._C._host_emptyCache()  # so that the block is new, not a cached one handed out again
        before = stats_fn() if stats_fn else None
        t0 = time.perf_counter()
        t = torch.empty(n, dtype=torch.uint8, pin_memory=ctx.cuda)
        row["empty_s"] = time.perf_counter() - t0
        row["is_pinned"] = bool(t.is_pinned()) if ctx.cuda else False
        if before is not None:
            after = stats_fn()

            def delta(key: str):
                return (after.get(key, 0) or 0) - (before.get(key, 0) or 0)

            row["allocator_allocated_bytes_delta"] = delta("allocated_bytes.current")
            row["allocator_num_host_alloc_delta"] = delta("num_host_alloc")
            row["allocator_host_alloc_time_us_delta"] = delta("host_alloc_time.total")
            row["rounding_overhead_bytes"] = row["allocator_allocated_bytes_delta"] - n
        t0 = time.perf_counter()
        t.fill_(1)  # first touch: pinned pages are already resident, pageable ones fault in here
        row["first_fill_s"] = time.perf_counter() - t0
        del t
        row["register_exact"] = _register_exact(ctx, torch, n)
        rows.append(row)
    return {"method": ("dry run: pageable torch.empty, no allocator statistics, no cudaHostRegister" if ctx.dry else
                       "torch.empty(pin_memory=True) after torch._C._host_emptyCache(); deltas of "
                       "torch.cuda.host_memory_stats() (allocated_bytes.current is the rounded block the caching "
                       "host allocator took); register_exact: cudaHostRegister of an exact-size anonymous mmap"),
            "host_memory_stats_available": stats_fn is not None,
            "host_memory_stats_keys": sorted(stats_fn()) if stats_fn else None, "sizes": rows}


def _register_exact(ctx: Ctx, torch, n: int) -> dict:
    """Pin exactly ``n`` bytes: an anonymous mmap (page-aligned) registered with cudaHostRegister."""
    if not ctx.cuda:
        return {"status": "skipped", "reason": "no CUDA (dry run)"}
    import mmap

    cudart = torch.cuda.cudart()
    mm = mmap.mmap(-1, n)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    try:
        return _register_and_copy(torch, cudart, t, n)
    except Exception as e:  # noqa: BLE001 - one size's failure is recorded in its row; the others still run
        return {"status": "error", "error": f"{type(e).__name__}: {e}"}
    finally:
        del t
        mm.close()


def _register_and_copy(torch, cudart, t, n: int) -> dict:
    t0 = time.perf_counter()
    err = int(cudart.cudaHostRegister(t.data_ptr(), n, 0))  # 0: cudaHostRegisterDefault
    out: dict[str, Any] = {"status": "ok" if err == 0 else "error", "cuda_error": err,
                           "register_s": time.perf_counter() - t0}
    if err != 0:
        return out
    try:
        out["is_pinned"] = bool(t.is_pinned())
        dev = torch.empty(min(n, 256 * MiB), dtype=torch.uint8, device="cuda")
        times = _median_times(lambda: dev.copy_(t[:dev.numel()], non_blocking=True), cuda=True, reps=3)
        out["h2d_bytes_per_s"] = dev.numel() / statistics.median(times)
    finally:
        torch.cuda.synchronize()  # no copy may still read the pages when they are unregistered
        t0 = time.perf_counter()
        out["unregister_error"] = int(cudart.cudaHostUnregister(t.data_ptr()))
        out["unregister_s"] = time.perf_counter() - t0
    return out


# -- host rates -------------------------------------------------------------------------------------------

def section_host_rates(ctx: Ctx) -> dict:
    import torch

    from megatrain.ir.hardware import CAST_BYTES_PER_ELEMENT, host_worker_threads
    from megatrain.runtime.host_kernels import HostAdamW, deepspeed_installed, run_on_team
    from megatrain.runtime.measure import host_cores, host_tile_numel

    l3 = l3_cache()["total_bytes"]
    cores = host_cores()
    budget = host_worker_threads(cores)  # the threads a rank's host workers run with
    threads = sorted({t for t in ((1, 2) if ctx.dry else (1, 2, 4, 8, 16)) if t <= cores} | {budget})
    # Working set at least 4x the total L3 (AdamW touches 16 B/param, a cast 6 B/element), and never
    # under 64M elements (1 GiB for AdamW, above any single host's L3 today, should the L3 size be
    # unknown), so the tiles stream from DRAM. Computed in a dry run too (then replaced by small
    # tiles), so that the dry run checks these lines: a name missing here cost the first GPU session
    # its host rates.
    adam_numel = max(host_tile_numel(16, l3), 64 << 20)
    cast_numel = max(host_tile_numel(CAST_BYTES_PER_ELEMENT, l3), 64 << 20)
    if ctx.dry:
        adam_numel = cast_numel = 1 << 18
    min_s = 0.02 if ctx.dry else 0.5
    megatrain_kernel = HostAdamW().kernel
    kernels = ["torch"] + (["deepspeed"] if deepspeed_installed() else [])
    g = torch.Generator().manual_seed(0)
    p = torch.randn(adam_numel, generator=g)
    grad = torch.randn(adam_numel, generator=g) * 1e-3
    grad_bf16 = grad.bfloat16()
    m, v, step = torch.zeros(adam_numel), torch.zeros(adam_numel), torch.zeros(())
    src = torch.randn(cast_numel, generator=g)
    dst = torch.empty(cast_numel, dtype=torch.bfloat16)
    adams = {k: HostAdamW(k) for k in kernels}

    def adamw(kernel: str, gradient: torch.Tensor):
        return lambda: adams[kernel].step(p, gradient, m, v, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                          weight_decay=0.01)

    def run_cast():
        dst.copy_(src)

    def rates() -> dict:
        out: dict[str, Any] = {}
        for name, fn, n in ([(f"adamw_{k}", adamw(k, grad), adam_numel) for k in kernels]
                            + [(f"adamw_{k}_bf16_grads", adamw(k, grad_bf16), adam_numel) for k in kernels]
                            + [("cast", run_cast, cast_numel)]):
            fn()  # warm: the pool at this size, the pages faulted in
            out[name] = n / statistics.median(_repeat_for(fn, min_s))
        return out

    rows = []
    for t in threads:
        r = run_on_team(t, rates)  # on a thread of its own with a team of t, as the host workers run
        row = {"threads": t, "cast_elements_per_s": r["cast"], "cast_bytes_per_s": 6 * r["cast"]}
        for k in kernels:
            row[f"adamw_{k}_params_per_s"] = r[f"adamw_{k}"]
            row[f"adamw_{k}_bf16_grads_params_per_s"] = r[f"adamw_{k}_bf16_grads"]
        row["adamw_params_per_s"] = row[f"adamw_{megatrain_kernel}_params_per_s"]
        row["adamw_bf16_grads_params_per_s"] = row[f"adamw_{megatrain_kernel}_bf16_grads_params_per_s"]
        row["adamw_bytes_per_s"] = 28 * row["adamw_params_per_s"]
        rows.append(row)
    if not torch.isfinite(p).all():
        raise RuntimeError("host AdamW produced non-finite parameters; the rates are not trustworthy")
    at_budget = next(r for r in rows if r["threads"] == budget)
    return {"l3_total_bytes": l3, "adamw_numel": adam_numel, "adamw_working_set_bytes": 16 * adam_numel,
            "cast_numel": cast_numel, "cast_working_set_bytes": 6 * cast_numel,
            "larger_than_l3": 16 * adam_numel > l3 and 6 * cast_numel > l3 and l3 > 0,
            "bytes_per_param_counted": {"adamw": 28, "cast": 6}, "host_cores": cores, "kernels": kernels,
            "megatrain_kernel": megatrain_kernel, "budget_threads": budget, "rows": rows,
            "adamw_params_per_s_at_budget": at_budget["adamw_params_per_s"],
            "adamw_bf16_grads_params_per_s_at_budget": at_budget["adamw_bf16_grads_params_per_s"],
            "cast_elements_per_s_at_budget": at_budget["cast_elements_per_s"],
            "note": ("dry run: small tiles that fit in cache" if ctx.dry else
                     "adamw_bytes_per_s counts 28 B/param (read p, g, m, v; write p, m, v), cast 6 B/element; "
                     "each row on a thread of its own with that intra-op team (set_thread_team), the "
                     "megatrain kernel's rate at budget_threads (host_worker_threads) is the spec's")}


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


# -- launch cost ------------------------------------------------------------------------------------------

def section_launch(ctx: Ctx) -> dict:
    import torch

    from megatrain.runtime.host_kernels import HostAdamW

    n = 2000 if ctx.dry else 20000
    trials = 3 if ctx.dry else 5
    dev = "cuda" if ctx.cuda else "cpu"
    x = torch.zeros(1, device=dev)
    issue, total = [], []
    sync = torch.cuda.synchronize if ctx.cuda else (lambda: None)
    for _ in range(trials):
        x.zero_()
        for _ in range(100):
            x.add_(1.0)
        x.zero_()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        issue.append((t1 - t0) / n)
        total.append((t2 - t0) / n)
        if float(x.item()) != float(n):
            raise RuntimeError(f"{n} launches of x.add_(1) left x = {x.item()}, not {n}: launches were lost")
    from megatrain.runtime.measure import measure_launch_overhead

    out = {"ops_per_trial": n, "trials": trials, "kernel": "x.add_(1.0) on a 1-element tensor",
           "issue_s_per_op": statistics.median(issue), "total_s_per_op": statistics.median(total),
           "issue_s_per_op_all": issue, "total_s_per_op_all": total,
           "template_issue_s_per_op": measure_launch_overhead(dev, seconds=0.05 if ctx.dry else 0.5)}
    sh = DRY_STEP if ctx.dry else GPU_STEP
    costs = template_issue_costs(dev, sh, seconds=0.05 if ctx.dry else 0.5, host_work=_host_ops(ctx),
                                 h2d_numel=(1 << 16) if ctx.dry else 60_821_504)  # one 1B block's tile
    out["template_issue"] = costs
    # The forward's time and an H2D's rate, each beside the other: the spec's copy/compute contention
    # (h2d_beside_compute_bytes_per_s, compute_slowdown_beside_h2d), and the forward's launches beside
    # copies the same thread queued (issue_slowdown_beside_h2d; MEASURED_FIELDS).
    out["forward_beside_h2d"] = costs["beside_h2d"]
    out["optimizer_issue_stall"] = costs["issue_stall"]["opt"]["stall"]
    out["optimizer_kernel"] = HostAdamW().kernel  # the host AdamW kernel _host_ops's OPT ran
    out["cast_issue_stall"] = costs["issue_stall"]["cast"]["stall"]
    # The spec's issue costs: seconds per dispatched op of megatrain's own template of the step's block.
    out["template_fwd_s_per_op"] = costs["template"]["fwd_s_per_op"]
    out["template_bwd_s_per_op"] = costs["template"]["bwd_s_per_op"]
    if ctx.cuda:
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        evs = [torch.cuda.Event() for _ in range(1000)]
        sync()
        t0 = time.perf_counter()
        for e in evs:
            e.record(s1)
            s2.wait_event(e)
        t1 = time.perf_counter()
        sync()
        out["event_record_and_wait_s"] = (t1 - t0) / len(evs)
    else:
        out["event_record_and_wait_s"] = None
        out["note"] = "dry run: CPU kernels; no events"
    return out


def template_issue_costs(device: str, sh: "StepShape", seconds: float = 0.5,
                         host_work: dict[str, Callable[[], None]] | None = None,
                         h2d_numel: int | None = None) -> dict:
    """Issuing-thread seconds per dispatched op of a layer template's forward (a FWD op) and of its
    local backward (a BWD op: the leaves detached, the recompute, ``torch.autograd.grad``), as the
    executor runs them, for two templates on ``device``: the stand-in block
    ``HardwareSpec.launch_overhead_s`` was first measured with (``runtime.measure._llama_like_block``,
    hidden 64, 16 tokens) and megatrain's own template of ``sh``'s decoder block (traced by
    :func:`megatrain.planner.trace.trace` at ``sh``'s micro-batch and sequence, BF16 on CUDA, FP32
    elsewhere). Ops are counted as the time model counts them (:func:`megatrain.ir.profile.profile_template`,
    fused attention one op). The four calls are timed one at a time, round-robin for about
    ``seconds`` each, medians: on a GPU after a synchronisation, by wall clock, so it is the time to
    issue a call's kernels (the launch queue does not fill within one call), not to run them; on a
    CPU by the thread's CPU time (the kernels run inline there, and a shared CPU's other load is
    not counted).

    ``host_work``: host ops by name (the OPT and CAST a host worker runs) whose effect on the issuing
    thread is measured too (``issue_stall``, :func:`_issue_stalls`). ``h2d_numel``: also the template's
    forward and an H2D weight copy of that many BF16 elements, each alone and beside the other
    (``beside_h2d``, :func:`_forward_beside_h2d`).

    On a GPU the template's figures are the spec's ``launch_overhead_s`` and
    ``backward_launch_overhead_s``. On a CPU at these tiny sizes the ratios between the two templates'
    figures are what :func:`issue_costs_from_standin` carries to a probe that measured only the
    stand-in (the first H100 session): megatrain's template's forward ops cost about twice the
    stand-in's (its ``torch.ops.aten`` calls, casts and views against the stand-in's ``torch``
    functions)."""
    import torch
    import torch.fx as fx
    from transformers import LlamaForCausalLM

    from megatrain.ir.graph import retarget
    from megatrain.ir.issue import count_launches
    from megatrain.ir.profile import profile_template
    from megatrain.planner.trace import trace
    from megatrain.runtime.measure import LAUNCH_BLOCK_HIDDEN, _llama_like_block

    cuda = str(device).startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if cuda else time.thread_time
    g = torch.Generator().manual_seed(0)

    def calls(gm, args: list, grad: list[bool]):
        def forward() -> None:
            with torch.no_grad():
                gm(*args)

        def local_backward() -> None:
            xs = [a.detach().requires_grad_(True) if q else a for a, q in zip(args, grad)]
            with torch.enable_grad():
                outs = gm(*xs)
                outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if o.requires_grad]
                torch.autograd.grad(outs, [x for x, q in zip(xs, grad) if q], [torch.ones_like(o) for o in outs])

        fwd_p, bwd_p = profile_template(gm, args, grad)
        counts = {"fwd_ops": fwd_p.launches, "bwd_ops": bwd_p.launches + sum(grad),
                  "meta_counts": list(count_launches(gm, args, grad))}
        return forward, local_backward, counts

    d, ff = LAUNCH_BLOCK_HIDDEN, 2 * LAUNCH_BLOCK_HIDDEN
    shapes = [(d,), (d, d), (d // 2, d), (d // 2, d), (d, d), (d,), (ff, d), (ff, d), (d, ff), (1, 16, d)]
    standin = [(torch.randn(s, generator=g) * 0.1).to(device, dtype) for s in shapes]
    three = StepShape(**{**sh.__dict__, "layers": 3})
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(three))
    traced = trace(model, micro_batch_size=sh.micro_batch_size, seq_len=sh.seq_len, param_dtype=dtype)
    layer = traced.graph.layers[1]  # the first decoder block
    gm = retarget(traced.templates[layer.template], torch.device(device))
    vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    args = [(torch.randn(v.shape, generator=g) * 0.02).to(device, v.dtype) if v.is_floating_point()
            else torch.zeros(v.shape, dtype=v.dtype, device=device) for v in vals]
    grad = ([p.trainable for p in layer.params] + [False] * len(layer.buffers)
            + [traced.graph.values[v].requires_grad for v in layer.inputs])
    templates = {"standin": calls(fx.symbolic_trace(_llama_like_block), standin, [True] * len(standin)),
                 "template": calls(gm, args, grad)}
    fns = {(name, part): fn for name, (fwd, bwd, _) in templates.items() for part, fn in (("fwd", fwd), ("bwd", bwd))}
    for fn in fns.values():  # first calls pick kernels and warm the allocator
        fn()
        fn()
    times: dict = {k: [] for k in fns}
    t_end = time.perf_counter() + 4 * seconds
    while min(len(v) for v in times.values()) < 5 or time.perf_counter() < t_end:
        for k, fn in fns.items():
            sync()
            t0 = clock()
            fn()
            times[k].append(clock() - t0)
    sync()
    out: dict[str, Any] = {"device": str(device), "dtype": str(dtype), "clock": clock.__name__}
    for name, (_, _, counts) in templates.items():
        tf, tb = statistics.median(times[(name, "fwd")]), statistics.median(times[(name, "bwd")])
        out[name] = {**counts, "fwd_s": tf, "bwd_s": tb, "fwd_s_per_op": tf / counts["fwd_ops"],
                     "bwd_s_per_op": tb / counts["bwd_ops"], "calls": len(times[(name, "fwd")])}
    out["template"]["shape"] = {"hidden": sh.hidden, "ffn": sh.ffn, "heads": sh.heads, "kv_heads": sh.kv_heads,
                                "tokens": sh.micro_batch_size * sh.seq_len}
    out["template_fwd_over_standin_fwd"] = out["template"]["fwd_s_per_op"] / out["standin"]["fwd_s_per_op"]
    out["template_bwd_over_standin_bwd"] = out["template"]["bwd_s_per_op"] / out["standin"]["bwd_s_per_op"]
    if host_work:
        out["issue_stall"] = _issue_stalls(fns[("template", "fwd")], host_work, sync, seconds)
    if h2d_numel:
        out["beside_h2d"] = _forward_beside_h2d(fns[("template", "fwd")], h2d_numel, cuda, seconds)
    return out


COPY_GATE_CYCLES = 20_000_000
"""GPU clock cycles of the sleep a timed copy is queued behind (``torch.cuda._sleep``): ~10 ms at
H100 clocks, twice Python's default switch interval, the longest the issuing thread waits for the
GIL a looping thread holds."""


def _forward_beside_h2d(forward: Callable[[], None], numel: int, cuda: bool, seconds: float) -> dict:
    """The template's ``forward`` and an H2D weight copy (``numel`` BF16 elements from a pinned tile
    into a GPU slot, on a stream of its own, as a step's H2D), each alone and while the other runs
    over and over, as a step's forwards run beside the next layers' copies: the first H100 step's
    block forwards took 2.06 ms alone and 2.75 ms beside a copy, and its copies ran at ~42 GB/s
    beside forwards against the copy test's 54 GB/s alone (bench/results/2026-11-27-h100-step-timelines.json),
    which no measurement then priced.

    Each is timed as the step's timeline times an op: on a GPU by CUDA events around it on its stream,
    the forward from an idle stream (so its issue counts, as a step's issue-bound forward's does), the
    copy queued behind a short GPU sleep on its stream (as a step's H2D is queued behind its wait, so
    its events bracket the copy alone, not the issuing thread's wait for the GIL the looping forward
    holds), each call waited for; beside the timed forward the copies run four at a time, so the copy
    engine stays busy; on a CPU (dry run) by wall clock. Medians: ``forward_alone_s``,
    ``forward_beside_h2d_s``, ``h2d_alone_s``, ``h2d_beside_forward_s``; the copy's rates
    (``h2d_alone_bytes_per_s``, ``h2d_beside_forward_bytes_per_s``) and the forward's slowdown
    (``forward_slowdown`` = 1 - alone / beside, as :func:`_issue_stalls`'s ``stall``).

    Those loop the other op on a second Python thread, which also takes the GIL from the issuing
    one, so they cannot tell a slower issuing thread from slower kernels. The runtime has one
    issuing thread, which queues a copy (``non_blocking`` from a pinned tile) and goes on launching;
    so does the same-thread measurement (:func:`_same_thread_beside_h2d`), whose keys are added:
    ``forward_issue_alone_s`` and ``forward_issue_beside_h2d_s`` (the forward's launches' wall time
    alone and beside copies in flight: ``HardwareSpec.issue_slowdown_beside_h2d`` =
    ``issue_slowdown_beside_h2d`` = 1 - alone / beside in [0, 1)), ``forward_beside_h2d_same_thread_s``
    (its CUDA-event time beside them) and ``forward_slowdown_same_thread`` (1 - ``forward_alone_s`` /
    that)."""
    import torch

    staging = torch.ones(numel, dtype=torch.bfloat16, pin_memory=cuda)
    slot = torch.empty(numel, dtype=torch.bfloat16, device="cuda" if cuda else "cpu")
    side = torch.cuda.Stream() if cuda else None

    def timed(fn: Callable[[], None], stream, gate: bool = False) -> float:
        if not cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            if gate:
                torch.cuda._sleep(COPY_GATE_CYCLES)  # the copy queued before its stream reaches it
            e0.record(stream)
            fn()
            e1.record(stream)
        e1.synchronize()
        return e0.elapsed_time(e1) / 1e3

    main = torch.cuda.current_stream() if cuda else None

    def copy() -> None:
        slot.copy_(staging, non_blocking=cuda)

    def copies() -> None:  # back to back, so the copy engine stays busy while the forward is timed
        for _ in range(4):
            copy()

    def beside(fn: Callable[[], None], stream, gate: bool, other: Callable[[], None], other_stream) -> list[float]:
        stop, times = threading.Event(), []

        def loop() -> None:
            while not stop.is_set():
                timed(other, other_stream)
        th = threading.Thread(target=loop, daemon=True)
        th.start()
        time.sleep(0.002)  # the other under way
        t_end = time.perf_counter() + seconds
        while len(times) < 5 or time.perf_counter() < t_end:
            times.append(timed(fn, stream, gate))
        stop.set()
        th.join()
        return times

    for _ in range(2):  # warm the copy path and the allocator
        timed(copy, side, True)
        timed(forward, main)
    f_alone = statistics.median([timed(forward, main) for _ in range(10)])
    c_alone = statistics.median([timed(copy, side, True) for _ in range(10)])
    f_beside = statistics.median(beside(forward, main, False, copies, side))
    c_beside = statistics.median(beside(copy, side, True, forward, main))
    # Enough copies to stay in flight through the forward twice over, by the times just measured (on
    # a CPU they run inline, before the forward, so two show the harness).
    copies_n = max(2, math.ceil(2 * max(f_alone, f_beside) / c_alone)) if cuda else 2
    same = _same_thread_beside_h2d(forward, copy, copies_n, cuda, side, seconds)
    if not bool((slot[:1] == 1).all()):
        raise RuntimeError("the H2D beside the forward did not copy its tile")
    nbytes = numel * 2
    out = {"numel": numel, "bytes": nbytes, "forward_alone_s": f_alone, "forward_beside_h2d_s": f_beside,
           "forward_slowdown": min(1.0, max(0.0, 1.0 - f_alone / f_beside)), "h2d_alone_s": c_alone,
           "h2d_beside_forward_s": c_beside, "h2d_alone_bytes_per_s": nbytes / c_alone,
           "h2d_beside_forward_bytes_per_s": nbytes / c_beside, **same}
    beside_same = same["forward_beside_h2d_same_thread_s"]
    out["forward_slowdown_same_thread"] = (None if beside_same is None else
                                           min(1.0, max(0.0, 1.0 - f_alone / beside_same)))
    return out


def _same_thread_beside_h2d(forward: Callable[[], None], copy: Callable[[], None], copies: int, cuda: bool, side,
                            seconds: float) -> dict:
    """The template's ``forward`` launched by the thread that has just queued ``copies`` H2D copies
    (``copy``: ``non_blocking`` from a pinned tile) on the ``side`` stream, as the runtime's one
    issuing thread does, against the same forward with no copy queued, alternately for about
    ``seconds`` (at least 5 of each), each from a synchronised GPU.

    Each trial records the forward's issue time (``time.perf_counter`` around the ``forward()`` call,
    not synchronised: the wall time of its launches) and, on a GPU, its CUDA-event time on its
    stream. That the copies were in flight is checked, not assumed: an event recorded after them on
    the side stream must not have completed when the forward's launches returned (``query()``: they
    ran through the whole issue, having been queued on an idle stream before it), and for the
    event time must complete after the forward's end event (``elapsed_time``); a trial that fails a
    check is left out of that median (``copies_in_flight_trials``, ``copies_outlast_forward_trials``
    count those kept), and a median with no trial is None (the spec then takes the preset's "no
    slowdown", listed). ``copies`` is sized to twice the forward's time by the caller. On a CPU (dry
    run) the copies run inline before the forward and nothing is in flight: wall clock both, the
    checks None. Medians: ``forward_issue_alone_s``, ``forward_issue_beside_h2d_s``,
    ``forward_beside_h2d_same_thread_s``; ``issue_slowdown_beside_h2d`` = 1 - alone / beside, in
    [0, 1) (``HardwareSpec.issue_slowdown_beside_h2d``)."""
    import torch

    def trial(queued: bool) -> tuple[float, float, bool | None, bool | None]:
        if not cuda:
            if queued:
                for _ in range(copies):
                    copy()
            t0 = time.perf_counter()
            forward()
            t = time.perf_counter() - t0
            return t, t, None, None
        torch.cuda.synchronize()
        done = None
        if queued:
            with torch.cuda.stream(side):
                for _ in range(copies):
                    copy()
                done = torch.cuda.Event(enable_timing=True)
                done.record(side)
        main = torch.cuda.current_stream()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(main)
        t0 = time.perf_counter()
        forward()
        issue = time.perf_counter() - t0
        e1.record(main)
        flying = None if done is None else not done.query()
        torch.cuda.synchronize()
        outlast = None if done is None else e0.elapsed_time(done) >= e0.elapsed_time(e1)
        return issue, e0.elapsed_time(e1) / 1e3, flying, outlast

    trial(True)  # warm
    alone: list[float] = []
    beside: list[tuple[float, float, bool | None, bool | None]] = []
    t_end = time.perf_counter() + seconds
    while len(beside) < 5 or time.perf_counter() < t_end:
        alone.append(trial(False)[0])
        beside.append(trial(True))
    return {"same_thread_copies": copies, **same_thread_summary(alone, beside)}


def same_thread_summary(alone: list[float], beside: list[tuple[float, float, bool | None, bool | None]]) -> dict:
    """:func:`_same_thread_beside_h2d`'s medians from its trials: ``alone``, the forward's issue
    seconds with no copy queued; ``beside``, per trial with copies queued ``(issue s, event s, copies
    still in flight when its launches returned, copies ended after its end event)``, the checks None
    where not made (a CPU). A trial whose check is False is left out of that median."""
    issue = [b[0] for b in beside if b[2] is not False]
    event = [b[1] for b in beside if b[3] is not False]
    checked = any(b[2] is not None for b in beside)
    a = statistics.median(alone)
    b = statistics.median(issue) if issue else None
    return {"same_thread_trials": len(beside),
            "copies_in_flight_trials": len(issue) if checked else None,
            "copies_outlast_forward_trials": len(event) if checked else None,
            "forward_issue_alone_s": a, "forward_issue_beside_h2d_s": b,
            "issue_slowdown_beside_h2d": (None if b is None else
                                          min(math.nextafter(1.0, 0.0), max(0.0, 1.0 - a / b))),
            "forward_beside_h2d_same_thread_s": statistics.median(event) if event else None}


def _issue_stalls(forward: Callable[[], None], host_work: dict[str, Callable[[], None]], sync, seconds: float) -> dict:
    """How much each host op slows the issuing thread: the template's ``forward`` timed by wall clock
    alone and while ``host_work[name]`` runs over and over on a thread of its own (as a host worker
    runs an OPT or a CAST), alternately; ``stall`` = 1 - alone / during, the fraction of the host op's
    time the thread could not issue (``HardwareSpec.host_optimizer_issue_stall``,
    ``host_cast_issue_stall``): about 1 for a kernel that holds the GIL for its whole call, near 0
    for one that releases it, in between where the host work also takes the thread's core or memory
    bandwidth."""
    out: dict[str, Any] = {}
    for name, work in host_work.items():
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                work()

        alone, during = [], []
        t_end = time.perf_counter() + 2 * seconds
        while len(during) < 5 or time.perf_counter() < t_end:
            sync()
            t0 = time.perf_counter()
            forward()
            alone.append(time.perf_counter() - t0)
            stop.clear()
            th = threading.Thread(target=loop, daemon=True)
            th.start()
            time.sleep(0.002)  # the host op under way
            sync()
            t0 = time.perf_counter()
            forward()
            during.append(time.perf_counter() - t0)
            stop.set()
            th.join()
        a, d = statistics.median(alone), statistics.median(during)
        out[name] = {"alone_s": a, "during_s": d, "stall": min(1.0, max(0.0, 1.0 - a / d)), "calls": len(during)}
    return out


def _host_ops(ctx: Ctx) -> dict[str, Callable[[], None]]:
    """One layer's host OPT (megatrain's AdamW kernel, FP32 gradients) and CAST (FP32 master to a BF16
    tile), each on the host workers' thread team (``host_worker_threads``), at the step's block size
    (a 1B block's 60.8M parameters; 256K on a dry run)."""
    import torch

    from megatrain.ir.hardware import host_worker_threads
    from megatrain.runtime.host_kernels import HostAdamW, set_thread_team
    from megatrain.runtime.measure import host_cores

    numel = (1 << 18) if ctx.dry else 60_821_504
    team = host_worker_threads(host_cores())
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g) * 1e-3
    m, v, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(())
    staging = torch.empty(numel, dtype=torch.bfloat16)
    adam = HostAdamW()

    def opt() -> None:
        set_thread_team(team)
        adam.step(p, grad, m, v, step, lr=1e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def cast() -> None:
        set_thread_team(team)
        staging.copy_(p)
    return {"opt": opt, "cast": cast}


def issue_costs_from_standin(standin_s_per_meta_op: float, ratios: dict, bf16: bool = True) -> tuple[float, float]:
    """(``launch_overhead_s``, ``backward_launch_overhead_s``) for a probe that measured only the
    stand-in block (``launch.template_issue_s_per_op``: its forward and local backward's issuing time
    over its ops as meta tracing counts them, the first H100 session's 12.0 us), converted to
    megatrain's own template: the stand-in's time per dispatched op (its meta count over its
    dispatched count, both from its structure), times the template-over-stand-in ratio of the same
    phase from ``ratios`` (:func:`template_issue_costs` on one CPU: ``template_fwd_over_standin_fwd``,
    ``template_bwd_over_standin_bwd``). It assumes the stand-in's forward and backward ops cost the
    same per op on the GPU host (its ops are launch-bound there; on a CPU its backward kernels run
    inline and cost more), which a probe that measures the template itself does not need."""
    import torch
    import torch.fx as fx

    from megatrain.ir.issue import count_launches
    from megatrain.ir.profile import profile_template
    from megatrain.runtime.measure import LAUNCH_BLOCK_HIDDEN, _llama_like_block

    d, ff = LAUNCH_BLOCK_HIDDEN, 2 * LAUNCH_BLOCK_HIDDEN
    dtype = torch.bfloat16 if bf16 else torch.float32
    shapes = [(d,), (d, d), (d // 2, d), (d // 2, d), (d, d), (d,), (ff, d), (ff, d), (d, ff), (1, 16, d)]
    args = [torch.empty(s, dtype=dtype, device="meta") for s in shapes]
    gm = fx.symbolic_trace(_llama_like_block)
    meta = sum(count_launches(gm, args, [True] * len(args)))
    fwd, bwd = profile_template(gm, args, [True] * len(args))
    dispatched = fwd.launches + bwd.launches + len(args)  # + the leaves a local backward detaches
    per_op = standin_s_per_meta_op * meta / dispatched
    return per_op * ratios["template_fwd_over_standin_fwd"], per_op * ratios["template_bwd_over_standin_bwd"]


# -- matmul -----------------------------------------------------------------------------------------------

def section_matmul(ctx: Ctx) -> dict:
    import torch

    n = 256 if ctx.dry else 8192
    dev = "cuda" if ctx.cuda else "cpu"
    reps, warm = (3, 1) if ctx.dry else (10, 3)
    out: dict[str, Any] = {"n": n, "flop_per_product": 2 * n ** 3, "reps": reps, "warmup": warm}
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    try:
        for key, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp32", torch.float32, False),
                                 ("tf32", torch.float32, True)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            g = torch.Generator(device=dev).manual_seed(1)
            a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
            b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
            c = torch.empty(n, n, device=dev, dtype=dtype)
            times = _median_times(lambda: torch.mm(a, b, out=c), cuda=ctx.cuda, reps=reps, warmup=warm)
            t = statistics.median(times)
            rows = torch.arange(0, n, n // 2)[:2]
            ref = a[rows].double().cpu() @ b.double().cpu()
            err = float((c[rows].double().cpu() - ref).norm() / ref.norm())
            # rel_err tells the modes apart: FP32 ~1e-6, TF32 ~3e-4, a BF16 output ~2e-3 (METHOD.md's ranges).
            out[key] = {"dtype": str(dtype), "allow_tf32": tf32, "s": t, "flops_per_s": 2 * n ** 3 / t,
                        "rel_err_vs_fp64": err,
                        "fp32_precision": str(getattr(torch.backends.cuda.matmul, "fp32_precision", "n/a"))}
            del a, b, c
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    if ctx.dry:
        out["note"] = "dry run: CPU products; the TF32 switch has no effect on the CPU"
    return out


# -- kernels: the rates of the simulator's kernel model ----------------------------------------------------

def section_kernels(ctx: Ctx) -> dict:
    """The GPU rates :func:`megatrain.planner.time.kernel_time` reads, at the step's shapes (Llama-3.2-1B's
    block, 2 x 2048 tokens, BF16; tiny on a dry run), each timed with CUDA events, median of reps:

    - ``memory_bytes_per_s``: the element-wise ops of an unfused block (FP32 RMSNorm: cast, square,
      row mean, scale, cast back; a residual add; SwiGLU's silu and product; a strided-half ``cat``
      as rotary embeddings do), their bytes (distinct elements read and written, as the kernel
      profile counts them) over their summed time;
    - ``kernel_overhead_s``: GPU seconds per kernel of 1-element adds queued behind matmuls (the
      issuing thread far ahead), less nothing: their work is nil;
    - ``attention``: fused causal attention forward and backward at the step's shape (grouped-query
      heads), useful FLOP/s (``torch.utils.flop_counter``'s count halved for the causal mask);
    - ``matmuls``: the block's projections forward (``[tokens, in] x [in, out]``) and their weight
      gradients (``[out, tokens] x [tokens, in]``), FLOP/s each, beside the roofline's prediction from
      the measured ``bf16_flops`` and ``memory_bytes_per_s`` (not read by the spec: the check of
      the matmul model by shape);
    - ``h2d_after_cast_bytes_per_s``: a BF16 layer tile copied to the GPU right after the host cast
      it from FP32 masters (a CAST then its H2D, as a step runs them: the source is in the CPU's
      cache, not DRAM, when the copy engine reads it)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    sh = DRY_STEP if ctx.dry else GPU_STEP
    dev = "cuda" if ctx.cuda else "cpu"
    dt = torch.bfloat16 if ctx.cuda else torch.float32
    reps = 3 if ctx.dry else 10
    tokens, h, f = sh.micro_batch_size * sh.seq_len, sh.hidden, sh.ffn
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype=dt):
        return torch.randn(*shape, generator=g).to(dev, dtype)

    def median_s(fn) -> float:
        return statistics.median(_median_times(fn, cuda=ctx.cuda, reps=reps, warmup=2))

    x, r, w = rnd(tokens, h), rnd(tokens, h), rnd(h)
    up, gate = rnd(tokens, f), rnd(tokens, f)
    q4 = rnd(sh.micro_batch_size, sh.heads, sh.seq_len, h // sh.heads)
    x32 = x.float()
    ops = {  # name: (work, bytes of the distinct elements read and written)
        "cast_to_fp32": (lambda: x.float(), x.numel() * (x.element_size() + 4)),
        "square_fp32": (lambda: x32.pow(2), x32.numel() * 8),
        "row_mean_fp32": (lambda: x32.mean(-1, keepdim=True), x32.numel() * 4 + tokens * 4),
        "scale_rows_fp32": (lambda: x32 * x32[:, :1], x32.numel() * 8 + tokens * 4),
        "cast_to_compute": (lambda: x32.to(dt), x32.numel() * (4 + x.element_size())),
        "weight_mul": (lambda: w * x, 2 * x.numel() * x.element_size() + w.numel() * w.element_size()),
        "residual_add": (lambda: x + r, 3 * x.numel() * x.element_size()),
        "silu": (lambda: F.silu(gate), 2 * gate.numel() * gate.element_size()),
        "swiglu_mul": (lambda: gate * up, 3 * gate.numel() * gate.element_size()),
        "rotary_cat": (lambda: torch.cat((-q4[..., q4.shape[-1] // 2:], q4[..., :q4.shape[-1] // 2]), -1),
                       2 * q4.numel() * q4.element_size()),
    }
    elementwise, total_b, total_s = {}, 0, 0.0
    for name, (fn, nbytes) in ops.items():
        t = median_s(fn)
        elementwise[name] = {"bytes": nbytes, "s": t, "bytes_per_s": nbytes / t}
        total_b, total_s = total_b + nbytes, total_s + t
    out: dict[str, Any] = {"shape": sh.__dict__, "elementwise": elementwise, "memory_bytes_per_s": total_b / total_s}

    # Tiny kernels queued behind enough matmul work that the thread is far ahead when they run.
    tiny, n_tiny = torch.zeros(1, device=dev), 200 if ctx.dry else 2000
    big = rnd(2048, 2048) if ctx.cuda else rnd(64, 64)
    if ctx.cuda:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        for _ in range(40):  # ~20 ms of matmuls at H100 rates: the thread issues the adds meanwhile
            big @ big
        e0.record()
        for _ in range(n_tiny):
            tiny.add_(1.0)
        e1.record()
        torch.cuda.synchronize()
        out["kernel_overhead_s"] = e0.elapsed_time(e1) / 1e3 / n_tiny
    else:
        t0 = time.perf_counter()
        for _ in range(n_tiny):
            tiny.add_(1.0)
        out["kernel_overhead_s"] = (time.perf_counter() - t0) / n_tiny
    if float(tiny.item()) != float(n_tiny):
        raise RuntimeError(f"{n_tiny} adds left {tiny.item()}: kernels were lost")

    b, hq, hkv, s_len, hd = sh.micro_batch_size, sh.heads, sh.kv_heads, sh.seq_len, h // sh.heads
    q = rnd(b, hq, s_len, hd).requires_grad_(True)
    k, v = (rnd(b, hkv, s_len, hd).requires_grad_(True) for _ in range(2))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    go = torch.ones_like(o)
    t_fwd = median_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    t_bwd = median_s(lambda: torch.autograd.grad(o, (q, k, v), go, retain_graph=True))
    fwd_flops = sdpa_flop_count(q.shape, k.shape, v.shape)
    bwd_flops = sdpa_backward_flop_count(o.shape, q.shape, k.shape, v.shape)
    out["attention"] = {"q": list(q.shape), "kv": list(k.shape), "causal": True, "fwd_s": t_fwd, "bwd_s": t_bwd,
                        "fwd_counted_flops": fwd_flops, "bwd_counted_flops": bwd_flops,
                        "fwd_useful_flops_per_s": fwd_flops / 2 / t_fwd,
                        "bwd_useful_flops_per_s": bwd_flops / 2 / t_bwd}

    bf16 = (ctx.measured("matmul") or {}).get("bf16", {}).get("flops_per_s")
    kv = hkv * hd
    matmuls = []
    for m_, k_, n_ in ((tokens, h, h), (tokens, h, kv), (tokens, h, f), (tokens, f, h), (h, tokens, h),
                       (f, tokens, h), (h, tokens, f)):
        a, bm = rnd(m_, k_), rnd(k_, n_)
        t = median_s(lambda: a @ bm)
        flops, nbytes = 2 * m_ * k_ * n_, (m_ * k_ + k_ * n_ + m_ * n_) * a.element_size()
        row = {"m": m_, "k": k_, "n": n_, "s": t, "flops_per_s": flops / t}
        if bf16:
            row["roofline_s"] = max(flops / bf16, nbytes / out["memory_bytes_per_s"])
        matmuls.append(row)
    out["matmuls"] = matmuls

    # A CAST (FP32 masters -> BF16 pinned staging tile) and at once its H2D, as a step runs them.
    numel = (1 << 16) if ctx.dry else 60_821_504  # one 1B block's tile
    master = torch.randn(numel, generator=g)
    staging = torch.empty(numel, dtype=torch.bfloat16, pin_memory=ctx.cuda)
    slot = torch.empty(numel, dtype=torch.bfloat16, device=dev)
    times = []
    for _ in range(reps):
        staging.copy_(master)
        if ctx.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            slot.copy_(staging, non_blocking=True)
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        else:
            t0 = time.perf_counter()
            slot.copy_(staging)
            times.append(time.perf_counter() - t0)
    out["h2d_after_cast_bytes_per_s"] = numel * 2 / statistics.median(times)
    if ctx.dry:
        out["note"] = "dry run: CPU kernels at tiny sizes; the numbers check the harness, not a GPU"
    return out


# -- spec -------------------------------------------------------------------------------------------------

MEASURED_FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gpu_memory_bytes": ("environment", ("gpu", "total_memory_bytes")),
    "bf16_flops": ("matmul", ("bf16", "flops_per_s")),
    # IEEE FP32 (TF32 off): megatrain's FP32 ops run under strict_fp32 (HardwareSpec.fp32_flops). The
    # first GPU session (H100, 2026-11-27) filled it with the TF32 rate, 394 TFLOP/s for 51.
    "fp32_flops": ("matmul", ("fp32", "flops_per_s")),
    "h2d_bytes_per_s": ("copies", ("h2d_bytes_per_s",)),  # at the largest size
    "d2h_bytes_per_s": ("copies", ("d2h_bytes_per_s",)),
    "duplex": ("copies", ("duplex",)),
    "host_memory_bytes": ("environment", ("memory", "MemTotal")),
    "host_optimizer_params_per_s": ("host_rates", ("adamw_params_per_s_at_budget",)),
    "host_optimizer_bf16_params_per_s": ("host_rates", ("adamw_bf16_grads_params_per_s_at_budget",)),
    "host_cast_elements_per_s": ("host_rates", ("cast_elements_per_s_at_budget",)),
    "host_cores": ("host_rates", ("host_cores",)),
    # Seconds of the issuing thread per dispatched aten op of megatrain's template of the step's
    # block, forward and local backward (the 2026-11-27 probe measured a stand-in block instead).
    "launch_overhead_s": ("launch", ("template_fwd_s_per_op",)),
    "backward_launch_overhead_s": ("launch", ("template_bwd_s_per_op",)),
    # The kernel model's GPU rates (planner.time.kernel_time), at the step's shapes.
    "memory_bytes_per_s": ("kernels", ("memory_bytes_per_s",)),
    "kernel_overhead_s": ("kernels", ("kernel_overhead_s",)),
    "attention_flops": ("kernels", ("attention", "fwd_useful_flops_per_s")),
    "attention_backward_flops": ("kernels", ("attention", "bwd_useful_flops_per_s")),
    "h2d_after_cast_bytes_per_s": ("kernels", ("h2d_after_cast_bytes_per_s",)),
    # How much the host OPT (megatrain's kernel) and a CAST slow the issuing thread while they run.
    "host_optimizer_issue_stall": ("launch", ("optimizer_issue_stall",)),
    "host_cast_issue_stall": ("launch", ("cast_issue_stall",)),
    # How much a layer tile's H2D and the template's forward slow each other (_forward_beside_h2d): the
    # simulator's copy/compute contention. Presets leave both unmeasured (no contention).
    "h2d_beside_compute_bytes_per_s": ("launch", ("forward_beside_h2d", "h2d_beside_forward_bytes_per_s")),
    "compute_slowdown_beside_h2d": ("launch", ("forward_beside_h2d", "forward_slowdown")),
    # How much copies in flight slow the thread that queued them and launches the forward
    # (_same_thread_beside_h2d): the simulator's issuing thread beside an H2D-stream copy.
    "issue_slowdown_beside_h2d": ("launch", ("forward_beside_h2d", "issue_slowdown_beside_h2d")),
}
"""Each HardwareSpec field the probe measures: (section, keys into its result). Fields the spec type
lacks are left out; fields whose section did not succeed come from ``--fallback-preset``, listed."""


def section_spec(ctx: Ctx) -> dict:
    from megatrain.ir.hardware import (HOST_KERNEL_ISSUE_STALL, MEASURED_MATMUL_EFFICIENCY, PINNED_FRACTION,
                                       HardwareSpec, cpu_name, preset)

    fallback = preset(ctx.args.fallback_preset)
    known = HardwareSpec.model_fields
    fields: dict[str, Any] = {}
    sources: dict[str, str] = {}
    from_preset: list[str] = []
    for name, (section, keys) in MEASURED_FIELDS.items():
        if name not in known:
            continue
        value: Any = ctx.measured(section)
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        where = f"{section}.{'.'.join(keys)}"
        if value is None:
            fields[name] = getattr(fallback, name)
            from_preset.append(name)
            sources[name] = f"{ctx.args.fallback_preset} preset ({where} not measured)"
        else:
            fields[name] = value
            sources[name] = where
    fields["pinned_memory_cap_bytes"] = int(fields["host_memory_bytes"] * PINNED_FRACTION)
    sources["pinned_memory_cap_bytes"] = "PINNED_FRACTION x host_memory_bytes"
    fields["matmul_efficiency"] = MEASURED_MATMUL_EFFICIENCY
    sources["matmul_efficiency"] = "MEASURED_MATMUL_EFFICIENCY (an estimate, not measured)"
    if "bf16_flops" not in from_preset:
        fields["gemm_efficiency"] = 1.0
        sources["gemm_efficiency"] = "1.0: bf16_flops is a measured large (8192^3) product's rate"
    else:
        fields["gemm_efficiency"] = fallback.gemm_efficiency
        sources["gemm_efficiency"] = f"{ctx.args.fallback_preset} preset (its bf16_flops is a datasheet peak)"
    measured_with = (ctx.measured("launch") or {}).get("optimizer_kernel")
    if ("host_optimizer_issue_slowdown" in known and "host_optimizer_issue_stall" not in from_preset
            and HOST_KERNEL_ISSUE_STALL.get(measured_with) == 0.0):
        # A kernel that releases the GIL slows the issuing thread throughout the OPT rather than
        # stopping it for a leading share: its measured stall is the spec's slowdown.
        fields["host_optimizer_issue_slowdown"] = min(fields["host_optimizer_issue_stall"], math.nextafter(1.0, 0.0))
        sources["host_optimizer_issue_slowdown"] = (f"launch.optimizer_issue_stall ({measured_with!r}'s kernel "
                                                    "releases the GIL: a slowdown throughout the OPT)")
        fields["host_optimizer_issue_stall"] = HOST_KERNEL_ISSUE_STALL[measured_with]
        sources["host_optimizer_issue_stall"] = (f"HOST_KERNEL_ISSUE_STALL[{measured_with!r}] (the GIL is released; "
                                                 "launch.optimizer_issue_stall is host_optimizer_issue_slowdown)")
    kernel = (ctx.measured("host_rates") or {}).get("megatrain_kernel")
    if "host_optimizer_issue_stall" in from_preset and kernel in HOST_KERNEL_ISSUE_STALL:
        from_preset.remove("host_optimizer_issue_stall")
        fields["host_optimizer_issue_stall"] = HOST_KERNEL_ISSUE_STALL[kernel]
        sources["host_optimizer_issue_stall"] = (f"HOST_KERNEL_ISSUE_STALL[{kernel!r}] (the kernel host_rates "
                                                 "measured; launch.optimizer_issue_stall not measured)")
    defaults = [k for k in known if k not in fields and k != "name"]
    for k in defaults:
        sources[k] = "HardwareSpec default (not measured by the probe)"
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    gpu = ((ctx.measured("environment") or {}).get("gpu") or {}).get("name", "GPU?")
    if ctx.dry:
        name = f"gpu_probe dry run {when}: CPU stand-in measurements on {cpu_name()}, not a GPU"
    else:
        name = f"gpu_probe {when}: {gpu} + {cpu_name()} x{os.cpu_count()}"
    if from_preset:
        name += f" (partly {ctx.args.fallback_preset} preset: {', '.join(from_preset)})"
    spec = HardwareSpec(name=name, **fields)
    path = ctx.out / "spec.json"
    spec.save(path)
    back = HardwareSpec.load(path)
    if back != spec:
        raise RuntimeError(f"{path} does not read back to the spec that was saved")
    ctx.spec = spec
    return {"path": path.name, "spec": json.loads(spec.model_dump_json()), "sources": sources,
            "fields_from_preset": from_preset, "fields_at_default": defaults,
            "measured_fields_not_in_spec_type": [f for f in MEASURED_FIELDS if f not in known]}


# -- one measured step beside simulate() --------------------------------------------------------------------

@dataclass(frozen=True)
class StepShape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    micro_batch_size: int
    micro_batches: int


GPU_STEP = StepShape(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, vocab=32000, seq_len=2048,
                     micro_batch_size=2, micro_batches=4)
"""Llama-3.2-1B's blocks with Llama-2's 32,000-token vocabulary, untied: 1,104,218,112 parameters
(per block 2 h^2 + 2 h kv + 3 h ffn + 2 h = 60,821,504 with h 2048, kv 512, ffn 8192; 16 blocks, the
final norm and two 32,000 x 2048 embeddings). Global batch 8 x 2048 tokens as 4 micro-batches of 2."""

DRY_STEP = StepShape(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=256, seq_len=32,
                     micro_batch_size=2, micro_batches=2)

STANDIN_STEP = StepShape(layers=3, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=256, seq_len=16,
                         micro_batch_size=1, micro_batches=1)
"""The stand-in block's own dimensions (``runtime.measure._llama_like_block``: hidden 64, FFN 128,
4 heads, 2 KV heads, 16 tokens) as a model: :func:`template_issue_costs` on a CPU at this shape
compares the two templates' code paths on the same arithmetic (``bench/template_issue.py``)."""


def llama_config(sh: StepShape):
    """The ``LlamaConfig`` of ``sh`` (untied embeddings, no KV cache)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=sh.vocab, hidden_size=sh.hidden, intermediate_size=sh.ffn,
                       num_hidden_layers=sh.layers, num_attention_heads=sh.heads, num_key_value_heads=sh.kv_heads,
                       max_position_embeddings=max(sh.seq_len, 128), tie_word_embeddings=False, use_cache=False)


def section_step(ctx: Ctx) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    import megatrain

    if ctx.spec is None:
        raise RuntimeError("the step needs the spec section's HardwareSpec, which it did not build (see the "
                           "spec section's error); run with --sections including spec")
    spec = ctx.spec
    sh = DRY_STEP if ctx.dry else GPU_STEP
    if ctx.args.layers:
        sh = StepShape(**{**sh.__dict__, "layers": ctx.args.layers})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(sh))
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    trainer = megatrain.compile(model, seq_len=sh.seq_len, micro_batch_size=sh.micro_batch_size,
                                micro_batches=sh.micro_batches, optimizer=megatrain.AdamW(lr=1e-4),
                                hardware=spec, device="cpu" if ctx.dry else "cuda")
    compile_s = time.perf_counter() - t0
    if ctx.dry:
        from megatrain.runtime.cuda import CUDABackend
        from megatrain.testing import FakeCuda

        # The CUDA backend's logic on CPU tensors; the executor allocates its slots at the first run.
        trainer.backend = trainer.executor.backend = CUDABackend(adapter=FakeCuda())
    backend = trainer.backend
    try:
        out = _measured_step(ctx, torch, trainer, spec, sh, compile_s, params)
    except BaseException:
        # The step's own error is what the JSON records; closing the backend after it adds nothing.
        with contextlib.suppress(Exception):
            backend.close()
        raise
    backend.close()
    return out


def _measured_step(ctx: Ctx, torch, trainer, spec, sh: StepShape, compile_s: float, params: int) -> dict:
    from megatrain.planner.simulate import simulate
    from megatrain.planner.timeline import measured_timeline

    backend = trainer.backend
    rows = sh.micro_batch_size * sh.micro_batches
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"model": {**sh.__dict__, "params": params, "tied": False},
                           "backend": type(backend).__name__ + (" + FakeCuda" if ctx.dry else ""),
                           "compile_s": compile_s, "plan": _plan_dict(trainer.plan), "steps": []}
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    measured = None
    sched = None
    timed: list[tuple[int, Any]] = []  # (row index, measured Timeline) of each timed step
    for i in range(1 + ctx.args.steps):
        ids = torch.randint(0, sh.vocab, (rows, sh.seq_len), generator=g)
        backend.record = i > 0  # the first step is the warm-up: allocations, cuBLAS handles
        sched = trainer.schedule  # the schedule this step runs
        cpu0 = time.thread_time()
        res = trainer.step({"input_ids": ids, "labels": ids})
        # The issuing thread's CPU seconds in the step (launches, Python, waits that spin): near
        # wall_s when issuing is what the step waits for.
        row = {"step": res.step, "loss": res.loss, "wall_s": res.seconds, "warmup": i == 0,
               "applied": res.applied, "issuing_thread_cpu_s": time.thread_time() - cpu0}
        if i > 0:
            timed.append((len(out["steps"]), measured_timeline(backend, sched, trainer.graph, spec)))
            row["timeline_step_s"] = timed[-1][1].step_time_s
        out["steps"].append(row)
        if not math.isfinite(res.loss):
            raise RuntimeError(f"step {res.step} gave a non-finite loss {res.loss}")
    kept, measured = timed[median_step([t.step_time_s for _, t in timed])]
    out["steps"][kept]["timeline_kept"] = True
    predicted = simulate(sched, trainer.graph, spec)
    out["profile"] = _profiled_step(ctx, torch, trainer, sh, g)
    out["measured"] = _timeline_summary(measured)
    out["predicted"] = _timeline_summary(predicted)
    out["predicted_over_measured"] = predicted.step_time_s / measured.step_time_s
    out["by_context"] = by_context(measured, predicted)
    out["ops"] = len(sched.ops)
    if ctx.cuda:
        out["peak_gpu_allocated_bytes"] = torch.cuda.max_memory_allocated()
        # The GPU reserve this step needed, beside the planner's derived one (megatrain.planner.memory.gpu_reserve):
        # what the device held at the peak (the allocator's reserved bytes, the context and its
        # modules) less the plan's own peak. A spec's gpu_reserve_bytes takes it as measured.
        from megatrain.planner.cost import memory_breakdown

        planned = memory_breakdown(trainer.graph, trainer.plan, spec, sched)
        free, total = torch.cuda.mem_get_info()
        context = total - free - torch.cuda.memory_reserved()
        stats = torch.cuda.memory_stats()
        out["reserve"] = {"derived_bytes": planned.reserve, "planned_peak_bytes": planned.gpu_peak,
                          "max_reserved_bytes": torch.cuda.max_memory_reserved(), "context_bytes": context,
                          "measured_bytes": torch.cuda.max_memory_reserved() + context
                          - (planned.gpu_peak - planned.reserve),
                          "alloc_retries": stats.get("num_alloc_retries", 0)}
        out["host_memory_stats"] = {k: v for k, v in torch.cuda.host_memory_stats().items()
                                    if k in ("allocated_bytes.current", "allocated_bytes.peak",
                                             "num_host_alloc", "host_alloc_time.total")}
    (ctx.out / "timelines.json").write_text(json.dumps(
        {"measured": json.loads(measured.to_json()), "predicted": json.loads(predicted.to_json()),
         "measured_steps": [{"step": out["steps"][k]["step"], "timeline": json.loads(t.to_json())} for k, t in timed]}))
    trace = measured.to_chrome_trace()
    for ev in predicted.to_chrome_trace()["traceEvents"]:
        trace["traceEvents"].append({**ev, "pid": 2})
    (ctx.out / "trace.json").write_text(json.dumps(trace))
    out["files"] = ["timelines.json", "trace.json"]
    return out


BESIDE_KINDS = ("CAST", "OPT", "H2D", "D2H")
"""The op kinds whose overlap with a compute op :func:`by_context` names: the host ops that slow the
issuing thread (CAST, OPT) and the copies that contend with compute (H2D) or share the link (D2H)."""

BESIDE_FRACTION = 0.5
"""A compute op counts as beside an op kind when ops of that kind overlap at least this share of its
measured time."""


def by_context(measured: Timeline, predicted: Timeline) -> list[dict]:
    """Compute ops (FWD, RECOMPUTE, BWD) of ``measured`` grouped by op kind and what ran beside them
    in the measured step (the :data:`BESIDE_KINDS` overlapping at least :data:`BESIDE_FRACTION` of
    the op; ``"alone"`` for none), each group's median measured and predicted seconds (the same ops
    in ``predicted``, the same schedule simulated): where a ratio departs from the others, what ran
    beside those ops is the suspect (2026-11-27: block forwards beside a CAST 2.45 ms, alone
    2.02 ms, both predicted 1.80). Rows sorted by kind, then context; ops missing from
    ``predicted`` are left out."""
    from megatrain.ir.schedule import OpKind

    pred = {r.op: r for r in predicted.records}
    windows: dict[str, list[tuple[float, float]]] = {k: [] for k in BESIDE_KINDS}
    for r in measured.records:
        if r.kind.value in windows:
            windows[r.kind.value].append((r.start_s, r.end_s))
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in measured.records:
        kind = r.kind.value
        if r.kind not in (OpKind.FWD, OpKind.RECOMPUTE, OpKind.BWD) or r.op not in pred or r.end_s <= r.start_s:
            continue
        d = r.end_s - r.start_s
        beside = [k for k, ws in windows.items()
                  if sum(max(0.0, min(r.end_s, b) - max(r.start_s, a)) for a, b in ws) >= BESIDE_FRACTION * d]
        q = pred[r.op]
        groups.setdefault((kind, "+".join(beside) or "alone"), []).append((d, q.end_s - q.start_s))
    return [{"kind": kind, "beside": ctx, "ops": len(v), "measured_median_s": statistics.median(m for m, _ in v),
             "predicted_median_s": statistics.median(p for _, p in v)}
            for (kind, ctx), v in sorted(groups.items())]


def median_step(step_times_s: list[float]) -> int:
    """Index of the timed step whose timeline the probe compares with the simulator (``measured`` in
    ``probe.json`` and ``timelines.json``): the one of median step time (seconds), the lower of the
    middle two for an even count, so one step disturbed by something outside the schedule (the
    2026-11-27 H100 probe's last step: ~100 ms in two layers' backwards, 0.844 s where the one before
    took 0.738 s) neither sets the comparison nor is averaged into it; equal times rank in step order.

    Raises:
        ValueError: no step times."""
    if not step_times_s:
        raise ValueError("median_step: no timed steps (the probe runs at least one, --steps >= 1)")
    order = sorted(range(len(step_times_s)), key=lambda i: (step_times_s[i], i))
    return order[(len(order) - 1) // 2]


def _profiled_step(ctx: Ctx, torch, trainer, sh: StepShape, g) -> dict:
    """One more step under ``torch.profiler`` (not recorded in the timeline): whether the GPU idles
    inside the compute ops, waiting on the issuing thread, or its kernels are slow. The union of all
    CUDA kernels' intervals over the step's wall time (``gpu_kernel_busy_fraction``), the kernel
    count, and the top kernels by GPU time and aten ops by the issuing thread's self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    rows = sh.micro_batch_size * sh.micro_batches
    ids = torch.randint(0, sh.vocab, (rows, sh.seq_len), generator=g)
    trainer.backend.record = False
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        trainer.step({"input_ids": ids, "labels": ids})
        if ctx.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy_us, end = 0.0, -math.inf
    for a, b in kernels:  # union of the kernels' intervals, microseconds
        if b > end:
            busy_us += b - max(a, end)
            end = b
    avg = prof.key_averages()
    dev_attr = "device_time_total" if hasattr(avg[0], "device_time_total") else "cuda_time_total"

    def top(key, n=20):
        chosen = sorted(avg, key=lambda e: getattr(e, key), reverse=True)[:n]
        return [{"name": e.key[:120], "calls": e.count, "s": getattr(e, key) / 1e6} for e in chosen]

    return {"wall_s": wall, "cuda_kernels": len(kernels), "gpu_kernel_busy_s": busy_us / 1e6,
            "gpu_kernel_busy_fraction": busy_us / 1e6 / wall,
            "top_gpu": top(dev_attr) if ctx.cuda else [], "top_self_cpu": top("self_cpu_time_total")}


def _plan_dict(plan) -> dict:
    return {"micro_batches": plan.micro_batches, "slots": plan.slots, "prefetch_distance": plan.prefetch_distance,
            "grad_ring": plan.grad_ring, "resident": sorted(plan.resident), "layer_by_layer": plan.layer_by_layer,
            "optimizer": plan.optimizer.value, "compute_dtype": plan.compute_dtype,
            "staging_ring": plan.staging_ring,
            "activations": [a.value for a in plan.activations]}


def _timeline_summary(tl) -> dict:
    """A Timeline's figures: step, throughput, per-stream busy time (each op from its start marker
    to its end marker) and, for a measured CUDA step, its split into GPU-busy time (the op's work
    all issued) and issue-bound time (the op still being issued), with the issuing thread's
    seconds issuing and, of those, off a core (``issuing_thread``); seconds per op kind."""
    by_kind: dict[str, dict] = {}
    for r in tl.records:
        k = by_kind.setdefault(r.kind.value, {"count": 0, "total_s": 0.0})
        k["count"] += 1
        k["total_s"] += r.duration_s
        if r.issued_s is not None:
            k["gpu_busy_s"] = k.get("gpu_busy_s", 0.0) + r.gpu_busy_s
            k["issue_bound_s"] = k.get("issue_bound_s", 0.0) + r.issue_bound_s

    def per_stream(d):
        return {s.value: x for s, x in d.items()}

    return {"step_time_s": tl.step_time_s, "hardware": tl.hardware, "tokens_per_s": tl.tokens_per_s,
            "mfu": tl.mfu, "bottleneck": tl.bottleneck.value,
            "busy_s": per_stream(tl.busy_s), "busy_fraction": per_stream(tl.busy_fraction),
            "gpu_busy_s": per_stream(tl.gpu_busy_s), "gpu_busy_fraction": per_stream(tl.gpu_busy_fraction),
            "issue_bound_s": per_stream(tl.issue_bound_s), "issue_bound_fraction": per_stream(tl.issue_bound_fraction),
            "issuing_thread": {"busy_s": sum(tl.issue_busy_s.values()), "blocked_s": sum(tl.issue_blocked_s.values()),
                               "busy_s_by_stream": per_stream(tl.issue_busy_s),
                               "blocked_s_by_stream": per_stream(tl.issue_blocked_s)} if tl.issue_busy_s else None,
            "by_kind": by_kind, "gpu_peak_bytes": tl.gpu_peak_bytes, "pinned_peak_bytes": tl.pinned_peak_bytes,
            "tail": _tail(tl)}


def _tail(tl) -> dict | None:
    """The step's tail: the ops still running after the compute stream's last op ends (with updates
    during backward, the D2H and optimizer steps of the last layers the backward reaches, which are
    the first layers of the forward), ``after_last_compute_s`` long.

    ``carry_saving_bound_s``: the most that carrying those optimizer steps into the next step, to
    run there beside its forward, could save. Exactness has each of them end before its layer's
    first H2D or CAST of the next step, and they run one at a time on the host (HOST and CAST share
    the cores), so the next step's forward of layer ``l`` still waits for the carried steps of
    every tail layer up to ``l``: only the forward of the layers below the highest tail layer can
    overlap them, and never more than the tail. None without a compute op."""
    from megatrain.ir.schedule import Op, OpKind, Stream

    compute = [r.end_s for r in tl.records if r.stream is Stream.COMPUTE]
    if not compute:
        return None
    end = max(compute)
    after = sorted((r for r in tl.records if r.end_s > end), key=lambda r: r.start_s)
    layers = sorted({Op.parse(r.op).layer for r in after if r.kind is OpKind.OPT})
    forward = sum(r.duration_s for r in tl.records
                  if r.kind is OpKind.FWD and layers and Op.parse(r.op).layer < layers[-1])
    tail = tl.step_time_s - end
    return {"after_last_compute_s": tail, "ops": [r.op for r in after], "opt_layers": layers,
            "forward_below_s": forward, "carry_saving_bound_s": min(tail, forward)}


# -- the tests, in subprocesses -----------------------------------------------------------------------------

RACE_TESTS = "tests/test_race_detector.py"


def section_cuda_tests(ctx: Ctx) -> dict:
    paths = ["tests/test_backends.py"] if ctx.dry else ["tests"]
    if "race_detector" in ctx.sections and (ROOT / RACE_TESTS).exists():
        paths.append(f"--ignore={RACE_TESTS}")  # its CUDA tests run in their own section
    return _pytest(ctx, paths, "junit_cuda.xml", select_cuda=True)


def section_race_detector(ctx: Ctx) -> dict | Skipped:
    if not (ROOT / RACE_TESTS).exists():
        return Skipped(f"{RACE_TESTS} does not exist in this checkout")
    # The file's CUDA tests: the detector on real streams (its CPU tests run in the ordinary suite).
    # Without CUDA they skip, which checks the plumbing in seconds.
    return _pytest(ctx, [RACE_TESTS], "junit_race.xml", select_cuda=True)


SUBPROCESS_SECTIONS = ("cuda_tests", "race_detector")


def _pytest(ctx: Ctx, paths: list[str], junit_name: str, select_cuda: bool) -> dict:
    junit = ctx.out / junit_name
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", "--continue-on-collection-errors",
            f"--junitxml={junit}", *paths]
    env = dict(os.environ)
    if select_cuda:
        argv[3:3] = ["-p", "gpu_probe"]
        env[SELECT_ENV] = "cuda"
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), *filter(None, [env.get("PYTHONPATH")])])
    timeout = max(ctx.limit_s, 1.0)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise SectionTimeout(f"pytest {' '.join(paths)} ran past its limit of {timeout:.0f} s and was killed; "
                             f"output so far: ...{tail[-1500:]}") from None
    out: dict[str, Any] = {"command": " ".join(argv[1:]), "selection": "needs CUDA" if select_cuda else "all",
                           "exit_code": p.returncode, "seconds": time.perf_counter() - t0,
                           "output_tail": (p.stdout + p.stderr)[-4000:], "junit": junit_name}
    if junit.exists():
        out.update(parse_junit(junit))
    else:
        out["junit_missing"] = True
    if p.returncode not in (0, 1, 5):  # 1: some tests failed (in the counts); 5: none selected
        raise RuntimeError(f"pytest exited with {p.returncode} (interrupted, internal or usage error): "
                           f"{(p.stdout + p.stderr)[-1500:]}")
    return out


def parse_junit(path: Path) -> dict:
    """Counts and failures from a pytest ``--junitxml`` file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
    failed, skipped_reasons = [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                failed.append({"test": name, "kind": tag, "message": (el.get("message") or "")[:500]})
        sk = case.find("skipped")
        if sk is not None:
            reason = (sk.get("message") or "")[:200]
            skipped_reasons[reason] = skipped_reasons.get(reason, 0) + 1
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed, "skip_reasons": skipped_reasons}


def _needs_cuda(item) -> bool:
    """Marked ``cuda``, or skipped exactly when CUDA is absent with a reason naming CUDA
    (``conftest.requires_cuda``). The condition is compared with this machine's CUDA, so a test
    skipped *on* CUDA machines (one that checks the error raised without a GPU) is left out."""
    if item.get_closest_marker("cuda") is not None:
        return True
    import torch

    absent = not torch.cuda.is_available()
    for m in item.iter_markers("skipif"):
        cond = m.args[0] if m.args else m.kwargs.get("condition")
        if isinstance(cond, bool) and cond == absent and "cuda" in str(m.kwargs.get("reason", "")).lower():
            return True
    return False


def pytest_collection_modifyitems(config, items) -> None:
    """Pytest plugin hook (``-p gpu_probe`` with ``GPU_PROBE_SELECT=cuda``): keep the CUDA tests."""
    if os.environ.get(SELECT_ENV) != "cuda":
        return
    needs = [_needs_cuda(it) for it in items]
    keep = [it for it, n in zip(items, needs) if n]
    drop = [it for it, n in zip(items, needs) if not n]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


SECTIONS: dict[str, Callable[[Ctx], Any]] = {
    "environment": section_environment, "copies": section_copies, "pinned_alloc": section_pinned_alloc,
    "host_rates": section_host_rates, "launch": section_launch, "matmul": section_matmul,
    "kernels": section_kernels, "spec": section_spec,
    "step": section_step, "cuda_tests": section_cuda_tests, "race_detector": section_race_detector,
}


# -- summary and main ---------------------------------------------------------------------------------------

def summary(ctx: Ctx) -> dict:
    """The few numbers a reader wants first, each None where its section did not succeed."""
    def get(section: str, *keys):
        cur: Any = ctx.measured(section)
        for k in keys:
            if not isinstance(cur, dict):
                return None
            cur = cur.get(k)
        return cur

    return {
        "gpu": get("environment", "gpu", "name"),
        "h2d_GBps": _scale(get("copies", "h2d_bytes_per_s"), 1e-9),
        "d2h_GBps": _scale(get("copies", "d2h_bytes_per_s"), 1e-9),
        "duplex": get("copies", "duplex"),
        "bf16_TFLOPs": _scale(get("matmul", "bf16", "flops_per_s"), 1e-12),
        "fp32_TFLOPs": _scale(get("matmul", "fp32", "flops_per_s"), 1e-12),
        "tf32_TFLOPs": _scale(get("matmul", "tf32", "flops_per_s"), 1e-12),
        "adamw_Gparams_per_s": _scale(get("host_rates", "adamw_params_per_s_at_budget"), 1e-9),
        "cast_Gelements_per_s": _scale(get("host_rates", "cast_elements_per_s_at_budget"), 1e-9),
        "launch_us_per_op": _scale(get("launch", "issue_s_per_op"), 1e6),
        "measured_step_s": get("step", "measured", "step_time_s"),
        "predicted_step_s": get("step", "predicted", "step_time_s"),
        "predicted_over_measured": get("step", "predicted_over_measured"),
        # Compute stream: its ops' time (start to end marker), and of that the GPU busy with work all
        # issued vs the ops still being issued (the GPU waiting on the issuing thread for part of it).
        "compute_busy_fraction": get("step", "measured", "busy_fraction", "compute"),
        "compute_gpu_busy_fraction": get("step", "measured", "gpu_busy_fraction", "compute"),
        "compute_issue_bound_fraction": get("step", "measured", "issue_bound_fraction", "compute"),
        "issuing_thread_busy_s": get("step", "measured", "issuing_thread", "busy_s"),
        "issuing_thread_blocked_s": get("step", "measured", "issuing_thread", "blocked_s"),
        # After the last compute op: the last layers' optimizer steps, and what carrying them could save.
        "tail_s": get("step", "measured", "tail", "after_last_compute_s"),
        "tail_carry_saving_bound_s": get("step", "measured", "tail", "carry_saving_bound_s"),
        "cuda_tests": _test_counts(get("cuda_tests")),
        "race_detector": _test_counts(get("race_detector")),
        "statuses": {k: v["status"] for k, v in ctx.results.items()},
    }


def _scale(x, k):
    return None if x is None else x * k


def _test_counts(r) -> str | None:
    if not r or "tests" not in r:
        return None
    return f"{r['passed']} passed, {r['failures']} failed, {r['errors']} errors, {r['skipped']} skipped"


def _kv(pairs: list[str], what: str, choices=None, convert=str) -> dict:
    out = {}
    for p in pairs:
        name, sep, val = p.partition("=")
        if not sep or name not in SECTIONS:
            raise SystemExit(f"{what} {p!r}: write SECTION=VALUE with SECTION one of {list(SECTIONS)}")
        if choices and val not in choices:
            raise SystemExit(f"{what} {p!r}: VALUE must be one of {choices}")
        out[name] = convert(val)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for probe.json and the other files")
    ap.add_argument("--dry-run", action="store_true", help="every section on the CPU with tiny sizes, in seconds")
    ap.add_argument("--sections", default=",".join(SECTION_ORDER),
                    help=f"comma-separated subset of {','.join(SECTION_ORDER)} (run in that order)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="wall-clock budget of the whole probe; no section starts past it (default 540)")
    ap.add_argument("--limit", action="append", default=[], metavar="SECTION=SECONDS",
                    help="override one section's time limit")
    ap.add_argument("--steps", type=int, default=3, help="measured steps after one warm-up step (default 3: the "
                    "timeline compared is the median step's)")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers of the step's model (default: 16; dry 2)")
    ap.add_argument("--fallback-preset", default="H100_SXM",
                    help="preset whose values the spec takes, listed, for fields whose measurement failed")
    ap.add_argument("--inject", action="append", default=[], metavar="SECTION=error|hang",
                    help="for the probe's own tests: make SECTION raise, or hang until its limit")
    args = ap.parse_args(argv)
    args.limit = _kv(args.limit, "--limit", convert=float)
    args.inject = _kv(args.inject, "--inject", choices=("error", "hang"))
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown}; choose from {list(SECTION_ORDER)}")
    names = [s for s in SECTION_ORDER if s in names]
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args=args, out=args.out, dry=args.dry_run, sections=tuple(names))
    doc: dict[str, Any] = {"probe_format_version": PROBE_FORMAT_VERSION,
                           "mode": "dry-run" if args.dry_run else "gpu",
                           "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "command": " ".join([Path(sys.executable).name, *sys.argv]),
                           "budget_s": args.budget_s, "sections": {}}
    path = args.out / "probe.json"

    def write() -> None:
        doc["summary"] = summary(ctx)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, path)

    run_sections(ctx, names, doc, write)
    doc["finished_utc"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write()
    print_table(doc)
    return 0


def print_table(doc: dict) -> None:
    print(f"\ngpu_probe ({doc['mode']}), {doc['started_utc']} -> {doc['finished_utc']}")
    print("| section | status | seconds |")
    print("| --- | --- | --- |")
    for name, e in doc["sections"].items():
        print(f"| {name} | {e['status']} | {e.get('seconds', '-')} |")
    print()
    for k, v in doc["summary"].items():
        if k != "statuses":
            print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
