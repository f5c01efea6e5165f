"""A trainer's whole training state as one dict of views, and its restore: the checkpoint boundary.

``Trainer.state_dict`` and ``Trainer.load_state_dict`` are these two functions: a checkpoint
(:mod:`megatrain.checkpoint`) reads the views and loads into them, as torchtitan's checkpointer
does with its ``Stateful`` components. The views are the host state's own rows
(:mod:`megatrain.runtime.host`), so reading one copies nothing and a load writes the tiles in
place; rows on NVMe and rows of a host state sharded across nodes are row objects that read and
write through (``NvmeRow``, ``SlicedRow``). ``trainer`` is a ``megatrain.trainer.Trainer``, the
floor above, which this module does not import.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from megatrain.errors import CheckpointError, ConfigError
from megatrain.optim import spec_of
from megatrain.runtime.host import MASTER, NvmeRow, SlicedRow, as_tensor


def state_dict(trainer) -> dict[str, Any]:
    """``Trainer.state_dict(flush=False)``: the views of the trainer's state; see that method for
    the keys. A deferred update is not applied here (the method applies it first)."""
    host, layers, model_ = trainer.host, trainer.graph.layers, trainer.model
    model, masters, optimizer = _sliced_rows(trainer) if host.sliced else (
        {spec.name: host.param_row(li, pi) for li, layer in enumerate(layers)
         for pi, spec in enumerate(layer.params)},
        {f"{layer.name}.master": host.master_row(li) for li, layer in enumerate(layers)},
        {f"{layer.name}.{kind}": host.moment_row(li, k) for li, layer in enumerate(layers)
         for k, kind in enumerate(host.optimizer.states)})
    # state_dict() returns detached tensors sharing the module's storage: copying into one
    # writes the module's buffer.
    # A tied parameter's other names (lm_head.weight) are no buffers: it is saved once, in "model".
    # A parameter the loss never reads (LLaVA's last vision block) is in no layer: it is kept
    # here as the model holds it, so that a checkpoint is the whole model.
    placed = {id(p) for name, p in model_.named_parameters(remove_duplicate=False) if name in model}
    aliases = {name for name, p in model_.named_parameters(remove_duplicate=False) if id(p) in placed}
    buffers = {name: t for name, t in model_.state_dict().items()
               if name not in model and name not in aliases and isinstance(t, torch.Tensor)
               and t.device.type != "meta"}
    return {
        "model": model,
        "buffers": buffers,
        "masters": masters,
        "optimizer": optimizer,
        "adam_steps": {layer.name: float(host.steps[li]) for li, layer in enumerate(layers)},
        "step_count": trainer.step_count,
        "optimizer_settings": trainer.optimizer,
        "layers": [{"name": layer.name, "numel": layer.numel, "trainable_numel": layer.trainable_numel,
                    "params": [[p.name, list(p.shape), p.offset] for p in layer.params]} for layer in layers],
    }


def load_state_dict(trainer, state: Mapping[str, Any]) -> None:
    """``Trainer.load_state_dict``: every name, shape and the layer layout checked before
    anything is written; then the tensors copied into the trainer's views (those that are the
    views already are not copied), the steps, step count and optimizer settings set, and a
    deferred update dropped.

    Raises:
        CheckpointError: a state of another optimizer, layer layout, tensor name or shape (the
            message names it); nothing has changed then.
    """
    mine = state_dict(trainer)  # a pending update is dropped, not applied to what is overwritten
    host = trainer.host
    theirs_spec = spec_of(state["optimizer_settings"])
    if theirs_spec is not host.optimizer:
        raise CheckpointError(f"load_state_dict: the state is of a {theirs_spec.name} trainer (rows "
                              f"{theirs_spec.states}), this trainer runs {host.optimizer.name} (rows "
                              f"{host.optimizer.states}); compile with optimizer={{'name': "
                              f"{theirs_spec.name!r}, ...}} to resume it")
    if state["layers"] != mine["layers"]:
        raise CheckpointError("load_state_dict: the state's layer layout differs from this trainer's; load the "
                              "state of a trainer compiled from the same model")
    pairs = _pairs(state, mine)
    if set(state["adam_steps"]) != set(mine["adam_steps"]):
        raise CheckpointError("load_state_dict: adam_steps name other layers than this trainer's")
    with torch.no_grad(), host.batched_nvme_writes():
        for dst, src in pairs:
            if isinstance(dst, (NvmeRow, SlicedRow)):
                if not dst.same(src):  # written through to the file
                    dst.copy_(as_tensor(src))
            elif isinstance(src, NvmeRow):
                dst.copy_(src.read())
            elif not (dst.data_ptr() == src.data_ptr() and dst.dtype == src.dtype and dst.shape == src.shape):
                dst.copy_(src)
    for li, layer in enumerate(trainer.graph.layers):
        host.steps[li].fill_(float(state["adam_steps"][layer.name]))
    trainer.step_count = int(state["step_count"])
    trainer.set_optimizer(state["optimizer_settings"])
    trainer.drop_pending_updates()


def _pairs(state: Mapping[str, Any], mine: dict[str, Any]) -> list[tuple[Any, Any]]:
    """``(this trainer's view, the state's tensor)`` of every tensor group, names and shapes checked
    (``"masters"`` may be left out: ``"model"`` holds the same weights)."""
    pairs = []
    for group in ("model", "buffers", "masters", "optimizer"):
        if group == "masters" and group not in state:
            continue
        theirs = state[group]
        if set(theirs) != set(mine[group]):
            diff = sorted(set(theirs) ^ set(mine[group]))
            raise CheckpointError(f"load_state_dict: {group} tensors differ from this trainer's: {diff[:8]}")
        for name, dst in mine[group].items():
            src = theirs[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise CheckpointError(f"load_state_dict: {group} tensor {name!r} has shape {list(src.shape)}, "
                                      f"this trainer's {list(dst.shape)}")
            pairs.append((dst, src))
    return pairs


def _sliced_rows(trainer) -> tuple[dict[str, SlicedRow], dict[str, SlicedRow], dict[str, SlicedRow]]:
    """The ``"model"``, ``"masters"`` and ``"optimizer"`` of a host state sharded across nodes:
    :class:`~megatrain.runtime.host.SlicedRow` entries (a load writes each node's part; only
    ``Trainer.save``, on global rank 0, reads them)."""
    host, layers = trainer.host, trainer.graph.layers

    def fetch(layer: int, kind: int) -> torch.Tensor:
        """A whole row of a sharded host state, gathered to global rank 0 while ``Trainer.save`` runs."""
        if trainer.slice_reader is None:
            raise ConfigError(f"layer {layers[layer].name!r}: the host state is sharded across "
                              f"{trainer.plan.nodes} nodes (Plan.host_state='shard'), so its weights are read only "
                              "by Trainer.save, called on every rank; save a checkpoint and read that")
        return trainer.slice_reader.row(layer, kind)

    return ({spec.name: SlicedRow(host, li, MASTER, spec.offset, spec.shape, fetch)
             for li, layer in enumerate(layers) for spec in layer.params},
            {f"{layer.name}.master": SlicedRow(host, li, MASTER, 0, (layer.numel,), fetch)
             for li, layer in enumerate(layers)},
            {f"{layer.name}.{kind}": SlicedRow(host, li, k + 1, 0, (layer.trainable_numel,), fetch)
             for li, layer in enumerate(layers) for k, kind in enumerate(host.optimizer.states)})


__all__ = ["state_dict", "load_state_dict"]
