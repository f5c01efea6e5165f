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
shapes, same wiring) share one template, so a 80-block model has three templates.

FLOPs per layer are counted by running each template once on the meta device under
``torch.utils.flop_counter.FlopCounterMode`` (forward, then forward plus backward for the local
backward), so attention FLOPs are included exactly as the kernels see them.
"""

from __future__ import annotations

import copy
import inspect
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from megatrain.errors import TraceError, UnsupportedModelError
from megatrain.planner.graph import BATCH_PRODUCER, Layer, LayerGraph, ParamSpec, Value, align_up

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
        if schema is None or schema.name not in _RANDOM_OPS:
            continue
        if schema.name.endswith("dropout") and (len(n.args) > 1 and n.args[1] == 0.0 or
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
    model was on (the runtime re-targets it). ``buffer_sources`` maps each buffer name a layer lists
    to where its value lives: ``("buffer", fqn)`` for a module buffer, ``("constant", tensor)`` for
    a tensor constant export lifted out of ``forward``.
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


def _work_bytes(nodes: list[fx.Node]) -> int:
    """Bytes of the tensors a layer's ops create; a view shares its base's storage and is free."""
    total = 0
    for n in nodes:
        v = _val(n)
        if n.op != "call_function" or not isinstance(v, torch.Tensor):
            continue
        schema = getattr(n.target, "_schema", None)
        is_view = schema is not None and any(r.alias_info is not None for r in schema.returns)
        if not is_view:
            total += v.numel() * v.element_size()
    return total


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


def trace(model: nn.Module, *, micro_batch_size: int, seq_len: int,
          input_names: Sequence[str] = ("input_ids", "labels")) -> TracedModel:
    """Trace ``model`` into a LayerGraph for micro-batches of ``[micro_batch_size, seq_len]``.

    ``model(**{name: LongTensor[micro_batch_size, seq_len] for name in input_names})`` must return
    its scalar loss (a tensor, an object with ``.loss`` or a tuple whose first element is the loss).
    The model may live on the ``meta`` device; no parameter memory is touched either way.

    Raises:
        TraceError: export failed (names the module that was running and the failing op).
        UnsupportedModelError: no trainable parameters, tied parameters used by two layers, or
            blocks called out of order.
    """
    if micro_batch_size < 1 or seq_len < 1:
        raise TraceError(f"micro_batch_size ({micro_batch_size}) and seq_len ({seq_len}) must be >= 1")
    device = _model_device(model)
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no trainable parameters (all have requires_grad=False): "
            "there is nothing to train")
    example = tuple(torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device=device)
                    for _ in input_names)
    ep = _export(model, input_names, example)
    gm = ep.graph_module
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _ASSERT_OPS:
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _check_no_randomness(gm)

    sig = ep.graph_signature
    param_of = {k: _strip(v) for k, v in sig.inputs_to_parameters.items()}
    buffer_of = {k: _strip(v) for k, v in sig.inputs_to_buffers.items()}
    const_of = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    user_inputs = [s for s in sig.user_inputs]
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}

    container = _find_block_container(model)
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
            values.append(dict(node=n, name=f"{names[stage[n]]}:{n.name}", producer=stage[n]))

    # Does a value depend on a parameter? Propagate from parameter placeholders.
    needs_grad: set[fx.Node] = {placeholders[p] for p in param_of}
    for n in gm.graph.nodes:
        if n.op == "call_function" and any(a in needs_grad for a in n.all_input_nodes):
            needs_grad.add(n)

    stage_nodes: list[list[fx.Node]] = [[] for _ in names]
    for n in gm.graph.nodes:
        if n in stage:
            stage_nodes[stage[n]].append(n)

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
            work_bytes=_work_bytes(nodes),
            arg_vals=[_val(a) for a in params + buffers + inputs],
            grad_args=[trainable[param_of[a.name]] for a in params] + [False] * len(buffers)
            + [a in needs_grad and _is_float(_val(a)) for a in inputs]))

    flops: dict[int, tuple[int, int]] = {}
    for L in layers:
        if L["template"] not in flops:
            flops[L["template"]] = _count_flops(templates[L["template"]], L["arg_vals"], L["grad_args"])

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
              fwd_flops=flops[L["template"]][0], bwd_flops=flops[L["template"]][1])
        for L in layers)
    graph = LayerGraph(layers=layer_recs, values=tuple(value_recs), batch_inputs=tuple(input_names),
                       loss=value_of[loss_node], micro_batch_size=micro_batch_size, seq_len=seq_len,
                       meta={"model": type(model).__name__, "block_container": container})
    _check_covers_params(model, graph)
    return TracedModel(graph=graph, templates=tuple(templates), buffer_sources=buffer_sources)


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
