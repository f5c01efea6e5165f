"""Sequence chunking of token-wise regions: the kernel, the pass that installs it, exactness, and
the liveness model of a layer's working memory (``Layer.work_bytes``) against measured peaks."""

from __future__ import annotations

import copy
import functools
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import megatrain
import megatrain.planner.front
from megatrain.kernels import chunk_bounds, grouped_query_attention, sequence_chunked
from megatrain.ir.graph import retarget
from megatrain.ir.plan import Plan
from megatrain.planner.trace import MIXED, chunk_sequence_regions, sequence_dims, trace

from conftest import random_batch, tiny_gpt, tiny_llama
from test_exactness import ADAMW, assert_bf16_tracks_eager, assert_same_training

aten = torch.ops.aten


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is sequence_chunked]


def _region_targets(gm: fx.GraphModule, call: fx.Node) -> list:
    return [n.target for n in getattr(gm, call.args[0].target).graph.nodes if n.op == "call_function"]


# -- the kernel --------------------------------------------------------------------------------------

class _Counted:
    """A token-wise region ``(x [B,S,D], y [B,H,S,E], w [D,D], scale []) -> (x', y')`` that counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, y, w, scale):
        self.calls += 1
        h = F.linear(F.layer_norm(x, x.shape[-1:]), w).tanh() * scale
        return h + x, (y.softmax(-1) * y).transpose(1, 2)


def _region_inputs(seq: int = 11):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, seq, 6, generator=g, requires_grad=True)
    y = torch.randn(2, 3, seq, 4, generator=g, requires_grad=True)
    w = torch.randn(6, 6, generator=g, requires_grad=True)
    scale = torch.tensor(0.7, requires_grad=True)
    return x, y, w, scale


def test_chunk_bounds_cover_the_sequence_in_near_equal_parts():
    assert chunk_bounds(11, 3) == [4, 4, 3]
    assert chunk_bounds(8, 4) == [2, 2, 2, 2]
    assert chunk_bounds(5, 99) == [1] * 5, "at most one chunk per position"
    assert chunk_bounds(5, 1) == [5]


@pytest.mark.parametrize("chunks", [1, 2, 3, 11, 50])
def test_kernel_equals_the_region_run_whole_in_value_and_gradient(chunks):
    ins = _region_inputs()
    region = _Counted()
    want = region(*ins)
    got = sequence_chunked(region, chunks, (1, 2, None, None), (1, 1), *ins)
    assert [t.shape for t in got] == [t.shape for t in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    seeds = [torch.randn_like(t) for t in want]
    for a, b in zip(torch.autograd.grad(got, ins, seeds), torch.autograd.grad(want, ins, seeds)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_kernel_recomputes_each_chunk_once_in_the_backward_and_not_without_gradients():
    ins = _region_inputs()
    region = _Counted()
    out = sequence_chunked(region, 3, (1, 2, None, None), (1, 1), *ins)
    assert region.calls == 3
    torch.autograd.grad(out, ins, [torch.ones_like(t) for t in out])
    assert region.calls == 6, "the checkpoint drops each chunk's intermediates and recomputes them"
    region.calls = 0
    with torch.no_grad():
        out = sequence_chunked(region, 3, (1, 2, None, None), (1, 1), *ins)
    assert region.calls == 3 and all(t.grad_fn is None for t in out)


def test_kernel_on_meta_runs_one_chunk_and_counts_the_recompute():
    x = torch.empty(2, 64, 16, device="meta", requires_grad=True)
    w = torch.empty(32, 16, device="meta", requires_grad=True)
    region = _LinearRegion()
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        sequence_chunked(region, 8, (1, None), (1,), x, w)
    fwd = 2 * 2 * 64 * 16 * 32
    assert fc.get_total_flops() == fwd and region.calls == 1
    with FlopCounterMode(display=False) as fc:
        (out,) = sequence_chunked(region, 8, (1, None), (1,), x, w)
        torch.autograd.backward([out], [torch.ones_like(out)])
    assert fc.get_total_flops() == 4 * fwd, "forward, recompute, and the two backward matmuls"


class _LinearRegion:
    def __init__(self):
        self.calls = 0

    def __call__(self, x, w):
        # tanh saves its output, so the recompute must run the matmul (a region ending in a matmul
        # would not: the checkpoint stops once the tensors the backward saved are back, and a
        # matmul saves its inputs before it runs).
        self.calls += 1
        return (F.linear(x, w).tanh(),)


def test_kernel_under_autocast_computes_in_the_autocast_dtype_like_the_region():
    ins = _region_inputs(seq=9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _Counted()(*ins)
        got = sequence_chunked(_Counted(), 4, (1, 2, None, None), (1, 1), *ins)
        grads = torch.autograd.grad(got, ins, [torch.ones_like(t) for t in got])
    assert [t.dtype for t in got] == [t.dtype for t in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert [g.dtype for g in grads] == [torch.float32] * 4


def test_kernel_rejects_inputs_of_different_sequence_lengths():
    x, y, w, s = _region_inputs()
    with pytest.raises(ValueError, match="same length"):
        sequence_chunked(_Counted(), 2, (1, 1, None, None), (1, 1), x, y, w, s)
    with pytest.raises(ValueError, match="in_dims"):
        sequence_chunked(_Counted(), 2, (1, 2), (1, 1), x, y, w, s)


# -- sequence dimensions and regions on hand-built graphs ---------------------------------------------

def _export_block(fn, *shapes, activations=None):
    """``fn`` exported to an aten GraphModule whose placeholders are named ``x0, x1, ...``."""

    class M(nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    ep = torch.export.export(M(), tuple(torch.randn(*s) for s in shapes), strict=False)
    gm = ep.graph_module
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return gm, set(names if activations is None else [names[i] for i in activations])


def test_sequence_dims_follow_reshapes_and_transposes_and_stop_at_mixing_ops():
    S = 10

    def fn(x, pos):
        h = x.view(1, S, 4, 3).transpose(1, 2)      # sequence at 2
        a = h.softmax(-1)                          # over the head dim: token-wise
        b = h.softmax(2)                           # over the sequence: mixes positions
        c = x + pos                                # a table of size S added: not sliceable with x
        d = x.cumsum(1)                            # a scan along the sequence
        e = x.mean(1)                              # a reduction over it
        f = x[:, 1:]                               # a shift along it
        return a, b, c, d, e, f

    gm, acts = _export_block(fn, (1, S, 12), (S, 12), activations=[0])
    sd, tw = sequence_dims(gm, batch=1, seq_len=S, activations=acts)
    by_target = {}
    for n in gm.graph.nodes:
        by_target.setdefault(n.target, []).append(n)
    (view,) = by_target[aten.view.default]
    (tr,) = by_target[aten.transpose.int]
    soft = by_target.get(aten._softmax.default) or by_target[aten.softmax.int]
    (add,) = by_target[aten.add.Tensor]
    (cs,) = by_target[aten.cumsum.default]
    (mean,) = by_target[aten.mean.dim]
    (sl,) = by_target[aten.slice.Tensor]
    assert (sd[view], sd[tr]) == (1, 2) and view in tw and tr in tw
    assert sd[soft[0]] == 2 and soft[0] in tw
    assert sd[soft[1]] == 2 and soft[1] not in tw, "still indexed by position, but each reads all"
    assert sd[add] == 1 and add not in tw, "the position table would need slicing too"
    assert sd[cs] == 1 and cs not in tw
    assert sd[mean] is None and sd[sl] is MIXED, "a mean over the sequence is whole; a shifted slice is not"


def _mixing_graph():
    """x -> a = x*2 -> m = a.cumsum(seq) -> b = a + m: b cannot join a's region (m runs between)."""

    def fn(x, w):
        a = F.linear(x * 2, w)
        m = a.cumsum(1)
        return (a.tanh() + m).exp()

    return _export_block(fn, (2, 12, 5), (5, 5), activations=[0])


def test_a_region_never_swallows_a_path_through_a_position_mixing_op():
    gm, acts = _mixing_graph()
    x = torch.randn(2, 12, 5)
    w = torch.randn(5, 5)
    want = gm(x, w)
    rewritten = copy.deepcopy(gm)
    assert chunk_sequence_regions(rewritten, batch=2, seq_len=12, activations=acts, chunk_bytes=1) == 2
    calls = _calls(rewritten)
    cs = next(n for n in rewritten.graph.nodes if n.target is aten.cumsum.default)
    # The cumsum reads the first region and feeds the second.
    assert calls[0] in {a.args[0] for a in cs.all_input_nodes if a.target is operator.getitem}
    assert aten.exp.default in _region_targets(rewritten, calls[1])
    torch.testing.assert_close(rewritten(x, w), want, rtol=1e-5, atol=0)


# -- the pass on traced models -----------------------------------------------------------------------

@pytest.mark.parametrize("seq", [8, 64])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt], ids=["llama", "gpt"])
def test_tiny_models_are_unchanged_under_the_default_threshold(make, seq):
    t = trace(make(layers=2), micro_batch_size=2, seq_len=seq)
    assert not any(_calls(gm) for gm in t.templates)


def test_a_llama_block_becomes_two_regions_around_attention():
    t = trace(tiny_llama(layers=2), micro_batch_size=2, seq_len=16, seq_chunk_bytes=1000)
    g = t.graph
    block = t.templates[g.layers[1].template]
    a, b = _calls(block)
    ra, rb = _region_targets(block, a), _region_targets(block, b)
    assert ra.count(aten.linear.default) == 3 and aten.rsqrt.default in ra and aten.cat.default in ra, \
        "input norm, q/k/v projections and the rotary embedding"
    assert rb.count(aten.linear.default) == 4 and aten.silu.default in rb and rb.count(aten.rsqrt.default) == 1, \
        "o projection, post-attention norm and the MLP"
    sdpa = next(n for n in block.graph.nodes if n.target in (aten.scaled_dot_product_attention.default,
                                                             grouped_query_attention))  # GQA: the kernel

    def source(x):
        while x.target is not operator.getitem:
            x = x.args[0]  # views the pass leaves outside the region
        return x.args[0]
    assert {source(x) for x in sdpa.all_input_nodes} == {a}, "attention reads region (a)'s outputs"
    # Parameters are passed whole; the residual stream and the rotary tables are sliced.
    for call, sliced in ((a, 3), (b, 2)):  # stream, cos, sin; attention's output, residual
        dims = {arg.name: d for arg, d in zip(call.args[4:], call.args[2])}
        assert all(d is None for name, d in dims.items() if name.startswith("p_")), dims
        assert sum(d is not None for d in dims.values()) == sliced, dims
    assert a.args[1] == b.args[1] == 16, "chunks are capped at the sequence length"
    (head,) = _calls(t.templates[g.layers[-1].template])
    assert aten.rsqrt.default in _region_targets(t.templates[g.layers[-1].template], head), "the final norm"


def test_a_chunk_size_below_one_byte_is_refused_with_the_fix():
    from megatrain.errors import TraceError

    with pytest.raises(TraceError, match="seq_chunk_bytes.*None"):
        trace(tiny_gpt(layers=1), micro_batch_size=1, seq_len=8, seq_chunk_bytes=0)


def test_chunking_counts_the_recompute_in_the_backward_flops():
    b, s, d, ff = 2, 16, 32, 64
    model = tiny_llama(layers=1, hidden=d, device="meta")
    plain = trace(model, micro_batch_size=b, seq_len=s, seq_chunk_bytes=None).graph.layers[1]
    chunked = trace(model, micro_batch_size=b, seq_len=s, seq_chunk_bytes=1000).graph.layers[1]
    kv = d // 2
    qkv_o, gate_up, down = 2 * b * s * (2 * d * d + 2 * d * kv), 2 * b * s * 2 * d * ff, 2 * b * s * ff * d
    assert chunked.fwd_flops == plain.fwd_flops == qkv_o + gate_up + down + 4 * b * s * s * d
    assert plain.bwd_flops == 3 * plain.fwd_flops
    # The regions' projections run once more in the backward, but for the MLP's down projection:
    # region (b) ends in it and a residual add, and the checkpoint stops recomputing once every
    # tensor the backward saved is back (a matmul saves its inputs before it runs).
    assert chunked.bwd_flops == plain.bwd_flops + qkv_o + gate_up


def test_retarget_rewrites_devices_inside_the_regions():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.out = nn.Linear(8, 16)

        def forward(self, input_ids, labels):
            x = self.emb(input_ids)
            for blk in self.blocks:
                x = x + torch.ones_like(x, device=x.device) * blk(x).tanh()
            return F.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())

    with torch.device("meta"):
        model = Net()
    t = trace(model, micro_batch_size=1, seq_len=8, seq_chunk_bytes=1)
    block = t.templates[t.graph.layers[1].template]
    (call,) = _calls(block)
    region = getattr(block, call.args[0].target)
    has_device = [n for n in region.graph.nodes if n.kwargs.get("device") is not None]
    assert has_device and all(n.kwargs["device"] == torch.device("meta") for n in has_device)
    moved = retarget(block, "cpu")
    region = getattr(moved, call.args[0].target)
    assert all(n.kwargs["device"] == torch.device("cpu") for n in region.graph.nodes if "device" in n.kwargs)


# -- exactness ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("make,chunk_bytes", [(tiny_llama, 1000), (tiny_llama, 1), (tiny_gpt, 3000)],
                         ids=["llama-few-chunks", "llama-one-token-chunks", "gpt"])
def test_chunked_training_matches_eager(monkeypatch, make, chunk_bytes):
    monkeypatch.setattr(megatrain.planner.front, "trace", functools.partial(trace, seq_chunk_bytes=chunk_bytes))
    torch.manual_seed(0)
    trainer = assert_same_training(make(layers=2), steps=6, micro_batches=2)
    chunks = [c.args[1] for gm in trainer.traced.templates for c in _calls(gm)]
    assert len(chunks) >= 2 and all(1 < c <= 16 for c in chunks)
    # The evaluation forward (no_grad: chunks without checkpoints) equals the trained model's loss.
    batch = random_batch(2, 16, 96, seed=7)
    with torch.no_grad():
        want = trainer.model(**batch)
    want = (want if isinstance(want, torch.Tensor) else want.loss).item()
    assert trainer.evaluate(batch) == pytest.approx(want, rel=1e-5)


def test_chunked_bf16_compute_tracks_eager_autocast(monkeypatch):
    """Sequence-chunked regions with BF16 compute: every step within the derived BF16 bounds of
    eager autocast at the same weights (``test_exactness.bf16_tolerances``)."""
    monkeypatch.setattr(megatrain.planner.front, "trace", functools.partial(trace, seq_chunk_bytes=1000))
    torch.manual_seed(5)
    model = tiny_llama(layers=2)
    batches = [random_batch(2, 16, 96, seed=s % 3) for s in range(12)]
    trainer = megatrain.compile(model, seq_len=16, micro_batch_size=2, optimizer=ADAMW,
                                plan=Plan(compute_dtype="bfloat16"))
    assert _calls(trainer.traced.templates[1])
    assert_bf16_tracks_eager(model, trainer, batches, blocks=2)


# -- working memory: the model against measured peaks ------------------------------------------------

def _measured_peak(fn) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before, from the CPU
    allocator's events as the profiler records them (every allocation and free, in order).

    One intra-op thread: the CPU attention kernels keep per-thread buffers, which would make the
    figure depend on the machine's core count.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fn()  # warm up: one-time allocations of a first call are not the layer's
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        torch.set_num_threads(threads)
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    cur = peak = 0
    for _, size in sorted(events):
        cur += size
        peak = max(peak, cur)
    return peak


def _local_backward(traced, li: int):
    """A closure running layer ``li``'s local backward as the executor does: the template over views
    of a flat weight tile, then ``torch.autograd.grad`` for the tile and the inputs that need it."""
    g = traced.graph
    layer = g.layers[li]
    tmpl = retarget(traced.templates[layer.template], "cpu")
    gen = torch.Generator().manual_seed(li)
    flat = (torch.randn(layer.numel, generator=gen) * 0.1).requires_grad_()
    params = [flat[p.offset:p.offset + p.numel].view(p.shape) for p in layer.params]
    ins = []
    for vid in layer.inputs:
        v = g.values[vid]
        if v.dtype.startswith("int"):
            ins.append(torch.randint(0, 90, v.shape, generator=gen))
        else:
            ins.append(torch.randn(v.shape, generator=gen).requires_grad_(v.requires_grad))
    seeds = [torch.randn(g.values[vid].shape, generator=gen) if vid != g.loss else torch.tensor(1.0)
             for vid in layer.outputs]

    def run():
        outs = tmpl(*params, *ins)
        grads = torch.autograd.grad(outs, [flat] + [x for x in ins if x.requires_grad], seeds)
        del outs, grads

    return run


@functools.cache
def _traced_1024(chunk_bytes: int | None):
    """One Llama block (hidden 256, 4 heads) at 1024 tokens: tensors of 1 MiB, a chunk of 256 KiB."""
    torch.manual_seed(0)
    return trace(tiny_llama(layers=1, hidden=256, vocab=512), micro_batch_size=1, seq_len=1024,
                 seq_chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("chunk_bytes", [None, 1 << 18], ids=["whole", "chunked"])
def test_work_bytes_bound_the_measured_peak_of_a_local_backward(chunk_bytes):
    traced = _traced_1024(chunk_bytes)
    assert bool(_calls(traced.templates[1])) == (chunk_bytes is not None)
    for li in (1, 2):  # a block, and the final norm + chunked LM head + loss
        work = traced.graph.layers[li].work_bytes
        measured = _measured_peak(_local_backward(traced, li))
        assert measured <= work <= 3 * measured, f"layer {li}: measured {measured:,} B, modelled {work:,} B"


def test_chunking_lowers_both_the_modelled_and_the_measured_peak():
    whole, chunked = _traced_1024(None), _traced_1024(1 << 18)
    measured = [_measured_peak(_local_backward(t, 1)) for t in (whole, chunked)]
    modelled = [t.graph.layers[1].work_bytes for t in (whole, chunked)]
    assert modelled[1] < 0.5 * modelled[0] and measured[1] < 0.6 * measured[0], (modelled, measured)
