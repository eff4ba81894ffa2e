"""Apply a :class:`~autofit.Plan` inside other training loops: Hugging Face ``Trainer`` (:mod:`autofit.integrations.hf`)
and Lightning (:mod:`autofit.integrations.lightning`). Each imports its library lazily and raises
:class:`~autofit.core.errors.InvalidInputError` naming the package to install when it is missing."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import replace
from types import ModuleType
from typing import Any

from torch import nn

from autofit.core.errors import InvalidInputError
from autofit.features import FEATURES, OPT_IN, before_wrap
from autofit.features.activation_offload import ACTIVATION_OFFLOAD
from autofit.emit.plan import Plan
from autofit.training.config import DEVICES
from autofit.training.step import patched_model

__all__ = ["require", "plan_patches", "checked_plan"]


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or say which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise InvalidInputError(f"this integration needs {module.split('.')[0]}: pip install '{extra}'") from e


def checked_plan(plan: object, callback: str) -> Plan:
    """``plan`` if a callback named ``callback`` can apply it: a Plan whose parameters stay in their own precision
    (a stored-low-precision plan needs the wrapper's master copy, Note [stored precision]) and none of whose step
    features needs ``wrap()`` (``Feature.outside_wrap``), its caching-allocator setting put in place
    (``Feature.before_wrap``)."""
    if not isinstance(plan, Plan):
        raise InvalidInputError(f"{callback} needs an autofit.Plan, got {type(plan).__name__}")
    plan.parallel.refuse_for_callback(callback)  # the layout says which loops can apply it (FSDP2: wrap() only)
    if plan.precision.stored not in (None, "fp32"):
        raise InvalidInputError(
            f"this plan stores the parameters as {plan.precision.stored} (Note [stored precision]), which "
            f"{callback} does not apply: train it with plan.wrap(model, optimizer), or plan with "
            "min_stored_precision='fp32'"
        )
    for feature in FEATURES:  # Note [step features]
        refused = feature.outside_wrap(plan, callback)
        if refused is not None:
            raise InvalidInputError(refused)
    before_wrap(plan)  # built before the Trainer moves the model: the allocator setting can still apply
    return plan


def _device_type(model: nn.Module) -> str:
    return next((p.device.type for p in model.parameters()), "cpu")


def plan_patches(plan: Plan, model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """The plan's module-level knobs on ``model`` (exactly ``plan.checkpoint`` recomputed with non-reentrant
    checkpointing, ``plan.offload``'s saved activations on the host, ``plan.precision.fp32_modules`` out of
    autocast), undone on exit: the same patch of the same step, ``plan.step``, the emitted Trainer applies
    (autofit.training.step.patched_model), so another training loop runs the step autofit simulated."""
    plan.parallel.refuse_for_callback("another training loop")
    if any(feature.in_force(plan) is not None for feature in OPT_IN):  # Note [step features]
        raise InvalidInputError(
            f"this plan climbed the rung {' or '.join(repr(f.name) for f in OPT_IN)}, which replace "
            f"{' or '.join(f.replaces for f in OPT_IN)} of the step: train it with plan.wrap(model, optimizer), or "
            "plan without allow=..."
        )
    device_type = _device_type(model)
    # the step the plan's estimate verified (Note [the plan's step], autofit/emit/plan.py), on the device the loop's
    # model is on (a device autofit does not model, such as "mps", patches as on the CPU)
    config = replace(plan.step, device=device_type if device_type in DEVICES else "cpu")
    return _patched(model, config, device_type)


@contextlib.contextmanager
def _patched(model: nn.Module, config: Any, device_type: str) -> Iterator[nn.Module]:
    """``patched_model``, then the offloaded activations (a step feature's, entered after the other module-level
    knobs as the trainer enters it, so an offloaded module's saved tensors go to the host whatever else it runs)."""
    with patched_model(model, config, device_type) as patched, \
            ACTIVATION_OFFLOAD.step_context(config, patched, None):
        yield patched


