"""Binding the user's module to host tiles: after :func:`bind_module` every parameter of the module
is a view into its layer's master tile (of a :class:`~megatrain.runtime.host.HostState`, or of the
whole :class:`FullMasters` rank 0 initialises a sliced state's weights into), so the module holds no
storage of its own, ``model.state_dict()`` reads the trained weights, and host memory is not
doubled. Parameters and buffers built on the ``meta`` device are initialised in place by the
model's own initialisation. A layer whose master lives on NVMe has no tile to view: its parameters
become ``meta`` tensors (:func:`unbind_spilled`), and ``Trainer.state_dict()`` reads its weights.

The host state is taken by what it offers (``graph``, ``param_view``, ``spilled``), so this module
imports no ``HostState``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatrain.errors import UnsupportedModelError
from megatrain.ir.graph import LayerGraph
from megatrain.runtime.pages import page_aligned_empty


class FullMasters:
    """Whole FP32 master rows of every layer of ``graph`` (``rows[i]``: ``float32[numel]``, private,
    zero padding), without moments: what global rank 0 initialises the module into
    (:func:`bind_module` takes it as a host) when the host state is sliced across nodes
    (``Plan.host_state == "shard"``), before each row is sent to the nodes' slices. 4 bytes per
    parameter, held until the caller drops it."""

    def __init__(self, graph: LayerGraph):
        self.graph = graph
        self.rows = [page_aligned_empty(lay.numel * 4).view(torch.float32) for lay in graph.layers]

    def param_view(self, layer: int, index: int) -> torch.Tensor:
        spec = self.graph.layers[layer].params[index]
        return self.rows[layer][spec.offset:spec.offset + spec.numel].view(spec.shape)


def materialize_buffers(model: nn.Module) -> None:
    """Materialise ``model``'s meta-device buffers on the CPU and initialise them by their modules'
    own initialisation (the rotary tables of a model built on ``meta``), writing no parameter
    elsewhere than in the module's own tensors: a rank whose parameters are not bound
    (a sliced host state) still runs its layers with real buffers.

    Raises:
        UnsupportedModelError: a meta module has no initialisation megatrain can call.
    """
    needs_init: dict[str, nn.Module] = {}
    if _meta_buffers(model, needs_init):
        _initialise(model, needs_init)


def unbind_parameters(model: nn.Module) -> None:
    """Replace every parameter of ``model`` (each of its names, so ties stay tied) by one of the same
    shape, dtype and ``requires_grad`` on the ``meta`` device, which holds no memory: with a sliced
    host state no rank keeps a whole copy of the weights; the trained ones are read from a
    checkpoint (``Trainer.save``)."""
    fresh: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if id(p) not in fresh:
            fresh[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                        requires_grad=p.requires_grad)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, fresh[id(p)])


def bind_module(model: nn.Module, host: Any, writer: bool = True) -> None:
    """Move every parameter of ``model`` into its master tile and make it a view of the tile.

    Parameters on the ``meta`` device are initialised in place by the model's own initialisation:
    a Hugging Face model's ``_init_weights(module)``, otherwise ``module.reset_parameters()``.
    Buffers on ``meta`` are materialised on the CPU and initialised the same way.

    ``writer=False`` (a rank of a node whose shared host state another rank fills): the parameters
    become views of the tiles and nothing is written to them; meta buffers are initialised first,
    while the parameters are still the module's own.

    Raises:
        UnsupportedModelError: a meta module has no initialisation megatrain can call.
    """
    needs_init: dict[str, nn.Module] = {}
    fresh: list[tuple[int, int]] = []
    if not writer and _meta_buffers(model, needs_init):
        _initialise(model, needs_init)  # the parameters are still the module's own: nothing shared is written
    # Every name of each parameter: a tied one (lm_head.weight is model.embed_tokens.weight) is
    # rebound under all of them to the one view, so the module stays tied.
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for li, layer in enumerate(host.graph.layers):
        for pi, spec in enumerate(layer.params):
            mod_name, _, attr = spec.name.rpartition(".")
            mod = model.get_submodule(mod_name)
            old = getattr(mod, attr)
            view = host.param_view(li, pi)
            if not writer:
                pass
            elif old.device.type == "meta":
                # NaN marks "not initialised yet", so an init that skips a parameter is caught.
                view.fill_(float("nan"))
                needs_init[mod_name] = mod
                fresh.append((li, pi))
            else:
                with torch.no_grad():
                    view.copy_(old)
            bound = nn.Parameter(view, requires_grad=old.requires_grad)
            for alias in aliases.get(id(old), [spec.name]):
                owner, _, name = alias.rpartition(".")
                setattr(model.get_submodule(owner), name, bound)
    if not writer:
        return
    _meta_buffers(model, needs_init)
    if needs_init:
        _initialise(model, needs_init)
    for li, pi in fresh:
        if torch.isnan(host.param_view(li, pi)).any():
            spec = host.graph.layers[li].params[pi]
            raise UnsupportedModelError(
                f"parameter {spec.name!r} was built on the meta device and its module's "
                "initialisation did not set it: give the module reset_parameters() (or handle it "
                "in the model's _init_weights), or build the model on the CPU")


def unbind_spilled(model: nn.Module, host: Any) -> None:
    """Make the parameters of ``model`` that viewed a master row :meth:`~megatrain.runtime.host.HostState.spill_masters`
    dropped into ``meta`` tensors of their shape (under every name, tied ones included), so that
    nothing reads a stale or freed copy: their weights are read through ``Trainer.state_dict()``
    (:class:`NvmeMasterRow`), and the trainer's forward reads the BF16 staging tiles."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    for li in sorted(host.nvme_rows.spilled):
        for spec in host.graph.layers[li].params:
            mod_name, _, attr = spec.name.rpartition(".")
            old = getattr(model.get_submodule(mod_name), attr)
            if old.device.type == "meta":
                continue
            bound = nn.Parameter(torch.empty(tuple(spec.shape), dtype=torch.float32, device="meta"),
                                 requires_grad=old.requires_grad)
            for alias in aliases.get(id(old), [spec.name]):
                owner, _, name = alias.rpartition(".")
                setattr(model.get_submodule(owner), name, bound)


def _meta_buffers(model: nn.Module, needs_init: dict[str, nn.Module]) -> bool:
    """Materialise ``model``'s meta-device buffers on the CPU (uninitialised) and add their
    modules to ``needs_init``; whether there were any."""
    found = False
    for name, mod in model.named_modules():
        for bname, buf in list(mod._buffers.items()):
            # Not to_empty(): that would also re-allocate the parameters bound to tiles.
            if buf is not None and buf.device.type == "meta":
                mod._buffers[bname] = torch.empty_like(buf, device="cpu")
                needs_init[name] = mod
                found = True
    return found


def _initialise(model: nn.Module, modules: dict[str, nn.Module]) -> None:
    hf_init = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for name, mod in modules.items():
            if hf_init is not None:
                hf_init(mod)
            elif hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
            else:
                raise UnsupportedModelError(
                    f"module {name or type(model).__name__!r} ({type(mod).__name__}) was built on the "
                    "meta device and has no reset_parameters() to initialise it: give it one, or build "
                    "the model on the CPU")
