"""One configuration, one figure (issue 39, Note [one configuration, one figure] in autofit/emit/assemble.py): the
plan's table, its front (the row of the chosen configuration), its JSON and ``estimate`` of the same configuration
say the same number. The front's other rows stay modelled. That ``estimate`` is the trainer's real step is held to
the CPU allocator in tests/test_verdict.py (the issue's MLP) and tests/test_accuracy.py."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import autofit
from autofit.core.units import format_mib
from autofit.options import Options
from autofit.planner import plan_with_analysis
from autofit.request import make_request


def _chosen_rows(plan: autofit.Plan) -> list:
    return [a for a in plan.frontier if (a.precision, a.micro_batch_size, a.gradient_accumulation_steps, a.checkpoint)
            == (plan.precision.label, plan.micro_batch_size, plan.gradient_accumulation_steps, plan.checkpoint)]


def _rendered(plan: autofit.Plan) -> str:
    from rich.console import Console

    from autofit.cli.render import render_plan

    out = io.StringIO()
    render_plan(Console(file=out, width=200), plan, "model", None)
    return out.getvalue()


@pytest.mark.sim
@pytest.mark.parametrize("share", [1.0, 0.6, 0.35])
def test_the_front_row_of_the_chosen_configuration_is_the_plans_figure_and_its_estimate(share):
    """A small CNN with wide inputs (batch 16, 3 x 32 x 32), AdamW, fp32, on the CPU: planned with its front under
    budgets that choose the whole batch, and micro-batches with accumulation. The chosen row of the front equals
    ``plan.device_bytes``, through the JSON too, and ``autofit.estimate`` of that configuration (the whole batch
    resident, its default) gives the same bytes; the rendered table shows that number in the knobs and the front."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    sample, target = torch.randn(16, 3, 32, 32), torch.randint(0, 4, (16,))
    kw = dict(options=Options.of(precision="fp32", device="cpu"), batch_size=16, target=target,
              loss_fn=nn.CrossEntropyLoss(), optimizer="adamw")
    whole, _ = plan_with_analysis(make_request(model, sample, "1GB", **kw))
    plan, _ = plan_with_analysis(make_request(model, sample, int(whole.device_bytes * share), **kw))
    if share < 1.0:
        assert plan.gradient_accumulation_steps > 1
    assert [a.peak_bytes for a in _chosen_rows(plan)] == [plan.device_bytes]
    again = autofit.Plan.from_json(plan.to_json())
    assert again.device_bytes == plan.device_bytes and [a.peak_bytes for a in _chosen_rows(again)] == [
        plan.device_bytes]
    est = autofit.estimate(model, sample, target=target,
                           loss_fn=nn.CrossEntropyLoss(), optimizer="adamw", precision="fp32", device="cpu",
                           step=autofit.Step(micro_batch_size=plan.micro_batch_size,
                                             accumulation_steps=plan.gradient_accumulation_steps,
                                             checkpoint=plan.checkpoint))
    assert est.input_rows == plan.estimate.input_rows == 16
    assert est.device_bytes == plan.device_bytes
    assert _rendered(plan).count(format_mib(plan.device_bytes)) >= 2  # "total" of the breakdown and the front row


@pytest.mark.slow
def test_the_readme_example_front_row_is_the_plans_figure(monkeypatch):
    """README.md's example (GPT-2 on a T4, batch 32 x 1024): the chosen fp16 8 x 4 was 14,618.0 MiB on the device in
    the plan and 14,961.3 MiB (modelled) in the front (issue 39). The front's row for the chosen configuration now
    is the plan's figure, in the JSON and in the printed table; the plot draws both from these fields."""
    pytest.importorskip("transformers")
    from typer.testing import CliRunner

    from autofit.cli.app import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(app, ["plan", "hf:gpt2", "--budget", "16GB", "--batch-size", "32", "--input-shape",
                                      "1024", "--device", "cuda", "--gpu", "T4", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    plan = autofit.Plan.from_json(result.stdout[result.stdout.index("{"):])
    assert (plan.precision.label, plan.micro_batch_size, plan.gradient_accumulation_steps) == ("fp16", 8, 4)
    assert len(plan.frontier) > 1 and [a.peak_bytes for a in _chosen_rows(plan)] == [plan.device_bytes]
    assert _rendered(plan).count(format_mib(plan.device_bytes)) >= 3  # on the device, total, the front's row
