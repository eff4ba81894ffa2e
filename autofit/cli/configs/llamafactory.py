"""LLaMA-Factory training YAML (``llamafactory-cli train FILE``): its examples/train_lora, train_qlora and
train_full files.

Field semantics from hiyouga/LLaMA-Factory's ``src/llamafactory/hparams`` (read at ff6d4d1, 2026-08):
- ``model_args.py``: ``model_name_or_path``; ``quantization_bit`` (4 or 8: bitsandbytes when
  ``quantization_method`` is bnb, the default), ``double_quantization``; ``disable_gradient_checkpointing``
  (default False: LLaMA-Factory checkpoints every layer unless told not to); ``use_unsloth``,
  ``enable_liger_kernel``, ``upcast_layernorm`` change memory in ways autofit does not model.
- ``finetuning_args.py``: ``finetuning_type`` (default ``lora``; ``full``, ``freeze``, ``oft``); ``lora_rank``
  (8), ``lora_alpha`` (None: ``lora_rank * 2``, set in ``__post_init__``), ``lora_target`` (``all``: every
  linear layer), ``lora_dropout`` (0); ``pure_bf16`` (the model in bf16 without autocast); ``use_galore``,
  ``use_apollo``, ``use_badam``, ``use_adam_mini`` (other optimizers, not modelled); ``stage`` (sft, pt, rm,
  dpo, kto, ppo: the preference stages also run a reference model).
- ``data_args.py``: ``cutoff_len`` (2048) tokens per row; ``packing`` (None: on for stage pt only),
  ``neat_packing`` (packing without cross-attention).
- ``training_args.py``: transformers' ``Seq2SeqTrainingArguments`` (autofit.cli.configs.hf_args), so
  ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``bf16``/``fp16``, ``optim``, ``deepspeed``.
- Dtypes (``parser.py`` sets ``compute_dtype`` bf16 when ``bf16`` or ``pure_bf16``; ``model/adapter.py``'s
  ``cast_trainable_params_to_fp32`` unless ``pure_bf16`` or DeepSpeed ZeRO-3): the model is loaded in the compute
  dtype and its trainable parameters cast back to fp32, so a full fine-tune keeps fp32 weights under bf16 autocast,
  and LoRA a bf16 base with fp32 adapters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from autofit.core.errors import InvalidInputError
from autofit.cli.configs.hf_args import read_trainer_keys, trainer_changes
from autofit.cli.configs.models import model_ref
from autofit.cli.configs.value import Adapter, Fields, TrainConfig, as_bool, as_int, build

__all__ = ["read", "looks_like", "changes", "FRAMEWORK"]

FRAMEWORK = "llama-factory"
_MARKERS = ("finetuning_type", "cutoff_len", "stage", "template", "lora_target", "quantization_bit")
IRRELEVANT = ("flash_attn", "ddp_timeout", "overwrite_cache", "shift_attn", "rope_scaling", "infer_backend",
              "adapter_name_or_path", "export_*", "media_dir", "image_*", "video_*", "val_size",
              "quantization_type", "use_reentrant_gc", "max_grad_norm", "loraplus_*",
              "use_rslora", "neat_packing")


def _bits(fields, bits: Any, path) -> int:
    """``quantization_bit`` as autofit builds it: bitsandbytes' 4-bit NF4 or int8 base; another method (GPTQ, AWQ,
    HQQ, EETQ, ...) is named, planned as bitsandbytes of the same width."""
    method = str(fields.get("quantization_method", "the quantization library (bnb: bitsandbytes, the default)",
                            "bnb"))
    bits = as_int(bits, "quantization_bit")
    if bits not in (4, 8):
        raise InvalidInputError(f"{path or 'config'}: quantization_bit {bits}: autofit builds 4-bit (QLoRA, NF4) "
                                "and 8-bit (int8) bitsandbytes bases; set quantization_bit: 4 or 8")
    if method != "bnb":
        fields.skipped.append(("quantization_method", f"{method!r}: planned as bitsandbytes' {bits}-bit base"))
    fields.mark("double_quantization")
    if bits == 4 and method == "bnb" and fields.raw("double_quantization", True) is False:
        fields.skipped.append(("double_quantization", "false: an fp32 absmax per block of 64 (4.5 bits a "
                                                      "weight); planned double-quantized (4.13 bits a weight)"))
    return bits


def looks_like(data: Mapping[str, Any]) -> bool:
    return "model_name_or_path" in data and any(k in data for k in _MARKERS)


def read(data: Mapping[str, Any], path: Path | None = None) -> TrainConfig:
    fields = Fields(data, irrelevant=IRRELEVANT)
    name = fields.get("model_name_or_path", "the model")
    if not name:
        raise InvalidInputError(f"{path or 'config'}: no model_name_or_path")
    stage = fields.get("stage", "training stage (sft, pt, rm, dpo, kto, ppo)", "sft")
    if stage in ("dpo", "kto", "ppo"):
        fields.skipped.append(("stage", f"{stage!r}: a preference stage also runs a reference (or value) model; "
                                        "autofit plans the policy's step only"))
    kind = fields.get("finetuning_type", "lora, full, freeze or oft", "lora")
    if kind in ("freeze", "oft"):
        fields.skipped.append(("finetuning_type", f"{kind!r}: planned as a full fine-tune (every weight trained)"))
    values = read_trainer_keys(fields, path.parent if path else None,
                               checkpoint_default=False)
    if any(r.key == "gradient_checkpointing" for r in fields.readings):  # LLaMA-Factory decides by its own key
        fields.readings[:] = [r for r in fields.readings if r.key != "gradient_checkpointing"]
        fields.skipped.append(("gradient_checkpointing", "LLaMA-Factory recomputes unless "
                                                         "disable_gradient_checkpointing: true; this key is not read"))
    off = as_bool(fields.get("disable_gradient_checkpointing", "checkpointing off (LLaMA-Factory checkpoints every "
                                                             "layer by default)", False),
                  "disable_gradient_checkpointing")
    values["checkpointing"] = "none" if off else "full"
    pure = as_bool(fields.get("pure_bf16", "the model in bf16, no autocast", False), "pure_bf16")
    bits = fields.get("quantization_bit", "base weights quantized (4: QLoRA, 8: LoRA over int8 weights)")
    if bits is not None:
        bits = _bits(fields, bits, path)
    adapter = None
    if kind == "lora":
        rank = as_int(fields.get("lora_rank", "LoRA rank", 8), "lora_rank")
        target = str(fields.get("lora_target", "the modules LoRA adapts (all: every linear layer)", "all"))
        adapter = Adapter(rank=rank, alpha=float(fields.get("lora_alpha", "LoRA alpha (default rank x 2)", rank * 2)),
                          targets=("all-linear",) if target == "all" else tuple(t.strip() for t in target.split(",")),
                          dropout=float(fields.get("lora_dropout", "LoRA dropout", 0.0)),
                          quantized_bits=bits)
    elif bits:
        fields.skipped.append(("quantization_bit", "quantized weights without LoRA"))
    zero3 = values["sharding"] is not None and values["sharding"].zero_stage == 3
    if pure:
        values["precision"], dtype = "fp32", "bf16"
    elif adapter is not None or zero3:
        dtype = values["precision"] if values["precision"] != "fp32" else None  # loaded in the compute dtype
    else:
        dtype = "fp32"  # trainable parameters cast back to fp32 (cast_trainable_params_to_fp32)
    for key, why in (("use_unsloth", "Unsloth's kernels and its own checkpointing"),
                     ("use_unsloth_gc", "Unsloth's offloaded checkpointing"),
                     ("enable_liger_kernel", "Liger's fused kernels; the estimate errs high"),
                     ("use_galore", "GaLore's low-rank optimizer state"), ("use_apollo", "APOLLO's optimizer state"),
                     ("use_badam", "BAdam trains one block at a time"), ("use_adam_mini", "Adam-mini's state"),
                     ("upcast_layernorm", "layer norms kept in fp32"), ("use_dora", "DoRA's extra magnitude vectors"),
                     ("use_llama_pro", "LLaMA Pro's expanded blocks"), ("freeze_trainable_layers", "frozen layers"),
                     ("additional_target", "more trainable modules beside LoRA"),
                     ("mixture_of_depths", "mixture of depths"), ("fp8", "FP8 training")):
        fields.unmodelled(key, why)
    seq = as_int(fields.get("cutoff_len", "tokens per row", 2048), "cutoff_len")
    packing = fields.get("packing", "rows packed to cutoff_len (default: on for stage pt)")
    model, note = model_ref(str(name), path)
    return build(FRAMEWORK, path, fields, model=model, notes=(note,) if note else (), sequence_length=seq,
                 adapter=adapter, model_dtype=dtype, packing=bool(packing) if packing is not None else stage == "pt",
                 **values)


def changes(config: TrainConfig, knobs) -> dict[str, Any]:
    out = trainer_changes(config, knobs, checkpoint_key="disable_gradient_checkpointing", checkpoint_inverted=True)
    if knobs.stored == "bf16" and config.model_dtype != "bf16":
        out["pure_bf16"] = True
        out["bf16"] = False
    return out


