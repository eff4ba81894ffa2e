"""The micro-batches the trainer would cut from the sample: what a step that reads the values of its rows is
simulated on (Note [rows that differ], autofit/solve/estimator.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from autofit.training.batch import Batch, micro_batch_bounds

__all__ = ["SampleRows", "sample_micro_batches", "each_step"]

T = TypeVar("T")


@dataclass(frozen=True)
class SampleRows:
    """One micro-batch the trainer would cut from the sample (Note [rows that differ]): its rows resized to the
    micro-batch as a simulation takes them, what to call it, and whether no micro-batch before it had its values."""

    label: str
    batch: Batch
    target: Batch | None
    distinct: bool


def sample_micro_batches(batch: Batch, target: Batch | None, batch_size: int, per_rank: int, micro: int,
                         min_rows: int = 1) -> list[SampleRows]:
    """Every micro-batch of ``micro`` rows the trainer cuts from the sample seen as consecutive batches of
    ``batch_size`` rows (the last filled cyclically), each split over the data-parallel ranks (``per_rank`` rows
    each) and cut by ``micro_batch_bounds``; the first is the sample's first rows, what a simulation takes by
    itself (Note [rows that differ])."""
    batch_size = max(batch_size, per_rank)
    total = batch_size * -(-batch.size // batch_size)
    whole = batch.resize(total) if total != batch.size else batch
    whole_target = None if target is None else (target.resize(total) if total != target.size else target)
    ranks = max(1, batch_size // per_rank)
    out: list[SampleRows] = []
    seen: list[list] = []
    for start in range(0, total, per_rank):
        bounds = micro_batch_bounds(per_rank, micro, min_rows)
        for k, (a, b) in enumerate(bounds):
            a, b = start + a, start + b
            rows = whole.slice(a, b).resize(micro)
            rows_target = None if whole_target is None else whole_target.slice(a, b).resize(micro)
            values = rows.per_sample_tensors() + ([] if rows_target is None else rows_target.per_sample_tensors())
            distinct = not any(_equal(values, other) for other in seen)
            if distinct:
                seen.append(values)
            where = f"micro-batch {k + 1} of {len(bounds)}"
            if ranks > 1 or total > batch_size:
                where += f" of rank {(start // per_rank) % ranks}" if ranks > 1 else ""
                where += f" of batch {start // batch_size + 1}" if total > batch_size else ""
            span = f"row {a}" if b - a == 1 else f"rows {a} to {b - 1}"
            label = f"{where} ({span}{' of the sample repeated' if b > batch.size else ''})"
            out.append(SampleRows(label, rows, rows_target, distinct))
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two micro-batches hold the same values."""
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b))


def each_step(rows: list[SampleRows], first: T, run: Callable[[SampleRows], T],
              program: Callable[[T], Any]) -> list[tuple[SampleRows, T]]:
    """``first``, the result of ``rows[0]`` (the sample's first rows), and ``run(r)`` of each later micro-batch whose
    reads do not all get the answers of one run before (``RowProgram.same_answers``; Note [rows that differ],
    autofit/solve/estimator.py), in order. ``program(result)`` is a result's program: where the first's did not
    come back from a worker, the first rows run again here, which keeps it; where none can be run (one grown past
    ``MAX_PROGRAM_BYTES``), every micro-batch with values of its own runs."""
    def usable(result: T) -> bool:
        p = program(result)
        return p is not None and p.usable

    if program(first) is not None and program(first).unpickled:
        first = run(rows[0])
    done = [(rows[0], first)]
    pending = [r for r in rows[1:] if r.distinct]

    def answered(r: SampleRows) -> bool:
        inputs = r.batch.tensors() + ([] if r.target is None else r.target.tensors())
        return any(usable(result) and program(result).same_answers(inputs) for _, result in done)

    while pending := [r for r in pending if not answered(r)]:
        done.append((pending[0], run(pending[0])))
        pending = pending[1:]
    return done
