"""bench/gpu_session.sh, the one command of a GPU session, on the CPU (its --dry-run): a phase that
hangs is cut at its time box and the phases after it still run and pack their results, and no
phase outlives the whole command's budget. Both decide whether a session's 15 device minutes bring
anything back, so they are checked here, where minutes cost nothing."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_session.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _session(out: Path, **env: str) -> tuple[dict[str, dict[str, str]], subprocess.CompletedProcess]:
    """Run the dry run with ``env`` added; return phases.tsv's rows by phase and the process."""
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env})
    with open(out / "phases.tsv") as f:
        rows = {r["phase"]: r for r in csv.DictReader(f, delimiter="\t")}
    return rows, proc


def _packed(out: Path) -> set[str]:
    with tarfile.open(out / "res.tgz") as t:
        return {Path(n).name for n in t.getnames()}


def test_a_hung_phase_is_cut_at_its_box_and_the_next_phase_still_runs_and_packs(tmp_path):
    rows, proc = _session(tmp_path, GPU_SESSION_PHASES="probe,hostopt", GPU_SESSION_HANG="probe",
                          GPU_SESSION_LIMIT_PROBE="6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rows["probe"]["rc"] == "124", rows  # timeout's exit status: cut at the box
    assert 6 <= int(rows["probe"]["seconds"]) <= 6 + 10, rows  # the box, plus timeout's -k grace at most
    assert rows["hostopt"]["rc"] == "0", proc.stdout[-3000:]
    packed = _packed(tmp_path)
    assert {"host_optimizer.json", "phases.tsv"} <= packed, packed
    assert (tmp_path / "log").read_text().count("packed") >= 3  # after each phase, and at the end


def test_no_phase_outlives_the_budget(tmp_path):
    # The hung phase's own box (240 s by default) is longer than the whole budget: it gets what is
    # left of the budget, and the phase after it, with nothing left, is skipped rather than started.
    rows, proc = _session(tmp_path, GPU_SESSION_PHASES="probe,hostopt", GPU_SESSION_HANG="probe",
                          GPU_SESSION_BUDGET_S="7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rows["probe"]["rc"] == "124", rows
    assert int(rows["probe"]["box_s"]) <= 7, rows
    assert rows["hostopt"]["rc"] == "skipped", rows
    assert "phases.tsv" in _packed(tmp_path)


def test_the_compare_phase_runs_megatrain_on_its_own_plan_and_at_the_fixed_split(tmp_path):
    # Issue 40 step 1: megatrain on the solver's micro-batch size and count, and at the fixed split the
    # peers run; a system's box is overridden by its name in upper case, "-" as "_" (a shell variable
    # name cannot hold "-": the override once aborted the phase). Step 2 (3B at seq 2048 and 4096
    # against DeepSpeed and FSDP2) runs the phase with other sizes, lengths and boxes: the dry run
    # prints each system's GPU command as it would run it. One dry run checks both.
    systems = ("megatrain-own-plan", "deepspeed", "megatrain", "fsdp2")
    rows, proc = _session(tmp_path, GPU_SESSION_PHASES="compare", GPU_SESSION_LIMIT_COMPARE_MEGATRAIN_OWN_PLAN="77",
                          GPU_SESSION_COMPARE_SIZES="3b", GPU_SESSION_COMPARE_SEQ_LEN="4096",
                          GPU_SESSION_COMPARE_GLOBAL_BATCH="8", GPU_SESSION_COMPARE_MICRO_BATCH="1",
                          GPU_SESSION_COMPARE_BOX_S="120", GPU_SESSION_COMPARE_SYSTEMS=" ".join(systems))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "invalid variable name" not in proc.stdout + proc.stderr
    assert rows["compare_megatrain-own-plan"]["rc"] == "0" and rows["compare_megatrain-own-plan"]["box_s"] == "77", rows
    assert rows["compare_megatrain"]["rc"] == "0", rows
    assert "compare_deepspeed" not in rows and "compare_fsdp2" not in rows  # the peers need CUDA
    log = (tmp_path / "log").read_text()
    assert "own plan: micro-batch" in log
    for system in systems:
        line = next(x for x in log.splitlines() if x.startswith(f"compare_{system} on a GPU (box 120s): "))
        assert (f"bench/compare.py --sizes 3b --system {system} --seq-len 4096 --global-batch 8 --micro-batch 1 "
                "--warmup 2 --steps 5 --child-timeout 110 --results-dir") in line, line
