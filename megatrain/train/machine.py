"""What this machine offers a run: host memory available, this process's resident set, a matmul
rate (the MFU peak on the CPU, or on a GPU without a spec), and a hardware spec by name or file."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pydantic

from megatrain.errors import ConfigError

MATMUL_N = 1024
MATMUL_SECONDS = 0.3


def available_host_memory() -> tuple[int, str] | None:
    """``(bytes, where it was read)`` of host memory available to a new allocation, or None.

    Reads ``MemAvailable`` in ``/proc/meminfo`` (Linux), else ``psutil.virtual_memory().available``
    when psutil is installed.
    """
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available), "psutil.virtual_memory().available"


def load_hardware_spec(name_or_path: str):
    """A HardwareSpec from a preset name or a JSON file written by ``HardwareSpec.save``.

    Raises:
        ConfigError: no such preset, or the file is not a valid spec.
    """
    from megatrain.planner.hardware import HardwareSpec, preset

    path = Path(name_or_path)
    if path.is_file():
        try:
            return HardwareSpec.load(path)
        except pydantic.ValidationError as e:
            raise ConfigError(f"{path} is not a valid HardwareSpec: {e}") from None
    return preset(name_or_path)


def measure_matmul_flops(device: str = "cpu", dtype=None, *, n: int = MATMUL_N,
                         seconds: float | None = None) -> float:
    """FLOP/s of ``torch.mm`` on two ``n x n`` matrices of ``dtype`` (default FP32) on ``device``.

    Times repeated products for about ``seconds`` (default :data:`MATMUL_SECONDS`, 0.3 s) after
    one warm-up product, with the current
    ``torch.get_num_threads()``; counts ``2 n^3`` FLOPs per product. Uses a private generator, so
    the global torch RNG (and with it the model's initialisation) is untouched.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    seconds = MATMUL_SECONDS if seconds is None else seconds
    g = torch.Generator().manual_seed(0)
    a = torch.rand(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.rand(n, n, generator=g).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
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


def _host_rss_bytes() -> int | None:
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
