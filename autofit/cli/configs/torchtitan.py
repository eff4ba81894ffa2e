"""torchtitan TOML (``torchrun ... -m torchtitan.train --job.config_file FILE``): its
torchtitan/models/*/train_configs/*.toml files.

torchtitan replaced its TOML job files by Python config registries in February 2026 (pytorch/torchtitan#2386); the
TOML format read here is ``JobConfig`` of ``torchtitan/config/job_config.py`` at 238fa99 (2026-02-23), the last
version with it, whose fields autofit's torchtitan export writes too (autofit/emit/export.py):
- ``[model]``: ``name`` (llama3, qwen3, ...), ``flavor`` (8B, 0.6B), ``hf_assets_path`` (the Hugging Face
  folder of the tokenizer and config: its name identifies the checkpoint).
- ``[training]``: ``local_batch_size`` (default 8) rows per device, ``global_batch_size`` (-1: local x data ranks;
  larger: the accumulation is global / (local x data ranks)), ``seq_len`` (2048), ``mixed_precision_param``
  (bfloat16: FSDP2's MixedPrecisionPolicy computes in bf16 over fp32 parameters), ``enable_cpu_offload``
  (FSDP2's CPUOffloadPolicy), ``max_norm`` (1.0: clipping).
- ``[parallelism]``: ``data_parallel_replicate_degree`` (1), ``data_parallel_shard_degree`` (-1: every rank
  left), ``fsdp_reshard_after_forward`` (default / always / never), ``tensor_parallel_degree``,
  ``pipeline_parallel_degree``, ``context_parallel_degree``, ``expert_parallel_degree``.
- ``[activation_checkpoint]``: ``mode`` (selective, the default; full; none; memory_budget) and
  ``selective_ac_option`` ("op": torchtitan's per-op policy, its attention and every other matmul saved, autofit's
  "op-selective"; an int N: every N-th layer recomputed whole).
- ``[optimizer]``: ``name`` (AdamW, Adam); ``[compile]`` ``enable``; ``[quantize.linear.float8]`` /
  ``[model] converters`` (Float8).
torchtitan trains the whole model (no LoRA); with one rank its FSDP is still applied (a shard degree of 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from autofit.core.errors import InvalidInputError
from autofit.cli.configs.models import model_ref
from autofit.cli.configs.value import Fields, Sharding, TrainConfig, as_bool, as_int, build

__all__ = ["read", "looks_like", "changes", "with_ranks", "FRAMEWORK"]

FRAMEWORK = "torchtitan"
IRRELEVANT = ("job.*", "profiling.*", "metrics.*", "checkpoint.*", "validation.*", "lr_scheduler.*", "optimizer.lr",
              "optimizer.eps", "optimizer.weight_decay", "optimizer.implementation", "training.steps",
              "training.dataset", "training.dataset_path", "training.seed",
              "training.mixed_precision_reduce", "model.tokenizer_path", "comm.*", "experimental.*",
              "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "float8.precompute_float8_dynamic_"
              "scale_for_fsdp", "compile.components",
              "fault_tolerance.*", "memory_estimation.*", "debug.*", "model.norm_type")


def looks_like(data: Mapping[str, Any]) -> bool:
    return isinstance(data.get("training"), Mapping) and isinstance(data.get("model"), Mapping) and (
        "flavor" in data["model"] or "local_batch_size" in data["training"] or "parallelism" in data)


def read(data: Mapping[str, Any], path: Path | None = None) -> TrainConfig:
    fields = Fields(data, irrelevant=IRRELEVANT)
    family = fields.get("model.name", "the model family")
    flavor = fields.get("model.flavor", "the model size")
    assets = fields.get("model.hf_assets_path", "the Hugging Face folder: its name identifies the checkpoint")
    if not assets:
        raise InvalidInputError(f"{path or 'config'}: [model] hf_assets_path names no Hugging Face folder, from "
                                f"which autofit reads the model ({family} {flavor})")
    local = as_int(fields.get("training.local_batch_size", "rows per device and micro-batch", 8),
                   "local_batch_size")
    replicate = as_int(fields.get("parallelism.data_parallel_replicate_degree", "HSDP replicas", 1),
                       "data_parallel_replicate_degree")
    shard = as_int(fields.get("parallelism.data_parallel_shard_degree", "FSDP shard ranks (-1: every rank left)",
                              -1), "data_parallel_shard_degree")
    stated = shard > 0
    ranks = replicate * (shard if stated else 1)
    global_batch = as_int(fields.get("training.global_batch_size", "samples per step (-1: local x data ranks)", -1),
                          "global_batch_size")
    accum = 1
    if global_batch > 0:
        if global_batch % (local * ranks):
            raise InvalidInputError(f"{path or 'config'}: global_batch_size {global_batch} is not a multiple of "
                                    f"local_batch_size {local} x {ranks} data ranks")
        accum = global_batch // (local * ranks)
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                "expert_parallel_degree"):
        degree = fields.get(f"parallelism.{key}", f"{key.replace('_', ' ')}", 1)
        if int(degree) != 1:
            fields.skipped.append((f"parallelism.{key}", f"{degree}: not read from the config; plan it with "
                                                         "autofit's own flags (--tensor-parallel)"))
    raf = fields.get("parallelism.fsdp_reshard_after_forward", "FSDP2: reshard after forward (default: every "
                                                                "block but the last)", "default")
    offload = as_bool(fields.get("training.enable_cpu_offload", "parameters, gradients and optimizer state on "
                                                                "the host", False), "enable_cpu_offload")
    mixed = fields.get("training.mixed_precision_param", "FSDP2 computes in this dtype over fp32 parameters",
                       "bfloat16")
    mode = fields.get("activation_checkpoint.mode", "recompute: selective (default), full or none", "selective")
    option = str(fields.get("activation_checkpoint.selective_ac_option", "op: keep attention and every other "
                                                                          "matmul; N: every N-th layer", "2"))
    if mode == "selective" and option != "op":
        fields.skipped.append(("activation_checkpoint.selective_ac_option",
                               f"{option!r}: every {option}-th layer recomputed; planned as every layer"))
    checkpointing = {"none": "none", "full": "full", "selective": "op-selective" if option == "op" else "full"}.get(
        mode)
    if checkpointing is None:
        fields.skipped.append(("activation_checkpoint.mode", f"{mode!r}: planned without recomputation"))
        checkpointing = "none"
    optimizer = str(fields.get("optimizer.name", "the optimizer", "AdamW")).lower()
    if optimizer not in ("adamw", "adam", "sgd"):
        fields.skipped.append(("optimizer.name", f"{optimizer!r}: not mapped; planned as AdamW"))
        optimizer = "adamw"
    fields.unmodelled("compile.enable", "torch.compile: autofit plans it with --compile")
    float8 = _float8(fields)
    seq = as_int(fields.get("training.seq_len", "tokens per row", 2048), "seq_len")
    clip = fields.get("training.max_norm", "clip the gradients' norm", 1.0)
    model, note = model_ref(str(assets).rstrip("/"), path)
    return build(FRAMEWORK, path, fields, model=model, notes=(note,) if note else (), sequence_length=seq,
                 micro_batch_size=local, accumulation_steps=accum, data_ranks=ranks, data_ranks_stated=stated,
                 precision="bf16" if mixed == "bfloat16" else "fp32", model_dtype="fp32",
                 checkpointing=checkpointing, optimizer=optimizer, clip_grad_norm=float(clip) if clip else None,
                 float8=float8,
                 sharding=Sharding(zero_stage=2 if raf == "never" else 3,
                                   reshard_after_forward=raf != "never", offload=offload))


# torchtitan's float8 converter: [model] converters names it ("quantize.linear.float8", "float8" before mid-2025) and
# its section holds the recipe (None: torchao's default, tensorwise), the module names left in high precision
# (substrings of torchtitan's own names; "output" is its head, which autofit always leaves) and the all-gather
_FLOAT8_CONVERTERS = ("quantize.linear.float8", "float8")
_TITAN_HEAD = "output"


def _float8(fields: Fields) -> tuple[str, tuple[str, ...], bool] | None:
    """The float8 training the config turns on, as (recipe, skip, all_gather) (TrainConfig.float8), or None."""
    converters = fields.get("model.converters", "model converters applied before parallelize", []) or []
    section = next((s for s in _FLOAT8_CONVERTERS if s in converters), None)
    for other in (c for c in converters if c not in _FLOAT8_CONVERTERS):
        fields.skipped.append(("model.converters", f"{other!r}: not modelled (autofit plans Float8 only)"))
    for key in ("recipe_name", "filter_fqns", "enable_fsdp_float8_all_gather"):
        fields.mark(f"quantize.linear.float8.{key}", f"float8.{key}")
    if section is None:  # a section without its converter changes nothing in torchtitan
        return None
    recipe = fields.get(f"{section}.recipe_name", "Float8 recipe (none: tensorwise)", None) or "tensorwise"
    skip = fields.get(f"{section}.filter_fqns", "linears left in high precision (name substrings)", []) or []
    all_gather = as_bool(fields.get(f"{section}.enable_fsdp_float8_all_gather", "FSDP2 gathers weights in float8",
                                    False), "enable_fsdp_float8_all_gather")
    return str(recipe), tuple(str(s) for s in skip if s != _TITAN_HEAD), all_gather


def with_ranks(config: TrainConfig, ranks: int) -> TrainConfig:
    """The config launched on ``ranks`` data ranks: a stated global batch stays, so the accumulation is global /
    (local x ranks); without one (-1) every rank adds its rows."""
    import dataclasses

    stated = next((int(r.value) for r in config.readings if r.key == "training.global_batch_size"), -1)
    accum = config.accumulation_steps
    if stated > 0:
        if stated % (config.micro_batch_size * ranks):
            raise InvalidInputError(f"global_batch_size {stated} is not a multiple of local_batch_size "
                                    f"{config.micro_batch_size} x {ranks} data ranks")
        accum = stated // (config.micro_batch_size * ranks)
    return dataclasses.replace(config, data_ranks=ranks, data_ranks_stated=True, accumulation_steps=accum)


def changes(config: TrainConfig, knobs) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if knobs.micro_batch_size != config.micro_batch_size:
        out["training.local_batch_size"] = knobs.micro_batch_size
    stated = any(r.key == "training.global_batch_size" and int(r.value) > 0 for r in config.readings)
    if knobs.accumulation_steps > 1 and not stated:
        # torchtitan derives the accumulation from the global batch (the effective batch, which the plan keeps):
        # a file that left it at -1 (no accumulation) states it now
        out["training.global_batch_size"] = knobs.micro_batch_size * knobs.accumulation_steps * knobs.data_ranks
    if knobs.precision != config.precision:
        out["training.mixed_precision_param"] = "bfloat16" if knobs.precision == "bf16" else "float32"
    # torchtitan's one op-level mode stands for both selective policies (the plan's "selective" keeps more)
    plan_mode = ("op-selective" if knobs.selective else "full") if knobs.checkpointing else "none"
    if plan_mode != config.checkpointing:
        out["activation_checkpoint.mode"] = "selective" if plan_mode == "op-selective" else plan_mode
        if plan_mode == "op-selective":
            out["activation_checkpoint.selective_ac_option"] = "op"
    if knobs.fsdp is not None:
        if knobs.fsdp.offload != config.sharding.offload:
            out["training.enable_cpu_offload"] = knobs.fsdp.offload
        if knobs.fsdp.reshard_after_forward != config.sharding.reshard_after_forward:
            out["parallelism.fsdp_reshard_after_forward"] = "always" if knobs.fsdp.reshard_after_forward else "never"
    return out
