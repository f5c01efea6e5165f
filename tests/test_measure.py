"""megatrain.runtime.measure's host side: the L3 size, the host-rate tiles sized beyond it, and the
host rates a spec gets (measured on a thread of their own, with the host workers' thread team)."""

from __future__ import annotations

import pytest
import torch

from megatrain.planner import cost
from megatrain.ir.hardware import HardwareSpec
from megatrain.runtime import measure


@pytest.mark.parametrize("text, nbytes", [("32768K", 32 << 20), ("1M", 1 << 20), ("2G", 2 << 30), ("512", 512),
                                          ("16 MiB", 16 << 20)])
def test_parse_cache_size(text, nbytes):
    assert measure._parse_size(text) == nbytes


def test_l3_size_falls_back_to_lscpu_when_sysfs_has_none(monkeypatch):
    monkeypatch.setattr(measure, "_l3_sysfs", lambda: {"total_bytes": 0})
    lscpu = "L2 cache:                               1 MiB (2 instances)\nL3 cache:          256 MiB (8 instances)\n"
    monkeypatch.setattr(measure, "_lscpu", lambda: lscpu)
    assert measure.l3_cache() == {"total_bytes": 256 << 20, "source": "lscpu (sysfs has no L3)"}
    monkeypatch.setattr(measure, "_lscpu", lambda: "")
    assert measure.l3_cache()["total_bytes"] == 0


@pytest.mark.parametrize("l3, per_element, want", [
    (32 << 20, 16, 8 << 20),  # this CI's EPYC: 4 x 32 MiB over AdamW's 16 B/param
    (32 << 20, 6, 22 << 20),  # the cast's 6 B/element: 21.3M, in whole MiB of elements
    (0, 16, measure.HOST_TILE_MIN_NUMEL),  # L3 unknown
    (210 << 20, 16, 53 << 20),  # two Xeon 8480C sockets (105 MB each, rounded to MiB here)
])
def test_host_tiles_stream_from_dram(l3, per_element, want):
    n = measure.host_tile_numel(per_element, l3)
    assert n == want and n % (1 << 20) == 0
    assert n * per_element >= measure.HOST_TILE_L3_MULTIPLE * l3


def test_host_rates_are_measured_with_the_host_workers_team_on_a_thread_of_their_own():
    main = torch.get_num_threads()
    r = measure.measure_host_rates(1 << 18, seconds=0.02, cores=5)
    assert r["host_cores"] == 5 and r["threads"] == cost.host_worker_threads(5) == 4
    assert r["numel"] == {"adamw": 1 << 18, "cast": 1 << 18}
    for key in ("host_optimizer_params_per_s", "host_optimizer_bf16_params_per_s", "host_cast_elements_per_s"):
        assert r[key] > 0
    assert torch.get_num_threads() == main, "the measurement's team must not leak into the caller"
    fields = {k: r[k] for k in ("host_optimizer_params_per_s", "host_optimizer_bf16_params_per_s",
                                "host_cast_elements_per_s", "host_cores")}
    assert HardwareSpec.model_fields.keys() >= fields.keys()


def test_measure_hardware_fills_every_host_field(tmp_path):
    hw = measure.measure_hardware(tmp_path / "me.json", optimizer_numel=1 << 18, seconds=0.02)
    assert hw.host_optimizer_bf16_params_per_s > 0 and hw.host_cast_elements_per_s > 0
    assert hw.host_cores == measure.host_cores()
    assert HardwareSpec.load(tmp_path / "me.json") == hw
