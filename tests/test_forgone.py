"""Issue 56: a plan that climbed the ladder shows, beside it, the best without the rung it climbed (Note [what a
rung buys], planning/climb.py). The truth: ``autofit.estimate`` of the same knobs without that rung, a path of its
own (no planner, no search), and the states-floor arithmetic counted by hand."""

from __future__ import annotations

import pytest

import autofit
from tests.test_offload import _data, _model  # the offload tests' model: six blocks a T4 budget pushes to the host


@pytest.mark.sim
def test_an_offloaded_plan_shows_the_same_configuration_without_offload_and_that_it_does_not_fit():
    x, y = _data(64)
    model = _model()
    kw = dict(target=y, precision="fp32")
    savers = autofit.Savers(checkpoint="auto")
    with pytest.raises(autofit.InfeasibleBudgetError) as info:  # the smallest budget with the states on the GPU
        autofit.plan(model, x, 1, device="T4", savers=autofit.Savers(checkpoint="auto", offload=False), **kw)
    without = info.value.min_budget_bytes
    budget = without - 2**20  # nothing fits with the states on the GPU; with them on the host it does
    plan = autofit.plan(model, x, budget, device=autofit.Device(gpu="T4", host_budget="1GB"), savers=savers, **kw)
    assert plan.parallel.offload_states
    (row,) = plan.alternatives
    assert row.without == "the states on the host" and not row.fits
    assert (row.micro_batch_size, row.gradient_accumulation_steps, row.checkpoint) == (
        plan.micro_batch_size, plan.gradient_accumulation_steps, plan.checkpoint)
    truth = autofit.estimate(model, x, target=y, precision="fp32", device="T4",
                             step=autofit.Step(micro_batch_size=row.micro_batch_size,
                                               accumulation_steps=row.gradient_accumulation_steps,
                                               checkpoint=row.checkpoint, offload=plan.offload))
    assert row.peak_bytes == truth.peak_bytes
    assert row.device_bytes == truth.device_bytes > budget - plan.margin_bytes
    assert row.step_seconds is not None and row.gpus is None  # one GPU: no count of GPUs
    shown = autofit.Plan.from_json(plan.to_json())
    assert shown.alternatives == plan.alternatives
    assert "without the states on the host" in str(plan) and "does not fit" in str(plan)


def test_the_gpus_that_keep_the_states_on_them_by_hand():
    """``gpus_for_states``: AdamW in fp32 keeps 16 bytes per parameter (parameter, gradient, two moments); ZeRO-3
    keeps nothing gathered between forward and backward, so with a budget of B bytes the states fit on each of N GPUs
    from N = ceil(16 n / B)."""
    from autofit.options import Options
    from autofit.request import make_request
    from autofit.solve.ladder import gpus_for_states, ladder
    from autofit.parallel.choices import layouts

    model = _model()
    n = sum(p.numel() for p in model.parameters())
    x, y = _data(8)
    for budget in (16 * n // 3, 16 * n // 5 + 1):
        options = Options.of(device=autofit.Device(gpu="T4", margin=0), precision="fp32",
                             layout=autofit.Layout(world_size=2, strategy="fsdp2", reshard_after_forward=True),
                             search=autofit.Search(alternatives=False))
        request = make_request(model, x, budget, options=options, target=y)
        (parallel,) = layouts(request, "fsdp2")
        expected = -(-16 * n // request.fit_bytes)
        assert gpus_for_states(request, ladder(request, parallel)) == max(2, expected)
