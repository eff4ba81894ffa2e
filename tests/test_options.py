"""The options per concern (autofit/options.py): shortcuts, typed errors that name the fix, and the old flat keywords
mapped to their fields in one place with a FutureWarning (Note [flat keywords])."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch
from torch import nn

import autofit
from autofit import Device, Layout, Precision, Savers, Search, Step
from autofit.options import (FLAT_KEYWORDS, STEP_GROUPS, Options, as_device, as_layout, as_precision, as_savers,
                             as_search, as_step, gather)
from autofit.request import make_request

# The tests of the old flat keywords themselves: pyproject.toml makes autofit's deprecation warning an error in every
# other test (the suite writes the option values); here it is what is tested (pytest.warns records it either way)
OLD_SPELLING = pytest.mark.filterwarnings("default:.*is deprecated. write:FutureWarning")


def test_shortcuts_build_the_values_they_stand_for():
    assert as_device("cpu") == Device(kind="cpu")
    assert as_device("cuda") == Device()
    assert as_device("cuda:1") == Device(kind="cuda:1")
    assert as_device("H100") == Device(gpu="H100")
    assert as_device(torch.device("cpu")) == Device(kind="cpu")
    assert as_precision("bf16") == Precision(compute="bf16")
    policy = autofit.PrecisionPolicy(name="bf16", fp32_modules=("head",))
    assert as_precision(policy) == Precision(compute=policy)
    assert as_savers("none") == Savers(checkpoint=(), offload=False)
    assert as_savers("auto") == as_savers(None) == Savers()
    assert as_layout(8) == Layout(world_size=8)
    assert as_search("exact") == Search(extrapolate_depth=False)
    assert as_layout({"world_size": 4, "strategy": "fsdp2"}) == Layout(world_size=4, strategy="fsdp2")
    assert as_step(None) == Step() and as_step({"accumulation_steps": 4}) == Step(accumulation_steps=4)


def test_the_values_are_frozen_and_keyword_only():
    for cls in (Device, Precision, Savers, Layout, Search, Step, Options):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        with pytest.raises(TypeError):
            cls("positional")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Layout().world_size = 2


@pytest.mark.parametrize("call, fix", [
    (lambda: as_layout("eight"), "an int (the world size)"),
    (lambda: as_layout(True), "an int (the world size)"),
    (lambda: as_savers("off"), "'auto' or 'none'"),
    (lambda: as_search("fast"), "'auto' or 'exact'"),
    (lambda: as_device(3), "a catalog GPU name"),
    (lambda: as_layout({"world": 2}), "its fields are"),
    (lambda: as_step({"acumulation_steps": 2}), "Step has no field 'acumulation_steps'"),
    (lambda: as_step("4"), "an autofit.Step(...), an int (the micro-batch size), or a mapping of its fields"),
    (lambda: Layout(world_size=0), "world_size must be an int >= 1"),
    (lambda: Layout(strategy="zero3"), "must be 'ddp', 'fsdp2' or None"),
    (lambda: Savers(offload="sometimes"), "offload must be 'auto'"),
    (lambda: Search(extrapolate_depth="yes"), "extrapolate_depth must be True, False or 'auto'"),
    (lambda: Device(kind="H100"), "Device(gpu='H100')"),
])
def test_a_wrong_value_is_a_typed_error_naming_the_fix(call, fix):
    with pytest.raises(autofit.InvalidInputError) as e:
        call()
    assert fix in str(e.value)


@OLD_SPELLING
def test_each_flat_keyword_maps_to_a_field_of_its_value_with_a_warning_naming_it():
    for keyword, (group, field) in FLAT_KEYWORDS.items():
        assert field in {f.name for f in dataclasses.fields(type(getattr(Options(), group)))}, keyword
    with pytest.warns(FutureWarning) as record:
        values = gather("plan", {}, {"world_size": 2, "strategy": "ddp"})
    assert [str(w.message) for w in record] == [
        "plan(world_size=...) is deprecated: write layout=autofit.Layout(world_size=2)",
        "plan(strategy=...) is deprecated: write layout=autofit.Layout(strategy='ddp')"]
    assert values["layout"] == Layout(world_size=2, strategy="ddp")
    with pytest.warns(FutureWarning):  # the old device="cuda", gpu=... refines the shortcut
        assert gather("plan", {"device": "cuda"}, {"gpu": "H100"})["device"] == Device(gpu="H100")


def test_a_flat_keyword_beside_the_value_that_owns_it_is_refused():
    with pytest.raises(autofit.InvalidInputError, match=r"drop gpu= and write device=autofit\.Device\(gpu='T4'\)"):
        gather("plan", {"device": Device(gpu="H100")}, {"gpu": "T4"})
    with pytest.raises(autofit.InvalidInputError, match="world_size= and layout= both given"):
        gather("plan", {"layout": {"world_size": 2}}, {"world_size": 4})


def test_an_unknown_keyword_is_a_type_error_as_python_names_it():
    with pytest.raises(TypeError, match="plan\\(\\) got an unexpected keyword argument 'wrold_size'"):
        gather("plan", {}, {"wrold_size": 2})
    # a flat keyword of a value estimate does not take (Search) is unknown to it
    with pytest.raises(TypeError, match="estimate\\(\\) got an unexpected keyword argument 'extrapolate_depth'"):
        autofit.estimate(nn.Linear(4, 4), torch.zeros(2, 4), step=1, extrapolate_depth=False)


def test_plan_estimate_and_measure_take_the_values():
    for function in (autofit.plan, autofit.estimate, autofit.measure):
        parameters = inspect.signature(function).parameters
        assert {"device", "precision", "layout"} <= set(parameters), function
        assert not {"gpu", "world_size", "strategy", "tensor_parallel"} & set(parameters), function
    assert {"savers", "search"} <= set(inspect.signature(autofit.plan).parameters)
    # 29 before, ``**deprecated`` counted; 16 since issue 55's ``batch_dim`` (a property of the sample, as ``shared``)
    assert len(inspect.signature(autofit.plan).parameters) <= 16
    # estimate and measure: the step's knobs in one Step, none of them flat (26 and 27 before, ``**deprecated``
    # counted; ``measure`` has its own ``steps``, the windows it measures)
    step_knobs = {f.name for f in dataclasses.fields(Step)}
    for function, most in ((autofit.estimate, 14), (autofit.measure, 15)):
        parameters = inspect.signature(function).parameters
        assert "step" in parameters and not step_knobs & set(parameters), function
        assert len(parameters) <= most, (function, len(parameters))


@pytest.mark.sim
@OLD_SPELLING
def test_a_step_is_one_value_and_its_old_flat_keywords_fold_into_it():
    """The truth is the CPU allocator: ``measure`` of the same step. The Step, a mapping of its fields and the old flat
    keywords (with a warning naming the new spelling) describe the same step; the word ``checkpoint`` is a Step field
    for estimate and a Savers field for plan (Note [flat keywords])."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    x, y = torch.randn(256, 16), torch.randint(0, 4, (256,))
    kw = dict(target=y, optimizer="sgd")  # no state: the activations decide the peak
    step = Step(micro_batch_size=128, accumulation_steps=2, checkpoint=["2"], inputs="micro-batch")
    measured = autofit.measure(model, x, step=step, **kw).peak_bytes
    assert autofit.estimate(model, x, step=step, **kw).peak_bytes == measured
    as_mapping = {"micro_batch_size": 128, "accumulation_steps": 2, "checkpoint": ["2"], "inputs": "micro-batch"}
    assert autofit.estimate(model, x, step=as_mapping, **kw).peak_bytes == measured
    with pytest.warns(FutureWarning) as record:
        flat = autofit.estimate(model, x, accumulation_steps=2, checkpoint=["2"], inputs="micro-batch",
                                micro_batch_size=128, **kw)
    assert flat.peak_bytes == measured
    assert "estimate(accumulation_steps=...) is deprecated: write step=autofit.Step(accumulation_steps=2)" in [
        str(w.message) for w in record]
    # each knob reached the step: without it the allocator records another peak
    for other in (Step(micro_batch_size=128, checkpoint=["2"], inputs="micro-batch"),
                  Step(micro_batch_size=128, accumulation_steps=2, inputs="micro-batch"),
                  Step(micro_batch_size=128, accumulation_steps=2, checkpoint=["2"])):
        assert autofit.measure(model, x, step=other, **kw).peak_bytes != measured, other
    with pytest.warns(FutureWarning, match="write savers=autofit.Savers"):
        assert gather("plan", {}, {"checkpoint": ()})["savers"] == Savers(checkpoint=())
    with pytest.warns(FutureWarning, match="write step=autofit.Step"):
        assert gather("estimate", {}, {"checkpoint": ()}, groups=STEP_GROUPS)["step"] == Step(checkpoint=())
    with pytest.raises(autofit.InvalidInputError, match="accumulation_steps= and step= both given"):
        autofit.estimate(model, x, step=step, accumulation_steps=2, **kw)
    with pytest.raises(TypeError, match="estimate\\(\\) got an unexpected keyword argument 'savers'"):
        autofit.estimate(model, x, savers="none", step=128, **kw)


def _request(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        request = make_request(model, x, "1GB", options=Options.of(**kwargs), batch_size=8, target=y)
    return {f.name: getattr(request, f.name) for f in dataclasses.fields(request)
            if f.name not in ("model", "batch", "target", "options")}


@pytest.mark.sim
@OLD_SPELLING
def test_the_old_keywords_and_the_values_make_the_same_request():
    old = _request(device="cuda", gpu="T4", margin="5%", host_budget="8GB", world_size=2, strategy="fsdp2",
                   reshard_after_forward=False, checkpoint="auto", offload=False, min_stored_precision="fp32",
                   extrapolate_depth=False)
    new = _request(device=Device(gpu="T4", margin="5%", host_budget="8GB"),
                   layout=Layout(world_size=2, strategy="fsdp2", reshard_after_forward=False),
                   savers=Savers(offload=False), precision=Precision(min_stored="fp32"), search="exact")
    assert old == new
    assert old["world_size"] == 2 and old["reshard_options"] == (False,) and not old["offload"]


@pytest.mark.sim
@OLD_SPELLING
def test_estimate_takes_one_layout_and_refuses_the_planners_choices():
    model, x = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)), torch.randn(4, 16)
    y = torch.randn(4, 1)
    old = autofit.estimate(model, x, step=2, target=y, layout=Layout(world_size=2, strategy="fsdp2"))
    with pytest.warns(FutureWarning):
        flat = autofit.estimate(model, x, step=2, target=y, world_size=2, strategy="fsdp2")
    assert old.peak_bytes == flat.peak_bytes
    with pytest.raises(autofit.InvalidInputError, match="Layout\\(tensor_parallel=T\\)"):
        autofit.estimate(model, x, step=2, target=y, layout=Layout(tensor_parallel="auto"))
    with pytest.raises(autofit.InvalidInputError, match="an estimate has no budget"):
        autofit.estimate(model, x, step=2, target=y, device=Device(kind="cpu", margin="5%"))


@OLD_SPELLING
def test_the_micro_batch_size_is_a_field_of_the_step_and_an_int_is_its_shortcut():
    assert as_step(8) == Step(micro_batch_size=8) and as_step({"micro_batch_size": 8}) == Step(micro_batch_size=8)
    # the old keyword folds into the Step, also beside one that leaves the field unset (None, its default)
    with pytest.warns(FutureWarning, match=r"write step=autofit\.Step\(micro_batch_size=8\)"):
        values = gather("estimate", {"step": Step(accumulation_steps=2)}, {"micro_batch_size": 8}, groups=STEP_GROUPS)
    assert values["step"] == Step(micro_batch_size=8, accumulation_steps=2)
    with pytest.raises(autofit.InvalidInputError, match="micro_batch_size= and step= both given"):
        gather("estimate", {"step": Step(micro_batch_size=4)}, {"micro_batch_size": 8}, groups=STEP_GROUPS)
    for function in (autofit.estimate, autofit.measure):  # none given: the error names the fix, before any work
        with pytest.raises(autofit.InvalidInputError, match=r"micro_batch_size=None: give step=N"):
            function(nn.Linear(4, 4), torch.zeros(2, 4), step=Step(accumulation_steps=2))


@OLD_SPELLING
def test_shared_is_a_field_of_the_batch_dim_and_a_dim_is_its_shortcut():
    from autofit import BatchDim
    from autofit.options import as_batch_dim

    assert as_batch_dim(1) == BatchDim(1) and as_batch_dim((1, 0)) == BatchDim(dim=(1, 0))
    assert as_batch_dim(None) == BatchDim() == BatchDim(0, shared=())
    for function, groups in (("plan", None), ("estimate", STEP_GROUPS)):
        kw = {"groups": groups} if groups else {}
        with pytest.warns(FutureWarning, match=r"write batch_dim=autofit\.BatchDim\(shared=\('mask',\)\)"):
            values = gather(function, {"batch_dim": 1}, {"shared": ("mask",)}, **kw)
        assert values["batch_dim"] == BatchDim(1, shared=("mask",))
    with pytest.raises(autofit.InvalidInputError, match="shared= and batch_dim= both given"):
        gather("plan", {"batch_dim": BatchDim(0, shared=(0,))}, {"shared": ("mask",)})
