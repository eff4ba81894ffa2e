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
    carriers = (Plan, PlanRequest, StepConfig)
    for feature in FEATURES:
        if feature.own_field:
            assert feature.field in _fields(Plan), feature.name
        else:  # Note [carried features]: no field of its own anywhere, read as one on a plan
            assert all(feature.field not in _fields(c) and "more_features" in _fields(c) for c in carriers)
            assert isinstance(getattr(Plan, feature.field), property), feature.name
    for feature in OPT_IN:
        if feature.own_field:
            assert {feature.field, feature.allow_field} <= _fields(PlanRequest), feature.name
    # the step reads the values of the features whose step hooks read them
    assert {"chunked_loss", "optimizer_in_backward"} <= _fields(StepConfig)


def test_a_carried_feature_travels_in_more_features_and_its_value_checks_the_step():
    """Note [carried features], with Float8 (its value made by hand: no torchao needed): the step keeps it under its
    name, sorted, None dropped; a request carries what allow= opened beside what is in force, and only the latter
    reaches the step; the value's own rule runs on the step (the float8 all-gather is FSDP2's); a value that is no
    feature's is refused."""
    from autofit.core.errors import InvalidInputError
    from autofit.features import FURTHER, step_features
    from autofit.features.float8 import FLOAT8, Float8
    from autofit.parallel.layout import Parallel
    from autofit.training.config import make_step_config

    assert FLOAT8 in FURTHER
    config = make_step_config(micro_batch_size=1, float8=Float8(recipe="rowwise"))
    assert config.more_features == (("float8", Float8(recipe="rowwise")),)
    assert FLOAT8.in_force(config) == Float8(recipe="rowwise")
    assert make_step_config(micro_batch_size=1, float8=None).more_features == ()
    assert FLOAT8.in_force(FLOAT8.carry(config, None)) is None

    @dataclasses.dataclass(frozen=True)
    class Request:
        more_features: tuple = ()

    opened = Request(more_features=(("allow_float8", Float8()),))
    assert FLOAT8.allowed(opened) == Float8() and FLOAT8.in_force(opened) is None
    assert step_features(opened) == ()
    rung = FLOAT8.carry(opened, Float8())
    assert rung.more_features == (("allow_float8", Float8()), ("float8", Float8()))
    assert step_features(rung) == (("float8", Float8()),)
    assert FLOAT8.request_without(rung, opened).more_features == opened.more_features
    with pytest.raises(InvalidInputError, match="strategy='fsdp2'"):
        make_step_config(micro_batch_size=1, float8=Float8(all_gather=True),
                         layout=Parallel(strategy="ddp", world_size=2))
    with pytest.raises(InvalidInputError, match="not a step feature's value"):
        make_step_config(micro_batch_size=1, float8="tensorwise")  # the user's spelling is read by from_user


def test_the_cli_has_a_flag_for_each_carried_feature_the_user_sets():
    """The CLI declares the carried features' flags without importing torch (FEATURE_FLAGS, autofit/cli/flags.py):
    one per carried feature the user sets, on both plan and estimate."""
    import typer

    from autofit.cli.app import app
    from autofit.cli.flags import FEATURE_FLAGS, feature_flag_names
    from autofit.features import FURTHER

    assert set(FEATURE_FLAGS) == {f.field for f in FURTHER if f.user_setting}
    commands = typer.main.get_command(app).commands
    for name in ("plan", "estimate"):
        opts = {o for p in commands[name].params for o in p.opts}
        assert {n for names in feature_flag_names().values() for n in names} <= opts, name


def test_allow_accepts_exactly_the_opt_in_features():
    assert ALLOW_NAMES == ("8bit-optimizer", "chunked-loss", "float8")
    assert sorted(f.name for f in OPT_IN) == list(ALLOW_NAMES)


def test_the_registry_refuses_a_name_twice():
    twin = Feature(name="chunked-loss", field="other")
    with pytest.raises(ValueError, match="same name"):
        registry(*FEATURES, twin)


@pytest.mark.sim
def test_a_carried_feature_reaches_the_plan_its_json_its_step_and_its_export():
    """Float8 on a GPU target (no CPU fp8 kernel needed): the user's value travels request -> plan -> JSON -> the
    plan's step, read as ``plan.float8``, and the torchtitan export writes the feature's own sections."""
    pytest.importorskip("torchao.float8")
    import torch
    from torch import nn

    import autofit
    from autofit.emit.export import to_torchtitan_config
    from autofit.features.float8 import FLOAT8, Float8

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 16))
    x = torch.randn(8, 64)
    plan = autofit.plan(model, x, "4GB", loss_fn=lambda out: out.square().mean(), device="H100",
                        savers=autofit.Savers(float8="rowwise", checkpoint="none"))
    assert plan.float8 == Float8(recipe="rowwise") and plan.more_features == (("float8", plan.float8),)
    assert FLOAT8.in_force(plan.step) == plan.float8
    loaded = autofit.Plan.from_json(plan.to_json())
    assert loaded.float8 == plan.float8 and loaded.step == plan.step
    assert '"float8": {"recipe": "rowwise"' in plan.to_json(indent=None)
    titan = to_torchtitan_config(plan)
    assert titan["model"]["converters"] == ["quantize.linear.float8"]
    assert titan["quantize.linear.float8"]["recipe_name"] == "rowwise"
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))  # planning converts a copy
