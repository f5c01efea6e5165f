"""Qwen2-VL and Qwen2.5-VL: images of a fixed patch grid, their value-dependent tensors made on the host.

Qwen2-VL (Wang et al., "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at
Any Resolution", arXiv:2409.12191; transformers' ``Qwen2VLForConditionalGeneration``) and Qwen2.5-VL
(arXiv:2502.13923, ``Qwen2_5_VLForConditionalGeneration``) take every image of a batch as one
flat sequence of patches, ``pixel_values: FloatTensor[patches, C*T*P*P]``, with ``image_grid_thw:
LongTensor[images, 3]`` (frames, rows and columns of patches of each image). Their forward reads
sizes from tensor values: ``image_grid_thw.tolist()`` for the vision rotary positions, the
per-image ``cu_seqlens`` split of the vision attention, Qwen2.5-VL's window index, and the
M-RoPE positions (``get_rope_index``, a Python loop over ``input_ids``). A fixed-shape trace cannot
follow those, so:

- The **image grid is part of the traced shape**: every row carries the same images, of the grids
  ``image_grid_thw`` given to ``megatrain.compile`` (default: one 448x448 image per row). What
  depends only on the grid is computed once on the host at trace time by transformers' own
  functions (``transformers.vision_utils``: ``get_vision_position_ids``,
  ``get_vision_cu_seqlens``, ``get_vision_window_index``) and given to the vision tower through
  its precomputed-tensor keywords; the trace holds them as constants, which each layer that reads
  them gets as a buffer.
- The vision attention's per-image split (``torch.split`` by ``cu_seqlens.tolist()``) becomes one
  SDPA call over the micro-batch's patches with the block-diagonal mask ``cu_seqlens`` describes
  (the same per-image attention: masked keys add exact zeros). The model's attention code runs
  unchanged: for the export only, the vision config names an attention implementation registered
  through transformers' ``AttentionInterface`` (:func:`varlen_attention`) that takes the
  variable-length keywords (``cu_seq_lens_q``) the model passes to FlashAttention-2's varlen kernel.
  Its cost: scores over all the micro-batch's patches, ``(rows x patches per row) ** 2`` per head,
  where the split computes each image's (or window's: Qwen2.5-VL's windows of 8x8 patches make
  its window blocks' attention the larger overhead); the trace measures, and the planner counts,
  what runs.
- The **M-RoPE positions depend on where each row's image tokens are**, so they are a batch input,
  ``mrope_position_ids: LongTensor[rows, 3, seq_len]``, computed per batch on the host by the
  model's own ``get_rope_index`` (:func:`prepare_batch`), and passed to ``forward`` as its
  ``position_ids``.
- The traced forward calls the vision tower itself (patch embedding, blocks, merger) and hands its
  features to the model's forward as ``mm_encoder_outputs``, which skips the ``image_grid_thw``
  split of ``get_image_features``; the text embedding is computed first, so it is in the prologue
  beside the patch embedding, and the merger and the scatter into the text embeddings make the
  connector layer (``model.visual.merger``).

A batch gives ``input_ids``, ``labels``, ``pixel_values`` and ``image_grid_thw`` (and optionally
``attention_mask`` and ``mm_token_type_ids``) as the model's processor returns them;
:func:`prepare_batch` checks them (BatchError) and turns them into the traced inputs.
Videos are not supported.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from megatrain.errors import BatchError, ConfigError, UnsupportedModelError

GRID_INPUT = "image_grid_thw"
"""The batch input with each image's patch grid, ``LongTensor[images, 3]`` (frames, rows, columns)."""
TOKEN_TYPES = "mm_token_type_ids"
"""The processor's modality of each token (0 text, 1 image), ``[rows, seq_len]``; optional."""
ROPE_INPUT = "mrope_position_ids"
"""The traced input with the M-RoPE positions, ``LongTensor[rows, 3, seq_len]`` (temporal, height,
width), made on the host by :func:`prepare_batch`."""
DEFAULT_IMAGE_PIXELS = 448
"""The side of the image each row carries by default (Qwen2-VL's processor keeps a 448x448 image
at that size: 32x32 patches of 14 pixels, 256 image tokens)."""

_VARLEN_ATTENTION = "megatrain_flash_varlen_sdpa"
"""The attention implementation :func:`varlen_attention` registers. transformers passes the
variable-length keywords to implementations whose name contains ``flash``
(``is_flash_attention_requested``)."""


@dataclass(frozen=True, slots=True)
class PatchGridFamily:
    """A vision-language family whose images are flattened patches with a grid (Qwen2-VL's).

    ``vision_tower``: the module path of the vision encoder; ``blocks``: its block container,
    within it. ``windowed``: the tower alternates window attention with full attention
    (Qwen2.5-VL's ``fullatt_block_indexes``).
    """

    model_type: str
    vision_tower: str
    blocks: str = "blocks"
    windowed: bool = False


def _vision_utils(model: nn.Module, tower: nn.Module):
    """transformers' ``vision_utils``, where this model's code takes what they compute precomputed.

    Raises:
        UnsupportedModelError: an older transformers (5.4 computes the grid tensors inside the
            vision tower's forward and has no ``mm_encoder_outputs``), naming the installed version.
    """
    import inspect
    import sys

    try:
        from transformers import vision_utils
    except ImportError:
        vision_utils = None
    modeling = sys.modules.get(type(tower).__module__)
    if (vision_utils is None or not hasattr(vision_utils, "get_vision_window_index")
            or getattr(modeling, "get_vision_position_ids", None) is not vision_utils.get_vision_position_ids
            or "mm_encoder_outputs" not in inspect.signature(model.forward).parameters):
        import transformers

        raise UnsupportedModelError(
            f"Qwen2-VL and Qwen2.5-VL with images need a transformers whose vision tower takes its grid-derived "
            f"tensors precomputed (transformers.vision_utils) and whose forward takes mm_encoder_outputs; the "
            f"installed {transformers.__version__} computes them inside the forward, which a fixed-shape trace "
            "cannot follow: upgrade transformers, or train on text alone (input_names without pixel_values)")
    return vision_utils


def row_grid(config: Any, grid: Sequence[Sequence[int]] | None) -> tuple[tuple[int, int, int], ...]:
    """The grids of one row's images, as ``((t, h, w), ...)``: ``grid`` checked, or one
    :data:`DEFAULT_IMAGE_PIXELS`-pixel square image (``(1, 448 / patch_size, 448 / patch_size)``,
    rounded down to whole merge windows).

    Raises:
        ConfigError: a grid that is not ``(t, h, w)`` positive integers with ``h`` and ``w``
            multiples of the vision config's ``spatial_merge_size``.
    """
    v = config.vision_config
    merge = v.spatial_merge_size
    if grid is None:
        side = max(DEFAULT_IMAGE_PIXELS // v.patch_size // merge, 1) * merge
        return ((1, side, side),)
    rows = tuple(tuple(int(x) for x in g) for g in grid)
    bad = [g for g in rows if len(g) != 3 or min(g) < 1 or g[1] % merge or g[2] % merge]
    if not rows or bad:
        raise ConfigError(
            f"image_grid_thw={list(grid)}: give each image of a row as (t, h, w), positive patch counts with h and w "
            f"multiples of spatial_merge_size={merge} (what the processor returns in image_grid_thw: an image of "
            f"H x W pixels is (1, H / {v.patch_size}, W / {v.patch_size}))")
    return rows


def row_grids(batch: Mapping[str, torch.Tensor]) -> tuple[tuple[int, int, int], ...] | None:
    """The grids of one row's images in a batch with ``image_grid_thw`` (every row alike), or None
    for a batch without it.

    Raises:
        BatchError: ``image_grid_thw`` that does not split into the same grids for every row of
            ``input_ids`` (names what to change).
    """
    grids = batch.get(GRID_INPUT)
    if grids is None:
        return None
    rows = batch["input_ids"].shape[0]
    if grids.dim() != 2 or grids.shape[1] != 3 or grids.shape[0] % rows:
        raise BatchError(f"batch['image_grid_thw'] has shape {tuple(grids.shape)}; it gives each image's (t, h, w), "
                         f"the same number of images for each of the {rows} rows: [{rows} x images per row, 3]")
    per_row = grids.view(rows, -1, 3)
    if not bool((per_row == per_row[:1]).all()):
        raise BatchError(f"the rows of this batch carry images of different grids ({grids.tolist()}); megatrain "
                         "traces one grid per shape, the same for every row: batch images of one size together, "
                         "or resize them to one size")
    return tuple(tuple(int(x) for x in g) for g in per_row[0].tolist())


def patch_features(config: Any) -> int:
    """Elements of one flattened patch: ``in_channels * temporal_patch_size * patch_size ** 2``."""
    v = config.vision_config
    return v.in_channels * v.temporal_patch_size * v.patch_size ** 2


def image_tokens(config: Any, grid: Sequence[Sequence[int]]) -> int:
    """Image tokens the images of ``grid`` fill in ``input_ids``: a token per merged
    ``spatial_merge_size ** 2`` patches."""
    return sum(t * h * w for t, h, w in grid) // config.vision_config.spatial_merge_size ** 2


def traced_names(input_names: Sequence[str]) -> tuple[str, ...]:
    """The traced inputs for a batch of ``input_names``: ``image_grid_thw`` becomes
    :data:`ROPE_INPUT` (the grid itself is part of the traced shape), ``mm_token_type_ids`` is read
    on the host only.

    Raises:
        UnsupportedModelError: ``pixel_values`` without ``image_grid_thw``, or ``position_ids``
            (M-RoPE positions are made from the grid and the image tokens).
    """
    names = tuple(input_names)
    if GRID_INPUT not in names:
        raise UnsupportedModelError(
            f"Qwen2-VL takes each batch's image grids beside pixel_values: compile with input_names including "
            f"{GRID_INPUT!r} (and give it in every batch, as the processor returns it)")
    if "position_ids" in names:
        raise UnsupportedModelError(
            "position_ids among the inputs of Qwen2-VL with images: megatrain computes its M-RoPE positions from "
            "input_ids and image_grid_thw with the model's get_rope_index; drop position_ids")
    return tuple(ROPE_INPUT if n == GRID_INPUT else n for n in names if n != TOKEN_TYPES)


def input_shapes(config: Any, grid: Sequence[Sequence[int]], micro_batch_size: int,
                 seq_len: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The traced shapes of one micro-batch's images and positions: ``pixel_values``
    ``[micro_batch_size, patches per row, C*T*P*P]`` float32 and :data:`ROPE_INPUT`
    ``[micro_batch_size, 3, seq_len]`` int64.

    Raises:
        ConfigError: a row's images fill more tokens than ``seq_len``.
    """
    tokens = image_tokens(config, grid)
    if tokens > seq_len:
        raise ConfigError(f"each row's images of grids {[list(g) for g in grid]} fill {tokens} image tokens, more "
                          f"than seq_len={seq_len}: raise seq_len, or give smaller images (image_grid_thw)")
    patches = sum(t * h * w for t, h, w in grid)
    return {"pixel_values": ((micro_batch_size, patches, patch_features(config)), torch.float32),
            ROPE_INPUT: ((micro_batch_size, 3, seq_len), torch.int64)}


def vision_constants(model: nn.Module, fam: PatchGridFamily, grid: Sequence[Sequence[int]],
                     micro_batch_size: int) -> dict[str, Any]:
    """The vision tower's grid-derived keywords for one micro-batch (``micro_batch_size`` rows of
    the images of ``grid``), by transformers' own functions: ``position_ids`` ``[patches, 2]`` of
    the rotary embedding, ``cu_seqlens`` (each image's boundary) and ``max_seqlen``; for a
    windowed tower also ``window_index``, ``cu_window_seqlens`` and ``max_window_seqlen``."""
    tower = model.get_submodule(fam.vision_tower)
    vu = _vision_utils(model, tower)
    config = tower.config
    grid_thw = torch.tensor([g for _ in range(micro_batch_size) for g in grid], dtype=torch.long)
    cu = vu.get_vision_cu_seqlens(grid_thw)
    out = {"position_ids": vu.get_vision_position_ids(grid_thw, config.spatial_merge_size),
           "cu_seqlens": cu, "max_seqlen": int((cu[1:] - cu[:-1]).max())}
    if fam.windowed:
        index, cu_window = vu.get_vision_window_index(grid_thw, config.spatial_merge_size, config.window_size,
                                                      config.patch_size)
        out.update(window_index=index, cu_window_seqlens=cu_window,
                   max_window_seqlen=int((cu_window[1:] - cu_window[:-1]).max()))
    # On the parameters' device, as the buffers they meet are (meta for a model too large to build).
    device = next(tower.parameters()).device
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def trace_call(model: nn.Module, fam: PatchGridFamily, grid: Sequence[Sequence[int]], micro_batch_size: int):
    """The function the trace's loss wrapper calls the model with, for batches of the traced names
    (:func:`traced_names`): the text embedding, the vision tower on the micro-batch's patches with
    the grid's constants (:func:`vision_constants`), then the model's forward with those features
    (``mm_encoder_outputs``) and the M-RoPE positions (``position_ids``, ``[3, rows, seq_len]``)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    constants = vision_constants(model, fam, grid, micro_batch_size)

    def call(m: nn.Module, **batch: torch.Tensor):
        pixels, positions = batch.pop("pixel_values"), batch.pop(ROPE_INPUT)
        # First, so that the text embedding is in the prologue with the patch embedding.
        embeds = m.get_input_embeddings()(batch["input_ids"])
        tower = m.get_submodule(fam.vision_tower)
        features = tower(pixels.flatten(0, 1).type(tower.dtype), grid_thw=None, **constants).pooler_output
        return m(**batch, inputs_embeds=embeds, position_ids=positions.transpose(0, 1),
                 mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=(features,))})

    return call


def _masked_varlen_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None = None,
                        cu_seq_lens_k: torch.Tensor | None = None, max_length_q: int | None = None,
                        max_length_k: int | None = None, **kwargs):
    """Variable-length attention over packed sequences (FlashAttention-2's ``flash_attn_varlen_func``
    contract: ``query`` ``[1, heads, L, head_dim]``, sequence ``i`` at ``cu_seq_lens_q[i]:
    cu_seq_lens_q[i + 1]``) as transformers' SDPA attention with the block-diagonal mask those
    boundaries make: each position attends to the keys of its own sequence only. Returns
    ``([1, L, heads, head_dim], None)``, as the varlen kernel's caller expects."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    positions = torch.arange(query.shape[2], device=query.device)
    segment = (positions[:, None] >= cu_seq_lens_q[None, 1:-1]).sum(-1)
    mask = (segment[:, None] == segment[None, :])[None, None]
    return sdpa_attention_forward(module, query, key, value, attention_mask=mask, **kwargs)


@contextlib.contextmanager
def varlen_attention(model: nn.Module, fam: PatchGridFamily):
    """Within the block, the vision tower's attention runs as :func:`_masked_varlen_sdpa` (one
    masked SDPA over the micro-batch's patches instead of a split by ``cu_seqlens.tolist()``):
    registered with transformers' ``AttentionInterface`` and named by the vision config for the
    export only; put back on exit, whatever happens."""
    from transformers import AttentionInterface

    AttentionInterface.register(_VARLEN_ATTENTION, _masked_varlen_sdpa)
    config = model.get_submodule(fam.vision_tower).config
    before = config._attn_implementation
    try:
        config._attn_implementation = {"": _VARLEN_ATTENTION}  # this config only
        yield
    finally:
        config._attn_implementation = {"": before}


def prepare_batch(model: nn.Module, batch: Mapping[str, torch.Tensor], names: Sequence[str],
                  grid: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """A batch as the processor returns it, checked and turned into the traced inputs ``names``
    (:func:`traced_names`): ``pixel_values`` ``[rows * patches per row, C*T*P*P]`` as ``[rows,
    patches per row, C*T*P*P]``, and :data:`ROPE_INPUT` from the model's ``get_rope_index`` on the
    host (with ``mm_token_type_ids`` if given, else the image tokens of ``input_ids``, and the
    ``attention_mask`` if any). Other inputs pass through.

    Raises:
        BatchError: ``image_grid_thw`` other than ``grid`` for every row (names the grid the trainer
            was compiled for), ``pixel_values`` of another dtype or shape, a row whose image-token
            count differs from its images' (names the row), ``mm_token_type_ids`` of another shape.
    """
    config = model.config
    ids, pixels, grids = batch["input_ids"], batch["pixel_values"], batch[GRID_INPUT]
    rows = ids.shape[0]
    want = torch.tensor([g for _ in range(rows) for g in grid], dtype=torch.long)
    if grids.dtype.is_floating_point or tuple(grids.shape) != tuple(want.shape) or not torch.equal(grids.long(), want):
        raise BatchError(
            f"batch['image_grid_thw'] is {grids.tolist()}, but the trainer was compiled for {len(grid)} image(s) per "
            f"row of grids {[list(g) for g in grid]} ({rows} rows: {want.tolist()}): resize the images to that many "
            f"patches of {config.vision_config.patch_size} pixels (the processor's min_pixels and max_pixels), or "
            f"compile again with image_grid_thw={[list(g) for g in grid]} changed to theirs")
    per_row = sum(t * h * w for t, h, w in grid)
    shape = (rows * per_row, patch_features(config))
    if pixels.dtype != torch.float32:
        raise BatchError(f"batch['pixel_values'] has dtype {pixels.dtype}; the model was traced with float32 "
                         "pixel_values: convert with .to(torch.float32)")
    if tuple(pixels.shape) != shape:
        raise BatchError(f"batch['pixel_values'] has shape {tuple(pixels.shape)}, but {rows} rows of images of grids "
                         f"{[list(g) for g in grid]} flatten to {list(shape)} ([patches, channels x "
                         "temporal_patch_size x patch_size^2], as the processor returns them)")
    from megatrain.planner.trace.vlm import refuse_image_token_counts  # (vlm imports this module)

    refuse_image_token_counts(ids, config.image_token_id, image_tokens(config, grid),
                              f"its images of grids {[list(g) for g in grid]}")
    types = batch.get(TOKEN_TYPES)
    if types is None:
        types = (ids == config.image_token_id).int()
    elif tuple(types.shape) != tuple(ids.shape):
        raise BatchError(f"batch[{TOKEN_TYPES!r}] has shape {tuple(types.shape)}; it gives each token of input_ids "
                         f"its modality, {list(ids.shape)}")
    positions, _ = model.get_submodule("model").get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=grids, attention_mask=batch.get("attention_mask"))
    out = dict(batch, pixel_values=pixels.view(rows, per_row, -1))
    out[ROPE_INPUT] = positions.permute(1, 0, 2).contiguous()
    return {n: out[n] for n in names}


__all__ = ["DEFAULT_IMAGE_PIXELS", "GRID_INPUT", "PatchGridFamily", "ROPE_INPUT", "TOKEN_TYPES", "image_tokens",
           "input_shapes", "patch_features", "prepare_batch", "row_grid", "row_grids", "trace_call", "traced_names",
           "varlen_attention", "vision_constants"]
