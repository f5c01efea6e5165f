"""megatrain as a VERL training backend (``pip install 'megatrain[verl]'``): importing this module
registers :class:`MegatrainEngine` in VERL's ``EngineRegistry`` as ``backend="megatrain"`` for
``model_type="language_model"`` (VERL 0.9's engine interface, ``verl/workers/engine/base.py``), so
that a VERL worker whose engine config says ``strategy: megatrain`` (:class:`MegatrainEngineConfig`)
trains with it.

What the engine does with VERL's calls:

- ``infer_batch(data)``: the per-token log-probabilities of VERL's no-padding batch (``input_ids``
  a jagged nested tensor of prompt + response tokens per row) from ``Trainer.logprobs``, returned
  as VERL's engines return them: ``{"model_output": {"log_probs": nested}}``, aligned as VERL aligns
  them (``log_probs[t]`` is the log-probability of token ``t + 1``; the last position 0).
- ``train_batch(data, loss_function)``: one ``Trainer.step`` on VERL's own loss (``ppo_loss``,
  ``sft_loss``, or any ``loss_function(model_output, data, dp_group) -> (loss, metrics)``): the loss
  is called on each micro-batch's log-probabilities and rows of ``data`` with VERL's global
  normalisers (``batch_num_tokens``, ``dp_size``) set as VERL's FSDP engine sets them, so the sum of
  the micro-batches' terms is the global batch's loss, which is what megatrain's per-token head
  trains on (:class:`megatrain.rl.TokenLoss`). Forward, backward and the host AdamW update are one
  pass in megatrain, so ``forward_backward_batch`` without ``forward_only`` and ``optimizer_step``
  are not separate calls here.
- ``get_per_tensor_param()``: the weights as ``(Hugging Face name, BF16 tensor)`` pairs
  (:func:`megatrain.rl.rollout_weights`), what VERL's checkpoint engines send to the rollout.

Limits (VERL 0.9.1 on the CPU, tested in ``tests/test_verl_engine.py``): one process (no data
parallel group: ``dp_size`` 1); every training batch has the compiled number of rows
(``micro_batch_size x micro_batches``) and at most ``seq_len`` tokens a row (megatrain's trainer
has one shape; rows are right-padded to it); text-only inputs; no LoRA, no value model, no
``use_dynamic_bsz``; the learning rate is ``optimizer_config.lr``, constant.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric.utils import Metric
from verl.workers.config.engine import EngineConfig
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry

import megatrain
from megatrain.errors import BatchError, ConfigError
from megatrain.rl.losses import TokenLoss
from megatrain.rl.rollout import release_gpu, rollout_weights

__all__ = ["MegatrainEngine", "MegatrainEngineConfig"]

_ROW = "_megatrain_row"


@dataclasses.dataclass
class MegatrainEngineConfig(EngineConfig):
    """VERL's engine config for megatrain: ``strategy: megatrain``, the trainer's one shape
    (``seq_len`` tokens a row, ``micro_batch_size`` rows a micro-batch, ``micro_batches`` per step)
    and its ``device`` (``cpu`` or ``cuda``)."""

    strategy: str = "megatrain"
    seq_len: int = 1024
    micro_batch_size: int = 1
    micro_batches: int = 1
    device: str = "cuda"

    def __post_init__(self):
        if self.strategy != "megatrain":
            raise ConfigError(f"MegatrainEngineConfig: strategy={self.strategy!r} must be 'megatrain'")


def _rows_of(data: TensorDict) -> int:
    return int(data["input_ids"].offsets().diff().numel()) if data["input_ids"].is_nested else data.batch_size[0]


def _select(data: TensorDict, idx: list[int]) -> TensorDict:
    """The rows ``idx`` of a VERL batch: padded tensors indexed, jagged ones rebuilt, the
    non-tensor entries kept."""
    out = {}
    for key in data.keys():
        value = data.get(key)
        if isinstance(value, torch.Tensor) and value.is_nested:
            out[key] = torch.nested.as_nested_tensor([value[i] for i in idx], layout=torch.jagged)
        elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == data.batch_size[0]:
            out[key] = value[idx]
    sub = TensorDict(out, batch_size=[len(idx)])
    for key in data.keys():
        if key not in out:
            tu.assign_non_tensor(sub, **{key: tu.get_non_tensor_data(data=data, key=key, default=None)})
    return sub


class _VerlLoss(TokenLoss):
    """VERL's ``loss_function`` as a :class:`megatrain.rl.TokenLoss`: megatrain's per-token
    log-probabilities of a micro-batch's rows (``[rows, seq_len]``, ``out[b, t]`` the token ``t``'s)
    become VERL's jagged ``log_probs`` (``[t]`` the token ``t + 1``'s), the rows of ``data`` are
    selected by the batch's row index, and VERL's loss is the rows' term (VERL normalises by the
    global ``batch_num_tokens`` and ``dp_size`` itself, so the terms add to the global loss)."""

    inputs = (_ROW,)

    def __init__(self, fn: Callable, data: TensorDict, lengths: list[int], dp_group=None):
        self.fn, self.data, self.lengths, self.dp_group = fn, data, lengths, dp_group
        self.metrics: list[dict] = []

    def check(self, mask, tensors):
        pass  # VERL's loss masks its own tokens (rows of prompt only are VERL's to refuse)

    def __call__(self, logprobs, mask, tensors, totals):
        idx = [int(i) for i in tensors[_ROW]]
        values = torch.cat([torch.cat([logprobs[j, 1:self.lengths[i]], logprobs.new_zeros(1)])
                            for j, i in enumerate(idx)])
        offsets = torch.tensor([0, *torch.tensor([self.lengths[i] for i in idx]).cumsum(0).tolist()])
        nested = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
        loss, metrics = self.fn(model_output={"log_probs": nested}, data=_select(self.data, idx),
                                dp_group=self.dp_group)
        self.metrics.append(metrics)
        return loss


@EngineRegistry.register(model_type="language_model", backend="megatrain", device=["cuda", "cpu"])
class MegatrainEngine(BaseEngine):
    """VERL's ``BaseEngine`` on a megatrain ``Trainer`` (module docstring).

    Args:
        model_config: VERL's ``HFModelConfig`` (``local_path``: a Hugging Face model directory
            loaded in FP32), or ``model=``: an ``nn.Module`` to compile instead.
        engine_config: a :class:`MegatrainEngineConfig`.
        optimizer_config: VERL's optimizer config (``lr``, ``betas``, ``weight_decay``, ``clip_grad``).
        checkpoint_config: VERL's (unused: ``save_checkpoint`` writes megatrain's checkpoint).
    """

    def __init__(self, model_config, engine_config: MegatrainEngineConfig, optimizer_config, checkpoint_config=None,
                 *, model: torch.nn.Module | None = None):
        super().__init__()
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self._model, self.trainer, self.mode = model, None, None

    def initialize(self):
        model = self._model
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_config.local_path, dtype=torch.float32,
                                                         trust_remote_code=False, local_files_only=True)
        e, o = self.engine_config, self.optimizer_config
        clip = getattr(o, "clip_grad", None)
        self.trainer = megatrain.compile(model, seq_len=e.seq_len, micro_batch_size=e.micro_batch_size,
                                         micro_batches=e.micro_batches, device=e.device,
                                         optimizer=megatrain.AdamW(lr=o.lr, betas=tuple(o.betas),
                                                                   weight_decay=o.weight_decay,
                                                                   eps=getattr(o, "eps", 1e-8)),
                                         max_grad_norm=clip if clip and clip > 0 else None)

    @property
    def is_param_offload_enabled(self) -> bool:
        return False  # the state lives on the host already; to() releases the GPU slots

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs):
        return BaseEngineCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return BaseEngineCtx(self, "eval", **kwargs)

    def _padded(self, data: TensorDict) -> tuple[dict[str, torch.Tensor], list[int]]:
        """``input_ids`` and ``labels`` ``[rows, seq_len]`` of a no-padding batch (right-padded with
        token 0, labels -100 there and at each row's first token), and each row's length.

        Raises:
            BatchError: the batch is not in VERL's no-padding layout, or a row is longer than ``seq_len``."""
        ids = data["input_ids"]
        if not ids.is_nested:
            raise BatchError("MegatrainEngine reads VERL's no-padding batches (input_ids a jagged nested tensor: "
                             "verl.workers.utils.padding.left_right_2_no_padding)")
        seq_len = self.engine_config.seq_len
        rows = ids.unbind()
        lengths = [len(r) for r in rows]
        if max(lengths) > seq_len:
            raise BatchError(f"a row of {max(lengths)} tokens is longer than the engine's seq_len={seq_len}; raise "
                             "MegatrainEngineConfig.seq_len (or the rollout's max lengths)")
        out = torch.zeros(len(rows), seq_len, dtype=torch.long)
        labels = torch.full_like(out, -100)
        for b, r in enumerate(rows):
            out[b, :len(r)] = r
            labels[b, 1:len(r)] = r[1:]
        return {"input_ids": out, "labels": labels}, lengths

    def _rows(self) -> int:
        return self.engine_config.micro_batch_size * self.engine_config.micro_batches

    def infer_batch(self, data: TensorDict, loss_function: Optional[Callable] = None) -> Any:
        """``{"model_output": {"log_probs": nested}}`` of ``data`` (module docstring), computed
        the trainer's batch shape at a time (the last chunk filled up with the first rows and cut)."""
        batch, lengths = self._padded(data)
        n, k = len(lengths), self._rows()
        lp = []
        for a in range(0, n, k):
            idx = torch.arange(a, a + k) % n
            lp.append(self.trainer.logprobs({key: v[idx] for key, v in batch.items()})[:min(k, n - a)])
        lp = torch.cat(lp)
        values = torch.cat([torch.cat([lp[b, 1:m], lp.new_zeros(1)]) for b, m in enumerate(lengths)])
        nested = torch.nested.nested_tensor_from_jagged(values, offsets=data["input_ids"].offsets())
        return {"model_output": {"log_probs": nested}, "metrics": {}}

    def forward_backward_batch(self, data: TensorDict, loss_function: Callable, forward_only=False) -> Any:
        if forward_only:
            return self.infer_batch(data, loss_function)
        raise NotImplementedError("megatrain runs forward, backward and the optimizer step as one pass: call "
                                  "train_batch(data, loss_function)")

    def train_batch(self, data: TensorDict, loss_function: Callable) -> Any:
        """One ``Trainer.step`` on ``loss_function`` over ``data`` (``micro_batch_size x
        micro_batches`` rows). Returns ``{"loss", "metrics"}``: the global loss, ``grad_norm`` and
        each metric VERL's loss returned, aggregated over the micro-batches as its ``Metric`` says.

        Raises:
            BatchError: another number of rows than the trainer's batch, a row longer than
                ``seq_len``, or a batch not in VERL's no-padding layout."""
        rows = _rows_of(data)
        if rows != self._rows():
            raise BatchError(f"a VERL batch of {rows} rows, but this engine trains batches of micro_batch_size x "
                             f"micro_batches = {self._rows()} rows (megatrain's trainer has one shape): set VERL's "
                             "mini-batch size to it")
        batch, lengths = self._padded(data)
        batch[_ROW] = torch.arange(rows, dtype=torch.float32)
        # VERL's FSDP engine sets these before its micro-batches (forward_backward_batch): the global
        # normalisers of its losses.
        tu.assign_non_tensor(data, batch_num_tokens=int(data["loss_mask"].sum()), dp_size=1)
        if tu.get_non_tensor_data(data=data, key="global_batch_size", default=None) is None:
            tu.assign_non_tensor(data, global_batch_size=rows)
        loss = _VerlLoss(loss_function, data, lengths)
        res = self.trainer.step(batch, loss=loss)
        merged: dict[str, Any] = {}
        for m in loss.metrics[-self.engine_config.micro_batches:]:  # VERL's Metric aggregates its micro-batches
            for k, v in m.items():
                if isinstance(v, Metric):
                    merged.setdefault(k, v.init_list()).append(v)
                else:
                    merged[k] = v
        metrics = {k: float(v.aggregate()) if isinstance(v, Metric) else v for k, v in merged.items()}
        return {"loss": res.loss, "metrics": {**metrics, "grad_norm": res.grad_norm}}

    def optimizer_zero_grad(self):
        pass  # megatrain's step owns its gradients

    def optimizer_step(self):
        raise NotImplementedError("megatrain's train_batch applies the update; there is no separate optimizer step")

    def lr_scheduler_step(self):
        return self.optimizer_config.lr

    def get_per_tensor_param(self, **kwargs):
        def gen():
            for bucket in rollout_weights(self.trainer):
                yield from bucket
        return gen(), None

    def get_data_parallel_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_group(self):
        return None

    def is_mp_src_rank_with_outputs(self):
        return True

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if device == "cpu" and model and self.trainer is not None:
            release_gpu(self.trainer)  # the host state stays; the next step makes the slots again

    def save_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None, global_step: int = 0,
                        max_ckpt_to_keep: Optional[int] = None, **kwargs) -> None:
        self.trainer.save(local_path)

    def load_checkpoint(self, local_path: str, hdfs_path: Optional[str] = None, del_local_after_load: bool = True,
                        **kwargs) -> None:
        self.trainer.load(local_path)

    def disable_adapter(self):
        return nullcontext()
