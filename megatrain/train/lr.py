"""The learning-rate schedule of ``megatrain train`` and of ``examples/train_lm.py``: linear
warm-up, then a half cosine to a floor at the last step."""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of the 0-based step ``step``: linear warm-up, then cosine decay.

    Steps ``0 .. warmup_steps - 1`` ramp linearly to ``lr`` (``lr * (step + 1) / warmup_steps``);
    from step ``warmup_steps`` to the last step ``max_steps - 1`` a half cosine goes from ``lr``
    to ``lr * min_lr_ratio``; later steps stay there. A pure function of the step, so a resumed
    run continues the schedule exactly.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    floor = lr * min_lr_ratio
    span = max_steps - 1 - warmup_steps
    frac = min(1.0, (step - warmup_steps) / span) if span > 0 else 0.0
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
