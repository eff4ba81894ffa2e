"""Reference tests of the emitted trainer against plain PyTorch (micrograd-style): one ``trainer.step`` over a batch
must update the parameters exactly as one plain full-batch fp32 step on the same data does, whatever the plan's
micro-batching, accumulation, checkpointing and input form; lower precisions agree within their rounding.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.emit.plan import Plan
from autofit.training.precision import PrecisionPolicy
from autofit.core.report import MemoryEstimate

# fp32: the trainer sums per-micro-batch gradients (weights n_i / N) where the reference reduces the whole batch at
# once; only the order of float32 additions differs, a few ulps of the gradient, times lr = 0.1.
RTOL, ATOL = 1e-5, 1e-6
LR = 0.1


def _plan(*, micro: int, batch: int, precision: str = "fp32", checkpoint: tuple[str, ...] = (),
          optimizer: str = "sgd") -> Plan:
    """A plan with exactly these knobs (the planner's choice is not under test here)."""
    k = -(-batch // micro)
    last = batch - micro * (k - 1)
    return Plan(
        micro_batch_size=micro, gradient_accumulation_steps=k, batch_size=batch, last_micro_batch_size=last,
        precision=PrecisionPolicy(name=precision), checkpoint=checkpoint, peak_bytes=1, device_bytes=1,
        budget_bytes=1, device="cpu", optimizer=optimizer, predicted_step_seconds=0.0,
        estimate=MemoryEstimate(peak_bytes=1, breakdown={}),
    )


class Block(nn.Module):
    """Counts its forward runs, so a test can see that checkpointing recomputes it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + self.fc2(F.gelu(self.norm(self.fc1(x))))


class MLP(nn.Module):
    def __init__(self, inp: int = 6, dim: int = 16, out: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(inp, dim)
        self.block1 = Block(dim)
        self.block2 = Block(dim)
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block2(self.block1(torch.tanh(self.inp(x)))))


class TwoInputs(MLP):
    """Positional inputs (x, z): a tuple batch."""

    def __init__(self) -> None:
        super().__init__(inp=6 + 4)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.cat([x, z], dim=1))


class KeywordInputs(MLP):
    """Keyword inputs with a per-row mask and a non-batch tensor (a shared per-feature scale, passed whole)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return super().forward(x * mask.unsqueeze(1) * scale[:1])


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


def _reference_step(model: nn.Module, inputs, target, loss_fn) -> float:
    """Plain full-batch fp32 SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    if isinstance(inputs, dict):
        output = model(**inputs)
    elif isinstance(inputs, tuple):
        output = model(*inputs)
    else:
        output = model(inputs)
    loss = loss_fn(output, target)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _trainer_step(model: nn.Module, plan: Plan, inputs, target, loss_fn) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = plan.wrap(model, opt, loss_fn=loss_fn)
    loss = trainer.step(inputs, target)
    trainer.unwrap()
    return loss


def _compare_with_reference(model: nn.Module, plan: Plan, inputs, target, *, rtol=RTOL, atol=ATOL,
                            loss_fn=_mse) -> tuple[nn.Module, nn.Module]:
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    before = copy.deepcopy(model)
    ref_loss = _reference_step(ref, inputs, target, loss_fn)
    our_loss = _trainer_step(ours, plan, inputs, target, loss_fn)
    assert our_loss == pytest.approx(ref_loss, rel=max(rtol, 1e-6))
    for (name, a), b, b0 in zip(ours.named_parameters(), ref.parameters(), before.parameters()):
        assert not torch.equal(b, b0), f"{name}: the reference step did not change it (test is vacuous)"
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    return ours, ref


def _data(batch: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)


@pytest.fixture
def model() -> MLP:
    torch.manual_seed(0)
    return MLP()


# ---- fp32: exact equivalence -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("batch", "micro"), [(10, 10), (10, 5), (10, 4), (10, 3), (10, 1), (7, 2)])
def test_accumulation_matches_full_batch_step(model: MLP, batch: int, micro: int) -> None:
    x, y = _data(batch)
    plan = _plan(micro=micro, batch=batch)
    assert plan.gradient_accumulation_steps == -(-batch // micro)
    _compare_with_reference(model, plan, x, y)


def test_uneven_last_micro_batch(model: MLP) -> None:
    # batch 10 in micro-batches of 4: 4 + 4 + 2, the last weighted 2/10
    x, y = _data(10)
    plan = _plan(micro=4, batch=10)
    assert (plan.gradient_accumulation_steps, plan.last_micro_batch_size) == (3, 2)
    seen = []

    def loss_fn(output, target):
        seen.append(output.shape[0])
        return _mse(output, target)

    _compare_with_reference(model, plan, x, y, loss_fn=loss_fn)
    assert seen == [10, 4, 4, 2]  # the reference's one call, then the trainer's three


@pytest.mark.parametrize("checkpoint", [("block1",), ("block1", "block2"), ("block2.fc1",)])
def test_checkpointing_matches_full_batch_step(model: MLP, checkpoint: tuple[str, ...]) -> None:
    x, y = _data(10)
    plan = _plan(micro=4, batch=10, checkpoint=checkpoint)
    ours, ref = _compare_with_reference(model, plan, x, y)
    # checkpointing really happened: each checkpointed block ran twice per micro-batch (forward + recompute)
    for name in ("block1", "block2"):
        recomputed = name in checkpoint
        assert getattr(ours, name).calls == 3 * (2 if recomputed else 1), name
    assert ref.block1.calls == 1


def test_tuple_inputs() -> None:
    torch.manual_seed(0)
    model = TwoInputs()
    g = torch.Generator().manual_seed(2)
    x, z, y = torch.randn(10, 6, generator=g), torch.randn(10, 4, generator=g), torch.randn(10, 3, generator=g)
    _compare_with_reference(model, _plan(micro=4, batch=10, checkpoint=("block2",)), (x, z), y)


def test_dict_inputs_with_a_non_batch_tensor() -> None:
    torch.manual_seed(0)
    model = KeywordInputs()
    g = torch.Generator().manual_seed(3)
    inputs = {"x": torch.randn(10, 6, generator=g), "mask": (torch.rand(10, generator=g) > 0.3).float(),
              "scale": torch.rand(3, 6, generator=g) + 0.5}  # dim 0 is 3, not the batch: passed whole each time
    y = torch.randn(10, 3, generator=g)
    _compare_with_reference(model, _plan(micro=3, batch=10), inputs, y)


def test_dict_target(model: MLP) -> None:
    x, y = _data(10)
    target = {"y": y, "w": torch.rand(10)}

    def loss_fn(output, t):
        return (t["w"].unsqueeze(1) * (output - t["y"]) ** 2).mean()

    _compare_with_reference(model, _plan(micro=4, batch=10), x, target, loss_fn=loss_fn)


def test_adam_state_matches_full_batch_step(model: MLP) -> None:
    # beyond SGD: Adam's moments see the same (accumulated) gradient as a full-batch step; two steps
    x, y = _data(10)
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    trainer = _plan(micro=4, batch=10, optimizer="adam", checkpoint=("block1",)).wrap(
        ours, torch.optim.Adam(ours.parameters(), lr=1e-2), loss_fn=_mse)
    for _ in range(2):
        _mse(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        trainer.step(x, y)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.sim
def test_plan_from_planner_with_accumulation_and_checkpointing() -> None:
    # end to end: a budget tight enough that the planner itself splits the batch; its knobs are checked before the
    # comparison relies on them
    torch.manual_seed(0)
    model = MLP(inp=6, dim=32)  # small weights, a batch of 64: activations dominate, so the budget can bite
    x, y = _data(64)
    free = autofit.plan(model, x, 10**10, batch_size=64, target=y, loss_fn=_mse, optimizer="sgd",
                        precision="fp32", device="cpu")
    assert free.gradient_accumulation_steps == 1
    try:
        autofit.plan(model, x, 1, batch_size=64, target=y, loss_fn=_mse, optimizer="sgd", precision="fp32",
                     device="cpu")
    except autofit.InfeasibleBudgetError as e:
        smallest = e.min_budget_bytes
    else:
        raise AssertionError("a 1-byte budget must be infeasible")
    tight = autofit.plan(model, x, (smallest + free.peak_bytes) // 2, batch_size=64, target=y, loss_fn=_mse,
                         optimizer="sgd", precision="fp32", device="cpu")
    assert tight.precision.name == "fp32"
    assert tight.gradient_accumulation_steps > 1 or tight.checkpoint, str(tight)
    _compare_with_reference(model, tight, x, y)


# ---- every sample contributes exactly once ------------------------------------------------------------------------
class PerSample(nn.Module):
    """Each sample id owns one embedding row: its gradient is non-zero only when that sample is used."""

    def __init__(self, n: int, dim: int = 4) -> None:
        super().__init__()
        self.table = nn.Embedding(n, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids).sum(dim=1)  # one number per sample


@pytest.mark.parametrize(("batch", "micro"), [(10, 4), (10, 3), (9, 9), (13, 5)])
def test_every_sample_contributes_exactly_once(batch: int, micro: int) -> None:
    torch.manual_seed(0)
    n = 2 * batch
    model = PerSample(n)
    before = model.table.weight.detach().clone()
    ids = torch.randperm(n)[:batch]
    seen: list[int] = []

    def loss_fn(output, target):
        seen.extend(target.tolist())  # the rows this micro-batch holds
        return output.mean()

    trainer = _plan(micro=micro, batch=batch).wrap(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                                   loss_fn=loss_fn)
    trainer.step(ids, ids.clone())
    assert sorted(seen) == sorted(ids.tolist())  # each row reaches the loss once
    # d(mean over the batch)/d(row of sample i) = 1/N on each of its entries: seen once, with the weight n_i/N of
    # its micro-batch times 1/n_i inside it. Twice would be 2/N, a missing sample 0.
    delta = before - model.table.weight.detach()
    used = torch.zeros(n, dtype=torch.bool)
    used[ids] = True
    torch.testing.assert_close(delta[used], torch.full((batch, 4), 1.0 / batch), rtol=1e-6, atol=1e-7)
    assert torch.count_nonzero(delta[~used]) == 0


# ---- lower precisions --------------------------------------------------------------------------------------------
# bf16 and fp16 run forward and loss under autocast: Linear inputs and weights are rounded to 8 (bf16) or 11 (fp16)
# significant bits, unit roundoff u = 2^-8 = 3.9e-3 and 2^-11 = 4.9e-4; norms, softmax and the loss stay fp32, and
# the gradients land in the fp32 parameters. Through the model's five Linear layers (forward and backward), relative
# errors of a few u add up, so the parameter *update* (lr * gradient) is compared in relative norm against the fp32
# reference: <= 4 u for bf16 (1.6e-2) and <= 4 u for fp16 (2e-3); observed: at most 1.8 u for both. Elementwise
# checks would be meaningless for updates near zero. A weighting or slicing mistake shows up as an error of O(10 %).
LOW_PRECISION_TOLERANCE = {"bf16": 4 * 2.0**-8, "fp16": 4 * 2.0**-11}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("checkpoint", [(), ("block1",)])
def test_low_precision_matches_fp32_reference(model: MLP, precision: str, checkpoint: tuple[str, ...]) -> None:
    x, y = _data(10)
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_loss = _reference_step(ref, x, y, _mse)
    plan = _plan(micro=4, batch=10, precision=precision, checkpoint=checkpoint)
    opt = torch.optim.SGD(ours.parameters(), lr=LR)
    trainer = plan.wrap(ours, opt, loss_fn=_mse)
    if precision == "fp16":
        assert trainer.scaler is not None and trainer.scaler.is_enabled()
        scale = trainer.scaler.get_scale()
    loss = trainer.step(x, y)
    if precision == "fp16":
        assert trainer.scaler.get_scale() >= scale, "the step was skipped (inf/NaN gradients): test is vacuous"
    tol = LOW_PRECISION_TOLERANCE[precision]
    assert loss == pytest.approx(ref_loss, rel=tol)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        ours_update, ref_update = a.detach() - before[name], b.detach() - before[name]
        error = float((ours_update - ref_update).norm() / ref_update.norm())
        assert error <= tol, f"{name}: update differs from fp32 by {error:.2e} (relative norm), tolerance {tol:.1e}"
        assert a.dtype == torch.float32  # master weights stay fp32


def test_fp16_non_finite_gradient_skips_step_and_backs_off_scale(model: MLP) -> None:
    x, y = _data(10)
    x[7, 2] = float("nan")  # one bad sample, in the last micro-batch of three
    plan = _plan(micro=4, batch=10, precision="fp16")
    trainer = plan.wrap(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn=_mse)
    before = [p.detach().clone() for p in model.parameters()]
    scale = trainer.scaler.get_scale()
    trainer.step(x, y)
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a, b), "the optimizer stepped with NaN gradients"
        assert a.grad is None  # gradients still zeroed for the next window
    assert trainer.scaler.get_scale() == pytest.approx(scale * 0.5)  # GradScaler's backoff factor
    # the next, finite batch does step
    x_ok, y_ok = _data(10, seed=5)
    trainer.step(x_ok, y_ok)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp16_overflowing_gradient_skips_step() -> None:
    torch.manual_seed(0)
    model = MLP()
    x, y = _data(10)
    trainer = _plan(micro=5, batch=10, precision="fp16").wrap(model, torch.optim.SGD(model.parameters(), lr=LR),
                                                              loss_fn=lambda o, t: _mse(o, t) * 1e36)
    before = [p.detach().clone() for p in model.parameters()]
    scale = trainer.scaler.get_scale()
    trainer.step(x, y)  # loss * 65536 * 1e36 overflows float32: inf gradients
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert trainer.scaler.get_scale() < scale


# ---- wrapping and unwrapping --------------------------------------------------------------------------------------
def test_unwrap_restores_the_model(model: MLP) -> None:
    x, _ = _data(4)
    plan = _plan(micro=2, batch=4, checkpoint=("block1", "block2.fc1", "head"))
    with torch.no_grad():
        expected = model(x)
    keys = list(model.state_dict())
    trainer = plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn=_mse)
    assert "forward" in model.block1.__dict__  # the patch is instance-level while wrapped
    returned = trainer.unwrap()
    assert returned is model
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == []
    assert list(model.state_dict()) == keys
    assert type(model.block1).forward is Block.forward
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="unwrapped"):
        trainer.step(x, torch.zeros(4, 3))
    trainer.unwrap()  # a second unwrap is harmless


def test_context_manager_unwraps_and_keeps_user_overrides(model: MLP) -> None:
    custom = model.head.forward  # a user's own instance-level override must survive wrap / unwrap

    def my_forward(x):
        return custom(x)

    model.head.forward = my_forward
    with _plan(micro=2, batch=4, checkpoint=("head",)).wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                            loss_fn=_mse) as trainer:
        trainer.step(*_data(4))
        assert model.head.__dict__["forward"] is not my_forward
    assert model.head.__dict__["forward"] is my_forward
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == ["head"]


# ---- BatchNorm with accumulation ------------------------------------------------------------------------------------
class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.bn(self.fc(x)))


def test_batchnorm_with_accumulation_warns() -> None:
    model = BNNet()
    with pytest.warns(UserWarning, match="BatchNorm"):
        _plan(micro=4, batch=10).wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_mse)


def test_batchnorm_without_accumulation_does_not_warn() -> None:
    model = BNNet()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = _plan(micro=10, batch=10).wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_mse)
    # and with one micro-batch it is the plain step, batch statistics included
    ref = BNNet()
    ref.load_state_dict(model.state_dict())
    x, y = _data(10)
    trainer.step(x, y)
    _reference_step(ref, x, y, _mse)
    for a, b in zip(model.state_dict().values(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_wrap_rejects_wrong_arguments(model: MLP) -> None:
    plan = _plan(micro=2, batch=4)
    with pytest.raises(autofit.InvalidInputError):
        plan.wrap(model, model.parameters())
    with pytest.raises(autofit.InvalidInputError):
        plan.wrap(lambda x: x, torch.optim.SGD(model.parameters(), lr=0.1))
    trainer = plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_mse)
    with pytest.raises(autofit.InvalidInputError):
        trainer.step(torch.randn(4, 6), torch.randn(3, 3))  # target rows differ from input rows
    trainer.unwrap()
