"""compile() and Trainer: where state lives, and what bad input gets."""

from __future__ import annotations

import math

import pytest
import torch

import megatrain
from megatrain.errors import BatchError, ConfigError, UnsupportedModelError

from conftest import random_batch, tiny_gpt, tiny_llama


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
    model = tiny_llama(layers=1)
    model.requires_grad_(False)  # refused: nothing to train
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


class _Poisonable(torch.nn.Module):
    """A tiny residual net whose loss stays finite while its gradients become NaN when a batch's
    first token is 0: d/dx sqrt(|x|) at x = 0 is infinite, times the 0 that makes x = 0. Its loss
    has a term besides the cross-entropy, so megatrain cannot count its targets: it compiles with
    per_token_loss=False."""

    def __init__(self, vocab: int = 32, d: int = 16, n: int = 3):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, input_ids, labels):
        h = self.emb(input_ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        ce = torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())
        clean = (input_ids[:, 0] != 0).all().float()
        return ce + 1e-3 * torch.sqrt((h.sum() * clean).abs())


def _state(trainer):
    return [b.clone() for b in trainer.host.blocks], [s.clone() for s in trainer.host.steps]


def _batch(first_token: int):
    ids = torch.randint(1, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = first_token
    return {"input_ids": ids, "labels": ids.clone()}


def test_non_finite_gradients_are_not_applied_when_updates_wait_for_the_norm():
    torch.manual_seed(0)
    trainer = megatrain.compile(_Poisonable(), seq_len=8, micro_batch_size=2, max_grad_norm=1.0,
                                per_token_loss=False)
    good = trainer.step(_batch(5))
    assert good.applied and good.grad_norm > 0 and good.skipped_layers == ()
    trainer.flush()
    before = _state(trainer)
    bad = trainer.step(_batch(0))
    assert bad.loss == bad.loss, "the loss itself stays finite"
    assert not bad.applied and not bad.grad_norm == bad.grad_norm  # NaN
    trainer.flush()  # nothing is pending: the bad step's update was dropped
    after = _state(trainer)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])), "weights or moments changed"
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1])), "Adam step counts changed"
    assert trainer.step(_batch(5)).applied, "training goes on after a skipped step"


def test_non_finite_gradient_during_backward_stops_the_remaining_updates():
    torch.manual_seed(0)
    trainer = megatrain.compile(_Poisonable(), seq_len=8, micro_batch_size=2, per_token_loss=False)
    before = _state(trainer)
    bad = trainer.step(_batch(0))
    after = _state(trainer)
    n = len(trainer.graph.layers)
    # The head's gradients (last layer) are finite and arrive first; the blocks' are NaN.
    assert not bad.applied and bad.skipped_layers == tuple(range(n - 2, -1, -1))
    changed = [i for i in range(n) if not torch.equal(before[0][i], after[0][i])]
    assert changed == [n - 1]
    assert [float(s) for s in after[1]] == [0.0] * (n - 1) + [1.0]


def test_non_finite_loss_applies_nothing_even_during_backward():
    torch.manual_seed(0)
    model = _Poisonable()
    trainer = megatrain.compile(model, seq_len=8, micro_batch_size=2, per_token_loss=False)
    with torch.no_grad():
        model.head.bias[0] = float("inf")  # a view of the master tile: the next H2D copies it
    before = _state(trainer)
    res = trainer.step(_batch(5))
    assert not res.applied and not math.isfinite(res.loss) and res.skipped_layers == (4, 3, 2, 1, 0)
    after = _state(trainer)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]) if torch.isfinite(a).all())
    assert all(float(s) == 0.0 for s in after[1])


def test_clipping_needs_deferred_optimizer_steps():
    from megatrain.ir.plan import Plan

    with pytest.raises(ConfigError, match="max_grad_norm=1.0 needs the global gradient norm"):
        megatrain.compile(tiny_llama(layers=1), seq_len=8, micro_batch_size=1, plan=Plan(), max_grad_norm=1.0)


def test_hardware_for_the_solver_is_validated():
    with pytest.raises(ConfigError, match="no hardware preset named 'B300'"):
        megatrain.compile(tiny_llama(layers=1), seq_len=8, micro_batch_size=1, hardware="B300")
    with pytest.raises(ConfigError, match="compute_dtype='float16'"):
        megatrain.compile(tiny_llama(layers=1), seq_len=8, micro_batch_size=1, compute_dtype="float16")


# -- a step that raises -----------------------------------------------------------------------------
# The reference trains batches 1 and 2; the faulty run trains 1, then a step that raises (a bad batch,
# or a fault injected at a chosen op), then 2. A failed step must leave the trainer as if it had
# never been called, so both runs agree bit for bit (the same ops on the same CPU in the same order).

VOCAB = 96


def _small_trainer(clip: bool = True, model=None):
    torch.manual_seed(0)
    return megatrain.compile(model or tiny_gpt(layers=1, vocab=VOCAB), seq_len=8, micro_batch_size=2,
                             max_grad_norm=1.0 if clip else None)


def _good(seed: int):
    return random_batch(2, 8, VOCAB, seed=seed)


class _Faults:
    """Makes ``backend.launch`` raise at chosen ``(run, op index)`` pairs, counting runs from now (a
    run ends at ``synchronize``, or at ``abort`` when the executor closes a run that failed);
    ``after=True`` raises once the op has run (its effect stays), else instead of running it;
    ``inside=True`` makes the op itself raise where it runs (a host op: on the CUDA backend's worker).
    """

    def __init__(self, backend, at, after: bool = False, inside: bool = False, error=RuntimeError):
        self.run = self.index = 0
        self.hits: list[tuple[int, int]] = []
        launch, sync, abort = backend.launch, backend.synchronize, backend.abort

        def faulty_launch(stream, fn, waits, label=""):
            where = (self.run, self.index)
            self.index += 1
            if where in at and inside:
                self.hits.append(where)

                def failing():
                    raise RuntimeError(f"injected fault in {label}")
                return launch(stream, failing, waits, label)
            if where in at and not after:
                self.hits.append(where)
                raise error(f"injected fault at {label}")
            handle = launch(stream, fn, waits, label)
            if where in at:
                self.hits.append(where)
                raise RuntimeError(f"injected fault after {label}")
            return handle

        def counting_sync():
            self.run, self.index = self.run + 1, 0
            sync()

        def counting_abort():
            self.run, self.index = self.run + 1, 0
            abort()

        backend.launch, backend.synchronize, backend.abort = faulty_launch, counting_sync, counting_abort


def _flushed_state(trainer):
    trainer.flush()
    return [b.clone() for b in trainer.host.blocks], [float(s) for s in trainer.host.steps]


@pytest.fixture(scope="module")
def reference():
    trainer = _small_trainer()
    losses = [trainer.step(_good(s)).loss for s in (1, 2)]
    return losses, _flushed_state(trainer)


def _assert_as_reference(trainer, reference, first_loss):
    ref_losses, (ref_blocks, ref_steps) = reference
    losses = [first_loss, trainer.step(_good(2)).loss]
    assert trainer.step_count == 2
    assert losses == ref_losses, "a failed step changed what later steps compute"
    blocks, steps = _flushed_state(trainer)
    assert steps == ref_steps == [2.0] * len(steps), "an update was applied twice or lost"
    assert all(torch.equal(a, b) for a, b in zip(blocks, ref_blocks)), "weights or moments differ"


def test_out_of_range_ids_are_a_batch_error_before_anything_runs():
    # A Hugging Face model: the bounds come from get_input_embeddings / get_output_embeddings.
    trainer = _small_trainer(model=tiny_llama(layers=1, vocab=VOCAB))
    trainer.step(_good(1))
    before = _state(trainer)
    for name, bad in (("input_ids", VOCAB), ("input_ids", -1), ("labels", VOCAB), ("labels", -2)):
        batch = _good(5)
        batch[name][1, 3] = bad
        with pytest.raises(BatchError, match=rf"batch\['{name}'\] holds {bad} at \[1, 3\].*{VOCAB}"):
            trainer.step(batch)
    assert trainer.step_count == 1 and trainer.schedule is trainer.schedules.carrying, "the update is still pending"
    after = _state(trainer)
    assert all(torch.equal(a, b) for a, b in zip(before[0] + before[1], after[0] + after[1]))
    batch = _good(5)
    batch["labels"][:, :4] = -100  # the ignore index is not refused
    assert math.isfinite(trainer.step(batch).loss)


def _ops(trainer, kind):
    return [i for i, op in enumerate(trainer.schedules.carrying.ops) if op.kind.name == kind]


# Where the fault hits the carrying schedule (it starts with the previous step's optimizer steps,
# interleaved with the forward): which op, and whether before or after it ran.
_FAULTS = {
    "first carried OPT, before it runs (none ran)": (lambda t: _ops(t, "OPT")[0], False),
    "second carried OPT, before it runs (one ran)": (lambda t: _ops(t, "OPT")[1], False),
    "second carried OPT, after it ran": (lambda t: _ops(t, "OPT")[1], True),
    "forward after every carried OPT": (lambda t: [i for i in _ops(t, "FWD") if i > _ops(t, "OPT")[-1]][0], False),
    "second local backward": (lambda t: _ops(t, "BWD")[1], False),
    "last gradient copy, after it ran": (lambda t: _ops(t, "D2H")[-1], True),
}


@pytest.mark.parametrize("where", list(_FAULTS))
def test_a_step_that_raises_leaves_the_trainer_as_if_it_never_ran(reference, where):
    trainer = _small_trainer()
    first = trainer.step(_good(1)).loss
    pick, after = _FAULTS[where]
    index = pick(trainer)
    faults = _Faults(trainer.backend, {(0, index)}, after=after)
    with pytest.raises(megatrain.StepError, match=r"step 2 failed .*injected fault.*as if it never saw the batch"):
        trainer.step(_good(5))
    assert faults.hits == [(0, index)] and trainer.step_count == 1
    _assert_as_reference(trainer, reference, first)


def test_a_failure_while_finishing_the_carried_updates_leaves_the_rest_pending(reference):
    # The step fails after one carried OPT ran; the trainer then runs the others alone, and that
    # fails too before its first one: two updates stay pending, and the next step applies them
    # (once) before running its batch with the schedule that carries no update.
    trainer = _small_trainer()
    first = trainer.step(_good(1)).loss
    faults = _Faults(trainer.backend, {(0, _ops(trainer, "OPT")[1]), (1, 0)})
    with pytest.raises(megatrain.StepError, match=r"updates of layers \[1, 2\] are still pending"):
        trainer.step(_good(5))
    assert len(faults.hits) == 2 and trainer.schedule is trainer.schedules.first
    _assert_as_reference(trainer, reference, first)


def test_a_failed_flush_applies_each_update_once(reference):
    trainer = _small_trainer()
    losses = [trainer.step(_good(s)).loss for s in (1, 2)]
    _Faults(trainer.backend, {(0, 1)})
    with pytest.raises(megatrain.StepError, match=r"updates of layers \[1, 2\] are still pending"):
        trainer.flush()
    assert losses == reference[0]
    blocks, steps = _flushed_state(trainer)  # applies the rest
    assert steps == reference[1][1] and all(torch.equal(a, b) for a, b in zip(blocks, reference[1][0]))


def test_a_failed_backward_without_clipping_updates_no_layer_twice():
    # Without max_grad_norm each layer's update runs as soon as its gradients arrive: a fault in the
    # second local backward comes after the last layer's update, which stays (applied once).
    clean = _small_trainer(clip=False)
    before, _ = _state(clean)
    clean.step(_good(5))
    once, _ = _state(clean)
    trainer = _small_trainer(clip=False)
    bwd = [i for i, op in enumerate(trainer.schedules.first.ops) if op.kind.name == "BWD"]
    _Faults(trainer.backend, {(0, bwd[1])})
    n = len(trainer.graph.layers)
    with pytest.raises(megatrain.StepError, match=rf"layers \[{n - 1}\] had already applied") as info:
        trainer.step(_good(5))
    assert info.value.updated_layers == (n - 1,) and trainer.step_count == 0
    blocks, steps = _state(trainer)
    assert [float(s) for s in steps] == [0.0] * (n - 1) + [1.0]
    assert torch.equal(blocks[n - 1], once[n - 1])
    assert all(torch.equal(blocks[i], before[i]) for i in range(n - 1))
    trainer.step(_good(6))
    assert [float(s) for s in trainer.host.steps] == [1.0] * (n - 1) + [2.0]


def test_compile_refuses_encoders_and_sequences_past_the_positions():
    from transformers import BertConfig, BertLMHeadModel

    bert = BertLMHeadModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=64, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))
    with pytest.raises(UnsupportedModelError, match="model_type 'bert' is an encoder family"):
        megatrain.compile(bert, seq_len=8)
    with pytest.raises(ConfigError, match="seq_len=65 exceeds .*max_position_embeddings=64"):
        megatrain.compile(tiny_llama(layers=1), seq_len=65)


def test_optimizer_errors_are_config_errors_that_say_what_to_pass():
    with pytest.raises(ConfigError, match=r"invalid AdamW settings: lr=-1"):
        megatrain.AdamW(lr=-1)
    model = tiny_gpt(layers=1)
    with pytest.raises(ConfigError, match=r"torch.optim.adamw.AdamW.*pass megatrain.AdamW\(lr="):
        megatrain.compile(model, seq_len=8, optimizer=torch.optim.AdamW(model.parameters()))


def test_attention_mask_is_an_input_like_the_token_ids():
    # The same first-step loss as the eager model given the same mask; FP32 on both sides, the
    # difference being only the summation order of per-layer templates (DESIGN.md's 1e-5 relative).
    torch.manual_seed(0)
    model = tiny_llama(layers=1, vocab=VOCAB)
    eager = tiny_llama(layers=1, vocab=VOCAB)
    eager.load_state_dict(model.state_dict())
    batch = _good(1)
    batch["attention_mask"] = torch.ones(2, 8, dtype=torch.long)
    batch["attention_mask"][0, :3] = 0
    with torch.no_grad():
        expected = float(eager(**batch).loss)
        unmasked = float(eager(input_ids=batch["input_ids"], labels=batch["labels"]).loss)
    assert abs(expected - unmasked) > 1e-3, "the mask must change the loss for this test to mean anything"
    trainer = megatrain.compile(model, seq_len=8, micro_batch_size=2,
                                input_names=("input_ids", "attention_mask", "labels"))
    assert trainer.step(batch).loss == pytest.approx(expected, rel=1e-5)


def test_a_host_op_failing_on_the_cuda_backends_worker_leaves_the_trainer_as_if_it_never_ran(reference):
    # The CUDA backend's logic on the CPU (FakeCuda): the second carried OPT raises on the host
    # worker, which skips the host ops queued after it; the GPU op waiting on it raises on the issuing
    # thread. The trainer learns which updates ran, applies the rest, and matches the CPU reference.
    from megatrain.runtime.cuda import CUDABackend
    from megatrain.testing import FakeCuda

    trainer = _small_trainer()
    trainer.backend = trainer.executor.backend = CUDABackend(adapter=FakeCuda())
    first = trainer.step(_good(1)).loss
    faults = _Faults(trainer.backend, {(0, _ops(trainer, "OPT")[1])}, inside=True)
    with pytest.raises(megatrain.StepError, match=r"step 2 failed .*injected fault in OPT:L1.*as if it never saw"):
        trainer.step(_good(5))
    assert len(faults.hits) == 1 and trainer.schedule is trainer.schedules.first
    _assert_as_reference(trainer, reference, first)


def test_an_interrupt_mid_step_is_re_raised_after_the_same_clean_up(reference):
    # A second SIGINT (KeyboardInterrupt) between two carried updates: it propagates as it is, and
    # the trainer has applied the rest of the previous step's update, as for any other failure.
    trainer = _small_trainer()
    first = trainer.step(_good(1)).loss
    _Faults(trainer.backend, {(0, _ops(trainer, "OPT")[1])}, error=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt, match="injected fault"):
        trainer.step(_good(5))
    assert trainer.step_count == 1 and trainer.schedule is trainer.schedules.first
    _assert_as_reference(trainer, reference, first)


def test_deferred_updates_live_in_the_executor_alone():
    """With clipping, a step's updates are owed to the next schedule: the executor holds which layers,
    the clipping scale and the AdamW settings of the step that made them (one place), a carried run
    takes each update it ran off them, and set_lr after the step does not change the owed update."""
    from megatrain.runtime.executor import DeferredUpdates

    trainer = _small_trainer()
    ex = trainer.executor
    assert ex.deferred == DeferredUpdates()
    result = trainer.step(_good(1))
    owed = ex.deferred
    assert owed.layers == frozenset(trainer.schedules.tiles) and owed.optimizer == trainer.optimizer
    assert owed.clip_scale == pytest.approx(min(1.0, 1.0 / (result.grad_norm + 1e-6)))
    assert not any(hasattr(trainer, name) for name in ("_clip_scale", "_pending_optimizer"))
    trainer.set_lr(0.5)
    assert ex.deferred.optimizer == owed.optimizer and ex.deferred.optimizer.lr != 0.5
    trainer.flush()
    assert ex.deferred.layers == frozenset() and ex.updated == sorted(owed.layers)
    trainer.step(_good(2))
    trainer.drop_pending_updates()
    assert ex.deferred == DeferredUpdates()
