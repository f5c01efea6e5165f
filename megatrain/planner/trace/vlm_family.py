"""What a vision-language family answers: the contract of the one record :data:`.vlm.FAMILIES` holds per ``model_type``.

A family record (LLaVA's :class:`.vlm.VisionLanguageFamily`, Qwen2-VL's :class:`.qwen_vl.PatchGridFamily`)
is the whole of what megatrain knows of a vision-language family: the image inputs its batches carry
(:attr:`VisionFamily.batch_inputs`), whether a run gives it an image grid (:attr:`VisionFamily.takes_grid`),
how it is traced (:meth:`VisionFamily.trace_inputs`, :meth:`VisionFamily.block_container`,
:meth:`VisionFamily.export_attention`), how a batch is cut into the traced micro-batches
(:meth:`VisionFamily.prepare`, :meth:`VisionFamily.row_images`) and how a processor's output is checked
against the model (:meth:`VisionFamily.check_processor`). Every caller (the trace, the trainer's batch
preparation, ``megatrain train``) asks the record found by :func:`.vlm.family`, never its class, so that a
family of a kind megatrain knows is one more entry of :data:`.vlm.FAMILIES` (and its name in
:data:`megatrain.models.VISION_LANGUAGE`, the floor below, where models are accepted), and a new kind one
more module with its record class.

This module sits below both kinds' modules (which import it) so that they share :class:`ImageInputs`
without importing :mod:`.vlm`, which imports them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, Mapping, Protocol, Sequence

import torch
from torch import nn

IMAGE_INPUT = "pixel_values"
"""The batch input that carries the images (``FloatTensor``), as transformers' VLMs name it."""


@dataclass(frozen=True, slots=True)
class ImageInputs:
    """How a model's batch inputs are traced (:func:`.vlm.image_inputs`).

    ``names``: the traced inputs, in call order (Qwen2-VL's ``image_grid_thw`` becomes
    ``mrope_position_ids`` and the vision tower's grid-derived inputs). ``shapes``: ``{name: (shape
    of one micro-batch, dtype)}`` of each traced input that is not a ``[micro_batch_size, seq_len]``
    long tensor. ``call``: how the trace's loss wrapper calls the model with them (``call(model,
    **inputs)``), None for ``model(**inputs)``. ``grid``: the patch grids whose patches are a row's
    budget (a family that :attr:`~VisionFamily.takes_grid`), None otherwise. ``family``: the
    family traced with its images, None for a batch without images.
    """

    names: tuple[str, ...]
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    call: Callable[..., Any] | None = None
    grid: tuple[tuple[int, int, int], ...] | None = None
    family: VisionFamily | None = None

    def attention(self, model: nn.Module) -> ContextManager[None]:
        """A context for the export: the family's (:meth:`VisionFamily.export_attention`); nothing
        for a batch without images."""
        return contextlib.nullcontext() if self.family is None else self.family.export_attention(model)


class VisionFamily(Protocol):
    """The questions every vision-language family record answers (see the module docstring).

    ``model_type``: transformers' name of the family; ``vision_tower``: the module path of its
    vision encoder in the ``*ForConditionalGeneration`` model.
    """

    model_type: str
    vision_tower: str
    batch_inputs: ClassVar[tuple[str, ...]]
    """The image inputs a batch carries beside the token inputs, in ``input_names`` order
    (``pixel_values``; a patch-grid family's also ``image_grid_thw``)."""
    takes_grid: ClassVar[bool]
    """A run gives each row's images as patch grids (``image_grid_thw`` to compile, ``image_size``
    to ``megatrain train``), not as ``images_per_row`` fixed-size image slots."""

    def block_container(self, model: nn.Module) -> str:
        """The module path of the vision tower's block container, within :attr:`vision_tower`."""
        ...

    def trace_inputs(self, model: nn.Module, names: tuple[str, ...], micro_batch_size: int, seq_len: int,
                     image_grid_thw: Sequence[Sequence[int]] | None, images_per_row: int) -> ImageInputs:
        """The traced inputs of ``model`` for batches of ``names`` with ``pixel_values`` (the
        arguments checked by :func:`.vlm.image_inputs`, whose errors it adds to)."""
        ...

    def export_attention(self, model: nn.Module) -> ContextManager[None]:
        """A context the export runs in (the vision attention without a value-dependent split)."""
        ...

    def prepare(self, model: nn.Module, batch: Mapping[str, torch.Tensor], input_names: Sequence[str],
                grid: Sequence[Sequence[int]] | None, micro_batch_size: int,
                images_per_row: int) -> dict[str, torch.Tensor]:
        """A batch of ``input_names`` cut into micro-batches of ``micro_batch_size`` rows as the
        traced graph reads them (``grid``: the traced row's patch grids; ``images_per_row``: the
        traced image slots a row); a batch the family's trace reads as it is, unchanged.

        Raises:
            BatchError: a batch that does not fit the traced shape (naming the row and the fix).
        """
        ...

    def row_images(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> int:
        """The image slots a row of ``batch`` needs (``images_per_row``, at least 1), for a trainer
        that traces one shape per batch layout; 1 for a family whose images are grids.

        Raises:
            BatchError: ``pixel_values`` that fit no layout of the family.
        """
        ...

    def check_processor(self, model: nn.Module, dataset: Any, images: Any,
                        grid: Sequence[Sequence[int]] | None = None) -> None:
        """Refuse, before training, a processor (``images``: a
        :class:`megatrain.data.sft_images.ChatProcessor`) whose output for ``dataset`` (a
        :class:`megatrain.data.SftDataset` with images) does not fit ``model`` traced with ``grid``.

        Raises:
            ConfigError: naming the processor, what does not fit, and to use the model's own processor.
        """
        ...


__all__ = ["IMAGE_INPUT", "ImageInputs", "VisionFamily"]
