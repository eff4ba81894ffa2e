"""Sharding (FSDP2's ``fully_shard``): parameters, gradients and optimizer state split over the ranks of the shard
dim, each training other rows; its options are FSDP2's ``reshard_after_forward`` (ZeRO-3, ZeRO-2, or an int group to
reshard to) and the states on the host. Its degree is the ranks the other dimensions leave (torchtitan's
``dp_shard=-1``)."""

from __future__ import annotations

from typing import Any

from autofit.core.errors import InvalidInputError
from autofit.parallel.dimension import Dimension, Layout, Placement

__all__ = ["SHARD"]


class _Shard(Dimension):
    def choices(self, space: Any):
        """One placement per ``reshard_after_forward`` the request allows, over the ranks the others leave."""
        return tuple(Placement(self.name, None, (("reshard_after_forward", raf),)) for raf in space.reshard_options)

    def check(self, layout: Layout) -> None:
        placement = layout.placement(self.name)
        if placement is None or layout.partial:
            return
        shard, raf = placement.degree, placement.option("reshard_after_forward", True)
        if not isinstance(raf, bool) and (raf <= 1 or raf >= shard or shard % raf):
            raise InvalidInputError(
                f"reshard_after_forward={raf} must be a divisor of the shard group size {shard} other than 1 and "
                f"{shard} (torch's fully_shard; use False for 1 and True for {shard}), e.g. the GPUs per node")


SHARD = _Shard(name="dp_shard", mesh_rank=2, shares_rows=False, field="world_size")
