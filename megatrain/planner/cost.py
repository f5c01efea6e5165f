"""The cost model's one import: the op times (:mod:`megatrain.planner.time`), the byte accounting
(:mod:`megatrain.planner.memory`, with the activation events of :mod:`megatrain.planner.activations`)
and the buffer layout they share with the runtime (:mod:`megatrain.ir.layout`), re-exported.

The planner's passes, the CLI and the tests read ``cost.<name>``; each name is defined in the module
of its concern, and this module defines none. ``from megatrain.planner import cost`` stays the
planner's way in; the runtime reads the layout from the IR instead (``Schedule.layout``).
"""

from megatrain.ir.hardware import host_worker_threads
from megatrain.ir.layout import *  # noqa: F401,F403
from megatrain.planner.activations import *  # noqa: F401,F403
from megatrain.planner.memory import *  # noqa: F401,F403
from megatrain.planner.memory import dynamic_peaks as _dynamic_peaks  # noqa: F401 (tests/test_cost.py reads it)
from megatrain.planner.time import *  # noqa: F401,F403

__all__ = [
    "Resource", "resource_of", "compute_rate", "h2d_bytes", "d2h_bytes", "h2d_time", "d2h_time",
    "fwd_time", "bwd_time", "opt_time", "cast_time", "acc_time", "checkpoint_bytes", "offload_time", "op_duration",
    "op_time", "op_times", "kernel_time", "ComputeWork", "compute_work", "compute_works", "fresh_gradients",
    "issue_stall",
    "launch_count", "launch_times", "working_bytes", "ActivationLiveness",
    "activation_liveness", "allocation_stream", "issue_fences", "pool_peaks", "GpuReserve", "gpu_reserve",
    "ROUND_LARGE_BYTES", "SEGMENT_BYTES", "ALLOCATING_STREAMS", "CUBLAS_HANDLES", "SLOT_TENSORS",
    "MemoryBreakdown", "weight_slot_count", "slot_numels", "slot_bytes", "memory_breakdown", "graph_pool_bytes",
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
