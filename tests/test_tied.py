"""Tied parameters (issue 14 item 1): an input embedding shared with the LM head has one owner
layer (the prologue's tile, one optimizer step); the epilogue reads an ``aten.clone`` of it as a
value that travels through the schedule, and its gradient is summed into the owner's before the
step. Exact in FP32 against eager + AdamW (1e-5 relative, as test_exactness) on three HF families."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import megatrain
from megatrain.errors import ScheduleError
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.ir.schedule import OpKind
from megatrain.planner.verify import verify

from conftest import random_batch, tiny_llama
from test_exactness import ADAMW, RTOL, assert_same_training, eager_losses

VOCAB = 96
K, OFF, RE = ActivationPolicy.KEEP, ActivationPolicy.OFFLOAD, ActivationPolicy.RECOMPUTE


def tied_llama(layers: int = 2):
    return tiny_llama(layers=layers, tie_word_embeddings=True)


def tied_qwen3(layers: int = 2):
    # Qwen3 rather than Qwen2: Qwen2's key bias has a zero gradient in exact arithmetic (softmax
    # ignores a shift shared by all keys), so AdamW turns rounding noise into its updates and the
    # 1e-5 weight comparison fails there tied or untied (1.2e-5 untied, 2-core CPU, 2026-11-24).
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(head_dim=8, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True))


def tied_gemma(layers: int = 2):
    # Gemma rather than GPT-2: GPT-2's fused c_attn bias holds the key bias, whose gradient is zero
    # in exact arithmetic (see tied_qwen3), so its weights differ by 3e-4 relative after 4 steps.
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                        max_position_embeddings=64, tie_word_embeddings=True))


FAMILIES = {"llama": tied_llama, "qwen3": tied_qwen3, "gemma": tied_gemma}


def _is_tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _tied_value(graph):
    """The value the owner layer passes to the LM head: the clone of the shared weight."""
    (v,) = [v for v in graph.values if v.name.endswith("_tied")]
    return v


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tied_family_matches_eager_with_micro_batches(family):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    assert _is_tied(model)
    trainer = assert_same_training(model, micro_batches=2, steps=4)
    assert _is_tied(model), "training keeps the tie"
    graph = trainer.traced.graph
    owners = [layer.name for layer in graph.layers for p in layer.params
              if p.name == next(n for n, q in model.named_parameters() if q is model.get_input_embeddings().weight)]
    assert owners == ["prologue"], "one owner tile: the shared weight is in the prologue's tile only"
    tied = _tied_value(graph)
    assert tied.producer == 0 and tied.consumers == (len(graph.layers) - 1,) and tied.requires_grad
    opts = [op.layer for op in trainer.schedule.ops if op.kind is OpKind.OPT]
    assert sorted(opts) == list(range(len(graph.layers))), "every layer, the owner too, steps exactly once"


@pytest.mark.parametrize("plan,clip", [
    (Plan(micro_batches=2, slots=1, prefetch_distance=0, grad_ring=4, activations=(OFF, RE, K, K),
          optimizer=OptimizerPlacement.NEXT_FORWARD), 0.05),
    (Plan(micro_batches=2, slots=2, prefetch_distance=1, resident=frozenset({0, 3})), None),
    (Plan(micro_batches=2, layer_by_layer=False, optimizer=OptimizerPlacement.NEXT_FORWARD,
          activations=(OFF, K, K, K)), 0.05),
], ids=["one-slot-offload-clipped", "resident", "per-micro-batch-clipped"])
def test_tied_plan_shapes_match_eager(plan, clip):
    """The clone is a checkpoint like any other: offloaded, kept across a resident owner, carried
    through host accumulators; clipping sees the summed gradient once (clip_grad_norm_ at 0.05)."""
    torch.manual_seed(1)
    trainer = assert_same_training(tied_llama(), micro_batches=2, plan=plan, steps=4, max_grad_norm=clip)
    if OFF in plan.activations[:1]:
        assert any(op.kind is OpKind.OFFLOAD and op.layer == 0 for op in trainer.schedule.ops)


def test_tied_solved_plan_matches_eager():
    """The solver plans the tied model for a GPU with the least memory any plan needs."""
    from megatrain.ir.hardware import preset
    from megatrain.planner.solve import SolveLimits, SolveRequest, minimum_requirements, solve
    from megatrain.planner.trace import trace

    torch.manual_seed(6)
    model = tied_llama(layers=2)
    graph = trace(copy.deepcopy(model), micro_batch_size=2, seq_len=16).graph
    request = SolveRequest(graph, preset("H100_SXM").model_copy(update={"gpu_reserve_bytes": 0}), 4, "float32",
                           limits=SolveLimits(micro_batch_sizes=(2,)))
    tight = request.hardware.model_copy(update={"gpu_memory_bytes": minimum_requirements(request).gpu_memory_bytes})
    trainer = assert_same_training(model, micro_batches=2, steps=4, hardware=tight)
    assert trainer.plan == solve(dataclasses.replace(request, hardware=tight)).plan and trainer.plan.slots == 1


def test_tied_training_on_the_cuda_backend_logic_through_fake_cuda():
    from megatrain.runtime.cuda import CUDABackend
    from megatrain.testing import FakeCuda

    torch.manual_seed(2)
    model = tied_llama()
    ref = copy.deepcopy(model)
    batches = [random_batch(4, 16, VOCAB, seed=s) for s in range(3)]
    planned = megatrain.plan_model(model, seq_len=16, micro_batch_size=2, micro_batches=2,
                                   plan=Plan(micro_batches=2, slots=2, prefetch_distance=1))
    trainer = megatrain.materialize(planned, ADAMW, backend=CUDABackend(adapter=FakeCuda()))
    got = [trainer.step(b).loss for b in batches]
    want = eager_losses(ref, batches, 2)
    for a, b in zip(got, want):
        assert abs(a - b) <= RTOL * abs(b)


def test_verifier_rejects_a_reader_that_runs_before_the_owner_made_its_copy():
    """Hand-mutated schedule: the LM head's first op moved before the owner's forward (the one that
    clones the shared weight), with the edge between them removed."""
    torch.manual_seed(3)
    planned = megatrain.plan_model(tied_llama(), seq_len=16, micro_batch_size=2,
                                   plan=Plan(slots=4, prefetch_distance=3))
    graph, s = planned.traced.graph, planned.schedules.first
    tied = _tied_value(graph)
    verify(s, graph)
    ops = list(s.ops)
    owner = next(i for i, op in enumerate(ops) if op.kind is OpKind.FWD and op.layer == tied.producer)
    # The LM head's layer computes the loss: its forward is the first half of its local backward.
    reader = next(i for i, op in enumerate(ops) if op.kind in (OpKind.FWD, OpKind.BWD) and op.layer == tied.consumers[0])
    moved = dataclasses.replace(ops[reader], deps=tuple(d for d in ops[reader].deps if d < owner))
    ops = ops[:owner] + [moved] + ops[owner:reader] + ops[reader + 1:]
    remap = {old: new for new, old in enumerate(list(range(owner)) + [reader] + list(range(owner, reader))
                                                 + list(range(reader + 1, len(s.ops))))}
    ops = [dataclasses.replace(op, deps=tuple(sorted(remap[d] for d in op.deps if remap[d] < k)))
           for k, op in enumerate(ops)]
    with pytest.raises(ScheduleError, match=r"rule '(data|order)'"):
        verify(dataclasses.replace(s, ops=tuple(ops)), graph)


def test_tied_checkpoint_is_hf_layout_with_one_tensor_and_loads_back(tmp_path):
    """save_checkpoint writes the shared matrix once, under its input-embedding name (what
    transformers writes for a tied model); megatrain and transformers both load it back tied."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    model = tied_llama()
    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2, optimizer=ADAMW)
    for s in range(2):
        trainer.step(random_batch(2, 16, VOCAB, seed=s))
    trainer.save(tmp_path / "ckpt")
    files = list((tmp_path / "ckpt").glob("model*.safetensors"))
    names = set()
    for f in files:
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert hf.lm_head.weight is hf.model.embed_tokens.weight, "transformers keeps the tie"
    assert torch.equal(hf.model.embed_tokens.weight, model.model.embed_tokens.weight)
    again = megatrain.from_pretrained(tmp_path / "ckpt", seq_len=16, micro_batch_size=2, optimizer=ADAMW)
    assert _is_tied(again.model)
    assert torch.equal(again.model.lm_head.weight, model.lm_head.weight)


def test_a_file_that_also_stores_the_lm_head_loads_it_once(tmp_path):
    """Some tied checkpoints store the matrix under both names; megatrain loads it (strict) once."""
    from safetensors.torch import save_file

    torch.manual_seed(6)
    src = tied_llama()
    state = {k: v.detach().clone().contiguous() for k, v in src.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    trainer = megatrain.compile(tied_llama(), seq_len=16, micro_batch_size=2)
    loaded = trainer.load_hf_weights(tmp_path)
    assert loaded.unexpected == () and loaded.missing == ()
    assert torch.equal(trainer.model.lm_head.weight, src.lm_head.weight) and _is_tied(trainer.model)


def test_tied_bf16_compute_tracks_eager_autocast():
    """BF16 compute: the copy the LM head reads is the owner's BF16 weight; at every step the loss
    and gradient norm match eager autocast at the same weights (test_exactness's bounds)."""
    from test_exactness import assert_bf16_tracks_eager

    torch.manual_seed(5)
    model = tied_llama()
    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2, optimizer=ADAMW,
                                plan=Plan(compute_dtype="bfloat16"))
    # Traced with BF16 parameters (BF16 compute): the copy the LM head reads is BF16, half the bytes.
    assert _tied_value(trainer.traced.graph).dtype == "bfloat16"
    batches = [random_batch(2, 16, VOCAB, seed=s % 3) for s in range(6)]
    assert_bf16_tracks_eager(model, trainer, batches, blocks=2)
    assert _is_tied(model)
