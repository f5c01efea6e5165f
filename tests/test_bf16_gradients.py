"""BF16 gradients over D2H (issue 11 item 8): where a GPU gradient slot holds one micro-batch's
gradients of BF16 weights, they are BF16 values, so a BF16 slot, D2H and host tile carry them
exactly in half the bytes. The steps must be bitwise those of FP32 gradients, plan otherwise equal."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import megatrain
from megatrain.errors import PlanError
from megatrain.planner import cost
from megatrain.ir.hardware import ADAMW_BYTES_PER_PARAM, ADAMW_WIDENED_BYTES_PER_PARAM
from megatrain.planner.lower import lower
from megatrain.ir.plan import OptimizerPlacement, Plan

from conftest import random_batch, tiny_gpt, tiny_llama
from graphs import chain_graph, spec

ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _train(model, plan: Plan, M: int, steps: int, max_grad_norm: float | None):
    batches = [random_batch(2 * M, 16, 96, seed=s % 3) for s in range(steps)]
    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2, micro_batches=M, optimizer=ADAMW,
                                plan=plan, max_grad_norm=max_grad_norm)
    out = [trainer.step(b) for b in batches]
    trainer.flush()  # a deferred last update belongs in the final state
    return trainer, [r.loss for r in out], [r.grad_norm for r in out]


CASES = [
    # (micro-batches, layer_by_layer): one micro-batch per step, and per-micro-batch passes that
    # sum on the host (ACC widens into the FP32 accumulator).
    pytest.param(1, True, id="M1"),
    pytest.param(2, False, id="per-mb-M2"),
]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt], ids=["llama", "gpt"])
@pytest.mark.parametrize("M,l2l", CASES)
@pytest.mark.parametrize("clip", [None, 0.05], ids=["noclip", "clip"])
def test_bf16_d2h_is_bitwise_fp32_d2h(make, M, l2l, clip):
    torch.manual_seed(7)
    model = make(layers=2)
    twin = copy.deepcopy(model)
    n_layers = 4  # embedding, two blocks, head: all trainable
    plan = Plan(micro_batches=M, layer_by_layer=l2l, compute_dtype="bfloat16",
                optimizer=OptimizerPlacement.NEXT_FORWARD if clip else OptimizerPlacement.DURING_BACKWARD,
                grad_ring=n_layers if clip else 2)
    assert plan.gradient_dtype == "bfloat16" and plan.gradient_itemsize == 2  # the default where exact
    fp32 = replace(plan, d2h_dtype="float32")
    t16, losses16, norms16 = _train(model, plan, M, 6, clip)
    t32, losses32, norms32 = _train(twin, fp32, M, 6, clip)
    assert losses16 == losses32, "BF16 D2H must give bitwise the same losses"
    assert norms16 == norms32, "and the same FP32 gradient norms"
    for a, b in zip(t16.host.blocks, t32.host.blocks):
        assert torch.equal(a, b), "and bitwise the same masters and moments"
    assert [s.item() for s in t16.host.steps] == [s.item() for s in t32.host.steps]
    b16, b32 = t16.executor._buffers, t32.executor._buffers
    assert b16.grads[0].dtype is torch.bfloat16 and b16.ring[0].dtype is torch.bfloat16
    assert b32.grads[0].dtype is torch.float32 and b32.ring[0].dtype is torch.float32
    # The optimizer reads an FP32 accumulator with per-micro-batch passes, else widens a chunk at a
    # time in its kernel's scratch.
    assert (t16.executor.opt_kernel._scratch is not None) == l2l and t32.executor.opt_kernel._scratch is None
    assert losses16[-1] < losses16[0]


def test_plan_refuses_bf16_gradients_where_they_would_round():
    with pytest.raises(PlanError, match="layer-by-layer passes sum"):
        Plan(compute_dtype="bfloat16", micro_batches=2, d2h_dtype="bfloat16")
    with pytest.raises(PlanError, match="FP32 compute"):
        Plan(d2h_dtype="bfloat16")
    with pytest.raises(PlanError, match="use 'float32', 'bfloat16' or None"):
        Plan(compute_dtype="bfloat16", d2h_dtype="float16")
    # The default takes the narrowest exact dtype, and follows the plan through replace().
    assert Plan(compute_dtype="bfloat16", micro_batches=2).gradient_dtype == "float32"  # summed in the slot
    assert Plan(compute_dtype="bfloat16", micro_batches=2, layer_by_layer=False).gradient_dtype == "bfloat16"
    assert Plan(compute_dtype="bfloat16").gradient_dtype == "bfloat16"
    assert Plan().gradient_dtype == "float32"
    assert replace(Plan(), compute_dtype="bfloat16").gradient_dtype == "bfloat16"
    assert Plan(compute_dtype="bfloat16", d2h_dtype="float32").gradient_dtype == "float32"


def test_cost_model_sees_half_the_d2h_and_the_bf16_optimizer_rate():
    g = chain_graph(3, numel=1 << 16)
    hw = spec(d2h_bytes_per_s=1e9, host_optimizer_params_per_s=1e8)
    layer = g.layers[1]
    bf16 = Plan(compute_dtype="bfloat16", staging_ring=1)
    fp32 = replace(bf16, d2h_dtype="float32")
    assert cost.d2h_bytes(layer, bf16) * 2 == cost.d2h_bytes(layer, fp32) == cost.d2h_bytes(layer)
    lat = hw.op_latency_s
    assert cost.d2h_time(layer, hw, bf16) - lat == pytest.approx((cost.d2h_time(layer, hw, fp32) - lat) / 2)
    # OPT steps BF16 tiles widened chunk by chunk: a spec without a measured BF16 rate counts the
    # widened copy through DRAM (34 bytes per parameter where FP32 gradients move 28), as on a
    # many-core host...
    n = layer.trainable_numel
    assert cost.opt_time(layer, hw, fp32) - lat == pytest.approx(n / 1e8)
    assert cost.opt_time(layer, hw, bf16) - lat == pytest.approx(n * ADAMW_WIDENED_BYTES_PER_PARAM / (1e8 * ADAMW_BYTES_PER_PARAM))
    # ...and a measured one replaces it (a team of one on this 2-core VM keeps the chunks in the cache).
    fast = hw.model_copy(update={"host_optimizer_bf16_params_per_s": 1.2e8})
    assert cost.opt_time(layer, fast, bf16) - lat == pytest.approx(n / 1.2e8)
    assert cost.opt_time(layer, fast, fp32) == cost.opt_time(layer, hw, fp32)
    # With per-micro-batch passes ACC widens into the FP32 accumulator, and OPT reads that.
    acc = Plan(compute_dtype="bfloat16", micro_batches=2, layer_by_layer=False)
    assert cost.opt_time(layer, hw, acc) == cost.opt_time(layer, hw)
    assert cost.d2h_bytes(layer, acc) == layer.trainable_numel * 2
    # The pinned ring halves (tiles of whole pages), and so do the GPU gradient slots.
    assert cost.gradient_ring_bytes(g, bf16) * 2 == cost.gradient_ring_bytes(g, fp32)
    m16, m32 = cost.memory_breakdown(g, bf16), cost.memory_breakdown(g, fp32)
    assert m16.gradient_ring * 2 == m32.gradient_ring and m16.gradient_slots * 2 == m32.gradient_slots
    assert m16.gradient_scratch == min(1 << 16, cost.OPT_CHUNK_ELEMENTS) * 4 and m32.gradient_scratch == 0
    assert cost.memory_breakdown(g, acc).gradient_scratch == 0
    # The simulator's D2H ops take the smaller time.
    op = next(o for o in lower(g, bf16).ops if o.kind.value == "D2H")
    assert cost.op_time(op, g, bf16, hw) == cost.d2h_time(g.layers[op.layer], hw, bf16)
