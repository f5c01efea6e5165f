"""The simulator's prediction of a measured GPU step, again, on another ``HardwareSpec``.

``bench/gpu_probe.py``'s step section measures one Llama step on a GPU and predicts it with the spec
it built in the same run. When that spec was wrong or lacks rates the time model now reads (a
section failed and a preset filled in, a field read the wrong measurement, a probe older than the
kernel model), the question "how far is the simulator from the measurement on the right spec?"
needs no GPU: this script traces the probe's model on the meta device, lowers the *same plan* the
probe ran, simulates it on ``--spec`` and prints predicted against measured seconds per op kind
(FWD, BWD, OPT, CAST, H2D, D2H) and the step, from the probe's timelines file; then the compute ops'
median seconds grouped by what ran beside them in the measured step (:func:`by_context`: a CAST,
an OPT, a copy, or nothing), which says where a gap comes from.

A spec written before a field existed is completed (:func:`complete_spec`), each filled field with
its source, printed:

- the kernel model's GPU rates it lacks (``memory_bytes_per_s``, ``attention_flops``,
  ``attention_backward_flops``) from ``--fallback-preset`` (datasheet-derived estimates, each with
  its source in ``megatrain.ir.hardware``);
- the issue costs of megatrain's own template (``launch_overhead_s``, ``backward_launch_overhead_s``)
  from the probe's stand-in measurement and the template-over-stand-in ratios of ``--issue-ratios``
  (``bench/template_issue.py``; :func:`gpu_probe.issue_costs_from_standin`);
- ``host_optimizer_issue_stall`` from the same session's ``bench/host_optimizer.py`` JSON
  (``--host-optimizer``) where its kernel (``megatrain_kernel``) is DeepSpeed's: ``rates.megatrain``
  (the OPT: the kernel's call, which holds the GIL, and the finite check's sum, which releases it)
  over ``rates.deepspeed_cpu_adam`` (the call alone), the fraction of the OPT the call takes; else
  from the host AdamW kernel the host rates were measured with (``--host-kernel``;
  ``megatrain.ir.hardware.HOST_KERNEL_ISSUE_STALL``);
- the copy/compute contention (``compute_slowdown_beside_h2d``, ``h2d_beside_compute_bytes_per_s``)
  and the issuing thread's slowdown beside a copy in flight (``issue_slowdown_beside_h2d``) from the
  probe's ``launch.forward_beside_h2d`` where it has them (the 2026-11-27 probe has none of them, so
  there they stay unmeasured: no contention), or given by hand (``--contention
  SLOWDOWN,H2D_BYTES_PER_S[,ISSUE_SLOWDOWN]``, over what the spec or the probe says; a field not
  given still comes from the probe). Factors read off the timeline being checked make a what-if,
  not a prediction: nothing measured them apart from it. ``--host-issue CAST[,OPT]`` sets the
  issuing thread's slowdown beside a host CAST (``host_cast_issue_stall``) and an OPT's GIL-free
  part (``host_optimizer_issue_slowdown``) the same way, for the same kind of what-if.

The probe ran several timed steps (``steps``: each one's ``timeline_step_s``) and kept one
timeline as ``measured``: the median step's since 2026-12-03 (``gpu_probe.median_step``; the row
says ``timeline_kept``), the last one's before. The step is compared with that one (``step``, per op
kind as well; ``kept`` says which timed step it is) and with each timed step and their median
(``steps``), since a step's timeline can hold a disturbance that no op of the schedule explains
(2026-11-27: the last step, the one kept then, has ~100 ms in the backward of layers 3 and 2, no
host op overlapping two of its slow backwards, an OPT at 2.4x its neighbours' time; the step before
it took 0.738 s where that one took 0.844 s).

Usage (any CPU, about 20 s at 1B)::

    python bench/resimulate_step.py --probe bench/results/2026-11-27-h100-probe.json \\
        --timelines bench/results/2026-11-27-h100-step-timelines.json \\
        --spec bench/results/2026-11-27-h100-spec.json \\
        --issue-ratios bench/results/2026-11-28-cpu-template-issue.json --host-kernel deepspeed \\
        --host-optimizer bench/results/2026-11-27-h100-host-optimizer.json [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_probe import StepShape, _timeline_summary, by_context, issue_costs_from_standin, llama_config  # noqa: E402

from megatrain.ir.hardware import HOST_KERNEL_ISSUE_STALL, HardwareSpec, preset  # noqa: E402
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan  # noqa: E402
from megatrain.planner.front import PlanRequest, plan  # noqa: E402
from megatrain.planner.simulate import simulate  # noqa: E402
from megatrain.planner.timeline import Timeline  # noqa: E402

CONTENTION_FIELDS = {"compute_slowdown_beside_h2d": "forward_slowdown",
                     "h2d_beside_compute_bytes_per_s": "h2d_beside_forward_bytes_per_s",
                     "issue_slowdown_beside_h2d": "issue_slowdown_beside_h2d"}
"""The spec's contention fields and their keys in a probe's ``launch.forward_beside_h2d``, in the order
``--contention`` gives them."""

KERNEL_RATE_FIELDS = ("memory_bytes_per_s", "attention_flops", "attention_backward_flops")
"""The kernel model's GPU rates a spec written before them lacks (``HardwareSpec.has_kernel_rates``)."""


def probe_plan(d: dict) -> Plan:
    """The ``Plan`` of a probe step's ``plan`` record (``gpu_probe._plan_dict``)."""
    return Plan(micro_batches=d["micro_batches"], slots=d["slots"], prefetch_distance=d["prefetch_distance"],
                grad_ring=d["grad_ring"], resident=frozenset(d["resident"]), layer_by_layer=d["layer_by_layer"],
                optimizer=OptimizerPlacement(d["optimizer"]), compute_dtype=d["compute_dtype"],
                staging_ring=d["staging_ring"], activations=tuple(ActivationPolicy(a) for a in d["activations"]))


def optimizer_call_fraction(host_optimizer: dict) -> float | None:
    """The fraction of megatrain's OPT (FP32 gradients, whole tile) that DeepSpeed's ``adam_update``
    call takes, from a ``bench/host_optimizer.py`` JSON whose kernel is DeepSpeed's: its
    ``rates.megatrain`` over ``rates.deepspeed_cpu_adam`` (parameters/s each; the OPT is that call
    and the finite check's sum), at most 1; None where it has no such pair."""
    rates = host_optimizer.get("rates", {})
    if host_optimizer.get("megatrain_kernel") != "deepspeed" or not rates.get("megatrain") \
            or not rates.get("deepspeed_cpu_adam"):
        return None
    return min(1.0, rates["megatrain"] / rates["deepspeed_cpu_adam"])


HOST_ISSUE_FIELDS = ("host_cast_issue_stall", "host_optimizer_issue_slowdown")
"""The spec's slowdowns of the issuing thread beside a GIL-releasing host op, in the order
``--host-issue`` gives them."""


def complete_spec(fields: dict, probe: dict, fallback: str = "H100_SXM", ratios: dict | None = None,
                  host_kernel: str | None = None,
                  host_optimizer: dict | None = None,
                  contention: tuple[float, ...] | None = None,
                  host_issue: tuple[float, ...] | None = None) -> tuple[HardwareSpec, dict[str, str]]:
    """The spec of JSON ``fields`` with the fields it lacks filled (module docstring), and each filled
    field's source. ``probe``: the probe.json the step came from (its ``launch`` section);
    ``host_optimizer``: the same session's ``bench/host_optimizer.py`` JSON; ``contention``:
    ``(compute_slowdown_beside_h2d, h2d_beside_compute_bytes_per_s[, issue_slowdown_beside_h2d])``
    given by hand, set whatever the spec or the probe says (a field it leaves out as without it);
    ``host_issue``: ``(host_cast_issue_stall[, host_optimizer_issue_slowdown])`` given by hand, the same way."""
    fields, filled = dict(fields), {}
    pre = preset(fallback)
    for name in KERNEL_RATE_FIELDS:
        if not fields.get(name):
            fields[name] = getattr(pre, name)
            filled[name] = f"{fallback} preset (not measured in this probe)"
    if "backward_launch_overhead_s" not in fields and ratios is not None:
        standin = probe["sections"]["launch"]["result"]["template_issue_s_per_op"]
        fields["launch_overhead_s"], fields["backward_launch_overhead_s"] = issue_costs_from_standin(standin, ratios)
        filled["launch_overhead_s"] = filled["backward_launch_overhead_s"] = (
            f"the probe's stand-in block ({standin * 1e6:.2f} us per meta-counted op) x the template / stand-in "
            f"per-op ratios of {ratios.get('date', '?')} on {ratios.get('machine', '?')} (forward "
            f"{ratios['template_fwd_over_standin_fwd']:.3f}, backward {ratios['template_bwd_over_standin_bwd']:.3f})")
    call = optimizer_call_fraction(host_optimizer) if host_optimizer is not None else None
    if "host_optimizer_issue_stall" not in fields and call is not None:
        fields["host_optimizer_issue_stall"] = call
        filled["host_optimizer_issue_stall"] = (
            f"bench/host_optimizer.py {host_optimizer.get('date', '?')} at {host_optimizer.get('threads', '?')} "
            f"threads: rates.megatrain {host_optimizer['rates']['megatrain']:.4g} / rates.deepspeed_cpu_adam "
            f"{host_optimizer['rates']['deepspeed_cpu_adam']:.4g} params/s (the GIL-holding call's share of the OPT)")
    elif "host_optimizer_issue_stall" not in fields and host_kernel is not None:
        fields["host_optimizer_issue_stall"] = HOST_KERNEL_ISSUE_STALL[host_kernel]
        filled["host_optimizer_issue_stall"] = f"HOST_KERNEL_ISSUE_STALL[{host_kernel!r}]"
    by_hand = dict(zip(CONTENTION_FIELDS, contention or ()))
    beside = ((probe.get("sections", {}).get("launch") or {}).get("result") or {}).get("forward_beside_h2d")
    for name, key in CONTENTION_FIELDS.items():
        if name in by_hand:
            fields[name] = by_hand[name]
            filled[name] = "given by hand (--contention)"
        elif not fields.get(name) and beside and beside.get(key) is not None:
            fields[name] = beside[key]
            filled[name] = f"the probe's launch.forward_beside_h2d.{key}"
    for name, value in zip(HOST_ISSUE_FIELDS, host_issue or ()):
        fields[name] = value
        filled[name] = "given by hand (--host-issue)"
    return HardwareSpec.model_validate(fields), filled


def _floats(text: str) -> tuple[float, ...]:
    """A flag's comma-separated numbers; () where one is not a number."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        return ()


def parse_host_issue(text: str) -> tuple[float, ...]:
    """``--host-issue CAST[,OPT]``: the issuing thread's slowdown beside a host CAST and, optionally,
    beside an OPT's GIL-free part (fractions in [0, 1))."""
    values = _floats(text)
    if len(values) not in (1, 2) or not all(0 <= v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"--host-issue {text!r}: give CAST[,OPT], one or two fractions in [0, 1) "
                                         "(the issuing thread beside a CAST, or an OPT's GIL-free part, issues "
                                         "at 1 - that of its speed), e.g. 0.18 or 0.18,0.1")
    return values


def parse_contention(text: str) -> tuple[float, ...]:
    """``--contention SLOWDOWN,H2D_BYTES_PER_S[,ISSUE_SLOWDOWN]``: the compute slowdown beside an H2D
    (a fraction in [0, 1)), the H2D rate beside compute (bytes/s, 0: not measured) and, optionally,
    the issuing thread's slowdown beside a copy in flight (a fraction in [0, 1))."""
    values = _floats(text)
    if len(values) not in (2, 3):
        raise argparse.ArgumentTypeError(f"--contention {text!r}: give SLOWDOWN,H2D_BYTES_PER_S[,ISSUE_SLOWDOWN], "
                                         "two or three numbers, e.g. 0.25,42e9 or 0.25,42e9,0.15")
    slowdown, rate, *issue = values
    if not 0 <= slowdown < 1 or rate < 0 or not all(0 <= c < 1 for c in issue):
        raise argparse.ArgumentTypeError(f"--contention {text!r}: SLOWDOWN must be in [0, 1) (a compute op beside "
                                         "an H2D takes time / (1 - SLOWDOWN)), H2D_BYTES_PER_S >= 0 and "
                                         "ISSUE_SLOWDOWN in [0, 1) (the issuing thread beside a copy in flight "
                                         "issues at 1 - ISSUE_SLOWDOWN of its speed)")
    return values


def resimulate(step: dict, measured: dict, spec: HardwareSpec) -> dict:
    """Predicted against measured seconds, per op kind and for the step, of a probe's step record
    ``step`` (``probe.json``'s ``sections.step.result``) and its measured timeline ``measured``
    (``timelines.json``'s ``measured``), the same plan simulated on ``spec``."""
    shape = StepShape(**{k: v for k, v in step["model"].items() if k in StepShape.__dataclass_fields__})
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(llama_config(shape))
    p = probe_plan(step["plan"])
    device = "cpu" if "FakeCuda" in step["backend"] else "cuda"  # a dry run's step ran on the CPU
    planned = plan(PlanRequest(model, seq_len=shape.seq_len, global_batch=shape.micro_batch_size * p.micro_batches,
                               micro_batch_size=shape.micro_batch_size, plan=p, hardware=spec, device=device,
                               compute_dtype=p.compute_dtype))
    simulated = simulate(planned.schedules.steady, planned.graph, spec)
    measured_tl = Timeline.from_json(json.dumps(measured))
    predicted, got = _timeline_summary(simulated), _timeline_summary(measured_tl)
    pk, mk = ({k: v["total_s"] for k, v in t["by_kind"].items()} for t in (predicted, got))
    rows = {k: {"measured_s": mk.get(k, 0.0), "predicted_s": pk.get(k, 0.0)} for k in sorted(set(pk) | set(mk))}
    rows_timed = [s for s in step.get("steps", []) if not s.get("warmup") and "timeline_step_s" in s]
    timed = [s["timeline_step_s"] for s in rows_timed]
    steps = {"measured_s": timed, "median_s": statistics.median(timed) if timed else None,
             "predicted_s": predicted["step_time_s"]}
    return {"spec": spec.name, "step": {"measured_s": got["step_time_s"], "predicted_s": predicted["step_time_s"]},
            "steps": steps, "kept": kept_step(rows_timed, got["step_time_s"]), "by_kind": rows,
            "by_context": by_context(measured_tl, simulated), "predicted_bottleneck": predicted["bottleneck"]}


def kept_step(timed: list[dict], step_time_s: float) -> dict | None:
    """Which of a probe's timed step rows ``timed`` the timelines file's ``measured`` timeline is:
    ``{"index": i (0-based among the timed steps), "of": len(timed), "rule": "median" | "last" |
    "matched"}`` (a probe of 2026-12-03 on marks its row ``timeline_kept``, the median step; an older
    one kept the last; else the row whose ``timeline_step_s`` equals ``step_time_s``), None where no
    row matches."""
    for i, r in enumerate(timed):
        if r.get("timeline_kept"):
            return {"index": i, "of": len(timed), "rule": "median"}
    matching = [i for i, r in enumerate(timed) if r["timeline_step_s"] == step_time_s]
    if not matching:
        return None
    i = matching[-1]
    return {"index": i, "of": len(timed), "rule": "last" if i == len(timed) - 1 else "matched"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", required=True, help="a gpu_probe probe.json with an ok step section")
    ap.add_argument("--timelines", required=True, help="the same run's timelines.json (measured records)")
    ap.add_argument("--spec", required=True, help="a HardwareSpec JSON to predict on")
    ap.add_argument("--fallback-preset", default="H100_SXM",
                    help="preset whose kernel rates fill those the spec lacks (default H100_SXM)")
    ap.add_argument("--issue-ratios", help="bench/template_issue.py's JSON: converts a probe's stand-in issue "
                                           "cost to megatrain's template's, where the spec lacks it")
    ap.add_argument("--host-kernel", choices=sorted(HOST_KERNEL_ISSUE_STALL),
                    help="the host AdamW kernel the spec's host rates were measured with, where the spec lacks "
                         "host_optimizer_issue_stall")
    ap.add_argument("--host-optimizer", help="the same session's bench/host_optimizer.py JSON: the share of the OPT "
                                             "its GIL-holding kernel call takes, where the spec lacks "
                                             "host_optimizer_issue_stall")
    ap.add_argument("--contention", type=parse_contention, metavar="SLOWDOWN,H2D_BYTES_PER_S[,ISSUE_SLOWDOWN]",
                    help="set the copy/compute contention by hand: a compute op's slowdown beside an H2D (it takes "
                         "time / (1 - SLOWDOWN)), the H2D rate beside compute and, optionally, the issuing "
                         "thread's slowdown beside a copy in flight, e.g. 0.25,42e9 or 0.25,42e9,0.15; else from "
                         "the probe's launch.forward_beside_h2d where it has them")
    ap.add_argument("--host-issue", type=parse_host_issue, metavar="CAST[,OPT]",
                    help="set by hand how much a host CAST and, optionally, an OPT's GIL-free part slow the issuing "
                         "thread (host_cast_issue_stall, host_optimizer_issue_slowdown), e.g. 0.18 or 0.18,0.1; "
                         "else the spec's (the 2026-11-27 spec has neither)")
    ap.add_argument("--json", help="write the comparison here too")
    args = ap.parse_args(argv)
    probe = json.loads(Path(args.probe).read_text())
    ratios = json.loads(Path(args.issue_ratios).read_text()) if args.issue_ratios else None
    host_optimizer = json.loads(Path(args.host_optimizer).read_text()) if args.host_optimizer else None
    spec, filled = complete_spec(json.loads(Path(args.spec).read_text()), probe, args.fallback_preset, ratios,
                                 args.host_kernel, host_optimizer, args.contention, args.host_issue)
    out = resimulate(probe["sections"]["step"]["result"], json.loads(Path(args.timelines).read_text())["measured"],
                     spec)
    out["filled"] = filled
    print(f"spec: {out['spec']}")
    for name, source in filled.items():
        print(f"  {name} = {getattr(spec, name):.4g}: {source}")
    print(f"{'':6} {'measured s':>11} {'predicted s':>12} {'pred/meas':>9}")
    for k, r in [("STEP", out["step"]), *out["by_kind"].items()]:
        ratio = r["predicted_s"] / r["measured_s"] if r["measured_s"] else float("nan")
        print(f"{k:6} {r['measured_s']:11.4f} {r['predicted_s']:12.4f} {ratio:9.2f}")
    print("compute ops by what ran beside them in the measured step (medians):")
    print(f"{'kind':6} {'beside':12} {'ops':>4} {'measured ms':>12} {'predicted ms':>13} {'pred/meas':>9}")
    for r in out["by_context"]:
        print(f"{r['kind']:6} {r['beside']:12} {r['ops']:4} {r['measured_median_s'] * 1e3:12.3f} "
              f"{r['predicted_median_s'] * 1e3:13.3f} {r['predicted_median_s'] / r['measured_median_s']:9.2f}")
    st = out["steps"]
    if st["measured_s"]:
        each = ", ".join(f"{m:.4f} s ({st['predicted_s'] / m:.2f})" for m in st["measured_s"])
        kept = out["kept"]
        which = ("not one of them" if kept is None else
                 f"timed step {kept['index'] + 1} of {kept['of']}'s" + {"median": " (the median step)",
                                                                        "last": " (the last)"}.get(kept["rule"], ""))
        print(f"timed steps (predicted/measured): {each}; median {st['median_s']:.4f} s "
              f"({st['predicted_s'] / st['median_s']:.2f}); the timeline is {which}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
