"""Qwen2-VL on the CPU: a tiny Qwen2-VL (or Qwen2.5-VL) trained with megatrain on random images.

The model is built from a config (nothing is downloaded): a vision tower of 4-pixel patches
merged 2x2 into image tokens, and a Qwen2 decoder with M-RoPE. Each batch is laid out as Qwen2-VL's
processor returns it: ``pixel_values`` ``[patches, 3 * 2 * 4 * 4]`` (every image of the batch,
flattened), ``image_grid_thw`` ``[images, 3]``, ``mm_token_type_ids``, and ``input_ids`` with
each image's tokens between vision start and end tokens; labels are masked (-100) on the image
tokens. Each row carries two images, 16x16 and 16x32 pixels (grids ``(1, 4, 4)`` and
``(1, 4, 8)``: 4 + 8 image tokens). megatrain computes the M-RoPE positions of each batch with the
model's own ``get_rope_index``. ``--freeze-vision`` freezes the patch embedding and the vision
blocks (the merger and the decoder train); ``--qwen2.5`` builds a Qwen2.5-VL (window attention in
its first vision block). It prints the layers megatrain streams, then the loss of each step::

    python examples/train_qwen2_vl.py                  # a few seconds on 2 CPU cores
    python examples/train_qwen2_vl.py --qwen2.5 --freeze-vision --steps 20
"""

from __future__ import annotations

import argparse

import torch

import megatrain

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 90, 91, 92, 93
PATCH = 4
GRID = ((1, 4, 4), (1, 4, 8))
"""The images of each row, as ``image_grid_thw`` gives them: (frames, rows, columns) of patches."""
INPUT_NAMES = ("input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids", "labels")


def qwen_vl_config(kind: str = "qwen2_vl", vision_layers: int = 2, text_layers: int = 2, vocab_size: int = 96,
                   tokens: tuple[int, int, int, int] = (IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END)):
    """The config of :func:`tiny_qwen_vl`; ``tokens``: the image, video, vision start and vision
    end token ids, in a vocabulary of ``vocab_size``."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=text_layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None,
                eos_token_id=None, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                    "rope_theta": 10000.0})
    ids = dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"), tokens))
    vision = dict(depth=vision_layers, num_heads=4, patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=2,
                  in_channels=3)
    if kind == "qwen2_vl":
        return Qwen2VLConfig(vision_config=dict(vision, embed_dim=32, hidden_size=32, mlp_ratio=2),
                             text_config=text, **ids)
    return Qwen2_5_VLConfig(vision_config=dict(vision, hidden_size=32, intermediate_size=48, out_hidden_size=32,
                                               window_size=4 * PATCH, fullatt_block_indexes=[vision_layers - 1]),
                            text_config=text, **ids)


def tiny_qwen_vl(kind: str = "qwen2_vl", vision_layers: int = 2, text_layers: int = 2):
    """A Qwen2-VL (``kind="qwen2_vl"``) or Qwen2.5-VL (``"qwen2_5_vl"``: SwiGLU vision MLP, RMSNorm,
    windows of 2x2 merged tokens in every block but the last, which attends to the whole image) of
    ``vision_layers`` vision blocks 32 wide and ``text_layers`` decoder blocks 32 wide, 96 tokens
    of vocabulary: about 70 K parameters."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(qwen_vl_config(kind, vision_layers, text_layers))


def image_batch(rows: int, seq_len: int, generator: torch.Generator, grid=GRID,
                row_grids=None) -> dict[str, torch.Tensor]:
    """Random text around each row's random images of ``grid`` (vision start, the image's tokens,
    vision end), at offsets that differ by row; labels on the text only. ``row_grids``: each row's
    own images instead (``rows`` lists of grids, an empty one for a text-only row)."""
    row_grids = [list(grid)] * rows if row_grids is None else [list(g) for g in row_grids]
    ids = torch.randint(0, IMAGE_TOKEN, (rows, seq_len), generator=generator)
    for r in range(rows):
        at = 1 + r % 3
        for t, h, w in row_grids[r]:
            n = t * h * w // 4  # one token per 2x2 merged patches
            ids[r, at], ids[r, at + 1:at + 1 + n], ids[r, at + 1 + n] = VISION_START, IMAGE_TOKEN, VISION_END
            at += n + 3
    images = [g for row in row_grids for g in row]
    patches = sum(t * h * w for t, h, w in images)
    return {"input_ids": ids, "pixel_values": torch.randn(patches, 3 * 2 * PATCH * PATCH, generator=generator),
            "image_grid_thw": torch.tensor(images, dtype=torch.long).view(-1, 3),
            "mm_token_type_ids": (ids == IMAGE_TOKEN).int(), "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100)}


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--freeze-vision", action="store_true",
                   help="freeze the patch embedding and vision blocks; train the merger and the decoder")
    p.add_argument("--qwen2.5", dest="qwen25", action="store_true", help="a Qwen2.5-VL instead of a Qwen2-VL")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = tiny_qwen_vl("qwen2_5_vl" if args.qwen25 else "qwen2_vl")
    if args.freeze_vision:
        model.model.visual.patch_embed.requires_grad_(False)
        model.model.visual.blocks.requires_grad_(False)
    trainer = megatrain.compile(model, seq_len=24, micro_batch_size=2, input_names=INPUT_NAMES, image_grid_thw=GRID)
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
