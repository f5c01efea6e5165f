"""Qwen2-VL and Qwen2.5-VL images in SFT data: their processor, and one image size for a run.

What differs from LLaVA's data path (:mod:`megatrain.data.sft_images`, which reads both):

- **The processor.** transformers' ``Qwen2VLProcessor`` and ``Qwen2_5_VLProcessor`` hold a video
  processor beside the image processor, and loading one needs torchvision. megatrain reads
  images only (videos are not supported), so :func:`load_processor` loads the model's processor
  class (transformers' own, by ``model_type``: :func:`video_processor_class`, no list of families
  here) without it (:func:`images_only`): the same tokenizer, image processor, chat template and
  image-token expansion (``image_grid_thw.prod() // merge_size ** 2`` tokens an image); saved,
  its ``processor_config.json`` names the model's processor class and holds a video processor's
  settings (the directory's it was loaded from, else the image processor's), for
  ``AutoProcessor`` where torchvision is installed.
- **One grid a run.** The processor gives each image the grid of its own size (``smart_resize``:
  multiples of ``patch_size * merge_size`` within its min and max pixels). The trace takes rows of
  any grids within a patch budget (:mod:`megatrain.planner.trace.qwen_vl`), but this data path
  gives every row the same images so that rows split evenly over micro-batches and ranks: every
  image of a run is resized first to one size, ``H x W`` pixels
  (:class:`~megatrain.data.sft_images.ChatProcessor`'s ``image_size``), which the processor then
  turns into one grid, :func:`image_grid`, known when the run is planned. The default size
  (:func:`run_image_size`) is the processor's own size for a 448 x 448 image (Qwen2-VL's 256
  image tokens; smaller where its ``max_pixels`` is).
- **Or native sizes** (``megatrain train``'s ``image_max_pixels``, LLaMA-Factory's name): each
  image keeps its own size and aspect, the processor's ``smart_resize`` told ``max_pixels`` at most
  (``size["longest_edge"]``), and a record carries 0 to ``images_per_row`` images. The run is
  traced for ``images_per_row`` images of :func:`native_grid`'s patches a row, the most an image
  under ``max_pixels`` gets; a record whose images' patches exceed that budget (an extreme aspect
  ratio, which ``smart_resize`` keeps at least one merge window wide) is refused when the store is
  built. Rows then differ in patches: the data-parallel split cuts a batch by each row's own
  images (:func:`megatrain.planner.trace.qwen_vl.batch_rows`).
- **The batch layout** is the processor's: ``pixel_values`` ``[patches, C*T*P*P]`` with each row's
  images' patches one contiguous block (``t * h * w`` patches an image), ``image_grid_thw``
  ``[images, 3]``; the rows' concatenated in order, which the trainer and the data-parallel split
  cut by rows as every row holds the same number of patches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatrain.errors import ConfigError
from megatrain.models import DEFAULT_IMAGE_PIXELS

__all__ = ["image_grid", "images_only", "load_processor", "native_grid", "parse_image_size", "run_image_size",
           "video_processor_class"]


def video_processor_class(model_type: str) -> str | None:
    """transformers' processor class of ``model_type`` (its ``PROCESSOR_MAPPING_NAMES``) when that
    class holds a video processor (Qwen2-VL's ``Qwen2VLProcessor``), which megatrain drops
    (:func:`images_only`); None for a processor of images only (LLaVA's) or a type transformers
    maps to none. Read from transformers rather than listed, so that a family added to the planner
    (``megatrain.planner.trace.vlm.FAMILIES``) needs nothing here."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    cls = getattr(transformers, PROCESSOR_MAPPING_NAMES.get(model_type) or "", None)
    if cls is None:
        return None
    # transformers 5 lists the sub-processors by get_attributes(); older versions in ``attributes``.
    parts = cls.get_attributes() if hasattr(cls, "get_attributes") else getattr(cls, "attributes", ())
    return cls.__name__ if "video_processor" in parts else None


def images_only(name: str) -> type:
    """transformers' processor class ``name`` (``"Qwen2VLProcessor"``) without its video
    processor: constructed from ``(image_processor, tokenizer, chat_template)``, loaded by
    ``from_pretrained`` from the same directory, saved with ``processor_class`` ``name``."""
    import transformers

    base = getattr(transformers, name)

    class ImagesOnly(base):
        video_config: dict | None = None  # the video processor's settings where it was loaded from

        # ProcessorMixin takes its sub-processors from this signature: no video_processor.
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        def to_dict(self) -> dict[str, Any]:
            out = super().to_dict()
            # AutoProcessor (with torchvision) loads the video processor too: the source's settings,
            # else the image processor's (the same patches, merge and normalisation).
            video = self.video_config or {**{k: v for k, v in out.get("image_processor", {}).items()
                                             if k != "image_processor_type"},
                                          "video_processor_type": "Qwen2VLVideoProcessor"}
            return {**out, "processor_class": name, "video_processor": video}

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = f"{name}ImagesOnly"
    return ImagesOnly


def load_processor(directory: Path, model_type: str):
    """The processor of a ``model_type`` saved in ``directory`` (its tokenizer, image processor and
    chat template): one whose class holds a video processor (:func:`video_processor_class`:
    Qwen2-VL's, Qwen2.5-VL's) without it (:func:`images_only`), any other as
    ``transformers.AutoProcessor`` loads it (:func:`megatrain.hf_load.load_processor`).

    Raises:
        ConfigError: the processor is defined only by the directory's own code
            (:func:`megatrain.hf_load.load_processor`).
        OSError, ValueError: ``directory`` holds no such processor (transformers' errors).
    """
    from megatrain.hf_load import load_processor as load

    name = video_processor_class(model_type)
    if name is None:
        return load(directory)
    processor = load(directory, images_only(name))
    directory = Path(directory)
    try:  # transformers 5 nests the sub-processors' settings in processor_config.json; older, a file each
        processor.video_config = json.loads((directory / "processor_config.json").read_text()).get("video_processor")
    except (OSError, ValueError, AttributeError):
        pass
    if processor.video_config is None and (directory / "video_preprocessor_config.json").is_file():
        processor.video_config = json.loads((directory / "video_preprocessor_config.json").read_text())
    return processor


def parse_image_size(text: str) -> tuple[int, int]:
    """``"HxW"`` (pixels, height first) as ``(H, W)``.

    Raises:
        ConfigError: not two positive integers joined by ``x``; more pixels than
            :data:`megatrain.bounds.MAX_IMAGE_PIXELS`.
    """
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        h = w = 0
    if h < 1 or w < 1:
        raise ConfigError(f"image_size {text!r}: give the height and width in pixels as HxW, e.g. 448x448")
    from megatrain.bounds import check_image_size

    check_image_size(h, w, f"image_size {text}")
    return h, w


def image_grid(processor, size: tuple[int, int]) -> tuple[int, int, int]:
    """The grid ``(t, h, w)`` of patches the processor gives an image of ``size`` ``(H, W)``
    pixels (its ``image_grid_thw``; ``h * patch_size`` by ``w * patch_size`` pixels after its
    ``smart_resize``).

    Raises:
        ConfigError: the processor refuses that size (an aspect ratio of 200 or more).
    """
    from PIL import Image

    try:
        out = processor.image_processor(images=[Image.new("RGB", (size[1], size[0]))])
    except ValueError as e:
        raise ConfigError(f"image_size {size[0]}x{size[1]}: the processor refuses images of that size ({e}); "
                          "choose another --image-size") from None
    t, h, w = (int(x) for x in out["image_grid_thw"][0])
    return t, h, w


def run_image_size(processor, image_size: str | None) -> tuple[int, int]:
    """The size ``(H, W)`` every image of a run is resized to: ``image_size`` (``"HxW"``), else the
    size the processor gives a 448 x 448 image (``DEFAULT_IMAGE_PIXELS``, what ``megatrain plan`` plans;
    :func:`image_grid` times its ``patch_size``).

    Raises:
        ConfigError: ``image_size`` is not ``HxW``.
    """
    if image_size is not None:
        return parse_image_size(image_size)
    _, h, w = image_grid(processor, (DEFAULT_IMAGE_PIXELS, DEFAULT_IMAGE_PIXELS))
    patch = int(processor.image_processor.patch_size)
    return h * patch, w * patch


def native_grid(processor, max_pixels: int) -> tuple[int, int, int]:
    """A grid ``(1, merge, merge * n)`` holding the most patches the processor's ``smart_resize``
    gives an image of at most ``max_pixels`` pixels: ``n = max_pixels // (patch_size *
    merge_size) ** 2`` merge windows of ``merge_size ** 2`` patches each (``smart_resize`` rounds
    each side to whole windows, scaling down until the pixels fit). The budget of one image of a
    native-size run (``megatrain.compile(image_grid_thw=...)`` counts only its patches).

    Raises:
        ConfigError: ``max_pixels`` is less than one merge window (``(patch_size * merge_size) ** 2``
            pixels), the smallest image the processor makes.
    """
    ip = processor.image_processor
    patch, merge = int(ip.patch_size), int(ip.merge_size)
    windows = max_pixels // (patch * merge) ** 2
    if windows < 1:
        raise ConfigError(f"image_max_pixels={max_pixels}: the processor makes every image at least one "
                          f"{patch * merge}x{patch * merge}-pixel merge window ({(patch * merge) ** 2} pixels); give "
                          "at least that many")
    return 1, merge, merge * windows
