"""Export: the model, wrapped to return only its scalar loss, as one aten graph.

``torch.export.export(strict=False)`` runs on the device the parameters are on (``meta`` for a
model too large to build, where export runs on fake tensors and costs no parameter memory). Plain
``torch.fx.symbolic_trace`` cannot follow Hugging Face transformers 5.x models; non-strict export
can, and it lifts parameters and buffers into graph inputs and records in each node's
``nn_module_stack`` the chain of modules that called it, which :mod:`.cut` reads. A failure names
the module that was running.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import nn

from megatrain.errors import TraceError, UnsupportedModelError

if TYPE_CHECKING:
    from megatrain.planner.trace.context import TraceContext

WRAPPED = "inner"  # attribute name of the user's model inside the loss wrapper


class _LossOnly(nn.Module):
    """Calls the user's model with keyword batch inputs and returns only the scalar loss."""

    def __init__(self, model: nn.Module, input_names: Sequence[str], call=None):
        super().__init__()
        setattr(self, WRAPPED, model)
        self.input_names = tuple(input_names)
        self.call = call  # a vision-language family's own way to call the model (TraceOptions.call)
        params = inspect.signature(model.forward).parameters
        # A KV cache is for generation; in training it only adds graph inputs and copies.
        self.extra = {"use_cache": False} if "use_cache" in params else {}

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        model, inputs = getattr(self, WRAPPED), dict(zip(self.input_names, batch))
        out = model(**inputs, **self.extra) if self.call is None else self.call(model, **inputs, **self.extra)
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


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s first floating parameter (float32 when it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def model_device(model: nn.Module) -> torch.device:
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


def _export(model: nn.Module, input_names: Sequence[str], example: tuple[torch.Tensor, ...], call=None):
    wrapper = _LossOnly(model, input_names, call)
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


@contextlib.contextmanager
def parameters_as(module: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Inside the block, ``module``'s floating parameters hold their values cast to ``dtype`` (each
    parameter's ``.data``, put back after; shared and tied parameters once); buffers keep theirs.
    This is how mixed precision as PyTorch's FSDP2 (``MixedPrecisionPolicy(param_dtype=...)``) and
    DeepSpeed's ``bf16`` run a model: parameters in the compute dtype, buffers (rotary frequencies)
    as the model made them. On the meta device it costs nothing; elsewhere one copy of each
    parameter in ``dtype`` for the duration. None: nothing changes."""
    saved: list[tuple[nn.Parameter, torch.Tensor]] = []
    try:
        if dtype is not None:
            seen: set[int] = set()
            for p in module.parameters():
                if id(p) in seen or not p.is_floating_point() or p.dtype == dtype:
                    continue
                seen.add(id(p))
                saved.append((p, p.data))
                p.data = p.data.to(dtype)
        yield
    finally:
        for p, data in saved:
            p.data = data


def strip_wrapper(fqn: str) -> str:
    """``fqn`` as the user's model names it: without the loss wrapper's ``inner.`` prefix."""
    return fqn[len(WRAPPED) + 1:] if fqn.startswith(WRAPPED + ".") else fqn


def check_model(model: nn.Module, input_names: Sequence[str] = ()) -> None:
    """Raise UnsupportedModelError unless ``model`` has a parameter that requires grad and its
    ``forward`` takes every name of ``input_names`` as a keyword (or has ``**kwargs``)."""
    model_device(model)
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no trainable parameters (all have requires_grad=False): "
            "there is nothing to train")
    params = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    takes = [n for n, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                       inspect.Parameter.KEYWORD_ONLY)]
    missing = [n for n in input_names if n not in takes]
    if missing:
        raise UnsupportedModelError(
            f"{type(model).__name__}.forward takes no {missing} (its inputs: {takes}); compile with "
            f"input_names from those, or give forward those arguments")


def export(ctx: TraceContext) -> None:
    """Pass: export ``ctx.module`` on batches of zeros and read its graph signature into ``ctx``.

    With ``ctx.options.param_dtype`` the floating parameters are exported in that dtype
    (:func:`parameters_as`), so the graph computes as the model does built in it: a BF16-built
    template's residual stream, checkpoints and casts are BF16 where an FP32 model's are FP32.

    Fills ``example`` (one ``[micro_batch_size, seq_len]`` long tensor per batch input, or zeros of
    its ``options.input_shapes`` entry, on the parameters' device), ``program``, ``gm``, ``user_inputs`` and the maps from placeholder names
    to parameter, buffer and constant names (as the user's model names them), and ``trainable``.
    Raises TraceError naming the module that was running when export failed.
    """
    o = ctx.options
    device = model_device(ctx.module)
    shapes = {name: (shape, dtype) for name, shape, dtype in o.input_shapes}
    token = ((o.micro_batch_size, o.seq_len), torch.long)
    ctx.example = tuple(torch.zeros(*shapes.get(name, token)[0], dtype=shapes.get(name, token)[1], device=device)
                        for name in o.input_names)
    with parameters_as(ctx.module, o.param_dtype):
        ctx.program = _export(ctx.module, o.input_names, ctx.example, o.call)
    ctx.gm = ctx.program.graph_module
    sig = ctx.program.graph_signature
    # A tied parameter has several names (``lm_head.weight`` and ``model.embed_tokens.weight``);
    # export may pick any: use the one ``named_parameters()`` lists, the name its checkpoints use.
    first = {id(p): name for name, p in reversed(list(ctx.module.named_parameters(remove_duplicate=False)))}
    canonical = {name: first[id(p)] for name, p in ctx.module.named_parameters(remove_duplicate=False)}
    ctx.param_of = {k: canonical.get(strip_wrapper(v), strip_wrapper(v)) for k, v in sig.inputs_to_parameters.items()}
    ctx.user_inputs = list(sig.user_inputs)
    ctx.buffer_of = {k: strip_wrapper(v) for k, v in sig.inputs_to_buffers.items()}
    ctx.const_of = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    ctx.trainable = {name: p.requires_grad for name, p in ctx.module.named_parameters()}


__all__ = ["WRAPPED", "check_model", "export", "model_device", "model_dtype", "parameters_as", "strip_wrapper"]
