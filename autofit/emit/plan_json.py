"""The plan's JSON (plain JSON; loading runs no code): :class:`PlanJson`, a base of :class:`~autofit.emit.plan.Plan`,
writes a plan (``to_dict``, ``to_json``) and reads it back (``from_json``), plans written by earlier versions
included."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any, Self

from autofit.core.errors import InvalidInputError
from autofit.training.config import ZeroGrad
from autofit.training.length import LengthSpec
from autofit.training.precision import PrecisionPolicy
from autofit.core.report import MemoryEstimate
from autofit.emit.model_record import ModelRecord
from autofit.emit.plan_text import Alternative, Forgone
from autofit.features import FEATURES, FURTHER
from autofit.features.base import with_carried
from autofit.parallel.layout import Parallel
from autofit.parallel.layout_json import json_fields, layout_from_json

__all__ = ["PlanJson"]

_FORMAT = "autofit.plan/1"


class PlanJson:
    """A plan as JSON and back: a base of :class:`~autofit.emit.plan.Plan`, whose fields it writes and reads."""

    # ---- serialisation (plain JSON; loading runs no code) -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = {}
        for f in fields(self):
            if f.name == "more_features":  # each carried feature under its own name, where this field stands
                data.update((feature.field, None) for feature in FURTHER)
            elif f.name not in ("loss_fn", "parallel", "verified_step"):
                data[f.name] = getattr(self, f.name)
            data.update(json_fields(self.parallel, after=f.name))  # Note [the layout in a plan's JSON]
        data["precision"] = {"name": self.precision.name, "fp32_modules": list(self.precision.fp32_modules),
                             "stored": self.precision.stored, "built": self.precision.built}
        data["peak_allocated_bytes"] = self.peak_allocated_bytes  # written for readers; from_json ignores it
        data["estimate"] = self.estimate.to_dict()
        data["checkpoint"] = list(self.checkpoint)
        data["selective"] = list(self.selective)
        data["op_selective"] = list(self.op_selective)
        data["checkpoint_policies"] = self.checkpoint_policies  # written for readers; from_json ignores it
        data["frontier"] = [dict(asdict(a), checkpoint=list(a.checkpoint), selective=list(a.selective),
                                 op_selective=list(a.op_selective))
                            for a in self.frontier]
        data["notes"] = list(self.notes)
        data["alternatives"] = [dict(asdict(a), checkpoint=list(a.checkpoint)) for a in self.alternatives]
        data["shared"] = list(self.shared)
        data["made_for"] = None if self.made_for is None else self.made_for.to_dict()
        if tuple(self.batch_dim) == (0, 0):  # the default's plan is written as before it was a field
            del data["batch_dim"]
        else:
            data["batch_dim"] = list(self.batch_dim)
        data["lengths"] = None if self.lengths is None else {
            "length": self.lengths.length, "shapes": [list(s) for s in self.lengths.shapes],
            "length_tensors": list(self.lengths.length_tensors),
        }
        data["rows_by_length"] = [list(r) for r in self.rows_by_length]
        data["even_split"] = None if self.even_split is None else list(self.even_split)
        for feature in FEATURES:  # each step feature's value as JSON (Note [step features])
            data[feature.field] = feature.to_json(feature.in_force(self))
        for name in ("alloc_conf", "preallocated_grads"):  # derived from the estimate: written after it, as always
            data[name] = data.pop(name)
        if self.zero_grad is ZeroGrad.AFTER_STEP:  # the default's plan is written as before it was a field
            del data["zero_grad"]
        else:
            data["zero_grad"] = str(self.zero_grad)
        return {"format": _FORMAT, **data}

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Self:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidInputError(f"not a plan: invalid JSON ({e})") from e
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise InvalidInputError(f"not an autofit plan: expected \"format\": \"{_FORMAT}\"")
        data = dict(data)
        data.pop("format")
        data.pop("peak_allocated_bytes", None)  # = peak_bytes
        data.pop("checkpoint_policies", None)  # = checkpoint, selective and op_selective
        try:
            data["estimate"] = MemoryEstimate.from_dict(data["estimate"])
            data["precision"] = PrecisionPolicy(name=data["precision"]["name"],
                                                fp32_modules=tuple(data["precision"]["fp32_modules"]),
                                                stored=data["precision"].get("stored"),
                                                built=data["precision"].get("built"))
            data["checkpoint"] = tuple(data["checkpoint"])
            data["selective"] = tuple(data.get("selective", ()))  # absent from plans written before issue 27
            data["op_selective"] = tuple(data.get("op_selective", ()))  # absent from plans written before issue 58
            flat = layout_from_json(data)  # Note [the layout in a plan's JSON]: the one reader of the flat fields
            data = {k: v for k, v in data.items() if k not in flat}
            data["parallel"] = Parallel(**flat)
            data["notes"] = tuple(data["notes"])
            data["shared"] = tuple(data.get("shared", ()))  # absent from plans written before issue 39
            made_for = data.get("made_for")  # absent from plans written before issue 55: wrap takes any model
            data["made_for"] = None if made_for is None else ModelRecord.from_dict(made_for)
            data["batch_dim"] = tuple(data.get("batch_dim", (0, 0)))  # absent from plans written before issue 55
            data["frontier"] = tuple(Alternative(**dict(a, checkpoint=tuple(a["checkpoint"]),
                                                        selective=tuple(a.get("selective", ())),
                                                        op_selective=tuple(a.get("op_selective", ()))))
                                     for a in data["frontier"])
            data["alternatives"] = tuple(Forgone(**dict(a, checkpoint=tuple(a["checkpoint"])))  # absent before issue 56
                                         for a in data.get("alternatives", ()))
            lengths = data.get("lengths")  # absent from plans written before variable-length batches
            data["lengths"] = None if lengths is None else LengthSpec(
                length=lengths["length"], shapes=tuple(tuple(int(d) for d in s) for s in lengths["shapes"]),
                length_tensors=tuple(bool(b) for b in lengths["length_tensors"]),
            )
            data["rows_by_length"] = tuple((int(n), int(r)) for n, r in data.get("rows_by_length", ()))
            split = data.get("even_split")
            data["even_split"] = None if split is None else (int(split[0]), int(split[1]))
            more: tuple[tuple[str, Any], ...] = ()
            for feature in FEATURES:  # a field absent (a plan written before the feature) keeps its default
                if feature.field in data:
                    data[feature.field] = feature.from_json(data[feature.field])
                    if not feature.own_field:  # Note [carried features]
                        more = with_carried(more, feature.field, data.pop(feature.field))
            return cls(**data, more_features=more)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, InvalidInputError):
                raise
            raise InvalidInputError(f"plan JSON is missing or has a malformed field: {e}") from e
