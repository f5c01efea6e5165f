"""A global batch checked against what a trainer was compiled for, and cut into its micro-batches.

:class:`MicroBatches` is the ``Trainer``'s batch boundary: ``step``, ``evaluate`` and
``logprobs`` (:mod:`megatrain.rl.logprobs`) hand it what the user passed, and everything it
refuses is refused here, before anything runs, so a bad batch changes nothing. The traced graph
is the reference: each input's dtype and its shape per micro-batch are those of the graph's input
value of that name (``[micro_batch_size, seq_len]`` token ids, or a vision-language model's images).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from megatrain.data.packing import IGNORE_INDEX
from megatrain.errors import BatchError
from megatrain.ir.graph import LayerGraph
from megatrain.planner.trace.vlm import IMAGE_INPUT, prepare_images


class MicroBatches:
    """The batch checks and the micro-batch cut of one compiled model.

    Args:
        model: the module the trainer runs (its ``get_input_embeddings`` and
            ``get_output_embeddings`` bound the token ids and labels, where it has them; a
            vision-language model also prepares its images).
        graph: the traced graph (its input values give each input's dtype and micro-batch shape).
        input_names: the compiled inputs, in order.
        micro_batch_size: sequences per micro-batch.
    """

    def __init__(self, model: nn.Module, graph: LayerGraph, input_names: Sequence[str], micro_batch_size: int):
        self.model = model
        self.graph = graph
        self.input_names = tuple(input_names)
        self.micro_batch_size = micro_batch_size
        self.token_limits = token_limits(model, self.input_names)

    def as_dict(self, batch) -> dict[str, torch.Tensor]:
        """``batch`` as ``{input name: tensor}``: a plain tensor is ``input_ids`` (and ``labels``).

        Raises:
            BatchError: not a tensor or a mapping, a plain tensor for a model with other inputs,
                or inputs missing or beyond the compiled ones.
        """
        names = self.input_names
        if isinstance(batch, torch.Tensor):
            if not set(names) <= {"input_ids", "labels"} or "input_ids" not in names:
                raise BatchError(f"a plain tensor batch is taken as input_ids (and labels), but the model "
                                 f"was compiled with inputs {list(names)}; pass a dict")
            return {n: batch for n in names}
        if not isinstance(batch, Mapping):
            raise BatchError(f"batch must be a dict of tensors or a tensor, not {type(batch).__name__}")
        extra = sorted(set(batch) - set(names))
        if extra:
            raise BatchError(f"batch has inputs {extra} that the model was not compiled with (compiled: "
                             f"{list(names)}); drop them or compile with input_names including them")
        missing = [n for n in names if n not in batch]
        if missing:
            raise BatchError(f"batch lacks inputs {missing}; the model was compiled with inputs {list(names)}")
        return dict(batch)

    def rows(self, batch) -> int:
        """The sequences in ``batch`` (dim 0 of its ``input_ids``, else of its first input).

        Raises:
            BatchError: as :meth:`as_dict`, or a first input that is no ``[batch, seq_len]`` tensor.
        """
        d = self.as_dict(batch)
        first = d.get("input_ids", next(iter(d.values())))  # not pixel_values: LLaVA's may hold several per row
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            raise BatchError("batch tensors must be [batch, seq_len]")
        return first.shape[0]

    def split(self, batch, k: int) -> list[dict[str, torch.Tensor]]:
        """``batch`` checked and cut along dim 0 into ``k`` micro-batches, each input as traced
        (``attention_mask`` as ``LongTensor`` 0/1; a vision-language model's images prepared:
        Qwen2-VL's grids checked and each micro-batch's patches, tower inputs and M-RoPE positions
        made, LLaVA's real images first in each micro-batch and zeros after).

        Raises:
            BatchError: as :meth:`as_dict`; a non-tensor input; a dtype or shape other than
                compiled (``k`` micro-batches of the traced shape); an ``attention_mask`` that is
                not 0/1; a token id or label outside the model's vocabulary.
        """
        mbs = self.micro_batch_size
        slots = self.graph.value_by_name(IMAGE_INPUT).shape[0] // mbs if IMAGE_INPUT in self.input_names else 1
        d = prepare_images(self.model, self.as_dict(batch), self.input_names, self.graph.meta.get("image_grid_thw"),
                           mbs, slots)
        # Each input's micro-batch is its traced length along dim 0: micro_batch_size rows, or
        # LLaVA's micro_batch_size x images_per_row images.
        per: dict[str, int] = {}
        for name, t in d.items():
            if not isinstance(t, torch.Tensor):
                raise BatchError(f"batch[{name!r}] is a {type(t).__name__}, not a tensor")
            if name == "attention_mask":
                d[name] = t = mask_as_long(t)
            # The traced shape of one micro-batch: [micro_batch_size, seq_len] token ids, or a
            # vision-language model's images, [micro_batch_size * images_per_row, C, H, W] float32.
            v = self.graph.value_by_name(name)
            per[name] = v.shape[0]
            want = (k * v.shape[0], *v.shape[1:])
            if str(t.dtype).removeprefix("torch.") != v.dtype:
                what = ("token inputs must be torch.long (int64): convert with .long()" if v.dtype == "int64"
                        else f"the model was traced with {v.dtype} {name}: convert with .to(torch.{v.dtype})")
                raise BatchError(f"batch[{name!r}] has dtype {t.dtype}; {what}")
            if tuple(t.shape) != want:
                per_row = ", ".join(map(str, v.shape[1:]))
                rows = f"{k} micro-batches x {mbs}"
                if v.shape[0] != mbs:  # LLaVA's images: images_per_row of them per row
                    rows += f" rows x images_per_row={v.shape[0] // mbs}"
                raise BatchError(f"batch[{name!r}] has shape {tuple(t.shape)}, but the trainer was compiled "
                                 f"for [{rows}, {per_row}] = {list(want)}: "
                                 "pad or crop the batch, or compile again with its shape")
        for name, limit in self.token_limits.items():
            check_ids(name, d[name], limit)
        return [{n: t[i * per[n]:(i + 1) * per[n]] for n, t in d.items()} for i in range(k)]


def real_tokens(part: Mapping[str, torch.Tensor]) -> int:
    """Tokens of a micro-batch that are not padding: ``attention_mask.sum()``, else every token."""
    mask = part.get("attention_mask")
    if mask is not None:
        return int(mask.sum())
    return next(iter(part.values())).numel()


def no_targets(what: str, world: int) -> str:
    """The message of a batch without a supervised token (on all ``world`` ranks together)."""
    ranks = f" on all {world} ranks" if world > 1 else ""
    return (f"{what} has no supervised token{ranks}: every label is -100 after the model's shift, so its loss "
            "would be the mean over nothing (NaN). Drop the batch, or give it labels (-100 marks only the tokens "
            "the loss skips: padding, prompts, document starts).")


def mask_as_long(mask: torch.Tensor) -> torch.Tensor:
    """A Hugging Face padding mask as the model was traced with it: ``LongTensor`` of 0/1.

    Accepts bool and integer masks (what tokenizers and collators return); values are checked.

    Raises:
        BatchError: a floating-point mask, or values other than 0 and 1 (an additive mask of
            0/-inf, or a 4D mask, is not a padding mask).
    """
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise BatchError(f"batch['attention_mask'] has dtype {mask.dtype}; pass the 0/1 padding mask (1 = real "
                         "token, 0 = padding) as torch.long or torch.bool, as Hugging Face tokenizers return it")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        bad = sorted({int(v) for v in mask.unique()} - {0, 1})[:5]
        raise BatchError(f"batch['attention_mask'] holds values {bad}; a padding mask is 0 (padding) or 1 "
                         "(real token)")
    return mask.long() if mask.dtype != torch.long else mask


def token_limits(model: nn.Module, names: Sequence[str]) -> dict[str, int]:
    """The exclusive upper bound of ``input_ids`` (the input embedding's rows) and of ``labels``
    (the output layer's rows), where the model states them: Hugging Face's ``get_input_embeddings``
    and ``get_output_embeddings`` (labels: else the input bound). Other models are not checked: a
    guess (say, their first ``nn.Embedding``, which may be a position table) could refuse good
    batches; an id out of range then fails inside the step, which leaves the trainer as it was."""
    def call(name: str):
        fn = getattr(model, name, None)
        try:
            return fn() if callable(fn) else None
        except (NotImplementedError, AttributeError):  # transformers' base class without embeddings
            return None

    emb = call("get_input_embeddings")
    head = call("get_output_embeddings")
    vocab_in = emb.num_embeddings if isinstance(emb, nn.Embedding) else None
    vocab_out = head.out_features if isinstance(head, nn.Linear) else vocab_in
    limits = {"input_ids": vocab_in, "labels": vocab_out}
    return {n: limits[n] for n in names if limits.get(n) is not None}


def check_ids(name: str, t: torch.Tensor, limit: int) -> None:
    """Refuse a token id (``input_ids``) or label (``labels``; -100 is ignored) outside ``0..limit - 1``.

    Raises:
        BatchError: naming the first such value and where it is.
    """
    bad = (t < 0) | (t >= limit)
    if name == "labels":
        bad &= t != IGNORE_INDEX
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        allowed = f"0..{limit - 1}" + (f" or {IGNORE_INDEX} (ignored)" if name == "labels" else "")
        raise BatchError(f"batch[{name!r}] holds {int(t[where])} at {list(where)}, but the model has {limit} "
                         f"{'embedding rows' if name == 'input_ids' else 'output classes'} ({name} must be "
                         f"{allowed}); use a tokenizer that matches the model's vocab_size")


__all__ = ["MicroBatches", "real_tokens", "no_targets", "mask_as_long", "token_limits", "check_ids"]
