"""The intermediate representation: the records the planner produces and the runtime reads.

``graph`` (LayerGraph: layers, parameters, FLOPs, activation bytes, templates), ``plan`` (Plan: the
solver's decisions), ``schedule`` (Schedule: the explicit DAG of typed ops on streams), ``liveness``
(which activations an op reads and frees), ``hardware`` (HardwareSpec: the machine), ``issue``
(the issue policy the runtime's issuing thread and the simulator share) and ``layout`` (the buffer
layout lowering records in ``Schedule.layout``: slot, pinned arena, NVMe and gather buffer sizes,
each layer's shards and slices, and the arithmetic that derives them). It imports nothing from
``megatrain.planner`` or ``megatrain.runtime`` (tests/test_layering.py): the planner builds these
records, the runtime walks them.
"""
