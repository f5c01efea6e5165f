"""Inputs beyond token ids: padding masks (left and right), position_ids, packed documents.

Every case trains against eager Hugging Face training on the same batches (FP32, the 1e-5 bound of
test_exactness). The eager reference runs with ``use_cache=False``, as training does: with a KV
cache object (transformers' default ``use_cache=True`` makes one even in training) transformers
skips its packed-sequence detection and lets packed documents attend to each other.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

import megatrain
from megatrain.errors import BatchError

from conftest import random_batch, tiny_llama
from test_exactness import ADAMW, RTOL, eager_losses

S, MBS, VOCAB = 16, 2, 96
OPT = ADAMW  # eps far below the gradients: test_exactness.ADAMW says why


def _padded(rows: int, seed: int, *, left: bool) -> dict[str, torch.Tensor]:
    """Rows of 4..S real tokens, padded on the left or the right; labels -100 on padding."""
    b = random_batch(rows, S, VOCAB, seed)
    g = torch.Generator().manual_seed(1000 + seed)
    mask = torch.zeros(rows, S, dtype=torch.long)
    for i, n in enumerate(torch.randint(4, S + 1, (rows,), generator=g).tolist()):
        if left:
            mask[i, S - n:] = 1
        else:
            mask[i, :n] = 1
    b["attention_mask"] = mask
    b["labels"] = b["labels"].masked_fill(mask == 0, -100)
    return b


def _packed(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """Two or three documents per row: position_ids restart at 0 at each document start, and the
    label of each document's first token is -100 (nothing predicts it from another document)."""
    b = random_batch(rows, S, VOCAB, seed)
    g = torch.Generator().manual_seed(2000 + seed)
    pos = torch.empty(rows, S, dtype=torch.long)
    for i in range(rows):
        cuts = sorted(set(torch.randint(3, S - 2, (2,), generator=g).tolist()))
        starts = [0, *cuts]
        for a, z in zip(starts, [*cuts, S]):
            pos[i, a:z] = torch.arange(z - a)
        b["labels"][i, cuts] = -100
    b["position_ids"] = pos
    return b


def _no_cache(model):
    """The model's forward with ``use_cache=False``: how eager training runs it (module docstring)."""
    model.forward = functools.partial(model.forward, use_cache=False)
    return model


def _train_both(model, batches, names, micro_batches):
    ref = _no_cache(copy.deepcopy(model))
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=MBS, micro_batches=micro_batches,
                                optimizer=OPT, input_names=names)
    got = [trainer.step(b) for b in batches]
    want = eager_losses(ref, batches, micro_batches, adamw=OPT)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a.loss - b) <= RTOL * abs(b), f"step {step}: megatrain {a.loss} vs eager {b}"
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if not q.requires_grad:
            assert torch.equal(p, q), f"frozen {name} changed"
            continue
        err = ((p - q).norm() / q.norm()).item()
        assert err <= RTOL, f"{name}: relative difference {err:.2e}"
    return trainer, got


def _qwen2(layers=2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, tie_word_embeddings=False))
    # The key bias adds q.b_k to every score of a query: softmax is invariant to that, so its exact
    # gradient is 0 and the computed one is rounding noise, which AdamW normalises into full-size
    # steps of arbitrary sign. Frozen (megatrain keeps frozen parameters exact), the rest compares.
    for layer in model.model.layers:
        layer.self_attn.k_proj.bias.requires_grad_(False)
    return model


FAMILIES = {"llama": tiny_llama, "qwen2": _qwen2}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("left", [False, True], ids=["right-padding", "left-padding"])
def test_padded_batches_match_eager(family, left):
    torch.manual_seed(0)
    batches = [_padded(2 * MBS, s % 3, left=left) for s in range(4)]
    _, got = _train_both(FAMILIES[family](), batches, ("input_ids", "attention_mask", "labels"), micro_batches=2)
    # tokens/s counts real tokens only: the padding is not work the user asked for
    assert [r.tokens for r in got] == [int(b["attention_mask"].sum()) for b in batches]
    assert all(r.tokens < 2 * MBS * S for r in got)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_documents_match_eager(family):
    torch.manual_seed(0)
    batches = [_packed(2 * MBS, s % 3) for s in range(4)]
    _, got = _train_both(FAMILIES[family](), batches, ("input_ids", "position_ids", "labels"), micro_batches=2)
    assert [r.tokens for r in got] == [2 * MBS * S] * 4


def test_explicit_position_ids_match_eager():
    """Positions that do not restart (an offset, as a continued sequence has) are one document."""
    torch.manual_seed(0)
    batches = []
    for s in range(3):
        b = random_batch(2 * MBS, S, VOCAB, s)
        b["position_ids"] = torch.arange(S).repeat(2 * MBS, 1) + 5 * s
        batches.append(b)
    _train_both(tiny_llama(), batches, ("input_ids", "position_ids", "labels"), micro_batches=2)


def test_packed_documents_do_not_attend_across_the_boundary():
    """Doc B's loss does not depend on doc A's tokens when positions restart; it does without."""
    torch.manual_seed(0)
    model = tiny_llama()
    cut = 7
    b = random_batch(MBS, S, VOCAB, 0)
    b["labels"][:, :cut + 1] = -100  # the loss is doc B's own next-token loss only
    b["position_ids"] = torch.cat([torch.arange(cut), torch.arange(S - cut)]).repeat(MBS, 1)
    other = {k: v.clone() for k, v in b.items()}
    other["input_ids"][:, :cut] = (other["input_ids"][:, :cut] + 1) % VOCAB
    packed = megatrain.compile(copy.deepcopy(model), seq_len=S, micro_batch_size=MBS,
                               input_names=("input_ids", "position_ids", "labels"))
    # Masked-out keys get softmax weight exp(-inf) = 0 exactly, so doc A cannot change a bit of B.
    assert packed.evaluate(b) == packed.evaluate(other)
    causal = megatrain.compile(copy.deepcopy(model), seq_len=S, micro_batch_size=MBS)
    plain = {"input_ids": b["input_ids"], "labels": b["labels"]}
    assert causal.evaluate(plain) != causal.evaluate({**plain, "input_ids": other["input_ids"]})


def test_mask_follows_each_batch_not_the_trace_example():
    """The mask is built from each batch's values inside the traced prologue: two batches that
    differ only in padding give the two eager losses."""
    torch.manual_seed(0)
    model = tiny_llama()
    trainer = megatrain.compile(copy.deepcopy(model), seq_len=S, micro_batch_size=MBS,
                                input_names=("input_ids", "attention_mask", "labels"))
    ids = random_batch(MBS, S, VOCAB, 0)
    for n in (S, 9, 4):
        mask = torch.zeros(MBS, S, dtype=torch.long)
        mask[:, :n] = 1
        batch = {"input_ids": ids["input_ids"], "attention_mask": mask,
                 "labels": ids["labels"].masked_fill(mask == 0, -100)}
        with torch.no_grad():
            want = model(**batch, use_cache=False).loss.item()
        assert abs(trainer.evaluate(batch) - want) <= RTOL * want


def test_a_model_without_the_input_is_refused_by_name():
    """megatrain's own example GPT takes input_ids and labels only: padding or packing it is a
    clear error, not an export failure."""
    from megatrain.errors import UnsupportedModelError

    from conftest import tiny_gpt

    with pytest.raises(UnsupportedModelError, match=r"GPT\.forward takes no \['attention_mask'\] \(its inputs: "
                                                     r"\['input_ids', 'labels'\]\)"):
        megatrain.compile(tiny_gpt(), seq_len=S, micro_batch_size=MBS,
                          input_names=("input_ids", "attention_mask", "labels"))


def test_attention_mask_dtypes_and_values():
    torch.manual_seed(0)
    model = tiny_llama()
    trainer = megatrain.compile(model, seq_len=S, micro_batch_size=MBS,
                                input_names=("input_ids", "attention_mask", "labels"))
    b = _padded(MBS, 0, left=False)
    as_bool = {**b, "attention_mask": b["attention_mask"].bool()}
    as_int32 = {**b, "attention_mask": b["attention_mask"].int()}
    before = trainer.evaluate(b)
    assert trainer.evaluate(as_bool) == before == trainer.evaluate(as_int32)
    with pytest.raises(BatchError, match=r"attention_mask.*values \[2\].*0 \(padding\) or 1"):
        trainer.step({**b, "attention_mask": b["attention_mask"] * 2})
    with pytest.raises(BatchError, match=r"attention_mask.*dtype torch.float32.*torch.bool"):
        trainer.step({**b, "attention_mask": b["attention_mask"].float()})
    assert trainer.step_count == 0 and trainer.evaluate(b) == before  # refused before anything ran


def test_store_windows_restart_positions_at_each_document(tmp_path):
    """StoreWindows(document_attention=True): position_ids restart after every end-of-text token,
    and the label of each document's first token is -100."""
    from megatrain.data import StoreWindows, cached_token_store, train_bpe_tokenizer

    docs = [f"document {i} " + "word " * (3 + 5 * i) for i in range(12)]
    root = tmp_path / "corpus"
    root.mkdir()
    for i, d in enumerate(docs):
        (root / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    tok = train_bpe_tokenizer(docs, vocab_size=300)
    store = cached_token_store(root, tok, tmp_path / "store", max_bytes=None, progress=False)
    plain = StoreWindows(store, 16, seed=0)
    packed = StoreWindows(store, 16, seed=0, document_attention=True)
    assert plain.fingerprint() != packed.fingerprint()
    w = np.arange(plain.num_windows)
    a, b = plain.read(w), packed.read(w)
    assert "position_ids" not in a and torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["labels"], b["labels"])
    ids, pos = b["input_ids"].numpy(), b["position_ids"].numpy()
    for row, p in zip(ids, pos):
        want, k = [], 0
        for t in range(16):
            k = 0 if t == 0 or row[t - 1] == store.eot_id else k + 1
            want.append(k)
        assert p.tolist() == want
    assert (pos == 0).sum() > len(ids)  # some windows do hold a document start
