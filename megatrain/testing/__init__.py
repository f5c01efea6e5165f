"""Test doubles for the runtime: fake CUDA layers that run the real CUDA backend on a CPU.

- :class:`AsyncFakeCuda`: streams as worker threads, events as cross-thread signals, random
  delays before every op; races in a schedule show up as wrong results or errors.
- :class:`FakeCuda`: synchronous; streams run work at once on the issuing thread and events keep
  the bookkeeping, so a wait on an unrecorded event, a stream waiting on its own event, or a host
  handle passed to ``wait_event`` raises :class:`FakeCudaError` at once.
- :class:`IssueTimeFakeCuda`: asynchronous streams, but each op's work runs on the issuing thread
  when it is issued, as on a GPU, and :class:`CachingAllocatorModel` reports what the CUDA caching
  allocator would hold (live tensors plus freed blocks still waiting for another stream).
- :class:`FakeGraph` (through ``FakeCuda.capture``/``replay``): CUDA graphs on the CPU; a capture
  records the work's aten ops, a replay re-dispatches them on the same tensors, and a capture that
  reads a tensor that is not a static buffer (a forgotten copy-in) or a device value on the host
  raises :class:`FakeCudaError`.
- :class:`SlowTorchCuda`: the real ``torch.cuda`` adapter with the same delay hook (a GPU-side
  sleep before a chosen op's kernels), so the race tests run on real streams when a GPU is there.

Each implements the adapter protocol :class:`megatrain.runtime.cuda.CudaApi`.
"""

from megatrain.testing.allocator import CachingAllocatorModel, IssueTimeFakeCuda
from megatrain.testing.async_cuda import AsyncEvent, AsyncFakeCuda, AsyncFakeCudaError, AsyncStream
from megatrain.testing.fake_cuda import FakeCuda, FakeCudaError, FakeEvent, FakeStream
from megatrain.testing.fake_graph import FakeGraph
from megatrain.testing.slow_cuda import SlowTorchCuda

__all__ = ["AsyncFakeCuda", "AsyncFakeCudaError", "AsyncEvent", "AsyncStream", "CachingAllocatorModel", "FakeCuda",
           "FakeCudaError", "FakeEvent", "FakeGraph", "FakeStream", "IssueTimeFakeCuda", "SlowTorchCuda"]
