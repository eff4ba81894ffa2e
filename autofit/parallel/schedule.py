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
    it) each hand the schedule the window as one value (:class:`Window`). A pipeline schedule is another class,
    which its dimension returns from ``Dimension.schedule`` (:func:`schedule_of` asks the layout's dimensions), with
    the same two answers: how many micro-batches a simulation must run to see the peak (:meth:`Sequential.simulated`),
    and how many micro-batches' activations are alive at once (:attr:`Sequential.in_flight`).

    The window is what torch's pipeline schedules take (``PipelineSchedule._step_microbatches(arg_mbs, kwarg_mbs,
    target_mbs, losses)``, torch/distributed/pipelining/schedules.py, the loss function given when the schedule is
    built): each micro-batch's rows and target, each one's share of the batch's loss, the step's loss, and beside
    them the body that runs one micro-batch whole (forward, loss, backward), which :class:`Sequential` runs in order.
    A schedule that orders forwards and backwards itself reads the first three, tells the window each phase as it
    starts (``on_phase``) and leaves the body, so the callers hand every schedule the same value:
    tests/test_dimensions.py runs a GPipe-ordered one through the trainer, ``estimate`` and ``measure``.
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

__all__ = ["Sequential", "SyncRule", "Window", "schedule_of"]

# the context one micro-batch runs in under a layout: (model, layout, last=...) -> context manager
SyncRule = Callable[..., contextlib.AbstractContextManager[Any]]


@dataclasses.dataclass(frozen=True)
class Window:
    """An optimizer step's micro-batches as its caller hands them to the schedule (Note [one schedule]). The types
    are the step's (``autofit.training``, which imports this folder): a ``Batch`` of rows, a ``WindowPlace``."""

    size: int  # the window's micro-batches
    rows: Callable[[int], tuple[Any, Any]]  # micro-batch i's inputs and target (None without one), on the device
    # micro-batch i's place in the window (``WindowPlace``): its share of the batch's loss, and the gradients it
    # clears where the step's zero_grad order says (the body does; a schedule that leaves it steps in the default
    # order, the gradients cleared after the optimizer step, or its dimension refuses the others: ``check_step``)
    place: Callable[[int], Any]
    # the step's loss of a micro-batch's output against its target (the value its Batch gives), before its share
    # weights it: ``autofit.training.loss.compute_loss`` with the user's loss_fn, its default and its checks
    loss: Callable[[Any, Any], Any]
    # micro-batch i run whole on its rows, target and place: forward, loss and backward; its result (the loss)
    body: Callable[[int, Any, Any, Any], Any]
    # told (i, "forward") and (i, "backward") as micro-batch i's phases start, by a schedule that runs them apart (the
    # simulation files allocations by them; the body tells them itself)
    on_phase: Callable[[int, str], None] = lambda index, phase: None


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

    def note(self) -> str:
        """Nothing to say: accumulation keeps no rank waiting on another."""
        return ""

    def run(self, model: nn.Module, layout: Parallel, window: Window, *, count: int | None = None,
            sync: SyncRule = gradient_sync) -> list[Any]:
        """Run the window's body for each micro-batch in order (``count`` of them: all by default, a simulation's
        :meth:`simulated`), each inside ``sync(model, layout, last=...)``; their results (the losses), in order."""
        n = self.micro_batches if count is None else count
        results = []
        for i in range(n):
            with sync(model, layout, last=i == n - 1):
                inputs, target = window.rows(i)
                results.append(window.body(i, inputs, target, window.place(i)))
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
