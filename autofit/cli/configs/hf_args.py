"""TRL / Hugging Face ``TrainingArguments`` configs (JSON or YAML, as ``trl sft --config`` and ``HfArgumentParser``
read them), and the ``TrainingArguments`` keys LLaMA-Factory and axolotl share.

Field semantics, from the sources (read, not copied):
- transformers ``TrainingArguments`` (transformers/training_args.py, 5.24): ``per_device_train_batch_size``
  (default 8) rows per device and micro-batch; ``gradient_accumulation_steps`` (1); ``bf16`` / ``fp16`` turn on
  autocast in that dtype (mixed precision; the weights stay in the dtype they were loaded in);
  ``gradient_checkpointing`` recomputes every decoder layer (``gradient_checkpointing_enable``); ``optim``
  (``OptimizerNames``, default ``adamw_torch_fused``), where ``*_8bit`` are bitsandbytes' blockwise 8-bit states and
  ``paged_*`` their paged (unified-memory) variants; ``max_grad_norm`` (1.0) clips; ``fsdp`` a string or list of
  ``full_shard`` / ``shard_grad_op`` / ``hybrid_shard`` / ``offload`` / ``auto_wrap`` with ``fsdp_config``
  (``version``, ``reshard_after_forward``); ``deepspeed`` a path to a DeepSpeed JSON or a dict, whose
  ``zero_optimization.stage`` and ``offload_*`` decide memory.
- TRL ``SFTConfig`` (trl/trainer/sft_config.py): ``max_length`` (default 1024) the sequence length, and with
  ``packing`` the length of every packed row; it defaults ``gradient_checkpointing`` to True and ``bf16`` to True
  unless ``fp16`` is set. ``model_init_kwargs.dtype`` (or ``torch_dtype``) the dtype the model is loaded in.
- TRL ``ModelConfig`` (trl/trainer/model_config.py), the ``trl sft`` script's model arguments in the same file:
  ``model_name_or_path``, ``dtype``, ``use_peft`` with ``lora_r`` (16), ``lora_alpha`` (32), ``lora_dropout``
  (0.05), ``lora_target_modules`` (None: peft's default for the architecture), ``load_in_4bit`` / ``load_in_8bit``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from autofit.core.errors import InvalidInputError
from autofit.cli.configs.models import model_ref
from autofit.cli.configs.value import Adapter, Fields, Sharding, TrainConfig, as_bool, as_int, build

__all__ = ["read", "looks_like", "read_trainer_keys", "optimizer_of", "sharding_of", "dtype_name", "TRL_KEYS",
           "IRRELEVANT", "changes", "step_changes", "trainer_changes", "EIGHT_BIT_NAME"]

TRL_KEYS = ("max_length", "max_seq_length", "packing", "use_peft", "dataset_text_field", "completion_only_loss",
            "assistant_only_loss", "model_init_kwargs", "padding_free", "lora_r")
IRRELEVANT = ("model_revision", "attn_implementation", "ddp_find_unused_parameters", "bf16_full_eval",
              "fp16_full_eval", "tf32", "lora_task_type", "dataset_name", "dataset_config", "dataset_train_split",
              "dataset_test_split", "dataset_text_field", "completion_only_loss", "assistant_only_loss",
              "packing_strategy", "truncation_mode", "eos_token", "pad_token", "use_liger_kernel_*",
              "logging_*", "gradient_checkpointing_kwargs.use_reentrant", "max_grad_norm", "use_rslora")

# transformers' OptimizerNames (training_args.py) -> (autofit optimizer, state bits, paged)
_OPTIM: dict[str, tuple[str, int, bool]] = {
    **{n: ("adamw", 32, False) for n in ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused",
                                         "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_anyprecision",
                                         "adamw_32bit", "adamw_bnb_32bit")},
    "adamw_bnb_8bit": ("adamw", 8, False), "adamw_8bit": ("adamw", 8, False), "adamw_torch_8bit": ("adamw", 8, False),
    "paged_adamw_8bit": ("adamw", 8, True), "paged_adamw_32bit": ("adamw", 32, True),
    "paged_adamw": ("adamw", 32, True), "sgd": ("sgd", 32, False), "adafactor": ("adafactor", 32, False),
}
EIGHT_BIT_NAME = "adamw_bnb_8bit"  # what the plan's 8-bit rung writes back (bitsandbytes' AdamW8bit)

_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16",
           "float32": "fp32", "fp32": "fp32", "float": "fp32"}


def dtype_name(value: Any, key: str) -> str | None:
    """"bfloat16" / "torch.bfloat16" / "bf16" -> "bf16"; "auto" -> None (the loader's default)."""
    text = str(value).strip().lower().removeprefix("torch.")
    if text == "auto":
        return None
    if text not in _DTYPES:
        raise InvalidInputError(f"{key}: unknown dtype {value!r} (bfloat16, float16, float32 or auto)")
    return _DTYPES[text]


def looks_like(data: Mapping[str, Any]) -> bool:
    return "per_device_train_batch_size" in data or ("model_name_or_path" in data and any(k in data for k in TRL_KEYS))


def optimizer_of(fields: Fields, key: str, name: Any) -> dict[str, Any]:
    """The TrainConfig optimizer fields for an ``OptimizerNames`` value; an unknown one is named, AdamW planned."""
    text = str(name).strip().lower()
    if text not in _OPTIM:
        fields.skipped.append((key, f"{name!r}: an optimizer autofit has no mapping for; planned as AdamW"))
        return {}
    optimizer, bits, paged = _OPTIM[text]
    return {"optimizer": optimizer, "optimizer_bits": bits, "paged_optimizer": paged}


def _deepspeed(fields: Fields, key: str, value: Any, base: Path | None) -> Sharding:
    """A DeepSpeed config named by path (read when the file is there) or inline."""
    if isinstance(value, str):
        path = Path(value) if Path(value).is_absolute() or base is None else base / value
        if not path.is_file():
            fields.skipped.append((key, f"{value!r}: the DeepSpeed file is not there to read; its ZeRO stage is "
                                        "taken from the name (zero3/z3 -> 3)"))
            stage = next((s for s in (3, 2, 1, 0) if f"z{s}" in value or f"zero{s}" in value), 0)
            return Sharding(deepspeed=True, zero_stage=stage, offload="offload" in value)
        import json

        value = json.loads(path.read_text())
    zero = value.get("zero_optimization", {}) if isinstance(value, Mapping) else {}
    stage = int(zero.get("stage", 0))
    offload = any(str((zero.get(k) or {}).get("device", "none")) == "cpu" for k in ("offload_param",
                                                                                      "offload_optimizer"))
    return Sharding(deepspeed=True, zero_stage=stage, offload=offload)


def sharding_of(fields: Fields, base: Path | None) -> Sharding | None:
    """``deepspeed`` or ``fsdp`` + ``fsdp_config`` (TrainingArguments' spelling, which LLaMA-Factory shares)."""
    ds = fields.get("deepspeed", "DeepSpeed config: its ZeRO stage and offload shard the states")
    if ds:
        return _deepspeed(fields, "deepspeed", ds, base)
    fsdp = fields.get("fsdp", "FSDP options: full_shard (ZeRO-3), shard_grad_op (ZeRO-2), offload")
    if not fsdp:
        return None
    words = set(fsdp.split() if isinstance(fsdp, str) else fsdp)
    raf = fields.get("fsdp_config.reshard_after_forward", "FSDP2: reshard parameters after forward (ZeRO-3)")
    fields.get("fsdp_config.version", "FSDP version (2: fully_shard)")
    stage = 2 if "shard_grad_op" in words else 3
    return Sharding(zero_stage=stage,
                    reshard_after_forward=None if raf is None else as_bool(raf, "fsdp_config.reshard_after_forward"),
                    offload="offload" in words)


def read_trainer_keys(fields: Fields, base: Path | None, *, checkpoint_default: bool = False,
                      bf16_default: bool = False) -> dict[str, Any]:
    """The TrainingArguments keys as TrainConfig fields (shared by TRL/HF and LLaMA-Factory)."""
    out: dict[str, Any] = {
        "micro_batch_size": as_int(fields.get("per_device_train_batch_size", "rows per device and micro-batch", 8),
                                   "per_device_train_batch_size"),
        "accumulation_steps": as_int(fields.get("gradient_accumulation_steps", "micro-batches per optimizer step",
                                                1), "gradient_accumulation_steps"),
    }
    fp16 = as_bool(fields.get("fp16", "autocast in fp16 (mixed precision)", False), "fp16")
    bf16 = as_bool(fields.get("bf16", "autocast in bf16 (mixed precision)", bf16_default and not fp16), "bf16")
    out["precision"] = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    gc = fields.get("gradient_checkpointing", "recompute every decoder layer in backward", checkpoint_default)
    out["checkpointing"] = "full" if as_bool(gc, "gradient_checkpointing") else "none"
    optim = fields.get("optim", "the optimizer (OptimizerNames)")
    if optim is not None:
        out.update(optimizer_of(fields, "optim", optim))
    clip = fields.get("max_grad_norm", "clip the gradients' norm before the step", 1.0)
    out["clip_grad_norm"] = float(clip) if clip else None
    out["sharding"] = sharding_of(fields, base)
    fields.mark("fsdp_config")
    fields.unmodelled("torch_compile", "torch.compile: autofit plans it with --compile, not from the config")
    fields.unmodelled("gradient_checkpointing_kwargs", "the checkpointing options beyond use_reentrant")
    fields.unmodelled("use_liger_kernel", "Liger's fused kernels (fused linear cross-entropy) save memory autofit "
                                          "does not model; the estimate errs high")
    fields.unmodelled("torch_empty_cache_steps", "the allocator's cache emptied every N steps")
    return out


def _peft(fields: Fields) -> Adapter | None:
    four = as_bool(fields.get("load_in_4bit", "base weights quantized to 4 bits (bitsandbytes)", False),
                   "load_in_4bit")
    eight = as_bool(fields.get("load_in_8bit", "base weights quantized to 8 bits (bitsandbytes)", False),
                    "load_in_8bit")
    fields.mark("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")
    if not as_bool(fields.get("use_peft", "train a LoRA adapter (peft)", False), "use_peft"):
        if four or eight:
            fields.skipped.append(("load_in_4bit" if four else "load_in_8bit", "quantized weights without use_peft"))
        return None
    targets = fields.get("lora_target_modules", "the modules LoRA adapts")
    if isinstance(targets, str):
        targets = ["all-linear"] if targets == "all-linear" else [t.strip() for t in targets.split(",")]
    return Adapter(rank=as_int(fields.get("lora_r", "LoRA rank", 16), "lora_r"),
                   alpha=float(fields.get("lora_alpha", "LoRA alpha", 32)),
                   targets=tuple(targets or ()), dropout=float(fields.get("lora_dropout", "LoRA dropout", 0.05)),
                   quantized_bits=4 if four else 8 if eight else None)


def read(data: Mapping[str, Any], path: Path | None = None) -> TrainConfig:
    trl = any(k in data for k in TRL_KEYS)
    framework = "trl" if trl else "hf"
    fields = Fields(data, irrelevant=IRRELEVANT)
    name = fields.get("model_name_or_path", "the model (TRL's ModelConfig)")
    if not name:
        raise InvalidInputError(f"{path or 'config'}: TrainingArguments name no model: add model_name_or_path "
                                "(TRL's ModelConfig key), e.g. model_name_or_path: Qwen/Qwen2.5-0.5B")
    seq = fields.get("max_length", "tokens per row (TRL SFTConfig; with packing, every packed row)")
    if seq is None:
        seq = fields.get("max_seq_length", "tokens per row (TRL's older spelling of max_length)")
    if seq is None and trl:
        seq = 1024  # SFTConfig's default
    if seq is None:
        raise InvalidInputError(f"{path or 'config'}: TrainingArguments carry no sequence length: add max_length "
                                "(TRL SFTConfig's key), e.g. max_length: 2048")
    values = read_trainer_keys(fields, path.parent if path else None, checkpoint_default=trl, bf16_default=trl)
    dtype = fields.get("model_init_kwargs.dtype", "the dtype the model is loaded in")
    dtype = dtype or fields.get("model_init_kwargs.torch_dtype", "the dtype the model is loaded in")
    dtype = dtype or fields.get("dtype", "the dtype the model is loaded in (TRL's ModelConfig)")
    dtype = dtype or fields.get("torch_dtype", "the dtype the model is loaded in (older spelling)")
    fields.mark("model_init_kwargs")
    packing = as_bool(fields.get("packing", "rows packed to max_length", False), "packing")
    fields.unmodelled("padding_free", "rows concatenated without padding (flash-attention varlen)")
    fields.unmodelled("activation_offloading", "activations kept in host memory")
    model, note = model_ref(str(name), path)
    return build(framework, path, fields, model=model, notes=(note,) if note else (),
                 sequence_length=as_int(seq, "max_length"),
                 adapter=_peft(fields), model_dtype=dtype_name(dtype, "dtype") if dtype else None, packing=packing,
                 **values)


def changes(config: TrainConfig, knobs) -> dict[str, Any]:
    """The keys of a TrainingArguments file the plan ``knobs`` change (autofit.cli.configs.writeback.PlanKnobs)."""
    return trainer_changes(config, knobs)


def step_changes(config: TrainConfig, knobs, *, batch_key: str, optimizer_key: str,
                 checkpoint_key: str = "gradient_checkpointing", checkpoint_inverted: bool = False) -> dict[str, Any]:
    """The keys of the knobs TrainingArguments and the configs built on it (axolotl, LLaMA-Factory) share, each
    under its framework's name: rows per device, accumulation, the bf16 / fp16 flags, the checkpointing switch and
    the 8-bit optimizer; only where the plan differs from what was read."""
    out: dict[str, Any] = {}
    if knobs.micro_batch_size != config.micro_batch_size:
        out[batch_key] = knobs.micro_batch_size
    if knobs.accumulation_steps != config.accumulation_steps:
        out["gradient_accumulation_steps"] = knobs.accumulation_steps
    if knobs.precision != config.precision:
        out["bf16"] = knobs.precision == "bf16"
        out["fp16"] = knobs.precision == "fp16"
    if knobs.checkpointing != (config.checkpointing != "none"):
        out[checkpoint_key] = (not knobs.checkpointing) if checkpoint_inverted else knobs.checkpointing
    if knobs.eight_bit_optimizer and config.optimizer_bits != 8:
        out[optimizer_key] = EIGHT_BIT_NAME
    return out


def trainer_changes(config: TrainConfig, knobs, *, checkpoint_key: str = "gradient_checkpointing",
                    checkpoint_inverted: bool = False) -> dict[str, Any]:
    """TrainingArguments' spelling of the plan's knobs, only where they differ from what was read."""
    out = step_changes(config, knobs, batch_key="per_device_train_batch_size", optimizer_key="optim",
                       checkpoint_key=checkpoint_key, checkpoint_inverted=checkpoint_inverted)
    if knobs.fsdp is not None and config.sharding is not None and not config.sharding.deepspeed:
        words = ["full_shard" if knobs.fsdp.reshard_after_forward else "shard_grad_op", "auto_wrap"]
        if knobs.fsdp.offload:
            words.append("offload")
        if set(words) != set(_fsdp_words(config)):
            out["fsdp"] = " ".join(words)
    return out


def _fsdp_words(config: TrainConfig) -> list[str]:
    s = config.sharding
    words = ["full_shard" if s.zero_stage == 3 else "shard_grad_op", "auto_wrap"]
    return words + (["offload"] if s.offload else [])
