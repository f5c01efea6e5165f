"""A run's data: documents -> tokenizer -> packed rows (``megatrain.data``), and the special
tokens the checkpoint's configs and ``tokenizer_config.json`` name."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatrain.errors import ConfigError, MegatrainError
from megatrain.train.rundir import TOKENIZER_FILE

if TYPE_CHECKING:
    from megatrain.train.config import TrainConfig
    from megatrain.train.model import ModelSource

BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")


def prepare_data(cfg: TrainConfig, source: ModelSource, echo):
    """Documents -> tokenizer -> packed rows. Returns ``(tokenizer, dataset, eot_token)``."""
    from megatrain import data as D

    try:
        t0 = time.perf_counter()
        skipped: list[Path] = []
        docs = D.load_documents(cfg.data, max_bytes=cfg.max_bytes, text_field=cfg.text_field, skipped=skipped)
        if skipped:
            echo(f"note: data: skipped {len(skipped)} file{'s' if len(skipped) > 1 else ''} that are not UTF-8 "
                 f"text ({', '.join(str(p) for p in skipped[:3])}{', ...' if len(skipped) > 3 else ''})")
        vocab = source.config.vocab_size
        if cfg.tokenizer is not None:
            tokenizer, origin = D.load_tokenizer(cfg.tokenizer), cfg.tokenizer
        elif source.directory is not None and (source.directory / TOKENIZER_FILE).is_file():
            tokenizer = D.load_tokenizer(source.directory / TOKENIZER_FILE)
            origin = str(source.directory / TOKENIZER_FILE)
        else:
            if vocab < 257:
                raise ConfigError(f"the model's vocab_size is {vocab}, below the 257 tokens of a byte-level BPE "
                                  "(256 bytes + end-of-text); raise vocab_size or give a tokenizer")
            tokenizer, origin = D.train_bpe_tokenizer(docs, vocab_size=vocab), f"byte-level BPE trained here"
        if tokenizer.get_vocab_size() > vocab:
            raise ConfigError(f"the tokenizer ({origin}) has {tokenizer.get_vocab_size()} tokens but the model's "
                              f"vocab_size is {vocab}: token ids would index past the embedding; use a "
                              "matching tokenizer or raise vocab_size")
        eot = cfg.eot_token or D.find_eot_token(tokenizer)
        eot_id = tokenizer.token_to_id(eot)
        if eot_id is None:
            raise ConfigError(f"the tokenizer ({origin}) has no token {eot!r}; set eot_token to its "
                              "end-of-sequence token")
        token_docs = D.tokenize_documents(tokenizer, docs)
        n_text = sum(len(d.encode("utf-8")) for d in docs)
        del docs
        packed = D.pack_documents(token_docs, cfg.seq_len, eot_id=eot_id)
        del token_docs
        dataset = D.PackedDataset(packed, val_fraction=cfg.val_fraction, seed=cfg.seed)
        dataset.batches(cfg.global_batch)  # raises now when one batch does not fit
        dataset.eval_batches(cfg.micro_batch_size, 1)
    except (OSError, ValueError, ImportError) as e:
        if isinstance(e, MegatrainError):
            raise
        raise ConfigError(f"data: {e}") from None
    echo(f"data: {packed.num_documents:,} documents, {n_text / 1e6:.2f} MB of text -> {packed.num_tokens:,} "
         f"tokens in {dataset.num_train_rows:,} training + {dataset.num_val_rows:,} validation rows of "
         f"{cfg.seq_len} ({packed.padding_fraction:.1%} padding); tokenizer: {origin}, vocab "
         f"{tokenizer.get_vocab_size():,}, end-of-text {eot!r} ({time.perf_counter() - t0:.1f} s)")
    return tokenizer, dataset, eot


def match_special_tokens(model, tokenizer, eot: str, seq_len: int) -> dict:
    """Make the model's config and generation config name the tokenizer's special tokens, and
    return the ``tokenizer_config.json`` that lets ``transformers.AutoTokenizer`` load the checkpoint.

    The end-of-text token the data were packed with is the end of sequence; the beginning of
    sequence is the tokenizer's own (``<|begin_of_text|>``, ``<s>``, ``<bos>``) or, as with GPT-2's
    byte-level BPE, the end-of-text token too. A config's default ids (often 1 and 2) would
    otherwise make generation stop on the wrong token.
    """
    bos = next((t for t in BOS_CANDIDATES if tokenizer.token_to_id(t) is not None), eot)
    ids = {"bos_token_id": tokenizer.token_to_id(bos), "eos_token_id": tokenizer.token_to_id(eot)}
    for cfg in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if cfg is not None:
            for k, v in ids.items():
                setattr(cfg, k, v)
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(gen, "pad_token_id", None) is None:
        gen.pad_token_id = ids["eos_token_id"]  # packed rows have no padding token; generate() needs one
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eot,
            "model_max_length": seq_len}
