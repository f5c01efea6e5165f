"""Side-by-side training throughput on one GPU: megatrain, DeepSpeed ZeRO-3 offload, FSDP2 offload,
plain PyTorch.

Method. Every system trains the same model (``LlamaForCausalLM``, or ``Qwen2ForCausalLM`` for
``qwen2.5-7b``, from a config, untied embeddings, nothing downloaded) on the same seeded synthetic
token batches, with the same global batch, micro-batch size, sequence length and AdamW settings,
BF16 compute on the GPU and FP32 master weights and moments. megatrain runs the solver's plan for
the spec ``measure_hardware()`` measures in its own process (its knobs are in the row,
``megatrain_plan``), with BF16 compute as the peers' mixed precision runs it: the model traced with
BF16 parameters, no autocast;
``megatrain-own-plan`` runs the same with the micro-batch size and count the solver chooses for
the global batch (the split megatrain would pick; the loss is the same for any split). Each
system runs in a fresh child process (``--child SYSTEM``) so that its peak host memory
(``ru_maxrss`` and ``VmHWM`` of that process) and peak GPU memory
(``torch.cuda.max_memory_allocated``) are its own. A step is one global batch: warm-up steps are
run and discarded, then each timed step is bracketed by device synchronisations.

Accounting, the same for every system (:func:`model_flops_per_token`):

- tokens counts the non-padding tokens of a step (``labels != -100``).
- model FLOPs per token follow PaLM's model FLOPs utilisation (Chowdhery et al. 2022, "PaLM:
  Scaling Language Modeling with Pathways", arXiv:2204.02311, appendix B): ``6 N + 12 L H Q T``
  with ``N`` the parameters that take part in matrix multiplies, ``L`` layers, ``H`` attention
  heads of dimension ``Q`` and ``T`` the sequence length. ``N`` leaves out the input embedding
  table, which is a gather, not a matmul (Megatron-LM counts it the same way: Narayanan et al.
  2021, arXiv:2104.04473, section 5.1); the untied output projection is counted. Recompute for
  activation checkpointing is not counted, and the attention term counts the full ``T x T``
  score matrix, as PaLM does, although causal kernels skip half of it.
- TFLOPS = model FLOPs per token x tokens / step time; MFU = TFLOPS / the BF16 matmul rate measured
  on the same GPU in the same run (an 8192^3 product, :func:`measure_peak_matmul`).
- Also in MegaTrain's accounting (its public ``examples/train.py``: ``6 * num_params * n_tokens``
  over the step time), for comparing with the figures it reports (~272 TFLOPS for Qwen2.5-7B at
  seq 1024 on one H100): ``tflops_6n_padded`` = 6 x every parameter (the input embedding included)
  x every token of the batch, padding included, no attention term, / step time.

``--dry-run`` runs everything on the CPU with a tiny Llama in FP32 (the peak is then an FP32
matmul on the CPU, labelled as such): it checks the harness, not the systems' speed.

Usage (see bench/README.md for the GPU machine and the DeepSpeed wheel)::

    python bench/compare.py --dry-run
    python bench/compare.py --sizes 1b,3b,7b --system all --seq-len 2048 --global-batch 32 \\
        --micro-batch 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from megatrain.ir.hardware import cpu_name
from megatrain.units import GiB

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout where megatrain is not installed
    sys.path.insert(0, str(ROOT))

SYSTEMS = ("megatrain", "megatrain-own-plan", "deepspeed", "fsdp2", "torch")
"""``megatrain`` runs the benchmark's micro-batch size and count, as the peers do;
``megatrain-own-plan`` lets the solver choose both for the same global batch and sequence length
(``PlanRequest.micro_batch_size=None``, as ``megatrain plan`` does), the split megatrain would run."""
RESULT_MARK = "BENCH_RESULT "
"""A child prints exactly one line starting with this, followed by its row as JSON."""



# -- models ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A Llama or Qwen2 decoder shape. ``name`` is the size label used in file names and tables;
    ``family`` ``"llama"`` (``LlamaForCausalLM``) or ``"qwen2"`` (``Qwen2ForCausalLM``: biases on
    the q, k and v projections)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    family: str = "llama"

    @classmethod
    def from_preset(cls, name: str) -> "ModelConfig":
        """The shape of megatrain's model preset ``name`` (:data:`megatrain.planner.presets.MODEL_PRESETS`)."""
        from megatrain.planner.presets import MODEL_PRESETS

        c = MODEL_PRESETS[name]
        if c.get("tie_word_embeddings") or c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]) \
                != c["hidden_size"] // c["num_attention_heads"]:
            raise ValueError(f"preset {name!r}: the benchmark's shapes have untied embeddings and hidden / heads "
                             "as the head dimension")
        return cls(name, c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                   c["num_attention_heads"], c["num_key_value_heads"], c["model_type"])

    def __post_init__(self) -> None:
        if self.family not in ("llama", "qwen2"):
            raise ValueError(f"model {self.name!r}: family {self.family!r} is not 'llama' or 'qwen2'")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name!r}: hidden_size {self.hidden_size} must divide into "
                             f"{self.num_heads} heads, and heads into {self.num_kv_heads} KV heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def hf_config(self, seq_len: int):
        """The transformers config of this shape (``AutoModelForCausalLM.from_config`` builds it)."""
        from transformers import LlamaConfig, Qwen2Config

        kind = Qwen2Config if self.family == "qwen2" else LlamaConfig
        return kind(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                    intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                    num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                    max_position_embeddings=max(seq_len, 2048), tie_word_embeddings=False, use_cache=False)


# The sizes 1b, 3b and 7b use Llama-2's 32,000-token vocabulary so that only depth and width change;
# the named shapes after them are megatrain's presets of released models (issue 40's 7B-8B step).
MODELS: dict[str, ModelConfig] = {
    # Llama-2 block shapes at 1.1B (TinyLlama's shape: 22 layers, hidden 2048, GQA with 4 KV heads).
    "1b": ModelConfig("1b", 32000, 2048, 5632, 22, 32, 4),
    # Llama-3.2-3B's block shape (28 layers, hidden 3072, 24 heads, 8 KV heads) with a 32k vocabulary.
    "3b": ModelConfig("3b", 32000, 3072, 8192, 28, 24, 8),
    # Llama-2-7B (Touvron et al. 2023, table 2 / the released config).
    "7b": ModelConfig("7b", 32000, 4096, 11008, 32, 32, 32),
    # Qwen2.5-7B (MegaTrain's public code reports ~272 TFLOPS for it at seq 1024 on one H100) and
    # Llama-3-8B, as released: their vocabularies, Qwen2's QKV biases.
    "qwen2.5-7b": ModelConfig.from_preset("qwen2.5-7b"),
    "llama-3-8b": ModelConfig.from_preset("llama-3-8b"),
    # The dry-run model: small enough that four systems finish in seconds on two CPU cores.
    "tiny": ModelConfig("tiny", 256, 64, 128, 2, 4, 2),
}


def param_count(cfg: ModelConfig) -> int:
    """All parameters of ``LlamaForCausalLM`` (no biases) or ``Qwen2ForCausalLM`` (biases on q, k
    and v), untied embeddings."""
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    attn = 2 * h * h + 2 * h * kv  # q and o are h x h; k and v are h x (kv heads x head dim)
    attn += h + 2 * kv if cfg.family == "qwen2" else 0
    mlp = 3 * h * cfg.intermediate_size  # gate, up, down
    norms = 2 * h
    return cfg.num_layers * (attn + mlp + norms) + h + 2 * cfg.vocab_size * h


def matmul_param_count(cfg: ModelConfig) -> int:
    """``N`` of the FLOP count: every parameter but the input embedding table (a gather)."""
    return param_count(cfg) - cfg.vocab_size * cfg.hidden_size


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token, PaLM appendix B: ``6 N + 12 L H Q T`` (see the module docstring)."""
    return 6 * matmul_param_count(cfg) + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len


# -- data ------------------------------------------------------------------------------------------

def make_batch(global_batch: int, seq_len: int, vocab: int, seed: int, pad_fraction: float):
    """A seeded batch ``{"input_ids", "labels"}`` of ``LongTensor[global_batch, seq_len]``.

    Padding is on the right (token 0, label -100) so that a causal model gives the non-padding
    tokens the same outputs with or without an attention mask; no system gets a mask. Each row
    loses a uniform random number of tokens in ``[0, 2 x pad_fraction x seq_len]``.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (global_batch, seq_len), generator=g)
    labels = ids.clone()
    max_pad = min(seq_len - 1, int(2 * pad_fraction * seq_len))
    if max_pad > 0:
        pads = torch.randint(0, max_pad + 1, (global_batch,), generator=g)
        for row, p in enumerate(pads.tolist()):
            if p:
                ids[row, seq_len - p:] = 0
                labels[row, seq_len - p:] = -100
    return {"input_ids": ids, "labels": labels}


def count_tokens(batch) -> int:
    """Non-padding tokens of a batch: the labels that take part in the loss or would (!= -100)."""
    return int((batch["labels"] != -100).sum())


# -- measurement helpers ---------------------------------------------------------------------------

def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def host_peak_bytes() -> dict:
    """This process's peak resident memory: ``ru_maxrss`` (KiB on Linux) and ``VmHWM``."""
    out = {"ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    out["vmhwm_bytes"] = _proc_status_bytes("VmHWM")
    vals = [v for v in out.values() if v]
    out["peak_host_bytes"] = max(vals) if vals else None
    return out


def _proc_status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _mem_available_bytes() -> int | None:
    from megatrain.runtime.measure import available_host_memory

    got = available_host_memory()
    return None if got is None else got[0]


def measure_peak_matmul(dry_run: bool) -> dict:
    """The matmul rate MFU is measured against, timed here and now on this machine.

    GPU: the median of 10 BF16 8192^3 products (random data, after 3 warm-ups), timed with CUDA
    events. CPU (dry run): an FP32 1024^3 product on the CPU, labelled so; it is not a GPU peak.
    """
    import torch

    if not dry_run and torch.cuda.is_available():
        n, dtype, reps = 8192, torch.bfloat16, 10
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a @ b
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        t = statistics.median(times)
        return {"flops_per_s": 2 * n ** 3 / t, "what": f"bf16 {n}^3 matmul on {torch.cuda.get_device_name()}",
                "device": torch.cuda.get_device_name(), "dtype": "bfloat16"}
    n, reps = 1024, 5
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"flops_per_s": 2 * n ** 3 / t, "what": f"fp32 {n}^3 matmul on the CPU (no GPU: not a GPU peak)",
            "device": "cpu: " + cpu_name(), "dtype": "float32"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _enable_checkpointing(model) -> None:
    """Activation checkpointing of every decoder layer through Hugging Face's own switch."""
    kw = {"use_reentrant": False}
    fn = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x
    if fn is not None:
        fn(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def _micro_batches(args) -> int:
    return args.global_batch // args.micro_batch


def _split(batch, micro: int, device: str):
    rows = batch["input_ids"].shape[0]
    return [{k: v[i:i + micro].to(device, non_blocking=True) for k, v in batch.items()}
            for i in range(0, rows, micro)]


def _batches(args, cfg: ModelConfig):
    n = args.warmup + args.steps
    return [make_batch(args.global_batch, args.seq_len, cfg.vocab_size, args.seed + i, args.pad_fraction)
            for i in range(n)]


def _timed_loop(step_fn: Callable[[dict], float], args, cfg: ModelConfig) -> dict:
    """Run warm-up then timed global steps; ``step_fn(batch) -> mean loss``. Returns timings."""
    batches = _batches(args, cfg)
    losses, times, tokens, padded = [], [], [], []
    for i, batch in enumerate(batches):
        _sync()
        t0 = time.perf_counter()
        loss = step_fn(batch)
        _sync()
        dt = time.perf_counter() - t0
        losses.append(float(loss))
        if i >= args.warmup:
            times.append(dt)
            tokens.append(count_tokens(batch))
            padded.append(batch["input_ids"].numel())
    return {"losses": losses, "step_times_s": times, "timed_tokens": tokens, "timed_padded_tokens": padded}


def _adamw_kwargs(args) -> dict:
    return dict(lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps, weight_decay=args.weight_decay)


def _gpu_fit_estimate(cfg: ModelConfig, args) -> int:
    """Bytes plain PyTorch needs on the GPU with autocast and activation checkpointing.

    16 B/parameter (FP32 weights and gradients, two FP32 Adam moments) plus, per micro-batch: the
    BF16 layer-boundary checkpoints, one layer's recomputed activations (about 34 x hidden bytes
    per token for a Llama block in BF16, Korthikanti et al. 2022, arXiv:2205.05198, table 2, plus
    the MLP's wider intermediate) and the logits (FP32 and a BF16 copy, and their gradient).
    """
    tok = args.micro_batch * args.seq_len
    h = cfg.hidden_size
    checkpoints = cfg.num_layers * tok * h * 2
    layer = tok * (34 * h + 6 * cfg.intermediate_size)
    logits = tok * cfg.vocab_size * (4 + 2 + 4)
    return 16 * param_count(cfg) + checkpoints + layer + logits


HOST_BYTES_PER_PARAM = {
    # FP32 master and two moments (12 B) plus rings of a few layers.
    "megatrain": 12,
    "megatrain-own-plan": 12,
    # FP32 master and moments (12 B), FP32 gradient partition on the host (4 B), the offloaded BF16
    # parameter partition (2 B): DeepSpeed ZeRO-3 offload's documented footprint is 18 B/param.
    "deepspeed": 18,
    # FP32 sharded parameters and gradients offloaded (8 B) plus two FP32 moments (8 B).
    "fsdp2": 16,
    "torch": 0,
}
"""Estimated host bytes per parameter of each system's persistent state, to skip runs that cannot
fit in host memory before they swap or are killed (the issue's "7B where host memory allows")."""


def _host_skip_reason(system: str, cfg: ModelConfig, args) -> str | None:
    if args.dry_run or args.force:
        return None
    need = HOST_BYTES_PER_PARAM[system] * param_count(cfg)
    avail = _mem_available_bytes()
    if avail is not None and need > 0.9 * avail:
        return (f"needs ~{need / GiB:.0f} GiB of host memory ({HOST_BYTES_PER_PARAM[system]} B/param), "
                f"{avail / GiB:.0f} GiB available; pass --force to try anyway")
    return None


class Skip(Exception):
    """A system cannot run here; its row says why."""


# -- the four systems ------------------------------------------------------------------------------

def run_megatrain(cfg: ModelConfig, args, own_plan: bool = False) -> dict:
    """megatrain: the model built on ``meta``, compiled with the solver's plan for the spec measured
    on this machine (``measure_hardware()``; the dry run plans for ``--sim-preset``), at the
    benchmark's micro-batch size and count, or with ``own_plan`` at the micro-batch size and count
    the solver chooses for the same global batch (``megatrain.compile(..., global_batch=...)``
    without a split: traced, solved and lowered once, then traced again at the chosen size for the
    templates that run); host tiles hold all persistent state. Each step
    is given the whole global batch, which the trainer cuts into its plan's micro-batches. BF16
    compute traces the model with BF16 parameters (FP32 masters and moments stay on the host), as
    the peers' mixed precision runs it; the dry run computes in FP32 like the others."""
    import torch
    from transformers import AutoModelForCausalLM

    import megatrain
    from megatrain.ir.hardware import preset

    if not args.dry_run and not torch.cuda.is_available():
        raise Skip("needs CUDA (use --dry-run on a CPU)")
    device = "cpu" if args.dry_run else "cuda"
    k = _micro_batches(args)
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg.hf_config(args.seq_len))
    if args.dry_run:
        hw = preset(args.sim_preset)
    else:
        from megatrain.runtime.measure import measure_hardware

        hw = measure_hardware()
    dtype = "float32" if args.dry_run else "bfloat16"
    # own_plan: the global batch alone, so the solver chooses the micro-batch size and count with the plan
    split = {"global_batch": args.global_batch} if own_plan else {"micro_batch_size": args.micro_batch,
                                                                  "micro_batches": k}
    trainer = megatrain.compile(model, seq_len=args.seq_len, **split, optimizer=megatrain.AdamW(**_adamw_kwargs(args)),
                                hardware=hw, compute_dtype=dtype, device=device)
    own_seconds = []
    last = {}
    total = args.warmup + args.steps

    def step(batch) -> float:
        # The last timed step is recorded (every op timed on its stream, as gpu_probe's step is): its
        # measured Timeline goes beside the simulator's in the row (_megatrain_extras).
        recorded = len(own_seconds) == total - 1
        trainer.backend.record = recorded
        sched = trainer.schedule  # the schedule this step runs
        res = trainer.step({"input_ids": batch["input_ids"], "labels": batch["labels"]})
        trainer.backend.record = False
        own_seconds.append(res.seconds)
        if recorded:
            from megatrain.planner.timeline import measured_timeline

            last["timeline"] = (sched, measured_timeline(trainer.backend, sched, trainer.graph,
                                                         trainer.planned.hardware))
        return res.loss

    out = _timed_loop(step, args, cfg)
    out["megatrain_reported_step_s"] = own_seconds[args.warmup:]
    out["megatrain_plan"] = _plan_summary(trainer)
    if own_plan:
        mp = out["megatrain_plan"]
        mp["chosen_by"] = f"solver ({trainer.planned.solution.method}), micro-batch size and count included"
        out["note"] = (f"own plan: micro-batch {mp['micro_batch_size']} x {mp['micro_batches']} "
                       f"(the solver's, for global batch {args.global_batch})")
    out["_finish"] = lambda row: _megatrain_extras(row, trainer, last.get("timeline"), args)
    return out


def _plan_summary(trainer) -> dict:
    """The plan's knobs and who chose them (the solver's method), for the row: what megatrain ran."""
    plan, solution = trainer.plan, trainer.planned.solution
    policies = [p.value for p in plan.activations]
    return {"chosen_by": f"solver ({solution.method})" if solution is not None else "given",
            "micro_batch_size": trainer.planned.options.micro_batch_size,
            "micro_batches": plan.micro_batches, "slots": plan.slots, "prefetch_distance": plan.prefetch_distance,
            "resident_layers": len(plan.resident), "grad_ring": plan.grad_ring, "layer_by_layer": plan.layer_by_layer,
            "optimizer": plan.optimizer.value, "compute_dtype": plan.compute_dtype, "cast_once": plan.cast_once,
            "checkpoints": {p: policies.count(p) for p in sorted(set(policies))},
            # The plan's memory (the cost model's), beside the row's measured peak_gpu_reserved_bytes and
            # peak_host_bytes: issue 40's longest-context step compares the two.
            "planned_gpu_peak_bytes": trainer.planned.memory.gpu_peak,
            "planned_host_bytes": trainer.planned.memory.host_total,
            "planned_pinned_bytes": trainer.planned.memory.host_pinned}


def _megatrain_extras(row: dict, trainer, recorded, args) -> None:
    """The simulator's prediction beside what ran: the step, stream busy fractions and, from the
    last timed step's measured Timeline (``recorded``: ``(schedule, timeline)``), seconds per op
    kind and the compute ops grouped by what ran beside them (``gpu_probe.by_context``), measured
    against the same schedule simulated on the spec the solver planned for; both timelines are
    written beside the results (``timelines_file``, gpu_probe's ``timelines.json`` layout)."""
    try:
        from megatrain.planner.simulate import simulate
    except ImportError as e:  # an older megatrain without a simulator
        row["predicted_note"] = f"no simulator in this megatrain ({e})"
        return
    try:
        # The spec the solver planned for (measured in this run; a preset in the dry run, where a
        # CPU has no GPU rates: labelled so), and its simulation of the schedule that ran.
        hw = trainer.planned.hardware
        label = (f"{args.sim_preset} preset (dry run: not comparable with the CPU time)" if args.dry_run
                 else f"spec measured in this run: {hw.name}")
        tl = trainer.planned.timeline or simulate(trainer.schedule, trainer.graph, hw)
    except Exception as e:  # noqa: BLE001 - the row records why there is no prediction
        row["predicted_note"] = f"simulator failed: {type(e).__name__}: {e}"
        return
    row["predicted_step_s"] = tl.step_time_s
    row["predicted_hw"] = label
    row["stream_busy_predicted"] = _stream_dict(tl.busy_fraction)
    row["predicted_bottleneck"] = str(getattr(tl.bottleneck, "value", tl.bottleneck))
    if recorded is None:
        return
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_probe import _timeline_summary, by_context

    sched, measured = recorded
    predicted = simulate(sched, trainer.graph, hw)  # the schedule the recorded step ran
    row["stream_busy_measured"] = _stream_dict(measured.busy_fraction)
    row["megatrain_timeline_step_s"] = measured.step_time_s
    got, want = _timeline_summary(measured), _timeline_summary(predicted)
    kinds = sorted(set(got["by_kind"]) | set(want["by_kind"]))
    row["by_kind"] = {k: {"measured_s": got["by_kind"].get(k, {}).get("total_s", 0.0),
                          "predicted_s": want["by_kind"].get(k, {}).get("total_s", 0.0)} for k in kinds}
    row["by_context"] = by_context(measured, predicted)
    row["measured_timeline"] = {k: got[k] for k in ("busy_s", "gpu_busy_s", "issue_bound_s", "issuing_thread")}
    path = _results_path(Path(args.results_dir), f"{datetime.now(timezone.utc):%Y-%m-%d}",
                         "cpu-dry-run" if args.dry_run else torch.cuda.get_device_name(),
                         f"{args.size}-{args.child}-timelines")
    path.write_text(json.dumps({"measured": json.loads(measured.to_json()),
                                "predicted": json.loads(predicted.to_json())}) + "\n")
    row["timelines_file"] = str(path)


def _stream_dict(d) -> dict | None:
    if not d:
        return None
    return {str(getattr(k, "value", k)): float(v) for k, v in d.items()}


def run_deepspeed(cfg: ModelConfig, args) -> dict:
    """DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to pinned CPU memory.

    Tuned as DeepSpeed's ZeRO-3 offload tutorial and the Hugging Face integration advise:
    ``pin_memory``, ``overlap_comm``, ``contiguous_gradients``, ``reduce_bucket_size = hidden^2``,
    ``stage3_prefetch_bucket_size = 0.9 hidden^2`` and ``stage3_param_persistence_threshold = 10
    hidden`` (the values HF's "auto" resolves to), BF16, activation checkpointing, and the model
    built partitioned under ``zero.Init`` so the full model never exists on one device.
    """
    import torch

    if args.dry_run or not torch.cuda.is_available():
        raise Skip("needs CUDA: ZeRO-3 offload moves parameters between pinned host memory and the GPU")
    try:
        import deepspeed
    except ImportError as e:
        raise Skip(f"import deepspeed failed: {e}; carry its wheel (bench/README.md)") from None
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                 ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl")
    ds_config = deepspeed_config(cfg, args)
    # Keep this object alive: it tells transformers to build the model under zero.Init.
    hf_ds = HfDeepSpeedConfig(ds_config)  # noqa: F841
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg.hf_config(args.seq_len))
    _enable_checkpointing(model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    engine.train()

    def step(batch) -> float:
        losses = []
        for mb in _split(batch, args.micro_batch, "cuda"):
            loss = engine(**mb).loss
            engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself
            engine.step()  # updates only at the accumulation boundary
            losses.append(loss.detach())
        return float(torch.stack(losses).float().mean())

    out = _timed_loop(step, args, cfg)
    out["deepspeed_config"] = ds_config
    return out


def deepspeed_config(cfg: ModelConfig, args) -> dict:
    """The ZeRO-3 offload configuration (see :func:`run_deepspeed` for where each value comes from)."""
    h = cfg.hidden_size
    return {
        "train_batch_size": args.global_batch,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": _micro_batches(args),
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [args.beta1, args.beta2],
                                                  "eps": args.eps, "weight_decay": args.weight_decay}},
        "bf16": {"enabled": True},
        "gradient_clipping": 0.0,  # megatrain does not clip; neither does anyone here
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": h * h,
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
            "stage3_max_live_parameters": int(1e9),
            "stage3_max_reuse_distance": int(1e9),
            "sub_group_size": int(1e9),
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def run_fsdp2(cfg: ModelConfig, args) -> dict:
    """FSDP2 ``fully_shard`` at world size 1: each decoder layer, then the root, with CPU offload.

    On the GPU: ``CPUOffloadPolicy(pin_memory=True)`` (sharded FP32 parameters, gradients and the
    optimizer step on the host) and ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.
    The dry run shards on the CPU over gloo without offload: offloading to the CPU from the CPU
    means nothing there.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    gpu = not args.dry_run
    if gpu and not torch.cuda.is_available():
        raise Skip("needs CUDA for the offload run (use --dry-run on a CPU)")
    device = "cuda" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(cfg.hf_config(args.seq_len))  # FP32, on the host
        _enable_checkpointing(model)
        kw: dict = {"mesh": mesh}
        if gpu:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        if gpu:  # FSDP2 manages parameters only; buffers (rotary inv_freq) go where the compute is
            for mod in model.modules():
                for name, buf in list(mod._buffers.items()):
                    if buf is not None:
                        mod._buffers[name] = buf.to(device)
        # With offload the sharded parameters stay on the host and the optimizer steps there.
        opt = torch.optim.AdamW(model.parameters(), fused=True, **_adamw_kwargs(args))
        model.train()
        # FSDP2's MixedPrecisionPolicy casts to BF16 itself: no autocast around its forward.
        out = _timed_loop(_accumulating_step(model, opt, args, device, autocast=False), args, cfg)
        if not gpu:
            out["note"] = "dry run: sharded on the CPU over gloo, no offload (CPU to CPU is meaningless)"
        return out
    finally:
        dist.destroy_process_group()


def _accumulating_step(model, opt, args, device: str, *, autocast: bool):
    """One optimizer step of eager training over the global batch's micro-batches (loss / k each),
    as FSDP2 and plain PyTorch both run it; ``autocast`` wraps the forward in BF16 autocast."""
    import torch

    k = _micro_batches(args)

    def step(batch) -> float:
        losses = []
        for mb in _split(batch, args.micro_batch, device):
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
                loss = model(**mb).loss
            (loss / k).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).float().mean())

    return step


def run_torch(cfg: ModelConfig, args) -> dict:
    """Plain PyTorch: FP32 model on the GPU, BF16 autocast, checkpointing, fused AdamW.

    Skipped when :func:`_gpu_fit_estimate` exceeds 92% of the free GPU memory, since everything
    (16 B/param and activations) must live on the GPU.
    """
    import torch
    from transformers import AutoModelForCausalLM

    gpu = not args.dry_run
    if gpu and not torch.cuda.is_available():
        raise Skip("needs CUDA (use --dry-run on a CPU)")
    device = "cuda" if gpu else "cpu"
    if gpu and not args.force:
        need = _gpu_fit_estimate(cfg, args)
        free, _ = torch.cuda.mem_get_info()
        if need > 0.92 * free:
            raise Skip(f"does not fit: needs ~{need / GiB:.1f} GiB on the GPU (16 B/param + activations), "
                       f"{free / GiB:.1f} GiB free; pass --force to try anyway")
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg.hf_config(args.seq_len)).to(device)
    _enable_checkpointing(model)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **_adamw_kwargs(args))
    model.train()
    try:
        return _timed_loop(_accumulating_step(model, opt, args, device, autocast=gpu), args, cfg)
    except torch.cuda.OutOfMemoryError as e:
        raise Skip(f"out of GPU memory: {str(e).splitlines()[0]}") from None


RUNNERS: dict[str, Callable[[ModelConfig, argparse.Namespace], dict]] = {
    "megatrain": run_megatrain, "megatrain-own-plan": lambda cfg, args: run_megatrain(cfg, args, own_plan=True),
    "deepspeed": run_deepspeed, "fsdp2": run_fsdp2, "torch": run_torch}


# -- child: one system, one size -------------------------------------------------------------------

def child_main(args) -> int:
    """Run one system on one size in this process and print its row after ``RESULT_MARK``."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    cfg = MODELS[args.size]
    row: dict = {"system": args.child, "size": cfg.name, "status": "ok"}
    import torch

    if args.dry_run:
        # On a small shared CPU, OpenMP threads that spin while another process holds a core turn a
        # 10 ms step into a second; one thread keeps the dry run's times steady.
        torch.set_num_threads(1)
    row["host_rss_after_import_bytes"] = _proc_status_bytes("VmRSS")
    reason = _host_skip_reason(args.child, cfg, args)
    t0 = time.perf_counter()
    try:
        if reason:
            raise Skip(reason)
        out = RUNNERS[args.child](cfg, args)
    except Skip as s:
        row.update(status="skipped", reason=str(s))
        out = None
    except Exception as e:  # noqa: BLE001 - a system that breaks is a row that says how, not a lost run
        import traceback

        row.update(status="failed", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        out = None
    row["wall_s"] = time.perf_counter() - t0
    if out is not None:
        finish = out.pop("_finish", None)
        row.update(out)
        fill_accounting(row, cfg, args)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            row["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
            row["peak_gpu_reserved_bytes"] = torch.cuda.max_memory_reserved()
        row.update(host_peak_bytes())  # before the extras below, which allocate for themselves
        if finish is not None:
            finish(row)
    print(RESULT_MARK + json.dumps(row, default=str), flush=True)
    return 0


def fill_accounting(row: dict, cfg: ModelConfig, args) -> None:
    """tokens/s, TFLOPS and MFU of the timed steps, by the module docstring's rules."""
    times, tokens = row["step_times_s"], row["timed_tokens"]
    total_t, total_tok = sum(times), sum(tokens)
    fpt = model_flops_per_token(cfg, args.seq_len)
    row["step_time_s"] = total_t / len(times)
    row["step_time_median_s"] = statistics.median(times)
    row["tokens_per_s"] = total_tok / total_t
    row["tflops"] = fpt * total_tok / total_t / 1e12
    peak = getattr(args, "peak_flops", None)
    row["mfu"] = row["tflops"] * 1e12 / peak if peak else None
    row["tflops_6n_padded"] = 6 * param_count(cfg) * sum(row["timed_padded_tokens"]) / total_t / 1e12
    row["final_loss"] = row["losses"][-1]


# -- parent: spawn children, collect, write, print -------------------------------------------------

def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "deepspeed", "megatrain"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    if out["megatrain"] is None:  # a checkout on PYTHONPATH, not installed
        try:
            import megatrain

            out["megatrain"] = getattr(megatrain, "__version__", "unknown") + " (source)"
        except ImportError:
            pass
    try:
        out["git_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out


def _child_argv(args, system: str, size: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", system, "--size", size]
    for name in ("seq_len", "global_batch", "micro_batch", "warmup", "steps", "lr", "beta1", "beta2",
                 "eps", "weight_decay", "seed", "pad_fraction", "peak_flops", "sim_preset", "results_dir"):
        v = getattr(args, name)
        if v is not None:
            argv += ["--" + name.replace("_", "-"), repr(v) if isinstance(v, float) else str(v)]
    if args.dry_run:
        argv.append("--dry-run")
    if args.force:
        argv.append("--force")
    return argv


def _run_child(argv: list[str], timeout: float) -> tuple[dict | None, str]:
    """Run a child; return its row (None if it printed none) and the tail of its stderr."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return None, f"timed out after {timeout:.0f} s. " + err[-1500:]
    row = None
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            row = json.loads(line[len(RESULT_MARK):])
    tail = (p.stderr or "")[-1500:]
    if row is None:
        tail = f"exit code {p.returncode}. " + tail
    return row, tail


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "unknown"


def _results_path(directory: Path, date: str, device: str, size: str) -> Path:
    base = f"{date}-{_slug(device)}-{size}"
    path, n = directory / f"{base}.json", 2
    while path.exists():  # keep every run's raw JSON
        path, n = directory / f"{base}-{n}.json", n + 1
    return path


def parent_main(args, argv_used: list[str]) -> int:
    asked = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in asked if s not in MODELS]
    if bad:  # a dry run checks the sizes a GPU run would be given, then runs the tiny model
        print(f"unknown size(s) {bad}; choose from {sorted(MODELS)}", file=sys.stderr)
        return 2
    sizes = ["tiny"] if args.dry_run else asked
    systems = list(SYSTEMS) if args.system == "all" else [args.system]
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc)
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/compare.py", *argv_used])

    # The matmul peak comes from its own child so that the parent never holds a CUDA context.
    peak_row, err = _run_child([sys.executable, str(Path(__file__).resolve()), "--measure-peak"]
                               + (["--dry-run"] if args.dry_run else []), args.child_timeout)
    if peak_row is None:
        print(f"measuring the matmul peak failed: {err}", file=sys.stderr)
        return 1
    args.peak_flops = peak_row["flops_per_s"]
    meta = {
        "date_utc": now.strftime("%Y-%m-%d %H:%M UTC"),
        "device": peak_row["device"],
        "host": {"cpu": cpu_name(), "cores": os.cpu_count(), "mem_available_bytes": _mem_available_bytes()},
        "versions": _versions(),
        "command": command,
        "peak_matmul": peak_row,
        "settings": {k: getattr(args, k) for k in ("seq_len", "global_batch", "micro_batch", "warmup", "steps",
                                                   "lr", "beta1", "beta2", "eps", "weight_decay", "seed",
                                                   "pad_fraction", "dry_run")},
        "accounting": "tokens = labels != -100; model FLOPs/token = 6 N + 12 L H Q T (PaLM, appendix B), "
                      "N without the input embedding; MFU against peak_matmul",
    }
    status = 0
    for size in sizes:
        cfg = MODELS[size]
        model_info = {**asdict(cfg), "params": param_count(cfg), "matmul_params": matmul_param_count(cfg),
                      "flops_per_token": model_flops_per_token(cfg, args.seq_len)}
        rows = []
        for system in systems:
            print(f"[{size}] {system} ...", file=sys.stderr, flush=True)
            row, err = _run_child(_child_argv(args, system, size), args.child_timeout)
            if row is None:
                row = {"system": system, "size": size, "status": "failed", "reason": err.strip()}
            if row.get("status") == "failed":
                status = 1
            rows.append(row)
        record = {"meta": meta, "model": model_info, "rows": rows}
        path = _results_path(results_dir, now.strftime("%Y-%m-%d"), "cpu-dry-run" if args.dry_run
                             else meta["device"], size)
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(format_table(record))
        print(f"\nraw JSON: {path}\n")
    return status


def _count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}" if div > 1e3 else f"{n / div:.1f}{unit}"
    return str(n)


def _gib(b) -> str:
    return f"{b / GiB:.2f}" if b else "-"


def format_table(record: dict) -> str:
    """The markdown section for one size, ready to paste into BENCHMARKS.md."""
    meta, model, rows = record["meta"], record["model"], record["rows"]
    s, v, pk = meta["settings"], meta["versions"], meta["peak_matmul"]
    vers = ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "deepspeed", "megatrain", "python") if v.get(k))
    lines = [
        f"### {_title(model)}: {model['params']:,} parameters ({_count(model['params'])}; "
        f"N = {model['matmul_params']:,} in matmuls), {model['num_layers']} layers, hidden "
        f"{model['hidden_size']}, FFN {model['intermediate_size']}, {model['num_heads']} heads "
        f"({model['num_kv_heads']} KV), vocab {model['vocab_size']}",
        "",
        f"- device: {meta['device']}; host: {meta['host']['cpu']}, {meta['host']['cores']} cores",
        f"- date: {meta['date_utc']}; {vers}; commit {v.get('git_commit') or '?'}",
        f"- seq {s['seq_len']}, global batch {s['global_batch']} (micro-batch {s['micro_batch']} x "
        f"{s['global_batch'] // s['micro_batch']}), AdamW lr {s['lr']} betas ({s['beta1']}, {s['beta2']}) "
        f"eps {s['eps']} wd {s['weight_decay']}, {s['warmup']} warm-up + {s['steps']} timed steps, "
        f"pad fraction {s['pad_fraction']}",
        f"- model FLOPs/token {model['flops_per_token']:.4g} (6N + 12·L·H·Q·T); MFU against "
        f"{pk['flops_per_s'] / 1e12:.4g} TFLOP/s measured: {pk['what']}",
        f"- command: `{meta['command']}`",
        "",
        "| system | params | tokens/s | TFLOPS | MFU | peak GPU GiB | peak host GiB | step s | "
        "predicted step s | stream busy (measured / predicted) | loss | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            reason = str(r.get("reason", "")).replace("|", "/").replace("\n", " ")
            lines.append(f"| {r['system']} | {_count(model['params'])} | - | - | - | - | - | - | - | - | - | "
                         f"{r.get('status')}: {reason[:300]} |")
            continue
        pred = f"{r['predicted_step_s']:.4g}" if r.get("predicted_step_s") is not None else "-"
        busy = _busy_cell(r)
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        six_n = r.get("tflops_6n_padded")
        note = "; ".join(x for x in (r.get("note"), r.get("predicted_note"),
                                     f"{six_n:.3g} TFLOPS as MegaTrain counts (6 N, padded tokens)" if six_n else None,
                                     f"predicted on {r['predicted_hw']}" if r.get("predicted_hw") else None) if x)
        lines.append(f"| {r['system']} | {_count(model['params'])} | {r['tokens_per_s']:.1f} | "
                     f"{r['tflops']:.3g} | {mfu} | {_gib(r.get('peak_gpu_bytes'))} | "
                     f"{_gib(r.get('peak_host_bytes'))} | {r['step_time_s']:.4g} | {pred} | {busy} | "
                     f"{r['final_loss']:.4f} | {note.replace('|', '/')} |")
    return "\n".join(lines)


def _title(model: dict) -> str:
    """A size's heading: ``Llama 1b`` for the benchmark's own Llama shapes, the preset's name
    (``qwen2.5-7b``) for a released model's."""
    from megatrain.planner.presets import MODEL_PRESETS

    return model["name"] if model["name"] in MODEL_PRESETS else f"Llama {model['name']}"


def _busy_cell(r: dict) -> str:
    parts = []
    for key in ("stream_busy_measured", "stream_busy_predicted"):
        d = r.get(key)
        parts.append(" ".join(f"{k} {100 * v:.0f}%" for k, v in d.items()) if d else "-")
    return " / ".join(parts) if any(p != "-" for p in parts) else "-"


# -- command line ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny Llama (2 layers, hidden 64, vocab 256), seq 32, global batch 4, "
                        "1 warm-up + 2 timed steps: checks the harness end to end")
    p.add_argument("--sizes", default="1b,3b", help=f"comma-separated sizes from {sorted(MODELS)} (GPU runs; a "
                   "dry run checks them and runs the tiny model)")
    p.add_argument("--system", default="all", choices=("all", *SYSTEMS))
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (2048; 32 in a dry run)")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (16; 4 in a dry run)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (2; 2 in a dry run)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (3; 1 in a dry run)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (10; 2 in a dry run)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pad-fraction", type=float, default=None,
                   help="mean fraction of right padding per sequence (0; 0.25 in a dry run so that the "
                        "non-padding token count is exercised)")
    p.add_argument("--results-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--child-timeout", type=float, default=None, help="seconds per system (3600; 120 dry run)")
    p.add_argument("--force", action="store_true", help="run systems that the memory estimates would skip")
    p.add_argument("--sim-preset", default="H100_SXM",
                   help="hardware preset the dry run simulates megatrain's schedule on (GPU runs use a "
                        "spec measured in the run)")
    # Internal: child modes.
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--measure-peak", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peak-flops", type=float, default=None, help=argparse.SUPPRESS)
    return p


def _fill_defaults(args) -> None:
    dry = {"seq_len": 32, "global_batch": 4, "micro_batch": 2, "warmup": 1, "steps": 2, "pad_fraction": 0.25,
           "child_timeout": 120.0}
    gpu = {"seq_len": 2048, "global_batch": 16, "micro_batch": 2, "warmup": 3, "steps": 10, "pad_fraction": 0.0,
           "child_timeout": 3600.0}
    for k, v in (dry if args.dry_run else gpu).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.global_batch % args.micro_batch:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of --micro-batch {args.micro_batch}")
    if not 0 <= args.pad_fraction < 0.5:
        raise SystemExit(f"--pad-fraction {args.pad_fraction} must be in [0, 0.5)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    _fill_defaults(args)
    if args.measure_peak:
        print(RESULT_MARK + json.dumps(measure_peak_matmul(args.dry_run)), flush=True)
        return 0
    if args.child:
        return child_main(args)
    return parent_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
