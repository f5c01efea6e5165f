"""Trace a model into a :class:`LayerGraph` and one executable template per kind of layer.

Method. The model, wrapped so that it returns only its scalar loss, is exported with
``torch.export.export(strict=False)`` on the device its parameters are on (``meta`` for a model
too large to build, where export runs on fake tensors and costs no parameter memory). Plain
``torch.fx.symbolic_trace`` cannot follow Hugging Face transformers 5.x models; non-strict export
can, and it lifts parameters and buffers into graph inputs and records in each node's
``nn_module_stack`` the chain of modules that called it.

The repeated blocks are found structurally, not from a table of class names: the
``nn.ModuleList``/``nn.Sequential`` holding the most parameters is the block container, and a
node belongs to block ``i`` when its module stack passes through child ``i``. Nodes called
outside any block before the first block form the *prologue* (embeddings, rotary tables, the
causal mask), nodes after the last block the *epilogue* (final norm, LM head, loss). The graph is
then cut at those boundaries: every tensor one layer produces and a later layer reads becomes a
``Value``, and each layer becomes a pure function ``(params..., buffers..., inputs...) ->
outputs`` as an ``fx.GraphModule``. Layers whose functions are structurally equal (same ops, same
shapes, same wiring) share one template, so a 80-block model has three templates. A value is
named after its layer and its node's name counted within that layer (``model.layers.7:add_5``),
so names do not depend on how many layers came before.

Export's graph is cleaned before it is cut, in every nested graph (the bodies of higher-order ops
such as ``wrap_with_set_grad_enabled``, which a ``torch.no_grad`` region becomes) as well as the
top-level one, so that a template traced in FP32 runs the same under BF16 autocast:
:func:`erase_metadata_asserts` drops export's dtype asserts, :func:`keep_position_math_fp32` runs
matmuls that read no parameter (rotary angles) with autocast off, as the model's own
autocast-disabled region did before export dropped it, and
:func:`install_grouped_query_attention` routes grouped-query attention through a kernel that expands
key/value heads where SDPA would otherwise fall back to the math kernel's ``[B, H, S, S]`` scores
(FP32 on CUDA).

FLOPs per layer are counted by running each template once on the meta device under
``torch.utils.flop_counter.FlopCounterMode`` (forward, then forward plus backward for the local
backward), so attention FLOPs are included exactly as the kernels see them.

Four refinements keep tracing fast and its graph and working memory small at scale:

- *Replicated blocks.* Export costs time in proportion to the ops it records, ~0.1 s per block of
  a 120B model. When every block is the same module (same module types, parameter and buffer
  shapes, dtypes and ``requires_grad``, the same plain attributes but for the block's own index,
  no per-layer entries in a Hugging Face config such as ``layer_types``), a shallow copy of the
  model keeping three blocks (the first, the middle one, the last) is traced instead, and the
  full-depth graph is built by repeating the middle block's layer record with its parameter
  names and value ids renumbered. It is used only when the three traced blocks agree (one
  template, the same work bytes and FLOPs, the same wiring: each reads the batch, the prologue
  and the block before it, and only the next layer reads its outputs); otherwise, or when the
  short copy fails to trace, the full model is traced. ``graph.meta["trace"]`` says which (and
  ``meta["trace_full_because"]`` why not). What the checks cannot see is Python in the model's
  forward that treats an untraced block differently by its position alone (``if i == 17:``) or
  computes with the number of blocks (``len(self.layers)``, which is 3 in the copy; transformers
  models read ``config.num_hidden_layers``, which the copy shares); the check on config lists
  covers the transformers idiom for per-layer variation (``layer_types``).
- *No materialised causal mask.* Under export transformers' ``masking_utils`` builds the
  ``(B, 1, S, S)`` causal mask as a tensor (at 512k tokens a 256 GiB boundary value), because
  the check that would let SDPA use ``is_causal`` instead is disabled while tracing. When the
  batch has no ``attention_mask`` and no ``position_ids`` every row is one unpadded causal
  sequence, so for ``sdpa`` models the trace registers (through transformers' public
  ``AttentionInterface`` / ``AttentionMaskInterface``) an implementation that is SDPA itself with
  a mask function returning ``None`` for exactly the plain causal mask, and switches the
  model's configs to it for the duration of the export only (see :func:`_causal_attention`).
- *Chunked LM head loss.* The epilogue's ``lm_head -> cast -> cross_entropy`` would hold the
  ``[tokens, vocab]`` logits (64 GiB at 512k tokens x 32k vocabulary in FP32).
  :func:`chunk_lm_head_loss` rewrites that subgraph of the epilogue template into one call of
  :func:`megatrain.kernels.linear_cross_entropy`, which never holds more than a chunk of them.
- *Sequence chunking.* Norms, projections, rotary embeddings and MLPs compute each position on its
  own; at 512k tokens a Llama-2-7B block's such ops create 160 GiB of intermediates.
  :func:`chunk_sequence_regions` (Mini-Sequence Transformer, Luo et al. 2024, arXiv:2407.15892)
  finds the maximal regions of such token-wise ops between attention calls and, where their
  intermediates exceed ``seq_chunk_bytes``, runs each as one call of
  :func:`megatrain.kernels.sequence_chunked`, a checkpointed chunk of the sequence at a time.

A layer's ``work_bytes`` comes from a liveness simulation of its local backward over the template
(:func:`_work_bytes`): what its forward creates, the gradients its backward creates, and what the
chunked kernels hold inside, at the peak.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import inspect
import operator
import re
import sys
from dataclasses import dataclass
from typing import Any, Collection, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from megatrain.errors import TraceError, UnsupportedModelError
from megatrain.kernels import (chunk_bounds, grouped_query_attention, linear_cross_entropy,
                               linear_cross_entropy_work_bytes, sequence_chunked, without_autocast)
from megatrain.planner.graph import BATCH_PRODUCER, Layer, LayerGraph, ParamSpec, Value, align_up
from megatrain.planner.issue import count_launches

_aten = torch.ops.aten

_WRAPPED = "inner"  # attribute name of the user's model inside the loss wrapper

# Ops export inserts to assert the device/dtype seen at trace time; they would pin the graph to
# the meta device and carry no computation.
_ASSERT_OPS = {torch.ops.aten._assert_tensor_metadata.default}

# Ops that draw random numbers. A local backward recomputes the forward, which would draw a
# different dropout mask than the forward did and silently train a different function.
_RANDOM_OPS = {"aten::dropout", "aten::native_dropout", "aten::bernoulli", "aten::rand", "aten::randn",
               "aten::rand_like", "aten::randn_like", "aten::randint", "aten::randperm", "aten::multinomial",
               "aten::normal", "aten::uniform", "aten::feature_dropout", "aten::alpha_dropout"}


def _check_no_randomness(gm: fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if n.op == "call_function" and n.target is grouped_query_attention:
            schema = _aten.scaled_dot_product_attention.default._schema  # it takes SDPA's leading arguments
        if schema is None:
            continue
        if schema.name not in _RANDOM_OPS:
            # Attention kernels take their dropout as an argument (HF's attention_dropout > 0 reaches
            # scaled_dot_product_attention as dropout_p).
            names = [a.name for a in schema.arguments]
            if "dropout_p" not in names:
                continue
            k = names.index("dropout_p")
            p = n.args[k] if len(n.args) > k else n.kwargs.get("dropout_p", 0.0)
            if not p:
                continue
        elif schema.name.endswith("dropout") and (len(n.args) > 1 and n.args[1] == 0.0 or
                                                  len(n.args) > 2 and n.args[2] is False):
            continue  # p == 0 or not training: no randomness
        stack = n.meta.get("nn_module_stack") or {}
        where = _strip(list(stack.values())[-1][0]) if stack else "the model's forward"
        raise UnsupportedModelError(
            f"module {where!r} calls {schema.name} ({n.name}): megatrain recomputes each layer's "
            "forward in its local backward and does not replay random number draws yet, so dropout "
            "and other random ops are not supported; set dropout probabilities to 0 or call "
            "model.eval() on the dropout modules")


@dataclass(frozen=True, slots=True)
class TracedModel:
    """A LayerGraph with what it takes to run it.

    ``templates[t]`` is an ``fx.GraphModule`` taking ``(*params, *buffers, *inputs)`` of a layer
    whose ``template == t`` and returning the tuple of its output values, traced on the device the
    model was on (the runtime re-targets it). Besides aten ops a template may call the kernels of
    :mod:`megatrain.kernels` (the chunked LM head loss). ``buffer_sources`` maps each buffer name
    a layer lists to where its value lives: ``("buffer", fqn)`` for a module buffer,
    ``("constant", tensor)`` for a tensor constant export lifted out of ``forward``.
    """

    graph: LayerGraph
    templates: tuple[fx.GraphModule, ...]
    buffer_sources: dict[str, tuple[str, Any]]


class _LossOnly(nn.Module):
    """Calls the user's model with keyword batch inputs and returns only the scalar loss."""

    def __init__(self, model: nn.Module, input_names: Sequence[str]):
        super().__init__()
        setattr(self, _WRAPPED, model)
        self.input_names = tuple(input_names)
        params = inspect.signature(model.forward).parameters
        # A KV cache is for generation; in training it only adds graph inputs and copies.
        self.extra = {"use_cache": False} if "use_cache" in params else {}

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        out = getattr(self, _WRAPPED)(**dict(zip(self.input_names, batch)), **self.extra)
        return _extract_loss(out)


def _extract_loss(out: Any) -> torch.Tensor:
    loss = None
    if isinstance(out, torch.Tensor):
        loss = out
    elif isinstance(out, dict) or hasattr(out, "keys"):
        loss = out.get("loss") if hasattr(out, "get") else None
    elif isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if loss is None and hasattr(out, "loss"):
        loss = out.loss
    if not isinstance(loss, torch.Tensor):
        raise TraceError(
            f"the model returned {type(out).__name__} with no loss tensor; megatrain trains a model "
            "whose forward returns its loss (a scalar tensor, an object with .loss, or a tuple whose "
            "first element is the loss): pass labels among the batch inputs")
    if loss.dim() != 0:
        raise TraceError(f"the model returned a tensor of shape {tuple(loss.shape)} where megatrain "
                         "expects the scalar loss: if these are logits, pass labels among the batch "
                         "inputs; otherwise reduce the loss with mean or sum inside forward")
    return loss


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    raise UnsupportedModelError(f"{type(model).__name__} has no parameters: there is nothing to train")


class _ModuleTracker:
    """Remembers which module was running when export failed, to name it in the error."""

    def __init__(self, model: nn.Module):
        self.stack: list[str] = []
        self.deepest: list[str] = []
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._pre(name or type(model).__name__)))
            self.handles.append(mod.register_forward_hook(self._post()))

    def _pre(self, name: str):
        def hook(_m, _a):
            self.stack.append(name)
            self.deepest = list(self.stack)
        return hook

    def _post(self):
        def hook(_m, _a, _o):
            if self.stack:
                self.stack.pop()
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _export(model: nn.Module, input_names: Sequence[str], example: tuple[torch.Tensor, ...]):
    wrapper = _LossOnly(model, input_names)
    tracker = _ModuleTracker(model)
    try:
        return torch.export.export(wrapper, example, strict=False)
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the module that failed named
        where = tracker.stack[-1] if tracker.stack else (tracker.deepest[-1] if tracker.deepest else "?")
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise TraceError(
            f"torch.export could not trace {type(model).__name__}: the failure happened in module "
            f"{where!r}: {type(e).__name__}: {first}. megatrain needs a forward that torch.export "
            "(non-strict) can follow: no data-dependent Python control flow on tensor values, no "
            "custom autograd.Function without a fake/meta implementation") from e
    finally:
        tracker.close()


def _find_block_container(model: nn.Module) -> str | None:
    """Name of the ModuleList/Sequential whose children hold the most parameters, or None."""
    best, best_count = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 0:
            count = sum(p.numel() for p in mod.parameters())
            if count > best_count:
                best, best_count = name, count
    return best


def _block_of(node: fx.Node, prefix: str) -> int | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, _ty in stack.values():
        if path.startswith(prefix):
            head = path[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def _strip(fqn: str) -> str:
    return fqn[len(_WRAPPED) + 1:] if fqn.startswith(_WRAPPED + ".") else fqn


def _val(node: fx.Node):
    return node.meta.get("val")


def _assign_stages(gm: fx.GraphModule, container: str | None, n_blocks: int) -> tuple[dict[fx.Node, int], list[str]]:
    """Stage index of every call_function node; stages are [prologue, blocks..., epilogue]."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    prefix = f"{_WRAPPED}.{container}." if container is not None else None
    block = {n: (_block_of(n, prefix) if prefix else None) for n in calls}
    last_block_pos = max((i for i, n in enumerate(calls) if block[n] is not None), default=-1)
    stage: dict[fx.Node, int] = {}
    current = -1
    for i, n in enumerate(calls):
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0] in stage:
            stage[n] = stage[n.args[0]]  # a tuple element stays with the op that made the tuple
            continue
        b = block[n]
        if b is not None:
            if b < current:
                raise UnsupportedModelError(
                    f"block {container}.{b} runs after block {container}.{current}: megatrain streams "
                    "blocks in the order they are called, and expects each block's ops to be "
                    "contiguous and in index order")
            current = b
            stage[n] = 1 + b
        elif i > last_block_pos >= 0:
            stage[n] = 1 + n_blocks
        else:
            # Before the first block: the prologue. Between blocks: glue code of the parent's loop
            # body, which runs with the block before it.
            stage[n] = 0 if current < 0 else 1 + current
    names = ["prologue"] + [f"{container}.{b}" for b in range(n_blocks)] + ["epilogue"]
    return stage, names


def _signature(gm: fx.GraphModule) -> tuple:
    """Structural identity of a graph: ops, targets, wiring and shapes, not names."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def norm(a):
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, norm(v)) for k, v in a.items())))
        return ("const", repr(a))

    sig = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = _val(n)
            sig.append(("ph", tuple(v.shape) if isinstance(v, torch.Tensor) else None,
                        str(v.dtype) if isinstance(v, torch.Tensor) else repr(v)))
        elif n.op == "get_attr":
            attr = getattr(gm, n.target)
            sig.append(("attr", _signature(attr) if isinstance(attr, fx.GraphModule) else
                        (tuple(attr.shape), str(attr.dtype)) if isinstance(attr, torch.Tensor) else repr(attr)))
        else:
            sig.append((n.op, str(n.target), norm(n.args), norm(n.kwargs)))
    return tuple(sig)


def _grad_kinds(params: Sequence[fx.Node], inputs: Sequence[fx.Node], trainable: dict[str, bool],
                param_of: dict[str, str], needs_grad: set[fx.Node]) -> dict[str, str]:
    """What the executor's local backward differentiates: every parameter view of the flat tile when
    the layer has a trainable parameter (the whole tile requires grad), and the inputs that depend
    on a parameter."""
    kinds = {}
    if any(trainable[param_of[a.name]] for a in params):
        kinds.update((a.name, "keep") for a in params)
    kinds.update((a.name, "boundary") for a in inputs if a in needs_grad and _is_float(_val(a)))
    return kinds


def _flat_bytes(params: Sequence[fx.Node], numel: int, trainable: dict[str, bool], param_of: dict[str, str]) -> int:
    """Bytes of the gradient of a layer's flat tile of ``numel`` elements (none without trainable
    parameters), in the parameters' dtype."""
    if not any(trainable[param_of[a.name]] for a in params):
        return 0
    return numel * max(_val(a).element_size() for a in params)


def _value_bytes(n: fx.Node) -> int:
    """Bytes of ``n``'s value: a tensor's, or the sum over the tensors of a tuple."""
    v = _val(n)
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(x.numel() * x.element_size() for x in v if isinstance(x, torch.Tensor))
    return 0


def _viewable(x: torch.Tensor, shape: Sequence[int]) -> bool:
    """Whether ``x.reshape(shape)`` is a view (no copy), as the strides of ``x`` decide."""
    try:
        torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta").view(shape)
    except RuntimeError:
        return False
    return True


def _allocates(n: fx.Node) -> bool:
    """Whether op ``n`` creates new storage (not a view or alias of an input)."""
    if n.op != "call_function" or n.target is operator.getitem:
        return False
    t = n.target
    x = _val(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    v = _val(n)
    if t in (_aten.to.dtype, _aten.to.dtype_layout) and isinstance(x, torch.Tensor):
        return x.dtype != v.dtype or x.device != v.device or bool(_bind(n).get("copy"))
    if t is _aten.contiguous.default and isinstance(x, torch.Tensor):
        return not x.is_contiguous()
    if t in (_aten.reshape.default, _aten.flatten.using_ints) and isinstance(x, torch.Tensor):
        return not _viewable(x, v.shape)
    if t is _aten._unsafe_view.default:
        return False  # a view its schema does not annotate
    schema = getattr(t, "_schema", None)
    return not (schema is not None and any(r.alias_info is not None for r in schema.returns))


def _allocated_bytes(n: fx.Node) -> int:
    return _value_bytes(n) if _allocates(n) else 0


# Ops whose backward hands the output's gradient to the input as it is or as a view of it.
_GRAD_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.flatten.using_ints,
               _aten.transpose.int, _aten.permute.default, _aten.t.default, _aten.unsqueeze.default,
               _aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default, _aten.alias.default,
               _aten.clone.default, _aten.contiguous.default}


def _passes_gradient(n: fx.Node) -> bool:
    if n.target is operator.getitem or n.target in _GRAD_VIEWS:
        return True
    return n.target in (_aten.to.dtype, _aten.to.dtype_layout) and not _allocates(n)


def _differentiable(gm: fx.GraphModule, grad_kinds: dict[str, str]) -> set[fx.Node]:
    """Nodes whose value requires grad: floating point and computed from a placeholder named in
    ``grad_kinds`` (a grad-disabling higher-order op cuts the chain)."""
    rg = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in grad_kinds}
    for n in gm.graph.nodes:
        if n.op != "call_function" or not any(a in rg for a in n.all_input_nodes):
            continue
        if n.target is torch.ops.higher_order.wrap_with_set_grad_enabled and not n.args[0]:
            continue
        v = _val(n)
        vals = v if isinstance(v, (list, tuple)) else (v,)
        if any(_is_float(x) for x in vals):
            rg.add(n)
    return rg


def _op_memory(gm: fx.GraphModule, n: fx.Node, nbytes, rg: set[fx.Node]) -> tuple[int, int, int, int]:
    """What op ``n`` holds beyond its output: (bytes it allocates with its output and frees in its
    backward, a transient at its forward, bytes held from its forward to its backward, a transient
    at its backward)."""
    t = n.target
    if t is sequence_chunked:
        return (0, *_chunked_memory(gm, n, nbytes, rg))
    if t is linear_cross_entropy:
        # The kernel computes its gradients in the forward and holds them until the backward.
        held = sum(nbytes(a) for a in n.args[:3] if isinstance(a, fx.Node) and a in rg)
        return 0, _linear_cross_entropy_work(n), held, 0
    if t in _ATTENTION:
        q = _val(n.args[0])
        rows = q.numel() // q.shape[-1]
        expanded = 0
        if t is grouped_query_attention:
            # Where it expands K and V to the query heads (FP32 on CUDA), SDPA saves the expanded
            # copies until the backward, which creates their gradients before summing each group.
            k, v = _val(n.args[1]), _val(n.args[2])
            expanded = sum(x.numel() * x.element_size() * (q.shape[-3] // x.shape[-3]) for x in (k, v))
        # The flash and memory-efficient kernels save the FP32 logsumexp of every query row; the
        # FlashAttention-2 backward accumulates dq in FP32 (Dao 2023, arXiv:2307.08691, algorithm 2).
        return rows * 4, 0, expanded, q.numel() * 4 + expanded
    nested = [getattr(gm, a.target) for a in n.all_input_nodes
              if a.op == "get_attr" and isinstance(getattr(gm, a.target, None), fx.GraphModule)]
    if nested:  # a higher-order op: its body's intermediates, while it runs
        return 0, max(_simulate(m, _value_bytes, {})[1] for m in nested), 0, 0
    return 0, 0, 0, 0


def _chunked_memory(gm: fx.GraphModule, n: fx.Node, nbytes, rg: set[fx.Node]) -> tuple[int, int, int]:
    """(forward transient, held, backward transient) of a :func:`sequence_chunked` call.

    Forward: the chunks' outputs, all of which exist just before they are concatenated (the
    concatenation is the node's own value), plus one chunk's intermediates. Backward: one chunk's
    recompute and backward (:func:`_simulate` of the region with every tensor that has the sequence
    scaled to the largest chunk), plus the chunk gradients of each sliced input, which exist whole
    before the split's backward joins them.
    """
    region = getattr(gm, n.args[0].target)
    chunks, in_dims = n.args[1], n.args[2]
    args = list(n.args[4:])
    seq_len = next(_val(a).shape[d] for a, d in zip(args, in_dims) if d is not None)
    largest = chunk_bounds(seq_len, chunks)[0]
    phs = [p for p in region.graph.nodes if p.op == "placeholder"]
    sliced = {p for p, d in zip(phs, in_dims) if d is not None}

    def inner_bytes(m: fx.Node) -> int:
        full = _value_bytes(m)
        return full * largest // seq_len if (m.op == "call_function" or m in sliced) else full

    kinds = {p.name: "keep" for p, a in zip(phs, args) if a in rg}
    inner_peak, inner_fwd = _simulate(region, inner_bytes, kinds)
    pieces = sum(nbytes(a) for a, d in zip(args, in_dims) if d is not None and a in rg)
    return _value_bytes(n) + inner_fwd, 0, inner_peak + pieces


def _simulate(gm: fx.GraphModule, nbytes, grad_kinds: dict[str, str], finalize: int = 0) -> tuple[int, int]:
    """(peak bytes of one forward + backward of ``gm``, peak of the forward alone), as modelled.

    ``nbytes(node)`` gives the bytes of a node's value (and of its gradient); ``grad_kinds`` maps
    the placeholders that require grad to ``"keep"`` (the gradient is this graph's to hold, to the
    end) or ``"boundary"`` (a layer input whose gradient the cost model already counts: only
    contributions beyond its first are transient here). ``finalize`` is added at the end. See
    :func:`_work_bytes` for the model.
    """
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    rg = _differentiable(gm, grad_kinds)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    base: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        src = n.args[0] if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) else None
        base[n] = base.get(src, src) if src is not None and not _allocates(n) else n
    pinned = {base[o] for o in out_node.all_input_nodes}  # the caller holds the outputs to the end
    live = peak = 0
    value: dict[fx.Node, int] = {}
    held: dict[fx.Node, int] = {}
    memory: dict[fx.Node, tuple[int, int, int, int]] = {}
    for n in nodes:
        memory[n] = extra, fwd_transient, keep, _ = _op_memory(gm, n, nbytes, rg)
        value[n] = (nbytes(n) if _allocates(n) else 0) + extra
        live += value[n]
        peak = max(peak, live + fwd_transient)
        held[n] = keep
        live += keep
    fwd_peak = peak
    grads: dict[fx.Node, int] = {o: 0 for o in out_node.all_input_nodes if o in rg}  # seeds: the caller's
    for n in reversed(nodes):
        out_grad = grads.pop(n, None)
        if n in rg and out_grad is not None:
            xs = list(dict.fromkeys(a for a in n.all_input_nodes if a in rg))
            alloc, freed = 0, out_grad
            if _passes_gradient(n):
                for x in xs[:1]:
                    if x.op == "placeholder" and grad_kinds.get(x.name) == "boundary" and x not in grads:
                        grads[x] = 0  # it becomes the layer input's gradient, which the cost model counts
                    elif x not in grads:
                        grads[x], freed = out_grad, 0  # the input's gradient is the output's
                    elif n.target is operator.getitem:
                        grads[x], freed = grads[x] + out_grad, 0  # held apart until the op's backward
            else:
                for x in xs:
                    g = nbytes(x)
                    if x in grads:  # added into the gradient x already has, then freed
                        alloc, freed = alloc + g, freed + g
                    elif x.op == "placeholder" and grad_kinds.get(x.name) == "boundary":
                        grads[x] = 0
                    else:
                        grads[x] = g
                        alloc += g
            live += alloc
            peak = max(peak, live + memory[n][3])
            live -= freed
        if base[n] is n and n not in pinned:
            live -= value[n]
        live -= held[n]
    return max(peak, live + finalize), fwd_peak


def _work_bytes(gm: fx.GraphModule, grad_kinds: dict[str, str], flat_bytes: int = 0) -> int:
    """Peak transient bytes of one local backward of template ``gm``, by a liveness simulation.

    The executor's local backward runs the template with gradients on and calls
    ``torch.autograd.grad`` on its outputs for the flat weight tile and the inputs that require
    grad. The model, over the template's nodes:

    - Forward, in node order: each op's new storage (views and aliases are free) is allocated and
      stays alive, as if autograd saved every intermediate for the backward.
    - Backward, in reverse node order, for each op that requires grad and gets a gradient: a
      gradient the size of each differentiable input is allocated (a view-like op hands its
      output's gradient on instead; a second contribution to a gradient is allocated and freed
      once added in); the output's gradient is freed; the op's own value is freed (its consumers'
      backward steps ran before it), unless it backs a template output, which the caller holds.
    - Op internals: a :func:`~megatrain.kernels.sequence_chunked` call holds, at its forward, its
      chunk outputs before concatenation plus one chunk's intermediates, and at its backward one
      chunk's recompute and backward (the same simulation over its region, sizes scaled to a
      chunk) plus the chunk gradients of its sliced inputs; :func:`linear_cross_entropy` holds
      :func:`~megatrain.kernels.linear_cross_entropy_work_bytes` at its forward and its gradients
      until its backward; attention saves an FP32 logsumexp per query row and its backward an FP32
      dq accumulator; a higher-order op's body its own forward peak.
    - End: the parameter gradients (each accumulated in a buffer of its size) are gathered into
      the flat tile's gradient; each parameter's slice backward allocates a zero-filled tile, so
      ``2 * flat_bytes`` is counted on top of what is still alive then.

    Not counted (accounted elsewhere, as checkpoints, slots and boundary gradients): the layer's
    inputs, weights and buffers, the gradients arriving for its outputs, and the first
    contribution to each input's gradient (``grad_kinds[name] == "boundary"``). Workspace inside
    single aten kernels (matmul, norm) is not modelled: it is small next to the tensors here.
    Since every intermediate is assumed held from its creation to its own backward step, the
    figure bounds a forward under ``no_grad`` too.
    """
    return _simulate(gm, _value_bytes, grad_kinds, 2 * flat_bytes)[0]


def _linear_cross_entropy_work(n: fx.Node) -> int:
    hidden, weight, bias = (_val(a) if isinstance(a, fx.Node) else None for a in n.args[:3])
    return linear_cross_entropy_work_bytes(
        hidden.shape[0], hidden.shape[1], weight.shape[0], n.args[6], dtype=torch.result_type(hidden, weight),
        logits_dtype=n.args[7], bias=bias is not None)


def _is_float(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def _count_flops(gm: fx.GraphModule, args: list[torch.Tensor], grad_args: list[bool]) -> tuple[int, int]:
    """(forward FLOPs, local backward FLOPs = recompute + backward) of one call, on meta."""
    fn = retarget(gm, torch.device("meta"))
    metas = [torch.empty(a.shape, dtype=a.dtype, device="meta") for a in args]
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        fn(*metas)
    fwd = fc.get_total_flops()
    leaves = [m.requires_grad_(g) if g else m for m, g in zip(metas, grad_args)]
    with FlopCounterMode(display=False) as fc, torch.enable_grad():
        outs = [o for o in fn(*leaves) if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [m for m, g in zip(leaves, grad_args) if g]
        if outs and wrt:
            # backward(), not autograd.grad(): FlopCounterMode's module hooks reject the latter.
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return int(fwd), int(fc.get_total_flops())


# -- causal attention without a materialised mask --------------------------------------------------

_CAUSAL_SDPA = "megatrain_causal_sdpa"
"""Name of the attention implementation :func:`_causal_attention` registers with transformers."""

# Batch inputs that can make rows something other than one unpadded causal sequence each.
_MASK_INPUTS = frozenset({"attention_mask", "position_ids"})


def _causal_sdpa_mask(*args, **kwargs):
    """transformers' ``sdpa_mask`` without its refusal to skip the causal mask while exporting.

    ``sdpa_mask`` returns ``None`` (so that SDPA runs with ``is_causal``) when its caller allows it
    (``allow_is_causal_skip``: the plain causal pattern, no extra mask functions) and the mask
    would be plain causal: no padding, queries and keys of one length at offset 0, no sliding
    window or chunk reaching across the sequence. Under export it never does, because the padding
    check would read tensor values. Here there is no padding mask by construction (the batch has
    no ``attention_mask``), so the same decision needs no values. Anything else is delegated.

    The arguments are bound to the installed ``sdpa_mask``'s own signature: early 5.x releases
    (5.0) pass ``cache_position`` where later ones pass ``q_length`` and ``q_offset``; in a
    training forward (no KV cache, no ``position_ids``: the only case this mask function is used
    in) it is ``arange(q_length)``, so the offset is 0.
    """
    from transformers import masking_utils as mu

    bound = inspect.signature(mu.sdpa_mask).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if "q_length" in a:
        q_length, q_offset = a["q_length"], a["q_offset"]
    else:
        q_length, q_offset = a["cache_position"].shape[0], 0
    kv_length, kv_offset, local_size = a["kv_length"], a.get("kv_offset", 0), a.get("local_size")
    if (a.get("allow_is_causal_skip", True) and a.get("attention_mask") is None and isinstance(q_offset, int)
            and isinstance(kv_offset, int) and q_offset == kv_offset == 0 and q_length == kv_length
            and (local_size is None or kv_length < local_size)):
        return None
    if a.get("mask_function") is None:
        a["mask_function"] = mu.causal_mask_function
    return mu.sdpa_mask(*bound.args, **bound.kwargs)


def _no_packed_sequences(position_ids):
    """``find_packed_sequence_indices`` for the default positions: one sequence per row (None)."""
    return None


def _hf_configs(model: nn.Module) -> list:
    """Every transformers config a module of ``model`` holds, sub-configs included, once each."""
    transformers = sys.modules.get("transformers")
    if transformers is None:  # not imported, so no module of the model is a transformers model
        return []
    PretrainedConfig = transformers.PretrainedConfig
    seen: dict[int, Any] = {}

    def visit(cfg) -> None:
        if isinstance(cfg, PretrainedConfig) and id(cfg) not in seen:
            seen[id(cfg)] = cfg
            for key in getattr(cfg, "sub_configs", {}) or {}:
                visit(getattr(cfg, key, None))

    for mod in model.modules():
        visit(getattr(mod, "config", None))
    return list(seen.values())


@contextlib.contextmanager
def _causal_attention(model: nn.Module, input_names: Sequence[str]):
    """Within the block, ``sdpa`` models skip the plain causal mask as they do eagerly; yields whether.

    Applies only when the batch has neither ``attention_mask`` nor ``position_ids``, so every row is
    one unpadded sequence at positions ``0..S-1``. Two of transformers' decisions read tensor
    values, and under export both are answered conservatively; the trace knows the answers:

    - whether the positions pack several sequences into a row (``find_packed_sequence_indices``;
      with the default positions they do not, so it is replaced by one returning None for the
      export), which otherwise forbids the skip for every causal mask;
    - whether the padding mask is all ones (there is none; :func:`_causal_sdpa_mask`).

    The second is a mask function registered through transformers' ``AttentionMaskInterface``
    under :data:`_CAUSAL_SDPA`, beside ``AttentionInterface``'s own ``sdpa`` attention function
    under the same name, so the kernels are unchanged. The ``sdpa`` configs of ``model`` name it
    for the export only. Every change is undone on exit, whatever happens.
    """
    configs = [] if _MASK_INPUTS & set(input_names) else [c for c in _hf_configs(model)
                                                          if getattr(c, "_attn_implementation", None) == "sdpa"]
    if not configs:
        yield False
        return
    from transformers import AttentionInterface
    from transformers import masking_utils as mu

    AttentionInterface.register(_CAUSAL_SDPA, AttentionInterface._global_mapping["sdpa"])
    mu.AttentionMaskInterface.register(_CAUSAL_SDPA, _causal_sdpa_mask)
    packed = getattr(mu, "find_packed_sequence_indices", None)
    try:
        if packed is not None:
            mu.find_packed_sequence_indices = _no_packed_sequences
        for c in configs:
            # A dict sets this config only; the plain setter would recurse into sub-configs.
            c._attn_implementation = {"": _CAUSAL_SDPA}
        yield True
    finally:
        for c in configs:
            c._attn_implementation = {"": "sdpa"}
        if packed is not None:
            mu.find_packed_sequence_indices = packed


# -- chunked LM head + cross-entropy ---------------------------------------------------------------

DEFAULT_LOSS_CHUNK_BYTES = 256 * 2**20
"""Bytes of one chunk of logits in :func:`chunk_lm_head_loss`, counted at 4 bytes a logit: about
2,100 tokens of a 32k vocabulary, 520 of a 128k one. Each chunk's matmul is still thousands of
rows by the full hidden size, large enough to run at full rate on a GPU."""

_CASTS = {_aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default}
_RESHAPES = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
_SAME = {_aten.contiguous.default, _aten.alias.default, _aten.clone.default}
_NLL = {_aten.nll_loss.default, _aten.nll_loss_nd.default, _aten.nll_loss_forward.default}
_LOG_SOFTMAX = {_aten.log_softmax.int, _aten._log_softmax.default}
_REDUCTION_NAMES = {1: "mean", 2: "sum"}  # at::Reduction; "none" (0) is left unfused


def _bind(n: fx.Node) -> dict[str, Any]:
    """The arguments of an aten call by schema name, defaults filled in."""
    out = {}
    for i, a in enumerate(n.target._schema.arguments):
        if i < len(n.args):
            out[a.name] = n.args[i]
        elif a.name in n.kwargs:
            out[a.name] = n.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _only_user(n: fx.Node) -> fx.Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def _find_loss(n: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node], dict] | None:
    """If ``n`` computes a cross-entropy: (its logits input, the node whose value is the loss, the
    nodes to remove, the arguments). Matches ``cross_entropy_loss`` and ``nll_loss(log_softmax)``."""
    if n.op != "call_function":
        return None
    if n.target is _aten.cross_entropy_loss.default:
        args = _bind(n)
        return args["self"], n, [n], args
    if n.target in _NLL:
        args = _bind(n)
        ls = args["self"]
        if not (isinstance(ls, fx.Node) and ls.op == "call_function" and ls.target in _LOG_SOFTMAX
                and _only_user(ls) is n):
            return None
        lsa = _bind(ls)
        x = lsa["self"]
        if lsa["dim"] not in (1, -1) or lsa.get("dtype") is not None or lsa.get("half_to_float"):
            return None
        args.update(label_smoothing=0.0)
        if n.target is _aten.nll_loss_forward.default:
            # (loss, total_weight): only the loss may be read.
            outs = list(n.users)
            if not (len(outs) == 1 and outs[0].target is operator.getitem and outs[0].args[1] == 0):
                return None
            return x, outs[0], [outs[0], n, ls], args
        return x, n, [n, ls], args
    return None


def _replay_on_hidden(g: fx.Graph, chain: list[fx.Node], hidden: fx.Node, vocab: int,
                      features: int) -> tuple[fx.Node | None, list[fx.Node]]:
    """Apply to ``hidden [..., features]`` the row ops ``chain`` applied to the logits ``[..., vocab]``.

    ``chain`` runs from the linear's output to the loss's input; casts and copies are skipped
    (the kernel casts its logits itself), reshapes keep the last dimension and swap its size,
    slices and flattens must not touch the last dimension. Returns the last new node (None for an
    op it cannot move) and the nodes it created.
    """
    cur, made = hidden, []
    for n in chain:
        src = _val(n.args[0])
        last = src.dim() - 1
        if n.target in _CASTS or n.target in _SAME:
            continue
        if n.target in _RESHAPES:
            shape = list(n.args[1])
            if _val(n).shape[-1] != vocab or shape[-1] not in (vocab, -1):
                return None, made
            target, rest = _aten.reshape.default, (shape[:-1] + [features],)
        elif n.target is _aten.slice.Tensor:
            a = _bind(n)
            if a["dim"] % src.dim() == last:
                return None, made
            target, rest = _aten.slice.Tensor, (a["dim"], a["start"], a["end"], a["step"])
        elif n.target is _aten.flatten.using_ints:
            a = _bind(n)
            if last in (a["start_dim"] % src.dim(), a["end_dim"] % src.dim()):
                return None, made
            target, rest = _aten.flatten.using_ints, (a["start_dim"], a["end_dim"])
        else:
            return None, made
        h = _val(cur)
        new = g.call_function(target, (cur, *rest))
        new.meta["val"] = target(torch.empty(h.shape, dtype=h.dtype, device="meta"), *rest)
        made.append(new)
        cur = new
    return cur, made


def chunk_lm_head_loss(gm: fx.GraphModule, chunk_bytes: int = DEFAULT_LOSS_CHUNK_BYTES) -> bool:
    """Fuse ``linear -> (casts, row reshapes) -> cross_entropy`` in ``gm`` into one chunked kernel.

    Finds a cross-entropy (``aten.cross_entropy_loss``, or ``nll_loss`` of ``log_softmax`` over the
    class dimension) with the mean or sum reduction, no class weights and no label smoothing,
    whose ``[tokens, vocab]`` input is a linear layer's output reached only through dtype casts,
    copies, and reshapes, slices or flattens of the leading dimensions (Hugging Face's
    ``logits.float().view(-1, V)``, or a GPT's ``logits[:, :-1].reshape(-1, V)``), each read by
    nothing else. It replaces them with :func:`megatrain.kernels.linear_cross_entropy` over the
    linear's input put through the same row ops, the weight, the bias, the unchanged labels and
    the loss's ``ignore_index`` and reduction. Chunks hold ``chunk_bytes // (vocab * 4)`` tokens
    (at least one). Rewrites ``gm`` in place; returns whether it found the pattern. A graph
    without it (a model whose loss is not a cross-entropy over an LM head) is left unchanged.
    """
    g = gm.graph
    for node in list(g.nodes):
        found = _find_loss(node)
        if found is None:
            continue
        x, loss_node, loss_nodes, args = found
        if (args.get("weight") is not None or args.get("label_smoothing", 0.0) != 0.0
                or args["reduction"] not in _REDUCTION_NAMES or not isinstance(x, fx.Node)
                or not _is_float(_val(x)) or _val(x).dim() != 2):
            continue
        chain, cur = [], x
        while cur.op == "call_function" and cur.target is not _aten.linear.default and len(chain) < 16:
            if len(cur.users) != 1 or not isinstance(cur.args[0], fx.Node):
                break
            chain.append(cur)
            cur = cur.args[0]
        if cur.op != "call_function" or cur.target is not _aten.linear.default or len(cur.users) != 1:
            continue
        la = _bind(cur)
        hidden, weight, bias = la["input"], la["weight"], la.get("bias")
        w = _val(weight)
        if w.dim() != 2 or _val(x).shape[1] != w.shape[0]:
            continue
        vocab, features = w.shape
        logits_dtype = _val(x).dtype
        # The kernel casts its logits once, straight to the loss's dtype, on the linear's device: a
        # chain through a third dtype would round differently, one across devices would move data.
        if any(_val(n).dtype not in (_val(cur).dtype, logits_dtype) or _val(n).device != _val(cur).device
               for n in chain):
            continue
        with g.inserting_before(loss_node):
            rows, made = _replay_on_hidden(g, chain[::-1], hidden, vocab, features)
            if rows is None or tuple(_val(rows).shape) != (_val(x).shape[0], features):
                for n in reversed(made):
                    g.erase_node(n)
                continue
            chunk = max(1, min(_val(x).shape[0], chunk_bytes // (vocab * 4)))
            fused = g.call_function(linear_cross_entropy, (
                rows, weight, bias, args["target"], args["ignore_index"], _REDUCTION_NAMES[args["reduction"]],
                chunk, logits_dtype))
        fused.meta = dict(loss_node.meta)
        fused.meta["val"] = torch.empty((), dtype=logits_dtype, device="meta")
        loss_node.replace_all_uses_with(fused)
        # Users before what they read: the loss, then the chain back to the linear.
        for n in loss_nodes + chain + [cur]:
            g.erase_node(n)
        g.lint()
        gm.recompile()
        return True
    return False


# -- sequence chunking of token-wise regions -------------------------------------------------------

DEFAULT_SEQ_CHUNK_BYTES = 4 * 2**30
"""Intermediate bytes above which :func:`chunk_sequence_regions` chunks a region, and about those
of one chunk (``ceil(intermediates / this)`` chunks).

Larger than the loss chunk (:data:`DEFAULT_LOSS_CHUNK_BYTES`) on purpose: the chunked LM head costs
no extra FLOPs, but a chunked region is recomputed in the backward, one more forward of its
projections and MLP per step (a quarter more compute for a block whose matmuls dominate), and the
trace decides this without knowing the GPU. So only regions too large for any GPU's comfort are
chunked: a Llama-2-7B block's regions hold 0.5, 0.7 GiB of intermediates at 4k tokens per
micro-batch (not chunked; nor is the dense-120b preset's largest, 1.9 GiB at 4k) and 68, 91 GiB at
512k (17 and 23 chunks of 31k and 23k tokens, each still thousands of rows for the matmuls).
With 1 GiB instead, planning dense-120b at 4k tokens for an H200 (``bench/plan_scale.py``)
predicts 44.5% MFU instead of 52.1%."""


class _Mixed:
    """Sequence dimension of a tensor whose positions cannot be told apart (attention scores, a
    slice along the sequence, the output of an op this pass does not know)."""

    def __repr__(self) -> str:
        return "MIXED"


MIXED = _Mixed()

# Ops that map each element on its own (besides those tagged ``pointwise``): casts, copies, aliases
# and the ``*_like`` constructors, whose output has the input's shape.
_ELEMENTWISE = {_aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default, _aten.type_as.default,
                _aten.contiguous.default, _aten.alias.default, _aten.detach.default, _aten.clone.default,
                _aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default,
                _aten.empty_like.default}
# Reductions over the dimensions named by their ``dim`` argument (all of them when it is None).
_REDUCTIONS = {_aten.mean.dim, _aten.sum.dim_IntList, _aten.amax.default, _aten.amin.default,
               _aten.var.correction, _aten.std.correction, _aten.var_mean.correction,
               _aten.logsumexp.default, _aten.linalg_vector_norm.default, _aten.max.dim, _aten.min.dim,
               _aten.argmax.default, _aten.argmin.default}
# Ops that normalise, accumulate or scan along one dimension ``dim``.
_ALONG_DIM = {_aten._softmax.default, _aten._log_softmax.default, _aten.softmax.int, _aten.log_softmax.int,
              _aten.cumsum.default, _aten.cumprod.default, _aten.logcumsumexp.default}
_NORMS = {_aten.layer_norm.default, _aten.native_layer_norm.default, _aten.rms_norm.default}
_SPLITS = {_aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default}
# Ops whose size argument names the sequence length: rewritten to -1 there inside a region.
_SIZED = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.expand.default}
# Both take (query, key, value, attn_mask, dropout_p, is_causal, scale) first.
_ATTENTION = {_aten.scaled_dot_product_attention.default, grouped_query_attention}


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _reshaped_seq_dim(src: Sequence[int], d: int, dst: Sequence[int], seq_len: int):
    """Where dimension ``d`` of a row-major ``src``-shaped tensor lands in a reshape to ``dst``: the
    dimension ``j`` with ``dst[j] == seq_len`` and the same number of elements before it, or MIXED
    (the sequence dimension is merged with or split into others)."""
    before, acc = _prod(src[:d]), 1
    for j, size in enumerate(dst):
        if acc == before and size == seq_len:
            return j
        acc *= size
    return MIXED


def _seq_rule(n: fx.Node, sd: dict[fx.Node, Any], tokenwise: set[fx.Node], seq_len: int) -> tuple[Any, bool]:
    """(Sequence dimension of ``n``'s value, whether ``n`` is token-wise), given its inputs'."""
    v = _val(n)
    ins = n.all_input_nodes
    dims = [sd.get(a, MIXED) for a in ins]
    if n.target is operator.getitem:
        src, i = n.args[0], n.args[1]
        d = sd.get(src, MIXED)
        return (d[i], src in tokenwise) if isinstance(d, tuple) else (d if d is None else MIXED, False)
    if any(d is MIXED or isinstance(d, tuple) for d in dims):
        return MIXED, False
    if all(d is None for d in dims):
        return None, False  # computed without the sequence: whole in every chunk
    t = n.target
    if t in _ATTENTION:
        q = n.args[0]
        nd = _val(q).dim()
        return (nd - 2, False) if sd.get(q) == nd - 2 else (MIXED, False)
    if not isinstance(t, torch._ops.OpOverload) or not isinstance(v, (torch.Tensor, list, tuple)):
        return MIXED, False
    if torch.Tag.pointwise in t.tags or t in _ELEMENTWISE:
        nd = v.dim()
        aligned = {d + nd - _val(a).dim() for a, d in zip(ins, dims) if d is not None}
        if len(aligned) != 1:
            return MIXED, False
        od = aligned.pop()
        # An input without the sequence broadcasts over it only where its size there is 1 (a
        # learned position table of size S added to the stream is not sliced with the chunk).
        whole = True
        for a, d in zip(ins, dims):
            if d is None:
                av = _val(a)
                k = av.dim() - (nd - od) if isinstance(av, torch.Tensor) else -1
                whole = whole and (k < 0 or av.shape[k] == 1)
        return od, whole
    a = _bind(n)
    if t is _aten.embedding.default:
        return sd.get(a["indices"], MIXED), False  # a gather from the table: its gradient is table-sized
    # From here on the first input (``self``/``input``) carries the sequence; for all but cat and
    # stack every other tensor input (weights, biases) must be without it.
    x = ins[0]
    d = sd.get(x)
    joins = t in (_aten.cat.default, _aten.stack.default)
    if not isinstance(d, int) or (not joins and any(sd.get(o) is not None for o in ins[1:])):
        return MIXED, False
    xv = _val(x)
    nd = xv.dim()
    if t is _aten.linear.default or t in (_aten.matmul.default, _aten.mm.default):
        w = _val(ins[1])
        ok = d != nd - 1 and (t is _aten.linear.default or w.dim() <= 2)
        return (d, True) if ok else (MIXED, False)
    if t in _NORMS:
        k = len(a["normalized_shape"])
        if d >= nd - k:
            return MIXED, False
        return ((d,) * 3 if t is _aten.native_layer_norm.default else d), True
    if t in _REDUCTIONS:
        red = a.get("dim")
        if red is None or (isinstance(red, (list, tuple)) and not red):
            return None, False  # reduced over the whole sequence: the same value for every chunk
        red = [r % nd for r in ([red] if isinstance(red, int) else red)]
        if d in red:
            return None, False
        od = d if a.get("keepdim", False) else d - sum(r < d for r in red)
        return ((od,) * len(v) if isinstance(v, (list, tuple)) else od), True
    if t in _ALONG_DIM:
        # Along the sequence (a softmax over keys, a cumulative sum) each output position reads
        # others, but it is still the same position: later token-wise ops may slice it.
        return d, a["dim"] % nd != d
    if t in (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.flatten.using_ints):
        return _reshaped_seq_dim(xv.shape, d, v.shape, seq_len), True
    if t is _aten.transpose.int:
        d0, d1 = a["dim0"] % nd, a["dim1"] % nd
        return (d1 if d == d0 else d0 if d == d1 else d), True
    if t is _aten.permute.default:
        return [p % nd for p in a["dims"]].index(d), True
    if t is _aten.t.default:
        return (nd - 1 - d if nd == 2 else d), True
    if t is _aten.unsqueeze.default:
        k = a["dim"] % (nd + 1)
        return (d + 1 if k <= d else d), True
    if t in (_aten.squeeze.dim, _aten.squeeze.dims, _aten.squeeze.default):
        named = a.get("dim", None) if t is not _aten.squeeze.default else None
        cand = range(nd) if named is None else [r % nd for r in ([named] if isinstance(named, int) else named)]
        gone = [r for r in cand if xv.shape[r] == 1]
        return (MIXED, False) if d in gone else (d - sum(r < d for r in gone), True)
    if t is _aten.expand.default:
        return d + v.dim() - nd, True
    if t is _aten.slice.Tensor:
        k = a["dim"] % nd
        if k != d:
            return d, True
        whole = a["start"] in (None, 0) and (a["end"] is None or a["end"] >= seq_len) and a["step"] == 1
        return (d, True) if whole else (MIXED, False)
    if t is _aten.narrow.default:
        return (d, True) if a["dim"] % nd != d else (MIXED, False)
    if t is _aten.select.int:
        k = a["dim"] % nd
        return (d - (k < d), True) if k != d else (MIXED, False)
    if t in _SPLITS or t is _aten.unbind.int:
        k = a["dim"] % nd
        if k == d:
            return MIXED, False
        od = d - (k < d) if t is _aten.unbind.int else d
        return (od,) * len(v), True
    if t in (_aten.cat.default, _aten.stack.default):
        out_nd = v.dim()
        k = a["dim"] % out_nd
        if any(sd.get(o) != d for o in ins):
            # A tensor without the sequence joined to ones with it would need slicing too.
            return MIXED, False
        if t is _aten.cat.default:
            return (d, True) if k != d else (MIXED, False)
        return d + (k <= d), True
    return MIXED, False


def sequence_dims(gm: fx.GraphModule, *, batch: int, seq_len: int,
                  activations: Collection[str]) -> tuple[dict[fx.Node, Any], set[fx.Node]]:
    """The sequence dimension of every value of template ``gm`` and its token-wise nodes.

    A placeholder named in ``activations`` (a layer input, not a parameter or buffer) has its
    sequence dimension at index 1 when its shape starts ``(batch or 1, seq_len)`` (the residual
    stream ``(B, S, D)``, rotary tables ``(1, S, D)``), and none otherwise, unless ``seq_len`` is
    one of its sizes (a ``(B, 1, S, S)`` mask: MIXED). Parameters, buffers and constants have none.
    From there each op's rule (:func:`_seq_rule`) carries the dimension through: elementwise ops
    with broadcasting, reductions and norms over other dimensions, linear layers, reshapes that
    keep the sequence dimension whole, transposes, permutes, (un)squeezes, slices, splits and
    concatenations along other dimensions. A value's entry is an int, None (no sequence dimension:
    computed without the sequence, or reduced over all of it, so the same for every chunk) or
    MIXED; a tuple of those for an op returning several. Token-wise nodes compute output positions
    ``[a, b)`` from input positions ``[a, b)`` alone; attention and anything mixing positions is
    not, though its output may still have a known sequence dimension (SDPA's is its query's, a
    cumulative sum's its input's).
    """
    sd: dict[fx.Node, Any] = {}
    tokenwise: set[fx.Node] = set()
    for n in gm.graph.nodes:
        v = _val(n)
        if n.op == "placeholder":
            if n.name in activations and isinstance(v, torch.Tensor) and seq_len > 1:
                lead = tuple(v.shape[:2])
                sd[n] = 1 if lead in ((batch, seq_len), (1, seq_len)) else (MIXED if seq_len in v.shape else None)
            else:
                sd[n] = None
        elif n.op == "get_attr":
            sd[n] = None
        elif n.op == "call_function":
            d, tw = _seq_rule(n, sd, tokenwise, seq_len)
            vals = v if isinstance(d, tuple) else (v,)
            dd = d if isinstance(d, tuple) else (d,)
            if len(vals) != len(dd) or any(
                    isinstance(k, int) and not (isinstance(x, torch.Tensor) and 0 <= k < x.dim()
                                                and x.shape[k] == seq_len) for k, x in zip(dd, vals)):
                d, tw = MIXED, False  # a rule's claim the shapes do not bear out: do not trust it
            tw = tw and all(isinstance(k, int) for k in dd)  # a chunk is a slice of every output
            sd[n] = d
            if tw:
                tokenwise.add(n)
    return sd, tokenwise


def _find_regions(gm: fx.GraphModule, tokenwise: set[fx.Node]) -> list[list[fx.Node]]:
    """Maximal connected sets of token-wise nodes, each of which can become one call.

    Regions grow in graph order: a token-wise node joins the regions of its token-wise inputs,
    merging them, unless that would put a node outside the region on a path from the region back
    into it (a region feeding attention whose output feeds the region again would become a call
    that needs its own output). Then it tries each of those regions alone, largest first, and
    else starts a region of its own. ``deps[n]`` is the set of regions ``n`` depends on.
    """
    parent: dict[fx.Node, fx.Node] = {}

    def find(r: fx.Node) -> fx.Node:
        while parent[r] is not r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    members: dict[fx.Node, list[fx.Node]] = {}
    outside: dict[fx.Node, set[fx.Node]] = {}  # region -> inputs its members read from outside it
    region_of: dict[fx.Node, fx.Node] = {}
    deps: dict[fx.Node, set[fx.Node]] = {}

    def roots(s: set[fx.Node]) -> set[fx.Node]:
        return {find(r) for r in s}

    def convex(group: set[fx.Node], n: fx.Node) -> bool:
        inside = set().union(*(members[r] for r in group)) | {n}
        reads = set().union(*(outside[r] for r in group)) | set(n.all_input_nodes)
        return not any(roots(deps.get(z, set())) & group for z in reads - inside)

    for n in gm.graph.nodes:
        dep = set()
        for a in n.all_input_nodes:
            dep |= deps.get(a, set())
        if n in tokenwise:
            cands = {find(region_of[a]) for a in n.all_input_nodes if a in region_of}
            trials = [cands] + [{c} for c in sorted(cands, key=lambda r: -len(members[r]))] if cands else []
            group = next((g for g in trials if convex(g, n)), None)
            if group is None:
                parent[n] = n
                members[n], outside[n] = [n], set(n.all_input_nodes)
                r = n
            else:
                r, *rest = sorted(group, key=lambda x: -len(members[x]))
                for q in rest:
                    parent[q] = r
                    members[r] += members.pop(q)
                    outside[r] |= outside.pop(q)
                members[r].append(n)
                outside[r] |= set(n.all_input_nodes)
                outside[r] -= set(members[r])
            region_of[n] = r
            dep.add(r)
        deps[n] = dep
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [sorted(m, key=order.__getitem__) for m in members.values()]


def _region_plan(gm: fx.GraphModule, region: list[fx.Node], sd: dict[fx.Node, Any]):
    """(members, external inputs in first-use order, outputs, intermediate bytes) of a region, or
    None when an output is not a single tensor (it could not be concatenated).

    Views and aliases of the region's inputs, and views the region would only return, leave it
    first: they cost nothing outside, while an output of the region is a new tensor (the chunks'
    concatenation), which for an alias of the residual stream (an FP32 model's no-op
    ``.to(float32)``) would be a copy of it.
    """
    inside = set(region)
    peeled = True
    while peeled:
        peeled = False
        for m in list(region):
            if _allocates(m) or m.target is operator.getitem:
                continue
            if not inside & set(m.all_input_nodes) or not inside & set(m.users):
                region.remove(m)
                inside.discard(m)
                peeled = True
    if not region:
        return None
    inputs: list[fx.Node] = []
    for m in region:
        for a in m.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [m for m in region if any(u not in inside for u in m.users)]
    if any(not isinstance(_val(o), torch.Tensor) or not isinstance(sd[o], int) for o in outputs):
        return None
    work = sum(_allocated_bytes(m) for m in region if m not in outputs)
    return region, inputs, outputs, work


def _extract_region(gm: fx.GraphModule, region: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
                    sd: dict[fx.Node, Any]) -> fx.GraphModule:
    """The region as a GraphModule ``(*inputs) -> tuple(outputs)`` whose size arguments leave the
    sequence length free (-1), so one module runs every chunk."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, a in enumerate(inputs):
        env[a] = g.placeholder(f"in_{k}")
        env[a].meta = dict(a.meta)
    for m in region:
        new = g.node_copy(m, lambda x: env[x])
        if m.target in _SIZED:
            size = list(_val(m).shape)
            size[sd[m]] = -1
            new.args = (new.args[0], size, *new.args[2:])
        env[m] = new
    g.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(torch.nn.Module(), g)


def chunk_sequence_regions(gm: fx.GraphModule, *, batch: int, seq_len: int, activations: Collection[str],
                           chunk_bytes: int = DEFAULT_SEQ_CHUNK_BYTES) -> int:
    """Run each large token-wise region of template ``gm`` a chunk of the sequence at a time.

    The method of Mini-Sequence Transformer (Luo et al. 2024, arXiv:2407.15892): a block's norms,
    projections, rotary embeddings and MLP treat every position on its own, so they can run on
    slices of the sequence, and with each slice checkpointed a local backward holds one slice's
    intermediates at a time. :func:`sequence_dims` finds the token-wise nodes and
    :func:`_find_regions` groups them into maximal regions that attention (or any op mixing
    positions) separates; for a Llama block that is (a) the input RMSNorm, the q/k/v projections
    and the rotary embedding, up to attention's inputs, and (b) from attention's output the o
    projection, the residual add, the second RMSNorm, the MLP and the second residual add.

    A region whose intermediates (the non-view tensors its nodes create, less its outputs) exceed
    ``chunk_bytes`` is replaced by one call of :func:`megatrain.kernels.sequence_chunked` over a
    nested GraphModule (a submodule ``seq_chunk_<k>`` of ``gm``, read by a ``get_attr`` node),
    with ``min(seq_len, ceil(intermediates / chunk_bytes))`` chunks. Inputs with a sequence
    dimension are sliced along it; parameters, buffers and values computed without the sequence
    are passed whole. ``activations`` names the placeholders that are layer inputs (only they can
    carry the sequence). Rewrites ``gm`` in place; returns the number of regions rewritten (0
    leaves ``gm`` as it was).
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_sequence_regions: chunk_bytes must be >= 1, got {chunk_bytes}")
    sd, tokenwise = sequence_dims(gm, batch=batch, seq_len=seq_len, activations=activations)
    g = gm.graph
    done = 0
    for region in _find_regions(gm, tokenwise):
        plan = _region_plan(gm, region, sd)
        if plan is None:
            continue
        region, inputs, outputs, work = plan
        chunks = min(seq_len, -(-work // chunk_bytes))
        if chunks < 2:
            continue
        sub = _extract_region(gm, region, inputs, outputs, sd)
        name = f"seq_chunk_{done}"
        while hasattr(gm, name):
            name += "_"
        gm.add_submodule(name, sub)
        in_dims = tuple(sd[a] if isinstance(sd[a], int) else None for a in inputs)
        out_dims = tuple(sd[o] for o in outputs)
        inside = set(region)
        # Nodes between the region's first and last node that read its outputs, directly or not,
        # move after the call (none of them feeds the region, or the region would not be convex).
        moved: list[fx.Node] = []
        node = region[0].next
        while node is not region[-1]:
            if node not in inside and any(a in inside or a in moved for a in node.all_input_nodes):
                moved.append(node)
            node = node.next
        with g.inserting_after(region[-1]):
            attr = g.get_attr(name)
        with g.inserting_after(attr):
            call = g.call_function(sequence_chunked, (attr, chunks, in_dims, out_dims, *inputs))
        call.meta["val"] = tuple(_val(o) for o in outputs)
        prev = call
        for k, o in enumerate(outputs):
            with g.inserting_after(prev):
                item = g.call_function(operator.getitem, (call, k))
            item.meta = dict(o.meta)
            sd[item] = sd[o]  # a later region may read it
            o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
            prev = item
        for m in moved:
            prev.append(m)
            prev = m
        for m in reversed(region):
            g.erase_node(m)
        done += 1
    if done:
        g.lint()
        gm.recompile()
    return done


# -- export clean-up -------------------------------------------------------------------------------

def _graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and every graph nested in it (the bodies of higher-order ops such as
    ``wrap_with_set_grad_enabled``, which export makes of a ``torch.no_grad`` region)."""
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def _nested_calls(gm: fx.GraphModule, n: fx.Node) -> list[tuple[fx.GraphModule, tuple]]:
    """(body, operands) of each graph a higher-order op ``n`` calls: the arguments after the body."""
    out = []
    for i, a in enumerate(n.args):
        if isinstance(a, fx.Node) and a.op == "get_attr" and isinstance(getattr(gm, a.target, None), fx.GraphModule):
            out.append((getattr(gm, a.target), tuple(n.args[i + 1:])))
    return out


def erase_metadata_asserts(gm: fx.GraphModule) -> int:
    """Drop the ``aten._assert_tensor_metadata`` checks export inserts, in ``gm`` and every nested graph.

    They assert the dtype and device each ``.to()`` saw at trace time: they would pin a template
    to the trace device, and under autocast (BF16 compute) they fail where an input's dtype
    legitimately differs from the FP32 trace. Returns how many were erased; recompiles what changed.
    """
    erased = 0
    for m in _graph_modules(gm):
        dead = [n for n in m.graph.nodes if n.op == "call_function" and n.target in _ASSERT_OPS]
        for n in dead:
            m.graph.erase_node(n)
        if dead:
            m.graph.eliminate_dead_code()
            m.recompile()
        erased += len(dead)
    return erased


# Ops autocast runs in its low-precision dtype (torch/csrc/autograd/autocast_mode.cpp, the
# ``lower_precision_fp`` lists of CUDA and CPU) that can appear in position arithmetic.
_AUTOCAST_LOW = {_aten.mm, _aten.bmm, _aten.matmul, _aten.addmm, _aten.baddbmm, _aten.addbmm, _aten.addmv,
                 _aten.addr, _aten.mv, _aten.linear, _aten.einsum, _aten.chain_matmul, _aten.linalg_multi_dot,
                 _aten.linalg_vecdot, _aten.dot, _aten.vdot}


def keep_position_math_fp32(gm: fx.GraphModule, learned: Collection[str]) -> int:
    """Run every matmul-like op that reads no learned value with autocast off, in ``gm`` and its nested graphs.

    Position and angle arithmetic (rotary ``inv_freq @ position_ids``, ALiBi slopes) is computed
    from buffers, constants, integer inputs and ``arange`` alone. Models compute it in FP32 and
    switch autocast off around it (transformers' rotary embeddings: ``maybe_autocast(...,
    enabled=False)``), because in BF16 the angle at position ``p`` is off by up to ``p * 2**-8``
    rad. Export traces in FP32 without autocast, so that region is a no-op and leaves nothing in
    the graph; the executor then runs the template under autocast for BF16 compute, and the
    matmul would run in BF16. Each such op, one whose inputs depend on no placeholder named in
    ``learned`` (parameters and floating-point batch inputs: where learned or data values enter),
    becomes a call of :func:`megatrain.kernels.without_autocast`, so it computes in its inputs'
    dtype under any autocast; in FP32 nothing changes. Other position ops (cos, sin, cat, mul) are
    not recast by autocast. Dependence follows values into the bodies of higher-order ops.
    Rewrites in place; returns how many ops were wrapped.
    """
    return _pin_fp32(gm, {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in learned})


def _pin_fp32(gm: fx.GraphModule, tainted: set[fx.Node]) -> int:
    tainted = set(tainted)
    nested: dict[int, tuple[fx.GraphModule, set[fx.Node]]] = {}
    wrap = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if any(a in tainted for a in n.all_input_nodes):
            tainted.add(n)
        for body, operands in _nested_calls(gm, n):
            phs = [p for p in body.graph.nodes if p.op == "placeholder"]
            # wrap_with_set_grad_enabled and wrap_with_autocast pass their operands to the body's
            # placeholders in order; for any other layout every placeholder is tainted if the call is.
            inner = ({p for p, a in zip(phs, operands) if a in tainted} if len(phs) == len(operands)
                     else set(phs) if n in tainted else set())
            nested.setdefault(id(body), (body, set()))[1].update(inner)  # a body called twice: either's taint
        packet = getattr(n.target, "overloadpacket", None)
        if n not in tainted and packet in _AUTOCAST_LOW:
            wrap.append(n)
    for n in wrap:
        n.args = (n.target, *n.args)
        n.target = without_autocast
    if wrap:
        gm.recompile()
    return len(wrap) + sum(_pin_fp32(body, inner) for body, inner in nested.values())


def install_grouped_query_attention(gm: fx.GraphModule) -> int:
    """Route grouped-query attention (GQA) through :func:`megatrain.kernels.grouped_query_attention`, in ``gm`` and its nested graphs.

    Transformers calls ``scaled_dot_product_attention(..., enable_gqa=True)`` where no mask is
    passed (megatrain's causal trace). On CUDA in FP32 no fused kernel takes ``enable_gqa`` and
    SDPA silently runs the math kernel, whose ``[B, H, S, S]`` scores the memory model does not
    count; the kernel expands K and V to the query heads exactly there (decided when it runs, on
    the dtype autocast gives it) and is SDPA itself everywhere else, so CPU runs and BF16 flash
    runs are unchanged. :func:`_work_bytes` counts the expanded K and V and their gradients in
    every case (the planner does not know the device's choice). Rewrites in place; returns how
    many attention calls changed.
    """
    done = 0
    for m in _graph_modules(gm):
        changed = False
        for n in m.graph.nodes:
            if n.op != "call_function" or n.target is not _aten.scaled_dot_product_attention.default:
                continue
            a = _bind(n)
            if not a.get("enable_gqa") or _val(a["query"]).shape[-3] == _val(a["key"]).shape[-3]:
                continue
            n.target = grouped_query_attention
            n.args = (a["query"], a["key"], a["value"], a.get("attn_mask"), a.get("dropout_p", 0.0),
                      a.get("is_causal", False), a.get("scale"))
            n.kwargs = {}
            changed = True
            done += 1
        if changed:
            m.graph.lint()
            m.recompile()
    return done


# -- tracing ---------------------------------------------------------------------------------------

def trace(model: nn.Module, *, micro_batch_size: int, seq_len: int,
          input_names: Sequence[str] = ("input_ids", "labels"), replicate_blocks: bool = True,
          loss_chunk_bytes: int | None = DEFAULT_LOSS_CHUNK_BYTES,
          seq_chunk_bytes: int | None = DEFAULT_SEQ_CHUNK_BYTES) -> TracedModel:
    """Trace ``model`` into a LayerGraph for micro-batches of ``[micro_batch_size, seq_len]``.

    ``model(**{name: LongTensor[micro_batch_size, seq_len] for name in input_names})`` must return
    its scalar loss (a tensor, an object with ``.loss`` or a tuple whose first element is the loss).
    The model may live on the ``meta`` device; no parameter memory is touched either way, and the
    model is not modified.

    ``replicate_blocks``: trace three blocks and repeat them when every block is the same (see
    the module docstring); the graph equals the full trace's. ``loss_chunk_bytes``: the bytes of
    one chunk of logits for :func:`chunk_lm_head_loss`, or None to keep the LM head and loss as
    the model wrote them. ``seq_chunk_bytes``: for :func:`chunk_sequence_regions`, the intermediate
    bytes above which a token-wise region of a layer runs in chunks of the sequence, and about the
    bytes of one chunk's intermediates; None runs every region whole.

    Raises:
        TraceError: export failed (names the module that was running and the failing op).
        UnsupportedModelError: no trainable parameters, tied parameters used by two layers, or
            blocks called out of order.
    """
    if micro_batch_size < 1 or seq_len < 1:
        raise TraceError(f"micro_batch_size ({micro_batch_size}) and seq_len ({seq_len}) must be >= 1")
    if loss_chunk_bytes is not None and loss_chunk_bytes < 1:
        raise TraceError(f"loss_chunk_bytes ({loss_chunk_bytes}) must be >= 1, or None to keep the unchunked loss")
    if seq_chunk_bytes is not None and seq_chunk_bytes < 1:
        raise TraceError(f"seq_chunk_bytes ({seq_chunk_bytes}) must be >= 1, or None to run token-wise regions "
                         "over the whole sequence")
    _model_device(model)
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no trainable parameters (all have requires_grad=False): "
            "there is nothing to train")
    container = _find_block_container(model)
    options = dict(micro_batch_size=micro_batch_size, seq_len=seq_len, input_names=tuple(input_names),
                   loss_chunk_bytes=loss_chunk_bytes, seq_chunk_bytes=seq_chunk_bytes)
    with _causal_attention(model, input_names) as mask_free:
        why = _why_not_replicate(model, container) if replicate_blocks else "replicate_blocks=False"
        traced = None
        if why is None:
            picks = _picks(len(model.get_submodule(container)))
            try:
                short = _trace_graph(_short_copy(model, container, picks), container, **options)
            except TraceError as e:
                # The full trace either succeeds or raises this error with the real block names.
                why = f"the three-block copy did not trace ({type(e).__name__})"
            else:
                traced = _replicate(short, model, container, picks)
                if isinstance(traced, str):
                    why, traced = traced, None
        if traced is None:
            traced = _trace_graph(model, container, **options)
    traced.graph.meta.update(trace="full" if why else "replicated", skip_causal_mask=mask_free)
    if why:
        traced.graph.meta["trace_full_because"] = why
    _check_covers_params(model, traced.graph)
    return traced


def _local_names(nodes: Sequence[fx.Node]) -> dict[fx.Node, str]:
    """Node names renumbered within one layer: ``add_14`` is ``add_5`` when it is the layer's sixth
    ``add``. fx numbers names across the whole graph, so a block's names would depend on its depth."""
    seen: dict[str, int] = {}
    out = {}
    for n in nodes:
        base = re.sub(r"_\d+$", "", n.name)
        k = seen.get(base, 0)
        seen[base] = k + 1
        out[n] = base if k == 0 else f"{base}_{k}"
    return out


def _trace_graph(model: nn.Module, container: str | None, *, micro_batch_size: int, seq_len: int,
                 input_names: tuple[str, ...], loss_chunk_bytes: int | None,
                 seq_chunk_bytes: int | None) -> TracedModel:
    """Export ``model`` and cut it into layers at the children of ``container``."""
    device = _model_device(model)
    example = tuple(torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device=device)
                    for _ in input_names)
    ep = _export(model, input_names, example)
    gm = ep.graph_module
    sig = ep.graph_signature
    param_of = {k: _strip(v) for k, v in sig.inputs_to_parameters.items()}
    user_inputs = [s for s in sig.user_inputs]
    # Export clean-up, over the nested graphs of higher-order ops as well as the top-level one.
    erase_metadata_asserts(gm)
    for sub in _graph_modules(gm):
        _check_no_randomness(sub)
    keep_position_math_fp32(gm, learned=set(param_of) | {ph for ph, x in zip(user_inputs, example) if _is_float(x)})
    install_grouped_query_attention(gm)

    buffer_of = {k: _strip(v) for k, v in sig.inputs_to_buffers.items()}
    const_of = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}

    n_blocks = len(model.get_submodule(container)) if container is not None else 0
    stage, stage_names = _assign_stages(gm, container, n_blocks)
    n_stages = len(stage_names)
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}

    # Which stage reads each node (get_attr nodes are copied into every stage that reads them).
    readers: dict[fx.Node, set[int]] = {n: set() for n in gm.graph.nodes}
    for n, s in stage.items():
        for a in n.all_input_nodes:
            readers[a].add(s)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss_node = out_node.args[0][0] if isinstance(out_node.args[0], (tuple, list)) else out_node.args[0]
    if loss_node not in stage:
        raise UnsupportedModelError("the loss does not depend on any computation of the model")

    for ph_name, fqn in param_of.items():
        used = sorted(readers[placeholders[ph_name]])
        if len(used) > 1:
            raise UnsupportedModelError(
                f"parameter {fqn!r} is used by layers {[stage_names[s] for s in used]} (tied "
                "weights); megatrain streams each parameter with one layer and does not support tied "
                "parameters yet: untie them (for Hugging Face models, tie_word_embeddings=False)")

    # Drop stages with no ops (a model with no prologue, say) and renumber.
    live = sorted(set(stage.values()))
    renum = {s: i for i, s in enumerate(live)}
    stage = {n: renum[s] for n, s in stage.items()}
    names = [stage_names[s] for s in live]
    readers = {n: {renum[s] for s in ss} for n, ss in readers.items()}
    if stage[loss_node] != len(live) - 1:
        raise UnsupportedModelError(
            f"the loss is computed in layer {names[stage[loss_node]]!r}, but later layers compute "
            "more; megatrain needs the loss to be the model's last computation")

    stage_nodes: list[list[fx.Node]] = [[] for _ in names]
    for n in gm.graph.nodes:
        if n in stage:
            stage_nodes[stage[n]].append(n)
    local = {n: name for nodes in stage_nodes for n, name in _local_names(nodes).items()}

    # Values: batch inputs, then every node read by a later stage, in graph order.
    values: list[dict] = []
    value_of: dict[fx.Node, int] = {}
    for ph, input_name in zip(user_inputs, input_names):
        node = placeholders[ph]
        value_of[node] = len(values)
        values.append(dict(node=node, name=input_name, producer=BATCH_PRODUCER))
    for n in gm.graph.nodes:
        if n in stage and (any(r > stage[n] for r in readers[n]) or n is loss_node):
            v = _val(n)
            if not isinstance(v, torch.Tensor):
                raise UnsupportedModelError(
                    f"layer {names[stage[n]]!r} passes a non-tensor value ({type(v).__name__}, node "
                    f"{n.name}) to a later layer; only tensors can cross a layer boundary")
            value_of[n] = len(values)
            values.append(dict(node=n, name=f"{names[stage[n]]}:{local[n]}", producer=stage[n]))

    # Does a value depend on a parameter? Propagate from parameter placeholders.
    needs_grad: set[fx.Node] = {placeholders[p] for p in param_of}
    for n in gm.graph.nodes:
        if n.op == "call_function" and any(a in needs_grad for a in n.all_input_nodes):
            needs_grad.add(n)

    buffer_sources: dict[str, tuple[str, Any]] = {}
    for ph_name, fqn in buffer_of.items():
        buffer_sources[fqn] = ("buffer", fqn)
    for ph_name, fqn in const_of.items():
        buffer_sources[_strip(fqn)] = ("constant", ep.constants[fqn])

    templates: list[fx.GraphModule] = []
    template_sigs: list[tuple] = []
    layers: list[Layer] = []
    for s, nodes in enumerate(stage_nodes):
        params, buffers, inputs = [], [], []
        in_stage = set(nodes)
        for n in nodes:
            for a in n.all_input_nodes:
                if a in in_stage or a.op == "get_attr":
                    continue
                if a.op == "placeholder" and a.name in param_of:
                    bucket = params
                elif a.op == "placeholder" and (a.name in buffer_of or a.name in const_of):
                    bucket = buffers
                else:
                    bucket = inputs
                if a not in bucket:
                    bucket.append(a)
        # Trainable parameters first: the optimizer updates one contiguous prefix of the tile.
        params.sort(key=lambda a: not trainable[param_of[a.name]])
        outputs = [n for n in nodes if n in value_of]

        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in params + buffers + inputs:
            env[a] = g.placeholder(a.name)
            env[a].meta = dict(a.meta)

        def lookup(x: fx.Node) -> fx.Node:
            if x not in env and x.op == "get_attr":
                env[x] = g.node_copy(x)
            return env[x]

        for n in nodes:
            env[n] = g.node_copy(n, lookup)
        g.output(tuple(env[o] for o in outputs))
        sub = fx.GraphModule(gm, g)
        if loss_chunk_bytes is not None and loss_node in in_stage:
            chunk_lm_head_loss(sub, loss_chunk_bytes)
        if seq_chunk_bytes is not None:
            # After the loss pass: its pattern starts at the LM head's linear, which is token-wise.
            chunk_sequence_regions(sub, batch=micro_batch_size, seq_len=seq_len,
                                   activations={a.name for a in inputs}, chunk_bytes=seq_chunk_bytes)

        layer_sig = _signature(sub)
        if layer_sig in template_sigs:
            tid = template_sigs.index(layer_sig)
        else:
            tid = len(templates)
            templates.append(sub)
            template_sigs.append(layer_sig)

        specs, offset = [], 0
        for a in params:
            fqn = param_of[a.name]
            specs.append(ParamSpec(fqn, tuple(_val(a).shape), offset, trainable[fqn]))
            offset = align_up(offset + specs[-1].numel)
        n_train = [p for p in specs if p.trainable]
        trainable_numel = align_up(n_train[-1].offset + n_train[-1].numel) if n_train else 0
        buffer_names = []
        for a in buffers:
            buffer_names.append(buffer_of.get(a.name) or _strip(const_of[a.name]))
        layers.append(dict(
            index=s, name=names[s], template=tid, params=tuple(specs), numel=offset,
            trainable_numel=trainable_numel, inputs=tuple(value_of[a] for a in inputs),
            outputs=tuple(value_of[o] for o in outputs), buffers=tuple(buffer_names),
            buffer_bytes=sum(_val(a).numel() * _val(a).element_size() for a in buffers),
            work_bytes=_work_bytes(sub, _grad_kinds(params, inputs, trainable, param_of, needs_grad),
                                   flat_bytes=_flat_bytes(params, offset, trainable, param_of)),
            arg_vals=[_val(a) for a in params + buffers + inputs],
            grad_args=[trainable[param_of[a.name]] for a in params] + [False] * len(buffers)
            + [a in needs_grad and _is_float(_val(a)) for a in inputs]))

    flops: dict[int, tuple[int, int]] = {}
    for L in layers:
        if L["template"] not in flops:
            flops[L["template"]] = (_count_flops(templates[L["template"]], L["arg_vals"], L["grad_args"])
                                    + count_launches(templates[L["template"]], L["arg_vals"], L["grad_args"]))

    consumers: dict[int, set[int]] = {i: set() for i in range(len(values))}
    for L in layers:
        for v in L["inputs"]:
            consumers[v].add(L["index"])
    value_recs = []
    for i, v in enumerate(values):
        t = _val(v["node"])
        value_recs.append(Value(
            id=i, name=v["name"], shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
            nbytes=t.numel() * t.element_size(), producer=v["producer"],
            consumers=tuple(sorted(consumers[i])),
            requires_grad=v["node"] in needs_grad and _is_float(t)))
    layer_recs = tuple(
        Layer(index=L["index"], name=L["name"], template=L["template"], params=L["params"],
              numel=L["numel"], trainable_numel=L["trainable_numel"], inputs=L["inputs"],
              outputs=L["outputs"], buffers=L["buffers"], buffer_bytes=L["buffer_bytes"],
              work_bytes=L["work_bytes"],
              fwd_flops=flops[L["template"]][0], bwd_flops=flops[L["template"]][1],
              fwd_launches=flops[L["template"]][2], bwd_launches=flops[L["template"]][3])
        for L in layers)
    graph = LayerGraph(layers=layer_recs, values=tuple(value_recs), batch_inputs=tuple(input_names),
                       loss=value_of[loss_node], micro_batch_size=micro_batch_size, seq_len=seq_len,
                       meta={"model": type(model).__name__, "block_container": container})
    return TracedModel(graph=graph, templates=tuple(templates), buffer_sources=buffer_sources)




# -- replicated blocks -----------------------------------------------------------------------------

# What every nn.Module keeps in its __dict__ (parameters, buffers, submodules, hooks): compared
# structurally below, not as attributes.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


def _attr_key(v: Any) -> Any:
    """An attribute as compared between blocks: plain data by value, anything else by identity
    (a config object all blocks share is the same; a tensor each block keeps is not). A
    ``functools.partial`` (transformers' activations keep one each) is its function and arguments."""
    if isinstance(v, _PLAIN):
        return ("value", v)
    if isinstance(v, (tuple, list, frozenset)) and all(isinstance(x, _PLAIN) for x in v):
        return ("value", type(v).__name__, tuple(v))
    if isinstance(v, functools.partial):
        return ("partial", _attr_key(v.func), tuple(_attr_key(a) for a in v.args),
                tuple(sorted((k, _attr_key(x)) for k, x in v.keywords.items())))
    return ("object", id(v))


def _fingerprint(block: nn.Module) -> dict[tuple, Any]:
    """What must match between two blocks for one's traced graph to stand for the other's."""
    out: dict[tuple, Any] = {}
    for path, mod in block.named_modules(remove_duplicate=False):
        out[("module", path)] = type(mod)
        for key, v in vars(mod).items():
            if key not in _MODULE_INTERNALS:
                out[("attr", path, key)] = _attr_key(v)
        for h in _HOOKS:
            out[("hooks", path, h)] = tuple(id(getattr(f, "__func__", f)) for f in getattr(mod, h, {}).values())
        out[("non-persistent", path)] = frozenset(mod._non_persistent_buffers_set)
    for name, p in block.named_parameters(remove_duplicate=False):
        out[("param", name)] = (tuple(p.shape), p.dtype, p.requires_grad, p.device, type(p))
    for name, b in block.named_buffers(remove_duplicate=False):
        out[("buffer", name)] = (tuple(b.shape), b.dtype, b.device)
    return out


def _why_not_replicate(model: nn.Module, container: str | None) -> str | None:
    """None when the blocks of ``container`` are interchangeable up to their index, else why not."""
    if not container:  # None, or the root itself, which a copy cannot shorten
        return "no block container"
    blocks = list(model.get_submodule(container))
    if len(blocks) <= len(_picks(len(blocks))):
        return f"{len(blocks)} blocks: no fewer to trace"
    if len({id(b) for b in blocks}) != len(blocks):
        return f"a module appears twice in {container}"
    params = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    if len(set(params)) != len(params):
        return "tied parameters"  # the full trace names them in its error
    prints = [_fingerprint(b) for b in blocks]
    if any(p.keys() != prints[0].keys() for p in prints):
        return f"the blocks of {container} differ in their modules, parameters or buffers"
    for key, first in prints[0].items():
        vals = [p[key] for p in prints]
        if all(v == first for v in vals):
            continue
        # An int attribute that counts with the block (transformers' ``layer_idx``) is the block's
        # own index: it selects a KV-cache slot, which training does not have.
        ints = [v[1] if v[0] == "value" and type(v[1]) is int else None for v in vals]
        if key[0] == "attr" and None not in ints and all(x - ints[0] == i for i, x in enumerate(ints)):
            continue
        if key[0] == "attr":
            where = ".".join(filter(None, (container, "<i>", key[1])))
            return f"attribute {key[2]!r} of {where} differs between blocks"
        return f"{key[0]} {key[1]!r} of {container}.<i> differs between blocks"
    for cfg in _hf_configs(model):
        for key, v in vars(cfg).items():
            if isinstance(v, (list, tuple)) and len(v) == len(blocks) and any(x != v[0] for x in v):
                return f"config.{key} differs between layers"
    return None


def _picks(n: int) -> tuple[int, ...]:
    """The blocks a short copy keeps: first, middle, last (the ones models most often special-case)."""
    return tuple(sorted({0, n // 2, n - 1}))


def _short_copy(model: nn.Module, container: str, picks: Sequence[int]) -> nn.Module:
    """A shallow copy of ``model`` whose ``container`` holds only the blocks ``picks``.

    Every module on the path to the container is copied with its own ``_modules`` dict, so the
    user's model is untouched; everything else (parameters, buffers, configs, the blocks) is
    shared, and the copy is used only for one export.
    """
    root = copy.copy(model)
    node = root
    parts = container.split(".")
    for i, name in enumerate(parts):
        node.__dict__["_modules"] = dict(node._modules)
        old = node._modules[name]
        new = copy.copy(old)
        if i == len(parts) - 1:
            new.__dict__["_modules"] = {str(j): old[k] for j, k in enumerate(picks)}
        node._modules[name] = new
        node = new
    return root


def _replicate(short: TracedModel, model: nn.Module, container: str, picks: Sequence[int]) -> TracedModel | str:
    """The full-depth TracedModel of ``model`` from the trace of its three-block copy, or why not.

    In the short graph the blocks are ``container.0..k-1`` standing for real blocks ``picks``.
    Block 0 is kept as it is; blocks ``1..n-1`` repeat short block 1 (the middle one), which must
    agree with every other short block field for field once its own index is taken out of its
    parameter and buffer names, and read only batch inputs, prologue values and the block before
    it. Layers after the blocks may read batch inputs, prologue values and the last block.
    """
    g = short.graph
    k, n = len(picks), len(model.get_submodule(container))
    index = {layer.name: layer.index for layer in g.layers}
    if any(f"{container}.{j}" not in index for j in range(k)):
        return "a block of the three-block copy traced to no layer"
    first = index[f"{container}.0"]
    if [index[f"{container}.{j}"] for j in range(k)] != list(range(first, first + k)):
        return "the blocks of the three-block copy are not consecutive layers"
    blocks = g.layers[first:first + k]
    pre, post = g.layers[:first], g.layers[first + k:]
    if [v.producer for v in g.values] != sorted(v.producer for v in g.values):
        return "values are not in layer order"

    def own(name: str, j: int) -> str | None:
        prefix = f"{container}.{j}."
        return name[len(prefix):] if name.startswith(prefix) else None

    def canon(layer: Layer, j: int):
        params = tuple((own(p.name, j), p.shape, p.offset, p.trainable) for p in layer.params)
        bufs = tuple(own(b, j) if b.startswith(f"{container}.") else ("shared", b) for b in layer.buffers)
        outs = tuple((g.values[v].name.split(":", 1)[1], g.values[v].shape, g.values[v].dtype,
                      g.values[v].requires_grad, g.values[v].consumers == (layer.index + 1,)) for v in layer.outputs)
        return (layer.template, params, layer.numel, layer.trainable_numel, bufs, layer.buffer_bytes,
                layer.work_bytes, layer.fwd_flops, layer.bwd_flops, outs)

    def wiring(layer: Layer):
        prev = g.layers[layer.index - 1].outputs
        out = []
        for v in layer.inputs:
            if g.values[v].producer < first:
                out.append(("head", v))
            elif v in prev:
                out.append(("prev", prev.index(v)))
            else:
                return None
        return tuple(out)

    shapes = [canon(b, j) for j, b in enumerate(blocks)]
    if any(None in (p[0] for p in s[1]) for s in shapes):
        return "a block reads a parameter outside itself"
    if any(None in s[4] for s in shapes):
        return "a block reads another block's buffer"
    if any(s != shapes[0] for s in shapes) or not all(o[-1] for o in shapes[0][-1]):
        return "the three traced blocks differ"
    pattern = wiring(blocks[1])
    if pattern is None or any(wiring(b) != pattern for b in blocks[2:]):
        return "the traced blocks read values other than the batch, the prologue and the block before"
    if any(short.buffer_sources.get(b, ("buffer",))[0] != "buffer" for layer in blocks for b in layer.buffers):
        return "a block reads a tensor constant"

    # Value ids: the head (batch inputs, prologue outputs) keeps its ids; then each block's outputs;
    # then those of the layers after the blocks.
    head = [v for v in g.values if v.producer < first]
    values: list[dict] = [dict(v=v, name=v.name, producer=v.producer) for v in head]
    block_outs: list[list[int]] = []
    for b in range(n):
        src = blocks[0] if b == 0 else blocks[1]
        ids = []
        for v in src.outputs:
            ids.append(len(values))
            local = g.values[v].name.split(":", 1)[1]
            values.append(dict(v=g.values[v], name=f"{container}.{b}:{local}", producer=first + b))
        block_outs.append(ids)
    post_id: dict[int, int] = {}
    for i, layer in enumerate(post):
        for v in layer.outputs:
            post_id[v] = len(values)
            values.append(dict(v=g.values[v], name=g.values[v].name, producer=first + n + i))
    last_outs = blocks[-1].outputs

    def post_input(v: int) -> int | None:
        if g.values[v].producer < first:
            return v
        if v in last_outs:
            return block_outs[-1][last_outs.index(v)]
        return post_id.get(v)

    def rename(name: str, b: int) -> str:
        rest = own(name, 1)
        return name if rest is None else f"{container}.{b}.{rest}"

    layers: list[Layer] = list(pre)
    layers.append(dataclasses.replace(blocks[0], outputs=tuple(block_outs[0])))
    tmpl = blocks[1]
    for b in range(1, n):
        ins = tuple(x if kind == "head" else block_outs[b - 1][x] for kind, x in pattern)
        layers.append(dataclasses.replace(
            tmpl, index=first + b, name=f"{container}.{b}",
            params=tuple(dataclasses.replace(p, name=rename(p.name, b)) for p in tmpl.params),
            buffers=tuple(rename(x, b) for x in tmpl.buffers), inputs=ins, outputs=tuple(block_outs[b])))
    for i, layer in enumerate(post):
        ins = tuple(post_input(v) for v in layer.inputs)
        if None in ins:
            return "a layer after the blocks reads a block other than the last"
        layers.append(dataclasses.replace(layer, index=first + n + i, inputs=ins,
                                          outputs=tuple(post_id[v] for v in layer.outputs)))

    consumers: dict[int, list[int]] = {i: [] for i in range(len(values))}
    for layer in layers:
        for v in layer.inputs:
            consumers[v].append(layer.index)
    value_recs = tuple(
        dataclasses.replace(d["v"], id=i, name=d["name"], producer=d["producer"], consumers=tuple(sorted(consumers[i])))
        for i, d in enumerate(values))
    if g.loss not in post_id:
        return "the loss is not computed after the blocks"
    graph = LayerGraph(layers=tuple(layers), values=value_recs, batch_inputs=g.batch_inputs, loss=post_id[g.loss],
                       micro_batch_size=g.micro_batch_size, seq_len=g.seq_len,
                       meta={**g.meta, "model": type(model).__name__, "traced_blocks": tuple(picks)})

    sources = {}
    for name, src in short.buffer_sources.items():
        j = next((j for j in range(k) if own(name, j) is not None), None)
        if j is None:
            sources[name] = src
        else:
            for b in range(n):
                real = f"{container}.{b}.{own(name, j)}"
                sources[real] = ("buffer", real)
    return TracedModel(graph=graph, templates=short.templates, buffer_sources=sources)


def _check_covers_params(model: nn.Module, graph: LayerGraph) -> None:
    placed = {p.name for layer in graph.layers for p in layer.params}
    unused = [n for n, p in model.named_parameters() if n not in placed and p.requires_grad]
    if unused:
        # A parameter the loss never reads would never get a gradient; eager AdamW skips it too,
        # so this is not an error, but it is not streamed either.
        graph.meta["unused_parameters"] = unused


def _map_devices(a, device: torch.device):
    if isinstance(a, torch.device):
        return device
    if isinstance(a, (list, tuple)):
        return type(a)(_map_devices(x, device) for x in a)
    if isinstance(a, dict):
        return {k: _map_devices(v, device) for k, v in a.items()}
    return a


def retarget(gm: fx.GraphModule, device: torch.device | str) -> fx.GraphModule:
    """A copy of template ``gm`` whose ops create tensors on ``device``.

    Export records the device it traced on (``meta`` for a model too large to build) in ops such
    as ``arange(..., device=meta)``; running the template elsewhere needs those rewritten. Nested
    graphs (higher-order ops such as ``wrap_with_set_grad_enabled``) are rewritten too.
    """
    device = torch.device(device)
    out = copy.deepcopy(gm)
    for mod in out.modules():
        if isinstance(mod, fx.GraphModule):
            for n in mod.graph.nodes:
                n.args = _map_devices(n.args, device)
                n.kwargs = _map_devices(n.kwargs, device)
            mod.recompile()
    return out
