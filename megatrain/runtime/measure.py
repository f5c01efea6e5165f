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


def measure_cuda_fields() -> dict:
    """The GPU fields of a spec, measured on the current CUDA device.

    GPU memory (``total_memory``), the rate of an :data:`GPU_MATMUL_N`-sided BF16 and strict-FP32
    product (:func:`measure_matmul_flops`), pinned H2D and D2H bandwidth of :data:`COPY_BYTES`
    copies, and whether both directions run at full rate at once on two streams.

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
    return dict(gpu_memory_bytes=int(props.total_memory), h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
                duplex=duplex, **rates)


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
           "total_host_memory_bytes", "available_host_memory", "host_rss_bytes"]
