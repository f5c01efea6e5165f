"""bench/gpu_diag_exactness.py on the CPU (``--device cpu``): every case runs and, where no GPU kernel
choice is involved, megatrain and eager agree to DESIGN.md's 1e-5 at every step; the dropout case
dispatches random ops on both sides (the harness would otherwise compare nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_exactness_diagnosis_runs_on_the_cpu_and_finds_nothing_to_diagnose(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    out = tmp_path / "diag.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_diag_exactness.py"), "--device", "cpu",
                        "--steps", "3", "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 10
    for name, case in cases.items():
        assert "error" not in case, f"{name}: {case.get('error')}"
        assert case["rel_loss"] and max(case["rel_loss"]) <= 1e-5, name
    drop = cases["dropout_llama_default"]
    assert drop["mt_ops"] and drop["eager_ops"], "both sides drew dropout masks"
