"""The Schedule: an explicit DAG of typed ops on streams, and its JSON form.

Ops are frozen records with a short repr that parses back (``H2D:L3:s1``, ``H2D:L3:s1:t0``,
``FWD:L3:m0:s1``, ``BWD:L3:m0:s1``, ``D2H:L3:s1:r0``, ``OPT:L3:r0``, ``OPT:L3:a2``,
``OFFLOAD:L3:m0:c0``, ``RELOAD:L3:m0:c0``, ``RECOMPUTE:L3:m0:s1``, ``CAST:L3:t0``,
``ACC:L3:m1:r0:a2``, ``NVME_READ:L3:b0``, ``OPT:L3:r0:b0``, ``D2H:L3:s1:g0``, ``NVME_WRITE:L3:g0``,
``OPT:L3:g1:b0``, ``COUNT_REDUCE:L5``), after the ``_Action`` records of
``torch.distributed.pipelining``. Each op names every buffer it touches (see :class:`Op`), so the
lowering decides and the runtime reads. The op list is in issue order: a topological order of the
DAG, and for each stream the order its in-order queue runs the ops. ``deps`` are indices of
earlier ops that must finish first; a dependency that crosses streams becomes an event in the
CUDA backend.

Op kinds. :data:`OP_KINDS` holds one :class:`OpKindSpec` per kind: its stream (and so its
resource), its fields and text form, its timeline colour, what issuing it costs, how the solver's
bounds time it, which GPU values it reads and writes, and which verifier rules check it. The
per-kind tables elsewhere derive from it. Adding a kind takes its ``OpKind`` member and record
here, its time formula (``planner.time.DURATIONS``), its handler (``runtime.executor.HANDLERS``), the
lowering pass that emits it and the verifier rules that check it; ``tests/test_op_kinds.py``
fails until each has it.

JSON. ``Schedule.to_json`` writes ``{"version", "mode", "carries_updates", "n_layers", "plan",
"ops", "layout"}``; the plan's part is derived from the :class:`Plan` dataclass's fields, not listed again.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

import pydantic

from megatrain.ir.enums import IdentityEnum
from megatrain.ir.layout import BufferLayout, gradient_tiles
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan

SCHEDULE_FORMAT_VERSION = 19
"""4 named every resource in the op (an H2D's staging tile, an accumulator apart from ring tiles, an
OFFLOAD's pinned copy); 5 added the NVMe tier's ops (NVME_READ/NVME_WRITE on the IO stream) and
Plan.nvme_moments; 6 the data-parallel ALL_REDUCE on the COMM stream and Plan.data_parallel; 7 the
sharded optimizer's ALL_GATHER and Plan.optimizer_shards; 8 the NVMe I/O buffer (``b``) that
NVME_READ fills, the OPT of an NVMe layer steps in and NVME_WRITE writes from; 9 the topology,
Plan.nodes and Plan.host_state; 10 the gradient I/O buffer (``g``) of Plan.nvme_gradients, which a D2H
fills, NVME_WRITE/NVME_READ move and a carried OPT reads; 11 REDUCE_SCATTER and
Plan.gradient_reduction; 12 Plan.nvme_buffers (the NVMe reads' read-ahead); 13 the weight gather of
Plan.host_state "shard" (an ALL_GATHER naming its gather tile, ``t``); 14 Plan.nvme_masters and the
CAST from an NVMe I/O buffer (``b``) of a layer whose masters live on NVMe; 15 Plan.shared_cast (a
node's staging tiles shared, each rank casting its shard); 16 COUNT_REDUCE (the step's supervised
tokens summed over the ranks before the loss layer's first backward); 17 Schedule.issue_after (the
issue fences that bound how far the issuing thread runs ahead of the device); 18 Schedule.layout (the buffer layout
lowering decided: slots, pinned arena, NVMe and gather buffers, each layer's shards and slices, which
the runtime reads instead of deriving it); 19 Plan.templates (compiled layer templates) and Plan.cuda_graphs;
files of earlier versions are refused (lower the plan again)."""


class Stream(IdentityEnum):
    """The in-order queues a schedule runs on."""

    COMPUTE = "compute"
    H2D = "h2d"
    D2H = "d2h"
    HOST = "host"  # the host optimizer worker: OPT and ACC, in list order
    CAST = "cast"  # a second host worker for CASTs, so a layer's BF16 staging copy never queues behind
    #                the optimizer steps of other layers (it still waits for its own layer's update)
    IO = "io"  # a host worker for NVMe reads and writes (megatrain.runtime.nvme), in list order
    COMM = "comm"  # a host worker for data-parallel collectives (torch.distributed), in list order

class OpKind(IdentityEnum):
    H2D = "H2D"  # copy a layer's weights (compute dtype) from host into a GPU buffer slot
    FWD = "FWD"  # forward of one layer for one micro-batch; stores its output checkpoint
    BWD = "BWD"  # local backward: recompute the layer's forward from its input checkpoint, then grad
    D2H = "D2H"  # copy a slot's accumulated FP32 gradients into a host gradient tile
    OPT = "OPT"  # host AdamW step of one layer from its gradients on the host (see Schedule)
    OFFLOAD = "OFFLOAD"  # copy a layer's output checkpoints (one micro-batch) to pinned host memory
    RELOAD = "RELOAD"  # copy them back to the GPU before the local backwards that read them
    RECOMPUTE = "RECOMPUTE"  # forward of a layer in the backward phase, to rebuild its checkpoints
    CAST = "CAST"  # host: write a layer's master weights in the compute dtype into a staging tile (b: from NVMe I/O)
    ACC = "ACC"  # host: add one micro-batch's gradients from a ring tile into the layer's accumulator
    NVME_READ = "NVME_READ"  # read a layer's Adam moments (b) or gradient tile (g) from NVMe into an I/O buffer
    NVME_WRITE = "NVME_WRITE"  # write them from that buffer to the layer's NVMe file (moments after the OPT)
    ALL_REDUCE = "ALL_REDUCE"  # data parallel: sum a layer's step gradients (its tile or accumulator) over ranks
    REDUCE_SCATTER = "REDUCE_SCATTER"  # like ALL_REDUCE, but each rank gets the sum of its optimizer shard only
    ALL_GATHER = "ALL_GATHER"  # sharded optimizer: every rank's updated shard of a layer's master, to every rank
    #                            (with a gather tile ``t``, host_state "shard": the whole layer from every node's
    #                            slice into that node-shared tile, in the compute dtype, which the next H2D
    #                            reads; with Plan.shared_cast, the node's barrier between its ranks' CASTs
    #                            of their shards into the shared staging tile and the H2Ds that read it)
    COUNT_REDUCE = "COUNT_REDUCE"  # data parallel: sum the step's supervised tokens (the loss's divisor) over the
    #                                ranks; ``layer`` is the loss layer, whose first local backward reads it

    @property
    def stream(self) -> Stream:
        return _STREAM_OF[self]

    @property
    def spec(self) -> "OpKindSpec":
        """This kind's record in :data:`OP_KINDS`."""
        return OP_KINDS[self]


HOST_STREAMS = frozenset({Stream.HOST, Stream.CAST, Stream.IO, Stream.COMM})
"""Streams whose ops run on host worker threads (the others are GPU streams)."""

_ORDER = ("layer", "mb", "slot", "ring", "tile", "acc", "gbuf", "copy", "buf")
"""Every index field, in the order a repr writes them."""
_PREFIX = {"layer": "L", "mb": "m", "slot": "s", "ring": "r", "tile": "t", "acc": "a", "copy": "c", "buf": "b",
           "gbuf": "g"}
_FIELD_OF = {prefix: name for name, prefix in _PREFIX.items()}


@dataclass(frozen=True, slots=True)
class OpKindSpec:
    """What the IR states about one op kind: the one record a new kind adds, from which every
    per-kind table of the planner and the runtime derives (:data:`OP_KINDS`).

    What a kind *does* lives with the module that does it, keyed by kind and checked complete
    (``tests/test_op_kinds.py``): its time formula (``planner.time.DURATIONS``), its handler
    (``runtime.executor.HANDLERS``), where lowering emits it (``lower.py``) and the bodies of the
    verifier rules named in ``rules``. The IR cannot import the cost model or the runtime, so those
    three stay there; everything that is a fact about the kind is here.

    Attributes:
        stream: the in-order queue its ops run on (``OpKind.stream``). Its resource in the
            simulator, the solver's bounds and the replay backend is the stream's
            (:func:`megatrain.planner.time.resource_of`: the GPU, a copy engine, the host, NVMe, the
            network), and it runs on a host worker iff the stream is in :data:`HOST_STREAMS`.
        required: index fields (``Op`` attributes after ``layer``, e.g. ``("mb", "slot")``) every op
            of the kind names; with ``optional`` they are the op's text form (``FWD:L3:m0:s1``),
            which is its JSON (``{"op": "FWD:L3:m0:s1", ...}``).
        optional: index fields it may name.
        one_of: the fields of ``optional`` of which it names exactly one (where its data comes
            from or goes), in the order its error message lists them.
        colour: matplotlib colour of its bars in :meth:`Timeline.save_png`.
        launches: what the issuing thread calls for a GPU op (``cost.launch_count``): ``"copy"``
            one ``copy_``, ``"checkpoints"`` one per checkpoint of the layer, ``"fwd"`` / ``"bwd"``
            the layer's dispatched aten ops, ``"d2h"`` ``cost.D2H_LAUNCHES``; None for a host op
            (one queue put, ``cost.HOST_OP_LAUNCHES``).
        bounds: how the solver's bounds time it (``solve/bounds.py``): ``"size"`` grows with the
            micro-batch size, ``"step"`` the layer's alone, ``"untimed"`` added after the solve
            (the NVMe tier, data-parallel collectives).
        gpu_reads / gpu_writes: the layer's GPU values it reads / puts on the GPU (liveness):
            ``"inputs"``, ``"outputs"`` or ``"checkpoints"`` (the layer's outputs another layer
            reads), or None.
        rules: the verifier rules (``verify.RULES``, by name without ``_check_``) that check ops of
            this kind by kind; ``order`` and ``budget``'s index checks hold for every op.
    """

    stream: Stream
    required: tuple[str, ...]
    colour: str
    bounds: Literal["size", "step", "untimed"]
    rules: tuple[str, ...]
    optional: tuple[str, ...] = ()
    one_of: tuple[str, ...] = ()
    launches: Literal["copy", "checkpoints", "fwd", "bwd", "d2h"] | None = None
    gpu_reads: Literal["inputs", "checkpoints"] | None = None
    gpu_writes: Literal["outputs", "checkpoints"] | None = None


# Fields of each kind (OpKindSpec.required, optional, one_of). An H2D names the staging tile it reads
# when the plan computes in BF16 (FP32 copies read the master rows); an OPT reads either a host
# gradient tile (``ring``) or an accumulator (``acc``), exactly one of them; the OPT of a layer whose
# moments live on NVMe names the I/O buffer (``buf``) its NVME_READ filled. A layer of
# Plan.nvme_gradients has no tile of its own: its D2H names the gradient I/O buffer (``gbuf``) it
# lands in instead of a ring tile, and its carried OPT the gradient buffer its NVME_READ filled.
#
# What an NVMe transfer moves is said by which pool its buffer field names (``b``: the pageable
# moments pool, ``g``: the pinned gradient pool), not by new op kinds: both are the same operation
# on the same I/O stream and drives (one file of the layer, one host buffer), timed by one formula
# of their bytes, and the buffer field must be there anyway for the verifier's turn checks; two
# more kinds would duplicate every rule and handler for a difference one field already states.
_K, _S = OpKind, Stream
OP_KINDS: dict[OpKind, OpKindSpec] = {
    _K.H2D: OpKindSpec(stream=_S.H2D, required=("slot",), optional=("tile",), colour="tab:blue", launches="copy",
                       bounds="step", rules=("weights", "staging", "updates", "collectives", "layout")),
    _K.FWD: OpKindSpec(stream=_S.COMPUTE, required=("mb", "slot"), colour="tab:green", launches="fwd",
                       bounds="size", gpu_reads="inputs", gpu_writes="outputs", rules=("weights", "coverage", "data")),
    _K.BWD: OpKindSpec(stream=_S.COMPUTE, required=("mb", "slot"), colour="tab:olive", launches="bwd",
                       bounds="size", gpu_reads="inputs",
                       rules=("weights", "gradients", "coverage", "data", "updates", "collectives")),
    _K.D2H: OpKindSpec(stream=_S.D2H, required=("slot",), optional=("ring", "gbuf"), one_of=("ring", "gbuf"),
                       colour="tab:orange", launches="d2h", bounds="step",
                       rules=("budget", "gradients", "updates", "nvme", "collectives", "layout")),
    _K.OPT: OpKindSpec(stream=_S.HOST, required=(), optional=("ring", "acc", "gbuf", "buf"),
                       one_of=("ring", "acc", "gbuf"), colour="tab:purple", bounds="step",
                       rules=("gradients", "coverage", "updates", "nvme")),
    _K.OFFLOAD: OpKindSpec(stream=_S.D2H, required=("mb", "copy"), colour="tab:red", launches="checkpoints",
                           bounds="size", gpu_reads="checkpoints", rules=("data", "layout")),
    _K.RELOAD: OpKindSpec(stream=_S.H2D, required=("mb", "copy"), colour="tab:cyan", launches="checkpoints",
                          bounds="size", gpu_writes="checkpoints", rules=("data",)),
    _K.RECOMPUTE: OpKindSpec(stream=_S.COMPUTE, required=("mb", "slot"), colour="tab:pink", launches="fwd",
                             bounds="size", gpu_reads="inputs", gpu_writes="outputs",
                             rules=("weights", "coverage", "data")),
    _K.CAST: OpKindSpec(stream=_S.CAST, required=("tile",), optional=("buf",), colour="tab:gray", bounds="step",
                        rules=("budget", "staging", "coverage", "updates", "nvme", "collectives", "layout")),
    _K.ACC: OpKindSpec(stream=_S.HOST, required=("mb", "ring", "acc"), colour="tab:brown", bounds="step",
                       rules=("gradients", "updates", "collectives")),
    _K.NVME_READ: OpKindSpec(stream=_S.IO, required=(), optional=("buf", "gbuf"), one_of=("buf", "gbuf"),
                             colour="goldenrod", bounds="untimed", rules=("coverage", "nvme", "layout")),
    _K.NVME_WRITE: OpKindSpec(stream=_S.IO, required=(), optional=("buf", "gbuf"), one_of=("buf", "gbuf"),
                              colour="darkkhaki", bounds="untimed", rules=("coverage", "nvme", "layout")),
    _K.ALL_REDUCE: OpKindSpec(stream=_S.COMM, required=(), optional=("ring", "acc"), one_of=("ring", "acc"),
                              colour="teal", bounds="untimed", rules=("collectives",)),
    _K.REDUCE_SCATTER: OpKindSpec(stream=_S.COMM, required=(), optional=("ring", "acc"), one_of=("ring", "acc"),
                                  colour="cadetblue", bounds="untimed", rules=("collectives",)),
    _K.ALL_GATHER: OpKindSpec(stream=_S.COMM, required=(), optional=("tile",), colour="darkslategray",
                              bounds="untimed", rules=("budget", "coverage", "collectives")),
    _K.COUNT_REDUCE: OpKindSpec(stream=_S.COMM, required=(), colour="lightseagreen", bounds="untimed",
                                rules=("collectives",)),
}
"""The op kinds, one record each (:class:`OpKindSpec`). Every per-kind table derives from it:
``OpKind.stream``, :data:`COMPUTE_KINDS`, an op's fields, text form and JSON (``Op``), the timeline's
colours, ``cost.launch_count``, the solver's kind classes (``solve/bounds.py``) and liveness's
reads and writes (``liveness.reads_of`` / ``writes_of``)."""
del _K, _S
assert list(OP_KINDS) == list(OpKind), "every op kind needs its record in OP_KINDS, in OpKind's order"

_STREAM_OF = {kind: spec.stream for kind, spec in OP_KINDS.items()}
"""``OpKind.stream``, as a plain dict: the issuing thread looks streams up several times per op."""

COMPUTE_KINDS = frozenset(kind for kind, spec in OP_KINDS.items() if spec.stream is Stream.COMPUTE)
"""Op kinds that run a layer's template on the GPU with the layer's weights in a slot."""


def _spelling(kind: OpKind) -> str:
    """How an op of ``kind`` is written, e.g. ``H2D:L<int>:s<int>[:t<int>]``, ``D2H:L<int>:s<int>:(r<int>|g<int>)``."""
    spec = OP_KINDS[kind]
    text = ":".join([kind.value, "L<int>"] + [f"{_PREFIX[n]}<int>" for n in spec.required])
    if spec.one_of:
        text += ":(" + "|".join(f"{_PREFIX[n]}<int>" for n in spec.one_of) + ")"
    return text + "".join(f"[:{_PREFIX[n]}<int>]" for n in spec.optional if n not in spec.one_of)


@dataclass(frozen=True, slots=True)
class Op:
    """One op of a schedule. ``deps`` are indices of ops earlier in the schedule's list.

    Every resource an op touches is a field, filled by the lowering and checked by the verifier,
    so a backend reads it and derives nothing:

    - ``slot``: the device buffer slot (weights and gradients) of H2D, FWD, BWD, RECOMPUTE, D2H;
    - ``ring``: a pinned host gradient tile, written by D2H and read by ACC, or by an OPT that
      steps from the tile (layer-by-layer passes);
    - ``tile``: a pinned staging tile, written by CAST and read by a BF16 H2D (None: the H2D reads
      the FP32 master rows; with ``Plan.shared_cast`` the tile is the node's, shared by its ranks);
      on an ALL_GATHER (``Plan.host_state == "shard"``), the node's gather tile (one of
      ``layout.GATHER_BUFFERS``) it gathers the layer's weights into, in the compute dtype, which the
      H2D that depends on it reads in place of the master rows (no CAST: ``Plan.staged``);
    - ``acc``: a layer's FP32 host accumulator (per-micro-batch passes), which ACC adds into and
      an OPT steps from;
    - ``copy``: the pinned copy of a layer's checkpoints an OFFLOAD writes and a RELOAD reads (one
      per micro-batch layer by layer; copy 0, reused, with per-micro-batch passes);
    - ``buf``: the host I/O buffer of the NVMe pool (``layout.nvme_buffers``) that an NVME_READ
      fills with a layer's two Adam moments, the layer's OPT steps them in, and the NVME_WRITE
      writes back to the layer's file (layers in ``Plan.nvme_moments`` only: their moments have
      no rows in host memory); with ``Plan.nvme_masters`` the buffer holds the layer's master
      too, and the CAST after the OPT names it (``CAST:L3:t3:b1``): it casts the new master from
      the buffer into the layer's staging tile, and the NVME_WRITE waits for it;
    - ``gbuf``: the pinned gradient I/O buffer of the NVMe pool (``layout.nvme_gradient_buffers``)
      that a D2H of a layer in ``Plan.nvme_gradients`` fills and an NVME_WRITE empties to the
      layer's gradient file, or that an NVME_READ fills from that file and the layer's carried
      OPT steps from.

    Raises:
        ValueError: a field the kind needs is missing, or one it takes no part in is set.
    """

    kind: OpKind
    layer: int
    mb: int | None = None
    slot: int | None = None
    ring: int | None = None
    tile: int | None = None
    acc: int | None = None
    copy: int | None = None
    buf: int | None = None
    gbuf: int | None = None
    deps: tuple[int, ...] = field(default=(), compare=True)

    def __post_init__(self) -> None:
        spec = OP_KINDS[self.kind]
        for name in _ORDER[1:]:
            present = getattr(self, name) is not None
            if name in spec.required and not present:
                raise ValueError(f"{self.kind.value} op needs {name}: it is written {_spelling(self.kind)}")
            if present and name not in spec.required and name not in spec.optional:
                raise ValueError(f"{self.kind.value} op takes no {name}: it is written {_spelling(self.kind)}")
        sources = spec.one_of
        if sources and sum(getattr(self, f) is not None for f in sources) != 1:
            names = {"ring": "a gradient tile (ring)", "acc": "an accumulator (acc)",
                     "buf": "a moments I/O buffer (buf)", "gbuf": "a gradient I/O buffer (gbuf)"}
            said = [names[f] for f in sources]
            raise ValueError(f"{self.kind.value} op names {', '.join(said[:-1])} or {said[-1]}: give exactly one; "
                             f"it is written {_spelling(self.kind)}")

    @property
    def stream(self) -> Stream:
        return _STREAM_OF[self.kind]

    def __repr__(self) -> str:
        return ":".join([self.kind.value] + [f"{_PREFIX[f]}{getattr(self, f)}" for f in _ORDER
                                             if getattr(self, f) is not None])

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
        kw: dict[str, int] = {}
        for part in parts:
            name = _FIELD_OF.get(part[:1])
            if name is None or not part[1:].isdigit() or name in kw \
                    or (kw and _ORDER.index(name) < _ORDER.index(list(kw)[-1])):
                raise ValueError(f"{text!r}: unexpected {part!r}; a {kind.value} op is written {_spelling(kind)}")
            kw[name] = int(part[1:])
        if "layer" not in kw:
            raise ValueError(f"{text!r}: no layer; a {kind.value} op is written {_spelling(kind)}")
        try:
            return cls(kind, deps=tuple(deps), **kw)
        except ValueError as e:
            raise ValueError(f"{text!r}: {e}") from None



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
    D2H is followed by ``ACC:L3:m<mb>:r<k>:a<a>``, which adds ring tile ``k`` into accumulator
    ``a``, layer 3's (micro-batch 0 overwrites it), and ``OPT:L3:a<a>`` steps from the accumulator.
    Where each layer keeps a tile or accumulator of its own, its index is the layer's in
    :func:`gradient_tiles`. A layer of ``Plan.nvme_gradients`` keeps its tile on NVMe instead: its
    D2H lands in gradient I/O buffer ``g`` (``D2H:L3:s1:g0``), ``NVME_WRITE:L3:g0`` writes it to
    the layer's file, and the next schedule's ``NVME_READ:L3:g1`` brings it back for ``OPT:L3:g1``.

    The loss's divisor. Each micro-batch's loss is seeded with ``1 / N``, ``N`` the supervised tokens
    of the whole global batch. Under data parallel a train schedule's first op is
    ``COUNT_REDUCE:L<n-1>`` on the COMM stream, which sums the ranks' counts, and the loss layer's
    first local backward depends on it; with one rank ``N`` is the rank's own count.

    ``issue_after[i]``: the earlier ops that must have *finished* on the device before op ``i`` is
    issued (its fences), which bounds how far the issuing thread runs ahead of the device where the
    CUDA caching allocator would otherwise hold more than the cost model counts
    (:func:`megatrain.planner.activations.issue_fences` derives them). One tuple per op, or empty: no fences.

    ``layout``: every buffer the schedule runs on, its size and where each rank's and node's part
    of a tile is (:class:`~megatrain.ir.layout.BufferLayout`), as lowering decided it: the runtime
    allocates from it and the verifier checks it. None for a schedule built by hand, whose runner
    derives the one lowering would record (:func:`~megatrain.ir.layout.buffer_layout`).
    """

    ops: tuple[Op, ...]
    plan: Plan
    n_layers: int
    mode: Mode = "train"
    carries_updates: bool = False
    issue_after: tuple[tuple[int, ...], ...] = ()
    layout: BufferLayout | None = None

    def fences(self, i: int) -> tuple[int, ...]:
        """``issue_after[i]`` (empty for a schedule without fences)."""
        return self.issue_after[i] if self.issue_after else ()

    def of_layers(self, layers: frozenset[int]) -> "Schedule":
        """The ops of ``layers`` alone, in order (an update schedule of some pending layers): a
        dependency on a dropped op becomes a dependency on what that op depended on, so the order
        the kept ops had through it (the chain of collectives, say) stays. A kept op's issue fences
        on kept ops stay; those on dropped ops go with them (nothing they guarded runs)."""
        index: dict[int, int] = {}
        through: dict[int, frozenset[int]] = {}  # a dropped op -> the kept ops it waited for
        ops: list[Op] = []
        after: list[tuple[int, ...]] = []
        for i, op in enumerate(self.ops):
            deps = frozenset().union(*({index[d]} if d in index else through[d] for d in op.deps))
            if op.layer in layers:
                index[i] = len(ops)
                ops.append(dataclasses.replace(op, deps=tuple(sorted(deps))))
                after.append(tuple(index[f] for f in self.fences(i) if f in index))
            else:
                through[i] = deps
        return dataclasses.replace(self, ops=tuple(ops), issue_after=tuple(after) if any(after) else ())

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


_PLAN_HINTS = typing.get_type_hints(Plan)
_PLAN_FIELDS = tuple((f.name, _PLAN_HINTS[f.name], f.default) for f in dataclasses.fields(Plan))
"""Each field of the Plan dataclass: (name, type, default)."""


def _json_type(hint):
    """A Plan field's type at the JSON boundary: a frozenset or tuple is a list."""
    return list[typing.get_args(hint)[0]] if typing.get_origin(hint) in (frozenset, tuple) else hint


class _PlanBase(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    @pydantic.model_serializer(mode="wrap")
    def _omit_adamw(self, handler: pydantic.SerializerFunctionWrapHandler) -> dict:
        # optimizer_name is written only when not AdamW, so that AdamW's schedule files stay as they
        # were (older files load as AdamW; an older reader refuses a Lion file by its unknown field).
        out = handler(self)
        if out.get("optimizer_name") == "adamw":
            del out["optimizer_name"]
        return out


_PlanModel = pydantic.create_model("_PlanModel", __base__=_PlanBase,
                                   **{name: (_json_type(hint), default) for name, hint, default in _PLAN_FIELDS})
"""JSON boundary of a Plan, derived from its dataclass fields (names, order, types, defaults), so a
field added to Plan is in the schedule file without a second list: a set of layers is written as a
sorted list, a tuple as a list; ``Plan.__post_init__`` checks the values when a file is read. The
one exception: ``optimizer_name`` is left out when it is ``"adamw"`` (the default)."""


def _plan_to_json(plan: Plan) -> pydantic.BaseModel:
    def value(v):
        return sorted(v) if isinstance(v, frozenset) else list(v) if isinstance(v, tuple) else v
    return _PlanModel(**{name: value(getattr(plan, name)) for name, _, _ in _PLAN_FIELDS})


def _plan_from_json(model: pydantic.BaseModel) -> Plan:
    def value(v, hint):
        origin = typing.get_origin(hint)
        return origin(v) if origin in (frozenset, tuple) else v
    return Plan(**{name: value(getattr(model, name), hint) for name, hint, _ in _PLAN_FIELDS})


class _OpModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    op: str
    deps: list[int]
    after: list[int] = []


class _ScheduleModel(pydantic.BaseModel):
    """JSON boundary of a Schedule: ``{"version", "mode", "carries_updates", "n_layers", "plan", "ops"}``,
    each op ``{"op", "deps", "after"}`` (``after``: its ``Schedule.issue_after``), and ``"layout"``, the
    :class:`~megatrain.ir.layout.BufferLayout`'s fields (null for a schedule without one)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    version: int = SCHEDULE_FORMAT_VERSION
    mode: Literal["train", "eval", "update"]
    carries_updates: bool = False
    n_layers: int
    plan: _PlanModel
    ops: list[_OpModel]
    layout: BufferLayout | None = None  # its dataclass fields, tuples as lists

    @pydantic.field_validator("version")
    @classmethod
    def _current(cls, v: int) -> int:
        if v != SCHEDULE_FORMAT_VERSION:
            raise ValueError(f"schedule file format version {v} is not {SCHEDULE_FORMAT_VERSION}, the one this "
                             "megatrain reads (version 4 names staging tiles, accumulators and pinned copies in "
                             "the ops): lower the plan again (megatrain plan --out DIR)")
        return v

    @classmethod
    def from_schedule(cls, s: Schedule) -> "_ScheduleModel":
        return cls(mode=s.mode, carries_updates=s.carries_updates, n_layers=s.n_layers, plan=_plan_to_json(s.plan),
            ops=[_OpModel(op=repr(o), deps=list(o.deps), after=list(s.fences(i))) for i, o in enumerate(s.ops)],
            layout=s.layout)

    def to_schedule(self) -> Schedule:
        plan = _plan_from_json(self.plan)
        return Schedule(ops=tuple(Op.parse(o.op, tuple(o.deps)) for o in self.ops), plan=plan,
                        n_layers=self.n_layers, mode=self.mode, carries_updates=self.carries_updates,
                        issue_after=tuple(tuple(o.after) for o in self.ops) if any(o.after for o in self.ops) else (),
                        layout=self.layout)



__all__ = ["COMPUTE_KINDS", "HOST_STREAMS", "Mode", "OP_KINDS", "Op", "OpKind", "OpKindSpec", "SCHEDULE_FORMAT_VERSION",
           "Schedule", "Stream", "gradient_tiles"]
