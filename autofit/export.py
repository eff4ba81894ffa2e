"""A plan in other frameworks' terms: keyword arguments as plain dicts (no dependency on those packages).

- Hugging Face ``transformers.TrainingArguments``: ``per_device_train_batch_size``, ``gradient_accumulation_steps``,
  ``bf16`` / ``fp16``, and ``gradient_checkpointing`` off: HF's switch recomputes every decoder layer, which is not
  the plan's memory or speed. The plan's modules are listed beside it; ``autofit.integrations.hf.AutofitCallback``
  checkpoints exactly those.
- DeepSpeed config fragment: ``train_batch_size = micro x accumulation x world``, ``bf16.enabled`` /
  ``fp16.enabled`` with dynamic loss scaling, as in DeepSpeed's config JSON documentation.
- Lightning ``Trainer``: ``precision`` ("32-true", "bf16-mixed", "16-mixed"), ``accumulate_grad_batches``; the
  micro-batch is the DataLoader's batch size (``autofit.integrations.lightning.AutofitLightningCallback`` sets all
  of it, checkpointing included).

Stored precision (Note [stored precision], autofit/stored.py) maps where the framework has the same scheme: pure bf16
is Lightning's "bf16-true" and, for Hugging Face, loading the model with ``torch_dtype=torch.bfloat16``; bf16/fp16
parameters with an fp32 master copy are DeepSpeed's ``bf16`` / ``fp16`` modes (its optimizer keeps fp32 master
weights). Where a framework has no such scheme the export says so under ``autofit_notes`` rather than picking a
scheme with other memory.
"""

from __future__ import annotations

from typing import Any

from autofit.plan import Plan

__all__ = ["to_hf_training_arguments", "to_deepspeed_config", "to_lightning_trainer", "EXPORTERS"]


def _stored(plan: Plan) -> str | None:
    return None if plan.precision.stored in (None, "fp32") else plan.precision.stored


def to_hf_training_arguments(plan: Plan) -> dict[str, Any]:
    args: dict[str, Any] = {
        "per_device_train_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "bf16": plan.precision.name == "bf16",
        "fp16": plan.precision.name == "fp16",
        # off: HF would recompute every decoder layer; autofit.integrations.hf.AutofitCallback applies the plan's
        # modules (autofit_checkpoint_modules) instead
        "gradient_checkpointing": False,
    }
    out = {"training_arguments": args, "autofit_checkpoint_modules": list(plan.checkpoint)}
    stored = _stored(plan)
    if stored == "bf16":
        out["model_torch_dtype"] = "bfloat16"  # from_pretrained(..., torch_dtype=torch.bfloat16): pure bf16 storage
    elif stored is not None:
        out["autofit_notes"] = [f"the plan stores {stored}: Hugging Face's Trainer keeps no fp32 master copy of "
                                "low-precision parameters; train with plan.wrap() or the DeepSpeed export"]
    return out


def to_deepspeed_config(plan: Plan) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "train_batch_size": plan.micro_batch_size * plan.gradient_accumulation_steps * plan.world_size,
        "bf16": {"enabled": plan.precision.name == "bf16"},
        "fp16": {"enabled": plan.precision.name == "fp16", "loss_scale": 0},  # 0: dynamic loss scaling
    }
    if plan.checkpoint:
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    if _stored(plan) == "bf16":
        config["autofit_notes"] = ["the plan stores pure bf16 (no fp32 master copy, bf16 optimizer state); "
                                   "DeepSpeed's bf16 mode keeps fp32 master weights, which need more memory"]
    return config


def to_lightning_trainer(plan: Plan) -> dict[str, Any]:
    precision = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[plan.precision.name]
    stored = _stored(plan)
    out: dict[str, Any] = {}
    if stored == "bf16":
        precision = "bf16-true"  # parameters, gradients and optimizer state in bf16
    elif stored is not None:
        out["autofit_notes"] = [f"the plan stores {stored}: Lightning has no fp32-master scheme ('bf16-true' keeps no "
                                "master copy, '-mixed' keeps fp32 parameters); train with plan.wrap()"]
    return {
        "trainer": {"precision": precision, "accumulate_grad_batches": plan.gradient_accumulation_steps},
        "dataloader_batch_size": plan.micro_batch_size,
        "autofit_checkpoint_modules": list(plan.checkpoint),
        **out,
    }


EXPORTERS = {"hf": to_hf_training_arguments, "deepspeed": to_deepspeed_config, "lightning": to_lightning_trainer}
