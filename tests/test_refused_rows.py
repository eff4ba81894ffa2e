"""A model that refuses a micro-batch of one row (BatchNorm1d after a global pool) is planned at the micro-batches it
accepts (Note [micro-batches a model refuses], autofit/capture/rows.py); truth: the CPU allocator and a real
trainer step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autofit
from autofit.capture.rows import smallest_rows
from autofit.training.batch import as_batch


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.BatchNorm1d(8), nn.Linear(8, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(13, 3, 16, 16), torch.randint(0, 4, (13,))


def test_one_row_refused_is_detected() -> None:
    x, _ = _data()
    model = _bn_model()
    with pytest.raises(ValueError, match="more than 1 value per channel"):  # the truth: torch itself refuses
        model(x[:1])
    rows, why = smallest_rows(model, as_batch(x))
    assert rows == 2 and "more than 1 value per channel" in why
    assert smallest_rows(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), as_batch(torch.randn(5, 4, 3))) == (1, None)


@pytest.mark.sim
@pytest.mark.slow
def test_batchnorm_model_planned_under_half_the_full_batch() -> None:
    model, (x, y) = _bn_model(), _data()
    full = autofit.estimate(model, x, target=y, micro_batch_size=13).peak_bytes
    budget = int(full * 0.5)
    plan = autofit.plan(model, x, budget, target=y, batch_size=13, device="cpu", precision="fp32", checkpoint=())
    assert plan.micro_batch_size < 13
    assert min(plan.micro_batch_size, plan.last_micro_batch_size) >= 2
    assert any("at least 2 rows" in n for n in plan.notes)
    kw = dict(target=y, micro_batch_size=plan.micro_batch_size, accumulation_steps=plan.gradient_accumulation_steps)
    assert autofit.estimate(model, x, **kw).peak_bytes <= budget
    assert autofit.measure(model, x, **kw).peak_bytes <= budget  # the allocator's figure
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="BatchNorm"):  # statistics per micro-batch: the plan's own warning
        trainer = plan.wrap(model, torch.optim.AdamW(model.parameters()))
    trainer.step(x, y)  # every micro-batch has at least two rows: BatchNorm1d trains
    trainer.unwrap()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.sim
def test_batchnorm_model_at_035_never_a_forward_error() -> None:
    model, (x, y) = _bn_model(), _data()
    full = autofit.estimate(model, x, target=y, micro_batch_size=13).peak_bytes
    budget = int(full * 0.35)
    try:
        plan = autofit.plan(model, x, budget, target=y, batch_size=13, device="cpu", precision="fp32",
                            checkpoint=())
    except autofit.InfeasibleBudgetError:
        return  # 13 rows in micro-batches of 2 to 4 always end with a micro-batch of one row
    assert min(plan.micro_batch_size, plan.last_micro_batch_size) >= 2
    kw = dict(target=y, micro_batch_size=plan.micro_batch_size, accumulation_steps=plan.gradient_accumulation_steps)
    assert autofit.measure(model, x, **kw).peak_bytes <= budget
