"""Clean-up of export's graph, in every nested graph as well as the top-level one.

The nested graphs are the bodies of higher-order ops such as ``wrap_with_set_grad_enabled``, which
a ``torch.no_grad`` region becomes. The clean-up makes a template traced in FP32 run the same under
BF16 autocast: :func:`erase_metadata_asserts` drops export's dtype asserts,
:func:`keep_position_math_fp32` runs matmuls that read no parameter (rotary angles) with autocast
off, as the model's own autocast-disabled region did before export dropped it, and
:func:`install_grouped_query_attention` routes grouped-query attention through a kernel that expands
key/value heads where SDPA would otherwise fall back to the math kernel's ``[B, H, S, S]`` scores
(FP32 on CUDA). Random ops are refused: a local backward recomputes the forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection

import torch
import torch.fx as fx

from megatrain.errors import UnsupportedModelError
from megatrain.kernels import grouped_query_attention, without_autocast
from megatrain.planner.trace.export import strip_wrapper
from megatrain.planner.trace.fx_util import bind, graph_modules, is_float, nested_calls, node_val

if TYPE_CHECKING:
    from megatrain.planner.trace.context import TraceContext

_aten = torch.ops.aten

# Ops export inserts to assert the device/dtype seen at trace time; they would pin the graph to
# the meta device and carry no computation.
_ASSERT_OPS = {torch.ops.aten._assert_tensor_metadata.default}

# Ops that draw random numbers. A local backward recomputes the forward, which would draw a
# different dropout mask than the forward did and silently train a different function.
_RANDOM_OPS = {"aten::dropout", "aten::native_dropout", "aten::bernoulli", "aten::rand", "aten::randn",
               "aten::rand_like", "aten::randn_like", "aten::randint", "aten::randperm", "aten::multinomial",
               "aten::normal", "aten::uniform", "aten::feature_dropout", "aten::alpha_dropout"}


def _check_no_randomness(gm: fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if n.op == "call_function" and n.target is grouped_query_attention:
            schema = _aten.scaled_dot_product_attention.default._schema  # it takes SDPA's leading arguments
        if schema is None:
            continue
        if schema.name not in _RANDOM_OPS:
            # Attention kernels take their dropout as an argument (HF's attention_dropout > 0 reaches
            # scaled_dot_product_attention as dropout_p).
            names = [a.name for a in schema.arguments]
            if "dropout_p" not in names:
                continue
            k = names.index("dropout_p")
            p = n.args[k] if len(n.args) > k else n.kwargs.get("dropout_p", 0.0)
            if not p:
                continue
        elif schema.name.endswith("dropout") and (len(n.args) > 1 and n.args[1] == 0.0 or
                                                  len(n.args) > 2 and n.args[2] is False):
            continue  # p == 0 or not training: no randomness
        stack = n.meta.get("nn_module_stack") or {}
        where = strip_wrapper(list(stack.values())[-1][0]) if stack else "the model's forward"
        raise UnsupportedModelError(
            f"module {where!r} calls {schema.name} ({n.name}): megatrain recomputes each layer's "
            "forward in its local backward and does not replay random number draws yet, so dropout "
            "and other random ops are not supported; set dropout probabilities to 0 or call "
            "model.eval() on the dropout modules")


def erase_metadata_asserts(gm: fx.GraphModule) -> int:
    """Drop the ``aten._assert_tensor_metadata`` checks export inserts, in ``gm`` and every nested graph.

    They assert the dtype and device each ``.to()`` saw at trace time: they would pin a template
    to the trace device, and under autocast (BF16 compute) they fail where an input's dtype
    legitimately differs from the FP32 trace. Returns how many were erased; recompiles what changed.
    """
    erased = 0
    for m in graph_modules(gm):
        dead = [n for n in m.graph.nodes if n.op == "call_function" and n.target in _ASSERT_OPS]
        for n in dead:
            m.graph.erase_node(n)
        if dead:
            m.graph.eliminate_dead_code()
            m.recompile()
        erased += len(dead)
    return erased


# Ops autocast runs in its low-precision dtype (torch/csrc/autograd/autocast_mode.cpp, the
# ``lower_precision_fp`` lists of CUDA and CPU) that can appear in position arithmetic.
_AUTOCAST_LOW = {_aten.mm, _aten.bmm, _aten.matmul, _aten.addmm, _aten.baddbmm, _aten.addbmm, _aten.addmv,
                 _aten.addr, _aten.mv, _aten.linear, _aten.einsum, _aten.chain_matmul, _aten.linalg_multi_dot,
                 _aten.linalg_vecdot, _aten.dot, _aten.vdot}


def keep_position_math_fp32(gm: fx.GraphModule, learned: Collection[str]) -> int:
    """Run every matmul-like op that reads no learned value with autocast off, in ``gm`` and its nested graphs.

    Position and angle arithmetic (rotary ``inv_freq @ position_ids``, ALiBi slopes) is computed
    from buffers, constants, integer inputs and ``arange`` alone. Models compute it in FP32 and
    switch autocast off around it (transformers' rotary embeddings: ``maybe_autocast(...,
    enabled=False)``), because in BF16 the angle at position ``p`` is off by up to ``p * 2**-8``
    rad. Export traces in FP32 without autocast, so that region is a no-op and leaves nothing in
    the graph; the executor then runs the template under autocast for BF16 compute, and the
    matmul would run in BF16. Each such op, one whose inputs depend on no placeholder named in
    ``learned`` (parameters and floating-point batch inputs: where learned or data values enter),
    becomes a call of :func:`megatrain.kernels.without_autocast`, so it computes in its inputs'
    dtype under any autocast; in FP32 nothing changes. Other position ops (cos, sin, cat, mul) are
    not recast by autocast. Dependence follows values into the bodies of higher-order ops.
    Rewrites in place; returns how many ops were wrapped.
    """
    return _pin_fp32(gm, {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in learned})


def _pin_fp32(gm: fx.GraphModule, tainted: set[fx.Node]) -> int:
    tainted = set(tainted)
    nested: dict[int, tuple[fx.GraphModule, set[fx.Node]]] = {}
    wrap = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if any(a in tainted for a in n.all_input_nodes):
            tainted.add(n)
        for body, operands in nested_calls(gm, n):
            phs = [p for p in body.graph.nodes if p.op == "placeholder"]
            # wrap_with_set_grad_enabled and wrap_with_autocast pass their operands to the body's
            # placeholders in order; for any other layout every placeholder is tainted if the call is.
            inner = ({p for p, a in zip(phs, operands) if a in tainted} if len(phs) == len(operands)
                     else set(phs) if n in tainted else set())
            nested.setdefault(id(body), (body, set()))[1].update(inner)  # a body called twice: either's taint
        packet = getattr(n.target, "overloadpacket", None)
        if n not in tainted and packet in _AUTOCAST_LOW:
            wrap.append(n)
    for n in wrap:
        n.args = (n.target, *n.args)
        n.target = without_autocast
    if wrap:
        gm.recompile()
    return len(wrap) + sum(_pin_fp32(body, inner) for body, inner in nested.values())


def install_grouped_query_attention(gm: fx.GraphModule) -> int:
    """Route grouped-query attention (GQA) through a kernel that expands heads where it must.

    The kernel is :func:`megatrain.kernels.grouped_query_attention`; ``gm`` and its nested graphs
    are rewritten.

    Transformers calls ``scaled_dot_product_attention(..., enable_gqa=True)`` where no mask is
    passed (megatrain's causal trace). On CUDA in FP32 no fused kernel takes ``enable_gqa`` and
    SDPA silently runs the math kernel, whose ``[B, H, S, S]`` scores the memory model does not
    count; the kernel expands K and V to the query heads exactly there (decided when it runs, on
    the dtype autocast gives it) and is SDPA itself everywhere else, so CPU runs and BF16 flash
    runs are unchanged. :func:`~megatrain.planner.trace.measure.work_bytes` counts the expanded K
    and V and their gradients in every case (the planner does not know the device's choice).
    Rewrites in place; returns how many attention calls changed.
    """
    done = 0
    for m in graph_modules(gm):
        changed = False
        for n in m.graph.nodes:
            if n.op != "call_function" or n.target is not _aten.scaled_dot_product_attention.default:
                continue
            a = bind(n)
            if not a.get("enable_gqa") or node_val(a["query"]).shape[-3] == node_val(a["key"]).shape[-3]:
                continue
            n.target = grouped_query_attention
            n.args = (a["query"], a["key"], a["value"], a.get("attn_mask"), a.get("dropout_p", 0.0),
                      a.get("is_causal", False), a.get("scale"))
            n.kwargs = {}
            changed = True
            done += 1
        if changed:
            m.graph.lint()
            m.recompile()
    return done


def clean(ctx: TraceContext) -> None:
    """Pass: erase export's asserts, refuse random ops, keep position math in FP32 and route GQA,
    over ``ctx.gm`` and its nested graphs. Learned values enter at the parameters and the
    floating-point batch inputs. Raises UnsupportedModelError for a random op."""
    erase_metadata_asserts(ctx.gm)
    for sub in graph_modules(ctx.gm):
        _check_no_randomness(sub)
    floats = {ph for ph, x in zip(ctx.user_inputs, ctx.example) if is_float(x)}
    keep_position_math_fp32(ctx.gm, learned=set(ctx.param_of) | floats)
    install_grouped_query_attention(ctx.gm)


__all__ = ["clean", "erase_metadata_asserts", "install_grouped_query_attention", "keep_position_math_fp32"]
