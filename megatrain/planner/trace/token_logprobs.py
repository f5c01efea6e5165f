"""The loss layer as per-token log-probabilities, and where each of them sits in the batch.

Preference and RL losses (DPO, GRPO: :mod:`megatrain.rl`) are functions of the log-probability the
model gives each target token, not of the summed cross-entropy the traced loss layer returns. Both
come from the same chunked LM head (:func:`megatrain.planner.trace.lm_head.chunk_lm_head_loss`
installs :func:`~megatrain.kernels.linear_cross_entropy`): :func:`logprobs_template` copies the
loss layer's template with that call replaced by :func:`~megatrain.kernels.logprobs.linear_logprobs`
over the same rows, weight, bias, targets and chunking, so its loss output becomes ``[rows]`` FP32
log-probabilities; nothing else of the layer (its final norm, its other outputs) changes, and the
other layers, the plan and the schedule are the ones the model trains with.

The kernel's rows are the loss's rows: the targets after the model's shift, flattened as the loss
reads them (Hugging Face's ``pad(labels, (0, 1), -100)[..., 1:].view(-1)``, a GPT's
``labels[:, 1:].reshape(-1)``). :func:`target_positions` finds, for each row, the position in
``labels`` of its target, by running the ops between the batch and the loss's targets (the graph
:mod:`megatrain.planner.trace.token_loss` extracted to count them) on the positions themselves
instead of the labels. A model whose targets are not a pure re-indexing of ``labels`` (they depend
on the values) is refused where that shows (:func:`check_positions`).
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.fx as fx

from megatrain.errors import ConfigError
from megatrain.kernels.lm_head import linear_cross_entropy
from megatrain.kernels.logprobs import linear_logprobs

_aten = torch.ops.aten


def logprobs_and_entropy(hidden, weight, bias, labels, ignore_index, chunk_tokens, logits_dtype) -> torch.Tensor:
    """``[2, rows]``: :func:`linear_logprobs` with ``entropy=True``, stacked (a template output is one tensor)."""
    return torch.stack(linear_logprobs(hidden, weight, bias, labels, ignore_index, chunk_tokens, logits_dtype,
                                       entropy=True))


def logprobs_template(gm: fx.GraphModule, loss_index: int, entropy: bool = False) -> fx.GraphModule:
    """A copy of the loss layer's template ``gm`` whose output ``loss_index`` (the loss) is the
    per-token log-probabilities of the fused LM head's targets: ``[rows]`` in the head's reduction
    dtype (FP32), 0 for a row whose target is ``ignore_index``; with ``entropy``, ``[2, rows]``
    (log-probabilities, then entropies, the latter without a gradient). ``gm`` is not changed.

    Raises:
        ConfigError: the loss output is not one call of the chunked LM-head cross-entropy (a model
            traced with ``loss_chunk_bytes=None``, or whose loss is not a cross-entropy over an LM head).
    """
    out = copy.deepcopy(gm)
    g = out.graph
    ret = next(n for n in g.nodes if n.op == "output")
    outs = ret.args[0] if isinstance(ret.args[0], (tuple, list)) else (ret.args[0],)
    node = outs[loss_index]
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is linear_cross_entropy):
        raise ConfigError("per-token log-probabilities come from the chunked LM head fused with the loss, but this "
                          "model's loss layer does not end in it (megatrain.planner.trace.lm_head.chunk_lm_head_loss "
                          "did not match its loss): use a causal LM whose loss is a cross-entropy of its LM head's "
                          "logits, traced with the default loss_chunk_bytes")
    a = inspect.signature(linear_cross_entropy).bind(*node.args, **node.kwargs)
    a.apply_defaults()
    a = a.arguments
    args = (a["hidden"], a["weight"], a["bias"], a["labels"], a["ignore_index"], a["chunk_tokens"],
            a["logits_dtype"])
    with g.inserting_before(node):
        new = g.call_function(logprobs_and_entropy if entropy else linear_logprobs, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    g.lint()
    out.recompile()
    return out


def target_graph(count_targets: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """The targets themselves from the counter of :mod:`megatrain.planner.trace.token_loss`
    (``TracedModel.count_targets``, which ends in ``sum(ne(targets, ignore_index))``): a graph of
    the same batch inputs returning the ``[rows]`` int64 targets as the loss reads them, and the
    ``ignore_index``."""
    out = copy.deepcopy(count_targets)
    g = out.graph
    ret = next(n for n in g.nodes if n.op == "output")
    total = ret.args[0]
    ne = total.args[0] if isinstance(total, fx.Node) and total.target is _aten.sum.default else None
    if not (isinstance(ne, fx.Node) and ne.target is _aten.ne.Scalar):
        raise ValueError("target_graph: the counter does not end in sum(ne(targets, ignore_index))")
    targets, ignore = ne.args
    ret.args = (targets,)
    g.erase_node(total)
    g.erase_node(ne)
    g.lint()
    out.recompile()
    return out, int(ignore)


def target_positions(targets: fx.GraphModule, ignore_index: int, batch: dict[str, torch.Tensor],
                     inputs: tuple[str, ...]) -> torch.Tensor:
    """For each row of the loss (each target, as the kernel reads them) the flat position in
    ``labels`` (``[rows]`` int64 into ``labels.view(-1)``) of the label it is, or -1 for a row
    that reads none (a pad). ``batch`` is one micro-batch's inputs by name, ``inputs`` their order
    (``graph.batch_inputs``); its labels' values are not read, only their shape.

    Raises:
        ConfigError: the model has no ``labels`` input, or an ``ignore_index`` that is a position.
    """
    if "labels" not in inputs:
        raise ConfigError(f"per-token log-probabilities are those of the labels, but the model was compiled with "
                          f"inputs {list(inputs)}; compile with input_names including 'labels'")
    if ignore_index >= 0:
        raise ConfigError(f"the model's loss ignores label {ignore_index}, which is also a token position; use a "
                          "negative ignore_index (Hugging Face's -100)")
    labels = batch["labels"]
    where = torch.arange(labels.numel(), dtype=labels.dtype).view(labels.shape)
    with torch.no_grad():
        rows = targets(*(where if n == "labels" else batch[n].cpu() for n in inputs))
    return torch.where(rows == ignore_index, torch.full_like(rows, -1), rows)


def check_positions(targets: fx.GraphModule, ignore_index: int, positions: torch.Tensor,
                    batch: dict[str, torch.Tensor], inputs: tuple[str, ...]) -> torch.Tensor:
    """The targets of micro-batch ``batch`` (``[rows]``), checked to be ``labels`` read at
    ``positions`` (:func:`target_positions`), ``ignore_index`` where a row reads none.

    Raises:
        ConfigError: they are not: the model's targets depend on the labels' values (a mask it makes
            from them), not only on where they are.
    """
    with torch.no_grad():
        rows = targets(*(batch[n].cpu() for n in inputs))
    flat = batch["labels"].cpu().reshape(-1)
    want = torch.where(positions >= 0, flat[positions.clamp(min=0)], torch.full_like(positions, ignore_index))
    if rows.shape != positions.shape or not bool((rows == want).all()):
        raise ConfigError("this model's loss targets are not the labels re-indexed (its shift reads their values, "
                          "not only their positions), so megatrain cannot say which token each log-probability "
                          "belongs to; use a causal LM whose loss shifts the labels (Hugging Face's, a GPT's)")
    return rows


__all__ = ["check_positions", "logprobs_and_entropy", "logprobs_template", "target_graph", "target_positions"]
