"""One global batch, one loss: the mean over its supervised tokens, whatever the split.

Eager PyTorch on the whole global batch is the reference (FP32, the 1e-5 bound of test_exactness):
one forward of every row, the mean of the token losses over every label that is not -100 after
the shift. megatrain must give that loss and its gradients for any split into micro-batches and
data-parallel ranks, when rows carry different numbers of targets (padded, packed and SFT rows) and
when a micro-batch or a whole rank has none. Real gloo ranks are tested in test_distributed (which
trains such batches); here ranks are simulated in one process: each rank's part runs the
data-parallel schedule (COUNT_REDUCE, ALL_REDUCE) with the collectives answered in-process, and the
ranks' gradient tiles are summed, as the ALL_REDUCE sums them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import megatrain
from megatrain.errors import BatchError, ConfigError
from megatrain.planner.lower import lower
from megatrain.ir.plan import default_plan
from megatrain.ir.schedule import OpKind, gradient_tiles
from megatrain.planner.trace import trace
from megatrain.planner.verify import verify
from megatrain.runtime import executor as executor_mod
from megatrain.runtime.loss import loss_weights, micro_batch_means

from conftest import eager_train, random_batch, tiny_gpt, tiny_llama
from test_exactness import RTOL, supervised_tokens
from test_inputs import FAMILIES, OPT, _packed, _padded

S, ROWS, VOCAB = 16, 4, 96


# -- the arithmetic -------------------------------------------------------------------------------

@pytest.mark.parametrize("targets,supervised,micro_batches,per_token,want", [
    ([13, 3], 24, 4, True, [1 / 24, 1 / 24]),  # this rank's two of four micro-batches (13/3/4/4)
    ([0, 5], 5, 2, True, [1 / 5, 1 / 5]),  # a micro-batch without targets: its summed loss is 0
    ([0, 0], 0, 2, True, [0.0, 0.0]),  # a batch without targets: nothing to seed (the step refuses it)
    ([13, 3], 24, 4, False, [1 / 52, 1 / 12]),  # the mean of micro-batch means: 1 / (4 x n_mb)
    ([0, 5], 5, 2, False, [0.0, 1 / 10]),
    ([None, None], None, 4, False, [0.25, 0.25]),  # a loss megatrain cannot count: the model's own, / 4
])
def test_loss_weights(targets, supervised, micro_batches, per_token, want):
    assert loss_weights(targets, supervised, micro_batches, per_token=per_token) == pytest.approx(want, rel=1e-15)


def test_loss_weights_refuse_what_cannot_be_weighed():
    with pytest.raises(ValueError, match="not counted"):
        loss_weights([None], None, 1, per_token=True)
    with pytest.raises(ValueError, match="negative"):
        loss_weights([-1], 3, 1, per_token=False)
    means = micro_batch_means([26.0, 0.0, 3.0], [13, 0, None])
    assert means[0] == 2.0 and math.isnan(means[1]) and means[2] == 3.0


# -- the trace ------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt], ids=["llama", "gpt"])
def test_the_loss_becomes_a_sum_and_its_targets_are_counted_after_the_shift(make):
    """Hugging Face pads the labels with -100 and shifts them; the example GPT slices logits and
    labels: either way the counter counts the labels the loss reads, and a micro-batch's loss is
    the model's mean times that count (0, not NaN, without targets)."""
    torch.manual_seed(0)
    model = make(layers=1)
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=2)
    b = random_batch(2, S, VOCAB, 0)
    b["labels"][0, :9] = -100
    b["labels"][1, 1:] = -100  # only the label at 0, which nothing predicts: no target in this row
    (n,) = trainer.executor.targets([b])
    assert n == supervised_tokens(b) == S - 1 - 8
    with torch.no_grad():  # the model's parameters are views of the trainer's weights, before the step
        res = model(**b)
        mean = (res if isinstance(res, torch.Tensor) else res.loss).item()
    out = trainer.executor.run(trainer.schedules.first, [b])
    assert out.targets == [n] and out.supervised_tokens == n
    assert out.losses[0] == pytest.approx(mean * n, rel=RTOL)
    b["labels"][:] = -100
    assert trainer.executor.targets([b]) == [0]


class _WithAux(nn.Module):
    def __init__(self, smoothing: float = 0.0, aux: float = 0.0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])
        self.head = nn.Linear(8, VOCAB)
        self.smoothing, self.aux = smoothing, aux

    def forward(self, input_ids, labels):
        h = torch.tanh(self.blocks[0](self.emb(input_ids)))
        ce = nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), label_smoothing=self.smoothing)
        return ce + self.aux * h.square().mean() if self.aux else ce


@pytest.mark.parametrize("model,why", [(functools.partial(_WithAux, aux=0.1), "more terms than one"),
                                       (functools.partial(_WithAux, smoothing=0.1), "smooths the labels")],
                         ids=["auxiliary-term", "label-smoothing"])
def test_a_loss_megatrain_cannot_count_trains_only_as_the_mean_of_micro_batch_losses(model, why):
    torch.manual_seed(0)
    traced = trace(model(), micro_batch_size=1, seq_len=S)
    assert traced.count_targets is None and why in traced.graph.meta["uncounted_loss_because"]
    with pytest.raises(ConfigError, match=f"cannot count this model's.*{why}.*per_token_loss=False"):
        megatrain.compile(model(), seq_len=S, micro_batch_size=1)
    # Explicitly: each micro-batch's loss as the model returns it, weighted 1 / micro-batches, as
    # eager gradient accumulation of loss / M.
    m = model()
    ref = copy.deepcopy(m)
    trainer = megatrain.compile(m, seq_len=S, micro_batch_size=1, micro_batches=2, per_token_loss=False)
    b = random_batch(2, S, VOCAB, 1)
    got = trainer.step(b)
    with torch.no_grad():
        want = [ref(**{k: t[i:i + 1] for k, t in b.items()}).item() for i in range(2)]
    assert got.supervised_tokens is None and list(got.micro_batch_losses) == pytest.approx(want, rel=RTOL)
    assert got.loss == pytest.approx(sum(want) / 2, rel=RTOL)


# -- batches whose rows carry different numbers of targets ----------------------------------------

def _sft(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """SFT rows: a prompt (labels -100), an answer (supervised) and right padding; the last row's
    answer was cut at ``S`` before it began, so it has no target at all."""
    b = random_batch(rows, S, VOCAB, seed)
    g = torch.Generator().manual_seed(3000 + seed)
    mask = torch.zeros(rows, S, dtype=torch.long)
    for i in range(rows):
        n = int(torch.randint(6, S + 1, (1,), generator=g))
        prompt = n if i == rows - 1 else int(torch.randint(1, n - 2, (1,), generator=g))
        mask[i, :n] = 1
        b["labels"][i, :prompt] = -100
    b["attention_mask"] = mask
    b["labels"] = b["labels"].masked_fill(mask == 0, -100)
    return b


KINDS = {"padded": (functools.partial(_padded, left=False), ("input_ids", "attention_mask", "labels")),
         "packed": (_packed, ("input_ids", "position_ids", "labels")),
         "sft": (_sft, ("input_ids", "attention_mask", "labels"))}


def _eager_whole_batch(model, batches, max_grad_norm: float | None) -> list[float]:
    """Eager training on each whole batch with torch AdamW."""
    return eager_train(model, batches, torch.optim.AdamW(model.parameters(), **OPT), max_grad_norm, use_cache=False)


@pytest.mark.parametrize("family,kind,micro_batches,clip", [
    ("llama", "padded", 4, 0.05), ("llama", "packed", 4, None), ("llama", "sft", 4, 0.05),
    ("qwen2", "packed", 2, 0.05), ("qwen2", "sft", 4, None),
])
def test_steps_equal_eager_training_on_the_whole_batch(family, kind, micro_batches, clip):
    """Four rows of different target counts, split into micro-batches of one row (a row without
    targets, in the SFT batches, is a micro-batch without targets): the losses and weights of eager
    training on the whole batch, with and without clipping (0.05 clips every step here)."""
    make, names = KINDS[kind]
    torch.manual_seed(0)
    model = FAMILIES[family]()
    ref = copy.deepcopy(model)
    batches = [make(ROWS, s % 2) for s in range(3)]
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=ROWS // micro_batches, micro_batches=micro_batches,
                                optimizer=OPT, input_names=names, max_grad_norm=clip)
    got = [trainer.step(b) for b in batches]
    trainer.flush()
    want = _eager_whole_batch(ref, batches, clip)
    for step, (r, w, b) in enumerate(zip(got, want, batches)):
        assert r.applied and abs(r.loss - w) <= RTOL * abs(w), f"step {step}: megatrain {r.loss} vs eager {w}"
        assert r.supervised_tokens == supervised_tokens(b)
        real = int(b["attention_mask"].sum()) if "attention_mask" in b else ROWS * S
        assert r.tokens == real > r.supervised_tokens  # tokens/s counts every token read, prompts included
    if kind == "sft" and micro_batches == ROWS:
        assert all(math.isnan(r.micro_batch_losses[-1]) for r in got)  # the row without targets
    if clip:
        assert got[0].grad_norm > clip  # the clipping acted
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if not q.requires_grad:
            continue
        err = ((p - q).norm() / q.norm()).item()
        assert err <= RTOL, f"{name}: relative difference {err:.2e}"


def test_a_batch_without_targets_is_refused_and_evaluate_weighs_tokens():
    torch.manual_seed(0)
    model = tiny_llama()
    ref = copy.deepcopy(model)
    names = ("input_ids", "attention_mask", "labels")
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=1, micro_batches=ROWS, optimizer=OPT,
                                input_names=names, max_grad_norm=1.0)
    good = _sft(ROWS, 0)
    trainer.step(good)
    empty = {**good, "labels": torch.full_like(good["labels"], -100)}
    with pytest.raises(BatchError, match="no supervised token.*mean over nothing"):
        trainer.step(empty)
    with pytest.raises(BatchError, match="no supervised token"):
        trainer.evaluate(empty)
    assert trainer.step_count == 1
    trainer.flush()  # the first step's update, still pending: nothing of the empty batch joined it
    _eager_whole_batch(ref, [good], 1.0)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert ((p - q).norm() / q.norm()).item() <= RTOL
    # evaluate: the token mean over all four micro-batches (the model's parameters are views of
    # the trainer's weights), where the mean of their means would differ by 5e-3 here.
    other = _sft(ROWS, 1)
    with torch.no_grad():
        want = model(**other, use_cache=False).loss.item()
    got = trainer.evaluate(other)
    assert got == pytest.approx(want, rel=RTOL)
    # megatrain train's validation loss: its micro-batches evaluated as one batch, token-weighted.
    from megatrain.train.loop import _evaluate

    class Validation:
        def eval_batches(self, rows, count):
            assert (rows, count) == (1, ROWS)
            return iter([{k: v[i:i + 1] for k, v in other.items()} for i in range(ROWS)])

    cfg = mock.Mock(micro_batch_size=1, eval_batches=ROWS)
    assert _evaluate(trainer, Validation(), cfg) == pytest.approx(want, rel=RTOL)


# -- every split, ranks simulated in one process --------------------------------------------------

SPLITS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (1, 4)]
"""(micro-batches, ranks) of a global batch of four rows; each micro-batch holds 4 / (M x R) rows."""


@pytest.fixture(scope="module")
def probes():
    """One trainer per micro-batch size (1, 2 and 4 rows), all with the same weights, and the eager model."""
    torch.manual_seed(0)
    model = tiny_llama()
    trainers = {mbs: megatrain.compile(copy.deepcopy(model), seq_len=S, micro_batch_size=mbs, optimizer=OPT,
                                       input_names=("input_ids", "attention_mask", "labels"))
                for mbs in (1, 2, 4)}
    return trainers, model


def _split_gradients(trainer, batch, micro_batches: int, ranks: int, layer_by_layer: bool):
    """The loss and gradients of ``batch`` when ``ranks`` ranks of ``micro_batches`` micro-batches
    each train it: each rank's part runs the plan's data-parallel train schedule (optimizer steps
    deferred, so the gradients stay in the host tiles), with COUNT_REDUCE answered by the global
    batch's count and ALL_REDUCE leaving each rank's tiles as they are; the ranks' tiles are then
    summed (what ALL_REDUCE's sum would give every rank)."""
    graph, ex = trainer.graph, trainer.executor
    plan = dataclasses.replace(default_plan(graph, micro_batches, clip_gradients=True), data_parallel=ranks,
                               layer_by_layer=layer_by_layer)
    schedule = lower(graph, plan)
    verify(schedule, graph)
    assert sum(op.kind is OpKind.COUNT_REDUCE for op in schedule.ops) == (ranks > 1)
    mbs = trainer.options.micro_batch_size
    parts = [{n: t[i * mbs:(i + 1) * mbs] for n, t in batch.items()} for i in range(micro_batches * ranks)]
    total = supervised_tokens(batch)
    grads: dict[str, torch.Tensor] = {}
    summed = 0.0
    answer = lambda values, dtype, group: torch.tensor([total], dtype=dtype)  # noqa: E731
    with mock.patch.object(executor_mod, "sum_over_ranks", answer), \
            mock.patch("torch.distributed.all_reduce", lambda *a, **k: None):
        for r in range(ranks):
            out = ex.run(schedule, parts[r * micro_batches:(r + 1) * micro_batches])
            assert out.supervised_tokens == total
            summed += sum(out.losses)
            tiles = ex._buffers.accumulators if plan.accumulates_on_host else ex._buffers.ring
            for li, k in gradient_tiles(graph).items():
                for p in graph.layers[li].params:
                    if p.trainable:
                        g = tiles[k][p.offset:p.offset + p.numel].view(p.shape)
                        grads[p.name] = grads[p.name] + g if p.name in grads else g.clone()
    return summed / total, grads


@st.composite
def _global_batches(draw):
    """Four rows of 1..S real tokens (right or left padding), each with a prompt of 0..all of them
    whose labels are -100 (so a row, a micro-batch or a rank may have no target), and at least one
    target in the batch."""
    seed = draw(st.integers(0, 2**16))
    b = random_batch(ROWS, S, VOCAB, seed)
    mask = torch.zeros(ROWS, S, dtype=torch.long)
    left = draw(st.booleans())
    for i in range(ROWS):
        n = draw(st.integers(1, S))
        prompt = draw(st.integers(0, n))
        real = slice(S - n, S) if left else slice(0, n)
        mask[i, real] = 1
        b["labels"][i, real.start:real.start + prompt] = -100
    b["attention_mask"] = mask
    b["labels"] = b["labels"].masked_fill(mask == 0, -100)
    return b


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=_global_batches().filter(lambda b: supervised_tokens(b) > 0), layer_by_layer=st.booleans())
def test_every_split_of_a_global_batch_gives_the_whole_batch_loss_and_gradients(probes, batch, layer_by_layer):
    trainers, model = probes
    ref = copy.deepcopy(model)
    loss = ref(**batch, use_cache=False).loss
    loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for m, r in SPLITS:
        got, grads = _split_gradients(trainers[ROWS // (m * r)], batch, m, r, layer_by_layer)
        assert abs(got - loss.item()) <= RTOL * loss.item(), f"{m} micro-batches x {r} ranks: {got} vs {loss.item()}"
        assert set(grads) == set(want)
        for name, g in grads.items():
            err = ((g - want[name]).norm() / want[name].norm()).item()
            assert err <= RTOL, f"{m} micro-batches x {r} ranks, {name}: relative difference {err:.2e}"


def test_bf16_steps_of_uneven_micro_batches_track_eager_autocast_on_the_whole_batch():
    """BF16 compute, SFT rows in four micro-batches of one row (the last without targets): at every
    step the loss and gradient norm of eager BF16 autocast on the whole batch at the same weights,
    within the derived bounds of test_exactness (summation order and the BF16 residual stream; the
    split adds only FP32 summation order)."""
    from megatrain.ir.plan import Plan

    from test_exactness import assert_bf16_tracks_eager

    torch.manual_seed(5)
    model = tiny_llama(layers=2)
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=1, micro_batches=ROWS, optimizer=OPT,
                                input_names=("input_ids", "attention_mask", "labels"),
                                plan=Plan(micro_batches=ROWS, compute_dtype="bfloat16"))
    assert_bf16_tracks_eager(model, trainer, [_sft(ROWS, s % 2) for s in range(4)], blocks=2)
