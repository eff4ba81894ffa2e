"""What ``wrap`` checks before it patches anything, and the record of the models a live trainer has patched.

See Note [one trainer per model].
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn

from autofit.core.errors import InvalidInputError, TrainerStateError

__all__ = ["check_optimizer", "claim", "refuse_wrapped", "release"]

# Note [one trainer per model]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A trainer patches modules' instance ``forward`` (checkpointing, fp32 pins, offload) and restores what it found on
# unwrap. Two live trainers on one model stack their patches, and unwrapping them in the order they were made
# restores the first one's "nothing" before the second one's "the first one's wrapper": the checkpoint wrapper then
# stays on the module for good (a notebook cell that wraps, run twice). So a module belongs to at most one live
# trainer: wrap refuses a model any of whose modules is patched by one. The record holds modules weakly and the
# trainer weakly: a trainer collected without unwrap has already undone its patches (its context managers are
# generators, which run their ``finally`` when collected), so its entry means nothing any more.
_WRAPPED: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


def refuse_wrapped(model: nn.Module) -> None:
    """A :class:`TrainerStateError` when a live trainer has patched ``model`` or one of its modules."""
    for name, module in model.named_modules():
        owner = _WRAPPED.get(module)
        if owner is not None and owner() is not None:
            where = "this model" if not name else f"its module {name!r}"
            raise TrainerStateError(
                f"{where} is already wrapped by a trainer that was not unwrapped (See Note [one trainer per model] in "
                "autofit/emit/wrapping.py): call that trainer's unwrap() first, or keep training with it"
            )


def claim(model: nn.Module, trainer: Any) -> None:
    ref = weakref.ref(trainer)
    for module in model.modules():
        _WRAPPED[module] = ref


def release(model: nn.Module, trainer: Any) -> None:
    for module in model.modules():
        owner = _WRAPPED.get(module)
        if owner is not None and owner() in (trainer, None):
            del _WRAPPED[module]


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer must step exactly the model's trainable parameters (the same tensor objects): a foreign one
    means the steps train another model, a missing one that part of this model never moves. Frozen parameters of
    the model may be in it (torch skips parameters without a gradient)."""
    _refuse_closure_step(optimizer)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    stepped: set[int] = set()
    foreign = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            stepped.add(id(p))
            if id(p) not in names:
                foreign.append(f"param_groups[{g}]['params'][{i}] (shape {tuple(p.shape)})")
    if foreign:
        raise InvalidInputError(
            f"the optimizer steps {len(foreign)} tensor(s) that are not parameters of this model: "
            f"{_listed(foreign)}; build it over this model's parameters, e.g. torch.optim.SGD(model.parameters(), "
            "...), after any change that replaces them (.to(dtype), loading a copy)"
        )
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in stepped]
    if missing:
        raise InvalidInputError(
            f"the optimizer does not step {len(missing)} trainable parameter(s) of this model: {_listed(missing)}; "
            "build it over model.parameters(), or freeze those with requires_grad_(False) before wrap()"
        )


def _refuse_closure_step(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer whose ``step`` needs a closure (``torch.optim.LBFGS``: it re-evaluates the loss several times per
    step) cannot run in a step that evaluates each micro-batch once and then steps: refused here, before anything is
    patched, rather than failing at the first ``step`` with the optimizer's own TypeError."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: the step itself decides
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise InvalidInputError(
            f"{type(optimizer).__name__}.step needs a closure that re-evaluates the loss (it runs forward and backward "
            "several times per step), which the trainer's step (each micro-batch once, then one optimizer step) "
            "cannot give: use an optimizer whose step takes no closure (SGD, Adam, AdamW, ...), or train with "
            f"{type(optimizer).__name__} in your own loop"
        )


def _listed(items: list[str]) -> str:
    return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")
