"""The plan carries the step its estimate was verified with (Note [the plan's step], autofit/emit/plan.py): the step
the planner's final simulation ran is ``plan.step``, a plan loaded from JSON runs the same step, and the trainer runs
it, replacing only the device and the optimizer it is given.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

import autofit
import autofit.solve.estimator
from autofit.core.report import MemoryEstimate
from autofit.emit.plan import Plan
from autofit.parallel.layout import Parallel
from autofit.training.precision import PrecisionPolicy

LR = 0.1


def _model(width: int = 64, depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _data(rows: int, width: int = 64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=g), torch.randint(0, 10, (rows,), generator=g)


def _tight(model, x, y, **kw) -> Plan:
    """A plan under a budget halfway between the smallest that works and what the whole batch needs at once, so
    that the planner accumulates or recomputes."""
    whole = autofit.plan(model, x, 10**10, target=y, **kw).device_bytes
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(model, x, 1, target=y, **kw)
    return autofit.plan(model, x, (info.value.min_budget_bytes + whole) // 2, target=y, **kw)


def _single_gpu() -> Plan:
    x, y = _data(16)
    return autofit.plan(_model(), x, "8GB", target=y, device=autofit.Device(gpu="T4"), optimizer="adamw")


def _accumulation() -> Plan:
    x, y = _data(64)
    plan = _tight(_model(), x, y, device="cpu", precision="fp32", optimizer="sgd",
                  savers=autofit.Savers(checkpoint=None))
    assert plan.gradient_accumulation_steps > 1
    return plan


def _checkpoint() -> Plan:
    x, y = _data(16)
    plan = autofit.plan(_model(), x, "1GB", target=y, device="cpu", optimizer="adamw", clip_grad_norm=1.0,
                        savers=autofit.Savers(checkpoint=("2", "4")))
    assert plan.checkpoint == ("2", "4")
    return plan


def _fsdp2() -> Plan:
    x, y = _data(16)
    plan = autofit.plan(_model(), x, "64MB", target=y, batch_size=16, device="cpu", precision="fp32",
                        optimizer="adamw", layout=autofit.Layout(world_size=2, strategy="fsdp2"))
    assert plan.parallel.strategy == "fsdp2" and plan.parallel.world_size == 2 and plan.step.held_rows == 8
    return plan


def _offloaded_states() -> Plan:
    x, y = _data(64, 256)
    model = _model(256, 6)
    kw = dict(target=y, precision="fp32", optimizer="adamw")
    t4 = autofit.Device(gpu="T4")
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(model, x, 1, device=t4, savers=autofit.Savers(offload=False), **kw)
    without = info.value.min_budget_bytes
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(model, x, 1, device=t4, **kw)
    plan = autofit.plan(model, x, (info.value.min_budget_bytes + without) // 2,
                        device=autofit.Device(gpu="T4", host_budget="1GB"), **kw)
    assert plan.parallel.offload_states and plan.step.layout.offload_states
    return plan


PLANS = {"single GPU": _single_gpu, "accumulation": _accumulation, "checkpoint": _checkpoint, "fsdp2": _fsdp2,
         "offloaded states": _offloaded_states}


@pytest.mark.sim
@pytest.mark.parametrize("make", PLANS.values(), ids=PLANS.keys())
def test_a_loaded_plan_runs_the_step_the_planned_one_verified(make):
    plan = make()
    loaded = Plan.from_json(plan.to_json())
    assert loaded.verified_step is None and plan.verified_step is plan.step  # the very value
    assert loaded.step == plan.step
    assert loaded.to_json() == plan.to_json()
    assert loaded.step.layout == plan.parallel and loaded.step.micro_batch_size == plan.micro_batch_size


@pytest.mark.sim
def test_the_trainer_runs_the_step_the_final_simulation_ran_and_trains_a_full_batch_step(monkeypatch):
    # the truth is what the simulation received: every step the planner simulated, with its peak
    simulated: list[tuple[object, int]] = []
    original = autofit.solve.estimator.simulate_step

    def spy(model, batch, target, loss_fn, config, **kw):
        sim = original(model, batch, target, loss_fn, config, **kw)
        simulated.append((config, sim.replay.peak_bytes))
        return sim

    monkeypatch.setattr(autofit.solve.estimator, "simulate_step", spy)
    x, y = _data(64)
    model = _model()
    plan = _tight(model, x, y, device="cpu", precision="fp32", optimizer="sgd")
    assert plan.gradient_accumulation_steps > 1 or plan.checkpoint
    # a full simulation of exactly the plan's step gave the plan's peak, and other steps were simulated beside it
    assert (plan.step, plan.peak_bytes) in simulated
    assert any(config != plan.step for config, _ in simulated)
    verified = next(config for config, peak in simulated if (config, peak) == (plan.step, plan.peak_bytes))

    reference, ours = copy.deepcopy(model), copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    nn.functional.cross_entropy(reference(x), y).backward()
    opt.step()
    with plan.wrap(ours, torch.optim.SGD(ours.parameters(), lr=LR)) as trainer:
        # the trainer's step is the verified one, but for the optimizer it was given
        assert dataclasses.replace(trainer.config, optimizer=verified.optimizer) == verified
        trainer.step(x, y)
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def _hand_plan(**changes) -> Plan:
    plan = Plan(
        micro_batch_size=4, gradient_accumulation_steps=2, batch_size=8, last_micro_batch_size=4,
        precision=PrecisionPolicy(name="bf16"), checkpoint=("1",), peak_bytes=1, device_bytes=1, budget_bytes=1,
        device="cpu", optimizer="adamw", predicted_step_seconds=0.0,
        estimate=MemoryEstimate(peak_bytes=1, breakdown={}),
    )
    return dataclasses.replace(plan, **changes)


def test_a_plan_built_or_loaded_without_its_verified_step_runs_its_own_fields():
    plan = _hand_plan()
    step = plan.step
    assert (step.micro_batch_size, step.accumulation_steps, step.checkpoint, step.held_rows) == (4, 2, ("1",), 8)
    assert step.precision == PrecisionPolicy(name="bf16") and step.optimizer.name == "adamw"
    assert Plan.from_json(plan.to_json()).step == step
    # the knobs follow the plan's fields: a replaced plan runs what it says
    assert dataclasses.replace(plan, micro_batch_size=8, gradient_accumulation_steps=1).step.accumulation_steps == 1
    # over two data-parallel ranks each holds half of the batch
    assert _hand_plan(parallel=Parallel(world_size=2, strategy="ddp")).step.held_rows == 4


def test_a_loaded_plan_names_an_optimizer_it_cannot_build():
    plan = Plan.from_json(_hand_plan(optimizer="my_factory").to_json())
    assert plan.step.optimizer.name == "my_factory"
    with pytest.raises(autofit.InvalidInputError, match="loaded from JSON"):
        plan.step.optimizer.build([nn.Parameter(torch.zeros(2))])


@pytest.mark.filterwarnings("default:.*is deprecated. write:FutureWarning")
def test_a_plan_holds_its_layout_whole_and_its_flat_fields_are_the_old_spelling():
    """Note [the plan's layout]: the layout is ``plan.parallel``; the JSON writes its fields flat, as plans always
    had them, and reads them back into one value; the flat reads and ``Plan(world_size=...)`` warn, naming the new
    spelling, and give what it gives."""
    layout = Parallel(world_size=2, strategy="ddp", gpus_per_node=1)
    plan = _hand_plan(parallel=layout, batch_size=16)
    written = json.loads(plan.to_json())
    # by hand: the fields a plan written before the layout was one value had, at the top level of the JSON
    assert (written["world_size"], written["strategy"], written["gpus_per_node"]) == (2, "ddp", 1)
    assert "parallel" not in written
    assert Plan.from_json(plan.to_json()).parallel == layout
    with pytest.warns(FutureWarning, match=r"plan.world_size is deprecated: write plan.parallel.world_size"):
        assert plan.world_size == 2
    with pytest.warns(FutureWarning, match=r"plan.strategy is deprecated: write plan.parallel.strategy"):
        assert plan.strategy == "ddp"
    with pytest.warns(FutureWarning, match=r"Plan\(world_size=2, strategy='ddp', gpus_per_node=1\) is deprecated: "
                                           r"write Plan\(parallel=Parallel\(world_size=2, "):
        flat = dataclasses.replace(_hand_plan(batch_size=16), world_size=2, strategy="ddp", gpus_per_node=1)
    assert flat == plan and flat.parallel == layout
