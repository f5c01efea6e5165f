"""Names of a package that load their module on first use (PEP 562), so that importing the package
costs only what its eager names need: ``megatrain --help``, the config's validation and the checks
``megatrain train`` makes before torch loads (:mod:`megatrain.train.early`) import no torch."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, table: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package ``package`` (its ``__name__``) whose names in
    ``table`` (name -> module) load on first use; each is then a global of the package, so later
    lookups do not come here.

    Raises (from ``__getattr__``):
        AttributeError: a name neither in ``table`` nor a global of the package.
    """
    import sys

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
