"""The executor's local backward (``Executor._bwd``): each trainable weight is a leaf of its own and its
gradient is written into its slice of the gradient slot, with no full-tile ``slice_backward`` zero
fills and sums, bitwise equal to the gradients of one flat leaf over the slot (the former method).

The block under test has a hidden size of 24, so each norm weight (24 elements) is followed by 8
elements of alignment padding, and a frozen ``up_proj`` laid out after the trainable prefix."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatrain

from conftest import tiny_llama

SEQ, MBS = 16, 2


@pytest.fixture(scope="module")
def block():
    """A compiled one-block Llama with a frozen MLP weight; returns (trainer, block layer index)."""
    torch.manual_seed(0)
    model = tiny_llama(layers=1, hidden=24)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    trainer = megatrain.compile(model, seq_len=SEQ, micro_batch_size=MBS, micro_batches=2)
    li = next(layer.index for layer in trainer.graph.layers if layer.name == "model.layers.0")
    layer = trainer.graph.layers[li]
    assert layer.trainable_numel < layer.numel, "the frozen weight is laid out after the trainable prefix"
    assert any(p.offset + p.numel < q.offset for p, q in zip(layer.params, layer.params[1:])), "padding"
    return trainer, li


def _inputs(trainer, li: int, seed: int, dtype: torch.dtype):
    """Random slot weights (in ``dtype``), layer inputs and output gradients for micro-batch 0 and 1."""
    g = trainer.graph
    layer = g.layers[li]
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.randn(layer.numel, generator=gen) * 0.2).to(dtype)
    acts, seeds = {}, {}
    for mb in range(2):
        for vid in layer.inputs:
            v = g.values[vid]
            acts[(vid, mb)] = (torch.randint(0, 90, v.shape, generator=gen) if v.dtype.startswith("int")
                               else torch.randn(v.shape, generator=gen))
        for vid in layer.outputs:
            seeds[(vid, mb)] = torch.randn(g.values[vid].shape, generator=gen)
    return weights, acts, seeds


def _run_bwd(trainer, li: int, weights, acts, seeds, compute_dtype: str, mbs=(0,), mode=None):
    """Run the executor's local backward of layer ``li`` on slot 0 for micro-batches ``mbs`` (the first
    fresh, the rest accumulating), the slot's gradients pre-filled with NaN, under the dispatch
    ``mode`` when given; returns the gradient slot and the input gradients of the last micro-batch."""
    from megatrain.ir.plan import Plan
    from megatrain.planner.lower import lower
    from megatrain.runtime.executor import local_backward

    ex = trainer.executor
    schedule = lower(trainer.graph, Plan(micro_batches=2, compute_dtype=compute_dtype))
    bufs = ex._ensure_buffers(schedule)
    bufs.weights[0][:weights.numel()].copy_(weights)
    bufs.grads[0].fill_(float("nan"))
    grads = {}
    for k, mb in enumerate(mbs):
        grads = {key: t.clone() for key, t in seeds.items() if key[1] == mb}
        with mode or contextlib.nullcontext():
            local_backward(ex, li, mb, bufs.weights[0], bufs.grads[0], acts, grads, {}, lambda: 0.5, compute_dtype,
                           fresh=k == 0)()
    layer = trainer.graph.layers[li]
    return bufs.grads[0].clone(), {vid: grads[(vid, mbs[-1])] for vid in layer.inputs if (vid, mbs[-1]) in grads}


def _flat_view_grads(trainer, li: int, weights, acts, seeds, compute_dtype: str, mb: int = 0):
    """The former local backward: ``torch.autograd.grad`` with respect to one flat view of the slot
    (the whole tile), each parameter a view of it. Returns (tile gradient, input gradients)."""
    ex = trainer.executor
    g = trainer.graph
    layer = g.layers[li]
    tmpl = ex.templates[layer.template]
    with torch.enable_grad(), ex._precision(compute_dtype):
        flat = weights.clone().requires_grad_()
        ins, diff = [], []
        for vid in layer.inputs:
            x = acts[(vid, mb)].detach().requires_grad_(g.values[vid].requires_grad)
            ins.append(x)
            if x.requires_grad:
                diff.append((vid, x))
        outs = tmpl(*ex._bind(li, flat), *ex.layer_buffers[li], *ins)
        roots = [t for t in outs if t.requires_grad]
        res = torch.autograd.grad(roots, [flat] + [x for _, x in diff], [seeds[(vid, mb)] for vid in layer.outputs],
                                  allow_unused=True)
    return res[0], {vid: gx for (vid, _), gx in zip(diff, res[1:])}


class _Ops(TorchDispatchMode):
    """Records each aten op with the element counts of its tensor arguments and results."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = []
        for x in torch.utils._pytree.tree_leaves((args, kwargs, out)):
            if isinstance(x, torch.Tensor):
                sizes.append(x.numel())
        self.ops.append((func.overloadpacket.__name__, sizes))
        return out


def _tile_sized(ops: _Ops, numels: set[int]) -> list[str]:
    """Names of the zero/fill/add/copy ops (and slice_backward) that touch a tensor of a size in
    ``numels``. (Slices inside the layer, rotary's halves, have a slice_backward of their own.)"""
    kinds = ("zero", "fill", "add", "copy", "slice_backward", "zeros", "new_zeros")
    return [name for name, sizes in ops.ops
            if any(k in name for k in kinds) and numels.intersection(sizes)]


def test_local_backward_has_no_full_tile_zero_fills_or_sums(block):
    trainer, li = block
    layer = trainer.graph.layers[li]
    weights, acts, seeds = _inputs(trainer, li, seed=1, dtype=torch.float32)
    tile = {layer.numel, layer.trainable_numel}
    n_trained = sum(p.trainable for p in layer.params)

    with _Ops() as old:  # control: the flat-view method shows the pattern, so the counter can fail
        _flat_view_grads(trainer, li, weights, acts, seeds, "float32")
    assert "slice_backward" in {name for name, _ in old.ops}
    assert len(_tile_sized(old, tile)) >= n_trained, _tile_sized(old, tile)

    new = _Ops()
    _run_bwd(trainer, li, weights, acts, seeds, "float32", mode=new)
    assert _tile_sized(new, tile) == []
    # Besides the autograd graph: the padding zeroed, each gradient written into its slot slice.
    assert [name for name, _ in new.ops if name.startswith("_foreach")] == ["_foreach_zero_", "_foreach_copy_"]


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_local_backward_equals_the_flat_view_gradients_bitwise(block, compute_dtype):
    """Each parameter's gradient, the padding (zero) and the input gradients equal the flat-view
    method's exactly; so does a second micro-batch added into the slot. In BF16 both methods produce
    the same BF16 gradients (the flat one sums disjoint zero-padded tiles, which is exact) that the
    FP32 slot takes without rounding."""
    trainer, li = block
    layer = trainer.graph.layers[li]
    n = layer.trainable_numel
    dtype = torch.bfloat16 if compute_dtype == "bfloat16" else torch.float32
    weights, acts, seeds = _inputs(trainer, li, seed=2, dtype=dtype)

    got, gin = _run_bwd(trainer, li, weights, acts, seeds, compute_dtype)
    want, win = _flat_view_grads(trainer, li, weights, acts, seeds, compute_dtype)
    assert want.dtype is dtype and got.dtype is torch.float32
    assert torch.equal(got[:n], want[:n].float())
    assert torch.isnan(got[n:]).all(), "nothing past the trainable prefix is written"
    assert set(gin) == set(win) and all(torch.equal(gin[v], win[v]) for v in win)

    got2, gin2 = _run_bwd(trainer, li, weights, acts, seeds, compute_dtype, mbs=(0, 1))
    want2, win2 = _flat_view_grads(trainer, li, weights, acts, seeds, compute_dtype, mb=1)
    assert torch.equal(got2[:n], want[:n].float() + want2[:n].float())
    assert all(torch.equal(gin2[v], win2[v]) for v in win2)


def test_local_backward_without_incoming_gradients_zeroes_a_fresh_slot(block):
    """No output of the layer gets a gradient (no seeds): its weights' gradients are zero, and a fresh
    backward writes those zeros over whatever the slot held."""
    trainer, li = block
    layer = trainer.graph.layers[li]
    weights, acts, _ = _inputs(trainer, li, seed=3, dtype=torch.float32)
    got, gin = _run_bwd(trainer, li, weights, acts, {}, "float32")
    assert torch.equal(got[:layer.trainable_numel], torch.zeros(layer.trainable_numel))
    assert gin == {}
