"""Resident layers as a 0/1 knapsack, behind one plain-data signature.

``(values, weights, capacity) -> chosen indices``, as ``torch/_functorch/_activation_checkpointing/
knapsack.py`` has it: a value per layer (the H2D seconds residency saves), a weight (the GPU bytes
of its slot) and the bytes left. :func:`greedy_knapsack` (value per byte) serves
``strategy_enumerate``, :func:`milp_knapsack` (``scipy.optimize.milp``, HiGHS) ``strategy_milp``.
"""

from __future__ import annotations

from typing import Callable, Sequence

from megatrain.errors import PlanError

Knapsack = Callable[[Sequence[float], Sequence[int], int], frozenset[int]]


def greedy_knapsack(values: Sequence[float], weights: Sequence[int], capacity: int) -> frozenset[int]:
    """Items by value per unit of weight (ties: lower index), each taken while it fits.

    Optimal when every weight is equal (resident blocks of one size), within one item's value
    otherwise (an embedding or LM head's slot is sized for it, not for a block). Items of value <= 0 are never taken.
    """
    order = sorted((i for i, v in enumerate(values) if v > 0),
                   key=lambda i: (-values[i] / max(weights[i], 1), i))
    chosen, left = [], capacity
    for i in order:
        if weights[i] <= left:
            chosen.append(i)
            left -= weights[i]
    return frozenset(chosen)


def milp_knapsack(values: Sequence[float], weights: Sequence[int], capacity: int) -> frozenset[int]:
    """The 0/1 knapsack solved by ``scipy.optimize.milp`` (HiGHS branch and cut), optimal to HiGHS's
    tolerances (totals closer than about 1e-6 of the largest value are not told apart).

    Items with equal value and weight (the identical blocks of a transformer) form one integer
    variable, how many of them to take, and the lowest indices of a group are taken, as
    :func:`greedy_knapsack` breaks ties; this also shrinks a 96-block model to a handful of
    variables. Items of value <= 0 are never taken. Trivial instances (nothing fits, or everything
    does) are answered without calling HiGHS.

    Raises:
        PlanError: HiGHS reports no optimal solution (it should not for a knapsack).
    """
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    items = [i for i, v in enumerate(values) if v > 0 and weights[i] <= capacity]
    if not items:
        return frozenset()
    if sum(weights[i] for i in items) <= capacity:
        return frozenset(items)
    groups: dict[tuple[float, int], list[int]] = {}
    for i in items:
        groups.setdefault((values[i], weights[i]), []).append(i)
    keys = list(groups)
    v = np.array([k[0] for k in keys], dtype=float)
    w = np.array([k[1] for k in keys], dtype=float)
    count = np.array([len(groups[k]) for k in keys], dtype=float)
    res = milp(c=-v / v.max(), integrality=np.ones(len(keys)), bounds=Bounds(0, count),
               constraints=LinearConstraint(w[None, :], ub=float(capacity)),
               options={"mip_rel_gap": 0.0})
    if res.status != 0 or res.x is None:
        raise PlanError(f"scipy.optimize.milp (HiGHS) found no optimal resident-layer selection: {res.message}. "
                        "Fix: use solve(request, method='enumerate')")
    chosen: list[int] = []
    for k, x in zip(keys, res.x):
        chosen.extend(sorted(groups[k])[:int(round(x))])
    return frozenset(chosen)


__all__ = ["Knapsack", "greedy_knapsack", "milp_knapsack"]
