"""HardwareSpec: every hardware constant the cost model reads, in one place, with its source.

A spec is plain data at a config boundary (it is loaded from and saved to JSON, and users write
their own), so it is a frozen pydantic model. The cost model (:mod:`megatrain.planner.cost`) is
the only reader that turns these rates into op times and memory budgets.

Presets hold vendor datasheet numbers where the vendor publishes one and say so; where a number is
an estimate (sustained copy bandwidth, host optimizer throughput, how much of the peak a layer
reaches) the docstring says what it is estimated from.
:func:`megatrain.runtime.measure.measure_hardware` replaces the estimates with numbers measured on
the machine at hand (measuring is the runtime's: the planner times nothing).

Units: bytes, seconds, FLOP/s (dense: no 2:4 sparsity), bytes/s, parameters/s. Decimal prefixes
(GB = 1e9 bytes, TFLOP/s = 1e12 FLOP/s) as vendors use them; GiB/TiB where memory comes in
powers of two.
"""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from dataclasses import dataclass
from typing import Iterator

import pydantic
from pydantic import Field

from megatrain.config import describe_validation
from megatrain.errors import ConfigError
from megatrain.units import GiB, MiB, TiB


DEFAULT_MATMUL_EFFICIENCY = 0.7
"""Fraction of the dense tensor-core peak a transformer layer's compute reaches (estimate).

Large BF16 GEMMs reach 75-80% of the dense peak on Hopper (about 780 of 989 TFLOP/s for
torch.mm with CUTLASS autotuning, Chillee's H100 peak-matmul gist); attention, norms and
element-wise kernels in a layer run below that, so 0.7 for a whole layer. To be calibrated against
measured timelines."""

MEASURED_MATMUL_EFFICIENCY = 0.85
"""The same fraction for a measured spec, whose FLOP/s fields hold the rate of one large square
matmul (already below peak), so a layer loses less against it (estimate)."""

LARGE_GEMM_EFFICIENCY = 0.79
"""Fraction of the datasheet dense BF16 peak one large matmul reaches on Hopper (estimate): about
780 of 989 TFLOP/s for torch.mm at 8192^3 (Chillee's H100 peak-matmul gist); the first H100 session
measured 760 (bench/results/2026-11-27-h100-probe.json, ``matmul.bf16``). A preset's
``gemm_efficiency``; a measured spec's FLOP/s fields are that product's rate already (1.0)."""

HBM_STREAM_FRACTION = 0.9
"""Fraction of the datasheet memory bandwidth that large element-wise kernels (copies, casts, adds,
row reductions) reach on HBM GPUs (estimate: PyTorch's vectorised elementwise kernels and
device-to-device copies reach 85-92% of the datasheet rate on A100 and H100 in public STREAM-like
measurements). A preset's ``memory_bytes_per_s`` is its datasheet rate times this;
``bench/gpu_probe.py`` measures it (section ``kernels``)."""

FLASH_ATTENTION_FWD_FRACTION = 0.35
"""Fraction of the dense BF16 peak the fused attention forward reaches, in useful FLOPs (a causal
mask counts half: FlashAttention's convention). FlashAttention-2, the kernel behind PyTorch's SDPA
on Hopper, reaches "only 35% utilization on the H100 GPU" (Shah et al. 2024, "FlashAttention-3",
arXiv:2407.08608, abstract), at long sequences and head dim 128; shorter sequences and head dim 64
run below it (estimate; ``bench/gpu_probe.py`` measures it at the step's shape)."""

FLASH_ATTENTION_BWD_FRACTION = 0.30
"""The same for the fused attention backward, whose five matmuls ``torch.utils.flop_counter`` counts
as 2.5x the forward: FlashAttention-2 reaches up to 73% of the A100's peak forward and 63% backward
(Dao 2023, arXiv:2307.08691), so 0.86 of the forward's fraction (estimate)."""

DEFAULT_KERNEL_OVERHEAD_S = 2e-6
"""GPU seconds each kernel costs beyond its work (estimate): the gap between back-to-back kernels
on one stream and the ramp of a small grid, 1-3 us on recent GPUs; it sets the floor of the many
small element-wise kernels of an unfused layer."""

DEFAULT_OP_LATENCY_S = 10e-6
"""Fixed cost added to every op (estimate): launching a layer's kernels or a cudaMemcpyAsync and
recording/waiting on the events that join it to its dependencies costs a few microseconds each;
10 us per op. It dominates only for tiny layers; ``measure_hardware()`` keeps the default."""

DEFAULT_LAUNCH_OVERHEAD_S = 8e-6
"""Seconds of the issuing thread per dispatched op (estimate, calibrated on the CPU backend): eager
PyTorch spends a few microseconds in Python and the dispatcher per aten op, and a CUDA kernel
launch adds cudaLaunchKernel's 2-4 us. Measured 2026-11-23 on this project's 2-core CI CPU under
a load average of 7: a tiny Llama block's forward (100 aten ops at hidden 16, so dispatch-bound)
at 13.4 us per op at best, its local backward (257 ops) at 27 us; unloaded that is about 4 and
8 us. A traced layer's ops are counted as a GPU dispatches them (``Layer.fwd_profile``, fused
attention one op), a hand-built one's by ``Layer.fwd_launches`` / ``bwd_launches``.
``bench/gpu_probe.py`` measures it on megatrain's own template of the step's block (section
``launch``); ``measure_hardware()`` on a GPU with a template-like op (a small Llama block's forward
and local backward over their meta-counted ops: ``megatrain.runtime.measure.measure_launch_overhead``),
not a one-element add, which has no autograd, views or multi-input dispatch and costs less per op;
megatrain's own template costs about 1.5x that stand-in per forward op and 1.2x per backward op
(``bench/template_issue.py``, one CPU, 2026-11-28)."""

CUDA_CONTEXT_BYTES = 1 * GiB
"""GPU memory of the CUDA context and the kernel modules a training step loads, outside PyTorch's
caching allocator (estimate). PyTorch measured 287 MB of context with lazy module loading and
667 MB with every kernel of libtorch_cuda loaded (pytorch/pytorch#86509, the PR that made
``CUDA_MODULE_LOADING=LAZY`` the default); lazy loading grows toward the latter as kernels are first
used, and cuBLAS's, cuDNN's and the attention kernels' modules come on top, so 1 GiB.
``measure_hardware()`` measures it on the machine (``mem_get_info`` less the allocator's reserved
bytes after a template-like layer ran)."""

CUBLAS_WORKSPACE_BYTES = 32 * MiB + 1 * MiB
"""GPU bytes of one cuBLAS handle's workspaces on one stream, from the caching allocator: PyTorch's
default cuBLAS workspace, 32 MiB on Hopper and Blackwell (compute capability 9 to 12) and
``4096 KiB x 2 + 16 KiB x 8`` elsewhere, unless ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT``
pairs) says otherwise, plus cuBLASLt's own, 1 MiB (``CUBLASLT_WORKSPACE_SIZE``) (PyTorch
``aten/src/ATen/cuda/CublasHandlePool.cpp``: ``parseChosenWorkspaceSize``,
``parseCUDABlasLtWorkspaceSize``; one workspace per (handle, stream) pair). The Hopper figure, the
largest default; ``measure_hardware()`` computes the machine's."""

PINNED_FRACTION = 0.9
"""Pinned (page-locked) host memory cap as a fraction of host memory: the rest stays pageable
for the OS, page cache, Python and the data loader. cudaHostAlloc is not bounded by
RLIMIT_MEMLOCK, so the practical limit is what the OS can spare."""

ADAMW_BYTES_PER_PARAM = 28
"""DRAM traffic of one fused FP32 AdamW update: it reads the parameter, gradient and both moments
(4 x 4 B) and writes the parameter and both moments (3 x 4 B). The host kernel does ~15 FLOPs per
parameter, far below a server CPU's vector throughput, so it is memory-bound."""

ADAMW_WIDENED_BYTES_PER_PARAM = 34
"""DRAM traffic of one AdamW update from a BF16 gradient tile whose widened FP32 copy goes through
DRAM: the BF16 read (2 B), the FP32 copy written and read back (8 B), and the update's 24 B. A team
of one or two threads widens chunks that stay in the cache (26 B, :mod:`megatrain.runtime.host_kernels`);
a many-core host's team widens chunks too large for it, so an estimate counts this."""

CAST_BYTES_PER_ELEMENT = 6
"""DRAM traffic of one CAST element: the FP32 master read (4 B), its BF16 copy written (2 B)."""

HOST_BANDWIDTH_FRACTION = 0.4
"""Fraction of a host's theoretical DRAM bandwidth the optimizer worker sustains (estimate):
STREAM-like kernels reach 60-80% of peak, and the two copy engines' DMA (up to ~100 GB/s on
PCIe Gen5, more on NVLink-C2C) and the data loader share the same memory at the same time."""


def _host_fields(dram_bytes_per_s: float, cores: int) -> dict:
    """A preset's host rates, estimated as memory-bound at ``HOST_BANDWIDTH_FRACTION`` of the
    theoretical DRAM bandwidth over each kernel's bytes per element, and its core count."""
    rate = dram_bytes_per_s * HOST_BANDWIDTH_FRACTION
    return dict(host_optimizer_params_per_s=rate / ADAMW_BYTES_PER_PARAM,
                host_optimizer_bf16_params_per_s=rate / ADAMW_WIDENED_BYTES_PER_PARAM,
                host_cast_elements_per_s=rate / CAST_BYTES_PER_ELEMENT, host_cores=cores)


def _gpu_kernel_fields(bf16_peak: float, hbm_bytes_per_s: float) -> dict:
    """A preset's kernel-level GPU rates from its datasheet: the large-matmul fraction of the peak,
    ``HBM_STREAM_FRACTION`` of the memory bandwidth, and the fused attention rates as fractions of
    the BF16 peak (each constant says where it comes from)."""
    return dict(gemm_efficiency=LARGE_GEMM_EFFICIENCY, memory_bytes_per_s=hbm_bytes_per_s * HBM_STREAM_FRACTION,
                attention_flops=bf16_peak * FLASH_ATTENTION_FWD_FRACTION,
                attention_backward_flops=bf16_peak * FLASH_ATTENTION_BWD_FRACTION)


FINITE_CHECK_BYTES_PER_PARAM = 4
"""DRAM traffic per parameter of the finite check after a whole-tile host AdamW step from FP32
gradients: the updated FP32 master read once more by its sum (``HostAdamW.step``'s
``param.sum()``, the guard the executor's OPT reads: ``megatrain.runtime.executor._opt``), 32 bytes in all with the
step's 28 (``bench/host_optimizer.py``'s ``DRAM_BYTES``)."""

HOST_KERNEL_ISSUE_STALL: dict[str, float] = {
    "deepspeed": ADAMW_BYTES_PER_PARAM / (ADAMW_BYTES_PER_PARAM + FINITE_CHECK_BYTES_PER_PARAM), "torch": 0.0}
"""``HardwareSpec.host_optimizer_issue_stall`` of each host AdamW kernel
(:data:`megatrain.runtime.host_kernels.KERNELS`) where it was not measured: the fraction of an OPT
during which the issuing thread cannot run Python. The simulator blocks the thread for that
leading fraction of the OPT (the kernel's call comes first, :mod:`megatrain.planner.simulate`).

- ``"deepspeed"``: 28 / 32 = 0.875. DeepSpeed's ``cpu_adam`` op binds ``adam_update`` without
  ``gil_scoped_release`` (DeepSpeed 0.19.8, ``csrc/adam/cpu_adam.cpp``), so the GIL is held for the
  whole call; the OPT's finite check after it (``param.sum()``, a torch op) releases the GIL. Both
  are memory-bound on one DRAM, so the call is its bytes' share of the OPT's:
  ``ADAMW_BYTES_PER_PARAM`` / (that + ``FINITE_CHECK_BYTES_PER_PARAM``). Measured on the first H100
  host (bench/results/2026-11-27-h100-host-optimizer.json, 15 threads): ``rates.megatrain`` (the
  OPT, DeepSpeed's kernel and the sum) over ``rates.deepspeed_cpu_adam`` (the call alone) = 0.844;
  in that session's step the gradient copy issued as an OPT began waited for the GIL until about
  0.84 of the OPT, then ran (``D2H:L0``, bench/results/2026-11-27-h100-step-timelines.json).
- ``"torch"``: 0.0. ``torch._fused_adamw_`` is an ATen op, and torch's Python bindings release the
  GIL while an op runs. Its threads still share the cores and the memory bandwidth with the issuing
  thread, which then issues slower rather than not at all: ``HardwareSpec.host_optimizer_issue_slowdown``,
  measured by ``bench/gpu_probe.py`` (0 where it was not).

``bench/host_optimizer.py`` measures the issuing thread's stalled fraction while each kernel runs."""


class HardwareSpec(pydantic.BaseModel):
    """One GPU and the host it is attached to, as rates and capacities.

    The kernel-level fields (``memory_bytes_per_s``, ``attention_flops``, ``attention_backward_flops``,
    ``kernel_overhead_s``, ``gemm_efficiency``, ``launch_overhead_s``, ``backward_launch_overhead_s``)
    feed the simulator's kernel model (:func:`megatrain.planner.time.kernel_time`,
    :class:`megatrain.planner.time.ComputeWork`); ``host_*_issue_stall`` how much a host op holds the
    issuing thread; ``h2d_beside_compute_bytes_per_s`` and ``compute_slowdown_beside_h2d`` how much a
    weight copy and a layer's compute slow each other, ``issue_slowdown_beside_h2d`` how much a copy in
    flight slows the issuing thread (measured only: presets leave them at "no contention", and so do
    specs written before them).

    Every field is in base units (bytes, seconds, FLOP/s, bytes/s, params/s). A GPU field of 0
    means "not measured / no GPU" (a host-only spec from ``measure_hardware()`` on a machine without CUDA);
    the cost model refuses to time GPU ops against it. For data parallel the spec is one node: the
    ``intra_node_*`` fields describe the link among its GPUs, the ``network_*`` fields its network
    to the other nodes (:mod:`megatrain.planner.topology` attaches sourced presets); how many GPUs
    and nodes a run uses is the Plan's (``Plan.data_parallel``, ``Plan.nodes``).
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="what this spec describes, e.g. 'H100 SXM 80GB (preset)'")
    gpu_memory_bytes: int = Field(ge=0, description="GPU memory in bytes, the total nvidia-smi reports")
    bf16_flops: float = Field(ge=0, description="dense BF16 matmul rate in FLOP/s (FP32 accumulate), "
                                               "peak or measured")
    fp32_flops: float = Field(ge=0, description="dense strict-FP32 matmul rate in FLOP/s (IEEE FP32, no "
                                               "TF32 tensor cores: megatrain runs FP32 compute that way, "
                                               "see strict_fp32)")
    matmul_efficiency: float = Field(DEFAULT_MATMUL_EFFICIENCY, gt=0, le=1,
                                     description="fraction of bf16_flops/fp32_flops a layer's forward and "
                                                 "backward reach (dimensionless)")
    h2d_bytes_per_s: float = Field(ge=0, description="pinned host-to-device copy bandwidth in bytes/s")
    d2h_bytes_per_s: float = Field(ge=0, description="pinned device-to-host copy bandwidth in bytes/s")
    h2d_after_cast_bytes_per_s: float = Field(0, ge=0,
                                              description="pinned host-to-device bandwidth of a staging tile the "
                                                          "host has just cast (written, so in its caches), "
                                                          "bytes/s; 0: not measured, h2d_bytes_per_s")
    duplex: bool = Field(description="H2D and D2H run at the same time, each at its full rate (two copy "
                                     "engines and a full-duplex link); if false they share one engine")
    h2d_beside_compute_bytes_per_s: float = Field(0, ge=0,
                                                  description="pinned host-to-device copy bandwidth while the GPU "
                                                              "runs a layer's forward or backward, bytes/s "
                                                              "(measured: bench/gpu_probe.py, launch."
                                                              "forward_beside_h2d.h2d_beside_forward_bytes_per_s); "
                                                              "0: not measured, h2d_bytes_per_s (no contention)")
    compute_slowdown_beside_h2d: float = Field(0.0, ge=0, lt=1,
                                               description="fraction of its speed a layer's forward or backward "
                                                           "loses while a host-to-device copy runs, dimensionless "
                                                           "(it takes time / (1 - this) beside one; measured: "
                                                           "bench/gpu_probe.py, launch.forward_beside_h2d."
                                                           "forward_slowdown = 1 - alone / beside); 0: none")
    issue_slowdown_beside_h2d: float = Field(0.0, ge=0, lt=1,
                                             description="fraction of its speed the issuing thread (the Python "
                                                         "thread that launches every GPU op) loses while a "
                                                         "host-to-device copy it queued is in flight, "
                                                         "dimensionless (a launch takes time / (1 - this) beside "
                                                         "one; measured: bench/gpu_probe.py, launch."
                                                         "forward_beside_h2d.issue_slowdown_beside_h2d = 1 - "
                                                         "the forward's launch wall time alone / beside copies "
                                                         "the same thread queued); 0: none")
    host_memory_bytes: int = Field(ge=0, description="host DRAM in bytes")
    pinned_memory_cap_bytes: int = Field(ge=0, description="most host memory that may be pinned, in bytes")
    host_optimizer_params_per_s: float = Field(gt=0, description="FP32 AdamW updates per second on the "
                                                                 "host from FP32 gradients (parameters/s): "
                                                                 "megatrain's host kernel "
                                                                 "(runtime.host_kernels) on tiles larger "
                                                                 "than the last-level cache, at the "
                                                                 "threads of hardware.host_worker_threads("
                                                                 "host_cores)")
    host_optimizer_bf16_params_per_s: float = Field(0, ge=0, description="the same from BF16 gradient tiles "
                                                                         "(widened in the cache, chunk by "
                                                                         "chunk), parameters/s; 0: not "
                                                                         "measured, estimated from "
                                                                         "host_optimizer_params_per_s by "
                                                                         "bytes moved (x 28/34)")
    host_cast_elements_per_s: float = Field(0, ge=0, description="CAST rate, FP32 master to BF16 staging "
                                                                 "tile, elements/s, same tiles and threads; "
                                                                 "0: not measured, estimated from "
                                                                 "host_optimizer_params_per_s by bytes "
                                                                 "moved (x 28/6)")
    host_cores: int = Field(0, ge=0, description="CPU cores of the host (one node) the host rates were "
                                                 "measured with, hardware.host_worker_threads of them per "
                                                 "rank; 0: not recorded")
    op_latency_s: float = Field(DEFAULT_OP_LATENCY_S, ge=0,
                                description="fixed time added to every op in seconds (launch, events)")
    launch_overhead_s: float = Field(DEFAULT_LAUNCH_OVERHEAD_S, ge=0,
                                     description="seconds the issuing thread spends per aten op a layer "
                                                 "template's forward dispatches (FWD, RECOMPUTE), and per event "
                                                 "record or wait")
    backward_launch_overhead_s: float | None = Field(None, ge=0,
                                                     description="seconds the issuing thread spends per aten op a "
                                                                 "local backward dispatches (its recompute and "
                                                                 "torch.autograd.grad together); None: "
                                                                 "launch_overhead_s")
    gemm_efficiency: float = Field(1.0, gt=0, le=1,
                                   description="fraction of bf16_flops/fp32_flops one large matmul kernel "
                                               "reaches: 1.0 where those fields were measured so (8192^3), "
                                               "LARGE_GEMM_EFFICIENCY for a datasheet peak")
    memory_bytes_per_s: float = Field(0, ge=0,
                                      description="GPU memory bandwidth element-wise kernels reach, bytes/s "
                                                  "(reads plus writes); 0: not known, and layers are timed by "
                                                  "their FLOPs alone (matmul_efficiency)")
    attention_flops: float = Field(0, ge=0,
                                   description="FLOP/s of the fused attention forward kernel in BF16, useful "
                                               "FLOPs (a causal mask counts half); 0: not known, as "
                                               "memory_bytes_per_s")
    attention_backward_flops: float = Field(0, ge=0,
                                            description="the same for the fused attention backward kernel")
    kernel_overhead_s: float = Field(DEFAULT_KERNEL_OVERHEAD_S, ge=0,
                                     description="GPU seconds each kernel costs beyond its work")
    host_optimizer_issue_stall: float = Field(0.0, ge=0, le=1,
                                              description="fraction of a host optimizer step's time the "
                                                          "issuing thread cannot issue (the kernel holds "
                                                          "the GIL): 1.0 for DeepSpeed's cpu_adam, 0.0 for "
                                                          "torch's fused AdamW (see HOST_KERNEL_ISSUE_STALL)")
    host_optimizer_issue_slowdown: float = Field(0.0, ge=0, lt=1,
                                                 description="fraction of its speed the issuing thread loses while "
                                                             "the part of a host optimizer step that releases the "
                                                             "GIL runs (all of torch's fused AdamW; DeepSpeed's "
                                                             "finite check after its call), dimensionless: the "
                                                             "kernel's threads take the cores and memory bandwidth "
                                                             "(measured: bench/gpu_probe.py, launch."
                                                             "optimizer_issue_stall where launch.optimizer_kernel "
                                                             "releases the GIL); 0: none")
    host_cast_issue_stall: float = Field(0.0, ge=0, le=1,
                                         description="the same for a host CAST (torch's copy_ releases the "
                                                     "GIL: 0.0)")
    cuda_context_bytes: int = Field(CUDA_CONTEXT_BYTES, ge=0,
                                    description="GPU bytes of the CUDA context and loaded kernel modules, "
                                                "outside PyTorch's caching allocator")
    cublas_workspace_bytes: int = Field(CUBLAS_WORKSPACE_BYTES, ge=0,
                                        description="GPU bytes of one cuBLAS handle's workspaces (cuBLAS and "
                                                    "cuBLASLt) on one stream")
    gpu_reserve_bytes: int | None = Field(None, ge=0,
                                          description="measured: GPU bytes a step needs beyond the plan's tensors "
                                                      "(context, workspaces, allocator rounding and pools); "
                                                      "replaces the derived reserve (cost.gpu_reserve) when given")
    nvme_capacity_bytes: int = Field(0, ge=0, description="bytes of the NVMe tier (a directory on local NVMe "
                                                         "drives) the plan may fill; 0: no NVMe tier")
    nvme_read_bytes_per_s: float = Field(0, ge=0, description="sustained sequential read rate of the NVMe "
                                                              "tier, bytes/s, large direct reads")
    nvme_write_bytes_per_s: float = Field(0, ge=0, description="sustained sequential write rate of the NVMe "
                                                               "tier, bytes/s, large direct writes")
    allreduce_bytes_per_s: float = Field(0, ge=0, description="data parallel: the bus bandwidth of an all-reduce "
                                                              "of host gradient tiles across the ranks, bytes/s "
                                                              "(NCCL's busbw convention: an all-reduce of B bytes "
                                                              "over N ranks takes 2(N-1)/N x B / this); 0: not known. "
                                                              "Legacy name of intra_node_bytes_per_s: a spec "
                                                              "gives one of the two or both equal")
    intra_node_bytes_per_s: float = Field(0, ge=0, description="data parallel: bus bandwidth (NCCL busbw) of a "
                                                               "collective among the GPUs of one node, bytes/s "
                                                               "(NVLink/NVSwitch or PCIe); 0: not known "
                                                               "(allreduce_bytes_per_s is used if set)")
    intra_node_latency_s: float = Field(0, ge=0, description="seconds per step of a ring collective among the "
                                                             "GPUs of one node (alpha of the alpha-beta model)")
    network_bytes_per_s: float = Field(0, ge=0, description="data parallel across nodes: network bandwidth of "
                                                            "one node in one direction, all its NICs together, "
                                                            "bytes/s; 0: not known (one node only)")
    network_latency_s: float = Field(0, ge=0, description="seconds per step of a ring collective between nodes "
                                                          "(alpha of the alpha-beta model)")

    @pydantic.model_validator(mode="after")
    def _pinned_within_host(self) -> "HardwareSpec":
        if self.pinned_memory_cap_bytes > self.host_memory_bytes:
            raise ValueError(f"HardwareSpec {self.name!r}: pinned_memory_cap_bytes "
                             f"({self.pinned_memory_cap_bytes}) exceeds host_memory_bytes "
                             f"({self.host_memory_bytes}); lower the cap")
        return self

    @pydantic.model_validator(mode="after")
    def _one_intra_node_rate(self) -> "HardwareSpec":
        a, b = self.allreduce_bytes_per_s, self.intra_node_bytes_per_s
        if a > 0 and b > 0 and a != b:
            raise ValueError(f"HardwareSpec {self.name!r}: allreduce_bytes_per_s ({a:g}) is the legacy name of "
                             f"intra_node_bytes_per_s ({b:g}) and the two differ; give only "
                             "intra_node_bytes_per_s")
        return self

    @property
    def intra_node_bus_bytes_per_s(self) -> float:
        """The intra-node collective bus bandwidth, bytes/s: ``intra_node_bytes_per_s``, or the legacy
        ``allreduce_bytes_per_s`` of a spec written before the topology fields; 0 when neither is set."""
        return self.intra_node_bytes_per_s or self.allreduce_bytes_per_s

    @property
    def has_nvme(self) -> bool:
        """An NVMe tier with capacity and both rates (see :mod:`megatrain.planner.nvme`)."""
        return (self.nvme_capacity_bytes > 0 and self.nvme_read_bytes_per_s > 0
                and self.nvme_write_bytes_per_s > 0)

    @property
    def has_kernel_rates(self) -> bool:
        """The rates the kernel-level time model needs (:mod:`megatrain.planner.time`): memory bandwidth
        and the fused attention rates; without them layers are timed by their FLOPs alone."""
        return self.memory_bytes_per_s > 0 and self.attention_flops > 0 and self.attention_backward_flops > 0

    @property
    def backward_launch_s(self) -> float:
        """Seconds per aten op a local backward dispatches (``backward_launch_overhead_s``, else
        ``launch_overhead_s``)."""
        a = self.backward_launch_overhead_s
        return self.launch_overhead_s if a is None else a

    @property
    def has_contention(self) -> bool:
        """Copy/compute contention is measured (``h2d_beside_compute_bytes_per_s`` or
        ``compute_slowdown_beside_h2d`` set): the simulator slows an H2D-stream copy and a compute op
        that run at once (:mod:`megatrain.planner.simulate`, "Contention")."""
        return self.h2d_beside_compute_bytes_per_s > 0 or self.compute_slowdown_beside_h2d > 0

    @property
    def has_issue_contention(self) -> bool:
        """A copy in flight slows the issuing thread (``issue_slowdown_beside_h2d`` set): the simulator
        issues at ``1 - issue_slowdown_beside_h2d`` of its speed while an H2D-stream copy runs
        (:mod:`megatrain.planner.simulate`, "Stalls"). Apart from :attr:`has_contention`, which slows
        the copy and the GPU's kernels, not the thread."""
        return self.issue_slowdown_beside_h2d > 0

    @property
    def has_gpu(self) -> bool:
        return self.gpu_memory_bytes > 0 and self.bf16_flops > 0 and self.h2d_bytes_per_s > 0

    def peak_flops(self, compute_dtype: str) -> float:
        """The matmul rate field for ``compute_dtype`` (``"bfloat16"`` or ``"float32"``), FLOP/s."""
        if compute_dtype == "bfloat16":
            return self.bf16_flops
        if compute_dtype == "float32":
            return self.fp32_flops
        raise ValueError(f"compute_dtype {compute_dtype!r}: use 'float32' or 'bfloat16'")

    # -- JSON --------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(self.model_dump_json(indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HardwareSpec":
        """Load a spec written by ``save``. Raises pydantic.ValidationError on a bad file."""
        return cls.model_validate_json(Path(path).read_text())


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """Within the block, FP32 matmuls and convolutions on CUDA run in IEEE FP32: TensorFloat-32
    (10-bit mantissa inputs on tensor cores) is off for cuBLAS and cuDNN; on exit the caller's
    settings are restored exactly. megatrain's FP32 forward and local backward ops and the FP32
    rate ``measure_hardware()`` times run under it, so the spec's ``fp32_flops`` is the rate the
    runtime gets. BF16 matmuls are unaffected. No CUDA call is made (the flags are host globals),
    so it is safe on a machine without a GPU.

    torch 2.9 added per-backend ``fp32_precision`` settings and raises when the legacy
    ``allow_tf32`` flags are read after the new API was used; so where the new API exists it is the
    one saved, set and restored (which also restores a legacy setting: they share state), else the
    legacy flags are (PyTorch docs, "TensorFloat-32 (TF32) on Ampere (and later) devices").
    """
    import torch

    cublas, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(cublas, "fp32_precision"):  # torch >= 2.9
        conv = cudnn.conv
        saved = (cublas.fp32_precision, conv.fp32_precision)
        cublas.fp32_precision = conv.fp32_precision = "ieee"
        try:
            yield
        finally:
            cublas.fp32_precision, conv.fp32_precision = saved
    else:
        saved = (cublas.allow_tf32, cudnn.allow_tf32)
        cublas.allow_tf32 = cudnn.allow_tf32 = False
        try:
            yield
        finally:
            cublas.allow_tf32, cudnn.allow_tf32 = saved


def cpu_name() -> str:
    """The host CPU's model name (``/proc/cpuinfo``, else ``platform``), for reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- presets ---------------------------------------------------------------------------------------

_PCIE5_MEASURED = 53e9
"""Pinned cudaMemcpy over PCIe Gen5 x16: 64 GB/s per direction theoretical (PCI-SIG, 32 GT/s x 16
lanes, 128b/130b), about 50-55 GB/s measured with bandwidthTest/nvbandwidth on H100 hosts."""

_PCIE4_MEASURED = 25e9
"""Pinned cudaMemcpy over PCIe Gen4 x16: 32 GB/s per direction theoretical, about 25 GB/s measured
on A100 and RTX 4090 hosts."""

H100_SXM = HardwareSpec(
    name="H100 SXM 80GB (preset)",
    gpu_memory_bytes=81559 * MiB,
    bf16_flops=989e12,
    fp32_flops=67e12,
    h2d_bytes_per_s=_PCIE5_MEASURED,
    d2h_bytes_per_s=_PCIE5_MEASURED,
    duplex=True,
    host_memory_bytes=2 * TiB,
    pinned_memory_cap_bytes=int(2 * TiB * PINNED_FRACTION),
    **_gpu_kernel_fields(989e12, 3.35e12),
    **_host_fields(614.4e9, cores=112),
)
"""NVIDIA H100 SXM5 80GB in a DGX H100-class node.

- gpu_memory_bytes: 80 GB HBM3; 81559 MiB is the total nvidia-smi reports.
- bf16_flops 989 TFLOP/s: NVIDIA H100 Tensor Core GPU datasheet, dense (the headline 1979 TFLOP/s
  figure is with 2:4 sparsity). fp32_flops 67 TFLOP/s: the same datasheet's FP32 (strict, no
  TF32; the TF32 tensor-core rate, 494.5 dense, is not what megatrain's FP32 compute uses).
- h2d/d2h 53 GB/s: PCIe Gen5 x16, 64 GB/s theoretical per direction, ~50-55 GB/s measured pinned.
- duplex: Hopper has several async copy engines and PCIe is full duplex.
- kernel rates (``_gpu_kernel_fields``): memory bandwidth 3.35 TB/s HBM3 (H100 datasheet) x
  HBM_STREAM_FRACTION; large matmuls at LARGE_GEMM_EFFICIENCY of the peak; fused attention at the
  FLASH_ATTENTION_*_FRACTION of it (FlashAttention-2 on H100).
- host_memory_bytes 2 TiB: DGX H100 system memory (NVIDIA DGX H100 datasheet: 2 TB).
- host rates (AdamW ~8.8e9 params/s, ~7.2e9 from BF16 gradients, CAST ~4.1e10 elements/s): estimates,
  2x Xeon Platinum 8480C with 8 channels of DDR5-4800 each (614.4 GB/s theoretical) x
  HOST_BANDWIDTH_FRACTION over each kernel's bytes (``_host_fields``); host_cores 112 (2 x 56).
"""

H200 = HardwareSpec(
    name="H200 SXM 141GB (preset)",
    gpu_memory_bytes=143771 * MiB,
    bf16_flops=989e12,
    fp32_flops=67e12,
    h2d_bytes_per_s=_PCIE5_MEASURED,
    d2h_bytes_per_s=_PCIE5_MEASURED,
    duplex=True,
    host_memory_bytes=3 * TiB // 2,
    pinned_memory_cap_bytes=int(1.5 * TiB * PINNED_FRACTION),
    **_gpu_kernel_fields(989e12, 4.8e12),
    **_host_fields(614.4e9, cores=112),
)
"""NVIDIA H200 SXM 141GB, host as in the MegaTrain paper (1.5 TB of host memory).

- gpu_memory_bytes: 141 GB HBM3e (NVIDIA H200 datasheet); 143771 MiB as nvidia-smi reports.
- bf16_flops 989 TFLOP/s (dense), fp32_flops 67 TFLOP/s (strict FP32, no TF32): H200 datasheet;
  same GH100 compute as the H100 SXM.
- h2d/d2h 53 GB/s: PCIe Gen5 x16 as for H100_SXM.
- kernel rates as H100_SXM's with 4.8 TB/s HBM3e (H200 datasheet).
- host_memory_bytes 1.5 TiB: DESIGN.md / MegaTrain (arXiv 2604.05091) setup.
- host rates and host_cores: estimates for the host CPUs of DGX H100/H200 (2x Xeon Platinum 8480C,
  8 channels of DDR5-4800 each, 614.4 GB/s theoretical, 112 cores), as for H100_SXM; the paper
  does not name its host CPU.
"""

GH200 = HardwareSpec(
    name="GH200 Grace Hopper 96GB + 480GB LPDDR5X (preset)",
    gpu_memory_bytes=96 * 10**9,
    bf16_flops=989e12,
    fp32_flops=67e12,
    h2d_bytes_per_s=380e9,
    d2h_bytes_per_s=380e9,
    duplex=True,
    host_memory_bytes=480 * 10**9,
    pinned_memory_cap_bytes=int(480 * 10**9 * PINNED_FRACTION),
    **_gpu_kernel_fields(989e12, 4.0e12),
    **_host_fields(546e9, cores=72),
)
"""NVIDIA GH200 Grace Hopper Superchip, 96 GB HBM3 + 480 GB LPDDR5X.

- gpu_memory_bytes 96 GB HBM3 and host_memory_bytes 480 GB LPDDR5X (decimal, as stated): NVIDIA Grace Hopper
  Superchip Architecture whitepaper (as summarised by datacrunch.io, 'Data movement in the NVIDIA
  GH200 Grace Hopper Superchip').
- bf16_flops/fp32_flops: the Hopper GPU's dense BF16 tensor-core rate and its strict FP32 rate, 67
  TFLOP/s (GH200 datasheet; the same GH100 compute as H100 SXM).
- h2d/d2h 380 GB/s: NVLink-C2C is 900 GB/s total, 450 GB/s per direction (whitepaper); 380 GB/s
  is an estimate of the sustained pinned copy rate (~85% of the link rate, the efficiency pinned
  copies reach on PCIe). ``measure_hardware()`` on the machine replaces it.
- kernel rates as H100_SXM's with 4 TB/s HBM3 (the 96 GB GH200's, NVIDIA GH200 datasheet).
- host rates: estimates, Grace LPDDR5X up to 546 GB/s (whitepaper) x HOST_BANDWIDTH_FRACTION over
  each kernel's bytes (AdamW ~7.8e9 params/s); host_cores 72 (Grace, 72 Neoverse V2 cores).
"""

A100_80GB = HardwareSpec(
    name="A100 SXM 80GB (preset)",
    gpu_memory_bytes=81920 * MiB,
    bf16_flops=312e12,
    fp32_flops=19.5e12,
    h2d_bytes_per_s=_PCIE4_MEASURED,
    d2h_bytes_per_s=_PCIE4_MEASURED,
    duplex=True,
    host_memory_bytes=1 * TiB,
    pinned_memory_cap_bytes=int(1 * TiB * PINNED_FRACTION),
    **_gpu_kernel_fields(312e12, 2.039e12),
    **_host_fields(409.6e9, cores=128),
)
"""NVIDIA A100 SXM4 80GB in a DGX A100-class node.

- gpu_memory_bytes: 80 GB HBM2e; 81920 MiB as nvidia-smi reports.
- bf16_flops 312 TFLOP/s (dense), fp32_flops 19.5 TFLOP/s (strict FP32; TF32 would be 156):
  NVIDIA A100 datasheet.
- h2d/d2h 25 GB/s: PCIe Gen4 x16, 32 GB/s theoretical, ~25 GB/s measured pinned.
- kernel rates as H100_SXM's with 2,039 GB/s HBM2e (A100 80GB SXM datasheet) and its BF16 peak
  (FlashAttention-2 reaches more of an A100's peak than of an H100's: the fractions are low here).
- host_memory_bytes 1 TiB: DGX A100 (1 TB standard, 2 TB option).
- host rates: estimates, 2x AMD EPYC 7742 with 8 channels of DDR4-3200 each (409.6 GB/s
  theoretical) x HOST_BANDWIDTH_FRACTION over each kernel's bytes (AdamW ~5.9e9 params/s);
  host_cores 128 (2 x 64).
"""

RTX_4090 = HardwareSpec(
    name="GeForce RTX 4090 24GB (preset)",
    gpu_memory_bytes=24564 * MiB,
    bf16_flops=165.2e12,
    fp32_flops=82.6e12,
    h2d_bytes_per_s=_PCIE4_MEASURED,
    d2h_bytes_per_s=_PCIE4_MEASURED,
    duplex=True,
    host_memory_bytes=128 * GiB,
    pinned_memory_cap_bytes=int(128 * GiB * PINNED_FRACTION),
    **_gpu_kernel_fields(165.2e12, 1.008e12),
    **_host_fields(89.6e9, cores=16),
)
"""NVIDIA GeForce RTX 4090 in a desktop workstation.

- gpu_memory_bytes: 24 GB GDDR6X; 24564 MiB as nvidia-smi reports.
- bf16_flops 165.2 TFLOP/s: dense BF16 with FP32 accumulate (NVIDIA Ada Lovelace architecture
  whitepaper, appendix; the 330 TFLOP/s figure is FP16 accumulate). fp32_flops 82.6 TFLOP/s,
  the peak FP32 (non-tensor) rate, same source (dense TF32 is also 82.6 on this GPU).
- h2d/d2h 25 GB/s: PCIe Gen4 x16 as for A100_80GB.
- kernel rates as H100_SXM's with 1,008 GB/s GDDR6X (Ada Lovelace whitepaper) and its BF16 peak.
- duplex: AD102 boards report two async copy engines (cudaDeviceProp.asyncEngineCount == 2);
  ``measure_hardware()`` checks it on the machine.
- host_memory_bytes 128 GiB: a typical workstation.
- host rates: estimates, dual-channel DDR5-5600 (89.6 GB/s theoretical) x HOST_BANDWIDTH_FRACTION
  over each kernel's bytes (AdamW ~1.3e9 params/s); host_cores 16 (a 16-core desktop CPU).
"""

PRESETS: dict[str, HardwareSpec] = {
    "H100_SXM": H100_SXM,
    "H200": H200,
    "GH200": GH200,
    "A100_80GB": A100_80GB,
    "RTX_4090": RTX_4090,
}
"""The presets by canonical name. ``preset`` also accepts lower case, '-' and ' ' for '_'."""


# -- the machine's other presets: NVMe arrays (the planner's NVMe tier, megatrain.planner.nvme) and
# the links of data parallel (megatrain.planner.topology), each number with its source ------------

@dataclass(frozen=True, slots=True)
class NvmeArray:
    """An array of identical NVMe drives, striped (RAID 0 or one file per drive): capacity and
    rates are the drive's times ``drives`` (the datasheet's sequential rates, an upper bound on
    what large direct I/O sustains; ``bench/nvme_io.py`` measures a machine's)."""

    name: str
    drives: int
    drive_bytes: int
    drive_read_bytes_per_s: float
    drive_write_bytes_per_s: float
    source: str

    @property
    def capacity_bytes(self) -> int:
        return self.drives * self.drive_bytes

    @property
    def read_bytes_per_s(self) -> float:
        return self.drives * self.drive_read_bytes_per_s

    @property
    def write_bytes_per_s(self) -> float:
        return self.drives * self.drive_write_bytes_per_s


_MICRON_7450 = ("Micron 7450 PRO 7.68 TB, PCIe Gen4 x4 U.3: sequential read 6,800 MB/s, sequential write "
                "5,300 MB/s (Micron 7450 SSD product brief)")
_SAMSUNG_PM1743 = ("Samsung PM1743 7.68 TB, PCIe Gen5 x4: sequential read 13,000 MB/s, sequential write "
                   "6,600 MB/s (Samsung PM1743 data sheet)")

NVME_ARRAYS: dict[str, NvmeArray] = {
    "4xgen4": NvmeArray("4x PCIe Gen4 NVMe (Micron 7450 PRO 7.68 TB)", 4, 7_680 * 10**9, 6.8e9, 5.3e9, _MICRON_7450),
    "8xgen4": NvmeArray("8x PCIe Gen4 NVMe (Micron 7450 PRO 7.68 TB)", 8, 7_680 * 10**9, 6.8e9, 5.3e9, _MICRON_7450),
    "4xgen5": NvmeArray("4x PCIe Gen5 NVMe (Samsung PM1743 7.68 TB)", 4, 7_680 * 10**9, 13.0e9, 6.6e9,
                        _SAMSUNG_PM1743),
    "8xgen5": NvmeArray("8x PCIe Gen5 NVMe (Samsung PM1743 7.68 TB)", 8, 7_680 * 10**9, 13.0e9, 6.6e9,
                        _SAMSUNG_PM1743),
}
"""NVMe array presets by name (``megatrain plan --nvme NAME``), each with its drive's source."""

@dataclass(frozen=True, slots=True)
class Link:
    """A collective's link as the cost model reads it: bus bandwidth in bytes/s (NCCL's busbw
    convention for an interconnect, one direction of all of a node's NICs for a network), the
    latency of one step of a ring collective in seconds, and where the numbers come from."""

    name: str
    bytes_per_s: float
    latency_s: float
    source: str

    def __post_init__(self) -> None:
        if self.bytes_per_s <= 0 or self.latency_s < 0:
            raise ConfigError(f"Link {self.name!r}: bytes_per_s ({self.bytes_per_s}) must be > 0 and latency_s "
                              f"({self.latency_s}) >= 0")


INTERCONNECTS: dict[str, Link] = {
    "nvlink4": Link(
        "NVLink 4 + NVSwitch (HGX/DGX H100, H200)", 450e9, 3e-6,
        "NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction per GPU, 900 GB/s bidirectional (NVIDIA H100 "
        "and H200 datasheets). NCCL all_reduce_perf on 8x H100 SXM5 measures a busbw of 460-480 GB/s at large "
        "sizes (docs.alayanew.com, 'NCCL-tests in practice', 2026; NVLink SHARP in the switch lets busbw pass "
        "the link rate) and the p2p test 380 GB/s per direction (github.com/NVIDIA/nccl issue 1264): 450 GB/s, "
        "the per-direction link rate, sits inside that range. Latency 3 us per ring step: estimate."),
    "pcie5": Link(
        "PCIe Gen5 x16, no NVLink", 40e9, 10e-6,
        "PCIe Gen5 x16: 64 GB/s per direction theoretical (PCI-SIG, 32 GT/s x 16 lanes, 128b/130b); NCCL "
        "all_reduce_perf on 8x H100 PCIe without NVSwitch measures a busbw of 35-45 GB/s "
        "(docs.alayanew.com, 'NCCL-tests in practice', 2026): 40 GB/s. Latency 10 us per ring step through "
        "the host bridges: estimate."),
}
"""Intra-node interconnect presets (``megatrain plan --interconnect NAME``), each with its source."""

NETWORKS: dict[str, Link] = {
    "ndr-8x400g": Link(
        "8x 400 Gb/s InfiniBand NDR / RoCE per node (one NIC per GPU)", 8 * 50e9, 5e-6,
        "DGX H100: 8 single-port ConnectX-7 NICs at 400 Gb/s (NVIDIA DGX H100 datasheet); 400 Gb/s = 50 GB/s "
        "per NIC per direction, 400 GB/s per node. NCCL all_reduce_perf across H100 nodes with NVLink and "
        "NDR measures a busbw of 400-450 GB/s (saturncloud.io, 'Validating multi-node GPU clusters with "
        "NCCL tests'), so the link rate is reached. Latency 5 us per ring step (NIC, switch hop, NCCL "
        "proxy): estimate."),
    "400g-1nic": Link(
        "one 400 Gb/s NIC per node", 50e9, 5e-6,
        "One 400 Gb/s InfiniBand NDR or 400GbE RoCE port (ConnectX-7): 50 GB/s per direction for the whole "
        "node. Latency 5 us per ring step: estimate, as for ndr-8x400g."),
}
"""Inter-node network presets (``megatrain plan --network NAME``), per node, each with its source."""


def preset(name: str) -> HardwareSpec:
    """The preset called ``name`` (``"h100_sxm"``, ``"H100-SXM"`` and ``"H100 SXM"`` all work).

    Raises:
        ConfigError: no preset has that name; the message lists the valid names.
    """
    key = name.strip().upper().replace("-", "_").replace(" ", "_")
    try:
        return PRESETS[key]
    except KeyError:
        raise ConfigError(f"no hardware preset named {name!r}; valid names are {sorted(PRESETS)} "
                          "(case-insensitive), or build a HardwareSpec, load one from a JSON file "
                          "(load_hardware) or measure one (megatrain.runtime.measure.measure_hardware)") from None


def load_hardware(hardware: "HardwareSpec | str | os.PathLike") -> HardwareSpec:
    """The spec ``hardware`` names: a HardwareSpec as is, a JSON file written by
    :meth:`HardwareSpec.save`, or a preset name (:func:`preset`).

    A string that names an existing file, or ends in ``.json``, is a file; anything else a preset.

    Raises:
        ConfigError: no such file or preset, or the file is not a valid spec (the message names
            the file and the field).
    """
    if isinstance(hardware, HardwareSpec):
        return hardware
    path = Path(hardware)
    if path.is_file():
        try:
            return HardwareSpec.load(path)
        except pydantic.ValidationError as e:
            raise ConfigError(f"{path} is not a valid HardwareSpec: {describe_validation(e)}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read the hardware spec {path}: {e}") from None
    if path.suffix == ".json":
        raise ConfigError(f"hardware spec file {str(hardware)!r} does not exist; write one with "
                          "megatrain.runtime.measure.measure_hardware(path) or name a preset "
                          f"({sorted(PRESETS)})")
    return preset(str(hardware))


def host_worker_threads(cores: int, gpus_per_node: int = 1) -> int:
    """Intra-op threads of one rank's host workers (HOST and CAST, which take turns on them): the
    rank's share of the node's ``cores`` less one for its issuing thread, at least 1. The CUDA
    backend runs its workers with it (:class:`megatrain.runtime.cuda.CUDABackend`) and
    :func:`megatrain.runtime.measure.measure_hardware` measures the host rates with it (one rank).

    Raises:
        ValueError: ``cores`` or ``gpus_per_node`` < 1.
    """
    if cores < 1 or gpus_per_node < 1:
        raise ValueError(f"host_worker_threads(cores={cores}, gpus_per_node={gpus_per_node}): both must be >= 1")
    return max(1, cores // gpus_per_node - 1)


__all__ = ["HardwareSpec", "PRESETS", "preset", "load_hardware", "H100_SXM", "H200", "GH200", "A100_80GB",
           "RTX_4090", "NvmeArray", "NVME_ARRAYS", "Link", "INTERCONNECTS", "NETWORKS"]
