"""Config out: the same file with only what the plan changes (Note [written back]).

Note [written back]
    The file is loaded again in a round-trip form (ruamel.yaml for YAML, tomlkit for TOML, which keep comments,
    order and quoting; JSON keeps order, and has no comments), the framework's ``changes`` name the keys the plan
    changes (dotted paths, only where the plan's value differs from the one read), those are set, and the document
    is dumped. Nothing else is touched: every other key, and its comments, stays as written. The plan is made for
    the config's effective batch and data ranks, so micro-batch x accumulation x data ranks is unchanged; a plan
    whose split no framework can express (a shorter last micro-batch) is written as its verified even split
    (autofit/emit/export.py), or refused when it has none.
"""

from __future__ import annotations

import io
import re
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autofit.core.errors import InvalidInputError
from autofit.cli.configs.detect import FORMATS, reader
from autofit.cli.configs.value import TrainConfig
from autofit.features import FURTHER

__all__ = ["FsdpKnobs", "PlanKnobs", "knobs_of", "plan_changes", "write_config", "render"]


@dataclass(frozen=True)
class FsdpKnobs:
    reshard_after_forward: bool
    offload: bool


@dataclass(frozen=True, kw_only=True)
class PlanKnobs:
    """What of a plan a framework's config can hold: the split, precision, recomputation, optimizer, sharding."""

    micro_batch_size: int
    accumulation_steps: int
    data_ranks: int
    precision: str  # the autocast dtype: fp32 (none), bf16, fp16
    stored: str | None  # the stored precision when lowered (bf16: pure bf16)
    checkpointing: bool
    selective: bool = False
    eight_bit_optimizer: bool = False
    optimizer_in_backward: bool = False
    fsdp: FsdpKnobs | None = None
    # the dotted keys the plan's step features set in the config's own framework (Feature.export_sections: torchtitan's
    # float8 converter and its section), written beside the framework's changes
    sections: tuple[tuple[str, Any], ...] = ()
    notes: tuple[str, ...] = ()


def knobs_of(plan, config: TrainConfig | None = None) -> PlanKnobs:
    """The knobs of an :class:`autofit.Plan` a config can hold, and notes on what it cannot; ``config``, the config
    written back, says which step features it turns on itself (torchtitan's float8 converter)."""
    if plan.last_micro_batch_size != plan.micro_batch_size and plan.even_split is None:
        raise InvalidInputError(f"the plan's last micro-batch has {plan.last_micro_batch_size} rows, which no "
                                "framework config can express, and it has no even split that fits: train with "
                                "plan.wrap(), or choose an effective batch the micro-batch divides")
    micro, steps = plan.even_split or (plan.micro_batch_size, plan.gradient_accumulation_steps)
    notes = []
    if plan.checkpoint:
        notes.append(f"the plan recomputes {len(plan.checkpoint)} modules; the framework's switch recomputes every "
                     "layer (less memory, more time than the plan)")
    if plan.offload:
        notes.append(f"the plan keeps {len(plan.offload)} modules' activations on the host, which these configs "
                     "cannot say: train with plan.wrap() for that")
    if plan.low_bit_optimizer:
        notes.append(f"the plan steps {plan.low_bit_optimizer}")
    # step features no framework key carries: the launch must add them, or the step holds more than planned
    if plan.alloc_conf:
        notes.append(f"the plan needs PYTORCH_CUDA_ALLOC_CONF={plan.alloc_conf} in the launch's environment")
    if plan.preallocated_grads:
        notes.append("the plan allocates every gradient before the first forward (zero_grad(set_to_none=False)); "
                     "the framework's loop frees them: check the written config with autofit check")
    if plan.chunked_loss is not None:
        notes.append("the plan computes the loss in chunks (--allow chunked-loss), which the config cannot say: "
                     "train with plan.wrap(), or use the framework's chunked loss")
    sections: dict[str, Any] = {}
    for feature in FURTHER:  # the features registered after the first ones (Note [carried features]), where the
        if getattr(config, feature.field, None) is not None:  # config does not turn them on itself
            continue
        written, written_notes = feature.export_sections(plan, config.framework) if config is not None else ({}, ())
        if written:  # the framework has keys for it: written back (a list the config has already is extended)
            sections.update(_dotted(written, config))
            notes += written_notes
        else:
            notes += feature.export_notes(plan, "the config")
    shards = plan.parallel.shards_parameters
    fsdp = FsdpKnobs(plan.parallel.reshard_after_forward is not False, plan.parallel.offload_states) if shards or \
        plan.parallel.offload_states else None
    return PlanKnobs(micro_batch_size=micro, accumulation_steps=steps,
                     data_ranks=plan.parallel.data_ranks, precision=plan.precision.name,
                     stored=None if plan.precision.stored in (None, "fp32") else plan.precision.stored,
                     checkpointing=bool(plan.checkpoint),
                     selective=bool(plan.selective or plan.op_selective),
                     eight_bit_optimizer=plan.low_bit_optimizer is not None,
                     optimizer_in_backward=plan.optimizer_in_backward, fsdp=fsdp, sections=tuple(sections.items()),
                     notes=tuple(notes))


def _dotted(sections: dict[str, dict[str, Any]], config: TrainConfig) -> dict[str, Any]:
    """``sections`` (an export's: {"model": {"converters": [...]}}) as the config's dotted keys, a list extending
    the one the config holds under that key (its other converters stay)."""
    held = {r.key: r.value for r in config.readings}
    out = {}
    for section, values in sections.items():
        for key, value in values.items():
            dotted = f"{section}.{key}"
            old = held.get(dotted)
            out[dotted] = list(dict.fromkeys([*old, *value])) if isinstance(old, list) and isinstance(value, list) \
                else value
    return out


def plan_changes(config: TrainConfig, knobs: PlanKnobs) -> dict[str, Any]:
    """The dotted keys of ``config``'s file that ``knobs`` change, with their new values."""
    if knobs.micro_batch_size * knobs.accumulation_steps * knobs.data_ranks != config.effective_batch:
        raise InvalidInputError(
            f"the plan's batch {knobs.micro_batch_size} x {knobs.accumulation_steps} x {knobs.data_ranks} is not "
            f"the config's effective batch {config.effective_batch}: plan with the config's batch and ranks")
    return {**reader(config.framework).changes(config, knobs), **dict(knobs.sections)}


def _set(doc: Any, key: str, value: Any, make) -> None:
    parts = key.split(".")
    node = doc
    for part in parts[:-1]:
        if part not in node or node[part] is None:
            node[part] = make()
        node = node[part]
    node[parts[-1]] = value


def render(path: Path, changes: dict[str, Any]) -> str:
    """The text of ``path`` with ``changes`` set (Note [written back])."""
    path = Path(path)
    fmt = FORMATS[path.suffix.lower()]
    text = path.read_text()
    if fmt == "json":
        doc = json.loads(text)
        for key, value in changes.items():
            _set(doc, key, value, dict)
        return json.dumps(doc, indent=2) + "\n"
    if fmt == "toml":
        tomlkit = _need("tomlkit")
        doc = tomlkit.parse(text)
        for key, value in changes.items():
            _set(doc, key, value, tomlkit.table)
        return tomlkit.dumps(doc)
    ruamel = _need("ruamel.yaml")
    yaml = ruamel.YAML()  # round trip: comments, order and quoting kept
    yaml.preserve_quotes = True
    yaml.width = 4096  # long lines stay as written
    dash = re.search(r"^( +)- ", text, re.M)  # block sequences indented under their key, as written
    if dash:
        yaml.indent(mapping=2, sequence=len(dash.group(1)) + 2, offset=len(dash.group(1)))
    doc = yaml.load(text)
    for key, value in changes.items():
        _set(doc, key, value, ruamel.comments.CommentedMap)
    out = io.StringIO()
    yaml.dump(doc, out)
    return out.getvalue()


def write_config(path: Path, changes: dict[str, Any], dest: Path) -> Path:
    """Write ``path`` with ``changes`` to ``dest`` (same format; ``dest`` may be ``path``)."""
    dest = Path(dest)
    if FORMATS.get(dest.suffix.lower()) != FORMATS.get(Path(path).suffix.lower()):
        raise InvalidInputError(f"--write {dest}: write the config back in its own format "
                                f"({Path(path).suffix})")
    text = render(path, changes)
    try:
        dest.write_text(text)
    except OSError as e:
        raise InvalidInputError(f"--write {dest}: {e.strerror or e}") from e
    return dest


def _need(module: str):
    import importlib

    try:
        mod = importlib.import_module(module)
        if module == "ruamel.yaml":
            import ruamel.yaml.comments  # noqa: F401
        return mod
    except ImportError as e:
        raise InvalidInputError(f"writing the config back keeps its comments with {module}: pip install "
                                "'torch-autofit[configs]'") from e
