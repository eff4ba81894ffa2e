"""``autofit models``: the checkpoints ``hf:NAME`` plans offline, with the parameter count of the model ``hf:`` builds
for each (the checkpoint's own head, on the meta device: nothing is downloaded or allocated). :func:`model_rows` is the
data, :func:`models_table` its rendering."""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from autofit.cli.hf_checkpoints import TABLE, Checkpoint
from autofit.cli.hf_spec import model_from_config, offline_config

__all__ = ["ModelRow", "model_rows", "models_table"]


@dataclass(frozen=True, kw_only=True)
class ModelRow:
    name: str
    family: str
    model_class: str  # what hf:NAME builds, e.g. Qwen2ForCausalLM
    parameters: int  # unique parameters: tied embeddings count once
    aliases: tuple[str, ...]


def _matches(entry: Checkpoint, match: str) -> bool:
    wanted = match.lower()
    return any(wanted in text.lower() for text in (entry.name, entry.family, *entry.aliases))


def _row(entry: Checkpoint) -> ModelRow:
    model, _ = model_from_config(offline_config(entry.name), name=entry.name)
    return ModelRow(name=entry.name, family=entry.family, model_class=type(model).__name__,
                    parameters=sum(p.numel() for p in model.parameters()), aliases=entry.aliases)


def model_rows(match: str | None = None) -> tuple[ModelRow, ...]:
    """The table's entries whose name, alias or family contains ``match`` (case-insensitive; all when None), in the
    table's order (decoders by family, then encoders, then vision models)."""
    return tuple(_row(entry) for entry in TABLE if match is None or _matches(entry, match))


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f} B" if parameters >= 1e9 else f"{parameters / 1e6:.1f} M"


def models_table(rows: tuple[ModelRow, ...]) -> Table:
    table = Table(title=f"hf:NAME offline: {len(rows)} checkpoints", title_justify="left")
    table.add_column("name")
    table.add_column("family")
    table.add_column("parameters", justify="right")
    table.add_column("model")
    table.add_column("also")
    for row in rows:
        table.add_row(row.name, row.family, _count(row.parameters), row.model_class, ", ".join(row.aliases))
    return table
