"""Optimizers as data: what each host optimizer keeps per parameter, and which kernel steps it.

megatrain runs the optimizer itself, on the host, over each layer's flat FP32 tiles. What the rest
of the package needs to know of an optimizer is in its :class:`OptimizerSpec`:

- ``states``: the FP32 rows it keeps per trainable parameter, in the order they follow one another
  in a layer's host block and NVMe file; their names are the optimizer's checkpoint keys
  (``"<layer>.<state>"`` in ``Trainer.state_dict()["optimizer"]``);
- ``state_bytes_per_param``: 4 bytes per state row, what the cost model sizes host memory and the
  NVMe tier with (``cost.MemoryBreakdown.adam_moments``, ``cost.nvme_bytes``);
- ``settings``: the pydantic model of its hyper-parameters (``compile(optimizer=...)``);
- ``kernel``: the dotted path of its host kernel class (``megatrain.runtime.host_kernels.HostAdamW``),
  imported by the runtime where it steps (this module stays without torch), whose
  ``update(param, grad, states, step, settings, grad_scale=..., scratch=...)`` steps one flat
  FP32 tile in place and returns the sum of the updated tile (0-dim FP32: the executor's finite
  check of the result, summed by the kernel while each chunk is in the cache).

Host storage (``runtime.host.HostState``), the NVMe tier, checkpoints, the cost model (through
``Plan.optimizer_name``) and the executor's OPT op read the spec; adding an optimizer is a settings
model and a spec here (its record: settings, states, kernel), and the kernel class its spec names
(``runtime/host_kernels.py``); every list of optimizer names derives from :data:`OPTIMIZERS`.

The optimizers:

- ``"adamw"``: :class:`AdamW` (Loshchilov & Hutter 2019, arXiv:1711.05101), two
  FP32 moments ``exp_avg`` and ``exp_avg_sq``: 8 bytes of state per parameter, 12 with the FP32
  master.
- ``"lion"``: :class:`Lion` (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
  arXiv:2302.06675, Algorithm 2), one FP32 moment ``exp_avg``: 4 bytes of state per parameter, 8
  with the master, so a host holds the state of 1.5x the parameters it holds under AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import pydantic
from pydantic import Field

from megatrain.config import OptimizerSettings
from megatrain.errors import ConfigError

STATE_ITEMSIZE = 4
"""Bytes per element of every optimizer state row: FP32."""


class AdamW(OptimizerSettings):
    """AdamW settings (Loshchilov & Hutter 2019, arXiv:1711.05101), as in ``torch.optim.AdamW``.

    The update runs on the host, per layer, over the layer's flat FP32 tiles through torch's fused
    AdamW kernel (``torch.optim.adamw.adamw(fused=True)``); weight decay is decoupled and applies to
    every trainable parameter, as ``torch.optim.AdamW`` does with one parameter group.
    """

    lr: float = Field(1e-3, ge=0.0, description="learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="first and second moment decay, each in [0, 1)")
    eps: float = Field(1e-8, gt=0.0, description="added to the denominator for stability")
    weight_decay: float = Field(0.01, ge=0.0, description="decoupled weight decay coefficient")

    @pydantic.field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        for name, b in zip(("beta1", "beta2"), v):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{name}={b} must be in [0, 1)")
        return v


class Lion(OptimizerSettings):
    """Lion settings (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
    arXiv:2302.06675, Algorithm 2), per parameter ``p`` with gradient ``g`` and moment ``m``::

        p <- p * (1 - lr * weight_decay) - lr * sign(beta1 * m + (1 - beta1) * g)
        m <- beta2 * m + (1 - beta2) * g

    Weight decay is decoupled and applies to every trainable parameter (one parameter group). The
    update has unit magnitude per element, so the paper uses a learning rate 3-10x smaller than
    AdamW's and a weight decay 3-10x larger (section 5).
    """

    lr: float = Field(1e-4, ge=0.0, description="learning rate")
    betas: tuple[float, float] = Field((0.9, 0.99), description="beta1 (update interpolation) and beta2 "
                                                                 "(moment decay), each in [0, 1]")
    weight_decay: float = Field(0.0, ge=0.0, description="decoupled weight decay coefficient")

    @pydantic.field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        for name, b in zip(("beta1", "beta2"), v):
            if not 0.0 <= b <= 1.0:
                raise ValueError(f"{name}={b} must be in [0, 1]")
        return v


@dataclass(frozen=True, slots=True)
class OptimizerSpec:
    """One host optimizer, as the planner and the runtime see it (module docstring).

    Attributes:
        name: the name ``compile(optimizer={"name": ...})``, ``megatrain train``'s ``optimizer``
            and ``Plan.optimizer_name`` use.
        settings: its hyper-parameters' pydantic model.
        states: names of its FP32 state rows per trainable parameter, in storage order (also its
            checkpoint keys); at least one.
        kernel: the dotted path of its host kernel class (``megatrain.runtime.host_kernels.HostLion``):
            what ``megatrain.runtime.host_kernels.host_kernel`` makes, with no table of its own.
        reference: where the algorithm is published.
        label: how memory tables and messages name its state (``"<label> moments"``).
    """

    name: str
    settings: type[OptimizerSettings]
    states: tuple[str, ...]
    kernel: str
    reference: str
    label: str

    def __post_init__(self) -> None:
        if not self.states or len(set(self.states)) != len(self.states):
            raise ValueError(f"optimizer {self.name!r}: states {self.states} must be distinct names, at least one")

    @property
    def state_bytes_per_param(self) -> int:
        """Bytes of optimizer state per trainable parameter (FP32 rows; the master not counted)."""
        return STATE_ITEMSIZE * len(self.states)


OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in (
    OptimizerSpec("adamw", AdamW, ("exp_avg", "exp_avg_sq"), "megatrain.runtime.host_kernels.HostAdamW",
                  "Loshchilov & Hutter 2019, arXiv:1711.05101", "Adam"),
    OptimizerSpec("lion", Lion, ("exp_avg",), "megatrain.runtime.host_kernels.HostLion",
                  "Chen et al. 2023, arXiv:2302.06675", "Lion"),
)}
"""Every host optimizer, by name."""

ADAMW = OPTIMIZERS["adamw"]


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec of optimizer ``name``. Raises ConfigError naming the known ones."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ConfigError(f"optimizer {name!r} is not one megatrain runs on the host; use one of "
                          f"{sorted(OPTIMIZERS)}") from None


def spec_of(settings: OptimizerSettings) -> OptimizerSpec:
    """The spec whose settings model ``settings`` is."""
    for spec in OPTIMIZERS.values():
        if type(settings) is spec.settings:
            return spec
    raise ConfigError(f"{type(settings).__qualname__} is not the settings of an optimizer megatrain runs; use one of "
                      + ", ".join(f"megatrain.{s.settings.__qualname__}" for s in OPTIMIZERS.values()))


def optimizer_settings(optimizer: OptimizerSettings | Mapping | None) -> OptimizerSettings:
    """The settings ``optimizer`` gives: a settings object (``megatrain.AdamW``, ``megatrain.Lion``)
    as it is; a mapping of its fields, with ``"name"`` choosing the optimizer (default
    ``"adamw"``), e.g. ``{"name": "lion", "lr": 3e-5, "weight_decay": 0.1}``; None: AdamW's defaults.

    Raises:
        ConfigError: an unknown name, a setting out of range or unknown to that optimizer, or an
            optimizer object (``torch.optim.AdamW(...)``) rather than settings.
    """
    if isinstance(optimizer, OptimizerSettings):
        spec_of(optimizer)
        return optimizer
    if optimizer is not None and not isinstance(optimizer, Mapping):
        raise ConfigError(f"optimizer={type(optimizer).__module__}.{type(optimizer).__qualname__}: megatrain runs "
                          "the optimizer itself on the host tiles, so it takes the settings, not an optimizer "
                          "object; pass megatrain.AdamW(lr=..., betas=..., eps=..., weight_decay=...), "
                          "megatrain.Lion(lr=..., betas=..., weight_decay=...) or a dict of those fields (with "
                          "\"name\": \"lion\" for Lion)")
    fields = dict(optimizer or {})
    name = fields.pop("name", "adamw")
    return optimizer_spec(str(name).lower()).settings(**fields)


__all__ = ["ADAMW", "AdamW", "Lion", "OPTIMIZERS", "OptimizerSpec", "STATE_ITEMSIZE", "optimizer_settings", "optimizer_spec",
           "spec_of"]
