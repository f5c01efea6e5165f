"""The main job: train a small Llama-architecture model on real text with megatrain, on the CPU.

By default the corpus is the source tree of this interpreter's Python standard library (real text
nobody here wrote; nothing is downloaded), tokenised with a byte-level BPE trained on it, once, into
a memory-mapped token store (``megatrain.data.cached_token_store``) that training windows are read from. The model
is built on the meta device and materialised straight into megatrain's host tiles by its own
initialisation. A validation split is held out; the job prints the validation loss before and
after training.

    python examples/train_lm.py                       # defaults: a few minutes on 2 CPU cores
    python examples/train_lm.py --data notes/ --steps 500
    megatrain-train-lm --data corpus.jsonl --text-field body --tokenizer tokenizer.json
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time

import torch


MIN_LR_RATIO = 0.1
"""The cosine decays to this fraction of the peak learning rate at the last step."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatrain-train-lm", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=None,
                   help="directory of text files, a .txt, or a .jsonl (default: the Python stdlib source)")
    p.add_argument("--text-field", default="text", help="field holding the text in a .jsonl")
    p.add_argument("--tokenizer", default=None, help="a tokenizer.json to use instead of training a BPE")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary size when training one")
    p.add_argument("--max-bytes", type=int, default=3_000_000,
                   help="UTF-8 bytes of text to train on, from the corpus's start (0: all of it)")
    p.add_argument("--data-cache", default=None,
                   help="directory of the token store, reused by later runs on the same data and tokenizer "
                        "(default: a temporary directory removed at the end)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps, then cosine decay to 10%% at the last step")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="megatrain-tokens-") as tmp:
        return _run(args, args.data_cache or tmp)


def _run(args, cache: str) -> int:
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    import megatrain
    from megatrain.data import (StoreWindows, cached_token_store, load_documents, load_tokenizer,
                                train_bpe_tokenizer)
    from megatrain.train import lr_at

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    max_bytes = args.max_bytes or None
    if args.tokenizer is not None:
        tokenizer = load_tokenizer(args.tokenizer)
    else:  # megatrain train's rule: a BPE learns from at most the first 10 MB
        sample = load_documents(args.data, max_bytes=min(max_bytes or 10_000_000, 10_000_000),
                                text_field=args.text_field)
        tokenizer = train_bpe_tokenizer(sample, args.vocab_size)
        del sample
    store = cached_token_store(args.data, tokenizer, cache, text_field=args.text_field, max_bytes=max_bytes)
    data = StoreWindows(store, args.seq_len, seed=args.seed)
    print(f"data: {store.num_tokens:,} tokens, {data.num_train_rows} train / {data.num_val_rows} "
          f"validation windows of {args.seq_len}, vocab {tokenizer.get_vocab_size()}; token store {store.path} "
          f"({store.origin}, {time.perf_counter() - t0:.1f} s)")

    cfg = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=args.hidden_size,
                      intermediate_size=3 * args.hidden_size, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=args.seq_len, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    trainer = megatrain.compile(
        model, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, micro_batches=args.micro_batches,
        optimizer=megatrain.AdamW(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay))
    n_params = trainer.graph.param_count
    print(f"model: Llama, {n_params / 1e6:.2f} M parameters in {len(trainer.graph.layers)} streamed layers; "
          f"host state {trainer.host.nbytes / 2**20:.1f} MiB (12 bytes per parameter)")

    global_batch = args.micro_batch_size * args.micro_batches
    eval_rows = args.micro_batch_size

    def validate() -> float:
        losses = [trainer.evaluate(b) for b in data.eval_batches(eval_rows, args.eval_batches)]
        return sum(losses) / len(losses)

    val0 = validate()
    print(f"step 0: validation loss {val0:.4f}")
    train_loss = float("nan")
    batches = data.batches(global_batch, seed=args.seed)
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)
    for step in bar:
        lr = lr_at(step, lr=args.lr, warmup_steps=args.warmup, max_steps=args.steps, min_lr_ratio=MIN_LR_RATIO)
        trainer.set_lr(lr)
        res = trainer.step(next(batches))
        train_loss = res.loss
        if not math.isfinite(res.loss):
            print(f"step {res.step}: loss is {res.loss}; stopping", file=sys.stderr)
            return 1
        bar.set_postfix(loss=f"{res.loss:.3f}", tok_s=f"{res.tokens_per_second:,.0f}", lr=f"{lr:.1e}")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            bar.write(f"step {step + 1}: validation loss {validate():.4f}")
    bar.close()
    val = validate()
    print(f"done in {time.perf_counter() - t0:.0f} s: train loss {train_loss:.4f}, validation loss {val:.4f} "
          f"(step 0: {val0:.4f}, ratio {val / val0:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
