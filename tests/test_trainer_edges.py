"""The trainer and its inputs at the edges (issue 39): the default loss applies only where it is unambiguous, the
plan remembers its loss, ``wrap`` checks the optimizer and refuses a second wrap, ``unwrap`` restores in any order,
sum-reduced losses are not divided silently, ``plan.precision`` names the stored dtype, raw torch exceptions become
typed errors, and the batch dimension follows a written rule with a way to mark inputs as shared.

Each truth is independent of the code under test: plain PyTorch steps, hand-computed losses, the model's own state.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.core.report import MemoryEstimate
from autofit.emit.plan import Plan
from autofit.training.loss import default_loss
from autofit.training.precision import PrecisionPolicy


def _plan(*, micro: int, batch: int, optimizer: str = "sgd") -> Plan:
    """A plan with exactly these knobs (the planner's choice is not under test here)."""
    k = -(-batch // micro)
    return Plan(
        micro_batch_size=micro, gradient_accumulation_steps=k, batch_size=batch,
        last_micro_batch_size=batch - micro * (k - 1), precision=PrecisionPolicy(name="fp32"), checkpoint=(),
        peak_bytes=1, device_bytes=1, budget_bytes=1, device="cpu", optimizer=optimizer, predicted_step_seconds=0.0,
        estimate=MemoryEstimate(peak_bytes=1, breakdown={}),
    )


class FeaturesAndLogits(nn.Module):
    """Returns ``(features, logits)``: which one a loss is about, only the user knows."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(8, 32)
        self.classifier = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor):
        h = self.features(x)
        return h, self.classifier(h)


def _classes(rows: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g)


# ---- 1. the default loss only where it is unambiguous -----------------------------------------------------------------
@pytest.mark.sim
@pytest.mark.parametrize("entry", ["estimate", "plan"])
def test_a_tuple_output_without_loss_fn_is_refused_by_estimate_and_plan(entry: str) -> None:
    x, y = _classes()
    with pytest.raises(autofit.LossError, match=r"tuple of 2: \(Tensor \(\d+, 32\), Tensor \(\d+, 4\)\).*loss_fn="):
        if entry == "estimate":
            autofit.estimate(FeaturesAndLogits(), x, target=y, micro_batch_size=4)
        else:
            autofit.plan(FeaturesAndLogits(), x, "100MB", batch_size=16, target=y, device="cpu")


def test_a_tuple_output_without_loss_fn_is_refused_by_the_trainer_before_any_update() -> None:
    model, (x, y) = FeaturesAndLogits(), _classes()
    before = copy.deepcopy(model.state_dict())
    trainer = _plan(micro=8, batch=16).wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(autofit.LossError, match="tuple of 2.*loss_fn="):
        trainer.step(x, y)
    trainer.unwrap()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_with_a_loss_fn_the_tuple_model_trains_its_classifier_as_plain_torch_does() -> None:
    model, (x, y) = FeaturesAndLogits(), _classes()
    ref = copy.deepcopy(model)
    loss_fn = lambda out, t: F.cross_entropy(out[1], t)  # noqa: E731
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(x)[1], y).backward()
    opt.step()
    with _plan(micro=4, batch=16).wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn) as t:
        t.step(x, y)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("output", [
    lambda logits: {"features": logits, "logits": logits},
    lambda logits: [logits],
])
def test_dict_and_list_outputs_without_a_loss_are_refused(output) -> None:
    logits = torch.randn(5, 4, requires_grad=True)
    with pytest.raises(autofit.LossError, match="loss_fn="):
        default_loss(output(logits), torch.randint(0, 4, (5,)))


def test_the_default_loss_still_reads_a_loss_a_tensor_and_hugging_face_logits() -> None:
    logits, y = torch.randn(5, 4, requires_grad=True), torch.randint(0, 4, (5,))
    truth = F.cross_entropy(logits, y)
    assert torch.equal(default_loss(logits, y), truth)
    assert default_loss({"loss": truth, "logits": logits}, y) is truth
    outputs = pytest.importorskip("transformers.modeling_outputs")
    assert torch.equal(default_loss(outputs.SequenceClassifierOutput(logits=logits), y), truth)
    hidden = outputs.BaseModelOutput(last_hidden_state=logits)  # no documented prediction: refused
    with pytest.raises(autofit.LossError, match="BaseModelOutput.*last_hidden_state.*loss_fn="):
        default_loss(hidden, y)


# ---- 2. the plan records its loss --------------------------------------------------------------------------------------
def _smoothed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, label_smoothing=0.2)


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


@pytest.mark.sim
def test_the_plan_trains_with_the_loss_it_was_planned_with_and_its_json_names_it() -> None:
    model, (x, y) = _classifier(), _classes()
    plan = autofit.plan(model, x, "100MB", batch_size=16, target=y, loss_fn=_smoothed, optimizer="sgd", device="cpu")
    assert plan.loss == f"custom: {__name__}._smoothed"
    by_hand = F.cross_entropy(model(x), y, label_smoothing=0.2).item()  # the truth: the smoothed loss, by hand
    plain = F.cross_entropy(model(x), y).item()
    assert abs(by_hand - plain) > 1e-3  # the two losses differ, so the check below can fail
    with plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1)) as trainer:  # no loss_fn: the planned one
        assert trainer.step(x, y) == pytest.approx(by_hand, rel=1e-6)
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and loaded.loss == plan.loss and loaded.loss_fn is None
    with pytest.raises(autofit.InvalidInputError, match=r"custom loss \(custom: .*_smoothed\).*loss_fn="):
        loaded.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with loaded.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_smoothed) as trainer:
        expected = F.cross_entropy(model(x), y, label_smoothing=0.2).item()
        assert trainer.step(x, y) == pytest.approx(expected, rel=1e-6)


def test_a_plan_of_the_default_loss_loaded_from_json_trains_with_the_default() -> None:
    model, (x, y) = _classifier(), _classes()
    plan = Plan.from_json(_plan(micro=8, batch=16).to_json())
    assert plan.loss == "default"
    expected = F.cross_entropy(model(x), y).item()
    with plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1)) as trainer:
        assert trainer.step(x, y) == pytest.approx(expected, rel=1e-6)
