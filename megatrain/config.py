"""User-facing settings, validated by pydantic at the boundary."""

from __future__ import annotations

from typing import Callable, Literal

import pydantic
from pydantic import Field

from megatrain.errors import ConfigError


class OptimizerSettings(pydantic.BaseModel):
    """The hyper-parameters of a host optimizer (``megatrain.optim``): frozen, no unknown fields."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **settings):
        """Raises ConfigError (not pydantic's ValidationError) naming each setting out of range."""
        try:
            super().__init__(**settings)
        except pydantic.ValidationError as e:
            raise ConfigError(f"invalid {type(self).__name__} settings: " + describe_validation(e)) from None


def describe_validation(e: pydantic.ValidationError, *, missing_hint: Callable[[str], str] | None = None) -> str:
    """pydantic's errors as one line, ``field=value: rule; ...``: the one formatting of every
    settings error megatrain raises (``AdamW``, ``compile``'s options, ``megatrain train``'s config).

    A missing field reads ``field is required`` followed by ``missing_hint(field)`` when given (the
    train config says which flag or file key sets it); an error of the whole model (a
    ``model_validator``, no field) is its message alone, which names the fields itself.
    """
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            parts.append(f"{loc} is required" + (missing_hint(loc) if missing_hint else ""))
        elif loc:
            given = repr(err.get("input"))  # a value quoted in full would make a line of any length
            parts.append(f"{loc}={given if len(given) <= 200 else given[:180] + ' ...'}: {msg}")
        else:
            parts.append(msg)
    return "; ".join(parts)


class CompileOptions(pydantic.BaseModel):
    """What ``megatrain.compile`` needs besides the model."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    seq_len: int = Field(gt=0, description="tokens per sequence")
    micro_batch_size: int = Field(1, gt=0, description="sequences per micro-batch")
    micro_batches: int = Field(1, gt=0, description="micro-batches per step (gradient accumulation)")
    input_names: tuple[str, ...] = Field(("input_ids", "labels"), min_length=1,
                                         description="keyword inputs of the model's forward, in order")
    device: Literal["cpu", "cuda"] = Field("cpu", description="where layers compute")
    max_grad_norm: float | None = Field(None, gt=0.0, description="clip the gradients to this global L2 "
                                        "norm (as torch.nn.utils.clip_grad_norm_), or None for no clipping")
    per_token_loss: bool = Field(True, description="the loss of a global batch is the mean over its supervised "
                                 "tokens (labels not -100, after the shift) across every micro-batch and rank, as "
                                 "eager PyTorch on the whole batch (Megatron-LM's --calculate-per-token-loss); "
                                 "False: the mean of the micro-batch means (megatrain.runtime.loss)")

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.micro_batches
