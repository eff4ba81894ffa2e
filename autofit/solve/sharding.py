"""The layout's choices for the planner, re-exported: they are the layout's, ``autofit/parallel/choices.py`` (the
layouts to plan, FSDP2's units, the collectives' floor), with the layout value, its collectives and tensor parallel's
share of a step (``autofit/parallel/layout.py``, ``collectives.py``, ``tensor.py``), so that the modules importing
them from here keep working."""

from __future__ import annotations

from autofit.parallel.choices import LayoutRequest, collective_floor, layouts, shard_units  # re-exported
from autofit.parallel.collectives import Links, ring_seconds  # re-exported
from autofit.parallel.layout import Parallel, Strategy, collective_seconds, layout_words, ranks_per_node  # re-exported
from autofit.parallel.tensor import split_ops, tensor_group_bytes, tensor_reduce_bytes  # re-exported, likewise

__all__ = ["Parallel", "LayoutRequest", "layouts", "tensor_group_bytes", "tensor_reduce_bytes", "split_ops",
           "layout_words", "shard_units", "collective_seconds", "collective_floor", "ranks_per_node", "Links",
           "Strategy", "ring_seconds"]
