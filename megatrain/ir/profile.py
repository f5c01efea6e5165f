"""Kernel profiles: what one call of a layer template dispatches, op by op, for the time model.

Why. A layer's forward or local backward is a few hundred aten ops, each issued by the one
Python thread and each (but views) one kernel on the GPU. Its time is neither its FLOPs over one
rate nor its op count times a launch cost: the matmuls are compute-bound at a rate that depends
on their shape, the attention kernel runs at its own rate, the element-wise work (RMSNorm in FP32,
rotary embeddings, SwiGLU, casts: about 0.3 MB per token forward and 1.0 MB per token backward in
a 1B Llama block) is memory-bound, and the GPU runs each kernel when it has been issued and its
stream is free. :class:`KernelProfile` keeps, per dispatched op, what the time model
(:mod:`megatrain.planner.time`) needs for that: its kind, FLOPs, bytes moved, and whether the
Python thread or the autograd engine issued it.

Method. :func:`profile_template` runs the template once on the ``meta`` device (no memory, any
size) under a dispatch mode that records every aten op: FLOPs from
``torch.utils.flop_counter``'s formulas (the ones ``FlopCounterMode`` uses), bytes as the sum of
the distinct elements of each tensor argument and result (a broadcast operand counts once, a view
counts its own elements), views and allocations as ops that launch no kernel. Meta tensors have no
fused attention kernel, so ``scaled_dot_product_attention`` would run its math decomposition
(about 40 ops forward at a 1B block, the op counts 18-55% high); the profile intercepts the call
and records it as the one fused kernel a GPU dispatches forward and the
one it dispatches backward (``_scaled_dot_product_flash_attention`` and its backward), with
``torch.utils.flop_counter``'s SDPA formulas (grouped-query heads broadcast, causal masking not
subtracted: ``Kernel.causal`` marks it).

The local backward's profile is its recompute (issued by Python, with autograd recording) followed
by ``torch.autograd.grad`` (issued by the autograd engine from C++, without Python per op:
``Kernel.autograd``), as the executor runs a BWD op (:func:`megatrain.runtime.executor.local_backward`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, Sequence

__all__ = ["KernelKind", "Kernel", "KernelProfile", "profile_template"]


class KernelKind(enum.Enum):
    """What an op costs the GPU."""

    NONE = "none"  # a view or an allocation: the issuing thread's time only
    MATMUL = "matmul"  # compute-bound: FLOPs at the matmul rate (or its bytes, when fewer FLOPs per byte)
    ATTENTION = "attention"  # the fused attention kernel, forward
    ATTENTION_BACKWARD = "attention_backward"  # its backward
    MEMORY = "memory"  # element-wise, reductions, copies, casts: bytes at the memory bandwidth


@dataclass(frozen=True, slots=True)
class Kernel:
    """One dispatched aten op of a template call, for one micro-batch.

    ``flops``: as ``torch.utils.flop_counter`` counts them (0 for memory-bound ops); ``nbytes``:
    bytes of the distinct elements its tensor arguments and results hold; ``autograd``: issued by
    the autograd engine (a backward op), not by the template's Python code; ``causal``: an
    attention kernel with a causal mask, whose kernel computes about half the counted FLOPs."""

    op: str
    kind: KernelKind
    flops: int = 0
    nbytes: int = 0
    autograd: bool = False
    causal: bool = False


@dataclass(frozen=True, slots=True)
class KernelProfile:
    """The ops one call (a FWD, or a BWD: recompute and backward) dispatches, in issue order."""

    kernels: tuple[Kernel, ...]

    @property
    def launches(self) -> int:
        """Aten ops dispatched (each costs the issuing thread one dispatch, kernels or not)."""
        return len(self.kernels)

    @property
    def autograd_launches(self) -> int:
        return sum(1 for k in self.kernels if k.autograd)

    @property
    def flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    @property
    def memory_bytes(self) -> int:
        """Bytes the memory-bound kernels move."""
        return sum(k.nbytes for k in self.kernels if k.kind is KernelKind.MEMORY)

    def scaled(self, k: int) -> "KernelProfile":
        """The profile of a micro-batch ``k`` times as large (``solve.scale_graph``): each kernel's
        FLOPs and bytes times ``k``. Exact for the FLOPs of per-token and per-sequence work; it
        over-counts the bytes of operands that do not grow with the batch (a matmul's weight, a
        weight gradient), which are a small part of a memory-bound kernel's traffic."""
        if k == 1:
            return self
        return KernelProfile(tuple(replace(x, flops=x.flops * k, nbytes=x.nbytes * k) for x in self.kernels))


def profile_template(gm: Any, args: Sequence[Any], grad_args: Sequence[bool]) -> tuple[KernelProfile, KernelProfile]:
    """(forward profile, local backward profile) of template ``gm`` called with ``args`` (tensors of
    any device; their shapes and dtypes are what count), ``grad_args[i]``: argument ``i`` is
    differentiated. Runs on ``meta``; see the module docstring."""
    import torch

    from megatrain.ir.devices import retarget

    Recorder, FusedAttention = _recorders()
    fn = retarget(gm, torch.device("meta"))
    metas = [torch.empty(a.shape, dtype=a.dtype, device="meta") for a in args]
    rec = Recorder()
    with FusedAttention(rec), rec, torch.no_grad():
        fn(*metas)
    fwd = KernelProfile(tuple(rec.kernels))
    rec = Recorder()
    leaves = [m.requires_grad_(g) if g else m for m, g in zip(metas, grad_args)]
    with FusedAttention(rec), rec, torch.enable_grad():
        outs = [o for o in fn(*leaves) if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [m for m, g in zip(leaves, grad_args) if g]
        if outs and wrt:
            rec.muted += 1  # the seeds: the gradients of the outputs arrive made (the loss's is one fill)
            seeds = [torch.ones_like(o) for o in outs]
            rec.muted -= 1
            rec.autograd = True
            torch.autograd.grad(outs, wrt, seeds, allow_unused=True)
    return fwd, KernelProfile(tuple(rec.kernels))


# -- recording -------------------------------------------------------------------------------------

_NO_KERNEL = frozenset({
    "aten._unsafe_view", "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
    "aten.new_empty_strided", "aten.detach", "aten.alias", "aten.lift_fresh", "aten._reshape_alias",
    "aten.set_", "aten.resize_", "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset",
})
"""Aten ops that allocate or alias without a kernel, besides views (``OpOverload.is_view``)."""


def _distinct_bytes(t: Any) -> int:
    """Bytes of the distinct elements ``t`` holds: a dimension of stride 0 (a broadcast) counts once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(x: Any) -> list:
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _recorders() -> tuple[type, type]:
    """The dispatch mode that records ops and the function mode that fuses attention (defined here:
    they subclass torch's modes, and this module's types import without torch)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        """Records each aten op dispatched inside it as a :class:`Kernel`; while ``muted`` (the math
        decomposition a fused kernel stands for) ops run but are not recorded."""

        def __init__(self) -> None:
            super().__init__()
            self.kernels: list[Kernel] = []
            self.autograd = False
            self.muted = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            from torch.utils.flop_counter import flop_registry

            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if self.muted:
                return out
            name = str(func.overloadpacket)
            if func.is_view or name in _NO_KERNEL:
                self.kernels.append(Kernel(name, KernelKind.NONE, autograd=self.autograd))
                return out
            tensors = {id(t): t for t in _tensors(list(args) + list(kwargs.values())) + _tensors(out)}
            nbytes = sum(_distinct_bytes(t) for t in tensors.values())
            counter = flop_registry.get(func.overloadpacket)
            flops = int(counter(*args, **kwargs, out_val=out)) if counter is not None else 0
            kind = KernelKind.MATMUL if flops else KernelKind.MEMORY
            self.kernels.append(Kernel(name, kind, flops, nbytes, self.autograd))
            return out

    class FusedAttention(TorchFunctionMode):
        """Inside it, ``scaled_dot_product_attention`` is recorded as one fused kernel forward and one
        backward (module docstring); its math decomposition runs muted, so shapes and autograd follow."""

        def __init__(self, rec: Recorder) -> None:
            super().__init__()
            self.rec = rec

        def __torch_function__(self, func, types, args=(), kwargs=None):
            import torch
            import torch.nn.functional as F

            kwargs = kwargs or {}
            # A template exported from the model calls the aten op; megatrain's GQA kernel calls F's.
            if func is F.scaled_dot_product_attention or func is torch.ops.aten.scaled_dot_product_attention.default:
                return _sdpa(self.rec, *args, **kwargs)
            return func(*args, **kwargs)

    return Recorder, FusedAttention


def _sdpa(rec, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    qs, ks, vs = (tuple(t.shape) for t in (query, key, value))
    lead = qs[:-3]
    b = 1
    for d in lead:
        b *= d
    q4, k4, v4 = ((b, *s[-3:]) for s in (qs, ks, vs))  # the flop formulas take [B, H, S, E]
    out_shape = (*qs[:-1], vs[-1])
    mask_bytes = _distinct_bytes(attn_mask) if isinstance(attn_mask, torch.Tensor) else 0
    io = sum(_distinct_bytes(t) for t in (query, key, value)) + mask_bytes
    itemsize = query.element_size()
    out_bytes = itemsize
    for d in out_shape:
        out_bytes *= d
    causal = bool(is_causal)

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            rec.kernels.append(Kernel("aten._scaled_dot_product_flash_attention", KernelKind.ATTENTION,
                                      sdpa_flop_count(q4, k4, v4), io + out_bytes, rec.autograd, causal))
            rec.muted += 1
            try:
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                          enable_gqa=enable_gqa)
            finally:
                rec.muted -= 1

        @staticmethod
        def backward(ctx, grad):
            rec.kernels.append(Kernel("aten._scaled_dot_product_flash_attention_backward",
                                      KernelKind.ATTENTION_BACKWARD,
                                      sdpa_backward_flop_count((b, *out_shape[-3:]), q4, k4, v4),
                                      2 * io + 2 * out_bytes, True, causal))
            rec.muted += 1
            try:
                return tuple(torch.empty(s, dtype=query.dtype, device=grad.device) for s in (qs, ks, vs))
            finally:
                rec.muted -= 1

    return Fused.apply(query, key, value)
