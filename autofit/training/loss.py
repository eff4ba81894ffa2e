"""The loss of one micro-batch, and the default used when the user gives no ``loss_fn``.

Default, in order (documented in docs/api.md):
1. the output has a ``loss`` (attribute or dict key), as Hugging Face models return when given labels: use it;
2. a target is given: integer target -> cross-entropy over the last dimension of the output (logits ``(..., C)``
   against class indices ``(...)``); floating target -> mean squared error;
3. no target and the output is a scalar: the output is the loss.
Anything else asks for a ``loss_fn``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from autofit.core._torch import PASSTHROUGH_ERRORS
from autofit.core.errors import LossError

__all__ = ["LossFn", "compute_loss"]

LossFn = Callable[..., torch.Tensor]


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    return None


def default_loss(output: Any, target: Any = None) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    prediction = _first_tensor(output)
    if target is not None and prediction is not None and isinstance(target, torch.Tensor):
        kind = "mean squared error" if target.is_floating_point() else "cross-entropy"
        try:
            if not target.is_floating_point():
                # logits (..., C) against class indices (...): flatten everything but the class dimension
                return F.cross_entropy(prediction.reshape(-1, prediction.shape[-1]), target.reshape(-1))
            return F.mse_loss(prediction, target.to(prediction.dtype))
        except PASSTHROUGH_ERRORS:
            raise
        except (RuntimeError, ValueError, IndexError) as e:
            raise LossError(
                f"the default loss ({kind} of the output, shape {tuple(prediction.shape)}, against the {target.dtype} "
                f"target, shape {tuple(target.shape)}) failed: {e}; pass loss_fn=lambda output, target: ... "
                "that fits the model's output"
            ) from e
    if target is None and prediction is not None and prediction.numel() == 1:
        return prediction.reshape(())
    raise LossError(
        "no loss could be derived from the model's output "
        f"({type(output).__name__}{'' if target is None else ' with a target'}): "
        "pass loss_fn=lambda output, target: ..."
    )


def compute_loss(loss_fn: LossFn | None, output: Any, target: Any) -> torch.Tensor:
    """Call the loss and check it is a differentiable floating scalar."""
    if loss_fn is None:
        loss = default_loss(output, target)
    else:
        loss = loss_fn(output) if target is None else loss_fn(output, target)
    if not isinstance(loss, torch.Tensor):
        raise LossError(f"loss_fn returned {type(loss).__name__}; it must return a scalar tensor")
    if loss.numel() != 1:
        raise LossError(
            f"the loss has shape {tuple(loss.shape)}; it must be a scalar: reduce it, e.g. with .mean()"
        )
    if not loss.is_floating_point():
        raise LossError(f"the loss has dtype {loss.dtype}; it must be floating point to be differentiated")
    if not loss.requires_grad:
        raise LossError(
            "the loss does not require grad: no parameter takes part in it (are all parameters frozen, "
            "or does the model run under torch.no_grad()?)"
        )
    return loss.reshape(())
