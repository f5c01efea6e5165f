"""Data pipeline for causal language-model training: text → BPE tokens → batches.

Everything runs locally with nothing downloaded. The default corpus is the
source tree of the running interpreter's standard library (real text that is
always present); a user may instead point at a directory of documents, a
single text file, a ``.jsonl`` file, a Parquet file or a directory saved with
Hugging Face ``datasets`` (``save_to_disk``); records are read through ``datasets``.

One dataset path: :func:`cached_token_store` tokenises the corpus once into a
memory-mapped file on disk (in parallel processes, reused while the source and
tokenizer are unchanged, rebuilt when it fails its checks) and
:class:`StoreWindows` reads seeded, resumable training windows from it, so
corpora larger than RAM train with flat host memory::

    tokenizer = train_bpe_tokenizer(load_documents(path), vocab_size=2048)
    store = cached_token_store(path, tokenizer, "runs/tokens")
    data = StoreWindows(store, 256, seed=0)
    for step, batch in zip(range(num_steps), data.batches(8, seed=0)):
        loss = model(**batch).loss   # input_ids, labels: LongTensor[8, 256]

Supervised fine-tuning (``sft``): :func:`resolve_sft_data` finds the datasets
(alpaca, sharegpt, chat messages or prompt/completion records in ``.json``,
``.jsonl``, ``.parquet``, ``.csv`` or saved datasets, or the entries of a
LLaMA-Factory ``dataset_info.json``), :class:`ChatTokenizer` renders them with a
chat template and marks the assistant's tokens as targets, :func:`cached_sft_store`
tokenises them once into a token store, and :class:`SftDataset` packs them into rows::

    sources = resolve_sft_data("alpaca_demo,sharegpt_demo:2@examples/data")
    chat = ChatTokenizer(tokenizer, None, eos_token=EOT_TOKEN)   # None: the default template
    store = cached_sft_store(sources, chat, "runs/sft-tokens", seq_len=256)
    data = SftDataset(store, 256, weights=[s.weight for s in sources])
    batch = next(data.batches(8))   # input_ids, position_ids, labels: LongTensor[8, 256]

Records with images, for a vision-language model: :class:`ChatProcessor` (the model's
``AutoProcessor``) in place of the :class:`ChatTokenizer`, and unpacked rows that carry the
processor's image inputs (``SftDataset(store, 256, packing=False, images=chat)``: ``pixel_values``;
Qwen2-VL's also ``image_grid_thw``, its processor and one image size a run in
:mod:`megatrain.data.sft_qwen_vl`).

:func:`pack_documents` packs whole documents into rows so that no loss target
is predicted from another document's text: the rows per-document attention needs;
:func:`best_fit_decreasing` is its packing rule.

Modules: ``sources`` (readers), ``tokenizer``, ``packing``, ``store`` (the
on-disk token store), ``windows`` (reading it), ``sft_formats``, ``sft_sources``,
``sft`` and ``sft_images`` (fine-tuning examples).

Units: ``max_bytes`` counts UTF-8 bytes of document text; ``seq_len`` and all
lengths of token arrays count tokens.
"""

from megatrain.data.packing import IGNORE_INDEX, PackedRows, best_fit_decreasing, pack_documents
from megatrain.data.sources import (
    DEFAULT_MAX_BYTES,
    RECORD_SUFFIXES,
    TEXT_SUFFIXES,
    corpus_bytes,
    corpus_files,
    default_corpus_dir,
    iter_file_documents,
    load_documents,
)
from megatrain.data.store import (
    CorruptStoreError,
    StoreError,
    StoreManifest,
    TokenStore,
    build_token_store,
    cached_token_store,
    open_token_store,
)
from megatrain.data.tokenizer import (
    EOT_CANDIDATES,
    EOT_TOKEN,
    encode_documents,
    find_eot_token,
    load_tokenizer,
    tokenize_documents,
    train_bpe_tokenizer,
)
from megatrain.data.sft import ChatTokenizer, SftDataset, SftStore, cached_sft_store
from megatrain.data.sft_images import ChatProcessor
from megatrain.data.sft_sources import SftSource, resolve_sft_data
from megatrain.data.windows import StoreWindows

__all__ = [
    "DEFAULT_MAX_BYTES",
    "EOT_CANDIDATES",
    "EOT_TOKEN",
    "IGNORE_INDEX",
    "RECORD_SUFFIXES",
    "TEXT_SUFFIXES",
    "ChatProcessor",
    "ChatTokenizer",
    "CorruptStoreError",
    "PackedRows",
    "SftDataset",
    "SftSource",
    "SftStore",
    "StoreError",
    "StoreManifest",
    "StoreWindows",
    "TokenStore",
    "best_fit_decreasing",
    "build_token_store",
    "cached_sft_store",
    "cached_token_store",
    "corpus_bytes",
    "corpus_files",
    "default_corpus_dir",
    "encode_documents",
    "find_eot_token",
    "iter_file_documents",
    "load_documents",
    "load_tokenizer",
    "open_token_store",
    "pack_documents",
    "resolve_sft_data",
    "tokenize_documents",
    "train_bpe_tokenizer",
]
