"""megatrain's public surface: pinned, so that a name is added or removed on purpose (as torchtitan's
``test_no_new_cli_options.py`` pins its CLI)."""

from __future__ import annotations

import inspect

import megatrain
from megatrain import errors


def test_public_surface_is_pinned():
    assert sorted(megatrain.__all__) == sorted([
        "compile", "from_pretrained", "plan_model", "materialize", "PlannedModel", "Trainer", "StepResult",
        "AdamW", "Lion", "CompileOptions",
        "HardwareSpec", "preset", "Plan", "OptimizerPlacement", "ActivationPolicy", "SolveRequest", "solve",
        "MegatrainError", "BatchError", "CheckpointError", "CollectiveError", "ConfigError", "InfeasibleRequestError", "PlanError",
        "ScheduleError", "StepError", "TraceError", "UnsupportedModelError"])
    assert len(set(megatrain.__all__)) == len(megatrain.__all__)
    for name in megatrain.__all__:
        assert hasattr(megatrain, name)


def test_every_error_class_is_exported_and_is_a_megatrain_error():
    declared = {name for name, obj in vars(errors).items()
                if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == errors.__name__}
    assert declared <= set(megatrain.__all__)
    for name in megatrain.__all__:
        obj = getattr(megatrain, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert issubclass(obj, megatrain.MegatrainError), name


def test_public_names_are_the_ones_the_modules_define():
    # Re-exports, not copies: megatrain.X is the object the defining module holds.
    from megatrain.ir import hardware, plan
    from megatrain.planner import solve
    from megatrain import product as trainer  # compile and plan_model live in megatrain.product, above the Trainer

    assert megatrain.preset is hardware.preset and megatrain.HardwareSpec is hardware.HardwareSpec
    assert megatrain.OptimizerPlacement is plan.OptimizerPlacement and megatrain.solve is solve.solve
    assert megatrain.compile is trainer.compile and megatrain.PlannedModel is trainer.PlannedModel
    # The planning front door is megatrain.planner.plan; the IR records live in megatrain.ir.
    from megatrain import planner
    from megatrain.planner import front

    assert planner.plan is front.plan and planner.PlanRequest is front.PlanRequest


def test_plan_model_then_materialize_is_compile():
    """The two halves of compile, used apart: the planned model allocates nothing, and the trainer
    runs exactly its schedules."""
    import torch

    from conftest import random_batch, tiny_llama

    torch.manual_seed(0)
    model = tiny_llama(layers=2, device="meta")
    planned = megatrain.plan_model(model, seq_len=16, micro_batch_size=2, max_grad_norm=1.0,
                                   hardware="H100_SXM", plan="default")
    assert all(p.device.type == "meta" for p in model.parameters()), "planning allocates nothing"
    assert planned.plan.optimizer is megatrain.OptimizerPlacement.NEXT_FORWARD
    assert planned.timeline is not None and planned.timeline.step_time_s > 0  # predicted on the spec, once
    assert planned.memory.host_total > 0 and planned.solution is None
    trainer = megatrain.materialize(planned, megatrain.AdamW(lr=1e-3))
    assert trainer.planned is planned and trainer.schedules is planned.schedules and trainer.plan is planned.plan
    first = trainer.step(random_batch(2, 16, 96, seed=0))
    assert trainer.schedule is planned.schedules.steady and first.applied


def test_a_solved_plan_runs_the_solvers_own_schedule_and_prediction():
    """Plan once: the solver lowered, verified and simulated the steady schedule; compile keeps
    them instead of lowering and simulating again."""
    import torch

    from conftest import random_batch, tiny_llama

    torch.manual_seed(0)
    trainer = megatrain.compile(tiny_llama(layers=2), seq_len=16, micro_batch_size=2, micro_batches=2,
                                hardware="H100_SXM", compute_dtype="float32")
    planned = trainer.planned
    assert planned.solution is not None and planned.plan is planned.solution.plan
    assert planned.schedules.steady is planned.solution.schedule
    assert planned.timeline is planned.solution.timeline and planned.memory is planned.solution.memory
    assert trainer.step(random_batch(4, 16, 96, seed=0)).applied
