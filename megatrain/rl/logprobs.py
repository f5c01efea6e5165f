"""Per-token log-probabilities through a trainer's schedules: ``Trainer.logprobs`` and the loss
head of ``Trainer.step(batch, loss=...)``.

Both run the trainer's own schedules (an eval schedule for the log-probabilities, the train
schedule for a step) with the loss layer's template replaced by its per-token version
(:func:`megatrain.planner.trace.token_logprobs.logprobs_template`, through the executor's
:class:`~megatrain.runtime.executor.TokenHead`): the plan, the other layers and every copy stay as
they are. The kernel's rows (the loss's targets after the model's shift) are put back where their
labels are (:func:`~megatrain.planner.trace.token_logprobs.target_positions`), so
``logprobs[b, t]`` is the log-probability of ``labels[b, t]``, 0 where there is no target.

A step on a :class:`~megatrain.rl.losses.TokenLoss`: before anything runs, the loss's inputs are
checked on each rank's rows and its totals (tokens, rows, pairs) summed over the ranks (one
all-reduce of a flag, so that a rank that refuses its batch stops every rank, then one of the
totals); in the loss layer's local backward each micro-batch's log-probabilities go through the
loss, and ``dloss/dlogprob`` seeds the chunked LM head's backward.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx

from megatrain.errors import BatchError, ConfigError
from megatrain.data.packing import IGNORE_INDEX  # re-exported (rl.__all__): the one label the losses skip
from megatrain.ir.graph import retarget
from megatrain.kernels.autocast import no_autocast
from megatrain.planner.trace.token_logprobs import check_positions, logprobs_template, target_graph, target_positions
from megatrain.rl.losses import TokenLoss
from megatrain.runtime.executor import TokenHead


def target_mask(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Where ``Trainer.logprobs`` of a Hugging Face causal LM (or any model that shifts its labels
    by one token) has a value: ``labels != ignore_index``, except position 0, which nothing
    predicts. ``labels``: ``[rows, seq_len]``; returns ``BoolTensor[rows, seq_len]``."""
    mask = labels != ignore_index
    mask[..., 0] = False
    return mask


@dataclass
class _Heads:
    """What a trainer's per-token runs share: the loss layer, its per-token templates on the
    device (by mode and entropy), the targets graph and where one micro-batch's rows sit."""

    layer: int
    loss_index: int
    targets: fx.GraphModule
    ignore: int
    inputs: tuple[str, ...]
    templates: dict[tuple[bool, bool], fx.GraphModule] = field(default_factory=dict)
    positions: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    def template(self, trainer, train: bool, entropy: bool = False) -> fx.GraphModule:
        key = (train, entropy)
        if key not in self.templates:
            traced = trainer.traced
            t = trainer.graph.layers[self.layer].template
            evals = traced.eval_templates
            # Dropout: a step trains with it, log-probabilities are the eval mode's.
            gm = traced.templates[t] if train or t >= len(evals) or evals[t] is None else evals[t]
            self.templates[key] = retarget(logprobs_template(gm, self.loss_index, entropy), trainer.backend.device)
        return self.templates[key]

    def locate(self, part: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index, valid)`` of micro-batch ``part``'s rows: each row's flat position in its labels,
        and whether it has a target. Raises ConfigError where the targets are not the labels re-indexed."""
        shape = tuple(part["labels"].shape)
        if shape not in self.positions:
            self.positions[shape] = target_positions(self.targets, self.ignore, dict(part), self.inputs)
        pos = self.positions[shape]
        rows = check_positions(self.targets, self.ignore, pos, dict(part), self.inputs)
        return pos, rows != self.ignore


_HEADS: "weakref.WeakKeyDictionary[Any, _Heads]" = weakref.WeakKeyDictionary()


def _heads(trainer) -> _Heads:
    if trainer not in _HEADS:
        traced, g = trainer.traced, trainer.graph
        if traced.count_targets is None:
            raise ConfigError("per-token log-probabilities are those of the loss's targets, but megatrain cannot count "
                              f"this model's ({g.meta.get('uncounted_loss_because')}); use a causal LM whose loss is "
                              "one mean cross-entropy of its LM head")
        targets, ignore = target_graph(traced.count_targets)
        li = len(g.layers) - 1
        _HEADS[trainer] = _Heads(li, g.layers[li].outputs.index(g.loss), targets, ignore, tuple(g.batch_inputs))
    return _HEADS[trainer]


def _align(rows: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``rows`` (``[n]``, the kernel's) put at their labels' positions in a ``shape`` tensor of
    zeros; differentiable in ``rows``."""
    where = index[valid].to(rows.device)
    flat = torch.zeros(math.prod(shape), dtype=rows.dtype, device=rows.device)
    return flat.index_put((where,), rows[valid.to(rows.device)]).view(shape)


def _mask(index: torch.Tensor, valid: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return _align(torch.ones(index.shape, dtype=torch.bool), index, valid, shape)


def _model_batch(trainer, batch) -> dict[str, torch.Tensor]:
    if not isinstance(batch, Mapping):
        raise BatchError(f"batch must be a dict of tensors (the compiled inputs, labels among them), not "
                         f"{type(batch).__name__}")
    return {n: t for n, t in batch.items() if n in trainer.options.input_names}


def token_logprobs(trainer, batch, *, entropy: bool = False, weights=None):
    """``Trainer.logprobs`` (see there); ``weights``: each layer's weights read from these host
    rows instead of the masters (:class:`megatrain.rl.Reference`)."""
    d = _model_batch(trainer, batch)
    rows, mbs = trainer.batches.rows(d), trainer.options.micro_batch_size
    if rows % mbs:
        raise BatchError(f"logprobs got {rows} rows; it needs a multiple of micro_batch_size={mbs}")
    k = rows // mbs
    heads = _heads(trainer)
    parts = trainer.batches.split(d, k)
    where = [heads.locate(p) for p in parts]
    targets = trainer.executor.targets(parts)
    trainer.flush()
    outs: dict[int, torch.Tensor] = {}

    def keep(mb: int, t: torch.Tensor) -> torch.Tensor:
        outs[mb] = t
        return t.new_zeros(())

    head = TokenHead(heads.layer, heads.template(trainer, train=False, entropy=entropy), keep=keep)
    trainer.run_schedule(trainer.eval_schedule(k), parts, "logprobs", targets, head=head, weights=weights)
    shape = tuple(parts[0]["labels"].shape)
    got = [outs[mb].float().cpu() for mb in range(k)]
    lp = torch.cat([_align(x[0] if entropy else x, *where[mb], shape) for mb, x in enumerate(got)])
    if not entropy:
        return lp
    return lp, torch.cat([_align(x[1], *where[mb], shape) for mb, x in enumerate(got)])


def loss_inputs(trainer, batch, loss: TokenLoss) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``batch`` of ``Trainer.step(batch, loss=...)`` as ``(model inputs, loss tensors)``, the latter
    float32, each ``[rows, seq_len]`` or ``[rows]``.

    Raises:
        BatchError: a tensor neither input nor loss reads, or a loss tensor of another shape, or not floating point.
        ConfigError: ``loss`` is not a TokenLoss.
    """
    if not isinstance(loss, TokenLoss):
        raise ConfigError(f"loss={loss!r}: give a megatrain.rl.TokenLoss (GRPOLoss, DPOLoss, or a subclass stating its "
                          "inputs and totals, so that it is exact under any split of the batch)")
    if not isinstance(batch, Mapping):
        raise BatchError(f"batch must be a dict of the compiled inputs and the loss's tensors {list(loss.inputs)}, "
                         f"not {type(batch).__name__}")
    names = trainer.options.input_names
    extra = sorted(set(batch) - set(names) - set(loss.inputs))
    if extra:
        raise BatchError(f"batch has tensors {extra} that neither the model (inputs {list(names)}) nor the loss "
                         f"({type(loss).__name__}: {list(loss.inputs)}) reads; drop them")
    model = {n: t for n, t in batch.items() if n in names}
    rows, seq = trainer.batches.rows(model), trainer.options.seq_len
    tensors = {}
    for name in loss.inputs:
        if name not in batch:
            continue
        t = batch[name]
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or tuple(t.shape) not in ((rows,), (rows, seq)):
            what = f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise BatchError(f"batch[{name!r}] is {what}; {type(loss).__name__} takes it as float [{rows}, {seq}] (per "
                             f"token, aligned with labels) or [{rows}] (per sequence)")
        tensors[name] = t.detach().float().cpu()
    return model, tensors


def loss_head(trainer, parts: list[dict[str, torch.Tensor]], tensors: dict[str, torch.Tensor],
              loss: TokenLoss) -> TokenHead:
    """The :class:`TokenHead` of a step on ``loss`` over this rank's micro-batches ``parts`` and
    the loss's ``tensors`` (their rows in order). Checks the input and sums the totals over the
    ranks first.

    Raises:
        BatchError: the loss refuses this rank's rows (``TokenLoss.check``), or another rank refused its own.
        ConfigError: a micro-batch size that would split the loss's units (DPO's pairs).
    """
    mbs = trainer.options.micro_batch_size
    if mbs % loss.rows_per_unit:
        raise ConfigError(f"{type(loss).__name__} keeps {loss.rows_per_unit} consecutive rows together (a preference "
                          f"pair), but micro_batch_size={mbs} would split them between micro-batches; compile with a "
                          f"micro_batch_size that is a multiple of {loss.rows_per_unit}")
    heads = _heads(trainer)
    shape = tuple(parts[0]["labels"].shape)
    where = [heads.locate(p) for p in parts]
    masks = [_mask(i, v, shape) for i, v in where]
    mask = torch.cat(masks)
    error, totals = None, {}
    try:
        loss.check(mask, tensors)
        totals = loss.totals(mask, tensors)
    except BatchError as e:
        error = e
    if trainer.plan.data_parallel > 1:
        totals = _over_ranks(trainer, error, totals)
    elif error is not None:
        raise error
    per = [{k: t[mb * mbs:(mb + 1) * mbs] for k, t in tensors.items()} for mb in range(len(parts))]

    def seed(mb: int, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = t.device
        x = t.detach().requires_grad_(True)
        with torch.enable_grad(), no_autocast(dev.type):
            lp = _align(x, *where[mb], shape)
            value = loss(lp, masks[mb].to(dev), {k: v.to(dev) for k, v in per[mb].items()}, totals)
            if not (isinstance(value, torch.Tensor) and value.dim() == 0):
                raise TypeError(f"{type(loss).__name__} returned {type(value).__name__}"
                                f"{list(value.shape) if isinstance(value, torch.Tensor) else ''}; a TokenLoss returns "
                                "a 0-dim tensor (the rows' term of the global loss)")
            (g,) = torch.autograd.grad(value, x, allow_unused=True)
        return value.detach(), torch.zeros_like(t) if g is None else g.to(t.dtype)

    return TokenHead(heads.layer, heads.template(trainer, train=True), seed=seed)


def _over_ranks(trainer, error: BatchError | None, totals: dict[str, float]) -> dict[str, float]:
    """Data parallel: raise on every rank when any refused its rows; else the totals summed over the ranks."""
    from megatrain.runtime.distributed import collective, sum_over_ranks

    group = trainer.host.data_parallel.groups.world
    with collective("the all-reduce of the loss's input checks"):
        refused = int(sum_over_ranks([int(error is not None)], torch.int64, group)[0])
    if error is not None:
        raise error
    if refused:
        raise BatchError(f"{refused} other rank(s) refused their rows of the global batch (their error says why); "
                         "nothing of the step ran")
    with collective("the all-reduce of the loss's totals"):
        summed = sum_over_ranks(list(totals.values()), torch.float64, group).tolist() if totals else []
    return dict(zip(totals, summed))


__all__ = ["IGNORE_INDEX", "loss_head", "loss_inputs", "target_mask", "token_logprobs"]
