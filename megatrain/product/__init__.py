"""The product above the engine: what builds a :class:`~megatrain.trainer.Trainer`, in one place.

Floors, lowest first (each module imports only those below it; tests/test_layering.py):

- ``planning``: :func:`plan_model`, a model and this process's topology into the planning front
  door (:func:`megatrain.planner.front.plan`), a frozen ``PlannedModel``; and :func:`process_topology`;
- ``materializer``: :func:`materialize`, a ``PlannedModel`` into host tiles, a backend and an
  executor: the ``Trainer``;
- ``shapes``: :class:`ShapeFreeTrainer`, compile with no shapes (one plan per batch shape);
- ``build``: :func:`compile` = ``materialize(plan_model(...))``, or a ``ShapeFreeTrainer``;
- ``pretrained``: :func:`from_pretrained`, a local Hugging Face directory through ``compile``.

``megatrain.trainer`` (the running ``Trainer``) is below all of them and imports none.
"""

from megatrain.planner.front import PlannedModel, Schedules
from megatrain.product.planning import plan_model, process_topology
from megatrain.product.materializer import materialize
from megatrain.product.shapes import ShapeFreeTrainer, pad_to_bucket
from megatrain.product.build import compile
from megatrain.product.pretrained import from_pretrained

__all__ = ["PlannedModel", "Schedules", "ShapeFreeTrainer", "compile", "from_pretrained", "materialize",
           "pad_to_bucket", "plan_model", "process_topology"]
