"""Sharding (FSDP2's ``fully_shard``): parameters, gradients and optimizer state split over the ranks of the shard
dim, each training other rows; its options are FSDP2's ``reshard_after_forward`` (ZeRO-3, ZeRO-2, or an int group to
reshard to) and the states on the host. Its degree is the ranks the other dimensions leave (torchtitan's
``dp_shard=-1``)."""

from __future__ import annotations

from typing import Any

from autofit.core.errors import InvalidInputError
from autofit.parallel.collectives import Links, ring_seconds
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

    def collective_seconds(self, layout: Layout, placement: Placement, links: Links, param_bytes: float,
                           grad_bytes: float, micro_batches: int) -> float:
        """FSDP2 over its S ranks: an all-gather of the parameters in every micro-batch's forward; in backward
        another over S (ZeRO-3), none (ZeRO-2: they stayed gathered), or one over the smaller reshard group k (an
        int); one reduce-scatter of the gradients per step, or one per micro-batch with
        ``reduce_every_micro_batch``."""
        shard = placement.degree
        on_shard = links.bandwidth(layout, shard)
        seconds = micro_batches * ring_seconds("all_gather", shard, param_bytes, on_shard)
        raf = placement.option("reshard_after_forward", True)
        if raf is True:
            seconds += micro_batches * ring_seconds("all_gather", shard, param_bytes, on_shard)
        elif raf is not False:
            seconds += micro_batches * ring_seconds("all_gather", raf, param_bytes, links.bandwidth(layout, raf))
        reductions = micro_batches if placement.option("reduce_every_micro_batch", False) else 1
        seconds += reductions * ring_seconds("reduce_scatter", shard, grad_bytes, on_shard)
        return seconds


SHARD = _Shard(name="dp_shard", mesh_rank=2, shares_rows=False, field="world_size")
