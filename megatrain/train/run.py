"""``megatrain train``'s entry: one run of a config, dispatched by its task.

``task`` lm and sft are :func:`megatrain.train.loop.train`'s run; dpo and grpo are
:func:`megatrain.train.rl_tasks.train_rl`'s, which shares the loop's stages up to the weights
(planning, materialising) and :mod:`megatrain.train.stages`' (threads, the model, the locks, the run's
files, the checkpoint, the plot), and has a loop of its own. This module sits above both, so
neither imports the other's caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from megatrain.train.config import resolve_device

if TYPE_CHECKING:
    from megatrain.train.config import TrainConfig
    from megatrain.train.loop import TrainResult

__all__ = ["RL_TASKS", "train"]

RL_TASKS = ("dpo", "grpo")
"""The tasks :mod:`megatrain.train.rl_tasks` runs."""


def train(cfg: TrainConfig, *, echo: Callable[[str], None] = print) -> TrainResult:
    """Run ``cfg`` to ``max_steps``: :func:`megatrain.train.loop.train` (its docstring gives the
    stages, outputs and errors) for ``task`` lm and sft, :func:`megatrain.train.rl_tasks.train_rl`
    for dpo and grpo.

    Raises:
        ConfigError, MegatrainError: as the run dispatched to.
    """
    if cfg.task not in RL_TASKS:
        from megatrain.train.loop import train as train_lm

        return train_lm(cfg, echo=echo)
    from megatrain.train.loop import InterruptOnTerm
    from megatrain.train.rl_tasks import train_rl

    given = cfg  # train_config.json keeps device: auto as auto
    cfg, device = resolve_device(cfg)
    with InterruptOnTerm():  # SIGTERM as SIGINT: the run's locks are released, the CLI exits 143
        return train_rl(cfg, echo=echo, device=device, given=given)
