"""``megatrain.from_pretrained``: a saved Hugging Face directory is built on meta, compiled and its
weights streamed into the tiles; training then equals eager training of the same checkpoint."""

from __future__ import annotations

import pytest
import torch

import megatrain

from conftest import random_batch, tiny_llama
from test_exactness import ADAMW, RTOL, eager_losses


def test_from_pretrained_loads_the_weights_and_trains_as_eager(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    tiny_llama().save_pretrained(tmp_path)
    trainer = megatrain.from_pretrained(tmp_path, seq_len=16, micro_batch_size=2, optimizer=ADAMW)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(p.device.type == "cpu" for p in trainer.model.parameters()), "meta parameters were bound to tiles"
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), f"{name} was not loaded"
    batches = [random_batch(2, 16, 96, seed=s) for s in range(4)]
    got = [trainer.step(b).loss for b in batches]
    want = eager_losses(ref, batches, 1)
    for a, b in zip(got, want):
        assert abs(a - b) <= RTOL * abs(b)


def test_from_pretrained_refuses_what_is_not_a_local_model(tmp_path):
    with pytest.raises(megatrain.ConfigError, match="not a directory"):
        megatrain.from_pretrained(tmp_path / "meta-llama/Llama-3-8B", seq_len=16)
    with pytest.raises(megatrain.ConfigError, match="no config.json"):
        megatrain.from_pretrained(tmp_path, seq_len=16)
    torch.manual_seed(0)
    tiny_llama().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(megatrain.CheckpointError):
        megatrain.from_pretrained(tmp_path, seq_len=16)


def test_tied_embeddings_load_tied_without_a_warning(tmp_path):
    import warnings

    from transformers import AutoModelForCausalLM

    torch.manual_seed(4)
    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = megatrain.from_pretrained(tmp_path, seq_len=16, micro_batch_size=2, optimizer=ADAMW)
    model = trainer.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ref = AutoModelForCausalLM.from_pretrained(tmp_path)  # eager reference: tied, as the checkpoint says
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    batches = [random_batch(2, 16, 96, seed=s) for s in range(3)]
    got = [trainer.step(b).loss for b in batches]
    want = eager_losses(ref, batches, 1)
    for a, b in zip(got, want):
        assert abs(a - b) <= RTOL * abs(b)
