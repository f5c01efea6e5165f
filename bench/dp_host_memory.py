"""Host memory of one node training data-parallel: the node's ranks sharing one copy of the
persistent host state (``share_host_memory=True``, the default) beside each rank keeping its own
(``False``), same model, same ranks, measured side by side in one run.

Each rank (gloo, one process per rank on this machine, ``LOCAL_WORLD_SIZE`` = ranks) builds a
Llama from a config, compiles it, takes ``--steps`` steps and reads its proportional set size
(``Pss`` of ``/proc/self/smaps_rollup``: a page shared by k processes counts 1/k in each), so
the ranks' sum is the node's memory with shared pages counted once. It also reports
``HostState.nbytes`` (the FP32 masters and Adam moments of one copy, 12 bytes per parameter).

Usage: ``python bench/dp_host_memory.py [--ranks 2] [--layers 4] [--hidden 512] [--out FILE]``;
prints a table and writes JSON (default ``bench/results/<date>-cpu-dp-host-memory-<ranks>ranks.json``). Linux only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def pss_bytes() -> int:
    """This process's proportional set size, bytes (``/proc/self/smaps_rollup``)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/smaps_rollup has no Pss line")


def _rank(rank: int, ranks: int, init: str, out: str, share: bool, layers: int, hidden: int, steps: int) -> None:
    os.environ.update(LOCAL_WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=ranks)
    torch.set_num_threads(1)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        import megatrain

        cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                          num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)  # initialised in the host tiles: no second copy
        trainer = megatrain.compile(model, seq_len=64, micro_batch_size=1, share_host_memory=share)
        ids = torch.randint(0, 4096, (1, 64), generator=torch.Generator().manual_seed(rank))
        for _ in range(steps):
            trainer.step({"input_ids": ids, "labels": ids})
        dist.barrier()  # every rank has its memory now; read while all are alive
        torch.save({"pss": pss_bytes(), "state": trainer.host.nbytes,
                    "params": trainer.graph.param_count}, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(ranks: int, share: bool, layers: int, hidden: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank")
        mp.spawn(_rank, args=(ranks, os.path.join(d, "init"), out, share, layers, hidden, steps), nprocs=ranks)
        rows = [torch.load(f"{out}.{r}") for r in range(ranks)]
    return {"share_host_memory": share, "node_pss_bytes": sum(r["pss"] for r in rows),
            "per_rank_pss_bytes": [r["pss"] for r in rows], "host_state_bytes": rows[0]["state"],
            "params": rows[0]["params"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    shared, own = (measure(a.ranks, share, a.layers, a.hidden, a.steps) for share in (True, False))
    gib = 2**30
    saved = own["node_pss_bytes"] - shared["node_pss_bytes"]
    record = {
        "date": datetime.date.today().isoformat(), "machine": platform.platform(), "cpus": os.cpu_count(),
        "ranks": a.ranks, "params": shared["params"], "shared": shared, "own_copies": own,
        "saved_bytes": saved, "saved_over_copies": saved / ((a.ranks - 1) * shared["host_state_bytes"]),
        "command": "python bench/dp_host_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print("| host state | ranks | node PSS, shared copy | node PSS, own copies | saved | saved / (ranks-1) copies |")
    print(f"| {shared['host_state_bytes'] / gib:.3f} GiB | {a.ranks} | {shared['node_pss_bytes'] / gib:.3f} GiB | "
          f"{own['node_pss_bytes'] / gib:.3f} GiB | {saved / gib:.3f} GiB | {record['saved_over_copies']:.2f} |")
    out = a.out or Path(__file__).parent / "results" / f"{record['date']}-cpu-dp-host-memory-{a.ranks}ranks.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
