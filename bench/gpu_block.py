"""One decoder block, three ways, on a GPU: where a block's compute time goes.

The first GPU session (H100, 2026-11-27) measured a Llama-3.2-1B block's forward at ~2.5 ms and its
local backward at ~8.2 ms per micro-batch of 2 x 2048 tokens, where the simulator predicts 1.3 and
3.3 ms (85% of the BF16 matmul peak, plus 12 us per issued op). This script times, at the probe's
block shape (bench/gpu_probe.py ``GPU_STEP``), BF16:

- ``template``: megatrain's traced block template run as the executor runs a FWD op (``no_grad``)
  and a BWD op (recompute with gradients on, ``torch.autograd.grad`` for the weights and the input);
- ``template_graph``: the same two calls captured once each in a CUDA graph and replayed (what
  capturing each template over static slots would give: no issuing per op);
- ``hf_eager``: transformers' own ``LlamaDecoderLayer`` in BF16, forward under ``no_grad`` and
  forward + ``autograd.grad``, as eager PyTorch training runs it.

For each call: ``gpu_ms`` (CUDA events around one call, median), ``synced_ms`` (wall time of one
call with a synchronisation after it, median), ``issue_ms`` (wall time per call of 10 calls in a row
with no synchronisation in between, so while the GPU keeps up it is the issuing side's time), and
the achieved TFLOP/s (the tracer's FLOP count over ``gpu_ms``). ``gpu_ms`` near ``issue_ms`` and
well above the graph's: the GPU waits on the issuing; ``template_graph`` near ``template``: the
kernels themselves are slow. JSON to ``--out``.

Usage: ``python bench/gpu_block.py --out block.json`` (about 30 s on an H100); ``--dry-run`` runs a
tiny block on the CPU (no graphs, no events) to check the harness.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_probe import DRY_STEP, GPU_STEP, StepShape, llama_config  # noqa: E402

import megatrain  # noqa: E402

REPS = 10


def _block_trainer(sh: StepShape, device: str, dtype: str):
    """A one-block model of shape ``sh`` compiled for ``device``: its executor's templates, buffers
    and graph (nothing is stepped)."""
    from transformers import LlamaForCausalLM

    cfg = llama_config(StepShape(**{**sh.__dict__, "layers": 1}))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    return model, megatrain.compile(model, seq_len=sh.seq_len, micro_batch_size=sh.micro_batch_size, micro_batches=1,
                                    optimizer=megatrain.AdamW(lr=1e-4), device=device, compute_dtype=dtype,
                                    plan="default")


def _time(fn, cuda: bool) -> dict:
    """gpu_ms, synced_ms and issue_ms of ``fn`` (see the module docstring)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    gpu, synced = [], []
    for _ in range(REPS):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        fn()
        if cuda:
            b.record()
        sync()
        synced.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            gpu.append(a.elapsed_time(b))
    t0 = time.perf_counter()
    for _ in range(REPS):
        fn()
    issue = (time.perf_counter() - t0) * 1e3 / REPS
    sync()
    return {"gpu_ms": statistics.median(gpu) if gpu else None, "synced_ms": statistics.median(synced),
            "issue_ms": issue}


def _graphed(fn):
    """``fn`` captured once in a CUDA graph (after warm-up on a side stream, as PyTorch's docs do);
    returns the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="block.json")
    ap.add_argument("--dry-run", action="store_true", help="a tiny block on the CPU: checks the harness")
    args = ap.parse_args()
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_block: no CUDA device (use --dry-run on a CPU)")
    sh = DRY_STEP if args.dry_run else GPU_STEP
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    tdtype = getattr(torch, dtype)
    model, trainer = _block_trainer(sh, device, dtype)
    ex, g = trainer.executor, trainer.graph
    li = next(i for i, layer in enumerate(g.layers) if layer.name.endswith("layers.0"))
    layer = g.layers[li]
    tmpl, lbufs = ex.templates[layer.template], ex.layer_buffers[li]
    gen = torch.Generator().manual_seed(0)

    def rand(shape, dt):
        return (torch.randn(shape, generator=gen) * 0.02).to(device, dt)

    weights = [rand(p.shape, tdtype) for p in layer.params]
    ins = [rand(g.values[v].shape, getattr(torch, g.values[v].dtype)) for v in layer.inputs]
    diff = [g.values[v].requires_grad for v in layer.inputs]
    outs = tmpl(*weights, *lbufs, *ins)
    seeds = [torch.randn_like(o) if o.is_floating_point() else None for o in outs]

    def fwd():
        with torch.no_grad(), ex._precision(dtype):
            tmpl(*weights, *lbufs, *ins)

    def bwd():
        with torch.enable_grad(), ex._precision(dtype):
            leaves = [w.detach().requires_grad_(True) for w in weights]
            xs = [x.detach().requires_grad_(True) if d else x for x, d in zip(ins, diff)]
            res = tmpl(*leaves, *lbufs, *xs)
            roots = [(o, s) for o, s in zip(res, seeds) if s is not None and o.requires_grad]
            torch.autograd.grad([o for o, _ in roots], leaves + [x for x, d in zip(xs, diff) if d],
                                [s for _, s in roots])

    hf = model.model.layers[0].to(device, tdtype)
    rotary = model.model.rotary_emb.to(device)
    hx = rand((sh.micro_batch_size, sh.seq_len, sh.hidden), tdtype)
    pos = torch.arange(sh.seq_len, device=device).unsqueeze(0).expand(sh.micro_batch_size, -1)
    cos_sin = tuple(t.to(tdtype) for t in rotary(hx, pos))
    hseed = torch.randn_like(hx)

    def hf_out(x):
        out = hf(x, position_embeddings=cos_sin, attention_mask=None, position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    def hf_fwd():
        with torch.no_grad():
            hf_out(hx)

    def hf_bwd():
        x = hx.detach().requires_grad_(True)
        params = [p for p in hf.parameters()]
        torch.autograd.grad(hf_out(x), params + [x], hseed)

    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "torch": torch.__version__,
                 "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": sh.__dict__,
                 "compute_dtype": dtype, "layer": layer.name, "fwd_flops": layer.fwd_flops,
                 "bwd_flops": layer.bwd_flops, "fwd_launches": layer.fwd_launches,
                 "bwd_launches": layer.bwd_launches, "variants": {}}
    variants = {"template": (fwd, bwd), "hf_eager": (hf_fwd, hf_bwd)}
    if cuda:
        variants["template_graph"] = (fwd, bwd)
    for name, (f, b) in variants.items():
        row = {}
        for kind, fn, flops in (("fwd", f, layer.fwd_flops), ("bwd", b, layer.bwd_flops)):
            try:
                fn = _graphed(fn) if name == "template_graph" else fn
                t = _time(fn, cuda)
                if t["gpu_ms"]:
                    t["tflops"] = flops / (t["gpu_ms"] / 1e3) / 1e12
                row[kind] = t
            except Exception as e:  # one variant failing must not lose the others
                row[kind] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        res["variants"][name] = row
        print(name, json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
