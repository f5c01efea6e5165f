"""Vision-language models: LLaVA's vision tower is layers of the same LayerGraph, training equals eager
PyTorch + AdamW with the tower trained or frozen, and the families megatrain does not trace are refused
with what they lack."""

from __future__ import annotations

import copy

import pytest
import torch

import megatrain
from megatrain.errors import BatchError, UnsupportedModelError
from megatrain.ir.plan import ActivationPolicy, Plan
from megatrain.ir.schedule import OpKind

from test_exactness import ADAMW, RTOL, assert_bf16_tracks_eager, eager_losses

transformers = pytest.importorskip("transformers")
if not hasattr(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(num_hidden_layers=1, hidden_size=8,
                                                                         intermediate_size=8, num_attention_heads=1,
                                                                         image_size=8, patch_size=4)), "embeddings"):
    # LLaVA is refused there (test_llava_is_refused_where_transformers_wraps_the_vision_tower)
    pytest.skip("this transformers (before 5.6) wraps CLIP's vision tower in vision_model", allow_module_level=True)

IMAGE_TOKEN = 95
PATCHES = 16  # (32 / 8) ** 2: image tokens per row with the "default" strategy (CLS dropped)


def tiny_llava(vision_layers: int = 3, text_layers: int = 2):
    """A tiny LLaVA: a CLIP vision tower (32x32 images, 8x8 patches) and a Llama decoder; the
    projector reads the vision tower's second-to-last hidden state (LLaVA-1.5's default), so the
    last vision block's weights are unused, as in the published checkpoints."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers,
                              num_attention_heads=4, image_size=32, patch_size=8)
    text = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=text_layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                     image_token_id=IMAGE_TOKEN, vision_feature_layer=-2,
                                                     vision_feature_select_strategy="default"))


def image_batch(rows: int, seq_len: int, seed: int, images_per_row: int = 1) -> dict[str, torch.Tensor]:
    """Random text around ``images_per_row`` random images per row, at a different offset in each
    row, one text token apart; labels supervise the text only (-100 on the image tokens), as an SFT
    collator masks them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, IMAGE_TOKEN, (rows, seq_len), generator=g)
    span = images_per_row * (PATCHES + 1)
    for r in range(rows):
        for i in range(images_per_row):
            start = 1 + r % (seq_len - span) + i * (PATCHES + 1)
            ids[r, start:start + PATCHES] = IMAGE_TOKEN
    labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
    return {"input_ids": ids, "pixel_values": torch.randn(rows * images_per_row, 3, 32, 32, generator=g),
            "labels": labels}


NAMES = ("input_ids", "pixel_values", "labels")


def train_both(model, *, steps: int, micro_batches: int, seq_len: int = 24, plan=None, images_per_row: int = 1):
    """``steps`` steps of megatrain and of eager AdamW on the same batches; asserts equal losses
    and weights (1e-5); returns the trainer."""
    ref = copy.deepcopy(model)
    batches = [image_batch(2 * micro_batches, seq_len, seed=s % 2, images_per_row=images_per_row)
               for s in range(steps)]
    trainer = megatrain.compile(model, seq_len=seq_len, micro_batch_size=2, micro_batches=micro_batches,
                                optimizer=ADAMW, input_names=NAMES, plan=plan,
                                images_per_row=images_per_row)
    got = [trainer.step(b).loss for b in batches]
    trainer.flush()
    want = eager_losses(ref, batches, micro_batches)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: megatrain {a} vs eager {b}"
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if name.endswith("self_attn.k_proj.bias"):
            # Its gradient is zero in exact arithmetic (a key bias adds q.b to every score of a
            # query, which softmax cancels), so both runs hold rounding noise there, which AdamW
            # normalises to steps of up to lr whatever its size: no two summation orders agree.
            continue
        diff, norm = (p - q).norm().item(), q.norm().item()
        assert diff <= RTOL * norm, f"{name}: difference {diff:.2e}, norm {norm:.2e}"  # zero biases: 0 <= 0
    return trainer


def test_llava_vision_blocks_are_layers_and_train_as_eager():
    torch.manual_seed(0)
    model = tiny_llava()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = train_both(model, steps=3, micro_batches=2)
    names = [layer.name for layer in trainer.graph.layers]
    vision = [n for n in names if n.startswith("model.vision_tower.encoder.layers.")]
    # The projector reads the second-to-last hidden state: the last block never runs.
    assert vision == ["model.vision_tower.encoder.layers.0", "model.vision_tower.encoder.layers.1"]
    assert names.index("model.multi_modal_projector") == names.index(vision[-1]) + 1
    assert names[names.index("model.multi_modal_projector") + 1] == "model.language_model.layers.0"
    vb = trainer.graph.layers[names.index(vision[0])]
    assert vb.template == trainer.graph.layers[names.index(vision[1])].template, "vision blocks share a template"
    unused = set(trainer.graph.meta["unused_parameters"])
    assert {n for n in before if n.startswith("model.vision_tower.encoder.layers.2.")} <= unused
    after = dict(model.named_parameters())
    for n in unused:  # eager AdamW skips a parameter without a gradient, and so does megatrain
        assert torch.equal(after[n], before[n]), n
    assert not torch.equal(after["model.vision_tower.encoder.layers.0.mlp.fc1.weight"],
                           before["model.vision_tower.encoder.layers.0.mlp.fc1.weight"]), "the tower trains"
    # Every vision layer has its local backward and its gradient copy.
    ops = trainer.schedule.ops
    for li, name in enumerate(names):
        if name in vision:
            assert {OpKind.BWD, OpKind.D2H} <= {op.kind for op in ops if op.layer == li}, name


K, OFF, RE = ActivationPolicy.KEEP, ActivationPolicy.OFFLOAD, ActivationPolicy.RECOMPUTE


@pytest.mark.parametrize("plan", [
    None,
    # The vision blocks' outputs recomputed for the projector's backward, which has no backward of
    # theirs to run; the projector's output offloaded; one slot.
    Plan(micro_batches=2, slots=1, prefetch_distance=0, grad_ring=1, activations=(K, RE, RE, OFF, K, K)),
], ids=["default", "recompute-offload"])
def test_llava_frozen_vision_tower_trains_projector_and_decoder_as_eager(plan):
    torch.manual_seed(1)
    model = tiny_llava(text_layers=1)
    for p in model.model.vision_tower.parameters():
        p.requires_grad_(False)
    tower = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("model.vision_tower.")}
    trainer = train_both(model, steps=3, micro_batches=1 if plan is None else plan.micro_batches, plan=plan)
    after = dict(model.named_parameters())
    for n, p in tower.items():
        assert torch.equal(after[n], p), f"frozen {n} changed"
    g = trainer.graph
    names = [layer.name for layer in g.layers]
    vision = [li for li, n in enumerate(names) if n.startswith("model.vision_tower.encoder.layers.")]
    assert len(vision) == 2
    for li in vision:
        layer = g.layers[li]
        assert layer.trainable_numel == 0
        assert not any(g.values[v].requires_grad for v in layer.outputs)
        # No vision gradient is computed: no local backward, gradient copy or optimizer step,
        # and no optimizer state.
        assert not [op for op in trainer.schedule.ops
                    if op.layer == li and op.kind in (OpKind.BWD, OpKind.D2H, OpKind.OPT, OpKind.ACC)]
        assert trainer.host.exp_avg(li).numel() == trainer.host.exp_avg_sq(li).numel() == 0
    if plan is not None:  # the recomputed blocks run forward twice a micro-batch: FWD and RECOMPUTE
        for li in vision:
            kinds = [op.kind for op in trainer.schedule.ops
                     if op.layer == li and op.kind in (OpKind.FWD, OpKind.RECOMPUTE)]
            assert sorted(k.value for k in kinds) == ["FWD", "FWD", "RECOMPUTE", "RECOMPUTE"], kinds
    # The prologue holds the text embedding (trainable) beside the frozen patch embedding.
    prologue = g.layers[names.index("prologue")]
    assert 0 < prologue.trainable_numel < prologue.numel


def test_batches_must_match_the_traced_images():
    torch.manual_seed(2)
    trainer = megatrain.compile(tiny_llava(vision_layers=2, text_layers=1), seq_len=24, micro_batch_size=2,
                                input_names=NAMES)
    good = image_batch(2, 24, seed=0)
    bad = dict(good, input_ids=good["input_ids"].clone())
    bad["input_ids"][1, torch.nonzero(bad["input_ids"][1] == IMAGE_TOKEN)[0]] = 3  # one image token less
    with pytest.raises(BatchError, match=rf"row 1 holds {PATCHES - 1} image tokens .* multiple of the {PATCHES}"):
        trainer.step(bad)
    with pytest.raises(BatchError, match=r"dtype torch.float64; .* float32"):
        trainer.step(dict(good, pixel_values=good["pixel_values"].double()))
    with pytest.raises(BatchError, match=r"shape \(2, 3, 64, 64\).* \[1 micro-batches x 2, 3, 32, 32\]"):
        trainer.step(dict(good, pixel_values=torch.zeros(2, 3, 64, 64)))
    assert trainer.step_count == 0
    trainer.step(good)
    assert trainer.step_count == 1


def test_unsupported_vision_language_families_are_refused_with_what_they_lack():
    from transformers import Qwen2VLConfig, Qwen3VLConfig

    from megatrain.models import check_causal_decoder

    with pytest.raises(UnsupportedModelError, match=r"'qwen3_vl' is a vision-language model .* deepstack"):
        check_causal_decoder(Qwen3VLConfig(), "config.json")
    check_causal_decoder(Qwen2VLConfig(), "config.json")  # trained with its images (test_qwen_vl)
    from conftest import tiny_llama

    with pytest.raises(UnsupportedModelError, match=r"'pixel_values' is a batch input only of .*llava"):
        megatrain.compile(tiny_llama(), seq_len=16, micro_batch_size=1,
                          input_names=("input_ids", "pixel_values", "labels"))


def test_llava_is_refused_where_transformers_wraps_the_vision_tower():
    # transformers before 5.6 hold CLIP's blocks in vision_tower.vision_model: a tower wrapped so.
    model = tiny_llava()
    wrapper = torch.nn.Module()
    wrapper.vision_model = model.model.vision_tower
    model.model.vision_tower = wrapper
    with pytest.raises(UnsupportedModelError, match=r"LLaVA needs a transformers .*5\.6 or later.*vision_model"):
        megatrain.compile(model, seq_len=32, micro_batch_size=1, input_names=("input_ids", "pixel_values", "labels"))


def plan_vision_section(config: dict, tmp_path, capsys, container: str, seq_len: int,
                        global_batch: int) -> dict[str, list[str]]:
    """``megatrain plan`` of a model ``config`` on the H100_SXM preset: the rows of its "vision
    tower (container)" section, by first word, each split into words."""
    import json

    from megatrain.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    rc = main(["plan", "--model", str(path), "--hardware", "H100_SXM", "--seq-len", str(seq_len), "--global-batch",
               str(global_batch), "--solver", "enumerate"])
    text = capsys.readouterr().out
    assert rc == 0, text
    section = text.split(f"vision tower ({container})")[1].strip().splitlines()[:5]
    return {line.split()[0]: line.split() for line in section}


def test_plan_reports_the_vision_towers_share(tmp_path, capsys):
    rows = plan_vision_section(tiny_llava().config.to_dict(), tmp_path, capsys, "model.vision_tower.encoder.layers",
                               seq_len=24, global_batch=2)
    blocks = tiny_llava().model.vision_tower.encoder.layers[:2]  # the third is never run
    assert rows["layers"][1] == "2/7", rows
    assert int(rows["parameters"][1].replace(",", "")) == sum(p.numel() for p in blocks.parameters())
    # The compute stream's share: positive, and below half (the decoder's two blocks are as
    # large and it adds the LM head and loss; the vision blocks' sequence is 17 against 24).
    share = float(rows["compute"][4].rstrip("%"))
    assert 0 < share < 50, rows["compute"]


def test_a_checkpoint_loads_with_auto_model_for_image_text_to_text_and_generates(tmp_path):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(3)
    model = tiny_llava(vision_layers=2, text_layers=1)
    trainer = megatrain.compile(model, seq_len=24, micro_batch_size=2, input_names=NAMES)
    batch = image_batch(2, 24, seed=0)
    trainer.step(batch)
    trainer.save(tmp_path / "ckpt")
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "ckpt")
    assert type(loaded) is type(model)
    want, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    # Every tensor, the last vision block's that no layer holds (the loss never reads it) included.
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    out = loaded.generate(input_ids=batch["input_ids"][:1], pixel_values=batch["pixel_values"][:1],
                          attention_mask=torch.ones(1, 24, dtype=torch.long), max_new_tokens=3, min_new_tokens=3,
                          do_sample=False)
    assert out.shape == (1, 27)


def test_llava_bf16_compute_tracks_eager_mixed_precision():
    """BF16 compute (the model traced with BF16 parameters, pixel_values cast to BF16 by the patch
    embedding as eagerly): at every step the loss and gradient norm of the eager model with BF16
    parameters at the same weights, within test_exactness.bf16_tolerances. Its chain from the
    embeddings to the logits counts the two vision blocks that run, the projector (two matmuls,
    as many roundings as a block) and the two decoder blocks: five blocks."""
    torch.manual_seed(4)
    model = tiny_llava()
    batches = [image_batch(2, 24, seed=s % 2) for s in range(3)]
    trainer = megatrain.compile(model, seq_len=24, micro_batch_size=2, optimizer=ADAMW, compute_dtype="bfloat16",
                                input_names=NAMES)
    assert trainer.graph.meta["param_dtype"] == "bfloat16"
    assert_bf16_tracks_eager(model, trainer, batches, blocks=5, bf16_parameters=True)


def test_llava_with_two_images_per_row_trains_as_eager_and_refuses_another_count():
    """images_per_row=2: pixel_values [rows x 2, C, H, W], each micro-batch's 2 x micro_batch_size
    images with its rows, each row's 2 x PATCHES image tokens filled in order, as eager does."""
    torch.manual_seed(4)
    trainer = train_both(tiny_llava(vision_layers=2, text_layers=1), steps=2, micro_batches=2, seq_len=40,
                         images_per_row=2)
    assert trainer.graph.value_by_name("pixel_values").shape[0] == 4  # micro_batch_size 2 x 2 images
    good = image_batch(4, 40, seed=5, images_per_row=2)
    one_image = image_batch(4, 40, seed=5)  # one image per row: 16 image tokens, 4 images
    # 4 images for rows whose image tokens say 2 each: neither one per real image nor 2 slots a row.
    with pytest.raises(BatchError, match=r"holds 4 images, and its 4 rows' image tokens say 8"):
        trainer.step(dict(good, pixel_values=one_image["pixel_values"]))
    assert trainer.step_count == 2
    # Shape-free: the batch's image slots per row are part of its shape: the slot layout's, or
    # in Hugging Face's layout the most images a row has; a count fitting neither is refused.
    shape_free = megatrain.compile(tiny_llava(vision_layers=2, text_layers=1), input_names=NAMES)
    with pytest.raises(BatchError, match=r"holds 5 images for 4 rows .*images_per_row.* or one per real image"):
        shape_free.step(dict(good, pixel_values=good["pixel_values"][:5]))
    shape_free.step(good)
    shape_free.step(counted_batch([0, 2, 1, 0], 40, seed=8))  # 3 images, at most 2 a row: the same shape
    assert shape_free.shapes == [(4, 40, 2)] and shape_free.traces == 1
    with pytest.raises(UnsupportedModelError, match=r"images_per_row=2 is the image count of LLaVA batches"):
        megatrain.compile(tiny_llava(), seq_len=24, images_per_row=2)  # a text-only batch
    with pytest.raises(megatrain.ConfigError, match=r"images_per_row=0"):
        megatrain.compile(tiny_llava(), seq_len=24, input_names=NAMES, images_per_row=0)


# -- rows with 0 to images_per_row images ----------------------------------------------------------

def counted_batch(counts: list[int], seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """Random text with ``counts[r]`` random images in row ``r`` (0 for a text-only row), in
    Hugging Face's layout: ``pixel_values`` ``[sum(counts), 3, 32, 32]``, the rows' images in order."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, IMAGE_TOKEN, (len(counts), seq_len), generator=g)
    for r, n in enumerate(counts):
        for i in range(n):
            start = 1 + r + i * (PATCHES + 1)
            ids[r, start:start + PATCHES] = IMAGE_TOKEN
    return {"input_ids": ids, "pixel_values": torch.randn(sum(counts), 3, 32, 32, generator=g),
            "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100)}


def in_slots(batch: dict[str, torch.Tensor], counts: list[int], k: int, fill: float) -> dict[str, torch.Tensor]:
    """``batch`` in megatrain's slot layout: ``pixel_values`` ``[rows * k, 3, 32, 32]``, row ``r``'s
    images first at ``r * k``, its unused slots ``fill``."""
    slots = torch.full((len(counts) * k, 3, 32, 32), fill)
    at = 0
    for r, n in enumerate(counts):
        slots[r * k:r * k + n] = batch["pixel_values"][at:at + n]
        at += n
    return dict(batch, pixel_values=slots)


def eager_trained(model, batch: dict[str, torch.Tensor], counts: list[int],
                  steps: int) -> tuple[torch.nn.Module, list[float]]:
    """A copy of ``model`` after ``steps`` steps of torch.optim.AdamW on the whole ``batch``
    (Hugging Face's layout, ``counts[r]`` images in row ``r``) in one forward, Hugging Face's own,
    given only the real images (no ``pixel_values`` when there are none), and its losses."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    inputs = dict(batch, pixel_values=batch["pixel_values"] if sum(counts) else None)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return model, losses


def assert_trains_as_eager(model, start, got: list[float], batch, counts: list[int]) -> None:
    """``model`` (trained from ``start``, a copy of it before, with losses ``got``) equals eager
    AdamW on the whole ``batch`` (one forward, Hugging Face's forward given only the real
    images): each loss and each parameter within RTOL (the key biases aside: train_both)."""
    whole, want = eager_trained(start, batch, counts, len(got))
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: megatrain {a} vs eager {b}"
    for (name, p), (_, q) in zip(model.named_parameters(), whole.named_parameters()):
        if not name.endswith("self_attn.k_proj.bias"):
            diff, norm = (p - q).norm().item(), q.norm().item()
            assert diff <= RTOL * norm, f"{name}: difference {diff:.2e}, norm {norm:.2e}"


@pytest.mark.parametrize("frozen", [False, True], ids=["tower-trained", "tower-frozen"])
def test_rows_with_0_1_or_2_images_train_as_eager_on_the_real_images(frozen):
    """images_per_row=2 as a maximum: rows of 0, 0, 2 and 1 images, 2 micro-batches (the first
    without any image). Step 1 takes Hugging Face's layout (the 3 real images), step 2 the slot
    layout with NaN in the unused slots: a padded slot reaching the loss or any gradient would
    make it NaN. Both equal eager AdamW on the whole batch given only the real images."""
    counts = [0, 0, 2, 1]
    torch.manual_seed(5)
    model = tiny_llava(vision_layers=2, text_layers=1)
    if frozen:
        model.model.vision_tower.requires_grad_(False)
    start = copy.deepcopy(model)
    batch = counted_batch(counts, 40, seed=6)
    trainer = megatrain.compile(model, seq_len=40, micro_batch_size=2, micro_batches=2, optimizer=ADAMW,
                                input_names=NAMES, images_per_row=2)
    assert trainer.graph.value_by_name("pixel_values").shape[0] == 4  # 2 slots x 2 rows, whatever the counts
    got = [trainer.step(batch).loss, trainer.step(in_slots(batch, counts, 2, float("nan"))).loss]
    trainer.flush()
    assert_trains_as_eager(model, start, got, batch, counts)
    if frozen:
        for (name, p), (_, q) in zip(model.named_parameters(), start.named_parameters()):
            assert not name.startswith("model.vision_tower.") or torch.equal(p, q), name


def test_place_images_puts_each_micro_batch_s_real_images_first_from_either_layout():
    from megatrain.planner.trace.vlm import place_images

    model = tiny_llava(vision_layers=1, text_layers=1)
    counts = [2, 0, 1, 1]
    hf = counted_batch(counts, 40, seed=7)
    img = hf["pixel_values"]
    zero = torch.zeros(3, 32, 32)
    # micro-batches of 2 rows: rows 0-1 (2 + 0 images), rows 2-3 (1 + 1): real images, then zeros
    want = torch.stack([img[0], img[1], zero, zero, img[2], img[3], zero, zero])
    for batch in (hf, in_slots(hf, counts, 2, 7.0)):
        assert torch.equal(place_images(model, batch, 2, 2)["pixel_values"], want)
    with pytest.raises(BatchError, match=r"holds 5 images, and its 4 rows' image tokens say 4: give one per real "
                                         r"image .*\[4, C, H, W\].* images_per_row=2 slots a row \(\[8, C, H, W\]"):
        place_images(model, dict(hf, pixel_values=torch.zeros(5, 3, 32, 32)), 2, 2)
    with pytest.raises(BatchError, match=r"row 0 holds the image tokens of 2 images, but the trainer was compiled "
                                         r"for at most images_per_row=1 .*images_per_row=2"):
        place_images(model, hf, 1, 2)
    cut = dict(hf, input_ids=hf["input_ids"].clone())
    cut["input_ids"][3, cut["input_ids"][3] == IMAGE_TOKEN] = 3
    cut["input_ids"][3, 4] = IMAGE_TOKEN
    with pytest.raises(BatchError, match=rf"row 3 holds 1 image tokens .* not a multiple of the {PATCHES} features"):
        place_images(model, cut, 2, 2)


def _dp_rank(rank: int, world: int, init_file: str, out: str) -> None:
    """One of ``world`` gloo ranks: its rows of a slot-layout global batch, cut as ``megatrain
    train`` cuts them (``_Ranks.rows``), 2 steps, its weights saved."""
    import datetime

    import torch.distributed as dist

    from megatrain.train.loop import _Ranks

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    torch.manual_seed(5)
    try:
        model = tiny_llava(vision_layers=2, text_layers=1)
        trainer = megatrain.compile(model, seq_len=40, micro_batch_size=2, optimizer=ADAMW, input_names=NAMES,
                                    images_per_row=2)
        batch = _Ranks(rank, world).rows(in_slots(counted_batch(DP_COUNTS, 40, seed=6), DP_COUNTS, 2, float("nan")))
        losses = [trainer.step(batch).loss for _ in range(2)]
        trainer.save(f"{out}.ckpt")  # flushes the last update
        torch.save({"losses": losses, "state": {n: p.detach().clone() for n, p in model.named_parameters()}},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


DP_COUNTS = [0, 0, 2, 1]  # rank 0's rows carry no image


def test_data_parallel_ranks_take_their_rows_with_their_image_slots_and_train_as_eager(tmp_path):
    """Two ranks split a slot-layout batch (rows of 0, 0, 2, 1 images, K=2, NaN in unused slots) by
    rows, each row's slots with it; together they equal eager AdamW on the whole batch's real images."""
    import torch.multiprocessing as mp

    mp.spawn(_dp_rank, args=(2, str(tmp_path / "init"), str(tmp_path / "rank")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank.{r}") for r in range(2)]
    assert ranks[0]["losses"] == ranks[1]["losses"]
    for n, t in ranks[0]["state"].items():
        assert torch.equal(t, ranks[1]["state"][n]), n
    torch.manual_seed(5)
    start = tiny_llava(vision_layers=2, text_layers=1)
    model = copy.deepcopy(start)
    model.load_state_dict(ranks[0]["state"], strict=False)
    assert_trains_as_eager(model, start, ranks[0]["losses"], counted_batch(DP_COUNTS, 40, seed=6), DP_COUNTS)
