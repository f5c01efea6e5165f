"""Rewards for GRPO (``megatrain train --task grpo --reward module:function``).

A reward function has TRL's signature (``GRPOTrainer``'s ``reward_funcs``, ``docs/source/
grpo_trainer.md``, "Using a custom reward function"): ``fn(prompts, completions, **columns) ->
list[float]``, where ``prompts`` and ``completions`` are lists of strings (a conversational prompt
is its list of messages), one entry per response, and each other column of the prompt set is a
keyword argument holding that column's value for each response (``answer=[...]``); it returns one
float per response. :func:`score` calls one and checks what it returns.

Built in, rule rewards for prompt sets with an ``answer`` column (``{"prompt": "3+4=", "answer":
"7"}``, ``examples/data/rl/``): :func:`exact_match_reward` (1 for the answer, else 0: its mean is the
exact-match accuracy; the bundled example's) and :func:`arithmetic_reward` (the same plus a 0.1
format reward for another integer).
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Any, Callable, Mapping, Sequence

import torch

from megatrain.errors import BatchError, ConfigError

__all__ = ["arithmetic_reward", "exact_match_reward", "load_reward", "score"]

_INT = re.compile(r"\s*(-?\d+)")


def arithmetic_reward(prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[str],
                      **_: Any) -> list[float]:
    """1.0 for a completion whose first token of text is the integer ``answer`` (leading
    whitespace allowed, what follows ignored), 0.1 for one that starts with another integer, 0
    otherwise: exact-match accuracy plus a small format reward, the two rule rewards of
    DeepSeek-R1 (Guo et al. 2025, arXiv:2501.12948, sec. 2.2.2), so that a model that cannot yet add
    is rewarded for answering with a number at all. ``answer``: the prompt set's column, one
    string (or int) per completion. Returns ``len(completions)`` floats."""
    out = []
    for text, want in zip(completions, answer, strict=True):
        m = _INT.match(text)
        out.append(0.0 if m is None else 1.0 if int(m.group(1)) == int(want) else 0.1)
    return out


def exact_match_reward(prompts: Sequence[Any], completions: Sequence[str], answer: Sequence[str],
                       **_: Any) -> list[float]:
    """1.0 for a completion whose leading integer (leading whitespace allowed, what follows it
    ignored, as :func:`arithmetic_reward` reads it) is ``answer``, else 0.0: DeepSeek-R1's accuracy
    reward without a format reward, so the mean reward of a batch is its exact-match accuracy.
    ``answer``: the prompt set's column, one string (or int) per completion. Returns
    ``len(completions)`` floats."""
    out = []
    for text, want in zip(completions, answer, strict=True):
        m = _INT.match(text)
        out.append(1.0 if m is not None and int(m.group(1)) == int(want) else 0.0)
    return out


def load_reward(spec: str) -> Callable[..., Sequence[float]]:
    """The function ``spec`` names, ``"package.module:function"`` (imported here).

    Raises:
        ConfigError: ``spec`` is not ``module:function``, the module cannot be imported, or it has
            no such callable.
    """
    module, colon, name = spec.partition(":")
    if not colon or not module or not name:
        raise ConfigError(f"reward {spec!r}: give it as module:function (e.g. megatrain.rl.rewards:arithmetic_reward)")
    try:
        mod = importlib.import_module(module)
    except Exception as e:
        raise ConfigError(f"reward {spec!r}: module {module!r} cannot be imported ({type(e).__name__}: {e}); put it "
                          "on PYTHONPATH") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ConfigError(f"reward {spec!r}: module {module!r} has no function {name!r}")
    return fn


def score(fn: Callable[..., Sequence[float]], prompts: Sequence[Any], completions: Sequence[str],
          columns: Mapping[str, Sequence[Any]], *, name: str = "the reward function") -> torch.Tensor:
    """``fn(prompts, completions, **columns)`` as a ``[len(completions)]`` float32 tensor.

    Raises:
        BatchError: ``fn`` raised (its error in the message), returned another number of values,
            something that is not a number, or a NaN or infinite value (naming the response).
    """
    try:
        values = fn(list(prompts), list(completions), **{k: list(v) for k, v in columns.items()})
    except Exception as e:
        raise BatchError(f"{name} raised {type(e).__name__}: {e}") from e
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise BatchError(f"{name} must return a list of numbers, one per completion; got {type(values).__name__} "
                         f"({e})") from None
    if len(values) != len(completions):
        raise BatchError(f"{name} returned {len(values)} rewards for {len(completions)} completions; it must return "
                         "one per completion")
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        raise BatchError(f"{name} returned {values[bad]} for completion {bad} ({completions[bad][:60]!r}); a reward "
                         "must be a finite number")
    return torch.tensor(values, dtype=torch.float32)
