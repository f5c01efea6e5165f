"""FP32 master weights on the NVMe tier (``Plan.nvme_masters``): the plan's rules, the lowering
(the CAST from the I/O buffer between the OPT and the NVME_WRITE), the runtime (no master row in
host memory; bitwise the all-in-RAM run), checkpoints and the planner's placement. Reuses the
moments' helpers of test_nvme (tiny_llama, a temp dir as the NVMe tier)."""

from __future__ import annotations

import dataclasses

import pytest

from megatrain.errors import PlanError
from megatrain.planner.plan import Plan

BF16_ONCE = dict(compute_dtype="bfloat16", cast_once=True)


def test_plan_takes_masters_on_nvme_only_with_bf16_cast_once_and_their_moments():
    ok = Plan(nvme_moments=frozenset({1, 2}), nvme_masters=frozenset({2}), **BF16_ONCE)
    assert ok.nvme_masters == {2}
    for kw, msg in (
            (dict(compute_dtype="float32"), r"compute_dtype='float32', cast_once=False: .*set "
                                            r"compute_dtype='bfloat16' and cast_once=True"),
            (dict(compute_dtype="bfloat16"), r"compute_dtype=.bfloat16., cast_once=False: masters go to NVMe only with BF16 compute and "
                                             r"cast_once=True"),
    ):
        with pytest.raises(PlanError, match=r"Plan.nvme_masters=\[2\] with " + msg):
            Plan(nvme_moments=frozenset({2}), nvme_masters=frozenset({2}), **kw)
    with pytest.raises(PlanError, match=r"nvme_masters names layers \[1\] that are not in nvme_moments: .*add them "
                                        r"to nvme_moments"):
        Plan(nvme_moments=frozenset({2}), nvme_masters=frozenset({1, 2}), **BF16_ONCE)
    with pytest.raises(PlanError, match=r"nvme_masters=\[-1\]: layer indices must be >= 0"):
        Plan(nvme_masters=frozenset({-1}), **BF16_ONCE)
    with pytest.raises(PlanError, match=r"nvme_masters=\[2\] with data_parallel=2: .*one rank"):
        Plan(nvme_moments=frozenset({2}), nvme_masters=frozenset({2}), data_parallel=2, d2h_dtype="float32",
             **BF16_ONCE)
    assert dataclasses.replace(ok, nvme_masters=frozenset()).nvme_masters == frozenset()
