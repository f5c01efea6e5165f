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

from megatrain.lazy import lazy_names

# Each name loads its module on first use (PEP 562): the readers and format checks that
# `megatrain train` runs before it imports torch (megatrain.train.early) import only what they need.
_LAZY = {
    "ChatProcessor": "megatrain.data.sft_images", "ChatTokenizer": "megatrain.data.sft",
    "CorruptStoreError": "megatrain.data.store", "DEFAULT_MAX_BYTES": "megatrain.data.sources",
    "EOT_CANDIDATES": "megatrain.data.tokenizer", "EOT_TOKEN": "megatrain.data.tokenizer",
    "IGNORE_INDEX": "megatrain.data.packing", "PackedRows": "megatrain.data.packing",
    "RECORD_SUFFIXES": "megatrain.data.sources", "SftDataset": "megatrain.data.sft",
    "SftSource": "megatrain.data.sft_sources", "SftStore": "megatrain.data.sft",
    "StoreError": "megatrain.data.store", "StoreManifest": "megatrain.data.store",
    "StoreWindows": "megatrain.data.windows", "TEXT_SUFFIXES": "megatrain.data.sources",
    "TokenStore": "megatrain.data.store", "best_fit_decreasing": "megatrain.data.packing",
    "build_token_store": "megatrain.data.store", "cached_sft_store": "megatrain.data.sft",
    "cached_token_store": "megatrain.data.store", "corpus_bytes": "megatrain.data.sources",
    "corpus_files": "megatrain.data.sources", "default_corpus_dir": "megatrain.data.sources",
    "encode_documents": "megatrain.data.tokenizer", "find_eot_token": "megatrain.data.tokenizer",
    "iter_file_documents": "megatrain.data.sources", "load_documents": "megatrain.data.sources",
    "load_tokenizer": "megatrain.data.tokenizer", "open_token_store": "megatrain.data.store",
    "pack_documents": "megatrain.data.packing", "resolve_sft_data": "megatrain.data.sft_sources",
    "tokenize_documents": "megatrain.data.tokenizer", "train_bpe_tokenizer": "megatrain.data.tokenizer",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


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
