"""compile() and Trainer: where state lives, and what bad input gets."""

from __future__ import annotations

import pytest
import torch

import megatrain
from megatrain.errors import BatchError, ConfigError, UnsupportedModelError

from conftest import random_batch, tiny_gpt, tiny_llama


def test_public_surface_is_pinned():
    assert sorted(megatrain.__all__) == sorted([
        "AdamW", "BatchError", "CheckpointError", "ConfigError", "MegatrainError", "Plan", "PlanError", "ScheduleError",
        "StepResult", "TraceError", "Trainer", "UnsupportedModelError", "compile"])
    for name in megatrain.__all__:
        assert hasattr(megatrain, name)


def test_parameters_live_only_in_host_tiles():
    model = tiny_llama(layers=3)
    n_params = sum(p.numel() for p in model.parameters())
    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2)
    host = trainer.host
    tiles = {b.untyped_storage().data_ptr(): b for b in host.blocks}
    for name, p in model.named_parameters():
        owner = [b for b in host.blocks if b.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()]
        assert len(owner) == 1, f"{name} is not a view of a host tile"
    assert len(tiles) == len(trainer.graph.layers)
    # 12 bytes per parameter (FP32 master + two moments), plus alignment padding of < 64 B a tensor.
    n_tensors = len(list(model.parameters()))
    assert 12 * n_params <= host.nbytes <= 12 * (n_params + 16 * n_tensors)


def test_transient_buffers_are_a_few_layers_not_one_per_parameter():
    model = tiny_llama(layers=24, vocab=32, hidden=32)
    trainer = megatrain.compile(model, seq_len=8, micro_batch_size=1)
    trainer.step(random_batch(1, 8, 32, seed=0))
    slots = trainer.executor._buffers
    transient = sum(t.numel() * t.element_size() for t in slots.weights + slots.grads + slots.ring)
    largest = max(l.numel for l in trainer.graph.layers) * 4
    assert transient == (2 + 2 + 2) * largest  # two weight slots, two gradient slots, two ring tiles
    assert transient < 0.5 * 4 * trainer.graph.param_count


def test_step_reports_tokens_and_time():
    trainer = megatrain.compile(tiny_gpt(), seq_len=8, micro_batch_size=2, micro_batches=2)
    res = trainer.step(random_batch(4, 8, 96, seed=0))
    assert res.step == 1 and res.tokens == 4 * 8 and res.seconds > 0
    assert len(res.micro_batch_losses) == 2
    assert res.loss == pytest.approx(sum(res.micro_batch_losses) / 2)
    assert trainer.step(random_batch(4, 8, 96, seed=1)).step == 2


@pytest.mark.parametrize("batch, match", [
    ({"input_ids": torch.zeros(4, 9, dtype=torch.long), "labels": torch.zeros(4, 9, dtype=torch.long)}, r"shape \(4, 9\)"),
    ({"input_ids": torch.zeros(3, 8, dtype=torch.long), "labels": torch.zeros(3, 8, dtype=torch.long)}, r"shape \(3, 8\)"),
    ({"input_ids": torch.zeros(4, 8, dtype=torch.int32), "labels": torch.zeros(4, 8, dtype=torch.long)}, "torch.long"),
    ({"input_ids": torch.zeros(4, 8, dtype=torch.long)}, r"lacks inputs \['labels'\]"),
    ({"input_ids": torch.zeros(4, 8, dtype=torch.long), "labels": torch.zeros(4, 8, dtype=torch.long),
      "attention_mask": torch.ones(4, 8, dtype=torch.long)}, "attention_mask"),
    ([1, 2, 3], "dict of tensors"),
])
def test_bad_batches_are_refused_and_nothing_changes(batch, match):
    model = tiny_gpt()
    trainer = megatrain.compile(model, seq_len=8, micro_batch_size=2, micro_batches=2)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(BatchError, match=match):
        trainer.step(batch)
    assert trainer.step_count == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_plain_tensor_batch_is_input_ids_and_labels():
    torch.manual_seed(0)
    a = tiny_gpt()
    b = tiny_gpt()
    b.load_state_dict(a.state_dict())
    ids = random_batch(2, 8, 96, seed=0)["input_ids"]
    ta = megatrain.compile(a, seq_len=8, micro_batch_size=2)
    tb = megatrain.compile(b, seq_len=8, micro_batch_size=2)
    assert ta.step(ids).loss == tb.step({"input_ids": ids, "labels": ids}).loss


@pytest.mark.parametrize("opt, match", [
    (dict(lr=-1.0), "lr"),
    (dict(betas=(0.9, 1.0)), "beta2"),
    (dict(eps=0.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(momentum=0.9), "momentum"),
])
def test_optimizer_settings_are_validated(opt, match):
    model = tiny_gpt()
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=match):
        megatrain.compile(model, seq_len=8, optimizer=opt)
    assert all(p is before[n] for n, p in model.named_parameters()), "a failed compile binds nothing"


@pytest.mark.parametrize("kw, match", [(dict(seq_len=0), "seq_len"), (dict(seq_len=8, micro_batches=0), "micro_batches"),
                                       (dict(seq_len=8, device="tpu"), "device")])
def test_compile_options_are_validated(kw, match):
    with pytest.raises(ConfigError, match=match):
        megatrain.compile(tiny_gpt(), **kw)


def test_failed_compile_leaves_the_model_as_it_was():
    model = tiny_llama(layers=1, tie_word_embeddings=True)
    model.tie_weights()
    before = {n: (p, p.clone()) for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedModelError):
        megatrain.compile(model, seq_len=8)
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1])


def test_trainer_save_and_load_round_trip_the_training_state(tmp_path):
    trainer = megatrain.compile(tiny_gpt(), seq_len=8, micro_batch_size=2)
    trainer.step(random_batch(2, 8, 96, seed=0))
    saved = [b.clone() for b in trainer.host.blocks]
    trainer.save(tmp_path / "ck", extra_state={"data_position": 17})
    trainer.step(random_batch(2, 8, 96, seed=1))
    assert not all(torch.equal(a, b) for a, b in zip(saved, trainer.host.blocks))
    assert trainer.load(tmp_path / "ck") == {"data_position": 17}
    assert all(torch.equal(a, b) for a, b in zip(saved, trainer.host.blocks)) and trainer.step_count == 1


def test_a_bad_learning_rate_is_refused_and_the_old_one_kept():
    trainer = megatrain.compile(tiny_gpt(), seq_len=8, optimizer=dict(lr=1e-3))
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="learning rate"):
            trainer.set_lr(bad)
    assert trainer.optimizer.lr == 1e-3 and trainer.executor.optimizer.lr == 1e-3
    trainer.set_lr(5e-4)
    assert trainer.executor.optimizer.lr == 5e-4
