"""A fake CUDA graph for CPU tests: capture records the aten ops of the work, replay re-dispatches
them on the same tensors.

What a CUDA graph does, and so what this does: the captured kernels run again at each replay, with
the arguments they had at capture, on the same memory. Tensor arguments are the same tensors
(addresses), so a replay reads what the static buffers hold now and writes the captured outputs
in place; Python scalars are constants of the capture (a host float read when the work was
captured keeps that value at every replay); a random op draws from the generator's state at
replay time (PyTorch offsets a captured Philox counter from the generator's current state).

What it refuses, as :class:`~megatrain.testing.FakeCudaError`, where a GPU would silently compute
garbage or fail to capture:

- the captured work reads a tensor that was made outside the capture and is not one of the
  ``static`` tensors the caller named (the static buffers it copies into before each replay, and
  persistent ones such as the weight slots): a forgotten copy-in, whose replay would read whatever
  that memory holds by then;
- the captured work reads a device value on the host (``.item()``, ``bool(t)``,
  ``aten._local_scalar_dense``): a synchronisation a capture forbids, and a value frozen into it.

The recording is a ``TorchDispatchMode``, below autograd, so a captured ``torch.autograd.grad``
(which runs on the calling thread for CPU tensors) is recorded as the aten ops of its backward. A
compiled (inductor) template does not dispatch its fused kernels through aten, so it cannot be
recorded here: its capture is checked on a GPU.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
               torch.ops.aten.equal.default}
"""Ops that return a device value to the host: a sync inside a capture on a GPU."""


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Recorder(TorchDispatchMode):
    def __init__(self, static: set[int], error: type[Exception]):
        super().__init__()
        self.static = static
        self.made: set[int] = set()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.error = error

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise self.error(f"the captured work reads a device value on the host ({func}: .item(), bool() or a Python "
                             "number from a tensor): on a GPU that synchronises inside the capture, and the value "
                             "would be frozen into every replay; keep it on the device (a static tensor)")
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.numel() and _storage(t) not in self.made \
                    and _storage(t) not in self.static:
                raise self.error(f"the captured work reads a {tuple(t.shape)} {t.dtype} tensor ({func}) made outside the "
                                 "capture that is not one of its static buffers: every replay would read whatever that "
                                 "memory holds then (a forgotten copy-in); copy it into a static buffer before each "
                                 "replay, or name it static if it never changes")
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() and _storage(t) not in self.static:
                self.made.add(_storage(t))
        self.ops.append((func, args, kwargs, out))
        return out


class FakeGraph:
    """The recorded ops of one capture; :meth:`replay` runs them again on the same tensors."""

    def __init__(self, ops: list[tuple[Any, tuple, dict, Any]]):
        self.ops = ops
        self.replays = 0

    @classmethod
    def capture(cls, fn: Callable[[], Any], static: Sequence[torch.Tensor],
                error: type[Exception]) -> tuple["FakeGraph", Any]:
        """Run ``fn`` once, recording its aten ops; ``static``: the tensors made outside the capture
        it may read. Returns ``(graph, fn's return value)``. Raises ``error`` as the module says."""
        rec = _Recorder({_storage(t) for t in static if t.numel()}, error)
        with rec:
            out = fn()
        return cls(rec.ops), out

    def replay(self) -> None:
        """Each recorded op again, with its recorded arguments; a result in new memory is copied into
        the tensor the capture returned (views and in-place results already are it)."""
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                res = func(*args, **kwargs)
                for o, r in zip(tree_leaves(out), tree_leaves(res)):
                    if isinstance(o, torch.Tensor) and o.numel() and _storage(o) != _storage(r):
                        o.copy_(r)
        self.replays += 1


__all__ = ["FakeGraph"]
