"""One checkpoint of the offline table (see :mod:`autofit.cli.checkpoints`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["Checkpoint"]

_DTYPES = ("float32", "bfloat16", "float16")  # the spellings config.json uses


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """A Hub checkpoint as numbers only: ``config`` is ``model_type`` plus the ``config.json`` fields that decide the
    model's shapes and attention (everything else keeps the config class's default). ``aliases`` are Hub ids that share
    the entry: their ``config.json`` differs at most in fields that change no shape (token ids, ``torch_dtype``, or
    ``max_position_embeddings`` for some instruct variants), so they build the same model.

    ``dtype`` is the checkpoint's ``config.json`` ``torch_dtype`` (``dtype`` from transformers 5): the dtype
    transformers 5 loads it in by default (Note [the dtype a checkpoint loads in], autofit/cli/hf_spec.py). Where the
    config names none (GPT-2, BERT, T5), the weights' own dtype, which is what ``dtype="auto"`` falls back to.
    ``alias_dtypes`` names the aliases published in another dtype (Gemma 2's base models are float32, their ``-it``
    models bfloat16)."""

    name: str
    family: str
    config: Mapping[str, Any] = field(repr=False)
    dtype: str
    aliases: tuple[str, ...] = ()
    alias_dtypes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "/" not in self.name:
            raise ValueError(f"Checkpoint.name must be a Hub id 'org/name', got {self.name!r}")
        if "model_type" not in self.config:
            raise ValueError(f"Checkpoint {self.name!r}: config needs 'model_type' (AutoConfig.for_model's key)")
        if "torch_dtype" in self.config or "dtype" in self.config:
            raise ValueError(f"Checkpoint {self.name!r}: give the dtype as Checkpoint.dtype, not in config")
        for dtype in (self.dtype, *self.alias_dtypes.values()):
            if dtype not in _DTYPES:
                raise ValueError(f"Checkpoint {self.name!r}: dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
        if not set(self.alias_dtypes) <= set(self.aliases):
            raise ValueError(f"Checkpoint {self.name!r}: alias_dtypes names ids that are not aliases")
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))
        object.__setattr__(self, "alias_dtypes", MappingProxyType(dict(self.alias_dtypes)))

    def dtype_of(self, name: str) -> str:
        """The published dtype of ``name``, this entry's name or one of its aliases."""
        return self.alias_dtypes.get(name, self.dtype)

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])
