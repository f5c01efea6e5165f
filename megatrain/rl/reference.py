"""The reference model of preference and RL training, without a second FP32 copy of the weights.

DPO's loss and GRPO's KL term compare the policy with a frozen reference (usually the policy at
the start of training). A second trainer would hold it as 12 more bytes per parameter (FP32
masters and moments); megatrain offers two ways that hold at most 2:

- :func:`precompute_reference`: the reference's log-probabilities over the data, computed before
  the first step (offline DPO, as TRL's ``precompute_ref_log_probs``): ``[rows, seq_len]`` FP32
  per batch (4 bytes a token), no weights at all.
- :class:`Reference`: a frozen BF16 copy of the weights on the host (2 bytes per parameter),
  whose log-probabilities run through the trainer's own eval schedule with every weight copy
  reading the copy instead of the FP32 masters: streamed layer by layer like the policy, in the
  policy's slots, planned and verified as any evaluation. Compile with ``reference="bfloat16"``
  so the planner counts its bytes (``megatrain plan --reference bfloat16`` shows them).

BF16 rounds each weight to 8 significant bits (relative error at most 2^-9), so a BF16 reference
equals the FP32 model only to that rounding; its log-probabilities are exactly those of the model
with its weights rounded to BF16 (computed in the plan's compute dtype).
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from megatrain.errors import ConfigError
from megatrain.rl.logprobs import token_logprobs


def precompute_reference(trainer, batches: Iterable[Mapping[str, torch.Tensor]], *,
                         key: str = "ref_logprobs") -> list[dict[str, torch.Tensor]]:
    """Each batch with ``trainer.logprobs(batch)`` added under ``key`` (``[rows, seq_len]``
    float32): the reference log-probabilities of the trainer's current weights. Call it before
    the first step (the reference is then the initial policy); the batches are read now, in
    order, and returned as new dicts.

    Raises:
        BatchError / ConfigError: as ``Trainer.logprobs``.
    """
    return [{**batch, key: trainer.logprobs(batch)} for batch in batches]


class Reference:
    """A frozen BF16 copy of ``trainer``'s current weights (2 bytes per parameter of host memory,
    ``nbytes``), and its per-token log-probabilities through the trainer's schedules.

    Args:
        trainer: a ``Trainer`` compiled with ``reference="bfloat16"`` (its plan counts the copy);
            a deferred update is applied first, so the copy is of the latest weights.
        weights: instead of the trainer's current weights, a saved copy: ``[sum of the layers'
            numel]`` BF16 CPU, a former reference's :attr:`weights` (what a resumed run reads back
            from its checkpoint).

    Raises:
        ConfigError: the trainer's plan does not count a reference (compile with
            ``reference="bfloat16"``), or its masters are not all in this host's memory (a state
            sharded across nodes, masters on NVMe); ``weights`` of another dtype or size (naming
            both).
    """

    def __init__(self, trainer, weights: torch.Tensor | None = None):
        plan, host = trainer.plan, trainer.host
        if trainer.planned.memory.reference_weights == 0:
            raise ConfigError("this trainer's plan holds no reference model: compile with reference='bfloat16' so that "
                              "the planner counts its 2 bytes per parameter of host memory (or precompute the "
                              "reference log-probabilities with megatrain.rl.precompute_reference)")
        if host.sliced or plan.nvme_masters:
            raise ConfigError("a BF16 reference copies the FP32 masters from host memory, but this plan keeps some "
                              "of them elsewhere (host_state='shard', or masters on NVMe); precompute the reference "
                              "log-probabilities instead")
        trainer.flush()
        layers = trainer.graph.layers
        self.trainer = trainer
        numel = sum(layer.numel for layer in layers)
        if weights is not None and (weights.dtype != torch.bfloat16 or weights.shape != (numel,)):
            raise ConfigError(f"reference weights: {weights.dtype} {tuple(weights.shape)} given, but this model's "
                              f"reference is torch.bfloat16 ({numel},): a copy saved from another model or plan")
        self._flat = torch.empty((numel,), dtype=torch.bfloat16) if weights is None else weights.contiguous()
        self.rows: list[torch.Tensor] = []
        at = 0
        for li, layer in enumerate(layers):
            row = self._flat[at:at + layer.numel]
            if weights is None:
                row.copy_(host.master(li)[:layer.numel])
            self.rows.append(row)
            at += layer.numel

    @property
    def weights(self) -> torch.Tensor:
        """The copy as one flat tensor, ``[sum of the layers' numel]`` BF16, each layer's rows in
        order (``Reference(trainer, weights=...)`` takes it back)."""
        return self._flat

    @property
    def nbytes(self) -> int:
        """Host bytes of the copy: 2 per tile element (parameters and their alignment padding)."""
        return self._flat.numel() * self._flat.element_size()

    def logprobs(self, batch: Mapping[str, torch.Tensor], *, entropy: bool = False
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``Trainer.logprobs`` (shapes, alignment and errors the same) of the reference weights:
        the trainer's eval schedule with each layer's weights copied from this BF16 copy. The
        policy's masters, moments and pending updates are not touched (a deferred update is
        applied first, as ``Trainer.logprobs`` does)."""
        return token_logprobs(self.trainer, batch, entropy=entropy, weights=self.rows)


__all__ = ["Reference", "precompute_reference"]
