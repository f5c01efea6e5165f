"""Data parallel on torch.distributed: ALL_REDUCE ops in the schedule, verified, and training with
2 and 4 gloo processes that equals one process training the global batch (FP32, 1e-5)."""

from __future__ import annotations

import copy
import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megatrain
from megatrain.errors import ScheduleError
from megatrain.planner.lower import lower
from megatrain.planner.plan import OptimizerPlacement, Plan
from megatrain.planner.schedule import OpKind, Schedule
from megatrain.planner.trace import trace
from megatrain.planner.verify import verify

from conftest import random_batch, tiny_llama
from test_exactness import ADAMW, RTOL, eager_losses

S, MBS, VOCAB = 16, 2, 96
# As in test_inputs: AdamW's eps bounds how far rounding noise in a near-zero gradient moves an
# update (lr * |dG| / eps); the ranks' sum of gradients rounds differently from one process's.
OPT = {**ADAMW, "eps": 1e-6}

PLANS = {
    "during-backward": Plan(micro_batches=2),
    "host-accumulation": Plan(micro_batches=2, layer_by_layer=False),
    "clipped-deferred": Plan(micro_batches=2, optimizer=OptimizerPlacement.NEXT_FORWARD, grad_ring=4),
}


@pytest.fixture(scope="module")
def graph():
    return trace(tiny_llama(), micro_batch_size=MBS, seq_len=S, input_names=("input_ids", "labels")).graph


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_layer_is_reduced_once_before_its_step_and_in_one_chain(graph, name):
    plan = dataclasses.replace(PLANS[name], data_parallel=2)
    carries = plan.optimizer is OptimizerPlacement.NEXT_FORWARD
    s = lower(graph, plan, "train", carries_updates=carries)
    verify(s, graph)
    reduces = [i for i, op in enumerate(s.ops) if op.kind is OpKind.ALL_REDUCE]
    assert sorted(s.ops[i].layer for i in reduces) == [i for i, l in enumerate(graph.layers) if l.trainable_numel]
    assert all(reduces[k - 1] in s.ops[reduces[k]].deps for k in range(1, len(reduces)))
    assert all(op.stream.value == "comm" for op in s.ops if op.kind is OpKind.ALL_REDUCE)
    # one rank: no collectives, as before
    assert not any(op.kind is OpKind.ALL_REDUCE for op in lower(graph, PLANS[name], "train").ops)
    assert not any(op.kind is OpKind.ALL_REDUCE for op in lower(graph, plan, "eval").ops)


def _mutated(s: Schedule, fn) -> Schedule:
    return dataclasses.replace(s, ops=tuple(fn(list(s.ops))))


def test_the_verifier_rejects_collectives_out_of_order_or_missing(graph):
    # (Rule 'collectives' also checks that the ALL_REDUCEs form one chain; in lowered schedules
    # their D2Hs already order them, so no one-dependency mutation of them breaks that part.)
    plan = dataclasses.replace(PLANS["during-backward"], data_parallel=2)
    s = lower(graph, plan, "train")
    reduces = [i for i, op in enumerate(s.ops) if op.kind is OpKind.ALL_REDUCE]

    def wrong_tile(ops):  # reduces a gradient tile its layer's D2H did not write
        r = ops[reduces[0]]
        ops[reduces[0]] = dataclasses.replace(r, ring=1 - r.ring)
        return ops

    with pytest.raises(ScheduleError, match="rule 'collectives'.*must reduce what #"):
        verify(_mutated(s, wrong_tile), graph)

    def early_step(ops):  # the OPT after the first ALL_REDUCE stops waiting for it
        o = next(i for i in range(reduces[0], len(ops)) if ops[i].kind is OpKind.OPT)
        ops[o] = dataclasses.replace(ops[o], deps=tuple(d for d in ops[o].deps if d != reduces[0]))
        return ops

    with pytest.raises(ScheduleError, match="rule 'collectives'.*before its gradients were reduced"):
        verify(_mutated(s, early_step), graph)
    with pytest.raises(ScheduleError, match="rule 'collectives'.*nothing is reduced across ranks"):
        verify(dataclasses.replace(s, plan=PLANS["during-backward"]), graph)


def _global_batches(world: int, k: int, steps: int) -> list[dict[str, torch.Tensor]]:
    return [random_batch(world * k * MBS, S, VOCAB, seed=s % 3) for s in range(steps)]


def _rank_main(rank: int, world: int, init_file: str, out: str, k: int, clip: float | None, steps: int,
               layer_by_layer: bool) -> None:
    """One rank: its slice of each global batch (micro-batches rank*k .. rank*k+k-1)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = tiny_llama()
        plan = dataclasses.replace(megatrain.planner.plan.Plan(micro_batches=k, layer_by_layer=layer_by_layer),
                                   optimizer=OptimizerPlacement.NEXT_FORWARD if clip else
                                   OptimizerPlacement.DURING_BACKWARD, grad_ring=8 if clip else 2)
        trainer = megatrain.compile(model, seq_len=S, micro_batch_size=MBS, micro_batches=k, optimizer=OPT,
                                    max_grad_norm=clip, plan=plan)
        assert trainer.plan.data_parallel == world
        rows = k * MBS
        results = []
        for b in _global_batches(world, k, steps):
            res = trainer.step({n: t[rank * rows:(rank + 1) * rows] for n, t in b.items()})
            results.append((res.loss, res.micro_batch_losses, res.tokens, res.grad_norm))
        trainer.flush()
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save({"results": results, "state": state}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,k,clip,layer_by_layer", [
    (2, 1, None, True),
    (2, 2, 1.0, True),
    (2, 2, None, False),
    (4, 1, 0.5, True),
], ids=["2-ranks", "2-ranks-clipped-2-microbatches", "2-ranks-host-accumulation", "4-ranks-clipped"])
def test_ranks_train_the_global_batch_as_one_process_does(tmp_path, world, k, clip, layer_by_layer):
    steps = 4
    out = str(tmp_path / "rank")
    mp.spawn(_rank_main, args=(world, str(tmp_path / "init"), out, k, clip, steps, layer_by_layer), nprocs=world,
             join=True)
    torch.manual_seed(0)
    ref = tiny_llama()
    batches = _global_batches(world, k, steps)
    want = eager_losses(copy.deepcopy(ref), batches, world * k, clip, adamw=OPT)
    ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    for r in ranks:  # every rank reports the global step and holds the same weights
        assert r["results"] == ranks[0]["results"]
        assert all(torch.equal(r["state"][n], ranks[0]["state"][n]) for n in r["state"])
    for step, ((loss, per_mb, tokens, _), w) in enumerate(zip(ranks[0]["results"], want)):
        assert abs(loss - w) <= RTOL * abs(w), f"step {step}: {world} ranks {loss} vs one process {w}"
        assert len(per_mb) == world * k and tokens == world * k * MBS * S
    eager_losses(ref, batches, world * k, clip, adamw=OPT)  # the same training again, for the weights
    for name, p in ref.named_parameters():
        q = ranks[0]["state"][name]
        err = ((q - p.detach()).norm() / p.detach().norm()).item()
        assert err <= RTOL, f"{name}: relative difference {err:.2e}"


def test_a_checkpoint_written_by_ranks_loads_into_one_process(tmp_path):
    """Rank 0 writes the checkpoint (the others wait); one process loads it: the same weights."""
    out = str(tmp_path / "rank")
    mp.spawn(_save_main, args=(2, str(tmp_path / "init"), out, str(tmp_path / "ckpt")), nprocs=2, join=True)
    torch.manual_seed(1)
    model = tiny_llama()
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=MBS, optimizer=OPT)
    trainer.load(tmp_path / "ckpt")
    saved = torch.load(f"{out}.0")
    assert all(torch.equal(p.detach(), saved[n]) for n, p in model.named_parameters())
    assert trainer.step_count == 2


def _save_main(rank: int, world: int, init_file: str, out: str, ckpt: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = tiny_llama()
        trainer = megatrain.compile(model, seq_len=S, micro_batch_size=MBS, optimizer=OPT)
        for b in _global_batches(world, 1, 2):
            trainer.step({n: t[rank * MBS:(rank + 1) * MBS] for n, t in b.items()})
        trainer.save(ckpt)
        if rank == 0:
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{out}.0")
    finally:
        dist.destroy_process_group()


def test_megatrain_train_under_torchrun_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """Not yet data parallel: each rank would read the same batches and write one output_dir."""
    from megatrain.errors import ConfigError
    from megatrain.train import TrainConfig
    from megatrain.train.loop import train

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="one of 2 processes.*README: Data parallel"):
        train(TrainConfig(model=str(tmp_path / "config.json"), output_dir=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_readme_data_parallel_snippet_runs(tmp_path, monkeypatch):
    """The README's example, as one rank of a one-process group (the multi-rank runs are above)."""
    from conftest import readme_snippet

    monkeypatch.chdir(tmp_path)  # it saves dp_checkpoint/ in the working directory
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        exec(compile(readme_snippet("## Data parallel (torch.distributed)"), "README.md", "exec"), {})
    finally:
        dist.destroy_process_group()


def test_all_reduce_time_is_a_ring_all_reduce(graph):
    from megatrain.errors import ConfigError
    from megatrain.planner import cost
    from megatrain.planner.hardware import preset

    layer = next(lay for lay in graph.layers if lay.trainable_numel)
    hw = preset("H100_SXM").model_copy(update={"allreduce_bytes_per_s": 1e9, "op_latency_s": 1e-5})
    # each rank sends and receives 2 (N - 1) / N of the FP32 gradients (4 bytes per parameter)
    want = 2 * 3 / 4 * layer.trainable_numel * 4 / 1e9 + 1e-5
    assert cost.all_reduce_time(layer, hw, Plan(data_parallel=4)) == pytest.approx(want, rel=1e-12)
    assert cost.all_reduce_time(layer, hw, Plan()) == 0.0
    with pytest.raises(ConfigError, match="allreduce_bytes_per_s=0"):
        cost.all_reduce_time(layer, preset("H100_SXM"), Plan(data_parallel=2))
