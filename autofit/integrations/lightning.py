"""A plan inside Lightning's ``Trainer``: one callback sets accumulation, precision and checkpointing.

    plan = autofit.plan(model, sample, "16GB", batch_size=32, device="T4")
    trainer = lightning.Trainer(callbacks=[AutofitLightningCallback(plan)], ...)
    trainer.fit(module, DataLoader(data, batch_size=plan.micro_batch_size))

In the callback's ``setup`` hook (Lightning's ``Trainer._run`` calls it before ``strategy.setup``, which applies
the precision plugin to the model and optimizers) it sets ``trainer.accumulate_grad_batches`` (read by the fit
loop at every batch) and replaces the strategy's precision plugin with the plan's: ``Precision()`` for fp32,
``MixedPrecision("bf16-mixed" | "16-mixed", device)`` otherwise, with a ``GradScaler`` for fp16 as Lightning's own
accelerator connector builds it. At ``on_fit_start`` it checkpoints exactly the plan's modules of the
LightningModule (autofit's patch, the one the estimate simulated) and removes the patch at ``teardown``. The
micro-batch is the DataLoader's batch size, which a callback cannot change: the first training batch is checked
against ``plan.micro_batch_size``.

Lightning's automatic optimization clears the gradients after the training step's forward and loss, before backward
(Note [where zero_grad falls], autofit/training/step.py), so the previous step's gradients live through the forward.
:func:`plan` plans in that order by default (``zero_grad="after-forward"``); the callback warns when it is given a
plan made for another order and the LightningModule optimizes automatically.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch

from autofit.training.batch import as_batch
from autofit.core.errors import InvalidInputError
from autofit.integrations import checked_plan, plan_patches, require
from autofit.emit.plan import Plan

__all__ = ["AutofitLightningCallback", "lightning_precision", "plan", "LIGHTNING_ORDER"]

# where Lightning's automatic optimization clears the gradients (src/lightning/pytorch/loops/optimization/automatic.py:
# the closure runs the training step, then the zero-grad function, then the backward function)
LIGHTNING_ORDER = "after-forward"


def plan(model: Any, sample: Any, budget: Any = "8GB", **kwargs: Any) -> Plan:
    """``autofit.plan`` for a LightningModule trained with automatic optimization: the same keywords, with
    ``Savers.zero_grad`` Lightning's order ("after-forward") unless the ``savers`` given set it; the plan's notes
    say what it costs."""
    import autofit
    from autofit.options import as_savers

    savers = as_savers(kwargs.get("savers"))
    if savers.zero_grad is None:
        kwargs["savers"] = dataclasses.replace(savers, zero_grad=LIGHTNING_ORDER)
    return autofit.plan(model, sample, budget, **kwargs)

_EXTRA = "torch-autofit[lightning]"
_PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def lightning_precision(plan: Plan) -> str:
    """The plan's precision as Lightning's ``Trainer(precision=...)`` names it."""
    return _PRECISIONS[plan.precision.name]


def _pl():
    """``lightning.pytorch``, or the older standalone ``pytorch_lightning`` package."""
    try:
        return require("lightning.pytorch", _EXTRA)
    except InvalidInputError as e:
        try:
            return require("pytorch_lightning", _EXTRA)
        except InvalidInputError:
            raise e from None


def _precision_plugin(pl, plan: Plan, device_type: str):
    if plan.precision.name == "fp32":
        return pl.plugins.precision.Precision()
    # lightning/pytorch/trainer/connectors/accelerator_connector.py (_check_and_init_precision): 16-mixed gets a
    # GradScaler for the device, bf16-mixed none
    scaler = torch.amp.GradScaler(device_type) if plan.precision.name == "fp16" else None
    return pl.plugins.precision.MixedPrecision(lightning_precision(plan), device_type, scaler)


def _callback_class():
    pl = _pl()

    class AutofitLightningCallback(pl.Callback):
        """Applies a :class:`~autofit.Plan` to a Lightning ``Trainer`` and its LightningModule (see the module)."""

        def __init__(self, plan: Plan) -> None:
            plan = checked_plan(plan, "AutofitLightningCallback")
            self.plan = plan
            self._patch = None
            self._checked = False

        def setup(self, trainer, pl_module, stage: str) -> None:
            if stage != "fit":
                return
            mismatch = self.plan.parallel.other_ranks(trainer.world_size, "the Trainer runs {ranks} processes but "
                                                      "the plan is for {planned}: plan with world_size={ranks}")
            if mismatch is not None:
                raise InvalidInputError(mismatch)
            if getattr(pl_module, "automatic_optimization", False) and self.plan.zero_grad != LIGHTNING_ORDER:
                warnings.warn(
                    f"this plan was made for zero_grad {self.plan.zero_grad!s}, but Lightning's automatic optimization "
                    "clears the gradients after forward, so the last step's gradients live through it and the peak "
                    "can be one gradient set higher than planned: plan with autofit.integrations.lightning.plan(...) "
                    "(or savers=Savers(zero_grad='after-forward'))", stacklevel=2)
            trainer.accumulate_grad_batches = self.plan.gradient_accumulation_steps
            trainer.strategy.precision_plugin = _precision_plugin(pl, self.plan, trainer.strategy.root_device.type)

        def on_fit_start(self, trainer, pl_module) -> None:
            self._patch = plan_patches(self.plan, pl_module)
            self._patch.__enter__()

        def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
            if self._checked:
                return
            self._checked = True
            rows = as_batch(batch, what="the training batch", batch_dim=self.plan.batch_dim[0]).size
            if rows > self.plan.micro_batch_size:
                raise InvalidInputError(f"the DataLoader gives batches of {rows} rows but the plan's micro-batch is "
                                        f"{self.plan.micro_batch_size}: build it with "
                                        f"batch_size=plan.micro_batch_size ({self.plan.micro_batch_size})")

        def teardown(self, trainer, pl_module, stage: str) -> None:
            if self._patch is not None:
                self._patch.__exit__(None, None, None)
                self._patch = None

    return AutofitLightningCallback


def __getattr__(name: str):
    if name == "AutofitLightningCallback":  # a subclass of lightning's Callback, built on first use
        cls = _callback_class()
        globals()["AutofitLightningCallback"] = cls
        return cls
    raise AttributeError(name)
