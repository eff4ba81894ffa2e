"""A plan in other frameworks' terms: keyword arguments as plain dicts (no dependency on those packages).

- Hugging Face ``transformers.TrainingArguments``: ``per_device_train_batch_size``, ``gradient_accumulation_steps``,
  ``bf16`` / ``fp16``, and ``activation_checkpointing`` off (the written file, :func:`export_file`, turns it on
  when the plan recomputes, so that the file alone fits): HF's switch recomputes every decoder layer, which is not
  the plan's memory or speed. The plan's modules are listed beside it; ``autofit.integrations.hf.AutofitCallback``
  checkpoints exactly those.
- DeepSpeed config fragment: ``train_batch_size = micro x accumulation x world``, ``bf16.enabled`` /
  ``fp16.enabled`` with dynamic loss scaling, as in DeepSpeed's config JSON documentation.
- Lightning ``Trainer``: ``precision`` ("32-true", "bf16-mixed", "16-mixed"), ``accumulate_grad_batches``; the
  micro-batch is the DataLoader's batch size (``autofit.integrations.lightning.AutofitLightningCallback`` sets all
  of it, checkpointing included). Its notes say which order of ``zero_grad`` the plan was made for: Lightning's
  automatic optimization (and Fabric loops written the same way) clear after forward (Note [where zero_grad falls],
  autofit/training/step.py), so ``autofit plan --export lightning`` plans in that order unless ``--zero-grad``
  says otherwise; the Hugging Face export notes an order other than the Trainer's (after the optimizer step).

Every export carries the plan's effective batch: an uneven plan (a shorter last micro-batch, which none of these
frameworks can express) is exported as its verified even split (Note [even split], autofit/solve/finish.py), and a plan
without one says under ``autofit_notes`` that the exported batch differs. Sharded plans carry their sharding:
DeepSpeed's ZeRO stage 3 for FSDP2 (0 for DDP), Hugging Face's ``fsdp=True`` with ``fsdp_config`` version 2 (transformers 5's keys), and
Lightning's ``strategy``.

Selective recomputation (autofit/training/recompute.py): every export lists the policy of each recomputed module under
``autofit_checkpoint_policies``. Hugging Face's and Lightning's exports apply it through autofit's callbacks; their
own switches cannot (HF's ``gradient_checkpointing`` recomputes every decoder layer with one policy). DeepSpeed's
activation checkpointing recomputes whole modules and has no op-level policy, which its export says.

DDP's bucket views (Note [DDP's bucket views], autofit/parallel/simulated.py): a DDP plan counts the gradients inside
DDP's communication buckets (``gradient_as_bucket_view=True``, as autofit's trainer wraps the model); torch's default,
which these frameworks keep unless told, holds one more gradient-sized copy. Every DDP export carries the setting
in the framework's own terms: Lightning's ``ddp_strategy`` (``DDPStrategy(**ddp_strategy)``), Accelerate's
``ddp_kwargs`` (``DistributedDataParallelKwargs(**ddp_kwargs)`` in ``Accelerator(kwargs_handlers=...)``), and for
Hugging Face, whose ``TrainingArguments`` cannot express it, ``ddp_kwargs`` with a note naming
``autofit.integrations.hf.bucket_views(trainer)``, which sets it on the Trainer's Accelerator.

The layout's part of each export (its ZeRO stage, FSDP plugin, DDP keywords, degrees, and the notes where a
framework's nearest setting differs or it cannot express a dimension) is each layout dimension's own
(``Dimension.export``, autofit/parallel/; Note [layout dimensions]): the exporters here write what every plan
shares (the batch, the precision, the recomputation), place the ranks and nodes the layout states
(``Parallel.export_ranks``) and merge what its dimensions give (``Parallel.export``, ``Layout.export``).

Stored precision (Note [stored precision], autofit/training/stored.py) maps where the framework has the same scheme: pure bf16
is Lightning's "bf16-true" and, for Hugging Face, loading the model with ``torch_dtype=torch.bfloat16``; bf16/fp16
parameters with an fp32 master copy are DeepSpeed's ``bf16`` / ``fp16`` modes (its optimizer keeps fp32 master
weights). Where a framework has no such scheme the export says so under ``autofit_notes`` rather than picking a
scheme with other memory.
"""

from __future__ import annotations

from typing import Any

from autofit.emit.plan import Plan
from autofit.features import FEATURES
from autofit.parallel.exports import ExportFragment, ExportInputs, merge_settings
from autofit.parallel.replicate import DDP_KWARGS

__all__ = ["DDP_KWARGS", "to_hf_training_arguments", "to_deepspeed_config", "to_lightning_trainer", "to_accelerate_config",
           "to_torchtitan_config", "to_torchtitan_toml", "export_file", "EXPORTERS"]


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
                f"express: {plan.parallel.batch_words(micro, steps)}, not {plan.batch_size}; train with plan.wrap()"]
    return [f"the plan runs {plan.micro_batch_size} x {plan.gradient_accumulation_steps} with a last micro-batch of "
            f"{plan.last_micro_batch_size}; exported as the verified even split {micro} x {steps} (same effective "
            f"batch {plan.batch_size})"]


def _feature_notes(plan: Plan, framework: str) -> list[str]:
    """What each step feature in force says ``framework`` must do to run it (Note [step features])."""
    return [note for feature in FEATURES for note in feature.export_notes(plan, framework)]


def _selective_notes(plan: Plan, how: str) -> list[str]:
    notes = []
    if plan.selective:
        notes.append(f"{len(plan.selective)} modules are recomputed selectively (matmul and attention outputs kept, "
                     f"torch.utils.checkpoint.create_selective_checkpoint_contexts): {how}")
    if plan.op_selective:
        notes.append(f"{len(plan.op_selective)} modules are recomputed by torchtitan's per-op policy (attention and "
                     f"every other matmul kept): {how}")
    return notes


def _layout(plan: Plan, framework: str) -> ExportFragment:
    """The plan's layout in ``framework``'s terms: its dimensions' fragments merged (``Parallel.export``, Note [layout
    dimensions]), given the plan's plain values they read."""
    micro, steps = _split(plan)
    return plan.parallel.export(framework, ExportInputs(
        precision=plan.precision.name, recomputes=bool(plan.checkpoint),
        gradient_bytes=plan.estimate.breakdown.get("gradients", 0), micro_batch_size=micro,
        accumulation_steps=steps))


def _layout_notes(fragment: ExportFragment) -> list[str]:
    """A layout fragment's notes: how the framework runs each dimension, then what it cannot express."""
    return list(fragment.notes + fragment.unexpressed)


def _order_note(plan: Plan, framework: str) -> list[str]:
    """Where the framework's loop clears the gradients against the order the plan was made for (Note [where zero_grad
    falls], autofit/training/step.py): Lightning's automatic optimization clears after forward, and Fabric loops are
    often written so; Hugging Face's Trainer after the optimizer step."""
    order = plan.zero_grad
    if framework == "lightning":
        if order == "after-forward":
            return ["planned with Lightning's order, zero_grad after forward (automatic optimization runs "
                    "training_step, then zero_grad, then backward and the step; a Fabric loop written as loss = "
                    "model(x), optimizer.zero_grad(), fabric.backward(loss), optimizer.step() runs the same): the last "
                    "step's gradients are counted through forward"]
        return [f"planned with zero_grad {order}, but Lightning's automatic optimization clears the gradients after "
                "forward, so the last step's gradients live through forward and the peak can be one gradient set "
                "higher than planned: plan with Savers(zero_grad='after-forward') (autofit plan --zero-grad "
                "after-forward, the default with --export lightning), or keep this order in a Fabric or "
                "manual-optimization loop"]
    if framework == "hf" and order != "after-step":
        return [f"planned with zero_grad {order}; Hugging Face's Trainer clears the gradients after the optimizer "
                "step, which keeps no gradients into the next forward: its peak is at most the plan's (plan with "
                "Savers(zero_grad='after-step') for its own figure)"]
    return []


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
        # modules (autofit_checkpoint_modules) instead. transformers 5 names it activation_checkpointing
        # (gradient_checkpointing is its deprecated alias, training_args.py)
        "activation_checkpointing": False,
    }
    out: dict[str, Any] = {"training_arguments": args, "autofit_checkpoint_modules": list(plan.checkpoint),
                           "autofit_checkpoint_policies": plan.checkpoint_policies}
    notes = _split_notes(plan) + _feature_notes(plan, "hf") + _order_note(plan, "hf") + _selective_notes(
        plan, "gradient_checkpointing_enable() recomputes every decoder layer with one policy; AutofitCallback "
              "applies the plan's")
    stored = _stored(plan)
    if stored == "bf16":
        out["model_torch_dtype"] = "bfloat16"  # from_pretrained(..., torch_dtype=torch.bfloat16): pure bf16 storage
    elif stored is not None:
        notes.append(f"the plan stores {stored}: Hugging Face's Trainer keeps no fp32 master copy of "
                     "low-precision parameters; train with plan.wrap() or the DeepSpeed export")
    layout = _layout(plan, "hf")  # DDP's keywords (beside the arguments), FSDP's fsdp and fsdp_config
    merge_settings(out, layout.settings)
    notes += _layout_notes(layout)
    if notes:
        out["autofit_notes"] = notes
    return out


def to_deepspeed_config(plan: Plan) -> dict[str, Any]:
    micro, steps = _split(plan)
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": steps}
    merge_settings(config, plan.parallel.export_ranks("deepspeed", micro, steps))  # train_batch_size, the layout's
    config.update({
        "bf16": {"enabled": plan.precision.name == "bf16"},
        "fp16": {"enabled": plan.precision.name == "fp16", "loss_scale": 0},  # 0: dynamic loss scaling
    })
    if plan.checkpoint:
        config["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    # ZeRO stage 0 (DeepSpeed's config JSON documentation, "ZeRO Optimizations"): DDP and one process replicate
    # parameters, gradients and optimizer state; the shard dimension sets its stage and ZeRO-Offload
    config["zero_optimization"] = {"stage": 0}
    layout = _layout(plan, "deepspeed")
    merge_settings(config, layout.settings)
    notes = _split_notes(plan) + _feature_notes(plan, "deepspeed")
    if plan.selective or plan.op_selective:
        config["autofit_checkpoint_policies"] = plan.checkpoint_policies
        notes += _selective_notes(plan, "DeepSpeed's activation checkpointing recomputes whole modules and has no "
                                        "op-level policy; apply them with autofit.integrations.plan_patches or train "
                                        "with plan.wrap()")
    notes += _layout_notes(layout)
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
    notes = _split_notes(plan) + _feature_notes(plan, "lightning") + _order_note(plan, "lightning")
    if stored == "bf16":
        precision = "bf16-true"  # parameters, gradients and optimizer state in bf16
    elif stored is not None:
        notes.append(f"the plan stores {stored}: Lightning has no fp32-master scheme ('bf16-true' keeps no master "
                     "copy, '-mixed' keeps fp32 parameters); train with plan.wrap()")
    trainer: dict[str, Any] = {"precision": precision, "accumulate_grad_batches": steps}
    out: dict[str, Any] = {"trainer": trainer, "dataloader_batch_size": micro,
                           "autofit_checkpoint_modules": list(plan.checkpoint),
                           "autofit_checkpoint_policies": plan.checkpoint_policies}
    notes += _selective_notes(plan, "Lightning has no per-module recomputation policy; AutofitLightningCallback "
                                    "applies the plan's")
    # the strategy (Lightning's name) and its keywords: DDPStrategy's, FSDPStrategy's and ModelParallelStrategy's
    layout = _layout(plan, "lightning")
    merge_settings(out, layout.settings)
    merge_settings(out, plan.parallel.export_ranks("lightning", micro, steps))  # the devices per node, the nodes
    notes += _layout_notes(layout)
    if notes:
        out["autofit_notes"] = notes
    return out


def to_accelerate_config(plan: Plan) -> dict[str, Any]:
    """``config_file``: an ``accelerate launch --config_file`` YAML as a dict, with the keys ``accelerate config``
    writes (accelerate/commands/config/cluster.py, ``ClusterConfig``) and ``accelerate launch`` reads (its
    ``--fsdp_*`` and ``--parallelism_config_*`` arguments, accelerate/commands/launch.py), FSDP version 2;
    ``accelerator``: ``Accelerator(...)`` keyword arguments (the accumulation)."""
    micro, steps = _split(plan)
    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[plan.precision.name]
    config: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "mixed_precision": mixed}
    merge_settings({"config_file": config}, plan.parallel.export_ranks("accelerate", micro, steps))  # the machines
    config["distributed_type"] = "NO"  # one process; DDP's MULTI_GPU and FSDP's plugin are their dimensions'

    notes = _split_notes(plan) + _feature_notes(plan, "accelerate")
    out: dict[str, Any] = {"config_file": config, "accelerator": {"gradient_accumulation_steps": steps}}
    layout = _layout(plan, "accelerate")  # DDP's keywords (beside the config file), FSDP's plugin, HSDP and TP
    merge_settings(out, layout.settings)
    notes += _layout_notes(layout)
    # the accumulation is the Accelerator's argument, not the config file's; the micro-batch the DataLoader's
    out.update({"dataloader_batch_size": micro, "autofit_notes": notes})
    return out


def to_torchtitan_config(plan: Plan) -> dict[str, dict[str, Any]]:
    """torchtitan's TOML sections as dicts: ``[parallelism]`` (``data_parallel_replicate_degree``,
    ``data_parallel_shard_degree``, ``fsdp_reshard_after_forward``, ``tensor_parallel_degree``) and ``[training]``
    (``local_batch_size`` per device, ``global_batch_size``, from which torchtitan derives the accumulation steps,
    ``mixed_precision_param``); field names and meanings from torchtitan/config/job_config.py."""
    micro, steps = _split(plan)
    notes = _split_notes(plan) + _feature_notes(plan, "torchtitan")
    # a degree no dimension of the layout writes is 1 (one process: every one); the dimensions write theirs, in
    # mesh order, and FSDP's reshard and parameter dtype
    parallelism: dict[str, Any] = {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 1}
    training: dict[str, Any] = {"local_batch_size": micro}
    merge_settings({"training": training}, plan.parallel.export_ranks("torchtitan", micro, steps))  # global batch
    if plan.precision.name != "fp32":
        training["mixed_precision_param"] = "bfloat16" if plan.precision.name == "bf16" else "float32"
    layout = _layout(plan, "torchtitan")
    merge_settings({"parallelism": parallelism, "training": training}, layout.settings)
    parallelism.setdefault("tensor_parallel_degree", 1)
    notes += _layout_notes(layout)
    if plan.precision.name == "fp16":
        notes.append("torchtitan's mixed precision is bf16 or fp32; the plan computes in fp16")
    activation = _torchtitan_recompute(plan, notes)
    out: dict[str, dict[str, Any]] = {"parallelism": parallelism, "training": training,
                                      "activation_checkpoint": activation}
    for feature in FEATURES:  # the step features' own sections (Float8's converter: Note [Float8 training])
        sections, feature_notes = feature.export_sections(plan, "torchtitan")
        merge_settings(out, sections)
        notes += feature_notes
    if notes:
        out["autofit"] = {"notes": notes}
    return out


def _torchtitan_recompute(plan: Plan, notes: list[str]) -> dict[str, Any]:
    """torchtitan's [activation_checkpoint] for the plan: its per-op policy (mode "selective", option "op") where
    every recomputed module is "op-selective" (Note [torchtitan's per-op policy]), else "full"; torchtitan applies
    either to every block."""
    if not plan.checkpoint:  # ActivationCheckpoint.mode defaults to "selective": say "none"
        return {"mode": "none"}
    if set(plan.op_selective) == set(plan.checkpoint):
        if set(plan.checkpoint) != set(plan.parallel.shard_units or plan.checkpoint):
            notes.append(f"the plan recomputes {len(plan.checkpoint)} modules by torchtitan's per-op policy; "
                         "torchtitan applies it to every block")
        return {"mode": "selective", "selective_ac_option": "op"}
    notes.append(f"recompute the plan's {len(plan.checkpoint)} modules ([activation_checkpoint] mode='full' "
                 "recomputes every block, which needs less memory and more time than the plan)")
    return {"mode": "full"}


def to_torchtitan_toml(plan: Plan) -> str:
    """:func:`to_torchtitan_config` as TOML text, sections in order (notes as comments)."""
    config = to_torchtitan_config(plan)
    lines = [f"# {n}" for n in config.pop("autofit", {}).get("notes", [])]
    for section, values in config.items():
        lines += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def _recompute_note(plan: Plan, switch: str) -> list[str]:
    if not plan.checkpoint:
        return []
    shown = ", ".join(plan.checkpoint[:3]) + (", ..." if len(plan.checkpoint) > 3 else "")
    return [f"the plan recomputes {len(plan.checkpoint)} modules ({shown}); {switch} recomputes every block: at most "
            "the plan's memory, more time. For exactly the plan's modules, train with plan.wrap() or autofit's "
            "callbacks (autofit.integrations)"]


def _yaml(mapping: dict[str, Any], indent: int = 0) -> str:
    """Block YAML for a mapping of scalars, lists and mappings, without a YAML library: each scalar and list in
    JSON's spelling, which YAML 1.2 reads as the same value (true, 8, "bf16", ["a", "b"])."""
    import json

    lines = []
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            lines.append(" " * indent + f"{key}:\n" + _yaml(value, indent + 2))
        else:
            lines.append(" " * indent + f"{key}: {json.dumps(value)}\n")
    return "".join(lines)


def _comments(lines: list[str]) -> str:
    return "".join(f"# {' '.join(line.split())}\n" for line in lines)


def export_file(plan: Plan, name: str) -> tuple[str, list[str]]:
    """``--export NAME=PATH``: the text of the file framework ``name`` reads, and the notes the format cannot hold
    (JSON has no comments; the command prints them). Current keys only, every knob of the plan in it, recomputation
    included (a switch that recomputes at least the plan's modules, so following the file alone fits):

    - ``hf``: a ``TrainingArguments`` JSON (``HfArgumentParser(TrainingArguments).parse_json_file`` reads it; it
      refuses unknown keys, so the file holds nothing else);
    - ``deepspeed``: DeepSpeed's config JSON;
    - ``accelerate``: ``accelerate launch --config_file`` YAML (accelerate's ``load_config_from_file`` reads it;
      it too refuses unknown keys: the micro-batch and the accumulation, which are the DataLoader's and the
      ``Accelerator``'s, are comments);
    - ``lightning``: YAML in LightningCLI's shape (``trainer:``, ``data: batch_size``);
    - ``torchtitan``: its TOML (``tomllib`` reads it)."""
    import json

    micro, steps = _split(plan)
    if name == "hf":
        out = to_hf_training_arguments(plan)
        args = dict(out["training_arguments"])
        if "fsdp_config" in args:
            # under FSDP, transformers asks for FSDP's own recomputation: the Trainer's switch adds an all-gather of
            # each unit's parameters in backward (training_args.py, the warning "prefer
            # fsdp_config['activation_checkpointing']")
            args["fsdp_config"] = {**args["fsdp_config"], "activation_checkpointing": bool(plan.checkpoint)}
        else:
            args["activation_checkpointing"] = bool(plan.checkpoint)
        if plan.device == "cpu":  # a plan for the CPU trains there (transformers refuses bf16 without a GPU else)
            args["use_cpu"] = True
        notes = list(out.get("autofit_notes", []))
        notes += _recompute_note(plan, "fsdp_config's activation_checkpointing (FSDP's own)" if "fsdp_config" in args
                                 else "activation_checkpointing (Trainer's gradient checkpointing)")
        if "model_torch_dtype" in out:
            notes.append("load the model with from_pretrained(..., dtype=torch.bfloat16): the plan stores pure bf16")
        return json.dumps(args, indent=2) + "\n", notes
    if name == "deepspeed":
        config = to_deepspeed_config(plan)
        notes = list(config.pop("autofit_notes", []))
        config.pop("autofit_checkpoint_policies", None)
        notes += _recompute_note(plan, "DeepSpeed's activation checkpointing (deepspeed.checkpointing.checkpoint "
                                       "around each block in the model code)")
        return json.dumps(config, indent=2) + "\n", notes
    if name == "accelerate":
        out = to_accelerate_config(plan)
        config = out["config_file"]
        head = [f"autofit plan: micro-batch {micro} (the DataLoader's batch_size), gradient accumulation {steps} "
                f"(Accelerator(gradient_accumulation_steps={steps})), precision {plan.precision.label}, "
                f"{config['num_processes']} process(es)"]
        if "ddp_kwargs" in out:
            head.append(f"Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(**{out['ddp_kwargs']})])")
        if plan.checkpoint and config.get("distributed_type") != "FSDP":
            head += _recompute_note(plan, "model.gradient_checkpointing_enable() (a transformers model)")
        elif plan.checkpoint:
            head += _recompute_note(plan, "fsdp_activation_checkpointing")
        text = _comments(head + out.get("autofit_notes", [])) + _yaml(config)
        return text, []
    if name == "lightning":
        out = to_lightning_trainer(plan)
        body = {"trainer": out["trainer"], "data": {"batch_size": out["dataloader_batch_size"]}}
        head = [f"autofit plan: micro-batch {micro}, gradient accumulation {steps}"]
        if plan.checkpoint:
            head.append(f"recompute {len(plan.checkpoint)} modules: add AutofitLightningCallback(plan) "
                        "(autofit.integrations.lightning)")
        text = _comments(head + out.get("autofit_notes", [])) + _yaml(body)
        return text, []
    if name == "torchtitan":
        return to_torchtitan_toml(plan), []
    raise KeyError(name)


EXPORTERS = {"hf": to_hf_training_arguments, "deepspeed": to_deepspeed_config, "lightning": to_lightning_trainer,
             "accelerate": to_accelerate_config, "torchtitan": to_torchtitan_config}
