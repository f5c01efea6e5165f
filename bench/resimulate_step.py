"""The simulator's prediction of a measured GPU step, again, on another ``HardwareSpec``.

``bench/gpu_probe.py``'s step section measures one Llama step on a GPU and predicts it with the spec
it built in the same run. When that spec was wrong (a section failed and a preset filled in, or a
field read the wrong measurement), the question "how far is the simulator from the measurement on
the right spec?" needs no GPU: this script traces the probe's model on the meta device, lowers the
*same plan* the probe ran, simulates it on ``--spec`` and prints predicted against measured seconds
per op kind (FWD, BWD, OPT, CAST, H2D, D2H) and the step, from the probe's timelines file.

Usage (any CPU, about 20 s at 1B)::

    python bench/resimulate_step.py --probe bench/results/2026-11-27-h100-probe.json \\
        --timelines bench/results/2026-11-27-h100-step-timelines.json \\
        --spec bench/results/2026-11-27-h100-spec.json [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_probe import StepShape, _timeline_summary, llama_config  # noqa: E402

from megatrain.ir.hardware import HardwareSpec  # noqa: E402
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan  # noqa: E402
from megatrain.planner.front import PlanRequest, plan  # noqa: E402
from megatrain.planner.simulate import simulate  # noqa: E402
from megatrain.planner.timeline import Timeline  # noqa: E402


def probe_plan(d: dict) -> Plan:
    """The ``Plan`` of a probe step's ``plan`` record (``gpu_probe._plan_dict``)."""
    return Plan(micro_batches=d["micro_batches"], slots=d["slots"], prefetch_distance=d["prefetch_distance"],
                grad_ring=d["grad_ring"], resident=frozenset(d["resident"]), layer_by_layer=d["layer_by_layer"],
                optimizer=OptimizerPlacement(d["optimizer"]), compute_dtype=d["compute_dtype"],
                staging_ring=d["staging_ring"], activations=tuple(ActivationPolicy(a) for a in d["activations"]))


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
    predicted = _timeline_summary(simulate(planned.schedules.steady, planned.graph, spec))
    got = _timeline_summary(Timeline.from_json(json.dumps(measured)))
    pk, mk = ({k: v["total_s"] for k, v in t["by_kind"].items()} for t in (predicted, got))
    rows = {k: {"measured_s": mk.get(k, 0.0), "predicted_s": pk.get(k, 0.0)} for k in sorted(set(pk) | set(mk))}
    return {"spec": spec.name, "step": {"measured_s": got["step_time_s"], "predicted_s": predicted["step_time_s"]},
            "by_kind": rows, "predicted_bottleneck": predicted["bottleneck"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", required=True, help="a gpu_probe probe.json with an ok step section")
    ap.add_argument("--timelines", required=True, help="the same run's timelines.json (measured records)")
    ap.add_argument("--spec", required=True, help="a HardwareSpec JSON to predict on")
    ap.add_argument("--json", help="write the comparison here too")
    args = ap.parse_args()
    step = json.loads(Path(args.probe).read_text())["sections"]["step"]["result"]
    out = resimulate(step, json.loads(Path(args.timelines).read_text())["measured"], HardwareSpec.load(args.spec))
    print(f"spec: {out['spec']}")
    print(f"{'':6} {'measured s':>11} {'predicted s':>12} {'pred/meas':>9}")
    for k, r in [("STEP", out["step"]), *out["by_kind"].items()]:
        ratio = r["predicted_s"] / r["measured_s"] if r["measured_s"] else float("nan")
        print(f"{k:6} {r['measured_s']:11.4f} {r['predicted_s']:12.4f} {ratio:9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
