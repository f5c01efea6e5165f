"""Activation-policy families: nested chains of per-layer policies indexed by a depth.

The ``3^n`` KEEP/OFFLOAD/RECOMPUTE choices are searched in a few structured families (offload,
alternate, alternate+offload, segments, segments+offload), each covering the first ``depth``
layers that have a checkpoint, earliest first; :mod:`megatrain.planner.solve` (item 2) says why
these families and why earliest first, with their sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph
from megatrain.ir.plan import ActivationPolicy

KEEP, OFFLOAD, RECOMPUTE = ActivationPolicy.KEEP, ActivationPolicy.OFFLOAD, ActivationPolicy.RECOMPUTE


@dataclass(frozen=True, slots=True)
class Family:
    """A nested chain of activation policies indexed by depth (:mod:`megatrain.planner.solve`, item 2).

    The first ``depth`` layers that have a checkpoint are covered, earliest first: every
    ``period``-th covered layer (an anchor) is ``stored`` (KEEP or OFFLOAD), the others are
    RECOMPUTE; uncovered layers KEEP. ``period == 1`` covers with ``stored`` alone.
    """

    name: str
    stored: ActivationPolicy
    period: int

    def policy(self, eligible: Sequence[int], n_layers: int, depth: int) -> tuple[ActivationPolicy, ...]:
        """One policy per layer, or ``()`` (KEEP everywhere, the Plan's canonical form)."""
        out = [KEEP] * n_layers
        for rank, layer in enumerate(eligible[:depth]):
            out[layer] = self.stored if rank % self.period == self.period - 1 else RECOMPUTE
        return tuple(out) if any(a is not KEEP for a in out) else ()

    def removed(self, eligible: Sequence[int], checkpoint_bytes: Sequence[int]) -> list[int]:
        """``removed[j]``: checkpoint bytes (one micro-batch) not kept on the GPU at depth ``j``."""
        out = [0]
        for rank, layer in enumerate(eligible):
            gone = not (rank % self.period == self.period - 1 and self.stored is KEEP)
            out.append(out[-1] + (checkpoint_bytes[layer] if gone else 0))
        return out

    def offloaded(self, eligible: Sequence[int], checkpoint_bytes: Sequence[int]) -> list[int]:
        """``offloaded[j]``: checkpoint bytes (one micro-batch) offloaded at depth ``j``."""
        out = [0]
        for rank, layer in enumerate(eligible):
            moved = rank % self.period == self.period - 1 and self.stored is OFFLOAD
            out.append(out[-1] + (checkpoint_bytes[layer] if moved else 0))
        return out


def families(n_eligible: int) -> tuple[Family, ...]:
    """The families searched; segments of ``round(sqrt(n))`` only where they differ from pairs."""
    families = [Family("offload", OFFLOAD, 1), Family("alternate", KEEP, 2),
                Family("alternate+offload", OFFLOAD, 2)]
    k = round(math.sqrt(n_eligible))
    if k >= 3:
        families += [Family("segments", KEEP, k), Family("segments+offload", OFFLOAD, k)]
    return tuple(families)


def eligible_layers(graph: LayerGraph) -> list[int]:
    """Layers whose policy matters: they run a forward (not the last) and another layer reads them."""
    return [p for p in range(len(graph.layers) - 1) if cost.checkpoint_bytes(graph, p) > 0]


__all__ = ["Family", "families", "eligible_layers"]
