"""The base of the enums the planner looks up per op."""

from __future__ import annotations

import enum


class IdentityEnum(enum.Enum):
    """An enum whose members hash by identity (they are singletons, compared by identity).

    Enum's own ``__hash__`` is a Python call that hashes the member's name; the simulator, lowering,
    liveness and the memory model key dicts and sets by stream, op kind, resource and activation
    policy millions of times per solve (``megatrain plan`` of dense-120b on an H200: 15 M calls, 3.9 s
    of a 57 s profile, 2026-12-03). Members of a subclass hash differently from process to process,
    as strings already did (``PYTHONHASHSEED``)."""

    __hash__ = object.__hash__


__all__ = ["IdentityEnum"]
