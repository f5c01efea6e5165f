"""Qwen2-VL and Qwen2.5-VL: rows of any images within a patch budget, their value-dependent tensors made on the host.

Qwen2-VL (Wang et al., "Qwen2-VL: Enhancing Vision-Language Model's Perception of the World at
Any Resolution", arXiv:2409.12191; transformers' ``Qwen2VLForConditionalGeneration``) and Qwen2.5-VL
(arXiv:2502.13923, ``Qwen2_5_VLForConditionalGeneration``) take every image of a batch as one
flat sequence of patches, ``pixel_values: FloatTensor[patches, C*T*P*P]``, with ``image_grid_thw:
LongTensor[images, 3]`` (frames, rows and columns of patches of each image). Their forward reads
sizes from tensor values: ``image_grid_thw.tolist()`` for the vision rotary positions, the
per-image ``cu_seqlens`` split of the vision attention, Qwen2.5-VL's window index, and the
M-RoPE positions (``get_rope_index``, a Python loop over ``input_ids``). A fixed-shape trace cannot
follow those, so:

- The **patch budget of a row is part of the traced shape**: the patches of the grids
  ``image_grid_thw`` given to ``megatrain.compile`` (default: one 448x448 image per row,
  :func:`patch_budget`). A row may carry any images (native resolutions, any number, none) whose
  patches fit it. Each micro-batch's ``pixel_values`` are ``[micro_batch_size, budget, C*T*P*P]``:
  its rows' patches in order, then zeros. The forward writes the merged features into the image
  tokens in order, so the zeros' features (whole merge groups: every grid's ``h`` and ``w`` are
  multiples of ``spatial_merge_size``) are read by nothing and get exactly zero gradient.
- What depends on the grids is a **batch input made on the host** per micro-batch
  (:func:`prepare_batch`, :func:`vision_inputs`) by transformers' own functions
  (``transformers.vision_utils``: ``get_vision_position_ids``, ``get_vision_cu_seqlens``,
  ``get_vision_window_index``) and given to the vision tower through its precomputed-tensor
  keywords: the rotary position ids, the image boundaries ``cu_seqlens`` and, for Qwen2.5-VL, the
  window order of the merged tokens and the window boundaries (its inverse, ``argsort``, is the
  model's own, traced). The padding patches are one segment of their own after the real ones and
  keep their place in the window order; the boundaries are padded to a fixed length by repeating
  the last (empty segments).
- The vision attention's per-image split (``torch.split`` by ``cu_seqlens.tolist()``) becomes one
  SDPA call over the micro-batch's patches with the block-diagonal mask ``cu_seqlens`` describes
  (the same per-image attention: masked keys add exact zeros). The model's attention code runs
  unchanged: for the export only, the vision config names an attention implementation registered
  through transformers' ``AttentionInterface`` (:func:`varlen_attention`) that takes the
  variable-length keywords (``cu_seq_lens_q``) the model passes to FlashAttention-2's varlen kernel.
  Its cost: scores over all the micro-batch's patch slots, ``(rows x budget) ** 2`` per head,
  where the split computes each image's (or window's: Qwen2.5-VL's windows of 8x8 patches make
  its window blocks' attention the larger overhead); the trace measures, and the planner counts,
  what runs, padding included.
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
``attention_mask`` and ``mm_token_type_ids``) as the model's processor returns them: each row's
images in ``image_grid_thw`` in row order, as many as its image tokens say;
:func:`prepare_batch` checks them (BatchError) and turns them into the traced inputs.
Videos are not supported.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

import torch
from torch import nn

from megatrain.errors import BatchError, ConfigError, UnsupportedModelError
from megatrain.models import DEFAULT_IMAGE_PIXELS  # re-exported: the planner plans this image size by default
from megatrain.planner.trace.vlm_family import IMAGE_INPUT, ImageInputs

GRID_INPUT = "image_grid_thw"
"""The batch input with each image's patch grid, ``LongTensor[images, 3]`` (frames, rows, columns)."""
TOKEN_TYPES = "mm_token_type_ids"
"""The processor's modality of each token (0 text, 1 image), ``[rows, seq_len]``; optional."""
ROPE_INPUT = "mrope_position_ids"
"""The traced input with the M-RoPE positions, ``LongTensor[rows, 3, seq_len]`` (temporal, height,
width), made on the host by :func:`prepare_batch`."""
VISION_INPUTS = {"vision_position_ids": "position_ids", "vision_cu_seqlens": "cu_seqlens"}
"""The traced inputs with the vision tower's grid-derived tensors of one micro-batch (made on the host by
:func:`prepare_batch`), by the tower keyword each is passed as: the rotary position ids ``[micro_batch_size,
patches per row, 2]`` int64 and the image boundaries ``[micro_batch_size, merged tokens per row + 1]`` int32
(flattened: the micro-batch's ``cu_seqlens``, repeated at its end)."""
WINDOW_INPUTS = {"vision_window_index": "window_index", "vision_cu_window_seqlens": "cu_window_seqlens"}
"""The same for a windowed tower (Qwen2.5-VL): the window order of the merged tokens ``[micro_batch_size,
merged tokens per row]`` int64 and the window boundaries, as ``vision_cu_seqlens``."""

_VARLEN_ATTENTION = "megatrain_flash_varlen_sdpa"
"""The attention implementation :func:`varlen_attention` registers. transformers passes the
variable-length keywords to implementations whose name contains ``flash``
(``is_flash_attention_requested``)."""


@dataclass(frozen=True, slots=True)
class PatchGridFamily:
    """A vision-language family whose images are flattened patches with a grid (Qwen2-VL's): a
    :class:`.vlm_family.VisionFamily` record, each answer this module's.

    ``vision_tower``: the module path of the vision encoder; ``blocks``: its block container,
    within it (named, since its merger's MLP may hold more parameters). ``windowed``: the tower
    alternates window attention with full attention (Qwen2.5-VL's ``fullatt_block_indexes``).
    """

    model_type: str
    vision_tower: str
    blocks: str = "blocks"
    windowed: bool = False

    batch_inputs: ClassVar[tuple[str, ...]] = (IMAGE_INPUT, GRID_INPUT)
    takes_grid: ClassVar[bool] = True

    def block_container(self, model: nn.Module) -> str:
        return self.blocks

    def trace_inputs(self, model: nn.Module, names: tuple[str, ...], micro_batch_size: int, seq_len: int,
                     image_grid_thw: Sequence[Sequence[int]] | None, images_per_row: int) -> ImageInputs:
        """Each row any images within the patches of ``image_grid_thw`` (default one 448x448
        image, :func:`row_grid`), traced as :func:`traced_names` and :func:`input_shapes` say,
        called by :func:`trace_call`; ``images_per_row`` is 1 (a row's images are its grids).

        Raises:
            UnsupportedModelError, ConfigError: as :func:`row_grid`, :func:`traced_names` and
                :func:`input_shapes`.
        """
        grid = row_grid(model.config, image_grid_thw)
        return ImageInputs(traced_names(names, self), input_shapes(model.config, self, grid, micro_batch_size, seq_len),
                           trace_call(model, self), grid, self)

    def export_attention(self, model: nn.Module):
        return varlen_attention(model, self)

    def prepare(self, model: nn.Module, batch: Mapping[str, torch.Tensor], input_names: Sequence[str],
                grid: Sequence[Sequence[int]] | None, micro_batch_size: int,
                images_per_row: int = 1) -> dict[str, torch.Tensor]:
        """:func:`prepare_batch` of a batch with images when traced with them (``grid`` the traced
        row's grids, whose patches are each row's budget); any other batch unchanged."""
        if IMAGE_INPUT not in batch or grid is None:
            return dict(batch)
        return prepare_batch(model, self, batch, traced_names(input_names, self), grid, micro_batch_size)

    def row_images(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> int:
        return 1  # a row's images are its grids (row_grids), not image slots

    def check_processor(self, model: nn.Module, dataset: Any, images: Any,
                        grid: Sequence[Sequence[int]] | None = None) -> None:
        """Refuse another patch grid, patch or image-token count than ``grid``, the traced one, in
        the first training row: what the first step would refuse (:meth:`prepare`)."""
        try:
            self.prepare(model, dataset.rows([0]), dataset.input_names, grid, 1)
        except BatchError as e:
            raise ConfigError(f"the processor ({type(images.processor).__name__}) does not fit the model: the "
                              f"first training row: {e}. Use the model's own processor (its patch_size, "
                              "merge_size and image size)") from None


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


def row_grids(batch: Mapping[str, torch.Tensor], config: Any) -> tuple[tuple[int, int, int], ...] | None:
    """The grids of the images of the row of a batch with ``image_grid_thw`` that carries the most
    patches (the first such), whose patches are then a budget every row fits (:func:`prepare_batch`);
    None for a batch without it. ``config``: the model's.

    Raises:
        BatchError: what :func:`prepare_batch` raises for ``image_grid_thw`` that does not fit the
            rows' image tokens, or a batch whose rows carry no image at all.
    """
    grids = batch.get(GRID_INPUT)
    if grids is None:
        return None
    grids = _checked_grids(grids, config)
    counts = _row_images(config, batch["input_ids"], grids)
    rows = grids.split(counts)
    largest = max(rows, key=lambda g: int(g.prod(-1).sum()))
    if not len(largest):
        raise BatchError(f"batch[{GRID_INPUT!r}] lists no image: drop pixel_values and image_grid_thw from a batch "
                         "of text only")
    return tuple(tuple(int(x) for x in g) for g in largest.tolist())


def patch_features(config: Any) -> int:
    """Elements of one flattened patch: ``in_channels * temporal_patch_size * patch_size ** 2``."""
    v = config.vision_config
    return v.in_channels * v.temporal_patch_size * v.patch_size ** 2


def image_tokens(config: Any, grid: Sequence[Sequence[int]]) -> int:
    """Image tokens the images of ``grid`` fill in ``input_ids``: a token per merged
    ``spatial_merge_size ** 2`` patches."""
    return patch_budget(grid) // config.vision_config.spatial_merge_size ** 2


def traced_names(input_names: Sequence[str], fam: PatchGridFamily) -> tuple[str, ...]:
    """The traced inputs for a batch of ``input_names``: ``image_grid_thw`` becomes
    :data:`ROPE_INPUT` and the tower's grid-derived inputs (:data:`VISION_INPUTS`, and
    :data:`WINDOW_INPUTS` for a windowed ``fam``), ``mm_token_type_ids`` is read on the host only.

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
    grid_inputs = (ROPE_INPUT, *VISION_INPUTS, *(WINDOW_INPUTS if fam.windowed else ()))
    return tuple(x for n in names if n != TOKEN_TYPES for x in (grid_inputs if n == GRID_INPUT else (n,)))


def patch_budget(grid: Sequence[Sequence[int]]) -> int:
    """The patches a row may carry: those of the images of ``grid``, ``sum(t * h * w)``."""
    return sum(t * h * w for t, h, w in grid)


def input_shapes(config: Any, fam: PatchGridFamily, grid: Sequence[Sequence[int]], micro_batch_size: int,
                 seq_len: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The traced shapes of one micro-batch's images and positions: ``pixel_values``
    ``[micro_batch_size, patches per row, C*T*P*P]`` float32 (patches per row: the budget
    :func:`patch_budget` of ``grid``), :data:`ROPE_INPUT` ``[micro_batch_size, 3, seq_len]`` int64,
    and the tower's grid-derived inputs (:data:`VISION_INPUTS`, :data:`WINDOW_INPUTS`).

    Raises:
        ConfigError: a row's images fill more tokens than ``seq_len``.
    """
    tokens = image_tokens(config, grid)
    if tokens > seq_len:
        raise ConfigError(f"each row's images of grids {[list(g) for g in grid]} fill {tokens} image tokens, more "
                          f"than seq_len={seq_len}: raise seq_len, or give smaller images (image_grid_thw)")
    patches, mbs, merged = patch_budget(grid), micro_batch_size, tokens
    shapes = {"pixel_values": ((mbs, patches, patch_features(config)), torch.float32),
              ROPE_INPUT: ((mbs, 3, seq_len), torch.int64),
              "vision_position_ids": ((mbs, patches, 2), torch.int64),
              "vision_cu_seqlens": ((mbs, merged + 1), torch.int32)}
    if fam.windowed:
        shapes.update(vision_window_index=((mbs, merged), torch.int64),
                      vision_cu_window_seqlens=((mbs, merged + 1), torch.int32))
    return shapes


def _boundaries(cu: torch.Tensor, total: int, length: int) -> torch.Tensor:
    """``cu_seqlens`` of the real patches (ending where they end) then ``total`` repeated to ``length``
    int32 entries: the padding patches up to ``total`` one segment of their own, the rest empty."""
    return torch.cat([cu.to(torch.int32), torch.full((length - len(cu),), total, dtype=torch.int32)])


def vision_inputs(model: nn.Module, fam: PatchGridFamily, grids: torch.Tensor, micro_batch_size: int,
                  patches_per_row: int) -> dict[str, torch.Tensor]:
    """The tower's grid-derived inputs of one micro-batch whose images have the grids ``grids``
    (``LongTensor[images, 3]``, in row order; the real patches first, then zeros up to
    ``micro_batch_size * patches_per_row``), by transformers' own functions (``vision_utils``):
    :data:`VISION_INPUTS` and, for a windowed tower, :data:`WINDOW_INPUTS`, each shaped as
    :func:`input_shapes` says. The padding patches have rotary position 0, one attention segment
    of their own, and keep their place in the window order (after every real patch)."""
    tower = model.get_submodule(fam.vision_tower)
    vu, config = _vision_utils(model, tower), tower.config
    merge = config.spatial_merge_size ** 2
    total, real = micro_batch_size * patches_per_row, int(grids.prod(-1).sum()) if len(grids) else 0
    length = micro_batch_size * (patches_per_row // merge + 1)
    position = torch.zeros(total, 2, dtype=torch.long)
    cu = torch.zeros(1, dtype=torch.int32)
    if real:
        position[:real] = vu.get_vision_position_ids(grids, config.spatial_merge_size)
        cu = vu.get_vision_cu_seqlens(grids)
    out = {"vision_position_ids": position.view(micro_batch_size, patches_per_row, 2),
           "vision_cu_seqlens": _boundaries(cu, total, length).view(micro_batch_size, -1)}
    if fam.windowed:
        index, cu_window = torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.int32)
        if real:
            index, cu_window = vu.get_vision_window_index(grids, config.spatial_merge_size, config.window_size,
                                                          config.patch_size)
        index = torch.cat([index, torch.arange(real // merge, total // merge)])
        out.update(vision_window_index=index.view(micro_batch_size, -1),
                   vision_cu_window_seqlens=_boundaries(cu_window, total, length).view(micro_batch_size, -1))
    return out


def trace_call(model: nn.Module, fam: PatchGridFamily):
    """The function the trace's loss wrapper calls the model with, for batches of the traced names
    (:func:`traced_names`): the text embedding, the vision tower on the micro-batch's patches with
    its grid-derived inputs (:func:`vision_inputs`, flattened over the micro-batch), then the
    model's forward with those features (``mm_encoder_outputs``) and the M-RoPE positions
    (``position_ids``, ``[3, rows, seq_len]``)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    keywords = {**VISION_INPUTS, **(WINDOW_INPUTS if fam.windowed else {})}

    def call(m: nn.Module, **batch: torch.Tensor):
        pixels, positions = batch.pop("pixel_values"), batch.pop(ROPE_INPUT)
        grid = {keyword: batch.pop(name).flatten(0, 1) for name, keyword in keywords.items()}
        # The varlen attention reads the boundaries only; the longest segment is a bound it ignores.
        longest = {"max_seqlen": pixels.shape[0] * pixels.shape[1]}
        if fam.windowed:
            longest["max_window_seqlen"] = longest["max_seqlen"]
        # First, so that the text embedding is in the prologue with the patch embedding.
        embeds = m.get_input_embeddings()(batch["input_ids"])
        tower = m.get_submodule(fam.vision_tower)
        features = tower(pixels.flatten(0, 1).type(tower.dtype), grid_thw=None, **grid, **longest).pooler_output
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


def _checked_grids(grids: torch.Tensor, config: Any) -> torch.Tensor:
    """``image_grid_thw`` as a host ``LongTensor[images, 3]``.

    Raises:
        BatchError: not ``[images, 3]`` positive integers with ``h`` and ``w`` multiples of
            ``spatial_merge_size``.
    """
    merge = config.vision_config.spatial_merge_size
    if (grids.dtype.is_floating_point or grids.dim() != 2 or grids.shape[-1] != 3 or bool((grids < 1).any())
            or bool((grids[:, 1:] % merge).any())):
        raise BatchError(f"batch['image_grid_thw'] is {grids.tolist()}; give each image's (t, h, w) as integers, "
                         f"[images, 3], h and w multiples of spatial_merge_size={merge}, as the processor returns them")
    return grids.long().cpu()


def _row_images(config: Any, ids: torch.Tensor, grids: torch.Tensor) -> list[int]:
    """How many of the images of ``grids`` (in row order) each row of ``ids`` carries: as many as
    fill its image tokens.

    Raises:
        BatchError: a row whose image tokens are not those of its next images (names the row), or
            images left over after the last row.
    """
    tokens = (ids == config.image_token_id).sum(dim=1).tolist()
    per_image = (grids.prod(-1) // config.vision_config.spatial_merge_size ** 2).tolist()
    counts, at = [], 0
    for row, want in enumerate(tokens):
        have, first = 0, at
        while have < want and at < len(per_image):
            have, at = have + per_image[at], at + 1
        if have != want:
            raise BatchError(
                f"batch row {row} holds {want} image tokens (id {config.image_token_id}), but its images "
                f"{grids[first:at].tolist()} (the next of image_grid_thw, in row order) fill {have}: build "
                "input_ids with the model's processor (it expands each image placeholder to its tokens), with "
                "image_grid_thw listing every row's images in order")
        counts.append(at - first)
    if at != len(per_image):
        raise BatchError(f"batch['image_grid_thw'] lists {len(per_image)} images, but the rows' image tokens "
                         f"(id {config.image_token_id}) take only the first {at}: give each image's tokens in "
                         "input_ids, or drop the images no row shows")
    return counts


def batch_rows(config: Any, batch: Mapping[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    """Rows ``start:stop`` of a batch as the processor lays it out: every input of one entry a row
    cut by rows, ``image_grid_thw`` by the rows' images and ``pixel_values`` by their patches (rows
    of any grids and image counts: each row's are its image tokens'). ``config``: the model's.

    Raises:
        BatchError: what :func:`prepare_batch` raises for ``image_grid_thw`` that does not fit the
            rows' image tokens.
    """
    ids = batch["input_ids"]
    grids = _checked_grids(batch[GRID_INPUT], config)
    counts = _row_images(config, ids, grids)
    first, last = sum(counts[:start]), sum(counts[:stop])
    patches = grids.prod(-1).tolist()
    out = {k: t[start:stop] for k, t in batch.items() if k not in (GRID_INPUT, "pixel_values")}
    out[GRID_INPUT] = batch[GRID_INPUT][first:last]
    out["pixel_values"] = batch["pixel_values"][sum(patches[:first]):sum(patches[:last])]
    return out


def prepare_batch(model: nn.Module, fam: PatchGridFamily, batch: Mapping[str, torch.Tensor], names: Sequence[str],
                  grid: Sequence[Sequence[int]], micro_batch_size: int) -> dict[str, torch.Tensor]:
    """A batch as the processor returns it, checked and turned into the traced inputs ``names``
    (:func:`traced_names`).

    Each row carries any images (none included) whose patches fit the budget of the traced
    ``grid`` (:func:`patch_budget`), as many as its image tokens say, in the order
    ``image_grid_thw`` lists them. For each micro-batch of ``micro_batch_size`` rows,
    ``pixel_values`` ``[micro_batch_size, patches per row, C*T*P*P]`` holds its rows' patches in
    order, then zeros: Qwen2-VL's forward writes the merged features into the image tokens in
    order, so the zeros' features are read by nothing and have zero gradient. Its tower inputs
    (:func:`vision_inputs`) and :data:`ROPE_INPUT` (the model's ``get_rope_index`` on the host,
    with ``mm_token_type_ids`` if given, else the image tokens of ``input_ids``, and the
    ``attention_mask`` if any) come with it. Other inputs pass through.

    Raises:
        BatchError: ``image_grid_thw`` that is not ``[images, 3]`` integers with ``h`` and ``w``
            multiples of ``spatial_merge_size``; a row whose image tokens are not its images' (names
            the row); a row whose patches exceed the budget (names the row, its patches, the budget
            and what to compile with); ``pixel_values`` of another dtype or patch count;
            ``mm_token_type_ids`` of another shape; rows not a multiple of ``micro_batch_size``.
    """
    config = model.config
    ids, pixels, grids = batch["input_ids"], batch["pixel_values"], batch[GRID_INPUT]
    rows, grids = ids.shape[0], _checked_grids(grids, config)
    if not rows or rows % micro_batch_size:
        raise BatchError(f"batch has {rows} rows, not a positive multiple of micro_batch_size={micro_batch_size}: "
                         "drop or add rows")
    counts = _row_images(config, ids, grids)
    budget = patch_budget(grid)
    per_row = grids.split(counts)
    patches = [int(g.prod(-1).sum()) for g in per_row]
    for row, n in enumerate(patches):
        if n > budget:
            own = per_row[row].tolist()
            raise BatchError(
                f"batch row {row} carries images of grids {own}, {n} patches, more than the {budget} a row "
                f"was compiled for (image_grid_thw={[list(g) for g in grid]}): compile with image_grid_thw="
                f"{own} (or any grids of at least {n} patches), or give the row smaller images (the "
                "processor's max_pixels)")
    features = patch_features(config)
    if pixels.dtype != torch.float32:
        raise BatchError(f"batch['pixel_values'] has dtype {pixels.dtype}; the model was traced with float32 "
                         "pixel_values: convert with .to(torch.float32)")
    if tuple(pixels.shape) != (sum(patches), features):
        raise BatchError(f"batch['pixel_values'] has shape {tuple(pixels.shape)}, but the images of image_grid_thw "
                         f"flatten to {[sum(patches), features]} ([patches, channels x temporal_patch_size x "
                         "patch_size^2], as the processor returns them)")
    types = batch.get(TOKEN_TYPES)
    if types is None:
        types = (ids == config.image_token_id).int()
    elif tuple(types.shape) != tuple(ids.shape):
        raise BatchError(f"batch[{TOKEN_TYPES!r}] has shape {tuple(types.shape)}; it gives each token of input_ids "
                         f"its modality, {list(ids.shape)}")
    positions, _ = model.get_submodule("model").get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=grids.to(ids.device), attention_mask=batch.get("attention_mask"))
    out = dict(batch)
    out[ROPE_INPUT] = positions.permute(1, 0, 2).contiguous()
    # Each micro-batch: its rows' patches first, zeros after, and the tower's inputs for them.
    mb_images = [sum(counts[i:i + micro_batch_size]) for i in range(0, rows, micro_batch_size)]
    mb_patches = [sum(patches[i:i + micro_batch_size]) for i in range(0, rows, micro_batch_size)]
    parts = []
    for g, p in zip(grids.split(mb_images), pixels.split(mb_patches)):
        padded = torch.cat([p, p.new_zeros(micro_batch_size * budget - len(p), features)])
        parts.append({"pixel_values": padded.view(micro_batch_size, budget, features),
                      **vision_inputs(model, fam, g, micro_batch_size, budget)})
    for name in parts[0]:
        out[name] = torch.cat([part[name] for part in parts]).to(pixels.device if name == "pixel_values" else
                                                                 ids.device)
    return {n: out[n] for n in names}


__all__ = ["DEFAULT_IMAGE_PIXELS", "GRID_INPUT", "PatchGridFamily", "ROPE_INPUT", "TOKEN_TYPES", "batch_rows",
           "image_tokens", "input_shapes", "patch_budget", "patch_features", "prepare_batch", "row_grid", "row_grids",
           "trace_call", "traced_names", "varlen_attention", "vision_inputs", "VISION_INPUTS", "WINDOW_INPUTS"]
