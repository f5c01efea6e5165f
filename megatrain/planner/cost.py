"""The cost model: how long each op takes and how many bytes a plan holds, in one module.

Everything that turns a (LayerGraph, Plan, HardwareSpec) into seconds or bytes lives here; the
simulator, the solver and the CLI call these functions and never re-derive a formula (FlexGen's
``cost_model.py`` shows what goes wrong when each constraint re-derives its own sizes).

Op times. Every op costs ``hw.op_latency_s`` plus its work over the rate of the resource it uses:

- ``H2D``: ``layer.numel x plan.compute_itemsize`` bytes over ``h2d_bytes_per_s``. The tile is
  copied whole, alignment padding included, so ``numel`` (not the parameter count) is moved.
- ``D2H``: ``layer.trainable_numel x plan.gradient_itemsize`` bytes over ``d2h_bytes_per_s``
  (FP32 gradients, or BF16 ones where they are exact: :attr:`Plan.gradient_dtype`).
- ``FWD``/``BWD``: ``layer.fwd_flops`` / ``layer.bwd_flops`` (one micro-batch; the local backward
  includes its recompute) over the matmul rate of ``plan.compute_dtype`` times
  ``hw.matmul_efficiency``.
- ``OPT``: ``layer.trainable_numel`` over the host AdamW rate (:func:`optimizer_rate`): from FP32
  gradients ``host_optimizer_params_per_s``; from BF16 gradients read from a host tile (widened
  chunk by chunk, :mod:`megatrain.runtime.host_kernels`: 26 bytes of DRAM traffic per parameter
  where the chunks stay in the cache, 34 where they do not, 28 with FP32 gradients)
  ``host_optimizer_bf16_params_per_s``. Both are measured on tiles larger than the last-level cache
  (:func:`megatrain.runtime.measure.measure_hardware`).
- ``RECOMPUTE``: as ``FWD``.
- ``OFFLOAD``/``RELOAD``: the bytes of the layer's outputs that some layer reads (one micro-batch)
  over ``d2h_bytes_per_s`` / ``h2d_bytes_per_s``.
- ``CAST``: ``layer.numel`` FP32 reads and BF16 writes (6 bytes per element) on the host, at the
  measured ``host_cast_elements_per_s`` (:func:`cast_rate`; 2.9-3.4x AdamW's parameter rate at 1
  thread and 1.2-2.0x at 2 on a shared 2-core EPYC VM, not the 28 / 6 = 4.67x that bytes predict).
- ``ACC``: ``layer.trainable_numel`` additions into an FP32 accumulator on the host: the tile
  (``plan.gradient_itemsize``) and the accumulator read, the accumulator written, at AdamW's
  memory-bound rate scaled by bytes (``ADAMW_BYTES_PER_PARAM``; micro-batch 0's copy moves a
  read less and is counted the same).
- ``ALL_REDUCE`` (data parallel): a hierarchical ring all-reduce of the FP32 step gradients over
  ``plan.gpus_per_node`` GPUs per node and ``plan.nodes`` nodes (:func:`all_reduce_time`).
- ``REDUCE_SCATTER`` (``Plan.gradient_reduction == "reduce_scatter"``, one node): a ring
  reduce-scatter of them over the node's GPUs, half the all-reduce's bytes (:func:`reduce_scatter_time`).
- ``COUNT_REDUCE`` (data parallel): the same all-reduce of one int64 count (:func:`count_reduce_time`).

Data parallel (``plan.data_parallel`` ranks on ``plan.nodes`` nodes). The ranks of a node share its
host memory bandwidth (:func:`host_rate`); ``plan.optimizer_shards`` of them share one copy of the
masters and moments (:func:`node_memory`), each rank's OPT stepping its shard of every tile
(:func:`optimizer_numel`). With ``plan.host_state == "shard"`` a node
holds and updates ``1 / nodes`` of the state and every H2D first all-gathers the layer's weights
over the network (:func:`weight_gather_time`).

Resources. Each stream is an in-order queue on one resource; H2D and D2H are separate resources
when ``hw.duplex`` and one shared copy engine otherwise (:func:`resource_of`), which the simulator
serialises. The HOST and CAST streams share one: the runtime runs their work one op at a time,
each with the rank's whole thread budget (:func:`host_worker_threads`), the threads the host rates
are measured with.

Memory (bytes). GPU: weight slots, ``numel x compute_itemsize`` each, and gradient slots,
``trainable_numel x plan.gradient_itemsize`` each, sized per slot (:func:`slot_numels`): each of the ``plan.slots``
streaming slots for the widest layer that is not resident, each resident layer's slot for that
layer alone (an embedding or LM head much wider than a block then costs only its own slot); buffers
``sum(layer.buffer_bytes)``; the reserve (:func:`gpu_reserve`: CUDA context, cuBLAS workspaces, the
caching allocator's rounding and per-stream pools, or a measured figure); and, varying over the step,
checkpoints, boundary gradients and the working memory of the running compute op
(:func:`activation_liveness`). Host: 12 bytes per tile element for the FP32 master and the two
Adam moments; with per-micro-batch passes also FP32 gradient accumulators, ``trainable_numel x 4``
per trainable layer (pageable: only the host reads and writes them); with BF16 gradients that the
optimizer reads from a host tile, one FP32 scratch of ``OPT_CHUNK_ELEMENTS`` per host worker thread
(pageable, 2 MiB each; :func:`gradient_scratch_numel`).

Pinned host memory is exactly what DMA reads or writes, and :func:`pinned_buffers` lays it out
for the runtime, which pins the same regions (one arena registered with ``cudaHostRegister``, not
the caching host allocator, which rounds every block up to a power of two): the host gradient
tiles that D2H writes (``plan.gradient_itemsize`` per element), each sized to the widest layer that uses it (one per trainable layer, at
its own size, when the optimizer waits for the next step; :func:`gradient_tile_numels`); with BF16
compute the staging tiles that H2D reads, ``max numel x 2`` each (with ``plan.cast_once`` one per
layer, ``numel x 2``: :func:`staging_tile_numels`); the offloaded checkpoints, one
region per (value, micro-batch) alive at once; and each layer's gradient norm and finite flag.
Every region starts on a page and takes whole pages (``HOST_PAGE_BYTES``). With FP32 compute H2D
reads the master row itself, so each layer's master is pinned too, rounded up to whole pages
(:func:`pinned_master_bytes`); the Adam moments are never DMA'd and stay pageable.

FLOPs. Model FLOPs follow PaLM's model FLOPs utilisation (Chowdhery et al. 2022, "PaLM: Scaling
Language Modeling with Pathways", appendix B): the FLOPs of one forward and backward of the model
per token, with recompute not counted, over the step time and the peak rate. The backward is
counted as twice the forward, so model FLOPs = 3 x the sum of the layers' traced forward FLOPs
(which include attention as the kernels compute it) per micro-batch.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Callable

from megatrain.errors import ConfigError
from megatrain.optim import ADAMW, OPTIMIZERS
from megatrain.ir.graph import Layer, LayerGraph
from megatrain.ir.hardware import (ADAMW_BYTES_PER_PARAM, ADAMW_WIDENED_BYTES_PER_PARAM, CAST_BYTES_PER_ELEMENT,
                                        CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, HardwareSpec)
from megatrain.ir.liveness import BATCH, liveness
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.ir.schedule import (COMPUTE_KINDS, HOST_STREAMS, OP_KINDS, Op, OpKind, Schedule, Stream,
                                        gradient_tiles)
from megatrain.units import MiB, human_bytes

GRAD_ITEMSIZE = 4
"""FP32 gradients: the accumulators, the optimizer's input, and the GPU slot, D2H and host tiles
unless the plan sends BF16 ones (``Plan.gradient_itemsize`` is what those use)."""

OPT_CHUNK_ELEMENTS = 1 << 19
"""Elements per intra-op thread that an OPT of BF16 gradients widens at a time into its FP32
scratch (2 MiB per thread), stepping each chunk right after
(:class:`megatrain.runtime.host_kernels.HostAdamW`). For one or two threads the chunk stays in the
last-level cache between its widening and its step (about 34 bytes move per chunk element
meanwhile: 17 MiB per thread, and an AMD Zen 4 CCD has 32 MiB, a Xeon Platinum 8480C socket 105 MB),
so the widened copy stays out of DRAM; a larger team gets a chunk as many times larger, so that
each of the chunk's two parallel regions (the widening, the step) gives every thread half a
million elements, whose milliseconds dwarf the team's wake-up. A multiple of every kernel's vector
width (16 FP32 lanes of AVX-512 times DeepSpeed's unroll of 8), so that the chunked step is
bitwise the unchunked one."""

MASTER_BYTES_PER_ELEMENT = 4
"""FP32 master weight per tile element."""

MOMENT_BYTES_PER_ELEMENT = ADAMW.state_bytes_per_param
"""AdamW's FP32 exp_avg and exp_avg_sq per trainable tile element; a plan's own optimizer's is
:func:`state_bytes_per_param`."""


def state_bytes_per_param(plan: Plan | None = None) -> int:
    """Bytes of optimizer state per trainable parameter under ``plan``'s host optimizer
    (``Plan.optimizer_name``; None: AdamW's 8): 4 per FP32 state row of its spec."""
    return (plan.optimizer_spec if plan is not None else ADAMW).state_bytes_per_param

STAGING_ITEMSIZE = 2
"""The staging ring holds BF16 copies of the tiles H2D is about to read."""

ACC_BYTES_PER_ELEMENT = 12
"""An ACC of FP32 gradients reads the ring tile and the accumulator and writes the accumulator
(4 B each); of BF16 gradients 2 B less (:func:`acc_time`)."""

HOST_PAGE_BYTES = 4096
"""Granularity of pinned host memory: ``cudaHostRegister`` page-locks whole pages, so every pinned
region starts on a page boundary and is a whole number of pages (the x86-64 base page; on a host
with larger pages the driver locks whole pages of its own size around each region)."""

NORM_ITEMSIZE = 4
"""Each layer's gradient norm reaches the host as one FP32 value (D2H, pinned)."""

FLAG_ITEMSIZE = 1
"""Each layer's finite flag reaches the host as one bool (D2H, pinned)."""

BACKWARD_TO_FORWARD_FLOPS = 2
"""Model FLOPs count a backward as twice the forward (PaLM appendix B; Kaplan et al. 2020)."""


class Resource(enum.Enum):
    """What an op occupies while it runs; ops on one resource never overlap."""

    GPU = "gpu"  # the SMs, for FWD and BWD
    H2D_ENGINE = "h2d_engine"
    D2H_ENGINE = "d2h_engine"
    COPY_ENGINE = "copy_engine"  # one engine for both directions when the spec is not duplex
    HOST = "host"  # the host optimizer worker
    NVME = "nvme"  # the NVMe drives: reads and writes share them
    COMM = "comm"  # the interconnect the data-parallel collectives use


def resource_of(stream: Stream, hw: HardwareSpec) -> Resource:
    """The resource ``stream``'s ops run on under ``hw``."""
    if stream is Stream.COMPUTE:
        return Resource.GPU
    if stream is Stream.IO:
        return Resource.NVME
    if stream is Stream.COMM:
        return Resource.COMM
    if stream is Stream.HOST or stream is Stream.CAST:
        # Two host workers, one DRAM and one thread budget: AdamW and a cast are memory-bound, so
        # at once they would only share the bandwidth (and oversubscribe the cores); the runtime
        # runs them one at a time (runtime/cuda.py, "One host CPU budget"), and so does the model.
        return Resource.HOST
    if not hw.duplex:
        return Resource.COPY_ENGINE
    return Resource.H2D_ENGINE if stream is Stream.H2D else Resource.D2H_ENGINE


# -- op times --------------------------------------------------------------------------------------

def _rate(hw: HardwareSpec, field: str, value: float, what: str) -> float:
    if value <= 0 and field.startswith("nvme_"):
        raise ConfigError(f"HardwareSpec {hw.name!r} has no NVMe tier ({field}=0), so it cannot time {what}; "
                          "attach one (megatrain.planner.nvme.with_nvme(hw, '4xgen5'), megatrain plan --nvme "
                          "4xgen5) or set nvme_capacity_bytes, nvme_read_bytes_per_s and nvme_write_bytes_per_s "
                          "in a HardwareSpec JSON")
    if value <= 0:
        raise ConfigError(f"HardwareSpec {hw.name!r} has {field}=0, so it cannot time {what}; use a "
                          "preset (megatrain.ir.hardware.preset('H100_SXM')) or "
                          "megatrain.runtime.measure.measure_hardware() on a machine with a GPU")
    return value


def compute_rate(hw: HardwareSpec, compute_dtype: str) -> float:
    """FLOP/s a layer's compute reaches in ``compute_dtype``: the peak matmul rate x efficiency."""
    field = "bf16_flops" if compute_dtype == "bfloat16" else "fp32_flops"
    return _rate(hw, field, hw.peak_flops(compute_dtype), "FWD/BWD ops") * hw.matmul_efficiency


def h2d_bytes(layer: Layer, plan: Plan) -> int:
    """Bytes one H2D weight copy moves: the whole tile, padding included, in the compute dtype."""
    return layer.numel * plan.compute_itemsize


def d2h_bytes(layer: Layer, plan: Plan | None = None) -> int:
    """Bytes one D2H gradient copy moves: the trainable prefix of the tile in the plan's gradient
    dtype (FP32 without a plan)."""
    return layer.trainable_numel * (plan.gradient_itemsize if plan is not None else GRAD_ITEMSIZE)


def h2d_time(layer: Layer, plan: Plan, hw: HardwareSpec) -> float:
    """One weight copy to the GPU; with ``plan.host_state == "shard"`` the layer's weights are first
    all-gathered over the network (:func:`weight_gather_time`), which the H2D waits for and is timed
    with: the schedule's gather (an ALL_GATHER with a gather tile, before the H2D or, with BF16
    compute, the CAST) is timed at its launch latency only, so the network time is counted once,
    on the copy's critical path, in the simulator and the topology planner alike."""
    rate = _rate(hw, "h2d_bytes_per_s", hw.h2d_bytes_per_s, "H2D ops")
    return hw.op_latency_s + h2d_bytes(layer, plan) / rate + weight_gather_time(layer, hw, plan)


def d2h_time(layer: Layer, hw: HardwareSpec, plan: Plan | None = None) -> float:
    rate = _rate(hw, "d2h_bytes_per_s", hw.d2h_bytes_per_s, "D2H ops")
    return hw.op_latency_s + d2h_bytes(layer, plan) / rate


def fwd_time(layer: Layer, plan: Plan, hw: HardwareSpec) -> float:
    """One forward of one micro-batch."""
    return hw.op_latency_s + layer.fwd_flops / compute_rate(hw, plan.compute_dtype)


def bwd_time(layer: Layer, plan: Plan, hw: HardwareSpec) -> float:
    """One local backward (recompute plus backward proper) of one micro-batch."""
    return hw.op_latency_s + layer.bwd_flops / compute_rate(hw, plan.compute_dtype)


SHARD_ALIGN_ELEMENTS = 16
"""Optimizer shards start on a multiple of 16 FP32 elements (64 bytes, one x86 cache line), so two
ranks stepping neighbouring shards of a shared tile never write the same line."""


def optimizer_shard(numel: int, shards: int, index: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of a layer's ``numel`` trainable parameters that rank ``index`` of
    ``shards`` steps (``Plan.optimizer_shards``): contiguous, in rank order, each but the last
    ``ceil(numel / shards)`` rounded up to :data:`SHARD_ALIGN_ELEMENTS` (the last may be shorter or
    empty). Together they cover ``[0, numel)`` once.

    Raises:
        ValueError: ``index`` is not in ``[0, shards)``.
    """
    if not 0 <= index < shards:
        raise ValueError(f"optimizer shard {index} of {shards}: the index is in [0, {shards})")
    per = _shard_size(numel, shards)
    lo = min(numel, index * per)
    return lo, min(numel, lo + per)


def _shard_size(numel: int, shards: int) -> int:
    """Elements of each but the last of ``shards`` optimizer shards of ``numel``: ``ceil(numel /
    shards)`` rounded up to :data:`SHARD_ALIGN_ELEMENTS`."""
    return -(-(-(-numel // SHARD_ALIGN_ELEMENTS)) // shards) * SHARD_ALIGN_ELEMENTS


def cast_shard(numel: int, trainable_numel: int, plan: Plan, index: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of a layer's master tile (``numel`` elements, the first
    ``trainable_numel`` trainable) that rank ``index`` of a node CASTs into the node's shared
    staging tile with ``plan.shared_cast``: its optimizer shard (:func:`optimizer_shard` of
    ``plan.optimizer_shards``), which only its own OPT writes, the node's last rank also the
    frozen parameters after the trainable prefix (nothing steps them). The ranks' shards tile
    ``[0, numel)``. Without ``shared_cast``, ``(0, numel)``: each rank casts the whole tile.

    Raises:
        ValueError: ``index`` is not in ``[0, plan.optimizer_shards)``."""
    if not plan.shared_cast:
        return 0, numel
    lo, hi = optimizer_shard(trainable_numel, plan.optimizer_shards, index)
    return lo, numel if index == plan.optimizer_shards - 1 else hi


def reduced_numel(numel: int, plan: Plan) -> int:
    """Elements a host gradient tile or accumulator of a layer with ``numel`` trainable parameters
    holds under ``plan``: ``numel``, or with ``plan.gradient_reduction == "reduce_scatter"``
    ``update_shards x`` the shard size of :func:`optimizer_shard` (fewer than ``update_shards x
    16`` more; ``Plan.update_shards``): a reduce-scatter needs equal chunks, so the tile is padded
    to them (the executor zeroes the padding before each REDUCE_SCATTER, so it never changes a sum)."""
    if plan.gradient_reduction != "reduce_scatter":
        return numel
    return plan.update_shards * _shard_size(numel, plan.update_shards)


def node_slice(numel: int, trainable_numel: int, plan: Plan, node: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of a layer's master tile (``numel`` elements, the first
    ``trainable_numel`` trainable) that node ``node`` holds, with its Adam moments for
    ``[lo, min(hi, trainable_numel))``. ``[0, numel)`` unless ``plan.host_state == "shard"``; then
    the union of the optimizer shards (:func:`optimizer_shard` of ``plan.update_shards``) of the
    node's ``optimizer_shards`` consecutive ranks, so each rank's shard lies in its node's slice,
    and the last node also holds the frozen parameters after the trainable prefix (they have no
    shard: nothing steps them). The nodes' slices tile ``[0, numel)`` in node order.

    Raises:
        ValueError: ``node`` is not in ``[0, plan.nodes)``.
    """
    if not 0 <= node < plan.nodes:
        raise ValueError(f"node {node} of a plan with {plan.nodes} nodes: the index is in [0, {plan.nodes})")
    if plan.host_state != "shard":
        return 0, numel
    ways, g = plan.update_shards, plan.optimizer_shards
    lo = optimizer_shard(trainable_numel, ways, node * g)[0]
    hi = numel if node == plan.nodes - 1 else optimizer_shard(trainable_numel, ways, node * g + g - 1)[1]
    return lo, hi


def opt_time(layer: Layer, hw: HardwareSpec, plan: Plan | None = None) -> float:
    """One rank's host AdamW step over its part of the layer's trainable parameters
    (:func:`optimizer_numel`: all of them for one rank) at its AdamW rate (:func:`optimizer_rate`:
    its share of the host's, from BF16 gradient tiles where the plan has them)."""
    return hw.op_latency_s + optimizer_numel(layer, plan) / optimizer_rate(hw, plan)


def host_rate(hw: HardwareSpec, plan: Plan | None = None) -> float:
    """AdamW parameters/s (FP32 gradients) one rank's host ops run at: the node's
    ``host_optimizer_params_per_s`` over ``plan.gpus_per_node``, the ranks on the node. Those ops
    are memory-bound (:data:`~megatrain.ir.hardware.ADAMW_BYTES_PER_PARAM`; the spec's rate is
    the whole host's, at :func:`host_worker_threads` threads) and the ranks of one node run the
    same schedule at the same time on one DRAM, so each gets an equal share of its bandwidth:
    ``G`` ranks that each step ``1 / G`` of a shared tile take as long as one rank stepping all of
    it, and ``G`` ranks that each step a whole copy of their own take ``G`` times longer."""
    return hw.host_optimizer_params_per_s / (plan.gpus_per_node if plan is not None else 1)


def optimizer_rate(hw: HardwareSpec, plan: Plan | None = None) -> float:
    """Parameters/s of one rank's OPT: :func:`host_rate`, or where the plan's OPTs read BF16
    gradient tiles (:func:`widens_gradients`) the spec's ``host_optimizer_bf16_params_per_s`` over
    the node's ranks. A spec without that rate (0: written before it was measured) gets the
    memory-bound estimate of a many-core host, whose widened chunks go through DRAM: :func:`host_rate`
    x 28 / 34 (``ADAMW_WIDENED_BYTES_PER_PARAM``; a small team's chunks stay in the cache and step
    faster, which a measured rate shows). Those rates are AdamW's, and every host optimizer
    (``plan.optimizer_name``) is timed at them: Lion moves 20 bytes per parameter where AdamW
    moves 28, but its kernel (torch's element-wise ops, several passes over each cache-sized chunk,
    :class:`~megatrain.runtime.host_kernels.HostLion`) stepped at 0.8-1.1x torch's fused AdamW
    rate on this project's 2-core VM (8 Mi-parameter tiles, 1 thread, 2026-11-27), not 28/20 =
    1.4x; the spec measures no rate of its own."""
    if plan is None or not widens_gradients(plan):
        return host_rate(hw, plan)
    if hw.host_optimizer_bf16_params_per_s > 0:
        return hw.host_optimizer_bf16_params_per_s / plan.gpus_per_node
    return host_rate(hw, plan) * ADAMW_BYTES_PER_PARAM / ADAMW_WIDENED_BYTES_PER_PARAM


def cast_rate(hw: HardwareSpec, plan: Plan | None = None) -> float:
    """Elements/s of one rank's CAST (FP32 master to BF16 staging tile): the spec's
    ``host_cast_elements_per_s`` over the node's ranks (sharing its bandwidth as :func:`host_rate`
    does). A spec without it (0: written before it was measured) gets the memory-bound estimate
    from the AdamW rate, 28 / 6 (``ADAMW_BYTES_PER_PARAM`` / ``CAST_BYTES_PER_ELEMENT``)."""
    ranks = plan.gpus_per_node if plan is not None else 1
    if hw.host_cast_elements_per_s > 0:
        return hw.host_cast_elements_per_s / ranks
    return host_rate(hw, plan) * ADAMW_BYTES_PER_PARAM / CAST_BYTES_PER_ELEMENT


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


def optimizer_numel(layer: Layer, plan: Plan | None = None) -> int:
    """Trainable parameters of ``layer`` one rank's OPT updates: its shard
    (:func:`optimizer_shard`, the largest) among the ``plan.optimizer_shards`` ranks that share a
    copy, and with ``plan.host_state == "shard"`` among the ``optimizer_shards x nodes`` ranks that
    share one copy spread over the nodes (each node holds and updates ``1 / nodes``). All of them
    for one rank (``plan`` None, or one shard)."""
    if plan is None:
        return layer.trainable_numel
    ways = plan.optimizer_shards * (plan.nodes if plan.host_state == "shard" else 1)
    lo, hi = optimizer_shard(layer.trainable_numel, ways, 0)
    return hi - lo


def widens_gradients(plan: Plan) -> bool:
    """Whether the host optimizer reads BF16 gradients from a host tile, widening them chunk by chunk
    in an FP32 scratch (with per-micro-batch passes ACC widens them into the FP32 accumulator instead)."""
    return plan.gradient_dtype == "bfloat16" and not plan.accumulates_on_host


def cast_time(layer: Layer, hw: HardwareSpec, plan: Plan | None = None) -> float:
    """One host CAST of the layer's master tile into a BF16 staging tile (each rank casts the whole
    tile for its own GPU, at its share of the host's CAST rate, :func:`cast_rate`); with
    ``plan.shared_cast`` only its shard into the node's shared tile (:func:`cast_shard`, the
    largest: the last rank's, frozen parameters included)."""
    rate = cast_rate(hw, plan)
    numel = layer.numel
    if plan is not None and plan.shared_cast:
        numel = max(hi - lo for lo, hi in (cast_shard(layer.numel, layer.trainable_numel, plan, k)
                                           for k in range(plan.optimizer_shards)))
    return hw.op_latency_s + numel / rate


def acc_time(layer: Layer, hw: HardwareSpec, plan: Plan | None = None) -> float:
    """One host ACC of a micro-batch's gradients of ``layer`` into its accumulator (each rank sums
    its own micro-batches, at its share of the host bandwidth, :func:`host_rate`); a BF16 tile
    moves 2 bytes per element less than an FP32 one."""
    nbytes = ACC_BYTES_PER_ELEMENT - GRAD_ITEMSIZE + (plan.gradient_itemsize if plan is not None else GRAD_ITEMSIZE)
    rate = host_rate(hw, plan) * ADAMW_BYTES_PER_PARAM / nbytes
    return hw.op_latency_s + layer.trainable_numel / rate


def checkpoint_bytes(graph: LayerGraph, layer: int) -> int:
    """Bytes of ``layer``'s outputs that another layer reads, for one micro-batch: what an OFFLOAD
    or RELOAD moves and what offloading them keeps in pinned host memory."""
    return sum(graph.values[vid].nbytes for vid in graph.checkpoints(layer))


def offload_time(graph: LayerGraph, layer: int, hw: HardwareSpec, kind: OpKind) -> float:
    """One OFFLOAD (D2H) or RELOAD (H2D) of ``layer``'s checkpoints for one micro-batch."""
    if kind is OpKind.OFFLOAD:
        rate = _rate(hw, "d2h_bytes_per_s", hw.d2h_bytes_per_s, "OFFLOAD ops")
    else:
        rate = _rate(hw, "h2d_bytes_per_s", hw.h2d_bytes_per_s, "RELOAD ops")
    return hw.op_latency_s + checkpoint_bytes(graph, layer) / rate


_DURATION: dict[OpKind, Callable[[LayerGraph, int, Plan, HardwareSpec], float]] = {
    OpKind.H2D: lambda g, i, plan, hw: h2d_time(g.layers[i], plan, hw),
    OpKind.D2H: lambda g, i, plan, hw: d2h_time(g.layers[i], hw, plan),
    OpKind.FWD: lambda g, i, plan, hw: fwd_time(g.layers[i], plan, hw),
    OpKind.RECOMPUTE: lambda g, i, plan, hw: fwd_time(g.layers[i], plan, hw),
    # A layer with no gradient to compute (a frozen vision tower) is given no BWD: none to time.
    OpKind.BWD: lambda g, i, plan, hw: (bwd_time(g.layers[i], plan, hw)
                                        if i == len(g.layers) - 1 or g.has_gradients(i) else 0.0),
    OpKind.OFFLOAD: lambda g, i, plan, hw: offload_time(g, i, hw, OpKind.OFFLOAD),
    OpKind.RELOAD: lambda g, i, plan, hw: offload_time(g, i, hw, OpKind.RELOAD),
    OpKind.OPT: lambda g, i, plan, hw: opt_time(g.layers[i], hw, plan),
    OpKind.CAST: lambda g, i, plan, hw: cast_time(g.layers[i], hw, plan),
    OpKind.ACC: lambda g, i, plan, hw: acc_time(g.layers[i], hw, plan),
    OpKind.NVME_READ: lambda g, i, plan, hw: nvme_time(g.layers[i], hw, OpKind.NVME_READ,
                                                       nvme_bytes(g.layers[i], i in plan.nvme_masters, plan), plan),
    OpKind.NVME_WRITE: lambda g, i, plan, hw: nvme_time(g.layers[i], hw, OpKind.NVME_WRITE,
                                                        nvme_bytes(g.layers[i], i in plan.nvme_masters, plan), plan),
    OpKind.ALL_REDUCE: lambda g, i, plan, hw: all_reduce_time(g.layers[i], hw, plan),
    OpKind.REDUCE_SCATTER: lambda g, i, plan, hw: reduce_scatter_time(g.layers[i], hw, plan),
    # On a node's shared host state the gather moves no bytes: it waits for the other ranks' shards.
    # Sharded across nodes, the leader's host copies into the gather tile (the network time is the H2D's).
    OpKind.ALL_GATHER: lambda g, i, plan, hw: hw.op_latency_s + weight_gather_host_time(g.layers[i], hw, plan),
    OpKind.COUNT_REDUCE: lambda g, i, plan, hw: count_reduce_time(hw, plan),
}
"""The formula of each op kind (module docstring, "Op times"); every op time is looked up here."""


def op_duration(kind: OpKind, graph: LayerGraph, layer: int, plan: Plan, hw: HardwareSpec) -> float:
    """Seconds an op of ``kind`` on layer index ``layer`` takes on its resource under ``hw`` (one
    micro-batch; ``plan`` gives the compute dtype). The simulator (through :func:`op_time`) and the
    solver's bounds both time ops with it, so they cannot disagree on a formula.

    Raises:
        ConfigError: ``hw`` has a rate of 0 that the kind needs (a host-only spec timing GPU ops).
    """
    return _DURATION[kind](graph, layer, plan, hw)


def op_time(op: Op, graph: LayerGraph, plan: Plan, hw: HardwareSpec) -> float:
    """Seconds ``op`` takes on its resource under ``hw`` (:func:`op_duration` of its kind and layer;
    an NVMe transfer of a gradient tile, ``Op.gbuf``, moves :func:`nvme_gradient_bytes`)."""
    if op.gbuf is not None and op.kind in (OpKind.NVME_READ, OpKind.NVME_WRITE):
        return nvme_time(graph.layers[op.layer], hw, op.kind, nvme_gradient_bytes(graph.layers[op.layer], plan),
                         plan)
    return _DURATION[op.kind](graph, op.layer, plan, hw)


def op_times(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec) -> tuple[float, ...]:
    """``op_time`` of every op of ``schedule``, computed once per (layer, kind, what an NVMe op moves)."""
    cache: dict[tuple[OpKind, int, bool], float] = {}
    out = []
    for op in schedule.ops:
        key = (op.kind, op.layer, op.gbuf is not None)
        t = cache.get(key)
        if t is None:
            t = cache[key] = op_time(op, graph, schedule.plan, hw)
        out.append(t)
    return tuple(out)


# -- launches on the issuing thread ----------------------------------------------------------------

D2H_LAUNCHES = 23
"""Aten ops the executor's D2H dispatches: the slot's norm and finiteness (with every micro-batch
loss), the two flag writes and three copies (counted with ``issue.DispatchCounter``)."""

COPY_LAUNCHES = 1
"""An H2D weight copy, and each checkpoint an OFFLOAD or RELOAD copies: one ``copy_``."""

HOST_OP_LAUNCHES = 1
"""A host op costs the issuing thread one queue put; its work runs on a host worker."""


def launch_count(op: Op, graph: LayerGraph, gpu_waits: int = 0) -> int:
    """Calls the issuing thread makes for ``op``: the aten ops its work dispatches (a layer's
    ``fwd_launches`` / ``bwd_launches`` for compute ops), plus for GPU ops the event recorded after
    it and ``gpu_waits`` stream waits (its dependencies on other GPU streams)."""
    launches = OP_KINDS[op.kind].launches  # what its kind dispatches (schedule.OpKindSpec.launches)
    if launches is None:
        return HOST_OP_LAUNCHES
    if launches == "fwd":
        n = graph.layers[op.layer].fwd_launches
    elif launches == "bwd":
        n = graph.layers[op.layer].bwd_launches
    elif launches == "d2h":
        n = D2H_LAUNCHES
    elif launches == "copy":
        n = COPY_LAUNCHES
    else:  # "checkpoints"
        n = COPY_LAUNCHES * len(graph.checkpoints(op.layer))
    return n + 1 + gpu_waits


def launch_times(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec) -> tuple[float, ...]:
    """Seconds the issuing thread spends issuing each op of ``schedule`` (``launch_count`` x
    ``hw.launch_overhead_s``)."""
    ops = schedule.ops
    out = []
    for op in ops:
        waits = sum(1 for d in op.deps if ops[d].stream is not op.stream and ops[d].stream not in HOST_STREAMS)
        out.append(launch_count(op, graph, waits) * hw.launch_overhead_s)
    return tuple(out)


# -- memory ----------------------------------------------------------------------------------------

def working_bytes(layer: Layer, kind: OpKind) -> int:
    """Transient GPU bytes while a compute op of ``kind`` runs on ``layer``.

    ``work_bytes`` bounds a local backward (every intermediate its forward creates may be held for
    the backward proper). A forward under no_grad frees intermediates sooner, but the bound is
    used for both: the runtime may run the forward with grad enabled, and an over-estimate here
    costs a little batch size where an under-estimate costs an out-of-memory error.
    """
    return layer.work_bytes if kind in COMPUTE_KINDS else 0


@dataclass(frozen=True, slots=True)
class ActivationLiveness:
    """When checkpoint and boundary-gradient bytes are allocated and freed, per op of a schedule.

    Every event belongs to a compute op, and compute ops run in list order on one in-order
    stream, so GPU activation memory is a function of that order alone. Bytes in ``alloc[i]``
    are taken when op ``i`` starts and those in ``free[i]`` given back when it ends; ``work[i]``
    is held only while it runs; ``at_start`` (the batch inputs) is held from the step's start.

    Liveness, per (value, micro-batch). A checkpoint is on the GPU in generations: from the start
    of the FWD or RECOMPUTE that produces it, or from a RELOAD that copies it back, to the end of
    the last compute op that reads it before the next generation begins (a value nobody reads,
    until its producer ends). A RELOAD's bytes are counted from the start of the compute op after
    the last compute op it waits for (it cannot start earlier). A generation an OFFLOAD copies out
    stays until the compute op just before the first compute op that waits for that OFFLOAD (the
    lowering makes one wait, so the copy is known done by then), or the step's end. The gradient of
    a value that requires grad, from the start of the first consumer's local backward (which
    produces it) to the end of its producer's local backward. A batch input from the step's start
    to the end of its last reader (or the step's end). Values the last layer produces inside its
    local backward (the loss) are part of that op's working memory.

    Pools. ``reload_alloc`` and ``reload_free`` are the part of ``alloc`` and ``free`` that RELOADs
    put on the GPU: the CUDA caching allocator keeps a pool per stream and hands a block only to
    the stream that made it, so the H2D stream's reloaded checkpoints and the compute stream's
    memory never share blocks (:func:`pool_peaks`). ``alloc_n`` and ``free_n`` count the tensors
    (one per generation or gradient) behind ``alloc`` and ``free``: the allocator rounds each
    (:func:`gpu_reserve`).
    """

    at_start: int
    alloc: tuple[int, ...]
    free: tuple[int, ...]
    work: tuple[int, ...]
    reload_alloc: tuple[int, ...] = ()
    reload_free: tuple[int, ...] = ()
    alloc_n: tuple[int, ...] = ()
    free_n: tuple[int, ...] = ()


def activation_liveness(schedule: Schedule, graph: LayerGraph) -> ActivationLiveness:
    """The allocation events of checkpoints, boundary gradients and working memory. The
    generations of the checkpoints and their readers come from
    :func:`megatrain.ir.liveness.liveness`, the walk the executor frees memory by too."""
    ops = schedule.ops
    n = len(ops)
    alloc, free, work = [0] * n, [0] * n, [0] * n
    ralloc, rfree = [0] * n, [0] * n
    nalloc, nfree = [0] * n, [0] * n
    bwd: dict[tuple[int, int], int] = {}
    for i, op in enumerate(ops):
        if op.kind in COMPUTE_KINDS:
            work[i] = working_bytes(graph.layers[op.layer], op.kind)
        if op.kind is OpKind.BWD:
            bwd[(op.layer, op.mb)] = i
    at_start = 0
    for g, alloc_at, end in _generation_spans(schedule, graph):
        nbytes = graph.values[g.key[0]].nbytes
        reloaded = g.producer != BATCH and ops[g.producer].kind is OpKind.RELOAD
        if alloc_at < 0:
            at_start += nbytes
        elif alloc_at < n:
            alloc[alloc_at] += nbytes
            ralloc[alloc_at] += nbytes if reloaded else 0
            nalloc[alloc_at] += 1
        if end >= 0 and end < n and alloc_at >= 0:
            nfree[end] += 1
        if end >= 0 and end < n:
            free[end] += nbytes
            rfree[end] += nbytes if reloaded else 0
    for mb in range(schedule.plan.micro_batches):
        for v in graph.values:
            q = bwd.get((v.producer, mb))
            grads_from = [bwd[(c, mb)] for c in v.consumers if (c, mb) in bwd]
            if v.requires_grad and q is not None and grads_from:
                first = min(grads_from)
                alloc[first] += v.nbytes
                free[max(q, first)] += v.nbytes
                nalloc[first] += 1
                nfree[max(q, first)] += 1
    return ActivationLiveness(at_start, tuple(alloc), tuple(free), tuple(work), tuple(ralloc), tuple(rfree),
                              tuple(nalloc), tuple(nfree))


def _generation_spans(schedule: Schedule, graph: LayerGraph):
    """``(generation, alloc_at, end)`` for each checkpoint generation (:func:`liveness`): the compute
    op whose start it is counted from (-1: the step's start) and the op at whose end it is freed,
    by the rules of :class:`ActivationLiveness`."""
    ops = schedule.ops
    n = len(ops)
    on_gpu = [op.kind in COMPUTE_KINDS for op in ops]  # the compute stream's ops, computed once
    compute = [i for i in range(n) if on_gpu[i]]
    after = [len(ops)] * (n + 1)  # after[i]: first compute op at or after i
    for i in range(n - 1, -1, -1):
        after[i] = i if on_gpu[i] else after[i + 1]
    before = [-1] * n  # before[i]: last compute op before i
    for i in range(1, n):
        before[i] = i - 1 if on_gpu[i - 1] else before[i - 1]
    waiters: dict[int, int] = {}  # non-compute op -> first compute op that lists it as a dependency
    for i, op in enumerate(ops):
        if on_gpu[i]:
            for d in op.deps:
                if not on_gpu[d]:
                    waiters.setdefault(d, i)
    last_compute = compute[-1] if compute else -1
    for g in liveness(schedule, graph).generations:
        if g.producer == BATCH:
            alloc_at = -1
        elif ops[g.producer].kind is OpKind.RELOAD:
            waits = [d for d in ops[g.producer].deps if on_gpu[d]]
            alloc_at = after[max(waits) + 1] if waits else -1  # it cannot start earlier
        else:
            alloc_at = g.producer
        end = max((r for r in g.readers if on_gpu[r]), default=alloc_at)
        for o in g.readers:
            if not on_gpu[o]:  # an OFFLOAD: the copy is known done before its first waiter
                w = waiters.get(o)
                end = max(end, before[w] if w is not None else last_compute)
        yield g, alloc_at, end


def allocation_stream(kind: OpKind) -> Stream | None:
    """The stream whose CUDA caching-allocator pool an op of ``kind`` allocates device memory from
    while it is issued: compute ops allocate their outputs, boundary gradients and working memory on
    the compute stream, a RELOAD the checkpoints it copies back on the H2D stream; other ops
    allocate nothing a plan sizes (None)."""
    if kind in COMPUTE_KINDS:
        return Stream.COMPUTE
    return Stream.H2D if kind is OpKind.RELOAD else None


def issue_fences(schedule: Schedule, graph: LayerGraph) -> tuple[tuple[int, ...], ...]:
    """For each op of ``schedule``, the ops that must have *finished* on the device before the issuing
    thread issues it (``Schedule.issue_after``), so that the CUDA caching allocator never holds more
    than :func:`activation_liveness` counts; empty tuples for most ops, and ``()`` for a schedule that
    needs no fence.

    Why. The allocator hands out memory when an op is issued, not when it runs, and takes a block
    back when the issuing thread drops the tensor; a block another stream read
    (``Tensor.record_stream``: a checkpoint an OFFLOAD copies out on the D2H stream, one a RELOAD
    brought in on the H2D stream and compute reads) is reused only once that stream has passed the
    point where it was freed (PyTorch ``c10/cuda/CUDACachingAllocator.cpp``: ``insert_events`` when
    a block with stream uses is freed, ``process_events`` before each allocation). An issuing
    thread far ahead of the device finds every such block still taken and asks for new memory,
    however early the cost model freed it: with unbounded run-ahead a forward pass of offloaded
    checkpoints holds all of them at once.

    Rule. A checkpoint generation read on a stream ``s`` other than the one that allocated it
    (:func:`allocation_stream` of its producer: compute for a FWD or RECOMPUTE, H2D for a RELOAD)
    is dropped at its last reader ``f`` (list order, as the executor drops it) and freed by the cost
    model after op ``m``. The first op after both that allocates on the producer's stream, ``j``, is
    where the cost model first reuses the bytes, so ``j`` waits for the last op of ``s`` at or before
    ``f`` (that op's completion implies every earlier one's on the in-order stream). Later
    allocations need no wait of their own: ``j`` was issued before them. Allocations never wait for
    their own stream: the allocator reuses a block on the stream that made it in stream order.
    """
    ops = schedule.ops
    n = len(ops)
    pool = [allocation_stream(op.kind) for op in ops]
    nxt: dict[Stream, list[int]] = {}
    for s in (Stream.COMPUTE, Stream.H2D):  # nxt[s][i]: first op at or after i that allocates on stream s
        a = [n] * (n + 1)
        for i in range(n - 1, -1, -1):
            a[i] = i if pool[i] is s else a[i + 1]
        nxt[s] = a
    last: dict[Stream, list[int]] = {}  # last[s][i]: the last op of stream s at or before i (-1: none)
    for s in (Stream.COMPUTE, Stream.H2D, Stream.D2H):
        a, prev = [], -1
        for op in ops:
            prev = len(a) if op.stream is s else prev
            a.append(prev)
        last[s] = a
    after: dict[int, dict[Stream, int]] = {}
    for g, _, end in _generation_spans(schedule, graph):
        if g.producer == BATCH or not g.readers:
            continue
        home = pool[g.producer]
        f = g.readers[-1]
        j = nxt[home][max(f, end) + 1]
        if j == n:
            continue
        for s in {ops[r].stream for r in g.readers} - {home}:
            fence = after.setdefault(j, {})
            fence[s] = max(fence.get(s, -1), last[s][f])
    if not after:
        return ()  # no fences (Schedule.issue_after's "none" form)
    return tuple(tuple(sorted(after[i].values())) if i in after else () for i in range(n))


def _dynamic_peaks(schedule: Schedule, live: ActivationLiveness) -> tuple[int, int, int]:
    """(activations peak, working peak, peak of their sum) over the compute ops in stream order."""
    cur = act_peak = dyn_peak = live.at_start
    work_peak = 0
    for i, op in enumerate(schedule.ops):
        if op.stream is not Stream.COMPUTE:
            continue
        cur += live.alloc[i]
        act_peak = max(act_peak, cur)
        work_peak = max(work_peak, live.work[i])
        dyn_peak = max(dyn_peak, cur + live.work[i])
        cur -= live.free[i]
    return act_peak, work_peak, dyn_peak


def pool_peaks(schedule: Schedule, live: ActivationLiveness, working: bool = True) -> dict[Stream, int]:
    """Peak bytes of each CUDA caching-allocator pool over the compute ops in stream order, by the
    accounting of :class:`ActivationLiveness`: the compute stream's (checkpoints it computed,
    boundary gradients, batch inputs and, with ``working``, the running op's working memory) and
    the H2D stream's (checkpoints RELOADs brought back). Their sum is at least the combined
    ``dynamic_peak``; the difference is memory the per-stream pools cannot share."""
    cur = live.at_start
    reloaded = 0
    peaks = {Stream.COMPUTE: cur, Stream.H2D: 0}
    ralloc = live.reload_alloc or (0,) * len(live.alloc)
    rfree = live.reload_free or (0,) * len(live.free)
    for i, op in enumerate(schedule.ops):
        if op.stream is not Stream.COMPUTE:
            continue
        cur += live.alloc[i] - ralloc[i]
        reloaded += ralloc[i]
        peaks[Stream.COMPUTE] = max(peaks[Stream.COMPUTE], cur + (live.work[i] if working else 0))
        peaks[Stream.H2D] = max(peaks[Stream.H2D], reloaded)
        cur -= live.free[i] - rfree[i]
        reloaded -= rfree[i]
    return peaks


def page_up(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pinned pages (``HOST_PAGE_BYTES``)."""
    return -(-nbytes // HOST_PAGE_BYTES) * HOST_PAGE_BYTES


def gradient_tile_numels(graph: LayerGraph, plan: Plan) -> tuple[int, ...]:
    """Elements of each of the ``plan.grad_ring`` host gradient tiles: the widest
    ``trainable_numel`` among the layers whose D2H writes the tile (0 for a tile no D2H uses).

    With ``OptimizerPlacement.NEXT_FORWARD`` layer by layer, tile ``k`` belongs to the ``k``-th
    trainable layer (:func:`megatrain.planner.lower.gradient_tiles`) and is sized to it alone.
    Otherwise the D2Hs take the tiles in turn, in the order the local backwards run (trainable
    layers from last to first, once per pass): D2H number ``k`` of the step writes tile
    ``k % grad_ring``, as :mod:`megatrain.planner.lower` assigns them. The verifier checks that
    every D2H's layer fits its tile (rule ``budget``).
    """
    layers = graph.layers
    widths = [0] * plan.grad_ring
    if plan.optimizer is OptimizerPlacement.NEXT_FORWARD and not plan.accumulates_on_host:
        for layer, k in gradient_tiles(graph).items():
            # A layer of Plan.nvme_gradients keeps its tile on NVMe: its index stays, sized 0.
            if k < plan.grad_ring and layer not in plan.nvme_gradients:
                widths[k] = reduced_numel(layers[layer].trainable_numel, plan)
        return tuple(widths)
    backward = [i for i in range(len(layers) - 1, -1, -1) if layers[i].trainable_numel > 0]
    passes = plan.micro_batches if plan.accumulates_on_host else 1
    for k, layer in enumerate(backward * passes):
        r = k % plan.grad_ring
        widths[r] = max(widths[r], reduced_numel(layers[layer].trainable_numel, plan))
    return tuple(widths)


def gradient_ring_bytes(graph: LayerGraph, plan: Plan) -> int:
    """Pinned bytes of the host gradient tiles, ``plan.gradient_itemsize`` per element, each in whole
    pages (what ``pinned_buffers`` gives them)."""
    return sum(page_up(w * plan.gradient_itemsize) for w in gradient_tile_numels(graph, plan))


def staging_tile_numels(graph: LayerGraph, plan: Plan) -> tuple[int, ...]:
    """Elements of each BF16 staging tile: with ``plan.cast_once`` tile ``k`` is layer ``k``'s and
    sized to it; otherwise each of the ``staging_ring`` tiles is sized for the widest layer (any
    layer may be cast into any tile, and every layer is loaded at least once per step). None with
    FP32 compute, or with the host state sharded across nodes (H2D reads the gather tile:
    ``Plan.staged``)."""
    if not plan.staged:
        return ()
    if plan.cast_once:
        return tuple(layer.numel for layer in graph.layers)
    return (max(layer.numel for layer in graph.layers),) * plan.staging_ring


def shared_staging_bytes(graph: LayerGraph, plan: Plan) -> int:
    """Pinned bytes of a node's shared BF16 staging tiles (``plan.shared_cast``: one per layer, in
    whole pages, once per group of ranks sharing a host copy, not in any rank's arena); 0 without."""
    if not plan.shared_cast:
        return 0
    return sum(page_up(n * STAGING_ITEMSIZE) for n in staging_tile_numels(graph, plan))


def pinned_master_bytes(graph: LayerGraph, plan: Plan) -> int:
    """Pinned bytes of the FP32 master rows: with FP32 compute H2D reads each layer's master row
    directly, so each is pinned, rounded up to whole pages; with BF16 compute none (H2D reads the
    staging tiles)."""
    if plan.compute_dtype != "float32":
        return 0
    return sum(page_up(layer.numel * MASTER_BYTES_PER_ELEMENT) for layer in graph.layers)


PinnedKind = str
"""``"norms"``, ``"flags"``, ``"ring"``, ``"staging"``, ``"offload"`` or ``"nvme_gradients"`` (the
gradient I/O buffers of ``Plan.nvme_gradients``, :func:`nvme_gradient_buffers`)."""


@dataclass(frozen=True, slots=True)
class PinnedTile:
    """One region of the pinned arena: ``nbytes`` at byte ``offset`` (a multiple of
    ``HOST_PAGE_BYTES``). ``key`` is the tile index for ``ring`` and ``staging``, ``(value id,
    micro-batch)`` for ``offload`` (micro-batch 0 for every pass with per-micro-batch passes, which
    reuse one copy), and 0 for ``norms`` and ``flags`` (``[n_layers]`` FP32 and bool)."""

    kind: PinnedKind
    key: int | tuple[int, int]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PinnedLayout:
    """The pinned arena of one plan: its tiles in order, and its size ``nbytes`` (whole pages)."""

    tiles: tuple[PinnedTile, ...]
    nbytes: int

    def tile(self, kind: PinnedKind, key: int | tuple[int, int]) -> PinnedTile:
        """The tile ``(kind, key)``. Raises KeyError naming it when the layout has none."""
        for t in self.tiles:
            if t.kind == kind and t.key == key:
                return t
        raise KeyError(f"the pinned layout has no {kind} tile {key!r}")

    def bytes_of(self, kind: PinnedKind) -> int:
        """Bytes the tiles of ``kind`` take in the arena, page rounding included."""
        return sum(page_up(t.nbytes) for t in self.tiles if t.kind == kind)

    def covers(self, other: "PinnedLayout") -> bool:
        """Whether every tile of ``other`` has a tile of the same kind and key here at least as large."""
        have = {(t.kind, t.key): t.nbytes for t in self.tiles}
        return all(have.get((t.kind, t.key), -1) >= t.nbytes for t in other.tiles)


def pinned_buffers(graph: LayerGraph, plan: Plan, mode: str = "train") -> PinnedLayout:
    """The pinned arena a schedule of ``mode`` under ``plan`` needs besides the master rows.

    ``"train"``: per-layer norms and flags, the gradient tiles (:func:`gradient_tile_numels`), the
    staging tiles with BF16 compute, and a region per offloaded checkpoint (``graph.values[v].nbytes``
    for each value of :meth:`LayerGraph.checkpoints` of a layer whose policy is OFFLOAD, for every
    micro-batch layer by layer, once with per-micro-batch passes). ``"eval"``: the staging tiles.
    ``"update"``: the gradient tiles (and the staging tiles with ``Plan.nvme_masters``: the CAST
    after such a layer's OPT fills its tile). ``"train"`` and ``"update"`` also hold the gradient I/O
    buffers of ``Plan.nvme_gradients`` (:func:`nvme_gradient_buffers`: a D2H lands in them, so they
    are pinned). Each tile starts on a page and takes whole pages.
    """
    regions: list[tuple[PinnedKind, int | tuple[int, int], int]] = []
    n = len(graph.layers)
    if mode in ("train", "update"):
        if mode == "train":
            regions += [("norms", 0, n * NORM_ITEMSIZE), ("flags", 0, n * FLAG_ITEMSIZE)]
        regions += [("ring", r, w * plan.gradient_itemsize) for r, w in enumerate(gradient_tile_numels(graph, plan))]
        count, nbytes = nvme_gradient_buffers(graph, plan)
        regions += [("nvme_gradients", k, nbytes) for k in range(count)]
    if (mode in ("train", "eval") or (mode == "update" and plan.nvme_masters)) and not plan.shared_cast:
        # An update of a layer whose master is on NVMe casts the new master into its staging tile;
        # shared tiles are the node's (shared_staging_bytes).
        regions += [("staging", t, w * STAGING_ITEMSIZE) for t, w in enumerate(staging_tile_numels(graph, plan))]
    if mode == "train":
        copies = plan.micro_batches if plan.layer_by_layer else 1
        for p in range(n):
            if plan.activation(p) is ActivationPolicy.OFFLOAD:
                regions += [("offload", (vid, mb), graph.values[vid].nbytes)
                            for mb in range(copies) for vid in graph.checkpoints(p)]
    tiles, offset = [], 0
    for kind, key, nbytes in regions:
        tiles.append(PinnedTile(kind, key, offset, nbytes))
        offset += page_up(nbytes)
    return PinnedLayout(tuple(tiles), offset)


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes a plan holds, by purpose, as a CLI prints them (``rows()``, ``format()``).

    Host: ``master_weights`` (FP32) and ``adam_moments`` (the FP32 state rows of the plan's
    optimizer, ``optimizer_name``: AdamW's two moments, Lion's one, :func:`state_bytes_per_param`)
    persist; the gradient
    and staging rings, the offloaded-checkpoint space and the per-layer norms and flags
    (``pinned_norms``) are pinned, each in whole pages (:func:`pinned_buffers`);
    ``gradient_accumulators`` (per-micro-batch passes only) and ``gradient_scratch`` (the FP32
    widening of BF16 gradients for the optimizer, :func:`widens_gradients`) are pageable.
    ``adam_moments`` counts the layers whose moments are in host memory only: those of
    ``Plan.nvme_moments`` live in their NVMe files and pass through the pageable I/O buffers
    (``nvme_buffers``, :func:`nvme_buffers`); likewise ``master_weights`` leaves out the masters of
    ``Plan.nvme_masters`` (their layers' staging tiles, in ``staging_ring``, hold the BF16 copy
    H2D reads). ``state_pinned`` is true
    when the master rows must be pinned too (``pinned_masters`` bytes, :func:`pinned_master_bytes`):
    with FP32 compute the H2D reads the master row directly, and a DMA needs page-locked memory.
    The moments are never pinned. ``host_pinned`` is the bytes the runtime page-locks, exactly.

    GPU: ``weight_slots``, ``gradient_slots``, ``buffers`` and ``reserve`` are allocated for the
    whole step; ``activations_peak`` (checkpoints, boundary gradients, batch inputs) and
    ``working_peak`` (the running compute op's transients) vary, and ``dynamic_peak`` is the peak
    of their sum at one instant, at most the sum of the two peaks.
    """

    master_weights: int
    adam_moments: int
    gradient_ring: int
    staging_ring: int
    pinned_activations: int
    state_pinned: bool
    pinned_masters: int
    pinned_norms: int
    gradient_accumulators: int
    weight_slots: int
    gradient_slots: int
    buffers: int
    activations_peak: int
    working_peak: int
    dynamic_peak: int
    reserve: int
    gradient_scratch: int = 0
    nvme_buffers: int = 0
    nvme_gradient_buffers: int = 0
    shared_staging: int = 0
    reserve_parts: GpuReserve | None = None
    optimizer_name: str = "adamw"

    @property
    def host_total(self) -> int:
        return (self.master_weights + self.adam_moments + self.gradient_ring + self.staging_ring
                + self.pinned_activations + self.pinned_norms + self.gradient_accumulators
                + self.gradient_scratch + self.nvme_buffers + self.nvme_gradient_buffers + self.shared_staging)

    @property
    def host_pinned(self) -> int:
        return (self.pinned_masters + self.gradient_ring + self.staging_ring + self.pinned_activations
                + self.pinned_norms + self.nvme_gradient_buffers + self.shared_staging)

    @property
    def gpu_fixed(self) -> int:
        """GPU bytes allocated for the whole step."""
        return self.weight_slots + self.gradient_slots + self.buffers + self.reserve

    @property
    def gpu_peak(self) -> int:
        return self.gpu_fixed + self.dynamic_peak

    def budgets(self, hw: HardwareSpec) -> tuple[tuple[str, int, int], ...]:
        """``(what, bytes needed, bytes hw has)`` for each limit a plan must stay within: GPU memory
        at the step's peak, pinned host memory against ``hw``'s cap, and host memory in total.
        The one definition of "fits" (:meth:`fits`, :meth:`host_fits`, the verifier's budget rule)."""
        return (("GPU memory", self.gpu_peak, hw.gpu_memory_bytes),
                ("pinned host memory", self.host_pinned, hw.pinned_memory_cap_bytes),
                ("host memory", self.host_total, hw.host_memory_bytes))

    def fits(self, hw: HardwareSpec) -> bool:
        """Whether every budget (:meth:`budgets`) holds on ``hw``."""
        return all(need <= have for _, need, have in self.budgets(hw))

    def host_fits(self, hw: HardwareSpec) -> bool:
        """Whether the host budgets hold on ``hw`` (host memory and its pinned cap), GPU aside."""
        return all(need <= have for what, need, have in self.budgets(hw) if what != "GPU memory")

    def _moments_label(self) -> str:
        spec = OPTIMIZERS[self.optimizer_name]
        return f"{spec.label} moments (FP32 x{len(spec.states)})"

    def rows(self) -> list[tuple[str, str, int]]:
        """``(where, what, bytes)`` rows for a table, totals last in each section."""
        return [
            ("host", "FP32 master weights", self.master_weights),
            ("host", self._moments_label(), self.adam_moments),
            ("host", "gradient ring (pinned)", self.gradient_ring),
            ("host", "BF16 staging ring (pinned)", self.staging_ring),
            ("host", "offloaded checkpoints (pinned)", self.pinned_activations),
            ("host", "FP32 master rows (pinned)", self.pinned_masters),
            ("host", "gradient norms and flags (pinned)", self.pinned_norms),
            ("host", "gradient accumulators (FP32)", self.gradient_accumulators),
            ("host", "gradient widening scratch (FP32)", self.gradient_scratch),
            ("host", f"NVMe I/O buffers ({OPTIMIZERS[self.optimizer_name].label} moments)", self.nvme_buffers),
            ("host", "NVMe I/O buffers (gradient tiles, pinned)", self.nvme_gradient_buffers),
            ("host", "BF16 staging tiles shared by the node (pinned)", self.shared_staging),
            ("host", "total", self.host_total),
            ("host", "of which pinned", self.host_pinned),
            ("gpu", "weight slots", self.weight_slots),
            ("gpu", "gradient slots", self.gradient_slots),
            ("gpu", "buffers", self.buffers),
            ("gpu", "checkpoints + boundary grads (peak)", self.activations_peak),
            ("gpu", "working memory (peak)", self.working_peak),
            ("gpu", "reserve: CUDA context, workspaces, allocator", self.reserve),
            ("gpu", "peak", self.gpu_peak),
        ]

    def format(self) -> str:
        """The rows as an aligned text table with binary units."""
        width = max(len(what) for _, what, _ in self.rows())
        return "\n".join(f"{where:<5} {what:<{width}} {human_bytes(b):>10}"
                         for where, what, b in self.rows())


ROUND_LARGE_BYTES = 2 * MiB
"""The CUDA caching allocator rounds a block over 1 MiB it takes from the driver up to 2 MiB
(``kRoundLarge``), and hands out a cached block up to 1 MiB larger than asked rather than split
it (``kSmallSize``), so each tensor of a plan wastes less than this (PyTorch
``c10/cuda/CUDACachingAllocator.cpp``, constants in ``c10/core/AllocatorConfig.h``)."""

SEGMENT_BYTES = 20 * MiB + 2 * MiB
"""What one stream's pools can hold beyond their tensors at the segment level: requests of 1 to 10
MiB are served from 20 MiB segments (``kLargeBuffer``, ``kMinLargeAlloc``) and those up to 1 MiB from
2 MiB ones (``kSmallBuffer``); one partly used segment of each per stream (same source)."""

ALLOCATING_STREAMS = 3
"""Streams whose ops allocate from the caching allocator, each a pool of its own: compute (outputs,
gradients, working memory), H2D (reloaded checkpoints), D2H (gradient norms)."""

SLOT_TENSORS = 2
"""Device tensors per weight slot: the weights and the gradients (:class:`GpuReserve` rounds each)."""

CUBLAS_HANDLES = 2
"""cuBLAS handles that run GEMMs on the compute stream, each with its own workspace (PyTorch keys
workspaces by (handle, stream) and hands each thread its own handle): the issuing thread's (forward
and recompute) and the autograd engine's device thread's (the backward's GEMMs). No other stream
runs a GEMM."""


@dataclass(frozen=True, slots=True)
class GpuReserve:
    """GPU bytes a step needs beyond the plan's own tensors (``MemoryBreakdown.reserve``), by cause.

    ``context``: the CUDA context and loaded kernel modules (``hw.cuda_context_bytes``);
    ``workspaces``: :data:`CUBLAS_HANDLES` cuBLAS/cuBLASLt workspaces (``hw.cublas_workspace_bytes``);
    ``rounding``: the caching allocator's rounding, :data:`ROUND_LARGE_BYTES` per tensor alive at the
    step's busiest instant (``tensors``: slots, buffers, checkpoints, boundary gradients, and the
    running op's intermediates, at most one per aten op it dispatches) plus :data:`SEGMENT_BYTES`
    per :data:`ALLOCATING_STREAMS`; ``pools``: what per-stream pools cannot share (:func:`pool_peaks`:
    their peaks' sum less the combined dynamic peak; 0 without RELOADs). Attention's own buffers
    (the FlashAttention-2 backward's FP32 dq accumulator and softmax sums) are part of each layer's
    working memory (``Layer.work_bytes``), not of this. ``measured``: the spec's
    ``gpu_reserve_bytes`` (a measured figure), which replaces the sum when given.
    """

    context: int
    workspaces: int
    tensors: int
    pools: int
    measured: int | None = None

    @property
    def rounding(self) -> int:
        """:data:`ROUND_LARGE_BYTES` per tensor of ``tensors`` plus :data:`SEGMENT_BYTES` per stream."""
        return ROUND_LARGE_BYTES * self.tensors + SEGMENT_BYTES * ALLOCATING_STREAMS

    @property
    def derived(self) -> int:
        return self.context + self.workspaces + self.rounding + self.pools

    def with_slots(self, extra: int) -> "GpuReserve":
        """The reserve with ``extra`` more weight slots (a weight and a gradient tensor each)."""
        return dataclasses.replace(self, tensors=self.tensors + SLOT_TENSORS * extra)

    @property
    def total(self) -> int:
        return self.measured if self.measured is not None else self.derived

    def describe(self) -> str:
        """One line: the parts (or that the spec's measured figure is used), binary units."""
        if self.measured is not None:
            return f"measured (HardwareSpec.gpu_reserve_bytes); derived would be {human_bytes(self.derived)}"
        return (f"context {human_bytes(self.context)} + cuBLAS workspaces {human_bytes(self.workspaces)} + "
                f"allocator rounding {human_bytes(self.rounding)} + per-stream pools {human_bytes(self.pools)}")


def gpu_reserve(graph: LayerGraph, plan: Plan, schedule: Schedule, hw: HardwareSpec | None = None,
                live: ActivationLiveness | None = None) -> GpuReserve:
    """The GPU reserve of running ``schedule`` (see :class:`GpuReserve`); ``hw`` gives the context and
    workspace sizes (their defaults, :data:`~megatrain.ir.hardware.CUDA_CONTEXT_BYTES` and
    :data:`~megatrain.ir.hardware.CUBLAS_WORKSPACE_BYTES`, without it) or a measured reserve."""
    live = live if live is not None else activation_liveness(schedule, graph)
    layers = graph.layers
    # Tensors alive at once: the slots (weights and gradients), the layers' buffers, the batch
    # inputs, and at each compute op the checkpoints and gradients alive plus its intermediates.
    fixed = SLOT_TENSORS * weight_slot_count(plan) + sum(len(layer.buffers) for layer in layers) + 2
    cur = len(graph.batch_inputs) * plan.micro_batches
    most = cur
    for i, op in enumerate(schedule.ops):
        if op.kind not in COMPUTE_KINDS:
            continue
        cur += live.alloc_n[i] if live.alloc_n else 0
        layer = layers[op.layer]
        most = max(most, cur + (layer.bwd_launches if op.kind is OpKind.BWD else layer.fwd_launches))
        cur -= live.free_n[i] if live.free_n else 0
    _, _, dyn = _dynamic_peaks(schedule, live)
    return GpuReserve(
        context=hw.cuda_context_bytes if hw is not None else CUDA_CONTEXT_BYTES,
        workspaces=CUBLAS_HANDLES * (hw.cublas_workspace_bytes if hw is not None else CUBLAS_WORKSPACE_BYTES),
        tensors=fixed + most,
        pools=max(0, sum(pool_peaks(schedule, live).values()) - dyn),
        measured=hw.gpu_reserve_bytes if hw is not None else None)


def weight_slot_count(plan: Plan) -> int:
    """Streaming slots plus one slot per resident layer."""
    return plan.slots + len(plan.resident)


def slot_numels(graph: LayerGraph, slots: int,
                resident: frozenset[int] | set[int] = frozenset()) -> tuple[tuple[int, int], ...]:
    """``(numel, trainable_numel)`` of each GPU slot, in slot order: ``slots`` streaming slots sized
    for the widest layer not in ``resident`` (only those stream through them), then one slot per
    resident layer, ascending, sized for that layer (the lowering's slot numbering)."""
    layers = graph.layers
    streamed = [layer for i, layer in enumerate(layers) if i not in resident]
    width = max((layer.numel for layer in streamed), default=0)
    gwidth = max((layer.trainable_numel for layer in streamed), default=0)
    own = [(layers[r].numel, layers[r].trainable_numel) for r in sorted(resident)]
    return tuple([(width, gwidth)] * slots + own)


def slot_bytes(graph: LayerGraph, slots: int, resident: frozenset[int] | set[int],
               compute_itemsize: int, gradient_itemsize: int = GRAD_ITEMSIZE) -> tuple[int, int]:
    """GPU bytes of the weight slots (compute dtype) and of the gradient slots (``gradient_itemsize``:
    the plan's :attr:`Plan.gradient_itemsize`, FP32 by default) of :func:`slot_numels`."""
    sizes = slot_numels(graph, slots, resident)
    return (sum(w for w, _ in sizes) * compute_itemsize, sum(g for _, g in sizes) * gradient_itemsize)


def memory_breakdown(graph: LayerGraph, plan: Plan, hw: HardwareSpec | None = None,
                     schedule: Schedule | None = None) -> MemoryBreakdown:
    """Host and GPU bytes of running ``graph`` under ``plan``.

    The activation peaks depend on the order of the compute ops, which ``schedule`` gives; when
    it is None the plan is lowered here (``lower(graph, plan)``, which raises PlanError for what
    lowering does not implement). ``hw`` supplies the sizes the GPU reserve is derived from, or a
    measured reserve (:func:`gpu_reserve`); without it the defaults are used.
    """
    if schedule is None:
        from megatrain.planner.lower import lower

        schedule = lower(graph, plan)
    layers = graph.layers
    weight_slots, gradient_slots = slot_bytes(graph, plan.slots, plan.resident, plan.compute_itemsize,
                                              plan.gradient_itemsize)
    pinned = pinned_buffers(graph, plan, "train")
    live = activation_liveness(schedule, graph)
    act, work, dyn = _dynamic_peaks(schedule, live)
    reserve = gpu_reserve(graph, plan, schedule, hw, live)
    bf16 = plan.compute_dtype == "bfloat16"
    return MemoryBreakdown(
        master_weights=sum(layer.numel for i, layer in enumerate(layers)
                           if i not in plan.nvme_masters) * MASTER_BYTES_PER_ELEMENT,
        adam_moments=sum(layer.trainable_numel for i, layer in enumerate(layers)
                         if i not in plan.nvme_moments) * state_bytes_per_param(plan),
        optimizer_name=plan.optimizer_name,
        gradient_ring=pinned.bytes_of("ring"),
        staging_ring=pinned.bytes_of("staging"),
        pinned_activations=pinned.bytes_of("offload"),
        state_pinned=not bf16,
        pinned_masters=pinned_master_bytes(graph, plan),
        pinned_norms=pinned.bytes_of("norms") + pinned.bytes_of("flags"),
        gradient_accumulators=(sum(reduced_numel(layer.trainable_numel, plan) for layer in layers) * GRAD_ITEMSIZE
                               if plan.accumulates_on_host else 0),
        weight_slots=weight_slots,
        gradient_slots=gradient_slots,
        buffers=sum(layer.buffer_bytes for layer in layers),
        activations_peak=act,
        working_peak=work,
        dynamic_peak=dyn,
        reserve=reserve.total,
        reserve_parts=reserve,
        gradient_scratch=gradient_scratch_numel(graph, plan, host_worker_threads(hw.host_cores, plan.gpus_per_node)
                                                if hw is not None and hw.host_cores else 1) * GRAD_ITEMSIZE,
        nvme_buffers=math.prod(nvme_buffers(graph, plan)),
        nvme_gradient_buffers=pinned.bytes_of("nvme_gradients"),
        shared_staging=shared_staging_bytes(graph, plan),
    )


def gradient_scratch_numel(graph: LayerGraph, plan: Plan, threads: int = 1) -> int:
    """FP32 elements of the host scratch an OPT widens BF16 gradients into, a chunk at a time, on a
    team of ``threads`` (:data:`OPT_CHUNK_ELEMENTS` per thread, fewer for narrower layers) when
    :func:`widens_gradients`, else 0. One suffices: OPTs run one at a time, in order, on the host
    stream. (:func:`memory_breakdown` counts the team of :func:`host_worker_threads` of the spec's
    ``host_cores``, one thread where it has none. DeepSpeed's kernel also divides a clipped update's
    FP32 gradients by the clip scale in such a scratch, which this does not count.)"""
    if not widens_gradients(plan):
        return 0
    return min(OPT_CHUNK_ELEMENTS * threads, max((layer.trainable_numel for layer in graph.layers), default=0))


# -- FLOPs and MFU ---------------------------------------------------------------------------------

def tokens_per_step(graph: LayerGraph, plan: Plan) -> int:
    return graph.tokens_per_micro_batch * plan.micro_batches


def model_flops_per_token(graph: LayerGraph) -> float:
    """Model FLOPs of one training token: 3 x the forward FLOPs (forward + 2x for the backward)."""
    fwd = sum(layer.fwd_flops for layer in graph.layers)
    return (1 + BACKWARD_TO_FORWARD_FLOPS) * fwd / graph.tokens_per_micro_batch


def flops_per_step(graph: LayerGraph, plan: Plan, mode: str = "train") -> float:
    """Model FLOPs of one step (recompute not counted); ``mode="eval"`` counts forwards only."""
    fwd = sum(layer.fwd_flops for layer in graph.layers) * plan.micro_batches
    return fwd * (1 + BACKWARD_TO_FORWARD_FLOPS) if mode == "train" else float(fwd)


def mfu(model_flops: float, step_time_s: float, compute_dtype: str, hw: HardwareSpec) -> float:
    """Model FLOPs utilisation: model FLOPs / step time / the peak matmul rate of the dtype.

    0 when either the step time or the peak is 0 (a host-only spec has no peak).
    """
    peak = hw.peak_flops(compute_dtype)
    if step_time_s <= 0 or peak <= 0:
        return 0.0
    return model_flops / step_time_s / peak


__all__ = [
    "Resource", "resource_of", "compute_rate", "h2d_bytes", "d2h_bytes", "h2d_time", "d2h_time",
    "fwd_time", "bwd_time", "opt_time", "cast_time", "acc_time", "checkpoint_bytes", "offload_time", "op_duration",
    "op_time", "op_times",
    "launch_count", "launch_times", "working_bytes", "ActivationLiveness",
    "activation_liveness", "allocation_stream", "issue_fences", "pool_peaks", "GpuReserve", "gpu_reserve",
    "ROUND_LARGE_BYTES", "SEGMENT_BYTES", "ALLOCATING_STREAMS", "CUBLAS_HANDLES", "SLOT_TENSORS",
    "MemoryBreakdown", "weight_slot_count", "slot_numels", "slot_bytes", "memory_breakdown",
    "HOST_PAGE_BYTES",
    "page_up", "state_bytes_per_param",
    "gradient_tile_numels", "staging_tile_numels", "pinned_master_bytes", "PinnedTile", "PinnedLayout",
    "pinned_buffers", "gradient_ring_bytes", "widens_gradients", "gradient_scratch_numel",
    "tokens_per_step", "model_flops_per_token", "flops_per_step", "mfu", "all_reduce_time", "reduce_scatter_time", "reduced_numel", "optimizer_shard",
    "node_slice", "cast_shard", "shared_staging_bytes",
    "NVME_BUFFERS", "nvme_buffers", "nvme_gradient_buffers", "nvme_gradient_bytes",
    "host_rate", "optimizer_rate", "cast_rate", "host_worker_threads", "OPT_CHUNK_ELEMENTS", "optimizer_numel", "weight_gather_bytes", "weight_gather_time", "weight_gather_host_time", "gather_scratch_bytes", "GATHER_BUFFERS", "gather_buffer_bytes",
    "NodeMemory", "node_memory", "rank_host_budgets", "persistent_state_bytes",
]


def nvme_bytes(layer: Layer, masters: bool = False, plan: Plan | None = None) -> int:
    """Bytes an NVME_READ or NVME_WRITE of ``layer`` moves on one rank: its FP32 optimizer state
    (:func:`state_bytes_per_param`, AdamW's two moments: 8 bytes per trainable parameter; under
    ``plan``'s data parallel, of the part one rank steps,
    :func:`optimizer_numel`: each rank's file holds its optimizer shard, the whole tile where each
    rank steps a copy of its own) and, with ``masters`` (``Plan.nvme_masters``: one file holds
    both), its FP32 master before them (4 bytes per parameter, frozen ones included), padded to the
    4096-byte O_DIRECT alignment (``runtime.nvme.ALIGN``)."""
    nbytes = (optimizer_numel(layer, plan) * state_bytes_per_param(plan)
              + (layer.numel * MASTER_BYTES_PER_ELEMENT if masters else 0))
    return -(-nbytes // 4096) * 4096


NVME_BUFFERS = 2
"""Host I/O buffers of the NVMe tier's gradient pool, and the default of the moments' pool
(``Plan.nvme_buffers``): one being read or written while the OPT uses the other (the lowering's
read-ahead, ``lower.add_nvme_io``, hands them out in turn)."""


def nvme_buffers(graph: LayerGraph, plan: Plan) -> tuple[int, int]:
    """``(count, bytes each)`` of the host I/O buffers the moments of ``plan.nvme_moments`` (and the
    masters of ``plan.nvme_masters``) pass through: ``plan.nvme_buffers``, or one per NVMe layer
    when there are fewer (the lowering's ``Op.buf`` indices are below it), each :func:`nvme_bytes`
    of the widest NVMe layer's file (whole 4096-byte blocks: the runtime reads and writes them with
    ``O_DIRECT``). ``(0, 0)`` without NVMe layers. Pageable: nothing in them goes to the GPU (a
    master's BF16 copy is cast into its pinned staging tile first)."""
    if not plan.nvme_moments:
        return 0, 0
    return (min(plan.nvme_buffers, len(plan.nvme_moments)),
            max(nvme_bytes(graph.layers[i], i in plan.nvme_masters, plan) for i in plan.nvme_moments))


def nvme_gradient_bytes(layer: Layer, plan: Plan) -> int:
    """Bytes an NVME_READ or NVME_WRITE of ``layer``'s gradient tile moves (``Op.gbuf``): its
    trainable gradients in ``plan.gradient_dtype`` (4 or 2 bytes each), padded to 4096 bytes."""
    return -(-layer.trainable_numel * plan.gradient_itemsize // 4096) * 4096


def nvme_gradient_buffers(graph: LayerGraph, plan: Plan) -> tuple[int, int]:
    """``(count, bytes each)`` of the pinned gradient I/O buffers of ``plan.nvme_gradients``
    (``Op.gbuf`` indexes them): :data:`NVME_BUFFERS`, or one per such layer when there are fewer,
    each :func:`nvme_gradient_bytes` of the widest such layer. The D2Hs of those layers land in
    them in turn (each waits for the NVME_WRITE that emptied its buffer) and the next step's
    NVME_READs fill them for the carried OPTs (``lower.add_nvme_io``). ``(0, 0)`` without such
    layers. Pinned (a D2H writes them by DMA), in the arena (:func:`pinned_buffers`)."""
    if not plan.nvme_gradients:
        return 0, 0
    return (min(NVME_BUFFERS, len(plan.nvme_gradients)),
            max(nvme_gradient_bytes(graph.layers[i], plan) for i in plan.nvme_gradients))


def nvme_time(layer: Layer, hw: HardwareSpec, kind: OpKind, nbytes: int | None = None,
              plan: Plan | None = None) -> float:
    """Seconds an NVME_READ or NVME_WRITE of ``layer`` takes on the NVMe tier: ``nbytes`` (default
    :func:`nvme_bytes`, the moments; a gradient tile's is :func:`nvme_gradient_bytes`) over
    ``hw.nvme_read_bytes_per_s`` / ``nvme_write_bytes_per_s`` shared by ``plan.gpus_per_node``
    ranks (the spec's rate is the node's drives'; its ranks run the same schedule at once, each
    moving its own files: an equal share each, as :func:`host_rate` shares the host's memory
    bandwidth), plus the op latency.

    Raises:
        ConfigError: ``hw`` has no NVMe rate (attach an array: ``planner.nvme.with_nvme``).
    """
    if kind is OpKind.NVME_READ:
        rate = _rate(hw, "nvme_read_bytes_per_s", hw.nvme_read_bytes_per_s, "an NVMe read")
    else:
        rate = _rate(hw, "nvme_write_bytes_per_s", hw.nvme_write_bytes_per_s, "an NVMe write")
    share = plan.gpus_per_node if plan is not None else 1
    return (nvme_bytes(layer, plan=plan) if nbytes is None else nbytes) * share / rate + hw.op_latency_s


def _intra_rate(hw: HardwareSpec, what: str) -> float:
    rate = hw.intra_node_bus_bytes_per_s
    if rate <= 0:
        raise ConfigError(f"HardwareSpec {hw.name!r} has intra_node_bytes_per_s=0 and allreduce_bytes_per_s=0, so "
                          f"it cannot time {what} among the GPUs of a node; attach an interconnect "
                          "(megatrain.planner.topology.with_topology(hw, interconnect='nvlink4'), or "
                          "megatrain plan --interconnect) or set intra_node_bytes_per_s")
    return rate


def _network_rate(hw: HardwareSpec, what: str) -> float:
    if hw.network_bytes_per_s <= 0:
        raise ConfigError(f"HardwareSpec {hw.name!r} has network_bytes_per_s=0, so it cannot time {what} "
                          "between nodes; attach a network (megatrain.planner.topology.with_topology(hw, "
                          "network='ndr-8x400g'), or megatrain plan --network) or set network_bytes_per_s")
    return hw.network_bytes_per_s


def all_reduce_time(layer: Layer, hw: HardwareSpec, plan: Plan) -> float:
    """Seconds an ALL_REDUCE of ``layer``'s FP32 step gradients (``B`` = 4 bytes per trainable
    parameter) takes over ``plan.data_parallel`` = ``G`` GPUs per node x ``M`` nodes, as a
    hierarchical ring all-reduce: a reduce-scatter among the node's GPUs, an all-reduce of each
    GPU's ``B / G`` slice between the nodes (the ``G`` slices in parallel, over the node's NICs
    together), an all-gather among the node's GPUs::

        2 (G-1)/G x B / intra  +  2 (M-1)/M x B / network  +  2 (G-1) a_intra + 2 (M-1) a_net + op latency

    ``intra`` is ``hw.intra_node_bus_bytes_per_s`` (NCCL's busbw: a ring reduce-scatter or
    all-gather of ``B`` over ``G`` ranks moves ``(G-1)/G x B`` through each rank's link), ``network``
    ``hw.network_bytes_per_s`` (the node's: ``G`` slices of ``B/G`` share it, so the slice size and
    the per-GPU share cancel), ``a_*`` the per-step latencies. Sources: the ring all-reduce is
    bandwidth-optimal at ``2 (N-1)/N`` of the bytes per rank (Patarasuk & Yuan, "Bandwidth optimal
    all-reduce algorithms for clusters of workstations", JPDC 2009); reduce-scatter + all-reduce +
    all-gather is the hierarchical composition of Thakur, Rabenseifner & Gropp, "Optimization of
    collective communication operations in MPICH" (IJHPCA 2005, section 4), which NCCL's ring and
    tree algorithms follow across nodes; the busbw convention is nccl-tests' doc/PERFORMANCE.md.
    With ``M = 1`` it is the flat ring of ``G`` ranks; 0 for one rank.

    Raises:
        ConfigError: ``G > 1`` and ``hw`` has no intra-node bandwidth, or ``M > 1`` and no network
            bandwidth.
    """
    return _all_reduce_seconds(layer.trainable_numel * GRAD_ITEMSIZE, hw, plan)


COUNT_BYTES = 8
"""Bytes a COUNT_REDUCE sums over the ranks: one int64 count of supervised tokens."""


def count_reduce_time(hw: HardwareSpec, plan: Plan) -> float:
    """Seconds a COUNT_REDUCE takes: the ring all-reduce of :func:`all_reduce_time` over
    :data:`COUNT_BYTES` (latency-bound: its per-step latencies and the op latency); 0 for one rank."""
    return _all_reduce_seconds(COUNT_BYTES, hw, plan)


def _all_reduce_seconds(nbytes: int, hw: HardwareSpec, plan: Plan) -> float:
    if plan.data_parallel == 1:
        return 0.0
    g, m = plan.gpus_per_node, plan.nodes
    t = hw.op_latency_s
    if g > 1:
        t += 2 * (g - 1) / g * nbytes / _intra_rate(hw, "a data-parallel all-reduce") + 2 * (g - 1) * hw.intra_node_latency_s
    if m > 1:
        t += 2 * (m - 1) / m * nbytes / _network_rate(hw, "a data-parallel all-reduce") + 2 * (m - 1) * hw.network_latency_s
    return t


def reduce_scatter_time(layer: Layer, hw: HardwareSpec, plan: Plan) -> float:
    """Seconds a REDUCE_SCATTER of ``layer``'s FP32 step gradients (``B`` = 4 bytes per trainable
    parameter) takes over the ``G = plan.data_parallel`` ranks of one node, or with a state sharded
    across ``M`` nodes (``host_state == "shard"``) over ``G`` GPUs per node x ``M`` nodes (the
    lowering uses it only there: ``Plan.gradient_reduction``), as a ring reduce-scatter: the first
    half of the (hierarchical) ring all-reduce of :func:`all_reduce_time`, so half its bytes and
    steps::

        (G-1)/G x B / intra  +  (G-1) a_intra  +  (M-1)/M x B / network  +  (M-1) a_net  +  op latency

    with ``intra`` = ``hw.intra_node_bus_bytes_per_s`` (nccl-tests' busbw convention,
    doc/PERFORMANCE.md: a reduce-scatter moves ``(G-1)/G x B`` through each rank's link) and
    ``a_intra`` = ``hw.intra_node_latency_s`` per ring step. Sources as :func:`all_reduce_time`'s
    (Patarasuk & Yuan, JPDC 2009; Thakur, Rabenseifner & Gropp, IJHPCA 2005). The padding of the
    tile to equal shards (fewer than ``G x 16`` elements, :func:`optimizer_shard`) is left out.
    0 for one rank.

    Raises:
        ConfigError: ``G > 1`` and ``hw`` has no intra-node bandwidth, ``M > 1`` and no network
            bandwidth, or ``plan.nodes > 1`` with a replicated state (a reduce-scatter over several
            nodes would not give each node's copy the whole tile).
    """
    if plan.data_parallel == 1:
        return 0.0
    if plan.nodes > 1 and plan.host_state != "shard":
        raise ConfigError(f"a reduce-scatter of the gradients over {plan.nodes} nodes: each node's host copy needs "
                          "the whole reduced tile; time an all-reduce (all_reduce_time) instead")
    g, m = plan.gpus_per_node, plan.nodes
    nbytes = layer.trainable_numel * GRAD_ITEMSIZE
    t = hw.op_latency_s
    if g > 1:
        t += (g - 1) / g * nbytes / _intra_rate(hw, "a data-parallel reduce-scatter") + (g - 1) * hw.intra_node_latency_s
    if m > 1:
        t += (m - 1) / m * nbytes / _network_rate(hw, "a data-parallel reduce-scatter") + (m - 1) * hw.network_latency_s
    return t


def weight_gather_bytes(layer: Layer, plan: Plan) -> int:
    """Bytes of ``layer``'s weights a node receives in one all-gather when the host state is sharded:
    the other nodes' ``(M-1)/M`` of the tile, in the compute dtype (each node casts its own slice
    before sending it), rounded up. 0 unless ``plan.host_state == "shard"``."""
    if plan.host_state != "shard":
        return 0
    m = plan.nodes
    return -(-(m - 1) * layer.numel * plan.compute_itemsize // m)


def weight_gather_time(layer: Layer, hw: HardwareSpec, plan: Plan) -> float:
    """Seconds of a ring all-gather of ``layer``'s weights across the ``plan.nodes`` nodes (ZeRO-3
    style, Rajbhandari et al. 2020, arXiv:1910.02054): each node receives :func:`weight_gather_bytes`
    over ``hw.network_bytes_per_s`` in ``M - 1`` steps of ``hw.network_latency_s`` (the ring
    all-gather, Thakur et al. 2005; one gather per node serves its ``G`` GPUs). 0 unless
    ``plan.host_state == "shard"``.

    Raises:
        ConfigError: the plan shards and ``hw`` has no network bandwidth.
    """
    if plan.host_state != "shard":
        return 0.0
    rate = _network_rate(hw, "the all-gather of sharded weights")
    return weight_gather_bytes(layer, plan) / rate + (plan.nodes - 1) * hw.network_latency_s


def weight_gather_host_time(layer: Layer, hw: HardwareSpec, plan: Plan) -> float:
    """Host seconds of one rank's copies in one weight gather (``runtime.distributed.gather_weights``)
    when the host state is sharded: the node's ranks cast their shares of the node's slice
    (:func:`node_slice`, the largest) from the FP32 masters into the compute dtype (4 + itemsize
    bytes per element), then copy their shares of every node's part into the gather tile (2 x
    itemsize bytes per element of the layer): ``1 / G`` of those bytes each, at one rank's share
    of the host bandwidth (:func:`host_rate`). 0 unless ``plan.host_state == "shard"``. With BF16
    this is the only cast of the layer on the node (``Plan.staged`` is False: the H2Ds read the
    gather tile)."""
    if plan.host_state != "shard":
        return 0.0
    item = plan.compute_itemsize
    sliced = max(hi - lo for lo, hi in (node_slice(layer.numel, layer.trainable_numel, plan, n)
                                        for n in range(plan.nodes)))
    nbytes = sliced * (MASTER_BYTES_PER_ELEMENT + item) + layer.numel * 2 * item
    return nbytes / plan.optimizer_shards / (host_rate(hw, plan) * ADAMW_BYTES_PER_PARAM)


def gather_scratch_bytes(graph: LayerGraph, plan: Plan) -> int:
    """Bytes of a node's weight-gather scratch (pageable, shared by its ranks): a send buffer of the
    longest node slice and a receive buffer of ``nodes`` of them, in the compute dtype, for the
    widest layer, in whole pages (``runtime.distributed.gather_weights``); 0 unless
    ``plan.host_state == "shard"``."""
    if plan.host_state != "shard":
        return 0
    chunk = max((hi - lo for layer in graph.layers for lo, hi in (node_slice(layer.numel, layer.trainable_numel,
                                                                             plan, n) for n in range(plan.nodes))),
                default=0)
    return page_up((plan.nodes + 1) * chunk * plan.compute_itemsize)


GATHER_BUFFERS = 2
"""Pinned host tiles per node that sharded weights are all-gathered into (host_state "shard"): one
being received while the GPUs copy from the other."""


def gather_buffer_bytes(graph: LayerGraph, plan: Plan) -> int:
    """Pinned bytes of a node's :data:`GATHER_BUFFERS` tiles, each the widest layer in the compute
    dtype in whole pages; 0 unless ``plan.host_state == "shard"``."""
    if plan.host_state != "shard":
        return 0
    return GATHER_BUFFERS * page_up(max((layer.numel for layer in graph.layers), default=0) * plan.compute_itemsize)


@dataclass(frozen=True, slots=True)
class NodeMemory:
    """Host bytes of one node that runs ``ranks`` ranks of a plan (all sizes in bytes).

    ``persistent``: the FP32 masters and Adam moments the node holds, one copy shared by its ranks
    (all of them, or ``1 / nodes`` when the state is sharded); ``per_rank``: what each rank holds on
    its own besides (gradient and staging tiles, offloaded checkpoints, norms and flags, gradient
    accumulators and scratch: :class:`MemoryBreakdown` less its masters and moments);
    ``gather_buffers``: the pinned tiles sharded weights are gathered into; ``shared_staging``:
    the BF16 staging tiles the node's ranks share (``Plan.shared_cast``, counted once per copy, in
    ``shared_pinned`` too); ``gather_scratch``: the weight gathers' pageable send and receive
    buffers (:func:`gather_scratch_bytes`). Pinned: the shared master rows (FP32 compute; none with a sharded state,
    whose H2Ds read the gather tiles), shared staging tiles and gather buffers, plus each rank's own.
    """

    ranks: int
    persistent: int
    per_rank: int
    gather_buffers: int
    shared_pinned: int
    per_rank_pinned: int
    shared_staging: int = 0
    gather_scratch: int = 0

    @property
    def total(self) -> int:
        return (self.persistent + self.gather_buffers + self.gather_scratch + self.shared_staging
                + self.ranks * self.per_rank)

    @property
    def pinned(self) -> int:
        return self.shared_pinned + self.gather_buffers + self.ranks * self.per_rank_pinned

    def budgets(self, hw: HardwareSpec) -> tuple[tuple[str, int, int], ...]:
        """``(what, bytes needed, bytes one node of hw has)`` for host memory and its pinned cap."""
        return (("host memory per node", self.total, hw.host_memory_bytes),
                ("pinned host memory per node", self.pinned, hw.pinned_memory_cap_bytes))

    def fits(self, hw: HardwareSpec) -> bool:
        return all(need <= have for _, need, have in self.budgets(hw))


def node_memory(graph: LayerGraph, plan: Plan, mem: MemoryBreakdown) -> NodeMemory:
    """The :class:`NodeMemory` of ``plan`` (``plan.gpus_per_node`` ranks per node, ``plan.host_state``)
    from one rank's :func:`memory_breakdown` ``mem`` of ``graph``."""
    ways = plan.nodes if plan.host_state == "shard" else 1
    copies = plan.gpus_per_node // plan.optimizer_shards  # groups of ranks that share a copy
    state = mem.master_weights + mem.adam_moments
    gather = gather_buffer_bytes(graph, plan)
    # Plan.shared_cast: the staging tiles are a node's, like the state it shares (one per copy).
    staging = mem.shared_staging
    return NodeMemory(ranks=plan.gpus_per_node, persistent=copies * -(-state // ways),
                      per_rank=mem.host_total - state - staging, gather_buffers=gather,
                      shared_pinned=_shared_pinned_masters(mem.pinned_masters, plan) + copies * staging,
                      per_rank_pinned=mem.host_pinned - mem.pinned_masters - staging, shared_staging=copies * staging,
                      gather_scratch=gather_scratch_bytes(graph, plan))


def _shared_pinned_masters(pinned_masters: int, plan: Plan) -> int:
    """Pinned bytes of a node's shared master rows, from one copy's ``pinned_masters``: one per group
    of ranks sharing a copy; none with a sharded state, whose H2Ds read the (pinned) gather tiles,
    not the master rows (``runtime.host.HostState.pin_masters``)."""
    if plan.host_state == "shard":
        return 0
    return plan.gpus_per_node // plan.optimizer_shards * pinned_masters


def persistent_state_bytes(graph: LayerGraph, plan: Plan | None = None) -> int:
    """Bytes of the persistent host state of ``graph``: FP32 masters of every tile element and the
    optimizer state of ``plan``'s optimizer (None: AdamW's two FP32 moments) per trainable
    parameter (``MemoryBreakdown.master_weights + adam_moments``)."""
    return (sum(layer.numel for layer in graph.layers) * MASTER_BYTES_PER_ELEMENT
            + sum(layer.trainable_numel for layer in graph.layers) * state_bytes_per_param(plan))


def rank_host_budgets(graph: LayerGraph, plan: Plan, hw: HardwareSpec) -> tuple[int, int]:
    """``(host bytes, pinned bytes)`` one rank may plan for, counting the full persistent state in
    it as :func:`memory_breakdown` does, such that a rank's breakdown within them is exactly a
    node within ``hw`` (:meth:`NodeMemory.fits`): ``state + (node bytes - node's state) / G`` and
    the same for the pinned masters and cap. Negative when the node's share of the state alone
    exceeds it. ``plan`` gives the topology and compute dtype, and with ``shared_cast`` the node's
    shared staging tiles (:func:`shared_staging_bytes`, counted like the state); its other knobs
    are not read."""
    g, ways = plan.gpus_per_node, (plan.nodes if plan.host_state == "shard" else 1)
    copies = g // plan.optimizer_shards
    state = persistent_state_bytes(graph, plan)
    masters = pinned_master_bytes(graph, plan)
    gather = gather_buffer_bytes(graph, plan)
    staging = shared_staging_bytes(graph, plan)  # a rank's breakdown counts the node's tiles whole, as the state
    scratch = gather_scratch_bytes(graph, plan)
    host = state + staging + (hw.host_memory_bytes - copies * -(-state // ways) - copies * staging - gather
                              - scratch) // g
    pinned = masters + staging + (hw.pinned_memory_cap_bytes - _shared_pinned_masters(masters, plan)
                                  - copies * staging - gather) // g
    return host, pinned
