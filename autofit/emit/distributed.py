"""The wrapper of a multi-process plan, on PyTorch's own engine: DDP or FSDP2 (``fully_shard``). Nothing home-made.

- DDP: ``DistributedDataParallel(model, gradient_as_bucket_view=True)`` (gradients live in the communication buckets,
  no second copy), ``no_sync()`` on every micro-batch but the last of a window.
- FSDP2: ``fully_shard`` on each planned unit and on the root, with a ``MixedPrecisionPolicy`` gathering parameters
  in the plan's low precision (reductions in fp32), the units' ``reshard_after_forward`` as planned (ZeRO-3 / ZeRO-2
  / an int group), over a 1-D mesh or, for HSDP, a 2-D (replicate, shard) ``init_device_mesh``;
  ``set_requires_gradient_sync(False)`` on every micro-batch but the last, except with the states offloaded to the
  host, where every micro-batch reduces and the shards accumulate on the host, and in plans with
  ``reduce_every_micro_batch``, where they accumulate sharded on the device. Sharding replaces the parameters,
  so the optimizer is built afterwards: ``wrap`` takes a factory.
- Tensor parallel (``plan.parallel.tensor_parallel`` T > 1): ``parallelize_module`` on the "tp" dim of a
  (world_size // T, T) mesh first, then FSDP2 on its "dp_shard" dim (none when T == world_size):
  parallel/apply.py, ``apply_layout``.
  What the layout decides for this trainer (its process group, the model laid out with its optimizer, the rows each
  rank trains, the loss normalisation across ranks) is the layout's: parallel/processes.py, asked, never read.
  The micro-batch loop and its gradient sync are the schedule's (parallel/schedule.py, Note [one schedule]).
  The T ranks of a group see the same rows: "rank" below is the data-parallel rank, ``rank // T``, of
  ``world_size // T``.
Every rank receives the same global batch of ``plan.batch_size`` samples and trains on its own contiguous slice of
``batch_size / world_size`` rows (pass ``local=True`` to ``step`` when a DistributedSampler already split the data),
so every sample of the global batch is used exactly once; DDP and FSDP2 average gradients over ranks, so each rank
weights its micro-batches by their share of the rows, or items, of the whole global batch (counted on every rank and
summed with one all_reduce before the first micro-batch) times the world size: the gradient of the global mean loss
even when the ranks hold different numbers of tokens.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from autofit.training.batch import Batch
from autofit.emit.trainer import Trainer
from autofit.features import before_wrap, convert_model
from autofit.core.errors import InvalidInputError
from autofit.training.loss import LossFn
from autofit.parallel.processes import join_process_group, lay_out_for_training, rank_rows_of

if TYPE_CHECKING:
    from autofit.emit.plan import Plan

__all__ = ["DistributedTrainer"]


def _refuse_one_process_knobs(plan: Plan) -> None:
    """The stored precision, planned for one process only, refused with why (the step features planned for one
    process only refuse a layout themselves: their ``Feature.before_wrap``)."""
    if plan.precision.stored not in (None, "fp32"):
        raise InvalidInputError(
            f"stored precision {plan.precision.stored!r} is planned for one process only; with DDP or FSDP2 use "
            "stored=None (FSDP2's own MixedPrecisionPolicy keeps fp32 sharded parameters)"
        )


class DistributedTrainer(Trainer):
    """Executes a multi-process plan (``plan.parallel.world_size > 1``) on this rank: :meth:`Plan.wrap
    <autofit.Plan.wrap>` returns it. Needs ``torch.distributed`` initialised with ``plan.parallel.world_size``
    processes. ``optimizer`` is an instance or a factory ``params -> Optimizer`` for DDP, and must be a factory for
    FSDP2. ``trainer.model`` is the DDP- or FSDP2-wrapped model; ``unwrap()`` returns the model itself."""

    def __init__(self, plan: Plan, model: nn.Module, optimizer: torch.optim.Optimizer | Callable, *,
                 loss_fn: LossFn | None = None, loss_reduction: str | None = None, shared: Any = None) -> None:
        before_wrap(plan)  # before FSDP2 moves or shards anything (the allocator's setting)
        convert_model(plan.step, model)  # Float8's linears before the layout (Note [step features])
        _refuse_one_process_knobs(plan)
        hook = sys.excepthook  # init_process_group prefixes tracebacks with "[rank0]" for good
        # the job's process group must run the plan's layout; FSDP2 on one process (Note [offload]) makes its own
        self._own_group = join_process_group(plan.parallel, lambda: plan.device.process_group_backend)
        if self._own_group:
            self._excepthook = hook
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # the rows this rank trains: the ranks of a tensor-parallel group share theirs (Layout.data_rank)
        self._rows = rank_rows_of(plan.parallel, self.rank)
        # the layout the plan was verified with (Note [the plan's step]), applied as the trainer runs it
        wrapped, built, compute = lay_out_for_training(
            model, optimizer, plan.step.layout, gradient_as_bucket_view=plan.step.gradient_as_bucket_view,
            param_dtype=plan.step.precision.param_dtype, planned_device=plan.device)
        if compute is not None:  # the device the step computes on, kept for the inputs
            self._compute_device = compute
        self._inner = model
        super().__init__(plan, wrapped, built, loss_fn=loss_fn, loss_reduction=loss_reduction, shared=shared)

    def _input_device(self) -> torch.device:
        return getattr(self, "_compute_device", None) or super()._input_device()

    def _shard(self, batch: Batch, target: Batch | None):
        if self._local:
            return batch, target
        return self._rows.slice(batch, target, self.plan.batch_size)

    def _across_ranks(self, count: int | float) -> tuple[int | float, int]:
        """Items (or rows) summed over every rank: DDP and FSDP2 average gradients over ranks, so each rank's
        weights are its share of the global count times the world size (See Note [loss normalisation]). With tensor
        parallel T every group counts its rows T times over: the data-parallel count is the sum over T."""
        device = next(iter(self.model.parameters())).device
        # a float: a class-weighted mean's sum of weights (Note [losses that ignore an index])
        weighted = isinstance(count, float)
        total = torch.tensor([count], dtype=torch.float64 if weighted else torch.int64, device=device)
        dist.all_reduce(total)
        # each row counted once per rank that trains it: the layout's to undo
        return self._rows.across_ranks(total.item() if weighted else int(total.item()))

    def _bounds(self, batch_rows: int, rows: int) -> list[tuple[int, int]]:
        """Every rank runs the same number of micro-batches: DDP broadcasts buffers and FSDP2 gathers parameters in
        each forward, so a rank that ran fewer would leave the others waiting. A rank whose batch is shorter (more
        rows fit) than another's splits its rows evenly into the larger count, never more rows than fit."""
        own = super()._bounds(batch_rows, rows)
        count = torch.tensor([len(own)], dtype=torch.int64, device=next(iter(self.model.parameters())).device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        n = int(count.item())
        if n == len(own):
            return own
        if batch_rows < n:
            raise InvalidInputError(
                f"this rank has {batch_rows} rows but another rank's batch needs {n} micro-batches: give every rank "
                "at least as many rows as the longest batch's micro-batches (or batches of similar length per step)"
            )
        return [(i * batch_rows // n, (i + 1) * batch_rows // n) for i in range(n)]

    def step(self, inputs: Any, target: Any = None, *, local: bool = False) -> float:
        """One optimizer step. ``inputs``: the global batch (every rank the same), or this rank's rows with
        ``local=True``. Returns this rank's mean loss."""
        self._local = local
        return super().step(inputs, target)

    def unwrap(self) -> nn.Module:
        """Undo autofit's patches and return the model (DDP's module; FSDP2's sharding cannot be undone). A process
        group this trainer made for a one-process offloaded plan is destroyed."""
        super().unwrap()
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
            sys.excepthook = self._excepthook
            self._own_group = False
        return self._inner
