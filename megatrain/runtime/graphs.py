"""CUDA graphs of the compute ops (``Plan.cuda_graphs``): each FWD, RECOMPUTE and BWD captured
once per (template, weight slot, variant) and replayed on static buffers.

Why. A block's local backward dispatches ~550 aten ops (~135 compiled); at small micro-batches
the issuing thread, not the GPU, sets the pace (issue 39: the 1B probe step was issue-bound). A
replay is one launch: the GPU runs the captured kernels back to back.

What is captured. The device computation of a compute op, the same function the eager path calls:
a forward (the template under ``no_grad``) or a local backward's
:func:`~megatrain.runtime.executor.backward_body` (the recompute with gradients on,
``torch.autograd.grad``, the weight gradients written or added into the gradient slot). A graph
reads and writes fixed addresses, so a variant is keyed by everything that fixes them or the
captured work: the template (compiled or eager, train or eval), the weight slot and gradient slot
(a layer's weights are views of its slot, its gradients go to views of its gradient slot), the
layer's parameter layout and buffers, whether the gradients are written or added, and which
outputs receive a gradient. Layers that share a template and a slot share its graphs.

Static buffers. Everything else a captured op reads is copied into a static buffer before each
replay, on the compute stream, in the op's own work: its input checkpoints, the incoming gradients
of its outputs, and the loss's seed (a host float, ``StepOutput`` weights, which a capture would
otherwise bake in: it is written into a one-element device tensor with ``fill_``). Its outputs
live in the graphs' memory pool and are overwritten by the next replay of any graph, so they are
copied out (``clone``) right after the replay; an output that is a view of a persistent tensor (a
tied weight the prologue passes on: a view of its slot) is that view, as in eager mode. Replays, copy-ins and copy-outs are all on the
compute stream, one op after the other, so one set of static buffers (by position, shape and
dtype) and one memory pool serve every graph; the pool's size is counted by the memory model
(:func:`megatrain.planner.memory.graph_pool_bytes`).

When. A key's first occurrence in a run runs eagerly (its kernels' lazy initialisation, cuBLAS
workspaces, the compiled template's first call: the warm-up PyTorch's CUDA graph docs ask for)
and is noted; before the next run's first op, :meth:`TemplateGraphs.capture_wanted` captures the
noted variants (between runs: no event record, host op or other stream's work is in flight, so
none falls inside a capture; a capture that fails stops that run before it changed anything).
Later runs replay them.

Random ops. A captured dropout draws from the device generator's state at replay time (PyTorch
registers the default CUDA generator with each capture and offsets its Philox counter per replay),
so the executor's generator replay (``replaying_rng`` around the replay of a recompute) makes it
draw its forward's masks, as in eager mode; the capture itself leaves the generator as it was.

Testing on a CPU. The backend's adapter makes the graphs (``CudaApi.capture`` / ``replay``):
:class:`megatrain.testing.FakeCuda` records the aten ops of the capture and re-dispatches them, on
the same tensors, at replay; it refuses a capture that reads a tensor neither made inside it nor
named static (a forgotten copy-in) or reads a device value on the host (``.item()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from megatrain.errors import ConfigError

Body = Callable[[Sequence[torch.Tensor], Sequence["torch.Tensor | None"], "float | torch.Tensor | None"],
                tuple["torch.Tensor | None", ...]]
"""A compute op's device work: ``body(inputs, output gradients (None where none), loss seed)`` ->
its outputs (a forward's values; a backward's loss and input gradients, None where there are none)."""


@dataclass(frozen=True, slots=True)
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "_Spec":
        return cls(tuple(t.shape), t.dtype)


@dataclass(slots=True)
class _Wanted:
    """A variant seen in a run, to capture after it: its body, what it reads and what else is static."""

    body: Body
    ins: tuple[_Spec, ...]
    seeds: tuple[_Spec | None, ...]
    loss_seed: bool
    static: tuple[torch.Tensor, ...]
    what: str


@dataclass(slots=True)
class _Captured:
    graph: Any
    ins: list[torch.Tensor]
    seeds: list[torch.Tensor | None]
    loss_seed: torch.Tensor | None
    outs: tuple[torch.Tensor | None, ...]
    persistent: tuple[bool, ...]  # the output is a view of a persistent tensor (a slot): not copied out
    replays: int = 0


@dataclass
class TemplateGraphs:
    """The captured compute ops of one executor (module docstring), over ``backend`` (one with
    ``capture`` and ``replay``: :class:`megatrain.runtime.cuda.CUDABackend`).

    ``captured`` by key, ``wanted`` (seen in a run, not captured yet), ``capture_s`` the seconds all
    captures took."""

    backend: Any
    captured: dict[tuple, _Captured] = field(default_factory=dict)
    wanted: dict[tuple, _Wanted] = field(default_factory=dict)
    capture_s: float = 0.0
    _buffers: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def run(self, key: tuple, body: Body, ins: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor | None] = (),
            loss_seed: float | None = None, static: Sequence[torch.Tensor] = (),
            what: str = "") -> tuple[torch.Tensor | None, ...]:
        """The outputs of ``body`` on ``ins``, ``seeds`` and ``loss_seed``: by replaying the graph of
        ``key`` (inputs copied in, outputs copied out), or, before it is captured, by calling
        ``body`` and noting ``key`` for :meth:`capture_wanted`. ``static``: the persistent tensors
        the body reads at fixed addresses (the slots, the layer's buffers). Runs on the compute
        stream, inside the op's work."""
        cap = self.captured.get(key)
        if cap is None:
            if key not in self.wanted:
                self.wanted[key] = _Wanted(body, tuple(_Spec.of(x) for x in ins),
                                           tuple(None if s is None else _Spec.of(s) for s in seeds),
                                           loss_seed is not None, tuple(static), what)
            return body(ins, seeds, loss_seed)
        for dst, x in zip(cap.ins, ins):
            dst.copy_(x, non_blocking=True)
        for dst, s in zip(cap.seeds, seeds):
            if dst is not None:
                dst.copy_(s, non_blocking=True)
        if cap.loss_seed is not None:
            cap.loss_seed.fill_(loss_seed)
        self.backend.replay(cap.graph)
        cap.replays += 1
        return tuple(None if o is None else o if keep else o.clone() for o, keep in zip(cap.outs, cap.persistent))

    def capture_wanted(self, loss_shape: tuple[int, ...], loss_dtype: torch.dtype) -> int:
        """Capture every variant noted since the last call; returns how many. ``loss_shape`` and
        ``loss_dtype``: the loss's (its seed's static buffer). Call between runs (the executor does,
        before a run's first op, with the device's generator state put back after: a capture of a
        random op may draw from it).

        Raises:
            ConfigError: a variant's work cannot be captured (a host read of a device value, a
                tensor read that is not a static buffer); names it and says to run without graphs.
        """
        import time

        wanted, self.wanted = self.wanted, {}
        t0 = time.perf_counter()
        for key, w in wanted.items():
            ins = [self._buffer(("in", k), s) for k, s in enumerate(w.ins)]
            seeds = [None if s is None else self._buffer(("seed", k), s) for k, s in enumerate(w.seeds)]
            loss_seed = self._buffer(("loss",), _Spec(tuple(loss_shape), loss_dtype)) if w.loss_seed else None
            static = [*ins, *(s for s in seeds if s is not None), *([loss_seed] if loss_seed is not None else []),
                      *w.static]
            try:
                graph, outs = self.backend.capture(lambda: w.body(ins, seeds, loss_seed), static)
            except Exception as e:
                raise ConfigError(f"{w.what or key[0]}: its work cannot be captured in a CUDA graph ({type(e).__name__}: "
                                  f"{str(e)[:500]}); train with cuda_graphs=False (megatrain train --cuda-graphs "
                                  "false)") from e
            slots = {t.untyped_storage().data_ptr() for t in w.static}
            self.captured[key] = _Captured(graph, ins, seeds, loss_seed, tuple(outs),
                                           tuple(o is not None and o.untyped_storage().data_ptr() in slots
                                                 for o in outs))
        self.capture_s += time.perf_counter() - t0
        return len(wanted)

    def _buffer(self, role: tuple, spec: _Spec) -> torch.Tensor:
        """The static buffer of ``role`` (its position among a body's inputs or seeds) and ``spec``,
        shared by every graph: the copy into it is in stream order right before each replay."""
        key = (role, spec.shape, spec.dtype)
        t = self._buffers.get(key)
        if t is None:
            t = self._buffers[key] = self.backend.device_empty(spec.shape, spec.dtype).zero_()
        return t

    @property
    def replays(self) -> int:
        """Replays so far, over every graph."""
        return sum(c.replays for c in self.captured.values())


def module_tensors(fn: Any) -> list[torch.Tensor]:
    """The tensors a template reads besides its arguments (its ``get_attr`` constants, parameters and
    buffers; of the module a compiled template wraps): static for a capture."""
    gm = getattr(fn, "_orig_mod", fn)
    if not isinstance(gm, torch.nn.Module):
        return []
    out = [*gm.parameters(), *gm.buffers()]
    for node in getattr(getattr(gm, "graph", None), "nodes", ()):
        if node.op == "get_attr":
            obj: Any = gm
            for part in node.target.split("."):
                obj = getattr(obj, part)
            if isinstance(obj, torch.Tensor):
                out.append(obj)
    return out


def check_backend(backend: Any) -> None:
    """Raise ConfigError unless ``backend`` captures CUDA graphs (``Plan.cuda_graphs`` needs it)."""
    if not (hasattr(backend, "capture") and hasattr(backend, "replay")):
        raise ConfigError(f"the plan captures its compute ops in CUDA graphs (Plan.cuda_graphs), which the "
                          f"{type(backend).__name__} cannot run; train on device='cuda', or set cuda_graphs=False")


__all__ = ["Body", "TemplateGraphs", "check_backend", "module_tensors"]
