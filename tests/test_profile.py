"""Kernel profiles (megatrain.ir.profile): what a template dispatches, op by op, and what each op costs."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from megatrain.ir.issue import count_launches
from megatrain.ir.profile import Kernel, KernelKind, KernelProfile, profile_template


def _attention_block(q, k, v, w):
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return (a.transpose(1, 2).reshape(a.shape[0], a.shape[2], -1) @ w,)


def test_attention_is_one_fused_kernel_forward_and_one_backward():
    b, h, kv, s, d = 2, 8, 2, 32, 16
    args = [torch.empty(b, h, s, d), torch.empty(b, kv, s, d), torch.empty(b, kv, s, d), torch.empty(h * d, 4)]
    gm = fx.symbolic_trace(_attention_block)
    fwd, bwd = profile_template(gm, args, [True, True, True, True])
    kinds = [k.kind for k in fwd.kernels]
    assert kinds.count(KernelKind.ATTENTION) == 1 and KernelKind.ATTENTION_BACKWARD not in kinds
    assert [k.kind for k in bwd.kernels].count(KernelKind.ATTENTION_BACKWARD) == 1
    att = next(k for k in fwd.kernels if k.kind is KernelKind.ATTENTION)
    # QK^T and PV over every query head (the KV heads broadcast), counted whole: the mask is noted.
    assert att.flops == 2 * (2 * b * h * s * s * d) and att.causal
    # Meta tracing alone runs SDPA's math decomposition: more ops than the GPU dispatches.
    meta_fwd, meta_bwd = count_launches(gm, args, [True] * 4)
    assert fwd.launches < meta_fwd and bwd.launches < meta_bwd
    assert not any(k.kind is KernelKind.MATMUL and k.op == "aten.bmm" for k in fwd.kernels + bwd.kernels)
    # Backward ops issued by autograd are marked; the recompute's are not.
    assert any(k.autograd for k in bwd.kernels) and not any(k.autograd for k in fwd.kernels)


def test_bytes_count_distinct_elements_and_views_launch_nothing():
    def f(x, w):
        y = x.view(4, 256)  # a view: dispatched, no kernel
        return ((y * w) + 1.0,)  # w broadcast over the rows: its 256 elements read once

    fwd, _ = profile_template(fx.symbolic_trace(f), [torch.empty(1024), torch.empty(256)], [False, False])
    by_op = {k.op: k for k in fwd.kernels}
    assert by_op["aten.view"].kind is KernelKind.NONE and by_op["aten.view"].nbytes == 0
    assert by_op["aten.mul"].kind is KernelKind.MEMORY and by_op["aten.mul"].nbytes == 4 * (1024 + 256 + 1024)
    assert by_op["aten.add"].nbytes == 4 * (1024 + 1024)


def test_matmul_flops_and_scaling():
    fwd, bwd = profile_template(fx.symbolic_trace(lambda x, w: (x @ w,)), [torch.empty(8, 16), torch.empty(16, 32)],
                                [True, True])
    mm = [k for k in fwd.kernels if k.kind is KernelKind.MATMUL]
    assert [k.flops for k in mm] == [2 * 8 * 16 * 32]
    assert sum(k.flops for k in bwd.kernels) == 3 * 2 * 8 * 16 * 32  # recompute, dX, dW
    big = bwd.scaled(3)
    assert big.flops == 3 * bwd.flops and big.memory_bytes == 3 * bwd.memory_bytes and big.launches == bwd.launches
    assert bwd.scaled(1) is bwd


def test_traced_llama_block_moves_its_elementwise_bytes():
    """A traced Llama block (BF16, FP32 RMSNorm, rotary, SwiGLU): its profile's FLOPs are the tracer's,
    and its memory-bound traffic per token is what the review of issue 39 counted at 1B scale
    (0.3 MB forward, 1.0 MB backward per token at hidden 2048), here proportional to the hidden size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatrain.planner.trace import trace

    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=1024, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    g = trace(model, micro_batch_size=2, seq_len=64, param_dtype=torch.bfloat16).graph
    block = g.layers[1]
    assert block.fwd_profile.flops == block.fwd_flops
    assert block.fwd_profile.launches < block.fwd_launches and block.bwd_profile.launches < block.bwd_launches
    tokens = 2 * 64
    fwd_per_token = block.fwd_profile.memory_bytes / tokens
    bwd_per_token = block.bwd_profile.memory_bytes / tokens
    # 0.3 MB and 1.0 MB per token at hidden 2048 and FFN 8192: a 256-wide block with the same ratios
    # moves an eighth of that (every element-wise tensor is [tokens, hidden] or [tokens, ffn]).
    assert 0.3e6 / 8 * 0.8 < fwd_per_token < 0.3e6 / 8 * 1.25
    assert 1.0e6 / 8 * 0.8 < bwd_per_token < 1.0e6 / 8 * 1.25
    assert all(layer.fwd_profile is block.fwd_profile for layer in g.layers[1:-1])  # one per template


def test_profile_kernels_are_plain_data():
    k = Kernel("aten.mm", KernelKind.MATMUL, flops=10, nbytes=4)
    with pytest.raises(Exception):
        k.flops = 3  # frozen
    assert KernelProfile((k, Kernel("aten.view", KernelKind.NONE))).launches == 2
