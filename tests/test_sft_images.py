"""SFT data with images: sharegpt/messages records read by a vision-language model's processor,
rows carrying pixel_values, trained like eager, and ``megatrain train --task sft`` on a tiny LLaVA.

The processor is a tiny LlavaProcessor built here (a byte-level BPE with ``<image>``, a CLIP
image processor to 32x32: examples/tiny_llava_sft.py); nothing is downloaded."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import megatrain
from megatrain.data import resolve_sft_data
from megatrain.data.sft import SftDataset, build_sft_store
from megatrain.data.sft_formats import RecordError
from megatrain.data.sft_images import ChatProcessor
from megatrain.examples.tiny_llava_sft import llava_config, write_processor

from test_exactness import ADAMW, RTOL, eager_losses

EOT = "<|endoftext|>"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    from transformers import AutoProcessor

    d = tmp_path_factory.mktemp("processor")
    write_processor(d)
    return AutoProcessor.from_pretrained(d)


def _png(path: Path, size: tuple[int, int], seed: int, mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).convert(mode).save(path)


def _write(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def _reference(processor, messages: list[dict]) -> dict[str, torch.Tensor]:
    """input_ids, labels and pixel_values as the processor's own apply_chat_template gives them
    (its image loading, token expansion and assistant mask): labels are the assistant's tokens."""
    out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                        return_tensors="pt")
    ids = out["input_ids"][0]
    labels = torch.where(out["assistant_masks"][0].bool(), ids, -100)
    return {"input_ids": ids, "labels": labels, **{k: out[k] for k in ("pixel_values",) if k in out}}  # none: text only


@pytest.mark.parametrize("markers", [True, False], ids=["generation-markers", "prefix-differences"])
def test_rows_hold_the_processors_tokens_pixels_and_assistant_labels(tmp_path, processor, markers):
    """A LLaMA-Factory registry's sharegpt entry (images relative to its directory) and a messages
    file (images relative to the file, or a part's own path) give, per example, the input_ids,
    pixel_values and assistant-only labels of the processor's own apply_chat_template."""
    data = tmp_path / "data"
    _png(data / "img" / "a.png", (20, 24), 0)
    _png(data / "img" / "b.png", (48, 40), 1, mode="L")  # grey: converted to RGB like transformers' load_image
    _png(data / "more" / "img" / "c.png", (32, 32), 2)
    _write(data / "sub" / "chat.json", [
        {"conversations": [{"from": "human", "value": "<image>What is this?"}, {"from": "gpt", "value": "Noise."},
                           {"from": "human", "value": "And again?"}, {"from": "gpt", "value": "Still noise."}],
         "images": ["img/a.png"]},
        {"conversations": [{"from": "human", "value": "Look: <image> here"}, {"from": "gpt", "value": "Grey."}],
         "images": ["img/b.png"]}])
    (data / "dataset_info.json").write_text(json.dumps({"chat": {
        "file_name": "sub/chat.json", "formatting": "sharegpt", "columns": {"messages": "conversations",
                                                                            "images": "images"}}}))
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    _write(data / "more" / "messages.jsonl", [
        {"messages": [{"role": "user", "content": [text("Which?"), {"type": "image"}]},
                      {"role": "assistant", "content": [text("That one.")]}], "images": ["img/c.png"]},
        {"messages": [{"role": "user", "content": [{"type": "image", "path": "img/c.png"}, text("Again?")]},
                      {"role": "assistant", "content": [text("Yes.")]}]}])
    image = lambda p: {"type": "image", "path": str(p)}  # noqa: E731
    want = [
        [{"role": "user", "content": [image(data / "img/a.png"), text("What is this?")]},
         {"role": "assistant", "content": [text("Noise.")]}, {"role": "user", "content": [text("And again?")]},
         {"role": "assistant", "content": [text("Still noise.")]}],
        [{"role": "user", "content": [text("Look: "), image(data / "img/b.png"), text(" here")]},
         {"role": "assistant", "content": [text("Grey.")]}],
        [{"role": "user", "content": [text("Which?"), image(data / "more/img/c.png")]},
         {"role": "assistant", "content": [text("That one.")]}],
        [{"role": "user", "content": [image(data / "more/img/c.png"), text("Again?")]},
         {"role": "assistant", "content": [text("Yes.")]}]]
    refs = [_reference(processor, m) for m in want]
    template = processor.chat_template if markers else \
        processor.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    chat = ChatProcessor(processor, template, eos_token=EOT, images_per_example=1)
    assert chat.markers is markers
    sources = resolve_sft_data(f"chat@{data}") + resolve_sft_data(str(data / "more" / "messages.jsonl"))
    store = build_sft_store(sources, chat, tmp_path / "store", seq_len=128, progress=False)
    assert store.manifest.num_images == 4
    ds = SftDataset(store, 128, packing=False, val_fraction=0.25, images=chat)
    assert ds.input_names == ("input_ids", "attention_mask", "pixel_values", "labels")
    matched = []
    for split, rows in (("train", ds.num_train_rows), ("val", ds.num_val_rows)):
        batch = ds.rows(range(rows), split)
        assert batch["pixel_values"].shape == (rows, 3, 32, 32)
        for r in range(rows):
            n = int(batch["attention_mask"][r].sum())
            k = next(i for i, ref in enumerate(refs) if torch.equal(batch["input_ids"][r, :n], ref["input_ids"]))
            matched.append(k)
            assert torch.equal(batch["labels"][r, :n], refs[k]["labels"])
            assert (batch["labels"][r, n:] == -100).all() and (batch["input_ids"][r, n:] == 0).all()
            assert torch.equal(batch["pixel_values"][r:r + 1], refs[k]["pixel_values"])
    assert sorted(matched) == [0, 1, 2, 3]
    assert all(int((ref["input_ids"] == chat.image_token_id).sum()) == 16 for ref in refs)  # 4x4 patches each


ANSWERS = ["Red.", "A blue one.", "Two squares.", "None.", "Green."]


def _shapes_messages(path: Path, k: int | list[int]) -> tuple[Path, list[list[dict]]]:
    """A messages file of 5 records with ``k`` of the bundled shape images each (or ``k[i]`` in
    record ``i``; its images ``i .. i+k-1`` of the six, in that order; answers of different
    lengths), and each record's messages."""
    files = sorted((EXAMPLES / "data" / "vlm_sft" / "images").glob("*.png"))
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    counts = k if isinstance(k, list) else [k] * len(ANSWERS)
    chats = [[{"role": "user", "content": [{"type": "image", "path": str(files[(i + j) % len(files)])}
                                           for j in range(counts[i])] + [text("Which shapes?")]},
              {"role": "assistant", "content": [text(a)]}] for i, a in enumerate(ANSWERS)]
    return _write(path, [{"messages": c} for c in chats]), chats


@pytest.mark.parametrize("k", [1, 2], ids=["one-image", "two-images"])
def test_a_step_on_the_readers_batches_equals_eager_adamw(tmp_path, processor, k):
    """Records with k images each: a batch of the reader holds each row's tokens and assistant
    labels and, rows in order, their images (pixel_values [rows * k, 3, 32, 32]) as the processor's
    own apply_chat_template gives them; two steps of megatrain.compile(images_per_row=k) on such
    batches (padded rows of different lengths, two micro-batches) equal eager AdamW (FP32, 1e-5)."""
    from transformers import LlavaForConditionalGeneration

    path, chats = _shapes_messages(tmp_path / "data.jsonl", k)
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=k)
    store = build_sft_store(resolve_sft_data(str(path)), chat, tmp_path / "store", seq_len=96, progress=False)
    assert store.manifest.num_images == 5 * k
    ds = SftDataset(store, 96, packing=False, val_fraction=0.2, images=chat)  # 4 training rows
    batches = [ds.rows([2 * s, 2 * s + 1]) for s in range(2)]
    for s, batch in enumerate(batches):
        refs = [_reference(processor, chats[ds.train_examples[r]]) for r in (2 * s, 2 * s + 1)]
        assert batch["pixel_values"].shape == (2 * k, 3, 32, 32)
        assert torch.equal(batch["pixel_values"], torch.cat([ref["pixel_values"] for ref in refs]))
        for r, ref in enumerate(refs):
            n = int(batch["attention_mask"][r].sum())
            assert torch.equal(batch["input_ids"][r, :n], ref["input_ids"])
            assert torch.equal(batch["labels"][r, :n], ref["labels"])
    lengths = batches[0]["attention_mask"].sum(1)
    assert lengths[0] != lengths[1]  # the padding is masked, not just absent
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(llava_config())
    ref = copy.deepcopy(model)
    trainer = megatrain.compile(model, seq_len=96, micro_batch_size=1, micro_batches=2, optimizer=ADAMW,
                                input_names=ds.input_names, images_per_row=k)
    got = [trainer.step(b).loss for b in batches]
    want = eager_losses(ref, batches, 2)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: megatrain {a} vs eager {b}"


def test_records_with_0_to_k_images_fill_k_slots_a_row_and_train_as_eager(tmp_path, processor):
    """images_per_row=2 as a maximum: records of 0, 1, 2, 0 and 2 images. A batch of the reader
    holds each row's tokens and labels as the processor's own apply_chat_template gives them and
    its images in 2 slots a row (pixel_values [rows * 2, 3, 32, 32]: the processor's pixels, then
    zeros); the losses of two steps of megatrain.compile(images_per_row=2) on it equal eager AdamW's
    on the whole batch given only the real images (FP32, 1e-5; weights: tests/test_vlm.py)."""
    from transformers import LlavaForConditionalGeneration

    from test_vlm import eager_trained

    counts = [0, 1, 2, 0, 2]
    path, chats = _shapes_messages(tmp_path / "data.jsonl", counts)
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=2)
    store = build_sft_store(resolve_sft_data(str(path)), chat, tmp_path / "store", seq_len=96, progress=False)
    assert store.manifest.num_images == sum(counts)
    ds = SftDataset(store, 96, packing=False, val_fraction=0.2, images=chat)  # 4 training rows
    batch = ds.rows(range(4))
    assert batch["pixel_values"].shape == (8, 3, 32, 32)
    real, row_counts = [], []
    for r in range(4):
        ref = _reference(processor, chats[ds.train_examples[r]])
        n = int(batch["attention_mask"][r].sum())
        assert torch.equal(batch["input_ids"][r, :n], ref["input_ids"])
        assert torch.equal(batch["labels"][r, :n], ref["labels"])
        images = ref.get("pixel_values", torch.zeros(0, 3, 32, 32))
        assert torch.equal(batch["pixel_values"][2 * r:2 * r + len(images)], images)
        assert not batch["pixel_values"][2 * r + len(images):2 * r + 2].any()
        real.append(images)
        row_counts.append(len(images))
    assert 0 in row_counts and 2 in row_counts, row_counts
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(llava_config())
    start = copy.deepcopy(model)
    trainer = megatrain.compile(model, seq_len=96, micro_batch_size=2, micro_batches=2, optimizer=ADAMW,
                                input_names=ds.input_names, images_per_row=2)
    got = [trainer.step(batch).loss for _ in range(2)]
    trainer.flush()
    _, want = eager_trained(start, dict(batch, pixel_values=torch.cat(real)), row_counts, 2)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: megatrain {a} vs eager {b}"


def test_a_store_built_for_one_image_per_row_is_not_reused_for_two(tmp_path, processor):
    """The SFT store's key holds the most images a row takes: the store built for one image a
    row is rebuilt, not reused, for two; a record with more images than the run takes is refused,
    naming the record, its count, the run's and --images-per-row."""
    from megatrain.data import cached_sft_store

    path, _ = _shapes_messages(tmp_path / "data.jsonl", 1)
    sources = resolve_sft_data(str(path))
    for k, origin in ((1, "built"), (1, "reused"), (2, "rebuilt (options changed)")):
        chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=k)
        assert cached_sft_store(sources, chat, tmp_path / "store", seq_len=96, progress=False).origin == origin
    path, _ = _shapes_messages(tmp_path / "two.jsonl", 2)
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=1)
    with pytest.raises(RecordError) as e:
        cached_sft_store(resolve_sft_data(str(path)), chat, tmp_path / "store2", seq_len=96, progress=False)
    assert (f"{str(path)!r}, record 1 (line 1): the example has 2 images, and the run takes at most 1 per row"
            in str(e.value))
    assert "set --images-per-row 2" in str(e.value)


@pytest.mark.parametrize("record, message", [
    ({"conversations": [{"from": "human", "value": "<image>Hi"}, {"from": "gpt", "value": "Ok."}],
      "images": ["img/missing.png"]}, "image file '{data}/img/missing.png' does not exist"),
    ({"conversations": [{"from": "human", "value": "<image>Hi"}, {"from": "gpt", "value": "Ok."}],
      "images": ["img/broken.png"]}, "image file '{data}/img/broken.png' cannot be read by Pillow"),
    ({"conversations": [{"from": "human", "value": "<image><image>Hi"}, {"from": "gpt", "value": "Ok."}],
      "images": ["img/a.png"]}, "2 image placeholder(s) <image> and 1 file(s) in field 'images'"),
    ({"conversations": [{"from": "human", "value": "<image><image>Hi"}, {"from": "gpt", "value": "Ok."}],
      "images": ["img/a.png", "img/a.png"]}, "has 2 images, and the run takes at most 1 per row"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "url": "http://x/y.png"}]},
                   {"role": "assistant", "content": "Ok."}]}, "image part without a local file"),
], ids=["missing", "unreadable", "placeholders", "too-many", "url"])
def test_a_bad_image_record_is_an_error_naming_the_file_and_record(tmp_path, processor, record, message):
    data = tmp_path / "data"
    _png(data / "img" / "a.png", (32, 32), 0)
    (data / "img" / "broken.png").write_bytes(b"not a png")
    good = {"conversations": [{"from": "human", "value": "<image>Hi"}, {"from": "gpt", "value": "Ok."}],
            "images": ["img/a.png"]}
    if "messages" in record:  # a file's first record decides its format
        good = {"messages": [{"role": "user", "content": [{"type": "image", "path": "img/a.png"}]},
                             {"role": "assistant", "content": "Ok."}]}
    path = _write(data / "d.jsonl", [good, record])
    chat = ChatProcessor(processor, None, eos_token=EOT, images_per_example=1)
    with pytest.raises(RecordError) as e:
        build_sft_store(resolve_sft_data(str(path)), chat, tmp_path / "store", seq_len=128, progress=False)
    assert f"{str(path)!r}, record 2 (line 2)" in str(e.value)
    assert message.format(data=data) in str(e.value)


def test_megatrain_train_fine_tunes_the_bundled_llava_on_images(tmp_path, capsys, monkeypatch):
    """docs/vision-language.md's command, 2 steps, with 4 text-only records beside the bundled images' 12 (0 or
    1 image a row under the default --images-per-row 1): the data line counts the images, the
    checkpoint loads with AutoModelForImageTextToText and AutoProcessor and generates from an image."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from megatrain.cli import main

    text = _write(tmp_path / "text.jsonl", [{"conversations": [{"from": "human", "value": f"Say {w}."},
                                                                {"from": "gpt", "value": w}]}
                                            for w in ("red", "blue", "green", "yellow")])
    import megatrain.planner.trace.vlm as vlm
    from megatrain.planner.trace.vlm import image_counts, place_images

    counts = []  # images of each row stepped
    monkeypatch.setattr(vlm, "place_images", lambda model, batch, *a: (
        counts.extend(image_counts(model, batch["input_ids"]).tolist()), place_images(model, batch, *a))[1])
    out = tmp_path / "run"
    assert main(["train", "--task", "sft", "--model", str(EXAMPLES / "tiny-llava"), "--data",
                 f"{EXAMPLES / 'data' / 'vlm_sft' / 'shapes.json'},{text}", "--output-dir", str(out), "--seq-len", "96",
                 "--global-batch", "4", "--micro-batch-size", "2", "--val-fraction", "0.2", "--max-steps", "2",
                 "--warmup-steps", "0", "--eval-interval", "0"]) == 0
    log = capsys.readouterr().out
    assert "16 SFT examples" in log
    assert 0 in counts and 1 in counts, counts  # text-only rows and rows with an image were trained
    assert "12 images, one example and up to one image a row (image examples are not packed)" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    model = AutoModelForImageTextToText.from_pretrained(out / "checkpoint")
    proc = AutoProcessor.from_pretrained(out / "checkpoint")
    messages = [{"role": "user", "content": [
        {"type": "image", "path": str(EXAMPLES / "data" / "vlm_sft" / "images" / "red_square.png")},
        {"type": "text", "text": "What shape is in the picture?"}]}]
    inputs = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 2)


def test_a_vision_language_config_needs_image_sft_data_and_a_processor(tmp_path):
    """megatrain train takes a bare LLaVA config.json, and then says what is missing: its
    processor (for task sft) or SFT data with images (for task lm); images_per_row above 1 is
    LLaVA's alone, and below 1 is no count."""
    from megatrain.errors import ConfigError
    from megatrain.train.config import TrainConfig, load_train_config
    from megatrain.train.corpus import prepare_data
    from megatrain.train.loop import batch_names, plan_request
    from megatrain.train.model import resolve_model

    path = tmp_path / "config.json"
    llava_config().to_json_file(path)
    source = resolve_model(str(path))
    cfg = TrainConfig(model=str(path), output_dir=str(tmp_path / "run"), task="sft",
                      data=str(EXAMPLES / "data" / "vlm_sft" / "shapes.json"))
    assert batch_names(cfg, source.config) == ("input_ids", "attention_mask", "pixel_values", "labels")
    with pytest.raises(ConfigError, match=r"'llava' is a vision-language model: its SFT data is read by its "
                                          r"processor.*--tokenizer DIR"):
        prepare_data(cfg, source, print)
    with pytest.raises(ConfigError, match=r"'llava' is a vision-language model: it trains on SFT data with images"):
        batch_names(cfg.model_copy(update={"task": "lm"}), source.config)
    # Qwen2-VL's rows carry their image grid too (tests/test_sft_qwen_vl.py).
    from transformers import Qwen2VLConfig
    assert batch_names(cfg, Qwen2VLConfig()) == ("input_ids", "attention_mask", "pixel_values", "image_grid_thw",
                                                 "labels")
    # images_per_row: LLaVA's images a row; a text model takes none, and a count is at least 1.
    two = cfg.model_copy(update={"images_per_row": 2})
    assert batch_names(two, source.config) == ("input_ids", "attention_mask", "pixel_values", "labels")
    # megatrain train and megatrain plan --config plan it (both build their request with plan_request).
    assert plan_request(two, SimpleNamespace(config=source.config), None, None).images_per_row == 2
    with pytest.raises(ConfigError, match=r"images_per_row=2: model_type 'llama' takes no images.*--images-per-row 1"):
        batch_names(two, source.config.text_config)
    with pytest.raises(ConfigError, match=r"images_per_row.*greater than or equal to 1"):
        load_train_config(None, {"model": str(path), "output_dir": str(tmp_path / "run"), "images_per_row": "0"})


def test_a_text_models_chat_tokenizer_joins_text_parts_and_refuses_images(processor):
    """A text model's template reads strings: messages content given as text parts is their join
    (the same tokens and targets as the string), and a record with images is an error."""
    from megatrain.data.sft import ChatTokenizer
    from megatrain.data.sft_formats import Chat

    chat = ChatTokenizer(processor.tokenizer.backend_tokenizer, None, eos_token=EOT)
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]
    as_parts = chat.encode(Chat(({"role": "user", "content": parts}, {"role": "assistant", "content": "Hi."}),
                                (False, True)))
    as_text = chat.encode(Chat(({"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}),
                               (False, True)))
    assert np.array_equal(as_parts.ids, as_text.ids) and np.array_equal(as_parts.targets, as_text.targets)
    image = Chat(({"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "Hi."}),
                 (False, True), images=("a.png",))
    with pytest.raises(RecordError, match=r"1 image\(s\), and the model reads text only"):
        chat.encode(image)


@pytest.mark.parametrize("patch, tokens", [(16, 4), (4, 64)])
def test_a_processor_that_does_not_fit_the_model_is_refused_before_training(tmp_path, patch, tokens):
    """A processor of another patch size writes 4 (or 64: four images' worth, which a row's image
    count read from its tokens would take for 4 images) image tokens an image where the tiny
    LLaVA's projector writes 16 features: refused with what to change, before the first step."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from megatrain.errors import ConfigError
    from megatrain.train.loop import _check_processor

    write_processor(tmp_path / "p")
    config = json.loads((tmp_path / "p" / "processor_config.json").read_text())
    (tmp_path / "p" / "processor_config.json").write_text(json.dumps({**config, "patch_size": patch}))
    chat = ChatProcessor(AutoProcessor.from_pretrained(tmp_path / "p"), None, eos_token=EOT, images_per_example=1)
    store = build_sft_store(resolve_sft_data(str(EXAMPLES / "data" / "vlm_sft" / "shapes.json")), chat,
                            tmp_path / "store", seq_len=160, progress=False)
    ds = SftDataset(store, 160, packing=False, val_fraction=0.2, images=chat)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(llava_config())
    with pytest.raises(ConfigError, match=rf"LlavaProcessor\) does not fit the model: it writes {tokens} image tokens "
                                          r"\(id \d+\) for the image .*\.png', and the model reads 16 an image .*"
                                          r"Use the model's own processor"):
        _check_processor(model, ds, chat)
