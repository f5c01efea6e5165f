"""The sequence-chunk pass: large token-wise regions of a layer run a chunk of the sequence at a time.

Norms, projections, rotary embeddings and MLPs compute each position on its own; at 512k tokens a
Llama-2-7B block's such ops create 160 GiB of intermediates. :func:`chunk_sequence_regions`
(Mini-Sequence Transformer, Luo et al. 2024, arXiv:2407.15892) finds the maximal regions of such
token-wise ops between attention calls and, where their intermediates exceed ``seq_chunk_bytes``,
runs each as one call of :func:`megatrain.kernels.sequence_chunked`, a checkpointed chunk of the
sequence at a time.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any, Collection, Sequence

import torch
import torch.fx as fx

from megatrain.kernels import sequence_chunked
from megatrain.planner.trace.fx_util import ATTENTION_OPS, allocated_bytes, allocates, bind, node_val, prod
from megatrain.units import GiB

if TYPE_CHECKING:
    from megatrain.planner.trace.context import TraceContext

_aten = torch.ops.aten

DEFAULT_SEQ_CHUNK_BYTES = 4 * GiB
"""Intermediate bytes above which :func:`chunk_sequence_regions` chunks a region, and about those
of one chunk (``ceil(intermediates / this)`` chunks).

Larger than the loss chunk (:data:`~megatrain.planner.trace.lm_head.DEFAULT_LOSS_CHUNK_BYTES`) on
purpose: the chunked LM head costs no extra FLOPs, but a chunked region is recomputed in the
backward, one more forward of its projections and MLP per step (a quarter more compute for a block
whose matmuls dominate), and the trace decides this without knowing the GPU. So only regions too
large for any GPU's comfort are chunked: a Llama-2-7B block's regions hold 0.5, 0.7 GiB of
intermediates at 4k tokens per micro-batch (not chunked; nor is the dense-120b preset's largest,
1.9 GiB at 4k) and 68, 91 GiB at 512k (17 and 23 chunks of 31k and 23k tokens, each still thousands
of rows for the matmuls). With 1 GiB instead, planning dense-120b at 4k tokens for an H200
(``bench/plan_scale.py``) predicts 44.5% MFU instead of 52.1%."""


class _Mixed:
    """Sequence dimension of a tensor whose positions cannot be told apart (attention scores, a
    slice along the sequence, the output of an op this pass does not know)."""

    def __repr__(self) -> str:
        return "MIXED"


MIXED = _Mixed()

# Ops that map each element on its own (besides those tagged ``pointwise``): casts, copies, aliases
# and the ``*_like`` constructors, whose output has the input's shape.
_ELEMENTWISE = {_aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default, _aten.type_as.default,
                _aten.contiguous.default, _aten.alias.default, _aten.detach.default, _aten.clone.default,
                _aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default,
                _aten.empty_like.default}
# Reductions over the dimensions named by their ``dim`` argument (all of them when it is None).
_REDUCTIONS = {_aten.mean.dim, _aten.sum.dim_IntList, _aten.amax.default, _aten.amin.default,
               _aten.var.correction, _aten.std.correction, _aten.var_mean.correction,
               _aten.logsumexp.default, _aten.linalg_vector_norm.default, _aten.max.dim, _aten.min.dim,
               _aten.argmax.default, _aten.argmin.default}
# Ops that normalise, accumulate or scan along one dimension ``dim``.
_ALONG_DIM = {_aten._softmax.default, _aten._log_softmax.default, _aten.softmax.int, _aten.log_softmax.int,
              _aten.cumsum.default, _aten.cumprod.default, _aten.logcumsumexp.default}
_NORMS = {_aten.layer_norm.default, _aten.native_layer_norm.default, _aten.rms_norm.default}
_SPLITS = {_aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default}
# Ops whose size argument names the sequence length: rewritten to -1 there inside a region.
_SIZED = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.expand.default}


def _reshaped_seq_dim(src: Sequence[int], d: int, dst: Sequence[int], seq_len: int):
    """Where dimension ``d`` of a row-major ``src``-shaped tensor lands in a reshape to ``dst``: the
    dimension ``j`` with ``dst[j] == seq_len`` and the same number of elements before it, or MIXED
    (the sequence dimension is merged with or split into others)."""
    before, acc = prod(src[:d]), 1
    for j, size in enumerate(dst):
        if acc == before and size == seq_len:
            return j
        acc *= size
    return MIXED


def _seq_rule(n: fx.Node, sd: dict[fx.Node, Any], tokenwise: set[fx.Node], seq_len: int) -> tuple[Any, bool]:
    """(Sequence dimension of ``n``'s value, whether ``n`` is token-wise), given its inputs'."""
    v = node_val(n)
    ins = n.all_input_nodes
    dims = [sd.get(a, MIXED) for a in ins]
    if n.target is operator.getitem:
        src, i = n.args[0], n.args[1]
        d = sd.get(src, MIXED)
        return (d[i], src in tokenwise) if isinstance(d, tuple) else (d if d is None else MIXED, False)
    if any(d is MIXED or isinstance(d, tuple) for d in dims):
        return MIXED, False
    if all(d is None for d in dims):
        return None, False  # computed without the sequence: whole in every chunk
    t = n.target
    if t in ATTENTION_OPS:
        q = n.args[0]
        nd = node_val(q).dim()
        return (nd - 2, False) if sd.get(q) == nd - 2 else (MIXED, False)
    if not isinstance(t, torch._ops.OpOverload) or not isinstance(v, (torch.Tensor, list, tuple)):
        return MIXED, False
    if torch.Tag.pointwise in t.tags or t in _ELEMENTWISE:
        nd = v.dim()
        aligned = {d + nd - node_val(a).dim() for a, d in zip(ins, dims) if d is not None}
        if len(aligned) != 1:
            return MIXED, False
        od = aligned.pop()
        # An input without the sequence broadcasts over it only where its size there is 1 (a
        # learned position table of size S added to the stream is not sliced with the chunk).
        whole = True
        for a, d in zip(ins, dims):
            if d is None:
                av = node_val(a)
                k = av.dim() - (nd - od) if isinstance(av, torch.Tensor) else -1
                whole = whole and (k < 0 or av.shape[k] == 1)
        return od, whole
    a = bind(n)
    if t is _aten.embedding.default:
        return sd.get(a["indices"], MIXED), False  # a gather from the table: its gradient is table-sized
    # From here on the first input (``self``/``input``) carries the sequence; for all but cat and
    # stack every other tensor input (weights, biases) must be without it.
    x = ins[0]
    d = sd.get(x)
    joins = t in (_aten.cat.default, _aten.stack.default)
    if not isinstance(d, int) or (not joins and any(sd.get(o) is not None for o in ins[1:])):
        return MIXED, False
    xv = node_val(x)
    nd = xv.dim()
    if t is _aten.linear.default or t in (_aten.matmul.default, _aten.mm.default):
        w = node_val(ins[1])
        ok = d != nd - 1 and (t is _aten.linear.default or w.dim() <= 2)
        return (d, True) if ok else (MIXED, False)
    if t in _NORMS:
        k = len(a["normalized_shape"])
        if d >= nd - k:
            return MIXED, False
        return ((d,) * 3 if t is _aten.native_layer_norm.default else d), True
    if t in _REDUCTIONS:
        red = a.get("dim")
        if red is None or (isinstance(red, (list, tuple)) and not red):
            return None, False  # reduced over the whole sequence: the same value for every chunk
        red = [r % nd for r in ([red] if isinstance(red, int) else red)]
        if d in red:
            return None, False
        od = d if a.get("keepdim", False) else d - sum(r < d for r in red)
        return ((od,) * len(v) if isinstance(v, (list, tuple)) else od), True
    if t in _ALONG_DIM:
        # Along the sequence (a softmax over keys, a cumulative sum) each output position reads
        # others, but it is still the same position: later token-wise ops may slice it.
        return d, a["dim"] % nd != d
    if t in (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.flatten.using_ints):
        return _reshaped_seq_dim(xv.shape, d, v.shape, seq_len), True
    if t is _aten.transpose.int:
        d0, d1 = a["dim0"] % nd, a["dim1"] % nd
        return (d1 if d == d0 else d0 if d == d1 else d), True
    if t is _aten.permute.default:
        return [p % nd for p in a["dims"]].index(d), True
    if t is _aten.t.default:
        return (nd - 1 - d if nd == 2 else d), True
    if t is _aten.unsqueeze.default:
        k = a["dim"] % (nd + 1)
        return (d + 1 if k <= d else d), True
    if t in (_aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default):
        named = a.get("dim", None) if t is not _aten.squeeze.default else None
        cand = range(nd) if named is None else [r % nd for r in ([named] if isinstance(named, int) else named)]
        gone = [r for r in cand if xv.shape[r] == 1]
        return (MIXED, False) if d in gone else (d - sum(r < d for r in gone), True)
    if t is _aten.expand.default:
        return d + v.dim() - nd, True
    if t is _aten.slice.Tensor:
        k = a["dim"] % nd
        if k != d:
            return d, True
        whole = a["start"] in (None, 0) and (a["end"] is None or a["end"] >= seq_len) and a["step"] == 1
        return (d, True) if whole else (MIXED, False)
    if t is _aten.narrow.default:
        return (d, True) if a["dim"] % nd != d else (MIXED, False)
    if t is _aten.select.int:
        k = a["dim"] % nd
        return (d - (k < d), True) if k != d else (MIXED, False)
    if t in _SPLITS or t is _aten.unbind.int:
        k = a["dim"] % nd
        if k == d:
            return MIXED, False
        od = d - (k < d) if t is _aten.unbind.int else d
        return (od,) * len(v), True
    if t in (_aten.cat.default, _aten.stack.default):
        out_nd = v.dim()
        k = a["dim"] % out_nd
        if any(sd.get(o) != d for o in ins):
            # A tensor without the sequence joined to ones with it would need slicing too.
            return MIXED, False
        if t is _aten.cat.default:
            return (d, True) if k != d else (MIXED, False)
        return d + (k <= d), True
    return MIXED, False


def sequence_dims(gm: fx.GraphModule, *, batch: int, seq_len: int,
                  activations: Collection[str]) -> tuple[dict[fx.Node, Any], set[fx.Node]]:
    """The sequence dimension of every value of template ``gm`` and its token-wise nodes.

    A placeholder named in ``activations`` (a layer input, not a parameter or buffer) has its
    sequence dimension at index 1 when its shape starts ``(batch or 1, seq_len)`` (the residual
    stream ``(B, S, D)``, rotary tables ``(1, S, D)``), and none otherwise, unless ``seq_len`` is
    one of its sizes (a ``(B, 1, S, S)`` mask: MIXED). Parameters, buffers and constants have none.
    From there each op's rule (:func:`_seq_rule`) carries the dimension through: elementwise ops
    with broadcasting, reductions and norms over other dimensions, linear layers, reshapes that
    keep the sequence dimension whole, transposes, permutes, (un)squeezes, slices, splits and
    concatenations along other dimensions. A value's entry is an int, None (no sequence dimension:
    computed without the sequence, or reduced over all of it, so the same for every chunk) or
    MIXED; a tuple of those for an op returning several. Token-wise nodes compute output positions
    ``[a, b)`` from input positions ``[a, b)`` alone; attention and anything mixing positions is
    not, though its output may still have a known sequence dimension (SDPA's is its query's, a
    cumulative sum's its input's).
    """
    sd: dict[fx.Node, Any] = {}
    tokenwise: set[fx.Node] = set()
    for n in gm.graph.nodes:
        v = node_val(n)
        if n.op == "placeholder":
            if n.name in activations and isinstance(v, torch.Tensor) and seq_len > 1:
                lead = tuple(v.shape[:2])
                sd[n] = 1 if lead in ((batch, seq_len), (1, seq_len)) else (MIXED if seq_len in v.shape else None)
            else:
                sd[n] = None
        elif n.op == "get_attr":
            sd[n] = None
        elif n.op == "call_function":
            d, tw = _seq_rule(n, sd, tokenwise, seq_len)
            vals = v if isinstance(d, tuple) else (v,)
            dd = d if isinstance(d, tuple) else (d,)
            if len(vals) != len(dd) or any(
                    isinstance(k, int) and not (isinstance(x, torch.Tensor) and 0 <= k < x.dim()
                                                and x.shape[k] == seq_len) for k, x in zip(dd, vals)):
                d, tw = MIXED, False  # a rule's claim the shapes do not bear out: do not trust it
            tw = tw and all(isinstance(k, int) for k in dd)  # a chunk is a slice of every output
            sd[n] = d
            if tw:
                tokenwise.add(n)
    return sd, tokenwise


def _find_regions(gm: fx.GraphModule, tokenwise: set[fx.Node]) -> list[list[fx.Node]]:
    """Maximal connected sets of token-wise nodes, each of which can become one call.

    Regions grow in graph order: a token-wise node joins the regions of its token-wise inputs,
    merging them, unless that would put a node outside the region on a path from the region back
    into it (a region feeding attention whose output feeds the region again would become a call
    that needs its own output). Then it tries each of those regions alone, largest first, and
    else starts a region of its own. ``deps[n]`` is the set of regions ``n`` depends on.
    """
    parent: dict[fx.Node, fx.Node] = {}

    def find(r: fx.Node) -> fx.Node:
        while parent[r] is not r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    members: dict[fx.Node, list[fx.Node]] = {}
    outside: dict[fx.Node, set[fx.Node]] = {}  # region -> inputs its members read from outside it
    region_of: dict[fx.Node, fx.Node] = {}
    deps: dict[fx.Node, set[fx.Node]] = {}

    def roots(s: set[fx.Node]) -> set[fx.Node]:
        return {find(r) for r in s}

    def convex(group: set[fx.Node], n: fx.Node) -> bool:
        inside = set().union(*(members[r] for r in group)) | {n}
        reads = set().union(*(outside[r] for r in group)) | set(n.all_input_nodes)
        return not any(roots(deps.get(z, set())) & group for z in reads - inside)

    for n in gm.graph.nodes:
        dep = set()
        for a in n.all_input_nodes:
            dep |= deps.get(a, set())
        if n in tokenwise:
            cands = {find(region_of[a]) for a in n.all_input_nodes if a in region_of}
            trials = [cands] + [{c} for c in sorted(cands, key=lambda r: -len(members[r]))] if cands else []
            group = next((g for g in trials if convex(g, n)), None)
            if group is None:
                parent[n] = n
                members[n], outside[n] = [n], set(n.all_input_nodes)
                r = n
            else:
                r, *rest = sorted(group, key=lambda x: -len(members[x]))
                for q in rest:
                    parent[q] = r
                    members[r] += members.pop(q)
                    outside[r] |= outside.pop(q)
                members[r].append(n)
                outside[r] |= set(n.all_input_nodes)
                outside[r] -= set(members[r])
            region_of[n] = r
            dep.add(r)
        deps[n] = dep
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [sorted(m, key=order.__getitem__) for m in members.values()]


def _region_plan(gm: fx.GraphModule, region: list[fx.Node], sd: dict[fx.Node, Any]):
    """(members, external inputs in first-use order, outputs, intermediate bytes) of a region, or
    None when an output is not a single tensor (it could not be concatenated).

    Views and aliases of the region's inputs, and views the region would only return, leave it
    first: they cost nothing outside, while an output of the region is a new tensor (the chunks'
    concatenation), which for an alias of the residual stream (an FP32 model's no-op
    ``.to(float32)``) would be a copy of it.
    """
    inside = set(region)
    peeled = True
    while peeled:
        peeled = False
        for m in list(region):
            if allocates(m) or m.target is operator.getitem:
                continue
            if not inside & set(m.all_input_nodes) or not inside & set(m.users):
                region.remove(m)
                inside.discard(m)
                peeled = True
    if not region:
        return None
    inputs: list[fx.Node] = []
    for m in region:
        for a in m.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [m for m in region if any(u not in inside for u in m.users)]
    if any(not isinstance(node_val(o), torch.Tensor) or not isinstance(sd[o], int) for o in outputs):
        return None
    work = sum(allocated_bytes(m) for m in region if m not in outputs)
    return region, inputs, outputs, work


def _extract_region(gm: fx.GraphModule, region: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                    sd: dict[fx.Node, Any]) -> fx.GraphModule:
    """The region as a GraphModule ``(*inputs) -> tuple(outputs)`` whose size arguments leave the
    sequence length free (-1), so one module runs every chunk."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, a in enumerate(inputs):
        env[a] = g.placeholder(f"in_{k}")
        env[a].meta = dict(a.meta)
    for m in region:
        new = g.node_copy(m, lambda x: env[x])
        if m.target in _SIZED:
            size = list(node_val(m).shape)
            size[sd[m]] = -1
            new.args = (new.args[0], size, *new.args[2:])
        env[m] = new
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(torch.nn.Module(), g)


def chunk_sequence_regions(gm: fx.GraphModule, *, batch: int, seq_len: int, activations: Collection[str],
                           chunk_bytes: int = DEFAULT_SEQ_CHUNK_BYTES) -> int:
    """Run each large token-wise region of template ``gm`` a chunk of the sequence at a time.

    The method of Mini-Sequence Transformer (Luo et al. 2024, arXiv:2407.15892): a block's norms,
    projections, rotary embeddings and MLP treat every position on its own, so they can run on
    slices of the sequence, and with each slice checkpointed a local backward holds one slice's
    intermediates at a time. :func:`sequence_dims` finds the token-wise nodes and
    :func:`_find_regions` groups them into maximal regions that attention (or any op mixing
    positions) separates; for a Llama block that is (a) the input RMSNorm, the q/k/v projections
    and the rotary embedding, up to attention's inputs, and (b) from attention's output the o
    projection, the residual add, the second RMSNorm, the MLP and the second residual add.

    A region whose intermediates (the non-view tensors its nodes create, less its outputs) exceed
    ``chunk_bytes`` is replaced by one call of :func:`megatrain.kernels.sequence_chunked` over a
    nested GraphModule (a submodule ``seq_chunk_<k>`` of ``gm``, read by a ``get_attr`` node),
    with ``min(seq_len, ceil(intermediates / chunk_bytes))`` chunks. Inputs with a sequence
    dimension are sliced along it; parameters, buffers and values computed without the sequence
    are passed whole. ``activations`` names the placeholders that are layer inputs (only they can
    carry the sequence). Rewrites ``gm`` in place; returns the number of regions rewritten (0
    leaves ``gm`` as it was).
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_sequence_regions: chunk_bytes must be >= 1, got {chunk_bytes}")
    sd, tokenwise = sequence_dims(gm, batch=batch, seq_len=seq_len, activations=activations)
    g = gm.graph
    done = 0
    for region in _find_regions(gm, tokenwise):
        plan = _region_plan(gm, region, sd)
        if plan is None:
            continue
        region, inputs, outputs, work = plan
        chunks = min(seq_len, -(-work // chunk_bytes))
        if chunks < 2:
            continue
        sub = _extract_region(gm, region, inputs, outputs, sd)
        name = f"seq_chunk_{done}"
        while hasattr(gm, name):
            name += "_"
        gm.add_submodule(name, sub)
        in_dims = tuple(sd[a] if isinstance(sd[a], int) else None for a in inputs)
        out_dims = tuple(sd[o] for o in outputs)
        inside = set(region)
        # Nodes between the region's first and last node that read its outputs, directly or not,
        # move after the call (none of them feeds the region, or the region would not be convex).
        moved: list[fx.Node] = []
        node = region[0].next
        while node is not region[-1]:
            if node not in inside and any(a in inside or a in moved for a in node.all_input_nodes):
                moved.append(node)
            node = node.next
        with g.inserting_after(region[-1]):
            attr = g.get_attr(name)
        with g.inserting_after(attr):
            call = g.call_function(sequence_chunked, (attr, chunks, in_dims, out_dims, *inputs))
        call.meta["val"] = tuple(node_val(o) for o in outputs)
        prev = call
        for k, o in enumerate(outputs):
            with g.inserting_after(prev):
                item = g.call_function(operator.getitem, (call, k))
            item.meta = dict(o.meta)
            sd[item] = sd[o]  # a later region may read it
            o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
            prev = item
        for m in moved:
            prev.append(m)
            prev = m
        for m in reversed(region):
            g.erase_node(m)
        done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


def chunk_sequences(ctx: TraceContext) -> None:
    """Pass: :func:`chunk_sequence_regions` on every layer with ``options.seq_chunk_bytes`` (None runs
    every region whole). A layer's activations are its inputs from other layers and the batch."""
    o = ctx.options
    if o.seq_chunk_bytes is None:
        return
    for layer in ctx.layers:
        chunk_sequence_regions(layer.module, batch=o.micro_batch_size, seq_len=o.seq_len,
                               activations={a.name for a in layer.inputs}, chunk_bytes=o.seq_chunk_bytes)


__all__ = ["DEFAULT_SEQ_CHUNK_BYTES", "MIXED", "chunk_sequence_regions", "chunk_sequences", "sequence_dims"]
