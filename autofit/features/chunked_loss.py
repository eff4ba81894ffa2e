"""The step feature "chunked-loss": the output head and the cross-entropy in chunks of tokens, so that the full logits
and their gradient are never live at once. The step itself is autofit/training/chunked_loss.py (Note [chunked
cross-entropy]); this module says what each stage does with it (Note [step features], autofit/features/base.py)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from autofit.features.base import OptInFeature, StepLoss
from autofit.training.chunked_loss import LossChunks, chunkable, chunked_step_loss

if TYPE_CHECKING:
    from torch import nn

    from autofit.training.batch import Batch
    from autofit.training.config import StepConfig
    from autofit.training.optim import OptimizerSpec

__all__ = ["CHUNKED_LOSS", "ChunkedLoss"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedLoss(OptInFeature):
    """The chunked loss; its value is a :class:`~autofit.training.chunked_loss.LossChunks`."""

    def resolve(self, model: nn.Module, batch: Batch, target: Batch | None, loss_fn: Any, optimizer: OptimizerSpec,
                allowed: bool) -> LossChunks | None:
        return chunkable(model, batch, target, loss_fn)

    def not_applicable(self, optimizer: OptimizerSpec) -> str:
        return ("allow 'chunked-loss' does not apply: it needs the default loss (no loss_fn), an nn.Linear output head, "
                "and an integer target or a Hugging Face causal LM given labels")

    def step_loss(self, config: StepConfig) -> StepLoss | None:
        chunks = config.chunked_loss
        if chunks is None:
            return None

        def loss(model: nn.Module, batch: Batch, target: Any, policy: Any) -> Any:
            return chunked_step_loss(model, batch, target, chunks,
                                     fp32_head=policy.autocast and chunks.head in policy.fp32_modules)
        return loss

    def rung_what(self, value: LossChunks) -> str:
        return f"chunked cross-entropy ({value.chunks} chunks)"

    def climbed(self, value: LossChunks, user: Any) -> str:
        return (f"rung 'chunked-loss' climbed: the output head {value.head!r} and the cross-entropy run in "
                f"{value.chunks} chunks of tokens, so the full logits and their gradient are never live at once "
                "(Note [chunked cross-entropy])")

    def to_json(self, value: LossChunks | None) -> dict[str, Any] | None:
        return None if value is None else {"head": value.head, "chunks": value.chunks}

    def from_json(self, data: Any) -> LossChunks | None:
        return None if data is None else LossChunks(head=data["head"], chunks=int(data["chunks"]))

    def plan_rows(self, plan: Any) -> tuple[tuple[str, str], ...]:
        chunks = plan.chunked_loss
        if chunks is None:
            return ()
        return (("loss", f"cross-entropy over {chunks.head!r} in {chunks.chunks} chunks of tokens"),)


CHUNKED_LOSS = ChunkedLoss(name="chunked-loss", field="chunked_loss", allow_field="allow_chunked_loss",
                           replaces="the loss")
