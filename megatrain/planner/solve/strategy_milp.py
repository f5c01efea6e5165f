"""Strategy "milp": the same search, resident layers chosen by a 0/1 knapsack MILP (HiGHS).

One strategy per file behind one signature, ``(SolveRequest) -> Solution`` (Checkmate's
``core/solvers/strategy_*.py``); ``megatrain.planner.solve.SOLVERS`` names them.
"""

from __future__ import annotations

from megatrain.planner.solve.knapsack import milp_knapsack
from megatrain.planner.solve.request import Solution, SolveRequest
from megatrain.planner.solve.search import Search


def solve_milp(request: SolveRequest) -> Solution:
    """The search of :func:`~megatrain.planner.solve.strategy_enumerate.solve_enumerate` with resident
    layers chosen by a 0/1 knapsack solved exactly (:func:`milp_knapsack`, ``scipy.optimize.milp``).

    Raises:
        InfeasibleRequestError (a PlanError): as ``solve_enumerate``.
        PlanError: HiGHS reports no optimal knapsack solution.
    """
    return Search(request, milp_knapsack).run("milp")


__all__ = ["solve_milp"]
