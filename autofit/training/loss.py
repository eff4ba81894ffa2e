"""The loss of one micro-batch, and the default used when the user gives no ``loss_fn``.

Default, in order (documented in docs/api.md), applied only where it is unambiguous (See Note [the default loss]):
1. the output has a ``loss`` tensor (attribute or dict key), as Hugging Face models return when given labels: use it;
2. the prediction is the output itself when it is a tensor, or the ``logits`` of a Hugging Face ``ModelOutput``;
   a target is given: integer target -> cross-entropy over the last dimension of the prediction (logits ``(..., C)``
   against class indices ``(...)``); floating target -> mean squared error;
3. no target and the prediction has one element: it is the loss.
Anything else (a tuple, list, dict or dataclass without a loss, a prediction that does not fit the target) asks for a
``loss_fn``.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from autofit.core._torch import PASSTHROUGH_ERRORS
from autofit.core.errors import LossError

if TYPE_CHECKING:  # annotations only
    from torch import nn

    from autofit.training.batch import Batch
    from autofit.training.precision import PrecisionPolicy

__all__ = ["LossFn", "StepLoss", "compute_loss", "describe_loss", "default_loss", "own_loss"]

# the step's loss where a step feature computes it (Note [step features], autofit/features/base.py): (model,
# micro-batch, the target's value or None, precision) -> loss
StepLoss = Callable[["nn.Module", "Batch", Any, "PrecisionPolicy"], "torch.Tensor"]


LossFn = Callable[..., torch.Tensor]


# Note [the default loss]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A model that returns several tensors, ``(features, logits)`` say, leaves no way to know which one the loss is
# about. Taking the first one trains the wrong head in silence: cross-entropy over the 32 feature columns, and the
# classifier never gets a gradient. So the default reads only outputs whose meaning is documented: a ``loss`` the
# model computed itself, a bare tensor, or the ``logits`` field of a Hugging Face ``ModelOutput`` (the classes whose
# fields transformers documents). Every other structure is refused with a LossError that describes it and asks for
# ``loss_fn``; estimate, plan and the trainer all go through here, so none of them can disagree about it.


def own_loss(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _is_hf_output(output: Any) -> bool:
    """A Hugging Face ``ModelOutput`` (only possible when transformers is imported already)."""
    if "transformers" not in sys.modules:
        return False
    try:
        from transformers.utils import ModelOutput
    except ImportError:
        return False
    return isinstance(output, ModelOutput)


def describe_output(output: Any, depth: int = 0) -> str:
    """The structure of a model's output in a few words: ``tuple of 2: (Tensor (16, 32), Tensor (16, 4))``."""
    if isinstance(output, torch.Tensor):
        return f"Tensor {tuple(output.shape)}"
    if depth > 1:
        return type(output).__name__
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
        return f"{type(output).__name__} (a dataclass) with " + _described_items(items, depth)
    if isinstance(output, Mapping):
        return f"{type(output).__name__} with " + _described_items(output, depth)
    if isinstance(output, (tuple, list)):
        inner = ", ".join(describe_output(item, depth + 1) for item in output[:6])
        more = ", ..." if len(output) > 6 else ""
        return f"{type(output).__name__} of {len(output)}: ({inner}{more})"
    return type(output).__name__


def _described_items(items: Mapping[Any, Any], depth: int) -> str:
    shown = [f"{k!r}: {describe_output(v, depth + 1)}" for k, v in list(items.items())[:6] if v is not None]
    return "{" + ", ".join(shown) + (", ..." if len(items) > 6 else "") + "}"


def _prediction(output: Any) -> torch.Tensor:
    """What the default loss compares with the target: the output itself, or a Hugging Face output's logits."""
    if isinstance(output, torch.Tensor):
        return output
    if _is_hf_output(output) and isinstance(getattr(output, "logits", None), torch.Tensor):
        return output.logits
    raise LossError(
        f"the model's output is a {describe_output(output)} without a 'loss': the default loss does not guess which "
        "part to train on (See Note [the default loss], autofit/training/loss.py); pass loss_fn=lambda output, "
        "target: ... that picks it, e.g. F.cross_entropy(output[1], target)"
    )


def default_loss(output: Any, target: Any = None) -> torch.Tensor:
    loss = own_loss(output)
    if loss is not None:
        return loss
    prediction = _prediction(output)
    if target is not None and isinstance(target, torch.Tensor):
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
    if target is None and prediction.numel() == 1:
        return prediction.reshape(())
    raise LossError(
        "no loss could be derived from the model's output "
        f"({describe_output(output)}{'' if target is None else ' with a target'}): "
        "pass loss_fn=lambda output, target: ..."
    )


def describe_loss(loss_fn: LossFn | None) -> str:
    """How a plan names its loss in JSON: "default", or "custom: <module>.<qualified name>"."""
    if loss_fn is None:
        return "default"
    name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__qualname__
    module = getattr(loss_fn, "__module__", None) or type(loss_fn).__module__
    return f"custom: {module}.{name}"


def _check_arity(loss_fn: LossFn, args: tuple) -> None:
    """A loss_fn that cannot take what the step passes gets a LossError saying why, not a TypeError from the call."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call itself decides
        return
    try:
        signature.bind(*args)
    except TypeError as e:
        if len(args) == 1:
            raise LossError(
                f"loss_fn{signature} cannot be called as loss_fn(output) ({e}): no target was given, so the loss "
                "gets the model's output alone. Pass target=... (the labels, one row per sample row), or a "
                "loss_fn of the output alone (lambda output: ...)") from None
        raise LossError(
            f"loss_fn{signature} cannot be called as loss_fn(output, target) ({e}): a target was given, so the "
            "loss gets the model's output and the micro-batch's target. Accept both, or leave target out and "
            "compute the loss from the output alone") from None


def compute_loss(loss_fn: LossFn | None, output: Any, target: Any) -> torch.Tensor:
    """Call the loss and check it is a differentiable floating scalar."""
    if loss_fn is None:
        loss = default_loss(output, target)
    else:
        args = (output,) if target is None else (output, target)
        _check_arity(loss_fn, args)
        loss = loss_fn(*args)
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
