"""Replicated blocks: trace three blocks and repeat them, when every block is the same.

Export costs time in proportion to the ops it records, ~0.1 s per block of a 120B model. When every
block is the same module (same module types, parameter and buffer shapes, dtypes and
``requires_grad``, the same plain attributes and containers of them but for the block's own index,
the same shared objects, no per-layer entries in a Hugging Face config such as ``layer_types``:
:func:`why_not_replicate`), a shallow copy of the model keeping three blocks (the first, the middle
one, the last; :func:`short_copy`) is traced instead, and the full-depth graph is built by
repeating the middle block's layer record with its parameter names and value ids renumbered
(:func:`replicate`). It is used only when the three traced blocks agree (one template, the same
work bytes and FLOPs, the same wiring: each reads the batch, the prologue and the block before it,
and only the next layer reads its outputs); otherwise, or when the short copy fails to trace, the
full model is traced. ``graph.meta["trace"]`` says which (and ``meta["trace_full_because"]`` why
not). What the checks cannot see is Python in the model's forward that treats an untraced block
differently by its position alone (``if i == 17:``) or computes with the number of blocks
(``len(self.layers)``, which is 3 in the copy; transformers models read
``config.num_hidden_layers``, which the copy shares); the check on config lists covers the
transformers idiom for per-layer variation (``layer_types``).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from megatrain.ir.graph import Layer, LayerGraph, TracedModel
from megatrain.planner.trace.hf import hf_configs

if TYPE_CHECKING:
    from megatrain.planner.trace.context import TraceContext

# What every nn.Module keeps in its __dict__ (parameters, buffers, submodules, hooks): compared
# structurally below, not as attributes.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


# How deep containers in an attribute are compared by their contents; deeper ones by identity
# (which refuses equal copies, never accepts different ones, and stops at a self-referring list).
_CONTAINER_DEPTH = 4


def _attr_key(v: Any, depth: int = 0) -> Any:
    """An attribute as compared between blocks: plain data by value, anything else by identity
    (a config object all blocks share is the same; a tensor each block keeps is not). A
    ``functools.partial`` (transformers' activations keep one each) is its function and arguments.

    A built-in container (tuple, list, set, dict) is its contents, each compared by this same rule,
    so per-block copies of the same entries are equal and a container holding one block's own
    tensor or function is not. Transformers 5.6 and 5.7 keep such a dict on every module decorated
    with ``use_kernelized_func``: ``_hidden_kernels``, e.g. ``{"apply_rotary_pos_emb": <function>}``
    on each Llama ``self_attn``, a new dict per block naming the one module-level function that
    ``PreTrainedModel.kernelize`` may swap for a Hub kernel (5.4 and 5.5 set that function as a
    ``rotary_fn`` attribute instead; 5.23 without the ``kernels`` package sets neither). A container
    subclass that keeps state of its own in ``__dict__`` is compared by identity, as other objects.
    """
    if isinstance(v, _PLAIN):
        return ("value", v)
    if isinstance(v, functools.partial):
        return ("partial", _attr_key(v.func, depth), tuple(_attr_key(a, depth) for a in v.args),
                tuple(sorted((k, _attr_key(x, depth)) for k, x in v.keywords.items())))
    if (isinstance(v, (tuple, list, set, frozenset, dict)) and depth < _CONTAINER_DEPTH
            and not getattr(v, "__dict__", None)):
        kind = type(v)
        if isinstance(v, dict):
            # In order: a forward that walks the dict meets its entries in this order.
            items = v.items()
            return ("container", kind, tuple((_attr_key(k, depth + 1), _attr_key(x, depth + 1)) for k, x in items))
        if isinstance(v, (set, frozenset)):
            return ("container", kind, frozenset(_attr_key(x, depth + 1) for x in v))
        return ("container", kind, tuple(_attr_key(x, depth + 1) for x in v))
    return ("object", id(v))


def _fingerprint(block: nn.Module) -> dict[tuple, Any]:
    """What must match between two blocks for one's traced graph to stand for the other's."""
    out: dict[tuple, Any] = {}
    for path, mod in block.named_modules(remove_duplicate=False):
        out[("module", path)] = type(mod)
        for key, v in vars(mod).items():
            if key not in _MODULE_INTERNALS:
                out[("attr", path, key)] = _attr_key(v)
        for h in _HOOKS:
            out[("hooks", path, h)] = tuple(id(getattr(f, "__func__", f)) for f in getattr(mod, h, {}).values())
        out[("non-persistent", path)] = frozenset(mod._non_persistent_buffers_set)
    for name, p in block.named_parameters(remove_duplicate=False):
        out[("param", name)] = (tuple(p.shape), p.dtype, p.requires_grad, p.device, type(p))
    for name, b in block.named_buffers(remove_duplicate=False):
        out[("buffer", name)] = (tuple(b.shape), b.dtype, b.device)
    return out


def why_not_replicate(model: nn.Module, container: str | None) -> str | None:
    """None when the blocks of ``container`` are interchangeable up to their index, else why not."""
    if not container:  # None, or the root itself, which a copy cannot shorten
        return "no block container"
    blocks = list(model.get_submodule(container))
    if len(blocks) <= len(pick_blocks(len(blocks))):
        return f"{len(blocks)} blocks: no fewer to trace"
    if len({id(b) for b in blocks}) != len(blocks):
        return f"a module appears twice in {container}"
    params = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    if len(set(params)) != len(params):
        return "tied parameters"  # the full trace gives them one owner layer (cut._tie)
    prints = [_fingerprint(b) for b in blocks]
    if any(p.keys() != prints[0].keys() for p in prints):
        return f"the blocks of {container} differ in their modules, parameters or buffers"
    for key, first in prints[0].items():
        vals = [p[key] for p in prints]
        if all(v == first for v in vals):
            continue
        # An int attribute that counts with the block (transformers' ``layer_idx``) is the block's
        # own index: it selects a KV-cache slot, which training does not have.
        ints = [v[1] if v[0] == "value" and type(v[1]) is int else None for v in vals]
        if key[0] == "attr" and None not in ints and all(x - ints[0] == i for i, x in enumerate(ints)):
            continue
        if key[0] == "attr":
            where = ".".join(filter(None, (container, "<i>", key[1])))
            return f"attribute {key[2]!r} of {where} differs between blocks"
        return f"{key[0]} {key[1]!r} of {container}.<i> differs between blocks"
    for cfg in hf_configs(model):
        for key, v in vars(cfg).items():
            if isinstance(v, (list, tuple)) and len(v) == len(blocks) and any(x != v[0] for x in v):
                return f"config.{key} differs between layers"
    return None


def pick_blocks(n: int) -> tuple[int, ...]:
    """The blocks a short copy keeps: first, middle, last (the ones models most often special-case)."""
    return tuple(sorted({0, n // 2, n - 1}))


def short_copy(model: nn.Module, container: str, picks: Sequence[int]) -> nn.Module:
    """A shallow copy of ``model`` whose ``container`` holds only the blocks ``picks``.

    Every module on the path to the container is copied with its own ``_modules`` dict, so the
    user's model is untouched; everything else (parameters, buffers, configs, the blocks) is
    shared, and the copy is used only for one export.
    """
    root = copy.copy(model)
    node = root
    parts = container.split(".")
    for i, name in enumerate(parts):
        node.__dict__["_modules"] = dict(node._modules)
        old = node._modules[name]
        new = copy.copy(old)
        if i == len(parts) - 1:
            new.__dict__["_modules"] = {str(j): old[k] for j, k in enumerate(picks)}
        node._modules[name] = new
        node = new
    return root


def _replicate(short: TracedModel, model: nn.Module, container: str, picks: Sequence[int]) -> TracedModel | str:
    """The full-depth TracedModel of ``model`` from the trace of its three-block copy, or why not.

    In the short graph the blocks are ``container.0..k-1`` standing for real blocks ``picks``.
    Block 0 is kept as it is; blocks ``1..n-1`` repeat short block 1 (the middle one), which must
    agree with every other short block field for field once its own index is taken out of its
    parameter and buffer names, and read only batch inputs, prologue values and the block before
    it. Layers after the blocks may read batch inputs, prologue values and the last block.
    """
    g = short.graph
    k, n = len(picks), len(model.get_submodule(container))
    index = {layer.name: layer.index for layer in g.layers}
    if any(f"{container}.{j}" not in index for j in range(k)):
        return "a block of the three-block copy traced to no layer"
    first = index[f"{container}.0"]
    if [index[f"{container}.{j}"] for j in range(k)] != list(range(first, first + k)):
        return "the blocks of the three-block copy are not consecutive layers"
    blocks = g.layers[first:first + k]
    pre, post = g.layers[:first], g.layers[first + k:]
    if [v.producer for v in g.values] != sorted(v.producer for v in g.values):
        return "values are not in layer order"

    def own(name: str, j: int) -> str | None:
        prefix = f"{container}.{j}."
        return name[len(prefix):] if name.startswith(prefix) else None

    def canon(layer: Layer, j: int):
        params = tuple((own(p.name, j), p.shape, p.offset, p.trainable) for p in layer.params)
        bufs = tuple(own(b, j) if b.startswith(f"{container}.") else ("shared", b) for b in layer.buffers)
        outs = tuple((g.values[v].name.split(":", 1)[1], g.values[v].shape, g.values[v].dtype,
                      g.values[v].requires_grad, g.values[v].consumers == (layer.index + 1,)) for v in layer.outputs)
        return (layer.template, params, layer.numel, layer.trainable_numel, bufs, layer.buffer_bytes,
                layer.work_bytes, layer.fwd_flops, layer.bwd_flops, outs)

    def wiring(layer: Layer):
        prev = g.layers[layer.index - 1].outputs
        out = []
        for v in layer.inputs:
            if g.values[v].producer < first:
                out.append(("head", v))
            elif v in prev:
                out.append(("prev", prev.index(v)))
            else:
                return None
        return tuple(out)

    shapes = [canon(b, j) for j, b in enumerate(blocks)]
    if any(None in (p[0] for p in s[1]) for s in shapes):
        return "a block reads a parameter outside itself"
    if any(None in s[4] for s in shapes):
        return "a block reads another block's buffer"
    if any(s != shapes[0] for s in shapes) or not all(o[-1] for o in shapes[0][-1]):
        return "the three traced blocks differ"
    pattern = wiring(blocks[1])
    if pattern is None or any(wiring(b) != pattern for b in blocks[2:]):
        return "the traced blocks read values other than the batch, the prologue and the block before"
    if any(short.buffer_sources.get(b, ("buffer",))[0] != "buffer" for layer in blocks for b in layer.buffers):
        return "a block reads a tensor constant"

    # Value ids: the head (batch inputs, prologue outputs) keeps its ids; then each block's outputs;
    # then those of the layers after the blocks.
    head = [v for v in g.values if v.producer < first]
    values: list[dict] = [dict(v=v, name=v.name, producer=v.producer) for v in head]
    block_outs: list[list[int]] = []
    for b in range(n):
        src = blocks[0] if b == 0 else blocks[1]
        ids = []
        for v in src.outputs:
            ids.append(len(values))
            local = g.values[v].name.split(":", 1)[1]
            values.append(dict(v=g.values[v], name=f"{container}.{b}:{local}", producer=first + b))
        block_outs.append(ids)
    post_id: dict[int, int] = {}
    for i, layer in enumerate(post):
        for v in layer.outputs:
            post_id[v] = len(values)
            values.append(dict(v=g.values[v], name=g.values[v].name, producer=first + n + i))
    last_outs = blocks[-1].outputs

    def post_input(v: int) -> int | None:
        if g.values[v].producer < first:
            return v
        if v in last_outs:
            return block_outs[-1][last_outs.index(v)]
        return post_id.get(v)

    def rename(name: str, b: int) -> str:
        rest = own(name, 1)
        return name if rest is None else f"{container}.{b}.{rest}"

    layers: list[Layer] = list(pre)
    layers.append(dataclasses.replace(blocks[0], outputs=tuple(block_outs[0])))
    tmpl = blocks[1]
    for b in range(1, n):
        ins = tuple(x if kind == "head" else block_outs[b - 1][x] for kind, x in pattern)
        layers.append(dataclasses.replace(
            tmpl, index=first + b, name=f"{container}.{b}",
            params=tuple(dataclasses.replace(p, name=rename(p.name, b)) for p in tmpl.params),
            buffers=tuple(rename(x, b) for x in tmpl.buffers), inputs=ins, outputs=tuple(block_outs[b])))
    for i, layer in enumerate(post):
        ins = tuple(post_input(v) for v in layer.inputs)
        if None in ins:
            return "a layer after the blocks reads a block other than the last"
        layers.append(dataclasses.replace(layer, index=first + n + i, inputs=ins,
                                          outputs=tuple(post_id[v] for v in layer.outputs)))

    consumers: dict[int, list[int]] = {i: [] for i in range(len(values))}
    for layer in layers:
        for v in layer.inputs:
            consumers[v].append(layer.index)
    value_recs = tuple(
        dataclasses.replace(d["v"], id=i, name=d["name"], producer=d["producer"], consumers=tuple(sorted(consumers[i])))
        for i, d in enumerate(values))
    if g.loss not in post_id:
        return "the loss is not computed after the blocks"
    graph = LayerGraph(layers=tuple(layers), values=value_recs, batch_inputs=g.batch_inputs, loss=post_id[g.loss],
                       micro_batch_size=g.micro_batch_size, seq_len=g.seq_len,
                       meta={**g.meta, "model": type(model).__name__, "traced_blocks": tuple(picks)})

    sources = {}
    for name, src in short.buffer_sources.items():
        j = next((j for j in range(k) if own(name, j) is not None), None)
        if j is None:
            sources[name] = src
        else:
            for b in range(n):
                real = f"{container}.{b}.{own(name, j)}"
                sources[real] = ("buffer", real)
    return TracedModel(graph=graph, templates=short.templates, buffer_sources=sources,
                       eval_templates=short.eval_templates, count_targets=short.count_targets)


def replicate(ctx: TraceContext) -> None:
    """Pass: for a trace of the three-block copy (``ctx.picks``), the full-depth TracedModel in
    ``ctx.traced``, or else None there and the reason in ``ctx.full_because``. A trace of the
    full model is left as it is."""
    if ctx.picks is None:
        return
    out = _replicate(ctx.traced, ctx.model, ctx.container, ctx.picks)
    if isinstance(out, str):
        ctx.traced, ctx.full_because = None, out
    else:
        ctx.traced = out


__all__ = ["pick_blocks", "replicate", "short_copy", "why_not_replicate"]
