"""The layout's part of a step's time, as the time model prices it (``autofit/solve/time_model.py``): what the
optimizer step streams on a rank (the whole model, or FSDP2's shard), the data-parallel collectives (each
dimension's, :func:`collective_seconds`, with the dimensions' own: tensor parallel's all-reduces),
and the host copies and CPU optimizer step of states kept on the host (FSDP2's CPUOffloadPolicy, Note [offload
time], solve/time_model.py). The time model asks one :class:`LayoutTime` for its seconds and reads no field of the
layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from autofit.parallel.collectives import Links
from autofit.parallel import DIMENSIONS
from autofit.parallel.layout import Parallel

__all__ = ["LayoutTime", "layout_time", "collective_seconds", "HOST_OPTIMIZER_BYTES_PER_SECOND"]

# What a CPU optimizer step streams per second through host memory: torch's for-loop (single-tensor) Adam on CPU
# tensors, which is what a CPU-offloaded FSDP2 step runs (foreach kernels are CUDA-only: torch/utils/_foreach_utils.py).
# An assumption for ranking, not a measurement: a few GB/s, well under a server's memory bandwidth, as the per-tensor
# loop and its temporaries cost several passes over memory (the ZeRO-Offload paper, Ren et al. 2021, section 5.1,
# reports PyTorch's CPU Adam several times slower than its vectorised CPU-Adam for the same reason).
HOST_OPTIMIZER_BYTES_PER_SECOND = 5e9


@dataclass(frozen=True)
class LayoutTime:
    """A layout's part of a step's time: ``optimizer_bytes`` the optimizer step reads and writes on a rank,
    ``collectives`` micro-batches -> seconds of communication per step (None: none), and ``host_state_bytes`` the
    fp32 parameter shard FSDP2's CPUOffloadPolicy moves over the host link (None: the states stay on the device)."""

    optimizer_bytes: int = 0
    collectives: Callable[[int], float] | None = None
    host_state_bytes: int | None = None

    def optimizer_seconds(self, bytes_per_second: float, host_transfer: float | None,
                          compute_per_micro: Sequence[float]) -> tuple[float, float]:
        """(the optimizer step's seconds with the collectives', the host copies' seconds that compute does not hide)
        of a step of one micro-batch per entry of ``compute_per_micro`` (its compute seconds), on a device streaming
        ``bytes_per_second`` with a host link of ``host_transfer`` (Note [offload time], solve/time_model.py)."""
        optimizer = self.optimizer_bytes / bytes_per_second
        exposed = 0.0
        if self.host_state_bytes is not None:
            # each micro-batch gathers every unit for forward and for backward (2 shards in), and reduces its fp32
            # gradients to the host (1 shard out): FSDP2 syncs every micro-batch when offloading (Note [offload]);
            # the copies run on FSDP2's own streams, hidden behind compute up to its length; the optimizer then steps
            # on the CPU, streaming parameters, gradients and state through host memory
            per_micro = 3 * self.host_state_bytes / host_transfer
            exposed = sum(max(0.0, per_micro - c) for c in compute_per_micro)
            optimizer = 4 * self.host_state_bytes / HOST_OPTIMIZER_BYTES_PER_SECOND
        if self.collectives is not None:
            optimizer += self.collectives(len(compute_per_micro))
        return optimizer, exposed


def layout_time(parallel: Parallel, param_bytes: int, links: Links, dimension_seconds: float = 0.0) -> LayoutTime:
    """``parallel``'s part of a step's time over ``param_bytes`` of parameters (one rank's: its tensor-parallel
    share, ``Layout.rank_work``): the optimizer streaming them four times (weight, grad, two states; FSDP2 streams
    one shard), the data-parallel collectives of ``parallel``'s data-parallel part (``Parallel.data_parallel``: FSDP2
    over the ranks tensor parallel leaves) over ``links`` with ``dimension_seconds``, the layout dimensions' own per
    optimizer step (``Layout.rank_work``: tensor parallel's all-reduces), and FSDP2's CPUOffloadPolicy's host copies,
    which reduce-scatter every micro-batch (Note [offload], autofit/training/step.py), as
    ``reduce_every_micro_batch`` does (Note [gradient sync under accumulation])."""
    parallel = parallel.data_parallel
    world_size = parallel.world_size
    optimizer_bytes = 4 * param_bytes // parallel.shard_group
    if parallel.offload_states:
        parallel = replace(parallel, reduce_every_micro_batch=True)

    def collectives(micro_batches: int) -> float:
        return collective_seconds(parallel, links, param_bytes, param_bytes, micro_batches) + dimension_seconds

    # one rank holds 1/world_size of the fp32 parameters (FSDP2 keeps fp32 shards whatever it gathers in)
    shard = param_bytes // parallel.shard_group
    return LayoutTime(optimizer_bytes,
                      collectives if (parallel.strategy and world_size > 1) or dimension_seconds else None,
                      shard if parallel.offload_states else None)


def collective_seconds(layout: Parallel, links: Links, param_bytes: float, grad_bytes: float,
                       micro_batches: int) -> float:
    """Seconds of communication per optimizer step of ``layout``'s data-parallel part (no overlap with compute
    assumed: a ranking, not a forecast): each dimension's own (``Dimension.collective_seconds``), the innermost
    first (FSDP2's shard dim, then HSDP's replicate dim). ``layout`` holds no tensor parallel (its all-reduces are
    counted apart; callers pass ``Parallel.data_parallel``)."""
    if layout.strategy is None or layout.world_size <= 1:
        return 0.0
    steps = layout.layout
    seconds = 0.0
    for placement in reversed(steps.placements):
        seconds += DIMENSIONS[placement.dimension].collective_seconds(steps, placement, links, param_bytes,
                                                                      grad_bytes, micro_batches)
    return seconds
