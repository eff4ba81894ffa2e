"""Stored precision (Note [stored precision], autofit/training/stored.py): for each choice the estimate equals the CPU
allocator's record, the trainer's step is the step of that scheme, the master copy is fp32, and unwrap() undoes it.
References: ``autofit.measure`` (the allocator), a plain fp32 PyTorch step, and hand byte counts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autofit
from autofit.core.errors import InvalidInputError
from autofit.training.precision import PrecisionPolicy
from autofit.core.report import MemoryEstimate
from autofit.training.stored import stored_bytes_per_parameter

CHOICES = [
    PrecisionPolicy(name="bf16", stored="fp32"),
    PrecisionPolicy(name="bf16", stored="bf16-master"),
    PrecisionPolicy(name="fp16", stored="fp16-master"),
    PrecisionPolicy(name="bf16", stored="bf16"),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 10))


def _data(rows: int = 8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 32, generator=g), torch.randint(0, 10, (rows,), generator=g)


def _plan(policy: PrecisionPolicy, optimizer: str = "adamw") -> autofit.Plan:
    return autofit.Plan(
        micro_batch_size=4, gradient_accumulation_steps=2, batch_size=8, last_micro_batch_size=4, precision=policy,
        checkpoint=(), peak_bytes=1, device_bytes=1, budget_bytes=1, device="cpu", optimizer=optimizer,
        predicted_step_seconds=0.0, estimate=MemoryEstimate(peak_bytes=1, breakdown={}),
    )


@pytest.mark.sim
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("policy", CHOICES, ids=lambda p: p.label)
def test_estimate_equals_measure(policy, optimizer):
    x, y = _data()
    kw = dict(step=4, target=y, precision=policy, optimizer=optimizer)
    est = autofit.estimate(_model(), x, **kw)
    assert est.peak_bytes == autofit.measure(_model(), x, **kw).peak_bytes


@pytest.mark.sim
def test_state_bytes_follow_the_hand_count():
    # parameters (dtype of storage) + optimizer state (AdamW: exp_avg, exp_avg_sq, and the master copy) at the
    # peak, against 2/4-byte counts by hand; the model's LayerNorm and Linear params are all converted
    x, y = _data()
    n = sum(p.numel() for p in _model().parameters())
    for policy, params, state in [(CHOICES[0], 4 * n, 8 * n), (CHOICES[1], 2 * n, (4 + 8) * n),
                                  (CHOICES[3], 2 * n, 4 * n)]:
        est = autofit.estimate(_model(), x, step=4, target=y, precision=policy, optimizer="adamw")
        assert est.breakdown["parameters"] == params, policy.label
        # + AdamW's per-parameter step counters (one fp32 scalar each)
        steps = 4 * len(list(_model().parameters()))
        assert est.breakdown["optimizer_state"] == state + steps, policy.label
    assert [stored_bytes_per_parameter(s, 2) for s in ("fp32", "bf16-master", "fp16-master", "bf16")] == \
        [16, 16, 16, 8]


@pytest.mark.parametrize("policy, tolerance", [(CHOICES[1], 2e-2), (CHOICES[2], 3e-3)], ids=["bf16", "fp16"])
def test_master_step_equals_an_fp32_step_within_low_precision_and_the_master_is_fp32(policy, tolerance):
    # SGD: the update is lr x the gradient, so the fp32-master update differs from the fp32 one only by the
    # gradient's low-precision error (bf16 keeps 8 significant bits, fp16 11: 2**-8 and 2**-11 relative, a few
    # times over a layer's accumulation); AdamW's first update, lr x sign(g), would flip on near-zero gradients
    x, y = _data()
    before, reference, ours = _model(), _model(), _model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.cross_entropy(reference(x), y).backward()
    opt.step()

    optimizer = torch.optim.SGD(ours.parameters(), lr=0.1)
    trainer = _plan(policy, "sgd").wrap(ours, optimizer)
    low = policy.dtype
    assert all(p.dtype == low for p in ours.parameters())
    masters = [t for g in optimizer.param_groups for t in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)  # the master copy really is fp32
    trainer.step(x, y)
    for m, p, r, p0 in zip(masters, ours.parameters(), reference.parameters(), before.parameters()):
        ours_update, ref_update = (m - p0).detach(), (r - p0).detach()
        assert float((ours_update - ref_update).norm() / ref_update.norm()) < tolerance
        assert torch.equal(p, m.to(low))  # the parameters are the master copy, rounded
    trainer.unwrap()
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    for p, m in zip(ours.parameters(), masters):
        assert torch.equal(p, m)  # unwrap restores the fp32 values of the master copy
    assert all(t is p for t, p in zip(optimizer.param_groups[0]["params"], ours.parameters()))


def test_master_copy_keeps_adamw_state_in_fp32():
    x, y = _data()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with _plan(CHOICES[1]).wrap(model, optimizer) as trainer:
        trainer.step(x, y)
        state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
        assert len(state) == 2 * len(list(model.parameters())) and all(v.dtype == torch.float32 for v in state)
    state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
    assert set(optimizer.state) == set(model.parameters())  # unwrap keys the state by the parameters again


def test_pure_bf16_step_equals_a_bf16_reference():
    x, y = _data()
    reference, ours = _model().to(torch.bfloat16), _model()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    opt.step()
    optimizer = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    plan = _plan(PrecisionPolicy(name="bf16", stored="bf16"))
    plan = type(plan)(**{**plan.__dict__, "micro_batch_size": 8, "gradient_accumulation_steps": 1,
                         "last_micro_batch_size": 8})
    with plan.wrap(ours, optimizer) as trainer:
        trainer.step(x, y)
        state = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]
        assert state and all(v.dtype == torch.bfloat16 for v in state)
        for p, r in zip(ours.parameters(), reference.parameters()):
            torch.testing.assert_close(p, r)
    assert all(p.dtype == torch.float32 for p in ours.parameters())


def test_pinned_modules_keep_fp32_parameters():
    model = _model()
    trainer = _plan(PrecisionPolicy(name="bf16", stored="bf16", fp32_modules=("3",))).wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[3].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    trainer.step(*_data())
    trainer.unwrap()


def test_plan_json_round_trips_the_stored_precision():
    plan = _plan(CHOICES[1])
    assert autofit.Plan.from_json(plan.to_json()).precision == CHOICES[1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="fp16", stored="fp16"), "pure fp16"),
    (dict(name="fp32", stored="bf16-master"), "need bf16 autocast"),
    (dict(name="bf16", stored="fp16-master"), "need fp16 autocast"),
    (dict(name="bf16", stored="int8"), "unknown stored precision"),
])
def test_bad_stored_precision_is_a_typed_error(kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        PrecisionPolicy(**kwargs)
