"""Compiled layer templates: each distinct template compiled once with ``torch.compile`` and shared
by every layer that uses it (``Plan.templates == "compiled"``).

A template is a fixed-shape, stateless ``fx.GraphModule`` (the layer's weights, buffers and inputs
in, its outputs out), which is what inductor compiles best: ``torch.compile(template,
fullgraph=True, dynamic=False)`` turns a block's ~190 dispatched aten ops into ~40 fused kernels
(forward) and ~550 into ~135 (backward), measured on the exported Llama template (issue 39). The
executor calls the compiled template where it called the template: under ``no_grad`` for a FWD or
RECOMPUTE (an inference graph), with gradients on for the local backward's recompute, where
AOTAutograd compiles the forward and its backward together and ``torch.autograd.grad`` runs the
compiled backward. The recompute-then-grad semantics of a local backward are unchanged: one
forward with gradients on, then the gradients of the layer's weights and differentiable inputs.

Numerics. FP32: inductor fuses element-wise chains and reorders some sums, so results differ from
eager by a few FP32 roundings (4e-7 relative on a block, issue 39); the trajectory stays within
the suite's 1e-5 of eager AdamW (``tests/test_compiled_templates.py``). BF16:
``emulate_precision_casts`` makes the fused kernels round to BF16 where eager's separate kernels
store BF16 (bitwise equal to eager on the exported block on a 2-core Xeon, 2026-11-28), so the
derived bounds of ``tests/test_exactness.py::bf16_tolerances`` hold unchanged. Random ops:
``fallback_random`` keeps aten's own random kernels (inductor's would draw other numbers), so a
layer's dropout masks are eager's and the executor's generator replay (``DeviceRng``) still makes
every recompute draw its forward's masks.

Caching. Inductor's own caches (its FX graph cache and AOTAutograd cache, keyed by the graph, the
input shapes, strides and dtypes, the config and the torch version) live under
:func:`inductor_cache_dir`: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else ``inductor/`` in
megatrain's cache directory (``$MEGATRAIN_CACHE_DIR``, default ``~/.cache/megatrain``), so a
second run of the same model and shapes loads the compiled kernels instead of generating and
building them again (cold: 50-120 s per template and shape on a 2-core CPU; from the cache: about
1 s, mostly Dynamo's trace). Nothing here keeps a cache of its own.

When. The executor compiles what a schedule's compute ops need before the schedule's first run
(``Executor.compile_templates``; ``materialize`` calls it for the train schedules), by running
each template once in each way the executor calls it on example tensors of the layer's shapes, so
compilation is never hidden in a step: a line says what is compiled and why, and one the time it
took (:class:`CompileReport`). Inputs reach a compiled template contiguous (a no-op for the
executor's own checkpoints), so the strides Dynamo guards on are those of the warm-up.

A template inductor cannot compile whole (a graph break, an unsupported op) is an error naming the
template, its layers and the node where Dynamo stopped: compile with ``templates="eager"``.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from megatrain.errors import UnsupportedModelError

CACHE_ENV = "MEGATRAIN_CACHE_DIR"
"""Environment variable naming megatrain's cache directory (default ``~/.cache/megatrain``)."""

COMPILE_OPTIONS = {"emulate_precision_casts": True, "fallback_random": True}
"""Inductor settings of every compiled template (module docstring, "Numerics"); part of inductor's
cache key, so they are the same for every template."""


def cache_dir() -> Path:
    """megatrain's cache directory: ``$MEGATRAIN_CACHE_DIR``, else ``~/.cache/megatrain`` (not made here)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "megatrain")


def inductor_cache_dir() -> str:
    """Where inductor keeps its caches for this process: ``$TORCHINDUCTOR_CACHE_DIR`` when the user
    set it, else ``inductor/`` under :func:`cache_dir`, which this sets it to (inductor reads the
    variable at each use). Inductor itself writes its default (a directory under /tmp, lost at a
    reboot) into the variable when first imported (transformers imports it), so that value counts
    as unset. Call before compiling."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not current or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_template(gm: Any) -> Callable[..., Any]:
    """``gm`` (a layer template) compiled lazily by ``torch.compile``: inductor, the whole graph or
    an error (``fullgraph=True``), static shapes (``dynamic=False``: a template has one shape), with
    :data:`COMPILE_OPTIONS`. Compiles at its first call in each grad mode."""
    import torch

    return torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False, options=dict(COMPILE_OPTIONS))


@dataclass(frozen=True, slots=True)
class TemplateCompile:
    """One template's compilation: ``template`` (its index), the ``layers`` that share it (names),
    ``seconds`` of wall time (Dynamo, AOTAutograd, inductor and the C++/Triton build, or the cache
    loads), ``graphs`` the calls compiled (the no-grad forward, the forward and backward with
    gradients, an eval variant), ``cache_hits`` of them loaded from inductor's FX graph cache."""

    template: int
    layers: tuple[str, ...]
    seconds: float
    graphs: int
    cache_hits: int = 0


@dataclass(frozen=True, slots=True)
class CompileReport:
    """The templates compiled before a schedule's first run, with the seconds it took in all and
    the cache directory (:func:`inductor_cache_dir`)."""

    templates: tuple[TemplateCompile, ...]
    seconds: float
    cache_dir: str

    def describe(self) -> str:
        """One line: how many templates and graphs, from the cache how many, in how long."""
        graphs = sum(t.graphs for t in self.templates)
        hits = sum(t.cache_hits for t in self.templates)
        return (f"compiled {len(self.templates)} layer template{'s' * (len(self.templates) != 1)} ({graphs} graphs, "
                f"{hits} from the cache in {self.cache_dir}) in {self.seconds:.1f} s")


def announce(templates: dict[int, list[str]], why: str) -> str:
    """The line said before compiling: which templates (and the layers sharing each), and why."""
    parts = [f"template {k} ({_layers(names)})" for k, names in sorted(templates.items())]
    return (f"compiling {len(templates)} layer template{'s' * (len(templates) != 1)} with torch.compile "
            f"(inductor, fullgraph) {why}: {'; '.join(parts)}; cache {inductor_cache_dir()} (cold: a minute or more "
            "per template on a 2-core CPU, seconds from the cache) ...")


def _layers(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more layer{'s' * (len(names) > 2)}"


def inductor_counts() -> tuple[int, int]:
    """``(graphs, cache hits)``: the graphs inductor compiled or loaded so far in this process, and
    how many of them came from its FX graph cache (its own counters)."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    hits = int(c["fxgraph_cache_hit"])
    return hits + int(c["fxgraph_cache_miss"]) + int(c["fxgraph_cache_bypass"]), hits


def compile_error(e: BaseException, gm: Any, template: int, layers: list[str]) -> UnsupportedModelError:
    """The error of template ``template`` (shared by ``layers``) failing to compile: names the template,
    its layers, the node Dynamo stopped at when its message shows one, and the way out."""
    node = _failing_node(str(e), gm)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    where = f" at node {node}" if node else ""
    return UnsupportedModelError(
        f"layer template {template} ({_layers(layers)}) cannot be compiled with torch.compile(fullgraph=True)"
        f"{where}: {type(e).__name__}: {first[:500]}. Compile with templates='eager' (megatrain train --templates "
        "eager) to run the templates uncompiled")


_GRAPH_FRAME = re.compile(r'File "<eval_with_key>[^"]*", line \d+, in forward\s*\n\s*(\w+) = ')


def _failing_node(message: str, gm: Any) -> str | None:
    """``name (target)`` of the template node whose line Dynamo's "from user code" stack shows, if any."""
    found = _GRAPH_FRAME.findall(message)
    if not found:
        return None
    name = found[-1]
    for n in getattr(getattr(gm, "graph", None), "nodes", ()):
        if n.name == name:
            target = getattr(n.target, "__name__", None) or str(n.target)
            return f"{name!r} ({n.op} {target})"
    return repr(name)


def stderr_echo(line: str) -> None:
    """The default reporter of compile progress: one ``megatrain: ...`` line on stderr, at once."""
    print(f"megatrain: {line}", file=sys.stderr, flush=True)


__all__ = ["CACHE_ENV", "COMPILE_OPTIONS", "CompileReport", "TemplateCompile", "announce", "cache_dir", "inductor_counts",
           "compile_error", "compile_template", "inductor_cache_dir", "stderr_echo"]
