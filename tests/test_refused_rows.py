"""A model that refuses a micro-batch of one row (BatchNorm1d after a global pool) is planned at the micro-batches it
accepts (Note [micro-batches a model refuses], autofit/capture/rows.py); truths: torch's own refusal, the CPU
allocator (autofit.measure) and the allocator's record of the trainer's real step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autofit
from autofit.capture.rows import smallest_rows
from autofit.measure.allocator import measure_callable
from autofit.solve.candidate import batch_options
from autofit.training.batch import as_batch


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.BatchNorm1d(8), nn.Linear(8, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(13, 3, 16, 16, generator=g), torch.randint(0, 4, (13,), generator=g)


def test_one_row_refused_is_detected() -> None:
    x, _ = _data()
    model = _bn_model()
    with pytest.raises(ValueError, match="more than 1 value per channel"):  # the truth: torch itself refuses
        model(x[:1])
    rows, why = smallest_rows(model, as_batch(x))
    assert rows == 2 and "more than 1 value per channel" in why
    assert smallest_rows(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(5)), as_batch(torch.randn(5, 5, 3))) == (1, None)


def test_windows_keep_two_rows() -> None:
    """By hand, 13 rows: b = 3 runs 3, 3, 3, 2, 2 (last 2); b = 4 runs 4, 4, 3, 2; b = 2 cannot spare a row."""
    assert batch_options(13) == [(13, 1, 13), (7, 2, 6), (5, 3, 3), (4, 4, 1), (3, 5, 1), (2, 7, 1), (1, 13, 1)]
    assert batch_options(13, 2) == [(13, 1, 13), (7, 2, 6), (5, 3, 3), (4, 4, 2), (3, 5, 2)]


def _trainer_step_peak(plan: autofit.Plan, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, list]:
    """The allocator's peak of one real steady-state ``trainer.step`` over the 13 rows, and its micro-batch sizes."""
    opt = torch.optim.AdamW(model.parameters())
    with pytest.warns(UserWarning, match="BatchNorm"):  # statistics per micro-batch: the plan's own warning
        trainer = plan.wrap(model, opt)
    sizes = []
    try:
        trainer.step(x, y)  # warm-up: the optimizer state exists
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        live = [*model.parameters(), *model.buffers(), *state, x, y]
        peak = measure_callable(lambda: trainer.step(x, y), live)
        sizes = [b - a for a, b in trainer._bounds(13, plan.micro_batch_size)]
    finally:
        trainer.unwrap()
    return peak, sizes


@pytest.mark.sim
@pytest.mark.slow
@pytest.mark.parametrize("share", [0.5, 0.35])
def test_batchnorm_model_planned_under_a_share_of_the_full_batch(share: float) -> None:
    model, (x, y) = _bn_model(), _data()
    full = autofit.estimate(model, x, target=y, step=13).peak_bytes
    budget = int(full * share)
    plan = autofit.plan(model, x, budget, target=y, batch_size=13, device="cpu", precision="fp32",
                        savers=autofit.Savers(checkpoint=()))
    assert plan.micro_batch_size < 13 and plan.min_rows == 2
    assert any("at least 2 rows" in n for n in plan.notes)
    # one micro-batch of inputs resident: estimate's whole batch would be micro x accumulation rows, not the 13 held
    kw = dict(target=y,
              step=autofit.Step(micro_batch_size=plan.micro_batch_size,
                                accumulation_steps=plan.gradient_accumulation_steps, inputs="micro-batch"))
    assert autofit.estimate(model, x, **kw).peak_bytes <= budget
    assert autofit.measure(model, x, **kw).peak_bytes <= budget  # the allocator, micro-batches of the plan's size
    peak, sizes = _trainer_step_peak(plan, model, x, y)
    assert min(sizes) >= 2 and max(sizes) == plan.micro_batch_size and sum(sizes) == 13
    assert peak <= plan.peak_bytes <= budget  # the trainer's own step, measured: within the plan's figure
    assert autofit.Plan.from_json(plan.to_json()).min_rows == 2
