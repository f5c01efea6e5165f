"""Measure this machine: a :class:`~megatrain.ir.hardware.HardwareSpec`, matmul rates, host memory.

The planner plans against a spec and never times anything (it imports no torch timing and no
CUDA); measuring is the runtime's side of that boundary, so it lives here and returns plain data.

- :func:`measure_hardware`: a whole spec, host fields always, GPU fields with CUDA.
- :func:`measure_matmul_flops`: FLOP/s of one ``n x n`` product on a device, the one matmul timer
  (the spec's ``bf16_flops``/``fp32_flops`` and a run's MFU peak both come from it).
- :func:`measure_host_rates`: the host rates of a spec (AdamW from FP32 and from BF16 gradients, the
  CAST), each on tiles several times the last-level cache (:func:`l3_cache`), so that they are DRAM
  rates as a layer's tiles get, at the intra-op threads the runtime's host workers run with;
  :func:`measure_adamw` and :func:`measure_cast` time one of them on the calling thread.
- Host memory from the OS, in bytes: :func:`total_host_memory_bytes`,
  :func:`available_host_memory` and :func:`host_rss_bytes` (Linux ``/proc``, with ``sysconf`` or
  psutil where ``/proc`` has no answer).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from megatrain.errors import ConfigError
from megatrain.ir.hardware import (CAST_BYTES_PER_ELEMENT, MEASURED_MATMUL_EFFICIENCY, PINNED_FRACTION, HardwareSpec,
                                   cpu_name, host_worker_threads, strict_fp32)
from megatrain.units import MiB

MATMUL_N = 1024
"""Side of the square matrices :func:`measure_matmul_flops` multiplies by default: large enough for
a CPU's BLAS to reach its sustained rate, small enough to time in a fraction of a second."""

MATMUL_SECONDS = 0.3
"""Default seconds :func:`measure_matmul_flops` times products for, after one warm-up product."""

GPU_MATMUL_N = 8192
"""Side of the matrices timed for a spec's GPU rates: 2 x 8192^3 = 1.1 TFLOP per product keeps a
Hopper GPU's tensor cores busy for about a millisecond, long past launch latency."""

GPU_MATMUL_SECONDS = 0.2
"""Seconds each GPU matmul rate is timed for in :func:`measure_hardware`."""

COPY_BYTES = 256 * MiB
"""Bytes of each pinned copy timed for a spec's H2D and D2H bandwidth: far beyond the copy
engines' fixed cost, so the rate is the link's sustained rate."""

COPY_REPS = 5
"""Copies timed per direction (after one warm-up copy)."""

HOST_TILE_L3_MULTIPLE = 4
"""The host rates are timed on tiles whose working set is this many times the host's total L3, so
the tiles stream from DRAM as a layer's do (a 64 MB working set fits the L3 of many server CPUs)."""

HOST_TILE_MIN_NUMEL = 4 << 20
"""The fewest elements a host-rate tile has, where the L3 size is unknown or small."""

DUPLEX_FRACTION = 0.75
"""Both directions at once in under this fraction of their serial time counts as full duplex: a
full-duplex link finishes both in about the longer one's time (0.5 of the serial time for equal
rates), one shared engine needs the whole sum."""


# -- host memory -----------------------------------------------------------------------------------

def total_host_memory_bytes() -> int:
    """Physical host memory in bytes: ``sysconf`` pages x page size, else ``MemTotal`` of
    ``/proc/meminfo``; 0 when neither answers."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return _meminfo_bytes("MemTotal") or 0


def available_host_memory() -> tuple[int, str] | None:
    """``(bytes, where it was read)`` of host memory available to a new allocation, or None.

    Reads ``MemAvailable`` in ``/proc/meminfo`` (Linux), else ``psutil.virtual_memory().available``
    when psutil is installed.
    """
    n = _meminfo_bytes("MemAvailable")
    if n is not None:
        return n, "MemAvailable in /proc/meminfo"
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available), "psutil.virtual_memory().available"


def host_rss_bytes() -> int | None:
    """Resident set size of this process in bytes (``/proc/self/statm``, else psutil), or None."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def _meminfo_bytes(key: str) -> int | None:
    """The ``key:`` line of ``/proc/meminfo`` in bytes (the file reports kB), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# -- rates -----------------------------------------------------------------------------------------

def measure_matmul_flops(device: str = "cpu", dtype=None, *, n: int = MATMUL_N,
                         seconds: float | None = None) -> float:
    """FLOP/s of ``torch.mm`` on two ``n x n`` matrices of ``dtype`` (default FP32) on ``device``.

    Times repeated products for about ``seconds`` (default :data:`MATMUL_SECONDS`) after one
    warm-up product, with the current ``torch.get_num_threads()``, synchronising a CUDA device
    every four products; counts ``2 n^3`` FLOPs per product. FP32 runs under
    :func:`~megatrain.ir.hardware.strict_fp32` (TF32 off; the caller's setting is restored),
    the precision megatrain's FP32 compute runs in, so the rate is the one the runtime gets.
    Uses a private generator, so the global torch RNG (and with it a model's initialisation) is
    untouched.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    seconds = MATMUL_SECONDS if seconds is None else seconds
    # Drawn where they are multiplied: 8192-sided matrices would take a second to fill on the host.
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.rand(n, n, generator=g, device=device).to(dtype)
    b = torch.rand(n, n, generator=g, device=device).to(dtype)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    with strict_fp32():  # BF16 products are unaffected
        torch.mm(a, b)
        sync()
        reps, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            reps += 1
            if reps % 4 == 0:
                sync()
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds:
                    return 2.0 * n ** 3 * reps / elapsed


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def l3_cache() -> dict:
    """Total L3 bytes of the host: the sum over distinct L3 instances in sysfs (one per socket or
    CCX, told apart by their ``shared_cpu_list``), with the per-instance size; where sysfs has no L3
    (some virtual machines), the total from ``lscpu``'s ``L3 cache:`` line; 0 when neither says.
    ``{"total_bytes", "source", ...}``."""
    sysfs = _l3_sysfs()
    if sysfs["total_bytes"] > 0:
        return sysfs
    m = re.search(r"^L3 cache:\s*([\d.]+\s*[KMG]i?B?)", _lscpu(), re.MULTILINE)
    if m:
        return {"total_bytes": _parse_size(m.group(1)), "source": "lscpu (sysfs has no L3)"}
    return {"total_bytes": 0, "source": "unknown: neither sysfs nor lscpu gives an L3 size"}


def _l3_sysfs() -> dict:
    seen: dict[str, int] = {}
    base = Path("/sys/devices/system/cpu")
    for cache in sorted(base.glob("cpu[0-9]*/cache/index[0-9]*")):
        try:
            if (cache / "level").read_text().strip() != "3":
                continue
            size = _parse_size((cache / "size").read_text().strip())
            seen[(cache / "shared_cpu_list").read_text().strip()] = size
        except (OSError, ValueError):
            continue
    return {"total_bytes": sum(seen.values()), "instances": len(seen),
            "instance_bytes": sorted(set(seen.values())), "source": "/sys/devices/system/cpu/*/cache/index*/"}


def _lscpu() -> str:
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _parse_size(text: str) -> int:
    """Bytes in a sysfs/lscpu cache size: ``32768K``, ``1M``, ``16 MiB``, ``512`` (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)I?B?\s*", text.upper())
    if m is None:
        raise ValueError(f"cache size {text!r} is not a number with an optional K/M/G unit")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


def host_tile_numel(bytes_per_element: int, l3_bytes: int | None = None) -> int:
    """Elements of a host-rate tile whose working set (``bytes_per_element`` each: 16 for AdamW's
    parameter, gradient and moments, 6 for a cast's source and copy) is
    :data:`HOST_TILE_L3_MULTIPLE` x the L3 (``l3_bytes``, default :func:`l3_cache`), at least
    :data:`HOST_TILE_MIN_NUMEL`, in whole MiB of elements."""
    l3 = l3_cache()["total_bytes"] if l3_bytes is None else l3_bytes
    n = max(HOST_TILE_L3_MULTIPLE * l3 // bytes_per_element, HOST_TILE_MIN_NUMEL)
    return -(-n // (1 << 20)) * (1 << 20)


def _rate(numel: int, run: Callable[[], Any], seconds: float) -> float:
    """``numel / seconds per call`` of ``run``, timed for about ``seconds`` and at least three calls
    after two warm-up calls (the first ones fault the pages in and start the thread pool)."""
    for _ in range(2):
        run()
    n, t0 = 0, time.perf_counter()
    while True:
        run()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and n >= 3:
            return numel * n / elapsed


LAUNCH_BLOCK_HIDDEN = 64
"""Width of the template-like block :func:`measure_launch_overhead` times: tiny, so every kernel
finishes faster than the issuing thread launches the next one and the time measured is the launch
path's (Python, the dispatcher, the kernel launch), not the GPU's."""


def _llama_like_block(ln1, wq, wk, wv, wo, ln2, wg, wu, wd, x):
    """A pre-norm Llama decoder block as a function of its weights: RMSNorm, grouped-query causal
    attention, residual add, RMSNorm, SwiGLU MLP, residual add (Touvron et al. 2023, arXiv:2302.13971)."""
    import torch.nn.functional as F

    def rms(h, w):
        return w * (h * (h.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt())

    b, s, d = x.shape
    heads, kv = 4, 2
    h = rms(x, ln1)
    q = F.linear(h, wq).view(b, s, heads, d // heads).transpose(1, 2)
    k = F.linear(h, wk).view(b, s, kv, d // heads).transpose(1, 2)
    v = F.linear(h, wv).view(b, s, kv, d // heads).transpose(1, 2)
    k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
    x = x + F.linear(a, wo)
    h = rms(x, ln2)
    return x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)


def measure_launch_overhead(device: str = "cuda", *, seconds: float = 0.3, clock=time.perf_counter) -> float:
    """Seconds of the issuing thread per dispatched aten op of a template-like op: the field
    ``HardwareSpec.launch_overhead_s``, which the simulator multiplies by a layer's
    ``fwd_launches`` / ``bwd_launches``.

    A small Llama block (:func:`_llama_like_block`, hidden :data:`LAUNCH_BLOCK_HIDDEN`, 16 tokens,
    BF16 on CUDA, FP32 elsewhere) runs as the executor runs a layer: forwards under ``no_grad``
    (a FWD op) and local backwards (recompute with gradients on, then ``torch.autograd.grad`` for
    the weights and the input: a BWD op), alternately for about ``seconds``, with the device
    synchronised only at the ends. Its ops are counted as the tracer counts a layer's
    (:func:`megatrain.ir.issue.count_launches`, on meta), so measured time over counted ops
    is the figure the simulator's product needs. A one-element ``x.add_(1)``, the previous
    measure, costs less per op: it has no autograd, no views and no multi-input dispatch.
    ``clock``: wall time by default (on a GPU the issuing thread also waits for autograd's device
    thread); ``time.thread_time`` on a shared CPU, where the backward runs on the calling thread.
    """
    import torch
    import torch.fx as fx

    from megatrain.ir.issue import count_launches

    d, ff = LAUNCH_BLOCK_HIDDEN, 2 * LAUNCH_BLOCK_HIDDEN
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(d,), (d, d), (d // 2, d), (d // 2, d), (d, d), (d,), (ff, d), (ff, d), (d, ff)]
    weights = [(torch.randn(sh, generator=g) * 0.1).to(device, dtype) for sh in shapes]
    x = torch.randn(1, 16, d, generator=g).to(device, dtype)
    gm = fx.symbolic_trace(_llama_like_block)
    fwd_ops, bwd_ops = count_launches(gm, weights + [x], [True] * len(weights) + [True])
    seed = torch.ones_like(x)

    def forward() -> None:
        with torch.no_grad():
            gm(*weights, x)

    def local_backward() -> None:
        leaves = [w.detach().requires_grad_(True) for w in weights] + [x.detach().requires_grad_(True)]
        with torch.enable_grad():
            torch.autograd.grad(gm(*leaves), leaves, seed)

    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    for _ in range(3):  # first calls load kernels and warm the caches
        forward()
        local_backward()
    sync()
    reps, t0 = 0, clock()
    while True:
        forward()
        local_backward()
        reps += 1
        elapsed = clock() - t0
        if elapsed >= seconds and reps >= 3:
            break
    sync()
    return elapsed / (reps * (fwd_ops + bwd_ops))


def cublas_workspace_bytes(capability_major: int, environ: dict | None = None) -> int:
    """Bytes of one cuBLAS handle's workspaces on one stream, as PyTorch sizes them
    (``aten/src/ATen/cuda/CublasHandlePool.cpp``): the cuBLAS workspace from
    ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs, SIZE in KiB, summed) or by default 32 MiB on
    compute capability 9 to 12 (Hopper, Blackwell) and ``4096 KiB x 2 + 16 KiB x 8`` before, plus
    the cuBLASLt workspace, ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024). ``environ`` defaults to
    ``os.environ``."""
    import re

    env = os.environ if environ is None else environ
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        cublas = sum(int(size) * 1024 * int(count) for size, count in pairs)
    else:
        cublas = 4096 * 8 * 1024 if 9 <= capability_major <= 12 else 4096 * 1024 * 2 + 16 * 1024 * 8
    try:
        lt = int(env.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    except ValueError:
        lt = 1024 * 1024  # PyTorch warns and keeps its default
    return cublas + lt


def measure_adamw(numel: int, seconds: float, *, grad_dtype: "torch.dtype | None" = None,
                  kernel: str | None = None) -> float:
    """Parameters per second of megatrain's host AdamW step
    (:class:`~megatrain.runtime.host_kernels.HostAdamW`, ``kernel``: default ``$MEGATRAIN_HOST_ADAM``,
    the one the executor runs) on one flat FP32 tile of ``numel`` elements with ``grad_dtype``
    gradients (FP32 by default; BF16 is stepped chunk by chunk, as an OPT from a BF16 tile), on the
    calling thread's intra-op team, timed as :func:`_rate` does."""
    import torch

    from megatrain.runtime.host_kernels import HostAdamW

    adam = HostAdamW(kernel)
    # Constant values: the rate must not depend on the data (no denormals, no NaN paths).
    p, grad = torch.full((numel,), 0.5), torch.full((numel,), 1e-3, dtype=grad_dtype or torch.float32)
    m, v, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(())
    return _rate(numel, lambda: adam.step(p, grad, m, v, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                          weight_decay=0.01), seconds)


def measure_cast(numel: int, seconds: float) -> float:
    """Elements per second of a CAST (an FP32 tile copied into a BF16 one, the executor's ``copy_``)
    of ``numel`` elements on the calling thread's intra-op team, timed as :func:`_rate` does."""
    import torch

    src, dst = torch.full((numel,), 0.5), torch.empty(numel, dtype=torch.bfloat16)
    return _rate(numel, lambda: dst.copy_(src), seconds)


def measure_host_rates(optimizer_numel: int | None = None, seconds: float = 0.3, *, cores: int | None = None,
                       kernel: str | None = None) -> dict:
    """The host fields of a spec, measured on a thread of their own with the intra-op team a rank's
    host workers get (:func:`~megatrain.ir.hardware.host_worker_threads` of ``cores``, default
    :func:`host_cores`; the calling thread's team is left alone): ``host_optimizer_params_per_s``
    and ``host_optimizer_bf16_params_per_s`` (:func:`measure_adamw`, FP32 and BF16 gradients) and
    ``host_cast_elements_per_s`` (:func:`measure_cast`), each for about ``seconds``, and
    ``host_cores``. Tiles: ``optimizer_numel`` elements for all three, or by default
    :func:`host_tile_numel` of each kernel's working set (16 bytes per element for AdamW, 6 for the
    cast): several times the L3, so the rates are DRAM rates, not cache rates. Also says, under
    ``"threads"``, ``"kernel"`` and ``"numel"``, what it measured with."""
    import torch

    from megatrain.runtime.host_kernels import HostAdamW, run_on_team

    cores = host_cores() if cores is None else cores
    threads = host_worker_threads(cores)
    kernel = HostAdamW(kernel).kernel
    adam_n = optimizer_numel or host_tile_numel(16)
    cast_n = optimizer_numel or host_tile_numel(CAST_BYTES_PER_ELEMENT)
    out = run_on_team(threads, lambda: dict(
        host_optimizer_params_per_s=measure_adamw(adam_n, seconds, kernel=kernel),
        host_optimizer_bf16_params_per_s=measure_adamw(adam_n, seconds, grad_dtype=torch.bfloat16, kernel=kernel),
        host_cast_elements_per_s=measure_cast(cast_n, seconds)))
    return dict(out, host_cores=cores, threads=threads, kernel=kernel,
                numel={"adamw": adam_n, "cast": cast_n})


def measure_cuda_fields() -> dict:
    """The GPU fields of a spec, measured on the current CUDA device.

    GPU memory (``total_memory``), the rate of an :data:`GPU_MATMUL_N`-sided BF16 and strict-FP32
    product (:func:`measure_matmul_flops`), pinned H2D and D2H bandwidth of :data:`COPY_BYTES`
    copies, whether both directions run at full rate at once on two streams, the issuing thread's
    cost per launched op of a template-like layer (:func:`measure_launch_overhead`), the memory of
    the CUDA context and its loaded modules (``mem_get_info``'s used bytes less the caching
    allocator's reserved ones, once those kernels ran) and the cuBLAS workspace size
    (:func:`cublas_workspace_bytes`).

    Raises:
        ConfigError: torch sees no CUDA device (the GPU fields cannot be measured on a CPU).
    """
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("measure_hardware: the GPU fields need a CUDA device and torch sees none "
                          f"(torch {torch.__version__}, CUDA build: {torch.backends.cuda.is_built()}); "
                          "measure on the GPU machine, or use a preset")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    rates = {key: measure_matmul_flops("cuda", dtype, n=GPU_MATMUL_N, seconds=GPU_MATMUL_SECONDS)
             for dtype, key in ((torch.bfloat16, "bf16_flops"), (torch.float32, "fp32_flops"))}

    def timed(fn, reps: int) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    nbytes = COPY_BYTES
    host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dev_src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = nbytes / timed(lambda: dev_buf.copy_(host_src, non_blocking=True), COPY_REPS)
    d2h = nbytes / timed(lambda: host_dst.copy_(dev_src, non_blocking=True), COPY_REPS)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(s1):
            dev_buf.copy_(host_src, non_blocking=True)
        with torch.cuda.stream(s2):
            host_dst.copy_(dev_src, non_blocking=True)

    both()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(COPY_REPS):
        both()
    torch.cuda.synchronize()
    concurrent = (time.perf_counter() - t0) / COPY_REPS
    duplex = concurrent < DUPLEX_FRACTION * (nbytes / h2d + nbytes / d2h)
    del host_src, host_dst, dev_buf, dev_src
    launch = measure_launch_overhead("cuda")
    # After the matmuls, copies and a layer's forward and backward have loaded their kernels: what
    # the device uses beyond the caching allocator is the context and its modules.
    free, total = torch.cuda.mem_get_info()
    context = max(0, total - free - torch.cuda.memory_reserved())
    return dict(gpu_memory_bytes=int(props.total_memory), h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
                duplex=duplex, launch_overhead_s=launch, cuda_context_bytes=context,
                cublas_workspace_bytes=cublas_workspace_bytes(props.major), **rates)


def measure_hardware(path: str | os.PathLike | None = None, *, optimizer_numel: int | None = None,
                     seconds: float = 0.3) -> HardwareSpec:
    """Measure this machine as a HardwareSpec; save it as JSON to ``path`` when given.

    Host: memory (:func:`total_host_memory_bytes`), the pinned cap as ``PINNED_FRACTION`` of it,
    and the host rates and cores (:func:`measure_host_rates`: ``optimizer_numel`` elements, by
    default tiles several times the L3, each rate for about ``seconds``). With CUDA also the GPU
    fields (:func:`measure_cuda_fields`), with ``matmul_efficiency = MEASURED_MATMUL_EFFICIENCY``
    (the rates are already a real matmul's). Without CUDA the GPU fields are 0 and the name says
    the spec is host-only (the solver refuses it). A few seconds on a CPU-only machine (filling
    the tiles, three rates), a few more with a GPU.
    """
    import torch

    host = total_host_memory_bytes()
    cpu = f"{cpu_name()} x{os.cpu_count()}"
    rates = measure_host_rates(optimizer_numel, seconds)
    fields = dict(host_memory_bytes=host, pinned_memory_cap_bytes=int(host * PINNED_FRACTION),
                  **{k: rates[k] for k in ("host_optimizer_params_per_s", "host_optimizer_bf16_params_per_s",
                                           "host_cast_elements_per_s", "host_cores")})
    if torch.cuda.is_available():
        spec = HardwareSpec(**fields, **measure_cuda_fields(), matmul_efficiency=MEASURED_MATMUL_EFFICIENCY,
                            name=f"measured: {torch.cuda.get_device_name()} + {cpu}")
    else:
        spec = HardwareSpec(**fields, name=f"host-only (no CUDA), measured: {cpu}", gpu_memory_bytes=0,
                            bf16_flops=0.0, fp32_flops=0.0, h2d_bytes_per_s=0.0, d2h_bytes_per_s=0.0,
                            duplex=False)
    if path is not None:
        spec.save(path)
    return spec


__all__ = ["measure_hardware", "measure_matmul_flops", "measure_adamw", "measure_cuda_fields",
           "measure_launch_overhead", "cublas_workspace_bytes",
           "total_host_memory_bytes", "available_host_memory", "host_rss_bytes"]


__all__ = ["measure_hardware", "measure_matmul_flops", "measure_adamw", "measure_cast", "measure_host_rates",
           "measure_cuda_fields", "host_cores", "host_tile_numel", "l3_cache", "total_host_memory_bytes",
           "available_host_memory", "host_rss_bytes"]
