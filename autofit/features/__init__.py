"""The step features, one module each, registered in :data:`FEATURES` (Note [step features],
autofit/features/base.py). The stages iterate over the registry and never name a feature."""

from __future__ import annotations

from typing import Any

from autofit.features.activation_offload import ACTIVATION_OFFLOAD
from autofit.features.allocator import ALLOCATOR_SETTING
from autofit.features.base import Feature, OptInFeature, StepLoss, with_carried
from autofit.features.chunked_loss import CHUNKED_LOSS
from autofit.features.compile import COMPILE
from autofit.features.float8 import FLOAT8
from autofit.features.in_backward import IN_BACKWARD
from autofit.features.low_bit_optimizer import LOW_BIT_OPTIMIZER
from autofit.features.preallocated_grads import PREALLOCATED_GRADS

__all__ = ["FEATURES", "FURTHER", "OPT_IN", "Feature", "OptInFeature", "StepLoss", "before_wrap",
           "convert_model", "feature_fields", "feature_names", "feature_values", "registry", "step_features",
           "user_features"]


def registry(*features: Feature) -> tuple[Feature, ...]:
    """``features`` as a registry: in the given order, each name and field once (a second would shadow the first)."""
    for attribute in ("name", "field"):
        seen = [getattr(f, attribute) for f in features]
        twice = sorted({v for v in seen if seen.count(v) > 1})
        if twice:
            raise ValueError(f"step features registered twice under the same {attribute}: {twice}")
    return features


# In registry order the stages enter the features' contexts and place their plan rows; the opt-in ones are also
# the order the ladder climbs them: float rounding only first, then the 8-bit state, which changes the update's
# numbers (Note [the ladder])
FEATURES: tuple[Feature, ...] = registry(FLOAT8, COMPILE, ALLOCATOR_SETTING, PREALLOCATED_GRADS, ACTIVATION_OFFLOAD,
                                         CHUNKED_LOSS, LOW_BIT_OPTIMIZER, IN_BACKWARD)
OPT_IN: tuple[OptInFeature, ...] = tuple(f for f in FEATURES if isinstance(f, OptInFeature))
# those carried in the carriers' more_features, not a field of their own (Note [carried features])
FURTHER: tuple[Feature, ...] = tuple(f for f in FEATURES if not f.own_field)


def feature_names() -> tuple[str, ...]:
    """The names ``plan(allow=...)`` accepts, sorted."""
    return tuple(sorted(f.name for f in OPT_IN))


def feature_fields(request: Any) -> dict[str, Any]:
    """The value on ``request`` (a rung's PlanRequest) of every feature it carries, by its field: what the rung set
    (the opt-in ones) and what the user set (Feature.user_setting), handed on to the plan; those registered after the
    first ones as its ``more_features`` (Note [carried features])."""
    own = {f.field: f.in_force(request) for f in FEATURES
           if f.own_field and (isinstance(f, OptInFeature) or f.user_setting)}
    return dict(own, more_features=step_features(request))


def step_features(carrier: Any) -> tuple[tuple[str, Any], ...]:
    """The values in force on ``carrier`` of the features carried in ``more_features`` (Note [carried features]),
    as a step carries them: a request's ``allow=`` values left out."""
    pairs: tuple[tuple[str, Any], ...] = ()
    for feature in FURTHER:
        pairs = with_carried(pairs, feature.field, feature.in_force(carrier))
    return pairs


def user_features(options: Any, gpu: Any) -> tuple[tuple[str, Any], ...]:
    """The values the user gave the features carried in ``more_features`` (Note [carried features]): each the
    attribute of ``options`` (an ``autofit.Step`` or ``Savers``) named as its field, read by its
    :meth:`Feature.from_user` for the target's ``gpu`` (a catalog GPUSpec, or None)."""
    pairs: tuple[tuple[str, Any], ...] = ()
    for feature in FURTHER:
        if hasattr(options, feature.field):
            pairs = with_carried(pairs, feature.field, feature.from_user(getattr(options, feature.field), gpu))
    return pairs


def feature_values(request: Any) -> tuple[Any, ...]:
    """Every opt-in feature's value on ``request``, in registry order: what tells apart the steps of two rungs (the
    key of their analyses)."""
    return tuple(f.in_force(request) for f in OPT_IN)


def before_wrap(plan: Any) -> None:
    """What every step feature puts in place before a trainer or a callback touches the model for ``plan``
    (Feature.before_wrap); raises where one cannot, or where one planned for one process only
    (Feature.one_process) is in force on a plan laid out over processes."""
    for feature in FEATURES:
        if feature.one_process is not None and feature.in_force(plan):
            plan.parallel.refuse_laid_out(feature.one_process)
        feature.before_wrap(plan)


def convert_model(config: Any, model: Any) -> Any:
    """``model`` as every step feature converts it for ``config``'s step (Feature.convert), in place, before the
    parallel layout is applied; returns it. The one call of the simulation, ``measure`` and the trainer."""
    for feature in FEATURES:
        feature.convert(config, model)
    return model
