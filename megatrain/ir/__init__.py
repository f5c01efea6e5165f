"""The intermediate representation: the records the planner produces and the runtime reads.

``graph`` (LayerGraph: layers, parameters, FLOPs, activation bytes, templates), ``plan`` (Plan: the
solver's decisions), ``schedule`` (Schedule: the explicit DAG of typed ops on streams), ``liveness``
(which activations an op reads and frees), ``hardware`` (HardwareSpec: the machine) and ``issue``
(the issue policy the runtime's issuing thread and the simulator share). It imports nothing from
``megatrain.planner`` or ``megatrain.runtime`` (tests/test_layering.py): the planner builds these
records, the runtime walks them.
"""
