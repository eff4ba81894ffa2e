"""The typed value a training config is read into (:class:`TrainConfig`), and :class:`Fields`, the reader that
records every key it reads and names the memory-relevant keys it does not understand (Note [every key accounted]).

Note [every key accounted]
    A config read for a memory plan must not drop what changes memory. Each key of the file ends in one of three
    lists: ``readings`` (read, with what it means: it decides the plan), ``unmodelled`` (known to change memory, but
    not modelled by autofit, with why: activation offloading, FP8, Liger kernels, ...) or ``unknown`` (a key the
    reader does not know at all: it may change memory, and the output names it). Keys known to leave the memory of
    a step alone (datasets, logging, learning rates, output folders) are set aside by each framework's list
    ``IRRELEVANT`` and a few shared patterns; every other key is named, never silently dropped.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autofit.core.errors import InvalidInputError, require_int

__all__ = ["Reading", "Adapter", "Sharding", "TrainConfig", "Fields", "PRECISIONS", "CHECKPOINTING", "as_bool", "as_int",
           "build"]

PRECISIONS = ("fp32", "bf16", "fp16")
CHECKPOINTING = ("none", "full", "selective", "op-selective")

# keys no framework's step memory depends on (shared by every reader; each adds its own IRRELEVANT)
_COMMON_IRRELEVANT = (
    "*learning_rate*", "lr", "lr_*", "*_lr", "warmup*", "*scheduler*", "weight_decay", "adam_beta*", "adam_epsilon",
    "eps", "betas", "seed", "data_seed", "output_dir", "*logging*", "log_*", "*_log*", "report_to", "run_name",
    "wandb*", "mlflow*", "comet*", "swanlab*", "hub_*", "push_to_hub", "save_*", "*_save*", "eval_*",
    "*evaluation*", "evals_per_epoch", "per_device_eval_batch_size", "num_train_epochs", "num_epochs", "epochs",
    "max_steps", "max_steps_per_epoch", "steps", "resume_from_checkpoint", "overwrite_output_dir", "do_train",
    "do_eval", "do_predict", "dataset*", "datasets", "*dataloader*", "preprocessing_num_workers", "max_samples",
    "val_set_size", "val_size", "template", "tokenizer*", "special_tokens", "shuffle", "plot_loss", "ddp_timeout",
    "trust_remote_code", "strict", "description", "print_args", "max_grad_norm_*", "label_smoothing*", "*_workers",
    "local_rank", "remove_unused_columns", "group_by_length", "train_on_inputs", "chat_template*", "*_token_id",
    "max_norm_*", "profil*", "metric*", "model_revision", "revision", "cache_dir", "hf_hub_token", "debug",
)


@dataclass(frozen=True, kw_only=True)
class Reading:
    """One key read from the file: its dotted path as written, its value, and what autofit takes it to mean."""

    key: str
    value: Any
    meaning: str


@dataclass(frozen=True, kw_only=True)
class Adapter:
    """A LoRA adapter over frozen base weights; ``quantized_bits`` 4 for QLoRA (bitsandbytes nf4 base), 8 for LoRA
    over int8 weights, None for unquantized ones. ``targets``: module names, or ("all-linear",)."""

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] = ()
    dropout: float = 0.0
    quantized_bits: int | None = None

    def __post_init__(self) -> None:
        require_int("adapter.rank", self.rank)
        if self.quantized_bits not in (None, 4, 8):
            raise InvalidInputError(f"adapter.quantized_bits must be 4, 8 or None, got {self.quantized_bits!r}")

    @property
    def kind(self) -> str:
        return "qlora" if self.quantized_bits == 4 else "lora"


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """The data-parallel sharding the config names: FSDP, or DeepSpeed's ZeRO (``deepspeed``); ``zero_stage``
    (DeepSpeed's 0-3, FSDP full shard is 3, shard-grad-op 2); ``reshard_after_forward`` where stated; ``offload``:
    parameters and optimizer state on the host."""

    deepspeed: bool = False
    zero_stage: int | None = None
    reshard_after_forward: bool | None = None
    offload: bool = False

    def __post_init__(self) -> None:
        if self.zero_stage not in (None, 0, 1, 2, 3):
            raise InvalidInputError(f"sharding.zero_stage must be 0 to 3, got {self.zero_stage!r}")

    @property
    def shards_states(self) -> bool:
        """Whether parameters, gradients and optimizer state are split over the ranks (FSDP, ZeRO-2 and -3; ZeRO-1
        splits the optimizer state only, planned as replicated)."""
        return not self.deepspeed or (self.zero_stage or 0) >= 2


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What a framework's training config says about the memory of its step, read from the framework's own keys.

    ``model`` is ``hf:NAME`` (a checkpoint of the offline table, or a name hf: resolves) or ``hf:DIR`` (a local
    directory with ``config.json``). ``precision`` is the autocast (mixed-precision) compute dtype; ``model_dtype``
    the dtype the weights are loaded in, when the config states it (None: the loader's default). The effective
    batch is ``micro_batch_size x accumulation_steps x data_ranks``; ``data_ranks`` is 1 unless the config states
    the ranks (``data_ranks_stated``) or the caller gives them."""

    framework: str
    path: Path | None = None
    model: str
    sequence_length: int
    micro_batch_size: int
    accumulation_steps: int = 1
    data_ranks: int = 1
    data_ranks_stated: bool = False
    adapter: Adapter | None = None
    precision: str = "fp32"
    model_dtype: str | None = None
    checkpointing: str = "none"
    optimizer: str = "adamw"
    optimizer_bits: int = 32
    paged_optimizer: bool = False
    optimizer_in_backward: bool = False
    packing: bool = False
    sharding: Sharding | None = None
    clip_grad_norm: float | None = None
    # float8 training of the linear layers, as (torchao recipe, module-name substrings left in high precision, FSDP2's
    # float8 all-gather), the feature "float8"'s value (autofit/features/float8.py) spelled without torch; None: off
    float8: tuple[str, tuple[str, ...], bool] | None = None
    readings: tuple[Reading, ...] = ()
    unmodelled: tuple[tuple[str, str], ...] = ()  # (key, why it is not modelled)
    unknown: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("sequence_length", "micro_batch_size", "accumulation_steps", "data_ranks"):
            require_int(f"{self.framework} config: {name}", getattr(self, name))
        if self.precision not in PRECISIONS:
            raise InvalidInputError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.model_dtype not in (None, *PRECISIONS):
            raise InvalidInputError(f"model_dtype must be one of {', '.join(PRECISIONS)} or None, got "
                                    f"{self.model_dtype!r}")
        if self.checkpointing not in CHECKPOINTING:
            raise InvalidInputError(f"checkpointing must be one of {', '.join(CHECKPOINTING)}, got "
                                    f"{self.checkpointing!r}")
        if self.optimizer_bits not in (8, 32):
            raise InvalidInputError(f"optimizer_bits must be 8 or 32, got {self.optimizer_bits!r}")

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step over all data ranks: micro-batch x accumulation x data ranks."""
        return self.micro_batch_size * self.accumulation_steps * self.data_ranks

    @property
    def hf_name(self) -> str:
        """The model's name or directory, without the ``hf:`` prefix."""
        return self.model.split(":", 1)[1]

    def lines(self) -> list[str]:
        """What was read, one line each, then what is not modelled and what is unknown (named, never dropped)."""
        out = [f"{r.key} = {_short(r.value)}: {r.meaning}" for r in self.readings]
        out += [f"not modelled: {key} ({why})" for key, why in self.unmodelled]
        out += [f"unknown key (may change memory, not read): {key}" for key in self.unknown]
        return out + [f"note: {n}" for n in self.notes]


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


_MISSING = object()


@dataclass
class Fields:
    """A config mapping read key by key: :meth:`get` records the reading, :meth:`unmodelled` names a key known to
    change memory that autofit does not model, and :meth:`leftover` names what is neither read nor set aside
    (Note [every key accounted]). Nested keys are dotted paths ("fsdp_config.offload_params")."""

    data: Mapping[str, Any]
    irrelevant: tuple[str, ...] = ()
    readings: list[Reading] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def raw(self, key: str, default: Any = None) -> Any:
        node: Any = self.data
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node

    def has(self, key: str) -> bool:
        return self.raw(key, _MISSING) is not _MISSING

    def get(self, key: str, meaning: str, default: Any = None) -> Any:
        """The value at ``key`` (``default`` when absent or null); a present key is recorded with ``meaning``."""
        value = self.raw(key, _MISSING)
        self.seen.add(key)
        if value is _MISSING or value is None:
            return default
        self.readings.append(Reading(key=key, value=value, meaning=meaning))
        return value

    def mark(self, *keys: str) -> None:
        """Keys looked at whose value changes nothing here (a default restated, a mapping read key by key)."""
        self.seen.update(keys)

    def unmodelled(self, key: str, why: str, *, when: Any = True) -> None:
        """Name ``key`` as memory-relevant and not modelled, when present and truthy (``when``)."""
        value = self.raw(key, _MISSING)
        self.seen.add(key)
        if value is not _MISSING and value not in (None, False, "", "none", 0) and when:
            self.skipped.append((key, f"{_short(value)}: {why}"))

    def leftover(self) -> tuple[str, ...]:
        """Keys (dotted) neither read nor set aside; a mapping counts as seen when any key under it was."""
        patterns = (*_COMMON_IRRELEVANT, *self.irrelevant)
        out: list[str] = []
        for key in _leaves(self.data):
            if any(key == s or key.startswith(s + ".") for s in self.seen):
                continue
            parts = key.split(".")
            names = {key, parts[-1], *(".".join(parts[:i]) for i in range(1, len(parts)))}
            if any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns):
                continue
            out.append(key)
        return tuple(out)


def _leaves(data: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path


def as_bool(value: Any, key: str) -> bool:
    """A YAML/TOML boolean, or the strings frameworks accept for one ("true", "auto" is not one)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise InvalidInputError(f"{key}: expected true or false, got {value!r}")


def as_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidInputError(f"{key}: expected an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise InvalidInputError(f"{key}: expected an integer, got {value!r}") from None


def build(framework: str, path: Path | None, fields: Fields, **values: Any) -> TrainConfig:
    """The TrainConfig of ``values``, with the readings, unmodelled keys and unknown keys ``fields`` gathered."""
    return TrainConfig(framework=framework, path=path, readings=tuple(fields.readings),
                       unmodelled=tuple(fields.skipped), unknown=fields.leftover(), **values)
