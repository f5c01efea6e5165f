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
