"""Trace a model into a :class:`~megatrain.ir.graph.LayerGraph` and one executable template per kind of layer.

Method. The model, wrapped so that it returns only its scalar loss, is exported with
``torch.export.export(strict=False)`` on the device its parameters are on (``meta`` for a model
too large to build: fake tensors, no parameter memory). The graph is cleaned so that a template
traced in FP32 runs the same under BF16 autocast, cut into layers at the children of the block
container (the ``nn.ModuleList`` holding the most parameters), and each layer's function is
rewritten where its intermediates would not fit (the LM head with its loss, large token-wise
regions a chunk of the sequence at a time); structurally equal layers share one template, and
each layer is measured (working memory, FLOPs, launches). When every block is the same module,
only three blocks are traced and the graph is repeated to the model's depth.

:func:`trace` runs :data:`PASSES`, each a function of one :class:`TraceContext` that fills the
fields later ones read; each module's docstring gives the method of its pass and its sources:

- :mod:`.export` (``export``): ``torch.export`` of the loss-only wrapper, naming the module that
  failed;
- :mod:`.cleanup` (``clean``): export's dtype asserts out, random ops that cannot be replayed refused
  (layers with dropout are marked ``Layer.draws_random`` by ``build_graph``), position math kept
  in FP32, grouped-query attention routed through :mod:`megatrain.kernels`;
- :mod:`.token_loss` (``sum_token_loss``): a mean cross-entropy loss as its sum over the
  micro-batch's targets, and the graph that counts them from a batch (the global batch's loss is
  the sum over its targets divided by their count);
- :mod:`.cut` (``cut``, ``share_templates``, ``build_graph``): stages, values, one GraphModule per
  layer, templates, the LayerGraph records;
- :mod:`.lm_head` (``fuse_lm_head_loss``): ``lm_head -> cross_entropy`` as one chunked kernel;
- :mod:`.seq_chunk` (``chunk_sequences``): Mini-Sequence Transformer chunking of token-wise regions;
- :mod:`.measure` (``measure``): work bytes by a liveness simulation, FLOPs and launches on meta;
- :mod:`.replicate` (``replicate``): the three-block trace repeated to full depth;
- :mod:`.vlm`: a vision-language model's vision blocks as a second block container, cut before
  the decoder's, and the shapes of its image inputs; :mod:`.qwen_vl`: Qwen2-VL's and Qwen2.5-VL's
  value-dependent tensors made on the host (grid-derived constants, M-RoPE positions per batch);
- :mod:`.hf` (transformers specifics: causal attention without an ``S x S`` mask, its configs) and
  :mod:`.fx_util` (fx helpers) serve the passes.

The planner's IR (:class:`~megatrain.ir.graph.TracedModel`, :func:`~megatrain.ir.graph.retarget`)
lives in :mod:`megatrain.ir.graph`; both are re-exported here for old imports.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from megatrain.errors import TraceError
from megatrain.ir.graph import TracedModel, retarget
from megatrain.planner.trace.cleanup import (clean, erase_metadata_asserts, install_grouped_query_attention,
                                             keep_position_math_fp32)
from megatrain.planner.trace.context import TraceContext, TraceOptions
from megatrain.planner.trace.cut import build_graph, check_covers_params, cut, find_block_container, share_templates
from megatrain.planner.trace.export import check_model, export, model_dtype
from megatrain.planner.trace.hf import causal_attention
from megatrain.planner.trace.lm_head import DEFAULT_LOSS_CHUNK_BYTES, chunk_lm_head_loss, fuse_lm_head_loss
from megatrain.planner.trace.measure import measure
from megatrain.planner.trace.replicate import pick_blocks, replicate, short_copy, why_not_replicate
from megatrain.planner.trace.token_loss import sum_token_loss
from megatrain.planner.trace.vlm import image_inputs, vision_tower
from megatrain.planner.trace.seq_chunk import (DEFAULT_SEQ_CHUNK_BYTES, MIXED, chunk_sequence_regions,
                                               chunk_sequences, sequence_dims)

PASSES: tuple[Callable[[TraceContext], None], ...] = (
    export,             # the loss-only wrapper as one aten graph
    clean,              # in every nested graph: asserts out, replayable randomness, FP32 positions, GQA
    sum_token_loss,     # a mean cross-entropy as its sum over the targets, and a counter of them
    cut,                # stages, values, one GraphModule per layer
    fuse_lm_head_loss,  # before chunk_sequences: the pattern starts at the LM head's linear, which is token-wise
    chunk_sequences,    # large token-wise regions a chunk of the sequence at a time
    share_templates,    # structurally equal layers share one template (after the rewrites above)
    measure,            # work bytes per layer; FLOPs and launches per template
    build_graph,        # the LayerGraph and the TracedModel
    replicate,          # a three-block trace repeated to the model's depth (full traces pass through)
)
"""The trace pipeline, in order; :func:`trace` runs it on the model or its three-block copy."""


def run_passes(ctx: TraceContext) -> TraceContext:
    """Run :data:`PASSES` over ``ctx`` in order; returns it."""
    for p in PASSES:
        p(ctx)
    return ctx


def trace(model: nn.Module, *, micro_batch_size: int, seq_len: int,
          input_names: Sequence[str] = ("input_ids", "labels"), replicate_blocks: bool = True,
          loss_chunk_bytes: int | None = DEFAULT_LOSS_CHUNK_BYTES,
          seq_chunk_bytes: int | None = DEFAULT_SEQ_CHUNK_BYTES, param_dtype: torch.dtype | None = None,
          image_grid_thw: Sequence[Sequence[int]] | None = None, images_per_row: int = 1) -> TracedModel:
    """Trace ``model`` into a LayerGraph for micro-batches of ``[micro_batch_size, seq_len]``.

    ``model(**{name: LongTensor[micro_batch_size, seq_len] for name in input_names})`` must return
    its scalar loss (a tensor, an object with ``.loss`` or a tuple whose first element is the loss).
    A vision-language model of :data:`.vlm.FAMILIES` (LLaVA) may take ``pixel_values`` among them,
    ``FloatTensor[micro_batch_size * images_per_row, C, H, W]`` (``images_per_row`` images per row,
    row by row): its vision blocks become layers too (:mod:`.vlm`). Qwen2-VL and Qwen2.5-VL take ``pixel_values`` and ``image_grid_thw``, each row
    any images within the patches of the grids ``image_grid_thw`` (``[(t, h, w), ...]``, default one
    448x448 image), and are traced with their M-RoPE positions and the vision tower's grid-derived
    tensors as inputs instead of the grid (:mod:`.qwen_vl`).
    The model may live on the ``meta`` device; no parameter memory is touched either way, and the
    model is not modified.

    ``replicate_blocks``: trace three blocks and repeat them when every block is the same (see
    :mod:`.replicate`); the graph equals the full trace's. ``loss_chunk_bytes``: the bytes of
    one chunk of logits for :func:`chunk_lm_head_loss`, or None to keep the LM head and loss as
    the model wrote them. ``seq_chunk_bytes``: for :func:`chunk_sequence_regions`, the intermediate
    bytes above which a token-wise region of a layer runs in chunks of the sequence, and about the
    bytes of one chunk's intermediates; None runs every region whole. ``param_dtype``: trace the
    model with its floating parameters in this dtype (the compute dtype: BF16 compute traces a
    BF16-built template, whose activations, checkpoints and residual stream are BF16, as mixed
    precision in FSDP2 and DeepSpeed runs it), buffers as they are; None traces the parameters'
    own dtype. ``graph.meta["param_dtype"]`` records the dtype traced in.

    The three-block copy is traced first when :func:`why_not_replicate` finds the blocks
    interchangeable; if it fails to trace (any TraceError) or its blocks disagree, :data:`PASSES`
    run again on the full model. ``graph.meta`` records ``trace`` (``"replicated"`` or ``"full"``),
    ``trace_full_because``, ``skip_causal_mask``, ``param_dtype``, any ``unused_parameters``, a
    vision-language model's ``vision_container`` (its vision blocks' layers are named under it), and
    a Qwen2-VL's ``image_grid_thw`` (the grids whose patches are a row's budget), and
    ``uncounted_loss_because`` when the loss is not a mean cross-entropy that
    :func:`~megatrain.planner.trace.token_loss.sum_token_loss` can sum and count
    (``TracedModel.count_targets`` is then None).

    Raises:
        TraceError: export failed (names the module that was running and the failing op), or a
            size argument is below 1.
        UnsupportedModelError: no trainable parameters, or
            blocks called out of order.
    """
    images = image_inputs(model, input_names, micro_batch_size, seq_len, image_grid_thw, images_per_row)
    options = TraceOptions(micro_batch_size=micro_batch_size, seq_len=seq_len, input_names=images.names,
                           loss_chunk_bytes=loss_chunk_bytes, seq_chunk_bytes=seq_chunk_bytes,
                           param_dtype=param_dtype, call=images.call,
                           input_shapes=tuple((name, shape, dtype) for name, (shape, dtype) in images.shapes.items()))
    check_model(model, tuple(input_names))
    tower, vision = vision_tower(model, options.input_names) or (None, None)
    container = find_block_container(model, skip=tower)
    with causal_attention(model, options.input_names) as mask_free, images.attention(model):
        why = why_not_replicate(model, container) if replicate_blocks else "replicate_blocks=False"
        if vision is not None:
            why = f"a vision-language model (vision blocks in {vision}) is traced in full"
        ctx = None
        if why is None:
            picks = pick_blocks(len(model.get_submodule(container)))
            try:
                ctx = run_passes(TraceContext(model=model, module=short_copy(model, container, picks),
                                              options=options, container=container, picks=picks))
            except TraceError as e:
                # The full trace either succeeds or raises this error with the real block names.
                why = f"the three-block copy did not trace ({type(e).__name__})"
            else:
                why = ctx.full_because
        if why is not None:
            ctx = run_passes(TraceContext(model=model, module=model, options=options, container=container,
                                          vision_container=vision))
    traced = ctx.traced
    traced.graph.meta.update(trace="full" if why else "replicated", skip_causal_mask=mask_free,
                             param_dtype=str(param_dtype or model_dtype(model)).removeprefix("torch."))
    if why:
        traced.graph.meta["trace_full_because"] = why
    if vision is not None:
        traced.graph.meta["vision_container"] = vision
    if images.grid is not None:
        traced.graph.meta["image_grid_thw"] = [list(g) for g in images.grid]
    check_covers_params(model, traced.graph)
    return traced


__all__ = ["DEFAULT_LOSS_CHUNK_BYTES", "DEFAULT_SEQ_CHUNK_BYTES", "MIXED", "PASSES", "TraceContext",
           "TraceOptions", "TracedModel", "chunk_lm_head_loss", "chunk_sequence_regions", "erase_metadata_asserts",
           "install_grouped_query_attention", "keep_position_math_fp32", "retarget", "run_passes", "sequence_dims",
           "trace"]
