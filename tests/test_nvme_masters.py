"""FP32 master weights on the NVMe tier (``Plan.nvme_masters``): the plan's rules, the lowering
(the CAST from the I/O buffer between the OPT and the NVME_WRITE), the runtime (no master row in
host memory; bitwise the all-in-RAM run) and the planner's placement. Reuses the moments'
helpers of test_nvme (tiny_llama, a temp dir as the NVMe tier); checkpoints, a truncated file and
the asynchronous fake CUDA with masters on NVMe are cases of test_nvme's tests of the moments, and
the dense-120b placement a case of its 512 GiB test."""

from __future__ import annotations

import dataclasses

import pytest

from megatrain.errors import PlanError, ScheduleError
from megatrain.planner.lower import lower
from megatrain.ir.plan import OptimizerPlacement, Plan
from megatrain.ir.schedule import Op, OpKind, Schedule, Stream
from megatrain.planner.verify import verify

from graphs import chain_graph, spec

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


@pytest.mark.parametrize("optimizer,carries", [(OptimizerPlacement.DURING_BACKWARD, False),
                                               (OptimizerPlacement.NEXT_FORWARD, True)])
def test_lowered_master_io_casts_from_the_buffer_between_the_opt_and_the_write(optimizer, carries):
    g = chain_graph(4)
    plan = Plan(optimizer=optimizer, grad_ring=4, micro_batches=2, nvme_moments=frozenset({1, 2, 3}),
                nvme_masters=frozenset({1, 3}), **BF16_ONCE)
    s = lower(g, plan, carries_updates=carries)
    verify(s, g)
    ops = s.ops
    at = {(op.kind, op.layer): i for i, op in enumerate(ops) if op.kind is not OpKind.H2D}
    for layer in (1, 3):
        o, w = at[(OpKind.OPT, layer)], at[(OpKind.NVME_WRITE, layer)]
        c = at[(OpKind.CAST, layer)]
        # One CAST of the layer, from the buffer its OPT stepped in, into its own tile; the write waits for it.
        assert [i for i, op in enumerate(ops) if op.kind is OpKind.CAST and op.layer == layer] == [c]
        assert ops[c] == Op(OpKind.CAST, layer, tile=layer, buf=ops[o].buf, deps=ops[c].deps)
        assert o in ops[c].deps and set(ops[w].deps) == {o, c} and ops[c].stream is Stream.CAST
        # Every H2D of the layer reads its own tile; one after the OPT depends on the CAST.
        for h in (i for i, op in enumerate(ops) if op.kind is OpKind.H2D and op.layer == layer):
            assert ops[h].tile == layer and ((h > c) == (c in ops[h].deps))
    # Layer 2 (moments only) and layer 0 cast from their master rows, before their copies.
    assert ops[at[(OpKind.CAST, 2)]].buf is None and ops[at[(OpKind.CAST, 0)]].buf is None
    assert Schedule.from_json(s.to_json()) == s and repr(ops[at[(OpKind.CAST, 1)]]).startswith("CAST:L1:t1:b")
    # The update schedule of a deferred step casts too; eval copies read the tiles as they are.
    if carries:
        u = lower(g, plan, mode="update")
        verify(u, g)
        assert [repr(op) for op in u.ops if op.layer == 3] == ["NVME_READ:L3:b0", "OPT:L3:r3:b0", "CAST:L3:t3:b0",
                                                               "NVME_WRITE:L3:b0"]
    e = lower(g, plan, mode="eval")
    verify(e, g)
    assert [op.layer for op in e.ops if op.kind is OpKind.CAST] == [0, 2]
    # The I/O ops of a masters layer move its master too: 12 B per parameter (chain_graph layers
    # are all trainable), timed as such.
    hw = spec(nvme_capacity_bytes=10**9, nvme_read_bytes_per_s=1e6, nvme_write_bytes_per_s=5e5)
    r = next(i for i, op in enumerate(ops) if op.kind is OpKind.NVME_READ and op.layer == 1)
    assert cost.op_time(ops[r], g, plan, hw) == pytest.approx(-(-12 * g.layers[1].numel // 4096) * 4096 / 1e6
                                                              + hw.op_latency_s)


def test_verifier_rejects_master_casts_out_of_order():
    g = chain_graph(4)
    plan = Plan(nvme_moments=frozenset({1, 2}), nvme_masters=frozenset({1}), **BF16_ONCE)
    s = lower(g, plan)
    ops = list(s.ops)
    c = next(i for i, op in enumerate(ops) if op.kind is OpKind.CAST and op.layer == 1)
    o = next(i for i, op in enumerate(ops) if op.kind is OpKind.OPT and op.layer == 1)
    w = next(i for i, op in enumerate(ops) if op.kind is OpKind.NVME_WRITE and op.layer == 1)

    def bad(mutated, msg):
        with pytest.raises(ScheduleError, match=msg):
            verify(dataclasses.replace(s, ops=tuple(mutated)), g)

    # The write no longer waits for the CAST: the master would go back while the cast may still read it.
    bad(ops[:w] + [dataclasses.replace(ops[w], deps=(o,))] + ops[w + 1:],
        rf"op #{w} NVME_WRITE:L1:b\d breaks rule 'nvme': it writes layer 1's master back before #{c}")
    # The CAST reads the master row, which the layer does not have.
    bad(ops[:c] + [dataclasses.replace(ops[c], buf=None)] + ops[c + 1:],
        rf"op #{c} CAST:L1:t1 breaks rule 'nvme': layer 1's master is on NVMe .*must cast from the I/O buffer")
    # The CAST runs before the OPT has stepped the master.
    bad(ops[:c] + [dataclasses.replace(ops[c], deps=())] + ops[c + 1:],
        rf"rule '(nvme|staging)'")
    # No CAST after the OPT: the tile keeps the old weights.
    dropped = [dataclasses.replace(op, deps=tuple(d - (d > c) for d in op.deps if d != c))
               for i, op in enumerate(ops) if i != c]
    bad(dropped, rf"op #{o} OPT:L1:r\d:b\d breaks rule 'nvme': it updates layer 1's master in I/O buffer b\d, but no "
                 "CAST after it")
    # An H2D of a masters layer reads another tile.
    h = next(i for i, op in enumerate(ops) if op.kind is OpKind.H2D and op.layer == 1)
    bad(ops[:h] + [dataclasses.replace(ops[h], tile=0)] + ops[h + 1:],
        rf"op #{h} H2D:L1:s\d:t0 breaks rule '(staging|budget)'")


# -- runtime: masters (and moments) on NVMe train bitwise like all in RAM --------------------------

import copy  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402

from megatrain.planner import cost  # noqa: E402
from megatrain.runtime.host import HostState, NvmeMasterRow  # noqa: E402

from conftest import tiny_llama  # noqa: E402
from test_nvme import BATCHES, ON_NVME, _compile, _planned, _train_alike  # noqa: E402

MASTERS = frozenset({1})  # of ON_NVME's {1, 3}: layer 3 (the head) keeps its master in RAM, moments on NVMe


def _bf16(model, max_grad_norm=None, masters=MASTERS, moments=ON_NVME):
    """test_nvme's plan (2 micro-batches layer by layer) in BF16 with cast_once, the moments of
    ``moments`` and the masters of ``masters`` on NVMe."""
    plan = _planned(model, max_grad_norm, moments)
    return dataclasses.replace(plan, compute_dtype="bfloat16", cast_once=True, nvme_masters=masters)


@pytest.mark.parametrize("max_grad_norm,layer_by_layer", [(None, True), (0.5, True), (None, False)],
                         ids=["layer-by-layer", "clipped", "per-micro-batch"])
def test_training_with_masters_on_nvme_is_bitwise_all_in_ram(tmp_path, max_grad_norm, layer_by_layer):
    """2 micro-batches, BF16: layer by layer, clipped (the updates carried into the next step and the
    final flush), and per-micro-batch passes (the layer's copies in every pass read its kept tile,
    the OPT after the last pass's ACC)."""
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    ref_model = copy.deepcopy(model)
    plan = dataclasses.replace(_bf16(copy.deepcopy(model), max_grad_norm), layer_by_layer=layer_by_layer)
    ram_plan = dataclasses.replace(plan, nvme_masters=frozenset(), nvme_moments=frozenset())
    ref = _compile(ref_model, ram_plan, None, max_grad_norm)
    got = _compile(model, plan, tmp_path, max_grad_norm)
    assert sorted(os.listdir(tmp_path)) == ["L1.state.tile", "L3.moments.tile"]
    # The module no longer views layer 1's master: its parameters are meta; the trainer's state
    # dict reads them from the file.
    name = next(s.name for s in got.planned.graph.layers[1].params)
    assert dict(model.named_parameters())[name].device.type == "meta"
    assert isinstance(got.state_dict(flush=False)["model"][name], NvmeMasterRow)
    with pytest.raises(ValueError, match=r"keeps its FP32 master on NVMe .*L1\.state\.tile.*read_master"):
        got.host.master(1)
    # Between steps the I/O buffers hold NaN, so the updates (and the CASTs into the staging tiles,
    # which every H2D of layer 1 reads) are right only if the NVME_READs bring masters and moments back.
    _train_alike(ref, got, ref_model, model, lambda: got.executor._nvme_pool)
    assert torch.equal(got.host.read_master(1), ref.host.master(1))


def test_masters_on_nvme_free_their_host_bytes_as_the_cost_model_counts(tmp_path):
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    plan = _bf16(copy.deepcopy(model))
    moments_only = dataclasses.replace(plan, nvme_masters=frozenset())
    trainer = _compile(model, plan, tmp_path)
    graph = trainer.planned.graph
    (tmp_path / "moments").mkdir()
    ram = HostState(graph, ON_NVME, str(tmp_path / "moments"))  # moments on NVMe, every master in RAM
    # 4 B per parameter of layer 1 fewer than with its moments alone on NVMe.
    assert ram.nbytes - trainer.host.nbytes == 4 * graph.layers[1].numel
    mem, mem_moments = cost.memory_breakdown(graph, plan), cost.memory_breakdown(graph, moments_only)
    assert trainer.host.nbytes == mem.master_weights + mem.adam_moments
    assert ram.nbytes == mem_moments.master_weights + mem_moments.adam_moments
    # The I/O buffers are sized for the widest NVMe layer's file: layer 1's master + moments, or
    # layer 3's moments, in whole 4 KiB blocks; the executor allocates what the cost model counts.
    widest = max(-(-12 * graph.layers[1].numel // 4096) * 4096, -(-8 * graph.layers[3].numel // 4096) * 4096)
    assert mem.nvme_buffers == 2 * widest
    trainer.step(BATCHES[0])
    assert sum(b.numel() for b in trainer.executor._nvme_pool) == mem.nvme_buffers
    # A second trainer over the same host state (as a shape-free trainer makes per batch shape) has
    # staging tiles of its own: once the first has trained, it re-casts them from the files.
    import megatrain
    from test_exactness import ADAMW

    other = megatrain.materialize(trainer.planned, ADAMW, nvme_dir=str(tmp_path), host=trainer.host)
    seen = other.evaluate(BATCHES[1])
    trainer.step(BATCHES[1])
    assert other.evaluate(BATCHES[1]) == trainer.evaluate(BATCHES[1]) != seen
    assert os.path.getsize(tmp_path / "L1.state.tile") == -(-12 * graph.layers[1].numel // 4096) * 4096
    # The placement moves masters once every moment is on NVMe, and its host figure is the cost
    # model's of the placed plan; a plan without cast_once gets it set (place_with_masters).
    from megatrain.planner.nvme import place_on_nvme, place_with_masters

    bare = dataclasses.replace(plan, nvme_masters=frozenset(), nvme_moments=frozenset())
    all_moments = cost.memory_breakdown(graph, dataclasses.replace(bare, nvme_moments=frozenset({0, 1, 2, 3})))
    hw = spec(host_memory_bytes=all_moments.host_total - 1, pinned_memory_cap_bytes=all_moments.host_pinned,
              nvme_capacity_bytes=10**9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9)
    placement = place_on_nvme(graph, bare, cost.memory_breakdown(graph, bare), hw)
    assert placement.moments == {0, 1, 2, 3} and placement.masters and placement.masters <= placement.moments
    placed = cost.memory_breakdown(graph, dataclasses.replace(bare, nvme_moments=placement.moments,
                                                              nvme_masters=placement.masters))
    assert placement.host_total(cost.memory_breakdown(graph, bare)) == placed.host_total <= hw.host_memory_bytes
    ring = dataclasses.replace(bare, cast_once=False)
    ring_moments = cost.memory_breakdown(graph, dataclasses.replace(ring, nvme_moments=frozenset({0, 1, 2, 3})))
    hw = spec(host_memory_bytes=ring_moments.host_total - 1, pinned_memory_cap_bytes=ring_moments.host_total - 1,
              nvme_capacity_bytes=10**9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9)
    with pytest.raises(PlanError, match="or set cast_once"):
        place_on_nvme(graph, ring, cost.memory_breakdown(graph, ring), hw)
    once, once_memory, again = place_with_masters(graph, ring, cost.memory_breakdown(graph, ring), hw)
    assert once == dataclasses.replace(ring, cast_once=True) and again.masters
    assert once_memory == cost.memory_breakdown(graph, once, hw)


def test_train_nvme_layers_move_masters_of_a_bf16_plan_and_set_cast_once(tmp_path):
    """``megatrain train --nvme-dir --host-memory``: when every moment on NVMe is not enough, a BF16
    plan's masters follow, with cast_once set (the plan had a shared staging ring)."""
    import megatrain
    from megatrain.planner.nvme import place_in_directory

    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    plan = dataclasses.replace(_planned(copy.deepcopy(model), None, frozenset()), compute_dtype="bfloat16")
    planned = megatrain.plan_model(model, plan=plan, seq_len=16, micro_batch_size=2, micro_batches=2)
    assert not planned.plan.cast_once
    every = frozenset({0, 1, 2, 3})
    short = cost.memory_breakdown(planned.graph, dataclasses.replace(plan, nvme_moments=every)).host_total - 1
    placed = place_in_directory(planned.graph, planned.plan, planned.memory, str(short), str(tmp_path))
    assert placed.moments == every and placed.masters and placed.masters <= every and placed.cast_once
    # ... and that plan runs.
    run = dataclasses.replace(plan, cast_once=True, nvme_moments=placed.moments, nvme_masters=placed.masters)
    trainer = megatrain.materialize(megatrain.plan_model(model, plan=run, seq_len=16, micro_batch_size=2,
                                                         micro_batches=2), nvme_dir=str(tmp_path))
    assert trainer.host.nbytes == sum(4 * planned.graph.layers[i].numel for i in every - placed.masters)
    assert torch.isfinite(torch.tensor(trainer.step(BATCHES[0]).loss))


def test_failed_nvme_write_after_its_opt_names_the_unsaved_layers_and_the_checkpoint(tmp_path, monkeypatch):
    """An NVME_WRITE that fails after its OPT (the disk full, say): the StepError names the layers
    whose masters and moments were updated in their I/O buffers but never saved, says the state
    is inconsistent and to load the last checkpoint; the file indeed still holds the old master."""
    from megatrain.errors import StepError

    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    t = _compile(model, _bf16(copy.deepcopy(model)), tmp_path)
    t.step(BATCHES[0])
    before = t.host.read_master(1)
    store = t.host.nvme
    real = store.write

    def full(key, buf):
        if key == "L1.state":
            raise OSError(28, "No space left on device")
        return real(key, buf)
    monkeypatch.setattr(store, "write", full)
    with pytest.raises(StepError, match=r"OSError: \[Errno 28\] No space left on device\); the optimizer steps of "
                                        r"layers \[3, 2, 1\] ran, and those of layers \[1\] updated masters or Adam "
                                        r"moments .*never written back.*load the last checkpoint") as e:
        t.step(BATCHES[1])
    assert e.value.unsaved_layers == (1,) and e.value.updated_layers == (3, 2, 1)
    monkeypatch.setattr(store, "write", real)
    assert torch.equal(t.host.read_master(1), before) and float(t.host.steps[1]) == 2.0  # the file is behind


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_masters_on_nvme_are_initialised_in_their_file_not_in_anonymous_memory(tmp_path):
    """Until spill_masters a layer's master row is its NVMe file mapped: what the initialisation
    writes is in the file (page cache the kernel may write back and reclaim), not in anonymous
    memory, so a state larger than host memory is never all in it at compile."""
    import torch

    from megatrain.runtime.host import HostState, state_key

    numel = 16 << 20  # 64 MiB of FP32 master
    g = chain_graph(2, numel=numel)
    host = HostState(g, frozenset({1}), str(tmp_path), nvme_masters=frozenset({1}))
    assert host.nvme.is_mapped(state_key(1))
    anon, file = _rss_kib("RssAnon"), _rss_kib("RssFile")
    host.master(1).copy_(torch.arange(numel, dtype=torch.float32))
    # 64 MiB written: file-backed pages, not anonymous ones (bounds of half of it leave room for
    # whatever else the process allocates meanwhile).
    assert _rss_kib("RssFile") - file > (numel * 4 >> 10) // 2
    assert _rss_kib("RssAnon") - anon < (numel * 4 >> 10) // 2
    host.spill_masters()
    assert host.nvme_rows.spilled == {1} and host.blocks[1].numel() == 0
    state = host.nvme_rows.read_state(1)
    assert torch.equal(state[:numel], torch.arange(numel, dtype=torch.float32))
    assert not state[numel:].any()  # fresh moments: zeros
