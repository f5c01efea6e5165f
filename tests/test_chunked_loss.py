"""The chunked LM head + cross-entropy: the kernel, the graph pass that installs it, its costs."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from megatrain.kernels import linear_cross_entropy, linear_cross_entropy_work_bytes
from megatrain.planner.trace import trace

from conftest import random_batch, tiny_gpt, tiny_llama


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Equal up to float32 rounding of sums taken in another order: within 1e-5 of the largest entry."""
    err = (got.double() - want.double()).abs().max().item()
    assert err <= 1e-5 * want.double().abs().max().item() + 1e-7, f"{what}: max abs error {err:.3g}"


def _labels(n: int, vocab: int, seed: int, ignored_every: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::ignored_every] = -100
    return y


# -- the kernel --------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 37, 1000])
def test_kernel_equals_linear_then_cross_entropy(reduction, bias, chunk):
    torch.manual_seed(0)
    n, d, v = 37, 16, 50
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    b = torch.randn(v, requires_grad=True) if bias else None
    y = _labels(n, v, seed=1)
    wrt = [h, w] + ([b] if bias else [])
    want = F.cross_entropy(F.linear(h, w, b), y, reduction=reduction)
    got = linear_cross_entropy(h, w, b, y, -100, reduction, chunk, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # A seed other than one checks that the stored gradients are scaled by the incoming one.
    for a, e in zip(torch.autograd.grad(got * 3.0, wrt), torch.autograd.grad(want * 3.0, wrt)):
        _assert_close(a, e)


def test_kernel_follows_the_casts_of_a_low_precision_head():
    torch.manual_seed(0)
    h = torch.randn(20, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.bfloat16, requires_grad=True)
    y = _labels(20, 30, seed=2)
    want = F.cross_entropy(F.linear(h, w).float(), y)
    got = linear_cross_entropy(h, w, None, y, chunk_tokens=6, logits_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, e in zip(torch.autograd.grad(got, [h, w]), torch.autograd.grad(want, [h, w])):
        assert a.dtype == torch.bfloat16
        # Different summation order, rounded to bfloat16 (8 bits of mantissa).
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-3)


def test_a_bf16_weight_gradient_sums_its_chunks_in_fp32():
    """The LM head's weight gradient of a BF16 head is ``sum_c dz_c^T h_c`` over the chunks. Summed in
    FP32 and rounded to BF16 once, every entry is within half a BF16 ulp of the exact sum plus the FP32
    sum's own error (``chunks`` roundings of at most 2^-24 of the running sum of magnitudes); rounding
    each chunk's product to BF16 first (as the kernel did) adds up to half an ulp per chunk and
    breaks that bound."""
    torch.manual_seed(3)
    n, d, v, chunk = 512, 16, 24, 8  # 64 chunks
    h = torch.randn(n, d).bfloat16().requires_grad_()
    w = torch.randn(v, d).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(4))
    loss = linear_cross_entropy(h, w, None, y, chunk_tokens=chunk, logits_dtype=torch.float32)
    (got,) = torch.autograd.grad(loss, [w])
    # The kernel's own per-chunk softmax gradients (FP32, cast back to BF16 before the matmuls).
    dzs, hs = [], []
    for s in range(0, n, chunk):
        za = F.linear(h[s:s + chunk], w).float()
        dz = torch.softmax(za, dim=1)
        dz[torch.arange(za.shape[0]), y[s:s + chunk]] -= 1.0
        dzs.append((dz / n).bfloat16())
        hs.append(h[s:s + chunk].detach())
    products = [dz.t().double() @ hc.double() for dz, hc in zip(dzs, hs)]
    exact = sum(products)
    magnitude = sum(p.abs() for p in products)
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs()  # the BF16 spacing at |exact|, within 2x
    bound = ulp / 2 + len(products) * 2.0 ** -24 * magnitude
    assert ((got.double() - exact).abs() <= bound).all()
    rounded_per_chunk = sum(p.bfloat16().float() for p in products).bfloat16()
    assert ((rounded_per_chunk.double() - exact).abs() > bound).any(), "the test must tell the two apart"


def test_ignored_tokens_do_not_count_and_all_ignored_is_nan_like_pytorch():
    h, w = torch.randn(6, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    y = torch.full((6,), -100)
    assert torch.isnan(linear_cross_entropy(h, w, None, y, chunk_tokens=4))
    assert torch.isnan(F.cross_entropy(h @ w.T, y))
    assert linear_cross_entropy(h, w, None, y, reduction="sum", chunk_tokens=4).item() == 0.0
    y = torch.tensor([1, -1, 2, -1, 3, 4])
    torch.testing.assert_close(linear_cross_entropy(h, w, None, y, ignore_index=-1, chunk_tokens=4),
                               F.cross_entropy(h @ w.T, y, ignore_index=-1))


def test_without_gradients_the_kernel_records_nothing():
    h, w = torch.randn(6, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    with torch.no_grad():
        out = linear_cross_entropy(h, w, None, torch.arange(6) % 5, chunk_tokens=2)
    assert not out.requires_grad and out.grad_fn is None
    torch.testing.assert_close(out, F.cross_entropy(h @ w.T, torch.arange(6) % 5).detach())


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_kernel_counts_the_flops_of_the_matmuls_it_replaces(device):
    n, d, v = 300, 16, 50
    h = torch.randn(n, d, device=device, requires_grad=True)
    w = torch.randn(v, d, device=device, requires_grad=True)
    y = torch.zeros(n, dtype=torch.long, device=device)
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        linear_cross_entropy(h, w, None, y, chunk_tokens=64)
    assert fc.get_total_flops() == 2 * n * d * v
    with FlopCounterMode(display=False) as fc:
        linear_cross_entropy(h, w, None, y, chunk_tokens=64).backward()
    assert fc.get_total_flops() == 3 * 2 * n * d * v, "logits, grad of hidden, grad of weight: no recompute"


def test_kernel_rejects_what_it_does_not_compute():
    h, w, y = torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction 'none'"):
        linear_cross_entropy(h, w, None, y, reduction="none")
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(h, w, None, y, chunk_tokens=0)
    with pytest.raises(ValueError, match=r"\[tokens, features\]"):
        linear_cross_entropy(h[None], w, None, y)


# -- the pass over the epilogue template -------------------------------------------------------------

def _epilogue(traced):
    layer = traced.graph.layers[-1]
    return layer, traced.templates[layer.template]


def _fused(gm):
    return [n for n in gm.graph.nodes if n.target is linear_cross_entropy]


def _run_epilogue(traced, params, hidden, labels):
    layer, gm = _epilogue(traced)
    assert not layer.buffers
    ins = [labels if traced.graph.values[v].name == "labels" else hidden for v in layer.inputs]
    (loss,) = gm(*params, *ins)
    return loss


class _Head(nn.Module):
    """Embedding, one block, and an LM head whose loss ``loss(logits, labels)`` the test chooses."""

    def __init__(self, loss, vocab=40, d=8, bias=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.Linear(d, d)])
        self.head = nn.Linear(d, vocab, bias=bias)
        self.loss = loss

    def forward(self, input_ids, labels):
        x = torch.tanh(self.blocks[0](self.emb(input_ids)))
        return self.loss(self.head(x), labels)


def _nll_of_log_softmax(logits, labels):
    return F.nll_loss(F.log_softmax(logits.flatten(0, 1), dim=1), labels.flatten(), ignore_index=-100,
                      reduction="sum")


@pytest.mark.parametrize("make", [
    lambda: tiny_llama(layers=1),
    lambda: tiny_gpt(layers=1),
    lambda: _Head(_nll_of_log_softmax, bias=True),
], ids=["hf-llama-shift", "gpt-slice", "log-softmax-nll-sum-bias"])
def test_fused_epilogue_equals_the_traced_one(make):
    torch.manual_seed(0)
    model = make()
    b, s = 2, 16
    plain = trace(model, micro_batch_size=b, seq_len=s, loss_chunk_bytes=None)
    fused = trace(model, micro_batch_size=b, seq_len=s, loss_chunk_bytes=4 * 96 * 5)  # 5..8 tokens a chunk
    assert not _fused(_epilogue(plain)[1])
    (node,) = _fused(_epilogue(fused)[1])
    assert node.args[6] < b * s, "several chunks"
    assert not [n for n in _epilogue(fused)[1].graph.nodes if n.target is torch.ops.aten.linear.default]
    layer = fused.graph.layers[-1]
    assert layer.params == plain.graph.layers[-1].params and layer.inputs == plain.graph.layers[-1].inputs
    vocab = max(p.shape[0] for p in layer.params if len(p.shape) == 2)
    params = [(torch.randn(p.shape) * 0.3).requires_grad_() for p in layer.params]
    (hidden_shape,) = [fused.graph.values[v].shape for v in layer.inputs if fused.graph.values[v].name != "labels"]
    hidden = torch.randn(hidden_shape, requires_grad=True)
    labels = _labels(b * s, vocab, seed=3, ignored_every=4).view(b, s)
    want = _run_epilogue(plain, params, hidden, labels)
    got = _run_epilogue(fused, params, hidden, labels)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    wrt = params + [hidden]
    for p, a, e in zip([*layer.params, "hidden"], torch.autograd.grad(got, wrt), torch.autograd.grad(want, wrt)):
        _assert_close(a, e, f"gradient of {p}")


@pytest.mark.parametrize("loss", [
    lambda z, y: F.cross_entropy(z.flatten(0, 1), y.flatten(), label_smoothing=0.1),
    lambda z, y: F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none").mean(),
    lambda z, y: F.cross_entropy(z.flatten(0, 1), y.flatten()) + 1e-4 * torch.logsumexp(z, -1).square().mean(),
    lambda z, y: (z - 1).square().mean(),
], ids=["label-smoothing", "reduction-none", "logits-read-twice", "no-cross-entropy"])
def test_losses_the_kernel_does_not_compute_are_left_as_traced(loss):
    traced = trace(_Head(loss), micro_batch_size=1, seq_len=6)
    _, gm = _epilogue(traced)
    assert not _fused(gm)
    assert [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]


def test_the_lm_head_layer_holds_a_chunk_of_logits_not_all_of_them():
    s, d, vocab = 1024, 32, 4096
    model = tiny_llama(layers=1, vocab=vocab, hidden=d, device="meta")
    chunked_tm = trace(model, micro_batch_size=1, seq_len=s, loss_chunk_bytes=1 << 20)
    chunked = chunked_tm.graph.layers[-1]
    plain = trace(model, micro_batch_size=1, seq_len=s, loss_chunk_bytes=None).graph.layers[-1]
    (node,) = _fused(_epilogue(chunked_tm)[1])
    assert node.args[6] == (1 << 20) // (vocab * 4) == 64
    logits = s * vocab * 4
    assert plain.work_bytes > logits > 2 * chunked.work_bytes
    assert chunked.work_bytes > linear_cross_entropy_work_bytes(
        s, d, vocab, 64, dtype=torch.float32, logits_dtype=torch.float32)
    assert (chunked.fwd_flops, chunked.bwd_flops) == (plain.fwd_flops, plain.bwd_flops) == (2 * s * d * vocab,
                                                                                           6 * s * d * vocab)


def test_training_with_a_many_chunk_loss_matches_eager(monkeypatch):
    import megatrain
    import megatrain.planner.front

    torch.manual_seed(0)
    model = tiny_llama(layers=2)
    ref = copy.deepcopy(model)
    monkeypatch.setattr(megatrain.planner.front, "trace", functools.partial(trace, loss_chunk_bytes=4 * 96 * 5))
    adamw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2, micro_batches=2, optimizer=adamw)
    (node,) = _fused(_epilogue(trainer.traced)[1])
    assert node.args[6] == 5
    opt = torch.optim.AdamW(ref.parameters(), **adamw)
    for step in range(6):
        batch = random_batch(4, 16, 96, seed=step % 2)
        got = trainer.step(batch).loss
        opt.zero_grad()
        want = 0.0
        for k in range(2):
            loss = ref(**{n: t[2 * k:2 * k + 2] for n, t in batch.items()}).loss / 2
            loss.backward()
            want += loss.item()
        opt.step()
        assert got == pytest.approx(want, rel=1e-5), f"step {step}"
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert ((p - q).norm() / q.norm()).item() <= 1e-5, name


def test_under_autocast_the_kernel_multiplies_in_the_autocast_dtype_like_the_unfused_head():
    # The executor's BF16 compute: FP32 activations, BF16 weights, the FP32-traced template under autocast.
    torch.manual_seed(0)
    h = torch.randn(24, 16, requires_grad=True)
    w = torch.randn(40, 16).bfloat16().requires_grad_()
    y = _labels(24, 40, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(h, w).float(), y)
        got = linear_cross_entropy(h, w, None, y, chunk_tokens=5, logits_dtype=torch.float32)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # same BF16 logits, FP32 reduction
    gh, gw = torch.autograd.grad(got, [h, w])
    eh, ew = torch.autograd.grad(want, [h, w])
    assert (gh.dtype, gw.dtype) == (torch.float32, torch.bfloat16)
    torch.testing.assert_close(gh, eh, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw.float(), ew.float(), rtol=2e-2, atol=2e-3)
