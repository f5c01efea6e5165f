"""Vision-language models: the vision tower as more layers of the same LayerGraph.

A vision-language model (VLM) such as LLaVA (Liu et al., "Visual Instruction Tuning", NeurIPS
2023; transformers' ``LlavaForConditionalGeneration``) runs a vision encoder over the batch's
images, projects its features to the decoder's width, and writes them into the text embeddings at
the image-token positions (``inputs_embeds.masked_scatter``) before the decoder runs. The trace
treats the vision encoder's blocks as a second block container (in :func:`vision_tower`): the
graph's layers are then ``prologue`` (text embedding, patch embedding), the vision blocks, a
``connector`` layer (the multi-modal projector and the merge into the text embeddings: the glue
between the two containers, named after the module whose parameters it holds), the decoder blocks
and the ``epilogue``; the planner streams, keeps, checkpoints and recomputes each like any layer.
A frozen vision tower (``requires_grad=False``, the common LLaVA recipe) has no gradient to
compute: its layers get no local backward, no gradient copy and no optimizer state.

Qwen2-VL and Qwen2.5-VL take their images as flattened patches with a grid, and their forward
reads sizes from tensor values; :mod:`.qwen_vl` makes those on the host per batch (a row's patch
budget fixed per traced shape) so that the same layers come out.

The family table (:data:`FAMILIES`) holds one record per supported family, which answers every
question megatrain asks of it (:class:`.vlm_family.VisionFamily`: its batch inputs, whether it takes
an image grid, how it is traced, how a batch is cut into micro-batches, how its processor's output
is checked): the functions here ask the record of a model's family (:func:`family`), never its
class. :data:`REFUSED` names, for the vision-language families transformers ships that megatrain
does not trace, what is missing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import nn

from megatrain.errors import BatchError, ConfigError, UnsupportedModelError
# The refusals are decided in megatrain.models (below the planner, which checks a model there);
# re-exported here, where the families are.
from megatrain.models import REFUSED, VISION_LANGUAGE, refuse_vision_language
from megatrain.planner.trace.qwen_vl import GRID_INPUT, PatchGridFamily
# Re-exported: the names every family shares, defined below both kinds' modules.
from megatrain.planner.trace.vlm_family import IMAGE_INPUT, ImageInputs, VisionFamily


@dataclass(frozen=True, slots=True)
class VisionLanguageFamily:
    """A vision-language family of fixed-size images (LLaVA's): a :class:`.vlm_family.VisionFamily`
    record, each answer this module's.

    ``vision_tower``: the module path of the vision encoder in the ``*ForConditionalGeneration``
    model; its largest block container is cut into layers before the decoder's.
    ``image_shape(config)``: the shape of one image of ``pixel_values``, without the image
    dimension. ``image_tokens(model)``: the image-token id and how many of them one image fills in
    ``input_ids`` (one per image feature the projector writes into the text embeddings).
    """

    model_type: str
    vision_tower: str
    image_shape: Callable[[Any], tuple[int, ...]]
    image_tokens: Callable[[nn.Module], tuple[int, int]]

    batch_inputs: ClassVar[tuple[str, ...]] = (IMAGE_INPUT,)
    takes_grid: ClassVar[bool] = False

    def block_container(self, model: nn.Module) -> str:
        """The container holding most of the tower's parameters (:func:`.cut.find_block_container`)."""
        from megatrain.planner.trace.cut import find_block_container

        return find_block_container(_unwrapped_tower(model, self.vision_tower))

    def trace_inputs(self, model: nn.Module, names: tuple[str, ...], micro_batch_size: int, seq_len: int,
                     image_grid_thw: Sequence[Sequence[int]] | None, images_per_row: int) -> ImageInputs:
        """``pixel_values`` as ``[micro_batch_size * images_per_row, C, H, W]`` float32 image slots
        (:func:`place_images`); the names as given, called as ``model(**inputs)``."""
        return ImageInputs(names, {IMAGE_INPUT: ((micro_batch_size * images_per_row, *self.image_shape(model.config)),
                                                 torch.float32)}, family=self)

    def export_attention(self, model: nn.Module):
        return contextlib.nullcontext()  # the tower's attention has no value-dependent split

    def prepare(self, model: nn.Module, batch: Mapping[str, torch.Tensor], input_names: Sequence[str],
                grid: Sequence[Sequence[int]] | None, micro_batch_size: int,
                images_per_row: int = 1) -> dict[str, torch.Tensor]:
        """:func:`place_images` of a batch with images when traced with them; any other unchanged."""
        if IMAGE_INPUT not in batch or IMAGE_INPUT not in input_names:
            return dict(batch)
        return place_images(model, batch, images_per_row, micro_batch_size)

    def row_images(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> int:
        """:func:`row_images` of a LLaVA batch."""
        images, ids = batch.get(IMAGE_INPUT), batch.get("input_ids")
        if images is None or ids is None or images.dim() != 4 or GRID_INPUT in batch:
            return 1
        rows, counts = ids.shape[0], image_counts(model, ids)
        if images.shape[0] == int(counts.sum()):
            return max(int(counts.max()) if rows else 0, 1)
        if not rows or images.shape[0] % rows or not images.shape[0]:
            raise BatchError(f"batch[{IMAGE_INPUT!r}] holds {images.shape[0]} images for {rows} rows of input_ids; "
                             f"give them in slots, [{rows} x images_per_row, C, H, W] (row r's images first in "
                             "[r * images_per_row, (r + 1) * images_per_row), zeros after), or one per real image "
                             f"in row order ({int(counts.sum())} by the image tokens)")
        return images.shape[0] // rows

    def check_processor(self, model: nn.Module, dataset: Any, images: Any,
                        grid: Sequence[Sequence[int]] | None = None) -> None:
        """Refuse a processor whose image token is not the model's, or that writes another number
        of image tokens per image than the model's projector writes features (a processor of
        another model or resolution): a row's image count is read from its image tokens
        (:func:`place_images`), so its tokens would not match its images. ``grid`` is unused."""
        token, per_image = self.image_tokens(model)
        path = next((p for paths in dataset.store.images or () for p in paths), None)
        n = None if path is None else images.image_tokens(path)
        if images.image_token_id != token or n not in (None, per_image):
            wrote = f"its image token is id {images.image_token_id}" if n is None else \
                f"it writes {n} image tokens (id {images.image_token_id}) for the image {path!r}"
            raise ConfigError(f"the processor ({type(images.processor).__name__}) does not fit the model: {wrote}, "
                              f"and the model reads {per_image} an image (id {token}, one per feature its projector "
                              "writes). Use the model's own processor (its image token, patch_size, image size and "
                              "vision_feature_select_strategy)")


def _llava_shape(config: Any) -> tuple[int, ...]:
    v = config.vision_config
    return (v.num_channels, v.image_size, v.image_size)


def _unwrapped_tower(model: nn.Module, path: str) -> nn.Module:
    """The vision tower at ``path``, which holds its embeddings and blocks itself.

    Raises:
        UnsupportedModelError: a tower that wraps them (``tower.vision_model``: CLIP's and SigLIP's
            in transformers before 5.6), whose blocks megatrain would name and cut otherwise.
    """
    tower = model.get_submodule(path)
    if not hasattr(tower, "embeddings") and hasattr(tower, "vision_model"):
        import transformers

        raise UnsupportedModelError(
            f"LLaVA needs a transformers whose vision tower holds its blocks itself (5.6 or later); the "
            f"installed {transformers.__version__} wraps them in {path}.vision_model. Upgrade transformers "
            "(pip install -U 'transformers>=5.6')")
    return tower


def _llava_tokens(model: nn.Module) -> tuple[int, int]:
    # LlavaModel.get_image_features keeps every position of the vision tower's sequence (CLIP's
    # patches and CLS, SigLIP's patches: ``embeddings.num_positions``), less the first with the
    # "default" strategy (``selected_image_feature[:, 1:]``).
    config = model.config
    positions = _unwrapped_tower(model, "model.vision_tower").embeddings.num_positions
    return config.image_token_id, positions - (config.vision_feature_select_strategy == "default")


FAMILIES: dict[str, VisionFamily] = {
    "llava": VisionLanguageFamily("llava", "model.vision_tower", _llava_shape, _llava_tokens),
    "qwen2_vl": PatchGridFamily("qwen2_vl", "model.visual"),
    "qwen2_5_vl": PatchGridFamily("qwen2_5_vl", "model.visual", windowed=True),
}
"""The vision-language families megatrain traces with their images, by ``model_type``: each one
complete record (:class:`.vlm_family.VisionFamily`) of :data:`megatrain.models.VISION_LANGUAGE`
(the names, on the floor below the planner, where models are accepted or refused)."""
if tuple(FAMILIES) != VISION_LANGUAGE:
    raise AssertionError(f"vlm.FAMILIES {tuple(FAMILIES)} and megatrain.models.VISION_LANGUAGE {VISION_LANGUAGE} "
                         "must name the same families: add a family to both")



def family(config: Any) -> VisionFamily | None:
    """The family record (:class:`.vlm_family.VisionFamily`: LLaVA's :class:`VisionLanguageFamily`,
    Qwen2-VL's and Qwen2.5-VL's :class:`.qwen_vl.PatchGridFamily`) of a transformers ``config``, or
    None for other models."""
    return FAMILIES.get(getattr(config, "model_type", None))


def image_inputs(model: nn.Module, input_names: Sequence[str], micro_batch_size: int, seq_len: int,
                 image_grid_thw: Sequence[Sequence[int]] | None = None, images_per_row: int = 1) -> ImageInputs:
    """The traced inputs of ``model`` for batches of ``input_names`` (:class:`ImageInputs`).

    LLaVA with ``pixel_values``: ``[micro_batch_size * images_per_row, C, H, W]`` float32 image
    slots, the micro-batch's real images first in row order, zeros after (:func:`place_images`:
    LLaVA's forward scatters the image features into the image-token positions in batch order, so
    the zeros' features are read by nothing).
    Qwen2-VL / Qwen2.5-VL with ``pixel_values``: each row carries any images within the patches of
    the grids ``image_grid_thw`` (default: one 448x448 image; :func:`.qwen_vl.row_grid`), traced as
    ``[micro_batch_size, patches per row, C*T*P*P]`` float32 patches, the M-RoPE positions and the
    vision tower's grid-derived inputs (:mod:`.qwen_vl`). Other batches: the names as given, nothing else.

    Raises:
        UnsupportedModelError: ``pixel_values`` among the inputs of a model that is not a supported
            vision-language model; Qwen2-VL inputs without ``image_grid_thw`` or with
            ``position_ids``; ``image_grid_thw`` for another model.
        UnsupportedModelError: ``images_per_row`` other than 1 for a model that is not LLaVA or
            without ``pixel_values`` (Qwen2-VL's images per row are its ``image_grid_thw``).
        ConfigError: a malformed ``image_grid_thw``, or one whose image tokens exceed ``seq_len``;
            ``images_per_row`` below 1.
    """
    names = tuple(input_names)
    fam = family(getattr(model, "config", None))
    # A row's images are either image slots (images_per_row) or patch grids (image_grid_thw): the family says which.
    grid = fam is not None and fam.takes_grid
    if isinstance(images_per_row, bool) or not isinstance(images_per_row, int) or images_per_row < 1:
        raise ConfigError(f"images_per_row={images_per_row!r}: give the number of images each row carries, an int >= 1")
    if images_per_row != 1 and not (fam is not None and not grid and IMAGE_INPUT in names):
        raise UnsupportedModelError(
            f"images_per_row={images_per_row} is the image count of LLaVA batches with pixel_values; "
            f"{type(model).__name__} with inputs {list(names)} takes none"
            + (" (Qwen2-VL and Qwen2.5-VL: give each row's images as image_grid_thw)"
               if grid else "") + ": drop it")
    if image_grid_thw is not None and not (grid and IMAGE_INPUT in names):
        raise UnsupportedModelError(
            f"image_grid_thw is the image grid of Qwen2-VL and Qwen2.5-VL batches with pixel_values; "
            f"{type(model).__name__} with inputs {list(names)} takes none: drop it")
    if IMAGE_INPUT not in names:
        return ImageInputs(names, {})
    if fam is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} takes no images megatrain knows how to shape: {IMAGE_INPUT!r} is a batch "
            f"input only of the vision-language families {sorted(FAMILIES)}; drop it from input_names")
    return fam.trace_inputs(model, names, micro_batch_size, seq_len, image_grid_thw, images_per_row)


def batch_names(config: Any) -> tuple[str, ...]:
    """The batch inputs a model of ``config`` is planned with by ``megatrain plan`` and the presets:
    a vision-language family's with its images, else ``input_ids`` and ``labels``."""
    fam = family(config)
    return ("input_ids", "labels") if fam is None else ("input_ids", *fam.batch_inputs, "labels")


def prepare_images(model: nn.Module, batch: Mapping[str, torch.Tensor], input_names: Sequence[str],
                   grid: Sequence[Sequence[int]] | None, micro_batch_size: int,
                   images_per_row: int = 1) -> dict[str, torch.Tensor]:
    """A batch of ``input_names`` with its images as the traced graph reads them: the family's
    :meth:`~.vlm_family.VisionFamily.prepare`, any other model's batch unchanged. Qwen2-VL with
    images (:func:`.qwen_vl.prepare_batch`, ``grid`` the traced row's grids, whose patches are each
    row's budget): checked, each micro-batch of ``micro_batch_size`` rows with its patches, its
    vision tower's grid-derived inputs and its M-RoPE positions. LLaVA traced with images
    (:func:`place_images`, ``images_per_row`` the traced slots a row): each micro-batch's real
    images first, zeros after. Any other batch unchanged.

    Raises:
        BatchError: what :func:`.qwen_vl.prepare_batch` or :func:`place_images` refuses.
    """
    fam = family(getattr(model, "config", None))
    if fam is None:
        return dict(batch)
    return fam.prepare(model, batch, input_names, grid, micro_batch_size, images_per_row)


def vision_tower(model: nn.Module, input_names: tuple[str, ...]) -> tuple[str, str] | None:
    """The module paths of a supported VLM's vision tower and of its block container (LLaVA:
    ``model.vision_tower`` and the container holding most of its parameters; Qwen2-VL:
    ``model.visual`` and ``model.visual.blocks``, named, since its merger's MLP may hold more) when
    the batch carries ``pixel_values``; None otherwise (a VLM trained on text alone never calls it)."""
    fam = family(getattr(model, "config", None))
    if IMAGE_INPUT not in input_names or fam is None:
        return None
    return fam.vision_tower, f"{fam.vision_tower}.{fam.block_container(model)}"


def row_images(batch: Mapping[str, torch.Tensor], model: nn.Module) -> int:
    """The family's :meth:`~.vlm_family.VisionFamily.row_images` (1 for a model of none): the
    image slots per row (``images_per_row``, K) of a LLaVA ``model``'s batch
    (:func:`place_images`): ``pixel_values`` in Hugging Face's layout (one entry per real image,
    as many as the rows' image tokens say) gives its most images a row (at least 1); in the slot
    layout, ``[rows x K, C, H, W]``, K. 1 for a batch without such images (none, or Qwen2-VL's
    patches, whose count per row :func:`.qwen_vl.row_grids` gives).

    Raises:
        BatchError: ``pixel_values`` that fit neither layout, or what :func:`image_counts` raises.
    """
    fam = family(getattr(model, "config", None))
    return 1 if fam is None else fam.row_images(model, batch)


def image_counts(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The real images of each row of a LLaVA batch, ``LongTensor[rows]``: its image tokens
    (``image_token_id``) over the tokens one image fills.

    Raises:
        BatchError: a row whose image-token count is not a whole number of images (naming it).
    """
    token, per_image = family(model.config).image_tokens(model)
    tokens = (input_ids == token).sum(dim=1)
    _refuse_rows(tokens, tokens % per_image != 0, token, f"not a multiple of the {per_image} features one image fills")
    return tokens // per_image


def _refuse_rows(tokens: torch.Tensor, bad: torch.Tensor, token: int, why: str) -> None:
    """Raise a BatchError for the first row ``bad`` marks, with its count of ``tokens`` and ``why``."""
    rows = bad.nonzero()
    if len(rows):
        row = int(rows[0, 0])
        raise BatchError(f"batch row {row} holds {int(tokens[row])} image tokens (id {token}), {why}; build "
                         "input_ids with the model's processor (it expands each image placeholder to its tokens)")


def place_images(model: nn.Module, batch: Mapping[str, torch.Tensor], images_per_row: int,
                 micro_batch_size: int) -> dict[str, torch.Tensor]:
    """A LLaVA batch with its images as the traced graph reads them; any other batch unchanged.

    Each row carries 0 to ``images_per_row`` (K) images, as many as its image tokens say
    (:func:`image_counts`). ``pixel_values`` may come in either layout:

    - slots: ``FloatTensor[rows * K, C, H, W]``, row ``r``'s images first in ``[r * K, (r + 1) * K)``
      in the order of its image tokens, the rest of its slots padding (any values; zeros are usual);
    - Hugging Face's: ``FloatTensor[total images, C, H, W]``, every real image in row order, as a
      processor returns a batch's images.

    Every row having K images, the two are one. The result holds, for each micro-batch of
    ``micro_batch_size`` rows, ``micro_batch_size * K`` images: its rows' real images in order,
    then zeros. LLaVA's forward writes the image features into the image-token positions in order
    (``masked_scatter``), so the real images' features fill exactly the image tokens and the zero
    padding's features are read by nothing: they add nothing to the loss, and their gradient (and
    hence their share of every vision gradient) is exactly zero.

    Raises:
        BatchError: a row with more than K images' tokens, or a partial image's; ``pixel_values``
            of another count than either layout's.
    """
    images, ids = batch.get(IMAGE_INPUT), batch.get("input_ids")
    if (not isinstance(family(getattr(model, "config", None)), VisionLanguageFamily)
            or not isinstance(images, torch.Tensor) or not isinstance(ids, torch.Tensor) or images.dim() != 4):
        return dict(batch)
    counts = image_counts(model, ids)
    rows, k = ids.shape[0], images_per_row
    over = (counts > k).nonzero()
    if len(over):
        row = int(over[0, 0])
        raise BatchError(f"batch row {row} holds the image tokens of {int(counts[row])} images, but the trainer was "
                         f"compiled for at most images_per_row={k} a row: compile with images_per_row="
                         f"{int(counts.max())}, or give the row fewer images")
    total = int(counts.sum())
    if images.shape[0] == rows * k:
        real = images[(torch.arange(k, device=counts.device)[None, :] < counts[:, None]).flatten()]
    elif images.shape[0] == total:
        real = images
    else:
        raise BatchError(
            f"batch[{IMAGE_INPUT!r}] holds {images.shape[0]} images, and its {rows} rows' image tokens say {total}: "
            f"give one per real image in row order ([{total}, C, H, W], Hugging Face's layout), or "
            f"images_per_row={k} slots a row ([{rows * k}, C, H, W], row r's images first at r * {k}, padding after)")
    out = images.new_zeros((rows * k, *images.shape[1:]))
    ends = torch.cumsum(counts, 0).tolist()
    for m in range(0, rows, micro_batch_size):
        start, end = ends[m - 1] if m else 0, ends[min(m + micro_batch_size, rows) - 1]
        out[m * k:m * k + end - start] = real[start:end]
    return {**batch, IMAGE_INPUT: out}


@dataclass(frozen=True, slots=True)
class VisionShare:
    """The vision blocks' share of a planned step (:func:`vision_share`).

    ``layers`` of ``total_layers``; ``params`` of ``total_params`` parameters; ``host_bytes`` of
    ``total_host_bytes`` of persistent host state (FP32 masters and Adam moments, in the shares of
    ``cost.memory_breakdown``'s totals their parameters hold: a frozen block keeps a master and no
    moments); ``compute_s`` of ``total_compute_s`` seconds of the compute stream's ops (forward,
    recompute, local backward) and ``h2d_s`` of ``total_h2d_s`` of weight copies, in the timeline.
    """

    layers: int
    total_layers: int
    params: int
    total_params: int
    host_bytes: int
    total_host_bytes: int
    compute_s: float
    total_compute_s: float
    h2d_s: float
    total_h2d_s: float


def _layer_of(op: str) -> int | None:
    """The layer an op's repr names (``FWD:L3:m0:s1`` -> 3)."""
    return next((int(p[1:]) for p in op.split(":")[1:] if p[:1] == "L" and p[1:].isdigit()), None)


def vision_share(graph, timeline, memory) -> VisionShare | None:
    """The vision blocks' share of the parameters, host state, compute and weight-copy time of a
    planned step (``graph``, the ``timeline`` of its schedule, whose records name each op's layer,
    and ``memory``, the ``cost.memory_breakdown`` of the plan); None for a model without vision blocks
    (``graph.meta["vision_container"]`` unset)."""
    from megatrain.ir.schedule import COMPUTE_KINDS, OpKind

    container = graph.meta.get("vision_container")
    if container is None:
        return None
    vision = {i for i, layer in enumerate(graph.layers) if layer.name.startswith(container + ".")}
    numel = sum(layer.numel for layer in graph.layers)
    trainable = sum(layer.trainable_numel for layer in graph.layers)
    v_numel = sum(graph.layers[i].numel for i in vision)
    v_trainable = sum(graph.layers[i].trainable_numel for i in vision)
    host = memory.master_weights + memory.adam_moments
    v_host = (memory.master_weights * v_numel // max(numel, 1)
              + memory.adam_moments * v_trainable // max(trainable, 1))
    times = {"compute": [0.0, 0.0], "h2d": [0.0, 0.0]}
    for r in timeline.records:
        kind = r.kind
        key = "compute" if kind in COMPUTE_KINDS else "h2d" if kind is OpKind.H2D else None
        if key is None:
            continue
        times[key][1] += r.duration_s
        if _layer_of(r.op) in vision:
            times[key][0] += r.duration_s
    return VisionShare(len(vision), len(graph.layers), sum(graph.layers[i].param_count for i in vision),
                       graph.param_count, v_host, host, *times["compute"], *times["h2d"])


__all__ = ["FAMILIES", "IMAGE_INPUT", "REFUSED", "ImageInputs", "VisionLanguageFamily", "VisionShare", "batch_names",
           "family", "image_counts", "image_inputs", "place_images", "prepare_images",
           "refuse_vision_language", "row_images", "vision_share", "vision_tower"]
