"""Preference and RL training on megatrain: losses over per-token log-probabilities.

- ``Trainer.logprobs(batch)``: the per-token log-probabilities of the labels, forward only,
  from the chunked LM head (``[B, T, V]`` never exists); :func:`target_mask` says where they are.
- ``Trainer.step(batch, loss=...)``: a step on a :class:`TokenLoss` of them, exact for any split
  of the global batch into micro-batches and ranks; built in: :class:`GRPOLoss`, :class:`DPOLoss`
  (:mod:`megatrain.rl.losses`, each citing its source), with :func:`group_advantages` and
  :func:`interleave_pairs` to build their batches.
- The reference model without a second FP32 copy: :func:`precompute_reference` (its
  log-probabilities over the data before training) or :class:`Reference` (a frozen BF16 copy of
  the weights on the host, streamed through the trainer's own schedule).
- A colocated rollout engine: :func:`rollout_weights` (Hugging Face-named BF16 tensors in buckets
  of a given size, as vLLM's and SGLang's weight updates take them), :func:`release_gpu` and
  :func:`retake_gpu` (the GPU's memory handed over between steps).

Beside them, imported on their own: :mod:`megatrain.rl.rewards` (rewards with TRL's signature for
``megatrain train --task grpo``, and the bundled rule rewards) and :mod:`megatrain.rl.verl`
(megatrain as a VERL training backend: the ``verl`` extra).
"""

from megatrain.rl.losses import AGGREGATIONS, DPOLoss, GRPOLoss, TokenLoss, group_advantages, interleave_pairs
from megatrain.rl.logprobs import target_mask
from megatrain.rl.reference import Reference, precompute_reference
from megatrain.rl.rollout import gpu_released, release_gpu, retake_gpu, rollout_weights

__all__ = ["AGGREGATIONS", "DPOLoss", "GRPOLoss", "Reference", "TokenLoss", "gpu_released", "group_advantages",
           "interleave_pairs", "precompute_reference", "release_gpu", "retake_gpu", "rollout_weights", "target_mask"]
