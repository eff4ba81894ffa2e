"""Side effects of planning, and a plan that knows its model (issue 55): ``plan``, ``estimate`` and ``analyse`` run
nothing of the user's model (Note [the loss probe], capture/loss_probe.py) and leave the global random generators as
they found them (Note [the user's random state], core/rng.py); a model's own summed loss is found and trained as
the full batch (Note [sum-reduced losses]); a plan records its model and ``wrap`` refuses another (Note [the plan's
model], emit/model_record.py); a meta sample for a forward that reads values is a typed error.

Each truth is independent of the code under test: the model's own counters and lists, a hand count of parameters,
a plain PyTorch full-batch step, the generators' next draws without a plan in between.
"""

from __future__ import annotations

import copy
import json
import random
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.core.errors import ModelMismatchError
from autofit.emit.plan import Plan


def _summed_ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="sum")


class Counting(nn.Module):
    """Counts its calls in a buffer and keeps every input it sees: any real forward shows."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(x.detach())
        return self.body(x)


# ---- 1. nothing of the user's model runs ------------------------------------------------------------------------
@pytest.mark.sim
def test_plan_estimate_and_analyse_run_nothing_of_the_users_model() -> None:
    torch.manual_seed(0)
    model, x, y = Counting(), torch.randn(16, 8), torch.randint(0, 4, (16,))
    before = copy.deepcopy(model.state_dict())
    plan = autofit.plan(model, x, "1GB", target=y, loss_fn=_summed_ce, device="cpu")
    autofit.estimate(model, x, step=4, target=y, loss_fn=_summed_ce)
    autofit.analyse(model, x, target=y, loss_fn=_summed_ce)
    # the truth: the model's own counter and list (before issue 55 the loss probe left calls == 3, 3 tensors kept)
    assert int(model.calls) == 0 and model.seen == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.training
    assert plan.loss_reduction == "sum"  # the probe still ran, on a copy


class ClampsItsWeight(nn.Module):
    """Clamps its own weight in place in forward (a hand-made weight constraint)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.clamp_(-0.01, 0.01)
        return self.lin(x)


@pytest.mark.sim
def test_the_loss_probe_writes_nothing_into_the_users_weights() -> None:
    """The probe's copy reads the user's weight storage; a forward that writes into it is stopped, not run."""
    torch.manual_seed(0)
    model, x, y = ClampsItsWeight(), torch.randn(16, 8), torch.randint(0, 4, (16,))
    weight = model.lin.weight.detach().clone()
    assert weight.abs().max() > 0.01  # the clamp would show
    plan = autofit.plan(model, x, "1GB", target=y, loss_fn=_summed_ce, device="cpu")
    assert torch.equal(model.lin.weight, weight)
    assert plan.loss_reduction == "mean"  # the probe could not tell, so the loss stays a mean


# ---- 2. a model's own summed loss -------------------------------------------------------------------------------
class VAE(nn.Module):
    """The pytorch/examples VAE recipe, small: the loss is BCE(reduction="sum") + KLD, summed over rows. With
    ``noise`` given the reparameterisation uses it (a deterministic step to compare with), else ``randn_like``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(20, 16), nn.Linear(16, 4), nn.Linear(16, 4)
        self.fc3, self.fc4 = nn.Linear(4, 16), nn.Linear(16, 20)

    def forward(self, x: torch.Tensor, noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = F.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        eps = torch.randn_like(logvar) if noise is None else noise
        recon = torch.sigmoid(self.fc4(F.relu(self.fc3(mu + eps * torch.exp(0.5 * logvar)))))
        bce = F.binary_cross_entropy(recon, x, reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        return {"loss": bce + kld, "recon": recon}


@pytest.mark.sim
def test_a_models_own_summed_loss_is_found_even_with_random_noise() -> None:
    torch.manual_seed(0)
    plan = autofit.plan(VAE(), torch.rand(16, 20), "1GB", optimizer="sgd", device="cpu")
    assert plan.loss_reduction == "sum"  # before issue 55: "mean", only a loss_fn was probed
    assert any("model's own loss" in n and "sum over rows" in n for n in plan.notes)


@pytest.mark.sim
def test_a_models_own_summed_loss_trains_as_one_full_batch_step() -> None:
    torch.manual_seed(0)
    model, x, noise = VAE(), torch.rand(16, 20), torch.randn(16, 4)
    plan = autofit.plan(model, (x, noise), "1GB", optimizer="sgd", device="cpu")
    assert plan.loss_reduction == "sum"
    ref = copy.deepcopy(model)  # the truth: one plain PyTorch SGD step on the whole batch
    opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
    ref(x, noise)["loss"].backward()
    opt.step()
    accumulating = replace(plan, micro_batch_size=4, gradient_accumulation_steps=4, last_micro_batch_size=4)
    with accumulating.wrap(model, torch.optim.SGD(model.parameters(), lr=1e-3)) as trainer:
        trainer.step((x, noise))
        assert trainer.micro_batches == 4
    # before issue 55 each parameter moved by exactly 1/4 of the full-batch update
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


# ---- 3. the user's random state --------------------------------------------------------------------------------
class Draws(nn.Module):
    """Dropout, a torch draw, and Python's and NumPy's generators in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(8, 4), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + 0.0 * random.random() + 0.0 * float(np.random.rand())
        return self.drop(self.lin(x + 0.01 * torch.randn_like(x))) * scale


def _seed() -> None:
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)


def _draws() -> tuple[torch.Tensor, float, float]:
    return torch.rand(4), random.random(), float(np.random.rand())


@pytest.mark.sim
@pytest.mark.parametrize("entry", ["plan", "estimate", "analyse"])
def test_planning_leaves_the_seeded_generators_as_they_were(entry: str) -> None:
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    model = Draws()
    _seed()
    expected = _draws()  # the truth: what a seeded script draws without autofit in between
    _seed()
    if entry == "plan":
        autofit.plan(model, x, "1GB", target=y, device="cpu")
    elif entry == "estimate":
        autofit.estimate(model, x, step=4, target=y)
    else:
        autofit.analyse(model, x, target=y)
    got = _draws()
    assert torch.equal(got[0], expected[0])  # before issue 55 the torch draw differed (dropout, randn_like)
    assert got[1:] == expected[1:]


# ---- 4. a plan records its model -------------------------------------------------------------------------------
def _mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(20, hidden), nn.ReLU(), nn.Linear(hidden, 4))


@pytest.mark.sim
def test_a_plan_records_its_model_and_wrap_refuses_another() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(16, 20), torch.randint(0, 4, (16,))
    made = autofit.plan(_mlp(26), x, "1GB", target=y, optimizer="sgd", device="cpu")
    hand = 20 * 26 + 26 + 26 * 4 + 4  # 654, by hand
    assert (made.made_for.parameters, made.made_for.trainable, made.made_for.tensors) == (hand, hand, 4)
    plan = Plan.from_json(made.to_json())
    assert plan.made_for == made.made_for

    def wrapped(model: nn.Module) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan.wrap(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)).unwrap()
        return [str(w.message) for w in caught]

    assert wrapped(_mlp(26)) == []  # the same architecture: silent
    big = _mlp(3000)  # 75,004 parameters: before issue 55 it wrapped without a word
    with pytest.raises(ModelMismatchError, match=f"{hand} parameters.*75,004 parameters.*autofit.plan"):
        wrapped(big)
    with pytest.raises(autofit.InvalidInputError, match="float64.*more bytes"):  # wider: more memory than verified
        wrapped(_mlp(26).to(torch.float64))
    unfrozen = _mlp(26)
    made_frozen = autofit.plan(_mlp(26).requires_grad_(False).append(nn.Linear(4, 4)), x, "1GB", target=y,
                               optimizer="sgd", device="cpu")
    assert made_frozen.made_for.trainable == 20 and made_frozen.made_for.parameters == hand + 20
    with pytest.raises(ModelMismatchError, match="more of its parameters train"):
        made_frozen.wrap(unfrozen.append(nn.Linear(4, 4)), torch.optim.SGD(unfrozen.parameters(), lr=0.1))
    assert any("bfloat16" in w and "no more memory" in w for w in wrapped(_mlp(26).to(torch.bfloat16)))
    frozen = _mlp(26)
    frozen[0].requires_grad_(False)
    assert any("fewer of them train (108, planned 654)" in w for w in wrapped(frozen))
    old = json.loads(made.to_json())
    del old["made_for"]  # a plan written before the record: loads, and wraps any model as before
    assert Plan.from_json(json.dumps(old)).made_for is None
    Plan.from_json(json.dumps(old)).wrap(big, torch.optim.SGD(big.parameters(), lr=0.1)).unwrap()


# ---- 5. a meta sample for a forward that reads values -----------------------------------------------------------
class ReadsItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) if x.sum() > 0 else self.lin(2 * x)


@pytest.mark.sim
@pytest.mark.parametrize("entry", ["estimate", "analyse"])
def test_a_meta_sample_for_a_forward_that_reads_values_is_a_typed_error(entry: str) -> None:
    x = torch.empty(16, 8, device="meta")
    call = (lambda: autofit.estimate(ReadsItsInput(), x, step=4)) if entry == "estimate" \
        else (lambda: autofit.analyse(ReadsItsInput(), x))
    # before issue 55: NotImplementedError "Cannot copy out of meta tensor; no data!"
    with pytest.raises(autofit.UnsupportedModelError, match="meta device, which hold no values.*real sample"):
        call()
