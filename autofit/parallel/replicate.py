"""Data-parallel replication: whole copies of the model (or of a shard group, HSDP's replicate dim), each training
other rows. Alone it is DDP; with sharding it is HSDP's outer mesh dim (replicate across nodes, shard within)."""

from __future__ import annotations

from typing import Any

from autofit.core.errors import InvalidInputError
from autofit.parallel.dimension import Dimension, Layout, Placement

__all__ = ["REPLICATE"]


class _Replicate(Dimension):
    def choices(self, space: Any):
        """HSDP's replicate sizes the request allows (1: plain FSDP; "auto" across nodes: also one per node)."""
        return tuple(Placement(self.name, r) for r in space.replicate_options)

    def check(self, layout: Layout) -> None:
        replicate = layout.degree(self.name)
        if layout.world_size % replicate:
            raise InvalidInputError(f"replicate {replicate} does not divide world_size {layout.world_size}: HSDP's "
                                    "mesh is (replicate, world_size // replicate); use the number of nodes")


REPLICATE = _Replicate(name="dp_replicate", mesh_rank=1, shares_rows=False, field="replicate")
