"""How the micro-batch losses of a step combine into the one loss of its global batch.

The loss of a global batch is the mean of the token losses over its supervised tokens: every label
that is not -100, after the model's shift, in every micro-batch of every data-parallel rank. It is
what eager PyTorch computes on the whole batch, and what Hugging Face's gradient accumulation
computes with ``num_items_in_batch`` (the summed loss of each micro-batch divided by the global
count: transformers ``Trainer.get_batch_samples`` and ``loss_utils.fixed_cross_entropy``;
Megatron-LM's ``--calculate-per-token-loss``). Where the model's loss is a mean cross-entropy the
trace makes the last layer return each micro-batch's summed loss ``L_mb`` and a counter of its
supervised tokens ``n_mb`` (:mod:`megatrain.planner.trace.token_loss`); with ``N = sum n_mb`` over
the global batch the step's loss is ``sum L_mb / N`` and each micro-batch's local backward is
seeded with ``1 / N``. A micro-batch (or rank) without a target has ``L_mb = 0`` and a zero
gradient: it adds nothing. The gradients of the ranks are then summed, not averaged.

``per_token=False`` keeps the mean of the micro-batch means instead (each micro-batch's loss over
its own supervised tokens, weighted ``1 / (micro-batches x ranks)``: Megatron-LM's default without
``--calculate-per-token-loss``, and megatrain's before 2026-11-27). It differs from the batch's
token mean whenever micro-batches hold different numbers of targets, which padded, packed and SFT
batches do. A model whose loss is not a mean cross-entropy (an auxiliary term, a regression loss)
has no count (``targets`` None) and trains only this way, each micro-batch's loss as the model
returns it.
"""

from __future__ import annotations

from typing import Sequence


def loss_weights(targets: Sequence[int | None], supervised: int | None, micro_batches: int, *,
                 per_token: bool) -> list[float]:
    """The factor of each micro-batch's loss in the global batch's loss: what its local backward
    seeds the loss with, and what the reported loss weighs it by.

    Args:
        targets: the supervised tokens of each micro-batch these weights are for (this rank's, or
            every rank's); None for a micro-batch whose loss is not counted (the model's own loss,
            :attr:`~megatrain.ir.graph.TracedModel.count_targets` None).
        supervised: the supervised tokens of the whole global batch (every micro-batch of every
            rank), or None where the loss is not counted.
        micro_batches: the micro-batches of the whole global batch (micro-batches x ranks).
        per_token: the global token mean (``1 / supervised`` for every micro-batch; 0 when the
            batch has no target) or the mean of the micro-batch means (``1 / (micro_batches x
            n_mb)``, 0 for a micro-batch without a target, ``1 / micro_batches`` for one whose
            loss is not counted).

    Raises:
        ValueError: ``per_token`` where the loss is not counted, or a negative count.
    """
    if per_token:
        if supervised is None or None in targets:
            raise ValueError("per_token needs the supervised tokens of every micro-batch; this loss is not counted")
        if supervised < 0:
            raise ValueError(f"the global batch cannot have {supervised} supervised tokens")
        return [1.0 / supervised if supervised else 0.0] * len(targets)
    if any(n is not None and n < 0 for n in targets):
        raise ValueError(f"a micro-batch cannot have a negative number of supervised tokens: {list(targets)}")
    return [1.0 / micro_batches if n is None else 1.0 / (micro_batches * n) if n else 0.0 for n in targets]


def micro_batch_means(losses: Sequence[float], targets: Sequence[int | None]) -> list[float]:
    """Each micro-batch's own loss: its summed loss over its supervised tokens (NaN where it has
    none: the mean of nothing), or where the loss is not counted (None) the loss the model returned."""
    return [loss if n is None else loss / n if n else float("nan") for loss, n in zip(losses, targets)]


__all__ = ["loss_weights", "micro_batch_means"]
