"""The planner: trace -> LayerGraph -> Plan -> Schedule -> verify. Knows nothing of CUDA.

Its one entry for running: :func:`megatrain.planner.front.plan` (``PlanRequest`` ->
``PlannedModel``), which ``megatrain.compile``, ``megatrain train`` and ``megatrain plan`` call;
every planning decision (the plan, data parallel, NVMe placement, host state) is made there.
"""
