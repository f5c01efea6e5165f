"""A token-wise region of a layer, run a chunk of the sequence at a time.

``sequence_chunked``: a region of a layer whose ops treat every sequence position on its own
(norms, projections, rotary embeddings, the MLP; found by
:func:`megatrain.planner.trace.seq_chunk.chunk_sequence_regions`), run ``chunks`` slices of the
sequence at a time, the method of Mini-Sequence Transformer (Luo et al. 2024, "Mini-Sequence Transformer:
Optimizing Intermediate Memory for Long Sequences Training", arXiv:2407.15892). At a 512k-token
sequence the MLP of a 7B block alone creates 43 GiB of intermediates; a chunk of 2k tokens creates
170 MiB. Each chunk runs under ``torch.utils.checkpoint`` (non-reentrant): its forward keeps only
its inputs, and the backward recomputes that one chunk's intermediates just before it needs them,
so a local backward holds one chunk's intermediates and their gradients at a time, at the price of
one more forward of the region (its FLOPs show up in the layer's ``bwd_flops``; the checkpoint stops
recomputing once every tensor the backward saved is back, so a last matmul whose saved tensors are
its inputs is not run again). Inputs are split and outputs concatenated along their sequence
dimension once, with ``split`` and ``cat``, whose backward passes are one ``cat`` and views: a
``narrow`` per chunk would have each chunk's backward allocate a zero-filled gradient of the whole
input.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint


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
    ops (random ops are not token-wise, so the tracer never puts one in a chunked region), so no RNG
    state needs replaying. Under ``no_grad`` the chunks
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

__all__ = ["chunk_bounds", "sequence_chunked"]
