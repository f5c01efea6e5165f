"""The bundled vision-language SFT example: a tiny LLaVA with its processor, and a few images.

``examples/tiny-llava/`` is a LLaVA config (a CLIP vision tower over 32x32 images in 8x8 patches,
16 image features, and a 2-layer Llama decoder) with its processor (a ``LlavaProcessor``: a
byte-level BPE of 258 tokens with ``<image>``, a ``CLIPImageProcessor`` that resizes and crops to
32x32, and megatrain's image chat template), nothing downloaded. ``examples/data/vlm_sft/`` holds
six 32x32 PNGs of coloured shapes and ``shapes.json``, a sharegpt (LLaMA-Factory) file whose
12 records ask about one image each (``<image>`` in the text, the file in ``images``, relative to
the JSON file). Fine-tune the tiny LLaVA on them on the CPU::

    megatrain train --task sft --model examples/tiny-llava --data examples/data/vlm_sft/shapes.json \\
        --output-dir runs/llava-sft --seq-len 96 --global-batch 4 --micro-batch-size 2 --val-fraction 0.2 \\
        --max-steps 10 --warmup-steps 0

This script wrote those files (``python examples/tiny_llava_sft.py`` writes them again, the same).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMAGE_SIZE, PATCH_SIZE = 32, 8

SHAPES = {  # name: fill colour
    "red_square": (220, 30, 30), "blue_circle": (30, 60, 220), "green_triangle": (30, 180, 60),
    "red_circle": (220, 30, 30), "blue_square": (30, 60, 220), "green_square": (30, 180, 60),
}


def write_processor(directory: Path, chat_template: str | None = None) -> None:
    """Save a tiny ``LlavaProcessor`` to ``directory`` (``AutoProcessor.from_pretrained`` loads it):
    a byte-level BPE (256 bytes, ``<|endoftext|>`` and ``<image>``), a CLIP image processor to
    32x32, 16 image tokens per image; ``chat_template`` (default: megatrain's image template)."""
    from tokenizers import AddedToken
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    from megatrain.data import train_bpe_tokenizer
    from megatrain.data.sft_images import DEFAULT_IMAGE_CHAT_TEMPLATE

    tok = train_bpe_tokenizer([""], vocab_size=257)  # the 256 bytes and <|endoftext|>: no merges
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    eot = "<|endoftext|>"
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eot, bos_token=eot, pad_token=eot)
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE,
                                                                               "width": IMAGE_SIZE})
    LlavaProcessor(image_processor=images, tokenizer=hf, patch_size=PATCH_SIZE,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1,  # CLIP's CLS position, dropped by the "default" strategy
                   chat_template=chat_template or DEFAULT_IMAGE_CHAT_TEMPLATE).save_pretrained(directory)


def llava_config(vocab_size: int = 258, image_token_id: int = 257):
    """The tiny LLaVA's ``LlavaConfig``: 2 CLIP vision blocks, 2 Llama decoder blocks, width 32."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token_id)


def write_images(directory: Path) -> list[Path]:
    """The six shapes as 32x32 PNGs in ``directory/images``."""
    from PIL import Image, ImageDraw

    out = []
    (directory / "images").mkdir(parents=True, exist_ok=True)
    for name, colour in SHAPES.items():
        im = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
        draw = ImageDraw.Draw(im)
        box = (6, 6, 25, 25)
        if name.endswith("square"):
            draw.rectangle(box, fill=colour)
        elif name.endswith("circle"):
            draw.ellipse(box, fill=colour)
        else:
            draw.polygon([(16, 5), (27, 26), (5, 26)], fill=colour)
        out.append(directory / "images" / f"{name}.png")
        im.save(out[-1], optimize=True)
    return out


def write_records(path: Path) -> None:
    """``shapes.json``: two sharegpt records per shape (its shape, its colour), the image placeholder first."""
    records = []
    for name in SHAPES:
        colour, shape = name.split("_")
        for q, a in (("What shape is in the picture?", f"A {colour} {shape}."),
                     ("What colour is the shape?", f"{colour.capitalize()}.")):
            records.append({"conversations": [{"from": "human", "value": f"<image>{q}"}, {"from": "gpt", "value": a}],
                            "images": [f"images/{name}.png"]})
    path.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")


def main() -> None:
    model = HERE / "tiny-llava"
    model.mkdir(exist_ok=True)
    write_processor(model)
    llava_config().to_json_file(model / "config.json")
    data = HERE / "data" / "vlm_sft"
    write_images(data)
    write_records(data / "shapes.json")


if __name__ == "__main__":
    main()
