"""The bundled Qwen2-VL SFT example: a tiny Qwen2-VL with its processor, fine-tuned on the shapes.

``examples/tiny-qwen2-vl/`` is a Qwen2-VL config (:func:`megatrain.examples.train_qwen2_vl.qwen_vl_config`:
a vision tower of 4-pixel patches merged 2x2, 2 vision blocks, a 2-layer Qwen2 decoder with
M-RoPE) with its processor (transformers' ``Qwen2VLProcessor`` files: a byte-level BPE of 261
tokens with ``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>`` and ``<|vision_end|>``, a
Qwen2-VL image processor with ``max_pixels`` 32 x 32, so a 448 x 448 image, megatrain's default
size, becomes 32 x 32: 8 x 8 patches, 16 image tokens; and megatrain's image chat template, an
image written as Qwen2-VL's template writes it, ``<|vision_start|><|image_pad|><|vision_end|>``),
nothing downloaded. It trains on the LLaVA example's data (``examples/data/vlm_sft``, written by
``tiny_llava_sft.py``: 12 questions about six 32 x 32 PNGs)::

    megatrain train --task sft --model examples/tiny-qwen2-vl --data examples/data/vlm_sft/shapes.json \\
        --output-dir runs/qwen2-vl-sft --seq-len 96 --global-batch 4 --micro-batch-size 2 --val-fraction 0.2 \\
        --max-steps 10 --warmup-steps 0

This script wrote ``tiny-qwen2-vl/`` (``python examples/tiny_qwen2_vl_sft.py`` writes it again, the same).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
SPECIAL = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
"""The processor's image, video, vision start and vision end tokens: ids 257 to 260."""
IMAGE_TEMPLATE = "<|vision_start|><|image_pad|><|vision_end|>"
"""An image part as Qwen2-VL's chat template writes it."""


def write_processor(directory: Path, max_pixels: int = 32 * 32) -> None:
    """Save a tiny Qwen2-VL processor to ``directory``: a byte-level BPE (256 bytes,
    ``<|endoftext|>`` and :data:`SPECIAL`), a Qwen2-VL image processor of 4-pixel patches merged
    2 x 2 (images resized to multiples of 8 pixels within 64 and ``max_pixels`` pixels), and
    megatrain's image chat template with :data:`IMAGE_TEMPLATE`. Saved without a video processor
    (:func:`megatrain.data.sft_qwen_vl.images_only`; transformers' needs torchvision)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from megatrain.data import train_bpe_tokenizer
    from megatrain.data.sft_images import DEFAULT_IMAGE_CHAT_TEMPLATE
    from megatrain.data.sft_qwen_vl import images_only

    tok = train_bpe_tokenizer([""], vocab_size=257)  # the 256 bytes and <|endoftext|>: no merges
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    eot = "<|endoftext|>"
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eot, pad_token=eot)
    images = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                                      max_pixels=max_pixels)
    template = DEFAULT_IMAGE_CHAT_TEMPLATE.replace("<image>", IMAGE_TEMPLATE)
    images_only("Qwen2VLProcessor")(images, hf, chat_template=template).save_pretrained(directory)


def config(kind: str = "qwen2_vl"):
    """The tiny Qwen2-VL's ``Qwen2VLConfig`` (``kind="qwen2_5_vl"``: a Qwen2.5-VL's of the same
    sizes): 261 tokens, the processor's special token ids."""
    from megatrain.examples.train_qwen2_vl import qwen_vl_config

    return qwen_vl_config(kind, vocab_size=261, tokens=(257, 258, 259, 260))


def main() -> None:
    model = HERE / "tiny-qwen2-vl"
    model.mkdir(exist_ok=True)
    write_processor(model)
    config().to_json_file(model / "config.json")


if __name__ == "__main__":
    main()
