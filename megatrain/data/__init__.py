"""Data pipeline for causal language-model training: text → BPE tokens → batches.

Everything runs locally with nothing downloaded. The default corpus is the
source tree of the running interpreter's standard library (real text that is
always present); a user may instead point at a directory of documents, a
single text file, a ``.jsonl`` file or a Parquet file (``pyarrow``, the
``data`` extra).

Two ways to cut token streams into rows:

- :class:`TokenDataset` cuts one stream into fixed windows, documents
  running across window boundaries (GPT-style; the main job uses it)::

      tokenizer, data = prepare_lm_data(seq_len=256)
      for step, batch in zip(range(num_steps), data.batches(8, seed=0)):
          loss = model(**batch).loss   # input_ids, labels: LongTensor[8, 256]

- :func:`pack_documents` + :class:`PackedDataset` pack whole documents into
  rows so that no loss target crosses a document boundary (``megatrain
  train`` uses it)::

      docs = tokenize_documents(tokenizer, load_documents(path))
      data = PackedDataset(pack_documents(docs, 256, eot_id=eot), seed=0)

- :func:`cached_token_store` + :class:`StoreWindows` tokenise the corpus once
  into a memory-mapped file on disk (in parallel processes, reused while the
  source and tokenizer are unchanged) and read windows from it, so corpora
  larger than RAM train with flat host memory::

      store = cached_token_store(path, tokenizer, "runs/tokens")
      data = StoreWindows(store, 256, seed=0)   # same batches/eval_batches API

Modules: ``sources`` (readers), ``tokenizer``, ``packing``, ``datasets``
(in-memory rows), ``store`` (the on-disk token store), ``windows`` (reading it).

Units: ``max_bytes`` counts UTF-8 bytes of document text; ``seq_len`` and all
lengths of token arrays count tokens.
"""

from megatrain.data.datasets import DEFAULT_SEQ_LEN, PackedDataset, TokenDataset, prepare_lm_data
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
from megatrain.data.windows import StoreWindows

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_SEQ_LEN",
    "EOT_CANDIDATES",
    "EOT_TOKEN",
    "IGNORE_INDEX",
    "RECORD_SUFFIXES",
    "TEXT_SUFFIXES",
    "CorruptStoreError",
    "PackedDataset",
    "PackedRows",
    "StoreError",
    "StoreManifest",
    "StoreWindows",
    "TokenDataset",
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
    "prepare_lm_data",
    "tokenize_documents",
    "train_bpe_tokenizer",
]
