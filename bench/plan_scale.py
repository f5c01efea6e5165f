"""How long planning takes at the scale DESIGN.md targets, and what the planner says there.

Two cases, each run end to end on this CPU with the planner only (no GPU, nothing downloaded):

1. ``dense-120b`` (121.5B parameters, :data:`megatrain.planner.presets.MODEL_PRESETS`) on the H200
   preset with 1.5 TiB of host memory, seq 4096, global batch 8 (the largest power of two whose
   checkpoints fit: under KEEP every sequence's checkpoints, ~9.7 GB each at this size, stay on the
   GPU until the backward).
2. ``llama-2-7b`` at a 512k-token context (524,288) on the GH200 preset, global batch 1.
3. The same with global batch 4 (``--batch-512k``): layer by layer, every sequence's offloaded
   checkpoints would be pinned at once (about 104 GiB each), beyond the GH200's pinned cap; the
   solver gives each sequence a pass of its own and sums the gradients in host accumulators.

For each: wall time of building the meta model, tracing it (torch.export + FLOP counting), solving,
and lowering + verifying + simulating the chosen plan once more; whether a plan fits, and if not
the PlanError's message with the smallest memory that would. DESIGN.md's target is a plan in under
10 s on a 2-core CPU. Tracing exports three blocks and replicates them when the blocks are all
alike (``graph.meta["trace"]`` says whether it did), which is what keeps the 120B case in budget.
At 512k tokens the trace holds no ``S x S`` causal mask (SDPA runs with ``is_causal``) and the LM
head's cross-entropy is chunked, so the largest boundary value is the residual stream.

At 512k tokens the 33 residual checkpoints (4 GiB each) do not fit a 96 GB GPU kept, so the solver
offloads most of them to pinned host memory; whether a plan fits then turns on the working memory
the trace records for one block's local backward (``Layer.work_bytes``, a liveness simulation of
the block's template). Each block's two token-wise regions (input norm, q/k/v projections and
rotary embedding; o projection, second norm and MLP) and the final norm run in checkpointed chunks
of the sequence (Mini-Sequence Transformer, arXiv:2407.15892; ``trace(seq_chunk_bytes=...)``), so a
block holds one chunk's intermediates instead of about 160 GiB of them; its peak is then attention's
backward, with q, k, v, the output and their gradients whole (about 44 GiB). At 4096 tokens the
dense-120b regions are below the chunking threshold and run whole. When no plan fits, this script
prints the planner's answer and reason as they are, with the smallest memory that would work.

Usage::

    .venv/bin/python bench/plan_scale.py [--global-batch 8] [--solver milp] [--skip-512k] [--batch-512k 4]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout where megatrain is not installed
    sys.path.insert(0, str(ROOT))


def run_case(model: str, hardware: str, seq_len: int, global_batch: int, solver: str) -> dict:
    import torch

    from megatrain.errors import PlanError
    from megatrain.ir.graph import BATCH_PRODUCER
    from megatrain.ir.hardware import preset
    from megatrain.planner.lower import lower
    from megatrain.planner.presets import build_meta_model, load_model_config
    from megatrain.planner.simulate import simulate
    from megatrain.planner.solve import SolveRequest, solve
    from megatrain.planner.trace import trace
    from megatrain.planner.verify import verify

    hw = preset(hardware)
    row: dict = dict(model=model, hardware=hw.name, seq_len=seq_len, global_batch=global_batch, solver=solver)
    t = time.perf_counter()
    meta_model = build_meta_model(load_model_config(model), dtype=torch.float32)  # as trace_preset does
    row["build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    graph = trace(meta_model, micro_batch_size=1, seq_len=seq_len, param_dtype=torch.bfloat16).graph
    row["trace_s"] = time.perf_counter() - t
    largest = max(graph.values, key=lambda v: v.nbytes)
    row.update(params=graph.param_count, layers=len(graph.layers), trace=graph.meta.get("trace"),
               largest_value=largest.name, largest_value_bytes=largest.nbytes,
               head_work_bytes=graph.layers[-1].work_bytes)
    # Values that need a gradient (the residual stream) must be kept, offloaded or recomputed by
    # any plan; side values (masks, rotary tables) depend on how the model was traced.
    residual = sum(v.nbytes for v in graph.values if v.producer != BATCH_PRODUCER and v.requires_grad)
    side = sum(v.nbytes for v in graph.values if v.producer != BATCH_PRODUCER and not v.requires_grad)
    row.update(residual_checkpoint_bytes_per_sequence=residual, side_value_bytes_per_sequence=side,
               max_work_bytes=max(layer.work_bytes for layer in graph.layers),
               max_work_layer=max(graph.layers, key=lambda layer: layer.work_bytes).name)
    t = time.perf_counter()
    try:
        sol = solve(SolveRequest(graph, hw, global_batch, "bfloat16"), solver)
    except PlanError as e:
        row["solve_s"] = time.perf_counter() - t
        row.update(fits=False, reason=str(e))
        req = getattr(e, "requirements", None)
        if req is not None:
            row.update(min_gpu_bytes=req.gpu_memory_bytes, min_host_bytes=req.host_memory_bytes,
                       min_pinned_bytes=req.pinned_memory_bytes, obstacle=req.obstacle)
        return row
    row["solve_s"] = time.perf_counter() - t
    t = time.perf_counter()
    sched = lower(sol.graph, sol.plan, carries_updates=sol.schedule.carries_updates)
    verify(sched, sol.graph, hw)
    tl = simulate(sched, sol.graph, hw)
    row["lower_verify_simulate_s"] = time.perf_counter() - t
    p = sol.plan
    row.update(fits=True, micro_batch_size=sol.micro_batch_size, micro_batches=p.micro_batches,
               layer_by_layer=p.layer_by_layer, slots=p.slots,
               prefetch_distance=p.prefetch_distance, grad_ring=p.grad_ring, staging_ring=p.staging_ring,
               resident=len(p.resident), offloaded=sum(a.value == "offload" for a in p.activations),
               recomputed=sum(a.value == "recompute" for a in p.activations), optimizer=p.optimizer.value,
               pinned_activation_bytes=sol.memory.pinned_activations,
               ops=len(sched.ops), candidates=sol.candidates, simulated=sol.simulated,
               optimality_gap=sol.optimality_gap, step_time_s=tl.step_time_s, tokens_per_s=tl.tokens_per_s,
               mfu=tl.mfu, bottleneck=tl.bottleneck.value,
               busy={s.value: f for s, f in tl.busy_fraction.items()},
               gpu_peak_bytes=sol.memory.gpu_peak, host_total_bytes=sol.memory.host_total,
               host_pinned_bytes=sol.memory.host_pinned)
    return row


def report(row: dict) -> str:
    from megatrain.units import GiB  # here, not at the top: importing megatrain imports torch (timed in main)

    out = [f"== {row['model']} ({row['params'] / 1e9:.2f}B parameters, {row['layers']} layers), seq {row['seq_len']:,} "
           f"x global batch {row['global_batch']}, on {row['hardware']}"]
    total = row["build_s"] + row["trace_s"] + row["solve_s"] + row.get("lower_verify_simulate_s", 0.0)
    out.append(f"  wall time: build meta model {row['build_s']:.2f} s, trace {row['trace_s']:.2f} s, "
               f"solve ({row['solver']}) {row['solve_s']:.2f} s"
               + (f", lower+verify+simulate {row['lower_verify_simulate_s']:.2f} s" if row["fits"] else "")
               + f"; total {total:.2f} s (target < 10 s: {'met' if total < 10 else 'missed'}); "
               f"blocks {row['trace']}")
    out.append(f"  checkpoints per sequence: residual stream {row['residual_checkpoint_bytes_per_sequence'] / GiB:.2f} "
               f"GiB, side values (masks, rotary tables) {row['side_value_bytes_per_sequence'] / GiB:.2f} GiB; "
               f"largest working memory {row['max_work_bytes'] / GiB:.2f} GiB ({row['max_work_layer']}); "
               f"largest boundary value {row['largest_value_bytes'] / GiB:.2f} GiB ({row['largest_value']}); "
               f"LM head + loss working memory {row['head_work_bytes'] / GiB:.2f} GiB")
    if row["fits"]:
        out.append(f"  fits: yes. micro-batch {row['micro_batch_size']} x {row['micro_batches']}, "
                   f"{'layer by layer' if row['layer_by_layer'] else 'a pass per micro-batch'}, "
                   f"slots {row['slots']}, "
                   f"prefetch {row['prefetch_distance']}, grad ring {row['grad_ring']}, staging ring "
                   f"{row['staging_ring']}, resident {row['resident']}; checkpoints: {row['offloaded']} offloaded "
                   f"({row['pinned_activation_bytes'] / GiB:.1f} GiB pinned), {row['recomputed']} recomputed; "
                   f"optimizer {row['optimizer']}; {row['ops']} ops; {row['candidates']} "
                   f"candidates, {row['simulated']} simulated, optimality gap {row['optimality_gap']:.2%}")
        out.append(f"  predicted step {row['step_time_s']:.2f} s, {row['tokens_per_s']:,.0f} tokens/s, MFU "
                   f"{row['mfu']:.1%}, bottleneck {row['bottleneck']}; busy "
                   + ", ".join(f"{k} {v:.1%}" for k, v in row["busy"].items()))
        out.append(f"  memory: GPU peak {row['gpu_peak_bytes'] / GiB:.1f} GiB, "
                   f"host {row['host_total_bytes'] / GiB:.1f} "
                   f"GiB ({row['host_pinned_bytes'] / GiB:.1f} GiB pinned)")
    else:
        out.append("  fits: NO. The planner says:")
        out.extend("    " + line for line in row["reason"].splitlines())
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per step for dense-120b (default 8)")
    ap.add_argument("--solver", choices=("milp", "enumerate"), default="milp")
    ap.add_argument("--skip-512k", action="store_true", help="only the dense-120b case")
    ap.add_argument("--batch-512k", type=int, default=4,
                    help="global batch of the third case, 7B at 512k (default 4; 0 skips it)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    import torch  # noqa: F401  (timed separately: importing torch and transformers is not planning)
    import transformers  # noqa: F401

    import_s = time.perf_counter() - t0
    from megatrain.ir.hardware import cpu_name

    print(f"host: {cpu_name()}, {os.cpu_count()} CPUs; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; import {import_s:.2f} s (not counted below)\n")
    rows = [run_case("dense-120b", "H200", 4096, args.global_batch, args.solver)]
    print(report(rows[-1]) + "\n")
    if not args.skip_512k:
        for batch in (1, args.batch_512k) if args.batch_512k else (1,):
            rows.append(run_case("llama-2-7b", "GH200", 524288, batch, args.solver))
            print(report(rows[-1]) + "\n")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
