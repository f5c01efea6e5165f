"""The simulator against the one GPU step measured so far: the 2026-11-27 H100 probe's 1.1B Llama
step (BENCHMARKS.md), resimulated on the CPU from the model's structure and that session's measured
rates (``bench/resimulate_step.py``). A drift guard: it fails when the time model moves away from
what ran.

What the rates say, per op kind (predicted / measured, 2026-11-28): the step 0.89, BWD 0.92 (the
host AdamW kernel holding the GIL stretches 15 block backwards from ~4.6 to ~20 ms, as measured),
OPT 0.96, CAST 0.95; FWD 0.74, D2H 0.77, H2D 0.79. The last three miss issue 39's 15% because that
session measured nothing that prices them, and each is measured from the next session on
(``bench/gpu_probe.py``): FWD is issue-bound and the issuing cost of megatrain's own template was
not measured (a stand-in block's was, converted here by ratios measured on a CPU,
``bench/template_issue.py``), nor how much a concurrent host CAST slows the issuing thread (the
measured forwards ran ~20% slower while one ran); H2D copies ran at ~43 GB/s against the 54 GB/s
of the probe's copy test (their source, a tile a CAST had just written, sat in the CPU's caches:
``kernels.h2d_after_cast_bytes_per_s`` now measures that case); D2H lost ~25 ms to one copy issued
during a GIL-holding step after the embedding's backward ran long, and to a one-off 30 ms stall.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _load(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def h100():
    resim = _load("resimulate_step")
    probe = json.loads((RESULTS / "2026-11-27-h100-probe.json").read_text())
    measured = json.loads((RESULTS / "2026-11-27-h100-step-timelines.json").read_text())["measured"]
    ratios = json.loads((RESULTS / "2026-11-28-cpu-template-issue.json").read_text())
    spec, filled = resim.complete_spec(json.loads((RESULTS / "2026-11-27-h100-spec.json").read_text()), probe,
                                       "H100_SXM", ratios, host_kernel="deepspeed")  # host-optimizer.json's kernel
    out = resim.resimulate(probe["sections"]["step"]["result"], measured, spec)
    ratio = {k: r["predicted_s"] / r["measured_s"] for k, r in out["by_kind"].items()}
    ratio["STEP"] = out["step"]["predicted_s"] / out["step"]["measured_s"]
    return spec, filled, ratio


def test_the_spec_is_completed_from_measured_rates_and_sourced_presets(h100):
    spec, filled, _ = h100
    assert spec.has_kernel_rates and spec.host_optimizer_issue_stall == 1.0
    assert set(filled) == {"memory_bytes_per_s", "attention_flops", "attention_backward_flops", "launch_overhead_s",
                           "backward_launch_overhead_s", "host_optimizer_issue_stall"}
    # megatrain's template issues each forward op at ~1.5x the stand-in's cost (bench/template_issue.py)
    assert 15e-6 < spec.backward_launch_overhead_s < spec.launch_overhead_s < 30e-6


@pytest.mark.parametrize("kind, low, high", [
    # Issue 39's target is 10% for the step and 15% per kind; 0.89 misses the first by the forward's
    # residual, and FWD, D2H and H2D miss the second (module docstring). The bands hold each kind
    # near what these rates give, so a change to the model that moves one shows here.
    ("STEP", 0.85, 1.10),
    ("BWD", 0.85, 1.15),  # within 15%: the GIL stalls modelled
    ("OPT", 0.85, 1.15),
    ("CAST", 0.85, 1.15),
    ("FWD", 0.70, 1.15),
    ("D2H", 0.72, 1.15),
    ("H2D", 0.75, 1.15),
])
def test_the_measured_h100_step_is_reproduced(h100, kind, low, high):
    assert low <= h100[2][kind] <= high, f"{kind}: predicted / measured {h100[2][kind]:.3f}"
