"""axolotl YAML (``axolotl train FILE``): its examples/*/lora-8b.yml, qlora.yml and fft-8b.yaml files.

Field semantics from axolotl-ai-cloud/axolotl (read at 067b021, 2026-07), ``src/axolotl/utils/schemas``:
- ``model.py``: ``base_model`` (a Hub id or a local directory), ``base_model_config``.
- ``training.py``: ``micro_batch_size`` (default 1) rows per GPU, ``gradient_accumulation_steps`` (1),
  ``batch_size`` (total; ``normalize_config`` in ``utils/config/__init__.py`` derives the accumulation as
  ``batch_size // micro_batch_size`` when it is not given), ``optimizer`` (transformers' ``OptimizerNames`` plus
  axolotl's own).
- ``max_grad_norm`` is passed to transformers' ``TrainingArguments`` when set, whose default (1.0) clips.
- ``config.py``: ``sequence_len`` (default 512), ``sample_packing``; ``bf16`` (default ``auto``: bf16 where the
  GPU has it), ``fp16``, ``bfloat16`` / ``float16`` (the model in that dtype without autocast);
  ``gradient_checkpointing`` (false, true, ``offload``: checkpoints offloaded to the host);
  ``activation_offloading``; ``deepspeed`` (a path or a dict); ``fsdp_config`` (``fsdp_version``,
  ``offload_params``, ``reshard_after_forward``, with or without the ``fsdp_`` prefix, ``fsdp.py``).
- ``peft.py``: ``adapter`` (``lora`` or ``qlora``), ``load_in_4bit`` / ``load_in_8bit``, ``lora_r``,
  ``lora_alpha``, ``lora_dropout``, ``lora_target_modules``, ``lora_target_linear`` (every linear layer).
- The model is loaded in ``cfg.torch_dtype``: bf16 when ``bf16`` or ``bfloat16``, fp16 for ``fp16``,
  ``float16`` or 8-bit loading, else fp32 (``utils/config/__init__.py``), and the Trainer autocasts in bf16 on
  top: a full fine-tune keeps bf16 weights and optimizer state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from autofit.core.errors import InvalidInputError
from autofit.cli.configs.hf_args import optimizer_of, sharding_of, step_changes
from autofit.cli.configs.models import model_ref
from autofit.cli.configs.value import Adapter, Fields, Sharding, TrainConfig, as_bool, as_int, build

__all__ = ["read", "looks_like", "changes", "FRAMEWORK"]

FRAMEWORK = "axolotl"
IRRELEVANT = ("model_type", "tokenizer_type", "attn_implementation", "flash_attention", "sdp_attention",
              "xformers_attention", "tf32", "lora_model_dir", "dataset_prepared_path", "pretraining_dataset",
              "pad_to_sequence_len", "reinit_weights", "saves_per_epoch", "gradient_checkpointing_kwargs",
              "lora_fan_in_fan_out", "fsdp_config.*state_dict_type", "fsdp_config.*auto_wrap_policy",
              "fsdp_config.*transformer_layer_cls_to_wrap", "fsdp_config.*cpu_ram_efficient_loading",
              "fsdp_config.*sync_module_states", "fsdp_config.*use_orig_params", "base_model_config",
              "peft_use_rslora", "hub_model_id", "is_*_derived_model", "excess_length_strategy")


def looks_like(data: Mapping[str, Any]) -> bool:
    return "base_model" in data


def _fsdp(fields: Fields) -> Sharding | None:
    config = fields.raw("fsdp_config")
    if not config:
        return None

    def key(name: str) -> str:
        return f"fsdp_config.fsdp_{name}" if fields.has(f"fsdp_config.fsdp_{name}") else f"fsdp_config.{name}"

    offload = fields.get(key("offload_params"), "FSDP: parameters (and optimizer state) on the host", False)
    raf = fields.get(key("reshard_after_forward"), "FSDP2: reshard after forward (ZeRO-3)", True)
    fields.get(key("version"), "FSDP version")
    fields.unmodelled(key("activation_checkpointing"), "FSDP's own activation checkpointing (every layer)")
    return Sharding(zero_stage=3 if as_bool(raf, "reshard_after_forward") else 2,
                    reshard_after_forward=as_bool(raf, "reshard_after_forward"), offload=as_bool(offload, "offload"))


def read(data: Mapping[str, Any], path: Path | None = None) -> TrainConfig:
    fields = Fields(data, irrelevant=IRRELEVANT)
    name = fields.get("base_model", "the model")
    if not name:
        raise InvalidInputError(f"{path or 'config'}: no base_model")
    micro = as_int(fields.get("micro_batch_size", "rows per GPU and micro-batch", 1), "micro_batch_size")
    total = fields.get("batch_size", "total batch (accumulation = batch_size // micro_batch_size)")
    accum = fields.get("gradient_accumulation_steps", "micro-batches per optimizer step")
    accum = as_int(accum, "gradient_accumulation_steps") if accum else (
        as_int(total, "batch_size") // micro if total else 1)
    seq = as_int(fields.get("sequence_len", "tokens per row", 512), "sequence_len")
    packing = as_bool(fields.get("sample_packing", "rows packed to sequence_len", False), "sample_packing")
    bf16 = fields.get("bf16", "autocast in bf16 ('auto': where the GPU has bf16), weights loaded in bf16", "auto")
    fp16 = as_bool(fields.get("fp16", "autocast in fp16, weights loaded in fp16", False), "fp16")
    pure_bf16 = as_bool(fields.get("bfloat16", "the model in bf16 without autocast", False), "bfloat16")
    pure_fp16 = as_bool(fields.get("float16", "the model in fp16 without autocast", False), "float16")
    bf16_on = bf16 == "auto" and not fp16 or (bf16 != "auto" and as_bool(bf16, "bf16"))
    precision = "bf16" if bf16_on else "fp16" if fp16 else "fp32"
    four = as_bool(fields.get("load_in_4bit", "base weights in 4 bits (bitsandbytes nf4)", False), "load_in_4bit")
    eight = as_bool(fields.get("load_in_8bit", "base weights in 8 bits (bitsandbytes int8)", False), "load_in_8bit")
    dtype = "bf16" if bf16_on or pure_bf16 else "fp16" if (fp16 or pure_fp16 or eight) else "fp32"
    if pure_bf16 or pure_fp16:
        precision = "fp32"  # no autocast: the model computes in its own dtype
    kind = fields.get("adapter", "lora or qlora")
    adapter = None
    if kind in ("lora", "qlora"):
        linear = as_bool(fields.get("lora_target_linear", "LoRA on every linear layer", False), "lora_target_linear")
        targets = fields.get("lora_target_modules", "the modules LoRA adapts") or []
        targets = [targets] if isinstance(targets, str) else list(targets)
        adapter = Adapter(rank=as_int(fields.get("lora_r", "LoRA rank", 8), "lora_r"),
                          alpha=float(fields.get("lora_alpha", "LoRA alpha", 16)),
                          targets=("all-linear",) if linear else tuple(targets),
                          dropout=float(fields.get("lora_dropout", "LoRA dropout", 0.0)),
                          quantized_bits=4 if (kind == "qlora" or four) else 8 if eight else None)
    elif kind:
        fields.skipped.append(("adapter", f"{kind!r}: an adapter autofit does not build; planned as full"))
    if adapter is None and (four or eight):  # bitsandbytes' weights train only under an adapter
        fields.skipped.append(("load_in_4bit" if four else "load_in_8bit", "quantized weights without a LoRA "
                                                                          "adapter; planned unquantized"))
    gc = fields.get("gradient_checkpointing", "recompute every decoder layer ('offload': to the host)", False)
    if gc in ("offload", "offload_disk"):
        fields.skipped.append(("gradient_checkpointing", f"{gc!r}: the checkpoints offloaded to the host; "
                                                         "planned as recomputation kept on the GPU"))
    values: dict[str, Any] = {}
    optimizer = fields.get("optimizer", "the optimizer (transformers' OptimizerNames, axolotl's own)")
    if optimizer is not None:
        values.update(optimizer_of(fields, "optimizer", optimizer))
    sharding = sharding_of(fields, path.parent if path else None) or _fsdp(fields)
    fields.mark("fsdp_config", "fsdp_version", "fsdp_config.fsdp_version", "fsdp_config.version")
    for key, why in (("activation_offloading", "activations kept on the host"), ("fp8", "FP8 training"),
                     ("liger_*", "Liger kernels"), ("plugins", "plugins may patch the model (Liger, cut "
                                                              "cross-entropy) and change memory"),
                     ("lora_mlp_kernel", "axolotl's fused LoRA kernels"),
                     ("lora_qkv_kernel", "axolotl's fused LoRA kernels"),
                     ("lora_o_kernel", "axolotl's fused LoRA kernels"), ("torch_compile", "torch.compile"),
                     ("unfrozen_parameters", "only some parameters trained"), ("deepcompile", "DeepSpeed compile"),
                     ("context_parallel_size", "context parallel"), ("tensor_parallel_size", "tensor parallel"),
                     ("selective_checkpointing", "selective recomputation inside checkpointed layers"),
                     ("peft_use_dora", "DoRA's magnitude vectors"), ("relora_steps", "ReLoRA")):
        if "*" in key:
            for k in [k for k in data if k.startswith(key[:-1])]:
                fields.unmodelled(k, why)
        else:
            fields.unmodelled(key, why)
    clip = fields.get("max_grad_norm", "clip the gradients' norm (the Trainer's default 1.0)", 1.0)
    model, note = model_ref(str(name), path)
    notes = [note] if note else []
    if bf16 == "auto":
        notes.append("bf16: auto is read as bf16 (every card of the catalog since Ampere has it; on one without, "
                     "axolotl trains in fp32)")
    return build(FRAMEWORK, path, fields, model=model, notes=tuple(notes), sequence_length=seq,
                 micro_batch_size=micro, accumulation_steps=accum, packing=packing, precision=precision,
                 model_dtype=dtype, adapter=adapter, checkpointing="full" if gc else "none", sharding=sharding,
                 clip_grad_norm=float(clip) if clip else None,
                 **values)


def changes(config: TrainConfig, knobs) -> dict[str, Any]:
    out = step_changes(config, knobs, batch_key="micro_batch_size", optimizer_key="optimizer")
    s = config.sharding
    if knobs.fsdp is not None and s is not None and not s.deepspeed:
        prefixed = any(r.key.startswith("fsdp_config.fsdp_") for r in config.readings)
        prefix = "fsdp_config.fsdp_" if prefixed else "fsdp_config."
        if knobs.fsdp.offload != s.offload:
            out[prefix + "offload_params"] = knobs.fsdp.offload
        if knobs.fsdp.reshard_after_forward != (s.reshard_after_forward is not False):
            out[prefix + "reshard_after_forward"] = knobs.fsdp.reshard_after_forward
    return out
