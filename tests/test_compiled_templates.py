"""Compiled layer templates (``Plan.templates == "compiled"``, megatrain.runtime.templates): each
distinct template compiled once with torch.compile (inductor), before the first step, its time
said; training stays within the suite's bounds of eager; dropout replays eager's masks.

Compiling is slow on a CPU (about a minute per template and shape, cold), so these tests are few,
on tiny models, and share inductor's on-disk cache through the session's ``compile_cache``: the
second compile of a model and shape in a run loads its kernels. Measured on the 2-core Xeon VM,
2026-11-28, with other jobs on it: the FP32 test compiles 3 templates (8 graphs) cold in about
150 s, the BF16 one as many."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import megatrain
from megatrain.errors import UnsupportedModelError
from megatrain.runtime.templates import inductor_counts

from conftest import random_batch, tiny_llama
from test_dropout import TRAIN_SEED, llama_with_dropout
from test_exactness import ADAMW, assert_bf16_tracks_eager, assert_same_training


def test_compiled_templates_train_like_eager_with_dropout_replayed(compile_cache, capsys):
    """FP32, attention dropout, one micro-batch per step: losses, gradient norms and weights within
    1e-5 of eager AdamW (the masks are eager's, so the recompute replays them through the compiled
    graphs); the three templates were compiled once each before the first step, the blocks' shared
    by both blocks, with a line before and one after; a later step compiles nothing; the plan and
    its schedule file record the choice; a second trainer of the model loads every graph from the
    on-disk cache."""
    torch.manual_seed(3)
    model = llama_with_dropout(layers=2)
    fresh = copy.deepcopy(model)
    trainer = assert_same_training(model, templates="compiled", seed=TRAIN_SEED, steps=8)
    assert trainer.plan.templates == "compiled"
    assert json.loads(trainer.schedule.to_json())["plan"]["templates"] == "compiled"
    (report,) = trainer.executor.compile_reports  # once, at compile: nothing compiled in a step
    blocks = [t for t in report.templates if len(t.layers) > 1]
    assert len(report.templates) == 3 and [t.layers for t in blocks] == [("model.layers.0", "model.layers.1")]
    assert all(t.graphs >= 2 for t in report.templates) and report.cache_dir.startswith(compile_cache)
    err = capsys.readouterr().err
    assert err.index("compiling 3 layer templates") < err.index("compiled 3 layer templates")

    before = inductor_counts()
    trainer.step(random_batch(2, 16, 96, seed=0))
    assert inductor_counts() == before, "a step after compile must not compile"

    again = megatrain.compile(fresh, seq_len=16, micro_batch_size=2, optimizer=ADAMW, templates="compiled")
    (second,) = again.executor.compile_reports
    assert sum(t.cache_hits for t in second.templates) == sum(t.graphs for t in second.templates) > 0


def test_compiled_bf16_templates_track_eager_within_the_derived_bounds(compile_cache):
    """BF16 compute (the model traced with BF16 parameters) with compiled templates: at every step
    the loss and gradient norm of the eager BF16 model at the same weights, within bf16_tolerances
    (inductor rounds to BF16 where eager does: emulate_precision_casts)."""
    torch.manual_seed(5)
    model = tiny_llama(layers=2)
    batches = [random_batch(2, 16, 96, seed=s % 3) for s in range(4)]
    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2, optimizer=ADAMW, compute_dtype="bfloat16",
                                templates="compiled")
    assert trainer.plan.templates == "compiled" and trainer.executor.compile_reports
    assert_bf16_tracks_eager(model, trainer, batches, blocks=2, bf16_parameters=True)


def test_a_template_that_cannot_compile_is_an_error_naming_it_and_its_node(compile_cache):
    """A node Dynamo cannot put in one graph (a graph break) in the prologue's template (the first
    compiled, so Dynamo stops before inductor spends a minute): compile raises UnsupportedModelError
    naming the template, its layer and the node, and says how to run eager."""
    torch.manual_seed(0)
    planned = megatrain.plan_model(tiny_llama(layers=2), seq_len=16, micro_batch_size=2, templates="compiled")
    k = planned.traced.graph.layers[0].template
    gm = planned.traced.templates[k]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        gm.graph.create_node("call_function", torch._dynamo.graph_break, name="untraceable")
    gm.recompile()
    with pytest.raises(UnsupportedModelError, match=rf"layer template {k} \(prologue\) cannot be compiled.*at node "
                                                    r"'untraceable'.*templates='eager'"):
        megatrain.materialize(planned, ADAMW)


def test_eager_is_the_default_on_the_cpu_and_a_given_plans_choice_is_kept():
    from megatrain.ir.plan import Plan

    model = tiny_llama(layers=1)
    assert megatrain.plan_model(model, seq_len=16, micro_batch_size=2).plan.templates == "eager"
    given = megatrain.plan_model(model, seq_len=16, micro_batch_size=2, plan=Plan(templates="compiled"))
    assert given.plan.templates == "compiled"
    assert megatrain.plan_model(model, seq_len=16, micro_batch_size=2, plan=Plan(templates="compiled"),
                                templates="eager").plan.templates == "eager"
    with pytest.raises(megatrain.ConfigError, match="templates='fast'"):
        megatrain.plan_model(model, seq_len=16, micro_batch_size=2, templates="fast")


def test_megatrain_train_passes_its_templates_and_graphs_settings_to_the_planner():
    """``megatrain train``'s ``templates`` and ``cuda_graphs`` reach the plan request it (and
    ``megatrain plan --config``) plans with; the defaults leave the device's choice."""
    from megatrain.planner.front import Topology, plan
    from megatrain.train import load_train_config
    from megatrain.train.loop import plan_request

    model = tiny_llama(layers=1)
    base = {"model": "llama-30m", "output_dir": "out", "seq_len": 16, "global_batch": 2, "micro_batch_size": 2}
    req = plan_request(load_train_config(None, base | {"templates": "compiled", "device": "cuda",
                                                       "cuda_graphs": "auto"}, saved_run=False),
                       model, None, Topology())
    assert (req.templates, req.cuda_graphs) == ("compiled", "auto")
    req = plan_request(load_train_config(None, base, saved_run=False), model, None, Topology())
    assert (req.templates, req.cuda_graphs) == (None, False)
    assert plan(req).plan.templates == "eager"
