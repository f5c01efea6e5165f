"""NVMe tier: the file-backed tile store (megatrain.runtime.nvme), on a temp dir as the NVMe."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from megatrain.runtime import nvme
from megatrain.runtime.nvme import ALIGN, NvmeError, NvmeStore, aligned_buffer


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("direct", [True, False])
def test_roundtrip_many_blocks_bitwise(tmp_path, direct):
    # Sizes: one byte, an exact block, and a tile spread over several blocks with a ragged tail.
    sizes = {"a": 1, "b": ALIGN, "c": 5 * ALIGN + 17}
    with NvmeStore(tmp_path, sizes, workers=3, block_bytes=2 * ALIGN, direct=direct) as store:
        if not direct:
            assert store.direct is False and store.fallback_reason == "direct=False"
        data = {k: _random_bytes(n, i) for i, (k, n) in enumerate(sizes.items())}
        bufs = {k: aligned_buffer(n) for k, n in sizes.items()}
        for k in sizes:
            bufs[k][:sizes[k]].copy_(data[k])
        reqs = [store.write(k, bufs[k]) for k in sizes]  # all in flight together
        for r in reqs:
            r.wait()
        for k, n in sizes.items():
            assert os.path.getsize(tmp_path / f"{k}.tile") == nvme.align_up(n)
            out = aligned_buffer(n)
            store.read(k, out).wait()
            assert torch.equal(out[:n], data[k])


def test_tensor_helpers_float32_exact(tmp_path):
    x = torch.randn(1000, dtype=torch.float32)
    with NvmeStore(tmp_path, {"m": x.nbytes}) as store:
        store.write_tensor("m", x)
        y = torch.empty_like(x)
        store.read_tensor("m", y)
    assert torch.equal(x, y)


def test_direct_probe_reports_outcome(tmp_path):
    with NvmeStore(tmp_path, {"a": 10}) as store:
        # Either O_DIRECT works here, or the reason it was refused is kept for the user.
        assert store.direct or store.fallback_reason
        assert not (tmp_path / ".megatrain-odirect-probe").exists()


def test_missing_file_named(tmp_path):
    with NvmeStore(tmp_path, {"layer0.m": 8192}) as store:
        os.unlink(tmp_path / "layer0.m.tile")
        with pytest.raises(NvmeError, match=r"layer0\.m\.tile.*missing"):
            store.read("layer0.m", aligned_buffer(8192))


def test_truncated_file_named(tmp_path):
    with NvmeStore(tmp_path, {"layer1.v": 3 * ALIGN}) as store:
        os.truncate(tmp_path / "layer1.v.tile", ALIGN)
        with pytest.raises(NvmeError, match=r"layer1\.v\.tile.*truncated.*4096 bytes on disk, 12288"):
            store.read("layer1.v", aligned_buffer(3 * ALIGN))


def test_disk_full_at_setup_names_bytes(tmp_path, monkeypatch):
    class Usage:
        free = 3 * ALIGN
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda _: Usage)
    with pytest.raises(NvmeError, match=r"need 16384 bytes.*a\.tile.*12288 bytes free"):
        NvmeStore(tmp_path, {"a": 2 * ALIGN, "b": 2 * ALIGN})


def test_fallocate_failure_names_file(tmp_path, monkeypatch):
    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(nvme.os, "posix_fallocate", full)
    with pytest.raises(NvmeError, match=r"reserve 4096 bytes.*x\.tile.*disk full"):
        NvmeStore(tmp_path, {"x": 100})


def test_bad_input(tmp_path):
    with pytest.raises(NvmeError, match="does not exist"):
        NvmeStore(tmp_path / "nope", {"a": 1})
    with pytest.raises(ValueError, match="at least one byte"):
        NvmeStore(tmp_path, {"a": 0})
    with pytest.raises(ValueError, match="letters, digits"):
        NvmeStore(tmp_path, {"../a": 1})
    with NvmeStore(tmp_path, {"a": 2 * ALIGN}) as store:
        with pytest.raises(ValueError, match="smaller than the tile"):
            store.write("a", aligned_buffer(ALIGN))


def test_bench_nvme_io_small(tmp_path):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "bench" / "nvme_io.py"
    spec = importlib.util.spec_from_file_location("nvme_io", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.measure(str(tmp_path), gib=8 / 1024, tile_mib=2, block_mib=1, workers=2, repeat=1)
    assert r["bytes"] == 8 << 20
    for k in ("megatrain_write_GBps", "megatrain_read_GBps", "dd_write_GBps", "dd_read_GBps"):
        assert r[k] > 0
    assert r["read_ratio"] == pytest.approx(r["megatrain_read_GBps"] / r["dd_read_GBps"])
    assert not list(tmp_path.iterdir())  # the scratch files are gone


# -- planner: HardwareSpec NVMe fields, presets, placement, the dense-120b answers -------------------

from megatrain.errors import ConfigError, PlanError  # noqa: E402
from megatrain.planner import cost  # noqa: E402
from megatrain.planner.hardware import PRESETS, HardwareSpec, preset  # noqa: E402
from megatrain.planner.nvme import (NVME_ARRAYS, parse_bytes, place_on_nvme, solve_with_nvme,  # noqa: E402
                                    with_nvme)
from megatrain.planner.solve import InfeasibleRequestError, SolveRequest, solve  # noqa: E402


@pytest.fixture(scope="module")
def dense_120b():
    from megatrain.planner.presets import build_meta_model, load_model_config
    from megatrain.planner.trace import trace

    return trace(build_meta_model(load_model_config("dense-120b"), dtype=torch.bfloat16), micro_batch_size=1,
                 seq_len=4096).graph


def test_hardware_nvme_fields_default_off_and_roundtrip(tmp_path):
    assert all(not hw.has_nvme and hw.nvme_capacity_bytes == 0 for hw in PRESETS.values())
    hw = with_nvme(preset("H200"), "8xgen4", parse_bytes("512GiB"))
    a = NVME_ARRAYS["8xgen4"]
    assert hw.has_nvme and hw.nvme_capacity_bytes == 8 * a.drive_bytes
    assert hw.nvme_read_bytes_per_s == 8 * a.drive_read_bytes_per_s
    assert hw.host_memory_bytes == 512 * 2**30 and hw.pinned_memory_cap_bytes <= hw.host_memory_bytes
    hw.save(tmp_path / "hw.json")
    assert HardwareSpec.load(tmp_path / "hw.json") == hw
    with pytest.raises(ConfigError, match="no NVMe array preset named 'raid9'.*4xgen5"):
        with_nvme(hw, "raid9")


@pytest.mark.parametrize("text,n", [("512GiB", 512 << 30), ("1.5TiB", 3 << 39), ("768 GB", 768 * 10**9),
                                    ("4096", 4096)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


def test_parse_bytes_rejects():
    with pytest.raises(ConfigError, match="not a size"):
        parse_bytes("lots")


def _check_placement(ns, graph):
    p, hw, mem = ns.placement, ns.hardware, ns.solution.memory
    layers = graph.layers
    moved = (sum(cost.page_up(layers[i].trainable_numel * ns.solution.plan.gradient_itemsize) for i in p.gradients)
             + sum(layers[i].trainable_numel * cost.MOMENT_BYTES_PER_ELEMENT for i in p.moments)
             + sum(layers[i].numel * cost.MASTER_BYTES_PER_ELEMENT for i in p.masters))
    assert p.host_freed == moved and p.read_bytes == p.write_bytes == moved
    assert p.io_time_s == pytest.approx(moved / hw.nvme_read_bytes_per_s + moved / hw.nvme_write_bytes_per_s)
    assert mem.host_total > hw.host_memory_bytes  # the plan needed the NVMe tier ...
    assert ns.fits and ns.host_total <= hw.host_memory_bytes  # ... and fits with it
    assert moved <= p.nvme_bytes <= hw.nvme_capacity_bytes
    assert ns.step_time_s == max(ns.simulated_step_s, p.io_time_s)


def test_dense_120b_with_clipping_fits_h200_1_5tb_with_nvme(dense_120b):
    req = SolveRequest(dense_120b, preset("H200"), 8, "bfloat16", clip_gradients=True)
    with pytest.raises(InfeasibleRequestError):  # the premise: without NVMe it does not fit
        solve(req)
    ns = solve_with_nvme(SolveRequest(dense_120b, with_nvme(preset("H200"), "4xgen5"), 8, "bfloat16",
                                      clip_gradients=True))
    _check_placement(ns, dense_120b)
    assert ns.placement.gradients  # deferred gradient tiles go first
    assert ns.solution.plan.optimizer.name == "NEXT_FORWARD"


def test_dense_120b_without_clipping_fits_h200_512gib_with_nvme(dense_120b, capsys):
    from megatrain.cli import main

    assert main(["plan", "--model", "dense-120b", "--hardware", "H200", "--seq-len", "4096", "--global-batch", "8",
                 "--host-memory", "512GiB", "--nvme", "4xgen5"]) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and "Adam moments on NVMe" in out and "slowdown" in out
    hw = with_nvme(preset("H200"), "4xgen5", parse_bytes("512GiB"))
    ns = solve_with_nvme(SolveRequest(dense_120b, hw, 8, "bfloat16"))
    _check_placement(ns, dense_120b)
    assert ns.placement.moments and not ns.placement.gradients
    assert ns.step_time_s >= ns.simulated_step_s
    # Not enough NVMe: the error names the bytes needed and the fix.
    small = HardwareSpec.model_validate({**hw.model_dump(), "nvme_capacity_bytes": 10 * 2**30})
    with pytest.raises(PlanError, match="NVMe tier needs .* and has 10.00 GiB.*larger array"):
        place_on_nvme(ns.solution.graph, ns.solution.plan, ns.solution.memory, small)
    # Too little host memory even with everything movable on NVMe.
    tiny = with_nvme(hw, None, parse_bytes("8GiB"))
    with pytest.raises(PlanError, match="still needs .* of host memory"):
        place_on_nvme(ns.solution.graph, ns.solution.plan, ns.solution.memory, tiny)
