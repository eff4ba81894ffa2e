"""The schedule of a step's micro-batches: the one owner of the micro-batch loop. See Note [one schedule].

Note [one schedule]
    An optimizer step runs its batch as micro-batches. With gradient accumulation on every rank (what autofit plans
    today) they run one after another, each forward and backward whole, and the gradients are synchronised across
    ranks on the last one only (``gradient_sync``, autofit/parallel/apply.py, from each dimension's
    ``micro_batch_context``; FSDP2's reduce-scatter per micro-batch where the layout says so). torch's
    ``torch.distributed.pipelining`` makes the loop an object (``PipelineSchedule.step``: GPipe, 1F1B,
    interleaved), which owns which micro-batch runs when on which stage and how many are in flight; context parallel
    wraps each micro-batch in a context. So the loop lives here, once: the simulation (``simulate/window.py``),
    ``measure`` (``measure/allocator.py``) and the trainers (``emit/trainer.py``, ``emit/distributed.py`` through
    it) each hand the schedule the body of one micro-batch. A pipeline schedule is another class, which its
    dimension returns from ``Dimension.schedule`` (:func:`schedule_of` asks the layout's dimensions), with the same
    two answers: how many micro-batches a simulation must run to see the peak (:meth:`Sequential.simulated`), and
    how many micro-batches' activations are alive at once (:attr:`Sequential.in_flight`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autofit.parallel.apply import gradient_sync
from autofit.parallel.dimension import Schedule

if TYPE_CHECKING:
    from torch import nn

    from autofit.parallel.layout import Parallel

__all__ = ["Sequential", "SyncRule", "schedule_of"]

# the context one micro-batch runs in under a layout: (model, layout, last=...) -> context manager
SyncRule = Callable[..., contextlib.AbstractContextManager[Any]]


@dataclasses.dataclass(frozen=True)
class Sequential:
    """Gradient accumulation: the window's ``micro_batches`` one after another on every rank, gradients
    synchronised on the last (Note [one schedule])."""

    micro_batches: int
    in_flight: int = 1  # one micro-batch's activations alive at a time: each backward ends before the next forward

    def simulated(self, window: int) -> int:
        """The micro-batches a simulation runs to see the window's peak, at most ``window`` (the first, with no
        gradients yet, and one with them: every later one starts from the same live set and runs the same ops)."""
        return min(self.micro_batches, window)

    def run(self, model: nn.Module, layout: Parallel, micro_batch: Callable[[int], Any], *, count: int | None = None,
            sync: SyncRule = gradient_sync) -> list[Any]:
        """Run ``micro_batch(i)`` for each micro-batch in order (``count`` of them: all by default, a simulation's
        :meth:`simulated`), each inside ``sync(model, layout, last=...)``; their results, in order."""
        n = self.micro_batches if count is None else count
        results = []
        for i in range(n):
            with sync(model, layout, last=i == n - 1):
                results.append(micro_batch(i))
        return results


def schedule_of(layout: Parallel, micro_batches: int) -> Schedule:
    """The schedule of a step of ``micro_batches`` under ``layout``: the first of its dimensions, outermost first,
    that has its own (:meth:`~autofit.parallel.Dimension.schedule`: a pipeline's), else sequential accumulation
    (Note [one schedule])."""
    placed = layout.layout
    for placement in placed.placements:
        schedule = placed.registry[placement.dimension].schedule(placed, placement, micro_batches)
        if schedule is not None:
            return schedule
    return Sequential(micro_batches)
