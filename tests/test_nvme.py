"""NVMe tier: the file-backed tile store (megatrain.runtime.nvme), on a temp dir as the NVMe."""

from __future__ import annotations

import collections
import errno
import math
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


def test_a_symlink_planted_under_a_tile_name_is_refused_and_its_target_untouched(tmp_path):
    """Shared scratch: a symlink named like a tile made a run overwrite the file it pointed at."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    d = tmp_path / "nvme"
    d.mkdir()
    (d / "L0.moments.tile").symlink_to(victim)
    with pytest.raises(NvmeError, match=r"L0\.moments\.tile' exists and cannot be reused .*symlink"):
        NvmeStore(d, {"L0.moments": 2 * ALIGN})
    assert victim.read_text() == "precious"
    os.link(victim, d / "L1.moments.tile")  # a hard link to another file: two links, refused too
    with pytest.raises(NvmeError, match=r"L1\.moments\.tile' exists and is not a file this user made .*2 links"):
        NvmeStore(d, {"L1.moments": 2 * ALIGN})
    assert victim.read_text() == "precious"


def test_files_are_private_and_an_earlier_runs_are_reused(tmp_path):
    with NvmeStore(tmp_path, {"a": 3 * ALIGN}) as store:
        store.write("a", aligned_buffer(3 * ALIGN).fill_(9)).wait()
    os.chmod(tmp_path / "a.tile", 0o644)
    with NvmeStore(tmp_path, {"a": 3 * ALIGN}) as store:  # emptied: reads as zeros, as fresh moments
        buf = aligned_buffer(3 * ALIGN)
        store.read("a", buf).wait()
        assert not buf.any()
    assert [p.name for p in tmp_path.iterdir()] == ["a.tile"]  # the O_DIRECT probe file is gone
    assert (tmp_path / "a.tile").stat().st_mode & 0o777 == 0o600


def test_resuming_counts_the_space_of_its_own_old_tiles(tmp_path, monkeypatch):
    """A disk that holds the tiles once: the second run reuses the first's files. The free space was
    checked before they were emptied, so a resume failed whenever old tiles filled half the disk."""
    sizes = {"a": 64 * ALIGN, "b": 32 * ALIGN}
    capacity = sum(sizes.values()) + ALIGN

    class Usage:  # a file system of `capacity` bytes holding only this directory's files
        @property
        def free(self):
            return capacity - sum(p.stat().st_blocks * 512 for p in tmp_path.iterdir())

    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda _: Usage())
    NvmeStore(tmp_path, sizes).close()
    assert Usage().free < min(sizes.values())  # the old tiles fill the disk
    NvmeStore(tmp_path, sizes).close()
    with pytest.raises(NvmeError, match=r"with the \d+ bytes of this store's files from an earlier run"):
        NvmeStore(tmp_path, {**sizes, "c": 2 * ALIGN})


@pytest.mark.parametrize("mapped", [False, True], ids=["written", "mapped"])
def test_a_tile_changed_on_disk_is_an_error_at_its_next_read(tmp_path, mapped):
    n = 3 * ALIGN
    data = aligned_buffer(n).copy_(_random_bytes(n, 1))
    with NvmeStore(tmp_path, {"a": n}, block_bytes=ALIGN) as store:
        if mapped:  # masters on NVMe are first written through a mapping, then synced
            store.map_tile("a").copy_(data)
            store.sync("a")
        else:
            store.write("a", data).wait()
        buf = aligned_buffer(n)
        store.read("a", buf).wait()
        assert torch.equal(buf, data)
        with open(tmp_path / "a.tile", "r+b") as f:
            f.seek(ALIGN + 5)
            f.write(b"\x01")
        with pytest.raises(NvmeError, match=r"a\.tile' changed on disk .*4096 bytes at offset 4096 differs"):
            store.read("a", buf).wait()
    with NvmeStore(tmp_path, {"a": n}, block_bytes=ALIGN, checksums=False) as store:
        store.write("a", data).wait()
        with open(tmp_path / "a.tile", "r+b") as f:
            f.write(b"\x01")
        store.read("a", buf).wait()  # not checked


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
from megatrain.ir.hardware import PRESETS, HardwareSpec, preset  # noqa: E402
from megatrain.planner.nvme import (NVME_ARRAYS, describe, parse_bytes, place_on_nvme,  # noqa: E402
                                    solve_with_nvme, with_nvme)
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
    p, hw, mem = ns.placement, ns.hardware, ns.memory
    layers = graph.layers
    moved = (sum(cost.page_up(layers[i].trainable_numel * ns.solution.plan.gradient_itemsize) for i in p.gradients)
             + sum(layers[i].trainable_numel * cost.MOMENT_BYTES_PER_ELEMENT for i in p.moments)
             + sum(layers[i].numel * cost.MASTER_BYTES_PER_ELEMENT for i in p.masters))
    assert p.host_freed == moved and p.read_bytes == p.write_bytes == moved
    assert p.io_time_s == pytest.approx(moved / hw.nvme_read_bytes_per_s + moved / hw.nvme_write_bytes_per_s)
    assert mem.host_total > hw.host_memory_bytes  # the plan needed the NVMe tier ...
    assert ns.fits and ns.host_total <= hw.host_memory_bytes  # ... and fits with it
    assert moved <= p.nvme_bytes <= hw.nvme_capacity_bytes
    assert ns.step_time_s == max(ns.timeline.step_time_s, p.io_time_s)
    # The plan carries the moment and gradient-tile layers; its schedule has their NVMe ops (a read of
    # each, and a write), verified, and adding ops and edges cannot make the simulated step shorter
    # than the all-in-RAM one. Its host bytes are the cost model's of the placed plan, masters included
    # (each of those layers' CAST reads its I/O buffer).
    assert ns.plan.nvme_moments == p.moments and ns.plan.nvme_gradients == p.gradients
    assert ns.plan.nvme_masters == p.masters <= p.moments
    assert ns.plan.cast_once == (ns.solution.plan.cast_once or ns.cast_once_set) and ns.cast_once_set <= bool(p.masters)
    from megatrain.ir.schedule import OpKind as K
    from megatrain.planner.verify import verify as check
    check(ns.schedule, ns.solution.graph)
    for kind in (K.NVME_READ, K.NVME_WRITE):
        assert sum(op.kind is kind and op.buf is not None for op in ns.schedule.ops) == len(p.moments)
        assert sum(op.kind is kind and op.gbuf is not None for op in ns.schedule.ops) == len(p.gradients)
    assert sum(op.kind is K.CAST and op.buf is not None for op in ns.schedule.ops) == len(p.masters)
    placed = cost.memory_breakdown(ns.solution.graph, ns.plan, hw, ns.schedule)
    assert placed.host_total == ns.host_total and placed.host_pinned == p.host_pinned(mem)
    assert ns.timeline.step_time_s >= ns.simulated_step_s * (1 - 1e-9)


def test_dense_120b_with_clipping_fits_h200_1_5tb_with_nvme(dense_120b):
    req = SolveRequest(dense_120b, preset("H200"), 8, "bfloat16", clip_gradients=True)
    with pytest.raises(InfeasibleRequestError):  # the premise: without NVMe it does not fit
        solve(req)
    ns = solve_with_nvme(SolveRequest(dense_120b, with_nvme(preset("H200"), "4xgen5"), 8, "bfloat16",
                                      clip_gradients=True))
    _check_placement(ns, dense_120b)
    assert ns.placement.gradients  # deferred gradient tiles go first, into the plan itself
    assert ns.plan.nvme_gradients == ns.placement.gradients
    assert ns.solution.plan.optimizer.name == "NEXT_FORWARD"
    # No moments on NVMe: no read-ahead to choose, and the report has no line for it.
    assert not ns.placement.moments and len(ns.searched) == 1
    assert [row[0] for row in describe(ns)][0] == "NVMe tier"


def test_dense_120b_without_clipping_fits_h200_512gib_with_nvme(dense_120b, capsys, monkeypatch):
    import megatrain.planner.nvme as planner_nvme
    from megatrain.cli import main

    # The CLI's own solve is the one checked below (solving again would double the test's time).
    solved = []

    def keep(request, *a, **kw):
        solved.append((request, solve_with_nvme(request, *a, **kw)))
        return solved[-1][1]
    monkeypatch.setattr(planner_nvme, "solve_with_nvme", keep)
    assert main(["plan", "--model", "dense-120b", "--hardware", "H200", "--seq-len", "4096", "--global-batch", "8",
                 "--host-memory", "512GiB", "--nvme", "4xgen5"]) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out and "Adam moments on NVMe" in out and "slowdown" in out
    hw = with_nvme(preset("H200"), "4xgen5", parse_bytes("512GiB"))
    (request, ns), = solved
    assert request.hardware == hw and request.global_batch == 8 and not request.clip_gradients
    assert [lay.numel for lay in request.graph.layers] == [lay.numel for lay in dense_120b.layers]
    _check_placement(ns, dense_120b)
    assert ns.placement.moments and not ns.placement.gradients and not ns.placement.masters
    # The read-ahead was searched: the plan has the count of the fastest placement tried, one buffer
    # (no read-ahead: the I/O stream waits for every OPT) the slowest, and the report says so.
    tried = {k: t for k, t, why in ns.searched if t is not None}
    assert ns.plan.nvme_buffers == min(tried, key=tried.get) and ns.step_time_s == min(tried.values())
    assert tried[1] > ns.step_time_s and ns.searched[0][0] == 1
    assert f"NVMe read-ahead          {ns.plan.nvme_buffers} buffers" in out
    from megatrain.ir.schedule import Stream as S
    assert ns.timeline.busy_s[S.IO] == pytest.approx(
        sum(cost.nvme_time(ns.solution.graph.layers[i], hw, k) for i in ns.placement.moments
            for k in (OpKind.NVME_READ, OpKind.NVME_WRITE)))
    assert ns.step_time_s >= ns.simulated_step_s
    # Not enough NVMe: the error names the bytes needed and the fix.
    small = HardwareSpec.model_validate({**hw.model_dump(), "nvme_capacity_bytes": 10 * 2**30})
    with pytest.raises(PlanError, match="NVMe tier needs .* and has 10.00 GiB.*larger array"):
        place_on_nvme(ns.solution.graph, ns.solution.plan, ns.solution.memory, small)
    # Too little host memory even with everything movable on NVMe.
    tiny = with_nvme(hw, None, parse_bytes("8GiB"))
    with pytest.raises(PlanError, match="still needs .* of host memory"):
        place_on_nvme(ns.solution.graph, ns.solution.plan, ns.solution.memory, tiny)
    # With 320 GiB the moments are not enough: masters follow, which needs each layer's own staging
    # tile, so cast_once is set and said; the masters' traffic is ops of the schedule.
    small_host = with_nvme(preset("H200"), "4xgen5", parse_bytes("320GiB"))
    ns = solve_with_nvme(SolveRequest(dense_120b, small_host, 8, "bfloat16"))
    _check_placement(ns, dense_120b)
    assert len(ns.placement.moments) == 98 and ns.placement.masters and ns.cast_once_set
    assert not ns.solution.plan.cast_once and ns.plan.cast_once
    assert ns.timeline.busy_s[S.IO] == pytest.approx(
        sum(cost.nvme_time(ns.solution.graph.layers[i], small_host, k, cost.nvme_bytes(
            ns.solution.graph.layers[i], i in ns.placement.masters)) for i in ns.placement.moments
            for k in (OpKind.NVME_READ, OpKind.NVME_WRITE)))
    rows = {what: (value, note) for what, value, note in describe(ns)}
    assert rows["FP32 masters on NVMe"] == (f"{len(ns.placement.masters)}/98", "layers; cast_once set: each keeps "
                                            "its own BF16 staging tile, which H2D reads")


# -- schedule: NVME_READ / NVME_WRITE on the I/O stream, lowered, verified, simulated ----------------

from megatrain.errors import ScheduleError  # noqa: E402
from megatrain.planner.lower import lower  # noqa: E402
from megatrain.ir.plan import OptimizerPlacement, Plan  # noqa: E402
from megatrain.ir.schedule import Op, OpKind, Schedule, Stream  # noqa: E402
from megatrain.planner.simulate import simulate  # noqa: E402
from megatrain.planner.verify import verify  # noqa: E402

from graphs import chain_graph, spec  # noqa: E402


@pytest.mark.parametrize("optimizer,carries", [(OptimizerPlacement.DURING_BACKWARD, False),
                                               (OptimizerPlacement.NEXT_FORWARD, True)])
@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_lowered_nvme_ops_read_before_and_write_after_each_opt(optimizer, carries, buffers):
    g = chain_graph(5)
    on_nvme = frozenset({1, 3, 4})
    grad_ring = 5 if optimizer is OptimizerPlacement.NEXT_FORWARD else 2
    plan = Plan(optimizer=optimizer, nvme_moments=on_nvme, grad_ring=grad_ring, nvme_buffers=buffers)
    s = lower(g, plan, carries_updates=carries)
    verify(s, g)
    ops = s.ops
    reads = {op.layer: i for i, op in enumerate(ops) if op.kind is OpKind.NVME_READ}
    writes = {op.layer: i for i, op in enumerate(ops) if op.kind is OpKind.NVME_WRITE}
    opts = {op.layer: i for i, op in enumerate(ops) if op.kind is OpKind.OPT}
    assert set(reads) == set(writes) == on_nvme
    for layer in on_nvme:
        assert reads[layer] in ops[opts[layer]].deps and ops[writes[layer]].deps == (opts[layer],)
    assert all(ops[i].stream is Stream.IO for i in list(reads.values()) + list(writes.values()))
    # Round trip through JSON, with the plan's NVMe layers.
    assert Schedule.from_json(s.to_json()) == s
    # Each NVMe layer's moments pass through one I/O buffer: read into it, stepped in it, written from
    # it; the plan's buffers (cost.nvme_buffers) are used in turn; layers in RAM name none.
    for layer in on_nvme:
        assert ops[opts[layer]].buf == ops[writes[layer]].buf == ops[reads[layer]].buf
    assert cost.nvme_buffers(g, plan)[0] == buffers
    in_order = sorted(reads.values())
    assert [ops[i].buf for i in in_order] == [k % buffers for k in range(3)]
    # The first `buffers` reads open the schedule; each later one comes right after the write that
    # emptied its buffer, before the next NVMe layer's OPT.
    assert in_order[:buffers] == list(range(buffers))
    for k in range(buffers, 3):
        emptied = next(writes[lay] for lay in on_nvme if opts[lay] == sorted(opts[x] for x in on_nvme)[k - buffers])
        assert emptied < in_order[k] < sorted(opts[x] for x in on_nvme)[k - buffers + 1]
    assert all(ops[i].buf is None for layer, i in opts.items() if layer not in on_nvme)
    assert repr(ops[reads[1]]) == f"NVME_READ:L1:b{ops[reads[1]].buf}"
    assert Op.parse("OPT:L3:r0:b1") == Op(OpKind.OPT, 3, ring=0, buf=1)
    with pytest.raises(ValueError, match=r"NVME_WRITE op names a moments I/O buffer \(buf\) or a gradient I/O buffer"):
        Op.parse("NVME_WRITE:L3")
    # The I/O stream has its own resource: the step is timed with it, and its busy time is the ops'.
    hw = spec(nvme_capacity_bytes=10**9, nvme_read_bytes_per_s=1e6, nvme_write_bytes_per_s=5e5)
    tl = simulate(s, g, hw)
    per_layer = -(-1024 * 8 // 4096) * 4096
    assert tl.busy_s[Stream.IO] == pytest.approx(3 * (per_layer / 1e6 + per_layer / 5e5))
    assert tl.step_time_s >= tl.busy_s[Stream.IO]
    with pytest.raises(ConfigError, match="nvme_read_bytes_per_s=0"):
        simulate(s, g, spec())


@pytest.mark.parametrize("dtype, clip", [("bfloat16", False), ("bfloat16", True), ("float32", True)])
def test_least_host_is_the_least_host_an_nvme_tier_leaves(dtype, clip):
    """nvme.least_host (the NVMe fix an impossible plan's error names): at exactly that host memory
    and pinned cap the placement fits (with cast_once set where it took the BF16 masters), and a
    byte less host memory does not."""
    from megatrain.planner.nvme import least_host, place_with_masters

    g = chain_graph(5, numel=[1 << 12, 1 << 14, 1 << 14, 1 << 14, 1 << 12])
    plan = Plan(micro_batches=2, compute_dtype=dtype, grad_ring=5 if clip else 2,
                optimizer=OptimizerPlacement.NEXT_FORWARD if clip else OptimizerPlacement.DURING_BACKWARD)
    mem = cost.memory_breakdown(g, plan, spec())
    host, pinned = least_host(g, plan, mem, spec())
    assert host < mem.host_total
    nvme_spec = dict(nvme_capacity_bytes=10**12, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9)
    placed_plan, placed_mem, placed = place_with_masters(
        g, plan, mem, spec(host_memory_bytes=host, pinned_memory_cap_bytes=pinned, **nvme_spec))
    assert placed.host_total(placed_mem) <= host and placed.host_pinned(placed_mem) <= pinned
    assert bool(placed.masters) == (dtype == "bfloat16") == placed_plan.cast_once
    with pytest.raises(PlanError, match="still needs"):
        place_with_masters(g, plan, mem, spec(host_memory_bytes=host - 1, pinned_memory_cap_bytes=pinned,
                                              **nvme_spec))


def test_verifier_rejects_nvme_op_misuse():
    g = chain_graph(3)
    plan = Plan(nvme_moments=frozenset({1}))
    s = lower(g, plan)
    ops = list(s.ops)
    r = next(i for i, op in enumerate(ops) if op.kind is OpKind.NVME_READ)
    o = next(i for i, op in enumerate(ops) if op.kind is OpKind.OPT and op.layer == 1)
    # The OPT no longer waits for the read.
    bad = ops[:o] + [Op(OpKind.OPT, 1, ring=ops[o].ring, deps=tuple(d for d in ops[o].deps if d != r))] + ops[o + 1:]
    with pytest.raises(ScheduleError, match="rule 'nvme'.*no NVME_READ"):
        verify(Schedule(tuple(bad), plan, 3), g)
    # The write no longer waits for the OPT.
    w = next(i for i, op in enumerate(ops) if op.kind is OpKind.NVME_WRITE)
    bad = ops[:w] + [Op(OpKind.NVME_WRITE, 1, buf=0)] + ops[w + 1:]
    with pytest.raises(ScheduleError, match="rule 'nvme'"):
        verify(Schedule(tuple(bad), plan, 3), g)
    # The OPT of an NVMe layer steps its moments in the buffer its read filled, and names it.
    # One NVMe layer: one I/O buffer (cost.nvme_buffers).
    for buf, msg in ((None, "must name an I/O buffer"), (1, r"names I/O buffer b1, but the plan has 1")):
        bad = ops[:o] + [dataclasses.replace(ops[o], buf=buf)] + ops[o + 1:]
        with pytest.raises(ScheduleError, match=f"rule 'nvme'.*{msg}"):
            verify(Schedule(tuple(bad), plan, 3), g)
    # A layer in host memory has no buffer.
    o0 = next(i for i, op in enumerate(ops) if op.kind is OpKind.OPT and op.layer == 0)
    bad = ops[:o0] + [dataclasses.replace(ops[o0], buf=0)] + ops[o0 + 1:]
    with pytest.raises(ScheduleError, match="rule 'nvme'.*in host memory, so its OPT names no I/O buffer"):
        verify(Schedule(tuple(bad), plan, 3), g)
    # A read into a buffer while the OPT of the layer read into it before may still be stepping there.
    nf = Plan(optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=4, nvme_moments=frozenset({2, 3}))
    g4 = chain_graph(4)
    ok = lower(g4, nf, mode="update")
    # Both reads at the start (two buffers), ahead of the OPTs of the layers in host memory.
    assert [repr(op) for op in ok.ops] == ["NVME_READ:L2:b0", "NVME_READ:L3:b1", "OPT:L0:r0", "OPT:L1:r1",
                                           "OPT:L2:r2:b0", "NVME_WRITE:L2:b0", "OPT:L3:r3:b1", "NVME_WRITE:L3:b1"]
    prefix = list(ok.ops[2:4])  # the OPTs of the layers in host memory
    racy = prefix + [Op.parse("NVME_READ:L2:b0"), Op.parse("OPT:L2:r2:b0", (2,)), Op.parse("NVME_READ:L3:b0"),
                               Op.parse("NVME_WRITE:L2:b0", (3,)), Op.parse("OPT:L3:r3:b0", (4,)),
                               Op.parse("NVME_WRITE:L3:b0", (6,))]
    with pytest.raises(ScheduleError, match=r"op #4 NVME_READ:L3:b0 breaks rule 'nvme': it fills I/O buffer b0 while "
                                            r"#3 OPT:L2:r2:b0 may still use it. Fix: make it depend on #3"):
        verify(Schedule(tuple(racy), nf, 4, mode="update"), g4)
    # An OPT naming the buffer that holds another layer's moments.
    swapped = list(ok.ops)
    swapped[4] = Op.parse("OPT:L2:r2:b1", (0,))
    with pytest.raises(ScheduleError, match=r"op #4 OPT:L2:r2:b1 breaks rule 'nvme': I/O buffer b1 holds layer 3's "
                                            r"moments, not layer 2's"):
        verify(Schedule(tuple(swapped), nf, 4, mode="update"), g4)
    # A buffer the plan does not have (two NVMe layers: two buffers).
    beyond = prefix + [Op.parse("NVME_READ:L2:b0"), Op.parse("NVME_READ:L3:b2"), Op.parse("OPT:L2:r2:b0", (2,)), Op.parse("NVME_WRITE:L2:b0", (4,)),
                  Op.parse("OPT:L3:r3:b2", (3,)), Op.parse("NVME_WRITE:L3:b2", (6,))]
    with pytest.raises(ScheduleError, match=r"op #3 NVME_READ:L3:b2 breaks rule 'nvme': it names I/O buffer b2, but "
                                            r"the plan has 2 \(cost.nvme_buffers\)"):
        verify(Schedule(tuple(beyond), nf, 4, mode="update"), g4)
    # Reading into the other buffer, the same order is safe.
    racy[4:8] = [Op.parse("NVME_READ:L3:b1"), racy[5], Op.parse("OPT:L3:r3:b1", (4,)),
                 Op.parse("NVME_WRITE:L3:b1", (6,))]
    verify(Schedule(tuple(racy), nf, 4, mode="update"), g4)
    # An NVMe op of a layer whose moments are in host memory.
    with pytest.raises(ScheduleError, match="rule 'nvme'.*not on NVMe"):
        verify(Schedule(tuple(ops), Plan(), 3), g)
    with pytest.raises(PlanError, match="nvme_moments names layers \\[7\\]"):
        lower(g, Plan(nvme_moments=frozenset({7})))


# -- runtime: bitwise the same training with moments on NVMe (a temp dir) as all in RAM --------------

import copy  # noqa: E402
import re  # noqa: E402
import dataclasses  # noqa: E402

import megatrain  # noqa: E402

from conftest import random_batch, tiny_llama  # noqa: E402
from test_exactness import ADAMW  # noqa: E402


from megatrain.errors import StepError  # noqa: E402
from megatrain.runtime.host import HostState, as_tensor  # noqa: E402

ON_NVME = frozenset({1, 3})  # of tiny_llama(layers=2)'s 4 layers: a decoder layer and the head, not all


def _planned(model, max_grad_norm=None, on_nvme=ON_NVME):
    """The default plan of ``model`` (2 micro-batches of 2 rows of 16 tokens) with the moments of
    ``on_nvme`` on NVMe."""
    planned = megatrain.plan_model(model, plan="default", seq_len=16, micro_batch_size=2, micro_batches=2,
                                   max_grad_norm=max_grad_norm)
    return dataclasses.replace(planned.plan, nvme_moments=on_nvme)


def _compile(model, plan, nvme_dir=None, max_grad_norm=None):
    return megatrain.compile(model, plan=plan, optimizer=ADAMW, seq_len=16, micro_batch_size=2, micro_batches=2,
                             max_grad_norm=max_grad_norm, nvme_dir=None if nvme_dir is None else str(nvme_dir))


BATCHES = [random_batch(4, 16, 96, seed=s) for s in range(4)]


@pytest.mark.parametrize("optimizer", [OptimizerPlacement.DURING_BACKWARD, OptimizerPlacement.NEXT_FORWARD])
def test_nvme_placement_moves_the_layers_updated_first(optimizer):
    """place_on_nvme moves the moments of the layers the step updates first (backward order with
    updates during the backward, forward order with deferred ones); on a step where the NVMe is
    slow, that beats moving the layers updated last, whose writes would trail the step."""
    from megatrain.planner.nvme import update_order

    g = chain_graph(6, numel=1 << 16)
    plan = Plan(optimizer=optimizer, grad_ring=6 if optimizer is OptimizerPlacement.NEXT_FORWARD else 2)
    first = [5, 4, 3, 2, 1, 0] if optimizer is OptimizerPlacement.DURING_BACKWARD else [0, 1, 2, 3, 4, 5]
    assert update_order(g, plan) == first
    mem = cost.memory_breakdown(g, plan)
    moments = (1 << 16) * 8
    # Three layers' moments must go: each frees its moments and, up to two, adds an I/O buffer as big.
    hw = spec(host_memory_bytes=mem.host_total - moments, pinned_memory_cap_bytes=mem.host_total - moments,
              nvme_capacity_bytes=10**9,
              nvme_read_bytes_per_s=2e8, nvme_write_bytes_per_s=1e8)
    p = place_on_nvme(g, plan, mem, hw, kinds=("moments",))
    assert p.moments == frozenset(first[:3])
    carries = optimizer is OptimizerPlacement.NEXT_FORWARD

    def step(on_nvme):
        placed = dataclasses.replace(plan, nvme_moments=on_nvme)
        return simulate(lower(g, placed, carries_updates=carries), g, hw).step_time_s
    if optimizer is OptimizerPlacement.DURING_BACKWARD:
        assert step(p.moments) < step(frozenset(first[3:]))


def test_nvme_moments_free_their_host_bytes_as_the_cost_model_counts(tmp_path):
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    plan = _planned(copy.deepcopy(model))
    ram_plan = dataclasses.replace(plan, nvme_moments=frozenset())
    graph = megatrain.plan_model(copy.deepcopy(model), plan=plan, seq_len=16, micro_batch_size=2,
                                 micro_batches=2).traced.graph
    moments = {i: 2 * 4 * graph.layers[i].trainable_numel for i in ON_NVME}  # exp_avg + exp_avg_sq, FP32
    ram, disk = HostState(graph), HostState(graph, ON_NVME, str(tmp_path))
    assert ram.nbytes - disk.nbytes == sum(moments.values())
    for host, p in ((ram, ram_plan), (disk, plan)):  # the persistent state is the planner's figure
        mem = cost.memory_breakdown(graph, p)
        assert host.nbytes == mem.master_weights + mem.adam_moments
    with pytest.raises(ValueError, match=r"keeps its Adam moments on NVMe .*L3\.moments\.tile"):
        disk.exp_avg(3)
    # The I/O buffers: two (cost.NVME_BUFFERS), each the widest NVMe layer's moments in whole 4 KiB blocks.
    mem, mem_ram = cost.memory_breakdown(graph, plan), cost.memory_breakdown(graph, ram_plan)
    assert mem.nvme_buffers == 2 * -(-max(moments.values()) // 4096) * 4096
    assert mem_ram.host_total - mem.host_total == sum(moments.values()) - mem.nvme_buffers
    # ... which is what the executor allocates for them.
    (tmp_path / "t").mkdir()
    trainer = _compile(copy.deepcopy(model), plan, tmp_path / "t")
    trainer.step(BATCHES[0])
    assert trainer.host.nbytes == disk.nbytes
    assert sum(b.numel() for b in trainer.executor._nvme_pool) == mem.nvme_buffers
    # The placement's host figure agrees too: with 1 byte too little host memory it moves moments,
    # largest layer first, until what they free exceeds the I/O buffers they add by a byte.
    hw = spec(host_memory_bytes=mem_ram.host_total - 1, pinned_memory_cap_bytes=mem_ram.host_pinned,
              nvme_capacity_bytes=10**9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9)
    placement = place_on_nvme(graph, ram_plan, mem_ram, hw)
    assert placement.moments and not placement.gradients and not placement.masters
    placed = cost.memory_breakdown(graph, dataclasses.replace(ram_plan, nvme_moments=placement.moments))
    assert placement.host_total(mem_ram) == placed.host_total and placed.nvme_buffers == placement.buffer_bytes


@pytest.mark.parametrize("max_grad_norm,buffers", [(None, 1), (0.5, 2)])
def test_training_with_moments_on_nvme_is_bitwise_all_in_ram(tmp_path, max_grad_norm, buffers):
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    ref_model = copy.deepcopy(model)
    plan = dataclasses.replace(_planned(copy.deepcopy(model), max_grad_norm), nvme_buffers=buffers)
    with pytest.raises(ConfigError, match="nvme_dir"):
        _compile(copy.deepcopy(model), plan, None, max_grad_norm)
    ref = _compile(ref_model, dataclasses.replace(plan, nvme_moments=frozenset()), None, max_grad_norm)
    got = _compile(model, plan, tmp_path, max_grad_norm)
    # The files are made at compile (a missing directory or full disk fails there).
    assert sorted(os.listdir(tmp_path)) == ["L1.moments.tile", "L3.moments.tile"]
    # Between steps the I/O buffers hold garbage, so the next step's updates are right only if
    # their NVME_READs bring the moments back from the files.
    _train_alike(ref, got, ref_model, model, lambda: got.executor._nvme_pool)


def _train_alike(ref, got, ref_model, model, scratch):
    """Step trainers ``ref`` and ``got`` (of ``ref_model`` and ``model``) on the same batches, filling
    the host buffers ``scratch()`` returns with NaN after each step, then flush both: the losses,
    weights, moments and Adam step counts must be equal, bitwise."""
    for step, b in enumerate(BATCHES + BATCHES[:2]):
        assert got.step(b).loss == ref.step(b).loss, f"step {step}"
        for buf in scratch():
            buf.view(torch.float32).fill_(float("nan"))
    ref.flush()
    got.flush()
    # Through the trainers' state dicts: a master on NVMe is no module parameter (a meta tensor).
    mine, theirs = got.state_dict()["model"], ref.state_dict()["model"]
    assert set(mine) == set(theirs) == set(dict(ref_model.named_parameters()))
    for name, a in theirs.items():
        assert torch.equal(as_tensor(mine[name]), a), name
    for li in range(4):
        assert torch.equal(got.host.read_moments(li), ref.host.read_moments(li)), li
        assert float(got.host.steps[li]) == float(ref.host.steps[li]) == len(BATCHES) + 2


@pytest.mark.parametrize("masters", [frozenset(), frozenset({1})], ids=["moments", "masters"])
def test_checkpoint_between_nvme_and_ram_trainers_continues_bitwise(tmp_path, masters):
    """Save with moments (and, BF16 with cast_once, masters: ``Plan.nvme_masters``) on NVMe and
    load into an all-in-RAM trainer, and the reverse: both go on exactly as an uninterrupted run
    (the optimizer rows, and masters, of NVMe layers are read from and written to their files; a
    load into a masters trainer re-casts its staging tiles, which a step before it made stale)."""
    torch.manual_seed(0)
    base = tiny_llama(layers=2)
    plan = _planned(copy.deepcopy(base), 0.5)
    if masters:
        plan = dataclasses.replace(plan, compute_dtype="bfloat16", cast_once=True, nvme_masters=masters)
    ram_plan = dataclasses.replace(plan, nvme_moments=frozenset(), nvme_masters=frozenset())
    for d in ("a", "c"):
        (tmp_path / d).mkdir()
    ref = _compile(copy.deepcopy(base), ram_plan, None, 0.5)
    nv = _compile(copy.deepcopy(base), plan, tmp_path / "a", 0.5)
    for b in BATCHES[:2]:
        assert ref.step(b).loss == nv.step(b).loss
    ref.save(tmp_path / "ckpt_ram")
    # Lossy BF16 shards with masters on NVMe: the FP32 masters are then saved from the files as state rows.
    nv.save(tmp_path / "ckpt_nvme", dtype="bfloat16" if masters else "float32")
    want = [ref.step(b).loss for b in BATCHES[2:]]
    ref.flush()
    into_ram = _compile(copy.deepcopy(base), ram_plan, None, 0.5)
    into_ram.load(tmp_path / "ckpt_nvme")
    into_nvme = _compile(copy.deepcopy(base), plan, tmp_path / "c", 0.5)
    into_nvme.step(BATCHES[3])  # its masters and staging tiles now hold other weights than the checkpoint's
    writes = collections.Counter()
    store = into_nvme.host.nvme
    write = store.write_tensor
    store.write_tensor = lambda key, *a, **kw: (writes.update([key]), write(key, *a, **kw))[1]
    into_nvme.load(tmp_path / "ckpt_ram")
    # A layer's rows (master, parameters, moments) are written into its file together, once per
    # pass over the checkpoint's files (weights, then optimizer rows), not once per row.
    assert set(writes) == {into_nvme.host.nvme_rows.key(li) for li in ON_NVME} and max(writes.values()) <= 2
    for t in (into_ram, into_nvme):
        assert [t.step(b).loss for b in BATCHES[2:]] == want
        t.flush()
        for li in range(4):
            assert torch.equal(t.host.read_master(li), ref.host.master(li)), li
            assert torch.equal(t.host.read_moments(li), ref.host.read_moments(li)), li
        assert t.step_count == ref.step_count
    # A trainer's state_dict loads into another directly too: NVMe rows are read, RAM rows written through.
    into_nvme.load_state_dict(into_ram.state_dict())
    into_ram.load_state_dict(into_nvme.state_dict())
    assert torch.equal(into_nvme.host.read_moments(3), ref.host.read_moments(3))
    assert torch.equal(into_nvme.host.read_master(1), ref.host.master(1))


@pytest.mark.parametrize("masters", [frozenset(), ON_NVME], ids=["moments", "masters"])
def test_truncated_nvme_file_mid_run_names_op_and_file_and_leaves_state(tmp_path, masters):
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    plan = _planned(copy.deepcopy(model))
    if masters:  # masters and moments in one file per layer (Plan.nvme_masters, BF16 with cast_once)
        plan = dataclasses.replace(plan, compute_dtype="bfloat16", cast_once=True, nvme_masters=masters)
    t = _compile(model, plan, tmp_path)
    t.step(BATCHES[0])
    before = [t.host.read_master(li) for li in range(4)]
    steps = [float(s) for s in t.host.steps]
    moments1 = t.host.read_moments(1)
    head = "L3.state" if masters else "L3.moments"
    os.truncate(tmp_path / f"{head}.tile", ALIGN)
    with pytest.raises(StepError, match=rf"NvmeError: op #\d+ NVME_READ:L3:b0: NVMe tile file .*{head}\.tile"
                                        r"' is truncated") as e:
        t.step(BATCHES[1])
    assert isinstance(e.value.__cause__, NvmeError)
    # Nothing was updated from garbage: the head's read failed before any optimizer step (its OPT is
    # the first), so every readable master, Adam step and moment is as before.
    assert e.value.updated_layers == ()
    for li in range(4 if not masters else 3):
        assert torch.equal(t.host.read_master(li), before[li]), li
    assert [float(s) for s in t.host.steps] == steps
    assert torch.equal(t.host.read_moments(1), moments1)


@pytest.mark.parametrize("masters", [frozenset(), ON_NVME], ids=["moments", "masters"])
def test_a_tile_overwritten_mid_run_stops_the_step_naming_the_file(tmp_path, masters):
    """It gave a different run, exit 0: now the checksum of the block read differs from the one
    written, and the step stops before any optimizer step used it."""
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    plan = _planned(copy.deepcopy(model))
    if masters:
        plan = dataclasses.replace(plan, compute_dtype="bfloat16", cast_once=True, nvme_masters=masters)
    t = _compile(model, plan, tmp_path)
    t.step(BATCHES[0])
    head = "L3.state" if masters else "L3.moments"
    with open(tmp_path / f"{head}.tile", "r+b") as f:  # another process, or a failing drive
        f.seek(8)
        f.write(b"\x7f" * 4)
    with pytest.raises(StepError, match=rf"NVME_READ:L3:b0: NVMe tile file .*{head}\.tile' changed on disk since "
                                        r"this run wrote it \(the checksum of the \d+ bytes at offset 0 differs\)"):
        t.step(BATCHES[1])


def test_readme_nvme_snippet_runs(tmp_path):
    from conftest import readme_snippet

    code = readme_snippet("## NVMe tier").replace("/mnt/nvme/run1", str(tmp_path))
    ns = {"megatrain": megatrain, "dataclasses": dataclasses, "model": tiny_llama(layers=2)}
    exec(compile(code, "README.md", "exec"), ns)
    trainer = ns["trainer"]
    assert trainer.planned.plan.nvme_moments == frozenset({1, 3})
    assert math.isfinite(trainer.step(random_batch(1, 16, 96, seed=0)).loss)
    assert sorted(os.listdir(tmp_path)) == ["L1.moments.tile", "L3.moments.tile"]


@pytest.mark.parametrize("grads,masters,buffers", [(frozenset(), frozenset(), 3), (frozenset({0, 1, 3}), frozenset(), 2),
                                                   (frozenset(), frozenset({0, 2, 3}), 2)],
                         ids=["moments", "moments+grads", "moments+masters"])
def test_nvme_ops_on_async_fake_cuda_train_like_the_cpu_backend(tmp_path, grads, masters, buffers):
    """The CUDA backend runs Stream.IO on a host worker of its own; on the asynchronous fake (random
    delays before every op) the NVMe plan trains bitwise like the CPU backend, with every read at
    the start of the step (3 buffers for 3 NVMe layers), with gradient tiles on NVMe (their D2Hs
    into the rotating pinned buffers wait for the NVME_WRITEs) and with masters on NVMe (BF16,
    cast_once: the CAST from an I/O buffer must run after its OPT and before its NVME_WRITE and the
    next read into that buffer)."""
    from megatrain.runtime.cuda import CUDABackend
    from megatrain.testing import AsyncFakeCuda

    torch.manual_seed(0)
    base = tiny_llama(layers=2)
    kw = dict(seq_len=16, micro_batch_size=2, max_grad_norm=0.5)
    planned = megatrain.plan_model(copy.deepcopy(base), plan="default", **kw)
    plan = dataclasses.replace(planned.plan, nvme_moments=frozenset({0, 2, 3}), nvme_gradients=grads,
                               nvme_buffers=buffers)
    if masters:
        plan = dataclasses.replace(plan, compute_dtype="bfloat16", cast_once=True, nvme_masters=masters)
    batches = [random_batch(2, 16, 96, seed=s) for s in range(3)]

    def run(backend, d):
        model = copy.deepcopy(base)
        p = megatrain.plan_model(model, plan=plan, **kw)
        t = megatrain.materialize(p, ADAMW, backend=backend, nvme_dir=str(d))
        losses = [t.step(b).loss for b in batches]
        t.flush()
        return losses, [t.host.read_master(li) for li in range(4)] + [t.host.read_moments(li) for li in range(4)]

    want = run(None, tmp_path)
    for seed in range(2):
        fake = AsyncFakeCuda(seed=seed, max_delay_s=2e-3)
        d = tmp_path / f"s{seed}"
        d.mkdir()
        got = run(CUDABackend(adapter=fake), d)
        fake.close()
        assert got[0] == want[0], f"seed {seed}"
        assert all(torch.equal(x, y) for x, y in zip(got[1], want[1])), f"seed {seed}"


def test_megatrain_train_with_nvme_dir_matches_all_in_ram(tmp_path, monkeypatch, capsys):
    import json

    import megatrain.runtime.measure
    from megatrain.cli import main
    from test_train_cli import CONFIG_YAML, write_model

    monkeypatch.setattr(megatrain.runtime.measure, "MATMUL_SECONDS", 0.02)
    write_model(tmp_path / "config.json")
    (tmp_path / "run.yaml").write_text(CONFIG_YAML.format(model=tmp_path / "config.json"))

    def losses(out, *extra):
        assert main(["train", "--config", str(tmp_path / "run.yaml"), "--output-dir", str(out), "--max-steps", "4",
                     *extra]) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if "loss" in r]

    want = losses(tmp_path / "ram")
    from megatrain.planner import front
    from megatrain.train import load_train_config
    from megatrain.train.loop import host_beside_plan, plan_request, planning_model
    from megatrain.train.model import resolve_model

    # A budget one byte under the host bytes of the run: its plan's, planned as megatrain train
    # plans it, and what it holds beside them (its data, the model built on the CPU).
    cfg = load_train_config(tmp_path / "run.yaml", {"output_dir": str(tmp_path / "ram")})
    source = resolve_model(cfg.model)
    model = planning_model(cfg, source)
    total = front.plan(plan_request(cfg, model, None, front.Topology())).memory.host_total
    total += host_beside_plan(cfg, source, model).total
    for name, extra, on_disk in (("all", (), 4), ("budget", ("--host-memory", "1TiB"), 0),
                                 ("short", ("--host-memory", str(total - 1)), 0)):
        nvme_dir = tmp_path / f"nvme_{name}"
        nvme_dir.mkdir()
        capsys.readouterr()
        got = losses(tmp_path / f"run_{name}", "--nvme-dir", str(nvme_dir), *extra)
        assert len(want) == 4 and got == want, name
        # Every layer's moments without a budget; none when the plan fits the budget in RAM; with
        # one byte too little, the clipped run's deferred gradient tiles first. Said.
        out = capsys.readouterr().out
        assert f"NVMe: Adam moments of {on_disk} of 4 trainable layers" in out
        files = [f for f in os.listdir(nvme_dir) if f != ".megatrain-nvme.lock"]  # the run's lock of nvme_dir
        assert sum(f.endswith(".moments.tile") for f in files) == on_disk
        grads = sum(f.endswith(".grad.tile") for f in files)
        assert (grads > 0) == (name == "short") and len(files) == on_disk + grads
        assert ("deferred gradient tiles of" in out) == (name == "short")


def test_a_second_run_on_an_nvme_dir_in_use_is_refused_naming_the_first(tmp_path, monkeypatch, capsys):
    """Issue 44, item 4: two runs on one --nvme-dir shared its tile files (with --nvme-checksums
    false the first run's weights silently changed). The second is one error line, before its data
    is prepared; once the first ends, the same command runs."""
    import megatrain.runtime.measure
    from megatrain.cli import main
    from megatrain.files import DirectoryLock
    from test_train_cli import CONFIG_YAML, write_model

    monkeypatch.setattr(megatrain.runtime.measure, "MATMUL_SECONDS", 0.02)
    write_model(tmp_path / "config.json")
    (tmp_path / "run.yaml").write_text(CONFIG_YAML.format(model=tmp_path / "config.json"))
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    args = ["train", "--config", str(tmp_path / "run.yaml"), "--output-dir", str(tmp_path / "b"), "--max-steps", "2",
            "--warmup-steps", "0", "--nvme-dir", str(nvme_dir)]
    with DirectoryLock(nvme_dir / ".megatrain-nvme.lock", "nvme_dir"):  # the first run, another output_dir
        assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: nvme_dir {nvme_dir} is in use by pid {os.getpid()} on host ") and "another" in err
    assert not (tmp_path / "b").exists()  # refused before anything of the run was written
    assert main(args) == 0


def test_train_nvme_layers_follow_the_host_memory_budget(tmp_path):
    from megatrain.planner.nvme import place_in_directory

    def place(planned, budget):  # what megatrain train --nvme-dir DIR [--host-memory budget] moves there
        return place_in_directory(planned.graph, planned.plan, planned.memory, budget, str(tmp_path))

    torch.manual_seed(0)
    planned = megatrain.plan_model(tiny_llama(layers=2), plan="default", seq_len=16, micro_batch_size=2)
    graph, total = planned.graph, planned.memory.host_total
    every = frozenset(i for i, layer in enumerate(graph.layers) if layer.trainable_numel)
    assert place(planned, None) == (every, frozenset(), frozenset(), False)
    assert every == {0, 1, 2, 3}
    assert place(planned, "1TiB") == (frozenset(), frozenset(), frozenset(), False)
    # One byte short: the largest layers' moments move until the host total fits, not every layer's.
    some, grads, masters, _ = place(planned, str(total - 1))
    assert not masters  # FP32 compute: the H2D reads the master rows
    assert not grads  # no clipping: no gradient tile waits between steps
    assert some and some < every and 3 in some  # the head (vocab x hidden) is the largest
    placed = cost.memory_breakdown(graph, dataclasses.replace(planned.plan, nvme_moments=some))
    assert placed.host_total <= total - 1
    assert placed.adam_moments == sum(8 * graph.layers[i].trainable_numel for i in every - some)
    with pytest.raises(PlanError, match="with every Adam moment on NVMe the plan still needs .* of host memory"):
        place(planned, "64KiB")
    # With clipping (deferred updates) the gradient tiles move first, and the plan runs them.
    clipped = megatrain.plan_model(tiny_llama(layers=2), plan="default", seq_len=16, micro_batch_size=2,
                                   max_grad_norm=0.5)
    total = clipped.memory.host_total
    moments, grads, _, _ = place(clipped, str(total - 1))
    assert grads and not moments
    placed = cost.memory_breakdown(clipped.graph, dataclasses.replace(clipped.plan, nvme_gradients=grads))
    assert placed.host_total <= total - 1


# -- gradient tiles on NVMe (Plan.nvme_gradients): deferred (clipped) updates ------------------------

GRADS_ON_NVME = frozenset({0, 1, 3})  # of tiny_llama(layers=2)'s 4 trainable layers: all but layer 2
ALL_LAYERS = frozenset({0, 1, 2, 3})


def _grad_plan(model, moments=frozenset(), grads=GRADS_ON_NVME):
    """The clipped (NEXT_FORWARD) default plan, 2 micro-batches layer by layer, with the gradient
    tiles of ``grads`` and the moments of ``moments`` on NVMe."""
    plan = _planned(model, 0.5, moments)
    assert plan.optimizer is OptimizerPlacement.NEXT_FORWARD and plan.layer_by_layer and plan.micro_batches == 2
    return dataclasses.replace(plan, nvme_gradients=grads)


@pytest.mark.parametrize("grads,moments", [(ALL_LAYERS, frozenset()), (GRADS_ON_NVME, ON_NVME)],
                         ids=["grads", "some grads+moments"])
def test_training_with_gradient_tiles_on_nvme_is_bitwise_all_in_ram(tmp_path, grads, moments):
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    ref_model = copy.deepcopy(model)
    plan = _grad_plan(copy.deepcopy(model), moments, grads)
    ram_plan = dataclasses.replace(plan, nvme_gradients=frozenset(), nvme_moments=frozenset())
    with pytest.raises(ConfigError, match=re.escape(f"gradient tiles of layers {sorted(grads)} on NVMe") + ".*nvme_dir"):
        _compile(copy.deepcopy(model), dataclasses.replace(plan, nvme_moments=frozenset()), None, 0.5)
    ref = _compile(ref_model, ram_plan, None, 0.5)
    got = _compile(model, plan, tmp_path, 0.5)
    assert sorted(os.listdir(tmp_path)) == sorted([f"L{i}.grad.tile" for i in grads]
                                                  + [f"L{i}.moments.tile" for i in moments])
    # Between steps the gradient buffers hold garbage (and the NVMe layers' own ring tiles do not
    # exist), so the carried updates are right only if their NVME_READs bring the tiles back.
    _train_alike(ref, got, ref_model, model, lambda: got.executor._buffers.nvme_gradients)
    # Pinned host memory drops by the NVMe layers' own gradient tiles, less the two rotating
    # gradient buffers (each the widest of them, whole pages): the executor's arena as the cost model.
    # (With all four layers on NVMe that is a saving: two buffers of the widest layer replace four tiles.)
    graph = got.planned.graph
    own = sum(cost.page_up(graph.layers[i].trainable_numel * 4) for i in grads)
    rotating = 2 * max(cost.nvme_gradient_bytes(graph.layers[i], plan) for i in grads)
    mem, mem_ram = cost.memory_breakdown(graph, plan), cost.memory_breakdown(graph, ram_plan)
    assert mem.nvme_gradient_buffers == rotating
    assert mem_ram.host_pinned - mem.host_pinned == own - rotating
    assert grads != ALL_LAYERS or own - rotating > 0
    # The placement moves gradient tiles first, and its host figures are the cost model's of the
    # placed plan: with one byte too little host memory it moves them until the tiles freed exceed
    # the two buffers added.
    hw = spec(host_memory_bytes=mem_ram.host_total - 1, pinned_memory_cap_bytes=mem_ram.host_pinned,
              nvme_capacity_bytes=10**9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9)
    placement = place_on_nvme(graph, ram_plan, mem_ram, hw)
    assert len(placement.gradients) >= 3 and not placement.moments and not placement.masters
    placed = cost.memory_breakdown(graph, dataclasses.replace(ram_plan, nvme_gradients=placement.gradients))
    assert placement.host_total(mem_ram) == placed.host_total <= hw.host_memory_bytes
    assert placement.host_pinned(mem_ram) == placed.host_pinned
    assert ref.executor._arena.nbytes - got.executor._arena.nbytes == own - rotating
    assert got.executor._arena.nbytes == cost.pinned_buffers(graph, plan, "train").nbytes


def test_truncated_gradient_file_names_the_op_and_file(tmp_path):
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    t = _compile(model, _grad_plan(copy.deepcopy(model)), tmp_path, 0.5)
    t.step(BATCHES[0])  # writes every NVMe layer's gradient tile; the next step's OPTs read them
    os.truncate(tmp_path / "L1.grad.tile", ALIGN)
    with pytest.raises(StepError, match=r"NvmeError: op #\d+ NVME_READ:L1:g\d: NVMe tile file .*L1\.grad\.tile"
                                        r"' is truncated") as e:
        t.step(BATCHES[1])
    assert isinstance(e.value.__cause__, NvmeError)


def test_nvme_gradient_plans_are_refused_where_no_tile_waits():
    g = chain_graph(3)
    with pytest.raises(PlanError, match="nvme_gradients=\\[1\\] with optimizer=.*NEXT_FORWARD"):
        Plan(nvme_gradients=frozenset({1}))  # DURING_BACKWARD: no tile waits for the next step
    with pytest.raises(PlanError, match="nvme_gradients=\\[1\\] with .*layer_by_layer=False, micro_batches=2"):
        Plan(optimizer=OptimizerPlacement.NEXT_FORWARD, nvme_gradients=frozenset({1}), layer_by_layer=False,
             micro_batches=2)
    with pytest.raises(PlanError, match="nvme_gradients names layers \\[7\\]"):
        lower(g, Plan(optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=3, nvme_gradients=frozenset({7})))
    with pytest.raises(PlanError, match="nvme_buffers=0: .* use 1 \\(no read-ahead\\) or more"):
        Plan(nvme_moments=frozenset({1}), nvme_buffers=0)


def test_verifier_rejects_gradient_tile_nvme_op_misuse():
    """Hand-mutated schedules of a plan with gradient tiles on NVMe: each is refused by rule
    'nvme' with a message naming the op."""
    g = chain_graph(4)
    plan = Plan(optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=4, nvme_gradients=frozenset({1, 2, 3}))
    s = lower(g, plan, carries_updates=True)
    verify(s, g)
    ops = list(s.ops)
    at = {repr(op): i for i, op in enumerate(ops)}

    def bad(mutated, msg):
        with pytest.raises(ScheduleError, match=msg):
            verify(dataclasses.replace(s, ops=tuple(mutated)), g)

    # The carried OPT must read what its NVME_READ filled: drop the dependency on the read.
    o = next(i for i, op in enumerate(ops) if op.kind is OpKind.OPT and op.layer == 3)
    r = next(d for d in ops[o].deps if ops[d].kind is OpKind.NVME_READ)
    m = list(ops)
    m[o] = dataclasses.replace(ops[o], deps=tuple(d for d in ops[o].deps if d != r))
    bad(m, rf"op #{o} {ops[o]!r} breaks rule 'nvme': it uses gradient I/O buffer g\d before #{r}")
    # The write of a D2H's tile must happen after the D2H (the tile complete).
    w = next(i for i, op in enumerate(ops) if op.kind is OpKind.NVME_WRITE and op.gbuf is not None)
    m = list(ops)
    m[w] = dataclasses.replace(ops[w], deps=())
    bad(m, rf"op #{w} {ops[w]!r} breaks rule 'nvme': it uses gradient I/O buffer g\d before #{w - 1}")
    # Without the write, the gradients never reach the file the next step reads.
    d = w - 1
    m = [op for i, op in enumerate(ops) if i != w]
    m = [dataclasses.replace(op, deps=tuple(x - (x > w) for x in op.deps if x != w)) for op in m]
    bad(m, rf"op #{d} {ops[d]!r} breaks rule 'nvme': the gradients it puts in gradient I/O buffer g\d are never "
           "written")
    # A D2H reusing a buffer before the previous turn's NVME_WRITE emptied it.
    d2hs = [i for i, op in enumerate(ops) if op.kind is OpKind.D2H and op.gbuf is not None]
    later = next(i for i in d2hs[1:] if ops[i].gbuf == ops[d2hs[0]].gbuf)
    m = list(ops)
    m[later] = dataclasses.replace(ops[later], deps=tuple(x for x in ops[later].deps if x != d2hs[0] + 1))
    bad(m, rf"op #{later} {ops[later]!r} breaks rule 'nvme': it fills gradient I/O buffer g\d while #{d2hs[0] + 1}")
    # An NVMe layer's D2H into its ring tile, and an in-RAM layer's OPT from a gradient buffer.
    m = list(ops)
    m[d2hs[0]] = dataclasses.replace(ops[d2hs[0]], gbuf=None, ring=3)
    # (its own tile has no bytes: the budget rule, which runs first, says so)
    bad(m, rf"op #{d2hs[0]} D2H:L3:s\d:r3 breaks rule 'budget': layer 3's 1,024 gradients do not fit host tile r3 of 0")
    o0 = at[next(k for k in at if k.startswith("OPT:L0"))]
    m = list(ops)
    m[o0] = dataclasses.replace(ops[o0], ring=None, gbuf=0)
    bad(m, rf"op #{o0} OPT:L0:g0 breaks rule 'nvme': layer 0's gradient tile is in host memory")
    # A buffer index outside the pool.
    m = list(ops)
    m[r] = dataclasses.replace(ops[r], gbuf=5)
    bad(m, rf"op #{r} NVME_READ:L3:g5 breaks rule 'nvme': it names gradient I/O buffer g5, but the plan has 2 "
           r"\(cost.nvme_gradient_buffers\)")
    # The JSON form keeps the plan's gradient layers and the ops' buffers.
    assert Schedule.from_json(s.to_json()) == s
    # A gradient tile's transfer is timed with its bytes (4 per trainable parameter, whole 4 KiB
    # blocks), not the moments' (8 per parameter).
    hw = spec(nvme_capacity_bytes=10**9, nvme_read_bytes_per_s=1e6, nvme_write_bytes_per_s=5e5)
    layer = g.layers[ops[r].layer]
    assert cost.nvme_gradient_bytes(layer, plan) == -(-layer.trainable_numel * 4 // 4096) * 4096
    assert cost.op_time(ops[r], g, plan, hw) == pytest.approx(cost.nvme_gradient_bytes(layer, plan) / 1e6
                                                              + hw.op_latency_s)
    assert cost.op_times(s, g, hw)[w] == pytest.approx(cost.nvme_gradient_bytes(g.layers[ops[w].layer], plan) / 5e5
                                                       + hw.op_latency_s)


def test_data_parallel_ranks_keep_their_optimizer_shard_of_the_moments_in_files_of_their_own(tmp_path):
    """Plan.nvme_moments under data parallel (HostState.nvme_shards): the two ranks of a node sharing
    one copy each keep their optimizer shard (cost.optimizer_shard) of a layer's moments in a file
    named by their global rank, in one directory; a state-dict row reads the whole row from both
    files, and a load writes only the rank's own shard. (Two HostStates in one process stand for the
    ranks; the spawned run is tests/test_distributed.py.)"""
    from megatrain.runtime.host import NvmeMomentRow, NvmeShards, moments_key

    graph = chain_graph(2, numel=[1000, 2000])
    ranks = [HostState(graph, frozenset({1}), str(tmp_path), nvme_shards=NvmeShards(rank=2 + r, ways=2, index=r,
                                                                                       first=2))
             for r in range(2)]  # node 1 of a 4-rank world: global ranks 2 and 3
    assert moments_key(1) == "L1.moments" and moments_key(1, 3) == "L1.r3.moments"
    spans = [h.nvme_rows.span(1) for h in ranks]
    assert spans == [cost.optimizer_shard(2000, 2, r) for r in range(2)] == [(0, 1008), (1008, 2000)]
    for r, (lo, hi) in enumerate(spans):  # the file: exp_avg then exp_avg_sq of the shard, 4 KiB blocks
        assert os.path.getsize(tmp_path / f"L1.r{2 + r}.moments.tile") == nvme.align_up(2 * (hi - lo) * 4)
    assert sorted(os.listdir(tmp_path)) == ["L1.r2.moments.tile", "L1.r3.moments.tile"]
    # The I/O buffer the executor sizes (cost.nvme_buffers of the plan) holds the larger shard, not the layer.
    plan = Plan(data_parallel=2, optimizer_shards=2, nvme_moments=frozenset({1}))
    assert cost.nvme_buffers(graph, plan) == (1, nvme.align_up(2 * 1008 * 4))
    want = torch.arange(2000, dtype=torch.float32)
    for h in ranks:  # every rank loads the same checkpoint row; each writes its own shard
        NvmeMomentRow(h, 1, 1).copy_(want)
    for h, (lo, hi) in zip(ranks, spans):
        mine = h.read_moments(1)
        assert torch.equal(mine[hi - lo:], want[lo:hi]) and not mine[:hi - lo].any()
        row = h.moment_row(1, 1)
        assert row.shape == (2000,) and torch.equal(row.read(), want)  # whole, from both ranks' files
        assert not h.moment_row(1, 0).read().any()
    with pytest.raises(ConfigError, match="per-rank NVMe files .*hold Adam moments only"):
        HostState(graph, frozenset({1}), str(tmp_path), nvme_masters=frozenset({1}),
                  nvme_shards=NvmeShards(rank=0, ways=1, index=0, first=0))
    (tmp_path / "L1.r3.moments.tile").unlink()
    with pytest.raises(NvmeError, match=r"L1\.r3\.moments\.tile.* is missing"):
        ranks[0].moment_row(1, 0).read()


def test_the_placement_under_data_parallel_sizes_a_rank_s_buffers_and_a_node_s_disk():
    """place_on_nvme with data_parallel 2 on one node: the I/O buffer holds a rank's shard of the
    moments (cost.nvme_buffers' size), and the node's drives hold one copy where its two ranks share
    it, two where each has its own (and move that much each step)."""
    graph = chain_graph(3, numel=[1000, 20480, 20480])  # 20,480 x 8 bytes: whole 4 KiB blocks
    whole = 20480 * 8
    placements = {}
    for name, extra in (("one", {}), ("shared", dict(data_parallel=2, optimizer_shards=2)),
                        ("own", dict(data_parallel=2))):
        plan = Plan(nvme_buffers=1, **extra)
        mem = cost.memory_breakdown(graph, plan)
        hw = spec(host_memory_bytes=mem.host_total - 1, pinned_memory_cap_bytes=mem.host_pinned,
                  nvme_capacity_bytes=10**9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9)
        placements[name] = p = place_on_nvme(graph, plan, mem, hw)
        assert p.buffer_bytes == math.prod(cost.nvme_buffers(graph, dataclasses.replace(plan, nvme_moments=p.moments)))
    # One rank's buffer of a whole layer frees no more than it takes: two layers move. A shard's
    # buffer is half a layer: one layer is enough.
    assert len(placements["one"].moments) == len(placements["own"].moments) == 2
    assert len(placements["shared"].moments) == 1
    assert placements["one"].buffer_bytes == placements["own"].buffer_bytes == whole
    assert placements["shared"].buffer_bytes == whole // 2
    assert placements["one"].nvme_bytes == 2 * whole and placements["shared"].nvme_bytes == whole
    assert placements["own"].nvme_bytes == 4 * whole and placements["own"].read_bytes == 4 * whole
