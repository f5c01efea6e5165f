"""bench/gpu_probe.py: its --dry-run end to end on the CPU, a failing and a hanging section recorded
while the others run, and the parts that need no run (junit parsing, which tests count as CUDA
tests, the section time limit, the budget)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatrain.ir.hardware import HardwareSpec
from megatrain.planner.timeline import Timeline

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_probe.py"


def _load_probe():
    spec = importlib.util.spec_from_file_location("gpu_probe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


probe = _load_probe()


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    # A budget far above the dry run's needs: on a loaded machine slowness must not read as a failure.
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--budget-s", "3000", *extra],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    p = _run(out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, json.loads((out / "probe.json").read_text())


def test_dry_run_runs_every_section(dry):
    out, doc = dry
    assert doc["mode"] == "dry-run" and doc["probe_format_version"] == probe.PROBE_FORMAT_VERSION
    assert list(doc["sections"]) == list(probe.SECTION_ORDER)
    race_file = (ROOT / "tests" / "test_race_detector.py").exists()
    for name, entry in doc["sections"].items():
        want = "skipped" if name == "race_detector" and not race_file else "ok"
        assert entry["status"] == want, f"{name}: {entry.get('error')}\n{entry.get('traceback', '')}"
        assert entry["seconds"] >= 0 and entry["limit_s"] > 0
    assert doc["summary"]["statuses"] == {k: v["status"] for k, v in doc["sections"].items()}
    assert doc["finished_utc"] >= doc["started_utc"]


def test_dry_run_environment(dry):
    _, doc = dry
    env = doc["sections"]["environment"]["result"]
    assert env["versions"]["torch"] == torch.__version__.split("+")[0] or env["versions"]["torch"] == torch.__version__
    assert env["versions"]["pydantic"] and env["versions"]["transformers"]
    assert env["cpu"]["os_cpu_count"] == os.cpu_count()
    assert env["memory"]["MemTotal"] > env["memory"]["MemAvailable"] > 0
    assert env["cpu"]["l3"]["total_bytes"] == probe.l3_cache()["total_bytes"]
    assert env["gpu"] is None and Path(env["megatrain_file"]).resolve().is_relative_to(ROOT)


def test_dry_run_copies_pinned_launch_and_matmul(dry):
    _, doc = dry
    s = {k: v["result"] for k, v in doc["sections"].items() if v["status"] == "ok"}
    copies = s["copies"]
    assert [r["bytes"] for r in copies["sizes"]] == [1 << 20, 4 << 20]
    for r in copies["sizes"]:
        assert r["data_checked"] and r["h2d_bytes_per_s"] > 0 and r["d2h_bytes_per_s"] > 0
        assert r["both_total_bytes_per_s"] > 0 and isinstance(r["duplex"], bool)
    assert copies["h2d_bytes_per_s"] == copies["sizes"][-1]["h2d_bytes_per_s"]

    pinned = s["pinned_alloc"]["sizes"]
    assert [r["requested_bytes"] for r in pinned] == [1 << 20, (3 << 20) + 4096]
    assert all(r["empty_s"] >= 0 and r["register_exact"]["status"] == "skipped" for r in pinned)

    launch = s["launch"]
    # Issue time is a prefix of each trial's total time, so its median cannot exceed the total's.
    assert 0 < launch["issue_s_per_op"] <= launch["total_s_per_op"]
    assert all(a <= b for a, b in zip(launch["issue_s_per_op_all"], launch["total_s_per_op_all"]))

    # The issue costs of a layer template as the executor runs it: the stand-in block and megatrain's
    # own template of the step's block, each op counted once (fused attention one op, fewer than meta
    # tracing counts).
    t = launch["template_issue"]
    for name in ("standin", "template"):
        r = t[name]
        assert r["fwd_s_per_op"] > 0 and r["bwd_s_per_op"] > 0 and r["calls"] >= 5
        assert r["fwd_ops"] < r["meta_counts"][0] and r["bwd_ops"] < r["meta_counts"][1] + 20
        assert r["fwd_s_per_op"] == pytest.approx(r["fwd_s"] / r["fwd_ops"])
    assert launch["template_fwd_s_per_op"] == t["template"]["fwd_s_per_op"]
    for name in ("opt", "cast"):
        st = t["issue_stall"][name]
        assert 0 <= st["stall"] <= 1 and st["calls"] >= 5 and st["alone_s"] > 0 and st["during_s"] > 0
        assert st["stall"] == pytest.approx(min(1.0, max(0.0, 1 - st["alone_s"] / st["during_s"])))
    assert t["template_fwd_over_standin_fwd"] == pytest.approx(t["template"]["fwd_s_per_op"] / t["standin"]["fwd_s_per_op"])
    # The template's forward and a layer tile's H2D, each alone and beside the other (the first H100
    # step's forwards and copies ran slower beside each other than alone, which nothing priced).
    b = launch["forward_beside_h2d"]
    assert b == t["beside_h2d"] and b["numel"] == 1 << 16 and b["bytes"] == 2 * b["numel"]
    for key in ("forward_alone_s", "forward_beside_h2d_s", "h2d_alone_s", "h2d_beside_forward_s"):
        assert b[key] > 0
    assert b["h2d_alone_bytes_per_s"] == pytest.approx(b["bytes"] / b["h2d_alone_s"])
    assert b["h2d_beside_forward_bytes_per_s"] == pytest.approx(b["bytes"] / b["h2d_beside_forward_s"])
    slowdown = 1 - b["forward_alone_s"] / b["forward_beside_h2d_s"]
    assert b["forward_slowdown"] == pytest.approx(min(1.0, max(0.0, slowdown)))
    # The same forward launched by the thread that has just queued the copies, as the runtime does
    # (no second thread): its launches' wall time alone and beside, and its time beside. On the CPU
    # the copies run inline, so nothing is checked in flight.
    assert b["same_thread_copies"] == 2 and b["same_thread_trials"] >= 5
    assert b["copies_in_flight_trials"] is None and b["copies_outlast_forward_trials"] is None
    for key in ("forward_issue_alone_s", "forward_issue_beside_h2d_s", "forward_beside_h2d_same_thread_s"):
        assert b[key] > 0
    issue = 1 - b["forward_issue_alone_s"] / b["forward_issue_beside_h2d_s"]
    assert 0 <= b["issue_slowdown_beside_h2d"] < 1
    assert b["issue_slowdown_beside_h2d"] == pytest.approx(max(0.0, issue))
    assert b["forward_slowdown_same_thread"] == pytest.approx(
        min(1.0, max(0.0, 1 - b["forward_alone_s"] / b["forward_beside_h2d_same_thread_s"])))

    k = s["kernels"]
    assert k["memory_bytes_per_s"] > 0 and k["kernel_overhead_s"] > 0 and k["h2d_after_cast_bytes_per_s"] > 0
    assert all(r["bytes_per_s"] > 0 for r in k["elementwise"].values())
    att = k["attention"]
    assert att["causal"] and att["bwd_counted_flops"] == pytest.approx(2.5 * att["fwd_counted_flops"])
    assert att["fwd_useful_flops_per_s"] == pytest.approx(att["fwd_counted_flops"] / 2 / att["fwd_s"])
    # The block's projections forward and their weight gradients, each beside the roofline's time.
    assert len(k["matmuls"]) == 7 and all(r["flops_per_s"] > 0 and r["roofline_s"] > 0 for r in k["matmuls"])

    mm = s["matmul"]
    for key in ("bf16", "fp32", "tf32"):
        assert mm[key]["flops_per_s"] > 0 and math.isfinite(mm[key]["rel_err_vs_fp64"])
    # The reference multiplies the same (already rounded) inputs in FP64, so only the output and the
    # accumulation round: FP32 over 256 terms is ~sqrt(256) x 2^-24 ~ 1e-6 relative (1e-4 bounds it
    # far off); a BF16 output alone rounds by up to 2^-8 ~ 3.9e-3 (1e-2 leaves room for blocked sums).
    assert mm["fp32"]["rel_err_vs_fp64"] < 1e-4
    assert mm["bf16"]["rel_err_vs_fp64"] < 1e-2


def test_dry_run_host_rates(dry):
    from megatrain.planner import cost
    from megatrain.runtime.host_kernels import HostAdamW, deepspeed_installed
    from megatrain.runtime.measure import host_cores

    _, doc = dry
    h = doc["sections"]["host_rates"]["result"]
    budget = cost.host_worker_threads(host_cores())
    assert h["host_cores"] == host_cores() and h["budget_threads"] == budget
    assert [r["threads"] for r in h["rows"]] == sorted({t for t in (1, 2) if t <= host_cores()} | {budget})
    assert h["kernels"] == ["torch"] + (["deepspeed"] if deepspeed_installed() else [])
    assert h["megatrain_kernel"] == HostAdamW().kernel
    for r in h["rows"]:
        for k in h["kernels"]:
            assert r[f"adamw_{k}_params_per_s"] > 0 and r[f"adamw_{k}_bf16_grads_params_per_s"] > 0
        assert r["adamw_params_per_s"] == r[f"adamw_{h['megatrain_kernel']}_params_per_s"]
        assert r["adamw_bytes_per_s"] == pytest.approx(28 * r["adamw_params_per_s"])
        assert r["cast_bytes_per_s"] == pytest.approx(6 * r["cast_elements_per_s"]) and r["cast_elements_per_s"] > 0
    row = next(r for r in h["rows"] if r["threads"] == budget)
    assert h["adamw_params_per_s_at_budget"] == row["adamw_params_per_s"]
    assert h["adamw_bf16_grads_params_per_s_at_budget"] == row["adamw_bf16_grads_params_per_s"]
    assert h["cast_elements_per_s_at_budget"] == row["cast_elements_per_s"]


def test_dry_run_spec_reads_back_and_names_its_sources(dry):
    out, doc = dry
    s = {k: v["result"] for k, v in doc["sections"].items() if v["status"] == "ok"}
    spec = HardwareSpec.load(out / "spec.json")
    assert spec == HardwareSpec.model_validate(s["spec"]["spec"])
    # Without a GPU only the GPU's memory has no measurement; it comes from the preset, and says so.
    assert s["spec"]["fields_from_preset"] == ["gpu_memory_bytes"]
    assert "dry run" in spec.name and "partly H100_SXM preset: gpu_memory_bytes" in spec.name
    assert spec.h2d_bytes_per_s == s["copies"]["h2d_bytes_per_s"]
    assert spec.d2h_bytes_per_s == s["copies"]["d2h_bytes_per_s"]
    assert spec.duplex == s["copies"]["duplex"]
    assert spec.bf16_flops == s["matmul"]["bf16"]["flops_per_s"]
    assert spec.fp32_flops == s["matmul"]["fp32"]["flops_per_s"], "strict FP32 (TF32 off), the rate megatrain's FP32 ops get"
    assert spec.host_optimizer_params_per_s == s["host_rates"]["adamw_params_per_s_at_budget"]
    assert spec.host_optimizer_bf16_params_per_s == s["host_rates"]["adamw_bf16_grads_params_per_s_at_budget"]
    assert spec.host_cast_elements_per_s == s["host_rates"]["cast_elements_per_s_at_budget"]
    assert spec.host_cores == s["host_rates"]["host_cores"]
    assert spec.host_memory_bytes == s["environment"]["memory"]["MemTotal"]
    # The issue model's per-op costs: megatrain's own template of the step's block, forward and backward.
    assert spec.launch_overhead_s == s["launch"]["template_fwd_s_per_op"]
    assert spec.backward_launch_overhead_s == s["launch"]["template_bwd_s_per_op"]
    # The kernel model's GPU rates, and the host kernel's GIL behaviour from the kernel measured.
    k = s["kernels"]
    assert spec.memory_bytes_per_s == k["memory_bytes_per_s"] and spec.kernel_overhead_s == k["kernel_overhead_s"]
    assert spec.attention_flops == k["attention"]["fwd_useful_flops_per_s"]
    assert spec.attention_backward_flops == k["attention"]["bwd_useful_flops_per_s"]
    assert spec.h2d_after_cast_bytes_per_s == k["h2d_after_cast_bytes_per_s"]
    assert spec.has_kernel_rates and spec.gemm_efficiency == 1.0
    # How much the host OPT and a CAST slow the issuing thread, measured on the template's forward: a
    # GIL-holding OPT kernel stops the thread for that share of the OPT, a GIL-releasing one slows it.
    from megatrain.ir.hardware import HOST_KERNEL_ISSUE_STALL

    kernel = s["launch"]["optimizer_kernel"]
    assert kernel == s["host_rates"]["megatrain_kernel"]
    if HOST_KERNEL_ISSUE_STALL[kernel] == 0.0:
        assert spec.host_optimizer_issue_stall == 0.0
        assert spec.host_optimizer_issue_slowdown == min(s["launch"]["optimizer_issue_stall"], math.nextafter(1.0, 0.0))
        assert "releases the GIL" in s["spec"]["sources"]["host_optimizer_issue_slowdown"]
    else:
        assert spec.host_optimizer_issue_stall == s["launch"]["optimizer_issue_stall"]
        assert spec.host_optimizer_issue_slowdown == 0.0
    assert spec.host_cast_issue_stall == s["launch"]["cast_issue_stall"]
    assert set(s["spec"]["sources"]) >= set(HardwareSpec.model_fields) - {"name"}


def test_dry_run_step_measured_beside_predicted(dry):
    out, doc = dry
    step = doc["sections"]["step"]["result"]
    assert step["backend"] == "CUDABackend + FakeCuda"
    assert [r["warmup"] for r in step["steps"]] == [True, False, False, False]
    assert all(math.isfinite(r["loss"]) for r in step["steps"])
    m, p = step["measured"], step["predicted"]
    assert m["step_time_s"] > 0 and p["step_time_s"] > 0
    assert step["predicted_over_measured"] == pytest.approx(p["step_time_s"] / m["step_time_s"])
    # The timeline compared is the median timed step's, and its row says so.
    timed = [r for r in step["steps"] if not r["warmup"]]
    assert [r.get("timeline_kept", False) for r in timed].count(True) == 1
    kept = next(r for r in timed if r.get("timeline_kept"))
    assert m["step_time_s"] == kept["timeline_step_s"] == sorted(r["timeline_step_s"] for r in timed)[1]
    for tl in (m, p):
        # Ops on one stream never overlap, so no stream is busy for longer than the step.
        assert all(0 <= f <= 1 + 1e-9 for f in tl["busy_fraction"].values())
        assert sum(k["count"] for k in tl["by_kind"].values()) == step["ops"]
        assert tl["bottleneck"] in tl["busy_s"]
    timelines = json.loads((out / "timelines.json").read_text())
    measured = Timeline.from_json(json.dumps(timelines["measured"]))
    predicted = Timeline.from_json(json.dumps(timelines["predicted"]))
    assert measured.source == "measured" and predicted.source == "simulated"
    assert [r.op for r in measured.records] == [r.op for r in predicted.records]
    assert measured.step_time_s == m["step_time_s"] and predicted.step_time_s == p["step_time_s"]
    # The compute ops grouped by what ran beside them: every one of the kept step's in one group.
    assert sum(r["ops"] for r in step["by_context"]) == sum(
        1 for r in measured.records if r.op.split(":")[0] in ("FWD", "RECOMPUTE", "BWD") and r.end_s > r.start_s)
    # Every timed step's timeline is kept beside it, each with its step number and time.
    each = timelines["measured_steps"]
    assert [e["step"] for e in each] == [r["step"] for r in timed]
    assert [Timeline.from_json(json.dumps(e["timeline"])).step_time_s for e in each] == \
        [r["timeline_step_s"] for r in timed]
    trace = json.loads((out / "trace.json").read_text())
    ops = {pid: sum(1 for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid and e["cat"] != "issue")
           for pid in (1, 2)}
    assert ops == {1: step["ops"], 2: step["ops"]}
    # GPU busy or issue-bound: the measured step (FakeCuda runs each op's work as it is issued, so
    # every GPU op is issue-bound) splits each GPU stream's time; the simulator's has no issue times.
    assert m["gpu_busy_s"]["compute"] == 0.0
    assert m["issue_bound_s"]["compute"] == pytest.approx(m["busy_s"]["compute"])
    assert m["issuing_thread"]["busy_s"] >= m["issue_bound_s"]["compute"]
    assert 0 <= m["issuing_thread"]["blocked_s"] <= m["issuing_thread"]["busy_s"]
    assert p["gpu_busy_s"] == {} and p["issuing_thread"] is None
    summary = doc["summary"]
    assert summary["compute_gpu_busy_fraction"] == 0.0
    assert summary["compute_issue_bound_fraction"] == pytest.approx(m["issue_bound_fraction"]["compute"])
    assert summary["compute_busy_fraction"] == m["busy_fraction"]["compute"]
    assert summary["issuing_thread_blocked_s"] == m["issuing_thread"]["blocked_s"]
    tail = m["tail"]
    assert summary["tail_s"] == tail["after_last_compute_s"] >= 0
    assert 0 <= tail["carry_saving_bound_s"] <= tail["after_last_compute_s"]


def test_the_median_step_is_compared_so_one_disturbed_step_is_not():
    """The first H100 probe's three timed steps (bench/results/2026-11-27-h100-probe.json): it kept the
    last, disturbed one (0.844 s); the median rule keeps 0.794 s, the middle one."""
    doc = json.loads((ROOT / "bench" / "results" / "2026-11-27-h100-probe.json").read_text())
    times = [r["timeline_step_s"] for r in doc["sections"]["step"]["result"]["steps"] if not r["warmup"]]
    assert probe.median_step(times) == 0 and times[0] == sorted(times)[1] < times[-1]
    # Odd counts: the middle; even: the lower of the middle two; equal times rank in step order.
    assert probe.median_step([3.0, 1.0, 2.0]) == 2
    assert probe.median_step([4.0, 1.0, 3.0, 2.0]) == 3
    assert probe.median_step([2.0, 2.0, 2.0]) == 1 and probe.median_step([5.0]) == 0
    with pytest.raises(ValueError, match="no timed steps"):
        probe.median_step([])


def test_the_tail_of_the_first_h100_step():
    """The 1.1B step the first GPU session measured (bench/results/): the compute stream's last op
    ended 40 ms before the step, with the D2H of layer 0 and the optimizer steps of layers 1 and 0
    still to run. Carried into the next step they would still run before its forward of layers 0
    and 1, one at a time, so only the forward of layer 0 (the embedding, 2.7 ms) could overlap them."""
    from megatrain.ir.schedule import Stream

    doc = json.loads((ROOT / "bench" / "results" / "2026-11-27-h100-step-timelines.json").read_text())
    tl = Timeline.from_json(json.dumps(doc["measured"]))
    tail = probe._tail(tl)
    assert tail["ops"] == ["OPT:L1:r1", "D2H:L0:s4:r2", "OPT:L0:r2"] and tail["opt_layers"] == [0, 1]
    assert tail["after_last_compute_s"] == pytest.approx(0.0399, abs=1e-4)
    fwd0 = sum(r.duration_s for r in tl.records if r.op.startswith("FWD:L0:"))
    assert tail["carry_saving_bound_s"] == tail["forward_below_s"] == pytest.approx(fwd0) == pytest.approx(0.0027, abs=1e-4)
    assert max(r.end_s for r in tl.records if r.stream is Stream.COMPUTE) + tail["after_last_compute_s"] == \
        pytest.approx(tl.step_time_s)


def test_dry_run_cuda_tests_select_only_tests_that_need_cuda(dry):
    out, doc = dry
    t = doc["sections"]["cuda_tests"]["result"]
    assert (out / "junit_cuda.xml").exists() and t["exit_code"] == 0
    assert t["tests"] >= 1 and t["failures"] == 0 and t["errors"] == 0
    if not torch.cuda.is_available():
        # Every selected test needs CUDA, so here each one skips: a selected test that ran would be
        # one that does not need a GPU (test_make_backend_cuda_without_a_gpu_... must be left out).
        assert t["skipped"] == t["tests"] and t["passed"] == 0
        assert set(t["skip_reasons"]) == {"needs a CUDA GPU"}


def test_a_failing_and_a_hanging_section_are_recorded_and_the_rest_runs(tmp_path):
    p = _run(tmp_path, "--sections", "copies,launch,spec", "--inject", "copies=error", "--inject", "launch=hang",
             "--limit", "launch=1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "probe.json").read_text())
    assert list(doc["sections"]) == ["copies", "launch", "spec"]
    copies, launch, spec = (doc["sections"][k] for k in ("copies", "launch", "spec"))
    assert copies["status"] == "error" and copies["error"].startswith("InjectedFailure")
    assert "InjectedFailure" in copies["traceback"] and "result" not in copies
    assert launch["status"] == "timeout" and "limit of 1 s" in launch["error"]
    assert launch["seconds"] >= 1.0 and launch["limit_s"] == 1.0
    assert spec["status"] == "ok"
    # Every measured field fell back to the preset, and the spec lists each one and says so in its name.
    fallback = set(spec["result"]["fields_from_preset"])
    assert fallback == {f for f in probe.MEASURED_FIELDS if f in HardwareSpec.model_fields}
    assert fallback >= {"gpu_memory_bytes", "bf16_flops", "fp32_flops", "h2d_bytes_per_s", "d2h_bytes_per_s",
                        "duplex", "host_memory_bytes", "host_optimizer_params_per_s"}
    assert all("preset" in spec["result"]["sources"][f] for f in fallback)
    loaded = HardwareSpec.load(tmp_path / "spec.json")
    assert "partly H100_SXM preset" in loaded.name
    assert doc["summary"]["statuses"] == {"copies": "error", "launch": "timeout", "spec": "ok"}
    assert doc["summary"]["h2d_GBps"] is None


def test_a_spent_budget_skips_sections_and_says_why(tmp_path, capsys):
    assert probe.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "0", "--sections", "copies,spec"]) == 0
    doc = json.loads((tmp_path / "probe.json").read_text())
    for name in ("copies", "spec"):
        assert doc["sections"][name]["status"] == "skipped"
        assert "budget" in doc["sections"][name]["reason"]


@pytest.mark.parametrize("argv, message", [
    (["--inject", "nosuch=error"], "SECTION one of"),
    (["--inject", "copies=explode"], "VALUE must be one of"),
    (["--limit", "copies"], "SECTION=VALUE"),
    (["--sections", "copies,nosuch"], "unknown ['nosuch']"),
])
def test_bad_options_name_the_rule(tmp_path, argv, message):
    with pytest.raises(SystemExit) as info:
        probe.main(["--dry-run", "--out", str(tmp_path), *argv])
    assert message in str(info.value)


def test_time_limit_interrupts_python_code():
    t0 = time.perf_counter()
    with pytest.raises(probe.SectionTimeout, match="limit of 0 s"):
        with probe.time_limit(0.2):
            while True:
                time.sleep(0.01)
    assert time.perf_counter() - t0 >= 0.2
    with probe.time_limit(5):  # a section that finishes in time leaves no alarm behind
        pass
    time.sleep(0.01)


def test_parse_junit(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text("""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1"
        failures="1" skipped="2" tests="5" time="1.0">
        <testcase classname="tests.test_a" name="test_ok" time="0.1"/>
        <testcase classname="tests.test_a" name="test_bad" time="0.1"><failure message="assert 1 == 2">x</failure></testcase>
        <testcase classname="tests.test_a" name="test_err" time="0.1"><error message="fixture broke">y</error></testcase>
        <testcase classname="tests.test_b" name="test_s1" time="0"><skipped message="needs a CUDA GPU"/></testcase>
        <testcase classname="tests.test_b" name="test_s2" time="0"><skipped message="needs a CUDA GPU"/></testcase>
        </testsuite></testsuites>""")
    r = probe.parse_junit(xml)
    assert (r["tests"], r["passed"], r["failures"], r["errors"], r["skipped"]) == (5, 1, 1, 1, 2)
    assert r["failed"] == [{"test": "tests.test_a::test_bad", "kind": "failure", "message": "assert 1 == 2"},
                           {"test": "tests.test_a::test_err", "kind": "error", "message": "fixture broke"}]
    assert r["skip_reasons"] == {"needs a CUDA GPU": 2}


def _item(*marks):
    return SimpleNamespace(get_closest_marker=lambda name: next((m for m in marks if m.name == name), None),
                           iter_markers=lambda name=None: [m for m in marks if name is None or m.name == name])


def test_cuda_test_selection():
    absent = not torch.cuda.is_available()
    needs_gpu = pytest.mark.skipif(absent, reason="needs a CUDA GPU").mark
    needs_no_gpu = pytest.mark.skipif(not absent, reason="checks the error on a machine without CUDA").mark
    other = pytest.mark.skipif(absent, reason="needs scipy").mark
    assert probe._needs_cuda(_item(pytest.mark.cuda.mark))
    assert probe._needs_cuda(_item(needs_gpu))
    assert not probe._needs_cuda(_item(needs_no_gpu))
    assert not probe._needs_cuda(_item(other))
    assert not probe._needs_cuda(_item())


def test_gpu_step_model_is_the_documented_1b():
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(probe.llama_config(probe.GPU_STEP))
    h, kv, ffn, vocab = 2048, 8 * 64, 8192, 32000  # hidden, KV heads x head dim, FFN, vocabulary
    block = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    assert sum(p.numel() for p in model.parameters()) == 16 * block + h + 2 * vocab * h == 1_104_218_112


def test_resimulating_the_probed_step_on_its_own_spec_gives_its_own_prediction(dry):
    """bench/resimulate_step.py rebuilds the probe's model and plan from probe.json alone: simulated on
    the spec the probe predicted with, the step time and every kind's seconds are the probe's own
    prediction, and the measured side is the timelines file's."""
    spec = importlib.util.spec_from_file_location("resimulate_step", ROOT / "bench" / "resimulate_step.py")
    resimulate_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(resimulate_step)
    out, doc = dry
    step = doc["sections"]["step"]["result"]
    timelines = json.loads((out / "timelines.json").read_text())
    got = resimulate_step.resimulate(step, timelines["measured"], HardwareSpec.load(out / "spec.json"))
    assert got["step"]["predicted_s"] == pytest.approx(step["predicted"]["step_time_s"], rel=1e-9)
    assert got["step"]["measured_s"] == step["measured"]["step_time_s"]
    for kind, row in step["predicted"]["by_kind"].items():
        assert got["by_kind"][kind]["predicted_s"] == pytest.approx(row["total_s"], rel=1e-9, abs=1e-12)
        assert got["by_kind"][kind]["measured_s"] == pytest.approx(step["measured"]["by_kind"][kind]["total_s"])


@pytest.mark.parametrize("measured", [True, False])
def test_the_spec_reads_the_contention_from_the_forward_beside_an_h2d(tmp_path, measured):
    """The spec's copy/compute contention comes from launch.forward_beside_h2d (the copy's rate beside
    the forward, the forward's slowdown beside the copy); a launch section without it (the first H100
    probe's) leaves both at "no contention", from the preset, which measures neither."""
    import argparse

    beside = {"forward_slowdown": 0.2, "h2d_beside_forward_bytes_per_s": 40e9, "issue_slowdown_beside_h2d": 0.15}
    launch = {"forward_beside_h2d": beside} if measured else {"template_fwd_s_per_op": 2e-5}
    ctx = probe.Ctx(args=argparse.Namespace(fallback_preset="H100_SXM"), out=tmp_path, dry=True,
                    results={"launch": {"status": "ok", "result": launch}})
    out = probe.section_spec(ctx)
    spec = HardwareSpec.load(tmp_path / "spec.json")
    if measured:
        assert spec.compute_slowdown_beside_h2d == 0.2 and spec.h2d_beside_compute_bytes_per_s == 40e9
        assert out["sources"]["compute_slowdown_beside_h2d"] == "launch.forward_beside_h2d.forward_slowdown"
        assert out["sources"]["h2d_beside_compute_bytes_per_s"] == \
            "launch.forward_beside_h2d.h2d_beside_forward_bytes_per_s"
        assert spec.issue_slowdown_beside_h2d == 0.15
        assert out["sources"]["issue_slowdown_beside_h2d"] == "launch.forward_beside_h2d.issue_slowdown_beside_h2d"
    else:
        assert not spec.has_contention and not spec.has_issue_contention
        assert {"compute_slowdown_beside_h2d", "h2d_beside_compute_bytes_per_s",
                "issue_slowdown_beside_h2d"} <= set(out["fields_from_preset"])


def test_dry_run_spec_has_the_measured_contention(dry):
    _, doc = dry
    s = {k: v["result"] for k, v in doc["sections"].items() if v["status"] == "ok"}
    spec = HardwareSpec.model_validate(s["spec"]["spec"])
    b = s["launch"]["forward_beside_h2d"]
    assert spec.compute_slowdown_beside_h2d == b["forward_slowdown"]
    assert spec.h2d_beside_compute_bytes_per_s == b["h2d_beside_forward_bytes_per_s"]
    assert spec.issue_slowdown_beside_h2d == b["issue_slowdown_beside_h2d"]


def test_same_thread_trials_whose_copies_were_not_in_flight_are_left_out():
    """On a GPU each trial checks that its copies were still in flight when the forward's launches
    returned (for the issue time) and ended after its end event (for its event time); a trial that
    fails a check is not counted, and with none left the median is None (the spec then takes the
    preset's "no slowdown"), never a number measured without copies beside."""
    alone = [1.0, 1.0, 1.0]
    beside = [(1.25, 3.0, True, True), (1.25, 3.0, True, False), (9.0, 9.0, False, False)]
    out = probe.same_thread_summary(alone, beside)
    assert out["same_thread_trials"] == 3
    assert out["copies_in_flight_trials"] == 2 and out["copies_outlast_forward_trials"] == 1
    assert out["forward_issue_beside_h2d_s"] == 1.25 and out["issue_slowdown_beside_h2d"] == pytest.approx(0.2)
    assert out["forward_beside_h2d_same_thread_s"] == 3.0
    none = probe.same_thread_summary(alone, [(1.25, 3.0, False, False)])
    assert none["forward_issue_beside_h2d_s"] is None and none["issue_slowdown_beside_h2d"] is None
    assert none["forward_beside_h2d_same_thread_s"] is None and none["copies_in_flight_trials"] == 0
    cpu = probe.same_thread_summary(alone, [(2.0, 2.0, None, None)])  # the dry run: nothing to check
    assert cpu["copies_in_flight_trials"] is None and cpu["issue_slowdown_beside_h2d"] == pytest.approx(0.5)
    fast = probe.same_thread_summary([2.0], [(1.0, 1.0, True, True)])  # clamped to [0, 1)
    assert fast["issue_slowdown_beside_h2d"] == 0.0
