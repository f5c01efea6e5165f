"""Rewards for GRPO (``megatrain train --task grpo --reward module:function``).

A reward function has TRL's signature (``GRPOTrainer``'s ``reward_funcs``, ``docs/source/
grpo_trainer.md``, "Using a custom reward function"): ``fn(prompts, completions, **columns) ->
list[float]``, where ``prompts`` and ``completions`` are lists of strings (a conversational prompt
is its list of messages), one entry per response, and each other column of the prompt set is a
keyword argument holding that column's value for each response (``answer=[...]``); it returns one
float per response. :func:`score` calls one and checks what it returns. Several, as TRL's list of
``reward_funcs`` with ``reward_weights``, are one :class:`RewardSum` (``--reward m:f,m:g``,
:func:`load_rewards`): the weighted sum of their rewards, each checked and kept for its metrics.

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

__all__ = ["RewardSum", "arithmetic_reward", "exact_match_reward", "load_reward", "load_rewards", "score"]

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
        if isinstance(fn, RewardSum) and isinstance(e, BatchError):  # one of its functions failed, named
            raise
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


class RewardSum:
    """Several reward functions as one, TRL's ``reward_funcs`` with ``reward_weights``
    (``GRPOTrainer``: the reward of a response is ``sum_i weight_i * reward_i``): called with the
    reward signature, each function is :func:`score`-d (checked, and named in its errors) and the
    weighted sum returned; :attr:`last` holds each function's rewards of the last call
    (``[responses]`` float32 by its name), what TRL logs as ``rewards/<name>/mean``.

    Args:
        functions: ``(name, function)`` pairs, the names distinct (:func:`load_rewards`'s).
        weights: one per function; None: all 1.0.

    Raises:
        ConfigError (constructor): no function, repeated names, or another number of weights.
    """

    def __init__(self, functions: Sequence[tuple[str, Callable[..., Sequence[float]]]],
                 weights: Sequence[float] | None = None):
        names = [n for n, _ in functions]
        if not functions or len(set(names)) != len(names):
            raise ConfigError(f"reward: give one or more distinct module:function names, got {names}")
        weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        if len(weights) != len(functions):
            raise ConfigError(f"reward_weights {weights}: {len(weights)} weights for {len(functions)} reward "
                              f"functions ({', '.join(names)}); give one per function")
        self.functions, self.weights = list(functions), weights
        self.last: dict[str, torch.Tensor] = {}
        short = [n.rpartition(":")[2] for n in names]
        self.labels = {n: (s if short.count(s) == 1 else re.sub(r"\W", "_", n)) for n, s in zip(names, short)}
        """Each function's name in metrics: the function's own name, or where two share it, the
        whole ``module:function`` with ``_`` for the punctuation."""

    def __call__(self, prompts, completions, **columns) -> list[float]:
        self.last = {name: score(fn, prompts, completions, columns, name=f"reward {name}")
                     for name, fn in self.functions}
        total = sum(w * r for w, r in zip(self.weights, self.last.values()))
        return total.tolist()


def load_rewards(spec: str, weights: Sequence[float] | None = None) -> RewardSum:
    """The functions of ``spec``, ``"module:function"`` or several comma-separated
    (``"megatrain.rl.rewards:exact_match_reward,mymod:format_reward"``), each :func:`load_reward`-ed,
    as one :class:`RewardSum` with ``weights`` (TRL's ``reward_weights``; None: 1.0 each).

    Raises:
        ConfigError: as :func:`load_reward` for each; a function named twice; weights of another count.
    """
    return RewardSum([(part.strip(), load_reward(part.strip())) for part in spec.split(",")], weights)
