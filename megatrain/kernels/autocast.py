"""Ops that autocast must not recast: :func:`without_autocast` and the context the kernels share."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


def no_autocast(device_type: str):
    """A context with autocast off on ``device_type``, or a no-op where the device has no autocast."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def without_autocast(op: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
    """``op(*args, **kwargs)`` with autocast off on the device of its first tensor argument.

    The op computes in its inputs' own dtypes (FP32 for the rotary angle math this is for), also
    when the caller runs under ``torch.autocast``, which would otherwise run a matmul such as
    ``inv_freq @ position_ids`` in BF16: at position 4096 a BF16 angle is off by up to 16 rad (8
    mantissa bits), so cos/sin would be wrong by up to 2.0. Transformers disables autocast around
    that math; ``torch.export`` keeps no trace of a region that is a no-op at trace time, so
    :func:`megatrain.planner.trace.cleanup.keep_position_math_fp32` restores it per op with this
    kernel.
    Without a tensor argument, or on a device without autocast (``meta``), it just calls ``op``.
    """
    dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), None)
    with no_autocast(dev) if dev is not None else contextlib.nullcontext():
        return op(*args, **kwargs)


__all__ = ["no_autocast", "without_autocast"]
