"""The registry of step features (Note [step features], autofit/features/base.py): each declared once, its value
carried under its field by the values the stages hand on."""

from __future__ import annotations

import dataclasses

import pytest

from autofit.emit.plan import Plan
from autofit.features import FEATURES, OPT_IN, Feature, registry
from autofit.request import PlanRequest
from autofit.training.config import StepConfig
from autofit.validate import ALLOW_NAMES


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_every_feature_is_carried_by_the_plan_and_every_opt_in_one_by_the_request():
    for feature in FEATURES:
        assert feature.field in _fields(Plan), feature.name
    for feature in OPT_IN:
        assert {feature.field, feature.allow_field} <= _fields(PlanRequest), feature.name
    # the step reads the values of the features whose step hooks read them
    assert {"chunked_loss", "optimizer_in_backward"} <= _fields(StepConfig)


def test_allow_accepts_exactly_the_opt_in_features():
    assert ALLOW_NAMES == ("8bit-optimizer", "chunked-loss", "float8")
    assert sorted(f.name for f in OPT_IN) == list(ALLOW_NAMES)


def test_the_registry_refuses_a_name_twice():
    twin = Feature(name="chunked-loss", field="other")
    with pytest.raises(ValueError, match="same name"):
        registry(*FEATURES, twin)
