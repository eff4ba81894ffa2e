"""The links a layout's collectives run over and the time of one collective on a ring: what each layout dimension's
``collective_seconds`` (autofit/parallel/) prices its collectives with.

Ring algorithms (NCCL's documented bus bandwidth factors, "NCCL performance" docs): an all-reduce moves 2 (N-1)/N of
the buffer per rank, an all-gather or a reduce-scatter (N-1)/N, at the bandwidth of the slowest link in the ring
(NVLink within a node, the network across nodes: the GPU catalog).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Links", "Ranks", "ring_seconds"]


class Ranks(Protocol):
    """What a ring's links depend on: the job's ranks and how many share a node (``Parallel`` and ``Layout`` both
    say)."""

    @property
    def world_size(self) -> int: ...
    @property
    def gpus_per_node(self) -> int: ...  # 0: every rank on one node


@dataclass(frozen=True)
class Links:
    """The links a layout's collectives run over, in bytes per second per GPU per direction: NVLink within a node,
    the network across nodes (the GPU catalog's)."""

    intra_bytes_per_second: float = 5e9
    inter_bytes_per_second: float = 5e9

    @classmethod
    def of(cls, target) -> Links:
        """The links of a ``DeviceTarget``."""
        return cls(target.interconnect_bytes_per_second, target.network_bytes_per_second)

    def bandwidth(self, parallel: Ranks, group: int, contiguous: bool = True) -> float:
        """The slowest link of a ring over ``group`` of ``parallel``'s ranks: NVLink when the group fits in one node
        (``contiguous`` ranks, as FSDP's shard dim and a reshard group are), else the network (a replicate group
        spans nodes)."""
        per_node = parallel.gpus_per_node or parallel.world_size
        within = group <= per_node if contiguous else per_node >= parallel.world_size
        return self.intra_bytes_per_second if within else self.inter_bytes_per_second


def ring_seconds(kind: str, group: int, nbytes: float, bytes_per_second: float) -> float:
    """One collective over ``group`` ranks on a ring (NCCL's "Performance" notes, nccl-tests doc/PERFORMANCE.md: bus
    bandwidth = algorithm bandwidth x (n-1)/n for all-gather and reduce-scatter, x 2(n-1)/n for all-reduce);
    ``nbytes`` is the whole (unsharded) buffer."""
    if group <= 1:
        return 0.0
    factor = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}[kind]
    return factor * (group - 1) / group * nbytes / bytes_per_second
