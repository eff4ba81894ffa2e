"""The layout in a plan's JSON: where each of :class:`~autofit.parallel.layout.Parallel`'s fields stands among the
plan's own, and how it is written and read back (Note [the layout in a plan's JSON])."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from autofit.parallel.dimension import Placement
from autofit.parallel.layout import Parallel

__all__ = ["JSON_PLACES", "json_fields", "layout_from_json"]


# Note [the layout in a plan's JSON]
#     A plan's JSON has always held its layout's fields flat, among the plan's own (``world_size`` and ``strategy``
#     after ``estimate``, FSDP2's and tensor parallel's after ``notes``, the states' place after ``offload``), and
#     plans written before the layout was one value load as they always did. Where each field stands, and how a
#     field that is no plain JSON value is written and read back, is the layout's to say, here: ``emit/plan_json.py``
#     writes what :func:`json_fields` gives after each of the plan's fields and reads the layout back with
#     :func:`layout_from_json`. A dimension beyond the first ones adds no field: its placement is one entry of
#     ``more_dimensions``, ``[dimension, degree, [[option, value], ...]]``, written only where there is one, so a
#     plan of the first dimensions reads as it always did. A field absent from an old plan keeps its default.
JSON_PLACES: dict[str, tuple[str, ...]] = {
    "estimate": ("world_size", "strategy"),
    "notes": ("shard_units", "reshard_after_forward", "replicate", "gpus_per_node", "tensor_parallel", "tensor_plan",
              "more_dimensions"),
    "offload": ("offload_states", "reduce_every_micro_batch"),
}
# the fields held as tuples, written as JSON lists, and read back (a field not named here is a plain JSON value)
_TO_JSON: dict[str, Callable[[Any], Any]] = {
    "shard_units": list, "tensor_plan": lambda plan: [list(pair) for pair in plan],
    "more_dimensions": lambda placed: [[p.dimension, p.degree, [[n, v] for n, v in p.options]] for p in placed]}
_FROM_JSON: dict[str, Callable[[Any], Any]] = {
    "shard_units": tuple, "tensor_plan": lambda plan: tuple((str(n), str(s)) for n, s in plan),
    "more_dimensions": lambda placed: tuple(Placement(str(d), int(n), tuple((str(k), _frozen(v)) for k, v in o))
                                            for d, n, o in placed)}
# written only where they hold something
_ONLY_WHEN_SET = frozenset({"more_dimensions"})
# every field has its place: a field without one would be dropped from the plan's JSON unseen
assert {f.name for f in fields(Parallel)} == {name for names in JSON_PLACES.values() for name in names}


def _frozen(value: Any) -> Any:
    """A JSON value as a placement's option holds it: lists as tuples, all the way down (a placement is hashable)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def layout_from_json(data: Mapping[str, Any]) -> dict[str, Any]:
    """The layout's fields of a plan's JSON ``data``, read back (Note [the layout in a plan's JSON]): those present,
    and the tuple fields always (empty where an old plan has none)."""
    found = {name: data[name] for names in JSON_PLACES.values() for name in names if name in data}
    for name, read in _FROM_JSON.items():
        found[name] = read(found.get(name, ()))
    return found


def json_fields(parallel: Parallel, after: str) -> dict[str, Any]:
    """The fields of ``parallel`` that a plan's JSON writes after its field ``after``, as JSON values (Note [the layout
    in a plan's JSON])."""
    names = JSON_PLACES.get(after, ())
    return {name: _TO_JSON.get(name, lambda value: value)(getattr(parallel, name)) for name in names
            if name not in _ONLY_WHEN_SET or getattr(parallel, name)}
