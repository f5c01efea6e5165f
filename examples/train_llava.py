"""A vision-language model on the CPU: a tiny LLaVA trained with megatrain on random images.

The model is built from a config (a CLIP vision tower, 32x32 images in 8x8 patches, and a Llama
decoder; nothing is downloaded). Each row of a batch is text around one image's 16 image tokens
(the features LLaVA's projector writes into the text embeddings there), with the labels masked
(-100) on the image tokens, as an SFT collator masks them. ``--freeze-vision`` freezes the vision
tower, LLaVA's recipe: only the projector and the decoder train, the tower's layers run forward
only (no local backward, no gradient copy, no optimizer state). ``--mixed``: rows of 0, 1 and 2
images (``images_per_row=2`` as a maximum, text-only rows included), given in Hugging Face's
layout (``pixel_values`` holds each real image once, rows in order). It prints the layers megatrain
streams, then the loss of each step::

    python examples/train_llava.py                     # a few seconds on 2 CPU cores
    python examples/train_llava.py --freeze-vision --steps 20
    python examples/train_llava.py --mixed
"""

from __future__ import annotations

import argparse

import torch

import megatrain

IMAGE_TOKEN = 95
IMAGE_TOKENS_PER_ROW = (32 // 8) ** 2  # patches of one image (the CLS position is dropped)


def tiny_llava():
    """A LLaVA of 3 CLIP vision blocks and 2 Llama decoder blocks, 96 tokens of vocabulary."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8)
    text = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                     image_token_id=IMAGE_TOKEN))


def image_batch(rows: int, seq_len: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random text with one random image per row (its tokens after the first text token)."""
    ids = torch.randint(0, IMAGE_TOKEN, (rows, seq_len), generator=generator)
    ids[:, 1:1 + IMAGE_TOKENS_PER_ROW] = IMAGE_TOKEN
    return {"input_ids": ids, "pixel_values": torch.randn(rows, 3, 32, 32, generator=generator),
            "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100)}


def mixed_batch(counts: list[int], seq_len: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random text with ``counts[r]`` random images in row ``r`` (0: a text-only row), each image's
    tokens one text token apart; ``pixel_values`` ``[sum(counts), 3, 32, 32]``, rows in order."""
    ids = torch.randint(0, IMAGE_TOKEN, (len(counts), seq_len), generator=generator)
    for r, n in enumerate(counts):
        for i in range(n):
            start = 1 + i * (IMAGE_TOKENS_PER_ROW + 1)
            ids[r, start:start + IMAGE_TOKENS_PER_ROW] = IMAGE_TOKEN
    return {"input_ids": ids, "pixel_values": torch.randn(sum(counts), 3, 32, 32, generator=generator),
            "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100)}


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--freeze-vision", action="store_true", help="train only the projector and the decoder")
    p.add_argument("--mixed", action="store_true", help="rows of 0, 1 and 2 images (images_per_row=2, a maximum)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = tiny_llava()
    if args.freeze_vision:
        model.model.vision_tower.requires_grad_(False)
    names = ("input_ids", "pixel_values", "labels")
    if args.mixed:  # 2 micro-batches of 2 rows, 2 image slots a row: the first micro-batch has 2 images, the second 1
        trainer = megatrain.compile(model, seq_len=40, micro_batch_size=2, micro_batches=2, input_names=names,
                                    images_per_row=2)
        batches = [mixed_batch([0, 2, 1, 0], 40, torch.Generator().manual_seed(s % 2)) for s in range(args.steps)]
    else:
        trainer = megatrain.compile(model, seq_len=24, micro_batch_size=2, input_names=names)
        batches = [image_batch(2, 24, torch.Generator().manual_seed(s % 2)) for s in range(args.steps)]
    print("layers:", ", ".join(layer.name for layer in trainer.graph.layers))
    losses = []
    for step, batch in enumerate(batches):
        losses.append(trainer.step(batch).loss)
        print(f"step {step}: loss {losses[-1]:.4f}")
    trainer.flush()
    return losses


if __name__ == "__main__":
    main()
