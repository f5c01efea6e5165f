"""``megatrain.compile(..., global_batch=B)``: the solver chooses the micro-batch size and count, the
trainer runs that split (traced once more at it, solved once), and stays exact; the split's rules and
errors; ``megatrain train``'s ``micro_batch_size: auto``."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import megatrain
from megatrain.errors import ConfigError
from megatrain.ir.hardware import preset
from megatrain.ir.plan import Plan
from megatrain.planner import front
from megatrain.planner.solve import SolveLimits, SolveRequest, minimum_requirements
from megatrain.planner.trace import trace
from megatrain.product.planning import plan_request, split_global_batch

from conftest import random_batch, tiny_llama
from test_exactness import assert_same_training

SEQ, ROWS = 16, 8


def two_row_gpu(model) -> "megatrain.HardwareSpec":
    """An H100 with just the GPU memory the least plan at micro-batches of 2 needs: 4 rows do not
    fit, so the solver's split of 8 rows is 4 micro-batches of 2 (its issue-bound step prefers the
    largest size that fits)."""
    graph = trace(copy.deepcopy(model), micro_batch_size=1, seq_len=SEQ).graph
    hw = preset("H100_SXM").model_copy(update={"gpu_reserve_bytes": 0})
    need = minimum_requirements(SolveRequest(graph, hw, ROWS, "float32", limits=SolveLimits(micro_batch_sizes=(2,))))
    return hw.model_copy(update={"gpu_memory_bytes": need.gpu_memory_bytes})


def test_compile_runs_the_solvers_split_solved_once_and_traced_at_it(monkeypatch):
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    hw = two_row_gpu(model)
    choice = front.plan(plan_request(copy.deepcopy(model), seq_len=SEQ, global_batch=ROWS, micro_batch_size=None,
                                     hardware=hw, compute_dtype="float32"))
    traced, solved = [], []
    real_trace, real_solve = front.trace, front.solve
    monkeypatch.setattr(front, "trace", lambda *a, **kw: traced.append(kw["micro_batch_size"]) or real_trace(*a, **kw))
    monkeypatch.setattr(front, "solve", lambda *a, **kw: solved.append(1) or real_solve(*a, **kw))
    trainer = megatrain.compile(model, seq_len=SEQ, global_batch=ROWS, hardware=hw)
    planned = trainer.planned
    assert (planned.options.micro_batch_size, trainer.plan.micro_batches) == (2, 4)
    assert (choice.options.micro_batch_size, choice.plan.micro_batches) == (2, 4)  # the front door's own choice
    assert trainer.plan == choice.plan and planned.solution is not None and planned.solution.micro_batch_size == 2
    # Solved once, on the trace at one row; traced once more at the chosen size, whose templates run.
    assert solved == [1] and traced == [1, 2]
    assert planned.graph is planned.traced.graph and planned.traced.graph.micro_batch_size == 2
    assert planned.schedules.steady.plan == trainer.plan
    assert planned.memory.gpu_peak <= hw.gpu_memory_bytes  # the plan fits on the graph that runs
    assert any(d.startswith("micro-batches: 4 of 2 sequences (the solver's size)") for d in planned.decisions)
    assert trainer.step(random_batch(ROWS, SEQ, 96, seed=0)).applied  # the whole global batch, as for any split


def test_at_the_edge_of_gpu_memory_the_solvers_size_is_solved_again_on_the_graph_that_runs(monkeypatch):
    """The GPU reserve counts the traced tensors, so a plan fitted to the rescaled graph at the least
    GPU memory any plan needs overflows the graph traced at its size by a few MiB: it is solved again
    at that size on that graph, and the plan that runs fits and runs the solver's own schedule."""
    model = tiny_llama(layers=2, device="meta")
    graph = trace(model, micro_batch_size=1, seq_len=SEQ, param_dtype=torch.bfloat16).graph
    hw = preset("H100_SXM")
    hw = hw.model_copy(update={"gpu_memory_bytes": minimum_requirements(SolveRequest(graph, hw, 4)).gpu_memory_bytes})
    sizes = []
    real_solve = front.solve
    monkeypatch.setattr(front, "solve", lambda req, *a: sizes.append(req.limits.micro_batch_sizes) or real_solve(req, *a))
    planned = front.plan(plan_request(model, seq_len=SEQ, global_batch=4, micro_batch_size=None, hardware=hw,
                                      device="cuda", compute_dtype="bfloat16"))
    assert sizes == [None, (4,)]  # every size, then the chosen one on the model traced at it
    assert planned.options.micro_batch_size == 4 and planned.memory.gpu_peak <= hw.gpu_memory_bytes
    assert planned.solution.graph is planned.graph and planned.schedules.steady is planned.solution.schedule


def test_the_solvers_split_trains_exactly_as_eager_on_the_whole_batch():
    """FP32: losses, gradient norms and weights within 1e-5 of eager PyTorch + AdamW on each whole
    batch of 8 rows, one backward, while megatrain runs the solver's 4 micro-batches of 2."""
    torch.manual_seed(1)
    model = tiny_llama(layers=2)
    trainer = assert_same_training(model, global_batch=ROWS, hardware=two_row_gpu(model), steps=5)
    assert (trainer.planned.options.micro_batch_size, trainer.plan.micro_batches) == (2, 4)


def test_a_given_plan_keeps_its_micro_batch_count_and_fills_the_global_batch():
    torch.manual_seed(2)
    trainer = assert_same_training(tiny_llama(layers=2), global_batch=ROWS, plan=Plan(micro_batches=2), steps=5)
    assert (trainer.planned.options.micro_batch_size, trainer.plan.micro_batches) == (4, 2)


@pytest.mark.parametrize("kw, fix", [
    (dict(global_batch=0, hardware="H100_SXM"), r"global_batch=0: .*an integer >= 1"),
    (dict(global_batch=-8, hardware="H100_SXM"), r"global_batch=-8: .*an integer >= 1"),
    (dict(global_batch=True, hardware="H100_SXM"), r"global_batch=True: .*an integer >= 1"),
    (dict(global_batch=8), r"device='cpu' there is no GPU to plan for; give hardware= \(a preset such as 'H100_SXM'"),
    (dict(global_batch=8, plan="default"), r"plan='default'.*give micro_batch_size="),
    (dict(global_batch=8, micro_batch_size=2, micro_batches=2),
     r"micro_batch_size=2 x micro_batches=2 is 4 rows; give global_batch alone"),
    (dict(global_batch=8, micro_batch_size=3, hardware="H100_SXM"), r"a multiple of 3, or a micro_batch_size that divides it"),
    (dict(global_batch=9, micro_batches=2), r"does not split into micro_batches=2; .*a multiple of 2"),
    (dict(global_batch=9, plan=Plan(micro_batches=2)), r"the plan's micro_batches=2"),
    (dict(global_batch=8, seq_len=None), r"shape-free compile \(seq_len=None\).*give seq_len="),
])
def test_global_batch_errors_name_the_fix(kw, fix):
    model = tiny_llama(layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=fix):
        megatrain.compile(model, **{"seq_len": SEQ, **kw})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "nothing bound or changed"


@pytest.mark.parametrize("args, want", [
    ((None, 2, 3, 1), (6, 2)),            # no global batch: as before it existed
    ((None, None, None, 2), (2, 1)),
    ((12, None, None, 3), (12, None)),    # the solver's, each rank 4 rows
    ((12, 2, None, 3), (12, 2)),          # 2 micro-batches of 2 on each of 3 ranks
    ((12, None, 2, 3), (12, 2)),
    ((12, 2, 2, 3), (12, 2)),
])
def test_split_global_batch_counts_rows_over_every_rank(args, want):
    global_batch, size, count, ranks = args
    assert split_global_batch(global_batch, size, count, ranks=ranks, hardware="H100_SXM") == want


@pytest.mark.parametrize("args, fix", [
    ((8, 2, None, 3), r"micro_batch_size=2 x 3 data-parallel ranks; give a global_batch that is a multiple of 6"),
    ((12, 2, 3, 3), r"micro_batch_size=2 x micro_batches=3 x 3 data-parallel ranks is 18 rows"),
    ((8, None, 2, 3), r"micro_batches=2 x 3 data-parallel ranks; give a global_batch that is a multiple of 6"),
])
def test_split_global_batch_refuses_rows_the_ranks_do_not_split(args, fix):
    global_batch, size, count, ranks = args
    with pytest.raises(ConfigError, match=fix):
        split_global_batch(global_batch, size, count, ranks=ranks, hardware="H100_SXM")


# -- megatrain train: micro_batch_size: auto ----------------------------------------------------------

BASE = {"model": "llama-30m", "output_dir": "out", "seq_len": SEQ, "global_batch": ROWS, "device": "cuda"}


def test_train_config_auto_round_trips_and_plans_the_solvers_split():
    from megatrain.train import TrainConfig, load_train_config
    from megatrain.train.loop import plan_request as run_request, planned_config

    cfg = load_train_config(None, BASE | {"micro_batch_size": "auto"}, saved_run=False)
    assert cfg.micro_batch_size == "auto" and cfg.micro_batches is None
    again = TrainConfig.model_validate(json.loads(cfg.model_dump_json()))  # as train_config.json holds it
    assert again.micro_batch_size == "auto" and again == cfg
    assert load_train_config(None, BASE | {"micro_batch_size": "4"}, saved_run=False).micro_batch_size == 4  # a flag
    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    hw = two_row_gpu(model)
    request = run_request(cfg, model, hw, front.Topology())
    assert request.micro_batch_size is None and request.plan is None
    planned = front.plan(request)
    assert (planned.options.micro_batch_size, planned.plan.micro_batches) == (2, 4)
    assert planned_config(cfg, planned).micro_batch_size == 2  # what the validation batches are cut by
    fixed = load_train_config(None, BASE | {"micro_batch_size": 4}, saved_run=False)
    assert front.plan(run_request(fixed, model, preset("H100_SXM"), front.Topology())).options.micro_batch_size == 4


@pytest.mark.parametrize("over, fix", [
    ({"micro_batch_size": 0}, r"micro_batch_size.*give a micro-batch size >= 1, or auto"),
    ({"micro_batch_size": "fast"}, r"micro_batch_size"),
    ({"micro_batch_size": True}, r"is a boolean, not a number"),
    ({"micro_batch_size": 3}, r"global_batch=8 is not a multiple of micro_batch_size=3"),
])
def test_train_config_bad_micro_batch_size_is_a_config_error(over, fix):
    from megatrain.train import load_train_config

    with pytest.raises(ConfigError, match=fix):
        load_train_config(None, BASE | over, saved_run=False)


def test_train_auto_on_the_cpu_backend_and_for_dpo_name_the_fix():
    from megatrain.train import load_train_config
    from megatrain.train.config import batch_split_error
    from megatrain.train.loop import plan_request as run_request

    cpu = load_train_config(None, BASE | {"micro_batch_size": "auto", "device": "cpu"}, saved_run=False)
    with pytest.raises(ConfigError, match=r"CPU backend \(device: cpu\).*give micro_batch_size a number"):
        run_request(cpu, tiny_llama(layers=1), preset("H100_SXM"), front.Topology())
    assert batch_split_error(8, "auto", ranks=2) is None
    assert "make global_batch a multiple of 3" in batch_split_error(8, "auto", ranks=3)


def test_megatrain_plan_config_with_auto_reports_the_solvers_split(tmp_path, capsys):
    from megatrain.cli import main

    model = tmp_path / "config.json"
    model.write_text(json.dumps(dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=64, tie_word_embeddings=False)))
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {model}\nseq_len: {SEQ}\nglobal_batch: {ROWS}\nmicro_batch_size: auto\n"
                   "device: cuda\nhardware: H100_SXM\n")
    assert main(["plan", "--config", str(run)]) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.strip().startswith("micro-batch size"))
    size, count = int(line.split()[2]), int(line.split()[3])
    assert size * count == ROWS and "(the solver's size)" in text, text
