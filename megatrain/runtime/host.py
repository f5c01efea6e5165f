"""Persistent host state: one contiguous block per layer holding FP32 master weights and the two
AdamW moments (12 bytes per parameter), plus binding the user's module to it.

After binding, every parameter of the user's module is a view into its layer's master tile, so
the module holds no storage of its own, ``model.state_dict()`` reads the trained weights, and host
memory is not doubled.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from megatrain.errors import UnsupportedModelError
from megatrain.planner.graph import LayerGraph

MASTER, EXP_AVG, EXP_AVG_SQ = 0, 1, 2


class HostState:
    """FP32 tiles for every layer: ``block(i)`` is a ``[3, numel]`` float32 tensor.

    ``alloc(shape, dtype)`` makes the memory: ordinary for the CPU backend, pinned (page-locked,
    page-aligned) for the CUDA backend so that one DMA moves a layer.
    """

    def __init__(self, graph: LayerGraph, alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]):
        self.graph = graph
        self.blocks = []
        for layer in graph.layers:
            block = alloc((3, layer.numel), torch.float32)
            block[1:].zero_()
            self.blocks.append(block)
        # Adam's step count per layer, a tensor because the fused kernel reads it as one.
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in graph.layers]

    def master(self, layer: int) -> torch.Tensor:
        return self.blocks[layer][MASTER]

    def exp_avg(self, layer: int) -> torch.Tensor:
        return self.blocks[layer][EXP_AVG]

    def exp_avg_sq(self, layer: int) -> torch.Tensor:
        return self.blocks[layer][EXP_AVG_SQ]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.blocks)

    def param_view(self, layer: int, index: int) -> torch.Tensor:
        spec = self.graph.layers[layer].params[index]
        return self.master(layer)[spec.offset:spec.offset + spec.numel].view(spec.shape)


def bind_module(model: nn.Module, host: HostState) -> None:
    """Move every parameter of ``model`` into its master tile and make it a view of the tile.

    Parameters on the ``meta`` device are initialised in place by the model's own initialisation:
    a Hugging Face model's ``_init_weights(module)``, otherwise ``module.reset_parameters()``.
    Buffers on ``meta`` are materialised on the CPU and initialised the same way.

    Raises:
        UnsupportedModelError: a meta module has no initialisation megatrain can call.
    """
    needs_init: dict[str, nn.Module] = {}
    fresh: list[tuple[int, int]] = []
    for li, layer in enumerate(host.graph.layers):
        for pi, spec in enumerate(layer.params):
            mod_name, _, attr = spec.name.rpartition(".")
            mod = model.get_submodule(mod_name)
            old = getattr(mod, attr)
            view = host.param_view(li, pi)
            if old.device.type == "meta":
                # NaN marks "not initialised yet", so an init that skips a parameter is caught.
                view.fill_(float("nan"))
                needs_init[mod_name] = mod
                fresh.append((li, pi))
            else:
                with torch.no_grad():
                    view.copy_(old)
            setattr(mod, attr, nn.Parameter(view, requires_grad=old.requires_grad))
    for name, mod in model.named_modules():
        for bname, buf in list(mod._buffers.items()):
            # Not to_empty(): that would also re-allocate the parameters just bound to tiles.
            if buf is not None and buf.device.type == "meta":
                mod._buffers[bname] = torch.empty_like(buf, device="cpu")
                needs_init[name] = mod
    if needs_init:
        _initialise(model, needs_init)
    for li, pi in fresh:
        if torch.isnan(host.param_view(li, pi)).any():
            spec = host.graph.layers[li].params[pi]
            raise UnsupportedModelError(
                f"parameter {spec.name!r} was built on the meta device and its module's "
                "initialisation did not set it: give the module reset_parameters() (or handle it "
                "in the model's _init_weights), or build the model on the CPU")


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
