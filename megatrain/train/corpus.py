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


def run_tokenizer(cfg: TrainConfig, source: ModelSource, sample=None):
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


CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where ``transformers`` saves a tokenizer's chat template, beside ``tokenizer_config.json``."""


def run_chat_template(cfg: TrainConfig, source: ModelSource) -> tuple[str | None, str | None]:
    """The chat template of an SFT run and where it came from: ``cfg.chat_template`` (a Jinja file),
    else the ``chat_template.jinja`` or the ``chat_template`` of the ``tokenizer_config.json`` beside
    the run's tokenizer file (a list of named templates gives its ``default``), else None (megatrain's)."""
    import json

    if cfg.chat_template is not None:
        f = Path(cfg.chat_template)
        if not f.is_file():
            raise ConfigError(f"chat_template {str(f)!r} does not exist; give a Jinja template file")
        return f.read_text(encoding="utf-8"), str(f)
    where = Path(cfg.tokenizer) if cfg.tokenizer is not None else source.directory
    if where is None:
        return None, None
    directory = where if where.is_dir() else where.parent
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        return (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8"), str(directory / CHAT_TEMPLATE_FILE)
    f = directory / TOKENIZER_CONFIG_FILE
    try:
        template = json.loads(f.read_text(encoding="utf-8")).get("chat_template") if f.is_file() else None
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{f} is not a JSON object ({e}); fix or remove it") from None
    if isinstance(template, list):  # [{"name", "template"}, ...], as transformers saves several
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(template, str):
        return template, str(f)
    return None, None


def _processor(cfg: TrainConfig, source: ModelSource):
    """The processor (:func:`megatrain.data.sft_qwen_vl.load_processor`: ``transformers.AutoProcessor``,
    or a processor class with a video processor, Qwen2-VL's, without it) of a vision-language run and where it came
    from: the directory of ``tokenizer``, else the model directory."""
    where = Path(cfg.tokenizer) if cfg.tokenizer is not None else source.directory
    hint = ("give --tokenizer DIR, a directory AutoProcessor.from_pretrained loads (the model's processor: "
            "tokenizer.json, tokenizer_config.json and processor_config.json or preprocessor_config.json)")
    if where is None:
        raise ConfigError(f"model_type {source.config.model_type!r} is a vision-language model: its SFT data is read "
                          f"by its processor, and a bare config names none; {hint}")
    directory = where if where.is_dir() else where.parent
    from megatrain.data.sft_qwen_vl import load_processor

    try:  # a processor class with a video processor (Qwen2-VL's) without it: loading one needs torchvision
        processor = load_processor(directory, source.config.model_type)
    except ConfigError:  # the directory's own code, refused
        raise
    except Exception as e:  # OSError, ValueError, KeyError from a directory that is not a processor's
        raise ConfigError(f"{directory}: AutoProcessor.from_pretrained cannot load a processor from it "
                          f"({type(e).__name__}: {e}); {hint}") from None
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(f"{directory} holds a {type(processor).__name__}, no image processor; {hint}")
    return processor, f"{type(processor).__name__} from {directory}"


def image_grid_thw(cfg: TrainConfig, source: ModelSource) -> tuple[tuple[int, int, int], ...] | None:
    """Qwen2-VL and Qwen2.5-VL: the patch grids ``(t, h, w)`` of a row's ``images_per_row``
    images, every image resized to the run's size (``image_size``; :mod:`megatrain.data.sft_qwen_vl`),
    what the run is traced with (``megatrain.compile(image_grid_thw=...)``); None for other models.

    Raises:
        ConfigError: the processor cannot be loaded (:func:`_processor`), or refuses ``image_size``.
    """
    from megatrain.data.sft_qwen_vl import image_grid, native_grid, run_image_size
    from megatrain.planner.trace.vlm import family

    if (fam := family(source.config)) is None or not fam.takes_grid:
        return None
    processor, _ = _processor(cfg, source)
    if cfg.image_max_pixels is not None:  # native sizes: the most patches an image of that many pixels gets
        return (native_grid(processor, cfg.image_max_pixels),) * cfg.images_per_row
    return (image_grid(processor, run_image_size(processor, cfg.image_size)),) * cfg.images_per_row


def sft_sources(cfg: TrainConfig):
    """The datasets of ``cfg.data`` for ``task: sft`` (:func:`megatrain.data.resolve_sft_data`).

    Raises:
        ConfigError: no data given.
        FileNotFoundError, ValueError: as :func:`~megatrain.data.resolve_sft_data`.
    """
    from megatrain.data.sft_sources import resolve_sft_data

    if cfg.data is None:
        raise ConfigError("task sft needs data (--data): alpaca, sharegpt, chat messages or prompt/completion "
                          "records, or a directory with a dataset_info.json")
    return resolve_sft_data(cfg.data, sft_format=cfg.sft_format)


def _text(content) -> str:
    """A message's text: its string, or its text parts joined (a list of parts also holds images)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""


def _prepare_sft(cfg: TrainConfig, source: ModelSource, echo, path: Path):
    from megatrain import data as D
    from megatrain.data.sft_sources import iter_examples
    from megatrain.data.sft_formats import Chat
    from megatrain.planner.trace.vlm import family

    t0 = time.perf_counter()
    sources = sft_sources(cfg)

    def sample() -> list[str]:  # a BPE learns from the examples' text, the first 10 MB of it
        texts, size = [], 0
        for src in sources:
            for example, _, _ in iter_examples(src):
                parts = ([_text(m.get("content")) for m in example.messages] if isinstance(example, Chat)
                         else [example.prompt, example.completion])
                texts.append("\n".join(parts))
                size += len(texts[-1].encode("utf-8"))
                if size >= tokenizer_sample_bytes(cfg):
                    return texts
        return texts

    # A vision-language model's examples carry up to images_per_row images a row (Qwen2-VL: exactly), read by its
    # processor, unpacked.
    if family(source.config) is not None:
        processor, origin = _processor(cfg, source)
        tokenizer = processor.tokenizer.backend_tokenizer
    else:
        processor = None
        tokenizer, origin = run_tokenizer(cfg, source, sample)
    check_vocab(tokenizer, origin, source.config.get_text_config().vocab_size)
    eot = run_eot_token(cfg, tokenizer, origin)
    template, template_origin = run_chat_template(cfg, source)
    if processor is None:
        chat = D.ChatTokenizer(tokenizer, template, eos_token=eot, bos_token=bos_token(tokenizer, eot),
                               loss=cfg.sft_loss, template_origin=template_origin)
    else:
        from megatrain.data.sft_images import ChatProcessor
        from megatrain.data.sft_qwen_vl import run_image_size

        grid = family(source.config).takes_grid
        native = grid and cfg.image_max_pixels is not None
        size = run_image_size(processor, cfg.image_size) if grid and not native else None
        chat = ChatProcessor(processor, template, eos_token=eot, bos_token=bos_token(tokenizer, eot),
                             loss=cfg.sft_loss, images_per_example=cfg.images_per_row, image_size=size,
                             max_pixels=cfg.image_max_pixels if native else None,
                             template_origin=template_origin or ("the processor's" if processor.chat_template
                                                                 else None))
        template_origin = template_origin or ("the processor's" if processor.chat_template else None)
    packing = cfg.sft_packing and processor is None
    store = D.cached_sft_store(sources, chat, path, seq_len=cfg.seq_len, truncation=cfg.sft_truncation)
    dataset = D.SftDataset(store, cfg.seq_len, packing=packing, val_fraction=cfg.val_fraction, seed=cfg.seed,
                           weights=[s.weight for s in sources], num_samples=[s.num_samples for s in sources],
                           images=chat if processor is not None else None)
    dataset.batches(cfg.global_batch)
    dataset.eval_batches(cfg.micro_batch_size, 1)
    m = store.manifest
    mixed = any(s.weight is not None or s.num_samples is not None for s in sources)
    sets = ", ".join(f"{d.name} ({d.format}, {d.examples:,}" + (f"; {c:,} a training epoch" if mixed else "") + ")"
                     for d, c in zip(m.datasets, dataset.counts))
    rows = "packed rows" if packing else "rows"
    k = cfg.images_per_row
    if getattr(chat, "exact_images", False):  # Qwen2-VL: every row has its k images
        per_row = "its image" if k == 1 else f"its {k} images"
    elif getattr(chat, "max_pixels", None) is not None:  # Qwen2-VL at native sizes
        per_row = (f"up to {k} image{'s' if k > 1 else ''} (each at its own size, up to {cfg.image_max_pixels:,} "
                   "pixels)")
    else:
        per_row = "up to one image" if k == 1 else f"up to {k} images"
    images = "" if processor is None else (f"; {m.num_images:,} images, one example and {per_row} a row"
                                           + (" (image examples are not packed)" if cfg.sft_packing else ""))
    fill = dataset.num_train_tokens / max(1, dataset.num_train_rows * cfg.seq_len)
    echo(f"data: {sum(d.examples for d in m.datasets):,} SFT examples from {sets}; {m.trimmed:,} trimmed to seq_len "
         f"(oldest context cut, answer kept), {m.dropped:,} dropped ({cfg.sft_truncation}); "
         f"{len(dataset.train_examples):,} training examples in {dataset.num_train_rows:,} {rows} + "
         f"{len(dataset.val_examples):,} validation examples in {dataset.num_val_rows:,} {rows} of {cfg.seq_len} "
         f"(training rows {fill:.1%} full), {m.num_target_tokens:,} target tokens ({cfg.sft_loss} assistant "
         f"turns){images}; chat template: {template_origin or 'megatrain default'}, {chat.describe()}; SFT store "
         f"{store.path} ({store.origin}); tokenizer: {origin}, vocab {tokenizer.get_vocab_size():,}, end-of-text "
         f"{eot!r} ({time.perf_counter() - t0:.1f} s)")
    return tokenizer, dataset, eot


def run_eot_token(cfg: TrainConfig, tokenizer, origin: str) -> str:
    """The run's end-of-text token: ``cfg.eot_token``, else the one ``tokenizer``
    (``tokenizers.Tokenizer``, from ``origin``) names (:func:`megatrain.data.find_eot_token`).

    Raises:
        ConfigError: the tokenizer has no such token.
    """
    from megatrain import data as D

    eot = cfg.eot_token or D.find_eot_token(tokenizer)
    if tokenizer.token_to_id(eot) is None:
        raise ConfigError(f"the tokenizer ({origin}) has no token {eot!r}; set eot_token to its end-of-sequence token")
    return eot


def check_vocab(tokenizer, origin: str, vocab: int) -> None:
    """Refuse a tokenizer (``tokenizers.Tokenizer``) with more tokens than the model's ``vocab``.

    Raises:
        ConfigError: its ids would index past the embedding.
    """
    if tokenizer.get_vocab_size() > vocab:
        raise ConfigError(f"the tokenizer ({origin}) has {tokenizer.get_vocab_size()} tokens but the model's "
                          f"vocab_size is {vocab}: token ids would index past the embedding; use a "
                          "matching tokenizer or raise vocab_size")


def prepare_data(cfg: TrainConfig, source: ModelSource, echo, path: Path | None = None):
    """Tokenizer -> token store -> windows. Returns ``(tokenizer, dataset, eot_token)``.

    With ``task: sft`` instead: tokenizer -> the datasets of ``data``
    (:func:`~megatrain.data.resolve_sft_data`) -> the SFT store at ``path`` (examples rendered with the
    chat template, fitted to ``seq_len``, labels on completion and assistant tokens only:
    :func:`~megatrain.data.cached_sft_store`) -> packed or padded rows (:class:`~megatrain.data.SftDataset`).

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
            return _prepare_sft(cfg, source, echo, path)
        except (OSError, ValueError, ImportError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"data: {e}") from None
    try:
        t0 = time.perf_counter()
        vocab = source.config.vocab_size
        tokenizer, origin = run_tokenizer(cfg, source)
        check_vocab(tokenizer, origin, vocab)
        eot = run_eot_token(cfg, tokenizer, origin)
        store = D.cached_token_store(cfg.data, tokenizer, path, eot_token=eot, text_field=cfg.text_field,
                                     max_bytes=cfg.max_bytes)
        m = store.manifest
        if m.skipped_files and cfg.data is not None:  # (the default corpus's are the stdlib's own test files)
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


def bos_token(tokenizer, eot: str) -> str:
    """The beginning-of-sequence token: the tokenizer's own (``<|begin_of_text|>``, ``<s>``,
    ``<bos>``) or, as with GPT-2's byte-level BPE, the end-of-text token."""
    return next((t for t in BOS_CANDIDATES if tokenizer.token_to_id(t) is not None), eot)


def match_special_tokens(model, tokenizer, eot: str, seq_len: int, chat_template: str | None = None) -> dict:
    """Make the model's config and generation config name the tokenizer's special tokens, and
    return the ``tokenizer_config.json`` that lets ``transformers.AutoTokenizer`` load the checkpoint
    (with ``chat_template``, the template an SFT run rendered its chats with, when given).

    The end-of-text token that ends every document in the token store is the end of sequence; the beginning of
    sequence is the tokenizer's own (``<|begin_of_text|>``, ``<s>``, ``<bos>``) or, as with GPT-2's
    byte-level BPE, the end-of-text token too. A config's default ids (often 1 and 2) would
    otherwise make generation stop on the wrong token.
    """
    bos = bos_token(tokenizer, eot)
    ids = {"bos_token_id": tokenizer.token_to_id(bos), "eos_token_id": tokenizer.token_to_id(eot)}
    for cfg in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if cfg is not None:
            for k, v in ids.items():
                setattr(cfg, k, v)
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(gen, "pad_token_id", None) is None:
        gen.pad_token_id = ids["eos_token_id"]  # training windows have no padding token; generate() needs one
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eot,
              "model_max_length": seq_len}
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config
