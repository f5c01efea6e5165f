"""megatrain's NVMe tier I/O rate beside ``dd`` with O_DIRECT on the same file system.

Writes then reads ``--gib`` GiB (default 1) as tiles of ``--tile-mib`` MiB through
:class:`megatrain.runtime.nvme.NvmeStore` (O_DIRECT file descriptors, a thread pool issuing
``--block-mib`` MiB ``pwritev``/``preadv`` calls, every tile in flight at once), and the same total
bytes through ``dd bs=<block> oflag=direct`` (write, from ``/dev/zero``) and ``dd iflag=direct``
(read, to ``/dev/null``) in the same directory. ``dd`` with O_DIRECT is the raw-device reference the
issue names (one request in flight, no page cache). Each measurement is the best of ``--repeat``
runs. Prints and (with ``--json``) writes read/write GB/s of both and megatrain/dd ratios (target
>= 0.8), with machine and date.

The same transfers run with the store's block checksums (``NvmeStore(checksums=True)``, the
default: XXH3-64 of each block as it is written, checked as it is read) and without, alternating
run by run on one set of files, and their rates' ratio is the checksums' cost (target: under 5%).

If the directory refuses O_DIRECT (tmpfs), megatrain falls back to buffered I/O and dd fails; the
script says so and the numbers are page-cache rates, not the disk's.

Usage::

    .venv/bin/python bench/nvme_io.py [--dir /tmp] [--gib 1] [--tile-mib 64] [--block-mib 8] \
        [--workers 4] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time

from megatrain.runtime.nvme import NvmeStore, aligned_buffer

MIB = 1 << 20


def _dd(args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t


def measure(directory: str, gib: float, tile_mib: int, block_mib: int, workers: int, repeat: int) -> dict:
    total = int(gib * 1024) * MIB
    tile = tile_mib * MIB
    ntiles = total // tile
    total = ntiles * tile
    work = tempfile.mkdtemp(prefix="megatrain-nvme-bench-", dir=directory)
    try:
        store = NvmeStore(work, {f"t{i}": tile for i in range(ntiles)}, workers=workers,
                          block_bytes=block_mib * MIB)
        bufs = [aligned_buffer(tile) for _ in range(ntiles)]
        for b in bufs:
            b.fill_(7)
        times: dict[bool, tuple[list[float], list[float]]] = {True: ([], []), False: ([], [])}
        for _ in range(repeat):
            for checked in (True, False):
                store.checksums = checked
                mt_w, mt_r = times[checked]
                t = time.perf_counter()
                for r in [store.write(f"t{i}", b) for i, b in enumerate(bufs)]:
                    r.wait()
                os.sync() if not store.direct else None
                mt_w.append(time.perf_counter() - t)
                t = time.perf_counter()
                for r in [store.read(f"t{i}", b) for i, b in enumerate(bufs)]:
                    r.wait()
                mt_r.append(time.perf_counter() - t)
        mt_w, mt_r = times[True]
        direct, reason = store.direct, store.fallback_reason
        store.close(remove=True)
        del bufs
        f = os.path.join(work, "dd.bin")
        bs, count = block_mib * MIB, total // (block_mib * MIB)
        dd_w = [_dd([f"if=/dev/zero", f"of={f}", f"bs={bs}", f"count={count}", "oflag=direct"])
                for _ in range(repeat)]
        dd_r = [_dd([f"if={f}", "of=/dev/null", f"bs={bs}", "iflag=direct"]) for _ in range(repeat)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gbs = lambda secs: total / min(secs) / 1e9  # noqa: E731
    out = {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "directory": directory, "bytes": total, "tile_bytes": tile, "block_bytes": block_mib * MIB,
        "workers": workers, "repeat": repeat, "o_direct": direct, "fallback_reason": reason,
        "megatrain_write_GBps": gbs(mt_w), "megatrain_read_GBps": gbs(mt_r),
        "unchecked_write_GBps": gbs(times[False][0]), "unchecked_read_GBps": gbs(times[False][1]),
        "dd_write_GBps": gbs(dd_w), "dd_read_GBps": gbs(dd_r),
    }
    out["checksum_write_cost"] = 1 - out["megatrain_write_GBps"] / out["unchecked_write_GBps"]
    out["checksum_read_cost"] = 1 - out["megatrain_read_GBps"] / out["unchecked_read_GBps"]
    out["write_ratio"] = out["megatrain_write_GBps"] / out["dd_write_GBps"]
    out["read_ratio"] = out["megatrain_read_GBps"] / out["dd_read_GBps"]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the file system to test")
    p.add_argument("--gib", type=float, default=1.0, help="GiB written and read per run (default 1)")
    p.add_argument("--tile-mib", type=int, default=64, help="tile size in MiB (default 64)")
    p.add_argument("--block-mib", type=int, default=8, help="bytes per system call and dd bs, MiB (default 8)")
    p.add_argument("--workers", type=int, default=4, help="megatrain I/O threads (default 4)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each; the best is kept (default 3)")
    p.add_argument("--json", help="also write the result here")
    a = p.parse_args(argv)
    r = measure(a.dir, a.gib, a.tile_mib, a.block_mib, a.workers, a.repeat)
    print(f"{r['machine']}, {r['date']}, {r['directory']} (O_DIRECT: {r['o_direct']}"
          f"{'' if r['o_direct'] else ', ' + str(r['fallback_reason'])}), {r['bytes'] / 2**30:.2f} GiB")
    print(f"write: megatrain {r['megatrain_write_GBps']:.2f} GB/s, dd oflag=direct {r['dd_write_GBps']:.2f} GB/s,"
          f" ratio {r['write_ratio']:.2f}")
    print(f"read:  megatrain {r['megatrain_read_GBps']:.2f} GB/s, dd iflag=direct {r['dd_read_GBps']:.2f} GB/s,"
          f" ratio {r['read_ratio']:.2f}")
    print(f"checksums: write {r['unchecked_write_GBps']:.2f} GB/s without, cost {r['checksum_write_cost']:.1%}; "
          f"read {r['unchecked_read_GBps']:.2f} GB/s without, cost {r['checksum_read_cost']:.1%}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(r, fh, indent=2)


if __name__ == "__main__":
    main()
