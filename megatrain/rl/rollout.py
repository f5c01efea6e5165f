"""A rollout engine beside the trainer: its weights handed out in buckets, and the GPU handed over.

RL training alternates generation (rollouts, by an inference engine such as vLLM or SGLang) and
training steps. Colocated on one GPU, the engine needs the trainer's current weights after each
step and the card's memory while it generates:

- :func:`rollout_weights` yields the weights as ``(Hugging Face name, BF16 tensor)`` pairs in
  buckets of at most a given number of bytes, the form the engines' weight-update calls take
  (vLLM's ``model.load_weights(weights)`` takes an iterable of such pairs; SGLang's
  ``update_weights_from_tensor(named_tensors)`` a list of them), so only one bucket of copies
  exists at a time besides what the engine keeps.
- :func:`release_gpu` frees the trainer's GPU weight and gradient slots (and the allocator's cache
  of them) between steps, :func:`retake_gpu` makes them again; :func:`gpu_released` is the two
  around a ``with`` block. The host state (masters, moments, a deferred update's gradients) is
  untouched, so training goes on as if nothing happened. What stays on the GPU: the CUDA context,
  the model's buffers (``sum(layer.buffer_bytes)``: rotary tables, ...) and 5 bytes a layer of
  gradient norms and flags.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from megatrain.errors import ConfigError
from megatrain.runtime.host import NvmeRow, SlicedRow


def rollout_weights(trainer, bucket_bytes: int = 1 << 30, *, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu") -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The trainer's current weights, each parameter once under its Hugging Face ``state_dict``
    name (a tied weight under the name its layer holds, as ``Trainer.state_dict()["model"]``), as
    new ``dtype`` (default BF16) tensors on ``device``, in graph order, grouped into buckets
    (lists of ``(name, tensor)``) of at most ``bucket_bytes`` bytes each; a tensor larger than
    that is a bucket of its own. A deferred update is applied first. Buffers (rotary tables) are
    not weights and are not included.

    Raises:
        ConfigError: ``bucket_bytes < 1``; a host state sharded across nodes (read the weights from
            a checkpoint there).
        StepError: as ``Trainer.flush``.
    """
    if bucket_bytes < 1:
        raise ConfigError(f"bucket_bytes={bucket_bytes}: a bucket holds at least one byte")
    if trainer.host.sliced:
        raise ConfigError("this trainer's host state is sharded across nodes (host_state='shard'): no rank holds the "
                          "whole weights; save a checkpoint (Trainer.save) and load the engine from it")
    weights = trainer.state_dict()["model"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, src in weights.items():
        nbytes = math.prod(src.shape) * itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        t = src.read() if isinstance(src, (NvmeRow, SlicedRow)) else src
        bucket.append((name, t.to(device=device, dtype=dtype, copy=True)))
        size += nbytes
    if bucket:
        yield bucket


def release_gpu(trainer) -> int:
    """Free the trainer's GPU weight and gradient slots between steps (and, on CUDA, return the
    caching allocator's free blocks to the driver: ``torch.cuda.empty_cache``), so that a
    colocated engine can use the memory. The next step, ``logprobs`` or ``evaluate`` (or
    :func:`retake_gpu`) makes them again. Returns the bytes of the slots freed (0 when none were held)."""
    freed = trainer.executor.release_device()
    if trainer.backend.device.type == "cuda":
        torch.cuda.empty_cache()
    return freed


def retake_gpu(trainer) -> None:
    """Make the GPU slots of the trainer's next step again, now (so that running out of memory,
    because the engine still holds it, shows here rather than in the step).

    Raises:
        torch.OutOfMemoryError / RuntimeError: the device allocation failed."""
    trainer.executor.allocate(trainer.schedule)


@contextlib.contextmanager
def gpu_released(trainer) -> Iterator[int]:
    """:func:`release_gpu` before the ``with`` block (which gets the bytes freed) and
    :func:`retake_gpu` after it."""
    freed = release_gpu(trainer)
    try:
        yield freed
    finally:
        retake_gpu(trainer)


__all__ = ["gpu_released", "release_gpu", "retake_gpu", "rollout_weights"]
