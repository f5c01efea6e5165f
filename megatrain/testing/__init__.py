"""Test doubles for the runtime: fake CUDA layers that run the real CUDA backend on a CPU.

- :class:`AsyncFakeCuda`: streams as worker threads, events as cross-thread signals, random
  delays before every op; races in a schedule show up as wrong results or errors.
- :class:`SlowTorchCuda`: the real ``torch.cuda`` adapter with the same delay hook (a GPU-side
  sleep before a chosen op's kernels), so the race tests run on real streams when a GPU is there.

The synchronous :class:`megatrain.runtime.cuda.FakeCuda` (bookkeeping checks, work at once) stays
in :mod:`megatrain.runtime.cuda`, beside the adapter protocol it checks.
"""

from megatrain.testing.async_cuda import AsyncEvent, AsyncFakeCuda, AsyncFakeCudaError, AsyncStream
from megatrain.testing.slow_cuda import SlowTorchCuda

__all__ = ["AsyncFakeCuda", "AsyncFakeCudaError", "AsyncEvent", "AsyncStream", "SlowTorchCuda"]
