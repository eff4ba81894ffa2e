"""The layout's part of a training job's processes (issue 54): which trainer a layout runs, the process group it
needs, where its step computes, the model laid out with its optimizer, the batches it can split, the rows each rank
trains of a batch and the loss normalisation across ranks; and the processes ``measure`` runs a layout's step in.

The trainers (``autofit/emit/trainer.py``, ``emit/distributed.py``) ask these for the finished thing and read no field
of the layout: what a rank trains, and why a job cannot run a layout, are the layout's to say (Note [layout
dimensions], autofit/parallel/dimension.py). The model itself is laid out by :mod:`autofit.parallel.apply`, the one
module that builds meshes and wraps models; this module only picks what the trainer's layout needs of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from autofit.core.errors import InvalidInputError
from autofit.parallel.apply import apply_layout, device_mesh
from autofit.parallel.sequence_parallel import require_sequence_split

if TYPE_CHECKING:
    from autofit.parallel.layout import Parallel

__all__ = ["RankRows", "computes_on", "join_process_group", "lay_out_for_training", "measured_processes", "rank_rows_of",
           "require_split_batch", "trainer_for"]

T = TypeVar("T")


def trainer_for(layout: Parallel, one_process: Callable[[], T], laid_out: Callable[[], T]) -> T:
    """The trainer ``layout`` runs: ``laid_out()`` (the distributed trainer) for a layout over several processes or
    with any strategy (FSDP2 on one process keeping the states on the host), ``one_process()`` otherwise."""
    return laid_out() if layout.world_size > 1 or layout.strategy is not None else one_process()


def measured_processes(layout: Parallel, one_process: Callable[[], T], ranks: Callable[[int], T]) -> T:
    """What ``measure`` runs a step of ``layout`` in on this machine: ``one_process()`` (the caller's own) for a layout
    of one process, ``ranks(n)`` (one process per rank, spawned by the caller) for a layout over ``n``; a typed error
    where ``layout`` keeps the states on the host, which needs FSDP2 on a process group that only the trainer makes
    (Note [offload])."""
    if layout.offload_states:
        raise InvalidInputError(
            "measure runs one plain process and offload_states needs FSDP2 on a process group: measure a "
            "CPU-offloaded step through plan.wrap() (the trainer) and torch's allocator statistics instead"
        )
    return ranks(layout.world_size) if layout.world_size > 1 else one_process()


def computes_on(layout: Parallel, planned: str, parameters: str) -> str:
    """The device type a step of ``layout`` computes on: the parameters' (``parameters``), but where the layout keeps
    them in host memory (FSDP2 CPUOffloadPolicy, Note [offload]) the plan's device (``planned``)."""
    return planned if layout.offload_states else parameters


def require_split_batch(layout: Parallel, tensors, what: str) -> None:
    """A typed error where ``layout``'s sequence parallel cannot split the tensors of a batch (``what``) evenly over
    a tensor-parallel group (:func:`~autofit.parallel.sequence_parallel.require_sequence_split`): the trainer's
    check of every batch."""
    require_sequence_split(layout.tensor_plan, layout.tensor_parallel, tensors, what)

def join_process_group(layout: Parallel, backend: Callable[[], str]) -> bool:
    """Check that this job's ``torch.distributed`` process group runs ``layout``, raising :class:`InvalidInputError`
    with what to do where not. FSDP2 on one process with the states on the host (Note [offload]) needs a process group
    of one: where none is initialised it is made here, torch's own, on ``backend()``; True then (the caller destroys
    it)."""
    import torch.distributed as dist

    ranks, own = layout.world_size, False
    if layout.offload_states and ranks == 1 and dist.is_available() and not dist.is_initialized():
        dist.init_process_group(backend(), store=dist.HashStore(), rank=0, world_size=1)
        own = True
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInputError(
            f"this plan is for {ranks} processes ({layout.strategy}): call "
            "torch.distributed.init_process_group() first (e.g. run under torchrun)"
        )
    if dist.get_world_size() != ranks:
        raise InvalidInputError(
            f"the plan is for world_size {ranks} but this job has {dist.get_world_size()} processes: "
            "plan again with world_size=torch.distributed.get_world_size()"
        )
    return own


def lay_out_for_training(model: nn.Module, optimizer: torch.optim.Optimizer | Callable, layout: Parallel, *,
                         gradient_as_bucket_view: bool, param_dtype: torch.dtype | None,
                         planned_device: str) -> tuple[nn.Module, torch.optim.Optimizer, torch.device | None]:
    """``model`` laid out as ``layout`` says on this rank, the optimizer over its parameters, and the device the step
    computes on where that is not the parameters' (None: theirs).

    - DDP: DistributedDataParallel with the step's bucket mode; ``optimizer`` an instance (stepping the parameters DDP
      wraps) or a factory built on them.
    - FSDP2 (with tensor parallel where the layout splits layers): :func:`~autofit.parallel.apply.apply_layout` on
      this rank's mesh; FSDP2 replaces the parameters when it shards them, so ``optimizer`` must be a factory, built
      on the sharded ones. With the states on the host the model must come on the CPU and the step computes on
      ``planned_device``."""
    if layout.replicates_parameters:
        built = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(model.parameters())
        device = next(model.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        wrapped = apply_layout(model, layout, gradient_as_bucket_view=gradient_as_bucket_view, device_ids=ids)
        return wrapped, built, None
    if not layout.shards_parameters:
        raise InvalidInputError(f"this plan has no data-parallel strategy ({layout.strategy!r}): plans use "
                                "'ddp' or 'fsdp2'")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            "FSDP2 replaces the parameters when it shards them, so wrap() needs an optimizer factory: "
            "plan.wrap(model, lambda params: torch.optim.AdamW(params, lr=...))"
        )
    device_type = computes_on(layout, planned_device, next(model.parameters()).device.type)
    if layout.offload_states:  # the parameters stay on the host, FSDP2 copies each unit to the device it computes on
        if any(p.device.type != "cpu" for p in model.parameters()):
            raise InvalidInputError(
                "this plan keeps the parameters in host memory (FSDP2 CPUOffloadPolicy): give wrap() the "
                "model on the CPU (do not move it to the GPU first; FSDP2 copies each unit to the GPU when "
                "it runs)"
            )
    mesh = device_mesh(device_type, layout)
    compute = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
        else torch.device(device_type)
    wrapped = apply_layout(model, layout, mesh=mesh, param_dtype=param_dtype, pin_memory=device_type == "cuda")
    return wrapped, optimizer(wrapped.parameters()), compute


@dataclass(frozen=True)
class RankRows:
    """The rows one rank trains of every global batch, and how its counts combine with the other ranks' (Note [loss
    normalisation], autofit/training/normalisation.py): a rank is the ``index``-th of ``ranks`` data ranks, each row
    trained by ``copies`` ranks (a tensor-parallel group's share theirs)."""

    index: int
    ranks: int
    copies: int

    def slice(self, batch: Any, target: Any, batch_size: int) -> tuple[Any, Any]:
        """This rank's contiguous slice of the global ``batch`` (and ``target``, or None) of the plan's
        ``batch_size`` rows, which every rank receives whole; another size is refused, naming what to pass
        instead."""
        if batch.size != batch_size:
            raise InvalidInputError(
                f"step() takes the global batch of {batch_size} samples on every rank (got {batch.size}); "
                "pass local=True with this rank's own batch of "
                f"{batch_size // self.ranks} samples instead"
            )
        rows = batch.size // self.ranks
        start, stop = self.index * rows, (self.index + 1) * rows
        return batch.slice(start, stop), (None if target is None else target.slice(start, stop))

    def across_ranks(self, summed: int | float) -> tuple[int | float, int]:
        """A count summed over every rank (rows, items, or a float sum of class weights), as the global count, and
        the ranks gradients are averaged over: each row was counted once per rank that trains it."""
        if isinstance(summed, float):
            return summed / self.copies, self.ranks
        return summed // self.copies, self.ranks


def rank_rows_of(layout: Parallel, rank: int) -> RankRows:
    """The rows global ``rank`` trains under ``layout``: its data rank among the data ranks
    (:meth:`Layout.data_rank`; the ranks of a tensor-parallel group train the same rows)."""
    shape = layout.layout
    return RankRows(shape.data_rank(rank), shape.data_ranks, shape.row_copies)
