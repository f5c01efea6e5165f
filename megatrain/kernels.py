"""Kernels that layer templates call in place of ops whose intermediates would not fit.

Four kernels, each installed by a graph pass of :mod:`megatrain.planner.trace`:
:func:`linear_cross_entropy` (the LM head fused with its loss, below),
:func:`sequence_chunked` (a token-wise region of a layer run a chunk of the sequence at a time, at
the end of this docstring), :func:`without_autocast` (one op that autocast must not recast:
rotary angle math) and :func:`grouped_query_attention` (SDPA for fewer key/value heads than query
heads that never falls back to the math kernel); see their docstrings.

``linear_cross_entropy``: the LM head (a linear layer ``hidden -> vocab``) fused with the
token-level cross-entropy, computed ``chunk_tokens`` rows at a time so the ``[tokens, vocab]``
logits never exist whole. At a 512k-token sequence and a 32k vocabulary the logits alone are 64 GiB
in FP32; one chunk of 2048 rows is 250 MiB.

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
FP32 is accumulated over the chunks in FP32 and rounded once at the end.

``sequence_chunked``: a region of a layer whose ops treat every sequence position on its own
(norms, projections, rotary embeddings, the MLP; found by
:func:`megatrain.planner.trace.chunk_sequence_regions`), run ``chunks`` slices of the sequence at a
time, the method of Mini-Sequence Transformer (Luo et al. 2024, "Mini-Sequence Transformer:
Optimizing Intermediate Memory for Long Sequences Training", arXiv:2407.15892). At a 512k-token
sequence the MLP of a 7B block alone creates 43 GiB of intermediates; a chunk of 2k tokens creates
170 MiB. Each chunk runs under ``torch.utils.checkpoint`` (non-reentrant): its forward keeps only
its inputs, and the backward recomputes that one chunk's intermediates just before it needs them,
so a local backward holds one chunk's intermediates and their gradients at a time, at the price of
one more forward of the region (its FLOPs show up in the layer's ``bwd_flops``; the checkpoint stops
recomputing once every tensor the backward saved is back, so a last matmul whose saved tensors are
its inputs is not run again). Inputs are split
and outputs concatenated along their sequence dimension once, with ``split`` and ``cat``, whose
backward passes are one ``cat`` and views: a ``narrow`` per chunk would have each chunk's backward
allocate a zero-filled gradient of the whole input.

This module must not import ``megatrain.runtime``: the planner imports it to rewrite templates.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

REDUCTIONS = ("mean", "sum")
"""Reductions :func:`linear_cross_entropy` supports; ``none`` would need the per-token losses whole."""


def _acc_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    # softmax and logsumexp in FP32 at least, as PyTorch's own kernels accumulate low precision.
    return torch.promote_types(logits_dtype, torch.float32)


def _no_autocast(device_type: str):
    # The kernel picks its matmul dtype once, outside (see linear_cross_entropy), and casts
    # explicitly inside: autocast would recast every op, including the out= matmuls.
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, reduction, chunk_tokens, logits_dtype, mm_dtype,
                want_grad):
        with _no_autocast(hidden.device.type):
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
    acc = _acc_dtype(logits_dtype)
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
        # Back through the casts the unfused graph made on the way to the loss.
        dz = dz.to(logits_dtype).to(mm_dtype)
        if need_h and grad_h.dtype == mm_dtype:
            torch.mm(dz, w, out=grad_h[rows])
        elif need_h:
            grad_h[rows] = dz.mm(w)
        if need_w and grad_w.dtype == mm_dtype:
            # addmm with out=, not addmm_: FlopCounterMode counts the former and not the latter.
            torch.addmm(grad_w, dz.t(), h, out=grad_w)
        elif need_w:
            grad_w.add_(dz.t().mm(h))
        if need_b:
            grad_b.add_(dz.sum(0))
    loss = total / count if count is not None else total
    grads = (grad_h,
             grad_w.to(weight.dtype) if grad_w is not None else None,
             grad_b.to(bias.dtype) if grad_b is not None else None)
    return loss.to(logits_dtype), grads


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in here: autocast's, when it is on and would
    cast these inputs, else the inputs' own."""
    own = torch.result_type(hidden, weight)
    dev = hidden.device.type
    if (own in (torch.float32, torch.float16, torch.bfloat16) and torch.amp.is_autocast_available(dev)
            and torch.is_autocast_enabled(dev)):
        return torch.get_autocast_dtype(dev)
    return own


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
    if chunk_tokens < 1:
        raise ValueError(f"linear_cross_entropy: chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: hidden must be [tokens, features] and labels [tokens]; got "
                         f"{tuple(hidden.shape)} and {tuple(labels.shape)}")
    mm_dtype = _matmul_dtype(hidden, weight)
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
                                    dtype: torch.dtype, logits_dtype: torch.dtype, bias: bool = False) -> int:
    """Transient bytes one differentiable call of :func:`linear_cross_entropy` holds at its peak.

    ``dtype`` is the matmul dtype. Per chunk: the logits in ``dtype``, their copy in the
    reduction dtype, the softmax gradient in that dtype and its cast back to ``dtype``, and a few
    per-token vectors. Kept from the forward to the backward: the gradient of ``hidden``
    (``tokens x in_features``) and of the weight and bias; a weight gradient narrower than FP32 is
    summed in an FP32 accumulator, with one chunk's product and the final cast beside it. A call
    without gradients needs only the chunk, so this bounds both.
    """
    item = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=_acc_dtype(logits_dtype)).element_size()
    chunk = min(chunk_tokens, tokens)
    per_chunk = chunk * vocab * (2 * item + 2 * acc) + chunk * 4 * acc
    weight_grad = vocab * in_features * (item if item >= 4 else 4 + 2 * item)
    return per_chunk + tokens * in_features * item + weight_grad + (vocab * (item + acc) if bias else 0)


def chunk_bounds(seq_len: int, chunks: int) -> list[int]:
    """Sizes of ``chunks`` (capped at ``seq_len``) consecutive slices covering ``seq_len`` positions,
    as equal as integers allow (they differ by at most one, larger first)."""
    chunks = max(1, min(chunks, seq_len))
    base, extra = divmod(seq_len, chunks)
    return [base + 1] * extra + [base] * (chunks - extra)


def _run_region(region: Callable[..., Sequence[torch.Tensor]], *args) -> tuple[torch.Tensor, ...]:
    return tuple(region(*args))


def sequence_chunked(region: Callable[..., Sequence[torch.Tensor]], chunks: int, in_dims: Sequence[int | None],
                     out_dims: Sequence[int], *args) -> tuple[torch.Tensor, ...]:
    """``region(*args)``, computed ``chunks`` slices of the sequence at a time.

    ``region`` (an ``fx.GraphModule`` in a template) maps ``args`` to a tuple of tensors and must be
    *token-wise*: output positions ``[a, b)`` along each output's sequence dimension depend only on
    positions ``[a, b)`` of the inputs that have one, and on the whole of the inputs that do not.
    ``in_dims[i]`` is the sequence dimension of ``args[i]`` (all of the same length ``S``), or None
    for an input passed whole to every chunk (parameters, buffers, anything without a sequence
    dimension: never sliced); ``out_dims[k]`` that of output ``k``. The sequence is cut into
    ``min(chunks, S)`` slices of near-equal length (:func:`chunk_bounds`); on the ``meta`` device,
    where the planner counts FLOPs and shapes, into one, since every op of such a region costs in
    proportion to the positions it sees.

    With gradients recorded (grad mode on and some input requiring grad) each chunk runs under
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=False)``: its
    intermediates are dropped after the forward and recomputed in the backward one chunk at a time.
    The checkpoint restores the autocast state of the forward for the recompute, works with
    ``torch.autograd.grad`` (which the executor's local backward calls), and a region has no random
    ops (the tracer refuses them), so no RNG state needs replaying. Under ``no_grad`` the chunks
    just run. Returns the outputs concatenated along ``out_dims``: equal to ``region(*args)`` up to
    the order of floating-point sums over chunks (the gradients of broadcast inputs add up one chunk
    at a time).
    """
    if len(in_dims) != len(args):
        raise ValueError(f"sequence_chunked: {len(args)} inputs but {len(in_dims)} input dimensions; pass one "
                         "in_dims entry (an int or None) per input")
    sliced = [(a, d) for a, d in zip(args, in_dims) if d is not None]
    if not sliced:
        raise ValueError("sequence_chunked: no input has a sequence dimension (every in_dims entry is None); "
                         "call the region directly")
    seq_len = sliced[0][0].shape[sliced[0][1]]
    for a, d in sliced:
        if not isinstance(a, torch.Tensor) or a.shape[d] != seq_len:
            raise ValueError(f"sequence_chunked: every sliced input needs the same length along its sequence "
                             f"dimension; got {seq_len} and {tuple(getattr(a, 'shape', ()))} at dimension {d}")
    if chunks < 1:
        raise ValueError(f"sequence_chunked: chunks must be >= 1, got {chunks}")
    if sliced[0][0].device.type == "meta":
        chunks = 1
    sizes = chunk_bounds(seq_len, chunks)
    record = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    # One split per input: its backward is one cat of the chunk gradients (see the module docstring).
    pieces = [a.split(sizes, d) if d is not None else None for a, d in zip(args, in_dims)]
    per_output: list[list[torch.Tensor]] = [[] for _ in out_dims]
    for i in range(len(sizes)):
        chunk_args = [p[i] if p is not None else a for a, p in zip(args, pieces)]
        if record:
            outs = checkpoint(_run_region, region, *chunk_args, use_reentrant=False, preserve_rng_state=False)
        else:
            outs = _run_region(region, *chunk_args)
        if len(outs) != len(out_dims):
            raise ValueError(f"sequence_chunked: the region returned {len(outs)} tensors but out_dims names "
                             f"{len(out_dims)}")
        for k, o in enumerate(outs):
            per_output[k].append(o)
        del outs
    result = []
    for k, d in enumerate(out_dims):
        parts = per_output[k]
        result.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=d))
        per_output[k] = []  # each output's chunks go as soon as they are joined
    return tuple(result)


def without_autocast(op: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
    """``op(*args, **kwargs)`` with autocast off on the device of its first tensor argument.

    The op computes in its inputs' own dtypes (FP32 for the rotary angle math this is for), also
    when the caller runs under ``torch.autocast``, which would otherwise run a matmul such as
    ``inv_freq @ position_ids`` in BF16: at position 4096 a BF16 angle is off by up to 16 rad (8
    mantissa bits), so cos/sin would be wrong by up to 2.0. Transformers disables autocast around
    that math; ``torch.export`` keeps no trace of a region that is a no-op at trace time, so
    :func:`megatrain.planner.trace.keep_position_math_fp32` restores it per op with this kernel.
    Without a tensor argument, or on a device without autocast (``meta``), it just calls ``op``.
    """
    dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    with _no_autocast(dev) if dev is not None else contextlib.nullcontext():
        return op(*args, **kwargs)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes ``t`` in here: autocast's where it is on and would cast ``t``."""
    dev = t.device.type
    if (t.dtype == torch.float32 and torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def gqa_needs_expansion(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                        dropout_p: float = 0.0, is_causal: bool = False) -> bool:
    """Whether ``scaled_dot_product_attention(..., enable_gqa=True)`` would run on the math kernel here.

    On CUDA only the flash and cuDNN kernels take ``enable_gqa`` (FP16/BF16 only); the
    memory-efficient kernel, the one FP32 runs on, rejects it (PyTorch ``sdp_utils``,
    ``check_grouped_query_attention``; huggingface/transformers#46960), and SDPA then silently
    runs the math kernel, which holds ``[B, H, S, S]`` scores. Asks PyTorch's own checks
    (``torch.backends.cuda.can_use_*_attention``) on inputs in the dtype SDPA will compute in
    (autocast's, inside ``torch.autocast``). Elsewhere False: the CPU flash kernel takes GQA in
    FP32 and BF16, and ``meta`` (FLOP counting) runs no kernel.
    """
    if q.device.type != "cuda" or q.shape[-3] == k.shape[-3]:
        return False
    dt = _compute_dtype(q)
    q, k, v = (x if x.dtype == dt else x.to(dt) for x in (q, k, v))
    cuda = torch.backends.cuda
    params = cuda.SDPAParams(q, k, v, attn_mask, dropout_p, is_causal, True)
    checks = [cuda.can_use_flash_attention, cuda.can_use_efficient_attention,
              getattr(cuda, "can_use_cudnn_attention", None)]
    return not any(check(params, False) for check in checks if check is not None)


def expand_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x`` of shape ``[..., Hkv, S, D]`` with each head repeated to ``heads``: head ``h`` is KV head
    ``h // (heads / Hkv)``, the grouping of SDPA's ``enable_gqa`` (``repeat_interleave`` on dim -3)."""
    kv = x.shape[-3]
    if heads % kv:
        raise ValueError(f"expand_kv_heads: {heads} query heads are not a multiple of {kv} key/value heads")
    group = heads // kv
    if group == 1:
        return x
    return x.unsqueeze(-3).expand(*x.shape[:-2], group, *x.shape[-2:]).reshape(*x.shape[:-3], heads, *x.shape[-2:])


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                            dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                            expand: bool | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, ..., enable_gqa=True)`` on a fused kernel wherever one exists.

    ``q`` is ``[..., H, L, E]``, ``k`` ``[..., Hkv, S, E]`` and ``v`` ``[..., Hkv, S, Ev]`` with
    ``H`` a multiple of ``Hkv``; returns ``[..., H, L, Ev]``. Where :func:`gqa_needs_expansion`
    says SDPA would fall back to the math kernel (FP32 on CUDA), ``k`` and ``v`` are expanded to
    ``H`` heads first (:func:`expand_kv_heads`, what transformers' ``repeat_kv`` does), so the
    memory-efficient kernel runs: the same outputs, gradients equal up to the order of the sums
    over each group, and ``2 * [..., H, S, E]`` more bytes held until the backward (the planner
    counts them in every case). Elsewhere it is SDPA with ``enable_gqa=True`` itself. ``expand``
    forces either path (None: decide as above). Raises ValueError if ``H`` is not a multiple of
    ``Hkv``.
    """
    if expand is None:
        expand = gqa_needs_expansion(q, k, v, attn_mask, dropout_p, is_causal)
    if expand:
        heads = q.shape[-3]
        return F.scaled_dot_product_attention(q, expand_kv_heads(k, heads), expand_kv_heads(v, heads), attn_mask,
                                              dropout_p, is_causal, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=True)


__all__ = ["REDUCTIONS", "chunk_bounds", "expand_kv_heads", "gqa_needs_expansion", "grouped_query_attention",
           "linear_cross_entropy", "linear_cross_entropy_work_bytes", "sequence_chunked", "without_autocast"]
