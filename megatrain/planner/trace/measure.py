"""Measure each layer: its working memory by a liveness simulation, its FLOPs, launches and kernel profile.

FLOPs are counted by running each template once on the meta device under
``torch.utils.flop_counter.FlopCounterMode`` (forward, then forward plus backward for the local
backward), so attention FLOPs are included exactly as the kernels see them; launches likewise with
:func:`megatrain.ir.issue.count_launches`; each template's kernel profile (every op a forward and a
local backward dispatch, fused attention counted as the one kernel a GPU runs) with
:func:`megatrain.ir.profile.profile_template`. A layer's ``work_bytes`` comes from a liveness
simulation of its local backward over the template (:func:`work_bytes`): what its forward creates,
the gradients its backward creates, and what the chunked kernels hold inside, at the peak.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Sequence

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from megatrain.kernels import (chunk_bounds, grouped_query_attention, linear_cross_entropy,
                               linear_cross_entropy_work_bytes, sequence_chunked)
from megatrain.ir.graph import retarget
from megatrain.ir.issue import count_launches
from megatrain.ir.profile import profile_template
from megatrain.planner.trace.fx_util import ATTENTION_OPS, allocates, is_float, node_val, value_bytes

if TYPE_CHECKING:
    from megatrain.planner.trace.context import TraceContext

_aten = torch.ops.aten

def _grad_kinds(params: Sequence[fx.Node], inputs: Sequence[fx.Node], trainable: dict[str, bool],
                param_of: dict[str, str], needs_grad: set[fx.Node]) -> dict[str, str]:
    """What the executor's local backward differentiates: every parameter view of the flat tile when
    the layer has a trainable parameter (the whole tile requires grad), and the inputs that depend
    on a parameter."""
    kinds = {}
    if any(trainable[param_of[a.name]] for a in params):
        kinds.update((a.name, "keep") for a in params)
    kinds.update((a.name, "boundary") for a in inputs if a in needs_grad and is_float(node_val(a)))
    return kinds


def _flat_bytes(params: Sequence[fx.Node], numel: int, trainable: dict[str, bool], param_of: dict[str, str]) -> int:
    """Bytes of the gradient of a layer's flat tile of ``numel`` elements (none without trainable
    parameters), in the parameters' dtype."""
    if not any(trainable[param_of[a.name]] for a in params):
        return 0
    return numel * max(node_val(a).element_size() for a in params)


# Ops whose backward hands the output's gradient to the input as it is or as a view of it.
_GRAD_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.flatten.using_ints,
               _aten.transpose.int, _aten.permute.default, _aten.t.default, _aten.unsqueeze.default,
               _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default, _aten.alias.default,
               _aten.clone.default, _aten.contiguous.default}


def _passes_gradient(n: fx.Node) -> bool:
    if n.target is operator.getitem or n.target in _GRAD_VIEWS:
        return True
    return n.target in (_aten.to.dtype, _aten.to.dtype_layout) and not allocates(n)


def _differentiable(gm: fx.GraphModule, grad_kinds: dict[str, str]) -> set[fx.Node]:
    """Nodes whose value requires grad: floating point and computed from a placeholder named in
    ``grad_kinds`` (a grad-disabling higher-order op cuts the chain)."""
    rg = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in grad_kinds}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not any(a in rg for a in n.all_input_nodes):
            continue
        if n.target is torch.ops.higher_order.wrap_with_set_grad_enabled and not n.args[0]:
            continue
        v = node_val(n)
        vals = v if isinstance(v, (list, tuple)) else (v,)
        if any(is_float(x) for x in vals):
            rg.add(n)
    return rg


def _op_memory(gm: fx.GraphModule, n: fx.Node, nbytes, rg: set[fx.Node]) -> tuple[int, int, int, int]:
    """What op ``n`` holds beyond its output: (bytes it allocates with its output and frees in its
    backward, a transient at its forward, bytes held from its forward to its backward, a transient
    at its backward)."""
    t = n.target
    if t is sequence_chunked:
        return (0, *_chunked_memory(gm, n, nbytes, rg))
    if t is linear_cross_entropy:
        # The kernel computes its gradients in the forward and holds them until the backward.
        held = sum(nbytes(a) for a in n.args[:3] if isinstance(a, fx.Node) and a in rg)
        return 0, _linear_cross_entropy_work(n), held, 0
    if t in ATTENTION_OPS:
        q = node_val(n.args[0])
        rows = q.numel() // q.shape[-1]
        expanded = 0
        if t is grouped_query_attention:
            # Where it expands K and V to the query heads (FP32 on CUDA), SDPA saves the expanded
            # copies until the backward, which creates their gradients before summing each group
            # (as FlashAttention-2's backward does for GQA itself: dk_expanded, dv_expanded).
            k, v = node_val(n.args[1]), node_val(n.args[2])
            expanded = sum(x.numel() * x.element_size() * (q.shape[-3] // x.shape[-3]) for x in (k, v))
            dropout_p = n.args[4] if len(n.args) > 4 else 0.0
            if not isinstance(dropout_p, (int, float)) or dropout_p > 0:
                # With attention dropout it runs SDPA's math kernel (eager's masks), which saves the
                # softmax output, the dropout mask (bool) and the dropped scores, [..., H, L, S]
                # each, until the backward, and creates their gradients there.
                scores = rows * k.shape[-2]
                expanded += scores * (2 * q.element_size() + 1)
        # The flash and memory-efficient kernels save the FP32 logsumexp of every query row. The
        # FlashAttention-2 backward (Dao 2023, arXiv:2307.08691, algorithm 2) accumulates dq in FP32
        # and keeps an FP32 row sum per query, both over the sequence rounded up to 128 and dq over
        # the head size rounded up to 32 (64 beyond 128) (PyTorch flash_attn/flash_api.cpp, mha_bwd:
        # dq_accum, softmax_d).
        seq, head = q.shape[-2], q.shape[-1]
        padded_rows = rows // seq * _round_up(seq, 128)
        workspace = padded_rows * (_round_up(head, 32 if head <= 128 else 64) + 1) * 4
        return rows * 4, 0, expanded, workspace + expanded
    nested = [getattr(gm, a.target) for a in n.all_input_nodes
              if a.op == "get_attr" and isinstance(getattr(gm, a.target, None), fx.GraphModule)]
    if nested:  # a higher-order op: its body's intermediates, while it runs
        return 0, max(_simulate(m, value_bytes, {})[1] for m in nested), 0, 0
    return 0, 0, 0, 0


def _round_up(x: int, k: int) -> int:
    return -(-x // k) * k


def _chunked_memory(gm: fx.GraphModule, n: fx.Node, nbytes, rg: set[fx.Node]) -> tuple[int, int, int]:
    """(forward transient, held, backward transient) of a :func:`sequence_chunked` call.

    Forward: the chunks' outputs, all of which exist just before they are concatenated (the
    concatenation is the node's own value), plus one chunk's intermediates. Backward: one chunk's
    recompute and backward (:func:`_simulate` of the region with every tensor that has the sequence
    scaled to the largest chunk), plus the chunk gradients of each sliced input, which exist whole
    before the split's backward joins them.
    """
    region = getattr(gm, n.args[0].target)
    chunks, in_dims = n.args[1], n.args[2]
    args = list(n.args[4:])
    seq_len = next(node_val(a).shape[d] for a, d in zip(args, in_dims) if d is not None)
    largest = chunk_bounds(seq_len, chunks)[0]
    phs = [p for p in region.graph.nodes if p.op == "placeholder"]
    sliced = {p for p, d in zip(phs, in_dims) if d is not None}

    def inner_bytes(m: fx.Node) -> int:
        full = value_bytes(m)
        return full * largest // seq_len if (m.op == "call_function" or m in sliced) else full

    kinds = {p.name: "keep" for p, a in zip(phs, args) if a in rg}
    inner_peak, inner_fwd = _simulate(region, inner_bytes, kinds)
    pieces = sum(nbytes(a) for a, d in zip(args, in_dims) if d is not None and a in rg)
    return value_bytes(n) + inner_fwd, 0, inner_peak + pieces


def _simulate(gm: fx.GraphModule, nbytes, grad_kinds: dict[str, str], finalize: int = 0) -> tuple[int, int]:
    """(peak bytes of one forward + backward of ``gm``, peak of the forward alone), as modelled.

    ``nbytes(node)`` gives the bytes of a node's value (and of its gradient); ``grad_kinds`` maps
    the placeholders that require grad to ``"keep"`` (the gradient is this graph's to hold, to the
    end) or ``"boundary"`` (a layer input whose gradient the cost model already counts: only
    contributions beyond its first are transient here). ``finalize`` is added at the end. See
    :func:`work_bytes` for the model.
    """
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    rg = _differentiable(gm, grad_kinds)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    base: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        src = n.args[0] if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) else None
        base[n] = base.get(src, src) if src is not None and not allocates(n) else n
    pinned = {base[o] for o in out_node.all_input_nodes}  # the caller holds the outputs to the end
    live = peak = 0
    value: dict[fx.Node, int] = {}
    held: dict[fx.Node, int] = {}
    memory: dict[fx.Node, tuple[int, int, int, int]] = {}
    for n in nodes:
        memory[n] = extra, fwd_transient, keep, _ = _op_memory(gm, n, nbytes, rg)
        value[n] = (nbytes(n) if allocates(n) else 0) + extra
        live += value[n]
        peak = max(peak, live + fwd_transient)
        held[n] = keep
        live += keep
    fwd_peak = peak
    grads: dict[fx.Node, int] = {o: 0 for o in out_node.all_input_nodes if o in rg}  # seeds: the caller's
    for n in reversed(nodes):
        out_grad = grads.pop(n, None)
        if n in rg and out_grad is not None:
            xs = list(dict.fromkeys(a for a in n.all_input_nodes if a in rg))
            alloc, freed = 0, out_grad
            if _passes_gradient(n):
                for x in xs[:1]:
                    if x.op == "placeholder" and grad_kinds.get(x.name) == "boundary" and x not in grads:
                        grads[x] = 0  # it becomes the layer input's gradient, which the cost model counts
                    elif x not in grads:
                        grads[x], freed = out_grad, 0  # the input's gradient is the output's
                    elif n.target is operator.getitem:
                        grads[x], freed = grads[x] + out_grad, 0  # held apart until the op's backward
            else:
                for x in xs:
                    g = nbytes(x)
                    if x in grads:  # added into the gradient x already has, then freed
                        alloc, freed = alloc + g, freed + g
                    elif x.op == "placeholder" and grad_kinds.get(x.name) == "boundary":
                        grads[x] = 0
                    else:
                        grads[x] = g
                        alloc += g
            live += alloc
            peak = max(peak, live + memory[n][3])
            live -= freed
        if base[n] is n and n not in pinned:
            live -= value[n]
        live -= held[n]
    return max(peak, live + finalize), fwd_peak


def work_bytes(gm: fx.GraphModule, grad_kinds: dict[str, str], flat_bytes: int = 0) -> int:
    """Peak transient bytes of one local backward of template ``gm``, by a liveness simulation.

    The executor's local backward runs the template with gradients on and calls
    ``torch.autograd.grad`` on its outputs for the flat weight tile and the inputs that require
    grad. The model, over the template's nodes:

    - Forward, in node order: each op's new storage (views and aliases are free) is allocated and
      stays alive, as if autograd saved every intermediate for the backward.
    - Backward, in reverse node order, for each op that requires grad and gets a gradient: a
      gradient the size of each differentiable input is allocated (a view-like op hands its
      output's gradient on instead; a second contribution to a gradient is allocated and freed
      once added in); the output's gradient is freed; the op's own value is freed (its consumers'
      backward steps ran before it), unless it backs a template output, which the caller holds.
    - Op internals: a :func:`~megatrain.kernels.sequence_chunked` call holds, at its forward, its
      chunk outputs before concatenation plus one chunk's intermediates, and at its backward one
      chunk's recompute and backward (the same simulation over its region, sizes scaled to a
      chunk) plus the chunk gradients of its sliced inputs; :func:`linear_cross_entropy` holds
      :func:`~megatrain.kernels.linear_cross_entropy_work_bytes` at its forward and its gradients
      until its backward; attention saves an FP32 logsumexp per query row and its backward holds an
      FP32 dq accumulator and row sums (FlashAttention-2's workspace, padded as the kernel pads
      it); a higher-order op's body its own forward peak.
    - End: the parameter gradients (each accumulated in a buffer of its size) are gathered into
      the flat tile's gradient; each parameter's slice backward allocates a zero-filled tile, so
      ``2 * flat_bytes`` is counted on top of what is still alive then.

    Not counted (accounted elsewhere, as checkpoints, slots and boundary gradients): the layer's
    inputs, weights and buffers, the gradients arriving for its outputs, and the first
    contribution to each input's gradient (``grad_kinds[name] == "boundary"``). The cuBLAS
    workspaces of the matmuls are the GPU reserve's (:func:`megatrain.planner.cost.gpu_reserve`);
    other single kernels' scratch (norms) is small next to the tensors here.
    Since every intermediate is assumed held from its creation to its own backward step, the
    figure bounds a forward under ``no_grad`` too.
    """
    return _simulate(gm, value_bytes, grad_kinds, 2 * flat_bytes)[0]


def _linear_cross_entropy_work(n: fx.Node) -> int:
    hidden, weight, bias = (node_val(a) if isinstance(a, fx.Node) else None for a in n.args[:3])
    return linear_cross_entropy_work_bytes(
        hidden.shape[0], hidden.shape[1], weight.shape[0], n.args[6], dtype=torch.result_type(hidden, weight),
        logits_dtype=n.args[7], bias=bias is not None)


def count_flops(gm: fx.GraphModule, args: list[torch.Tensor], grad_args: list[bool]) -> tuple[int, int]:
    """(forward FLOPs, local backward FLOPs = recompute + backward) of one call, on meta."""
    fn = retarget(gm, torch.device("meta"))
    metas = [torch.empty(a.shape, dtype=a.dtype, device="meta") for a in args]
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        fn(*metas)
    fwd = fc.get_total_flops()
    leaves = [m.requires_grad_(g) if g else m for m, g in zip(metas, grad_args)]
    with FlopCounterMode(display=False) as fc, torch.enable_grad():
        outs = [o for o in fn(*leaves) if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [m for m, g in zip(leaves, grad_args) if g]
        if outs and wrt:
            # backward(), not autograd.grad(): FlopCounterMode's module hooks reject the latter.
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return int(fwd), int(fc.get_total_flops())


def measure(ctx: TraceContext) -> None:
    """Pass: each layer's ``work_bytes``, and the FLOPs and launches of each template (counted on
    the first layer that uses it, whose argument shapes every layer of the template shares)."""
    for layer in ctx.layers:
        kinds = _grad_kinds(layer.params, layer.inputs, ctx.trainable, ctx.param_of, ctx.needs_grad)
        layer.work_bytes = work_bytes(layer.module, kinds,
                                      flat_bytes=_flat_bytes(layer.params, layer.numel, ctx.trainable, ctx.param_of))
    ctx.flops = {}
    ctx.profiles = {}
    for layer in ctx.layers:
        if layer.template not in ctx.flops:
            tmpl = ctx.templates[layer.template]
            args = [node_val(a) for a in layer.params + layer.buffers + layer.inputs]
            grad_args = ([ctx.trainable[ctx.param_of[a.name]] for a in layer.params] + [False] * len(layer.buffers)
                         + [a in ctx.needs_grad and is_float(node_val(a)) for a in layer.inputs])
            ctx.flops[layer.template] = count_flops(tmpl, args, grad_args) + count_launches(tmpl, args, grad_args)
            ctx.profiles[layer.template] = profile_template(tmpl, args, grad_args)


__all__ = ["count_flops", "measure", "work_bytes"]
