"""The CUDA-graph switch: capture the compute ops (``Plan.cuda_graphs``) where the step is
issue-bound.

A compute op's kernels cannot start before the issuing thread has launched them. Issuing a block's
local backward costs ~550 launches (``Layer.bwd_launches``) at ``HardwareSpec.launch_overhead_s``
each; at small micro-batches that approaches the GPU time of the kernels themselves, and the GPU
waits on the thread (the first H100 session, 2026-11-27: an 18.8% MFU step; issue 39). A CUDA graph
replay is one launch plus its copies in and out (:mod:`megatrain.runtime.graphs`).

:func:`issue_bound` compares, over a schedule's compute ops, the seconds the issuing thread spends
launching them (:func:`megatrain.planner.time.launch_times`) with the GPU seconds they run
(:func:`megatrain.planner.time.op_times`): the step is issue-bound when issuing takes at least
:data:`ISSUE_BOUND_RATIO` of the GPU time. The simulator does not model replays yet, so the
predicted step of a plan with graphs is the one without them.
"""

from __future__ import annotations

from megatrain.ir.graph import LayerGraph
from megatrain.ir.hardware import HardwareSpec
from megatrain.ir.schedule import COMPUTE_KINDS, Schedule
from megatrain.planner.time import launch_times, op_times

ISSUE_BOUND_RATIO = 0.5
"""Issue time over GPU time of the compute ops from which the step counts as issue-bound. Below 1,
because the issuing thread also launches every copy and waits for the GIL while a host op holds it
(issue 39: a host AdamW kernel held it for 32% of the measured 1B step): at half the GPU time it has
no slack left to stay ahead of the GPU."""


def compute_issue(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec) -> tuple[float, float]:
    """``(issue seconds, GPU seconds)`` of ``schedule``'s compute ops (FWD, RECOMPUTE, BWD) on ``hw``."""
    launch = launch_times(schedule, graph, hw)
    gpu = op_times(schedule, graph, hw)
    compute = [i for i, op in enumerate(schedule.ops) if op.kind in COMPUTE_KINDS]
    return sum(launch[i] for i in compute), sum(gpu[i] for i in compute)


def issue_bound(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec | None) -> tuple[bool, str]:
    """Whether ``schedule``'s step is issue-bound on ``hw`` (module docstring), and the line that
    says why; False without a spec that rates the GPU and the launch cost."""
    if hw is None or not hw.has_gpu or hw.launch_overhead_s <= 0 or hw.peak_flops(schedule.plan.compute_dtype) <= 0:
        return False, "no GPU spec with a launch cost to judge the issue rate by"
    issue, gpu = compute_issue(schedule, graph, hw)
    ratio = issue / gpu if gpu > 0 else float("inf")
    verdict = "issue-bound" if ratio >= ISSUE_BOUND_RATIO else "GPU-bound"
    return ratio >= ISSUE_BOUND_RATIO, (f"{verdict}: issuing the compute ops takes {issue * 1e3:,.1f} ms a step against "
                                        f"{gpu * 1e3:,.1f} ms of GPU time ({ratio:.2f}; issue-bound from "
                                        f"{ISSUE_BOUND_RATIO})")


__all__ = ["ISSUE_BOUND_RATIO", "compute_issue", "issue_bound"]
