"""Clean-up of export's graph, in every nested graph as well as the top-level one.

The nested graphs are the bodies of higher-order ops such as ``wrap_with_set_grad_enabled``, which
a ``torch.no_grad`` region becomes. The clean-up makes a template traced in FP32 run the same under
BF16 autocast: :func:`erase_metadata_asserts` drops export's dtype asserts,
:func:`keep_position_math_fp32` runs matmuls that read no parameter (rotary angles) with autocast
off, as the model's own autocast-disabled region did before export dropped it, and
:func:`install_grouped_query_attention` routes grouped-query attention through a kernel that expands
key/value heads where SDPA would otherwise fall back to the math kernel's ``[B, H, S, S]`` scores
(FP32 on CUDA). Random ops (dropout) are allowed where the executor can replay them: a local
backward recomputes the forward, and the executor restores the device generator's state of the
forward for that recompute (:func:`draws_random` marks the templates that need it,
``Layer.draws_random``); :func:`check_random_ops` refuses those drawing from a private generator.
"""

from __future__ import annotations

import copy
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
_ASSERT_OPS = {torch.ops.aten._assert_tensor_metadata.default,
               # torch._check on a tensor (transformers' torch_compilable_check: LLaVA's image-token
               # count) becomes a host sync (item) and these asserts; the batch is checked on the host
               # before the step instead (megatrain.planner.trace.vlm.place_images).
               torch.ops.aten._assert_scalar.default}

# Random ops the executor replays by restoring the device generator's state (the attention kernels,
# which draw only when their ``dropout_p`` is not 0, are told apart by that argument instead). Any
# other op tagged ``nondeterministic_seeded`` draws random numbers too and is replayed the same way.
_DROPOUT_OPS = {"aten::dropout", "aten::feature_dropout", "aten::alpha_dropout", "aten::feature_alpha_dropout",
                "aten::native_dropout"}


def _schema(n: fx.Node):
    if n.op != "call_function":
        return None
    if n.target is grouped_query_attention:
        return _aten.scaled_dot_product_attention.default._schema  # it takes SDPA's leading arguments
    return getattr(n.target, "_schema", None)


def _draws(n: fx.Node) -> bool:
    """Whether ``n`` draws random numbers when it runs (a dropout with ``p == 0`` or ``train=False``
    and attention with ``dropout_p == 0`` do not)."""
    schema = _schema(n)
    if schema is None:
        return False
    names = [a.name for a in schema.arguments]

    def arg(name: str, default):
        k = names.index(name)
        return n.args[k] if len(n.args) > k else n.kwargs.get(name, default)

    if "dropout_p" in names:  # SDPA and its kernels: attention_dropout > 0 reaches them as dropout_p
        return bool(arg("dropout_p", 0.0))
    if schema.name in _DROPOUT_OPS:
        return arg("p", 0.5) != 0.0 and arg("train", True) is not False
    tags = getattr(n.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def random_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` and of its nested graphs that draw random numbers (dropout with ``p > 0`` in
    training, attention with ``dropout_p > 0``, ``bernoulli``, ``rand*``, ``normal``, ...: every op
    tagged ``torch.Tag.nondeterministic_seeded``), in graph order."""
    return [n for m in graph_modules(gm) for n in m.graph.nodes if _draws(n)]


def draws_random(gm: fx.GraphModule) -> bool:
    """Whether template ``gm`` (or a graph nested in it) draws random numbers: the executor then
    records the device generator's state at the layer's forward and restores it for every recompute
    (``Layer.draws_random``)."""
    return bool(random_nodes(gm))


def without_dropout(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of template ``gm`` (and its nested graphs) that computes as the model does in eval
    mode: every dropout op gets ``train=False`` (the identity) and every attention call
    ``dropout_p=0``, as ``model.eval()`` would have traced them (transformers passes
    ``dropout_p = p if self.training else 0``). Other random ops (``rand``, ``bernoulli``, ...) are
    kept: eval mode does not turn them off in eager PyTorch either. ``gm`` is not modified."""
    out = copy.deepcopy(gm)
    for m in graph_modules(out):
        changed = False
        for n in m.graph.nodes:
            if not _draws(n):
                continue
            names = [a.name for a in _schema(n).arguments]
            if "dropout_p" in names:
                name, value = "dropout_p", 0.0
            elif _schema(n).name in _DROPOUT_OPS:
                name, value = "train", False
            else:
                continue
            k = names.index(name)
            if len(n.args) > k:
                n.args = (*n.args[:k], value, *n.args[k + 1:])
            else:
                n.kwargs = {**n.kwargs, name: value}
            changed = True
        if changed:
            m.recompile()
    return out


def check_random_ops(gm: fx.GraphModule) -> None:
    """Refuse random ops the executor cannot replay: one that draws from a ``torch.Generator`` passed
    as an argument. A recompute restores the state of the device's default generator only (the
    generator ``torch.manual_seed`` seeds and ``torch.utils.checkpoint`` restores), so a private
    generator would advance again and draw a different mask in the recompute.

    Raises:
        UnsupportedModelError: naming the module, the op and the fix.
    """
    for n in random_nodes(gm):
        # Export lifts a generator to a placeholder of the graph, so look at the argument's slot.
        names = [a.name for a in _schema(n).arguments]
        k = names.index("generator") if "generator" in names else None
        gen = None if k is None else n.args[k] if len(n.args) > k else n.kwargs.get("generator")
        if gen is not None:
            stack = n.meta.get("nn_module_stack") or {}
            where = strip_wrapper(list(stack.values())[-1][0]) if stack else "the model's forward"
            raise UnsupportedModelError(
                f"module {where!r} calls {_schema(n).name} ({n.name}) with its own torch.Generator: megatrain "
                "recomputes each layer's forward in its local backward and replays random draws by restoring "
                "the device's default generator, not a private one, so the recompute would draw different "
                "numbers; draw from the default generator (drop the generator= argument) or set the "
                "probability to 0")


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


def drop_unread(gm: fx.GraphModule) -> int:
    """Drop the ops whose results nothing reads, in ``gm`` and every nested graph; returns how many.

    ``Graph.eliminate_dead_code`` keeps every op tagged ``nondeterministic_seeded``, attention
    included, since it may draw random numbers; one that draws none (attention with ``dropout_p ==
    0``: :func:`_draws`) is dropped here too, while one that draws is kept, so the generator
    advances as eagerly. A model computes such dead branches where it discards an output: LLaVA
    reads the vision tower's hidden states before its last block (``vision_feature_layer=-2``), so
    that block's attention would otherwise stay, its weights in a layer with no output, their
    gradients zeros that weight decay would still move (eager AdamW skips them)."""
    def unread(n: fx.Node) -> bool:
        if n.op != "call_function" or n.users:
            return False
        if not n.is_impure():
            return True
        schema = _schema(n)  # impure: only a seeded op that draws nothing and writes no input goes
        return schema is not None and not schema.is_mutable and not _draws(n)

    dropped = 0
    for m in graph_modules(gm):
        before = dropped
        for n in reversed(list(m.graph.nodes)):  # users before their inputs: a chain goes in one sweep
            if unread(n):
                m.graph.erase_node(n)
                dropped += 1
        if dropped > before:
            m.recompile()
    return dropped


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
    """Pass: erase export's asserts and the ops nothing reads (:func:`drop_unread`), refuse random
    ops that cannot be replayed, keep position math in FP32 and route GQA, over ``ctx.gm`` and its
    nested graphs. Learned values enter at the parameters
    and the floating-point batch inputs. Raises UnsupportedModelError for a random op drawing from
    its own generator (:func:`check_random_ops`)."""
    erase_metadata_asserts(ctx.gm)
    drop_unread(ctx.gm)
    check_random_ops(ctx.gm)
    floats = {ph for ph, x in zip(ctx.user_inputs, ctx.example) if is_float(x)}
    keep_position_math_fp32(ctx.gm, learned=set(ctx.param_of) | floats)
    install_grouped_query_attention(ctx.gm)


__all__ = ["check_random_ops", "clean", "draws_random", "drop_unread", "erase_metadata_asserts",
           "install_grouped_query_attention", "keep_position_math_fp32", "random_nodes", "without_dropout"]
