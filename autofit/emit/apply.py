"""A plan applied to the user's model and optimizer: the trainer that runs exactly the planned step.

The plan is data (Note [the plan is data], autofit/emit/plan.py): it does not import the trainers, they read it, and
this module, which picks one, is where the two meet. :meth:`Plan.wrap <autofit.Plan.wrap>` calls :func:`wrap`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from autofit.emit.model_record import check_made_for
from autofit.emit.trainer import Trainer
from autofit.emit.wrapping import refuse_wrapped
from autofit.parallel.processes import trainer_for

if TYPE_CHECKING:
    from autofit.emit.plan import Plan

__all__ = ["wrap"]


def wrap(plan: Plan, model: nn.Module, optimizer: Any, *, loss_fn: Any = None, loss_reduction: str | None = None,
         shared: Any = None) -> Trainer:
    """The trainer of ``plan`` for ``model`` and ``optimizer``: :class:`~autofit.emit.Trainer` for one process, the
    DDP or FSDP2 :class:`~autofit.emit.distributed.DistributedTrainer` for a multi-process plan (or any plan with a
    strategy). The arguments are :meth:`Plan.wrap <autofit.Plan.wrap>`'s."""
    loss_fn = plan.planned_loss() if loss_fn is None else loss_fn
    if isinstance(model, nn.Module):
        refuse_wrapped(model)  # before DDP or FSDP2 wraps it (Note [one trainer per model])
        check_made_for(plan.made_for, model)  # Note [the plan's model]

    def laid_out() -> Trainer:
        # imported here, as before: torch.distributed's trainer is loaded only for a plan that needs it
        from autofit.emit.distributed import DistributedTrainer

        return DistributedTrainer(plan, model, optimizer, loss_fn=loss_fn, loss_reduction=loss_reduction,
                                  shared=shared)

    def one_process() -> Trainer:
        return Trainer(plan, model, optimizer, loss_fn=loss_fn, loss_reduction=loss_reduction, shared=shared)

    return trainer_for(plan.parallel, one_process, laid_out)  # which of the two the layout runs is its own
