"""The step feature "activation-offload": the saved activations of some modules live in host memory between their
forward and their backward (PyTorch's ``save_on_cpu``, Note [offload], autofit/training/step.py). The step's part is
autofit/training/activation_offload.py; this module says what each stage does with it (Note [step features],
autofit/features/base.py). Which modules offload is the search's choice, module by module beside recomputation
(``Candidate.offload``, solve/candidate.py; its transfers' time: Note [offload time], solve/time_model.py)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from autofit.features.base import Feature
from autofit.training.activation_offload import HostContext, offloaded_forwards

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autofit.training.config import StepConfig

__all__ = ["ACTIVATION_OFFLOAD", "ActivationOffload"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActivationOffload(Feature):
    """Activation offload; its value is the offloaded modules' qualified names (``()``: none)."""

    def in_force(self, carrier: Any) -> tuple[str, ...] | None:
        return getattr(carrier, self.field, None) or None

    def step_context(self, config: StepConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                     stepped: set[int] | None = None, *,
                     to_host: HostContext | None = None) -> contextlib.AbstractContextManager[Any]:
        if not config.offload:
            return contextlib.nullcontext()
        return offloaded_forwards(model, config, to_host)

    def plan_rows(self, plan: Any) -> tuple[tuple[str, str], ...]:
        if not plan.offload:
            return ()
        names = ", ".join(plan.offload)
        if len(names) > 100:
            names = f"{len(plan.offload)} modules: {names[:90]}..."
        return (("offloaded activations", f"{names} (save_on_cpu)"),)

    def to_json(self, value: tuple[str, ...] | None) -> list[str]:
        return list(value or ())

    def from_json(self, data: Any) -> tuple[str, ...]:
        return tuple(data or ())


ACTIVATION_OFFLOAD = ActivationOffload(name="activation-offload", field="offload", row_after="gradient clipping")
