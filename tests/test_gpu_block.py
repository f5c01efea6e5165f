"""bench/gpu_block.py's dry run (a tiny block on the CPU): the template, the compiled template and
transformers' layer each time a forward and a local backward, the compiled one after its compile
time is taken; the block's FLOP and launch counts are the tracer's, and nothing errors. The compile
shares the session's inductor cache (``compile_cache``), which the subprocess inherits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_block_harness_times_the_template_compiled_and_eager_on_the_cpu(tmp_path, compile_cache):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    out = tmp_path / "block.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_block.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["inductor_cache"].startswith(compile_cache)
    (block,) = res["blocks"].values()
    assert block["layer"].endswith("layers.0") and block["fwd_flops"] > 0 and block["bwd_flops"] > 2 * block["fwd_flops"]
    assert 0 < block["fwd_launches"] < block["bwd_launches"]
    assert list(block["variants"]) == ["template", "compiled", "hf_eager"], "no CUDA graphs without CUDA"
    assert block["variants"]["compiled"]["compile_s"] > 0
    for name, row in block["variants"].items():
        assert "error" not in row, f"{name}: {row['error']}"
        for kind in ("fwd", "bwd"):
            assert "error" not in row[kind], f"{name} {kind}: {row[kind].get('error')}"
            assert row[kind]["synced_ms"] > 0 and row[kind]["issue_ms"] > 0 and row[kind]["gpu_ms"] is None
