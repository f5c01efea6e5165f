"""Strategy "enumerate": the exhaustive search with bounds, resident layers chosen greedily.

One strategy per file behind one signature, ``(SolveRequest) -> Solution`` (Checkmate's
``core/solvers/strategy_*.py``); ``megatrain.planner.solve.SOLVERS`` names them.
"""

from __future__ import annotations

from megatrain.planner.solve.knapsack import greedy_knapsack
from megatrain.planner.solve.request import Solution, SolveRequest
from megatrain.planner.solve.search import Search


def solve_enumerate(request: SolveRequest) -> Solution:
    """Exhaustive search with bounds; resident layers chosen greedily by H2D seconds saved per byte
    (:func:`greedy_knapsack`: optimal when the candidates' slots are of one size).

    Raises:
        InfeasibleRequestError (a PlanError): no plan fits; the message gives the smallest GPU and
            host memory that would work and the layer that is the obstacle.
    """
    return Search(request, greedy_knapsack).run("enumerate")


__all__ = ["solve_enumerate"]
