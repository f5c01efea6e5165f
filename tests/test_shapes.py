"""megatrain.compile(model) with no shapes: plans per batch shape, cached, bounded, bucketed."""

from __future__ import annotations

import copy

import pytest
import torch

import megatrain
import megatrain.planner.front as front  # where the model is traced (once per shape)
from megatrain.errors import BatchError, ConfigError
from megatrain.product.shapes import ShapeFreeTrainer, pad_to_bucket

from conftest import random_batch, tiny_llama
from test_exactness import ADAMW, RTOL, eager_losses

VOCAB = 96


def _compare(model, ref, got, batches, micro_batches, max_grad_norm=None):
    want = eager_losses(ref, batches, micro_batches, max_grad_norm)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: megatrain {a} vs eager {b}"
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        err = ((p - q).norm() / q.norm()).item()
        assert err <= RTOL, f"{name}: relative difference {err:.2e}"


@pytest.fixture()
def count_traces(monkeypatch):
    calls = []
    real = front.trace

    def counting(model, **kw):
        calls.append((kw["micro_batch_size"], kw["seq_len"]))
        return real(model, **kw)

    monkeypatch.setattr(front, "trace", counting)
    return calls


@pytest.mark.parametrize("max_grad_norm", [None, 1.0], ids=["per-layer-updates", "clipped-deferred"])
def test_shapes_come_from_the_batches_and_training_is_exact(count_traces, max_grad_norm):
    """Alternating shapes train one set of weights and moments exactly as eager does; each shape
    is traced once and then served from the cache."""
    torch.manual_seed(0)
    model = tiny_llama()
    ref = copy.deepcopy(model)
    trainer = megatrain.compile(model, micro_batches=2, optimizer=ADAMW, max_grad_norm=max_grad_norm)
    assert isinstance(trainer, ShapeFreeTrainer) and trainer.trainer is None
    shapes = [(4, 16), (4, 12), (4, 16), (6, 12), (4, 12), (4, 16)]
    batches = [random_batch(r, s, VOCAB, seed=i % 3) for i, (r, s) in enumerate(shapes)]
    got = [trainer.step(b).loss for b in batches]
    trainer.flush()
    _compare(model, ref, got, batches, micro_batches=2, max_grad_norm=max_grad_norm)
    assert count_traces == [(2, 16), (2, 12), (3, 12)]  # one trace per new shape, none on a repeat
    assert trainer.traces == 3 and trainer.step_count == len(shapes)
    assert trainer.shapes == [(3, 12), (2, 12), (2, 16)]  # least recently used first


def test_the_cache_is_bounded_and_warns_once(count_traces):
    torch.manual_seed(0)
    trainer = megatrain.compile(tiny_llama(), max_shapes=2, optimizer=ADAMW)
    with pytest.warns(UserWarning, match=r"more than max_shapes=2 batch shapes .*seq_len_buckets"):
        for seq in (8, 10, 12):
            trainer.step(random_batch(2, seq, VOCAB, seed=0))
    assert trainer.shapes == [(2, 10), (2, 12)]
    trainer.step(random_batch(2, 8, VOCAB, seed=0))  # evicted: traced again
    assert [s for _, s in count_traces] == [8, 10, 12, 8]


def test_buckets_pad_without_changing_the_loss(count_traces):
    """Batches of 10 and 13 tokens padded to one bucket of 16 train as eager trains the unpadded
    batches: the padding comes after every real token and its labels are -100."""
    torch.manual_seed(0)
    model = tiny_llama()
    ref = copy.deepcopy(model)
    trainer = megatrain.compile(model, seq_len_buckets=(16, 32), optimizer=ADAMW)
    batches = [random_batch(2, s, VOCAB, seed=i) for i, s in enumerate((10, 13, 16, 10))]
    got = [trainer.step(b).loss for b in batches]
    _compare(model, ref, got, batches, micro_batches=1)
    assert count_traces == [(2, 16)]


def test_pad_to_bucket_fills_each_input_as_documented():
    b = {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[5, 6, 7]]),
         "attention_mask": torch.tensor([[1, 1, 1]]), "position_ids": torch.tensor([[0, 0, 1]])}
    out = pad_to_bucket(b, (2, 5))
    assert out["input_ids"].tolist() == [[5, 6, 7, 0, 0]] and out["labels"].tolist() == [[5, 6, 7, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0]] and out["position_ids"].tolist() == [[0, 0, 1, 2, 3]]
    with pytest.raises(BatchError, match=r"length 3 exceeds the largest seq_len bucket 2; add a bucket >= 3"):
        pad_to_bucket(b, (2,))


def test_shape_free_errors_name_the_cause():
    torch.manual_seed(0)
    model = tiny_llama()
    trainer = megatrain.compile(model, micro_batches=2)
    with pytest.raises(BatchError, match=r"3 rows, not a multiple of 2"):
        trainer.step(random_batch(3, 8, VOCAB, seed=0))
    with pytest.raises(ConfigError, match="no batch has been given yet"):
        trainer.save("unused")
    # a shape the model cannot take: the planning error says which shape it was planning
    with pytest.raises(ConfigError) as e:
        trainer.step(random_batch(2, 65, VOCAB, seed=0))  # tiny_llama has 64 positions
    assert "seq_len=65" in "".join(getattr(e.value, "__notes__", [])) + str(e.value)
    with pytest.raises(ConfigError, match="seq_len_buckets and max_shapes are for shape-free compile"):
        megatrain.compile(model, seq_len=8, seq_len_buckets=(8,))
    with pytest.raises(ConfigError, match="a Plan is made for one batch shape"):
        megatrain.compile(model, plan=megatrain.Plan(micro_batches=1))


def test_a_checkpoint_loads_before_the_first_batch(tmp_path, count_traces):
    """Resuming a shape-free trainer: load plans a probe shape to make the host tiles, then the
    first batch's shape trains from the loaded weights as a fixed-shape trainer does."""
    from megatrain.product.shapes import PROBE_SEQ_LEN

    torch.manual_seed(3)
    saved = megatrain.compile(tiny_llama(), seq_len=16, micro_batch_size=2, optimizer=ADAMW)
    saved.step(random_batch(2, 16, VOCAB, seed=1))
    saved.save(tmp_path / "ckpt")
    torch.manual_seed(0)
    model = tiny_llama()
    trainer = megatrain.compile(model, optimizer=ADAMW)
    del count_traces[:]  # (the fixed-shape trainer's own trace)
    trainer.load(tmp_path / "ckpt")
    assert count_traces == [(1, PROBE_SEQ_LEN)] and trainer.step_count == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved.model.parameters()))
    batch = random_batch(2, 16, VOCAB, seed=2)
    assert trainer.step(batch).loss == saved.step(batch).loss  # the same state, the same step
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), saved.model.parameters()))


def test_explicit_shapes_still_give_a_trainer():
    torch.manual_seed(0)
    trainer = megatrain.compile(tiny_llama(), seq_len=8)
    assert isinstance(trainer, megatrain.Trainer) and trainer.options.micro_batch_size == 1


def test_readme_without_shapes_snippet_runs(capsys):
    """docs/python-api.md's example, run as written."""
    from conftest import readme_snippet

    exec(compile(readme_snippet("### Without shapes: `megatrain.compile(model)`"), "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "[(2, 16), (2, 32)]"
