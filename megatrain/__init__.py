"""megatrain: train large language models on one GPU with all persistent state in host memory.

``trainer = megatrain.compile(model, seq_len=..., optimizer=megatrain.AdamW(lr=...))`` traces the
model into layers, plans and verifies a schedule of copies and computes, and moves the parameters
into per-layer FP32 host tiles; ``trainer.step(batch)`` then trains one global batch.
"""

from megatrain.config import AdamW
from megatrain.errors import (BatchError, CheckpointError, ConfigError, MegatrainError, PlanError, ScheduleError,
                              StepError, TraceError, UnsupportedModelError)
from megatrain.planner.plan import Plan
from megatrain.trainer import StepResult, Trainer, compile

__version__ = "0.1.0"

__all__ = [
    "AdamW",
    "BatchError",
    "CheckpointError",
    "ConfigError",
    "MegatrainError",
    "Plan",
    "PlanError",
    "ScheduleError",
    "StepError",
    "StepResult",
    "TraceError",
    "Trainer",
    "UnsupportedModelError",
    "compile",
]
