"""End-to-end planner tests: the plan's real training step fits its budget, and the planner behaves as promised.

(a) For zoo architectures and budgets from generous to tight, the peak of a real ``trainer.step`` (the CPU
    allocator's record, plus everything alive before the step) is within the budget and within 2 % of the plan's
    verified estimate ``peak_bytes``.
(b) As the budget falls, the chosen plan's peak never rises and its predicted step time never falls.
(c) An infeasible budget raises ``InfeasibleBudgetError`` with a ``min_budget_bytes`` that works.
(d) Plans survive a JSON round trip; junk is rejected with ``InvalidInputError``.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

import autofit
from autofit.training.batch import as_batch
from autofit.measure.allocator import measure_callable
from autofit.training.optim import as_optimizer_spec

try:
    from tests.zoo import ZOO, ZooCase
except ImportError:  # tests/ on sys.path rather than the repository root
    from zoo import ZOO, ZooCase

pytestmark = [pytest.mark.sim, pytest.mark.filterwarnings("ignore:the model has BatchNorm layers:UserWarning")]

BATCH = 8  # effective batch: up to 8 accumulation steps
TOLERANCE = 0.02
GENEROUS = 10**10


# Architectures (>= 8 kinds of layers and calling conventions) and the optimizer each is planned with.
ARCHITECTURES = {
    "lstm": "sgd",  # recurrent
    "hf_dict": "adamw",  # dict inputs, loss returned by the model
    "gpt_sdpa": "sgd",  # decoder with SDPA and dropout
    "inplace_cnn": "sgd",  # in-place activations
    "autoencoder": "adamw",  # float target (MSE) over a full-resolution output
    "torch_encoder": "adamw",  # nn.TransformerEncoder
    "resnet_bn": "adam",  # BatchNorm, residuals
    "unet": "sgd",  # GroupNorm, skip concatenation, transposed convolution
    "tied_lm": "adam",  # tied weights
}

# Budgets between the smallest feasible one (m) and the unconstrained plan's peak (p0): m + f (p0 - m).
LEVELS = {"generous": None, "half": 0.5, "tight": 0.15}


def _kwargs(case: ZooCase, optimizer: str, precision: str = "fp32") -> dict:
    return dict(batch_size=BATCH, target=case.target, loss_fn=case.loss_fn, optimizer=optimizer,
                precision=precision, device="cpu")


@functools.lru_cache(maxsize=None)
def _free_plan(name: str, optimizer: str, precision: str = "fp32") -> tuple[autofit.Plan, int]:
    """The plan under a generous budget, and the smallest budget the planner says works."""
    case = ZOO[name]()
    free = autofit.plan(case.model, case.sample, GENEROUS, **_kwargs(case, optimizer, precision))
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(case.model, case.sample, 1, **_kwargs(case, optimizer, precision))
    return free, info.value.min_budget_bytes


def _anchors(name: str, optimizer: str, precision: str = "fp32") -> tuple[int, int]:
    """(p0, m): the unconstrained plan's peak and the smallest budget the planner says works."""
    free, smallest = _free_plan(name, optimizer, precision)
    return free.peak_bytes, smallest


def _full_batch(value, rows: int):
    """The whole effective batch, as a data loader hands it: ``rows`` rows in tensors of their own."""
    return None if value is None else as_batch(value).resize(rows).value


def _measured_step_peak(case: ZooCase, plan: autofit.Plan, optimizer: str) -> int:
    """Peak bytes of one real ``trainer.step`` in the steady state (after a warm-up step created the optimizer
    state): the allocator's high-water mark plus parameters, buffers, optimizer state and the batch."""
    model = case.model  # in training mode, as the user has it
    assert model.training
    opt = as_optimizer_spec(optimizer).build(model.parameters())  # the instance the plan was made for
    inputs, target = _full_batch(case.sample, plan.batch_size), _full_batch(case.target, plan.batch_size)
    trainer = plan.wrap(model, opt, loss_fn=case.loss_fn)
    try:
        trainer.step(inputs, target)  # warm-up
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        batch = as_batch(inputs).tensors() + ([] if target is None else as_batch(target).tensors())
        live = [*model.parameters(), *model.buffers(), *state, *batch]
        return measure_callable(lambda: trainer.step(inputs, target), live)
    finally:
        trainer.unwrap()


# ---- (a) the real step fits the budget and matches the estimate ---------------------------------------------------
@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_real_step_fits_budget_and_estimate(name: str, level: str) -> None:
    _check_real_step(name, ARCHITECTURES[name], level, "fp32")


@pytest.mark.parametrize("name", ["hf_dict"])
def test_real_step_fits_budget_and_estimate_bf16(name: str) -> None:
    # autocast: the plan's bf16 activations and casts, the trainer's real bf16 step
    _check_real_step(name, ARCHITECTURES[name], "tight", "bf16")


def _check_real_step(name: str, optimizer: str, level: str, precision: str) -> None:
    p0, smallest = _anchors(name, optimizer, precision)
    fraction = LEVELS[level]
    if fraction is None:
        budget = GENEROUS
    else:
        assert smallest < p0, f"{name}: the smallest feasible budget {smallest:,} is not below the free peak {p0:,}"
        budget = int(smallest + fraction * (p0 - smallest))
    case = ZOO[name]()
    if fraction is None:
        plan = _free_plan(name, optimizer, precision)[0]  # planned from an identical case (the zoo is seeded)
    else:
        plan = autofit.plan(case.model, case.sample, budget, **_kwargs(case, optimizer, precision))
    assert plan.budget_bytes == budget and plan.peak_bytes <= budget
    assert plan.precision.name == precision
    assert plan.batch_size == BATCH
    measured = _measured_step_peak(case, plan, optimizer)
    config = (f"{name} [{level}: budget {budget:,}] micro-batch {plan.micro_batch_size} x "
              f"{plan.gradient_accumulation_steps}, {plan.precision.name}, checkpoint {plan.checkpoint}, {optimizer}: "
              f"measured {measured:,} B, "
              f"planned {plan.peak_bytes:,} B ({100 * (plan.peak_bytes - measured) / measured:+.2f} %)")
    assert measured <= budget, "over budget: " + config + f"\n{plan.estimate}"
    assert abs(plan.peak_bytes - measured) <= TOLERANCE * measured, config + f"\n{plan.estimate}"


def test_tight_budgets_change_the_knobs() -> None:
    # the cases above are not all the same plan: tight budgets really do split the batch or checkpoint
    name, optimizer = "gpt_sdpa", ARCHITECTURES["gpt_sdpa"]
    p0, smallest = _anchors(name, optimizer)
    case = ZOO[name]()
    tight = autofit.plan(case.model, case.sample, int(smallest + 0.15 * (p0 - smallest)),
                         **_kwargs(case, optimizer))
    assert tight.gradient_accumulation_steps > 1 or tight.checkpoint
    assert tight.peak_bytes < p0


# ---- (b) monotonic in the budget ------------------------------------------------------------------------------------
def test_budget_sweep_is_monotonic() -> None:
    name, optimizer = "lstm", "adam"
    case = ZOO[name]()
    kwargs = dict(batch_size=16, target=case.target, loss_fn=case.loss_fn, optimizer=optimizer, precision="fp32",
                  device="cpu")
    free = autofit.plan(case.model, case.sample, GENEROUS, **kwargs)
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(case.model, case.sample, 1, **kwargs)
    smallest = info.value.min_budget_bytes
    assert smallest < free.peak_bytes
    budgets = [int(free.peak_bytes * 1.1)] + [int(smallest + f * (free.peak_bytes - smallest))
                                              for f in (0.9, 0.75, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)]
    plans = [autofit.plan(case.model, case.sample, b, **kwargs) for b in budgets]
    rows = [f"budget {b:,}: peak {p.peak_bytes:,}, {p.predicted_step_seconds:.6g} s, micro {p.micro_batch_size} x "
            f"{p.gradient_accumulation_steps}, checkpoint {p.checkpoint}" for b, p in zip(budgets, plans)]
    table = "\n".join(rows)
    assert len({(p.micro_batch_size, p.checkpoint) for p in plans}) >= 3, "the sweep never changed the plan\n" + table
    for b, p in zip(budgets, plans):
        assert p.peak_bytes <= b, table
    for bigger, smaller in zip(plans, plans[1:]):
        assert smaller.peak_bytes <= bigger.peak_bytes, table
        assert smaller.predicted_step_seconds >= bigger.predicted_step_seconds, table


# ---- (c) infeasible budgets ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["hf_dict", "inplace_cnn"])
def test_infeasible_budget_reports_a_budget_that_works(name: str) -> None:
    optimizer = ARCHITECTURES[name]
    _, smallest = _anchors(name, optimizer)
    case = ZOO[name]()
    budget = smallest // 2
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(case.model, case.sample, budget, **_kwargs(case, optimizer))
    error = info.value
    assert error.budget_bytes == budget
    assert error.min_budget_bytes > budget
    assert error.min_budget_bytes == smallest  # independent of how far below it the budget was
    assert f"{error.min_budget_bytes:,}" in str(error)  # the message says what to ask for
    assert isinstance(error, autofit.AutofitError)
    plan = autofit.plan(case.model, case.sample, error.min_budget_bytes, **_kwargs(case, optimizer))
    assert plan.peak_bytes <= error.min_budget_bytes


@pytest.mark.parametrize("name", ["hf_dict", "shared_twice"])
def test_min_budget_is_the_smallest_that_works(name: str) -> None:
    # InfeasibleBudgetError documents min_budget_bytes as "the smallest budget any allowed [configuration] reaches":
    # one byte less must be infeasible too. shared_twice is parameter- and optimizer-dominated: accumulation (which
    # keeps a gradient alive across micro-batches) costs more than its activations save.
    optimizer = "adamw"
    case = ZOO[name]()
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(case.model, case.sample, 1, **_kwargs(case, optimizer))
    smallest = info.value.min_budget_bytes
    try:
        below = autofit.plan(case.model, case.sample, smallest - 1, **_kwargs(case, optimizer))
    except autofit.InfeasibleBudgetError:
        return
    raise AssertionError(
        f"{name}: min_budget_bytes = {smallest:,}, yet a budget of {smallest - 1:,} is planned (micro-batch "
        f"{below.micro_batch_size} x {below.gradient_accumulation_steps}, checkpoint {below.checkpoint}, peak "
        f"{below.peak_bytes:,})"
    )


def test_plan_at_min_budget_really_fits() -> None:
    # the tightest budget of all: the planner says it works, so a real step must stay inside it
    name, optimizer = "hf_dict", ARCHITECTURES["hf_dict"]
    _, smallest = _anchors(name, optimizer)
    case = ZOO[name]()
    plan = autofit.plan(case.model, case.sample, smallest, **_kwargs(case, optimizer))
    measured = _measured_step_peak(case, plan, optimizer)
    assert measured <= smallest, (
        f"measured {measured:,} B > budget {smallest:,} B (planned {plan.peak_bytes:,} B; micro-batch "
        f"{plan.micro_batch_size} x {plan.gradient_accumulation_steps}, checkpoint {plan.checkpoint})"
    )


# ---- (d) serialisation -----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _tight_plan_json() -> str:
    name, optimizer = "lstm", ARCHITECTURES["lstm"]
    p0, smallest = _anchors(name, optimizer)
    case = ZOO[name]()
    plan = autofit.plan(case.model, case.sample, (p0 + smallest) // 2, **_kwargs(case, optimizer))
    return plan.to_json()


def test_plan_json_round_trip() -> None:
    text = _tight_plan_json()
    plan = autofit.Plan.from_json(text)
    again = autofit.Plan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == text
    assert str(again) == str(plan)
    assert plan.frontier and plan.estimate.breakdown  # the round trip covered the nested parts
    assert isinstance(plan.checkpoint, tuple) and isinstance(plan.precision, autofit.PrecisionPolicy)
    # compact JSON round-trips too
    assert autofit.Plan.from_json(plan.to_json(indent=None)) == plan


def test_round_tripped_plan_wraps_and_steps() -> None:
    plan = autofit.Plan.from_json(_tight_plan_json())
    case = ZOO["lstm"]()
    measured = _measured_step_peak(case, plan, "sgd")
    assert measured <= plan.budget_bytes


def _edited(change) -> str:
    data = json.loads(_tight_plan_json())
    change(data)
    return json.dumps(data)


JUNK = {
    "not json": lambda: "micro_batch_size = 4",
    "empty": lambda: "",
    "a list": lambda: "[1, 2, 3]",
    "no format": lambda: _edited(lambda d: d.pop("format")),
    "other format": lambda: _edited(lambda d: d.update(format="autofit.plan/999")),
    "missing field": lambda: _edited(lambda d: d.pop("micro_batch_size")),
    "missing estimate field": lambda: _edited(lambda d: d["estimate"].pop("breakdown")),
    "unknown field": lambda: _edited(lambda d: d.update(surprise=1)),
    "frontier not a list": lambda: _edited(lambda d: d.update(frontier=5)),
    "unknown precision": lambda: _edited(lambda d: d["precision"].update(name="fp64")),
    "non-numeric peak": lambda: _edited(lambda d: d["estimate"].update(peak_bytes="lots")),
    "non-integer micro-batch": lambda: _edited(lambda d: d.update(micro_batch_size="four")),
    "negative micro-batch": lambda: _edited(lambda d: d.update(micro_batch_size=-4)),
}


@pytest.mark.parametrize("junk", list(JUNK))
def test_from_json_rejects_junk(junk: str) -> None:
    with pytest.raises(autofit.InvalidInputError):
        autofit.Plan.from_json(JUNK[junk]())
