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


def image_batch(rows: int, seq_len: int, seed: int, grid=GRID) -> dict[str, torch.Tensor]:
    """The example's processor-shaped batch: each row's images of ``grid`` in text, labels on the text."""
    return example_batch(rows, seq_len, torch.Generator().manual_seed(seed), grid)


def micro_batch(batch: dict[str, torch.Tensor], k: int, rows: int) -> dict[str, torch.Tensor]:
    """Micro-batch ``k`` of ``rows`` rows, its images' patches and grids with it."""
    total = batch["input_ids"].shape[0]
    cut = {"pixel_values": rows * batch["pixel_values"].shape[0] // total,
           "image_grid_thw": rows * batch["image_grid_thw"].shape[0] // total}
    return {n: t[k * cut.get(n, rows):(k + 1) * cut.get(n, rows)] for n, t in batch.items()}


def train_both(model, batches, *, micro_batches: int, **compile_options):
    """megatrain and eager AdamW (the whole batch's token-weighted loss by gradient accumulation
    over the same micro-batches) on ``batches``; asserts equal losses and weights (1e-5)."""
    ref = copy.deepcopy(model)
    trainer = megatrain.compile(model, micro_batch_size=2, micro_batches=micro_batches, optimizer=ADAMW,
                                input_names=NAMES, **compile_options)
    got = [trainer.step(b).loss for b in batches]
    trainer.flush()
    opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step, batch in enumerate(batches):
        opt.zero_grad()
        want = 0.0
        for k in range(micro_batches):
            part = micro_batch(batch, k, 2)
            loss = ref(**part).loss * (supervised_tokens(part) / supervised_tokens(batch))
            loss.backward()
            want += loss.item()
        opt.step()
        assert abs(got[step] - want) <= RTOL * abs(want), f"step {step}: megatrain {got[step]} vs eager {want}"
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if name.endswith("self_attn.k_proj.bias"):
            continue  # a zero gradient in exact arithmetic: AdamW scales both runs' rounding noise to lr (test_vlm)
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
    # Qwen2-VL's vision blocks share one template; Qwen2.5-VL's window-attention block reads more
    # sequence boundaries (a buffer of another shape) than its full-attention block, so each kind
    # has its own. Each has its local backward and gradient copy.
    assert (layers[1].template == layers[2].template) == (kind == "qwen2_vl")
    for li in (1, 2):
        assert {OpKind.BWD, OpKind.D2H} <= {op.kind for op in trainer.schedule.ops if op.layer == li}
    assert not torch.equal(model.model.visual.blocks[0].attn.qkv.weight, before), "the tower trains"
    assert trainer.graph.meta["image_grid_thw"] == [list(g) for g in GRID]


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
    with pytest.raises(BatchError, match=r"compiled for 2 image\(s\) per row of grids \[\[1, 4, 4\], \[1, 4, 8\]\]"):
        trainer.step(dict(good, image_grid_thw=torch.tensor([[1, 8, 8]] * 4)))
    bad = dict(good, input_ids=good["input_ids"].clone())
    bad["input_ids"][1, bad["input_ids"][1] == IMAGE] = 3
    with pytest.raises(BatchError, match=rf"row 1 holds 0 image tokens .* exactly {TOKENS}"):
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
