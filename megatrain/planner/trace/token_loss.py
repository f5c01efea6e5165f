"""The token-loss pass: the model's mean cross-entropy as a sum, and a counter of its targets.

A global batch has one loss: the mean over every supervised token of the batch (every label that is
not ``ignore_index``, after the shift the model applies), as eager PyTorch computes it on the whole
batch and as Hugging Face's gradient accumulation does with ``num_items_in_batch`` (transformers
``loss_utils.fixed_cross_entropy``: ``reduction="sum"``, then a division by the global count). A
micro-batch's own mean cannot be combined into that mean without its count, and is NaN when the
micro-batch has no target. So when the model's loss is a mean cross-entropy,
:func:`sum_token_loss` rewrites it to the sum over the micro-batch's targets (0 for a micro-batch
without one) and extracts the ops that turn the labels into the loss's targets (Hugging Face's
``pad(labels, (0, 1), -100)[..., 1:]``, a GPT's ``labels[:, 1:]``) into a small graph that counts
them from a batch before the step: :attr:`~megatrain.ir.graph.TracedModel.count_targets`. The
executor then seeds each micro-batch's summed loss with ``1 / N``, ``N`` the targets of the whole
global batch (summed over the ranks by the schedule's COUNT_REDUCE).

A loss that is not one mean cross-entropy read by nothing else (label smoothing, class weights, an
auxiliary term, a regression loss) is left as the model wrote it, with the reason in
``graph.meta["uncounted_loss_because"]``; such a model trains only with the micro-batch mean
(``megatrain.compile(..., per_token_loss=False)``).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from megatrain.planner.trace.fx_util import bind
from megatrain.planner.trace.lm_head import find_cross_entropy

if TYPE_CHECKING:
    from megatrain.planner.trace.context import TraceContext

_aten = torch.ops.aten
_MEAN, _SUM = 1, 2  # at::Reduction


def _loss_node(gm: fx.GraphModule) -> fx.Node:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]


def _why_not(loss: fx.Node) -> tuple[fx.Node | None, str | None]:
    """The cross-entropy op whose value is ``loss`` and can be summed, or None and why not."""
    op = loss.args[0] if loss.op == "call_function" and loss.target is operator.getitem else loss
    found = find_cross_entropy(op) if isinstance(op, fx.Node) else None
    if found is None or found[1] is not loss:
        return None, "the loss is not a cross-entropy (or has more terms than one)"
    args = found[3]
    if args["reduction"] != _MEAN:
        return None, f"its cross-entropy has reduction {'sum' if args['reduction'] == _SUM else 'none'}, not mean"
    if args.get("weight") is not None:
        return None, "its cross-entropy weights the classes"
    if args.get("label_smoothing", 0.0):
        return None, "its cross-entropy smooths the labels"
    return op, None


def _target_counter(gm: fx.GraphModule, ce: fx.Node, inputs: dict[str, str]) -> tuple[fx.GraphModule | None,
                                                                                       str | None]:
    """A graph ``(*batch_inputs) -> int64 count`` of ``ce``'s targets, from the ops between the
    batch inputs (placeholder name -> input name, in call order) and its target argument."""
    args = bind(ce)
    target, ignore = args["target"], args["ignore_index"]
    needed: set[fx.Node] = set()
    todo = [target]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        if n.op == "placeholder" and n.name not in inputs:
            return None, "its targets depend on the model's parameters or buffers, not on the batch alone"
        if n.op not in ("placeholder", "call_function"):
            return None, f"its targets go through {n.op} {n.name!r}, which the counter cannot copy"
        todo.extend(n.all_input_nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in inputs:
            env[n] = g.placeholder(inputs[n.name])
    for n in gm.graph.nodes:
        if n in needed and n.op == "call_function":
            env[n] = g.node_copy(n, lambda a: env[a])
    valid = g.call_function(_aten.ne.Scalar, (env[target], ignore))
    g.output(g.call_function(_aten.sum.default, (valid,)))
    return fx.GraphModule(torch.nn.Module(), g), None


def sum_token_loss(ctx: TraceContext) -> None:
    """Pass (after ``clean``, before ``cut``): where the exported loss is one mean cross-entropy,
    rewrite it to the sum over the micro-batch's targets and set ``ctx.count_targets`` to the graph
    that counts them from the batch inputs (:attr:`~megatrain.ir.graph.TracedModel.count_targets`);
    else leave the loss and set ``ctx.uncounted_loss_because``."""
    gm = ctx.gm
    ce, why = _why_not(_loss_node(gm))
    counter = None
    if ce is not None:
        inputs = dict(zip(ctx.user_inputs, ctx.options.input_names))
        counter, why = _target_counter(gm, ce, inputs)
    if counter is None:
        ctx.uncounted_loss_because = why
        return
    schema = ce.target._schema.arguments
    args = {**bind(ce), "reduction": _SUM}
    ce.args, ce.kwargs = tuple(args[a.name] for a in schema), {}
    gm.recompile()
    ctx.count_targets = counter


__all__ = ["sum_token_loss"]
