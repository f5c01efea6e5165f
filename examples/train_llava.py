"""A vision-language model on the CPU: a tiny LLaVA trained with megatrain on random images.

The model is built from a config (a CLIP vision tower, 32x32 images in 8x8 patches, and a Llama
decoder; nothing is downloaded). Each row of a batch is text around one image's 16 image tokens
(the features LLaVA's projector writes into the text embeddings there), with the labels masked
(-100) on the image tokens, as an SFT collator masks them. ``--freeze-vision`` freezes the vision
tower, LLaVA's recipe: only the projector and the decoder train, the tower's layers run forward
only (no local backward, no gradient copy, no optimizer state). It prints the layers megatrain
streams, then the loss of each step::

    python examples/train_llava.py                     # a few seconds on 2 CPU cores
    python examples/train_llava.py --freeze-vision --steps 20
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


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--freeze-vision", action="store_true", help="train only the projector and the decoder")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = tiny_llava()
    if args.freeze_vision:
        model.model.vision_tower.requires_grad_(False)
    trainer = megatrain.compile(model, seq_len=24, micro_batch_size=2,
                                input_names=("input_ids", "pixel_values", "labels"))
    print("layers:", ", ".join(layer.name for layer in trainer.graph.layers))
    batches = [image_batch(2, 24, torch.Generator().manual_seed(s % 2)) for s in range(args.steps)]
    losses = []
    for step, batch in enumerate(batches):
        losses.append(trainer.step(batch).loss)
        print(f"step {step}: loss {losses[-1]:.4f}")
    trainer.flush()
    return losses


if __name__ == "__main__":
    main()
