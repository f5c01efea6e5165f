"""One decoder block, five ways, on a GPU: where a block's compute time goes, and what compiling
and CUDA graphs win.

The first GPU session (H100, 2026-11-27) measured a Llama-3.2-1B block's forward at ~2.5 ms and its
local backward at ~8.2 ms per micro-batch of 2 x 2048 tokens, where the simulator predicts 1.3 and
3.3 ms (85% of the BF16 matmul peak, plus 12 us per issued op). This script times, BF16, at two
block shapes (``--shapes``): ``1b``, the probe's (bench/gpu_probe.py ``GPU_STEP``: Llama-3.2-1B,
hidden 2048), and ``7b`` (Llama-2-7B's: hidden 4096, FFN 11008, 32 heads), each 2 x 2048 tokens:

- ``template``: megatrain's traced block template run as the executor runs a FWD op (``no_grad``)
  and a BWD op (recompute with gradients on, ``torch.autograd.grad`` for the weights and the input);
- ``compiled``: the same template compiled as ``Plan.templates == "compiled"`` compiles it
  (:func:`megatrain.runtime.templates.compile_template`: inductor, whole graph); ``compile_s`` is
  the wall time of its first forward and first local backward (compilation, or inductor's cache);
- ``compiled_graph``: the compiled calls captured once each in a CUDA graph and replayed (what
  ``Plan.cuda_graphs`` does per template and slot);
- ``template_graph``: the eager calls captured and replayed;
- ``hf_eager``: transformers' own ``LlamaDecoderLayer`` in BF16, forward under ``no_grad`` and
  forward + ``autograd.grad``, as eager PyTorch training runs it.

For each call: ``gpu_ms`` (CUDA events around one call, median), ``synced_ms`` (wall time of one
call with a synchronisation after it, median), ``issue_ms`` (wall time per call of 10 calls in a row
with no synchronisation in between, so while the GPU keeps up it is the issuing side's time), and
the achieved TFLOP/s (the tracer's FLOP count over ``gpu_ms``). ``gpu_ms`` near ``issue_ms`` and
well above the graph's: the GPU waits on the issuing; a graph near its eager call: the kernels
themselves are slow; ``compiled`` well below ``template``: the unfused element-wise work. JSON to
``--out``, rewritten after every variant (a run cut off keeps what it finished).

Usage: ``python bench/gpu_block.py --out block.json`` (on an H100 about 30 s per shape eager, plus
inductor's cold compile of each shape's block, a minute or so, the whole within bench/gpu_session.sh's
block box); ``--dry-run`` runs a tiny block on the CPU (template, compiled and transformers' layer;
no graphs, no events) to check the harness, compile included.
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
from megatrain.runtime.templates import compile_template, inductor_cache_dir  # noqa: E402

REPS = 10

SHAPES = {
    "1b": GPU_STEP,
    "7b": StepShape(layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000, seq_len=2048,
                    micro_batch_size=2, micro_batches=4),
}
"""Block shapes by name: Llama-3.2-1B's (the probe's) and Llama-2-7B's (Touvron et al. 2023,
arXiv:2307.09288, Table 1 and its config: hidden 4096, FFN 11008, 32 heads), 2 x 2048 tokens each."""


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


def _calls(fn, ex, layer, weights, lbufs, ins, diff, seeds, dtype):
    """The executor's two calls of template ``fn``: a FWD (no grad) and a local backward."""
    def fwd():
        with torch.no_grad(), ex._precision(dtype):
            fn(*weights, *lbufs, *ins)

    def bwd():
        with torch.enable_grad(), ex._precision(dtype):
            leaves = [w.detach().requires_grad_(True) for w in weights]
            xs = [x.detach().requires_grad_(True) if d else x for x, d in zip(ins, diff)]
            res = fn(*leaves, *lbufs, *xs)
            roots = [(o, s) for o, s in zip(res, seeds) if s is not None and o.requires_grad]
            torch.autograd.grad([o for o, _ in roots], leaves + [x for x, d in zip(xs, diff) if d],
                                [s for _, s in roots])
    return fwd, bwd


def bench_block(name: str, sh: StepShape, cuda: bool, res: dict, out: Path) -> None:
    """Time the five variants (three on a CPU) of one block of shape ``sh`` into ``res["blocks"][name]``."""
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
    args = (ex, layer, weights, lbufs, ins, diff, seeds, dtype)

    hf = model.model.layers[0].to(device, tdtype)
    rotary = model.model.rotary_emb.to(device)
    hx = rand((sh.micro_batch_size, sh.seq_len, sh.hidden), tdtype)
    pos = torch.arange(sh.seq_len, device=device).unsqueeze(0).expand(sh.micro_batch_size, -1)
    cos_sin = tuple(t.to(tdtype) for t in rotary(hx, pos))
    hseed = torch.randn_like(hx)

    def hf_out(x):
        o = hf(x, position_embeddings=cos_sin, attention_mask=None, position_ids=pos)
        return o[0] if isinstance(o, tuple) else o

    def hf_fwd():
        with torch.no_grad():
            hf_out(hx)

    def hf_bwd():
        x = hx.detach().requires_grad_(True)
        torch.autograd.grad(hf_out(x), list(hf.parameters()) + [x], hseed)

    block = res["blocks"][name] = {
        "shape": sh.__dict__, "layer": layer.name, "fwd_flops": layer.fwd_flops, "bwd_flops": layer.bwd_flops,
        "fwd_launches": layer.fwd_launches, "bwd_launches": layer.bwd_launches, "variants": {}}
    compiled: dict = {}

    def compiled_calls():
        """The compiled template's calls, compiled on first use: compile_s is its first forward and
        first local backward, synchronised."""
        if "calls" not in compiled:
            fwd, bwd = _calls(compile_template(tmpl), *args)
            sync = torch.cuda.synchronize if cuda else (lambda: None)
            t0 = time.perf_counter()
            fwd()
            bwd()
            sync()
            compiled["compile_s"] = time.perf_counter() - t0
            compiled["calls"] = (fwd, bwd)
        return compiled["calls"]

    variants = {"template": lambda: _calls(tmpl, *args), "compiled": compiled_calls}
    if cuda:
        variants["compiled_graph"] = compiled_calls
        variants["template_graph"] = lambda: _calls(tmpl, *args)
    variants["hf_eager"] = lambda: (hf_fwd, hf_bwd)
    for vname, make in variants.items():
        row: dict = {}
        try:
            f, b = make()
        except Exception as e:  # one variant failing must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:1000]
            f = b = None
        if vname.startswith("compiled") and "compile_s" in compiled:
            row["compile_s"] = compiled["compile_s"]
        for kind, fn, flops in (("fwd", f, layer.fwd_flops), ("bwd", b, layer.bwd_flops)):
            if fn is None:
                continue
            try:
                fn = _graphed(fn) if vname.endswith("_graph") else fn
                t = _time(fn, cuda)
                if t["gpu_ms"]:
                    t["tflops"] = flops / (t["gpu_ms"] / 1e3) / 1e12
                row[kind] = t
            except Exception as e:
                row[kind] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        block["variants"][vname] = row
        print(name, vname, json.dumps(row), flush=True)
        out.write_text(json.dumps(res, indent=1))
    del model, trainer, hf
    if cuda:
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="block.json")
    ap.add_argument("--shapes", default="1b,7b", help=f"comma-separated block shapes, of {sorted(SHAPES)}")
    ap.add_argument("--dry-run", action="store_true", help="a tiny block on the CPU: checks the harness")
    args = ap.parse_args()
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        raise SystemExit("gpu_block: no CUDA device (use --dry-run on a CPU)")
    names = ["dry"] if args.dry_run else [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [n for n in names if n != "dry" and n not in SHAPES]
    if unknown:
        raise SystemExit(f"gpu_block: unknown shapes {unknown}; use some of {sorted(SHAPES)}")
    out = Path(args.out)
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (dry run)", "torch": torch.__version__,
                 "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "compute_dtype": "bfloat16" if cuda else "float32", "inductor_cache": inductor_cache_dir(),
                 "blocks": {}}
    for name in names:
        bench_block(name, DRY_STEP if name == "dry" else SHAPES[name], cuda, res, out)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
