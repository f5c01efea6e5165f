"""The Schedule: an explicit DAG of typed ops on streams, and its JSON form.

Ops are frozen records with a short repr that parses back (``H2D:L3:s1``, ``FWD:L3:m0:s1``,
``BWD:L3:m0:s1``, ``D2H:L3:s1:r0``, ``OPT:L3:r0``, ``OFFLOAD:L3:m0``, ``RELOAD:L3:m0``,
``RECOMPUTE:L3:m0:s1``, ``CAST:L3:t0``, ``ACC:L3:m1:r0``), after the ``_Action`` records of
``torch.distributed.pipelining``. The op list is in issue order: a topological order of the DAG,
and for each stream the order its in-order queue runs the ops. ``deps`` are indices of earlier ops
that must finish first; a dependency that crosses streams becomes an event in the CUDA backend.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Literal

import pydantic

from megatrain.planner.plan import ActivationPolicy, OptimizerPlacement, Plan

SCHEDULE_FORMAT_VERSION = 3
"""3 added ACC ops (per-micro-batch passes); version 2 files, which have none, still load."""


class Stream(enum.Enum):
    """The in-order queues a schedule runs on."""

    COMPUTE = "compute"
    H2D = "h2d"
    D2H = "d2h"
    HOST = "host"  # the host optimizer worker: OPT and ACC, in list order
    CAST = "cast"  # a second host worker for CASTs, so a layer's BF16 staging copy never queues behind
    #                the optimizer steps of other layers (it still waits for its own layer's update)


class OpKind(enum.Enum):
    H2D = "H2D"  # copy a layer's weights (compute dtype) from host into a GPU buffer slot
    FWD = "FWD"  # forward of one layer for one micro-batch; stores its output checkpoint
    BWD = "BWD"  # local backward: recompute the layer's forward from its input checkpoint, then grad
    D2H = "D2H"  # copy a slot's accumulated FP32 gradients into a host gradient tile
    OPT = "OPT"  # host AdamW step of one layer from its gradients on the host (see Schedule)
    OFFLOAD = "OFFLOAD"  # copy a layer's output checkpoints (one micro-batch) to pinned host memory
    RELOAD = "RELOAD"  # copy them back to the GPU before the local backwards that read them
    RECOMPUTE = "RECOMPUTE"  # forward of a layer in the backward phase, to rebuild its checkpoints
    CAST = "CAST"  # host: write a layer's master weights in the compute dtype into a staging tile
    ACC = "ACC"  # host: add one micro-batch's gradients from a ring tile into the layer's accumulator

    @property
    def stream(self) -> Stream:
        return _STREAM_OF[self]


HOST_STREAMS = frozenset({Stream.HOST, Stream.CAST})
"""Streams whose ops run on host worker threads (the others are GPU streams)."""

COMPUTE_KINDS = frozenset({OpKind.FWD, OpKind.BWD, OpKind.RECOMPUTE})
"""Op kinds that run a layer's template on the GPU with the layer's weights in a slot."""

_STREAM_OF = {OpKind.H2D: Stream.H2D, OpKind.FWD: Stream.COMPUTE, OpKind.BWD: Stream.COMPUTE,
              OpKind.D2H: Stream.D2H, OpKind.OPT: Stream.HOST, OpKind.OFFLOAD: Stream.D2H,
              OpKind.RELOAD: Stream.H2D, OpKind.RECOMPUTE: Stream.COMPUTE, OpKind.CAST: Stream.CAST,
              OpKind.ACC: Stream.HOST}
_FIELDS = {OpKind.H2D: ("layer", "slot"), OpKind.FWD: ("layer", "mb", "slot"),
           OpKind.BWD: ("layer", "mb", "slot"), OpKind.D2H: ("layer", "slot", "ring"),
           OpKind.OPT: ("layer", "ring"), OpKind.OFFLOAD: ("layer", "mb"), OpKind.RELOAD: ("layer", "mb"),
           OpKind.RECOMPUTE: ("layer", "mb", "slot"), OpKind.CAST: ("layer", "tile"),
           OpKind.ACC: ("layer", "mb", "ring")}
_PREFIX = {"layer": "L", "mb": "m", "slot": "s", "ring": "r", "tile": "t"}


@dataclass(frozen=True, slots=True)
class Op:
    """One op of a schedule. ``deps`` are indices of ops earlier in the schedule's list."""

    kind: OpKind
    layer: int
    mb: int | None = None
    slot: int | None = None
    ring: int | None = None
    tile: int | None = None  # a staging tile (CAST)
    deps: tuple[int, ...] = field(default=(), compare=True)

    def __post_init__(self) -> None:
        for name in ("mb", "slot", "ring", "tile"):
            present = getattr(self, name) is not None
            if present != (name in _FIELDS[self.kind]):
                raise ValueError(f"{self.kind.value} op {'needs' if not present else 'takes no'} {name}")

    @property
    def stream(self) -> Stream:
        return self.kind.stream

    def __repr__(self) -> str:
        return ":".join([self.kind.value] + [f"{_PREFIX[f]}{getattr(self, f)}" for f in _FIELDS[self.kind]])

    __str__ = __repr__

    @classmethod
    def parse(cls, text: str, deps: tuple[int, ...] = ()) -> "Op":
        """Inverse of ``repr``: ``Op.parse("FWD:L3:m0:s1")``. Raises ValueError on bad text."""
        head, *parts = text.split(":")
        try:
            kind = OpKind(head)
        except ValueError:
            raise ValueError(f"{text!r}: unknown op kind {head!r}; kinds are "
                             f"{[k.value for k in OpKind]}") from None
        names = _FIELDS[kind]
        if len(parts) != len(names):
            raise ValueError(f"{text!r}: a {kind.value} op is written "
                             + ":".join([kind.value] + [f"{_PREFIX[n]}<int>" for n in names]))
        kw = {}
        for name, part in zip(names, parts):
            if not part.startswith(_PREFIX[name]) or not part[1:].isdigit():
                raise ValueError(f"{text!r}: expected {_PREFIX[name]}<int> for {name}, got {part!r}")
            kw[name] = int(part[1:])
        return cls(kind, deps=tuple(deps), **kw)


Mode = Literal["train", "eval", "update"]


@dataclass(frozen=True, slots=True)
class Schedule:
    """The ops of one step (``mode="train"``), one evaluation pass (``"eval"``), or the optimizer
    steps still owed at the end of training (``"update"``).

    ``carries_updates``: with ``OptimizerPlacement.NEXT_FORWARD`` a step's optimizer steps run in
    the next step's schedule, before each layer's first weight copy, reading the gradient tiles the
    previous step left (one tile per trainable layer). A train schedule with ``carries_updates``
    starts with those steps; the first step after compiling (or after an ``"update"`` schedule, or a
    step whose update was dropped) runs the one without.

    Host gradients. A D2H copies a slot's gradients into ring tile ``r``. With layer-by-layer
    passes (or one micro-batch) that tile holds the layer's step gradients and ``OPT:L3:r<k>`` reads
    ring tile ``k``. With per-micro-batch passes (``plan.accumulates_on_host``) each micro-batch's
    D2H is followed by ``ACC:L3:m<mb>:r<k>``, which adds ring tile ``k`` into layer 3's FP32
    accumulator (micro-batch 0 overwrites it), and ``OPT:L3:r<a>`` reads accumulator ``a``, the
    layer's index in ``lower.gradient_tiles``.
    """

    ops: tuple[Op, ...]
    plan: Plan
    n_layers: int
    mode: Mode = "train"
    carries_updates: bool = False

    def __len__(self) -> int:
        return len(self.ops)

    def format(self, marker: int | None = None, context: int | None = None) -> str:
        """One op a line with its dependencies; ``marker`` points at op ``marker``."""
        lo, hi = 0, len(self.ops)
        if marker is not None and context is not None:
            lo, hi = max(0, marker - context), min(len(self.ops), marker + context + 1)
        lines = [] if lo == 0 else [f"      ... ({lo} ops before)"]
        for i in range(lo, hi):
            op = self.ops[i]
            arrow = "-->" if i == marker else "   "
            lines.append(f"{arrow} {i:5d} {op.stream.value:<7} {op!r:<20} deps={list(op.deps)}")
        if hi < len(self.ops):
            lines.append(f"      ... ({len(self.ops) - hi} ops after)")
        return "\n".join(lines)

    # -- JSON ------------------------------------------------------------------------------------
    def to_json(self, indent: int | None = 1) -> str:
        return _ScheduleModel.from_schedule(self).model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        """Load a schedule written by ``to_json``. Raises pydantic.ValidationError on bad JSON."""
        return _ScheduleModel.model_validate_json(text).to_schedule()

    def save(self, path) -> None:
        from pathlib import Path

        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> "Schedule":
        from pathlib import Path

        return cls.from_json(Path(path).read_text())


class _PlanModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    micro_batches: int
    slots: int
    prefetch_distance: int
    grad_ring: int
    resident: list[int]
    activations: list[ActivationPolicy]
    layer_by_layer: bool
    optimizer: OptimizerPlacement
    compute_dtype: Literal["float32", "bfloat16"]
    staging_ring: int
    cast_once: bool = False


class _OpModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    op: str
    deps: list[int]


class _ScheduleModel(pydantic.BaseModel):
    """JSON boundary of a Schedule: ``{"version", "mode", "carries_updates", "n_layers", "plan", "ops"}``."""

    model_config = pydantic.ConfigDict(extra="forbid")
    version: Literal[2, 3] = SCHEDULE_FORMAT_VERSION
    mode: Literal["train", "eval", "update"]
    carries_updates: bool = False
    n_layers: int
    plan: _PlanModel
    ops: list[_OpModel]

    @classmethod
    def from_schedule(cls, s: Schedule) -> "_ScheduleModel":
        p = s.plan
        return cls(mode=s.mode, carries_updates=s.carries_updates, n_layers=s.n_layers, plan=_PlanModel(
            micro_batches=p.micro_batches, slots=p.slots, prefetch_distance=p.prefetch_distance,
            grad_ring=p.grad_ring, resident=sorted(p.resident), activations=list(p.activations),
            layer_by_layer=p.layer_by_layer, optimizer=p.optimizer, compute_dtype=p.compute_dtype,
            staging_ring=p.staging_ring, cast_once=p.cast_once),
            ops=[_OpModel(op=repr(o), deps=list(o.deps)) for o in s.ops])

    def to_schedule(self) -> Schedule:
        p = self.plan
        plan = Plan(micro_batches=p.micro_batches, slots=p.slots, prefetch_distance=p.prefetch_distance,
                    grad_ring=p.grad_ring, resident=frozenset(p.resident),
                    activations=tuple(p.activations), layer_by_layer=p.layer_by_layer,
                    optimizer=p.optimizer, compute_dtype=p.compute_dtype, staging_ring=p.staging_ring,
                    cast_once=p.cast_once)
        return Schedule(ops=tuple(Op.parse(o.op, tuple(o.deps)) for o in self.ops), plan=plan,
                        n_layers=self.n_layers, mode=self.mode, carries_updates=self.carries_updates)


def schedule_json_schema() -> str:
    """The JSON schema of the schedule file format."""
    return json.dumps(_ScheduleModel.model_json_schema(), indent=1)
