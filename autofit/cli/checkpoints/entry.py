"""One checkpoint of the offline table (see :mod:`autofit.cli.checkpoints`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["Checkpoint"]


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """A Hub checkpoint as numbers only: ``config`` is ``model_type`` plus the ``config.json`` fields that decide the
    model's shapes and attention (everything else keeps the config class's default). ``aliases`` are Hub ids that share
    the entry: their ``config.json`` differs at most in fields that change no shape (token ids, ``torch_dtype``, or
    ``max_position_embeddings`` for some instruct variants), so they build the same model."""

    name: str
    family: str
    config: Mapping[str, Any] = field(repr=False)
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if "/" not in self.name:
            raise ValueError(f"Checkpoint.name must be a Hub id 'org/name', got {self.name!r}")
        if "model_type" not in self.config:
            raise ValueError(f"Checkpoint {self.name!r}: config needs 'model_type' (AutoConfig.for_model's key)")
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])
