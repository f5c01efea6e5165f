"""How much more megatrain's own layer template costs the issuing thread per op than the stand-in block.

The first GPU session (H100, 2026-11-27) measured ``HardwareSpec.launch_overhead_s`` with a stand-in
block (``megatrain.runtime.measure.measure_launch_overhead``: a hand-written Llama block, its ops
counted on meta), not with the template megatrain runs; the probe now measures both
(``bench/gpu_probe.py``, section ``launch``). This script runs the same measurement
(:func:`gpu_probe.template_issue_costs`) on any device, by default the CPU at the stand-in's own
dimensions (``gpu_probe.STANDIN_STEP``), where the two differ only in their code: the ratios it
writes (``template_fwd_over_standin_fwd``, ``template_bwd_over_standin_bwd``) are what
:func:`gpu_probe.issue_costs_from_standin` multiplies the 2026-11-27 stand-in figure by
(``bench/resimulate_step.py --issue-ratios``). One intra-op thread, the thread's CPU time, medians of
calls taken round-robin.

Usage::

    python bench/template_issue.py --json bench/results/<date>-cpu-template-issue.json [--seconds 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_probe import STANDIN_STEP, template_issue_costs  # noqa: E402

from megatrain.ir.hardware import cpu_name  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seconds", type=float, default=2.0, help="about this long per call measured (default 2)")
    ap.add_argument("--json", help="write the result here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = template_issue_costs(args.device, STANDIN_STEP, seconds=args.seconds)
    out = {"bench": "template_issue", "date": date.today().isoformat(),
           "machine": f"{cpu_name()} ({platform.machine()}), torch {torch.__version__}", **out}
    for name in ("standin", "template"):
        r = out[name]
        print(f"{name:9} forward {r['fwd_ops']:4d} ops {r['fwd_s_per_op'] * 1e6:7.2f} us/op   "
              f"local backward {r['bwd_ops']:4d} ops {r['bwd_s_per_op'] * 1e6:7.2f} us/op")
    print(f"template / stand-in per op: forward {out['template_fwd_over_standin_fwd']:.3f}, "
          f"backward {out['template_bwd_over_standin_bwd']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
