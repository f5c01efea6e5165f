"""``megatrain.compile(model)`` without shapes: the schedule follows the batches.

:class:`ShapeFreeTrainer` plans the model for the shape of the first batch it is given, and for
every new shape after it, and keeps those plans in a bounded cache keyed by
``(micro_batch_size, seq_len)``. Every plan trains the same host tiles (FP32 masters, AdamW
moments and step counts: one set, shared), so switching shape changes which schedule runs, never
the training state.

What a new shape costs. ``torch.export`` specialises the traced graph to the example's shape (view
and reshape sizes, the causal mask's ``arange``, the chunked loss's split points are constants of
the graph), and the LayerGraph's per-layer FLOPs and activation bytes scale with
``micro_batch_size x seq_len``, which the plan (slots, prefetch, checkpoints) is chosen for. So a
new shape is traced, planned, lowered and verified once (``megatrain.plan_model``), then reused
from the cache on every later batch of that shape; only a cache miss traces. Variable-length data
should use ``seq_len_buckets``: a batch is right-padded to the smallest bucket that holds it
(``input_ids`` with 0, ``labels`` with -100, ``attention_mask`` with 0, ``position_ids``
continuing each row's count), so a handful of schedules serve every length, and the padding
changes no loss: the padded positions come after every real token (causal attention never lets a
real token see them) and their labels are ignored.

The cache holds at most ``max_shapes`` plans (least recently used out first) and warns, naming the
shapes it has seen, the first time it evicts one: shapes that keep changing trace again and again.
On ``device="cuda"`` only the current shape's executor holds GPU buffers; a switch releases them.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from megatrain.data.packing import IGNORE_INDEX
from megatrain.errors import BatchError, ConfigError
from megatrain.optim import optimizer_settings, spec_of
from megatrain.planner.trace.qwen_vl import row_grids
from megatrain.planner.trace.vlm import row_images
from megatrain.product.materializer import materialize
from megatrain.product.planning import plan_model
from megatrain.trainer import Trainer

__all__ = ["ShapeFreeTrainer", "pad_to_bucket"]

PROBE_SEQ_LEN = 8
"""Tokens per sequence of the shape :meth:`ShapeFreeTrainer.load` plans when no batch has come yet
(the host tiles do not depend on the shape; a short one traces fastest)."""

DEFAULT_MAX_SHAPES = 8
"""Plans a :class:`ShapeFreeTrainer` keeps by default: enough for a few ``seq_len`` buckets at a
couple of batch sizes; each is a traced graph and its schedules (host metadata, no tensors)."""

_IMAGE_INPUTS = frozenset({"pixel_values", "image_grid_thw"})
"""A vision-language batch's image inputs, which :func:`pad_to_bucket` leaves as they are."""


def pad_to_bucket(batch: Mapping[str, torch.Tensor], buckets: Sequence[int]) -> dict[str, torch.Tensor]:
    """Right-pad every ``[rows, seq]`` tensor of ``batch`` to the smallest bucket ``>= seq``.

    ``input_ids`` and unknown inputs are padded with 0, ``labels`` with -100 (ignored by the loss),
    ``attention_mask`` with 0 and ``position_ids`` by continuing each row's last position (so no
    new document starts in the padding); ``pixel_values`` and ``image_grid_thw`` stay as they are.

    Raises:
        BatchError: the batch is longer than the largest bucket (names both; add a bucket).
    """
    seq = next(iter(batch.values())).shape[-1]
    fits = [b for b in sorted(buckets) if b >= seq]
    if not fits:
        raise BatchError(f"batch sequence length {seq} exceeds the largest seq_len bucket {max(buckets)}; "
                         f"add a bucket >= {seq} to seq_len_buckets or crop the batch")
    pad = fits[0] - seq
    if pad == 0:
        return dict(batch)
    out = {}
    for name, t in batch.items():
        if name in _IMAGE_INPUTS:
            out[name] = t  # images are not tokens: nothing of theirs follows the sequence length
            continue
        if name == "position_ids":
            tail = t[:, -1:] + torch.arange(1, pad + 1, dtype=t.dtype)
        else:
            fill = IGNORE_INDEX if name == "labels" else 0
            tail = torch.full((t.shape[0], pad), fill, dtype=t.dtype)
        out[name] = torch.cat([t, tail], dim=1)
    return out


class ShapeFreeTrainer:
    """A trainer whose shapes come from its batches (``megatrain.compile(model)`` with no
    ``seq_len``). See the module docstring for the cache and the buckets.

    ``step``, ``evaluate``, ``flush``, ``set_lr``, ``set_optimizer``, ``save``, ``load`` and
    ``state_dict`` behave as ``Trainer``'s; ``step`` takes a batch of any ``[rows, seq_len]`` (and,
    for Qwen2-VL, rows of any images: the grids of the row with the most patches are part of the
    shape, a patch budget every row fits; for LLaVA, up to any number of images per row: ``pixel_values`` in
    ``images_per_row`` slots a row, ``[rows x images_per_row, C, H, W]``, or one per real image
    (``images_per_row`` then the most a row has), ``images_per_row`` part of the shape) with ``rows`` a
    multiple of ``micro_batches``, split into ``micro_batches`` micro-batches of
    ``rows // micro_batches`` (or of ``micro_batch_size`` rows when given, then ``rows`` must be a
    multiple of it times ``micro_batches``). ``trainer`` is the ``Trainer`` of the last shape run
    (None before the first batch); ``shapes`` the cached ``(micro_batch_size, seq_len)`` keys
    (``(micro_batch_size, seq_len, grids of a row)`` for Qwen2-VL with images,
    ``(micro_batch_size, seq_len, images_per_row)`` for LLaVA with more than one image per row),
    least recently used first; ``traces`` how many shapes were planned so far.

    Raises (from ``step``/``evaluate``): BatchError for a batch whose rows do not split, or
    longer than every bucket; what ``compile`` raises for a shape that cannot be planned (a
    ``seq_len`` beyond the model's positions, a plan that does not fit), naming the shape.
    """

    def __init__(self, model: nn.Module, *, micro_batch_size: int | None = None, micro_batches: int = 1,
                 seq_len_buckets: Sequence[int] | None = None, max_shapes: int = DEFAULT_MAX_SHAPES,
                 optimizer: Any = None, nvme_dir: str | None = None, **compile_kwargs: Any) -> None:
        if max_shapes < 1:
            raise ConfigError(f"max_shapes={max_shapes}: keep at least one shape's plan")
        if micro_batches < 1 or (micro_batch_size is not None and micro_batch_size < 1):
            raise ConfigError(f"micro_batches={micro_batches} and micro_batch_size={micro_batch_size} must be >= 1")
        if seq_len_buckets is not None and (not seq_len_buckets or min(seq_len_buckets) < 1):
            raise ConfigError(f"seq_len_buckets={seq_len_buckets!r}: give positive sequence lengths")
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.micro_batches = micro_batches
        self.seq_len_buckets = tuple(sorted(seq_len_buckets)) if seq_len_buckets else None
        self.max_shapes = max_shapes
        self.optimizer = optimizer_settings(optimizer)
        self.compile_kwargs = compile_kwargs
        self.nvme_dir = nvme_dir
        self._plans: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._key: tuple | None = None
        self.trainer = None
        self._host = None
        self.step_count = 0
        self.traces = 0
        self._warned = False

    @property
    def shapes(self) -> list[tuple]:
        return list(self._plans)

    # -- shape dispatch -----------------------------------------------------------------------------
    def _prepare(self, batch) -> tuple[dict[str, torch.Tensor], tuple, dict[str, Any]]:
        if isinstance(batch, torch.Tensor):
            batch = {"input_ids": batch, "labels": batch}
        if not isinstance(batch, Mapping) or not batch:
            raise BatchError("batch must be a non-empty dict of [rows, seq_len] tensors (or one tensor)")
        first = next(iter(batch.values()))
        if not isinstance(first, torch.Tensor) or first.dim() != 2:
            raise BatchError("batch tensors must be [rows, seq_len]")
        if self.seq_len_buckets:
            batch = pad_to_bucket(batch, self.seq_len_buckets)
        rows, seq = next(iter(batch.values())).shape
        per_step = self.micro_batches * (self.micro_batch_size or 1)
        if rows % per_step:
            raise BatchError(f"batch has {rows} rows, not a multiple of {per_step} (micro_batches="
                             f"{self.micro_batches}, micro_batch_size={self.micro_batch_size}); drop or add rows")
        mbs = self.micro_batch_size or rows // self.micro_batches
        # The images of a row are part of the shape: the compile options that trace them.
        layout = {}
        grid, images = row_grids(batch, getattr(self.model, "config", None)), row_images(batch, self.model)
        if grid is not None:
            layout["image_grid_thw"] = grid
        if images != 1:
            layout["images_per_row"] = images
        return dict(batch), (mbs, seq, *layout.values()), layout

    def _switch(self, key: tuple, layout: Mapping[str, Any] | None = None) -> Any:
        if key == self._key:
            return self.trainer
        if self.trainer is not None:
            self.trainer.flush()  # the deferred update belongs to the tiles, not to this shape
            self.trainer = None  # its executor's buffers (GPU slots on CUDA) go with it
        planned = self._plans.get(key)
        if planned is None:
            mbs, seq, *_ = key
            try:
                # Shapes share one host state: a node mapping made without shared staging tiles
                # (an earlier shape's plan did not share casts) does not grow, so this shape's
                # ranks cast into tiles of their own.
                planned = plan_model(self.model, seq_len=seq, micro_batch_size=mbs,
                                     micro_batches=self.micro_batches, optimizer_name=spec_of(self.optimizer).name,
                                     **{**self.compile_kwargs, **(layout or {})},
                                     shared_staging=None if self._host is None else bool(self._host.staging))
            except Exception as e:
                e.add_note(f"(planning the batch shape micro_batch_size={mbs}, seq_len={seq}"
                           + "".join(f", {n}={v if n != 'image_grid_thw' else [list(g) for g in v]}"
                                     for n, v in (layout or {}).items()) + ")")
                raise
            self.traces += 1
            self._plans[key] = planned
            if len(self._plans) > self.max_shapes:
                old, _ = self._plans.popitem(last=False)
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"megatrain: more than max_shapes={self.max_shapes} batch shapes (micro_batch_size, "
                        f"seq_len) seen ({[*self._plans, old]}); each new shape traces and plans the model "
                        "again. Pad batches to a few lengths with seq_len_buckets=(...) or compile with "
                        "seq_len= and micro_batch_size=", stacklevel=3)
        self._plans.move_to_end(key)
        trainer = materialize(planned, self.optimizer, nvme_dir=self.nvme_dir, host=self._host)
        self._host = trainer.host
        trainer.step_count = self.step_count
        self.trainer, self._key = trainer, key
        return trainer

    # -- Trainer's API ------------------------------------------------------------------------------
    def step(self, batch):
        """One optimizer step on ``batch`` (any shape; see the class docstring). Returns StepResult."""
        batch, key, layout = self._prepare(batch)
        result = self._switch(key, layout).step(batch)
        self.step_count = self.trainer.step_count
        return result

    def evaluate(self, batch) -> float:
        """Mean loss over ``batch`` without updating anything."""
        batch, key, layout = self._prepare(batch)
        return self._switch(key, layout).evaluate(batch)

    def _current(self):
        if self.trainer is None:
            raise ConfigError("no batch has been given yet, so nothing is planned: call step(batch) first")
        return self.trainer

    def flush(self) -> None:
        if self.trainer is not None:
            self.trainer.flush()

    def set_optimizer(self, optimizer) -> None:
        self.optimizer = optimizer
        if self.trainer is not None:
            self.trainer.set_optimizer(optimizer)

    def set_lr(self, lr: float) -> None:
        Trainer.set_lr(self, lr)  # the same check, then this class's set_optimizer

    def save(self, path, **kwargs):
        return self._current().save(path, **kwargs)

    def load(self, path, **kwargs) -> dict:
        """Resume from a checkpoint (see ``Trainer.load``). Before any batch, the host tiles are
        made by planning a probe shape first: the smallest ``seq_len_buckets`` entry, else
        :data:`PROBE_SEQ_LEN` tokens, at ``micro_batch_size`` (default 1); every shape shares them."""
        if self.trainer is None:
            self._switch((self.micro_batch_size or 1,
                          self.seq_len_buckets[0] if self.seq_len_buckets else PROBE_SEQ_LEN))
        out = self.trainer.load(path, **kwargs)
        self.step_count = self.trainer.step_count
        return out

    def state_dict(self, **kwargs) -> dict:
        return self._current().state_dict(**kwargs)
