"""The ``megatrain`` command line.

``megatrain plan`` traces a model on the meta device, solves for a plan on a hardware spec, and
reports whether it fits, where the memory goes and how fast a step is predicted to run.

    megatrain plan --model llama-3-8b --hardware H100_SXM --seq-len 4096 --global-batch 64 --out plan/
    megatrain plan --model llama-3-70b --hardware H100_SXM --seq-len 4096 --global-batch 64 \
        --gpus-per-node 8 --nodes 2 --interconnect nvlink4 --network ndr-8x400g

Exit codes of ``plan``: 0 a plan fits; 3 no plan fits (the PlanError message says the least GPU and
host memory any plan needs, which layer is the obstacle, and each change that would fit); 2 invalid
input (an unknown model or hardware, a model that is not a causal decoder, a bad option, an ``--out``
that is a file), with one ``error: <message>`` line on stderr. ``megatrain --version`` prints the
version.

``megatrain train`` trains a model from a YAML or JSON config file whose every field is also a
flag (flags win); see :mod:`megatrain.train`.

    megatrain train --config run.yaml --max-steps 2000 --output-dir runs/a

Exit codes of ``train``: 0 the run finished (or had finished already), or SIGINT/SIGTERM stopped
it after saving a checkpoint; 2 any error (``error: <message>`` on stderr: a bad config, model,
data or checkpoint, not enough host memory, a full disk, an output_dir another run holds, a
non-finite step with ``nonfinite: stop``, too many skipped steps in a row); 130 (SIGINT) or 143
(SIGTERM) an interrupt before training started, or a second one during it (README, "Failures").

The plan table is plain aligned text, the same on every install: megatrain does not depend on a
terminal-formatting package, and tests read the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import sys
from pathlib import Path
from typing import Sequence

# Only what parsing needs is imported here: torch, transformers and the planner load when a command
# runs (`megatrain --help` imports no torch; tests/test_cli.py checks it).
from megatrain import __version__
from megatrain.errors import ConfigError, MegatrainError, PlanError
from megatrain.units import GiB


NO_FIT = 3
"""``megatrain plan``'s exit code when no plan fits: an answer, not an error (errors exit 2, as argparse's do)."""


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse would print its usage and exit itself; every error of this CLI is instead one `error:` line, exit 2.
    def error(self, message: str):
        raise _UsageError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="megatrain", description="Train large language models on one GPU with all persistent "
                                              "state in host memory.")
    p.add_argument("--version", action="version", version=f"megatrain {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="plan a model on a GPU and host (or G GPUs x M nodes), and predict its step",
                          description="Required: --model, --hardware, --seq-len and --global-batch; or --config "
                                      "RUN (and --hardware where RUN names none). "
                                      "Trace a model on the meta device, solve for a plan and report memory "
                                      "and predicted speed; with --gpus-per-node/--nodes, one rank's plan, the "
                                      "node's host memory, the host-state choice across nodes and the global "
                                      "tokens/s. With --config, the plan `megatrain train --config` runs with the "
                                      "same file (and --gpus-per-node/--nodes for torchrun's ranks): its "
                                      "schedule.json is the one the run writes to its output_dir. Exit code 0 when "
                                      "it fits, 3 when it does not, 2 on an error (one `error:` line).")
    _add_plan_flags(plan)
    train = sub.add_parser("train", help="train a causal LM from a config file and flags",
                           description="Train a causal LM with all persistent state in host memory. Settings "
                                       "come from --config (YAML or JSON) and the flags below, which override "
                                       "it; an optional setting takes 'none' on the command line (null in "
                                       "the file). Exit code 0 when the run finishes or a signal stops it after a "
                                       "checkpoint, 2 on any error. Data parallel: run it under torchrun "
                                       "(torchrun --standalone --nproc-per-node N --no-python megatrain train "
                                       "...); global_batch is then the rows of a step over all ranks, and "
                                       "rank 0 writes the outputs. output_dir/schedule.json is the schedule the run executes, "
                                       "byte for byte what `megatrain plan --config` with the same file writes.",
                           epilog="Environment: MEGATRAIN_HOST_ADAM=auto|torch|deepspeed chooses the host AdamW "
                                  "kernel (auto, the default: torch's fused AdamW, which releases the GIL while it "
                                  "runs; deepspeed: DeepSpeed's CPU Adam from pip install megatrain[deepspeed], "
                                  "which holds the GIL and so stalls the GPU work's issue while it runs; its op is "
                                  "compiled once per environment, with a line that says so).")
    _add_train_flags(train)
    return p


def _add_plan_flags(plan: argparse.ArgumentParser) -> None:
    """``megatrain plan``'s flags."""
    from megatrain.ir.hardware import NVME_ARRAYS, PRESETS as HARDWARE_PRESETS
    from megatrain.optim import OPTIMIZERS
    from megatrain.planner.presets import preset_names

    plan.add_argument("--config", type=Path, default=None, metavar="RUN",
                      help="a megatrain train settings file (YAML or JSON): plan what `megatrain train --config RUN` "
                           "runs, from its model, seq_len, global_batch, micro_batch_size, device, max_grad_norm, "
                           "hardware (or --hardware), nvme_dir, host_memory and host_state; instead of --model, "
                           "--seq-len, --global-batch, --compute-dtype and --clip-gradients")
    plan.add_argument("--model", default=None,
                      help=f"required without --config: a preset ({preset_names()}) or the path of a Hugging Face "
                           "config.json")
    plan.add_argument("--hardware", default=None,
                      help=f"required (with --config, where the run names none): a hardware preset "
                           f"({', '.join(HARDWARE_PRESETS)}) or the path of a HardwareSpec JSON file (with --config: "
                           "replaces the run's)")
    plan.add_argument("--seq-len", type=int, default=None, help="required without --config: tokens per sequence")
    plan.add_argument("--global-batch", type=int, default=None, help="required without --config: sequences per optimizer step")
    plan.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default=None,
                      help="dtype the GPU computes in (default bfloat16: the model traced with BF16 "
                           "parameters, activations and checkpoints in BF16, FP32 masters on the host, as "
                           "megatrain.compile traces it)")
    plan.add_argument("--clip-gradients", action="store_true",
                      help="the run clips gradients by global norm: optimizer steps wait for every "
                           "gradient and run in the next step's forward (one host gradient tile per layer)")
    plan.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=None,
                      help="host optimizer whose state the plan counts, in bytes per parameter: "
                           + ", ".join(f"{name} ({spec.state_bytes_per_param})" for name, spec in OPTIMIZERS.items())
                           + " (default adamw; megatrain.optim)")
    plan.add_argument("--templates", choices=("eager", "compiled"), default=None,
                      help="how the layer templates run: eager, or compiled once each with torch.compile "
                           "(inductor) when the trainer is built (default eager; with --config the run's); the "
                           "plan records it (schedule.json: plan.templates)")
    plan.add_argument("--cuda-graphs", choices=("false", "true", "auto"), default=None,
                      help="replay each compute op from a CUDA graph captured per template and weight slot: "
                           "false (the default), true, or auto: on where the step is issue-bound on the hardware "
                           "(the issuing thread's launches take at least half the compute ops' GPU time)")
    plan.add_argument("--solver", choices=("milp", "enumerate"), default="milp",
                      help="resident-layer selection: MILP knapsack (default) or greedy")
    plan.add_argument("--out", type=Path, default=None,
                      help="write schedule.json, trace.json (Chrome trace) and timeline.png here")
    plan.add_argument("--nvme", default=None, metavar="ARRAY",
                      help=f"attach an NVMe array to the hardware ({', '.join(NVME_ARRAYS)}: striped "
                           "Micron 7450 PRO / Samsung PM1743 drives, datasheet rates); when the state does not "
                           "fit in host memory the planner puts gradient tiles, Adam moments and masters of "
                           "some layers on it and reports them and the step time with their traffic")
    plan.add_argument("--host-memory", default=None, metavar="SIZE",
                      help="replace the hardware's host memory, e.g. 512GiB or 1.5TiB (the pinned cap becomes "
                           "90%% of it)")
    plan.add_argument("--reference", choices=("bfloat16",), default=None,
                      help="preference and RL training: hold a frozen BF16 copy of the weights on the host for the "
                           "reference model (2 bytes per parameter, megatrain.rl.Reference); the plan leaves it room "
                           "and the host memory table shows it (default: none, reference log-probabilities "
                           "precomputed before training)")
    plan.add_argument("--gpus-per-node", type=int, default=1, metavar="G",
                      help="data parallel: GPUs per node, each a rank training its own share of the global batch; "
                           "the ranks of a node share one copy of the host state and split its optimizer work "
                           "(default 1)")
    plan.add_argument("--nodes", type=int, default=1, metavar="M",
                      help="data parallel: nodes of --gpus-per-node GPUs each (default 1); with several the planner "
                           "replicates the host state on every node when it fits, else shards it (1/M per node, "
                           "weights all-gathered over the network), and says why")
    plan.add_argument("--interconnect", default=None, metavar="LINK",
                      help="the GPUs' link within a node for the gradient all-reduce (nvlink4: NVLink 4 + NVSwitch, "
                           "450 GB/s; pcie5: PCIe Gen5, 40 GB/s NCCL bus bandwidth); needed with --gpus-per-node > 1 "
                           "unless the hardware JSON sets intra_node_bytes_per_s")
    plan.add_argument("--network", default=None, metavar="NET",
                      help="the network between nodes, per node (ndr-8x400g: 8x 400 Gb/s InfiniBand NDR/RoCE, "
                           "400 GB/s; 400g-1nic: one 400 Gb/s NIC, 50 GB/s); needed with --nodes > 1 unless the "
                           "hardware JSON sets network_bytes_per_s")


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    """``--config`` plus one flag per TrainConfig field, generated so that none is forgotten. Flags
    are strings that pydantic validates (its errors name the field); absent flags leave the file's
    value alone."""
    import typing

    from megatrain.train import TrainConfig

    parser.add_argument("--config", type=Path, default=None, help="YAML (.yaml/.yml) or JSON file of the settings")
    for name, field in TrainConfig.model_fields.items():
        kw: dict = {"dest": name, "default": argparse.SUPPRESS, "metavar": name.upper()}
        args = typing.get_args(field.annotation)
        if typing.get_origin(field.annotation) is typing.Literal:
            kw["choices"] = list(args)
            kw.pop("metavar")
        kw["help"] = (field.description + _default_note(field)).replace("%", "%%")
        parser.add_argument("--" + name.replace("_", "-"), **kw)


def _default_note(field) -> str:
    """`` (default: X)`` after a flag's help, unless its description already says what the default
    does (a ``(default: ...)`` or ``null: ...`` of its own); ``(required)`` for a required field."""
    if field.is_required():
        return "" if "(default" in field.description else " (required)"
    if field.default is None and ("(default" in field.description or "null" in field.description):
        return ""
    d = field.default
    return f" (default: {'none' if d is None else str(d).lower() if isinstance(d, bool) else d})"


def hardware_sizes(hw) -> str:
    """``GPU 79.65 GiB, host 2.00 TiB`` (and the NVMe tier's capacity): the sizes a plan is for."""
    from megatrain.units import human_bytes

    return (f"GPU {human_bytes(hw.gpu_memory_bytes)}, host {human_bytes(hw.host_memory_bytes)}"
            + (f", NVMe {human_bytes(hw.nvme_capacity_bytes)}" if hw.has_nvme else ""))


def _grad_dtype(plan) -> str:
    # BF16 where it is exact (one micro-batch's gradients per slot, BF16 compute): Plan.gradient_dtype.
    return "BF16" if plan.gradient_dtype == "bfloat16" else "FP32"


def _gib(n: float) -> str:
    # The tables name the unit in their titles ("host memory (GiB)"), so numbers only.
    return f"{n / GiB:,.2f}"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "-"


def _section(title: str, rows: list[tuple[str, str, str]]) -> list[str]:
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    out = [title]
    for a, b, c in rows:
        out.append(f"  {a:<{w0}}  {b:>{w1}}" + (f"  {c}" if c else ""))
    return out


def format_report(planned, hw, *, model: str) -> str:
    """The plan table of a :class:`megatrain.planner.front.PlannedModel`: fit, host and GPU memory
    in GiB, knobs, predicted step and streams; with ``planned.nvme`` (the solver's
    :class:`megatrain.planner.nvme.NvmeSolution`) also what went to NVMe and the step time with the
    NVMe traffic (the host memory table subtracts what moved and adds the I/O buffers, so its
    total is what stays in RAM). With ``planned.topology`` (a
    :class:`megatrain.planner.topology.TopologySolution`) the tables are one rank's and a "data
    parallel" section gives the node's host memory, the host-state choice with its reason, and the
    step and tokens/s of all ranks. The front door's other decisions (NVMe layers in a directory,
    the host state) follow the header."""
    plan, mem, tl, g = planned.plan, planned.memory, planned.timeline, planned.graph
    solution, nvme, topology = planned.solution, planned.nvme, planned.topology
    if nvme is not None:  # the breakdown with nothing on NVMe: the placement's rows say what moved
        mem = nvme.memory
    n = len(g.layers)
    fits = topology.fits if topology is not None else mem.fits(hw) if nvme is None else nvme.fits
    how = (f"solved ({solution.method}) in {solution.solve_time_s:.2f} s: {solution.candidates} candidates, "
           f"{solution.simulated} simulated" if solution is not None else
           "the default plan (megatrain train on the CPU backend)" if planned.options.device == "cpu"
           else "a given plan")
    lines = [f"megatrain plan: {model} ({g.param_count / 1e9:.3g}B parameters, {n} layers) on {hw.name} "
             f"({hardware_sizes(hw)})",
             f"  seq_len {g.seq_len} x global batch "
             f"{plan.micro_batches * planned.options.micro_batch_size * plan.data_parallel}, "
             f"{plan.compute_dtype} compute; traced in {planned.trace_s:.2f} s, {how}",
             *(f"  {line}" for line in planned.decisions),
             "", f"fits: {'yes' if fits else 'NO'}", ""]
    lines += _host_rows(planned, mem, hw)
    lines.append("")
    lines += _gpu_rows(plan, mem, hw)
    lines.append("")
    lines += _plan_rows(planned, n)
    lines.append("")
    lines += _step_rows(plan, tl, hw, g, mem)
    if nvme is not None:
        from megatrain.planner.nvme import describe

        lines.append("")
        lines += _section("NVMe tier", describe(nvme))
    if topology is not None:
        lines.append("")
        lines += _section("data parallel", _topology_rows(topology))
    return "\n".join(lines)


def _host_rows(planned, mem, hw) -> list[str]:
    """format_report's host memory section (``mem``: the breakdown with nothing on NVMe)."""
    plan, nvme, topology = planned.plan, planned.nvme, planned.topology
    ranked = " of one rank, the whole state counted" if plan.data_parallel > 1 else ""
    total, pinned = mem.host_total, mem.host_pinned
    moved = []  # the NVMe placement's change to the rows above: the total is what stays in RAM
    if nvme is not None and not nvme.placement.empty:
        p = nvme.placement
        total, pinned = p.host_total(mem), p.host_pinned(mem)
        moved = [("moved to NVMe", "-" + _gib(p.host_freed), "gradient tiles, moments, masters: NVMe tier below"),
                 ("NVMe I/O buffers", _gib(p.buffer_bytes), f"of which {_gib(p.pinned_buffer_bytes)} pinned")]
    sharded = topology is not None and plan.host_state == "shard"
    return _section(f"host memory{ranked} (GiB)", [
        ("FP32 master weights", _gib(mem.master_weights), ""),
        (f"{plan.optimizer_spec.label} moments (FP32 x{len(plan.optimizer_spec.states)})", _gib(mem.adam_moments),
         ""),
        ("gradient ring (pinned)", _gib(mem.gradient_ring), f"{plan.grad_ring} tiles in {_grad_dtype(plan)}"),
        ("staging ring (pinned)", _gib(mem.staging_ring + mem.shared_staging),
         ("one BF16 tile per layer, shared by the node's ranks: each casts its shard once per step"
          if plan.shared_cast else "one BF16 tile per layer: each cast once per step" if plan.cast_once
          else f"{plan.staging_ring} BF16 tiles")
         if plan.compute_dtype == "bfloat16" else "unused with FP32 compute"),
        ("pinned activations", _gib(mem.pinned_activations), ""),
        *([("BF16 reference weights (frozen)", _gib(mem.reference_weights), "the reference model, pageable")]
          if mem.reference_weights else []),
        *moved,
        # Sharded across nodes no node holds the whole state: the node's share is in "data parallel".
        ("total", _gib(total), f"the whole state; a node holds 1/{plan.nodes} of the masters and moments: "
                               "'host memory per node' below" if sharded
         else f"of {_gib(hw.host_memory_bytes)} ({_pct(total, hw.host_memory_bytes)})"),
        ("of which pinned", _gib(pinned),
         f"of cap {_gib(hw.pinned_memory_cap_bytes)} ({_pct(pinned, hw.pinned_memory_cap_bytes)})"),
    ])


def _gpu_rows(plan, mem, hw) -> list[str]:
    """format_report's GPU memory section."""
    from megatrain.planner import cost

    return _section(f"GPU memory{' of one rank' if plan.data_parallel > 1 else ''} (GiB)", [
        ("weight slots", _gib(mem.weight_slots), f"{cost.weight_slot_count(plan)} slots in {plan.compute_dtype}"),
        ("gradient slots", _gib(mem.gradient_slots), _grad_dtype(plan)),
        ("buffers", _gib(mem.buffers), ""),
        ("activations peak", _gib(mem.activations_peak), "checkpoints + boundary gradients"),
        ("working peak", _gib(mem.working_peak), "largest layer transient"),
        ("reserve", _gib(mem.reserve), "held for CUDA beyond the plan's tensors, so the step does not run out: "
         + (mem.reserve_parts.describe() if mem.reserve_parts is not None else "CUDA context, workspaces, allocator")),
        *([("CUDA graphs", _gib(mem.graph_pool), "the graphs' memory pool and static buffers")]
          if mem.graph_pool else []),
        ("peak", _gib(mem.gpu_peak),
         f"of {_gib(hw.gpu_memory_bytes)} ({_pct(mem.gpu_peak, hw.gpu_memory_bytes)}): the rows above, with "
         "activations and working memory at their busiest instant and the reserve included; the solver fills the "
         "rest with slots, resident layers and checkpoints"),
    ])


def _plan_rows(planned, n: int) -> list[str]:
    """format_report's plan section (``n``: the graph's layers)."""
    plan, g = planned.plan, planned.graph
    resident = sorted(plan.resident)
    return _section("plan", [
        ("micro-batch size", str(planned.options.micro_batch_size), f"{plan.micro_batches} micro-batches per step"),
        ("weight slots", str(plan.slots), "streaming"),
        ("prefetch distance", str(plan.prefetch_distance), "layer visits ahead"),
        ("resident layers", f"{len(resident)}/{n}", _short_list([g.layers[i].name for i in resident])),
        ("gradient ring", str(plan.grad_ring), f"host tiles; gradients leave the GPU in {_grad_dtype(plan)}"),
        ("staging ring", "per layer" if plan.cast_once else str(plan.staging_ring),
         "host tiles shared by the node's ranks" if plan.shared_cast else "host tiles"),
        ("activations", _policy_counts(plan, n), "checkpoints kept on the GPU / offloaded to pinned host "
                                                  "memory / recomputed in the backward"),
        ("layer by layer", "yes" if plan.layer_by_layer else "no",
         "all micro-batches per weight load" if plan.layer_by_layer
         else "a pass per micro-batch, gradients summed in host accumulators"),
        ("optimizer", plan.optimizer.value.replace("_", " "), f"host {plan.optimizer_spec.settings.__name__}"),
        ("layer templates", plan.templates, "each compiled once with torch.compile (inductor) when the trainer is "
                                            "built" if plan.templates == "compiled" else
                                            "the traced graphs, one kernel per aten op"),
        ("CUDA graphs", "on" if plan.cuda_graphs else "off",
         "each compute op replayed from a graph per template and weight slot" if plan.cuda_graphs else ""),
    ])


def _step_rows(plan, tl, hw, g, mem) -> list[str]:
    """format_report's predicted step section (``tl``: the timeline, None where ``hw`` does not
    rate every stream), with a vision-language model's vision tower."""
    from megatrain.ir.schedule import Stream

    lines: list[str] = []
    if tl is None:
        lines += _section("predicted step", [("step time", "-", f"{hw.name} does not rate every stream this plan "
                                                                 "uses (a GPU, its links, an NVMe tier)")])
    else:
        busy = tl.busy_fraction
        lines += _section("predicted step", [
            ("step time", f"{tl.step_time_s:,.4g} s", ""),
            ("tokens/s" + (" per rank" if plan.data_parallel > 1 else ""), f"{tl.tokens_per_s:,.0f}",
             f"{tl.tokens_per_step:,} tokens per step"),
            ("MFU", f"{tl.mfu:.1%}",
             f"model FLOPs (3 x traced forward, recompute not counted) / {plan.compute_dtype} peak"),
            ("bottleneck", tl.bottleneck.value, "busiest stream"),
        ] + [(f"{s.value} busy", f"{busy.get(s, 0.0):.1%}", f"{tl.busy_s.get(s, 0.0):,.4g} s") for s in Stream])
        lines += _vision_rows(g, tl, mem)
    return lines


def _vision_rows(g, tl, mem) -> list[str]:
    """A vision-language model's "vision tower" section: its blocks' share of the parameters, host
    state and predicted time (:func:`megatrain.planner.trace.vlm.vision_share`); none for others."""
    from megatrain.planner.trace.vlm import vision_share

    v = vision_share(g, tl, mem)
    if v is None:
        return []
    return [""] + _section(f"vision tower ({g.meta['vision_container']})", [
        ("layers", f"{v.layers}/{v.total_layers}", "vision blocks, streamed like the decoder's"),
        ("parameters", f"{v.params:,}", f"{_pct(v.params, v.total_params)} of the model's"),
        ("host state", _gib(v.host_bytes), f"GiB of masters and moments ({_pct(v.host_bytes, v.total_host_bytes)})"),
        ("compute time", f"{v.compute_s:,.4g} s", f"{_pct(v.compute_s, v.total_compute_s)} of the compute "
                                                  "stream's forward, recompute and backward time"),
        ("weight copies", f"{v.h2d_s:,.4g} s", f"{_pct(v.h2d_s, v.total_h2d_s)} of the H2D time"),
    ])


def _topology_rows(ts) -> list[tuple[str, str, str]]:
    from megatrain.ir.schedule import Stream

    plan, node, hw, tl = ts.plan, ts.node, ts.hardware, ts.solution.timeline
    choice = ts.host_state
    comm = tl.busy_s.get(Stream.COMM, 0.0)
    return [
        ("ranks", f"{plan.gpus_per_node} x {plan.nodes}", f"GPUs per node x nodes = {plan.data_parallel}"),
        ("intra-node link", f"{hw.intra_node_bus_bytes_per_s / 1e9:g} GB/s" if plan.gpus_per_node > 1 else "-",
         "collective bus bandwidth"),
        ("network", f"{hw.network_bytes_per_s / 1e9:g} GB/s" if plan.nodes > 1 else "-", "per node, one direction"),
        ("host state", choice.mode, choice.reason),
        ("host memory per node", _gib(node.total),
         f"GiB of {_gib(hw.host_memory_bytes)} ({_pct(node.total, hw.host_memory_bytes)})"),
        ("pinned per node", _gib(node.pinned),
         f"GiB of cap {_gib(hw.pinned_memory_cap_bytes)} ({_pct(node.pinned, hw.pinned_memory_cap_bytes)})"),
        ("step time", f"{tl.step_time_s:,.4g} s", "every rank, in lockstep"),
        ("global tokens/s", f"{ts.global_tokens_per_s:,.0f}", f"{plan.data_parallel} ranks x {tl.tokens_per_s:,.0f}"),
        ("bottleneck", tl.bottleneck.value, "busiest stream of a rank"),
        ("collectives busy", f"{comm:,.4g} s", "per step: " + (
            "hierarchical reduce-scatter of the FP32 gradients over every rank, the weight gathers' barriers "
            "and the node's share of their host copies"
            if plan.host_state == "shard" else
            "reduce-scatter of the FP32 gradients in the node" if plan.gradient_reduction == "reduce_scatter"
            else "hierarchical all-reduce of the FP32 gradients") + (
            "" if plan.host_state == "shard" else ", the node's barriers after its shards' updates"
            + (" and shared casts" if plan.shared_cast else ""))),
        ("weight all-gathers", f"{choice.network_s_per_step:,.4g} s", "per step, on the H2D path (shard only)"),
    ]


def _short_list(names: list[str], k: int = 4) -> str:
    if len(names) <= k:
        return ", ".join(names)
    return ", ".join(names[:k]) + f", ... ({len(names) - k} more)"


def write_outputs(planned, out: Path, model: str) -> list[Path]:
    """DIR/schedule.json (the steady-state train schedule that runs), and with a prediction
    DIR/trace.json (Chrome trace) and DIR/timeline.png; returns the paths.

    Raises:
        ImportError: matplotlib is not installed (after the two JSON files are written).
    """
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "schedule.json"]
    planned.schedules.steady.save(paths[0])
    tl = planned.timeline
    if tl is None:
        return paths
    paths += [out / "trace.json", out / "timeline.png"]
    paths[1].write_text(json.dumps(tl.to_chrome_trace()))
    tl.save_png(paths[2], title=(
        f"{model}: predicted step {tl.step_time_s:.4g} s, {tl.tokens_per_s:,.0f} tokens/s, MFU {tl.mfu:.1%}, "
        f"bottleneck {tl.bottleneck.value} ({tl.hardware})"))
    return paths


def _policy_counts(plan, n_layers: int) -> str:
    from megatrain.ir.plan import ActivationPolicy

    counts = {p: 0 for p in ActivationPolicy}
    for layer in range(n_layers - 1):  # the last layer's output is the loss: no checkpoint
        counts[plan.activation(layer)] += 1
    return " / ".join(f"{counts[p]} {p.value}" for p in ActivationPolicy)


def _progress(line: str) -> None:
    """A progress line of ``megatrain plan`` on stderr (stdout is the report), shown at once."""
    print(f"megatrain plan: {line}", file=sys.stderr, flush=True)


def _plan_command(args: argparse.Namespace) -> int:
    from megatrain.planner import front

    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a file; --out names a directory for schedule.json, trace.json and "
                          "timeline.png: give a directory (new or existing)")
    if args.gpus_per_node < 1 or args.nodes < 1:
        raise _UsageError(f"megatrain plan: --gpus-per-node ({args.gpus_per_node}) and --nodes ({args.nodes}) must be >= 1")
    ranks = args.gpus_per_node * args.nodes
    if ranks > 1 and args.nvme is not None:
        raise _UsageError("megatrain plan: --nvme with several GPUs is not planned yet; plan one GPU with --nvme, "
                          "or several without it")
    request, model, hw, summary, tracing = (_run_request if args.config is not None else _flags_request)(args, ranks)
    if args.reference is not None:
        request = dataclasses.replace(request, storage=dataclasses.replace(request.storage, reference=args.reference))

    def traced(graph, seconds: float) -> None:
        _progress(f"traced {len(graph.layers)} layers in {seconds:.1f} s; "
                  + ("lowering the default plan" if request.plan == "default" else
                     f"solving ({request.solver}"
                     + (f", {args.gpus_per_node} x {args.nodes} ranks: replicate or shard" if ranks > 1 else "")
                     + (", then NVMe placement and read-ahead" if hw.has_nvme and ranks == 1 else "") + ")")
                  + " ...")

    _progress(tracing)
    try:
        planned = front.plan(dataclasses.replace(request, on_traced=traced))
    except PlanError as e:
        print(f"megatrain plan: {model} on {hw.name} ({hardware_sizes(hw)}), {summary}")
        print("\nfits: NO\n")
        print(str(e))
        return NO_FIT
    # Planned once, by the front door megatrain train plans with: this is the schedule that runs.
    print(format_report(planned, hw, model=model))
    if args.out is not None:
        try:
            paths = write_outputs(planned, args.out, model)
        except OSError as e:
            raise ConfigError(f"--out {args.out}: cannot write the plan's files ({e}); give a writable "
                              "directory") from None
        except ImportError as e:  # matplotlib is an optional dependency (megatrain[plot])
            print(f"\nwrote {args.out / 'schedule.json'}, {args.out / 'trace.json'}; not timeline.png: {e}")
        else:
            print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


def _spec(args: argparse.Namespace, hardware):
    """The hardware spec, with --nvme/--host-memory and --interconnect/--network attached."""
    from megatrain.ir.hardware import load_hardware

    hw = load_hardware(hardware)
    if args.nvme is not None or args.host_memory is not None:
        from megatrain.planner.nvme import parse_bytes, with_nvme

        hw = with_nvme(hw, args.nvme, None if args.host_memory is None else parse_bytes(args.host_memory))
    if args.interconnect is not None or args.network is not None:
        from megatrain.planner.topology import with_topology

        hw = with_topology(hw, args.interconnect, args.network)
    return hw


def _flags_request(args: argparse.Namespace, ranks: int):
    """``(request, model name, spec, summary, progress line)`` from --model, --hardware, --seq-len, --global-batch:
    the solver's plan (micro-batch size included) for a GPU of that spec."""
    from megatrain.models import check_causal_decoder
    from megatrain.planner.front import Topology
    from megatrain.planner.presets import build_meta_model, load_model_config
    from megatrain.product.planning import plan_request
    from megatrain.planner.trace.vlm import batch_names

    missing = [f"--{n.replace('_', '-')}" for n in ("model", "hardware", "seq_len", "global_batch")
               if getattr(args, n) is None]
    if missing:
        raise _UsageError(f"megatrain plan: the arguments {', '.join(missing)} are required (or --config RUN, a "
                          "megatrain train run's settings)")
    if args.seq_len < 1 or args.global_batch < 1:
        raise _UsageError(f"megatrain plan: --seq-len ({args.seq_len}) and --global-batch ({args.global_batch}) "
                          "must be >= 1")
    from megatrain.bounds import MAX_GLOBAL_BATCH, MAX_SEQ_LEN

    for flag, value, limit in (("--seq-len", args.seq_len, MAX_SEQ_LEN), ("--global-batch", args.global_batch,
                                                                           MAX_GLOBAL_BATCH)):
        if value > limit:
            raise _UsageError(f"megatrain plan: {flag} {value:,} is more than megatrain plans ({limit:,}; "
                              "megatrain.bounds says why); give a smaller one")
    dtype = args.compute_dtype or "bfloat16"
    hw = _spec(args, args.hardware)
    if ranks > 1 and args.global_batch % ranks == 0:  # (a batch the ranks cannot split: no plan fits, exit 3)
        from megatrain.planner import cost
        from megatrain.ir.plan import Plan

        cost.count_reduce_time(hw, Plan(data_parallel=ranks, nodes=args.nodes))  # a missing link names its flag
    config = load_model_config(args.model)
    check_causal_decoder(config, args.model)
    import torch

    # What compile traces for this model: built in FP32, traced in the compute dtype.
    # A vision-language model is planned with its images through its vision tower: LLaVA one per
    # row, Qwen2-VL one 448x448 image per row (trace.qwen_vl.row_grid).
    names = batch_names(config)
    request = plan_request(build_meta_model(config, dtype=torch.float32), seq_len=args.seq_len,
                           global_batch=args.global_batch, micro_batch_size=None, hardware=hw, device="cuda",
                           compute_dtype=dtype, input_names=names, max_grad_norm=1.0 if args.clip_gradients else None,
                           optimizer_name=args.optimizer,
                           topology=Topology(ranks, args.gpus_per_node, host_state="auto"), solver=args.solver,
                           **_execution_flags(args))
    summary = (f"seq_len {args.seq_len} x global batch {args.global_batch}, {dtype}"
               + (f", {args.optimizer}" if args.optimizer not in (None, "adamw") else "")
               + (f", {args.gpus_per_node} GPUs per node x {args.nodes} nodes" if ranks > 1 else ""))
    blocks = config.get_text_config().num_hidden_layers  # a vision-language config keeps them in text_config
    return request, args.model, hw, summary, (f"tracing {args.model} ({blocks} layers) on the meta "
                                              f"device at seq_len {args.seq_len} ...")


def _execution_flags(args: argparse.Namespace) -> dict:
    """``PlanRequest`` fields of ``--templates`` and ``--cuda-graphs``, where given."""
    out: dict = {}
    if args.templates is not None:
        out["templates"] = args.templates
    if args.cuda_graphs is not None:
        out["cuda_graphs"] = {"false": False, "true": True}.get(args.cuda_graphs, args.cuda_graphs)
    return out


def _run_request(args: argparse.Namespace, ranks: int):
    """``(request, model name, spec, summary, progress line)`` from --config: what ``megatrain train --config``
    with the same file plans, for --gpus-per-node x --nodes ranks (torchrun's)."""
    from megatrain.planner.front import Topology
    from megatrain.train import load_train_config
    from megatrain.train.config import check_batch_split, resolve_device
    from megatrain.train.corpus import image_grid_thw
    from megatrain.train.loop import plan_request, planning_model
    from megatrain.train.model import resolve_model

    given = [f"--{n.replace('_', '-')}" for n in ("model", "seq_len", "global_batch") if getattr(args, n) is not None]
    given += ["--compute-dtype"] * (args.compute_dtype is not None) + ["--clip-gradients"] * args.clip_gradients
    given += ["--optimizer"] * (args.optimizer is not None)
    if given:
        raise _UsageError(f"megatrain plan --config: {', '.join(given)} come from the run's settings (its model, "
                          "seq_len, global_batch, max_grad_norm, device, optimizer); change them in the file")
    # Planning reads no output_dir; the file may leave it to megatrain train's --output-dir.
    overrides = {"output_dir": "."} | ({} if args.hardware is None else {"hardware": args.hardware})
    cfg, device = resolve_device(load_train_config(args.config, overrides, saved_run=False), planning=True)
    if cfg.hardware is None:
        raise ConfigError(f"megatrain plan --config {args.config}: the run names no hardware to plan for or predict "
                          "on; give --hardware (a preset or a spec JSON file)")
    check_batch_split(cfg.global_batch, cfg.micro_batch_size, ranks)
    hw = _spec(args, cfg.hardware)
    source = resolve_model(cfg.model)
    request = plan_request(cfg, planning_model(cfg, source), hw,
                           Topology(ranks, args.gpus_per_node, host_state=cfg.host_state if ranks > 1 else None),
                           image_grid_thw(cfg, source), source)
    request = dataclasses.replace(request, **_execution_flags(args))  # --templates/--cuda-graphs replace the run's
    summary = (f"seq_len {cfg.seq_len} x global batch {cfg.global_batch}, {device}"
               + (f", images_per_row {cfg.images_per_row}" if cfg.images_per_row != 1 else "")
               + (f", images resized to {cfg.image_size}" if cfg.image_size else "")
               + (f", images at their own sizes up to {cfg.image_max_pixels:,} pixels" if cfg.image_max_pixels else "")
               + (f", {args.gpus_per_node} GPUs per node x {args.nodes} nodes" if ranks > 1 else ""))
    where = "on the meta device" if cfg.device == "cuda" else "built on the CPU, as megatrain train --device cpu does"
    return request, cfg.model, hw, summary, f"tracing {cfg.model} ({where}) at seq_len {cfg.seq_len} ..."


def _train_command(args: argparse.Namespace) -> int:
    from megatrain.train import load_train_config
    from megatrain.train.early import check_inputs

    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        cfg = load_train_config(args.config, overrides, saved_run=True)
        check_inputs(cfg)  # paths, formats and first records, before torch and transformers load
        from megatrain.train import train

        train(cfg)
    except MegatrainError as e:
        _print_error(e)
        return 2
    except OSError as e:  # the file system refused a read or write: the message names the path
        _print_error(describe_os_error(e))
        return 2
    except KeyboardInterrupt as e:
        print(f"error: interrupted ({e or 'SIGINT'}); nothing more was saved, and a checkpoint already written "
              "is intact: the same command resumes from it (or starts the run again when none was written)",
              file=sys.stderr)
        return 143 if "SIGTERM" in str(e) else 130  # 128 + the signal, as a shell reports it
    return 0


_OS_FIXES = {
    errno.EROFS: "the file system is read-only: give directories on a writable one (--output-dir, --data-cache, "
                 "--nvme-dir)",
    errno.ENOSPC: "the disk is full: free space, or give a directory on another disk, and run the same command again",
    errno.EDQUOT: "the disk quota is used up: free space, or give a directory on another disk, and run the same "
                  "command again",
    errno.EACCES: "permission denied: give paths this user may read (and, for outputs, write)",
    errno.EPERM: "the operation is not permitted: give paths this user may read (and, for outputs, write)",
}


def describe_os_error(e: OSError) -> str:
    """An ``OSError`` the file system raised, as an error line: its message, the path(s) where its
    message lacks them, and what to do for the common refusals (a read-only file system, a full
    disk or quota, a permission)."""
    text = str(e)
    for name in (e.filename, e.filename2):
        if name is not None and str(name) not in text:
            text += f": {name}"
    fix = _OS_FIXES.get(e.errno)
    return text + (f"; {fix}" if fix else "")


def _print_error(e: BaseException | str) -> None:
    """The one ``error:`` line of a failed command on stderr, at most
    :data:`megatrain.bounds.MAX_ERROR_CHARS` characters (a message that quotes a huge input keeps
    its start and end) and on one line."""
    from megatrain.bounds import shorten

    print("error: " + shorten(" ".join(str(e).splitlines())), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from megatrain.runtime.threads import prefer_passive_wait

    prefer_passive_wait()  # before anything imports torch: OpenMP reads it once (megatrain.runtime.threads)
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit as e:  # --help and --version print and exit 0
            return e.code if isinstance(e.code, int) else 0
        if args.command == "train":
            return _train_command(args)
        return _plan_command(args)
    except _UsageError as e:
        _print_error(e)
        return 2
    except MegatrainError as e:
        _print_error(e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
