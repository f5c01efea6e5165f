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

Supervised fine-tuning (``sft``): :func:`read_sft_examples` reads ``{"prompt",
"completion"}`` or chat ``{"messages"}`` JSONL, :func:`tokenize_sft` makes padded
rows with labels only on the answer, :class:`SftDataset` batches them.

:func:`pack_documents` packs whole documents into rows so that no loss target
is predicted from another document's text: the rows per-document attention needs.

Modules: ``sources`` (readers), ``tokenizer``, ``packing``, ``store`` (the
on-disk token store), ``windows`` (reading it), ``sft`` (fine-tuning examples).

Units: ``max_bytes`` counts UTF-8 bytes of document text; ``seq_len`` and all
lengths of token arrays count tokens.
"""

from megatrain.data.packing import IGNORE_INDEX, PackedRows, pack_documents
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
from megatrain.data.sft import SftDataset, SftRows, read_sft_examples, render_chat, tokenize_sft
from megatrain.data.windows import StoreWindows

__all__ = [
    "DEFAULT_MAX_BYTES",
    "EOT_CANDIDATES",
    "EOT_TOKEN",
    "IGNORE_INDEX",
    "RECORD_SUFFIXES",
    "TEXT_SUFFIXES",
    "CorruptStoreError",
    "PackedRows",
    "SftDataset",
    "SftRows",
    "StoreError",
    "StoreManifest",
    "StoreWindows",
    "TokenStore",
    "build_token_store",
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
    "read_sft_examples",
    "render_chat",
    "tokenize_documents",
    "tokenize_sft",
    "train_bpe_tokenizer",
]
