"""No import circles in the package: every import of every module of ``megatrain`` (at module level,
inside functions and under ``TYPE_CHECKING`` alike: a lazy import is still an arrow) read from the
sources with ``ast``, as a graph of modules; a strongly connected component of more than one module
is a circle. A submodule's import of its own package's ``__init__`` is not counted as an arrow:
Python imports the parent of every module first, so that arrow is in every import."""

import ast
from pathlib import Path

import networkx as nx

import megatrain

ROOT = Path(megatrain.__file__).parent


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(module: str, path: Path) -> list[str]:
    """The dotted names ``module`` imports (``a.b`` for ``import a.b``, ``a.b.c`` for ``from a.b import
    c``, relative imports resolved), lazy imports inside functions included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names += [f"{base}.{a.name}" for a in node.names]
    return names


def import_graph() -> nx.DiGraph:
    """Modules of ``megatrain`` and the arrows of their imports: ``from a.b import c`` is an arrow
    to the module ``a.b.c`` where there is one, else to ``a.b``."""
    mods = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(mods)
    for module, path in mods.items():
        for name in imported(module, path):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                graph.add_edge(module, name)
    return graph


def test_no_module_imports_itself_back():
    graph = import_graph()
    circles = sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)
    described = ["; ".join(f"{a} -> {b}" for a, b in graph.subgraph(c).edges) for c in circles]
    assert not circles, ("import circles (each a set of modules that import one another, lazily or not): "
                         + " | ".join(described) + ". Move what both sides need to a module below them.")


def test_the_walk_sees_lazy_and_relative_imports():
    graph = import_graph()
    # trainer.py imports the checkpoint lazily, inside Trainer.save.
    assert graph.has_edge("megatrain.trainer", "megatrain.checkpoint")
    assert graph.has_edge("megatrain.planner.solve", "megatrain.planner.solve.search")
    # A circle made on purpose is found.
    graph.add_edge("megatrain.ir.graph", "megatrain.trainer")
    assert any(len(c) > 1 for c in nx.strongly_connected_components(graph))
