"""Re-targeting a template to a device: the one torch-touching helper of the IR, kept in a module of
its own below :mod:`megatrain.ir.graph` and :mod:`megatrain.ir.profile`, which both use it
(``megatrain.ir.graph.retarget`` stays its documented import path). Imports torch only inside
:func:`retarget`."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.fx as fx


def _map_devices(a, device: torch.device):
    if isinstance(a, type(device)):  # a torch.device, without importing torch here
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
    import torch
    import torch.fx as fx

    device = torch.device(device)
    out = copy.deepcopy(gm)
    for mod in out.modules():
        if isinstance(mod, fx.GraphModule):
            for n in mod.graph.nodes:
                n.args = _map_devices(n.args, device)
                n.kwargs = _map_devices(n.kwargs, device)
            mod.recompile()
    return out
