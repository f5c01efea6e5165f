"""Issue fences (``Schedule.issue_after``): how far the issuing thread may run ahead of the device
before the CUDA caching allocator holds more than the cost model plans.

The allocator hands memory out when an op is issued and takes back a block read on another stream
only once that stream has passed the free; :func:`megatrain.planner.cost.issue_fences` makes each op
that would reuse such a block wait for the op that frees it. Checked here on the asynchronous fake
CUDA layer whose ops run at issue time, with a model of the allocator
(:mod:`megatrain.testing.allocator`), against the cost model's activation peak.
"""

from __future__ import annotations

import dataclasses

import torch

import megatrain
from megatrain.planner import cost
from megatrain.ir.hardware import preset
from megatrain.planner.lower import lower
from megatrain.ir.plan import ActivationPolicy, Plan
from megatrain.ir.schedule import Schedule, Stream
from megatrain.planner.simulate import simulate
from megatrain.runtime.cuda import CUDABackend
from megatrain.testing import IssueTimeFakeCuda

from conftest import random_batch, tiny_llama
from graphs import chain_graph

LAYERS, SEQ, MBS, M, VOCAB = 4, 16, 2, 2, 96
OFFLOAD_ALL = Plan(micro_batches=M, activations=(ActivationPolicy.OFFLOAD,) * (LAYERS + 1) + (ActivationPolicy.KEEP,))


def device_time(label: str) -> float:
    """The fake device's seconds per op (it starts only once something waits for it, so without
    fences the issuing thread gets through the whole forward first: IssueTimeFakeCuda)."""
    return 0.004 if label.split(":")[0] in ("FWD", "BWD", "RECOMPUTE") else 0.001


def compiled(plan: Plan):
    torch.manual_seed(0)
    return megatrain.compile(tiny_llama(layers=LAYERS), seq_len=SEQ, micro_batch_size=MBS, micro_batches=M,
                             plan=plan)


def test_fences_keep_the_caching_allocator_within_the_planned_activation_peak():
    """Every checkpoint offloaded: without fences the issuing thread frees checkpoints long before
    the stream that reads them has (an OFFLOAD in the forward, a local backward reading a reload),
    so a pool holds more than the cost model plans for it; with the schedule's fences neither pool
    (compute, and H2D for the reloads) does, and the values are the CPU backend's."""
    trainer = compiled(OFFLOAD_ALL)
    schedule = trainer.schedule
    assert schedule.issue_after, "an offload plan needs fences"
    planned = cost.pool_peaks(schedule, cost.activation_liveness(schedule, trainer.graph), working=False)
    batch = random_batch(MBS * M, SEQ, VOCAB, seed=1)
    mbs = [{k: v[i * MBS:(i + 1) * MBS] for k, v in batch.items()} for i in range(M)]
    state = [t.clone() for t in (*trainer.host.blocks, *trainer.host.steps)]
    want = trainer.executor.run(schedule, mbs).losses  # on the CPU backend it was compiled with
    for t, saved in zip((*trainer.host.blocks, *trainer.host.steps), state):
        t.copy_(saved)
    held = {}
    for fenced in (True, False):  # the second run starts from the first one's update: no matter here
        fake = IssueTimeFakeCuda(delay=device_time)
        trainer.executor.backend = backend = CUDABackend(adapter=fake)
        try:
            got = trainer.executor.run(schedule if fenced else dataclasses.replace(schedule, issue_after=()), mbs)
            held[fenced] = {s: fake.memory.peak_held.get(backend.stream(s), 0) for s in (Stream.COMPUTE, Stream.H2D)}
        finally:
            backend.close()
            fake.close()
        if fenced:
            assert got.losses == want, "the fenced run computes what the CPU backend does"
    assert all(held[True][s] <= planned[s] for s in planned), (held, planned)
    assert any(held[False][s] > planned[s] for s in planned), (held, planned)


def test_each_fence_is_the_op_that_frees_what_the_fenced_op_reuses():
    """Five chained layers, the first four offloaded. In the cost model L0's checkpoint is gone once
    its last forward reader (L1) is done and the next visit waits for its OFFLOAD, so L2's forward
    reuses its memory: it is fenced on OFFLOAD:L0 (and L3's on OFFLOAD:L1; the last layer's local
    backward, the first op after the forward, on OFFLOAD:L3). In the backward a RELOAD reuses the
    memory of the reload two before it, which the local backward that read it frees: RELOAD:L1
    waits for BWD:L4, RELOAD:L0 for BWD:L3. Nothing else is fenced, and a plan that keeps its
    checkpoints on the GPU has no fences."""
    g = chain_graph(5)
    s = lower(g, Plan(activations=(ActivationPolicy.OFFLOAD,) * 4 + (ActivationPolicy.KEEP,)))
    fences = {repr(s.ops[i]): [repr(s.ops[f]) for f in s.fences(i)] for i in range(len(s.ops)) if s.fences(i)}
    assert fences == {"FWD:L2:m0:s0": ["OFFLOAD:L0:m0:c0"], "FWD:L3:m0:s1": ["OFFLOAD:L1:m0:c0"],
                      "BWD:L4:m0:s0": ["OFFLOAD:L3:m0:c0"], "RELOAD:L1:m0:c0": ["BWD:L4:m0:s0"],
                      "RELOAD:L0:m0:c0": ["BWD:L3:m0:s1"]}
    assert lower(g, Plan()).issue_after == ()
    assert Schedule.from_json(s.to_json()).issue_after == s.issue_after


def test_the_simulator_starts_a_fenced_op_after_its_fences_end():
    """The simulator's issuing thread waits for fences as the backend does: no fenced op starts
    before every op it is fenced on has ended (on a spec whose slow compute lets issue run ahead)."""
    g = chain_graph(6, numel=1 << 20)
    s = lower(g, Plan(micro_batches=2, activations=(ActivationPolicy.OFFLOAD,) * 5 + (ActivationPolicy.KEEP,)))
    hw = preset("H100_SXM").model_copy(update={"bf16_flops": 1e9, "fp32_flops": 1e9})
    records = simulate(s, g, hw).records
    pairs = [(i, f) for i in range(len(s.ops)) for f in s.fences(i)]
    assert pairs and all(records[i].start_s >= records[f].end_s for i, f in pairs)
