"""The executor: walks a Schedule's ops in order and runs each on its backend.

Layers run through stateless templates: one ``fx.GraphModule`` per kind of layer, called with the
layer's weights bound as views of the buffer slot they were copied into (no copy at bind). A local
backward recomputes the layer's forward from its saved input checkpoint with gradients on, then
calls ``torch.autograd.grad`` for the layer's weights (as one flat slot view, so the gradient lands
in one contiguous tensor) and its differentiable inputs; no autograd graph outlives the op.

The executor decides nothing: which slot, which ring tile, which order — all come from the
Schedule. What it derives mechanically is when a checkpoint or a gradient is no longer read (after
the last op in the list that reads it), so it can be freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.optim.adamw import adamw

from megatrain.config import AdamW
from megatrain.planner.graph import LayerGraph
from megatrain.planner.schedule import OpKind, Schedule
from megatrain.planner.trace import TracedModel, retarget
from megatrain.runtime.backend import Backend
from megatrain.runtime.host import HostState


@dataclass
class _Slots:
    weights: list[torch.Tensor]
    grads: list[torch.Tensor]
    ring: list[torch.Tensor]


@dataclass
class StepOutput:
    """Losses of one schedule run: ``losses[mb]`` is micro-batch ``mb``'s scalar loss (a float)."""

    losses: list[float] = field(default_factory=list)


class Executor:
    """Runs schedules of one traced model on one backend, against one host state."""

    def __init__(self, traced: TracedModel, host: HostState, backend: Backend, optimizer: AdamW,
                 buffers: dict[str, torch.Tensor]):
        self.graph: LayerGraph = traced.graph
        self.host = host
        self.backend = backend
        self.optimizer = optimizer
        dev = backend.device
        self.templates = [retarget(gm, dev) for gm in traced.templates]
        self.layer_buffers = [[buffers[name].to(dev) for name in layer.buffers] for layer in self.graph.layers]
        self._slots: _Slots | None = None
        self._slot_key: tuple[int, int] | None = None
        # Per schedule (by identity, holding it alive): when each checkpoint is read for the last time.
        self._last_read: dict[int, tuple[Schedule, dict[int, list[tuple[int, int]]]]] = {}

    # -- memory ----------------------------------------------------------------------------------
    def _ensure_slots(self, schedule: Schedule) -> _Slots:
        n_slots = schedule.plan.slots + len(schedule.plan.resident)
        key = (n_slots, schedule.plan.grad_ring)
        if self._slots is None or self._slot_key != key:
            width = max(layer.numel for layer in self.graph.layers)
            gwidth = max(layer.trainable_numel for layer in self.graph.layers) or 1
            be = self.backend
            self._slots = _Slots(
                weights=[be.device_empty((width,), torch.float32) for _ in range(n_slots)],
                grads=[be.device_empty((gwidth,), torch.float32) for _ in range(n_slots)],
                ring=[be.host_empty((gwidth,), torch.float32) for _ in range(schedule.plan.grad_ring)])
            self._slot_key = key
        return self._slots

    # -- running ---------------------------------------------------------------------------------
    def run(self, schedule: Schedule, micro_batches: Sequence[dict[str, torch.Tensor]]) -> StepOutput:
        """Run ``schedule`` on ``micro_batches`` (one dict of input tensors per micro-batch)."""
        g = self.graph
        M = schedule.plan.micro_batches
        if len(micro_batches) != M:
            raise ValueError(f"schedule expects {M} micro-batches, got {len(micro_batches)}")
        slots = self._ensure_slots(schedule)
        dev = self.backend.device
        acts: dict[tuple[int, int], torch.Tensor] = {}
        grads: dict[tuple[int, int], torch.Tensor] = {}
        for mb, batch in enumerate(micro_batches):
            for name in g.batch_inputs:
                acts[(g.value_by_name(name).id, mb)] = batch[name].to(dev, non_blocking=True)
        if id(schedule) not in self._last_read:
            self._last_read[id(schedule)] = (schedule, _last_readers(schedule, g))
        last_read = self._last_read[id(schedule)][1]
        out = StepOutput(losses=[0.0] * M)
        loss_tensors: dict[int, torch.Tensor] = {}
        events: list[Any] = [None] * len(schedule.ops)

        for i, op in enumerate(schedule.ops):
            waits = [events[d] for d in op.deps if schedule.ops[d].stream is not op.stream and events[d] is not None]
            layer = g.layers[op.layer]
            if op.kind is OpKind.H2D:
                fn = self._h2d(slots.weights[op.slot], op.layer)
            elif op.kind is OpKind.FWD:
                fn = self._fwd(op.layer, op.mb, slots.weights[op.slot], acts, loss_tensors)
            elif op.kind is OpKind.BWD:
                fn = self._bwd(op.layer, op.mb, slots, op.slot, acts, grads, loss_tensors, M)
            elif op.kind is OpKind.D2H:
                n = layer.trainable_numel
                fn = _copy(slots.ring[op.ring][:n], slots.grads[op.slot][:n])
            elif op.kind is OpKind.OPT:
                fn = self._opt(op.layer, slots.ring[op.ring])
            else:  # pragma: no cover - OpKind is closed
                raise AssertionError(op.kind)
            events[i] = self.backend.launch(op.stream, fn, waits)
            for key in last_read.get(i, ()):
                acts.pop(key, None)
            if op.kind is OpKind.BWD:
                for vid in layer.outputs:
                    grads.pop((vid, op.mb), None)
        self.backend.synchronize()
        for mb, t in loss_tensors.items():
            out.losses[mb] = float(t)
        return out

    def _h2d(self, slot: torch.Tensor, layer: int):
        src = self.host.master(layer)
        return _copy(slot[:src.numel()], src)

    def _bind(self, layer: int, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[p.offset:p.offset + p.numel].view(p.shape) for p in self.graph.layers[layer].params]

    def _fwd(self, li: int, mb: int, slot: torch.Tensor, acts, loss_tensors):
        layer = self.graph.layers[li]
        tmpl = self.templates[layer.template]
        bufs = self.layer_buffers[li]
        loss_id = self.graph.loss

        def run() -> None:
            with torch.no_grad():
                outs = tmpl(*self._bind(li, slot[:layer.numel]), *bufs, *[acts[(v, mb)] for v in layer.inputs])
            for vid, t in zip(layer.outputs, outs):
                if vid == loss_id:
                    loss_tensors[mb] = t.detach()
                else:
                    acts[(vid, mb)] = t
        return run

    def _bwd(self, li: int, mb: int, slots: _Slots, s: int, acts, grads, loss_tensors, M: int):
        g = self.graph
        layer = g.layers[li]
        tmpl = self.templates[layer.template]
        bufs = self.layer_buffers[li]

        def run() -> None:
            with torch.enable_grad():
                flat = slots.weights[s][:layer.numel].detach().requires_grad_(layer.trainable_numel > 0)
                ins = []
                diff = []
                for vid in layer.inputs:
                    x = acts[(vid, mb)]
                    if g.values[vid].requires_grad:
                        x = x.detach().requires_grad_(True)
                        diff.append((vid, x))
                    ins.append(x)
                outs = tmpl(*self._bind(li, flat), *bufs, *ins)
                roots, seeds = [], []
                for vid, t in zip(layer.outputs, outs):
                    if vid == g.loss:
                        loss_tensors[mb] = t.detach()
                        roots.append(t)
                        # Step loss is the mean over micro-batches, as in eager accumulation of loss / M.
                        seeds.append(torch.full_like(t, 1.0 / M))
                    elif (vid, mb) in grads and t.requires_grad:
                        roots.append(t)
                        seeds.append(grads[(vid, mb)])
                wrt = ([flat] if layer.trainable_numel > 0 else []) + [x for _, x in diff]
                if not roots or not wrt:
                    return
                res = torch.autograd.grad(roots, wrt, seeds, allow_unused=True)
            if layer.trainable_numel > 0:
                gflat, res = res[0], res[1:]
                gslot = slots.grads[s][:layer.trainable_numel]
                if gflat is None:  # the loss does not depend on this layer's weights
                    if mb == 0:
                        gslot.zero_()
                elif mb == 0:
                    gslot.copy_(gflat[:layer.trainable_numel])
                else:
                    gslot.add_(gflat[:layer.trainable_numel])
            for (vid, _), gx in zip(diff, res):
                if gx is None:
                    continue
                key = (vid, mb)
                grads[key] = grads[key] + gx if key in grads else gx
        return run

    def _opt(self, li: int, ring_tile: torch.Tensor):
        layer = self.graph.layers[li]
        n = layer.trainable_numel
        h = self.host
        cfg = self.optimizer

        def run() -> None:
            adamw(
                [h.master(li)[:n]], [ring_tile[:n]], [h.exp_avg(li)[:n]], [h.exp_avg_sq(li)[:n]], [],
                [h.steps[li]], fused=True, amsgrad=False, beta1=cfg.betas[0], beta2=cfg.betas[1],
                lr=cfg.lr, weight_decay=cfg.weight_decay, eps=cfg.eps, maximize=False)
        return run


def _copy(dst: torch.Tensor, src: torch.Tensor):
    def run() -> None:
        dst.copy_(src, non_blocking=True)
    return run


def _last_readers(schedule: Schedule, g: LayerGraph) -> dict[int, list[tuple[int, int]]]:
    """For each op index, the (value, micro-batch) checkpoints no later op reads."""
    last: dict[tuple[int, int], int] = {}
    for i, op in enumerate(schedule.ops):
        if op.kind in (OpKind.FWD, OpKind.BWD):
            for vid in g.layers[op.layer].inputs:
                last[(vid, op.mb)] = i
    by_op: dict[int, list[tuple[int, int]]] = {}
    for key, i in last.items():
        by_op.setdefault(i, []).append(key)
    return by_op
