"""Data-parallel replication: whole copies of the model (or of a shard group, HSDP's replicate dim), each training
other rows. Alone it is DDP; with sharding it is HSDP's outer mesh dim (replicate across nodes, shard within)."""

from __future__ import annotations

from typing import Any

from autofit.core.errors import InvalidInputError
from autofit.parallel.collectives import Links, ring_seconds
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

    def collective_seconds(self, layout: Layout, placement: Placement, links: Links, param_bytes: float,
                           grad_bytes: float, micro_batches: int) -> float:
        """DDP (no shard dim): one all-reduce of the gradients per step over every rank. HSDP: each rank's gradient
        shard (grad_bytes / S, S the shard dim's ranks) all-reduced across the replicate groups, over the network
        (a replicate group spans nodes)."""
        replicate = placement.degree
        if replicate <= 1:
            return 0.0
        shard = layout.placement("dp_shard")
        if shard is None:
            return ring_seconds("all_reduce", replicate, grad_bytes, links.bandwidth(layout, replicate))
        return ring_seconds("all_reduce", replicate, grad_bytes / shard.degree,
                            links.bandwidth(layout, replicate, contiguous=False))


REPLICATE = _Replicate(name="dp_replicate", mesh_rank=1, shares_rows=False, field="replicate")
