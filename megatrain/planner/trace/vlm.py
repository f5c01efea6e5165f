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

The family table (:data:`FAMILIES`) says what each supported family's batch carries beside the
token inputs and how many image tokens a row holds; :data:`REFUSED` names, for the vision-language
families transformers ships that megatrain does not trace, what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from megatrain.errors import BatchError, UnsupportedModelError

IMAGE_INPUT = "pixel_values"
"""The batch input that carries the images (``FloatTensor``), as transformers' VLMs name it."""


@dataclass(frozen=True, slots=True)
class VisionLanguageFamily:
    """What megatrain needs to know of one vision-language ``model_type``.

    ``vision_tower``: the module path of the vision encoder in the ``*ForConditionalGeneration``
    model; its largest block container is cut into layers before the decoder's.
    ``image_shape(config)``: the shape of one row's ``pixel_values`` (one image per row: LLaVA-1.5's
    SFT recipe, one image per conversation), without the row dimension. ``image_tokens(model)``:
    the image-token id and how many of them one row's ``input_ids`` must hold (one per image
    feature the projector writes into the text embeddings).
    """

    model_type: str
    vision_tower: str
    image_shape: Callable[[Any], tuple[int, ...]]
    image_tokens: Callable[[nn.Module], tuple[int, int]]


def _llava_shape(config: Any) -> tuple[int, ...]:
    v = config.vision_config
    return (v.num_channels, v.image_size, v.image_size)


def _llava_tokens(model: nn.Module) -> tuple[int, int]:
    # LlavaModel.get_image_features keeps every position of the vision tower's sequence (CLIP's
    # patches and CLS, SigLIP's patches: ``embeddings.num_positions``), less the first with the
    # "default" strategy (``selected_image_feature[:, 1:]``).
    config = model.config
    positions = model.get_submodule("model.vision_tower").embeddings.num_positions
    return config.image_token_id, positions - (config.vision_feature_select_strategy == "default")


FAMILIES: dict[str, VisionLanguageFamily] = {
    "llava": VisionLanguageFamily("llava", "model.vision_tower", _llava_shape, _llava_tokens),
}
"""The vision-language families megatrain traces with their images, by ``model_type``."""

REFUSED: dict[str, str] = {
    "qwen2_vl": "variable image sizes (pixel_values as a [patches, features] tensor whose length follows "
                "image_grid_thw) and the vision attention's cu_seqlens split, which export cannot trace to "
                "fixed shapes, and M-RoPE position ids",
    "qwen2_5_vl": "variable image sizes (image_grid_thw), windowed vision attention over cu_seqlens, and M-RoPE "
                  "position ids",
    "qwen3_vl": "variable image sizes (image_grid_thw), deepstack features added inside the decoder's layers, "
                "and M-RoPE position ids",
    "llava_next": "AnyRes tiling (a variable number of tiles per image, image_sizes, and the unpadding of "
                  "the feature grid)",
    "llava_onevision": "AnyRes tiling (a variable number of tiles per image and image_sizes)",
    "internvl": "dynamic tiling (a variable number of 448x448 tiles per image) and its pixel-shuffle projector",
    "glm4v": "variable image sizes (image_grid_thw) and 3D rotary position ids",
    "idefics3": "image splitting into a variable number of sub-images",
    "smolvlm": "image splitting into a variable number of sub-images",
    "paligemma": "a prefix-LM attention mask (bidirectional over the image and prompt)",
}
"""Vision-language families megatrain refuses, by ``model_type``, with what it does not support yet."""


def family(config: Any) -> VisionLanguageFamily | None:
    """The :class:`VisionLanguageFamily` of a transformers ``config``, or None for other models."""
    return FAMILIES.get(getattr(config, "model_type", None))


def refuse_vision_language(config: Any, source: str) -> None:
    """Refuse a vision-language ``config`` megatrain does not trace; nothing for other configs.

    Called for a ``model_type`` with no causal-LM class in transformers (Gemma 3, Llama 4 and
    Mllama have one, and train on text alone through it).

    Raises:
        UnsupportedModelError: a vision-language family (one of :data:`REFUSED`, an image-text-to-text
            class of transformers, or a config with a ``vision_config``) not in :data:`FAMILIES`; the
            message names what megatrain lacks for it and the families it trains.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    mt = getattr(config, "model_type", None)
    if mt in FAMILIES or not (mt in REFUSED or mt in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
                              or getattr(config, "vision_config", None) is not None):
        return
    missing = REFUSED.get(mt, "its vision tower and the way its image features join the text (no tracing "
                              "recipe for this family yet)")
    raise UnsupportedModelError(
        f"{source}: model_type {mt!r} is a vision-language model that megatrain does not train yet: it lacks "
        f"support for {missing}. Vision-language families megatrain trains: {', '.join(sorted(FAMILIES))} "
        "(one fixed-size image per row)")


def image_input_shapes(model: nn.Module, input_names: tuple[str, ...],
                       micro_batch_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape of one micro-batch and the dtype of each batch input that is not a token tensor:
    ``{"pixel_values": ((micro_batch_size, C, H, W), torch.float32)}`` for a supported VLM whose
    inputs include ``pixel_values``; empty otherwise.

    Raises:
        UnsupportedModelError: ``pixel_values`` among the inputs of a model that is not a supported
            vision-language model.
    """
    if IMAGE_INPUT not in input_names:
        return {}
    fam = family(getattr(model, "config", None))
    if fam is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} takes no images megatrain knows how to shape: {IMAGE_INPUT!r} is a batch "
            f"input only of the vision-language families {sorted(FAMILIES)}; drop it from input_names")
    return {IMAGE_INPUT: ((micro_batch_size, *fam.image_shape(model.config)), torch.float32)}


def vision_tower(model: nn.Module, input_names: tuple[str, ...]) -> str | None:
    """The module path of a supported VLM's vision tower (LLaVA: ``model.vision_tower``) when the
    batch carries ``pixel_values``; None otherwise (a VLM trained on text alone never calls it)."""
    fam = family(getattr(model, "config", None))
    if IMAGE_INPUT not in input_names or fam is None:
        return None
    return fam.vision_tower


def check_image_tokens(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> None:
    """Refuse a batch whose rows do not each hold as many image tokens as one image has features.

    The family's forward writes the image features into the text embeddings at the image-token
    positions (``masked_scatter``), which takes the first features in order without checking their
    count once traced; eager transformers raises for a mismatch, and so does this check, before the
    step. Nothing to check for a batch without ``pixel_values``.

    Raises:
        BatchError: naming the row, its image-token count and the count each row needs.
    """
    fam = family(getattr(model, "config", None))
    if fam is None or IMAGE_INPUT not in batch or "input_ids" not in batch:
        return
    token, per_row = fam.image_tokens(model)
    counts = (batch["input_ids"] == token).sum(dim=1)
    bad = (counts != per_row).nonzero()
    if len(bad):
        row = int(bad[0, 0])
        raise BatchError(
            f"batch row {row} holds {int(counts[row])} image tokens (id {token}), but each row carries one image "
            f"of {per_row} features, which fill exactly {per_row} image tokens; build input_ids with the model's "
            "processor (it expands the image placeholder to that many tokens)")


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


__all__ = ["FAMILIES", "IMAGE_INPUT", "REFUSED", "VisionLanguageFamily", "VisionShare", "check_image_tokens",
           "family", "image_input_shapes", "refuse_vision_language", "vision_share", "vision_tower"]
