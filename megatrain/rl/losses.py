"""Losses over per-token log-probabilities: GRPO and DPO, exact under any split of the batch.

``Trainer.step(batch, loss=...)`` trains on a :class:`TokenLoss`: a function of the per-token
log-probabilities of the labels (``Trainer.logprobs``'s alignment: ``logprobs[b, t]`` is the
log-probability of ``labels[b, t]`` given the tokens before it, 0 where there is no target) and of
per-row tensors of the batch (advantages, old and reference log-probabilities). The step runs the
global batch in micro-batches (and data-parallel ranks) as any step does; the loss layer's local
backward computes each micro-batch's log-probabilities, calls the loss on them, and seeds the
chunked LM head's backward with ``dloss/dlogprob`` (:mod:`megatrain.kernels.logprobs`), so the
other layers and the plan are unchanged.

A loss is exact under every split when the global batch's loss is the sum of its micro-batches'
terms, each a function of the micro-batch's rows and of sums over the whole batch that do not
depend on the log-probabilities (the tokens to average over, the sequences, the pairs). A
:class:`TokenLoss` states them: ``totals(mask, tensors)`` gives its sums over some rows; megatrain
adds them over the micro-batches and ranks before the step (as the token-weighted loss counts its
targets, :mod:`megatrain.runtime.loss`), and ``loss(logprobs, mask, tensors, totals)`` is the rows'
term of the global loss. ``whole(...)`` is the loss of one batch computed at once, eagerly.

Built in (each with its source; written from the papers' formulas, reading TRL's ``dpo_loss`` and
VERL's ``core_algos`` for their conventions):

- :class:`GRPOLoss`: the clipped importance-ratio policy gradient (PPO, Schulman et al. 2017,
  arXiv:1707.06347) with GRPO's KL to the reference by the k3 estimator (Shao et al. 2024,
  DeepSeekMath, arXiv:2402.03300, eq. 3-4; Schulman 2020, "Approximating KL divergence"), and the
  aggregation over tokens as VERL names it (``loss_agg_mode``): ``"token-mean"`` over every token of
  the global batch (DAPO, Yu et al. 2025, arXiv:2503.14476, sec. 3.3), ``"seq-mean-token-mean"``
  (GRPO's per-sequence mean, then the mean over sequences) or ``"seq-mean-token-sum-norm"`` (Dr.
  GRPO, Liu et al. 2025, arXiv:2503.20783: each sequence's sum over a constant instead of its
  length). Asymmetric clipping (DAPO's clip-higher) by ``clip_high``.
- :class:`DPOLoss`: DPO's sigmoid loss (Rafailov et al. 2023, arXiv:2305.18290, eq. 7) with
  conservative DPO's label smoothing (Mitchell 2023, "A note on DPO with noisy preferences"), or
  IPO's squared loss (Azar et al. 2023, arXiv:2310.12036, eq. 17) on the per-token means of the
  sequences' log-probabilities, as TRL's ``DPOTrainer`` computes it.

:func:`group_advantages` makes GRPO's group-normalised advantages from rewards, and
:func:`interleave_pairs` a DPO batch from chosen and rejected rows.
"""

from __future__ import annotations

from typing import Literal, Mapping

import torch
import torch.nn.functional as F

from megatrain.errors import BatchError, ConfigError

Tensors = Mapping[str, torch.Tensor]


class TokenLoss:
    """A loss over per-token log-probabilities that ``Trainer.step(batch, loss=...)`` trains on
    exactly under any micro-batch and data-parallel split (module docstring).

    Subclasses set:
        inputs: the batch's tensors the loss reads besides the model's inputs, by name, each
            ``[rows, seq_len]`` (per token, aligned as the log-probabilities) or ``[rows]`` (per
            sequence), float; ``optional``: those of them that may be absent.
        rows_per_unit: rows that must stay in one micro-batch together (2 for DPO's pairs).

    and implement :meth:`totals`, :meth:`__call__` and (to refuse bad input before a step)
    :meth:`check`.
    """

    inputs: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    rows_per_unit: int = 1

    def check(self, mask: torch.Tensor, tensors: Tensors) -> None:
        """Refuse bad input (called on each rank's whole batch before anything runs). ``mask``:
        ``[rows, seq_len]`` bool, the positions with a target. Raises BatchError naming the row."""
        empty = (~mask.any(dim=1)).nonzero().flatten()
        if len(empty):
            raise BatchError(f"row {int(empty[0])} of the batch has no token with a label (an empty response: every "
                             "label -100 after the model's shift), so its log-probability terms are empty; drop the "
                             "row, or give its response tokens their labels")
        for name in self.inputs:
            if name in tensors and not bool(torch.isfinite(tensors[name]).all()):
                where = tuple(int(i) for i in (~torch.isfinite(tensors[name])).nonzero()[0])
                raise BatchError(f"batch[{name!r}] holds {float(tensors[name][where])} at {list(where)}; the loss needs "
                                 "finite values (positions without a target too: give them 0)")

    def totals(self, mask: torch.Tensor, tensors: Tensors) -> dict[str, float]:
        """The sums over these rows (``mask`` ``[rows, seq_len]`` bool, ``tensors`` the rows' inputs)
        that the loss normalises by, which add over rows: megatrain sums them over the global batch."""
        return {}

    def __call__(self, logprobs: torch.Tensor, mask: torch.Tensor, tensors: Tensors,
                 totals: Mapping[str, float]) -> torch.Tensor:
        """The term of these rows in the global batch's loss, a 0-dim tensor differentiable in
        ``logprobs`` (``[rows, seq_len]`` FP32, 0 where ``mask`` is False), given the global ``totals``."""
        raise NotImplementedError

    def whole(self, logprobs: torch.Tensor, mask: torch.Tensor, tensors: Tensors) -> torch.Tensor:
        """The loss of one whole batch at once, eagerly: :meth:`check`, then ``self(logprobs, mask,
        tensors, self.totals(mask, tensors))``. Raises BatchError as :meth:`check`."""
        self.check(mask, tensors)
        return self(logprobs, mask, tensors, self.totals(mask, tensors))


def _per_token(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-sequence ``[rows]`` tensor broadcast over the tokens of ``like`` ``[rows, T]``."""
    return t.unsqueeze(1) if t.dim() == 1 else t


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""How :class:`GRPOLoss` averages its token losses (VERL's ``loss_agg_mode`` names)."""


class GRPOLoss(TokenLoss):
    """GRPO's loss (Shao et al. 2024, arXiv:2402.03300, eq. 3; the clipped surrogate of PPO,
    Schulman et al. 2017, arXiv:1707.06347, eq. 7), per token ``t`` of a response:

        r_t = exp(logp_t - old_t)
        l_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t) + kl_coef * k3_t
        k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (Schulman's k3, GRPO eq. 4)

    aggregated over the global batch by ``aggregation``:

    - ``"token-mean"`` (default): ``sum_t l_t / N``, ``N`` every response token of the global batch
      (DAPO, arXiv:2503.14476: long responses are not down-weighted);
    - ``"seq-mean-token-mean"``: ``(1/S) sum_s (1/|s|) sum_{t in s} l_t`` over the ``S`` rows (GRPO);
    - ``"seq-mean-token-sum-norm"``: ``sum_t l_t / max_tokens`` (Dr. GRPO, arXiv:2503.20783; VERL
      divides by the response length, here ``max_tokens``, default the compiled ``seq_len``).

    Batch tensors: ``advantages`` (``[rows]`` per sequence, e.g. :func:`group_advantages`, or
    ``[rows, seq_len]`` per token), ``old_logprobs`` ``[rows, seq_len]`` (the policy's at rollout,
    ``Trainer.logprobs``; absent: on-policy, ``old = logp`` detached, so ``r_t = 1`` with its
    gradient, as VERL does for one update per rollout), ``ref_logprobs`` ``[rows, seq_len]`` (the
    reference's, needed when ``kl_coef > 0``). Unlike VERL, no dual clip and no clamping of the
    log-ratios.

    Raises (constructor): ConfigError for clip ranges outside ``[0, 1)`` / ``>= 0``, a negative
    ``kl_coef``, an unknown aggregation or ``max_tokens < 1``.
    """

    inputs = ("advantages", "old_logprobs", "ref_logprobs")
    optional = ("old_logprobs", "ref_logprobs")

    def __init__(self, clip_low: float = 0.2, clip_high: float | None = None, kl_coef: float = 0.0,
                 aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean",
                 max_tokens: int | None = None):
        clip_high = clip_low if clip_high is None else clip_high
        if not (0 <= clip_low < 1 and clip_high >= 0):
            raise ConfigError(f"GRPOLoss: clip_low={clip_low} must be in [0, 1) and clip_high={clip_high} >= 0")
        if not kl_coef >= 0:
            raise ConfigError(f"GRPOLoss: kl_coef={kl_coef} must be >= 0")
        if aggregation not in AGGREGATIONS:
            raise ConfigError(f"GRPOLoss: aggregation={aggregation!r}: use one of {AGGREGATIONS}")
        if max_tokens is not None and max_tokens < 1:
            raise ConfigError(f"GRPOLoss: max_tokens={max_tokens} must be >= 1")
        self.clip_low, self.clip_high, self.kl_coef = clip_low, clip_high, kl_coef
        self.aggregation, self.max_tokens = aggregation, max_tokens

    def check(self, mask, tensors):
        if "advantages" not in tensors:
            raise BatchError("GRPOLoss needs batch['advantages'] ([rows] per sequence, e.g. megatrain.rl."
                             "group_advantages(rewards, group_size), or [rows, seq_len] per token)")
        if self.kl_coef > 0 and "ref_logprobs" not in tensors:
            raise BatchError(f"GRPOLoss(kl_coef={self.kl_coef}) needs batch['ref_logprobs'] [rows, seq_len], the "
                             "reference model's log-probabilities (megatrain.rl.Reference(...).logprobs(batch), or "
                             "trainer.logprobs(batch) before training); or set kl_coef=0")
        super().check(mask, tensors)

    def totals(self, mask, tensors):
        return {"tokens": float(mask.sum()), "rows": float(mask.shape[0])}

    def token_losses(self, logprobs: torch.Tensor, tensors: Tensors) -> torch.Tensor:
        """``l_t`` of every position, ``[rows, seq_len]`` (meaningful where there is a target)."""
        old = tensors.get("old_logprobs")
        old = logprobs.detach() if old is None else old
        adv = _per_token(tensors["advantages"], logprobs)
        ratio = torch.exp(logprobs - old)
        loss = torch.maximum(-ratio * adv, -torch.clamp(ratio, 1 - self.clip_low, 1 + self.clip_high) * adv)
        if self.kl_coef > 0:
            d = tensors["ref_logprobs"] - logprobs
            loss = loss + self.kl_coef * (torch.exp(d) - d - 1)
        return loss

    def __call__(self, logprobs, mask, tensors, totals):
        per = torch.where(mask, self.token_losses(logprobs, tensors), torch.zeros_like(logprobs))
        if self.aggregation == "token-mean":
            return per.sum() / totals["tokens"]
        if self.aggregation == "seq-mean-token-mean":
            return (per.sum(1) / mask.sum(1)).sum() / totals["rows"]
        return per.sum() / (self.max_tokens or logprobs.shape[1])


class DPOLoss(TokenLoss):
    """DPO's loss over preference pairs (Rafailov et al. 2023, arXiv:2305.18290, eq. 7), as TRL's
    ``DPOTrainer.dpo_loss`` defines its ``loss_type`` choices: with ``pi_c``, ``pi_r`` the chosen
    and rejected responses' summed log-probabilities under the policy and ``ref_c``, ``ref_r`` under
    the reference, ``z = (pi_c - pi_r) - (ref_c - ref_r)`` and the mean over the global batch's pairs of

    - ``"sigmoid"``: ``-(1 - label_smoothing) log sigmoid(beta z) - label_smoothing log sigmoid(-beta z)``
      (conservative DPO's smoothing, Mitchell 2023; 0 gives DPO);
    - ``"ipo"``: ``(z - 1 / (2 beta))^2`` on the per-token means of the log-probabilities instead of
      their sums (IPO, Azar et al. 2023, arXiv:2310.12036, eq. 17, as TRL computes it).

    The batch holds each pair as two consecutive rows, chosen then rejected (rows ``2k``, ``2k +
    1``; :func:`interleave_pairs` makes it from separate chosen and rejected batches), so a pair is
    never split between micro-batches: the micro-batch size must be even. Batch tensor:
    ``ref_logprobs`` ``[rows, seq_len]``, the reference's per-token log-probabilities (precomputed
    before training: ``megatrain.rl.precompute_reference``, or a ``megatrain.rl.Reference``).

    Raises (constructor): ConfigError for ``beta <= 0``, ``label_smoothing`` outside ``[0, 0.5)``,
    an unknown ``loss_type`` or label smoothing with IPO.
    """

    inputs = ("ref_logprobs",)
    rows_per_unit = 2

    def __init__(self, beta: float = 0.1, loss_type: Literal["sigmoid", "ipo"] = "sigmoid",
                 label_smoothing: float = 0.0):
        if not beta > 0:
            raise ConfigError(f"DPOLoss: beta={beta} must be > 0")
        if loss_type not in ("sigmoid", "ipo"):
            raise ConfigError(f"DPOLoss: loss_type={loss_type!r}: use 'sigmoid' or 'ipo'")
        if not 0 <= label_smoothing < 0.5 or (label_smoothing and loss_type != "sigmoid"):
            raise ConfigError(f"DPOLoss: label_smoothing={label_smoothing} must be in [0, 0.5), with "
                              "loss_type='sigmoid'")
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing

    def check(self, mask, tensors):
        if mask.shape[0] % 2:
            raise BatchError(f"a DPO batch holds pairs as consecutive rows (chosen, rejected), but it has "
                             f"{mask.shape[0]} rows; build it with megatrain.rl.interleave_pairs(chosen, rejected)")
        if "ref_logprobs" not in tensors:
            raise BatchError("DPOLoss needs batch['ref_logprobs'] [rows, seq_len], the reference model's per-token "
                             "log-probabilities: megatrain.rl.precompute_reference(trainer, batches) before training, "
                             "or megatrain.rl.Reference(trainer).logprobs(batch)")
        super().check(mask, tensors)

    def totals(self, mask, tensors):
        return {"pairs": mask.shape[0] / 2}

    def margins(self, logprobs: torch.Tensor, mask: torch.Tensor, tensors: Tensors) -> torch.Tensor:
        """``z`` of each pair, ``[rows / 2]``."""
        def per_row(lp):
            s = torch.where(mask, lp, torch.zeros_like(lp)).sum(1)
            return s / mask.sum(1) if self.loss_type == "ipo" else s
        pi, ref = per_row(logprobs), per_row(tensors["ref_logprobs"])
        return (pi[0::2] - pi[1::2]) - (ref[0::2] - ref[1::2])

    def __call__(self, logprobs, mask, tensors, totals):
        z = self.margins(logprobs, mask, tensors)
        if self.loss_type == "ipo":
            losses = (z - 1 / (2 * self.beta)) ** 2
        else:
            losses = -(1 - self.label_smoothing) * F.logsigmoid(self.beta * z)
            if self.label_smoothing:
                losses = losses - self.label_smoothing * F.logsigmoid(-self.beta * z)
        return losses.sum() / totals["pairs"]


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's outcome advantages (Shao et al. 2024, arXiv:2402.03300, sec. 4.1.2): each reward minus
    its group's mean, divided by the group's standard deviation (``scale``; Bessel-corrected, as
    ``torch.std``, plus ``eps``); ``scale=False`` leaves the division out (Dr. GRPO,
    arXiv:2503.20783). A group whose rewards are all equal gets advantages of exactly 0. ``rewards``: ``[rows]`` float, ``group_size`` consecutive rows per prompt.
    Returns ``[rows]`` float32.

    Raises:
        BatchError: ``group_size < 2`` (one response per prompt has no baseline: every advantage
            would be 0), ``rows`` not a multiple of it, or a reward that is NaN or infinite.
    """
    if rewards.dim() != 1:
        raise BatchError(f"rewards must be [rows], one per response; got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise BatchError(f"group_size={group_size}: GRPO compares the responses of one prompt with each other, so a "
                         "group needs at least 2 (with 1, every advantage is 0 and nothing is learned)")
    if len(rewards) % group_size:
        raise BatchError(f"{len(rewards)} rewards do not split into groups of {group_size}; give group_size "
                         "responses per prompt, in consecutive rows")
    bad = (~torch.isfinite(rewards)).nonzero().flatten()
    if len(bad):
        raise BatchError(f"reward {float(rewards[bad[0]])} of row {int(bad[0])} is not finite; the reward function "
                         "must return a finite number for every response")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if scale:
        adv = adv / (r.std(1, keepdim=True) + eps)
    # A group of equal rewards has no advantage: its mean is rounded (eight 0.1s average to 0.1 + 1 ulp),
    # and that rounding over eps would otherwise be an advantage of ~0.01 for every response.
    return torch.where(r.amax(1, keepdim=True) == r.amin(1, keepdim=True), 0.0, adv).flatten()


def interleave_pairs(chosen: Tensors, rejected: Tensors) -> dict[str, torch.Tensor]:
    """A DPO batch from ``chosen`` and ``rejected`` batches of the same keys and shapes
    (``[pairs, ...]`` each): rows ``2k`` chosen, ``2k + 1`` rejected (:class:`DPOLoss`'s layout).

    Raises:
        BatchError: other keys, other numbers of pairs, or other shapes (sequence lengths: pad both
            to the compiled ``seq_len``).
    """
    if set(chosen) != set(rejected):
        raise BatchError(f"chosen has tensors {sorted(chosen)}, rejected {sorted(rejected)}: give both the same")
    out = {}
    for k in chosen:
        c, r = chosen[k], rejected[k]
        if c.shape != r.shape:
            raise BatchError(f"chosen[{k!r}] has shape {tuple(c.shape)} but rejected[{k!r}] {tuple(r.shape)}: a pair "
                             "needs as many rows on each side and the same sequence length (pad both to seq_len)")
        out[k] = torch.stack((c, r), dim=1).flatten(0, 1)
    return out


__all__ = ["AGGREGATIONS", "DPOLoss", "GRPOLoss", "TokenLoss", "group_advantages", "interleave_pairs"]
