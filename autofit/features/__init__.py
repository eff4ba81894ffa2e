"""The step features, one module each, registered in the order the ladder climbs them (Note [step features],
autofit/features/base.py). The stages iterate over :data:`FEATURES` and never name a feature."""

from __future__ import annotations

from typing import Any

from autofit.features.base import Feature, StepLoss
from autofit.features.chunked_loss import CHUNKED_LOSS
from autofit.features.low_bit_optimizer import LOW_BIT_OPTIMIZER

__all__ = ["FEATURES", "Feature", "StepLoss", "feature_fields", "feature_names", "feature_values", "registry"]


def registry(*features: Feature) -> tuple[Feature, ...]:
    """``features`` as a registry: in the given order, each name and field once (a second would shadow the first)."""
    for attribute in ("name", "field", "allow_field"):
        seen = [getattr(f, attribute) for f in features]
        twice = sorted({v for v in seen if seen.count(v) > 1})
        if twice:
            raise ValueError(f"step features registered twice under the same {attribute}: {twice}")
    return features


# float rounding only, so first; then the 8-bit state, which changes the update's numbers (Note [the ladder])
FEATURES: tuple[Feature, ...] = registry(CHUNKED_LOSS, LOW_BIT_OPTIMIZER)


def feature_names() -> tuple[str, ...]:
    """The names ``plan(allow=...)`` accepts, sorted."""
    return tuple(sorted(f.name for f in FEATURES))


def feature_fields(carrier: Any) -> dict[str, Any]:
    """Every feature's value on ``carrier`` (a PlanRequest, a StepConfig or a Plan) by its field: what a rung set,
    handed on to the plan."""
    return {f.field: f.in_force(carrier) for f in FEATURES}


def feature_values(carrier: Any) -> tuple[Any, ...]:
    """Every feature's value on ``carrier``, in registry order: what tells apart the steps of two rungs (the key of
    their analyses)."""
    return tuple(f.in_force(carrier) for f in FEATURES)
