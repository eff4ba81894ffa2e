"""A plan inside Hugging Face's ``Trainer``: its ``TrainingArguments`` and its model.

    plan = autofit.plan(model, sample, "16GB", batch_size=32, device="T4")
    args = training_arguments(plan, TrainingArguments(output_dir="out"))
    Trainer(model=model, args=args, train_dataset=data, callbacks=[AutofitCallback(plan)]).train()

``training_arguments`` sets the batch knobs and the precision (``per_device_train_batch_size``,
``gradient_accumulation_steps``, ``bf16`` / ``fp16``). Checkpointing is **not** HF's
``gradient_checkpointing=True``: ``PreTrainedModel.gradient_checkpointing_enable`` recomputes every decoder layer
(transformers' ``GradientCheckpointingLayer``), which is neither the memory nor the speed the plan predicted when
the plan recomputes a few modules, or parts of layers. So ``training_arguments`` leaves HF's switch off and
:class:`AutofitCallback` applies exactly ``plan.checkpoint`` (and the plan's fp32-pinned modules) to the model when
training begins, with autofit's own patch (non-reentrant ``torch.utils.checkpoint``, the one the estimate
simulated), and removes it when training ends.

A DDP plan counts the gradients inside DDP's buckets (``gradient_as_bucket_view=True``, Note [DDP's bucket views] in
autofit/parallel/simulated.py), which ``TrainingArguments`` cannot express: :func:`bucket_views` sets it on the
Trainer's Accelerator, after the Trainer is built and before ``train()`` wraps the model.

The Trainer clears the gradients after the optimizer step (transformers/trainer.py: ``model.zero_grad()`` right after
``self.optimizer.step()`` and the scheduler), autofit's default order (Note [where zero_grad falls],
autofit/training/step.py): plan with the default ``zero_grad="after-step"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autofit.core.errors import InvalidInputError
from autofit.emit.export import to_hf_training_arguments
from autofit.integrations import checked_plan, plan_patches, require
from autofit.emit.plan import Plan

__all__ = ["training_arguments", "AutofitCallback", "plan_argument_values", "bucket_views"]

_EXTRA = "torch-autofit[hf]"


def plan_argument_values(plan: Plan) -> dict[str, Any]:
    """The ``TrainingArguments`` fields a plan decides (the rest stay the user's): the ``--export hf`` values, with
    HF's ``gradient_checkpointing`` off because :class:`AutofitCallback` checkpoints the plan's modules."""
    values = dict(to_hf_training_arguments(plan)["training_arguments"])
    fields = {f.name for f in dataclasses.fields(require("transformers", _EXTRA).TrainingArguments)}
    if "activation_checkpointing" not in fields:  # transformers 4: the same switch's older name
        values["gradient_checkpointing"] = values.pop("activation_checkpointing")
    return values


def training_arguments(plan: Plan, args: Any = None, **kwargs: Any):
    """``args`` (a ``TrainingArguments``) with the plan's fields replaced, or new arguments from ``kwargs``."""
    transformers = require("transformers", _EXTRA)
    values = plan_argument_values(plan)
    if args is None:
        return transformers.TrainingArguments(**{**kwargs, **values})
    if not isinstance(args, transformers.TrainingArguments):
        raise InvalidInputError(f"training_arguments() needs a TrainingArguments, got {type(args).__name__}")
    return dataclasses.replace(args, **kwargs, **values)



def bucket_views(trainer: Any) -> Any:
    """Make ``trainer`` (a ``transformers.Trainer``, before ``train()``) wrap the model in DDP with
    ``gradient_as_bucket_view=True``, as a DDP plan assumes: its Accelerator's ``DistributedDataParallelKwargs``
    (the ``ddp_handler`` it passes to DDP in ``prepare_model``) with that field set, the Trainer's other DDP settings
    kept. Returns the trainer."""
    require("transformers", _EXTRA)
    accelerate_utils = require("accelerate.utils", _EXTRA)
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or not hasattr(accelerator, "ddp_handler"):
        raise InvalidInputError(f"bucket_views() needs a transformers.Trainer (built, before train()), got "
                                f"{type(trainer).__name__}")
    handler = accelerator.ddp_handler or accelerate_utils.DistributedDataParallelKwargs()
    accelerator.ddp_handler = dataclasses.replace(handler, gradient_as_bucket_view=True)
    return trainer


def _callback_class():
    transformers = require("transformers", _EXTRA)

    class AutofitCallback(transformers.TrainerCallback):
        """Checks that the Trainer's arguments are the plan's, and checkpoints exactly the plan's modules while
        ``train()`` runs (see the module's docstring)."""

        def __init__(self, plan: Plan) -> None:
            plan = checked_plan(plan, "AutofitCallback")
            self.plan = plan
            self._patch = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            _check_arguments(self.plan, args)
            if model is None:
                raise InvalidInputError("AutofitCallback got no model from the Trainer")
            self._patch = plan_patches(self.plan, model)
            self._patch.__enter__()

        def on_train_end(self, args, state, control, **kwargs):
            if self._patch is not None:
                self._patch.__exit__(None, None, None)
                self._patch = None

    return AutofitCallback


def _check_arguments(plan: Plan, args: Any) -> None:
    wrong = [f"{key}={getattr(args, key)!r} (the plan says {value!r})"
             for key, value in plan_argument_values(plan).items() if getattr(args, key) != value]
    mismatch = plan.parallel.other_ranks(getattr(args, "world_size", 1), "world_size={ranks} (the plan is for "
                                         "{planned} processes)")
    if mismatch is not None:
        wrong.append(mismatch)
    if wrong:
        raise InvalidInputError("the TrainingArguments are not the plan's: " + "; ".join(wrong) +
                                ". Build them with autofit.integrations.hf.training_arguments(plan, args)")


def __getattr__(name: str):
    if name == "AutofitCallback":  # a subclass of transformers.TrainerCallback, built on first use
        cls = _callback_class()
        globals()["AutofitCallback"] = cls
        return cls
    raise AttributeError(name)
