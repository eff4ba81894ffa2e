"""The layout's answers to the step that runs it (issue 54): who owns the gradients' storage, what needs
``fully_shard`` to run, and how many windows warm a measured step. The step (``training/config.py``) and ``measure``
(``measure/allocator.py``) ask these and read no field of the layout (Note [layout dimensions],
autofit/parallel/dimension.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from autofit.core._torch import ddp_bucket_sizes
from autofit.core.errors import InvalidInputError

if TYPE_CHECKING:
    from autofit.parallel.layout import Parallel

__all__ = ["gradients_in_buckets", "gradients_owner", "require_fully_sharded", "warm_up_windows", "kept_buckets",
           "kept_between_steps"]


def gradients_in_buckets(layout: Parallel, gradient_as_bucket_view: bool) -> bool:
    """The gradients are views of DDP's communication buckets (``gradient_as_bucket_view``, Note [DDP's bucket
    views], autofit/parallel/simulated.py), which live as long as the model: no step allocates or frees them."""
    return layout.replicates_parameters and gradient_as_bucket_view


def gradients_owner(layout: Parallel) -> str | None:
    """Why the step cannot hold the gradients' storage itself under ``layout``, in words ("ddp owns the gradients'
    storage ..."): the strategy's buckets or shards hold them; None for one process, where the step owns them."""
    if layout.strategy is None:
        return None
    return f"{layout.strategy} owns the gradients' storage (DDP's buckets, FSDP2's shards)"


def require_fully_sharded(layout: Parallel, why: str) -> None:
    """Raise ``why`` (a typed error) where ``layout`` does not run FSDP2's ``fully_shard`` (over several data ranks,
    or on one process keeping the states on the host): a step feature that is part of FSDP2's all-gather needs it."""
    if not layout.fully_sharded:
        raise InvalidInputError(why)


def warm_up_windows(layout: Parallel) -> int:
    """The windows a measured step runs before it is measured: one, after which the optimizer state exists as in the
    steady state; a second for DDP, which rebuilds its gradient buckets in the order of the first backward."""
    return 2 if layout.replicates_parameters else 1


def kept_buckets(layout: Parallel, model: nn.Module) -> list[int]:
    """Bytes of each gradient bucket that outlives every step of ``model`` laid out as ``layout``: DDP's (``model``
    is the DistributedDataParallel module), none otherwise."""
    return ddp_bucket_sizes(model) if layout.replicates_parameters else []


def kept_between_steps(layout: Parallel, model: nn.Module) -> list:
    """The tensors the layout's own machinery keeps from one step of ``model`` to the next (a pipeline's receive
    buffers: ``Dimension.kept_between_steps``), which ``measure`` counts as alive before a window as the step's own."""
    placed = layout.layout
    return [t for p in placed.placements
            for t in placed.registry[p.dimension].kept_between_steps(model, placed, p)]
