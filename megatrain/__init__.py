"""megatrain: train large language models on one GPU with all persistent state in host memory.

``trainer = megatrain.compile(model, seq_len=..., optimizer=megatrain.AdamW(lr=...))`` traces the
model into layers, plans and verifies a schedule of copies and computes, and moves the parameters
into per-layer FP32 host tiles; ``trainer.step(batch)`` then trains one global batch. ``compile``
is ``materialize(plan_model(...))``: ``plan_model`` decides everything that will run (a frozen
``PlannedModel`` with its memory and predicted step) and allocates nothing, so it can be checked
first. It, ``megatrain train`` and ``megatrain plan`` all plan through one front door,
``megatrain.planner.front.plan(PlanRequest(...))``.

What users need besides: the hardware a plan is for (``HardwareSpec``, ``preset("H100_SXM")``),
the plan's knobs (``Plan``, ``OptimizerPlacement``, ``ActivationPolicy``), the solver
(``solve(SolveRequest(graph, hardware, global_batch, compute_dtype))``) and every error megatrain
raises on purpose (each a ``MegatrainError``).
"""

from megatrain.config import CompileOptions
from megatrain.optim import AdamW, Lion
from megatrain.errors import (BatchError, CheckpointError, CollectiveError, ConfigError, MegatrainError, PlanError,
                              ScheduleError, StepError, TraceError, UnsupportedModelError)

from megatrain.lazy import lazy_names

# The names below import torch (and the planner, the runtime): loaded on first use (PEP 562), so
# that `megatrain --help` and the config's validation start in a fraction of a second.
_LAZY = {
    "HardwareSpec": "megatrain.ir.hardware", "preset": "megatrain.ir.hardware",
    "ActivationPolicy": "megatrain.ir.plan", "OptimizerPlacement": "megatrain.ir.plan",
    "Plan": "megatrain.ir.plan",
    "InfeasibleRequestError": "megatrain.planner.solve", "SolveRequest": "megatrain.planner.solve",
    "solve": "megatrain.planner.solve",
    "PlannedModel": "megatrain.trainer", "StepResult": "megatrain.trainer", "Trainer": "megatrain.trainer",
    "compile": "megatrain.product", "materialize": "megatrain.product", "plan_model": "megatrain.product",
    "from_pretrained": "megatrain.product",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


__version__ = "0.1.0"

__all__ = [
    # compile = materialize(plan_model(...)), and what it returns
    "compile",
    "from_pretrained",
    "plan_model",
    "materialize",
    "PlannedModel",
    "Trainer",
    "StepResult",
    # settings
    "AdamW",
    "Lion",
    "CompileOptions",
    # planning
    "HardwareSpec",
    "preset",
    "Plan",
    "OptimizerPlacement",
    "ActivationPolicy",
    "SolveRequest",
    "solve",
    # errors
    "MegatrainError",
    "BatchError",
    "CheckpointError",
    "CollectiveError",
    "ConfigError",
    "InfeasibleRequestError",
    "PlanError",
    "ScheduleError",
    "StepError",
    "TraceError",
    "UnsupportedModelError",
]
