"""Pinned host bytes of solved plans: what the runtime pinned before exact pinning, and what it pins now.

For each model (traced on the meta device at seq 4096, micro-batch 1, BF16 values) on the H100_SXM
preset with global batch 8, the solver's plan for BF16 and FP32 compute, with and without
gradient clipping, and three figures for that same plan:

- ``before``: what the previous runtime pinned. Every ``host_empty`` went through
  ``torch.empty(..., pin_memory=True)``, whose caching host allocator rounds each block up to a
  power of two: a ``[3, numel]`` FP32 block per layer (masters and both moments, in BF16 mode too),
  ``grad_ring`` gradient tiles and ``staging_ring`` staging tiles each of the widest layer, the
  per-layer norms and flags, and one block per offloaded checkpoint.
- ``old plan``: the previous cost model's figure (12 B/param of state when FP32, none when BF16,
  rings of the widest layer), which the planner checked against the pinned cap.
- ``after``: ``cost.memory_breakdown(...).host_pinned``, which is what the runtime pins now,
  exactly (``tests/test_pinned.py`` checks the equality through the fake CUDA layer).
- ``FP32 D2H``: ``after`` for the same plan with FP32 gradients (``Plan(d2h_dtype="float32")``),
  and the D2H bytes of one step with FP32 gradients and with the plan's own (``Plan.gradient_dtype``:
  BF16 where BF16 compute makes it exact), summed over the schedule's D2H ops (``cost.d2h_bytes``).

Usage::

    .venv/bin/python bench/pinned_bytes.py [--models llama-3-8b,llama-2-7b,qwen2.5-3b] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse

from dataclasses import replace

import torch

from megatrain.planner import cost
from megatrain.planner.lower import lower
from megatrain.ir.hardware import preset
from megatrain.ir.plan import ActivationPolicy, Plan
from megatrain.ir.schedule import OpKind
from megatrain.planner.presets import build_meta_model, load_model_config
from megatrain.planner.solve import InfeasibleRequestError, SolveRequest, solve
from megatrain.planner.trace import trace
from megatrain.units import GiB

# Qwen/Qwen2.5-3B config.json, with the LM head untied as megatrain plans it (presets.load_model_config).
QWEN25_3B = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu", hidden_size=2048,
                 intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                 vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                 use_sliding_window=False, sliding_window=32768, max_window_layers=36, attention_dropout=0.0,
                 initializer_range=0.02, tie_word_embeddings=False, use_cache=False)


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def before_bytes(graph, plan: Plan) -> int:
    layers = graph.layers
    width = max(layer.numel for layer in layers)
    gwidth = max(layer.trainable_numel for layer in layers) or 1
    n = len(layers)
    total = sum(pow2(3 * layer.numel * 4) for layer in layers)
    total += plan.grad_ring * pow2(gwidth * 4) + pow2(n * 4) + pow2(n)
    if plan.compute_dtype == "bfloat16":
        total += plan.staging_ring * pow2(width * 2)
    copies = plan.micro_batches if plan.layer_by_layer else 1
    for p in range(n):
        if plan.activation(p) is ActivationPolicy.OFFLOAD:
            total += copies * sum(pow2(graph.values[v].nbytes) for v in graph.checkpoints(p))
    return total


def old_plan_bytes(graph, plan: Plan) -> int:
    layers = graph.layers
    numel = sum(layer.numel for layer in layers)
    total = 12 * numel if plan.compute_dtype == "float32" else 0
    total += plan.grad_ring * max(layer.trainable_numel for layer in layers) * 4
    if plan.compute_dtype == "bfloat16":
        total += plan.staging_ring * max(layer.numel for layer in layers) * 2
    copies = plan.micro_batches if plan.layer_by_layer else 1
    return total + copies * sum(cost.checkpoint_bytes(graph, p) for p in range(len(layers))
                                if plan.activation(p) is ActivationPolicy.OFFLOAD)


def d2h_step_bytes(graph, plan: Plan) -> tuple[int, int]:
    """(pinned bytes, D2H bytes of one step) of ``plan``: its D2H ops each move ``cost.d2h_bytes``."""
    sched = lower(graph, plan)
    moved = sum(cost.d2h_bytes(graph.layers[op.layer], plan) for op in sched.ops if op.kind is OpKind.D2H)
    return cost.memory_breakdown(graph, plan, None, sched).host_pinned, moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3-8b,llama-2-7b,qwen2.5-3b")
    ap.add_argument("--hardware", default="H100_SXM")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    hw = preset(args.hardware)
    print(f"{'model':<12} {'compute':<9} {'clip':<5} {'params':>7} {'state':>8} {'before':>8} {'old plan':>9} "
          f"{'after':>8} {'FP32 D2H':>9} {'D2H/step':>9} {'FP32 D2H/step':>14}  (GiB; state = 12 B/param)")
    for name in args.models.split(","):
        if name == "qwen2.5-3b":
            from transformers import Qwen2Config

            config = Qwen2Config(**{k: v for k, v in QWEN25_3B.items() if k != "model_type"})
        else:
            config = load_model_config(name)
        graph = trace(build_meta_model(config, dtype=torch.bfloat16), micro_batch_size=1, seq_len=4096).graph
        for dtype in args.dtypes.split(","):
            for clip in (False, True):
                head = f"{name:<12} {dtype[:4]:<9} {str(clip):<5} {graph.param_count / 1e9:>6.2f}B " \
                       f"{12 * graph.param_count / GiB:>8.2f}"
                try:
                    plan = solve(SolveRequest(graph, hw, 8, dtype, clip_gradients=clip)).plan
                except InfeasibleRequestError as e:
                    print(f"{head}  no plan fits: {str(e).splitlines()[0][:80]}")
                    continue
                after, moved = d2h_step_bytes(graph, plan)
                after32, moved32 = d2h_step_bytes(graph, replace(plan, d2h_dtype="float32"))
                print(f"{head} {before_bytes(graph, plan) / GiB:>8.2f} {old_plan_bytes(graph, plan) / GiB:>9.2f} "
                      f"{after / GiB:>8.2f} {after32 / GiB:>9.2f} {moved / GiB:>9.2f} {moved32 / GiB:>14.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
