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


def test_legacy_pickled_weights_are_refused_with_how_to_convert_and_never_unpickled(tmp_path, monkeypatch):
    """config.json + pytorch_model.bin used to train from random weights without a word."""
    from megatrain.train.model import resolve_model

    torch.manual_seed(0)
    tiny_llama().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("unpickled"))
    for load in (lambda: megatrain.from_pretrained(tmp_path, seq_len=16), lambda: resolve_model(str(tmp_path))):
        with pytest.raises(megatrain.CheckpointError, match=r"pytorch_model\.bin\).*does not load .*save_pretrained\("):
            load()


def test_a_megatrain_checkpoint_is_checked_against_its_manifest(tmp_path):
    """A flipped byte in a checkpoint's weights loaded through from_pretrained, with the sha256 of
    every file beside it."""
    from megatrain.checkpoint import MANIFEST, STATE_DIR

    torch.manual_seed(0)
    trainer = megatrain.compile(tiny_llama(), seq_len=16, micro_batch_size=2)
    ckpt = trainer.save(tmp_path / "ckpt")
    megatrain.from_pretrained(ckpt, seq_len=16)  # intact: loads
    shard = ckpt / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(megatrain.CheckpointError, match=r"model\.safetensors: sha256 differs from the manifest"):
        megatrain.from_pretrained(ckpt, seq_len=16)
    (ckpt / STATE_DIR / MANIFEST).unlink()
    with pytest.raises(megatrain.CheckpointError, match=r"without megatrain_state/manifest\.json .*lacks only"):
        megatrain.from_pretrained(ckpt, seq_len=16)


def test_a_directory_that_needs_its_own_code_is_refused_without_asking(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked whether to run remote code"))
    torch.manual_seed(0)
    tiny_llama().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "modeling_x.py").write_text("raise SystemExit('remote code ran')\n")
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "x", "auto_map": {
        "AutoConfig": "modeling_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    with pytest.raises(megatrain.ConfigError, match="never runs code from a model directory"):
        megatrain.from_pretrained(tmp_path, seq_len=16)
    # A type transformers ships, with an auto_map left in: transformers' own class, no question asked.
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "auto_map": {
        "AutoConfig": "modeling_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    trainer = megatrain.from_pretrained(tmp_path, seq_len=16)
    assert type(trainer.model).__module__.startswith("transformers.models.llama")
