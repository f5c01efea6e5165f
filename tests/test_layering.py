"""Layering, read from the sources. The package is a building of floors: a module imports only from
the floors below its own (lazy imports inside functions included), never from its own floor's other
units or above. A unit is a subpackage of ``megatrain`` or a top-level module; :data:`FLOORS` lists
them, lowest first, and every unit has its place there.

The floors that matter most: the IR (``megatrain.ir``: graph, plan, schedule, liveness, hardware,
issue, layout) imports neither the planner nor the runtime; the planner imports no runtime
(measuring the machine is ``megatrain.runtime.measure``'s); the runtime imports the IR (its buffer
layout is ``Schedule.layout``) and nothing of the planner; kernels import nothing of megatrain; the
data imports neither the planner nor the runtime; ``megatrain.trainer`` (the running ``Trainer``)
imports nothing that builds it (``megatrain.product``: compile, plan_model, materialize, the
shape-free trainer, from_pretrained), and ``megatrain train`` (``megatrain.train``) and the CLI sit on
top. Import circles inside a unit are tests/test_import_cycles.py's."""

import ast
from pathlib import Path

import pytest

import megatrain
from test_import_cycles import import_graph

ROOT = Path(megatrain.__file__).parent

FLOORS = [
    # what everything may use: errors, units, lazy names, and the kernels (plain torch functions)
    {"megatrain.errors", "megatrain.units", "megatrain.lazy", "megatrain.kernels"},
    # settings at the boundary (pydantic), files a run writes and opens, safetensors files read and
    # written (hashed, in shards), the sizes refused at once, loading from a model directory without its code
    {"megatrain.config", "megatrain.files", "megatrain.safetensors_io", "megatrain.bounds", "megatrain.hf_load"},
    # optimizers as data; what a checkpoint directory holds, and its manifest's checks
    {"megatrain.optim", "megatrain.checkpoint_format"},
    # the records the planner makes and the runtime walks; which models are supported; the front page
    # (its eager names; the rest load on first use); Hugging Face weights into a trainer's state_dict
    {"megatrain.ir", "megatrain.models", "megatrain", "megatrain.hf_weights"},
    # the engine's two halves, and the data, each unaware of the others
    {"megatrain.planner", "megatrain.runtime", "megatrain.data"},
    # what uses both halves: checkpoints (over the runtime's host state), RL heads, the fake CUDA layers;
    # a batch checked and cut as traced; a trainer's state as views of its host rows
    {"megatrain.checkpoint", "megatrain.rl", "megatrain.testing", "megatrain.batches", "megatrain.training_state"},
    # the running object
    {"megatrain.trainer"},
    # the product: what builds a Trainer
    {"megatrain.product"},
    # megatrain train, and the documented path of shape-free compile
    {"megatrain.train", "megatrain.shapes"},
    # the command line
    {"megatrain.cli"},
]
FLOOR = {unit: i for i, floor in enumerate(FLOORS) for unit in floor}


def unit(module: str) -> str:
    """The unit of a module: ``megatrain`` itself, or ``megatrain.<first part>``."""
    return ".".join(module.split(".")[:2])


def test_every_unit_has_a_floor():
    units = {unit(m) for m in import_graph().nodes}
    assert units == set(FLOOR), (f"units without a floor: {sorted(units - set(FLOOR))}; floors naming no unit: "
                                 f"{sorted(set(FLOOR) - units)}: place each in FLOORS")
    assert sum(len(f) for f in FLOORS) == len(FLOOR), "a unit is on two floors"


def test_a_unit_imports_only_from_floors_below():
    bad = sorted(f"{a} -> {b} (floor {FLOOR[unit(a)]} -> {FLOOR[unit(b)]})" for a, b in import_graph().edges
                 if unit(a) != unit(b) and FLOOR[unit(b)] >= FLOOR[unit(a)])
    assert not bad, "imports that run sideways or up a floor: " + "; ".join(bad)


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
                 "megatrain.product")),
    ("kernels", ("megatrain.planner", "megatrain.runtime")),
    ("ir", ("megatrain.planner", "megatrain.runtime", "megatrain.trainer", "megatrain.train", "megatrain.testing",
            "megatrain.product")),
    ("data", ("megatrain.planner", "megatrain.runtime", "megatrain.trainer", "megatrain.train",
              "megatrain.product")),
])
def test_a_layer_imports_nothing_above_it(package, forbidden):
    bad = sorted((f, n) for f, n in imports(package) if n.startswith(forbidden))
    assert not bad, f"megatrain/{package} imports {bad}"


def test_the_trainer_imports_nothing_that_builds_it():
    bad = sorted(b for a, b in import_graph().edges
                 if a == "megatrain.trainer" and unit(b) in {"megatrain.product", "megatrain.train", "megatrain.shapes"})
    assert not bad, f"megatrain/trainer.py imports {bad}"


def test_the_check_sees_imports():
    # The checker itself: the runtime does import the IR, lazily or not.
    assert any(n.startswith("megatrain.ir.schedule") for _, n in imports("runtime"))
    # And a unit placed too low is found: the trainer imports the runtime.
    assert FLOOR["megatrain.trainer"] > FLOOR["megatrain.runtime"]
    assert import_graph().has_edge("megatrain.trainer", "megatrain.runtime.executor")
