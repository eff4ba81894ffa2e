"""The accumulation window of a simulated step, on the tracker: what the step holds before its first forward
(:class:`StepState`), the micro-batches that decide the window's peak and the optimizer step (:func:`run_window`),
and the typed errors the user's code and optimizer raise in it (:class:`DataDependent`, :func:`forward_errors`,
:func:`optimizer_values`). ``simulate/run.py`` builds the copy, enters the modes and calls these."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autofit.core._torch import DATA_DEPENDENT_ERRORS, unset_fake_temporarily, value_free_grad_scaler
from autofit.core import progress
from autofit.core.categories import Category
from autofit.core.errors import AutofitError, ForwardError, UnsupportedModelError
from autofit.capture.corrections import FakeKernelStricter
from autofit.features import FEATURES
from autofit.training.batch import Batch
from autofit.training.config import ZeroGrad
from autofit.training.loss import LossFn, compute_loss
from autofit.training.normalisation import LossNormalisation
from autofit.training.step import StepConfig, WindowPlace, optimizer_step, run_micro_batch
from autofit.training.stored import apply_stored
from autofit.parallel.host import states_off_device
from autofit.parallel.schedule import Window, schedule_of
from autofit.simulate.offload import host_optimizer
from autofit.parallel.simulated import grads_into_buckets, simulated_buckets, simulated_sync
from autofit.simulate.state import create_optimizer_state, drop_phantom_state, held_rows, register_state
from autofit.simulate.timeline import Phase
from autofit.simulate.tracker import StepTracker
from autofit.simulate.value_free import ValueFreeStep, reads_values_harmlessly
from autofit.simulate.value_twins import WEIGHT_READ

__all__ = ["DataDependent", "StepState", "WINDOW_MICRO_BATCHES", "forward_errors", "optimizer_values", "run_window"]


class DataDependent(Exception):
    def __init__(self, module: str, cause: str, why: str = "depends on tensor values", subject: str = "") -> None:
        super().__init__(cause)
        self.module, self.cause, self.why = module, cause, why
        self.subject = subject or f"module {module or '(top level)'!r}"


@contextlib.contextmanager
def optimizer_values(optimizer: torch.optim.Optimizer, fake: bool) -> Iterator[None]:
    """Around an optimizer step: see Note [optimizers that read values] (simulate/value_free.py)."""
    free = fake and reads_values_harmlessly(optimizer)
    try:
        with ValueFreeStep() if free else contextlib.nullcontext():
            yield
    except DATA_DEPENDENT_ERRORS as e:
        raise DataDependent("", f"{type(e).__name__}: {e}".splitlines()[0], why="reads tensor values in its step",
                             subject=f"the optimizer {_qualname(optimizer)}") from e
    except FakeKernelStricter as e:
        raise DataDependent("", str(e), why="runs an op that cannot be simulated",
                             subject=f"the optimizer {_qualname(optimizer)}") from e
    except (AutofitError, DataDependent):
        raise
    except Exception as e:  # noqa: BLE001 - an optimizer autofit cannot step on the simulated tensors
        raise UnsupportedModelError(
            f"the optimizer {_qualname(optimizer)} failed in the simulated step ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); autofit simulates torch.optim, bitsandbytes and torchao "
            "optimizers (docs/fine-tuning.md): measure this one with autofit.measure, or report it"
        ) from e


def _qualname(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class StepState:
    """What a simulated step holds before its first forward, made as the trainer makes it: the optimizer (with its
    state), the stored-precision state, the loss scaler, DDP's buckets, the rest of the batch. It must outlive the
    step: what it alone references would be freed in the middle of the tracked step."""

    optimizer: torch.optim.Optimizer
    stored: Any  # training/stored.py's StoredState
    scaler: Any  # a value-free GradScaler, or None
    buckets: list[torch.Tensor]
    states_apart: bool  # Note [host storages]: on a GPU target, the offloaded states are not the device's
    held: list[torch.Tensor]  # the rest of the batch the trainer slices micro-batches from

    @classmethod
    def build(cls, work: nn.Module, config: StepConfig, fake: bool, micro: Batch, micro_target: Any) -> StepState:
        with unset_fake_temporarily() if fake else contextlib.nullcontext():  # Note [optimizers that read values]
            optimizer = config.optimizer.build(work.parameters())
        # stored precision: the parameters converted and, with a master copy, the optimizer on fp32 copies of them,
        # exactly as the trainer does (Note [stored precision])
        stored = apply_stored(work, optimizer, config.precision.stored, config.precision.fp32_modules)
        scaler = value_free_grad_scaler("cpu") if config.precision.needs_grad_scaler else None
        with optimizer_values(optimizer, fake):
            # gradients a step leaves for the next (Note [where zero_grad falls]) are the warm-up step's, zeroed
            create_optimizer_state(work, optimizer, scaler, stored, keep_grads=config.grads_between_steps)
        # Note [DDP's bucket views]: with accumulation the gradients join the buckets in the window's last backward
        views = config.gradient_as_bucket_view and config.accumulation_steps == 1
        buckets = simulated_buckets(work, config.layout, views=views)
        return cls(optimizer, stored, scaler, buckets, states_off_device(config.layout, config.device),
                   held_rows(micro, micro_target, config))

    def register(self, tracker: StepTracker, work: nn.Module, micro: Batch, micro_target: Any) -> None:
        """Everything that exists before the step, each under its category; the rest of the batch the trainer
        slices micro-batches from as inputs."""
        register_state(tracker, work, self.optimizer, self.scaler, micro, micro_target, self.stored,
                       host_states=self.states_apart)
        for bucket in self.buckets:
            tracker.register(bucket, Category.GRADIENTS)
        for t in self.held:
            tracker.register(t, Category.INPUTS)


# Micro-batches of the accumulation window that are simulated: the first (no gradients yet) and one with gradients
# (every later micro-batch starts from the same live set and runs the same ops). tests/test_repetition.py compares it
# with simulating every micro-batch, byte for byte.
WINDOW_MICRO_BATCHES = 2


def run_window(tracker: StepTracker, model: nn.Module, state: StepState, micro: Batch, micro_target: Any,
                loss_fn: LossFn | None, config: StepConfig, caster: Any, stepped: set[int], *, fake: bool) -> None:
    """The accumulation window, reduced to what decides its peak: the first micro-batch (no gradients yet) and the
    last (gradients accumulated, then the optimizer step). Micro-batches in between repeat the last one's
    forward and backward exactly, so they cannot raise the peak."""
    optimizer, scaler, stored, buckets = state.optimizer, state.scaler, state.stored, state.buckets
    schedule = schedule_of(config.layout, config.accumulation_steps)
    steps = schedule.simulated(WINDOW_MICRO_BATCHES)
    # the sample's micro-batches are copies of one another: equal shares, however the loss counts (the weight only
    # decides whether a scalar multiply runs, not its size)
    norm = LossNormalisation.of_rows((config.micro_batch_size,) * config.accumulation_steps)
    phases = {"forward": Phase.FORWARD, "backward": Phase.BACKWARD}

    micro_index = 0

    def on_phase(name: str) -> None:
        # Non-reentrant checkpoint stops recomputing with an internal exception once it has what it needs, which
        # skips forward hooks: entries it left on the module stack must not label the next phase.
        tracker.module_stack.clear()
        if name == "backward" and caster is not None:
            caster.clear()  # torch.autocast clears its weight-cast cache when the region exits
        tracker.phase = phases[name]
        tracker.autocast_device = "cpu" if (name == "forward" and config.precision.autocast) else None
        tracker.timeline.mark(micro_index, tracker.phase)
        # how far a simulation is, inside the planner's stage that runs it (a 7B step: seconds per phase)
        progress.step(f"{name} of micro-batch {micro_index + 1} of the window's {steps}")

    received_grad: set[int] = set()
    # the previous step's gradients (Note [where zero_grad falls]); one a parameter never receives is not real
    carried = {id(p): tracker.sid_of(p.grad) for p in model.parameters() if p.grad is not None}

    def phase(index: int, name: str) -> None:  # micro-batch ``index``'s phase, as the schedule runs it
        nonlocal micro_index
        micro_index = index
        on_phase(name)

    def gradients_made() -> None:
        for p in model.parameters():
            if p.grad is not None:
                tracker.recategorize(p.grad, Category.GRADIENTS)
                received_grad.add(id(p))

    def one(index: int, inputs: Batch, target: Any, place: WindowPlace) -> None:
        nonlocal micro_index
        micro_index = index
        joining = (buckets and config.gradient_as_bucket_view and config.accumulation_steps > 1
                   and micro_index == steps - 1)
        into_buckets = (grads_into_buckets(model, list(buckets), as_ready=config.accumulation_steps == 2)
                        if joining else contextlib.nullcontext())  # Note [DDP's bucket views]
        with forward_errors(tracker), into_buckets:
            run_micro_batch(model, inputs, target, loss_fn, config, "cpu", place=place, scaler=scaler,
                            on_phase=on_phase, features=FEATURES)
        gradients_made()

    # FSDP2 reduce-scatters only on the window's last micro-batch, keeping unsharded gradients until then (Note
    # [gradient sync under accumulation]); with reduce_every_micro_batch, or with the states on the host (Note
    # [offload]), it reduces every micro-batch instead. The schedule applies that rule as on a real rank
    # (gradient_sync); DDP's sync is the buckets' here (the copy is not wrapped in DDP: Note [DDP's bucket views]).
    window = Window(config.accumulation_steps, rows=lambda _: (micro, micro_target),
                    place=lambda i: WindowPlace.of(i, norm, optimizer), loss=functools.partial(compute_loss, loss_fn),
                    body=one, on_phase=phase)
    schedule.run(model, config.layout, window, count=steps, sync=simulated_sync)
    gradients_made()  # a schedule that runs its own backwards (Note [one schedule]) made them outside the body
    if carried and not config.preallocated_grads:  # each gradient the step leaves in place of the one it freed
        left = {sid: tracker.sid_of(p.grad) for p in model.parameters()
                if (sid := carried.get(id(p))) is not None and p.grad is not None}
        tracker.timeline.carried = {sid: new for sid, new in left.items() if new is not None}
    tracker.module_stack.clear()
    tracker.phase = Phase.OPTIMIZER
    tracker.autocast_device = None
    tracker.timeline.mark(steps - 1, Phase.OPTIMIZER)
    with host_optimizer(tracker, state.states_apart), optimizer_values(optimizer, fake):
        progress.step("the optimizer step")
        optimizer_step(optimizer, scaler, clip_grad_norm=config.clip_grad_norm, stored=stored,
                       in_backward=config.optimizer_in_backward, keep_grads=config.preallocated_grads,
                       zero_grad=config.zero_grad is ZeroGrad.AFTER_STEP)
    received_grad |= stepped  # stepped in backward: their gradients are gone, their state is real
    tracker.phase = Phase.SETUP
    drop_phantom_state(tracker, model, optimizer, received_grad, stored,
                       carried={} if config.preallocated_grads else carried)


@contextlib.contextmanager
def forward_errors(tracker: StepTracker) -> Iterator[None]:
    """Turn exceptions of the user's code into typed errors naming the innermost module that was running."""
    try:
        yield
    except DATA_DEPENDENT_ERRORS as e:
        module = tracker.module
        tracker.module_stack.clear()
        if getattr(e, WEIGHT_READ, False):  # Note [value twins]: not computable from constants and inputs alone
            raise DataDependent(module, f"{type(e).__name__}: {e}".splitlines()[0],
                                 why="reads a tensor value computed from its weights or gradients (or by compiled code, "
                                     "which a simulation runs without its kernels), not only from constants and the "
                                     "inputs") from e
        raise DataDependent(module, f"{type(e).__name__}: {e}".splitlines()[0]) from e
    except FakeKernelStricter as e:
        module = tracker.module
        tracker.module_stack.clear()
        raise DataDependent(module, str(e), why="runs an op that cannot be simulated") from e
    except AutofitError:
        tracker.module_stack.clear()
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the user's forward gets the module's name attached
        module = tracker.module
        tracker.module_stack.clear()
        where = f"module {module!r}" if module else "the model's top-level forward (or the loss)"
        raise ForwardError(f"{where} raised {type(e).__name__}: {e}", module=module or None) from e
