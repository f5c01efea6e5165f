"""Qwen2-VL SFT data in ``megatrain train --task sft``: records with images read by the model's
processor (without its video processor), every image resized to the run's size so that all have
one patch grid; rows as the processor gives them, cut by rows for micro-batches and data-parallel
ranks, trained like eager; the bundled tiny Qwen2-VL fine-tuned from the command line.

The processor is the tiny one of examples/tiny_qwen2_vl_sft.py (4-pixel patches merged 2x2,
max_pixels 32x32); nothing is downloaded."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import megatrain
from megatrain.data import resolve_sft_data
from megatrain.data.sft import SftDataset, build_sft_store
from megatrain.data.sft_formats import RecordError
from megatrain.data.sft_images import ChatProcessor
from megatrain.data.sft_qwen_vl import image_grid, load_processor, run_image_size
from megatrain.examples.tiny_qwen2_vl_sft import config as tiny_config, write_processor

from test_exactness import ADAMW, RTOL, eager_losses

# Qwen2-VL with images needs a transformers whose vision tower takes its grid tensors precomputed
# (docs/vision-language.md; megatrain.planner.trace.qwen_vl refuses older ones). 5.4, the floor for
# text models, also cannot load a processor directory without a config.json that it saved itself.
vision_utils = pytest.importorskip("transformers.vision_utils", reason="an older transformers (5.4) computes "
                                   "Qwen2-VL's grid tensors inside its forward: megatrain refuses its images there")
if not hasattr(vision_utils, "get_vision_window_index"):
    pytest.skip("this transformers' Qwen2-VL computes its grid tensors inside the forward", allow_module_level=True)

EOT = "<|endoftext|>"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ANSWERS = ["Red.", "A blue one.", "Two squares.", "None.", "Green."]
SIZES = [(32, 32), (20, 24), (48, 40), (32, 32), (17, 50), (32, 16)]  # (width, height) of the PNGs


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    d = tmp_path_factory.mktemp("processor")
    write_processor(d)
    return load_processor(d, "qwen2_vl")


def _pngs(directory: Path) -> list[Path]:
    """Random RGB PNGs of :data:`SIZES`."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for i, size in enumerate(SIZES):
        pixels = np.random.default_rng(i).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        out.append(directory / f"{i}.png")
        Image.fromarray(pixels).save(out[-1])
    return out


def _records(path: Path, files: list[Path], k: int) -> list[list[dict]]:
    """A messages file of 5 records with ``k`` images each (record ``i``: files ``i .. i+k-1``),
    and each record's messages."""
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    chats = [[{"role": "user", "content": [{"type": "image", "path": str(files[(i + j) % len(files)])}
                                           for j in range(k)] + [text("Which shapes?")]},
              {"role": "assistant", "content": [text(a)]}] for i, a in enumerate(ANSWERS)]
    path.write_text("\n".join(json.dumps({"messages": c}) for c in chats) + "\n", encoding="utf-8")
    return chats


def _reference(processor, messages: list[dict], size: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The processor's own apply_chat_template on the chat with its images resized to ``size``
    (H, W) by Pillow (bicubic, the image processor's resampling): input_ids, assistant labels,
    pixel_values and image_grid_thw."""
    def resized(part):
        if part["type"] != "image":
            return part
        with Image.open(part["path"]) as im:
            return {"type": "image", "image": im.convert("RGB").resize(size[::-1], Image.Resampling.BICUBIC)}

    chat = [{**m, "content": [resized(p) for p in m["content"]]} for m in messages]
    out = processor.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                        return_tensors="pt")
    ids = out["input_ids"][0]
    return {"input_ids": ids, "labels": torch.where(out["assistant_masks"][0].bool(), ids, -100),
            "pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
            "mm_token_type_ids": out["mm_token_type_ids"][0]}


def test_the_run_image_size_gives_every_image_one_grid(tmp_path, processor):
    """The default size is the processor's for a 448x448 image (max_pixels 32x32: 32x32, 8x8
    patches); an explicit HxW is the size every image is resized to, whatever its own, and the
    processor's grid of it is the one every image then has (6 image tokens for 16x24)."""
    assert run_image_size(processor, None) == (32, 32)
    assert image_grid(processor, (32, 32)) == (1, 8, 8)
    assert run_image_size(processor, "16x24") == (16, 24)
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=1, image_size=(16, 24))
    files = _pngs(tmp_path)
    assert {chat.load(str(f)).size for f in files} == {(24, 16)}
    assert image_grid(processor, (16, 24)) == (1, 4, 6)
    assert {chat.image_tokens(str(f)) for f in files} == {6}


def _two_steps_equal_eager(kind, ds, chat, batches, grid, *, eager_micro_batches: int) -> None:
    """A tiny ``kind`` model compiled for ``grid`` (2 micro-batches of 1 row) takes ``batches``
    with the losses of eager AdamW (``eager_micro_batches`` even cuts of each batch), FP32 1e-5."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_config(kind))
    ref = copy.deepcopy(model)
    trainer = megatrain.compile(model, seq_len=96, micro_batch_size=1, micro_batches=2, optimizer=ADAMW,
                                input_names=ds.input_names, image_grid_thw=grid)
    got = [trainer.step(b).loss for b in batches]
    want = eager_losses(ref, [{**b, "mm_token_type_ids": (b["input_ids"] == chat.image_token_id).long()}
                              for b in batches], eager_micro_batches)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: megatrain {a} vs eager {b}"


@pytest.mark.parametrize("kind, k", [("qwen2_vl", 1), ("qwen2_vl", 2), ("qwen2_5_vl", 2)],
                         ids=["one-image", "two-images", "qwen2.5-two-images"])
def test_a_step_on_the_readers_batches_equals_eager_adamw(tmp_path, processor, kind, k):
    """Records with k images of different sizes each: a batch of the reader holds each row's
    tokens and assistant labels and, rows in order, its images resized to 32x32 as the processor's
    own apply_chat_template gives them (pixel_values [rows * k * 64 patches, 96], image_grid_thw
    [rows * k, 3]); two steps of megatrain.compile(image_grid_thw=k x (1, 8, 8)) on such batches
    (padded rows of different lengths, two micro-batches: the patches cut by rows) equal eager
    AdamW on the whole batch (FP32, 1e-5); a Qwen2.5-VL of the same sizes too (its processor's
    images are Qwen2-VL's)."""
    files = _pngs(tmp_path / "img")
    chats = _records(tmp_path / "data.jsonl", files, k)
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=k, image_size=(32, 32))
    store = build_sft_store(resolve_sft_data(str(tmp_path / "data.jsonl")), chat, tmp_path / "store", seq_len=96,
                            progress=False)
    ds = SftDataset(store, 96, packing=False, val_fraction=0.2, images=chat)  # 4 training rows
    assert ds.input_names == ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "labels")
    batches = [ds.rows([2 * s, 2 * s + 1]) for s in range(2)]
    for s, batch in enumerate(batches):
        refs = [_reference(processor, chats[ds.train_examples[r]], (32, 32)) for r in (2 * s, 2 * s + 1)]
        assert batch["pixel_values"].shape == (2 * k * 64, 96)
        for name in ("pixel_values", "image_grid_thw"):
            assert torch.equal(batch[name], torch.cat([ref[name] for ref in refs]))
        for r, ref in enumerate(refs):
            n = int(batch["attention_mask"][r].sum())
            assert torch.equal(batch["input_ids"][r, :n], ref["input_ids"])
            assert torch.equal(batch["labels"][r, :n], ref["labels"])
            # The batch leaves out the processor's token types: the trainer makes them from the image tokens.
            assert torch.equal((batch["input_ids"][r, :n] == chat.image_token_id).long(), ref["mm_token_type_ids"])
    lengths = batches[0]["attention_mask"].sum(1)
    assert lengths[0] != lengths[1]  # the padding is masked, not just absent
    _two_steps_equal_eager(kind, ds, chat, batches, [(1, 8, 8)] * k, eager_micro_batches=2)


def test_data_parallel_ranks_take_their_rows_patches_and_grids(tmp_path, processor):
    """The data-parallel split of a global batch of 4 rows of 2 images over 2 ranks: each rank
    gets its 2 rows and exactly their images' patch blocks and grids (what the reader gives for
    those rows alone); LLaVA's layout of k images a row is cut the same way."""
    from megatrain.train.loop import _Ranks

    files = _pngs(tmp_path / "img")
    _records(tmp_path / "data.jsonl", files, 2)
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=2, image_size=(32, 16))
    store = build_sft_store(resolve_sft_data(str(tmp_path / "data.jsonl")), chat, tmp_path / "store", seq_len=96,
                            progress=False)
    ds = SftDataset(store, 96, packing=False, val_fraction=0.2, images=chat)
    batch = ds.rows([0, 1, 2, 3])
    assert batch["pixel_values"].shape == (4 * 2 * 32, 96)  # 8x4 patches an image
    for rank in range(2):
        got = _Ranks(rank=rank, world=2).rows(batch)
        want = ds.rows([2 * rank, 2 * rank + 1])
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    # Native sizes (rows of 2, 0, 1 and 2 images of their own grids): cut by each row's own images.
    native = ChatProcessor(processor, None, eos_token=EOT, images_per_example=2, max_pixels=512)
    _native_records(tmp_path / "native.jsonl", files)
    store = build_sft_store(resolve_sft_data(str(tmp_path / "native.jsonl")), native, tmp_path / "native-store",
                            seq_len=96, progress=False)
    ds = SftDataset(store, 96, packing=False, val_fraction=0.2, images=native)
    batch = ds.rows([0, 1, 2, 3])
    assert len({int(batch["pixel_values"].shape[0]) // 2, int(ds.rows([0, 1])["pixel_values"].shape[0])}) == 2
    for rank in range(2):
        got = _Ranks(rank=rank, world=2).rows(batch, tiny_config("qwen2_vl"))
        want = ds.rows([2 * rank, 2 * rank + 1])
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    llava = {"input_ids": torch.arange(4)[:, None].expand(4, 8), "pixel_values": torch.arange(8.0)[:, None]}
    assert torch.equal(_Ranks(rank=1, world=2).rows(llava)["pixel_values"], torch.tensor([[4.0], [5.0], [6.0], [7.0]]))


def _native_records(path: Path, files: list[Path]) -> list[list[dict]]:
    """5 records with 2, 0, 1, 2 and 1 images of the PNGs' own sizes."""
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    picks = [[1, 2], [], [4], [5, 0], [2]]
    chats = [[{"role": "user", "content": [{"type": "image", "path": str(files[j])} for j in pick]
               + [text("Which shapes?")]}, {"role": "assistant", "content": [text(a)]}]
             for pick, a in zip(picks, ANSWERS)]
    path.write_text("\n".join(json.dumps({"messages": c}) for c in chats) + "\n", encoding="utf-8")
    return chats


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_native_sizes_give_each_image_its_own_grid_and_train_like_eager(tmp_path, processor, kind):
    """image_max_pixels (ChatProcessor(max_pixels=...)): each image keeps its size and aspect, as
    the processor's own apply_chat_template gives it with size["longest_edge"] = 512 (a 48x40 image
    to 4x6 patches; a 32x16 one, 512 pixels, stays 4x8), records of 0 to 2 images; two steps of
    megatrain.compile(image_grid_thw=2 x native_grid) on such batches (rows of different patches
    and image counts, two micro-batches) equal eager AdamW on the whole batch (FP32, 1e-5)."""
    from megatrain.data.sft_qwen_vl import native_grid

    files = _pngs(tmp_path / "img")
    chats = _native_records(tmp_path / "data.jsonl", files)
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=2, max_pixels=512)
    assert native_grid(processor, 512) == (1, 2, 16)  # 512 // 8**2 = 8 merge windows of 2x2 patches
    store = build_sft_store(resolve_sft_data(str(tmp_path / "data.jsonl")), chat, tmp_path / "store", seq_len=96,
                            progress=False)
    ds = SftDataset(store, 96, packing=False, val_fraction=0.2, images=chat)  # 4 training rows
    ref_proc = copy.deepcopy(processor)
    ref_proc.image_processor.size = {"longest_edge": 512, "shortest_edge": 64}

    def reference(messages):
        def own(part):
            if part["type"] != "image":
                return part
            with Image.open(part["path"]) as im:
                return {"type": "image", "image": im.convert("RGB")}

        out = ref_proc.apply_chat_template([{**m, "content": [own(q) for q in m["content"]]} for m in messages],
                                           tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                           return_tensors="pt")
        return out

    batches = [ds.rows([2 * s, 2 * s + 1]) for s in range(2)]
    grids = []
    for s, batch in enumerate(batches):
        refs = [reference(chats[ds.train_examples[r]]) for r in (2 * s, 2 * s + 1)]
        for r, ref in enumerate(refs):
            n = int(batch["attention_mask"][r].sum())
            assert torch.equal(batch["input_ids"][r, :n], ref["input_ids"][0])
        with_images = [ref for ref in refs if "image_grid_thw" in ref]
        for name in ("pixel_values", "image_grid_thw"):
            want = torch.cat([ref[name] for ref in with_images]) if with_images else batch[name][:0]
            assert torch.equal(batch[name], want), name
        grids += batch["image_grid_thw"].tolist()
    assert all(h * w * 16 <= 512 for _, h, w in grids) and len({tuple(g) for g in grids}) > 2
    sizes = {SIZES[i]: i for i in range(len(SIZES))}
    assert chat.image_tokens(str(files[sizes[(48, 40)]])) == 4 * 6 // 4
    assert chat.image_tokens(str(files[sizes[(32, 16)]])) == 4 * 8 // 4
    counts = [int((b["input_ids"] == chat.image_token_id).sum(1).gt(0).sum()) for b in batches]
    assert sum(counts) < 4  # a row without images among them
    # Eager on each whole batch at once (its rows' patches differ: no even cut into micro-batches).
    _two_steps_equal_eager(kind, ds, chat, batches, [native_grid(processor, 512)] * 2, eager_micro_batches=1)


def test_a_native_size_batch_of_text_rows_only_trains_like_eager(tmp_path, processor):
    """With image_max_pixels a batch may hold no image at all: its rows give pixel_values [0, 96]
    and image_grid_thw [0, 3], the compiled model takes it, and its step's loss is eager's on the
    text alone."""
    from transformers import AutoModelForImageTextToText

    from megatrain.data.sft_qwen_vl import native_grid

    files = _pngs(tmp_path / "img")
    chats = _native_records(tmp_path / "data.jsonl", files)
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=2, max_pixels=512)
    store = build_sft_store(resolve_sft_data(str(tmp_path / "data.jsonl")), chat, tmp_path / "store", seq_len=96,
                            progress=False)
    ds = SftDataset(store, 96, packing=False, val_fraction=0.2, images=chat)
    text_only = [r for r in range(ds.num_train_rows) if not any(p["type"] == "image" for m in
                                                               chats[ds.train_examples[r]] for p in m["content"])]
    batch = ds.rows(text_only[:1] * 2)
    assert batch["pixel_values"].shape == (0, 96) and batch["image_grid_thw"].shape == (0, 3)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_config("qwen2_vl"))
    ref = copy.deepcopy(model)
    trainer = megatrain.compile(model, seq_len=96, micro_batch_size=1, micro_batches=2, optimizer=ADAMW,
                                input_names=ds.input_names, image_grid_thw=[native_grid(processor, 512)] * 2)
    got = trainer.step(batch).loss
    text = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    (want,) = eager_losses(ref, [text], 1)
    assert abs(got - want) <= RTOL * abs(want), (got, want)


def test_native_images_over_the_row_budget_are_refused_naming_them(tmp_path, processor):
    """An image that smart_resize keeps one merge window high but scales to more than the budget
    (an aspect ratio of 150 under 512 pixels) is refused when the store is built, naming it."""
    wide = tmp_path / "wide.png"
    Image.fromarray(np.zeros((8, 1200, 3), dtype=np.uint8)).save(wide)
    chats = [[{"role": "user", "content": [{"type": "image", "path": str(wide)}, {"type": "text", "text": "?"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "A line."}]}]]
    (tmp_path / "data.jsonl").write_text(json.dumps({"messages": chats[0]}) + "\n")
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=1, max_pixels=512)
    with pytest.raises(RecordError, match=r"the example's images fill \d+ image tokens .*wide.png.*more than the 8 of "
                                          r"1 image\(s\) of at most 512 pixels"):
        build_sft_store(resolve_sft_data(str(tmp_path / "data.jsonl")), chat, tmp_path / "store", seq_len=400,
                        progress=False)


def test_a_record_with_another_image_count_is_an_error_naming_it(tmp_path, processor):
    files = _pngs(tmp_path / "img")
    _records(tmp_path / "data.jsonl", files, 1)
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=2, image_size=(32, 32))
    with pytest.raises(RecordError) as e:
        build_sft_store(resolve_sft_data(str(tmp_path / "data.jsonl")), chat, tmp_path / "store", seq_len=96,
                        progress=False)
    assert f"{str(tmp_path / 'data.jsonl')!r}, record 1 (line 1): the example has 1 image(s), and the run takes 2" \
        in str(e.value)


def test_megatrain_train_keeps_native_image_sizes_with_image_max_pixels(tmp_path, capsys):
    """--image-max-pixels 512 --images-per-row 2: records of 0 to 2 images of their own sizes train
    (the data line says so); with --image-size too, or for a text
    model, the run is refused naming the setting (exit 2, before anything is built)."""
    from megatrain.cli import main

    files = _pngs(tmp_path / "img")
    _native_records(tmp_path / "data.jsonl", files)
    out = tmp_path / "run"
    args = ["train", "--task", "sft", "--model", str(EXAMPLES / "tiny-qwen2-vl"), "--data",
            str(tmp_path / "data.jsonl"), "--output-dir", str(out), "--seq-len", "96", "--global-batch", "2",
            "--micro-batch-size", "1", "--val-fraction", "0.2", "--max-steps", "2", "--warmup-steps", "0",
            "--eval-interval", "0", "--images-per-row", "2", "--image-max-pixels", "512"]
    assert main(args) == 0
    log = capsys.readouterr().out
    assert "up to 2 images (each at its own size, up to 512 pixels) a row" in log, log
    assert "each at its own size, up to 512 pixels" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    assert main(args[:-4] + ["--output-dir", str(tmp_path / "b"), "--image-max-pixels", "512", "--image-size",
                             "32x32"]) == 2
    assert "give one of them" in capsys.readouterr().err
    text = ["train", "--task", "sft", "--model", str(EXAMPLES / "tiny_llama_rl.json"), "--data",
            str(EXAMPLES / "data" / "alpaca_demo.json"), "--output-dir", str(tmp_path / "c"), "--seq-len", "64",
            "--global-batch", "2", "--micro-batch-size", "1", "--max-steps", "1", "--warmup-steps", "0",
            "--image-max-pixels", "512"]
    assert main(text) == 2
    assert "image_max_pixels=512: model_type 'llama' takes no image sizes" in capsys.readouterr().err
    assert not (tmp_path / "c" / "checkpoint").exists()


def test_megatrain_train_fine_tunes_the_bundled_qwen2_vl_on_images(tmp_path, capsys):
    """docs/vision-language.md's command, 2 steps: the data line says the images' size; the checkpoint loads
    with AutoModelForImageTextToText, its processor (saved as a Qwen2VLProcessor) with
    load_processor, and it generates from an image."""
    from transformers import AutoModelForImageTextToText

    from megatrain.cli import main

    out = tmp_path / "run"
    assert main(["train", "--task", "sft", "--model", str(EXAMPLES / "tiny-qwen2-vl"), "--data",
                 str(EXAMPLES / "data" / "vlm_sft" / "shapes.json"), "--output-dir", str(out), "--seq-len", "96",
                 "--global-batch", "4", "--micro-batch-size", "2", "--val-fraction", "0.2", "--max-steps", "2",
                 "--warmup-steps", "0", "--eval-interval", "0"]) == 0
    log = capsys.readouterr().out
    assert "12 images, one example and its image a row" in log and "resized to 32x32" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    ckpt = out / "checkpoint"
    saved = json.loads((ckpt / "processor_config.json").read_text())
    assert saved["processor_class"] == "Qwen2VLProcessor"
    video = saved["video_processor"]  # for AutoProcessor with torchvision: the image processor's settings
    assert (video["video_processor_type"], video["patch_size"], video["merge_size"]) == ("Qwen2VLVideoProcessor", 4, 2)
    model = AutoModelForImageTextToText.from_pretrained(ckpt)
    proc = load_processor(ckpt, "qwen2_vl")
    messages = [{"role": "user", "content": [
        {"type": "image", "path": str(EXAMPLES / "data" / "vlm_sft" / "images" / "red_square.png")},
        {"type": "text", "text": "What shape is in the picture?"}]}]
    inputs = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    out = model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 2)


def test_image_size_is_qwen2_vls_and_planned_with_the_run(tmp_path):
    """megatrain train plans a Qwen2-VL run with the grid of its image size (megatrain plan
    --config the same: plan_request); image_size is refused for LLaVA and text models, and is HxW."""
    from types import SimpleNamespace

    from megatrain.errors import ConfigError
    from megatrain.examples.tiny_llava_sft import llava_config
    from megatrain.train.config import TrainConfig, load_train_config
    from megatrain.train.corpus import image_grid_thw
    from megatrain.train.loop import batch_names, plan_request
    from megatrain.train.model import resolve_model

    source = resolve_model(str(EXAMPLES / "tiny-qwen2-vl"))
    cfg = TrainConfig(model=str(EXAMPLES / "tiny-qwen2-vl"), output_dir=str(tmp_path / "run"), task="sft",
                      images_per_row=2, image_size="16x24")
    assert image_grid_thw(cfg, source) == ((1, 4, 6), (1, 4, 6))
    request = plan_request(cfg, SimpleNamespace(config=source.config), None, None, image_grid_thw(cfg, source))
    assert request.image_grid_thw == ((1, 4, 6), (1, 4, 6)) and request.images_per_row == 1
    assert image_grid_thw(cfg.model_copy(update={"image_size": None, "images_per_row": 1}), source) == ((1, 8, 8),)
    for config in (llava_config(), llava_config().text_config):
        with pytest.raises(ConfigError, match=r"image_size=16x24: model_type '(llava|llama)' takes no image size.*"
                                              r"drop --image-size"):
            batch_names(cfg.model_copy(update={"images_per_row": 1}), config)
    with pytest.raises(ConfigError, match=r"image_size"):
        load_train_config(None, {"model": str(tmp_path), "output_dir": str(tmp_path / "run"), "image_size": "448"})
    with pytest.raises(ConfigError, match=r"image_size 8x2000: the processor refuses images of that size.*"
                                          r"aspect ratio.*--image-size"):
        image_grid_thw(cfg.model_copy(update={"image_size": "8x2000"}), source)
    # Native sizes: the run is traced for images_per_row images of the most patches N pixels give.
    native = cfg.model_copy(update={"image_size": None, "image_max_pixels": 1024})
    assert image_grid_thw(native, source) == ((1, 2, 32), (1, 2, 32))  # 1024 // 8**2 = 16 windows of 2x2
    with pytest.raises(ConfigError, match=r"image_max_pixels=63: the processor makes every image at least one "
                                          r"8x8-pixel merge window"):
        image_grid_thw(native.model_copy(update={"image_max_pixels": 63}), source)


def test_a_processor_of_another_patch_size_is_refused_before_training(tmp_path):
    """A processor of 8-pixel patches gives a 32x32 image a 4x4 grid of 384-feature patches where
    the tiny Qwen2-VL's patch embedding takes 96 features: refused, naming the shapes and what to
    change, before the first step."""
    from transformers import AutoModelForImageTextToText

    from megatrain.errors import ConfigError
    from megatrain.train.loop import _check_processor

    write_processor(tmp_path / "p")
    config = json.loads((tmp_path / "p" / "processor_config.json").read_text())
    config["image_processor"]["patch_size"] = 8
    (tmp_path / "p" / "processor_config.json").write_text(json.dumps(config))
    processor = load_processor(tmp_path / "p", "qwen2_vl")
    grid = image_grid(processor, (32, 32))
    assert grid == (1, 4, 4)
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=1, image_size=(32, 32))
    store = build_sft_store(resolve_sft_data(str(EXAMPLES / "data" / "vlm_sft" / "shapes.json")), chat,
                            tmp_path / "store", seq_len=96, progress=False)
    ds = SftDataset(store, 96, packing=False, val_fraction=0.2, images=chat)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(tiny_config())
    with pytest.raises(ConfigError, match=r"Qwen2VLProcessorImagesOnly\) does not fit the model: .*pixel_values'\] "
                                          r"has shape \(16, 384\).*\[16, 96\].*Use the model's own processor"):
        _check_processor(model, ds, chat, [grid])


def test_the_processor_keeps_its_directorys_video_processor_settings(tmp_path):
    """A processor directory's video processor settings (nested in processor_config.json, or an
    older video_preprocessor_config.json) are saved again as they were, not replaced by the image
    processor's."""
    write_processor(tmp_path / "p")
    config = json.loads((tmp_path / "p" / "processor_config.json").read_text())
    video = {**config["video_processor"], "max_frames": 8}
    (tmp_path / "p" / "processor_config.json").write_text(json.dumps({**config, "video_processor": video}))
    load_processor(tmp_path / "p", "qwen2_5_vl").save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "processor_config.json").read_text())
    assert saved["video_processor"] == video and saved["processor_class"] == "Qwen2_5_VLProcessor"
    del config["video_processor"]
    (tmp_path / "p" / "processor_config.json").write_text(json.dumps(config))
    (tmp_path / "p" / "video_preprocessor_config.json").write_text(json.dumps(video))
    assert load_processor(tmp_path / "p", "qwen2_vl").video_config == video


def test_the_bundled_tiny_qwen2_vl_is_what_its_script_writes(tmp_path):
    """examples/tiny-qwen2-vl holds the files tiny_qwen2_vl_sft.py writes (config, tokenizer,
    processor and chat template), byte for byte but for the transformers release config.json names
    (``"transformers_version"``: the one that wrote the bundled copy, the lock's)."""
    write_processor(tmp_path)
    tiny_config().to_json_file(tmp_path / "config.json")
    bundled = EXAMPLES / "tiny-qwen2-vl"
    assert sorted(p.name for p in bundled.iterdir()) == sorted(p.name for p in tmp_path.iterdir())
    release = re.compile(rb'\n *"transformers_version": "[^"]*",?')
    for p in bundled.iterdir():
        assert release.sub(b"", p.read_bytes()) == release.sub(b"", (tmp_path / p.name).read_bytes()), p.name
