"""Preference and RL training: per-token log-probabilities, steps on GRPO and DPO losses, the
reference model, weights out to a rollout engine.

Eager PyTorch on the whole global batch is the reference, as in test_token_loss (FP32, the 1e-5 of
test_exactness): the model's logits, ``log_softmax(logits.float(), -1).gather(...)`` at the
labels, and the loss written here as TRL and VERL compute it on a whole batch (independently of
megatrain.rl.losses). megatrain must give that loss and its gradients for every split into
micro-batches and data-parallel ranks (ranks simulated in one process as test_token_loss does:
each rank's part runs the data-parallel schedule with the collectives answered in-process; real
gloo ranks in test_grpo_and_dpo_on_two_gloo_ranks_equal_one_process).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import weakref
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import megatrain
from megatrain.errors import BatchError, ConfigError
from megatrain.ir.plan import default_plan
from megatrain.ir.schedule import gradient_tiles
from megatrain.kernels.logprobs import linear_logprobs
from megatrain.planner.lower import lower
from megatrain.planner.trace import trace
from megatrain.planner.trace.token_logprobs import logprobs_template
from megatrain.planner.verify import verify
from megatrain.rl import (DPOLoss, GRPOLoss, Reference, gpu_released, group_advantages, interleave_pairs,
                          precompute_reference, release_gpu, retake_gpu, rollout_weights, target_mask)
from megatrain.rl import logprobs as rl_logprobs
from megatrain.runtime import executor as executor_mod

from conftest import random_batch, tiny_gpt, tiny_llama
from test_exactness import ADAMW, RTOL
from test_token_loss import SPLITS, probes  # noqa: F401 (a fixture: four rows, trainers of 1, 2 and 4 per micro-batch)

S, ROWS, VOCAB = 16, 4, 96
NAMES = ("input_ids", "attention_mask", "labels")


# -- eager references on the whole batch -----------------------------------------------------------

def eager_logprobs(model, batch, entropy: bool = False):
    """``[rows, S]``: ``log_softmax(logits.float())`` at ``labels[:, t]`` from the logits at ``t - 1``,
    0 where there is no target (and the entropy of that distribution)."""
    kw = {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}
    out = model(input_ids=batch["input_ids"], **kw, **({"use_cache": False} if hasattr(model, "config") else {}))
    logits = (out if isinstance(out, torch.Tensor) else out.logits).float()
    ls = F.log_softmax(logits, -1)[:, :-1]
    labels = batch["labels"][:, 1:]
    lp = ls.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    mask = target_mask(batch["labels"])
    lp = torch.where(mask, F.pad(lp, (1, 0)), 0.0)
    if not entropy:
        return lp
    return lp, torch.where(mask, F.pad(-(ls.exp() * ls).sum(-1), (1, 0)), 0.0)


def eager_grpo(lp, batch, *, clip_low=0.2, clip_high=None, kl_coef=0.0, aggregation="token-mean", magnitude=False):
    """GRPO on the whole batch, VERL's way: PPO's clipped surrogate per token plus ``kl_coef`` x k3,
    then ``agg_loss`` over the response mask. ``magnitude``: the same aggregation of the token
    losses' absolute values, the scale of the rounding error of their signed sum (advantages of
    both signs make the loss itself nearly cancel: it is no scale for an error)."""
    m = target_mask(batch["labels"]).float()
    adv = batch["advantages"]
    adv = adv[:, None] if adv.dim() == 1 else adv
    old = batch.get("old_logprobs", lp.detach())
    ratio = torch.exp(lp - old)
    clip_high = clip_low if clip_high is None else clip_high
    loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    if kl_coef:
        d = batch["ref_logprobs"] - lp
        loss = loss + kl_coef * (d.exp() - d - 1)
    if magnitude:
        loss = loss.abs()
    if aggregation == "token-mean":
        return (loss * m).sum() / m.sum()
    if aggregation == "seq-mean-token-mean":
        return ((loss * m).sum(-1) / m.sum(-1)).mean()
    return (loss * m).sum() / m.shape[-1]


def eager_dpo(lp, batch, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0):
    """DPO on the whole batch, TRL's ``dpo_loss`` way: summed (IPO: averaged) log-probabilities of
    chosen (even rows) and rejected (odd rows) responses, policy and reference."""
    m = target_mask(batch["labels"]).float()

    def seq(x):
        s = (x * m).sum(-1)
        return s / m.sum(-1) if loss_type == "ipo" else s
    pi, ref = seq(lp), seq(batch["ref_logprobs"])
    logits = (pi[0::2] - pi[1::2]) - (ref[0::2] - ref[1::2])
    if loss_type == "ipo":
        return ((logits - 1 / (2 * beta)) ** 2).mean()
    return (-F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing).mean()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# -- batches ---------------------------------------------------------------------------------------

def _responses(rows: int, seed: int, *, left: bool = False, prompt_max: int = 8) -> dict[str, torch.Tensor]:
    """Rows of a prompt (labels -100) and a response of at least one token, padded to S on the right
    (or left); the mask is 0 and the labels -100 on padding."""
    b = random_batch(rows, S, VOCAB, seed)
    g = torch.Generator().manual_seed(5000 + seed)
    length = torch.randint(4, S + 1, (rows,), generator=g)
    prompt = 1 + (torch.rand(rows, generator=g) * (length - 1).clamp(max=prompt_max)).long()  # 1 .. length - 1
    start = S - length if left else torch.zeros_like(length)
    pos = torch.arange(S)
    real = (pos >= start[:, None]) & (pos < (start + length)[:, None])
    b["attention_mask"] = real.long()
    b["labels"] = b["labels"].masked_fill(~real | (pos < (start + prompt)[:, None]), -100)
    return b


def _grpo_batch(model, rows: int, seed: int, *, per_token: bool = False, left: bool = False) -> dict:
    """A GRPO batch: responses with group advantages (or per-token ones), and old and reference
    log-probabilities near the model's (rollout-time policy and reference differ a little)."""
    b = _responses(rows, seed, left=left)
    g = torch.Generator().manual_seed(7000 + seed)
    with torch.no_grad():
        lp = eager_logprobs(model, b)
    mask = target_mask(b["labels"])
    b["advantages"] = (torch.randn(rows, S, generator=g) if per_token
                       else group_advantages(torch.randn(rows, generator=g), 2))
    b["old_logprobs"] = torch.where(mask, lp + 0.3 * torch.randn(rows, S, generator=g), 0.0)
    b["ref_logprobs"] = torch.where(mask, lp + 0.3 * torch.randn(rows, S, generator=g), 0.0)
    return b


def _dpo_batch(model, pairs: int, seed: int) -> dict:
    b = _responses(2 * pairs, seed)
    g = torch.Generator().manual_seed(9000 + seed)
    with torch.no_grad():
        lp = eager_logprobs(model, b)
    b["ref_logprobs"] = torch.where(target_mask(b["labels"]), lp + 0.5 * torch.randn(2 * pairs, S, generator=g), 0.0)
    return b


# -- the kernel ------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_equals_log_softmax_gather_and_its_gradient_for_any_seed(chunk, bias):
    g = torch.Generator().manual_seed(chunk)
    n, d, v = 37, 12, 50
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.randn(v, d, generator=g, requires_grad=True)
    b = torch.randn(v, generator=g, requires_grad=True) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[[3, 20]] = -100
    seed = torch.randn(n, generator=g)
    lp, ent = linear_logprobs(h, w, b, t, chunk_tokens=chunk, entropy=True)
    got = torch.autograd.grad((lp * seed).sum(), [x for x in (h, w, b) if x is not None])
    ls = F.log_softmax(F.linear(h, w, b).float(), -1)
    valid = t != -100
    want = torch.where(valid, ls.gather(1, t.clamp(min=0)[:, None]).squeeze(1), 0.0)
    want_ent = torch.where(valid, -(ls.exp() * ls).sum(-1), 0.0)
    assert ent.requires_grad is False and (lp[~valid] == 0).all()
    assert torch.allclose(lp, want, rtol=RTOL, atol=RTOL) and torch.allclose(ent, want_ent, rtol=RTOL, atol=RTOL)
    for a, e in zip(got, torch.autograd.grad((want * seed).sum(), [x for x in (h, w, b) if x is not None])):
        assert _rel(a, e) <= RTOL
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_logprobs(h, w, b, t, chunk_tokens=0)


def test_only_a_loss_layer_with_the_fused_lm_head_gives_per_token_log_probabilities():
    # (A fused one does: every logprobs test below runs its per-token template.)
    plain = trace(tiny_llama(layers=1), micro_batch_size=2, seq_len=S, loss_chunk_bytes=None)
    last = plain.graph.layers[-1]
    with pytest.raises(ConfigError, match="chunked LM head fused with the loss"):
        logprobs_template(plain.templates[last.template], last.outputs.index(plain.graph.loss))


# -- per-token log-probabilities -------------------------------------------------------------------

class _Logits(TorchDispatchMode):
    """The most rows of logits (a tensor whose last dimension is the vocabulary) any op returns
    while active."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view (the head's weight transposed for its matmul) holds no logits of its own
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB:
                self.rows = max(self.rows, t.numel() // VOCAB)
        return out


# The GPT's width is 40: its fused QKV projection (3 x width) is then not as wide as the vocabulary.
@pytest.mark.parametrize("make,mbs,left", [(tiny_llama, 1, False), (tiny_llama, 4, True),
                                           (functools.partial(tiny_gpt, d_model=40), 2, False)],
                         ids=["llama-mbs1", "llama-mbs4-left-padded", "gpt-mbs2"])
def test_logprobs_equal_eager_on_the_whole_batch_without_the_logits_and_touch_nothing(monkeypatch, make, mbs, left):
    """Chunks of 5 tokens (the LM head's rows): no tensor of a micro-batch's ``[tokens, vocab]``
    logits exists; the values and entropies are eager's, 0 where there is no target; the masters,
    moments and step counts are unchanged."""
    from megatrain.planner import front

    monkeypatch.setattr(front, "trace", functools.partial(trace, loss_chunk_bytes=4 * VOCAB * 5))
    torch.manual_seed(0)
    model = make(layers=2)
    ref = copy.deepcopy(model)
    gpt = make is not tiny_llama
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=mbs, input_names=NAMES[::2] if gpt else NAMES)
    batch = _responses(ROWS, 3, left=left)
    if gpt:
        del batch["attention_mask"]
    before = {k: v.clone() for k, v in trainer.state_dict()["masters"].items()}
    with _Logits() as seen:
        lp, ent = trainer.logprobs(batch, entropy=True)
    assert seen.rows == 5  # a chunk, of the rows the LM head reads (mbs x S)
    with torch.no_grad():
        want, want_ent = eager_logprobs(ref, batch, entropy=True)
    assert lp.dtype == torch.float32 and lp.shape == (ROWS, S)
    assert torch.allclose(lp, want, rtol=RTOL, atol=RTOL), (lp - want).abs().max()
    assert torch.allclose(ent, want_ent, rtol=RTOL, atol=RTOL)
    assert ((lp != 0) == target_mask(batch["labels"])).all() and (lp[:, 0] == 0).all()
    assert torch.equal(trainer.logprobs(batch), lp)
    state = trainer.state_dict()
    assert all(torch.equal(state["masters"][k], v) for k, v in before.items())
    assert all(s == 0 for s in state["adam_steps"].values()) and trainer.step_count == 0


def test_logprobs_refuse_what_they_cannot_align():
    torch.manual_seed(0)
    trainer = megatrain.compile(tiny_llama(layers=1), seq_len=S, micro_batch_size=2, input_names=NAMES)
    b = _responses(ROWS, 0)
    with pytest.raises(BatchError, match="multiple of micro_batch_size=2"):
        trainer.logprobs({k: v[:3] for k, v in b.items()})
    with pytest.raises(BatchError, match="dict of tensors"):
        trainer.logprobs(b["input_ids"])
    from test_token_loss import _WithAux

    uncounted = megatrain.compile(_WithAux(aux=0.1), seq_len=S, micro_batch_size=2, per_token_loss=False)
    with pytest.raises(ConfigError, match="cannot count this model's.*more terms than one"):
        uncounted.logprobs({"input_ids": b["input_ids"], "labels": b["labels"]})


# -- a step on a per-token loss: every split of the global batch -----------------------------------

def _split_gradients(trainer, batch, loss, micro_batches: int, ranks: int, layer_by_layer: bool):
    """The loss and gradients of ``batch`` when ``ranks`` ranks of ``micro_batches`` micro-batches
    each train it on ``loss``: each rank's part runs the data-parallel train schedule (updates
    deferred, so the gradients stay in the host tiles) with its loss head, whose totals the
    all-reduce would make the global batch's (answered here with them); the ranks' tiles summed."""
    graph, ex = trainer.graph, trainer.executor
    plan = dataclasses.replace(default_plan(graph, micro_batches, clip_gradients=True), data_parallel=ranks,
                               layer_by_layer=layer_by_layer)
    schedule = lower(graph, plan)
    verify(schedule, graph)
    mbs = trainer.options.micro_batch_size
    model, tensors = rl_logprobs.loss_inputs(trainer, batch, loss)
    totals = loss.totals(target_mask(batch["labels"]), tensors)
    count = int(target_mask(batch["labels"]).sum())
    per_rank = mbs * micro_batches
    grads: dict[str, torch.Tensor] = {}
    summed = 0.0
    with mock.patch.object(executor_mod, "sum_over_ranks", lambda v, dtype, g: torch.tensor([count], dtype=dtype)), \
            mock.patch("torch.distributed.all_reduce", lambda *a, **k: None), \
            mock.patch.object(rl_logprobs, "_over_ranks", lambda tr, error, t: totals), \
            mock.patch.object(trainer, "plan", plan):
        for r in range(ranks):
            rows = slice(r * per_rank, (r + 1) * per_rank)
            parts = [{n: t[rows][i * mbs:(i + 1) * mbs] for n, t in model.items()} for i in range(micro_batches)]
            head = rl_logprobs.loss_head(trainer, parts, {k: v[rows] for k, v in tensors.items()}, loss)
            out = ex.run(schedule, parts, head=head)
            summed += sum(out.losses)
            tiles = ex._buffers.accumulators if plan.accumulates_on_host else ex._buffers.ring
            for li, k in gradient_tiles(graph).items():
                for p in graph.layers[li].params:
                    g = tiles[k][p.offset:p.offset + p.numel].view(p.shape)
                    grads[p.name] = grads[p.name] + g if p.name in grads else g.clone()
    return summed, grads


def _scale(eager, lp, batch) -> float:
    """What a loss's rounding error is relative to: the loss, or for GRPO's signed token losses the
    same aggregation of their magnitudes (:func:`eager_grpo`)."""
    with torch.no_grad():
        return abs(eager(lp, batch, magnitude=True).item()) if eager.func is eager_grpo else abs(eager(lp, batch).item())


def _check_every_split(probes, batch, loss, eager, layer_by_layer, splits=SPLITS):
    trainers, model = probes
    ref = copy.deepcopy(model)
    lp = eager_logprobs(ref, batch)
    want_loss = eager(lp, batch)
    scale = _scale(eager, lp, batch)
    want_loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    for m, r in splits:
        got, grads = _split_gradients(trainers[ROWS // (m * r)], batch, loss, m, r, layer_by_layer)
        assert abs(got - want_loss.item()) <= RTOL * scale, f"{m} x {r}: {got} vs {want_loss.item()}"
        for name, g in grads.items():
            err = _rel(g, want[name])
            assert err <= RTOL, f"{m} micro-batches x {r} ranks, {name}: relative difference {err:.2e}"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), per_token=st.booleans(), left=st.booleans(),
       aggregation=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
       kl=st.sampled_from([0.0, 0.05]), clip_high=st.sampled_from([None, 0.28]), layer_by_layer=st.booleans())
def test_grpo_steps_give_the_whole_batch_loss_and_gradients_for_every_split(probes, seed, per_token, left, aggregation,
                                                                              kl, clip_high, layer_by_layer):
    batch = _grpo_batch(probes[1], ROWS, seed, per_token=per_token, left=left)
    opts = dict(kl_coef=kl, clip_high=clip_high, aggregation=aggregation)
    _check_every_split(probes, batch, GRPOLoss(**opts), functools.partial(eager_grpo, **opts), layer_by_layer)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), kind=st.sampled_from([("sigmoid", 0.0), ("sigmoid", 0.1), ("ipo", 0.0)]),
       beta=st.sampled_from([0.1, 0.5]), layer_by_layer=st.booleans())
def test_dpo_steps_give_the_whole_batch_loss_and_gradients_for_every_split(probes, seed, kind, beta, layer_by_layer):
    """Pairs stay in one micro-batch: splits of micro-batches of two or four rows."""
    batch = _dpo_batch(probes[1], ROWS // 2, seed)
    opts = dict(beta=beta, loss_type=kind[0], label_smoothing=kind[1])
    _check_every_split(probes, batch, DPOLoss(**opts), functools.partial(eager_dpo, **opts), layer_by_layer,
                       splits=[(1, 1), (2, 1), (1, 2)])


@pytest.mark.parametrize("kind", ["grpo", "dpo"])
def test_steps_on_a_loss_train_as_eager_adamw_on_the_whole_batch(kind):
    """Three steps, clipped (the update deferred to the next step) and not: the losses and the
    weights of eager training with torch's AdamW on each whole batch."""
    torch.manual_seed(1)
    model = tiny_llama()
    ref = copy.deepcopy(model)
    if kind == "grpo":
        batches = [_grpo_batch(ref, ROWS, s, per_token=s == 1) for s in range(3)]
        loss, eager = GRPOLoss(kl_coef=0.1, clip_high=0.28), functools.partial(eager_grpo, kl_coef=0.1, clip_high=0.28)
    else:
        batches = [_dpo_batch(ref, ROWS // 2, s) for s in range(3)]
        loss, eager = DPOLoss(beta=0.5), functools.partial(eager_dpo, beta=0.5)
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=2, micro_batches=2, optimizer=ADAMW,
                                input_names=NAMES, max_grad_norm=1.0)
    got = [trainer.step(b, loss=loss) for b in batches]
    trainer.flush()
    opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for r, b in zip(got, batches):
        opt.zero_grad()
        lp = eager_logprobs(ref, b)
        want = eager(lp, b)
        scale = _scale(eager, lp, b)
        want.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        assert r.applied and abs(r.loss - want.item()) <= RTOL * scale
        assert abs(r.grad_norm - norm.item()) <= RTOL * norm.item()
        assert sum(r.micro_batch_losses) == pytest.approx(r.loss, rel=1e-12)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert _rel(p, q) <= RTOL, name


def _state(trainer):
    s = trainer.state_dict()
    return {k: v.clone() for k, v in {**s["masters"], **s["optimizer"]}.items()}, dict(s["adam_steps"])


def _nan_advantage(b):
    b["advantages"][1] = float("nan")


def _empty_response(b):
    b["labels"][2, :] = -100


def _inf_old(b):
    b["old_logprobs"][0, 3] = float("inf")


def _short_tensor(b):
    b["advantages"] = b["advantages"][:3]


def _stray_key(b):
    b["rewards"] = torch.zeros(ROWS)


def _int_advantages(b):
    b["advantages"] = torch.ones(ROWS, dtype=torch.long)


@pytest.mark.parametrize("spoil,match", [
    (_nan_advantage, r"batch\['advantages'\] holds nan at \[1\]"),
    (_empty_response, "row 2 of the batch has no token with a label"),
    (_inf_old, r"batch\['old_logprobs'\] holds inf at \[0, 3\]"),
    (_short_tensor, r"takes it as float \[4, 16\].*or \[4\]"),
    (_stray_key, r"tensors \['rewards'\] that neither the model"),
    (_int_advantages, "takes it as float"),
    (lambda b: b.pop("advantages"), r"GRPOLoss needs batch\['advantages'\]"),
    (lambda b: b.pop("ref_logprobs"), r"kl_coef=0.1\) needs batch\['ref_logprobs'\]"),
], ids=["nan-advantage", "empty-response", "inf-old-logprob", "short-tensor", "stray-key", "int-advantages",
        "no-advantages", "no-reference"])
def test_bad_grpo_input_gets_one_error_and_no_update(spoil, match):
    torch.manual_seed(0)
    model = tiny_llama(layers=1)
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=2, micro_batches=2, optimizer=ADAMW,
                                input_names=NAMES)
    good = _grpo_batch(model, ROWS, 0)
    trainer.step(good, loss=GRPOLoss(kl_coef=0.1))
    before = _state(trainer)
    bad = {k: v.clone() for k, v in good.items()}
    spoil(bad)
    with pytest.raises(BatchError, match=match):
        trainer.step(bad, loss=GRPOLoss(kl_coef=0.1))
    after = _state(trainer)
    assert trainer.step_count == 1 and after[1] == before[1]
    assert all(torch.equal(after[0][k], v) for k, v in before[0].items())


def test_bad_dpo_input_and_settings_are_refused():
    torch.manual_seed(0)
    model = tiny_llama(layers=1)
    pairs = _dpo_batch(model, 2, 0)
    chosen = {k: v[0::2] for k, v in pairs.items()}
    rejected = {k: v[1::2] for k, v in pairs.items()}
    assert all(torch.equal(interleave_pairs(chosen, rejected)[k], v) for k, v in pairs.items())
    with pytest.raises(BatchError, match=r"chosen\['input_ids'\] has shape \(2, 16\) but rejected\['input_ids'\] "
                                         r"\(1, 16\)"):
        interleave_pairs(chosen, {k: v[:1] for k, v in rejected.items()})
    with pytest.raises(BatchError, match="same"):
        interleave_pairs(chosen, {k: v for k, v in rejected.items() if k != "ref_logprobs"})
    odd = megatrain.compile(copy.deepcopy(model), seq_len=S, micro_batch_size=1, micro_batches=4, input_names=NAMES)
    with pytest.raises(ConfigError, match="micro_batch_size=1 would split them"):
        odd.step(pairs, loss=DPOLoss())
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=2, micro_batches=2, input_names=NAMES)
    with pytest.raises(BatchError, match="has 3 rows"):  # (a trainer's even micro-batches never give it such rows)
        DPOLoss().whole(torch.zeros(3, S), target_mask(pairs["labels"][:3]), {"ref_logprobs": torch.zeros(3, S)})
    empty = {k: v.clone() for k, v in pairs.items()}
    empty["labels"][1] = -100  # a rejected response without a token
    with pytest.raises(BatchError, match="row 1 of the batch has no token"):
        trainer.step(empty, loss=DPOLoss())
    assert trainer.step_count == 0 and odd.step_count == 0
    for bad in (dict(beta=0.0), dict(loss_type="hinge"), dict(label_smoothing=0.5), dict(loss_type="ipo",
                                                                                        label_smoothing=0.1)):
        with pytest.raises(ConfigError, match="DPOLoss"):
            DPOLoss(**bad)
    for bad in (dict(clip_low=1.0), dict(kl_coef=-1.0), dict(aggregation="seq-sum"), dict(max_tokens=0)):
        with pytest.raises(ConfigError, match="GRPOLoss"):
            GRPOLoss(**bad)
    with pytest.raises(ConfigError, match="TokenLoss"):
        trainer.step(pairs, loss=lambda lp, mask, t, totals: lp.sum())


def test_group_advantages_are_grpo_and_dr_grpo_and_refuse_groups_of_one():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    adv = group_advantages(r, 3)
    g = r.view(2, 3)
    assert torch.allclose(adv, ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).flatten())
    assert torch.allclose(group_advantages(r, 2, scale=False), torch.tensor([0.5, -0.5, 0.0, 0.0, -1.0, 1.0]))
    with pytest.raises(BatchError, match="group_size=1.*at least 2"):
        group_advantages(r, 1)
    with pytest.raises(BatchError, match="do not split into groups of 4"):
        group_advantages(r, 4)
    with pytest.raises(BatchError, match="reward nan of row 2 is not finite"):
        group_advantages(torch.tensor([1.0, 0.0, math.nan, 1.0]), 2)
    # Equal rewards: no advantage. Eight 0.1s average to 0.1 + 7.5e-9 in FP32, which over eps = 1e-6
    # would be an advantage of -0.0075 each (what a GRPO run whose groups agree trained on before).
    r = torch.tensor([0.1] * 8 + [0.0, 1.0] * 4)
    assert (r[:8] - r[:8].mean()).abs().max() > 0  # the rounding is there
    adv = group_advantages(r, 8)
    assert torch.equal(adv[:8], torch.zeros(8)) and adv[8:].abs().min() > 0.9
    assert torch.equal(group_advantages(r, 8, scale=False)[:8], torch.zeros(8))


# -- the reference model ---------------------------------------------------------------------------

def test_a_bf16_reference_is_the_model_with_bf16_weights_counted_by_the_planner_and_frozen():
    torch.manual_seed(0)
    model = tiny_llama()
    start = copy.deepcopy(model)
    with pytest.raises(ConfigError, match="compile with reference='bfloat16'"):
        Reference(megatrain.compile(copy.deepcopy(model), seq_len=S, micro_batch_size=2, input_names=NAMES))
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=2, micro_batches=2, input_names=NAMES,
                                optimizer=ADAMW, reference="bfloat16")
    numel = sum(layer.numel for layer in trainer.graph.layers)
    mem = trainer.planned.memory
    assert mem.reference_weights == 2 * numel and ("host", "BF16 reference weights (frozen)", 2 * numel) in mem.rows()
    assert mem.host_total == dataclasses.replace(mem, reference_weights=0).host_total + 2 * numel
    reference = Reference(trainer)
    assert reference.nbytes == 2 * numel
    batch = _responses(ROWS, 1)
    offline = precompute_reference(trainer, [batch])[0]["ref_logprobs"]  # the initial policy, FP32
    with torch.no_grad():
        assert torch.allclose(offline, eager_logprobs(start, batch), rtol=RTOL, atol=RTOL)
        rounded = copy.deepcopy(start).to(torch.bfloat16).float()
        want = eager_logprobs(rounded, batch)
    for _ in range(2):
        trainer.step(_grpo_batch(model, ROWS, 2), loss=GRPOLoss())
    masters = {k: v.clone() for k, v in trainer.state_dict()["masters"].items()}
    got = reference.logprobs(batch)
    assert torch.allclose(got, want, rtol=RTOL, atol=RTOL), (got - want).abs().max()
    assert all(torch.equal(trainer.state_dict()["masters"][k], v) for k, v in masters.items())
    assert not torch.allclose(trainer.logprobs(batch), got, atol=1e-3)  # the policy moved on
    # A saved copy (what a resumed run reads from its checkpoint) is the same reference on a trainer
    # whose weights moved on; a copy of another size or dtype is refused naming both.
    again = Reference(trainer, weights=reference.weights.clone())
    assert torch.equal(again.logprobs(batch), got)
    for bad in (reference.weights[:-1], reference.weights.float()):
        with pytest.raises(ConfigError, match=rf"reference weights: {bad.dtype} \({bad.numel()},\) given, but this "
                                              rf"model's reference is torch.bfloat16 \({numel},\)"):
            Reference(trainer, weights=bad)


def test_a_bf16_reference_under_bf16_compute_is_the_policy_cast_and_leaves_its_casts_alone():
    """BF16 compute casts each master to BF16 for the GPU (a CAST into a staging tile, one per layer
    with cast_once): the reference's copy is that cast, so before any step its log-probabilities
    are the policy's, bit for bit. Its CASTs write the same tiles; the policy's next step casts its
    own masters again and trains exactly as a twin that never ran the reference."""
    from megatrain.ir.plan import Plan

    torch.manual_seed(0)
    model = tiny_llama()
    twin = copy.deepcopy(model)
    plan = Plan(micro_batches=2, compute_dtype="bfloat16", cast_once=True)
    trainers = [megatrain.compile(m, seq_len=S, micro_batch_size=2, micro_batches=2, input_names=NAMES, plan=plan,
                                  optimizer=ADAMW, reference="bfloat16") for m in (model, twin)]
    reference = Reference(trainers[0])
    batch, step = _responses(ROWS, 4), _grpo_batch(model, ROWS, 5)
    assert torch.equal(reference.logprobs(batch), trainers[0].logprobs(batch))
    got, want = (t.step(step, loss=GRPOLoss()) for t in trainers)
    assert got.loss == want.loss and all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert not torch.equal(reference.logprobs(batch), trainers[0].logprobs(batch))


def test_the_planner_leaves_host_memory_for_a_reference_and_the_cli_shows_it(capsys, tmp_path):
    """With host memory for the plan alone and half the reference, the solver plans with the
    reference counted: a plan whose total, the reference included, fits, or none."""
    import json

    from megatrain.cli import main
    from megatrain.errors import PlanError
    from megatrain.ir.hardware import load_hardware
    from megatrain.planner.front import PlanRequest, Storage, plan

    model = tiny_llama(layers=2, device="meta")
    with pytest.raises(ConfigError, match="reference='float16'"):
        plan(PlanRequest(model, S, 4, None, hardware="H100_SXM", storage=Storage(reference="float16")))
    planned = plan(PlanRequest(model, S, 4, None, hardware="H100_SXM", device="cuda"))
    alone, ref = planned.memory, 2 * sum(layer.numel for layer in planned.graph.layers)
    room = alone.host_total + ref // 2  # the plan alone fits, with the reference it would not
    tight = load_hardware("H100_SXM").model_copy(update={"host_memory_bytes": room, "pinned_memory_cap_bytes": room})
    try:
        with_ref = plan(PlanRequest(model, S, 4, None, hardware=tight, device="cuda",
                                    storage=Storage(reference="bfloat16"))).memory
        assert with_ref.reference_weights == ref and with_ref.host_total <= room
    except PlanError:
        pass  # no plan leaves it room: also right
    (tmp_path / "config.json").write_text(json.dumps({**tiny_llama(layers=2, device="meta").config.to_dict()}))
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--hardware", "H100_SXM", "--seq-len", str(S),
                 "--global-batch", "4", "--reference", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "BF16 reference weights (frozen)" in out and "reference model: a frozen BF16 copy" in out


# -- weights out to a rollout engine ---------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_rollout_weights_are_the_trained_weights_in_bf16_buckets_under_hf_names(tied):
    torch.manual_seed(0)
    model = tiny_llama(tie_word_embeddings=tied)
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=2, input_names=NAMES, max_grad_norm=1.0)
    trainer.step(_grpo_batch(model, 2, 0), loss=GRPOLoss())  # deferred: rollout_weights applies it first
    limit = 8 * 1024
    buckets = list(rollout_weights(trainer, bucket_bytes=limit))
    trained = dict(model.named_parameters())  # the update was applied: the module sees it
    names = [n for bucket in buckets for n, _ in bucket]
    assert sorted(names) == sorted(trained) and len(set(names)) == len(names)  # a tied weight once, as HF lists it
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1
        for name, t in bucket:
            assert t.dtype == torch.bfloat16 and torch.equal(t, trained[name].detach().to(torch.bfloat16))
    assert len(buckets) > 1 and trainer.executor.deferred.layers == frozenset()
    with pytest.raises(ConfigError, match="bucket_bytes=0"):
        next(rollout_weights(trainer, bucket_bytes=0))


def test_release_and_retake_the_gpu_between_steps_on_the_fake_cuda_backend():
    """The GPU slots are freed (nothing holds them: the fake CUDA's tensors are gone) and made
    again before the next step, which trains as if nothing happened."""
    from megatrain.runtime.cuda import CUDABackend
    from megatrain.testing import FakeCuda

    torch.manual_seed(0)
    model = tiny_llama()
    twin = copy.deepcopy(model)
    batches = [_grpo_batch(model, ROWS, s) for s in range(2)]
    fakes, trainers = [], []
    for m in (model, twin):
        fake = FakeCuda()
        planned = megatrain.plan_model(m, seq_len=S, micro_batch_size=2, micro_batches=2, input_names=NAMES,
                                       max_grad_norm=1.0)
        trainers.append(megatrain.materialize(planned, ADAMW, backend=CUDABackend(adapter=fake)))
        fakes.append(fake)
    held = [weakref.ref(t) for t in trainers[0].executor._buffers.weights + trainers[0].executor._buffers.grads]
    mem = trainers[0].planned.memory
    a = trainers[0].step(batches[0], loss=GRPOLoss())
    made = len(fakes[0].empty_calls)
    freed = release_gpu(trainers[0])
    assert freed == mem.weight_slots + mem.gradient_slots and all(r() is None for r in held)
    assert release_gpu(trainers[0]) == 0
    with gpu_released(trainers[0]) as again:
        assert again == 0 and len(fakes[0].empty_calls) == made
    assert len(fakes[0].empty_calls) == made + len(held)  # the slots, made again after the block
    release_gpu(trainers[0])
    retake_gpu(trainers[0])
    assert len(fakes[0].empty_calls) == made + 2 * len(held)
    got = [a, trainers[0].step(batches[1], loss=GRPOLoss())]
    want = [trainers[1].step(b, loss=GRPOLoss()) for b in batches]
    assert [r.loss for r in got] == [r.loss for r in want]
    trainers[0].flush(), trainers[1].flush()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


# -- data parallel: two gloo ranks -----------------------------------------------------------------

def _ranks_main(rank: int, world: int, init_file: str, out: str, batches_file: str) -> None:
    """One of two ranks, each with its half of every global batch: a GRPO step, a DPO step, a
    batch that rank 1 alone refuses (both raise, nothing is updated), the log-probabilities of its rows."""
    from test_distributed import _process_group

    with _process_group(rank, world, init_file):
        grpo, dpo, lp_batch = torch.load(batches_file)
        half = lambda b: {k: v[rank * 2:(rank + 1) * 2] for k, v in b.items()}  # noqa: E731
        trainer = megatrain.compile(tiny_llama(), seq_len=S, micro_batch_size=2, optimizer=ADAMW,
                                    input_names=NAMES, max_grad_norm=1.0)
        results = [trainer.step(half(grpo), loss=GRPOLoss(kl_coef=0.1, aggregation="token-mean")).loss,
                   trainer.step(half(dpo), loss=DPOLoss(beta=0.5)).loss]
        bad = half(grpo)
        if rank == 1:
            bad["advantages"] = bad["advantages"].clone()
            bad["advantages"][0] = float("nan")
        try:
            trainer.step(bad, loss=GRPOLoss())
            refused = ""
        except BatchError as e:
            refused = str(e)
        trainer.flush()
        torch.save({"results": results, "refused": refused, "steps": trainer.step_count,
                    "logprobs": trainer.logprobs(half(lp_batch)),
                    "state": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}}, f"{out}.{rank}")


def test_grpo_and_dpo_on_two_gloo_ranks_equal_one_process(tmp_path):
    """The loss's totals (GRPO's tokens, DPO's pairs) are summed over the ranks before the step:
    two ranks of two rows train as one process on the four (eager, whole batch); a batch one rank
    refuses stops both, with nothing applied."""
    import torch.multiprocessing as mp

    torch.manual_seed(0)
    ref = tiny_llama()  # rank 0's initial weights (seeded 0), which compile gives every rank
    batches = (_grpo_batch(ref, ROWS, 0, per_token=True), _dpo_batch(ref, ROWS // 2, 1), _responses(ROWS, 2))
    torch.save(batches, tmp_path / "batches")
    out = str(tmp_path / "rank")
    mp.spawn(_ranks_main, args=(2, str(tmp_path / "init"), out, str(tmp_path / "batches")), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    eager = (functools.partial(eager_grpo, kl_coef=0.1), functools.partial(eager_dpo, beta=0.5))
    for step, (b, fn) in enumerate(zip(batches[:2], eager)):
        opt.zero_grad()
        lp = eager_logprobs(ref, b)
        want = fn(lp, b)
        want.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        for r in ranks:
            assert abs(r["results"][step] - want.item()) <= RTOL * _scale(fn, lp, b), (step, r["results"], want)
    assert all(r["steps"] == 2 for r in ranks)
    assert "advantages" in ranks[1]["refused"] and "other rank(s) refused" in ranks[0]["refused"]
    with torch.no_grad():
        lp = eager_logprobs(ref, batches[2])
    for rank, r in enumerate(ranks):
        assert torch.allclose(r["logprobs"], lp[rank * 2:(rank + 1) * 2], rtol=RTOL, atol=RTOL)
        for name, p in ref.named_parameters():
            assert _rel(r["state"][name], p.detach()) <= RTOL, name


def test_the_example_trains_dpo_from_the_reference():
    """examples/rl_tiny.py --dpo: at the first step the policy is the reference (every margin 0, the
    loss log 2); the loss then falls."""
    from megatrain.examples.rl_tiny import dpo

    losses = dpo(steps=3, pairs=2, seed=0)
    assert losses[0] == pytest.approx(math.log(2), rel=RTOL) and losses[2] < losses[1] < losses[0]
