"""torchtune recipe YAML (``tune run RECIPE --config FILE``): its recipes/configs/*/8B_lora_single_device.yaml,
8B_qlora_single_device.yaml and *_full*.yaml files.

Field semantics from pytorch/torchtune (read at bd2a0fc, 2026-04), ``recipes/full_finetune_*.py``,
``recipes/lora_finetune_*.py`` and their configs:
- ``model._component_``: the builder; ``lora_<model>`` / ``qlora_<model>`` builders add LoRA (QLoRA: the base
  linear weights in NF4, ``torchtune.modules.peft.LoRALinear(quantize_base=True)``), with ``lora_attn_modules``
  (q_proj, k_proj, v_proj, output_proj), ``apply_lora_to_mlp``, ``apply_lora_to_output``, ``lora_rank``,
  ``lora_alpha``, ``lora_dropout``.
- ``checkpointer.checkpoint_dir``: the Hugging Face checkpoint folder (its name identifies the model).
- ``tokenizer.max_seq_len``: tokens per row (null: the dataset's longest; a plan needs a number, so null is
  refused unless ``dataset.packed``, which packs rows to ``max_seq_len`` too).
- ``batch_size`` per device, ``gradient_accumulation_steps``; the recipes' docstring: total batch = batch_size x
  GPUs x accumulation.
- ``dtype``: ``bf16`` or ``fp32``: the model's parameters, gradients and optimizer state are in that dtype, with
  no autocast (``training.get_dtype`` and ``set_default_dtype`` around the model's construction).
- ``enable_activation_checkpointing`` (every transformer layer), ``enable_activation_offloading``,
  ``optimizer._component_`` (``torch.optim.AdamW``, ``bitsandbytes.optim.PagedAdamW8bit``, ...),
  ``optimizer_in_bwd`` (the step fused into backward), ``fsdp_cpu_offload`` (distributed recipes),
  ``compile``, ``clip_grad_norm``, ``loss._component_`` (``LinearCrossEntropyLoss`` / ``CEWithChunkedOutputLoss``
  compute the output head and the loss in chunks).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from autofit.core.errors import InvalidInputError
from autofit.cli.configs.models import model_ref
from autofit.cli.configs.value import Adapter, Fields, Sharding, TrainConfig, as_bool, as_int, build

__all__ = ["read", "looks_like", "changes", "FRAMEWORK"]

FRAMEWORK = "torchtune"
IRRELEVANT = ("checkpointer.*", "tokenizer.*", "dataset.*", "metric_logger.*", "profiler.*", "device",
              "resume_from_checkpoint", "save_adapter_weights_only", "low_cpu_ram", "log_peak_memory_stats",
              "output_dir", "seed", "shuffle", "optimizer.lr", "optimizer.weight_decay", "optimizer.fused",
              "optimizer.betas", "optimizer.eps", "lr_scheduler.*", "custom_sharded_layers", "loss._component_")

# torch optimizer classes -> (autofit name, bits, paged)
_OPTIMIZERS = {
    "torch.optim.AdamW": ("adamw", 32, False), "torch.optim.Adam": ("adam", 32, False),
    "torch.optim.SGD": ("sgd", 32, False), "bitsandbytes.optim.AdamW8bit": ("adamw", 8, False),
    "bitsandbytes.optim.PagedAdamW8bit": ("adamw", 8, True), "bitsandbytes.optim.PagedAdamW": ("adamw", 32, True),
    "bitsandbytes.optim.PagedAdamW32bit": ("adamw", 32, True), "torchao.optim.AdamW8bit": ("adamw", 8, False),
}
EIGHT_BIT = "bitsandbytes.optim.AdamW8bit"
_BUILDER = re.compile(r"torchtune\.models\.(?P<family>\w+)\.(?P<kind>lora_|qlora_)?(?P<name>\w+)$")
_LORA_KEYS = ("lora_attn_modules", "apply_lora_to_mlp", "apply_lora_to_output", "lora_rank", "lora_alpha",
              "lora_dropout", "quantize_base", "use_dora")


def looks_like(data: Mapping[str, Any]) -> bool:
    model = data.get("model")
    return isinstance(model, Mapping) and "_component_" in model


def read(data: Mapping[str, Any], path: Path | None = None) -> TrainConfig:
    fields = Fields(data, irrelevant=IRRELEVANT)
    builder = str(fields.get("model._component_", "the model builder (lora_/qlora_ builders add LoRA)"))
    match = _BUILDER.match(builder)
    if match is None:
        raise InvalidInputError(f"{path or 'config'}: model._component_ {builder!r} is not a torchtune.models "
                                "builder (e.g. torchtune.models.llama3_1.lora_llama3_1_8b)")
    folder = fields.get("checkpointer.checkpoint_dir", "the checkpoint folder: its name identifies the model")
    if not folder:
        raise InvalidInputError(f"{path or 'config'}: checkpointer.checkpoint_dir names no checkpoint folder, "
                                "from which autofit reads the model")
    packed = as_bool(fields.get("dataset.packed", "rows packed to max_seq_len", False), "dataset.packed")
    seq = fields.get("tokenizer.max_seq_len", "tokens per row")
    if seq is None:
        raise InvalidInputError(f"{path or 'config'}: tokenizer.max_seq_len is null (every row as long as its "
                                "sample): give the longest rows you train on, e.g. tokenizer.max_seq_len: 2048")
    adapter = None
    if match["kind"]:
        modules = list(fields.get("model.lora_attn_modules", "attention projections LoRA adapts", []))
        if as_bool(fields.get("model.apply_lora_to_mlp", "LoRA on the MLP's projections", False), "mlp"):
            modules += ["w1", "w2", "w3"]
        if as_bool(fields.get("model.apply_lora_to_output", "LoRA on the output head", False), "output"):
            modules.append("output")
        adapter = Adapter(rank=as_int(fields.get("model.lora_rank", "LoRA rank", 8), "lora_rank"),
                          alpha=float(fields.get("model.lora_alpha", "LoRA alpha", 16)),
                          targets=tuple(_HF_NAMES.get(m, m) for m in modules),
                          dropout=float(fields.get("model.lora_dropout", "LoRA dropout", 0.0)),
                          quantized_bits=4 if match["kind"] == "qlora_" else None)
    fields.unmodelled("model.use_dora", "DoRA's magnitude vectors")
    dtype = str(fields.get("dtype", "parameters, gradients and optimizer state in this dtype, no autocast", "fp32"))
    if dtype not in ("bf16", "fp32", "fp16"):
        raise InvalidInputError(f"{path or 'config'}: dtype {dtype!r}: torchtune takes bf16 or fp32")
    values: dict[str, Any] = {}
    optimizer = fields.get("optimizer._component_", "the optimizer class")
    if optimizer is not None:
        if optimizer in _OPTIMIZERS:
            name, bits, paged = _OPTIMIZERS[optimizer]
            values.update(optimizer=name, optimizer_bits=bits, paged_optimizer=paged)
        else:
            fields.skipped.append(("optimizer._component_", f"{optimizer!r}: not mapped; planned as AdamW"))
    checkpointing = as_bool(fields.get("enable_activation_checkpointing", "recompute every transformer layer",
                                       False), "enable_activation_checkpointing")
    offload = as_bool(fields.get("fsdp_cpu_offload", "FSDP: parameters and optimizer state on the host", False),
                      "fsdp_cpu_offload")
    fields.mark("fsdp_reshard_after_forward")
    raf = fields.raw("fsdp_reshard_after_forward", True)
    # only the distributed recipes' configs carry FSDP keys (the recipe, not the file, decides the launch)
    sharding = Sharding(zero_stage=3 if raf else 2, reshard_after_forward=bool(raf), offload=offload) \
        if fields.has("fsdp_cpu_offload") or fields.has("fsdp_reshard_after_forward") else None
    in_bwd = as_bool(fields.get("optimizer_in_bwd", "the optimizer steps each parameter in backward", False),
                     "optimizer_in_bwd")
    clip = fields.get("clip_grad_norm", "clip the gradients' norm")
    fields.unmodelled("enable_activation_offloading", "activations kept on the host (torchtune's "
                                                      "OffloadActivations)")
    fields.unmodelled("compile", "torch.compile of the model and loss: autofit plans it with --compile")
    loss = str(fields.raw("loss._component_", ""))
    if "Chunked" in loss or "LinearCrossEntropy" in loss:
        fields.skipped.append(("loss._component_", f"{loss.rsplit('.', 1)[-1]}: the output head and loss in "
                                                   "chunks; planned with the whole logits (errs high)"))
    model, note = model_ref(str(folder).rstrip("/"), path)
    return build(FRAMEWORK, path, fields, model=model, notes=(note,) if note else (), sequence_length=int(seq),
                 micro_batch_size=as_int(fields.get("batch_size", "rows per device and micro-batch", 1),
                                         "batch_size"),
                 accumulation_steps=as_int(fields.get("gradient_accumulation_steps", "micro-batches per step", 1),
                                           "gradient_accumulation_steps"),
                 adapter=adapter, precision="fp32", model_dtype=dtype, packing=packed,
                 checkpointing="full" if checkpointing else "none", optimizer_in_backward=in_bwd,
                 sharding=sharding, clip_grad_norm=float(clip) if clip else None, **values)


# torchtune's module names -> the Hugging Face ones autofit's models use (torchtune/models/convert_weights.py)
_HF_NAMES = {"output_proj": "o_proj", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj", "output": "lm_head"}


def changes(config: TrainConfig, knobs) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if knobs.micro_batch_size != config.micro_batch_size:
        out["batch_size"] = knobs.micro_batch_size
    if knobs.accumulation_steps != config.accumulation_steps:
        out["gradient_accumulation_steps"] = knobs.accumulation_steps
    if knobs.checkpointing != (config.checkpointing != "none"):
        out["enable_activation_checkpointing"] = knobs.checkpointing
    if knobs.stored == "bf16" and config.model_dtype != "bf16":
        out["dtype"] = "bf16"
    if knobs.eight_bit_optimizer and config.optimizer_bits != 8:
        out["optimizer._component_"] = EIGHT_BIT
    if knobs.optimizer_in_backward != config.optimizer_in_backward:
        out["optimizer_in_bwd"] = knobs.optimizer_in_backward
    if knobs.fsdp is not None and config.sharding is not None and knobs.fsdp.offload != config.sharding.offload:
        out["fsdp_cpu_offload"] = knobs.fsdp.offload
    return out
