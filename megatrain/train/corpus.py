"""A run's data: a tokenizer, the corpus tokenised once into the on-disk token store
(:func:`megatrain.data.cached_token_store`), training windows read from its memory map
(:class:`megatrain.data.StoreWindows`), and the special tokens the checkpoint's configs and
``tokenizer_config.json`` name."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatrain.errors import ConfigError
from megatrain.train.rundir import STORE_DIR, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

if TYPE_CHECKING:
    from megatrain.data import StoreWindows
    from megatrain.train.config import TrainConfig
    from megatrain.train.model import ModelSource

BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")

TOKENIZER_SAMPLE_BYTES = 10_000_000
"""At most this many UTF-8 bytes of text (the corpus's first ``max_bytes``, or fewer) train the
byte-level BPE when no tokenizer is given: BPE training holds its sample in memory (about
:data:`~megatrain.train.preflight.DATA_BYTES_PER_TEXT_BYTE` bytes per text byte), so on a corpus
larger than RAM (``max_bytes: null``) it learns from a sample, as tokenizers usually are trained."""


def store_dir(cfg: TrainConfig) -> Path:
    """Where the run's token store lives: ``data_cache``, else ``output_dir/tokens``."""
    return Path(cfg.data_cache) if cfg.data_cache is not None else Path(cfg.output_dir) / STORE_DIR


def trains_tokenizer(cfg: TrainConfig, source: ModelSource) -> bool:
    """Whether the run trains a BPE (no ``tokenizer`` given and none in the model directory)."""
    return cfg.tokenizer is None and not (source.directory is not None
                                          and (source.directory / TOKENIZER_FILE).is_file())


def tokenizer_sample_bytes(cfg: TrainConfig) -> int:
    """UTF-8 bytes of text a trained BPE learns from (see :data:`TOKENIZER_SAMPLE_BYTES`)."""
    return min(cfg.max_bytes or TOKENIZER_SAMPLE_BYTES, TOKENIZER_SAMPLE_BYTES)


def _tokenizer(cfg: TrainConfig, source: ModelSource, sample=None):
    """The run's tokenizer and where it came from; a BPE is trained on ``sample()`` (default: the
    first :func:`tokenizer_sample_bytes` of the corpus)."""
    from megatrain import data as D

    vocab = source.config.vocab_size
    if cfg.tokenizer is not None:
        return D.load_tokenizer(cfg.tokenizer), cfg.tokenizer
    if not trains_tokenizer(cfg, source):
        return D.load_tokenizer(source.directory / TOKENIZER_FILE), str(source.directory / TOKENIZER_FILE)
    if vocab < 257:
        raise ConfigError(f"the model's vocab_size is {vocab}, below the 257 tokens of a byte-level BPE "
                          "(256 bytes + end-of-text); raise vocab_size or give a tokenizer")
    if sample is None:
        docs = D.load_documents(cfg.data, max_bytes=tokenizer_sample_bytes(cfg), text_field=cfg.text_field)
    else:
        docs = sample()
    return D.train_bpe_tokenizer(docs, vocab_size=vocab), "byte-level BPE trained here"


def _chat_template(cfg: TrainConfig, source: ModelSource) -> str | None:
    """The ``chat_template`` of the ``tokenizer_config.json`` beside the run's tokenizer file, if any."""
    import json

    where = Path(cfg.tokenizer) if cfg.tokenizer is not None else source.directory
    if where is None:
        return None
    f = (where if where.is_dir() else where.parent) / TOKENIZER_CONFIG_FILE
    try:
        template = json.loads(f.read_text(encoding="utf-8")).get("chat_template") if f.is_file() else None
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{f} is not a JSON object ({e}); fix or remove it") from None
    return template if isinstance(template, str) else None


def _prepare_sft(cfg: TrainConfig, source: ModelSource, echo):
    from megatrain import data as D

    t0 = time.perf_counter()
    if cfg.data is None:
        raise ConfigError("task sft needs data: a .jsonl of {prompt, completion} or {messages} records (--data)")
    vocab = source.config.vocab_size
    # A BPE learns from the examples' text (in the default rendering: it has no chat template).
    tokenizer, origin = _tokenizer(cfg, source, lambda: [
        "".join(t for t, _ in ex) for ex in D.read_sft_examples(cfg.data, eot_token=D.EOT_TOKEN)])
    _check_vocab(tokenizer, origin, vocab)
    eot = cfg.eot_token or D.find_eot_token(tokenizer)
    eot_id = tokenizer.token_to_id(eot)
    if eot_id is None:
        raise ConfigError(f"the tokenizer ({origin}) has no token {eot!r}; set eot_token to its end-of-sequence token")
    template = _chat_template(cfg, source)
    rows = D.tokenize_sft(tokenizer, D.read_sft_examples(cfg.data, chat_template=template, eot_token=eot),
                          cfg.seq_len, pad_id=eot_id)
    dataset = D.SftDataset(rows, val_fraction=cfg.val_fraction, seed=cfg.seed)
    dataset.batches(cfg.global_batch)
    dataset.eval_batches(cfg.micro_batch_size, 1)
    n = rows.input_ids.shape[0]
    echo(f"data: {n:,} SFT examples ({rows.truncated:,} cut at seq_len) in {dataset.num_train_rows:,} training + "
         f"{dataset.num_val_rows:,} validation rows of {cfg.seq_len}, {rows.num_target_tokens:,} target tokens; "
         f"{'chat template of ' + TOKENIZER_CONFIG_FILE if template else 'no chat template'}; tokenizer: {origin}, "
         f"vocab {tokenizer.get_vocab_size():,}, end-of-text {eot!r} ({time.perf_counter() - t0:.1f} s)")
    return tokenizer, dataset, eot


def _check_vocab(tokenizer, origin: str, vocab: int) -> None:
    if tokenizer.get_vocab_size() > vocab:
        raise ConfigError(f"the tokenizer ({origin}) has {tokenizer.get_vocab_size()} tokens but the model's "
                          f"vocab_size is {vocab}: token ids would index past the embedding; use a "
                          "matching tokenizer or raise vocab_size")


def prepare_data(cfg: TrainConfig, source: ModelSource, echo, path: Path | None = None):
    """Tokenizer -> token store -> windows. Returns ``(tokenizer, dataset, eot_token)``.

    With ``task: sft`` instead: tokenizer -> the ``.jsonl`` examples -> padded rows with labels on
    completion and assistant tokens only (:class:`~megatrain.data.SftDataset`).

    The store at ``path`` (default :func:`store_dir`) holds the corpus's first ``max_bytes`` bytes
    of text (all of it when ``max_bytes`` is None) tokenised with the run's tokenizer; it is
    reused while the data files, the tokenizer, ``eot_token``, ``text_field`` and ``max_bytes`` are
    unchanged, and rebuilt when it fails its sha256 check (the echo line says which). The dataset
    is a :class:`~megatrain.data.StoreWindows` of ``seq_len`` tokens whose labels are -100 at
    document starts.

    Raises:
        ConfigError: missing or unreadable data; a malformed record (naming the file and line);
            an empty corpus; a tokenizer larger than the model's vocabulary or without the
            end-of-text token; too little text for one training batch and one evaluation batch.
    """
    from megatrain import data as D

    path = store_dir(cfg) if path is None else path
    if cfg.task == "sft":
        try:
            return _prepare_sft(cfg, source, echo)
        except (OSError, ValueError, ImportError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"data: {e}") from None
    try:
        t0 = time.perf_counter()
        vocab = source.config.vocab_size
        tokenizer, origin = _tokenizer(cfg, source)
        _check_vocab(tokenizer, origin, vocab)
        eot = cfg.eot_token or D.find_eot_token(tokenizer)
        if tokenizer.token_to_id(eot) is None:
            raise ConfigError(f"the tokenizer ({origin}) has no token {eot!r}; set eot_token to its "
                              "end-of-sequence token")
        store = D.cached_token_store(cfg.data, tokenizer, path, eot_token=eot, text_field=cfg.text_field,
                                     max_bytes=cfg.max_bytes)
        m = store.manifest
        if m.skipped_files:
            shown = ", ".join(m.skipped_examples[:3]) + (", ..." if m.skipped_files > 3 else "")
            echo(f"note: data: skipped {m.skipped_files} file{'s' if m.skipped_files > 1 else ''} that are not "
                 f"UTF-8 text ({shown})")
        dataset = D.StoreWindows(store, cfg.seq_len, val_fraction=cfg.val_fraction, seed=cfg.seed,
                                 document_attention=cfg.document_attention)
        dataset.batches(cfg.global_batch)  # raises now when one batch does not fit
        dataset.eval_batches(cfg.micro_batch_size, 1)
    except (OSError, ValueError, ImportError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"data: {e}") from None  # a StoreError too: one error line, prefixed as the rest
    text = f"{m.text_bytes / 1e6:.2f} MB of text" if m.text_bytes is not None else "text"
    # The budget is spent when the text reaches it (less at most a UTF-8 character cut at the end).
    if m.max_bytes is not None and m.text_bytes is not None and m.text_bytes > m.max_bytes - 4:
        echo(f"note: data: max_bytes={m.max_bytes:,} cut the corpus: training on its first {m.text_bytes / 1e6:.2f} "
             f"MB of text ({m.num_documents:,} documents) of {m.source_files:,} "
             f"file{'s' if m.source_files != 1 else ''} holding {m.source_bytes / 1e6:.2f} MB on disk; max_bytes: "
             "null (--max-bytes none) trains on all of it")
    echo(f"data: {m.num_documents:,} documents, {text} -> {m.num_tokens:,} tokens in {dataset.num_train_rows:,} "
         f"training + {dataset.num_val_rows:,} validation windows of {cfg.seq_len}; token store {store.path} "
         f"({store.origin}); tokenizer: {origin}, vocab {tokenizer.get_vocab_size():,}, end-of-text {eot!r} "
         f"({time.perf_counter() - t0:.1f} s)")
    return tokenizer, dataset, eot


def match_special_tokens(model, tokenizer, eot: str, seq_len: int) -> dict:
    """Make the model's config and generation config name the tokenizer's special tokens, and
    return the ``tokenizer_config.json`` that lets ``transformers.AutoTokenizer`` load the checkpoint.

    The end-of-text token that ends every document in the token store is the end of sequence; the beginning of
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
        gen.pad_token_id = ids["eos_token_id"]  # training windows have no padding token; generate() needs one
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eot,
            "model_max_length": seq_len}
