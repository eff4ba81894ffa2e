"""A :class:`~autofit.cli.configs.value.TrainConfig` mapped onto autofit's own calls: the model and sample it names
(:func:`model_spec`), ``autofit.plan`` for its effective batch (:func:`plan_config`) and ``autofit.estimate`` of
the step as written (:func:`check_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autofit.core.errors import InvalidInputError, UnsupportedModelError
from autofit.cli.configs.detect import read_config
from autofit.cli.configs.value import TrainConfig

__all__ = ["model_spec", "optimizer_for", "layout_for", "plan_config", "plan_precision", "check_config", "ConfigPlan",
           "ConfigCheck", "config_features"]


def _adapter_model(config: TrainConfig):
    """The model with its adapter, built by ``autofit.hf_model`` (LoRA over a 16-bit, int8 or NF4 base, on the meta
    device)."""
    import importlib

    # the public builder of LoRA / QLoRA models on the meta device, looked up by its public name when called: the
    # module that defines it is another part's choice, and autofit/__init__.py imports this one lazily
    builder = getattr(importlib.import_module("autofit"), "hf_model", None)
    if builder is None:
        raise UnsupportedModelError(
            f"{config.framework} config {config.path or ''}: its {config.adapter.kind.upper()} adapter (rank "
            f"{config.adapter.rank}) needs autofit.hf_model(name, lora=RANK, lora_targets=..., qlora=...), which "
            "this autofit lacks; plan the full model with the adapter keys removed, or update autofit")
    adapter = config.adapter
    # ("all-linear",): every linear layer but the output; none named: peft's default for the architecture
    targets = ("all-linear" if adapter.targets == ("all-linear",) else list(adapter.targets) if adapter.targets
               else None)
    return builder(config.hf_name, dtype=config.model_dtype or "auto", task="causal-lm",
                   lora=adapter.rank, lora_targets=targets, lora_alpha=adapter.alpha,
                   qlora=adapter.quantized_bits == 4, load_in_8bit=adapter.quantized_bits == 8)


def model_spec(config: TrainConfig):
    """The :class:`autofit.cli.specs.ModelSpec` of the config's model: ``sequence_length`` tokens per row, labels
    so that the model returns its loss, in the dtype the framework loads it in."""
    import torch

    from autofit.cli.hf_spec import DTYPES
    from autofit.cli.specs import SAMPLE_ROWS, ModelSpec, load_spec

    if config.adapter is not None:
        built = _adapter_model(config)
        model, sample = (built, None) if isinstance(built, torch.nn.Module) else (
            getattr(built, "model", None), getattr(built, "sample", None))
        if isinstance(built, tuple):
            model, sample = built[0], built[1]
        if sample is None:
            vocab = int(model.config.get_text_config().vocab_size)
            ids = torch.randint(0, vocab, (SAMPLE_ROWS, config.sequence_length))
            sample = {"input_ids": ids, "labels": ids.clone()}
        base = " over an int8 base" if config.adapter.quantized_bits == 8 else ""
        return ModelSpec(model, sample, None, f"{config.hf_name} + {config.adapter.kind} r={config.adapter.rank}"
                                              f"{base}, sequence {config.sequence_length}")
    # every reader names its model as hf:... (configs/models.py, model_ref): one path builds it, in the dtype the
    # framework loads it in (hf_spec.load_dtype, Note [the dtype a checkpoint loads in]), as the config asked
    dtype = DTYPES[config.model_dtype] if config.model_dtype else "auto"
    return load_spec(config.model, input_shapes=[(config.sequence_length,)], task="causal-lm", dtype=dtype)


def optimizer_for(config: TrainConfig) -> Any:
    """autofit's optimizer for the config's: a name, or bitsandbytes' 8-bit class (paged or not)."""
    if config.optimizer == "adafactor":
        import torch

        return torch.optim.Adafactor
    if config.optimizer_bits == 8:
        try:
            import bitsandbytes.optim as bnb
        except ImportError as e:
            raise InvalidInputError(f"the config's 8-bit optimizer needs bitsandbytes: pip install bitsandbytes "
                                    f"({e})") from e
        return bnb.PagedAdamW8bit if config.paged_optimizer else bnb.AdamW8bit
    return config.optimizer


def layout_for(config: TrainConfig) -> dict[str, Any]:
    """``Layout`` keywords: one process, or DDP / FSDP2 over the config's data ranks (DeepSpeed's ZeRO-3 as FSDP2
    resharding after forward, ZeRO-2 as FSDP2 without; ZeRO-0/1 as DDP)."""
    if config.data_ranks == 1:
        return {"world_size": 1}
    s = config.sharding
    if not _shards(config):
        return {"world_size": config.data_ranks, "strategy": "ddp"}
    return {"world_size": config.data_ranks, "strategy": "fsdp2",
            "reshard_after_forward": s.zero_stage != 2 if s.reshard_after_forward is None else s.reshard_after_forward}


def _shards(config: TrainConfig) -> bool:
    return config.sharding is not None and config.sharding.shards_states


@dataclass(frozen=True)
class ConfigPlan:
    config: TrainConfig
    plan: Any  # autofit.Plan
    changes: dict[str, Any]
    notes: tuple[str, ...]


def plan_config(path: str | Path, budget: int | str, *, gpu: Any = None, data_ranks: int | None = None,
                allow: tuple[str, ...] = (), write: str | Path | None = None, **plan_options: Any) -> ConfigPlan:
    """``autofit.plan`` of the config at ``path`` for its own effective batch, model, precision and optimizer;
    the keys the plan changes (``changes``) and, with ``write``, the config written back with them."""
    from autofit.cli.configs.writeback import knobs_of, plan_changes, write_config
    from autofit.options import Device, Layout, Precision, Savers
    from autofit.planner import plan

    config = read_config(path, data_ranks=data_ranks)
    spec = model_spec(config)
    result = plan(spec.model, spec.sample, budget, batch_size=config.effective_batch, target=spec.target,
                  loss_fn=spec.loss_fn, optimizer=optimizer_for(config), clip_grad_norm=config.clip_grad_norm,
                  device=Device(kind="cuda", gpu=gpu), precision=Precision(compute=plan_precision(config)),
                  savers=Savers(allow=tuple(allow), **config_features(config)), layout=Layout(**layout_for(config)),
                  **plan_options)
    knobs = knobs_of(result, config)
    changes = plan_changes(config, knobs)
    if write is not None:
        write_config(config.path, changes, Path(write))
    return ConfigPlan(config, result, changes, knobs.notes)


def config_features(config: TrainConfig) -> dict[str, Any]:
    """The step features the config turns on itself, as the options of ``autofit.Step`` / ``Savers`` of their names
    take them (Note [carried features]): torchtitan's float8 converter as an ``autofit.features.float8.Float8``."""
    if config.float8 is None:
        return {}
    from autofit.features.float8 import Float8

    recipe, skip, all_gather = config.float8
    return {"float8": Float8(recipe=recipe, skip=skip, all_gather=all_gather)}


def plan_precision(config: TrainConfig) -> str:
    """The config's autocast dtype, or "auto" when it states none; a model loaded in 16 bits without autocast
    keeps computing in its own dtype ("fp32": no autocast)."""
    if config.precision != "fp32":
        return config.precision
    return "fp32" if config.model_dtype in ("bf16", "fp16") else "auto"


@dataclass(frozen=True)
class ConfigCheck:
    config: TrainConfig
    estimate: Any  # autofit.MemoryEstimate
    gpu: str
    capacity_bytes: int

    @property
    def fits(self) -> bool:
        return self.estimate.device_bytes <= self.capacity_bytes


def check_config(path: str | Path, gpu: Any, *, data_ranks: int | None = None) -> ConfigCheck:
    """The step the config at ``path`` describes, as written (micro-batch, accumulation, precision, recomputation,
    optimizer, layout), estimated on ``gpu``: fits when its memory on the device is within the card's."""
    from autofit.api import estimate
    from autofit.cuda.catalog import gpu_spec
    from autofit.options import Device, Layout, Step
    from autofit.parallel.choices import shard_units

    config = read_config(path, data_ranks=data_ranks)
    card = gpu_spec(gpu)
    spec = model_spec(config)
    checkpoint = None
    if config.checkpointing != "none":
        units = shard_units(spec.model)
        if not units:
            raise UnsupportedModelError(f"{config.hf_name}: no repeated blocks to recompute as the config asks")
        checkpoint = {u: config.checkpointing for u in units}
    layout = layout_for(config)
    # parameters, gradients and optimizer state on the host (FSDP2's CPUOffloadPolicy; DeepSpeed's offload as the
    # same), where the layout can hold them: one process, or FSDP2
    offload = config.sharding is not None and config.sharding.offload and (config.data_ranks == 1 or _shards(config))
    est = estimate(spec.model, spec.sample, target=spec.target, loss_fn=spec.loss_fn,
                   optimizer=optimizer_for(config),
                   precision=config.precision,
                   device=Device(kind="cuda", gpu=card.name), layout=Layout(**layout),
                   step=Step(micro_batch_size=config.micro_batch_size, clip_grad_norm=config.clip_grad_norm,
                             accumulation_steps=config.accumulation_steps, checkpoint=checkpoint,
                             optimizer_in_backward=config.optimizer_in_backward, offload_states=offload,
                             **config_features(config)))
    return ConfigCheck(config, est, card.name, card.memory_bytes)
