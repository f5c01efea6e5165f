"""What the trace passes share: the options of one trace, and the context its passes fill in turn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from megatrain.errors import TraceError

if TYPE_CHECKING:
    import torch
    import torch.fx as fx
    from torch import nn

    from megatrain.ir.graph import ParamSpec, TracedModel


@dataclass(frozen=True, slots=True)
class TraceOptions:
    """The arguments of :func:`megatrain.planner.trace.trace` the passes read.

    ``micro_batch_size`` and ``seq_len`` shape every batch input (``[micro_batch_size,
    seq_len]``); ``input_names`` name them in call order. ``loss_chunk_bytes``: bytes of one chunk
    of logits for the LM-head pass, None to keep the model's LM head and loss. ``seq_chunk_bytes``:
    the intermediate bytes above which the sequence-chunk pass runs a token-wise region in chunks,
    None to run every region whole. ``param_dtype``: the floating dtype the model's parameters are
    traced in (the compute dtype: mixed precision's ``param_dtype``), None for theirs.
    ``input_shapes``: ``(name, shape, dtype)`` of each batch input that is not a
    ``[micro_batch_size, seq_len]`` long tensor, its shape that of one micro-batch (a
    vision-language model's ``pixel_values``: :func:`~.vlm.image_inputs`). ``call``: how the loss
    wrapper calls the model with one micro-batch's inputs (``call(model, **inputs)``; Qwen2-VL's
    :func:`~.qwen_vl.trace_call`), None for ``model(**inputs)``. Raises TraceError for a size below 1.
    """

    micro_batch_size: int
    seq_len: int
    input_names: tuple[str, ...]
    loss_chunk_bytes: int | None
    seq_chunk_bytes: int | None
    param_dtype: torch.dtype | None = None
    input_shapes: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
    call: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.seq_len < 1:
            raise TraceError(f"micro_batch_size ({self.micro_batch_size}) and seq_len ({self.seq_len}) must be >= 1")
        if self.loss_chunk_bytes is not None and self.loss_chunk_bytes < 1:
            raise TraceError(f"loss_chunk_bytes ({self.loss_chunk_bytes}) must be >= 1, or None to keep the "
                             "unchunked loss")
        if self.seq_chunk_bytes is not None and self.seq_chunk_bytes < 1:
            raise TraceError(f"seq_chunk_bytes ({self.seq_chunk_bytes}) must be >= 1, or None to run token-wise "
                             "regions over the whole sequence")


@dataclass(frozen=True, slots=True)
class ValueCut:
    """A node of export's graph that becomes a :class:`~megatrain.ir.graph.Value`: a batch
    input or a tensor a later layer reads. ``name`` is ``layer:node`` (or the batch input's name);
    ``producer`` the layer index (``BATCH_PRODUCER`` for the batch)."""

    node: fx.Node
    name: str
    producer: int


@dataclass(slots=True)
class LayerCut:
    """One layer cut out of export's graph, before it becomes a :class:`~megatrain.ir.graph.Layer`.

    ``module`` is the layer's own ``fx.GraphModule`` ``(*params, *buffers, *inputs) -> outputs``,
    which the LM-head and sequence-chunk passes rewrite in place. ``params``, ``buffers``,
    ``inputs`` and ``outputs`` are the nodes of export's graph it reads and writes (parameters
    trainable first); ``specs`` lays the parameters out in the layer's flat tile of ``numel``
    elements, the first ``trainable_numel`` of them trainable. ``template`` (set by
    ``share_templates``) and ``work_bytes`` (by ``measure``) come later.
    """

    index: int
    name: str
    module: fx.GraphModule
    params: list[fx.Node]
    buffers: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    specs: tuple[ParamSpec, ...]
    numel: int
    trainable_numel: int
    template: int = -1
    work_bytes: int = 0


@dataclass(slots=True)
class TraceContext:
    """The state of one run of the trace passes over one module: each pass reads what the ones
    before it wrote and fills its own fields (named in its docstring).

    ``model`` is the user's model; ``module`` the one exported: the model itself, or its
    three-block copy keeping blocks ``picks`` of ``container`` (:mod:`.replicate`). The passes
    never modify ``model``. ``vision_container``: a vision-language model's vision blocks, cut into
    layers of their own before the decoder's (:mod:`.vlm`).
    """

    model: nn.Module
    module: nn.Module
    options: TraceOptions
    container: str | None
    picks: tuple[int, ...] | None = None
    vision_container: str | None = None
    # export
    example: tuple[torch.Tensor, ...] = ()
    program: Any = None  # torch.export.ExportedProgram
    gm: fx.GraphModule | None = None
    user_inputs: list[str] = field(default_factory=list)
    param_of: dict[str, str] = field(default_factory=dict)  # placeholder -> parameter name
    buffer_of: dict[str, str] = field(default_factory=dict)  # placeholder -> buffer name
    const_of: dict[str, str] = field(default_factory=dict)  # placeholder -> lifted constant name
    trainable: dict[str, bool] = field(default_factory=dict)  # parameter name -> requires_grad
    # sum_token_loss
    count_targets: fx.GraphModule | None = None
    uncounted_loss_because: str | None = None
    # cut
    loss_node: fx.Node | None = None
    values: list[ValueCut] = field(default_factory=list)
    value_of: dict[fx.Node, int] = field(default_factory=dict)
    needs_grad: set[fx.Node] = field(default_factory=set)
    buffer_sources: dict[str, tuple[str, Any]] = field(default_factory=dict)
    layers: list[LayerCut] = field(default_factory=list)
    # share_templates, measure
    templates: list[fx.GraphModule] = field(default_factory=list)
    flops: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)  # template -> fwd, bwd FLOPs, launches
    profiles: dict[int, tuple] = field(default_factory=dict)  # template -> (fwd, bwd) KernelProfile
    # build_graph, replicate
    traced: TracedModel | None = None
    full_because: str | None = None


__all__ = ["LayerCut", "TraceContext", "TraceOptions", "ValueCut"]
