"""Gradients allocated before forward and kept between steps (Note [gradients allocated before forward],
autofit/training/grads.py): the simulation, ``measure`` and the trainer run the same step.

Truth: the CPU allocator's record (``autofit.measure``) for the memory, and a plain PyTorch AdamW loop with
``zero_grad(set_to_none=True)`` for the parameters a trainer step leaves."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import autofit
from autofit.training.config import StepConfig
from autofit.parallel.layout import Parallel
from autofit.training.precision import PrecisionPolicy


def _mlp(rows: int = 64) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """At 1024 rows, activations (2 MiB a layer) above the weights (1.1 MiB): forward or backward holds the peak of
    a step of one micro-batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))
    return model, torch.randn(rows, 64), torch.randint(0, 4, (rows,))


@pytest.mark.sim
@pytest.mark.parametrize("micro,steps", [(1024, 1), (512, 2)])
def test_estimate_equals_the_cpu_allocator_with_the_gradients_allocated_before_forward(micro: int, steps: int):
    model, x, y = _mlp(1024)
    kw = dict(target=y, loss_fn=nn.CrossEntropyLoss())
    plain_step = autofit.Step(micro_batch_size=micro, accumulation_steps=steps)
    step = replace(plain_step, preallocated_grads=True)
    est = autofit.estimate(model, x, step=step, **kw)
    measured = autofit.measure(model, x, step=step, **kw)
    assert est.peak_bytes == measured.peak_bytes and est.preallocated_grads
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.breakdown["gradients"] == measured.breakdown["gradients"] == grads  # resident before the step
    plain = autofit.measure(model, x, step=plain_step, **kw)
    if steps == 1:  # the activations hold the peak: the gradients now live beside them
        assert est.peak_phase in ("forward", "backward")
        assert measured.peak_bytes > plain.peak_bytes
    else:  # the second micro-batch held them already
        assert measured.peak_bytes == plain.peak_bytes


@pytest.mark.sim
def test_estimate_equals_the_cpu_allocator_on_a_tiny_llama():
    pytest.importorskip("transformers")
    from tests.sharded_models import tiny_llama

    case = tiny_llama()
    for steps in (1, 2):
        step = autofit.Step(micro_batch_size=2, accumulation_steps=steps, checkpoint=("model.layers.0",),
                            preallocated_grads=True)
        est = autofit.estimate(case.model, case.sample, step=step)
        assert est.peak_bytes == autofit.measure(case.model, case.sample, step=step).peak_bytes


def _plan_with_grads_ahead(model, x, y, budget: int | None = None):
    plan = autofit.plan(model, x, budget or 10**10, batch_size=64, target=y, loss_fn=nn.CrossEntropyLoss(),
                        optimizer="adamw", precision="fp32", device="cpu", savers=autofit.Savers(checkpoint=None))
    return replace(plan, estimate=replace(plan.estimate, preallocated_grads=True))


@pytest.mark.sim
def test_a_trainer_step_with_the_gradients_allocated_before_forward_equals_a_plain_step():
    model, x, y = _mlp()
    plan = _plan_with_grads_ahead(model, x, y)
    assert plan.preallocated_grads and "allocated before the first forward" in str(plan)
    assert autofit.Plan.from_json(plan.to_json()).preallocated_grads
    assert '"preallocated_grads": true' in plan.to_json()
    from autofit.cli.render import knobs_table

    table = knobs_table(plan, "mlp")  # the CLI's table
    assert "gradients" in list(table.columns[0].cells)
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    trainer = plan.wrap(ours, opt, loss_fn=nn.CrossEntropyLoss())
    grads = [p.grad for p in ours.parameters()]
    assert all(g is not None and not g.any() for g in grads)  # allocated at wrap, before any forward
    for _ in range(3):
        nn.CrossEntropyLoss()(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        trainer.step(x, y)
        # the same tensors, zeroed in place: nothing was freed and allocated again
        assert all(p.grad is g and not g.any() for p, g in zip(ours.parameters(), grads))
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
    trainer.unwrap()
    assert all(p.grad is None for p in ours.parameters())  # as a plain step's zero_grad(set_to_none=True) leaves


@pytest.mark.sim
def test_trainer_with_accumulation_and_grads_ahead_equals_the_trainer_without():
    """Adding each micro-batch's gradient into zeros is exact (0 + g == g), so with accumulation the parameters are
    bitwise those of the same plan whose first backward creates the gradients (test_trainer.py holds that one to a
    full-batch step, within float reassociation)."""
    model, x, y = _mlp()
    ahead = replace(_plan_with_grads_ahead(model, x, y), micro_batch_size=16, gradient_accumulation_steps=4,
                    last_micro_batch_size=16)
    plain = replace(ahead, estimate=replace(ahead.estimate, preallocated_grads=False))
    trained = []
    for plan in (plain, ahead):
        ours = copy.deepcopy(model)
        with plan.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2), loss_fn=nn.CrossEntropyLoss()) as t:
            for _ in range(2):
                t.step(x, y)
        trained.append(ours)
    for (name, a), b, b0 in zip(trained[1].named_parameters(), trained[0].parameters(), model.parameters()):
        assert not torch.equal(b, b0), name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kw", [
    dict(optimizer_in_backward=True),
    dict(layout=Parallel(strategy="ddp", world_size=2)),
    dict(precision=PrecisionPolicy(name="bf16", stored="bf16-master")),
])
def test_where_the_gradients_cannot_be_kept_is_a_typed_error(kw):
    with pytest.raises(autofit.InvalidInputError, match="preallocated_grads"):
        StepConfig(micro_batch_size=2, preallocated_grads=True, **kw)


@pytest.mark.sim
def test_exports_say_what_their_framework_can_do_with_the_gradients():
    from autofit.emit import export

    model, x, y = _mlp()
    ahead = _plan_with_grads_ahead(model, x, y)
    plain = replace(ahead, estimate=replace(ahead.estimate, preallocated_grads=False))
    exports = {
        "hf": lambda p: export.to_hf_training_arguments(p).get("autofit_notes", []),
        "deepspeed": lambda p: export.to_deepspeed_config(p).get("autofit_notes", []),
        "lightning": lambda p: export.to_lightning_trainer(p).get("autofit_notes", []),
        "accelerate": lambda p: export.to_accelerate_config(p).get("autofit_notes", []),
        "torchtitan": lambda p: export.to_torchtitan_config(p).get("autofit", {}).get("notes", []),
    }
    for name, notes_of in exports.items():
        said = [n for n in notes_of(ahead) if "allocated before the first forward" in n]
        assert len(said) == 1, (name, notes_of(ahead))
        assert not any("allocated before the first forward" in n for n in notes_of(plain)), name
    assert "set_to_none=False" in export._feature_notes(ahead, "lightning")[0]


@pytest.mark.sim
def test_the_hugging_face_callback_refuses_a_plan_that_keeps_the_gradients():
    pytest.importorskip("transformers")
    from autofit.integrations.hf import AutofitCallback

    model, x, y = _mlp()
    with pytest.raises(autofit.InvalidInputError, match="plan.wrap"):
        AutofitCallback(_plan_with_grads_ahead(model, x, y))
