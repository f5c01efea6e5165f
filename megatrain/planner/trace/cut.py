"""Cut export's graph into layers: stages, the values between them, one GraphModule per layer.

The repeated blocks are found structurally, not from a table of class names: the
``nn.ModuleList``/``nn.Sequential`` holding the most parameters is the block container
(:func:`find_block_container`), and a node belongs to block ``i`` when its module stack passes
through child ``i``. Nodes called outside any block before the first block form the *prologue*
(embeddings, rotary tables, the causal mask), nodes after the last block the *epilogue* (final
norm, LM head, loss). The graph is then cut at those boundaries (:func:`cut`): every tensor one
layer produces and a later layer reads becomes a ``Value``, and each layer becomes a pure function
``(params..., buffers..., inputs...) -> outputs`` as an ``fx.GraphModule``. Layers whose functions
are structurally equal (same ops, same shapes, same wiring) share one template
(:func:`share_templates`), so a 80-block model has three templates. A value is named after its
layer and its node's name counted within that layer (``model.layers.7:add_5``), so names do not
depend on how many layers came before. :func:`build_graph` makes the LayerGraph records.
"""

from __future__ import annotations

import operator
import re
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.fx as fx
from torch import nn

from megatrain.errors import UnsupportedModelError
from megatrain.ir.graph import BATCH_PRODUCER, Layer, LayerGraph, ParamSpec, TracedModel, Value, align_up
from megatrain.planner.trace.cleanup import draws_random, without_dropout
from megatrain.planner.trace.context import LayerCut, ValueCut
from megatrain.planner.trace.export import WRAPPED, strip_wrapper
from megatrain.planner.trace.fx_util import is_float, node_val, signature

if TYPE_CHECKING:
    from megatrain.planner.trace.context import TraceContext

def find_block_container(model: nn.Module, skip: str | None = None) -> str | None:
    """Name of the ModuleList/Sequential whose children hold the most parameters, or None; with
    ``skip``, among those outside module ``skip`` (a vision-language model's vision tower)."""
    best, best_count = None, 0
    for name, mod in model.named_modules():
        if skip is not None and (name == skip or name.startswith(skip + ".")):
            continue
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 0:
            count = sum(p.numel() for p in mod.parameters())
            if count > best_count:
                best, best_count = name, count
    return best


def _block_of(node: fx.Node, prefixes: Sequence[str]) -> tuple[int, int] | None:
    """``(container, block)`` of the block whose module stack ``node`` runs in, or None."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, _ty in stack.values():
        for c, prefix in enumerate(prefixes):
            if path.startswith(prefix):
                head = path[len(prefix):].split(".", 1)[0]
                if head.isdigit():
                    return c, int(head)
    return None


def _assign_stages(gm: fx.GraphModule, containers: Sequence[tuple[str, int]],
                   param_of: dict[str, str]) -> tuple[dict[fx.Node, int], list[str]]:
    """Stage index of every call_function node, and the stages' names.

    ``containers``: ``(name, blocks)`` of each block container (a vision-language model's vision
    blocks, then the decoder's). Stages in call order: ``prologue``, each container's blocks, and
    between two containers a connector stage (the glue that runs after the last block of one and
    before the first of the next: LLaVA's projector and the merge of the image features into the
    text embeddings), then ``epilogue``."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    prefixes = [f"{WRAPPED}.{name}." for name, _ in containers]
    block = {n: _block_of(n, prefixes) for n in calls}
    in_blocks = [i for i, n in enumerate(calls) if block[n] is not None]
    last_block_pos = in_blocks[-1] if in_blocks else -1
    next_container: list[int | None] = [None] * len(calls)  # the container of the next block node
    upcoming = None
    for i in range(len(calls) - 1, -1, -1):
        upcoming = block[calls[i]][0] if block[calls[i]] is not None else upcoming
        next_container[i] = upcoming
    stage: dict[fx.Node, int] = {}
    names = ["prologue"]
    current: tuple[int, int] | None = None
    finished: set[int] = set()  # containers left for a later one
    connector: dict[int, int] = {}  # container left -> its connector stage
    for i, n in enumerate(calls):
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0] in stage:
            stage[n] = stage[n.args[0]]  # a tuple element stays with the op that made the tuple
            continue
        b = block[n]
        if b is not None:
            if current is not None and b[0] == current[0] and b[1] < current[1]:
                name = containers[b[0]][0]
                raise UnsupportedModelError(
                    f"block {name}.{b[1]} runs after block {name}.{current[1]}: megatrain streams "
                    "blocks in the order they are called, and expects each block's ops to be "
                    "contiguous and in index order")
            if b[0] in finished:
                raise UnsupportedModelError(
                    f"the blocks of {containers[b[0]][0]} run again after those of "
                    f"{containers[current[0]][0]}: megatrain expects each block container's blocks to run "
                    "once, one container after the other")
            if current is not None and b[0] != current[0]:
                finished.add(current[0])
            if b != current:
                names.append(f"{containers[b[0]][0]}.{b[1]}")
                current = b
            stage[n] = len(names) - 1
        elif i > last_block_pos >= 0:
            if names[-1] != "epilogue":
                names.append("epilogue")
            stage[n] = len(names) - 1
        elif current is None:
            stage[n] = 0  # before the first block: the prologue
        elif next_container[i] != current[0]:
            # Between the last block of one container and the first of the next: a connector.
            if current[0] not in connector:
                connector[current[0]] = len(names)
                names.append("connector")
            stage[n] = connector[current[0]]
        else:
            # Between blocks: glue code of the parent's loop body, which runs with the block before it.
            stage[n] = len(names) - 1
    for s in connector.values():
        names[s] = _connector_name(stage, s, param_of, names)
    return stage, names


def _connector_name(stage: dict[fx.Node, int], s: int, param_of: dict[str, str], names: list[str]) -> str:
    """A connector stage's name: the module that holds all its parameters (LLaVA's
    ``model.multi_modal_projector``), or ``connector`` when it has none or they share no module."""
    params = sorted({param_of[a.name] for n, k in stage.items() if k == s for a in n.all_input_nodes
                     if a.op == "placeholder" and a.name in param_of})
    parts = [p.split(".")[:-1] for p in params]
    common = parts[0] if parts else []
    for p in parts[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    name = ".".join(common)
    return name if name and name not in names else "connector"


def _tie(gm: fx.GraphModule, param: fx.Node, stage: dict[fx.Node, int], readers: dict[fx.Node, set[int]]) -> None:
    """A parameter read by several layers (tied weights, such as an input embedding and the LM
    head): the first layer that reads it owns it (its tile holds it, its optimizer step updates it
    once), and passes an ``aten.clone`` of it to the later readers as a value. The copy travels
    through the schedule like any checkpoint (kept, offloaded or recomputed as planned, and checked
    by the verifier: produced by the owner's FWD before a reader runs), and each reader's local
    backward returns the gradient of that value, which the owner's local backward adds to the
    gradient of its own use before its one optimizer step: the sum eager autograd forms for the
    shared leaf. The clone, not the parameter itself, crosses the boundary because a layer's
    parameters are views into its device slot, which a later layer's H2D overwrites."""
    owner = min(readers[param])
    first = next(n for n in gm.graph.nodes if stage.get(n) == owner and param in n.all_input_nodes)
    with gm.graph.inserting_before(first):
        copy = gm.graph.call_function(torch.ops.aten.clone.default, (param,))
    copy.name = f"{param.name}_tied"
    copy.meta = dict(param.meta)
    stage[copy] = owner
    later = [n for n in param.users if n is not copy and stage.get(n, owner) != owner]
    for n in later:
        n.replace_input_with(param, copy)
    readers[param] = {owner}
    readers[copy] = {stage[n] for n in later}
    gm.recompile()


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


def cut(ctx: TraceContext) -> None:
    """Pass: cut ``ctx.gm`` into ``ctx.layers`` at the children of ``ctx.container``.

    Fills ``loss_node``, ``values`` (batch inputs, then every node a later layer reads, in graph
    order), ``value_of``, ``needs_grad`` (nodes computed from a trainable parameter), ``buffer_sources`` and
    one :class:`LayerCut` per non-empty stage, its parameters laid out in a flat tile (trainable
    first: the optimizer updates one contiguous prefix of the tile). A parameter read by several
    layers (tied weights) belongs to the first; the others read its copy (:func:`_tie`).

    Raises:
        UnsupportedModelError: the loss depends on no computation or is not the last one, a
            blocks run out of order, or a
            non-tensor value crosses a layer boundary.
    """
    gm, param_of, buffer_of, const_of = ctx.gm, ctx.param_of, ctx.buffer_of, ctx.const_of
    containers = [(c, len(ctx.module.get_submodule(c))) for c in (ctx.vision_container, ctx.container)
                  if c is not None]
    stage, stage_names = _assign_stages(gm, containers, param_of)
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    user_inputs, input_names, trainable = ctx.user_inputs, ctx.options.input_names, ctx.trainable

    # Which stage reads each node (get_attr nodes are copied into every stage that reads them).
    readers: dict[fx.Node, set[int]] = {n: set() for n in gm.graph.nodes}
    for n, s in stage.items():
        for a in n.all_input_nodes:
            readers[a].add(s)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss_node = out_node.args[0][0] if isinstance(out_node.args[0], (tuple, list)) else out_node.args[0]
    if loss_node not in stage:
        raise UnsupportedModelError("the loss does not depend on any computation of the model")

    for ph_name in param_of:
        if len(readers[placeholders[ph_name]]) > 1:
            _tie(gm, placeholders[ph_name], stage, readers)

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
    values: list[ValueCut] = []
    value_of: dict[fx.Node, int] = {}
    for ph, input_name in zip(user_inputs, input_names):
        node = placeholders[ph]
        value_of[node] = len(values)
        values.append(ValueCut(node, input_name, BATCH_PRODUCER))
    for n in gm.graph.nodes:
        if n in stage and (any(r > stage[n] for r in readers[n]) or n is loss_node):
            v = node_val(n)
            if not isinstance(v, torch.Tensor):
                raise UnsupportedModelError(
                    f"layer {names[stage[n]]!r} passes a non-tensor value ({type(v).__name__}, node "
                    f"{n.name}) to a later layer; only tensors can cross a layer boundary")
            value_of[n] = len(values)
            values.append(ValueCut(n, f"{names[stage[n]]}:{local[n]}", stage[n]))

    # Does a value depend on a trainable parameter? Propagate from their placeholders (a frozen
    # vision tower's outputs need no gradient, and its layers get no local backward).
    needs_grad: set[fx.Node] = {placeholders[p] for p, fqn in param_of.items() if trainable[fqn]}
    for n in gm.graph.nodes:
        if n.op == "call_function" and any(a in needs_grad for a in n.all_input_nodes):
            needs_grad.add(n)

    buffer_sources: dict[str, tuple[str, Any]] = {}
    for ph_name, fqn in buffer_of.items():
        buffer_sources[fqn] = ("buffer", fqn)
    for ph_name, fqn in const_of.items():
        buffer_sources[strip_wrapper(fqn)] = ("constant", ctx.program.constants[fqn])
    ctx.loss_node, ctx.values, ctx.value_of = loss_node, values, value_of
    ctx.needs_grad, ctx.buffer_sources = needs_grad, buffer_sources

    ctx.layers = []
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

        specs, offset = [], 0
        for a in params:
            fqn = param_of[a.name]
            specs.append(ParamSpec(fqn, tuple(node_val(a).shape), offset, trainable[fqn]))
            offset = align_up(offset + specs[-1].numel)
        n_train = [p for p in specs if p.trainable]
        ctx.layers.append(LayerCut(
            index=s, name=names[s], module=fx.GraphModule(gm, g), params=params, buffers=buffers, inputs=inputs,
            outputs=outputs, specs=tuple(specs), numel=offset,
            trainable_numel=align_up(n_train[-1].offset + n_train[-1].numel) if n_train else 0))


def share_templates(ctx: TraceContext) -> None:
    """Pass: one template per structurally distinct layer (:func:`~.fx_util.signature`), in
    order of first use; sets each layer's ``template``."""
    ctx.templates = []
    sigs: list[tuple] = []
    for layer in ctx.layers:
        sig = signature(layer.module)
        if sig in sigs:
            layer.template = sigs.index(sig)
        else:
            layer.template = len(ctx.templates)
            ctx.templates.append(layer.module)
            sigs.append(sig)


def build_graph(ctx: TraceContext) -> None:
    """Pass: the LayerGraph's records from the cut layers and their measurements, into ``ctx.traced``;
    a layer whose template draws random numbers is marked ``draws_random``, and its template gets
    an eval-mode copy with dropout off (``TracedModel.eval_templates``)."""
    consumers: dict[int, set[int]] = {i: set() for i in range(len(ctx.values))}
    for layer in ctx.layers:
        for a in layer.inputs:
            consumers[ctx.value_of[a]].add(layer.index)
    value_recs = []
    for i, v in enumerate(ctx.values):
        t = node_val(v.node)
        value_recs.append(Value(
            id=i, name=v.name, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
            nbytes=t.numel() * t.element_size(), producer=v.producer,
            consumers=tuple(sorted(consumers[i])),
            requires_grad=v.node in ctx.needs_grad and is_float(t)))
    random_templates = [draws_random(t) for t in ctx.templates]
    layer_recs = []
    for L in ctx.layers:
        flops = ctx.flops[L.template]
        buffer_names = tuple(ctx.buffer_of.get(a.name) or strip_wrapper(ctx.const_of[a.name]) for a in L.buffers)
        layer_recs.append(Layer(
            index=L.index, name=L.name, template=L.template, params=L.specs, numel=L.numel,
            trainable_numel=L.trainable_numel, inputs=tuple(ctx.value_of[a] for a in L.inputs),
            outputs=tuple(ctx.value_of[o] for o in L.outputs), buffers=buffer_names,
            buffer_bytes=sum(node_val(a).numel() * node_val(a).element_size() for a in L.buffers),
            work_bytes=L.work_bytes, fwd_flops=flops[0], bwd_flops=flops[1], fwd_launches=flops[2],
            bwd_launches=flops[3], draws_random=random_templates[L.template],
            fwd_profile=ctx.profiles[L.template][0], bwd_profile=ctx.profiles[L.template][1]))
    o = ctx.options
    graph = LayerGraph(layers=tuple(layer_recs), values=tuple(value_recs), batch_inputs=o.input_names,
                       loss=ctx.value_of[ctx.loss_node], micro_batch_size=o.micro_batch_size, seq_len=o.seq_len,
                       meta={"model": type(ctx.module).__name__, "block_container": ctx.container})
    if ctx.uncounted_loss_because is not None:
        graph.meta["uncounted_loss_because"] = ctx.uncounted_loss_because
    evals = tuple(without_dropout(t) if r else None for t, r in zip(ctx.templates, random_templates))
    ctx.traced = TracedModel(graph=graph, templates=tuple(ctx.templates), buffer_sources=ctx.buffer_sources,
                             eval_templates=evals if any(random_templates) else (), count_targets=ctx.count_targets)


def check_covers_params(model: nn.Module, graph: LayerGraph) -> None:
    placed = {p.name for layer in graph.layers for p in layer.params}
    unused = [n for n, p in model.named_parameters() if n not in placed and p.requires_grad]
    if unused:
        # A parameter the loss never reads would never get a gradient; eager AdamW skips it too,
        # so this is not an error, but it is not streamed either.
        graph.meta["unused_parameters"] = unused


__all__ = ["build_graph", "check_covers_params", "cut", "find_block_container", "share_templates"]
