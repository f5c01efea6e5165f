"""Layering, read from the sources: the IR (``megatrain.ir``: graph, plan, schedule, liveness,
hardware, issue, layout) imports neither the planner nor the runtime; the planner imports no runtime
(measuring the machine is ``megatrain.runtime.measure``'s); the runtime imports the IR (its buffer
layout is ``Schedule.layout``) and nothing of the planner but the measured Timeline's type; kernels
import neither."""

import ast
from pathlib import Path

import pytest

import megatrain

ROOT = Path(megatrain.__file__).parent


def imports(package: str) -> set[tuple[str, str]]:
    """``(file, imported module or name)`` for every import under ``megatrain/<package>``, lazy
    imports inside functions included."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found |= {(str(path.relative_to(ROOT)), n) for n in names}
    return found


@pytest.mark.parametrize("package, forbidden", [
    ("planner", ("megatrain.runtime", "megatrain.trainer", "megatrain.train", "megatrain.testing")),
    ("runtime", ("megatrain.planner", "megatrain.trainer", "megatrain.train", "megatrain.testing",
                 "megatrain.materializer")),
    ("kernels", ("megatrain.planner", "megatrain.runtime")),
    ("ir", ("megatrain.planner", "megatrain.runtime", "megatrain.trainer", "megatrain.train", "megatrain.testing",
            "megatrain.materializer")),
])
def test_a_layer_imports_nothing_above_it(package, forbidden):
    bad = sorted((f, n) for f, n in imports(package) if n.startswith(forbidden))
    assert not bad, f"megatrain/{package} imports {bad}"


def test_the_check_sees_imports():
    # The checker itself: the runtime does import the IR, lazily or not.
    assert any(n.startswith("megatrain.ir.schedule") for _, n in imports("runtime"))
