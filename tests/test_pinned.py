"""Pinned host memory: the runtime page-locks exactly what the cost model says a plan pins.

The CUDA backend runs on CPU through ``FakeCuda``, which counts every byte registered with
``host_register`` (the ``cudaHostRegister`` path) and every ``pinned_empty`` (the caching host
allocator, which the runtime no longer uses for plan buffers). The same logic on a real GPU is
``test_cuda_pinned_bytes_equal_the_plans_figure``.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import megatrain
from megatrain.planner import cost
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.runtime.cuda import CUDABackend
from megatrain.testing import FakeCuda, FakeCudaError
from megatrain.runtime.host import PinnedArena, page_aligned_empty

from conftest import random_batch, requires_cuda, tiny_llama

ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# A vocabulary of 512 at width 32 makes the embedding and the LM head (16384 elements) wider than
# a block (about 10k), so per-layer tile sizes differ from the widest layer's.
SEQ, MBS, VOCAB, HIDDEN = 16, 2, 512, 32
_K, _OFF, _RE = ActivationPolicy.KEEP, ActivationPolicy.OFFLOAD, ActivationPolicy.RECOMPUTE

PLANS = {
    "fp32": Plan(micro_batches=2),
    "bf16": Plan(micro_batches=2, compute_dtype="bfloat16"),
    "fp32-offload": Plan(micro_batches=2, slots=3, prefetch_distance=2, activations=(_OFF, _RE, _OFF, _K)),
    "bf16-offload-clip": Plan(micro_batches=2, slots=3, prefetch_distance=2, activations=(_OFF, _K, _OFF, _K),
                              optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=4, compute_dtype="bfloat16"),
    "fp32-clip": Plan(micro_batches=2, optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=4),
    "bf16-per-micro-batch-offload": Plan(micro_batches=2, layer_by_layer=False, grad_ring=2,
                                         activations=(_OFF, _RE, _K, _K), compute_dtype="bfloat16"),
    "bf16-cast-once": Plan(micro_batches=2, compute_dtype="bfloat16", cast_once=True),
}


def compile_on_fake(plan: Plan, seed: int = 0):
    torch.manual_seed(seed)
    model = tiny_llama(layers=2, vocab=VOCAB, hidden=HIDDEN)
    clip = 1.0 if plan.optimizer is OptimizerPlacement.NEXT_FORWARD else None
    trainer = megatrain.compile(model, seq_len=SEQ, micro_batch_size=MBS, micro_batches=plan.micro_batches,
                                optimizer=ADAMW, plan=plan, max_grad_norm=clip)
    fake = FakeCuda()
    # The executor reads its backend at run time and pins on the first run, so swapping it before
    # the first step pins everything through the fake.
    trainer.backend = trainer.executor.backend = CUDABackend(adapter=fake)
    return trainer, fake


@pytest.mark.parametrize("name", list(PLANS))
def test_pinned_bytes_equal_the_plans_figure(name):
    plan = PLANS[name]
    trainer, fake = compile_on_fake(plan)
    mem = cost.memory_breakdown(trainer.graph, plan)
    assert fake.pinned_bytes == 0, "nothing is pinned before the first step"
    for s in range(2):
        trainer.step(random_batch(MBS * plan.micro_batches, SEQ, VOCAB, seed=s))
        assert fake.pinned_bytes == mem.host_pinned, (name, fake.pinned_bytes, mem)
    assert fake.pinned_calls == [], "no plan buffer goes through the power-of-two caching host allocator"
    # What is pinned is what DMA touches: master rows only with FP32 compute, never the moments.
    assert trainer.host.master_pins.nbytes == mem.pinned_masters == cost.pinned_master_bytes(trainer.graph, plan)
    assert (mem.pinned_masters > 0) == (plan.compute_dtype == "float32")
    # Each registration is a master row (from its block's first byte, whole pages) or the arena.
    arena = trainer.executor._arena
    expected = {arena.memory.data_ptr(): arena.nbytes}
    if plan.compute_dtype == "float32":
        expected.update({b.data_ptr(): cost.page_up(layer.numel * 4)
                         for b, layer in zip(trainer.host.blocks, trainer.graph.layers)})
    assert fake.registered == expected
    # An evaluation reuses the train arena (it needs only staging tiles): nothing more is pinned.
    trainer.evaluate(random_batch(MBS * plan.micro_batches, SEQ, VOCAB, seed=9))
    assert fake.pinned_bytes == mem.host_pinned


def test_clipping_tiles_are_sized_per_layer():
    plan = PLANS["fp32-clip"]
    trainer, _ = compile_on_fake(plan)
    trainer.step(random_batch(MBS * plan.micro_batches, SEQ, VOCAB, seed=0))
    ring = trainer.executor._buffers.ring
    widths = [layer.trainable_numel for layer in trainer.graph.layers if layer.trainable_numel > 0]
    assert [t.numel() for t in ring] == widths == list(cost.gradient_tile_numels(trainer.graph, plan))
    assert len(set(widths)) > 1, "the test model's layers must differ in width for this to test anything"
    # Against one tile of the widest layer per trainable layer, as before.
    assert sum(t.nbytes for t in ring) < len(widths) * max(widths) * 4


def test_pinned_layout_is_exact_page_aligned_and_disjoint():
    trainer, _ = compile_on_fake(PLANS["bf16-offload-clip"])
    g, plan = trainer.graph, PLANS["bf16-offload-clip"]
    layout = cost.pinned_buffers(g, plan)
    page = cost.HOST_PAGE_BYTES
    ends = 0
    for t in layout.tiles:
        assert t.offset % page == 0 and t.offset >= ends, t
        ends = t.offset + t.nbytes
    assert layout.nbytes == sum(cost.page_up(t.nbytes) for t in layout.tiles)
    offloads = [t for t in layout.tiles if t.kind == "offload"]
    # Two offloaded layers, each with its checkpoints (one value each here) for both micro-batches.
    assert {t.key[1] for t in offloads} == {0, 1}
    assert sum(t.nbytes for t in offloads) == plan.micro_batches * sum(
        cost.checkpoint_bytes(g, p) for p in (0, 2))
    # An eval layout is covered by the train layout; an update layout too.
    assert layout.covers(cost.pinned_buffers(g, plan, "eval")) and layout.covers(cost.pinned_buffers(g, plan, "update"))
    assert not cost.pinned_buffers(g, plan, "eval").covers(layout)


def test_fake_cuda_refuses_what_cuda_host_register_would():
    fake = FakeCuda()
    mem = page_aligned_empty(3 * cost.HOST_PAGE_BYTES)
    assert mem.data_ptr() % cost.HOST_PAGE_BYTES == 0
    with pytest.raises(ValueError, match="whole pages"):
        fake.host_register(mem[:100])
    with pytest.raises(ValueError, match="starts on a"):
        fake.host_register(mem[8:8 + cost.HOST_PAGE_BYTES])
    pin = fake.host_register(mem[:2 * cost.HOST_PAGE_BYTES])
    with pytest.raises(FakeCudaError, match="overlaps"):
        fake.host_register(mem[cost.HOST_PAGE_BYTES:])
    assert fake.pinned_bytes == 2 * cost.HOST_PAGE_BYTES
    del pin
    assert fake.pinned_bytes == 0 and fake.pin_log[-1][0] == "unregister"


def test_a_new_layout_releases_the_old_arena():
    """Switching to a plan whose tiles the arena does not hold pins the new arena after unpinning
    the old one: the pinned bytes never exceed what the current plan needs."""
    trainer, fake = compile_on_fake(PLANS["bf16"])
    batch = random_batch(MBS * 2, SEQ, VOCAB, seed=0)
    trainer.step(batch)
    wider = dataclasses.replace(PLANS["bf16"], grad_ring=3, staging_ring=3)
    from megatrain.planner.lower import lower

    trainer.executor.run(lower(trainer.graph, wider), trainer.batches.split(batch, 2))
    assert fake.pinned_bytes == cost.memory_breakdown(trainer.graph, wider).host_pinned


def test_carried_updates_refuse_a_new_arena():
    """The gradients a NEXT_FORWARD step leaves in the tiles would be lost with a new arena."""
    plan = PLANS["fp32-clip"]
    trainer, _ = compile_on_fake(plan)
    trainer.step(random_batch(MBS * 2, SEQ, VOCAB, seed=0))
    from megatrain.planner.lower import lower

    other = dataclasses.replace(plan, grad_ring=5)
    with pytest.raises(RuntimeError, match="carries optimizer steps"):
        trainer.executor.run(lower(trainer.graph, other, mode="update"), [])


def test_offloaded_checkpoint_larger_than_traced_is_an_error():
    arena_plan = PLANS["fp32-offload"]
    trainer, _ = compile_on_fake(arena_plan)
    g = trainer.graph
    layout = cost.pinned_buffers(g, arena_plan)
    # Shrink every offload region below its checkpoint: the executor must refuse, not overrun.
    small = cost.PinnedLayout(tuple(dataclasses.replace(t, nbytes=t.nbytes // 2) if t.kind == "offload" else t
                                    for t in layout.tiles), layout.nbytes)
    trainer.executor._ensure_buffers(trainer.schedule)
    trainer.executor._arena = PinnedArena(small, trainer.backend)
    trainer.executor._arena.layout = layout  # pretend it covers the plan, so it is kept
    with pytest.raises(megatrain.StepError, match="trace gave it") as info:
        trainer.step(random_batch(MBS * 2, SEQ, VOCAB, seed=0))
    assert isinstance(info.value.__cause__, RuntimeError)


@requires_cuda
def test_cuda_pinned_bytes_equal_the_plans_figure():  # CPU twin: test_pinned_bytes_equal_the_plans_figure
    plan = PLANS["bf16-offload-clip"]
    torch.manual_seed(0)
    model = tiny_llama(layers=2, vocab=VOCAB, hidden=HIDDEN)
    trainer = megatrain.compile(copy.deepcopy(model), seq_len=SEQ, micro_batch_size=MBS, micro_batches=2,
                                optimizer=ADAMW, plan=plan, max_grad_norm=1.0, device="cuda")
    trainer.step(random_batch(MBS * 2, SEQ, VOCAB, seed=0))
    ex = trainer.executor
    assert ex._arena.memory.is_pinned() and ex._arena.nbytes == cost.memory_breakdown(trainer.graph, plan).host_pinned
    assert all(t.is_pinned() for t in ex._buffers.ring + ex._buffers.staging)
    assert not any(b.is_pinned() for b in trainer.host.blocks), "BF16 compute pins no master row"


# -- per-layer sizes in the cost model and the verifier ------------------------------------------------

def test_slots_are_sized_per_layer_and_residents_cost_their_own_size():
    from graphs import chain_graph

    # A wide first and last layer (embedding, LM head) around narrow blocks.
    g = chain_graph(5, numel=[8192, 1024, 1024, 1024, 8192], trainable=[True, True, False, True, True])
    plan = Plan(slots=2, prefetch_distance=1, resident=frozenset({0, 4}))
    assert cost.slot_numels(g, plan.slots, plan.resident) == ((1024, 1024),) * 2 + ((8192, 8192),) * 2
    m = cost.memory_breakdown(g, plan)
    assert m.weight_slots == (2 * 1024 + 2 * 8192) * 4 and m.gradient_slots == (2 * 1024 + 2 * 8192) * 4
    # Without residents every streaming slot must hold the widest layer.
    assert cost.memory_breakdown(g, Plan(slots=2)).weight_slots == 2 * 8192 * 4


def test_verifier_catches_a_layer_in_a_slot_too_small_for_it():
    from graphs import chain_graph
    from megatrain.errors import ScheduleError
    from megatrain.planner.lower import lower
    from megatrain.ir.schedule import OpKind
    from megatrain.planner.verify import verify

    g = chain_graph(5, numel=[8192, 1024, 1024, 1024, 8192])
    plan = Plan(slots=2, prefetch_distance=1, resident=frozenset({0, 4}))
    s = lower(g, plan)
    verify(s, g)
    ops = list(s.ops)
    i = next(k for k, op in enumerate(ops) if op.kind is OpKind.H2D and op.layer == 4)
    ops[i] = dataclasses.replace(ops[i], slot=0)  # the LM head into a block-sized streaming slot
    with pytest.raises(ScheduleError, match=r"rule 'budget'.*layer 4 .*does not fit slot 0"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)


def test_verifier_catches_gradients_in_a_tile_too_small_for_them():
    from graphs import chain_graph
    from megatrain.errors import ScheduleError
    from megatrain.planner.lower import lower
    from megatrain.ir.schedule import OpKind
    from megatrain.planner.verify import verify

    g = chain_graph(4, numel=[4096, 1024, 1024, 4096])
    plan = Plan(optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=4)
    assert cost.gradient_tile_numels(g, plan) == (4096, 1024, 1024, 4096)
    s = lower(g, plan)
    verify(s, g)
    ops = list(s.ops)
    i = next(k for k, op in enumerate(ops) if op.kind is OpKind.D2H and op.layer == 3)
    ops[i] = dataclasses.replace(ops[i], ring=1)  # layer 3's gradients into layer 1's narrow tile
    with pytest.raises(ScheduleError, match=r"rule 'budget'.*do not fit host tile r1"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)


# -- cast once per step ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layer_by_layer", [True, False], ids=["layer-by-layer", "per-micro-batch"])
def test_cast_once_trains_bitwise_like_a_cast_per_copy(layer_by_layer):
    """The BF16 copy a reused tile holds is the cast of the same master, so the run is bitwise the
    same as casting before every copy; each layer is cast once per step."""
    from megatrain.ir.schedule import OpKind

    base = Plan(micro_batches=2, compute_dtype="bfloat16", layer_by_layer=layer_by_layer)
    ref, _ = compile_on_fake(base)
    got, fake = compile_on_fake(dataclasses.replace(base, cast_once=True))
    casts = [op for op in got.schedule.ops if op.kind is OpKind.CAST]
    assert sorted(op.layer for op in casts) == list(range(len(got.graph.layers)))
    assert sum(op.kind is OpKind.CAST for op in ref.schedule.ops) > len(casts)
    for s in range(3):
        batch = random_batch(MBS * 2, SEQ, VOCAB, seed=s)
        assert got.step(batch).micro_batch_losses == ref.step(batch).micro_batch_losses
    for x, y in zip(ref.host.blocks, got.host.blocks):
        assert torch.equal(x, y)
    # Each layer's staging tile is sized to it: 2 bytes per element pinned, in whole pages.
    staging = [t.numel() for t in got.executor._buffers.staging]
    assert staging == [layer.numel for layer in got.graph.layers]
    assert fake.pinned_bytes == cost.memory_breakdown(got.graph, got.plan).host_pinned


def test_verifier_catches_a_copy_of_a_cast_older_than_the_last_update():
    from graphs import chain_graph
    from megatrain.errors import ScheduleError
    from megatrain.planner.lower import lower
    from megatrain.ir.schedule import Op, OpKind
    from megatrain.planner.verify import verify

    g = chain_graph(4)
    s = lower(g, Plan(compute_dtype="bfloat16", cast_once=True))
    verify(s, g)
    ops = list(s.ops)
    cast = next(i for i, op in enumerate(ops) if op.kind is OpKind.CAST and op.layer == 1)
    opt = next(i for i, op in enumerate(ops) if op.kind is OpKind.OPT and op.layer == 1)
    # A copy of layer 1 after its update, from the cast made before it: stale weights.
    ops.append(Op(OpKind.H2D, 1, slot=0, tile=ops[cast].tile, deps=(cast, opt, len(ops) - 1)))  # after everything else
    with pytest.raises(ScheduleError, match=r"rule 'staging'.*may update the master in between"):
        verify(dataclasses.replace(s, ops=tuple(ops)), g)


def test_the_solver_casts_once_only_where_that_is_faster_and_fits():
    """A slow host makes the host stream (casts and optimizer steps) the bottleneck: a tile per
    layer removes a cast per reloaded layer, so the solver takes it where pinned memory holds it."""
    from graphs import chain_graph, spec
    from megatrain.planner.solve import SolveRequest, minimum_requirements, solve
    from test_solve import check_solution

    g = chain_graph(6, numel=1 << 16, fwd_flops=10**7)
    slow_host = spec(host_optimizer_params_per_s=1e6)
    req = SolveRequest(g, slow_host, 2, "bfloat16")
    # A GPU with room for about one slot beyond the least any plan needs: layers are copied again
    # in the backward, and each copy would need a cast.
    gpu = minimum_requirements(req).gpu_memory_bytes + 3 * (1 << 17)
    slow_host = slow_host.model_copy(update={"gpu_memory_bytes": gpu})
    req = dataclasses.replace(req, hardware=slow_host)
    sol = solve(req)
    check_solution(sol, req)
    kinds = [op.kind.value for op in sol.schedule.ops]
    assert sol.plan.cast_once and kinds.count("CAST") == len(g.layers) < kinds.count("H2D")
    assert sol.memory.staging_ring == sum(cost.page_up(layer.numel * 2) for layer in g.layers)
    # Pinned memory short of a tile per layer beside the smallest gradient ring: a cast per copy again.
    least = cost.memory_breakdown(g, Plan(compute_dtype="bfloat16", cast_once=True, grad_ring=1)).host_pinned
    tight = dataclasses.replace(req, hardware=slow_host.model_copy(update={"pinned_memory_cap_bytes": least - 1}))
    assert not solve(tight).plan.cast_once


def test_torch_cuda_registers_exactly_the_bytes_and_unregisters_on_drop(monkeypatch):
    """``TorchCuda.host_register``'s calls, against a stand-in for ``torch.cuda.cudart()`` (the CPU
    twin of the GPU test above): one cudaHostRegister of the tensor's address and bytes, flags 0,
    and one cudaHostUnregister of that address when the handle goes; a failure names the size."""
    import enum
    import gc

    from megatrain.runtime.cuda import TorchCuda

    class Err(enum.Enum):
        success = 0
        cudaErrorHostMemoryAlreadyRegistered = 712

    class Cudart:
        cudaError = Err

        def __init__(self):
            self.calls, self.fail = [], False

        def cudaHostRegister(self, ptr, size, flags):
            self.calls.append(("register", ptr, size, flags))
            return Err.cudaErrorHostMemoryAlreadyRegistered if self.fail else Err.success

        def cudaHostUnregister(self, ptr):
            self.calls.append(("unregister", ptr))
            return Err.success

        def cudaGetErrorString(self, err):
            return err.name

    rt = Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    mem = page_aligned_empty(2 * cost.HOST_PAGE_BYTES)
    pin = TorchCuda().host_register(mem)
    assert rt.calls == [("register", mem.data_ptr(), 2 * cost.HOST_PAGE_BYTES, 0)]
    del pin
    gc.collect()
    assert rt.calls[-1] == ("unregister", mem.data_ptr())
    rt.fail = True
    with pytest.raises(RuntimeError, match=rf"cudaHostRegister of {2 * cost.HOST_PAGE_BYTES} bytes.*AlreadyRegistered"):
        TorchCuda().host_register(mem)
