"""A layout dimension's part of each framework's export (Note [layout dimensions], autofit/parallel/dimension.py):
the frameworks, what a fragment reads of the plan, the fragment, and how fragments merge: plain values beside the
dimension's interface, which ``autofit/emit/export.py`` reads too."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["FRAMEWORKS", "ExportInputs", "ExportFragment", "merge_settings", "rank_count"]

# the frameworks a plan is exported to (autofit/emit/export.py): Hugging Face's TrainingArguments, DeepSpeed's config,
# Lightning's Trainer and strategies, Accelerate's config file, torchtitan's TOML
FRAMEWORKS = ("hf", "deepspeed", "lightning", "accelerate", "torchtitan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportInputs:
    """What a dimension's export fragment reads of a plan besides its layout, as plain values (this layer is below
    the ``Plan``): the precision's name ("fp32", "bf16", "fp16"), whether the plan recomputes any module, FSDP2's
    units (``Parallel.shard_units``, which ``Parallel.export`` puts in), the gradients' bytes per GPU at the peak, and
    the step's micro-batches (a pipeline's schedule runs them: torchtitan's ``pipeline_parallel_microbatch_size``)."""

    precision: str = "fp32"
    recomputes: bool = False
    shard_units: tuple[str, ...] = ()
    gradient_bytes: int = 0
    micro_batch_size: int = 1  # the rows of one micro-batch, of which a step runs accumulation_steps per data rank
    accumulation_steps: int = 1


@dataclasses.dataclass(frozen=True)
class ExportFragment:
    """A dimension's part of one framework's export (Note [layout dimensions]): ``settings`` in the export's own
    shape (a mapping merged into the export key by key, :func:`merge_settings`), ``notes`` saying how the framework
    runs the dimension or the nearest setting it has, and ``unexpressed``: what the framework cannot express of it
    (the export writes nothing for it)."""

    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    unexpressed: tuple[str, ...] = ()


def rank_count(count: int) -> str:
    """'1 rank', '8 ranks': a count of ranks in a layout's words."""
    return f"{count} rank{'s' if count != 1 else ''}"


def merge_settings(into: dict[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` merged into ``into``, in place: a mapping into the mapping under its key, key by key (made a new
    dict where there is none), any other value set; a key already there keeps its place, a new one comes last (the
    order the CLI prints)."""
    for key, value in settings.items():
        if isinstance(value, Mapping):
            if not isinstance(into.get(key), dict):
                into[key] = {}
            merge_settings(into[key], value)
        else:
            into[key] = value
    return into
