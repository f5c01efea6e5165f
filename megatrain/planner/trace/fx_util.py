"""fx helpers the trace passes share: a node's value, its arguments by name, its bytes, aliasing,
nested graphs, and a graph's structural identity."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from megatrain.kernels import grouped_query_attention

_aten = torch.ops.aten

# Both take (query, key, value, attn_mask, dropout_p, is_causal, scale) first.
ATTENTION_OPS = {_aten.scaled_dot_product_attention.default, grouped_query_attention}


def node_val(node: fx.Node):
    """The value export recorded for ``node`` (a fake or meta tensor, a tuple of them, or None)."""
    return node.meta.get("val")


def is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def bind(n: fx.Node) -> dict[str, Any]:
    """The arguments of an aten call by schema name, defaults filled in."""
    out = {}
    for i, a in enumerate(n.target._schema.arguments):
        if i < len(n.args):
            out[a.name] = n.args[i]
        elif a.name in n.kwargs:
            out[a.name] = n.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def only_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def value_bytes(n: fx.Node) -> int:
    """Bytes of ``n``'s value: a tensor's, or the sum over the tensors of a tuple."""
    v = node_val(n)
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(x.numel() * x.element_size() for x in v if isinstance(x, torch.Tensor))
    return 0


def viewable(x: torch.Tensor, shape: Sequence[int]) -> bool:
    """Whether ``x.reshape(shape)`` is a view (no copy), as the strides of ``x`` decide."""
    try:
        torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta").view(shape)
    except RuntimeError:
        return False
    return True


def allocates(n: fx.Node) -> bool:
    """Whether op ``n`` creates new storage (not a view or alias of an input)."""
    if n.op != "call_function" or n.target is operator.getitem:
        return False
    t = n.target
    x = node_val(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    v = node_val(n)
    if t in (_aten.to.dtype, _aten.to.dtype_layout) and isinstance(x, torch.Tensor):
        return x.dtype != v.dtype or x.device != v.device or bool(bind(n).get("copy"))
    if t is _aten.contiguous.default and isinstance(x, torch.Tensor):
        return not x.is_contiguous()
    if t in (_aten.reshape.default, _aten.flatten.using_ints) and isinstance(x, torch.Tensor):
        return not viewable(x, v.shape)
    if t is _aten._unsafe_view.default:
        return False  # a view its schema does not annotate
    schema = getattr(t, "_schema", None)
    return not (schema is not None and any(r.alias_info is not None for r in schema.returns))


def allocated_bytes(n: fx.Node) -> int:
    return value_bytes(n) if allocates(n) else 0


def graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and every graph nested in it (the bodies of higher-order ops such as
    ``wrap_with_set_grad_enabled``, which export makes of a ``torch.no_grad`` region)."""
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def nested_calls(gm: fx.GraphModule, n: fx.Node) -> list[tuple[fx.GraphModule, tuple]]:
    """(body, operands) of each graph a higher-order op ``n`` calls: the arguments after the body."""
    out = []
    for i, a in enumerate(n.args):
        if isinstance(a, fx.Node) and a.op == "get_attr" and isinstance(getattr(gm, a.target, None), fx.GraphModule):
            out.append((getattr(gm, a.target), tuple(n.args[i + 1:])))
    return out


def signature(gm: fx.GraphModule) -> tuple:
    """Structural identity of a graph: ops, targets, wiring and shapes, not names."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def norm(a):
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, norm(v)) for k, v in a.items())))
        return ("const", repr(a))

    sig = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = node_val(n)
            sig.append(("ph", tuple(v.shape) if isinstance(v, torch.Tensor) else None,
                        str(v.dtype) if isinstance(v, torch.Tensor) else repr(v)))
        elif n.op == "get_attr":
            attr = getattr(gm, n.target)
            sig.append(("attr", signature(attr) if isinstance(attr, fx.GraphModule) else
                        (tuple(attr.shape), str(attr.dtype)) if isinstance(attr, torch.Tensor) else repr(attr)))
        else:
            sig.append((n.op, str(n.target), norm(n.args), norm(n.kwargs)))
    return tuple(sig)


__all__ = ["ATTENTION_OPS", "allocated_bytes", "allocates", "bind", "graph_modules", "is_float", "nested_calls",
           "node_val", "only_user", "prod", "signature", "value_bytes", "viewable"]
