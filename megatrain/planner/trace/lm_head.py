"""The LM-head pass: the epilogue's ``lm_head -> cast -> cross_entropy`` as one chunked kernel.

That subgraph would hold the ``[tokens, vocab]`` logits (64 GiB at 512k tokens x 32k vocabulary in
FP32). :func:`chunk_lm_head_loss` rewrites it into one call of
:func:`megatrain.kernels.linear_cross_entropy`, which never holds more than a chunk of them.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from megatrain.kernels import linear_cross_entropy
from megatrain.planner.trace.fx_util import bind, is_float, node_val, only_user
from megatrain.units import MiB

if TYPE_CHECKING:
    from megatrain.planner.trace.context import TraceContext

_aten = torch.ops.aten

DEFAULT_LOSS_CHUNK_BYTES = 256 * MiB
"""Bytes of one chunk of logits in :func:`chunk_lm_head_loss`, counted at 4 bytes a logit: about
2,100 tokens of a 32k vocabulary, 520 of a 128k one. Each chunk's matmul is still thousands of
rows by the full hidden size, large enough to run at full rate on a GPU."""

_CASTS = {_aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default}
_RESHAPES = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
_SAME = {_aten.contiguous.default, _aten.alias.default, _aten.clone.default}
_NLL = {_aten.nll_loss.default, _aten.nll_loss_nd.default, _aten.nll_loss_forward.default}
_LOG_SOFTMAX = {_aten.log_softmax.int, _aten._log_softmax.default}
_REDUCTION_NAMES = {1: "mean", 2: "sum"}  # at::Reduction; "none" (0) is left unfused


def find_cross_entropy(n: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node], dict] | None:
    """If ``n`` computes a cross-entropy: (its logits input, the node whose value is the loss, the
    nodes to remove, the arguments). Matches ``cross_entropy_loss`` and ``nll_loss(log_softmax)``."""
    if n.op != "call_function":
        return None
    if n.target is _aten.cross_entropy_loss.default:
        args = bind(n)
        return args["self"], n, [n], args
    if n.target in _NLL:
        args = bind(n)
        ls = args["self"]
        if not (isinstance(ls, fx.Node) and ls.op == "call_function" and ls.target in _LOG_SOFTMAX
                and only_user(ls) is n):
            return None
        lsa = bind(ls)
        x = lsa["self"]
        if lsa["dim"] not in (1, -1) or lsa.get("dtype") is not None or lsa.get("half_to_float"):
            return None
        args.update(label_smoothing=0.0)
        if n.target is _aten.nll_loss_forward.default:
            # (loss, total_weight): only the loss may be read.
            outs = list(n.users)
            if not (len(outs) == 1 and outs[0].target is operator.getitem and outs[0].args[1] == 0):
                return None
            return x, outs[0], [outs[0], n, ls], args
        return x, n, [n, ls], args
    return None


def _replay_on_hidden(g: fx.Graph, chain: list[fx.Node], hidden: fx.Node, vocab: int,
                      features: int) -> tuple[fx.Node | None, list[fx.Node]]:
    """Apply to ``hidden [..., features]`` the row ops ``chain`` applied to the logits ``[..., vocab]``.

    ``chain`` runs from the linear's output to the loss's input; casts and copies are skipped
    (the kernel casts its logits itself), reshapes keep the last dimension and swap its size,
    slices and flattens must not touch the last dimension. Returns the last new node (None for an
    op it cannot move) and the nodes it created.
    """
    cur, made = hidden, []
    for n in chain:
        src = node_val(n.args[0])
        last = src.dim() - 1
        if n.target in _CASTS or n.target in _SAME:
            continue
        if n.target in _RESHAPES:
            shape = list(n.args[1])
            if node_val(n).shape[-1] != vocab or shape[-1] not in (vocab, -1):
                return None, made
            target, rest = _aten.reshape.default, (shape[:-1] + [features],)
        elif n.target is _aten.slice.Tensor:
            a = bind(n)
            if a["dim"] % src.dim() == last:
                return None, made
            target, rest = _aten.slice.Tensor, (a["dim"], a["start"], a["end"], a["step"])
        elif n.target is _aten.flatten.using_ints:
            a = bind(n)
            if last in (a["start_dim"] % src.dim(), a["end_dim"] % src.dim()):
                return None, made
            target, rest = _aten.flatten.using_ints, (a["start_dim"], a["end_dim"])
        else:
            return None, made
        h = node_val(cur)
        new = g.call_function(target, (cur, *rest))
        new.meta["val"] = target(torch.empty(h.shape, dtype=h.dtype, device="meta"), *rest)
        made.append(new)
        cur = new
    return cur, made


def chunk_lm_head_loss(gm: fx.GraphModule, chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES) -> bool:
    """Fuse ``linear -> (casts, row reshapes) -> cross_entropy`` in ``gm`` into one chunked kernel.

    Finds a cross-entropy (``aten.cross_entropy_loss``, or ``nll_loss`` of ``log_softmax`` over the
    class dimension) with the mean or sum reduction, no class weights and no label smoothing,
    whose ``[tokens, vocab]`` input is a linear layer's output reached only through dtype casts,
    copies, and reshapes, slices or flattens of the leading dimensions (Hugging Face's
    ``logits.float().view(-1, V)``, or a GPT's ``logits[:, :-1].reshape(-1, V)``), each read by
    nothing else. It replaces them with :func:`megatrain.kernels.linear_cross_entropy` over the
    linear's input put through the same row ops, the weight, the bias, the unchanged labels and
    the loss's ``ignore_index`` and reduction. Chunks hold ``chunk_bytes // (vocab * 4)`` tokens
    (at least one). Rewrites ``gm`` in place; returns whether it found the pattern. A graph
    without it (a model whose loss is not a cross-entropy over an LM head) is left unchanged.
    """
    g = gm.graph
    for node in list(g.nodes):
        found = find_cross_entropy(node)
        if found is None:
            continue
        x, loss_node, loss_nodes, args = found
        if (args.get("weight") is not None or args.get("label_smoothing", 0.0) != 0.0
                or args["reduction"] not in _REDUCTION_NAMES or not isinstance(x, fx.Node)
                or not is_float(node_val(x)) or node_val(x).dim() != 2):
            continue
        chain, cur = [], x
        while cur.op == "call_function" and cur.target is not _aten.linear.default and len(chain) < 16:
            if len(cur.users) != 1 or not isinstance(cur.args[0], fx.Node):
                break
            chain.append(cur)
            cur = cur.args[0]
        if cur.op != "call_function" or cur.target is not _aten.linear.default or len(cur.users) != 1:
            continue
        la = bind(cur)
        hidden, weight, bias = la["input"], la["weight"], la.get("bias")
        w = node_val(weight)
        if w.dim() != 2 or node_val(x).shape[1] != w.shape[0]:
            continue
        vocab, features = w.shape
        logits_dtype = node_val(x).dtype
        # The kernel casts its logits once, straight to the loss's dtype, on the linear's device: a
        # chain through a third dtype would round differently, one across devices would move data.
        linear = node_val(cur)
        if any(node_val(n).dtype not in (linear.dtype, logits_dtype) or node_val(n).device != linear.device
               for n in chain):
            continue
        with g.inserting_before(loss_node):
            rows, made = _replay_on_hidden(g, chain[::-1], hidden, vocab, features)
            if rows is None or tuple(node_val(rows).shape) != (node_val(x).shape[0], features):
                for n in reversed(made):
                    g.erase_node(n)
                continue
            chunk = max(1, min(node_val(x).shape[0], chunk_bytes // (vocab * 4)))
            fused = g.call_function(linear_cross_entropy, (
                rows, weight, bias, args["target"], args["ignore_index"], _REDUCTION_NAMES[args["reduction"]],
                chunk, logits_dtype))
        fused.meta = dict(loss_node.meta)
        fused.meta["val"] = torch.empty((), dtype=logits_dtype, device="meta")
        loss_node.replace_all_uses_with(fused)
        # Users before what they read: the loss, then the chain back to the linear.
        for n in loss_nodes + chain + [cur]:
            g.erase_node(n)
        g.lint()
        gm.recompile()
        return True
    return False


def fuse_lm_head_loss(ctx: TraceContext) -> None:
    """Pass: :func:`chunk_lm_head_loss` on the layer that computes the loss, in chunks of
    ``options.loss_chunk_bytes`` logits (None leaves the LM head and loss as the model wrote them)."""
    if ctx.options.loss_chunk_bytes is None:
        return
    for layer in ctx.layers:
        if ctx.loss_node in layer.outputs:
            chunk_lm_head_loss(layer.module, ctx.options.loss_chunk_bytes)


__all__ = ["DEFAULT_LOSS_CHUNK_BYTES", "chunk_lm_head_loss", "find_cross_entropy", "fuse_lm_head_loss"]
