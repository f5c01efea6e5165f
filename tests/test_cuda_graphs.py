"""CUDA graphs of the compute ops (``Plan.cuda_graphs``, megatrain.runtime.graphs), on the CPU: the
CUDA backend over FakeCuda, whose captures record aten ops and whose replays re-dispatch them on
the same tensors (megatrain.testing.FakeGraph). Checked here: the fake itself (a replay reads the
static buffers as they are then, a capture refuses a forgotten copy-in and a host read), training
through captured graphs equals eager (dropout included: the replay draws the forward's masks), what
is captured and when, the memory model's count of the graphs, and the planner's issue-bound switch.
What only a GPU can check is listed in docs/architecture.md, "Compiled templates and CUDA graphs"."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import megatrain
from megatrain.errors import ConfigError, StepError
from megatrain.ir.hardware import preset, strict_fp32
from megatrain.ir.plan import Plan
from megatrain.planner import cost
from megatrain.planner.graphs import ISSUE_BOUND_RATIO, compute_issue, issue_bound
from megatrain.planner.lower import lower
from megatrain.runtime.cuda import CUDABackend
from megatrain.testing import FakeCuda, FakeCudaError, FakeGraph

from conftest import random_batch, requires_cuda, tiny_llama
from graphs import chain_graph
from test_dropout import TRAIN_SEED, rng_state, tiny_gpt2
from test_exactness import ADAMW, RTOL, eager_losses


# -- the fake capture layer ------------------------------------------------------------------------

def test_a_replay_reads_the_static_buffers_as_they_are_then_and_keeps_captured_scalars():
    static_x, weight = torch.ones(4), torch.full((4,), 2.0)
    scale = 3.0  # a host float: a capture freezes it, as a GPU capture does
    graph, out = FakeGraph.capture(lambda: static_x * weight + scale, [static_x, weight], FakeCudaError)
    assert torch.equal(out, torch.full((4,), 5.0))
    static_x.copy_(torch.arange(4.0))  # the copy-in before a replay
    scale = 100.0
    graph.replay()
    assert torch.equal(out, torch.arange(4.0) * 2 + 3), "the replay wrote the captured output in place"


def test_a_capture_that_reads_a_tensor_it_was_not_given_as_static_is_a_forgotten_copy_in():
    static_x, activation = torch.ones(4), torch.randn(4)
    with pytest.raises(FakeCudaError, match=r"reads a \(4,\) torch.float32 tensor .* not one of its static "
                                            r"buffers.*forgotten copy-in"):
        FakeGraph.capture(lambda: static_x + activation, [static_x], FakeCudaError)
    with pytest.raises(FakeCudaError, match=r"device value on the host"):
        FakeGraph.capture(lambda: static_x * float(static_x.sum()), [static_x], FakeCudaError)


def test_a_captured_backward_is_replayed_with_new_inputs():
    """autograd.grad inside the capture is recorded as its aten ops and replays exactly."""
    w, x = torch.randn(3, 3), torch.randn(2, 3)

    def body():
        leaf = w.detach().requires_grad_(True)
        with torch.enable_grad():
            (g,) = torch.autograd.grad((x @ leaf).tanh().sum(), [leaf])
        return g

    graph, out = FakeGraph.capture(body, [w, x], FakeCudaError)
    x.copy_(torch.randn(2, 3))
    graph.replay()
    assert torch.allclose(out, body(), rtol=0, atol=1e-6)


# -- training through captured graphs --------------------------------------------------------------

def _graphed_trainer(model, plan: Plan, fake: FakeCuda | None = None):
    planned = megatrain.plan_model(model, seq_len=16, micro_batch_size=2, micro_batches=plan.micro_batches, plan=plan)
    return megatrain.materialize(planned, ADAMW, backend=CUDABackend(fake or FakeCuda()))


@pytest.mark.parametrize("plan", [Plan(cuda_graphs=True, micro_batches=2),
                                  Plan(cuda_graphs=True, micro_batches=2, layer_by_layer=False)],
                         ids=["layer_by_layer", "per_micro_batch"])
def test_training_through_captured_graphs_equals_eager(plan, capsys):
    """The first step runs eagerly and notes each (template, slot, variant); the graphs are captured
    after it, between runs (said on stderr); every compute op of the later steps is a replay; the
    losses, gradient norms and weights are eager training's within 1e-5. Layer by layer, a visit's
    second micro-batch adds into the gradient slot: a variant of its own."""
    torch.manual_seed(0)
    model = tiny_llama(layers=3)
    ref = copy.deepcopy(model)
    batches = [random_batch(4, 16, 96, seed=s % 3) for s in range(4)]
    fake = FakeCuda()
    trainer = _graphed_trainer(model, plan, fake)
    got = [trainer.step(b) for b in batches]
    graphs = trainer.executor.graphs
    compute = sum(op.kind.value in ("FWD", "RECOMPUTE", "BWD") for op in trainer.schedule.ops)
    assert graphs.replays == compute * (len(batches) - 1)
    captures = [i for i, e in enumerate(fake.log) if e[0] == "capture"]
    syncs = [i for i, e in enumerate(fake.log) if e[0] == "sync"]
    assert len(captures) == len(graphs.captured) and syncs[0] < captures[0] < syncs[1], \
        "captured between the first and the second run"
    bwd_variants = {k[4] for k in graphs.captured if k[0] == "bwd"}
    assert bwd_variants == ({True, False} if plan.layer_by_layer else {True})
    assert "captured" in capsys.readouterr().err
    norms: list[float] = []
    want = eager_losses(ref, batches, plan.micro_batches, grad_norms=norms)
    for step, (r, w, n) in enumerate(zip(got, want, norms)):
        assert abs(r.loss - w) <= RTOL * abs(w), f"step {step}: {r.loss} vs eager {w}"
        assert abs(r.grad_norm - n) <= RTOL * n, f"step {step}: gradient norm {r.grad_norm} vs eager {n}"
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert ((p - q).norm() / q.norm()).item() <= RTOL, name


def test_captured_dropout_replays_the_forwards_masks():
    """GPT-2 with dropout everywhere, one micro-batch: through replays the losses equal eager training
    seeded alike and the generator ends where eager's does (each forward replay draws from the
    generator, each recompute's replay from the forward's recorded state)."""
    torch.manual_seed(0)
    model = tiny_gpt2(layers=2)
    ref = copy.deepcopy(model)
    batches = [random_batch(2, 16, 96, seed=s % 3) for s in range(4)]
    trainer = _graphed_trainer(model, Plan(cuda_graphs=True))
    torch.manual_seed(TRAIN_SEED)
    got = [trainer.step(b).loss for b in batches]
    state = rng_state("cpu")
    torch.manual_seed(TRAIN_SEED)
    want = eager_losses(ref, batches, 1, precision=strict_fp32)
    assert trainer.executor.graphs.replays > 0
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: {a} vs eager {b}"
    assert torch.equal(state, rng_state("cpu"))


def test_a_capture_missing_a_static_buffer_is_an_error_naming_the_op(monkeypatch):
    """The runner's bug the fake exists to catch: a capture reading a slot it did not name static
    (as if its weights were copied elsewhere each time) fails at capture, before the second step's
    first op, naming the compute op; the step leaves nothing of its batch behind."""
    from megatrain.runtime import graphs

    run = graphs.TemplateGraphs.run

    def forgetful(self, key, body, ins, seeds=(), loss_seed=None, static=(), what=""):
        return run(self, key, body, ins, seeds, loss_seed, (), what)

    monkeypatch.setattr(graphs.TemplateGraphs, "run", forgetful)
    torch.manual_seed(0)
    trainer = _graphed_trainer(tiny_llama(layers=2), Plan(cuda_graphs=True))
    trainer.step(random_batch(2, 16, 96, seed=0))  # eager: the graphs are captured before the next run
    with pytest.raises(StepError, match=r"FWD:L0:m0:s\d \(layer 'prologue'\): its work cannot be captured.*"
                                        r"forgotten copy-in.*cuda_graphs=False.*nothing of this batch was applied"):
        trainer.step(random_batch(2, 16, 96, seed=1))


def test_cuda_graphs_need_a_backend_that_captures():
    model = tiny_llama(layers=1)
    with pytest.raises(ConfigError, match="cuda_graphs=True on device='cpu'"):
        megatrain.plan_model(model, seq_len=16, micro_batch_size=2, cuda_graphs=True)
    planned = megatrain.plan_model(model, seq_len=16, micro_batch_size=2, plan=Plan(cuda_graphs=True))
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ConfigError, match="CPUBackend cannot run.*device='cuda'"):
        megatrain.materialize(planned, ADAMW)
    assert [p.data_ptr() for p in model.parameters()] == before, "nothing bound to the model"


# -- the memory model and the planner's switch -----------------------------------------------------

def test_the_memory_model_counts_one_graph_per_captured_variant_and_the_pool():
    """graph_pool_bytes counts the graphs the executor captures (tiny Llama on FakeCuda: one per
    template, slot and kind), the largest op's working memory once, each graph's outputs and the
    shared static buffers; without graphs it is 0 and the peak is unchanged."""
    torch.manual_seed(0)
    trainer = _graphed_trainer(tiny_llama(layers=3), Plan(cuda_graphs=True))
    for seed in (0, 1):  # the graphs are captured before the second step
        trainer.step(random_batch(2, 16, 96, seed=seed))
    g, sched = trainer.graph, trainer.schedule
    off = lower(g, dataclasses.replace(sched.plan, cuda_graphs=False))
    assert cost.graph_pool_bytes(g, off) == 0
    pool = cost.graph_pool_bytes(g, sched)
    work = max(layer.work_bytes for layer in g.layers)
    widest = max(sum(g.values[v].nbytes for v in (*layer.inputs, *layer.outputs)) for layer in g.layers)
    assert work < pool <= work + widest * (1 + len(trainer.executor.graphs.captured))
    on, plain = cost.memory_breakdown(g, sched.plan, schedule=sched), cost.memory_breakdown(g, off.plan, schedule=off)
    assert on.graph_pool == pool and plain.graph_pool == 0
    assert on.gpu_peak == plain.gpu_fixed + max(plain.dynamic_peak, plain.activations_peak + pool)


def test_the_step_is_issue_bound_where_launches_outweigh_the_kernels():
    """issue_bound compares the compute ops' launch time with their GPU time: 500 launches of 10 us
    against 1 ms of FLOPs is issue-bound, against 100 ms it is not; no launch cost, no verdict."""
    def graph(flops: int):
        g = chain_graph(4, fwd_flops=flops)
        return dataclasses.replace(g, layers=tuple(dataclasses.replace(la, fwd_launches=200, bwd_launches=500)
                                                   for la in g.layers))

    hw = preset("H100_SXM").model_copy(update={"launch_overhead_s": 10e-6})
    rate = hw.peak_flops("float32") * hw.matmul_efficiency
    small, large = graph(int(rate * 1e-4)), graph(int(rate * 1e-2))
    sched = lower(small, Plan())
    issue, gpu = compute_issue(sched, small, hw)
    assert issue / gpu >= ISSUE_BOUND_RATIO
    on, why = issue_bound(sched, small, hw)
    assert on and why.startswith("issue-bound")
    assert not issue_bound(lower(large, Plan()), large, hw)[0]
    assert issue_bound(sched, small, None) == (False, "no GPU spec with a launch cost to judge the issue rate by")


def test_auto_turns_graphs_on_where_the_planner_finds_the_step_issue_bound(monkeypatch):
    """cuda_graphs='auto' on a CUDA request: the front door asks issue_bound and says its verdict
    among the plan's decisions; the plan, its schedules and its memory (the pool) follow it."""
    from megatrain.planner import front, graphs

    model = tiny_llama(layers=2, device="meta")
    request = front.PlanRequest(model, 16, 2, 1, plan="default", hardware="H100_SXM", device="cuda",
                                compute_dtype="bfloat16", cuda_graphs="auto")
    for verdict in (True, False):
        monkeypatch.setattr(graphs, "issue_bound", lambda *a, v=verdict: (v, "judged"))
        planned = front.plan(request)
        assert planned.plan.cuda_graphs is verdict and planned.schedules.steady.plan.cuda_graphs is verdict
        assert f"CUDA graphs: {'on' if verdict else 'off'}: judged" in planned.decisions
        assert (planned.memory.graph_pool > 0) is verdict


def test_megatrain_plan_takes_the_templates_and_graphs_flags_and_records_them(tmp_path, capsys):
    """``megatrain plan --templates compiled --cuda-graphs true``: the plan table says both, the GPU
    memory table has the graphs' pool, and schedule.json's plan records both; the defaults are eager
    and off."""
    import re

    from megatrain.cli import main
    from megatrain.ir.schedule import Schedule

    from test_cli import write_config

    cfg = write_config(tmp_path / "config.json")
    args = ["plan", "--model", str(cfg), "--hardware", "H100_SXM", "--seq-len", "16", "--global-batch", "4",
            "--solver", "enumerate"]
    assert main([*args, "--templates", "compiled", "--cuda-graphs", "true", "--out", str(tmp_path / "on")]) == 0
    text = capsys.readouterr().out
    assert re.search(r"layer templates +compiled +each compiled once with torch.compile", text)
    assert re.search(r"CUDA graphs +on +each compute op replayed", text)
    assert re.search(r"CUDA graphs +\d+\.\d\d +the graphs' memory pool", text)
    plan = Schedule.load(tmp_path / "on" / "schedule.json").plan
    assert (plan.templates, plan.cuda_graphs) == ("compiled", True)
    assert main([*args, "--out", str(tmp_path / "off")]) == 0
    text = capsys.readouterr().out
    assert re.search(r"layer templates +eager", text) and re.search(r"CUDA graphs +off", text)
    plan = Schedule.load(tmp_path / "off" / "schedule.json").plan
    assert (plan.templates, plan.cuda_graphs) == ("eager", False)


# -- on a GPU (CPU twins above: the same runs through FakeCuda) ------------------------------------

@requires_cuda
@pytest.mark.parametrize("templates", ["eager", "compiled"])
def test_cuda_graphs_train_like_eager_on_the_gpu(templates, compile_cache):
    """FP32, two micro-batches layer by layer, every compute op replayed from a real CUDA graph (of the
    eager or the compiled template) after the first step: losses and weights within 1e-5 of eager
    FP32 on the same GPU (TF32 off on both sides)."""
    torch.manual_seed(0)
    model = tiny_llama(layers=3)
    ref = copy.deepcopy(model).cuda()
    batches = [random_batch(4, 16, 96, seed=s % 3) for s in range(5)]
    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2, micro_batches=2, optimizer=ADAMW,
                                device="cuda", compute_dtype="float32", plan="default", templates=templates,
                                cuda_graphs=True)
    got = [trainer.step(b).loss for b in batches]
    assert trainer.executor.graphs.replays > 0
    with strict_fp32():
        want = eager_losses(ref, [{k: t.cuda() for k, t in b.items()} for b in batches], 2)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: {a} vs eager {b}"
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        q = q.detach().cpu()
        assert ((p.detach() - q).norm() / q.norm()).item() <= RTOL, name


@requires_cuda
def test_captured_dropout_replays_the_forwards_masks_on_the_gpu():
    """The CUDA generator under replay: each forward replay draws from its state then, each
    recompute's replay from the forward's (DeviceRng set before the replay): eager's masks, and the
    generator ends in eager's state."""
    from test_dropout import assert_same_training_with_dropout

    torch.manual_seed(0)
    trainer = assert_same_training_with_dropout(tiny_gpt2(layers=2), plan=Plan(cuda_graphs=True), device="cuda")
    assert trainer.executor.graphs.replays > 0


@requires_cuda
def test_compiled_templates_in_cuda_graphs_track_eager_bf16_on_the_gpu(compile_cache):
    from test_exactness import assert_bf16_tracks_eager

    torch.manual_seed(5)
    model = tiny_llama(layers=2)
    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2, optimizer=ADAMW, device="cuda",
                                compute_dtype="bfloat16", plan="default", templates="compiled", cuda_graphs=True)
    batches = [random_batch(2, 16, 96, seed=s % 3) for s in range(6)]
    assert_bf16_tracks_eager(model, trainer, batches, blocks=2, eager_device="cuda", bf16_parameters=True)
    assert trainer.executor.graphs.replays > 0
