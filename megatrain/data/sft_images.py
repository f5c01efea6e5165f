"""Images in fine-tuning data: chats with images -> tokens, targets and the processor's image inputs.

A vision-language model's examples are read by its processor (``transformers.AutoProcessor``: a
tokenizer, an image processor and a chat template). :class:`ChatProcessor` renders a chat whose
messages hold ``{"type": "image"}`` parts with the chat template (every message's content as a
list of parts, the convention of processors' templates), tokenises it and marks its targets as
:class:`~megatrain.data.sft.ChatTokenizer` does for text (assistant turns), then expands the one
image token the template writes per image into as many as the processor writes for that image
(LLaVA: one per patch feature the projector writes into the text embeddings; Qwen2-VL: one per
merged patch of the image's grid), counted by calling the processor on that image alone. Image
tokens are never targets. Images are loaded with Pillow (:func:`load_image`, as transformers'
``load_image`` loads a file).

The image inputs of a row (:meth:`ChatProcessor.image_inputs`) are what the processor returns for
its images under the names of the image processor's ``model_input_names`` (LLaVA: ``pixel_values``
``[images, C, H, W]``; Qwen2-VL: ``pixel_values`` ``[patches, features]`` and ``image_grid_thw``
``[images, 3]``; LLaVA-NeXT also ``image_sizes``), passed on by name: a batch concatenates its
rows' along dimension 0, the layout every one of these processors gives a list of images.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from megatrain.data.sft import ChatTokenizer, Encoded
from megatrain.data.sft_formats import Chat, Completion, RecordError

#: The image input a fixed-size image processor (LLaVA's) writes, ``[images, C, H, W]``.
IMAGES = "pixel_values"

__all__ = ["DEFAULT_IMAGE_CHAT_TEMPLATE", "ChatProcessor", "load_image"]

#: The chat template of a processor without one: megatrain's text template
#: (:data:`~megatrain.data.sft.DEFAULT_CHAT_TEMPLATE`) with content as a list of parts, an image
#: part written as the processor's image token (``<image>`` here, replaced by the processor's).
DEFAULT_IMAGE_CHAT_TEMPLATE = (
    "{%- macro content(c) %}{% if c is string %}{{ c }}{% else %}{% for p in c %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{%- if tools %}<|tools|>\n{{ tools | tojson }}{{ eos_token }}{% endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ content(m['content'] or '') }}"
    "{% if m['tool_calls'] %}{{ m['tool_calls'] | tojson }}{% endif %}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ content(m['content']) }}{{ eos_token }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def load_image(path: str):
    """The image file at ``path`` as an RGB ``PIL.Image.Image``, turned upright by its EXIF
    orientation: what ``transformers.image_utils.load_image`` gives for a file.

    Raises:
        RecordError: the file is missing, not a regular file (a FIFO is refused, not read), more
            than :data:`megatrain.bounds.MAX_IMAGE_PIXELS` pixels, or Pillow cannot read it (naming
            the file).
        ImportError: Pillow is missing (``pip install 'megatrain[hf]'``).
    """
    try:
        from PIL import Image, ImageOps, UnidentifiedImageError
    except ImportError as e:
        raise ImportError("images are read with Pillow: pip install 'megatrain[hf]'") from e
    from megatrain.bounds import MAX_IMAGE_PIXELS
    from megatrain.files import UnsafeFileError, open_regular

    try:
        with open_regular(path, "image file") as f, Image.open(f) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:  # known from the header, before a pixel is decoded
                raise RecordError(f"image file {path!r} is {im.width}x{im.height}, {im.width * im.height:,} pixels, "
                                  f"more than megatrain reads ({MAX_IMAGE_PIXELS:,}, Pillow's decompression-bomb "
                                  "limit); resize it")
            return ImageOps.exif_transpose(im).convert("RGB")
    except UnsafeFileError as e:
        raise RecordError(str(e)) from None
    except Image.DecompressionBombError as e:
        raise RecordError(f"image file {path!r}: {e}; resize it") from None
    except FileNotFoundError:
        raise RecordError(f"image file {path!r} does not exist (a relative path is read from the data file's "
                          "directory, or the dataset_info.json's)") from None
    except (UnidentifiedImageError, OSError) as e:
        raise RecordError(f"image file {path!r} cannot be read by Pillow: {e}") from None


class ChatProcessor(ChatTokenizer):
    """A :class:`~megatrain.data.sft.ChatTokenizer` for chats with images, through a processor.

    Args:
        processor: a ``transformers`` processor with ``tokenizer``, ``image_processor`` and
            ``image_token`` (``AutoProcessor.from_pretrained(model_dir)``).
        chat_template: Jinja source; None: the processor's, else :data:`DEFAULT_IMAGE_CHAT_TEMPLATE`.
        eos_token, bos_token, loss: as :class:`~megatrain.data.sft.ChatTokenizer`.
        images_per_example: the most images an example may have (``megatrain train``'s
            ``images_per_row``: each example is a row, traced with that many image slots; a row's
            :meth:`image_inputs` of fixed-size images fill the slots it does not use with zeros);
            exactly that many with a processor of patch grids (Qwen2-VL's ``image_grid_thw``);
            None: any number, not padded.
        image_size: ``(H, W)`` pixels every image is resized to (Pillow, the image processor's
            ``resample``) before the processor reads it, so that all get one patch grid (Qwen2-VL:
            :mod:`megatrain.data.sft_qwen_vl`); None: as the file is.
        max_pixels: a processor of patch grids only, instead of ``image_size``: every image at its
            own size and aspect, the processor's ``smart_resize`` told this many pixels at most
            (its ``size["longest_edge"]``, LLaMA-Factory's ``image_max_pixels``), and 0 to
            ``images_per_example`` images an example (:func:`~megatrain.data.sft_qwen_vl.native_grid`
            is then the budget of one image).
        template_origin: where ``chat_template`` came from, named in its render's errors.

    Raises:
        ValueError: the processor has no image token, or its tokenizer does not know it.
    """

    def __init__(self, processor: Any, chat_template: str | None, *, eos_token: str, bos_token: str | None = None,
                 loss: Literal["all", "last"] = "all", images_per_example: int | None = None,
                 image_size: tuple[int, int] | None = None, max_pixels: int | None = None,
                 template_origin: str | None = None) -> None:
        self.processor = processor
        self.image_token = getattr(processor, "image_token", None)
        tokenizer = processor.tokenizer
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token) if self.image_token else None
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the processor ({type(processor).__name__}) has no image token its tokenizer knows "
                             f"(image_token={self.image_token!r}); use the model's processor")
        if chat_template is None:
            chat_template = processor.chat_template or DEFAULT_IMAGE_CHAT_TEMPLATE.replace("<image>", self.image_token)
        super().__init__(tokenizer.backend_tokenizer, chat_template, eos_token=eos_token, bos_token=bos_token,
                         loss=loss, template_origin=template_origin)
        self.image_keys: tuple[str, ...] = tuple(processor.image_processor.model_input_names)
        self.images_per_example = images_per_example
        # A processor of patch grids (Qwen2-VL's image_grid_thw): megatrain train gives every example
        # exactly images_per_example images of one size, so that its rows' patches are alike and
        # split evenly over ranks; or, with max_pixels, each image at its own size and 0 to
        # images_per_example of them an example, rows of any grids within the traced patch budget.
        self.grid_images = "image_grid_thw" in self.image_keys
        if max_pixels is not None and (not self.grid_images or image_size is not None):
            raise ValueError("max_pixels is for a processor of patch grids (Qwen2-VL's), without image_size")
        self.exact_images = self.grid_images and max_pixels is None
        self.image_size = None if image_size is None else tuple(image_size)
        self.max_pixels = max_pixels
        self._size: dict[str, Any] = {}
        self._budget: int | None = None  # native sizes: the image tokens a row is traced for
        if max_pixels is not None:
            from megatrain.data.sft_qwen_vl import native_grid

            size = processor.image_processor.size
            low = size.get("shortest_edge") if hasattr(size, "get") else getattr(size, "shortest_edge", None)
            self._size = {"size": {"longest_edge": max_pixels, "shortest_edge": min(low or 1, max_pixels)}}
            if images_per_example:
                _, h, w = native_grid(processor, max_pixels)
                self._budget = images_per_example * h * w // int(processor.image_processor.merge_size) ** 2
        self._blank_image: torch.Tensor | None = None

    def describe(self) -> str:
        size = "" if self.image_size is None else f", resized to {self.image_size[0]}x{self.image_size[1]}"
        if self.max_pixels is not None:
            size = f", each at its own size, up to {self.max_pixels:,} pixels"
        return (f"{super().describe()}; images by {type(self.processor).__name__} (image token "
                f"{self.image_token!r}, inputs {', '.join(self.image_keys)}{size})")

    def key(self) -> list:
        """What the stored tokens depend on beyond the tokenizer and template: the image token and
        the image processor's settings and the size images are resized to (they decide how many
        tokens an image expands to), and the most images an example may have, or the count every
        example must have (a store built for another holds other examples)."""
        count = {"images": self.images_per_example} if self.exact_images else {"max_images": self.images_per_example}
        return [self.image_token, self.processor.image_processor.to_json_string(),
                {k: v for k, v in self.processor.to_dict().items() if isinstance(v, (int, str, float, bool))},
                count] + ([list(self.image_size)] if self.image_size is not None else []) \
            + ([{"max_pixels": self.max_pixels}] if self.max_pixels is not None else [])

    def encode(self, example: Chat | Completion) -> Encoded:
        """Tokens and targets of the example with its images' tokens expanded (module docstring);
        ``Encoded.images`` are its image files.

        Raises:
            RecordError: as :meth:`ChatTokenizer.encode`; the example has more than
                ``images_per_example`` images (a processor of patch grids: not that many); the
                template wrote a different number of image tokens than the example has images; an
                image file is missing or unreadable.
        """
        images = example.images if isinstance(example, Chat) else ()
        if self.exact_images and self.images_per_example is not None and len(images) != self.images_per_example:
            raise RecordError(f"the example has {len(images)} image(s), and the run takes {self.images_per_example} "
                              "per row (megatrain train gives every Qwen2-VL row the same images, resized to one "
                              "size, so that rows split evenly: --images-per-row); give every record of the data "
                              "exactly that many images (the images column), or set --images-per-row to the count "
                              "the records have")
        if self.images_per_example is not None and len(images) > self.images_per_example:
            raise RecordError(f"the example has {len(images)} images, and the run takes at most "
                              f"{self.images_per_example} per row (megatrain train traces a fixed number of image "
                              f"slots for every row: --images-per-row); set --images-per-row {len(images)} (or the "
                              "most any record has), or give this record fewer images (the images column)")
        enc = super().encode(example)
        if not images:
            return enc
        at = np.flatnonzero(enc.ids == self.image_token_id)
        if len(at) != len(images):
            raise RecordError(f"the chat template wrote {len(at)} image token(s) ({self.image_token!r}) for "
                              f"{len(images)} image(s); use a template that writes one per {{\"type\": \"image\"}} "
                              "part (the processor's)")
        counts = [self.image_tokens(p) for p in images]
        if self._budget is not None and sum(counts) > self._budget:
            raise RecordError(f"the example's images fill {sum(counts)} image tokens ({counts} for {list(images)}), "
                              f"more than the {self._budget} of {self.images_per_example} image(s) of at most "
                              f"{self.max_pixels:,} pixels a row is traced for (an image of an extreme aspect ratio "
                              "keeps one merge window on its short side): crop or resize those images, or raise "
                              "--images-per-row or --image-max-pixels")
        pieces_ids, pieces_tgt, prev = [], [], 0
        for a, n in zip(at, counts):
            pieces_ids += [enc.ids[prev:a], np.full(n, self.image_token_id, dtype=np.int64)]
            pieces_tgt += [enc.targets[prev:a], np.zeros(n, dtype=bool)]
            prev = a + 1
        ids = np.concatenate(pieces_ids + [enc.ids[prev:]])
        targets = np.concatenate(pieces_tgt + [enc.targets[prev:]])
        return Encoded(ids, targets, tuple(images))

    def _messages(self, chat: Chat) -> Chat:
        """A chat with images as processors' templates read it: every message's content a list of
        parts (a string becomes one text part); a chat without images as it is."""
        if not chat.images:
            return super()._messages(chat)
        return Chat(tuple({**m, "content": [{"type": "text", "text": m["content"]}]}
                          if isinstance(m.get("content"), str) else m for m in chat.messages),
                    chat.train, chat.tools, chat.images)

    def fit(self, example: Chat | Completion, seq_len: int,
            truncation: Literal["trim", "drop"] = "trim") -> tuple[Encoded | None, bool]:
        """As :meth:`ChatTokenizer.fit`, except that an example with images is kept whole or
        dropped: cutting it could cut an image's tokens or the message that shows it."""
        if not (isinstance(example, Chat) and example.images):
            return super().fit(example, seq_len, truncation)
        enc = self.encode(example)
        return (enc, False) if len(enc.ids) <= seq_len else (None, False)

    def load(self, path: str):
        """The image at ``path`` (:func:`load_image`), resized to ``image_size`` if set.

        Raises:
            RecordError: the file is missing or unreadable.
        """
        image = load_image(path)
        if self.image_size is None or image.size == self.image_size[::-1]:
            return image
        from PIL import Image

        resample = Image.Resampling(int(getattr(self.processor.image_processor, "resample", Image.Resampling.BICUBIC)))
        return image.resize(self.image_size[::-1], resample=resample)

    def image_tokens(self, path: str) -> int:
        """How many image tokens the processor writes for the image at ``path``."""
        out = self.processor(text=self.image_token, images=[self.load(path)], **self._size)
        return int(np.count_nonzero(np.asarray(out["input_ids"][0]) == self.image_token_id))

    def image_inputs(self, paths: Sequence[str]) -> dict[str, torch.Tensor]:
        """The processor's image inputs for the images at ``paths`` (module docstring), by name.
        With ``images_per_example`` K and fixed-size images (LLaVA's ``pixel_values``
        ``[images, C, H, W]``), ``K`` slots: the images, then zeros (megatrain's slot layout,
        :func:`megatrain.planner.trace.vlm.place_images`; a row without images gets K zero slots).

        Raises:
            RecordError: an image file is missing or unreadable.
        """
        out = {}
        if paths:
            out = self.processor(text=self.image_token * len(paths), images=[self.load(p) for p in paths],
                                 return_tensors="pt", **self._size)
            out = {k: out[k] for k in self.image_keys if k in out}
        elif self.max_pixels is not None:  # a row without images: no patches, no grids
            return self._no_images()
        k = self.images_per_example
        if k is None or (IMAGES in out and out[IMAGES].dim() != 4):
            return out
        blank = out[IMAGES][:1] if IMAGES in out else self._blank()
        pad = blank.new_zeros((k - len(paths), *blank.shape[1:]))
        return {**out, IMAGES: torch.cat([out[IMAGES], pad]) if IMAGES in out else pad}

    def _no_images(self) -> dict[str, torch.Tensor]:
        """A patch-grid processor's inputs for no image: ``pixel_values`` ``[0, C*T*P*P]`` float32 and
        ``image_grid_thw`` ``[0, 3]`` int64, so that a batch of text-only rows still has both."""
        ip = self.processor.image_processor
        features = 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2
        return {IMAGES: torch.zeros((0, features), dtype=torch.float32),
                "image_grid_thw": torch.zeros((0, 3), dtype=torch.long)}

    def _blank(self) -> torch.Tensor:
        """One image's ``pixel_values`` (``[1, C, H, W]``) as the image processor writes it: the
        shape and dtype of the zero slots of a row without images."""
        from PIL import Image

        if self._blank_image is None:
            out = self.processor.image_processor(images=[Image.new("RGB", (8, 8))], return_tensors="pt")
            self._blank_image = torch.as_tensor(out[IMAGES][:1])
        return self._blank_image
