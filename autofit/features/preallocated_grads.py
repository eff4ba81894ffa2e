"""The step feature "preallocated-grads": every trainable parameter's gradient allocated before the first forward and
zeroed in place after each step (Note [gradients allocated before forward], autofit/training/grads.py). The search
turns it on where only it fits the budget (Note [gradients before forward as a plan knob], solve/estimator.py), so
the estimate carries it and the plan reads it there; this module says what each stage does with it (Note [step
features], autofit/features/base.py). The step itself reads ``StepConfig.preallocated_grads``: the simulation's
optimizer state is created with the gradients kept (simulate/state.py), and each optimizer step zeroes them in place
(``optimizer_step(keep_grads=...)``, training/step.py)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from autofit.features.base import Feature
from autofit.training.grads import allocate_grads

if TYPE_CHECKING:
    from torch import nn

    from autofit.training.config import StepConfig

__all__ = ["PREALLOCATED_GRADS", "PreallocatedGrads"]

# what an estimate of such a step says
_ESTIMATE_NOTE = ("every gradient is allocated before the first forward and zeroed in place after each step "
                  "(zero_grad(set_to_none=False)), apart from the activations' segments, which the budget needs "
                  "free at the optimizer step; wrap() allocates them (Note [gradients allocated before forward])")

# What each framework an export writes for does with gradients between steps
_HOW = {
    "hf": "Hugging Face's Trainer calls model.zero_grad() (set_to_none=True) after every step, and its arguments "
          "have no setting to keep them",
    "deepspeed": "DeepSpeed's engine owns the gradients' storage and has no setting for this",
    "lightning": "allocate them before trainer.fit (p.grad = torch.zeros_like(p) for each trainable parameter) and "
                 "override LightningModule.optimizer_zero_grad to call optimizer.zero_grad(set_to_none=False)",
    "accelerate": "in your loop, allocate them before the first forward (p.grad = torch.zeros_like(p) for each "
                  "trainable parameter) and call optimizer.zero_grad(set_to_none=False)",
    "torchtitan": "torchtitan's train loop zeroes them with set_to_none and has no setting to keep them",
}


@contextlib.contextmanager
def _allocated(model: nn.Module) -> Iterator[None]:
    """The gradients ``model``'s parameters lack, allocated now and taken back on exit."""
    given = allocate_grads(model)
    try:
        yield
    finally:
        for p in given:
            p.grad = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreallocatedGrads(Feature):
    """Gradients allocated before forward; its value is a flag, on the plan the estimate's (``derived``)."""

    def real_context(self, config: StepConfig, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        # in the parameters' stored dtype: the stored precision is applied before
        return _allocated(model) if config.preallocated_grads else contextlib.nullcontext()

    def estimate_notes(self, config: StepConfig) -> tuple[str, ...]:
        return (_ESTIMATE_NOTE,) if config.preallocated_grads else ()

    def plan_rows(self, plan: Any) -> tuple[tuple[str, str], ...]:
        if not plan.preallocated_grads:
            return ()
        return (("gradients", "allocated before the first forward, zeroed in place after each step (the budget needs "
                              "them apart from the activations; wrap() allocates them)"),)

    def outside_wrap(self, plan: Any, callback: str) -> str | None:
        if not plan.preallocated_grads:
            return None
        return (f"this plan fits its budget only with every gradient allocated before the first forward and zeroed in "
                f"place after each step, which {callback} does not apply (the training loop frees them after every "
                "step): train it with plan.wrap(model, optimizer), or plan with a larger budget")

    def export_notes(self, plan: Any, framework: str) -> tuple[str, ...]:
        if not plan.preallocated_grads:
            return ()
        return (f"the budget fits only with every gradient allocated before the first forward and zeroed in place "
                f"after each step (plan.wrap() does it): {_HOW[framework]}",)


PREALLOCATED_GRADS = PreallocatedGrads(
    name="preallocated-grads", field="preallocated_grads", row_after=("CUDA allocator", "device"),
    one_process="preallocated_grads is planned for one process only: DDP's buckets and FSDP2's shards own the "
                "gradients' storage")
