"""bench/gpu_block.py's dry run (a tiny block on the CPU): both CPU variants time a forward and a
local backward, the block's FLOP and launch counts are the tracer's, and nothing errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_block_harness_times_the_template_and_eager_on_the_cpu(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    out = tmp_path / "block.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_block.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["layer"].endswith("layers.0") and res["fwd_flops"] > 0 and res["bwd_flops"] > 2 * res["fwd_flops"]
    assert 0 < res["fwd_launches"] < res["bwd_launches"]
    assert set(res["variants"]) == {"template", "hf_eager"}, "no CUDA graphs without CUDA"
    for name, row in res["variants"].items():
        for kind in ("fwd", "bwd"):
            assert "error" not in row[kind], f"{name} {kind}: {row[kind].get('error')}"
            assert row[kind]["synced_ms"] > 0 and row[kind]["issue_ms"] > 0 and row[kind]["gpu_ms"] is None
