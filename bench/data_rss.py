"""Host memory while training from the out-of-core token store: does RSS grow with the corpus?

Issue 15 asks that host RSS growth while training on at least 1 GB of text stay under 200 MB and not
grow with the corpus. This script measures it, end to end, on files of this machine:

1. **Corpus**: copies of the running interpreter's standard-library text files (``*.py``, ``*.txt``,
   ``*.md``, ``*.rst``; ``site-packages`` excluded), repeated into ``copy000/``, ``copy001/``, ...
   of a temporary directory until ``--gb`` GB (10^9 bytes) are on disk.
2. **Tokenizer**: a byte-level BPE of ``--vocab`` tokens trained on the first 3 MB (as
   ``megatrain train`` does with its default ``max_bytes`` when the model brings no tokenizer).
3. **Build**: :func:`megatrain.data.cached_token_store` with ``--workers`` processes; then a
   second call that must reuse the store (its time is the full sha256 verification).
4. **Train**: ``--train-steps`` AdamW steps of a tiny model (embedding -> linear head, ``--dim``)
   on :class:`~megatrain.data.StoreWindows` batches, then **scan**: the rest of one epoch
   read without a model, so that every window of the corpus has been read once.

RSS is this process's ``VmRSS`` from ``/proc/self/status`` (its ``RssAnon`` and ``RssFile`` parts
beside it), sampled every ``--sample-every`` batches. Growth is measured from the baseline taken
after ``--warmup`` training steps (the model, its optimizer state and torch's allocator are then
in place) to the largest sample after it. The worker processes of the build are separate
processes; their peak (``ru_maxrss`` of the largest child) is reported apart.

Usage (the JSON goes to ``--out`` and the last line of stdout)::

    .venv/bin/python bench/data_rss.py --gb 1          # about 10-20 min on 2 cores, mostly tokenising
    .venv/bin/python bench/data_rss.py --gb 0.05 --workers 1 --train-steps 20

Exit status 1 when the growth exceeds ``--max-growth-mb`` (default 200).

Measured on this project's CPU machine (2 AMD EPYC cores shared with other jobs, load ~7;
``bench/results/2026-11-24-cpu-data-rss-{1gb,100mb}.json``), defaults otherwise:

- ``--gb 1``: 1,000 MB in 59,754 files -> 352 M tokens, ``tokens.bin`` 704 MB; built by 2 workers in
  1,556 s (with the 8 MiB encode batches of before commit 4d3a16e: worker peak 682 MB); reused with
  full sha256 verification in 4.9 s; 50 training steps, then the rest of the epoch (40,833 batches
  of 8 x 1024, 521 batches/s). RSS 467.6 MB after warm-up, peak 473.9 MB: **+6.3 MB**, all of it in
  the first 40 training steps; flat over the 40,783 batches of the scan.
- ``--gb 0.1``: 35 M tokens; built in 65 s (worker peak 375 MB, mostly torch's import); **+0.5 MB**.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from megatrain.data import (TEXT_SUFFIXES, StoreWindows, cached_token_store, corpus_files, default_corpus_dir,
                            load_documents, train_bpe_tokenizer)

MB = 10**6


def rss() -> dict[str, int]:
    """``VmRSS``, ``RssAnon``, ``RssFile`` and ``VmHWM`` of this process, in bytes (Linux)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def make_corpus(root: Path, target_bytes: int) -> tuple[int, int]:
    """Copy stdlib text files into ``root/copyNNN/`` until ``target_bytes``; return (bytes, files)."""
    files = [f for f in corpus_files(default_corpus_dir()) if f.name.lower().endswith(TEXT_SUFFIXES)]
    base = default_corpus_dir()
    total = n = 0
    copy = 0
    while total < target_bytes:
        for f in files:
            dst = root / f"copy{copy:03d}" / f.relative_to(base)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
            total += dst.stat().st_size
            n += 1
            if total >= target_bytes:
                break
        copy += 1
    return total, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gb", type=float, default=1.0, help="corpus size on disk, GB (10^9 bytes)")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=None, help="tokenising processes (default: all cores)")
    ap.add_argument("--train-steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10, help="training steps before the RSS baseline")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--scan", type=int, default=-1,
                    help="batches read without a model after training; -1: the rest of one epoch")
    ap.add_argument("--sample-every", type=int, default=10)
    ap.add_argument("--dir", type=Path, default=None, help="work directory (kept); default a temp dir (removed)")
    ap.add_argument("--max-growth-mb", type=float, default=200.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    work = args.dir or Path(tempfile.mkdtemp(prefix="megatrain-data-rss-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    try:
        result["rss_start"] = rss()
        t = time.perf_counter()
        corpus = work / "corpus"
        if corpus.exists() and (work / "corpus.json").exists():
            made = json.loads((work / "corpus.json").read_text())
        else:
            nbytes, nfiles = make_corpus(corpus, int(args.gb * 1e9))
            made = {"bytes": nbytes, "files": nfiles}
            (work / "corpus.json").write_text(json.dumps(made))
        result["corpus"] = {**made, "seconds": round(time.perf_counter() - t, 1)}
        print(f"corpus: {made['bytes'] / MB:,.0f} MB in {made['files']:,} files", flush=True)

        t = time.perf_counter()
        tokenizer = train_bpe_tokenizer(load_documents(corpus, max_bytes=3_000_000), args.vocab)
        result["tokenizer_seconds"] = round(time.perf_counter() - t, 1)

        before = rss()
        t = time.perf_counter()
        store = cached_token_store(corpus, tokenizer, work / "store", workers=args.workers)
        build_s = time.perf_counter() - t
        m = store.manifest
        result["build"] = {
            "origin": store.origin, "seconds": round(build_s, 1), "documents": m.num_documents,
            "tokens": m.num_tokens, "tokens_file_bytes": (store.path / "tokens.bin").stat().st_size,
            "skipped_files": m.skipped_files, "workers": args.workers or os.cpu_count(),
            "parent_rss_before": before["VmRSS"], "parent_rss_after": rss()["VmRSS"],
            "largest_worker_max_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        }
        print(f"store: {store.origin} in {build_s:.1f} s: {m.num_documents:,} documents, "
              f"{m.num_tokens:,} {m.dtype} tokens", flush=True)
        store.close()
        t = time.perf_counter()
        store = cached_token_store(corpus, tokenizer, work / "store", workers=args.workers, progress=False)
        result["reuse"] = {"origin": store.origin, "seconds": round(time.perf_counter() - t, 2)}
        print(f"store: {store.origin} in {result['reuse']['seconds']} s (sha256 verified)", flush=True)

        data = StoreWindows(store, args.seq_len)
        per_epoch = data.batches_per_epoch(args.batch)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(m.vocab_size, args.dim),
                                    torch.nn.Linear(args.dim, m.vocab_size))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100)
        samples: list[tuple[str, int, dict[str, int]]] = []
        baseline = None
        batches = data.batches(args.batch, seed=0)
        t = time.perf_counter()
        loss = float("nan")
        for step in range(args.train_steps):
            b = next(batches)
            logits = model(b["input_ids"][:, :-1])
            out = loss_fn(logits.reshape(-1, m.vocab_size), b["labels"][:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            out.backward()
            opt.step()
            loss = out.item()
            if step + 1 == args.warmup:
                baseline = rss()
            if (step + 1) % args.sample_every == 0:
                samples.append(("train", step + 1, rss()))
        train_s = time.perf_counter() - t
        if baseline is None:
            baseline = rss()
        scan = per_epoch - args.train_steps if args.scan < 0 else args.scan
        t = time.perf_counter()
        for i in range(max(0, scan)):
            next(batches)
            if (i + 1) % (args.sample_every * 100) == 0:
                samples.append(("scan", args.train_steps + i + 1, rss()))
        scan_s = time.perf_counter() - t
        samples.append(("end", args.train_steps + max(0, scan), rss()))
        peak = max(s[2]["VmRSS"] for s in samples)
        growth = peak - baseline["VmRSS"]
        result["train"] = {"steps": args.train_steps, "seconds": round(train_s, 1), "last_loss": round(loss, 3),
                           "batches_per_epoch": per_epoch, "tokens_per_batch": args.batch * args.seq_len}
        result["scan"] = {"batches": max(0, scan), "seconds": round(scan_s, 1),
                          "batches_per_s": round(max(0, scan) / scan_s, 1) if scan_s > 0 else None}
        result["rss_baseline"] = baseline
        result["rss_samples"] = [{"phase": p, "batch": s, **r} for p, s, r in samples]
        result["rss_peak"] = peak
        result["rss_growth_bytes"] = growth
        result["rss_growth_mb"] = round(growth / MB, 1)
        result["ok"] = growth <= args.max_growth_mb * MB
        print(f"train: {args.train_steps} steps ({train_s:.1f} s, loss {loss:.2f}); scan: {max(0, scan):,} "
              f"batches ({scan_s:.1f} s); {args.train_steps + max(0, scan):,} of {per_epoch:,} batches "
              f"of one epoch read", flush=True)
        print(f"RSS: baseline {baseline['VmRSS'] / MB:.0f} MB (anon {baseline['RssAnon'] / MB:.0f}, file "
              f"{baseline['RssFile'] / MB:.0f}); peak after it {peak / MB:.0f} MB; growth "
              f"{growth / MB:+.1f} MB (limit {args.max_growth_mb:.0f} MB); tokens file "
              f"{result['build']['tokens_file_bytes'] / MB:,.0f} MB", flush=True)
        store.close()
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
