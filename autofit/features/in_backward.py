"""The step feature "optimizer-in-backward": the optimizer steps each parameter as soon as its gradient is complete
and frees that gradient, so the gradients never all live at once. The hooks themselves are
autofit/training/in_backward.py (Note [optimizer step in backward]); this module says what the step and the plan do
with it (Note [step features], autofit/features/base.py). It is no opt-in rung: the search tries it where the
precision allows (the ladder's ``Stage.in_backward``, Note [the ladder]), and the step and the optimizer's step read
``StepConfig.optimizer_in_backward``."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from autofit.features.base import Feature
from autofit.training.in_backward import stepping_in_backward

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autofit.training.activation_offload import HostContext
    from autofit.training.config import StepConfig

__all__ = ["IN_BACKWARD", "InBackward"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class InBackward(Feature):
    """The optimizer step in backward; its value is a flag (``False``: after backward)."""

    def step_context(self, config: StepConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                     stepped: set[int] | None = None, *,
                     to_host: HostContext | None = None) -> contextlib.AbstractContextManager[Any]:
        if not config.optimizer_in_backward:
            return contextlib.nullcontext()
        return stepping_in_backward(model, optimizer, stepped)

    def plan_rows(self, plan: Any) -> tuple[tuple[str, str], ...]:
        if not plan.optimizer_in_backward:
            return ()
        return (("optimizer step", "in backward, parameter by parameter"),)


IN_BACKWARD = InBackward(
    name="optimizer-in-backward", field="optimizer_in_backward", row_after="gradient clipping",
    one_process="optimizer_in_backward is planned for one process only: with DDP or FSDP2 a gradient is final only "
                "after the collective that averages it, which runs after autograd's hooks")
