"""Grouped-query attention that never falls back to SDPA's math kernel.

:func:`grouped_query_attention` is installed in layer templates by
:func:`megatrain.planner.trace.cleanup.install_grouped_query_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes ``t`` in here: autocast's where it is on and would cast ``t``."""
    dev = t.device.type
    if (t.dtype == torch.float32 and torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)):
        return torch.get_autocast_dtype(dev)
    return t.dtype


_GQA_CHECKS: dict[tuple, bool] = {}
""":func:`gqa_needs_expansion`'s answers by :func:`_sdpa_key`: a template calls it on every forward
and recompute with the same shapes, and asking SDPA's checks costs three tensor allocations."""

_GQA_CHECKS_MAX = 256
"""Entries kept before the cache starts afresh (a model has a few attention shapes per batch shape)."""


def gqa_needs_expansion(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                        dropout_p: float = 0.0, is_causal: bool = False) -> bool:
    """Whether ``scaled_dot_product_attention(..., enable_gqa=True)`` would run on the math kernel here.

    On CUDA only the flash and cuDNN kernels take ``enable_gqa`` (FP16/BF16 only); the
    memory-efficient kernel, the one FP32 runs on, rejects it (PyTorch ``sdp_utils``,
    ``check_grouped_query_attention``; huggingface/transformers#46960), and SDPA then silently
    runs the math kernel, which holds ``[B, H, S, S]`` scores. Asks PyTorch's own checks
    (``torch.backends.cuda.can_use_*_attention``) on inputs in the dtype SDPA will compute in
    (autocast's, inside ``torch.autocast``), once per call signature (:func:`_sdpa_key`: shapes,
    strides, dtypes, device, mask, dropout, causality, which tensors require grad and which
    kernels are enabled); later calls with the same signature read the cached answer. Elsewhere
    False: the CPU flash kernel takes GQA in FP32 and BF16, and ``meta`` (FLOP counting) runs no
    kernel.

    Also False with attention dropout (``dropout_p > 0``): eager PyTorch (transformers'
    ``enable_gqa=True`` call) then runs the math kernel, which draws its mask with
    ``native_dropout``, while the memory-efficient kernel draws another mask from the same
    generator state (its own Philox layout), so expanding would train on other masks than eager
    training does: on an H100 (2026-11-27, bench/gpu_diag_exactness.py) a 2-layer Llama with
    attention dropout 0.1 left eager by 4e-4 at step 0 expanded and by 7e-9 on the math kernel.
    The planner counts the math kernel's saved scores there (``work_bytes``).
    """
    if dropout_p > 0 or q.device.type != "cuda" or q.shape[-3] == k.shape[-3]:
        return False
    return _cached_needs_expansion(q, k, v, attn_mask, dropout_p, is_causal)


def _sdpa_key(q, k, v, attn_mask, dropout_p, is_causal) -> tuple:
    """Everything SDPA's kernel checks read: the inputs' shapes, strides, compute dtype, device and
    ``requires_grad``, the mask's shape, strides and dtype, dropout, causality, and the global switches
    that enable each kernel."""
    dt = _compute_dtype(q)
    cuda = torch.backends.cuda
    mask = None if attn_mask is None else (attn_mask.shape, attn_mask.stride(), attn_mask.dtype)
    return (tuple((x.shape, x.stride(), x.requires_grad) for x in (q, k, v)), dt, q.device, mask,
            dropout_p, is_causal, torch.is_grad_enabled(), cuda.flash_sdp_enabled(),
            cuda.mem_efficient_sdp_enabled(), getattr(cuda, "cudnn_sdp_enabled", lambda: None)())


def _cached_needs_expansion(q, k, v, attn_mask, dropout_p, is_causal) -> bool:
    key = _sdpa_key(q, k, v, attn_mask, dropout_p, is_causal)
    got = _GQA_CHECKS.get(key)
    if got is None:
        if len(_GQA_CHECKS) >= _GQA_CHECKS_MAX:
            _GQA_CHECKS.clear()
        got = _GQA_CHECKS[key] = _ask_sdpa(q, k, v, attn_mask, dropout_p, is_causal, key[1])
    return got


def _ask_sdpa(q, k, v, attn_mask, dropout_p, is_causal, dt: torch.dtype) -> bool:
    """Whether no fused kernel takes these inputs with ``enable_gqa`` (PyTorch's checks). The checks
    read metadata only, so inputs of another dtype stand in as uninitialised tensors of the same
    layout, not copies."""
    q, k, v = (x if x.dtype == dt else torch.empty_like(x, dtype=dt).requires_grad_(x.requires_grad)
               for x in (q, k, v))
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
    memory-efficient kernel runs (never with attention dropout: eager's masks come from the math
    kernel): the same outputs, gradients equal up to the order of the sums
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




__all__ = ["expand_kv_heads", "gqa_needs_expansion", "grouped_query_attention"]
