"""The simulator against the one GPU step measured so far: the 2026-11-27 H100 probe's 1.1B Llama
step (BENCHMARKS.md), resimulated on the CPU from the model's structure and that session's measured
rates (``bench/resimulate_step.py``). A drift guard: it fails when the time model moves away from
what ran.

What the rates say, per op kind (predicted / measured, 2026-12-02): the step 0.83 against the
timeline's step and 0.89 against the median of the probe's three timed steps (0.95 against the one
before it, 0.738 s), BWD 0.84, OPT 0.96, CAST 0.95; FWD 0.74, D2H 0.77, H2D 0.79.

The OPT holds the issuing thread for its kernel's call, DeepSpeed's ``adam_update`` (0.84 of the
OPT: ``rates.megatrain / rates.deepspeed_cpu_adam`` of that session's host_optimizer.json), and
frees it for the finite check's sum after it: so the block backwards that overlap an OPT end with
it, as measured (a whole-OPT hold, the model before, had them ~5 ms longer each and BWD at 0.92 by
that error). The timeline's step holds ~100 ms that no op of the schedule explains (the backwards
of layers 3 and 2 at 12-53 ms with no host op beside two of them, OPT:L3 at 2.4x its neighbours),
which the BWD and STEP ratios against it carry.

The rest misses issue 39's 15% because that session measured nothing that prices it, and each is
measured from the next session on (``bench/gpu_probe.py``): FWD is issue-bound and the issuing cost
of megatrain's own template was not measured (a stand-in block's was, converted here by ratios
measured on a CPU, ``bench/template_issue.py``), nor how much a concurrent host CAST
(``launch.cast_issue_stall``) or an H2D weight copy (``launch.forward_beside_h2d``, the spec's contention fields) slows it: the measured
block forwards took 2.06 ms with neither beside them, 2.36 with a CAST, 2.75 with an H2D. H2D
copies ran at ~42 GB/s against the 54 GB/s of the probe's copy test, whether or not a CAST ran
beside them, while the GPU ran forwards (``launch.forward_beside_h2d`` and
``kernels.h2d_after_cast_bytes_per_s`` measure that); D2H lost ~15 ms to one copy issued as a
GIL-holding OPT began after the embedding's backward ran long (1.2 ms per micro-batch against 0.4
predicted), and ~6 ms to the disturbance. The block backwards not beside an OPT took 4.56 ms
against 4.13 predicted, GPU and issue time nearly equal in the model; the timeline did not record
issue times (``OpRecord.issue_start_s``, recorded since), so which of the two is short is not known.
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
    host_optimizer = json.loads((RESULTS / "2026-11-27-h100-host-optimizer.json").read_text())
    spec, filled = resim.complete_spec(json.loads((RESULTS / "2026-11-27-h100-spec.json").read_text()), probe,
                                       "H100_SXM", ratios, host_kernel="deepspeed", host_optimizer=host_optimizer)
    out = resim.resimulate(probe["sections"]["step"]["result"], measured, spec)
    ratio = {k: r["predicted_s"] / r["measured_s"] for k, r in out["by_kind"].items()}
    ratio["STEP"] = out["step"]["predicted_s"] / out["step"]["measured_s"]
    ratio["STEP_MEDIAN"] = out["steps"]["predicted_s"] / out["steps"]["median_s"]
    return spec, filled, ratio, out, measured


def test_the_opt_holds_the_issuing_thread_for_its_kernel_call(h100):
    """The OPT's share the GIL-holding call takes is the measured rates' ratio (the whole-OPT constant
    is only the fallback), and DeepSpeed's constant is its bytes' share, near the measurement."""
    from megatrain.ir.hardware import HOST_KERNEL_ISSUE_STALL

    spec, filled, *_ = h100
    assert spec.host_optimizer_issue_stall == pytest.approx(3279144314.921853 / 3884673939.9914923)
    assert "rates.deepspeed_cpu_adam" in filled["host_optimizer_issue_stall"]
    assert HOST_KERNEL_ISSUE_STALL["deepspeed"] == pytest.approx(28 / 32)
    assert abs(HOST_KERNEL_ISSUE_STALL["deepspeed"] - spec.host_optimizer_issue_stall) < 0.05


def test_block_backwards_beside_an_opt_end_with_it_as_measured(h100):
    """The backwards the issuing thread was issuing when an OPT took the GIL: each ends about when the
    OPT does (measured), so in all they are predicted within 15%; a hold for the whole OPT put them
    ~25% over. Those are the block backwards (layers 4 to 15, outside the disturbance) that overlap
    an OPT by more than half their measured time."""
    spec, _, _, _, measured = h100
    resim = sys.modules["resimulate_step"]
    recs = measured["records"]
    opts = [(r["start_s"], r["end_s"]) for r in recs if r["op"].startswith("OPT:")]
    beside = []
    for r in recs:
        layer = int(r["op"].split(":")[1][1:])
        if r["op"].startswith("BWD:") and 4 <= layer <= 15:
            a, b = r["start_s"], r["end_s"]
            if sum(max(0.0, min(b, e) - max(a, s)) for s, e in opts) > 0.5 * (b - a):
                beside.append(r["index"])
    assert len(beside) >= 10
    predicted = _predicted_records(resim, spec)
    got = sum(predicted[i] for i in beside)
    want = sum(r["end_s"] - r["start_s"] for r in recs if r["index"] in beside)
    assert 0.85 <= got / want <= 1.15, (f"{len(beside)} backwards beside an OPT: {got:.4f} s predicted, "
                                        f"{want:.4f} measured")


def _predicted_records(resim, spec) -> dict[int, float]:
    """Seconds of each op of the probe's step, simulated on ``spec``, by schedule index."""
    import torch

    from megatrain.planner.front import PlanRequest, plan
    from megatrain.planner.simulate import simulate

    probe = json.loads((RESULTS / "2026-11-27-h100-probe.json").read_text())
    step = probe["sections"]["step"]["result"]
    shape = resim.StepShape(**{k: v for k, v in step["model"].items() if k in resim.StepShape.__dataclass_fields__})
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(resim.llama_config(shape))
    p = resim.probe_plan(step["plan"])
    planned = plan(PlanRequest(model, seq_len=shape.seq_len, global_batch=shape.micro_batch_size * p.micro_batches,
                               micro_batch_size=shape.micro_batch_size, plan=p, hardware=spec, device="cuda",
                               compute_dtype=p.compute_dtype))
    tl = simulate(planned.schedules.steady, planned.graph, spec)
    return {r.index: r.end_s - r.start_s for r in tl.records}


def test_the_spec_is_completed_from_measured_rates_and_sourced_presets(h100):
    spec, filled, *_ = h100
    assert spec.has_kernel_rates and 0.8 < spec.host_optimizer_issue_stall < 0.9
    assert set(filled) == {"memory_bytes_per_s", "attention_flops", "attention_backward_flops", "launch_overhead_s",
                           "backward_launch_overhead_s", "host_optimizer_issue_stall"}
    # megatrain's template issues each forward op at ~1.5x the stand-in's cost (bench/template_issue.py)
    assert 15e-6 < spec.backward_launch_overhead_s < spec.launch_overhead_s < 30e-6


@pytest.mark.parametrize("kind, low, high", [
    # Issue 39's target is 10% for the step and 15% per kind; the step misses the first by the
    # forward's residual (and, against the timeline's step, its disturbance), and FWD, D2H and H2D
    # miss the second (module docstring). The bands hold each kind near what these rates give, so a
    # change to the model that moves one shows here.
    ("STEP_MEDIAN", 0.85, 1.10),  # the median of the probe's timed steps
    ("STEP", 0.80, 1.10),  # the timeline's step, ~100 ms of it unexplained (module docstring)
    ("BWD", 0.80, 1.15),  # the GIL stalls modelled; the disturbance is ~75 ms of the measured BWD
    ("OPT", 0.85, 1.15),
    ("CAST", 0.85, 1.15),
    ("FWD", 0.70, 1.15),
    ("D2H", 0.72, 1.15),
    ("H2D", 0.75, 1.15),
])
def test_the_measured_h100_step_is_reproduced(h100, kind, low, high):
    assert low <= h100[2][kind] <= high, f"{kind}: predicted / measured {h100[2][kind]:.3f}"


def test_the_first_probe_measured_no_contention_so_none_is_filled(h100):
    """The 2026-11-27 probe has no launch.forward_beside_h2d: its spec stays at "no contention"."""
    spec, filled, *_ = h100
    assert not spec.has_contention and not set(filled) & {"compute_slowdown_beside_h2d",
                                                          "h2d_beside_compute_bytes_per_s"}
    assert not spec.has_issue_contention and "issue_slowdown_beside_h2d" not in filled


def _probe_with_contention(slowdown: float, rate: float, issue: float | None = None) -> dict:
    probe = json.loads((RESULTS / "2026-11-27-h100-probe.json").read_text())
    beside = {"forward_slowdown": slowdown, "h2d_beside_forward_bytes_per_s": rate}
    if issue is not None:
        beside["issue_slowdown_beside_h2d"] = issue
    probe["sections"]["launch"]["result"]["forward_beside_h2d"] = beside
    return probe


def test_contention_is_read_from_a_probe_that_measured_it(h100):
    resim = sys.modules["resimulate_step"]
    fields = json.loads((RESULTS / "2026-11-27-h100-spec.json").read_text())
    spec, filled = resim.complete_spec(fields, _probe_with_contention(0.1, 45e9))
    assert spec.compute_slowdown_beside_h2d == 0.1 and spec.h2d_beside_compute_bytes_per_s == 45e9
    assert filled["compute_slowdown_beside_h2d"] == "the probe's launch.forward_beside_h2d.forward_slowdown"
    assert filled["h2d_beside_compute_bytes_per_s"] == \
        "the probe's launch.forward_beside_h2d.h2d_beside_forward_bytes_per_s"
    # By hand over the probe's; a spec that has them keeps them against the probe.
    spec, filled = resim.complete_spec(fields, _probe_with_contention(0.1, 45e9), contention=(0.25, 42e9))
    assert (spec.compute_slowdown_beside_h2d, spec.h2d_beside_compute_bytes_per_s) == (0.25, 42e9)
    assert filled["compute_slowdown_beside_h2d"] == filled["h2d_beside_compute_bytes_per_s"] == \
        "given by hand (--contention)"
    kept, filled = resim.complete_spec({**fields, "compute_slowdown_beside_h2d": 0.3},
                                       _probe_with_contention(0.1, 45e9))
    assert kept.compute_slowdown_beside_h2d == 0.3 and "compute_slowdown_beside_h2d" not in filled
    assert kept.issue_slowdown_beside_h2d == 0 and "issue_slowdown_beside_h2d" not in filled


def test_the_issue_slowdown_is_read_from_a_probe_that_measured_it(h100):
    """The same-thread forward beside copies (launch.forward_beside_h2d.issue_slowdown_beside_h2d) fills
    the spec's issue slowdown; two values by hand leave it to the probe, a third sets it."""
    resim = sys.modules["resimulate_step"]
    fields = json.loads((RESULTS / "2026-11-27-h100-spec.json").read_text())
    probe = _probe_with_contention(0.1, 45e9, issue=0.2)
    spec, filled = resim.complete_spec(fields, probe)
    assert spec.issue_slowdown_beside_h2d == 0.2 and spec.has_issue_contention
    assert filled["issue_slowdown_beside_h2d"] == "the probe's launch.forward_beside_h2d.issue_slowdown_beside_h2d"
    spec, filled = resim.complete_spec(fields, probe, contention=(0.25, 42e9))
    assert spec.issue_slowdown_beside_h2d == 0.2 and filled["compute_slowdown_beside_h2d"] == \
        "given by hand (--contention)"
    spec, filled = resim.complete_spec(fields, probe, contention=(0.25, 42e9, 0.15))
    assert spec.issue_slowdown_beside_h2d == 0.15
    assert filled["issue_slowdown_beside_h2d"] == "given by hand (--contention)"


def _h100_argv(*extra: str, completed: bool = True) -> list[str]:
    """``resimulate_step.py``'s arguments for the 2026-11-27 H100 files, the spec completed as the
    ``h100`` fixture completes it (``completed``: the issue ratios and the host optimizer's JSON),
    then ``extra``."""
    argv = ["--probe", str(RESULTS / "2026-11-27-h100-probe.json"),
            "--timelines", str(RESULTS / "2026-11-27-h100-step-timelines.json"),
            "--spec", str(RESULTS / "2026-11-27-h100-spec.json")]
    if completed:
        argv += ["--issue-ratios", str(RESULTS / "2026-11-28-cpu-template-issue.json"), "--host-kernel", "deepspeed",
                 "--host-optimizer", str(RESULTS / "2026-11-27-h100-host-optimizer.json")]
    return [*argv, *extra]


def test_the_contention_flag_sets_both_fields_by_hand(h100, capsys):
    """``--contention SLOWDOWN,H2D_BYTES_PER_S`` fills the two fields, printed as given by hand, and the
    copies beside the forwards then take longer (a what-if on the 11-27 step: module docstring)."""
    resim = sys.modules["resimulate_step"]
    *_, out, _ = h100
    resim.main(_h100_argv("--contention", "0.25,42e9"))
    printed = capsys.readouterr().out
    assert "  compute_slowdown_beside_h2d = 0.25: given by hand (--contention)" in printed
    assert "  h2d_beside_compute_bytes_per_s = 4.2e+10: given by hand (--contention)" in printed
    h2d = next(line.split() for line in printed.splitlines() if line.startswith("H2D "))
    assert float(h2d[2]) > out["by_kind"]["H2D"]["predicted_s"] * 1.1


def test_the_contention_flag_takes_the_issue_slowdown_third(h100, capsys):
    """``--contention SLOWDOWN,H2D_BYTES_PER_S,ISSUE_SLOWDOWN`` also sets the issuing thread's slowdown
    beside a copy in flight, printed as given by hand, and the issue-bound forwards beside the
    copies then take longer (a what-if on the 11-27 step, not a prediction: module docstring)."""
    resim = sys.modules["resimulate_step"]
    printed = {}
    for text in ("0.25,42e9", "0.25,42e9,0.25"):
        resim.main(_h100_argv("--contention", text))
        printed[text] = capsys.readouterr().out
    assert "issue_slowdown_beside_h2d" not in printed["0.25,42e9"]
    assert "  issue_slowdown_beside_h2d = 0.25: given by hand (--contention)" in printed["0.25,42e9,0.25"]
    fwd = {k: float(next(line.split() for line in p.splitlines() if line.startswith("FWD "))[2])
           for k, p in printed.items()}
    assert fwd["0.25,42e9,0.25"] > fwd["0.25,42e9"] * 1.05


@pytest.mark.parametrize("text", ["0.25", "1.0,42e9", "-0.1,42e9", "0.25,-1", "a,b", "0.25,42e9,1.0",
                                  "0.25,42e9,-0.1", "0.25,42e9,0.1,0.1"])
def test_a_bad_contention_flag_names_the_rule(text, capsys):
    resim = _load("resimulate_step")
    with pytest.raises(SystemExit):
        resim.main(["--probe", "p", "--timelines", "t", "--spec", "s", "--contention", text])
    assert "SLOWDOWN" in capsys.readouterr().err


def test_the_kept_timeline_is_named_the_median_or_the_last(h100, capsys):
    """Which timed step the timelines file's ``measured`` is: the first H100 probe kept the last of its
    three (0.844 s), which the printout says; a probe that marks its row ``timeline_kept`` (the
    median step, ``gpu_probe.median_step``) is named by that mark, not by matching times."""
    resim = sys.modules["resimulate_step"]
    *_, out, _ = h100
    assert out["kept"] == {"index": 2, "of": 3, "rule": "last"}
    rows = [{"timeline_step_s": 0.79}, {"timeline_step_s": 0.74, "timeline_kept": True}, {"timeline_step_s": 0.84}]
    assert resim.kept_step(rows, 0.84) == {"index": 1, "of": 3, "rule": "median"}
    assert resim.kept_step(rows[:1] + rows[2:], 0.79) == {"index": 0, "of": 2, "rule": "matched"}
    assert resim.kept_step(rows[:1], 0.5) is None
    resim.main(_h100_argv(completed=False))
    assert "the timeline is timed step 3 of 3's (the last)" in capsys.readouterr().out


def test_the_host_issue_flag_slows_the_forwards_beside_the_casts(h100, capsys):
    """``--host-issue CAST[,OPT]`` sets how much a host CAST (and an OPT's GIL-free part) slow the
    issuing thread, printed as given by hand; the 11-27 step's forwards, issue-bound and issued
    while the CASTs run, then take longer, and the backwards beside the OPTs' tails too (a what-if:
    module docstring)."""
    resim = sys.modules["resimulate_step"]
    *_, out, _ = h100
    rows = {}
    for flag in ("0.2", "0.2,0.2"):
        resim.main(_h100_argv("--host-issue", flag))
        printed = capsys.readouterr().out
        rows[flag] = {line.split()[0]: float(line.split()[2]) for line in printed.splitlines()
                      if len(line.split()) == 4 and line.split()[0] in ("FWD", "BWD")}  # the per-kind table
        assert "  host_cast_issue_stall = 0.2: given by hand (--host-issue)" in printed
    assert rows["0.2"]["FWD"] > out["by_kind"]["FWD"]["predicted_s"] * 1.05
    assert rows["0.2"]["BWD"] == pytest.approx(out["by_kind"]["BWD"]["predicted_s"], abs=1e-4)  # no CAST beside them (printed to 0.1 ms)
    assert rows["0.2,0.2"]["BWD"] > rows["0.2"]["BWD"]


@pytest.mark.parametrize("text", ["", "1.0", "-0.1", "a", "0.1,0.1,0.1", "0.1,1.0"])
def test_a_bad_host_issue_flag_names_the_rule(text, capsys):
    resim = _load("resimulate_step")
    with pytest.raises(SystemExit):
        resim.main(["--probe", "p", "--timelines", "t", "--spec", "s", "--host-issue", text])
    assert "CAST[,OPT]" in capsys.readouterr().err


def test_compute_ops_are_grouped_by_what_ran_beside_them(h100, capsys):
    """``by_context`` on the 11-27 step: every compute op in one group; the block forwards beside a
    CAST were measured slower than those alone (2.36 against 2.02 ms) though predicted alike, the
    gap the CASTs' slowdown of the issuing thread explains; and on a two-op timeline built by hand
    the contexts and medians are the ones constructed."""
    from megatrain.ir.schedule import Stream
    from types import SimpleNamespace

    from megatrain.planner.timeline import OpRecord

    resim = sys.modules["resimulate_step"]
    *_, out, measured = h100
    rows = {(r["kind"], r["beside"]): r for r in out["by_context"]}
    compute = [r for r in measured["records"] if r["op"].split(":")[0] in ("FWD", "BWD")]
    assert sum(r["ops"] for r in out["by_context"]) == len(compute)
    cast, alone = rows[("FWD", "CAST")], rows[("FWD", "alone")]
    assert cast["measured_median_s"] > 1.1 * alone["measured_median_s"]
    assert cast["predicted_median_s"] == pytest.approx(alone["predicted_median_s"], rel=0.01)
    assert rows[("BWD", "OPT")]["measured_median_s"] > 3 * rows[("BWD", "alone")]["measured_median_s"]

    def tl(records):
        return SimpleNamespace(records=[OpRecord(i, *r) for i, r in enumerate(records)])

    m = tl([("FWD:L1:m0:s1", Stream.COMPUTE, 0.0, 2.0), ("CAST:L2:t0", Stream.CAST, 0.5, 2.0),
            ("FWD:L1:m1:s1", Stream.COMPUTE, 2.0, 3.0), ("H2D:L2:s0:t0", Stream.H2D, 2.9, 4.0)])
    p = tl([("FWD:L1:m0:s1", Stream.COMPUTE, 0.0, 1.0), ("FWD:L1:m1:s1", Stream.COMPUTE, 1.0, 2.0)])
    assert resim.by_context(m, p) == [
        {"kind": "FWD", "beside": "CAST", "ops": 1, "measured_median_s": 2.0, "predicted_median_s": 1.0},
        {"kind": "FWD", "beside": "alone", "ops": 1, "measured_median_s": 1.0, "predicted_median_s": 1.0}]
    resim.main(_h100_argv(completed=False))
    printed = capsys.readouterr().out
    assert "compute ops by what ran beside them in the measured step (medians):" in printed
    assert any(line.split()[:2] == ["FWD", "CAST"] for line in printed.splitlines())
