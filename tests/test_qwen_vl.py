"""Qwen2-VL and Qwen2.5-VL: the vision tower's blocks are layers of the LayerGraph, the grid-derived
tensors and the M-RoPE positions are made on the host, and training equals eager PyTorch + AdamW on
the processor's batch layout (flattened patches and image_grid_thw), with the tower trained or
frozen; BF16 within the derived bounds; bad batches refused before the step."""

from __future__ import annotations

import copy

import pytest
import torch

import megatrain
from megatrain.errors import BatchError, ConfigError
from megatrain.examples.train_qwen2_vl import GRID, IMAGE_TOKEN as IMAGE, INPUT_NAMES as NAMES
from megatrain.examples.train_qwen2_vl import image_batch as example_batch, tiny_qwen_vl as tiny_qwen
from megatrain.ir.schedule import OpKind

from test_exactness import ADAMW, RTOL, assert_bf16_tracks_eager, supervised_tokens
from test_vlm import plan_vision_section

vision_utils = pytest.importorskip("transformers.vision_utils", reason="an older transformers (5.4) computes "
                                   "Qwen2-VL's grid tensors inside its forward: megatrain refuses its images there")
if not hasattr(vision_utils, "get_vision_window_index"):
    pytest.skip("this transformers' Qwen2-VL computes its grid tensors inside the forward", allow_module_level=True)

TOKENS = 12  # a row's image tokens: GRID is a 16x16 and a 16x32 pixel image, 4 + 8 merged tokens


def image_batch(rows: int, seq_len: int, seed: int, grid=GRID, row_grids=None) -> dict[str, torch.Tensor]:
    """The example's processor-shaped batch: each row's images of ``grid`` (or its own of
    ``row_grids``) in text, labels on the text."""
    return example_batch(rows, seq_len, torch.Generator().manual_seed(seed), grid, row_grids)


def micro_batch(batch: dict[str, torch.Tensor], k: int, rows: int) -> dict[str, torch.Tensor]:
    """Micro-batch ``k`` of ``rows`` rows, its images' patches and grids with it (each row's images
    as many as fill its image tokens, in order)."""
    grids = batch["image_grid_thw"]
    fills = (grids.prod(-1) // 4).tolist()  # one image token per 2x2 merged patches
    ends, image = [0], 0
    for tokens in (batch["input_ids"] == IMAGE).sum(dim=1).tolist():
        while tokens:
            tokens, image = tokens - fills[image], image + 1
        ends.append(image)
    first, last = ends[k * rows], ends[(k + 1) * rows]
    patches = [0, *grids.prod(-1).cumsum(0).tolist()]
    cut = {"pixel_values": (patches[first], patches[last]), "image_grid_thw": (first, last)}
    return {n: t[slice(*cut.get(n, (k * rows, (k + 1) * rows)))] for n, t in batch.items()}


def eager_steps(ref, batches, micro_batches: int) -> list[float]:
    """Eager AdamW steps of ``ref`` on ``batches`` (the whole batch's token-weighted loss by
    gradient accumulation over micro-batches of 2 rows, Hugging Face's forward on each, images in
    the model's dtype); returns the losses."""
    opt, dtype, losses = torch.optim.AdamW(ref.parameters(), **ADAMW), next(ref.parameters()).dtype, []
    for batch in batches:
        opt.zero_grad()
        want = 0.0
        for k in range(micro_batches):
            part = micro_batch(batch, k, 2)
            loss = ref(**dict(part, pixel_values=part["pixel_values"].to(dtype))).loss
            loss = loss * (supervised_tokens(part) / supervised_tokens(batch))
            loss.backward()
            want += loss.item()
        opt.step()
        losses.append(want)
    return losses


def train_both(model, batches, *, micro_batches: int, **compile_options):
    """megatrain and eager AdamW (:func:`eager_steps`) on ``batches``; asserts equal losses and
    weights (1e-5)."""
    ref = copy.deepcopy(model)
    trainer = megatrain.compile(model, micro_batch_size=2, micro_batches=micro_batches, optimizer=ADAMW,
                                input_names=NAMES, **compile_options)
    got = [trainer.step(b).loss for b in batches]
    trainer.flush()
    for step, want in enumerate(eager_steps(ref, batches, micro_batches)):
        assert abs(got[step] - want) <= RTOL * abs(want), f"step {step}: megatrain {got[step]} vs eager {want}"
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if name.endswith("self_attn.k_proj.bias"):
            continue  # a zero gradient in exact arithmetic: AdamW scales both runs' rounding noise to lr (test_vlm)
        if name.endswith("attn.qkv.bias"):  # the vision attention's: its key third is such a bias
            p, q = (torch.cat([t[:len(t) // 3], t[2 * len(t) // 3:]]) for t in (p, q))
        diff, norm = (p - q).norm().item(), q.norm().item()
        assert diff <= RTOL * norm, f"{name}: difference {diff:.2e}, norm {norm:.2e}"
    return trainer


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_vision_blocks_are_layers_and_train_as_eager(kind):
    torch.manual_seed(0)
    model = tiny_qwen(kind)
    before = model.model.visual.blocks[0].attn.qkv.weight.detach().clone()
    trainer = train_both(model, [image_batch(4, 24, seed=s) for s in range(2)], micro_batches=2, seq_len=24,
                         image_grid_thw=GRID)
    names = [layer.name for layer in trainer.graph.layers]
    assert names == ["prologue", "model.visual.blocks.0", "model.visual.blocks.1", "model.visual.merger",
                     "model.language_model.layers.0", "model.language_model.layers.1", "epilogue"]
    layers = trainer.graph.layers
    # The vision blocks share one template: Qwen2.5-VL's window-attention block reads the window
    # boundaries where its full-attention block reads the images', batch inputs of one shape. Each
    # has its local backward and gradient copy.
    assert layers[1].template == layers[2].template
    for li in (1, 2):
        assert {OpKind.BWD, OpKind.D2H} <= {op.kind for op in trainer.schedule.ops if op.layer == li}
    assert not torch.equal(model.model.visual.blocks[0].attn.qkv.weight, before), "the tower trains"
    assert trainer.graph.meta["image_grid_thw"] == [list(g) for g in GRID]


# A 32x32 image (8x8 patches of 4 pixels), a 16x32 one, two small ones, and a text-only row:
# 64, 32, 24 and 0 patches of the budget of one 32x32 image a row.
BUDGET = ((1, 8, 8),)
ROWS = ([(1, 8, 8)], [(1, 4, 8)], [(1, 4, 4), (1, 2, 4)], [])


@pytest.mark.parametrize("kind, frozen", [("qwen2_vl", False), ("qwen2_5_vl", False), ("qwen2_5_vl", True)])
def test_qwen_vl_rows_of_different_grids_and_image_counts_train_as_eager(kind, frozen):
    """Rows of different grids and image counts, text-only included, in one batch of two
    micro-batches (the first with 96 of its 128 patch slots real, the second 24): each micro-batch's
    patches in row order then zeros, its rotary positions, image boundaries (and Qwen2.5-VL's
    window order and window boundaries: the 32x32 image has four windows) made on the host; equal
    to Hugging Face's forward on the whole batch, tower trained or frozen. A row whose patches
    exceed the budget is refused before the step, naming it."""
    torch.manual_seed(0)
    model = tiny_qwen(kind)
    if frozen:
        model.model.visual.patch_embed.requires_grad_(False)
        model.model.visual.blocks.requires_grad_(False)
    batches = [image_batch(4, 24, seed=s, row_grids=ROWS) for s in range(2)]
    trainer = train_both(model, batches, micro_batches=2, seq_len=24, image_grid_thw=BUDGET)
    parts = trainer.batches.split(batches[0], 2)
    real = [96, 24]  # each micro-batch's real patches; the zeros after them are its padding
    for part, n in zip(parts, real):
        pixels = part["pixel_values"].flatten(0, 1)
        assert pixels.shape[0] == 128 and torch.equal(pixels[n:], torch.zeros_like(pixels[n:]))
    assert torch.equal(parts[0]["pixel_values"].flatten(0, 1)[:96], batches[0]["pixel_values"][:96])
    over = image_batch(4, 24, seed=0, row_grids=[[(1, 8, 8), (1, 2, 2)], [], [(1, 4, 4)], []])
    with pytest.raises(BatchError, match=r"row 0 carries images of grids \[\[1, 8, 8\], \[1, 2, 2\]\], 68 patches, "
                                         r"more than the 64 .* image_grid_thw=\[\[1, 8, 8\], \[1, 2, 2\]\]"):
        trainer.step(over)
    assert trainer.step_count == 2


def test_shape_free_qwen2_vl_takes_the_row_with_the_most_patches_as_the_budget():
    """Shape-free, a batch's budget is the grids of its row with the most patches: the batch of
    ROWS is planned with one 32x32 image a row, and a batch of the same budget reuses that plan."""
    torch.manual_seed(0)
    model = tiny_qwen()
    shape_free = megatrain.compile(model, micro_batches=2, optimizer=ADAMW, input_names=NAMES)
    shape_free.step(image_batch(4, 24, seed=0, row_grids=ROWS))
    shape_free.step(image_batch(4, 24, seed=1, row_grids=[[], [(1, 4, 4)], [], [(1, 8, 8)]]))
    assert shape_free.shapes == [(2, 24, BUDGET)] and shape_free.traces == 1


def test_qwen2_vl_frozen_vision_tower_trains_merger_and_decoder_as_eager_at_each_grid(tmp_path):
    """The common recipe (patch embedding and vision blocks frozen, the merger and decoder
    trained), shape-free: a batch of another image grid is traced and planned as a new shape. The
    checkpoint is a Hugging Face directory."""
    torch.manual_seed(1)
    model = tiny_qwen(text_layers=1)
    frozen = [model.model.visual.patch_embed, model.model.visual.blocks]
    for p in (p for m in frozen for p in m.parameters()):
        p.requires_grad_(False)
    tower = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    one = ((1, 4, 4),)
    batches = [image_batch(4, 24, seed=0), image_batch(4, 16, seed=1, grid=one), image_batch(4, 24, seed=2)]
    shape_free = train_both(model, batches, micro_batches=2)
    assert shape_free.shapes == [(2, 16, one), (2, 24, GRID)] and shape_free.traces == 2
    trainer = shape_free.trainer
    after = dict(model.named_parameters())
    for n, p in tower.items():
        assert torch.equal(after[n], p), f"frozen {n} changed"
    g = trainer.graph
    for li in (1, 2):  # the vision blocks: no gradient computed, no optimizer state
        assert g.layers[li].trainable_numel == 0
        assert not [op for op in trainer.schedule.ops
                    if op.layer == li and op.kind in (OpKind.BWD, OpKind.D2H, OpKind.OPT, OpKind.ACC)]
        assert trainer.host.exp_avg(li).numel() == trainer.host.exp_avg_sq(li).numel() == 0
    # A Hugging Face directory that AutoModelForImageTextToText loads, every tensor equal, and generates from.
    from transformers import AutoModelForImageTextToText

    shape_free.save(tmp_path / "ckpt")
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "ckpt")
    want, got = model.state_dict(), loaded.state_dict()
    assert type(loaded) is type(model) and set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    row = micro_batch(batches[0], 0, 1)
    out = loaded.generate(**{n: t for n, t in row.items() if n != "labels"}, max_new_tokens=2, min_new_tokens=2,
                          do_sample=False)
    assert out.shape == (1, 26)


def test_qwen2_vl_batches_must_match_the_traced_grid_and_bf16_tracks_eager():
    """Bad grids are refused at compile, bad batches before the step; then BF16 compute (the model traced with BF16
    parameters) matches the eager model with BF16 parameters at the same weights, step by step,
    within test_exactness.bf16_tolerances: the chain from the embeddings to the logits counts the
    two vision blocks, the merger (two matmuls, as many roundings as a block) and the two decoder
    blocks: five blocks."""
    torch.manual_seed(2)
    model = tiny_qwen()
    with pytest.raises(ConfigError, match=r"multiples of spatial_merge_size=2"):
        megatrain.compile(model, seq_len=24, input_names=NAMES, image_grid_thw=[(1, 3, 4)])
    with pytest.raises(ConfigError, match=r"fill 16 image tokens, more than seq_len=12"):
        megatrain.compile(model, seq_len=12, input_names=NAMES, image_grid_thw=[(1, 8, 8)])
    trainer = megatrain.compile(model, seq_len=24, micro_batch_size=2, optimizer=ADAMW, compute_dtype="bfloat16",
                                input_names=NAMES, image_grid_thw=GRID)
    good = image_batch(2, 24, seed=0)
    with pytest.raises(BatchError, match=rf"row 0 holds {TOKENS} image tokens .* images \[\[1, 8, 8\]\] .* fill 16"):
        trainer.step(dict(good, image_grid_thw=torch.tensor([[1, 8, 8]] * 4)))
    bad = dict(good, input_ids=good["input_ids"].clone())
    bad["input_ids"][1, bad["input_ids"][1] == IMAGE] = 3  # row 1 shows no image: two are left over
    with pytest.raises(BatchError, match=r"lists 4 images, but the rows' image tokens .* take only the first 2"):
        trainer.step(bad)
    with pytest.raises(BatchError, match=r"dtype torch.float64"):
        trainer.step(dict(good, pixel_values=good["pixel_values"].double()))
    with pytest.raises(BatchError, match=r"shape \(2, 48, 96\).* \[96, 96\]"):
        trainer.step(dict(good, pixel_values=good["pixel_values"].view(2, 48, 96)))
    assert trainer.step_count == 0
    assert trainer.graph.meta["param_dtype"] == "bfloat16"
    assert_bf16_tracks_eager(model, trainer, [image_batch(2, 24, seed=s) for s in range(2)], blocks=5,
                             bf16_parameters=True)


def test_plan_reports_the_qwen2_vl_vision_towers_share(tmp_path, capsys):
    """``megatrain plan`` traces a Qwen2-VL config with one 448x448 image per row (32 x 32 patches
    of 14 pixels, 256 image tokens) through its vision tower and reports the tower's share."""
    model = tiny_qwen()
    config = model.config.to_dict()
    config["vision_config"]["patch_size"] = 14
    config["text_config"]["max_position_embeddings"] = 512
    rows = plan_vision_section(config, tmp_path, capsys, "model.visual.blocks", seq_len=272, global_batch=1)
    assert rows["layers"][1] == "2/7", rows
    assert int(rows["parameters"][1].replace(",", "")) == sum(p.numel() for p in model.model.visual.blocks.parameters())
    # The vision blocks' ops are counted (1024 patches a row through them) and are not all of the
    # compute stream's: the decoder, LM head and loss run too. Their weights are copied like any.
    assert 0 < float(rows["compute"][4].rstrip("%")) < 100, rows["compute"]
    assert float(rows["weight"][4].rstrip("%")) > 0, rows["weight"]
