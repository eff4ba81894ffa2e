"""What a plan knows of the model it was made for, and the check ``wrap`` makes with it (Note [the plan's model]).

Note [the plan's model]
    A plan's figures hold for one model: its parameters, gradients and optimizer state, its activations per row. A
    plan is also a JSON file, and nothing tied it to its model: a plan made for 676 parameters wrapped a model of
    86,020 without a word, and trained it at a micro-batch chosen for another. So the plan records the model it
    was made for (``Plan.made_for``, written to the JSON as ``"made_for"``): how many parameter elements it has and
    how many of them train, how many elements are held in each dtype, the number of parameter tensors, and a
    fingerprint of their names and shapes in order (a ``torch.compile`` wrapper's ``_orig_mod.`` left out: the
    same model compiled or not). ``wrap`` compares the model it is given (``check_made_for``):

    - other names or shapes (another architecture or size): refused, a :class:`ModelMismatchError`: nothing of the
      plan describes that model;
    - the same parameters held in wider dtypes (more bytes: planned in bf16, given in fp32), or more of them
      trainable (frozen when planned, not now: more gradients and optimizer state): refused, the step needs more
      memory than the plan verified;
    - narrower dtypes, or fewer trainable: a warning, not an error. The step needs less memory than planned, so the
      plan still fits (it wastes some), and frozen layers or a model cast down are common steps between planning
      and training; the warning says which and that a new plan would use the memory.

    A plan without a record (written before the record existed, or built by hand) wraps any model, as before.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autofit.core.errors import InvalidInputError, ModelMismatchError, require_int

__all__ = ["ModelRecord", "check_made_for", "record_model"]

_COMPILED = "_orig_mod."  # torch.compile's OptimizedModule holds the model under this name


@dataclass(frozen=True, kw_only=True)
class ModelRecord:
    """The model a plan was made for (See Note [the plan's model])."""

    parameters: int  # parameter elements (a tied weight once)
    trainable: int  # elements of those that require grad
    tensors: int  # parameter tensors
    dtypes: tuple[tuple[str, int], ...]  # (dtype, elements held in it), by dtype name
    fingerprint: str  # sha256 of the parameters' names and shapes, in order (16 hex digits)

    def __post_init__(self) -> None:
        for name in ("parameters", "trainable", "tensors"):
            require_int(f"ModelRecord.{name}", getattr(self, name), minimum=0)
        if not isinstance(self.fingerprint, str):
            raise InvalidInputError(f"ModelRecord.fingerprint must be a string, got {self.fingerprint!r}")

    @property
    def parameter_bytes(self) -> int:
        return sum(n * _itemsize(dtype) for dtype, n in self.dtypes)

    def words(self) -> str:
        """``86,020 parameters in 6 tensors (86,020 trainable, float32)``."""
        held = ", ".join(f"{n:,} {d}" if len(self.dtypes) > 1 else d for d, n in self.dtypes)
        return (f"{self.parameters:,} parameters in {self.tensors} tensors ({self.trainable:,} trainable"
                + (f", {held})" if held else ")"))

    def to_dict(self) -> dict[str, Any]:
        return {"parameters": self.parameters, "trainable": self.trainable, "tensors": self.tensors,
                "dtypes": {d: n for d, n in self.dtypes}, "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelRecord:
        return cls(parameters=data["parameters"], trainable=data["trainable"], tensors=data["tensors"],
                   dtypes=tuple(sorted((str(d), int(n)) for d, n in data["dtypes"].items())),
                   fingerprint=data["fingerprint"])


def _itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as torch spells it ("float32", "bfloat16", "uint8")."""
    found = getattr(torch, dtype, None)
    return found.itemsize if isinstance(found, torch.dtype) else 0


def record_model(model: nn.Module) -> ModelRecord:
    """The record of ``model`` (See Note [the plan's model])."""
    names = hashlib.sha256()
    dtypes: Counter[str] = Counter()
    parameters = trainable = tensors = 0
    for name, p in model.named_parameters():
        names.update(f"{name.replace(_COMPILED, '')}:{tuple(p.shape)}\n".encode())
        dtypes[str(p.dtype).removeprefix("torch.")] += p.numel()
        parameters += p.numel()
        trainable += p.numel() if p.requires_grad else 0
        tensors += 1
    return ModelRecord(parameters=parameters, trainable=trainable, tensors=tensors, dtypes=tuple(sorted(dtypes.items())),
                       fingerprint=names.hexdigest()[:16])


def check_made_for(made_for: ModelRecord | None, model: nn.Module) -> None:
    """Refuse a model other than the plan's, or warn where it differs harmlessly (See Note [the plan's model])."""
    if made_for is None or not isinstance(model, nn.Module):
        return
    now = record_model(model)
    if now == made_for:
        return
    if now.fingerprint != made_for.fingerprint:
        same = " (as many, under other names or in other shapes)" if now.parameters == made_for.parameters else ""
        raise ModelMismatchError(
            f"this plan was made for a model of {made_for.words()}; this one has {now.words()}{same}: its "
            "micro-batch, checkpoints and memory figures describe the other model. Plan this one: "
            "autofit.plan(model, sample, budget, ...) (See Note [the plan's model], autofit/emit/model_record.py)")
    wider = now.parameter_bytes > made_for.parameter_bytes
    more = now.trainable > made_for.trainable
    if wider or more:
        what = "its parameters take more bytes" if wider else "more of its parameters train"
        raise ModelMismatchError(
            f"this plan was made for this model as {made_for.words()}; it is now {now.words()}: {what}, so the "
            "step needs more memory than the plan verified. Plan it as it is now, or "
            + ("cast it back to the planned dtypes" if wider else "freeze what was frozen when planning")
            + " before wrap() (See Note [the plan's model], autofit/emit/model_record.py)")
    changes = []
    if now.dtypes != made_for.dtypes:
        changes.append(f"its parameters are held in other dtypes ({now.parameter_bytes:,} bytes, planned "
                       f"{made_for.parameter_bytes:,})")
    if now.trainable < made_for.trainable:
        changes.append(f"fewer of them train ({now.trainable:,}, planned {made_for.trainable:,})")
    warnings.warn(
        f"this plan was made for this model as {made_for.words()}; it is now {now.words()}: "
        f"{' and '.join(changes)}. The step needs no more memory than planned, so the plan fits, but it may leave "
        "memory unused: plan again to use it (See Note [the plan's model], autofit/emit/model_record.py)",
        stacklevel=4)
