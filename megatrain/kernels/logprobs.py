"""Per-token log-probabilities of the labels from the LM head, a chunk of tokens at a time.

``linear_logprobs``: for rows ``i`` with logits ``z_i = W h_i + b`` and target ``t_i``, the
log-probability ``log_softmax(z_i)[t_i] = z_i[t_i] - logsumexp(z_i)`` (0 where ``t_i`` is
``ignore_index``), and on request the entropy of ``softmax(z_i)``, computed ``chunk_tokens`` rows
at a time so the ``[tokens, vocab]`` logits never exist whole (the same reason as
:mod:`megatrain.kernels.lm_head`, whose cross-entropy is ``-`` this summed).

Gradient. Given ``g_i = dL/dlogp_i`` (a loss over the per-token log-probabilities: a policy
gradient, DPO), the gradient of the logits is ``dz_i = g_i * (onehot(t_i) - softmax(z_i))`` for
a counted row (0 for an ignored one): the cross-entropy kernel's gradient with a per-token seed
``-g_i`` instead of one scale. ``g`` is known only once the loss has seen every log-probability,
so the gradients cannot be formed in the forward as the cross-entropy kernel forms them; the
forward keeps ``logsumexp(z_i)`` (4 bytes a token) and the backward recomputes each chunk's
logits, as Cut Cross-Entropy does (Wijmans et al. 2024, arXiv:2411.09009): one matmul in the
forward and three in the backward, one more than the unfused linear + log-softmax, which would
keep the whole ``[tokens, vocab]`` logits instead. The entropy is returned without a gradient.

Numerics follow the unfused graph as in :mod:`megatrain.kernels.lm_head`: logits in the dtype
``F.linear`` computes in (autocast's under ``torch.autocast``), cast to ``logits_dtype`` and
reduced in at least FP32; the log-probabilities and entropies are in that reduction dtype (FP32
for FP32 or BF16 logits). A weight gradient narrower than FP32 is summed over the chunks in FP32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain.kernels.autocast import no_autocast
from megatrain.kernels.lm_head import acc_dtype, backward_chunk, check_rows, matmul_dtype


def _chunks(hidden, weight, bias, labels, ignore_index, chunk_tokens, logits_dtype, mm_dtype):
    """For each chunk: its rows, hidden rows in ``mm_dtype``, logits in the reduction dtype, its
    targets (ignored ones as 0) and its counted-row mask."""
    acc = acc_dtype(logits_dtype)
    w = weight.to(mm_dtype)
    b = bias.to(mm_dtype) if bias is not None else None
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        h = hidden[rows].to(mm_dtype)
        t = labels[rows]
        valid = t != ignore_index
        safe = torch.where(valid, t, torch.zeros_like(t)).unsqueeze(1)
        yield rows, h, F.linear(h, w, b).to(logits_dtype).to(acc), safe, valid


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, chunk_tokens, logits_dtype, mm_dtype, entropy):
        acc = acc_dtype(logits_dtype)
        n = hidden.shape[0]
        logp = torch.zeros((n,), dtype=acc, device=hidden.device)
        lse = torch.zeros((n,), dtype=acc, device=hidden.device)
        ent = torch.zeros((n,), dtype=acc, device=hidden.device) if entropy else None
        with no_autocast(hidden.device.type):
            for rows, _, z, safe, valid in _chunks(hidden, weight, bias, labels, ignore_index, chunk_tokens,
                                                   logits_dtype, mm_dtype):
                m = torch.logsumexp(z, dim=1)
                lse[rows] = m
                logp[rows] = torch.where(valid, z.gather(1, safe).squeeze(1) - m, torch.zeros_like(m))
                if ent is not None:
                    # H = logsumexp(z) - sum_j p_j z_j
                    p = torch.exp(z - m.unsqueeze(1))
                    ent[rows] = torch.where(valid, m - (p * z).sum(1), torch.zeros_like(m))
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.args = (ignore_index, chunk_tokens, logits_dtype, mm_dtype)
        if ent is None:
            return logp
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, *_):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        ignore_index, chunk_tokens, logits_dtype, mm_dtype = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = acc_dtype(logits_dtype)
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.promote_types(mm_dtype, torch.float32),
                             device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=grad_w.dtype if need_w else acc, device=bias.device) if need_b else None
        w = weight.to(mm_dtype)
        g_all = grad_logp.to(acc)
        with no_autocast(hidden.device.type):
            for rows, h, z, safe, valid in _chunks(hidden, weight, bias, labels, ignore_index, chunk_tokens,
                                                   logits_dtype, mm_dtype):
                g = torch.where(valid, g_all[rows], torch.zeros_like(g_all[rows]))
                # dz = g * (onehot - softmax), written in place over the chunk's logits
                dz = torch.exp(z - lse[rows].unsqueeze(1)).mul_(-g.unsqueeze(1))
                dz.scatter_add_(1, safe, g.unsqueeze(1))
                backward_chunk(dz, rows, h, w, grad_h, grad_w, grad_b, logits_dtype, mm_dtype)
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None, None, None, None)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                    ignore_index: int = -100, chunk_tokens: int = 2048, logits_dtype: torch.dtype | None = None,
                    entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(F.linear(hidden, weight, bias).to(logits_dtype), -1).gather(-1, labels)``, chunked.

    Args:
        hidden: ``[tokens, in_features]``, the LM head's input.
        weight: ``[vocab, in_features]``; ``bias``: ``[vocab]`` or None.
        labels: ``[tokens]`` integer targets; ``ignore_index`` rows get 0 and no gradient.
        chunk_tokens: the most rows of logits that exist at once (>= 1).
        logits_dtype: what the logits are cast to before the softmax (default: the matmul's dtype,
            autocast's inside ``torch.autocast``).
        entropy: also return each row's entropy (0 for an ignored row), without a gradient.

    Returns:
        ``logp``: ``[tokens]`` in the reduction dtype (FP32 for FP32 or BF16 logits),
        differentiable in ``hidden``, ``weight`` and ``bias``; with ``entropy``, ``(logp, entropy)``.

    Raises:
        ValueError: ``chunk_tokens < 1``, or ``hidden`` not ``[tokens, features]`` with ``labels``
            ``[tokens]``.
    """
    check_rows("linear_logprobs", hidden, labels, chunk_tokens)
    mm_dtype = matmul_dtype(hidden, weight)
    if hidden.device.type == "meta":
        chunk_tokens = max(chunk_tokens, hidden.shape[0])  # as linear_cross_entropy: FLOPs are linear in rows
    return _LinearLogprobs.apply(hidden, weight, bias, labels, ignore_index, chunk_tokens,
                                 logits_dtype or mm_dtype, mm_dtype, entropy)


__all__ = ["linear_logprobs"]
