"""Where the step clears the gradients (issue 61, Note [where zero_grad falls] in autofit/training/step.py):
"after-step" (the default), "before-forward" and "after-forward" (Lightning's automatic optimization).

The truths: the CPU allocator's record of the same step run for real (``autofit.measure``, and the profiler around a
real Lightning ``Trainer``), a plain PyTorch loop written in each order, and the JSON a plan written before the
field had.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import autofit
from autofit.core.errors import InvalidInputError
from autofit.core.report import MemoryEstimate
from autofit.training.config import ZERO_GRAD_ORDERS, make_step_config
from autofit.training.precision import PrecisionPolicy

ORDERS = tuple(str(o) for o in ZERO_GRAD_ORDERS)


# ---- the three models -------------------------------------------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    return model, torch.randn(512, 64), torch.randint(0, 10, (512,)), None


def _vit_loss(out, target):
    return F.cross_entropy(out.logits, target)


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                       image_size=32, patch_size=4, num_labels=10)
    return ViTForImageClassification(config), torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)), _vit_loss


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
    ids = torch.randint(0, 512, (8, 32))
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}, None, None


MODELS = {"mlp": _mlp, "vit": _vit, "llama": _llama}


@pytest.mark.sim
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(MODELS))
def test_estimate_matches_the_allocator_in_every_order(name, order):
    if name != "mlp":
        pytest.importorskip("transformers")
    model, sample, target, loss_fn = MODELS[name]()
    rows = next(iter(sample.values())).shape[0] if isinstance(sample, dict) else sample.shape[0]
    for steps in (1, 2):  # with accumulation the clearing runs at the window's first micro-batch only
        kw = dict(target=target, loss_fn=loss_fn,
                  step=autofit.Step(micro_batch_size=rows // 2, accumulation_steps=steps, zero_grad=order))
        est = autofit.estimate(model, sample, **kw)
        real = autofit.measure(model, sample, **kw)
        assert abs(est.peak_bytes - real.peak_bytes) <= 0.005 * real.peak_bytes, (steps, est.peak_bytes,
                                                                                 real.peak_bytes)


@pytest.mark.sim
def test_lightnings_order_raises_a_forward_peak_by_the_gradients_alive_through_it():
    pytest.importorskip("transformers")
    # the truth is the allocator: the same real step, in the two orders; the tiny ViT's peak is in forward once the
    # last step's gradients live through it
    model, sample, target, loss_fn = _vit()
    kw = dict(target=target, loss_fn=loss_fn)
    after_step = autofit.measure(model, sample, step=autofit.Step(micro_batch_size=8, zero_grad="after-step"), **kw)
    lightning = autofit.measure(model, sample, step=autofit.Step(micro_batch_size=8, zero_grad="after-forward"), **kw)
    assert lightning.peak_bytes > after_step.peak_bytes
    est = autofit.estimate(model, sample, step=autofit.Step(micro_batch_size=8, zero_grad="after-forward"), **kw)
    assert est.peak_phase == "forward" and est.breakdown["gradients"] > 0
    assert est.peak_bytes == lightning.peak_bytes


# ---- the trainer against a plain loop ---------------------------------------------------------------------------

def _hand_plan(order: str) -> autofit.Plan:
    """Two micro-batches of 4: the trainer's step, no simulation (the plan's fields are its step)."""
    return autofit.Plan(
        micro_batch_size=4, gradient_accumulation_steps=2, batch_size=8, last_micro_batch_size=4,
        precision=PrecisionPolicy(), checkpoint=(), peak_bytes=1, device_bytes=1, budget_bytes=1, device="cpu",
        optimizer="adamw", predicted_step_seconds=0.0, estimate=MemoryEstimate(peak_bytes=1, breakdown={}),
        zero_grad=order)


def _plain_loop(model, optimizer, x, y, order: str, steps: int) -> None:
    """The loop as users write it in each order, accumulating two micro-batches of the mean loss."""
    for _ in range(steps):
        for i, (xb, yb) in enumerate(zip(x.chunk(2), y.chunk(2))):
            if i == 0 and order == "before-forward":
                optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
            if i == 0 and order == "after-forward":
                optimizer.zero_grad(set_to_none=True)
            (loss / 2).backward()
        optimizer.step()
        if order == "after-step":
            optimizer.zero_grad(set_to_none=True)


@pytest.mark.sim
@pytest.mark.parametrize("order", ORDERS)
def test_trainer_update_equals_a_plain_loop_in_its_order(order):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    _plain_loop(plain, plain_opt, x, y, order, steps=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = _hand_plan(order).wrap(model, optimizer, loss_fn=F.cross_entropy)
    for _ in range(3):
        trainer.step(x, y)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q)
        assert (p.grad is None) == (q.grad is None) == (order == "after-step")
        if q.grad is not None:  # the last step's gradients, kept for the next step to clear
            torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.sim
def test_trainer_step_in_lightnings_order_peaks_where_the_plan_says():
    pytest.importorskip("transformers")
    from autofit.measure.allocator import measure_callable

    model, x, y, loss_fn = _vit()
    plan = autofit.plan(model, x, "1GB", target=y, loss_fn=loss_fn, device="cpu", precision="fp32",
                        savers=autofit.Savers(checkpoint=(), offload=False, zero_grad="after-forward"))
    assert plan.micro_batch_size == 16 and plan.zero_grad == "after-forward"
    optimizer = torch.optim.AdamW(model.parameters())
    trainer = plan.wrap(model, optimizer, loss_fn=loss_fn)

    def step():
        trainer.step(x, y)

    step()  # the optimizer state and the gradients a step leaves exist: the steady state
    state = [v for s in optimizer.state.values() for v in s.values()]
    # the gradients the warm-up leaves are what measure_callable counts as kept (no reference here keeps older ones)
    peak = measure_callable(step, [*model.parameters(), *state, x, y], warm_up=step)
    assert abs(peak - plan.peak_bytes) <= 0.005 * peak, (peak, plan.peak_bytes)
    # the note names the order and what it costs, against the same configuration with zero_grad after the step
    note = next(n for n in plan.notes if n.startswith("zero_grad after forward (Lightning's order)"))
    other = autofit.estimate(model, x, target=y, loss_fn=loss_fn,
                             step=autofit.Step(micro_batch_size=16, checkpoint=None)).peak_bytes
    assert f"({plan.peak_bytes - other:,} B;" in note


# ---- a real Lightning Trainer ------------------------------------------------------------------------------------

def _lightning_classifier(pl):
    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.GELU(),
                                     nn.Linear(1024, 4))

        def forward(self, x):
            return self.net(x).mean(1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):  # autofit's "sgd": momentum 0.9
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)

    torch.manual_seed(0)
    return Classifier()


def _measured_lightning_step(pl, module, plan, x, y) -> int:
    """Peak bytes of the third step of ``trainer.fit`` by the allocator's record: the storages alive when it starts
    (parameters, gradients, optimizer state, the batch) plus the high-water mark during it; the second step runs
    under a memory profile too, so the frees of what it left are seen (Note [memory from before the window])."""
    from autofit.core._torch_profiler import allocation_sizes, high_water_mark, memory_profile
    from autofit.integrations.lightning import AutofitLightningCallback
    from autofit.measure.allocator import _storage_bytes

    class Measure(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, i):
            if i == 1:
                self.warm = memory_profile()
                self.warm.__enter__()
            if i == 2:
                self.warm.__exit__(None, None, None)
                optimizer = trainer.optimizers[0]
                params = list(module.parameters())
                state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
                self.live = _storage_bytes([*params, *(p.grad for p in params if p.grad is not None), *state,
                                            *batch])
                gc.collect()
                self.window = memory_profile()
                self.prof = self.window.__enter__()

        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            if i == 2:
                self.window.__exit__(None, None, None)
                self.peak = self.live + high_water_mark(allocation_sizes(self.prof))[0]

    measure = Measure()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=plan.micro_batch_size)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[AutofitLightningCallback(plan), measure])
    trainer.fit(module, loader)
    return measure.peak


@pytest.mark.sim
def test_lightning_step_matches_the_callbacks_plan():
    pl = pytest.importorskip("lightning.pytorch")
    from autofit.integrations.lightning import plan as lightning_plan

    module = _lightning_classifier(pl)
    x, y = torch.randn(32, 64, 32), torch.randint(0, 4, (32,))
    kw = dict(target=y[:8], loss_fn=F.cross_entropy, device="cpu", precision="fp32", savers="none", optimizer="sgd")
    plan = lightning_plan(module, x[:8], "1GB", **kw)
    assert plan.zero_grad == "after-forward" and plan.micro_batch_size == 8
    peak = _measured_lightning_step(pl, module, plan, x, y)
    assert abs(peak - plan.peak_bytes) <= 0.005 * peak, (peak, plan.peak_bytes)
    # a plan in autofit's default order is short of Lightning's step here, and the callback says so
    default = autofit.plan(module, x[:8], "1GB", **kw)
    assert default.peak_bytes < peak - 0.005 * peak
    with pytest.warns(UserWarning, match="Lightning's automatic optimization clears the gradients after forward"):
        _measured_lightning_step(pl, _lightning_classifier(pl), default, x, y)


# ---- the plan, its JSON, the exports, bad input -----------------------------------------------------------------

def test_the_default_order_is_not_written_and_old_plans_load_with_it():
    plan = _hand_plan("after-step")
    data = json.loads(plan.to_json())
    assert "zero_grad" not in data  # a plan in the default order is written as before the field existed
    assert autofit.Plan.from_json(plan.to_json()).zero_grad == "after-step"
    lightning = dataclasses.replace(plan, zero_grad="after-forward")
    assert json.loads(lightning.to_json())["zero_grad"] == "after-forward"
    loaded = autofit.Plan.from_json(lightning.to_json())
    assert loaded.zero_grad == "after-forward" and loaded.step.zero_grad == "after-forward"
    assert "zero_grad" in dict(lightning.summary_rows(str)) and "zero_grad" not in dict(plan.summary_rows(str))


def test_an_unknown_order_is_refused_naming_the_three():
    for bad in ("before", None, 1):
        with pytest.raises(InvalidInputError, match="'after-step'.*'before-forward'.*'after-forward'"):
            make_step_config(micro_batch_size=1, zero_grad=bad)
    with pytest.raises(InvalidInputError, match="zero_grad must be"):
        _hand_plan("lightning")
    with pytest.raises(InvalidInputError, match=r"Savers\(zero_grad=...\) must be 'after-step'"):
        autofit.Savers(zero_grad="after-backward")


def test_exports_say_which_order_the_plan_assumed():
    from autofit.emit.export import to_hf_training_arguments, to_lightning_trainer

    lightning = to_lightning_trainer(_hand_plan("after-forward"))["autofit_notes"]
    assert any("planned with Lightning's order" in n for n in lightning)
    default = to_lightning_trainer(_hand_plan("after-step"))["autofit_notes"]
    assert any("zero_grad='after-forward'" in n for n in default)
    assert "autofit_notes" not in to_hf_training_arguments(_hand_plan("after-step"))
    hf = to_hf_training_arguments(_hand_plan("after-forward"))["autofit_notes"]
    assert any("Hugging Face's Trainer clears the gradients after the optimizer step" in n for n in hf)


@pytest.mark.sim
def test_cli_plans_a_lightning_export_in_lightnings_order_and_takes_zero_grad():
    from pathlib import Path

    from typer.testing import CliRunner

    from autofit.cli.app import app

    factory = f"{Path(__file__).resolve().parent.parent / 'examples' / 'factories.py'}:small_cnn"
    runner = CliRunner()
    args = ["plan", factory, "--budget", "50MB", "--batch-size", "8", "--device", "cpu", "--json"]
    lightning = runner.invoke(app, [*args, "--export", "lightning"], catch_exceptions=False)
    assert lightning.exit_code == 0, lightning.output
    plan = json.loads(lightning.stdout[lightning.stdout.index("{"):])
    assert plan["zero_grad"] == "after-forward"  # the order Lightning's automatic optimization runs
    told = runner.invoke(app, [*args, "--export", "lightning", "--zero-grad", "after-step"], catch_exceptions=False)
    assert "zero_grad" not in json.loads(told.stdout[told.stdout.index("{"):])
    bad = runner.invoke(app, [*args, "--zero-grad", "sometimes"])
    assert bad.exit_code == 2 and "must be 'after-step'" in bad.output and "'sometimes'" in bad.output
