"""The real CUDA adapter with a delay hook, for race tests on a GPU (see tests/test_race_detector.py)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from megatrain.runtime.cuda import TorchCuda

GPU_CYCLES_PER_S = 2.0e9
"""Clock cycles ``torch.cuda._sleep`` spins per second of delay: above the boost clock of current
data-centre GPUs (H100 SXM: 1.98 GHz, NVIDIA's datasheet), so a delay is at least as long as asked."""


class SlowTorchCuda(TorchCuda):
    """``TorchCuda`` whose op ``label`` first sleeps ``delay(label)`` seconds: on the GPU stream (a
    spinning kernel enqueued before the op's kernels) or on the host worker; device and pinned
    memory start as NaN (integers: their maximum, booleans: True), as in AsyncFakeCuda."""

    def __init__(self, delay: Callable[[str], float]):
        self.delay = delay

    def run(self, stream: torch.cuda.Stream, fn: Callable[[], Any], label: str) -> None:
        with torch.cuda.stream(stream):
            s = self.delay(label)
            if s > 0:
                torch.cuda._sleep(int(s * GPU_CYCLES_PER_S))
            fn()

    def host_run(self, fn: Callable[[], Any], label: str) -> None:
        s = self.delay(label)
        if s > 0:
            time.sleep(s)
        fn()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return _fill(torch.empty(shape, dtype=dtype, device=self.device))

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return _fill(torch.empty(shape, dtype=dtype, pin_memory=True))


def _fill(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    if t.dtype is torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).max)
