"""The planner: trace -> LayerGraph -> Plan -> Schedule -> verify. Knows nothing of CUDA.

Its one entry for running: ``megatrain.planner.plan(request)`` (:func:`megatrain.planner.front.plan`:
``PlanRequest`` -> ``PlannedModel``), which ``megatrain.compile``, ``megatrain train`` and
``megatrain plan`` call; every planning decision (the plan, data parallel, NVMe placement, host
state) is made there. The records it produces and the runtime reads (graph, plan, schedule,
liveness, hardware, issue) are the IR, :mod:`megatrain.ir`.
"""

_FRONT = ("plan", "PlanRequest", "PlannedModel", "Topology", "Storage")


def __getattr__(name: str):
    # Loaded on first use: importing a planner module (the cost model, say) does not load the
    # tracer and the solver behind the front door.
    if name in _FRONT:
        from megatrain.planner import front

        return getattr(front, name)
    raise AttributeError(f"module 'megatrain.planner' has no attribute {name!r}")


__all__ = list(_FRONT)
