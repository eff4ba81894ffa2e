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

Every export carries the plan's effective batch: an uneven plan (a shorter last micro-batch, which none of these
frameworks can express) is exported as its verified even split (Note [even split], autofit/solve/finish.py), and a plan
without one says under ``autofit_notes`` that the exported batch differs. Sharded plans carry their sharding:
DeepSpeed's ZeRO stage 3 for FSDP2 (0 for DDP), Hugging Face's ``fsdp="full_shard"`` with FSDP version 2, and
Lightning's ``strategy``.

Selective recomputation (autofit/recompute.py): every export lists the policy of each recomputed module under
``autofit_checkpoint_policies``. Hugging Face's and Lightning's exports apply it through autofit's callbacks; their
own switches cannot (HF's ``gradient_checkpointing`` recomputes every decoder layer with one policy). DeepSpeed's
activation checkpointing recomputes whole modules and has no op-level policy, which its export says.

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


def _split(plan: Plan) -> tuple[int, int]:
    """(micro-batch, accumulation) with equal micro-batches and the plan's effective batch: an uneven plan's
    verified even split (Note [even split], autofit/solve/finish.py), else its own. Without one the effective batch
    differs, and the exporter says so."""
    return plan.even_split or (plan.micro_batch_size, plan.gradient_accumulation_steps)


def _split_notes(plan: Plan) -> list[str]:
    micro, steps = _split(plan)
    if plan.last_micro_batch_size == plan.micro_batch_size:
        return []
    if plan.even_split is None:
        return [f"the plan's last micro-batch has {plan.last_micro_batch_size} rows, which this framework cannot "
                f"express: {micro} x {steps} x {plan.world_size} = {micro * steps * plan.world_size} samples per "
                f"step, not {plan.batch_size}; train with plan.wrap()"]
    return [f"the plan runs {plan.micro_batch_size} x {plan.gradient_accumulation_steps} with a last micro-batch of "
            f"{plan.last_micro_batch_size}; exported as the verified even split {micro} x {steps} (same effective "
            f"batch {plan.batch_size})"]


def _selective_notes(plan: Plan, how: str) -> list[str]:
    if not plan.selective:
        return []
    return [f"{len(plan.selective)} modules are recomputed selectively (matmul and attention outputs kept, "
            f"torch.utils.checkpoint.create_selective_checkpoint_contexts): {how}"]


def _stored(plan: Plan) -> str | None:
    return None if plan.precision.stored in (None, "fp32") else plan.precision.stored


def to_hf_training_arguments(plan: Plan) -> dict[str, Any]:
    micro, steps = _split(plan)
    args: dict[str, Any] = {
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": steps,
        "bf16": plan.precision.name == "bf16",
        "fp16": plan.precision.name == "fp16",
        # off: HF would recompute every decoder layer; autofit.integrations.hf.AutofitCallback applies the plan's
        # modules (autofit_checkpoint_modules) instead
        "gradient_checkpointing": False,
    }
    out: dict[str, Any] = {"training_arguments": args, "autofit_checkpoint_modules": list(plan.checkpoint),
                           "autofit_checkpoint_policies": plan.checkpoint_policies}
    notes = _split_notes(plan) + _selective_notes(plan, "gradient_checkpointing_enable() recomputes every decoder "
                                                        "layer with one policy; AutofitCallback applies the plan's")
    stored = _stored(plan)
    if stored == "bf16":
        out["model_torch_dtype"] = "bfloat16"  # from_pretrained(..., torch_dtype=torch.bfloat16): pure bf16 storage
    elif stored is not None:
        notes.append(f"the plan stores {stored}: Hugging Face's Trainer keeps no fp32 master copy of "
                     "low-precision parameters; train with plan.wrap() or the DeepSpeed export")
    if plan.strategy == "fsdp2":
        # TrainingArguments(fsdp="full_shard", fsdp_config={"version": 2}): FSDP2 through Accelerate (training_args.py)
        args["fsdp"] = "full_shard" + (" offload" if plan.offload_states else "")
        args["fsdp_config"] = {"version": 2}
    if notes:
        out["autofit_notes"] = notes
    return out


def to_deepspeed_config(plan: Plan) -> dict[str, Any]:
    micro, steps = _split(plan)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": steps,
        "train_batch_size": micro * steps * plan.world_size,
        "bf16": {"enabled": plan.precision.name == "bf16"},
        "fp16": {"enabled": plan.precision.name == "fp16", "loss_scale": 0},  # 0: dynamic loss scaling
    }
    if plan.checkpoint:
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    # ZeRO stage of the plan's sharding (DeepSpeed's config JSON documentation, "ZeRO Optimizations"): FSDP2 shards
    # parameters, gradients and optimizer state, which is stage 3; DDP replicates them, stage 0; states on the host
    # are ZeRO-Offload of the parameters and the optimizer
    zero: dict[str, Any] = {"stage": 3 if plan.strategy == "fsdp2" else 0}
    if plan.offload_states:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config["zero_optimization"] = zero
    notes = _split_notes(plan)
    if plan.selective:
        config["autofit_checkpoint_policies"] = plan.checkpoint_policies
        notes += _selective_notes(plan, "DeepSpeed's activation checkpointing recomputes whole modules and has no "
                                        "op-level policy; apply them with autofit.integrations.plan_patches or train "
                                        "with plan.wrap()")
    if _stored(plan) == "bf16":
        notes.append("the plan stores pure bf16 (no fp32 master copy, bf16 optimizer state); DeepSpeed's bf16 mode "
                     "keeps fp32 master weights, which need more memory")
    if notes:
        config["autofit_notes"] = notes
    return config


def to_lightning_trainer(plan: Plan) -> dict[str, Any]:
    precision = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[plan.precision.name]
    stored = _stored(plan)
    micro, steps = _split(plan)
    notes = _split_notes(plan)
    if stored == "bf16":
        precision = "bf16-true"  # parameters, gradients and optimizer state in bf16
    elif stored is not None:
        notes.append(f"the plan stores {stored}: Lightning has no fp32-master scheme ('bf16-true' keeps no master "
                     "copy, '-mixed' keeps fp32 parameters); train with plan.wrap()")
    trainer: dict[str, Any] = {"precision": precision, "accumulate_grad_batches": steps}
    if plan.strategy is not None:
        trainer["strategy"] = {"ddp": "ddp", "fsdp2": "fsdp"}[plan.strategy]
        trainer["devices"] = plan.world_size
    out: dict[str, Any] = {"trainer": trainer, "dataloader_batch_size": micro,
                           "autofit_checkpoint_modules": list(plan.checkpoint),
                           "autofit_checkpoint_policies": plan.checkpoint_policies}
    notes += _selective_notes(plan, "Lightning has no per-module recomputation policy; AutofitLightningCallback "
                                    "applies the plan's")
    if notes:
        out["autofit_notes"] = notes
    return out


EXPORTERS = {"hf": to_hf_training_arguments, "deepspeed": to_deepspeed_config, "lightning": to_lightning_trainer}
