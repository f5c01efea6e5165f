"""The LM head fused with its cross-entropy loss, computed a chunk of tokens at a time.

``linear_cross_entropy``: the LM head (a linear layer ``hidden -> vocab``) fused with the
token-level cross-entropy, computed ``chunk_tokens`` rows at a time so the ``[tokens, vocab]``
logits never exist whole. At a 512k-token sequence and a 32k vocabulary the logits alone are 64 GiB
in FP32; one chunk of 2048 rows is 250 MiB. The trace installs it with
:func:`megatrain.planner.trace.lm_head.chunk_lm_head_loss`.

Method. For rows ``i`` with logits ``z_i = W h_i + b`` and target ``t_i`` the loss is ``sum_i
valid_i * (logsumexp(z_i) - z_i[t_i])``, divided by ``sum_i valid_i`` under the mean reduction
(``valid_i = t_i != ignore_index``), exactly what ``torch.nn.functional.cross_entropy`` computes.
Its gradient with respect to the logits is ``dz_i = valid_i * s * (softmax(z_i) - onehot(t_i))``
with ``s`` the reduction's scale (``1 / sum_i valid_i`` or 1), and from it ``grad h_i = dz_i W``
and ``grad W = sum_i dz_i^T h_i``. Each chunk's logits are needed once for the loss and once for
the gradients. A call without gradients (a forward under ``no_grad``) computes only the loss. A
call that records autograd (the local backward re-running a layer with gradients on) computes both
in the same pass over the chunks and keeps the gradients of ``hidden`` and ``W`` until the
backward, which only scales them by the incoming gradient of the loss: one logits matmul per chunk
instead of a forward matmul plus a recompute in the backward, so the fused op costs what the
unfused linear + cross-entropy cost (one matmul in the forward, two in the backward). Liger
Kernel's fused linear cross-entropy computes the gradients in the forward the same way (Hsu et al.
2024, "Liger Kernel: Efficient Triton Kernels for LLM Training", arXiv:2410.10989); Cut
Cross-Entropy (Wijmans et al. 2024, arXiv:2411.09009) recomputes the logits in the backward
instead, which costs that extra matmul. This module is written from the formulas above with plain
PyTorch ops, so it runs on every device, the ``meta`` device included, where the planner counts its
FLOPs.

Numerics follow the unfused graph: the logits are produced in the dtype ``F.linear`` would use
(autocast's inside ``torch.autocast``, as the executor runs BF16 compute), cast to
``logits_dtype`` (what the model's loss casts them to, FP32 for Hugging Face causal LMs) and
reduced in at least FP32; the gradient is cast back the same way before the two matmuls. Results
equal the unfused ops up to the order of floating-point sums. A weight gradient narrower than
FP32 is accumulated over the chunks in FP32, each chunk's product written in FP32 by its GEMM
(never rounded to the narrow dtype first), and rounded once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain.kernels.autocast import no_autocast

REDUCTIONS = ("mean", "sum")
"""Reductions :func:`linear_cross_entropy` supports; ``none`` would need the per-token losses whole."""


def acc_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    # softmax and logsumexp in FP32 at least, as PyTorch's own kernels accumulate low precision.
    return torch.promote_types(logits_dtype, torch.float32)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, chunk_tokens, logits_dtype, mm_dtype,
                want_grad):
        # The matmul dtype was picked once, outside (see linear_cross_entropy), and _forward casts
        # explicitly: autocast would recast every op, including the out= matmuls.
        with no_autocast(hidden.device.type):
            loss, ctx.grads = _forward(hidden, weight, bias, labels, ignore_index, reduction, chunk_tokens,
                                       logits_dtype, mm_dtype,
                                       [want_grad and ctx.needs_input_grad[i] for i in range(3)])
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.grads
        ctx.grads = None  # free the stored gradients as soon as they are handed over
        if grads is None:
            raise RuntimeError("linear_cross_entropy: backward ran twice, or after a forward that recorded "
                               "no gradients; call it with gradients enabled and backpropagate once")
        out = [None if g is None else g * grad_loss.to(g.dtype) for g in grads]
        return out[0], out[1], out[2], None, None, None, None, None, None, None


def _forward(hidden, weight, bias, labels, ignore_index, reduction, chunk_tokens, logits_dtype, mm_dtype, needs):
    """The loss and, where ``needs`` says, the gradients of hidden, weight and bias for a unit seed."""
    n = hidden.shape[0]
    acc = acc_dtype(logits_dtype)
    need_h, need_w, need_b = needs
    w = weight.to(mm_dtype)
    b = bias.to(mm_dtype) if bias is not None else None
    valid_all = labels != ignore_index
    # The mean divides by the number of counted tokens (0/0 is NaN, as in F.cross_entropy); the
    # gradient divides by the same count, as the unfused nll_loss backward does.
    count = valid_all.sum().to(acc) if reduction == "mean" else None
    # Contiguous, so that each chunk's rows are one block a matmul can write in place.
    grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
    # Summed over chunks in FP32 at least: per-chunk partial sums rounded to BF16 would lose bits.
    grad_w = torch.zeros(weight.shape, dtype=torch.promote_types(mm_dtype, torch.float32),
                         device=weight.device) if need_w else None
    grad_b = torch.zeros(bias.shape, dtype=grad_w.dtype if need_w else acc, device=bias.device) if need_b else None
    total = torch.zeros((), dtype=acc, device=hidden.device)
    for start in range(0, n, chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        h = hidden[rows].to(mm_dtype)
        t = labels[rows]
        valid = valid_all[rows]
        za = F.linear(h, w, b).to(logits_dtype).to(acc)
        lse = torch.logsumexp(za, dim=1)
        safe = torch.where(valid, t, torch.zeros_like(t)).unsqueeze(1)
        target = za.gather(1, safe).squeeze(1)
        total = total + torch.where(valid, lse - target, torch.zeros_like(lse)).sum()
        if not (need_h or need_w or need_b):
            continue
        dz = torch.exp(za - lse.unsqueeze(1))
        dz.scatter_add_(1, safe, torch.full_like(target, -1.0).unsqueeze(1))
        dz.mul_(valid.to(acc).unsqueeze(1))
        if count is not None:
            dz.div_(count)
        backward_chunk(dz, rows, h, w, grad_h, grad_w, grad_b, logits_dtype, mm_dtype)
    loss = total / count if count is not None else total
    grads = (grad_h,
             grad_w.to(weight.dtype) if grad_w is not None else None,
             grad_b.to(bias.dtype) if grad_b is not None else None)
    return loss.to(logits_dtype), grads


def backward_chunk(dz, rows, h, w, grad_h, grad_w, grad_b, logits_dtype, mm_dtype) -> None:
    """From a chunk's logit gradient ``dz`` (reduction dtype): back through the casts the unfused
    graph made on the way to the loss, then its rows of the gradient of hidden (``grad_h[rows]``)
    and its shares of the weight's and bias's (added); a None gradient is not wanted."""
    dz = dz.to(logits_dtype).to(mm_dtype)
    if grad_h is not None and grad_h.dtype == mm_dtype:
        torch.mm(dz, w, out=grad_h[rows])
    elif grad_h is not None:
        grad_h[rows] = dz.mm(w)
    if grad_w is not None:
        _accumulate_product(grad_w, dz.t(), h)
    if grad_b is not None:
        grad_b.add_(dz.sum(0))


_CUDA_OUT_DTYPE = "dtype_out" in torch.ops.aten.addmm.overloads()
"""Whether this torch has ``addmm(..., out_dtype=)`` (CUDA kernels only; PyTorch 2.8 on): a BF16 or
FP16 GEMM that writes and accumulates its FP32 output in FP32, as cuBLAS does with an FP32 ``C``."""


def _accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b``, every product and partial sum kept in ``acc``'s dtype (FP32 for a low-precision
    weight gradient): the sum of a chunk is never rounded to ``a``'s dtype before it is added.

    Same dtypes: one ``addmm`` (with ``out=``, not ``addmm_``: FlopCounterMode counts the former and
    not the latter). BF16/FP16 operands into FP32: on CUDA the GEMM with an FP32 output
    (``out_dtype``, :data:`_CUDA_OUT_DTYPE`); elsewhere (CPU, meta, CUDA before PyTorch 2.8) the
    operands are widened to FP32 first, which is exact (a BF16 or FP16 value is an FP32 value) and
    costs an FP32 copy of each operand (counted by :func:`linear_cross_entropy_work_bytes`).
    """
    if a.dtype == acc.dtype:
        torch.addmm(acc, a, b, out=acc)
    elif acc.is_cuda and _CUDA_OUT_DTYPE:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        torch.addmm(acc, a.to(acc.dtype), b.to(acc.dtype), out=acc)


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in here: autocast's, when it is on and would
    cast these inputs, else the inputs' own."""
    own = torch.promote_types(hidden.dtype, weight.dtype)
    dev = hidden.device.type
    if (own in (torch.float32, torch.float16, torch.bfloat16) and torch.amp.is_autocast_available(dev)
            and torch.is_autocast_enabled(dev)):
        return torch.get_autocast_dtype(dev)
    return own


def check_rows(kernel: str, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int) -> None:
    """Raise ValueError unless ``chunk_tokens >= 1``, ``hidden`` is ``[tokens, features]`` and ``labels`` ``[tokens]``."""
    if chunk_tokens < 1:
        raise ValueError(f"{kernel}: chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"{kernel}: hidden must be [tokens, features] and labels [tokens]; got "
                         f"{tuple(hidden.shape)} and {tuple(labels.shape)}")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, ignore_index: int = -100, reduction: str = "mean",
                         chunk_tokens: int = 2048, logits_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).to(logits_dtype), labels, ...)``, chunked.

    ``hidden`` is ``[tokens, in_features]``, ``weight`` ``[vocab, in_features]``, ``bias``
    ``[vocab]`` or None, ``labels`` ``[tokens]`` integer class indices (``ignore_index`` rows do
    not count). At most ``chunk_tokens`` rows of logits exist at once. The matmuls run in the
    dtype ``F.linear`` would use (autocast's inside ``torch.autocast``); ``logits_dtype``
    defaults to it. Returns the scalar loss in ``logits_dtype``; differentiable in ``hidden``,
    ``weight`` and ``bias``, with gradients in their own dtypes.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction {reduction!r} is not one of {REDUCTIONS}")
    check_rows("linear_cross_entropy", hidden, labels, chunk_tokens)
    mm_dtype = matmul_dtype(hidden, weight)
    logits_dtype = logits_dtype or mm_dtype
    if hidden.device.type == "meta":
        # The planner runs templates on meta to count FLOPs and shapes: meta tensors hold no memory,
        # and a matmul's FLOPs are linear in its rows, so one chunk counts the same as many and
        # spares hundreds of dispatches at long sequences.
        chunk_tokens = max(chunk_tokens, hidden.shape[0])
    tensors = (hidden, weight) + ((bias,) if bias is not None else ())
    want_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, ignore_index, reduction, chunk_tokens,
                                     logits_dtype, mm_dtype, want_grad)


def linear_cross_entropy_work_bytes(tokens: int, in_features: int, vocab: int, chunk_tokens: int, *,
                                    dtype: torch.dtype, logits_dtype: torch.dtype, bias: bool = False,
                                    device: str = "cuda") -> int:
    """Transient bytes one differentiable call of :func:`linear_cross_entropy` holds at its peak.

    ``dtype`` is the matmul dtype. Per chunk: the logits in ``dtype``, their copy in the
    reduction dtype, the softmax gradient in that dtype and its cast back to ``dtype``, and a few
    per-token vectors; with a weight narrower than FP32 where the GEMM cannot write FP32 itself
    (:func:`_accumulate_product`; assumed for a device other than CUDA with ``out_dtype``), FP32
    copies of the chunk's softmax gradient and hidden rows too. Kept from the forward to the
    backward: the gradient of ``hidden`` (``tokens x in_features``) and of the weight and bias; a
    weight gradient narrower than FP32 is summed in an FP32 accumulator, with its final cast beside
    it. A call without gradients needs only the chunk, so this bounds both. ``device``: where it
    runs (``"cuda"`` by default: the planner sizes GPU memory).
    """
    item = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=acc_dtype(logits_dtype)).element_size()
    chunk = min(chunk_tokens, tokens)
    per_chunk = chunk * vocab * (2 * item + 2 * acc) + chunk * 4 * acc
    if item < 4 and not (device == "cuda" and _CUDA_OUT_DTYPE):
        per_chunk += chunk * (vocab + in_features) * 4
    weight_grad = vocab * in_features * (item if item >= 4 else 4 + item)
    return per_chunk + tokens * in_features * item + weight_grad + (vocab * (item + acc) if bias else 0)


__all__ = ["REDUCTIONS", "linear_cross_entropy", "linear_cross_entropy_work_bytes"]
