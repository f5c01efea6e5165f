"""Measure this machine: a :class:`~megatrain.planner.hardware.HardwareSpec`, matmul rates, host memory.

The planner plans against a spec and never times anything (it imports no torch timing and no
CUDA); measuring is the runtime's side of that boundary, so it lives here and returns plain data.

- :func:`measure_hardware`: a whole spec, host fields always, GPU fields with CUDA.
- :func:`measure_matmul_flops`: FLOP/s of one ``n x n`` product on a device, the one matmul timer
  (the spec's ``bf16_flops``/``fp32_flops`` and a run's MFU peak both come from it).
- :func:`measure_adamw`: parameters per second of the fused host AdamW the runtime runs per layer.
- Host memory from the OS, in bytes: :func:`total_host_memory_bytes`,
  :func:`available_host_memory` and :func:`host_rss_bytes` (Linux ``/proc``, with ``sysconf`` or
  psutil where ``/proc`` has no answer).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from megatrain.errors import ConfigError
from megatrain.planner.hardware import (MEASURED_MATMUL_EFFICIENCY, PINNED_FRACTION, HardwareSpec, cpu_name,
                                        strict_fp32)
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
    :func:`~megatrain.planner.hardware.strict_fp32` (TF32 off; the caller's setting is restored),
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


def measure_adamw(numel: int, seconds: float) -> float:
    """Parameters per second of the fused host AdamW (``torch.optim.adamw.adamw(fused=True)``, the
    call the runtime makes per layer) on one flat FP32 tile of ``numel`` elements, timed for about
    ``seconds`` and at least three calls after two warm-up calls."""
    import torch
    from torch.optim.adamw import adamw

    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(numel, generator=g), torch.randn(numel, generator=g)
    m, v, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(())

    def run() -> None:
        adamw([p], [grad], [m], [v], [], [step], fused=True, amsgrad=False, beta1=0.9, beta2=0.999,
              lr=1e-3, weight_decay=0.01, eps=1e-8, maximize=False)

    # The first calls fault the pages in and start the thread pool; they are not the steady state.
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
    (:func:`megatrain.planner.issue.count_launches`, on meta), so measured time over counted ops
    is the figure the simulator's product needs. A one-element ``x.add_(1)``, the previous
    measure, costs less per op: it has no autograd, no views and no multi-input dispatch.
    ``clock``: wall time by default (on a GPU the issuing thread also waits for autograd's device
    thread); ``time.thread_time`` on a shared CPU, where the backward runs on the calling thread.
    """
    import torch
    import torch.fx as fx

    from megatrain.planner.issue import count_launches

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


def measure_hardware(path: str | os.PathLike | None = None, *, optimizer_numel: int = 4 << 20,
                     seconds: float = 0.6) -> HardwareSpec:
    """Measure this machine as a HardwareSpec; save it as JSON to ``path`` when given.

    Host: memory (:func:`total_host_memory_bytes`), the pinned cap as ``PINNED_FRACTION`` of it,
    and optimizer throughput (:func:`measure_adamw` on ``optimizer_numel`` elements for about
    ``seconds``). With CUDA also the GPU fields (:func:`measure_cuda_fields`), with
    ``matmul_efficiency = MEASURED_MATMUL_EFFICIENCY`` (the rates are already a real matmul's).
    Without CUDA the GPU fields are 0 and the name says the spec is host-only (the solver refuses
    it). About 1 s on a CPU-only machine, a few seconds more with a GPU.
    """
    import torch

    host = total_host_memory_bytes()
    cpu = f"{cpu_name()} x{os.cpu_count()}"
    fields = dict(host_memory_bytes=host, pinned_memory_cap_bytes=int(host * PINNED_FRACTION),
                  host_optimizer_params_per_s=measure_adamw(optimizer_numel, seconds))
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
