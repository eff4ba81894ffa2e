"""The parallel layout's home: one module per way a step is split across GPUs, registered (Note [layout
dimensions], autofit/parallel/dimension.py).

:data:`DIMENSIONS` lists them in enumeration order (the first outermost: the planner tries every layout without
tensor parallel before those with it, replicate sizes before reshard options); their mesh order is each one's
``mesh_rank`` (torchtitan's: pp, dp_replicate, dp_shard, tp)."""

from __future__ import annotations

from autofit.parallel.dimension import Dimension, Layout, Placement, Registry, enumerate_layouts
from autofit.parallel.exports import ExportFragment, ExportInputs
from autofit.parallel.pipeline import PIPELINE
from autofit.parallel.replicate import REPLICATE
from autofit.parallel.shard import SHARD
from autofit.parallel.tensor import TENSOR

__all__ = ["DIMENSIONS", "Dimension", "ExportFragment", "ExportInputs", "Layout", "Placement", "Registry",
           "enumerate_layouts"]

DIMENSIONS = Registry((TENSOR, REPLICATE, SHARD, PIPELINE))
