"""The optimizer step fused into backward (Note [optimizer step in backward], autofit/training/in_backward.py). Truths: the CPU
allocator (``autofit.measure``) for the peak, and a plain optimizer step for the parameters."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import autofit
from autofit.core.errors import InvalidInputError
from autofit.training.precision import PrecisionPolicy
from autofit.core.report import MemoryEstimate


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)], nn.Linear(256, 10))


def _data(rows: int = 1):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 256, generator=g), torch.randint(0, 10, (rows,), generator=g)


@pytest.mark.sim
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_estimate_equals_measure_and_the_peak_loses_the_gradients(optimizer):
    x, y = _data()
    model = _model()
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    peaks = {}
    for in_backward in (False, True):
        kw = dict(target=y, optimizer=optimizer,
                  step=autofit.Step(micro_batch_size=1, optimizer_in_backward=in_backward))
        est = autofit.estimate(model, x, **kw)
        peaks[in_backward] = autofit.measure(model, x, **kw).peak_bytes
        assert est.peak_bytes == peaks[in_backward]
    saved = peaks[False] - peaks[True]
    # at micro-batch 1 the plain step's peak holds every gradient; in backward one parameter's gradient (and its
    # step) is live at a time, next to the gradients flowing back through the activations
    assert grads - 2 * largest <= saved <= grads, (saved, grads, largest)


def _plan(optimizer: str, **changes) -> autofit.Plan:
    plan = autofit.Plan(
        micro_batch_size=4, gradient_accumulation_steps=1, batch_size=4, last_micro_batch_size=4,
        precision=PrecisionPolicy(), checkpoint=(), peak_bytes=1, device_bytes=1, budget_bytes=1, device="cpu",
        optimizer=optimizer, predicted_step_seconds=0.0, estimate=MemoryEstimate(peak_bytes=1, breakdown={}),
        optimizer_in_backward=True,
    )
    return dataclasses.replace(plan, **changes)


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                  lambda p: torch.optim.AdamW(p, lr=1e-2)], ids=["sgd", "adamw"])
def test_trainer_step_equals_a_plain_step_and_unwrap_removes_the_hooks(make):
    x, y = _data(4)
    reference, ours = _model(), _model()
    opt = make(reference.parameters())
    for _ in range(2):  # a second step uses the state the first one made
        nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    optimizer = make(ours.parameters())
    trainer = _plan("sgd").wrap(ours, optimizer)
    trainer.step(x, y)
    trainer.step(x, y)
    assert all(p.grad is None for p in ours.parameters())
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert set(optimizer.state) == set(ours.parameters())  # the user's optimizer holds the state
    trainer.unwrap()
    before = [p.detach().clone() for p in ours.parameters()]
    nn.functional.cross_entropy(ours(x), y).backward()  # no hook steps any more
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))


@pytest.mark.parametrize("kwargs, match", [
    (dict(accumulation_steps=2), "accumulation"),
    (dict(clip_grad_norm=1.0), "clipping"),
    (dict(precision="fp16"), "loss scaling"),
    (dict(precision=PrecisionPolicy(name="bf16", stored="bf16-master")), "master copy"),
])
def test_invalid_combinations_are_typed_errors(kwargs, match):
    x, y = _data()
    kwargs = dict(kwargs)  # the step's knob in its Step, the rest as keywords
    step = autofit.Step(micro_batch_size=1, optimizer_in_backward=True,
                        accumulation_steps=kwargs.pop("accumulation_steps", 1),
                        clip_grad_norm=kwargs.pop("clip_grad_norm", None))
    with pytest.raises(InvalidInputError, match=match):
        autofit.estimate(_model(), x, target=y, **kwargs, step=step)


# ---- the planner turns to it when nothing fits with every gradient alive -------------------------------------------
@pytest.mark.sim
def test_planner_steps_in_backward_when_nothing_else_fits_and_the_step_really_fits():
    from autofit.measure.allocator import measure_callable

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)], nn.Linear(512, 10))
    x, y = torch.randn(2, 512), torch.randint(0, 10, (2,))
    knobs = dict(target=y, device="cpu", precision="fp32", optimizer="adamw")
    # by the allocator: the smallest plain step (micro-batch 1 x 2) and the whole batch stepped in backward
    plain = autofit.measure(model, x, step=autofit.Step(micro_batch_size=1, accumulation_steps=2), target=y).peak_bytes
    fused = autofit.measure(model, x, target=y,
                            step=autofit.Step(micro_batch_size=2, optimizer_in_backward=True)).peak_bytes
    assert fused < plain
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(model, x, 1, **knobs)
    assert info.value.min_budget_bytes == fused and "in backward" in str(info.value)
    budget = (plain + fused) // 2
    plan = autofit.plan(model, x, budget, **knobs)
    assert plan.optimizer_in_backward and plan.gradient_accumulation_steps == 1 and plan.peak_bytes <= budget
    assert autofit.Plan.from_json(plan.to_json()).optimizer_in_backward
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with plan.wrap(model, optimizer) as trainer:
        trainer.step(x, y)  # the state exists from here on
        state = [v for s in optimizer.state.values() for v in s.values()]
        live = [*model.parameters(), x, y, *state]
        assert measure_callable(lambda: trainer.step(x, y), live) <= budget
    # clipping needs every gradient: then nothing fits
    with pytest.raises(autofit.InfeasibleBudgetError):
        autofit.plan(model, x, budget, clip_grad_norm=1.0, **knobs)


def test_a_batch_larger_than_the_plan_is_refused_rather_than_stepped_twice():
    x, y = _data(8)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with _plan("sgd").wrap(model, torch.optim.SGD(model.parameters(), lr=0.1)) as trainer:
        with pytest.raises(InvalidInputError, match="at most 4 rows"):
            trainer.step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("knob", ["optimizer_in_backward", "preallocated_grads"])
def test_a_one_process_step_feature_refuses_a_distributed_trainer_before_any_process_group_is_needed(knob):
    """The step features planned for one process only (the ladder offers them without a strategy alone) refuse a
    plan with a layout when it is wrapped, naming the knob, before the trainer asks for a process group."""
    from autofit.parallel.layout import Parallel

    changes = dict(parallel=Parallel(strategy="ddp", world_size=2), optimizer_in_backward=knob == "optimizer_in_backward")
    if knob == "preallocated_grads":  # a plan's flag is its estimate's (the search decides it there)
        changes["estimate"] = MemoryEstimate(peak_bytes=1, breakdown={}, preallocated_grads=True)
    plan = _plan("sgd", **changes)
    assert plan.optimizer_in_backward is (knob == "optimizer_in_backward")
    assert plan.preallocated_grads is (knob == "preallocated_grads")
    with pytest.raises(InvalidInputError, match=f"{knob} is planned for one process only"):
        plan.wrap(_model(), lambda p: torch.optim.SGD(p, lr=0.1))
