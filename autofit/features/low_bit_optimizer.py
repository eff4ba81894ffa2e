"""The step feature "8bit-optimizer": AdamW's two moments in 8 bits, bitsandbytes' or torchao's twin of the user's
optimizer, built by the trainer in place of the one given to wrap(). The twin's lookup and the swap are
autofit/training/optim.py (Note [8-bit optimizer state]); this module says what each stage does with it (Note [step
features], autofit/features/base.py)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from autofit.features.base import OptInFeature
from autofit.training.optim import OptimizerSpec, eight_bit_possible, eight_bit_spec, to_eight_bit

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autofit.training.batch import Batch

__all__ = ["LOW_BIT_OPTIMIZER", "LowBitOptimizer"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LowBitOptimizer(OptInFeature):
    """The 8-bit optimizer. Its rung's value is the twin's spec and dotted class name; the request and the plan
    carry the class name only (the request's optimizer becomes the twin's spec)."""

    def resolve(self, model: nn.Module, batch: Batch, target: Batch | None, loss_fn: Any, optimizer: OptimizerSpec,
                allowed: bool) -> tuple[OptimizerSpec, str] | bool | None:
        # not allowed: whether a twin exists, without importing bitsandbytes or torchao
        return eight_bit_spec(optimizer) if allowed else eight_bit_possible(optimizer) or None

    def not_applicable(self, optimizer: OptimizerSpec) -> str:
        return (f"allow '8bit-optimizer' does not apply to optimizer {optimizer.name!r}: it swaps torch.optim.AdamW "
                "(or Adam without weight decay) for bitsandbytes' or torchao's 8-bit one, and needs one of "
                "those libraries (Note [8-bit optimizer state], autofit/training/optim.py)")

    def rung_what(self, value: tuple[OptimizerSpec, str]) -> str:
        return "8-bit optimizer state"

    def request_for(self, request: Any, value: tuple[OptimizerSpec, str]) -> Any:
        return dataclasses.replace(request, optimizer=value[0], low_bit_optimizer=value[1])

    def request_without(self, request: Any, user: Any) -> Any:
        return dataclasses.replace(request, optimizer=user.optimizer, low_bit_optimizer=None)

    def climbed(self, value: tuple[OptimizerSpec, str], user: Any) -> str:
        return (f"rung '8bit-optimizer' climbed: {user.optimizer.name} becomes {value[1]}, its two moments stored in "
                "8 bits (Note [8-bit optimizer state]); the trainer builds it from the optimizer given to wrap()")

    def trainer_optimizer(self, plan: Any, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if plan.low_bit_optimizer is None:
            return optimizer
        return to_eight_bit(optimizer, plan.low_bit_optimizer)

    def plan_rows(self, plan: Any) -> tuple[tuple[str, str], ...]:
        if plan.low_bit_optimizer is None:
            return ()
        return (("optimizer", f"{plan.low_bit_optimizer} (8-bit state, in place of {plan.optimizer})"),)


# moments of one byte each: the floor of its rung and those after it
LOW_BIT_OPTIMIZER = LowBitOptimizer(name="8bit-optimizer", field="low_bit_optimizer", allow_field="allow_eight_bit",
                                    replaces="the optimizer", state_bytes=1)
