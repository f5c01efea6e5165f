"""Tests for the cost model and the hardware spec: formulas checked against hand computation."""

from __future__ import annotations

import dataclasses
import json

import pytest

from graphs import chain_graph, spec
from megatrain.errors import ConfigError
from megatrain.ir import hardware
from megatrain.planner import cost
from megatrain.ir.hardware import PRESETS, HardwareSpec, load_hardware, preset
from megatrain.planner.lower import lower
from megatrain.ir.plan import ActivationPolicy, Plan
from megatrain.ir.schedule import Op, OpKind, Stream
from megatrain.units import MiB
from megatrain.runtime import measure


# -- public surface --------------------------------------------------------------------------------

def test_public_surface_is_pinned():
    assert set(hardware.__all__) == {"HardwareSpec", "PRESETS", "preset", "load_hardware", "H100_SXM", "H200",
                                     "GH200", "A100_80GB", "RTX_4090",
                                     # the NVMe and link presets, moved here from planner/nvme.py and topology.py
                                     "NvmeArray", "NVME_ARRAYS", "Link", "INTERCONNECTS", "NETWORKS"}
    assert set(cost.__all__) == {
        "Resource", "resource_of", "compute_rate", "h2d_bytes", "d2h_bytes", "h2d_time", "d2h_time",
        "fwd_time", "bwd_time", "opt_time", "cast_time", "acc_time", "checkpoint_bytes", "offload_time",
        "op_duration", "op_time", "op_times", "kernel_time", "ComputeWork", "compute_work", "compute_works",
        "fresh_gradients", "issue_stall", "launch_count", "launch_times", "working_bytes", "ActivationLiveness",
        "activation_liveness", "MemoryBreakdown", "weight_slot_count", "memory_breakdown", "graph_pool_bytes",
        "slot_numels", "slot_bytes", "HOST_PAGE_BYTES", "page_up", "gradient_tile_numels", "gradient_ring_bytes", "state_bytes_per_param",
        "staging_tile_numels", "pinned_master_bytes", "PinnedTile", "PinnedLayout", "pinned_buffers",
        "widens_gradients", "gradient_scratch_numel",
        "tokens_per_step", "model_flops_per_token", "flops_per_step", "mfu", "all_reduce_time", "reduce_scatter_time", "reduced_numel", "optimizer_shard",
        "node_slice", "cast_shard", "shared_staging_bytes",
        "NVME_BUFFERS", "nvme_buffers", "nvme_gradient_buffers", "nvme_gradient_bytes",
        "host_rate", "optimizer_numel", "weight_gather_bytes", "weight_gather_time", "weight_gather_host_time", "gather_scratch_bytes", "GATHER_BUFFERS",
        "gather_buffer_bytes", "NodeMemory", "node_memory", "rank_host_budgets", "persistent_state_bytes",
        "allocation_stream", "issue_fences", "pool_peaks", "GpuReserve", "gpu_reserve", "ROUND_LARGE_BYTES",
        "SEGMENT_BYTES", "ALLOCATING_STREAMS", "CUBLAS_HANDLES", "SLOT_TENSORS",
        "optimizer_rate", "cast_rate", "host_worker_threads", "OPT_CHUNK_ELEMENTS"}


# -- op times --------------------------------------------------------------------------------------

def test_op_times_by_hand():
    g = chain_graph(2, numel=[1000, 2000], fwd_flops=[3 * 10**6, 5 * 10**6], trainable=[True, False])
    hw = spec(h2d_bytes_per_s=2e9, d2h_bytes_per_s=4e9, fp32_flops=1e9, bf16_flops=4e9, matmul_efficiency=0.5,
              host_optimizer_params_per_s=1e6, op_latency_s=1e-6)
    fp32, bf16 = Plan(), Plan(compute_dtype="bfloat16")
    l0, l1 = g.layers
    assert l0.numel == 1008  # rounded up to the tile alignment of 16 elements
    assert cost.h2d_time(l0, fp32, hw) == pytest.approx(1e-6 + 1008 * 4 / 2e9)
    assert cost.h2d_time(l1, bf16, hw) == pytest.approx(1e-6 + 2000 * 2 / 2e9)
    assert cost.d2h_time(l0, hw) == pytest.approx(1e-6 + 1008 * 4 / 4e9)
    assert cost.d2h_bytes(l1) == 0  # frozen layer: no gradients leave the GPU
    assert cost.fwd_time(l0, fp32, hw) == pytest.approx(1e-6 + 3e6 / (1e9 * 0.5))
    assert cost.fwd_time(l0, bf16, hw) == pytest.approx(1e-6 + 3e6 / (4e9 * 0.5))
    assert cost.bwd_time(l1, fp32, hw) == pytest.approx(1e-6 + 15e6 / (1e9 * 0.5))
    assert cost.opt_time(l0, hw) == pytest.approx(1e-6 + 1008 / 1e6)
    # An ACC moves 12 bytes per element at the optimizer's memory-bound rate (28 bytes per parameter).
    assert cost.acc_time(l0, hw) == pytest.approx(1e-6 + 1008 * 12 / (1e6 * 28))
    for kind, fields, expect in [(OpKind.H2D, dict(slot=0), cost.h2d_time(l0, fp32, hw)),
                                 (OpKind.FWD, dict(mb=0, slot=0), cost.fwd_time(l0, fp32, hw)),
                                 (OpKind.BWD, dict(mb=0, slot=0), cost.bwd_time(l0, fp32, hw)),
                                 (OpKind.D2H, dict(slot=0, ring=0), cost.d2h_time(l0, hw)),
                                 (OpKind.OPT, dict(ring=0), cost.opt_time(l0, hw)),
                                 (OpKind.ACC, dict(mb=1, ring=0, acc=0), cost.acc_time(l0, hw))]:
        assert cost.op_time(Op(kind, 0, **fields), g, fp32, hw) == expect
        assert cost.op_duration(kind, g, 0, fp32, hw) == expect


def test_nvme_bytes_buffers_and_time_count_one_rank_s_shard_at_its_share_of_the_node_s_drives():
    """Under data parallel a rank's NVMe file holds the moments of what its OPT steps
    (cost.optimizer_shard): the whole tile with a copy per rank, 1/G with a node's shared copy; the
    node's G ranks move theirs at once over the node's drives, so each gets 1/G of the spec's rate."""
    g = chain_graph(2, numel=[1000, 20000])
    hw = spec(op_latency_s=1e-6, nvme_read_bytes_per_s=2e9, nvme_write_bytes_per_s=1e9)
    one, own, shared = Plan(), Plan(data_parallel=2), Plan(data_parallel=2, optimizer_shards=2)
    lay = g.layers[1]
    # 20,000 moments x 8 bytes = 160,000, padded to 4096: 163,840; a shard of two is 10,000 elements
    # (ceil(20000 / 2) on 16-element boundaries): 80,000 bytes, padded: 81,920.
    assert cost.nvme_bytes(lay, plan=one) == cost.nvme_bytes(lay, plan=own) == cost.nvme_bytes(lay) == 163840
    assert cost.nvme_bytes(lay, plan=shared) == 81920
    for plan in (one, own, shared):
        moved = dataclasses.replace(plan, nvme_moments=frozenset({0, 1}))
        assert cost.nvme_buffers(g, moved) == (2, cost.nvme_bytes(lay, plan=plan))
    assert cost.nvme_time(lay, hw, OpKind.NVME_READ, plan=one) == pytest.approx(163840 / 2e9 + 1e-6)
    assert cost.nvme_time(lay, hw, OpKind.NVME_READ, plan=own) == pytest.approx(2 * 163840 / 2e9 + 1e-6)
    assert cost.nvme_time(lay, hw, OpKind.NVME_WRITE, plan=shared) == pytest.approx(2 * 81920 / 1e9 + 1e-6)
    # Two nodes of one rank each: each rank has its node's drives to itself.
    assert cost.nvme_time(lay, hw, OpKind.NVME_READ, plan=Plan(data_parallel=2, nodes=2)) == pytest.approx(
        163840 / 2e9 + 1e-6)


def test_every_op_kind_has_one_duration_formula():
    g = chain_graph(2, numel=[1000, 2000], fwd_flops=[3 * 10**6, 5 * 10**6])
    hw = spec(op_latency_s=1e-6, nvme_read_bytes_per_s=2e9, nvme_write_bytes_per_s=1e9, allreduce_bytes_per_s=1e9)
    plan = Plan(compute_dtype="bfloat16", data_parallel=2)
    assert cost.op_duration(OpKind.RECOMPUTE, g, 1, plan, hw) == cost.fwd_time(g.layers[1], plan, hw)
    assert cost.op_duration(OpKind.NVME_READ, g, 1, plan, hw) == cost.nvme_time(g.layers[1], hw, OpKind.NVME_READ,
                                                                                plan=plan)
    assert cost.nvme_time(g.layers[1], hw, OpKind.NVME_WRITE) == pytest.approx(16384 / 1e9 + 1e-6)
    assert cost.op_duration(OpKind.CAST, g, 1, plan, hw) == cost.cast_time(g.layers[1], hw, plan)
    assert cost.op_duration(OpKind.OFFLOAD, g, 0, plan, hw) == cost.offload_time(g, 0, hw, OpKind.OFFLOAD)
    assert cost.op_duration(OpKind.RELOAD, g, 0, plan, hw) == cost.offload_time(g, 0, hw, OpKind.RELOAD)
    assert cost.op_duration(OpKind.ALL_REDUCE, g, 1, plan, hw) == cost.all_reduce_time(g.layers[1], hw, plan)
    assert cost.op_duration(OpKind.ALL_GATHER, g, 1, plan, hw) == hw.op_latency_s  # shared memory: a barrier
    for kind in OpKind:
        assert cost.op_duration(kind, g, 1, plan, hw) > 0


@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 1000, 4099])
@pytest.mark.parametrize("shards", [1, 2, 3, 8])
def test_optimizer_shards_cover_the_tile_once_in_rank_order_on_cache_lines(numel, shards):
    parts = [cost.optimizer_shard(numel, shards, i) for i in range(shards)]
    assert parts[0][0] == 0 and parts[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # contiguous, no overlap
    assert all(lo % cost.SHARD_ALIGN_ELEMENTS == 0 for lo, hi in parts if hi > lo)
    sizes = [hi - lo for lo, hi in parts]
    assert max(sizes) - min(sizes) <= cost.SHARD_ALIGN_ELEMENTS * shards  # balanced up to the alignment
    with pytest.raises(ValueError, match="index is in"):
        cost.optimizer_shard(numel, shards, shards)


def test_a_sharded_optimizer_step_takes_the_largest_shard_s_time():
    g = chain_graph(1, numel=4096)
    hw = spec(op_latency_s=1e-6, host_optimizer_params_per_s=1e9)
    whole = cost.opt_time(g.layers[0], hw, Plan())
    quarter = cost.opt_time(g.layers[0], hw, Plan(data_parallel=4, optimizer_shards=4))
    own = cost.opt_time(g.layers[0], hw, Plan(data_parallel=4))
    assert whole == pytest.approx(1e-6 + 4096 / 1e9)
    # A quarter of the tile at a quarter of the node's host bandwidth (four ranks on one DRAM, the
    # spec's rate being the whole host's): as long as one rank's whole step, and 4x shorter than
    # four ranks each stepping a copy of their own.
    assert quarter == pytest.approx(1e-6 + 1024 / (1e9 / 4))
    assert own - 1e-6 == pytest.approx(4 * (quarter - 1e-6))


def test_h2d_time_doubles_when_bandwidth_halves():
    g = chain_graph(1, numel=4096)
    layer, plan = g.layers[0], Plan()
    fast, slow = spec(h2d_bytes_per_s=8e9), spec(h2d_bytes_per_s=4e9)
    assert cost.h2d_time(layer, plan, slow) == pytest.approx(2 * cost.h2d_time(layer, plan, fast))
    # With a fixed per-op latency only the bandwidth term doubles.
    lat = 5e-6
    fast, slow = spec(h2d_bytes_per_s=8e9, op_latency_s=lat), spec(h2d_bytes_per_s=4e9, op_latency_s=lat)
    fast_t, slow_t = cost.h2d_time(layer, plan, fast), cost.h2d_time(layer, plan, slow)
    assert slow_t - lat == pytest.approx(2 * (fast_t - lat))


def test_op_times_matches_op_time_for_every_op():
    g = chain_graph(4, numel=[512, 1024, 2048, 64], fwd_flops=[1, 2, 3, 4])
    s = lower(g, Plan(micro_batches=2))
    hw = spec(op_latency_s=1e-6)
    assert cost.op_times(s, g, hw) == tuple(cost.op_time(op, g, s.plan, hw) for op in s.ops)


def test_resource_of_shares_one_copy_engine_without_duplex():
    duplex, simplex = spec(duplex=True), spec(duplex=False)
    assert cost.resource_of(Stream.H2D, duplex) != cost.resource_of(Stream.D2H, duplex)
    assert cost.resource_of(Stream.H2D, simplex) == cost.resource_of(Stream.D2H, simplex)
    for hw in (duplex, simplex):
        assert cost.resource_of(Stream.COMPUTE, hw) is cost.Resource.GPU
        assert cost.resource_of(Stream.HOST, hw) is cost.Resource.HOST


def test_host_only_spec_cannot_time_gpu_ops():
    hw = spec(bf16_flops=0.0, fp32_flops=0.0, h2d_bytes_per_s=0.0, name="host-only")
    layer = chain_graph(1).layers[0]
    with pytest.raises(ConfigError, match=r"'host-only' has h2d_bytes_per_s=0.*preset"):
        cost.h2d_time(layer, Plan(), hw)
    with pytest.raises(ConfigError, match="fp32_flops=0"):
        cost.fwd_time(layer, Plan(), hw)
    assert cost.opt_time(layer, hw) > 0  # the host side still has a rate


# -- memory ----------------------------------------------------------------------------------------

def test_memory_breakdown_static_terms_by_hand():
    g = chain_graph(3, numel=[1024, 4096, 2048], trainable=[True, True, False], buffer_bytes=[100, 0, 28])
    plan = Plan(slots=2, prefetch_distance=1, grad_ring=3, resident=frozenset({2}))
    m = cost.memory_breakdown(g, plan, spec(gpu_reserve_bytes=777))
    total = 1024 + 4096 + 2048
    page = cost.HOST_PAGE_BYTES
    assert m.master_weights == total * 4
    assert m.adam_moments == (1024 + 4096) * 8  # the frozen layer 2 has no optimizer state
    # The D2Hs run L1 then L0 (L2 is frozen): tile 0 holds L1's 4096 gradients, tile 1 L0's 1024,
    # tile 2 none. Each tile is pinned in whole pages (4096 B is one page).
    assert cost.gradient_tile_numels(g, plan) == (4096, 1024, 0)
    assert m.gradient_ring == 4096 * 4 + 1024 * 4
    assert m.staging_ring == 0  # FP32 compute reads the master tile directly
    # Masters pinned (each row a whole number of pages here), moments not; norms and flags a page each.
    assert m.state_pinned and m.pinned_masters == total * 4 and m.pinned_norms == 2 * page
    assert m.host_pinned == total * 4 + 4096 * 4 + 1024 * 4 + 2 * page
    # Two streaming slots for the widest streamed layer, and the resident layer 2's own slot (2048
    # elements, frozen: no gradient slot space).
    assert m.weight_slots == (2 * 4096 + 2048) * 4
    assert m.gradient_slots == 2 * 4096 * 4
    assert m.buffers == 128
    assert m.reserve == 777
    assert m.pinned_activations == 0
    # Fits exactly at every budget, and not one byte below any of them.
    exact = spec(gpu_memory_bytes=m.gpu_peak, host_memory_bytes=m.host_total, pinned_memory_cap_bytes=m.host_pinned)
    assert m.fits(exact) and m.host_fits(exact)
    assert [what for what, need, have in m.budgets(exact) if need == have] == [
        "GPU memory", "pinned host memory", "host memory"]
    assert not m.fits(exact.model_copy(update={"gpu_memory_bytes": m.gpu_peak - 1}))
    assert m.host_fits(exact.model_copy(update={"gpu_memory_bytes": m.gpu_peak - 1}))
    for field, need in (("pinned_memory_cap_bytes", m.host_pinned), ("host_memory_bytes", m.host_total)):
        short = exact.model_copy(update={field: need - 1})
        assert not m.fits(short) and not m.host_fits(short)
    bf16 = cost.memory_breakdown(g, Plan(compute_dtype="bfloat16", staging_ring=2, grad_ring=3, d2h_dtype="float32"))
    assert bf16.staging_ring == 2 * 4096 * 2
    assert bf16.weight_slots == 2 * 4096 * 2
    rings = 4096 * 4 + 1024 * 4
    assert not bf16.state_pinned and bf16.pinned_masters == 0
    assert bf16.host_pinned == rings + 2 * 4096 * 2 + 2 * page
    assert bf16.reserve == bf16.reserve_parts.derived and bf16.reserve_parts.context == hardware.CUDA_CONTEXT_BYTES
    assert bf16.host_total == total * 4 + (1024 + 4096) * 8 + rings + 2 * 4096 * 2 + 2 * page
    assert bf16.gradient_scratch == 0
    # BF16 gradients (the default where exact): ring tiles and gradient slots halve, and the
    # optimizer's FP32 widening scratch (pageable, the widest trainable layer) joins the host total.
    half = cost.memory_breakdown(g, Plan(compute_dtype="bfloat16", staging_ring=2, grad_ring=3))
    # (Each tile in whole pages: the 1024-element tile takes one page in either dtype.)
    half_rings = 4096 * 2 + page
    assert half.gradient_ring == half_rings
    assert half.gradient_slots == bf16.gradient_slots // 2
    assert half.host_pinned == bf16.host_pinned - rings + half_rings
    assert half.gradient_scratch == 4096 * 4
    assert half.host_total == bf16.host_total - rings + half_rings + 4096 * 4


def test_activation_peak_by_hand():
    # 3 layers, 2 micro-batches, KEEP everywhere. Fixed: 2 weight + 2 gradient slots of 1024 FP32
    # elements = 16384 B. Batch inputs: input_ids and labels, 128 B each per micro-batch = 512 B.
    # The peak is at the start of BWD:L2:m0: checkpoints h0, h1 of both micro-batches (4 x 4096),
    # the gradient of h1 for m0 that this backward produces (4096) and its working memory (100).
    g = chain_graph(3, numel=1024, act_bytes=4096, work_bytes=100)
    plan = Plan(micro_batches=2)
    m = cost.memory_breakdown(g, plan, spec())
    assert m.gpu_fixed == 16384
    assert m.activations_peak == 512 + 4 * 4096 + 4096
    assert m.working_peak == 100
    assert m.dynamic_peak == 512 + 5 * 4096 + 100
    assert m.gpu_peak == 16384 + 512 + 5 * 4096 + 100
    # The same with the lowered schedule passed in.
    assert cost.memory_breakdown(g, plan, spec(), lower(g, plan)) == m


def test_gpu_reserve_by_hand():
    """The derived reserve, term by term, for a 3-layer chain: the context and two cuBLAS workspaces
    from the spec; the allocator's rounding of every tensor alive at the busiest compute op (2 slots x
    weights and gradients, 2 norm/flag tensors, the batch inputs, the checkpoints and gradients alive
    there and one intermediate per launched aten op) plus a large and a small segment per allocating
    stream; no pool term without RELOADs. A measured reserve replaces the sum."""
    g = chain_graph(3, numel=1024)
    g = dataclasses.replace(g, layers=tuple(dataclasses.replace(x, fwd_launches=10, bwd_launches=30)
                                            for x in g.layers))
    plan = Plan(slots=2, prefetch_distance=1)
    s = lower(g, plan)
    hw = spec(gpu_reserve_bytes=None, cuda_context_bytes=7 * MiB, cublas_workspace_bytes=3 * MiB)
    r = cost.gpu_reserve(g, plan, s, hw)
    assert (r.context, r.workspaces, r.pools, r.measured) == (7 * MiB, 2 * 3 * MiB, 0, None)
    # The busiest op is the last layer's local backward: both batch inputs, both checkpoints (L0's
    # output, read later by L1's backward, and L1's, read now), the gradient it makes for L1's
    # output, and its 30 launched ops.
    busiest = 2 + 2 + 1 + 30
    assert r.tensors == 2 * 2 + 2 + busiest
    assert r.rounding == r.tensors * 2 * MiB + 3 * 22 * MiB
    assert cost.memory_breakdown(g, plan, hw, s).reserve == r.total == r.derived
    assert cost.gpu_reserve(g, plan, s, spec(gpu_reserve_bytes=5)).total == 5


def test_pool_peaks_split_reloads_from_compute():
    """With checkpoints offloaded and reloaded, the H2D stream's pool holds the reloads and the
    compute stream's the rest; the pools' peaks add to at least the combined peak."""
    g = chain_graph(5, numel=1024)
    plan = Plan(activations=(ActivationPolicy.OFFLOAD,) * 4 + (ActivationPolicy.KEEP,))
    s = lower(g, plan)
    live = cost.activation_liveness(s, g)
    peaks = cost.pool_peaks(s, live, working=False)
    act, _, dyn = cost._dynamic_peaks(s, live)
    assert peaks[Stream.H2D] > 0 and peaks[Stream.COMPUTE] > 0
    assert peaks[Stream.H2D] + peaks[Stream.COMPUTE] >= act
    assert sum(live.reload_alloc) == sum(live.reload_free) == 4 * g.values[2].nbytes
    assert cost.gpu_reserve(g, plan, s).pools == max(0, sum(cost.pool_peaks(s, live).values()) - dyn)


def test_activation_liveness_balances():
    g = chain_graph(5, act_bytes=1000, work_bytes=7)
    s = lower(g, Plan(micro_batches=3))
    live = cost.activation_liveness(s, g)
    # Everything allocated is freed by the end of the step.
    assert live.at_start + sum(live.alloc) == sum(live.free)
    for i, op in enumerate(s.ops):
        if op.stream is not Stream.COMPUTE:
            assert live.alloc[i] == live.free[i] == live.work[i] == 0


def test_pinned_activation_space_formula():
    g = chain_graph(4, act_bytes=1000)
    keep = Plan(micro_batches=3)
    offload = Plan(micro_batches=3, activations=(ActivationPolicy.OFFLOAD, ActivationPolicy.KEEP,
                                                 ActivationPolicy.OFFLOAD, ActivationPolicy.KEEP))
    m = cost.memory_breakdown(g, offload, spec())
    # h0 and h2, every micro-batch, each copy in a page of its own (1000 B rounds up to one page).
    assert m.pinned_activations == 2 * 3 * cost.HOST_PAGE_BYTES
    assert cost.memory_breakdown(g, keep, spec()).pinned_activations == 0


def test_per_micro_batch_passes_trade_gpu_checkpoints_for_host_accumulators():
    """Layer by layer, all 3 micro-batches' checkpoints are alive at the turn; per-micro-batch passes
    hold one micro-batch's (and pin one micro-batch's offloaded copies), and add FP32 accumulators."""
    g = chain_graph(4, numel=[1024, 2048, 512, 4096], trainable=[True, True, False, True], act_bytes=1000)
    offload_h0 = (ActivationPolicy.OFFLOAD,) + (ActivationPolicy.KEEP,) * 3
    l2l = cost.memory_breakdown(g, Plan(micro_batches=3, activations=offload_h0), spec())
    per = cost.memory_breakdown(g, Plan(micro_batches=3, activations=offload_h0, layer_by_layer=False), spec())
    page = cost.HOST_PAGE_BYTES
    assert l2l.pinned_activations == 3 * page and per.pinned_activations == page  # 1000 B: a page each
    assert l2l.gradient_accumulators == 0 and per.gradient_accumulators == (1024 + 2048 + 4096) * 4
    # Two ring tiles. Layer by layer the D2Hs run L3, L1, L0: tile 0 takes L3 and L0, tile 1 L1.
    # Per-micro-batch passes continue the turn in each pass (L3 L1 L0 L3 L1 L0 ...), so L3 reaches both.
    assert cost.gradient_tile_numels(g, Plan(micro_batches=3)) == (4096, 2048)
    assert cost.gradient_tile_numels(g, Plan(micro_batches=3, layer_by_layer=False)) == (4096, 4096)
    ring_growth = (4096 - 2048) * 4
    assert per.host_total - l2l.host_total == per.gradient_accumulators - 2 * page + ring_growth
    assert per.host_pinned == l2l.host_pinned - 2 * page + ring_growth  # the accumulators are pageable
    # Peak at the turn (BWD:L3:m0): labels of every micro-batch (128 B each, read by the last layer),
    # h1 and h2 kept, h0 already reloaded, and the gradient of h2 that this backward makes. Layer by
    # layer that is every micro-batch's; per micro-batch it is m0's, plus input_ids of m1 and m2.
    assert l2l.activations_peak == 3 * 128 + 3 * 2 * 1000 + 3 * 1000 + 1000
    assert per.activations_peak == 3 * 128 + 2 * 128 + 2 * 1000 + 1000 + 1000


def test_memory_breakdown_table_lists_every_row():
    m = cost.memory_breakdown(chain_graph(2), Plan(), spec())
    text = m.format()
    assert len(text.splitlines()) == len(m.rows())
    assert "weight slots" in text and "peak" in text


# -- FLOPs -----------------------------------------------------------------------------------------

def test_model_flops_and_mfu():
    g = chain_graph(3, fwd_flops=[0, 10**9, 2 * 10**9], micro_batch_size=2, seq_len=8)
    plan = Plan(micro_batches=4)
    assert cost.model_flops_per_token(g) == pytest.approx(3 * 3e9 / 16)
    assert cost.flops_per_step(g, plan) == pytest.approx(3 * 3e9 * 4)
    assert cost.flops_per_step(g, plan, "eval") == pytest.approx(3e9 * 4)
    assert cost.tokens_per_step(g, plan) == 64
    hw = spec(fp32_flops=1e12, bf16_flops=2e12)
    assert cost.mfu(1e12, 2.0, "float32", hw) == pytest.approx(0.5)
    assert cost.mfu(1e12, 2.0, "bfloat16", hw) == pytest.approx(0.25)
    assert cost.mfu(1e12, 0.0, "float32", hw) == 0.0
    assert cost.mfu(1e12, 1.0, "float32", spec(fp32_flops=0.0)) == 0.0


# -- hardware spec ---------------------------------------------------------------------------------

def test_presets_are_valid_and_looked_up_case_insensitively():
    assert set(PRESETS) == {"H100_SXM", "H200", "GH200", "A100_80GB", "RTX_4090"}
    for name, hw in PRESETS.items():
        assert preset(name.lower()) is hw
        assert preset(name.replace("_", "-")) is hw
        assert hw.has_gpu and hw.pinned_memory_cap_bytes <= hw.host_memory_bytes
        assert hw.fp32_flops < hw.bf16_flops
        assert HardwareSpec.model_validate_json(hw.model_dump_json()) == hw
    assert preset("h100 sxm").bf16_flops == 989e12
    assert preset("GH200").h2d_bytes_per_s <= 450e9  # NVLink-C2C per direction
    assert preset("H200").host_memory_bytes == 3 * 2**40 // 2
    assert preset("A100_80GB").bf16_flops == 312e12
    with pytest.raises(ConfigError, match=r"'h300'.*A100_80GB.*GH200.*H100_SXM.*H200.*RTX_4090"):
        preset("h300")


def test_spec_rejects_bad_values():
    import pydantic

    with pytest.raises(pydantic.ValidationError, match="extra"):
        spec(tflops=3)
    with pytest.raises(pydantic.ValidationError, match="pinned_memory_cap_bytes"):
        spec(host_memory_bytes=10, pinned_memory_cap_bytes=11)
    with pytest.raises(pydantic.ValidationError):
        spec(matmul_efficiency=1.5)
    with pytest.raises(pydantic.ValidationError):
        spec(host_optimizer_params_per_s=0)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        spec().h2d_bytes_per_s = 1.0


def test_spec_save_load_round_trip(tmp_path):
    hw = preset("RTX_4090")
    hw.save(tmp_path / "hw.json")
    assert HardwareSpec.load(tmp_path / "hw.json") == hw
    assert json.loads((tmp_path / "hw.json").read_text())["name"] == hw.name


def test_load_hardware_by_spec_name_or_file(tmp_path):
    hw = preset("RTX_4090")
    assert load_hardware(hw) is hw
    assert load_hardware("rtx-4090") is hw
    hw.save(tmp_path / "hw.json")
    assert load_hardware(tmp_path / "hw.json") == hw
    assert load_hardware(str(tmp_path / "hw.json")) == hw
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    with pytest.raises(ConfigError, match=r"(?s)bad\.json is not a valid HardwareSpec.*gpu_memory_bytes"):
        load_hardware(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match=r"missing\.json' does not exist"):
        load_hardware(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="no hardware preset named 'h300'"):
        load_hardware("h300")


def test_host_memory_readers():
    total = measure.total_host_memory_bytes()
    available, where = measure.available_host_memory()
    rss = measure.host_rss_bytes()
    assert 0 < available <= total and where
    assert 0 < rss <= total


def test_matmul_flops_is_positive_and_leaves_the_global_rng_alone():
    import torch

    torch.manual_seed(3)
    expect = torch.rand(2)
    torch.manual_seed(3)
    assert measure.measure_matmul_flops("cpu", n=64, seconds=0.01) > 0
    assert torch.equal(torch.rand(2), expect)


def test_measure_host(tmp_path):
    import torch

    hw = measure.measure_hardware(tmp_path / "me.json", optimizer_numel=1 << 20, seconds=0.2)
    assert hw.host_optimizer_params_per_s > 0
    assert hw.host_memory_bytes > 0 and 0 < hw.pinned_memory_cap_bytes <= hw.host_memory_bytes
    assert HardwareSpec.load(tmp_path / "me.json") == hw
    assert HardwareSpec.model_validate_json(hw.model_dump_json()) == hw
    if not torch.cuda.is_available():
        assert "host-only" in hw.name
        assert hw.bf16_flops == hw.h2d_bytes_per_s == hw.gpu_memory_bytes == 0
        assert not hw.has_gpu


@pytest.mark.parametrize("major, env, want", [
    (9, {}, 32 * MiB + MiB),  # Hopper: PyTorch's 32 MiB, and cuBLASLt's 1 MiB
    (12, {}, 32 * MiB + MiB),  # Blackwell likewise
    (8, {}, 4096 * 1024 * 2 + 16 * 1024 * 8 + MiB),  # Ampere: ":4096:2:16:8"
    (9, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 32 * MiB + MiB),
    (9, {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "0"}, 16 * 1024 * 8),  # deterministic mode
    (8, {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}, 4096 * 1024 * 2 + 16 * 1024 * 8 + MiB),
])
def test_cublas_workspace_bytes_as_pytorch_sizes_them(major, env, want):
    assert measure.cublas_workspace_bytes(major, env) == want
    assert hardware.CUBLAS_WORKSPACE_BYTES == measure.cublas_workspace_bytes(9, {})  # the presets' default


def test_host_rates_come_from_the_spec_and_estimates_fill_what_it_lacks():
    layer = chain_graph(1, numel=1 << 16).layers[0]
    n = layer.numel
    bf16 = Plan(compute_dtype="bfloat16", staging_ring=1)  # OPTs read BF16 gradient tiles
    old = spec(host_optimizer_params_per_s=1e9)  # a spec saved before the CAST and BF16 rates were measured
    assert cost.cast_rate(old) == pytest.approx(1e9 * 28 / 6) and cost.optimizer_rate(old, bf16) == pytest.approx(1e9 * 28 / 34)
    # A measured cast rate (the 2-core EPYC VM: 3.4x the AdamW rate, not the 4.67x bytes predict).
    hw = spec(host_optimizer_params_per_s=1e9, host_cast_elements_per_s=3.4e9, host_optimizer_bf16_params_per_s=0.8e9)
    assert cost.cast_time(layer, hw) == pytest.approx(n / 3.4e9)
    assert cost.opt_time(layer, hw, bf16) == pytest.approx(layer.trainable_numel / 0.8e9)
    assert cost.opt_time(layer, hw, Plan()) == pytest.approx(layer.trainable_numel / 1e9)
    # The ranks of a node share every host rate.
    four = Plan(data_parallel=4, compute_dtype="bfloat16", staging_ring=1)
    assert cost.cast_rate(hw, four) == 3.4e9 / 4 and cost.optimizer_rate(hw, four) == 0.8e9 / 4
    # An ACC of BF16 tiles reads 2 bytes less than one of FP32 tiles (10 and 12 of AdamW's 28).
    acc16 = Plan(compute_dtype="bfloat16", micro_batches=2, layer_by_layer=False)
    assert acc16.gradient_itemsize == 2
    assert cost.acc_time(layer, hw, acc16) == pytest.approx(layer.trainable_numel * 10 / 28e9)
    assert cost.acc_time(layer, hw) == pytest.approx(layer.trainable_numel * 12 / 28e9)


@pytest.mark.parametrize("cores, gpus, want", [(2, 1, 1), (16, 1, 15), (112, 8, 13), (4, 8, 1), (1, 1, 1)])
def test_host_worker_threads_leave_each_rank_a_core_to_issue_from(cores, gpus, want):
    assert cost.host_worker_threads(cores, gpus) == want


def test_host_and_cast_share_one_resource_as_the_runtime_runs_them():
    for duplex in (True, False):
        hw = spec(duplex=duplex)
        assert cost.resource_of(Stream.HOST, hw) is cost.resource_of(Stream.CAST, hw) is cost.Resource.HOST
    with pytest.raises(ValueError, match="both must be >= 1"):
        cost.host_worker_threads(0)


# -- data parallel: topology -----------------------------------------------------------------------

@pytest.mark.parametrize("g, m, lat_i, lat_n, want", [
    # B = 4 bytes x 16,000 parameters = 64,000 bytes; intra 1 GB/s, network 0.5 GB/s; op latency 1 us.
    (1, 1, 0.0, 0.0, 0.0),  # one rank: no collective
    (4, 1, 0.0, 0.0, 1e-6 + 2 * 3 / 4 * 64_000 / 1e9),  # one node: the flat ring
    (1, 2, 0.0, 0.0, 1e-6 + 2 * 1 / 2 * 64_000 / 0.5e9),  # one GPU per node: the ring over nodes
    (8, 2, 0.0, 0.0, 1e-6 + 2 * 7 / 8 * 64_000 / 1e9 + 2 * 1 / 2 * 64_000 / 0.5e9),  # RS + AR of B/G + AG
    (8, 4, 2e-6, 5e-6, 1e-6 + 2 * 7 / 8 * 64_000 / 1e9 + 2 * 7 * 2e-6 + 2 * 3 / 4 * 64_000 / 0.5e9 + 2 * 3 * 5e-6),
])
def test_all_reduce_time_is_a_hierarchical_ring(g, m, lat_i, lat_n, want):
    layer = chain_graph(1, numel=16_000).layers[0]
    hw = spec(op_latency_s=1e-6, intra_node_bytes_per_s=1e9, network_bytes_per_s=0.5e9,
              intra_node_latency_s=lat_i, network_latency_s=lat_n)
    assert cost.all_reduce_time(layer, hw, Plan(data_parallel=g * m, nodes=m)) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("g, lat_i, want", [
    # B = 64,000 bytes as above; intra 1 GB/s; op latency 1 us.
    (2, 0.0, 1e-6 + 1 / 2 * 64_000 / 1e9),
    (8, 2e-6, 1e-6 + 7 / 8 * 64_000 / 1e9 + 7 * 2e-6),
])
def test_reduce_scatter_time_is_half_the_flat_ring_all_reduce(g, lat_i, want):
    layer = chain_graph(1, numel=16_000).layers[0]
    hw = spec(op_latency_s=1e-6, intra_node_bytes_per_s=1e9, intra_node_latency_s=lat_i)
    plan = Plan(data_parallel=g, optimizer_shards=g, gradient_reduction="reduce_scatter")
    got = cost.reduce_scatter_time(layer, hw, plan)
    assert got == pytest.approx(want, rel=1e-12)
    # Half the bytes and ring steps of the all-reduce on the same node: the all-reduce is a
    # reduce-scatter then an all-gather.
    assert 2 * (got - 1e-6) == pytest.approx(cost.all_reduce_time(layer, hw, plan) - 1e-6, rel=1e-12)
    assert cost.op_duration(OpKind.REDUCE_SCATTER, chain_graph(1, numel=16_000), 0, plan, hw) == got
    assert cost.reduce_scatter_time(layer, hw, Plan()) == 0.0
    with pytest.raises(ConfigError, match="reduce-scatter of the gradients over 2 nodes.*all_reduce_time"):
        cost.reduce_scatter_time(layer, hw, Plan(data_parallel=4, nodes=2))


@pytest.mark.parametrize("numel", [1, 15, 16, 1000, 16_385])
@pytest.mark.parametrize("shards", [2, 3, 8])
def test_reduce_scatter_tiles_are_padded_to_equal_aligned_shards(numel, shards):
    plan = Plan(data_parallel=shards, optimizer_shards=shards, gradient_reduction="reduce_scatter")
    full = cost.reduced_numel(numel, plan)
    per = full // shards
    assert full % (shards * cost.SHARD_ALIGN_ELEMENTS) == 0 and numel <= full < numel + shards * cost.SHARD_ALIGN_ELEMENTS
    # Each rank's optimizer shard lies inside its chunk of the padded tile, at its start.
    for i in range(shards):
        lo, hi = cost.optimizer_shard(numel, shards, i)
        assert lo == min(numel, i * per) and hi <= (i + 1) * per
    assert cost.reduced_numel(numel, Plan(data_parallel=shards, optimizer_shards=shards)) == numel


def test_reduce_scatter_plans_size_the_gradient_tiles_and_accumulators_to_the_padded_shards():
    g = chain_graph(2, numel=[1024, 2000])
    rs = dict(data_parallel=3, optimizer_shards=3, gradient_reduction="reduce_scatter")
    padded = [cost.reduced_numel(n, Plan(**rs)) for n in (1024, 2000)]
    assert padded == [1056, 2016]  # 3 shards of 352 and of 672 elements (multiples of 16)
    # The D2Hs take the two tiles from the last layer back: each sized to its padded layer.
    assert cost.gradient_tile_numels(g, Plan(**rs)) == (padded[1], padded[0])
    assert cost.gradient_tile_numels(g, Plan(data_parallel=3, optimizer_shards=3)) == (2000, 1024)
    acc = cost.memory_breakdown(g, Plan(layer_by_layer=False, micro_batches=2, **rs)).gradient_accumulators
    assert acc == sum(padded) * 4


def test_all_reduce_time_reads_the_legacy_field_and_names_the_missing_rate():
    layer = chain_graph(1, numel=16_000).layers[0]
    legacy = HardwareSpec.model_validate_json(spec(allreduce_bytes_per_s=1e9).model_dump_json())
    new = spec(intra_node_bytes_per_s=1e9)
    plan = Plan(data_parallel=4)
    assert legacy.intra_node_bus_bytes_per_s == 1e9
    assert cost.all_reduce_time(layer, legacy, plan) == cost.all_reduce_time(layer, new, plan)
    with pytest.raises(ValueError, match="legacy name of intra_node_bytes_per_s"):
        spec(allreduce_bytes_per_s=1e9, intra_node_bytes_per_s=2e9)
    with pytest.raises(ConfigError, match="network_bytes_per_s=0.*--network"):
        cost.all_reduce_time(layer, new, Plan(data_parallel=2, nodes=2))
    with pytest.raises(ConfigError, match="intra_node_bytes_per_s=0 and allreduce_bytes_per_s=0.*--interconnect"):
        cost.all_reduce_time(layer, spec(network_bytes_per_s=1e9), Plan(data_parallel=4, nodes=2))


def test_ranks_of_a_node_split_the_update_and_share_the_host_bandwidth():
    layer = chain_graph(1, numel=16_000).layers[0]
    hw = spec(op_latency_s=1e-6, host_optimizer_params_per_s=1e9, intra_node_bytes_per_s=1e9,
              network_bytes_per_s=1e9)
    one, node8 = Plan(), Plan(data_parallel=8, optimizer_shards=8)
    own8 = Plan(data_parallel=8)  # eight ranks on one node, each with a copy of its own
    shard = Plan(data_parallel=16, nodes=2, host_state="shard", optimizer_shards=8)
    assert cost.optimizer_numel(layer, one) == cost.optimizer_numel(layer, own8) == 16_000
    assert cost.optimizer_numel(layer, node8) == 2_000  # 1/8 of each tile per rank
    # and each node only its 1/2: 1/16 of the tile, whole 64-byte lines (cost.optimizer_shard)
    assert cost.optimizer_numel(layer, shard) == 1_008 == -(-16_000 // 16 // 16) * 16
    assert cost.host_rate(hw, node8) == cost.host_rate(hw, own8) == 1e9 / 8
    assert cost.opt_time(layer, hw, own8) - 1e-6 == pytest.approx(8 * (cost.opt_time(layer, hw, node8) - 1e-6))
    # The node's DRAM does the same update per step either way: 1/8 of it at 1/8 of the bandwidth.
    assert cost.opt_time(layer, hw, node8) == pytest.approx(cost.opt_time(layer, hw, one), rel=1e-12)
    assert cost.opt_time(layer, hw, shard) - 1e-6 == pytest.approx(1_008 / (1e9 / 8))  # about half of one's
    # Each rank casts and accumulates its own whole tile, at its share of the bandwidth.
    assert cost.cast_time(layer, hw, node8) - 1e-6 == pytest.approx(8 * (cost.cast_time(layer, hw) - 1e-6))
    assert cost.acc_time(layer, hw, node8) - 1e-6 == pytest.approx(8 * (cost.acc_time(layer, hw) - 1e-6))


@pytest.mark.parametrize("numel,trainable,shards", [(16_000, 16_000, 8), (16_000, 12_345, 8), (112, 112, 3),
                                                     (20, 0, 2)])
def test_a_shared_cast_is_split_by_optimizer_shard_and_costs_its_largest_shard(numel, trainable, shards):
    # (A frozen tail after the trainable prefix, as graph.Layer lays tiles out.)
    layer = dataclasses.replace(chain_graph(1, numel=numel).layers[0], trainable_numel=trainable)
    numel = layer.numel  # (rounded up to the tile alignment)
    hw = spec(op_latency_s=1e-6, host_optimizer_params_per_s=1e9)
    own = Plan(data_parallel=shards, optimizer_shards=shards, compute_dtype="bfloat16", cast_once=True)
    shared = Plan(data_parallel=shards, optimizer_shards=shards, compute_dtype="bfloat16", cast_once=True,
                  shared_cast=True)
    parts = [cost.cast_shard(numel, trainable, shared, k) for k in range(shards)]
    # The ranks' shards tile [0, numel) in rank order: each its optimizer shard (which only its own
    # OPT writes), the last one also the frozen tail.
    assert parts[0][0] == 0 and parts[-1][1] == numel and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    assert parts[:-1] == [cost.optimizer_shard(trainable, shards, k) for k in range(shards - 1)]
    assert all(cost.cast_shard(numel, trainable, own, k) == (0, numel) for k in range(shards))
    # At 1/G of the host bandwidth each rank casts its largest shard instead of the whole tile:
    # 6 bytes per element (cost.CAST_BYTES_PER_ELEMENT) over AdamW's 28 (hardware.ADAMW_BYTES_PER_PARAM).
    rate = 1e9 / shards * 28 / 6
    largest = max(hi - lo for lo, hi in parts)
    assert cost.cast_time(layer, hw, shared) == pytest.approx(1e-6 + largest / rate, rel=1e-12)
    assert cost.cast_time(layer, hw, own) == pytest.approx(1e-6 + numel / rate, rel=1e-12)


def test_sharded_weights_are_gathered_over_the_network_before_each_copy():
    layer = chain_graph(1, numel=16_000).layers[0]
    hw = spec(network_bytes_per_s=0.5e9, network_latency_s=5e-6)
    rep = Plan(data_parallel=2, nodes=2, compute_dtype="bfloat16")
    shard = Plan(data_parallel=4, nodes=4, host_state="shard", compute_dtype="bfloat16")
    assert cost.weight_gather_bytes(layer, rep) == 0 and cost.weight_gather_time(layer, hw, rep) == 0
    assert cost.weight_gather_bytes(layer, shard) == 3 * 16_000 * 2 // 4  # the other 3 nodes' quarters, BF16
    want = 24_000 / 0.5e9 + 3 * 5e-6
    assert cost.weight_gather_time(layer, hw, shard) == pytest.approx(want, rel=1e-12)
    assert cost.h2d_time(layer, shard, hw) == pytest.approx(cost.h2d_time(layer, rep, hw) + want, rel=1e-12)
    with pytest.raises(ConfigError, match="network_bytes_per_s=0"):
        cost.weight_gather_time(layer, spec(), shard)


@pytest.mark.parametrize("plan", [Plan(data_parallel=4, optimizer_shards=4), Plan(data_parallel=4),
                                  Plan(data_parallel=8, nodes=2, host_state="shard", optimizer_shards=2),
                                  Plan(data_parallel=8, nodes=2, host_state="shard", optimizer_shards=4),
                                  Plan(data_parallel=3, nodes=3, host_state="shard", compute_dtype="bfloat16"),
                                  Plan(data_parallel=8, nodes=2, optimizer_shards=2, compute_dtype="bfloat16",
                                       cast_once=True, shared_cast=True)])
def test_node_memory_shares_the_state_and_rank_budgets_are_exact(plan):
    g = chain_graph(3, numel=[5000, 7000, 3000])
    mem = cost.memory_breakdown(g, plan)
    node = cost.node_memory(g, plan, mem)
    state = mem.master_weights + mem.adam_moments
    assert state == cost.persistent_state_bytes(g)
    ways = plan.nodes if plan.host_state == "shard" else 1
    copies = plan.gpus_per_node // plan.optimizer_shards  # ranks with a copy of their own hold one each
    assert node.persistent == copies * -(-state // ways)
    # Plan.shared_cast: a BF16 tile per layer, whole pages, once per copy, in no rank's arena.
    staging = sum(cost.page_up(n * 2) for n in (5000, 7000, 3000)) if plan.shared_cast else 0
    assert mem.shared_staging == staging and (mem.staging_ring == 0 or not plan.shared_cast)
    assert node.shared_staging == copies * staging
    assert node.per_rank == mem.host_total - state - staging
    assert node.per_rank_pinned == mem.host_pinned - mem.pinned_masters - staging
    assert node.gather_buffers == cost.gather_buffer_bytes(g, plan) == (
        0 if ways == 1 else 2 * cost.page_up(7000 * plan.compute_itemsize))
    assert node.gather_scratch == cost.gather_scratch_bytes(g, plan) == (
        0 if ways == 1 else cost.page_up((ways + 1) * max(hi - lo for n in range(ways)
                                                          for lo, hi in [cost.node_slice(7000, 7000, plan, n)])
                                         * plan.compute_itemsize))
    assert node.total == (node.persistent + node.gather_buffers + node.gather_scratch + node.shared_staging
                          + plan.gpus_per_node * node.per_rank)
    # One rank's breakdown fits its budgets exactly when the node fits: at the node's size, and
    # one byte below it.
    for extra, fits in ((0, True), (-1, False)):
        hw = spec(host_memory_bytes=node.total + extra, pinned_memory_cap_bytes=node.pinned)
        host, pinned = cost.rank_host_budgets(g, plan, hw)
        assert node.fits(hw) is fits
        assert (mem.host_total <= host and mem.host_pinned <= pinned) is fits
