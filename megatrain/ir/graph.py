"""The LayerGraph: the planner's view of a model, as plain frozen data.

A model is cut into an ordered list of layers (a prologue such as the embeddings, the repeated
blocks, an epilogue such as the final norm, LM head and loss). Layers exchange *values*: the
tensors that cross a layer boundary (the residual stream, but also side values such as rotary
cos/sin tables or the attention mask, which the prologue computes once and every block reads).
The solver, the lowering pass and the simulator read only the LayerGraph's types; the executable
templates live beside the graph in :class:`TracedModel`, which :func:`megatrain.planner.trace.trace`
makes and the runtime runs (after :func:`retarget` to its device; defined in :mod:`megatrain.ir.devices`,
which :mod:`megatrain.ir.profile` uses too). This module never imports torch, so the solver and the
simulator plan without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatrain.ir.devices import retarget  # re-exported: megatrain.ir.graph.retarget is its documented path
from megatrain.ir.profile import KernelProfile

if TYPE_CHECKING:
    import torch.fx as fx

# Offsets of parameters inside a layer's flat tile are multiples of this many elements, so every
# parameter starts on a 64-byte boundary in FP32 (and 32 bytes in BF16): vector loads and DMA
# stay aligned. The padding is a few hundred bytes per layer at most.
TILE_ALIGN_ELEMENTS = 16

BATCH_PRODUCER = -1
"""``Value.producer`` of a value that comes from the batch (``input_ids``, ``labels``)."""


def align_up(n: int, a: int = TILE_ALIGN_ELEMENTS) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter inside a layer's flat FP32 tile.

    ``offset`` and ``numel`` are in elements of the tile; ``name`` is the parameter's fully
    qualified name in the user's module (``model.layers.3.mlp.up_proj.weight``).
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    trainable: bool = True

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __post_init__(self) -> None:
        if self.offset < 0 or self.offset % TILE_ALIGN_ELEMENTS:
            raise ValueError(f"parameter {self.name!r}: offset {self.offset} is not a non-negative "
                             f"multiple of {TILE_ALIGN_ELEMENTS}")


@dataclass(frozen=True, slots=True)
class Value:
    """A tensor that crosses a layer boundary, for one micro-batch.

    ``shape`` is the micro-batch shape; ``nbytes`` = numel x itemsize. ``producer`` is the index of
    the layer that computes it (``BATCH_PRODUCER`` for batch inputs); ``consumers`` are the layers
    that read it, ascending. ``requires_grad`` is true when the value is floating point and depends
    on a parameter, so the local backward of a consumer returns a gradient for it.
    """

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    producer: int
    consumers: tuple[int, ...]
    requires_grad: bool


@dataclass(frozen=True, slots=True)
class Layer:
    """One unit of streaming: its parameters move to the GPU together, in one H2D copy.

    ``numel`` is the tile length in elements (parameters plus alignment padding);
    ``trainable_numel`` the prefix of the tile the optimizer updates (trainable parameters are laid
    out first). ``fwd_flops`` counts one forward of one micro-batch; ``bwd_flops`` one local
    backward of one micro-batch (the recompute of the forward plus the backward proper).
    ``template`` names the executable template; structurally identical layers share one.
    ``buffers`` are the fully qualified names of the non-trainable tensors (buffers, constants) it
    reads, which stay resident on the device. ``work_bytes`` bounds the transient device memory of
    one local backward of one micro-batch (and so of a forward): the peak of a liveness simulation
    over the layer's template (:func:`megatrain.planner.trace.measure.work_bytes`) in which every tensor
    the forward creates (views excluded) is held until its own op's backward step, the backward
    allocates a gradient for each differentiable input of each op in reverse order, the flat
    tile's weight gradient is gathered at the end, and chunked kernels add what they hold inside
    (one chunk's recompute and gradients for a sequence-chunked region; the logits chunk and held
    gradients of the fused LM head loss). It excludes what is accounted elsewhere: the layer's
    inputs, weights and buffers (checkpoints, slots, resident buffers), the gradients arriving for
    its outputs and the first gradient of each input (boundary gradients in the cost model).
    ``draws_random``: its template draws random numbers (dropout with ``p > 0`` in training mode,
    attention with ``dropout_p > 0``; :func:`megatrain.planner.trace.cleanup.draws_random`), so the
    executor records the device generator's state at its forward and restores it for every
    recompute (RECOMPUTE and the local backward), which then draws the same masks.
    ``fwd_profile`` / ``bwd_profile``: each op one forward / one local backward of one micro-batch
    dispatches, with its kind, FLOPs and bytes (:func:`megatrain.ir.profile.profile_template`, shared
    by the layers of a template), which the time model times kernel by kernel; None for a layer
    built by hand, timed by its FLOPs.
    """

    index: int
    name: str
    template: int
    params: tuple[ParamSpec, ...]
    numel: int
    trainable_numel: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    buffers: tuple[str, ...]
    fwd_flops: int
    bwd_flops: int
    buffer_bytes: int = 0
    work_bytes: int = 0
    fwd_launches: int = 0  # aten ops one forward dispatches (megatrain.ir.issue.count_launches)
    bwd_launches: int = 0  # the same for one local backward: its recompute plus the backward proper
    draws_random: bool = False  # its forward draws random numbers: recomputes replay the forward's RNG state
    fwd_profile: KernelProfile | None = None  # the ops one forward dispatches (megatrain.ir.profile)
    bwd_profile: KernelProfile | None = None  # the same for one local backward

    @property
    def param_count(self) -> int:
        return sum(p.numel for p in self.params)


@dataclass(frozen=True, slots=True)
class LayerGraph:
    """Ordered layers and the values between them, for one micro-batch of ``batch_shape``.

    ``batch_inputs`` are the names of the model's inputs in call order, each a ``Value`` with
    ``producer == BATCH_PRODUCER``; ``loss`` is the value id of the scalar loss, which the last
    layer produces.
    """

    layers: tuple[Layer, ...]
    values: tuple[Value, ...]
    batch_inputs: tuple[str, ...]
    loss: int
    micro_batch_size: int
    seq_len: int
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a LayerGraph needs at least one layer")
        for i, layer in enumerate(self.layers):
            if layer.index != i:
                raise ValueError(f"layer {layer.name!r} has index {layer.index}, expected {i}")
        for i, v in enumerate(self.values):
            if v.id != i:
                raise ValueError(f"value {v.name!r} has id {v.id}, expected {i}")
            if v.producer != BATCH_PRODUCER and any(c <= v.producer for c in v.consumers):
                raise ValueError(f"value {v.name!r} produced by layer {v.producer} is read by an "
                                 f"earlier layer {v.consumers}; layers must be in execution order")
        if self.values[self.loss].producer != len(self.layers) - 1:
            raise ValueError("the loss must be produced by the last layer")

    @property
    def param_count(self) -> int:
        return sum(layer.param_count for layer in self.layers)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len

    def checkpoints(self, layer: int) -> tuple[int, ...]:
        """Ids of ``layer``'s outputs that some layer reads: its checkpoints, what an OFFLOAD or
        RELOAD of the layer moves (the loss, read by no layer, is not one)."""
        return tuple(vid for vid in self.layers[layer].outputs if self.values[vid].consumers)

    def has_gradients(self, layer: int) -> bool:
        """Whether layer ``layer``'s local backward computes anything: a gradient of a trainable
        parameter, or of an input that one depends on. A layer of frozen parameters whose inputs
        need no gradient (a frozen vision tower, a frozen input embedding) has none, and the
        schedule gives it no local backward (its forward is all it runs)."""
        rec = self.layers[layer]
        return rec.trainable_numel > 0 or any(self.values[v].requires_grad for v in rec.inputs)

    def value_by_name(self, name: str) -> Value:
        for v in self.values:
            if v.name == name:
                return v
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class TracedModel:
    """A LayerGraph with what it takes to run it.

    ``templates[t]`` is an ``fx.GraphModule`` taking ``(*params, *buffers, *inputs)`` of a layer
    whose ``template == t`` and returning the tuple of its output values, traced on the device the
    model was on (the runtime re-targets it with :func:`retarget`). Besides aten ops a template may
    call the kernels of :mod:`megatrain.kernels` (the chunked LM head loss, sequence-chunked
    regions, autocast-free position math, grouped-query attention). ``buffer_sources`` maps each
    buffer name a layer lists to where its value lives: ``("buffer", fqn)`` for a module buffer,
    ``("constant", tensor)`` for a tensor constant export lifted out of ``forward``.
    ``eval_templates[t]``: template ``t`` as the model's eval mode runs it (dropout off:
    :func:`megatrain.planner.trace.cleanup.without_dropout`) where template ``t`` draws random
    numbers, else None; empty when no template does. Eval schedules run these.
    ``count_targets``: where the model's loss is a mean cross-entropy, the loss the last layer
    returns is its sum over the micro-batch's targets, and this ``fx.GraphModule`` takes one
    micro-batch's inputs (``graph.batch_inputs``, in order) and returns the number of them as a
    0-dim int64 tensor: the labels the loss counts, after the model's shift
    (:mod:`megatrain.planner.trace.token_loss`). None where the loss is left as the model wrote it
    (``graph.meta["uncounted_loss_because"]`` says why).
    """

    graph: LayerGraph
    templates: tuple[fx.GraphModule, ...]
    buffer_sources: dict[str, tuple[str, Any]]
    eval_templates: tuple[fx.GraphModule | None, ...] = ()
    count_targets: fx.GraphModule | None = None
