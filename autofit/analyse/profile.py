"""The peak of each stage of the step as an exact function of the micro-batch size.

The analysis simulates the accumulation window (two micro-batches and the optimizer step) at two consecutive batch
sizes, b = 2 and b = 3 (not 1: a batch dimension of size 1 makes transposed tensors contiguous, and PyTorch then
picks other kernels, so b = 1 is not on the same line). When both runs made the same allocations in the same order
(they do on fake tensors unless control flow depends on the batch size), every storage's size is linear in b:
``n(b) = c + d * b`` with ``d = n(3) - n(2)``. The live bytes
after each event are then linear in b too, ``A_j + S_j * b`` (prefix sums), and the peak of a stage is the upper
envelope of those lines: ``max_j (A_j + S_j * b)``. The envelope is kept as the few lines of its convex hull, so
evaluating any b is cheap and exact (no extrapolation of a single peak that may move to another op as b grows).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from autofit.simulate.timeline import EventKind, Phase, Timeline

__all__ = ["Envelope", "StepProfile", "build_profile"]


@dataclass(frozen=True)
class Envelope:
    """max over lines (intercept, slope) evaluated at b: a convex, piecewise-linear function of the batch."""

    lines: tuple[tuple[int, int], ...]

    def __call__(self, batch: int) -> int:
        return max(a + s * batch for a, s in self.lines) if self.lines else 0


@dataclass(frozen=True)
class StepProfile:
    """Peak live bytes per stage of the window, keyed by (micro-batch index, phase); index 1 is a micro-batch that
    starts with gradients already accumulated, so it stands for every micro-batch after the first."""

    stages: Mapping[tuple[int, Phase], Envelope]
    precision: str
    exact: bool  # False when the two runs did not align and stage peaks were joined by a straight line

    def stage(self, micro: int, phase: Phase, batch: int) -> int:
        envelope = self.stages.get((micro, phase))
        return envelope(batch) if envelope is not None else 0

    def peak(self, batch: int, accumulation_steps: int) -> int:
        micros = (0, 1) if accumulation_steps > 1 else (0,)
        values = [self.stage(m, p, batch) for m in micros for p in (Phase.FORWARD, Phase.BACKWARD)]
        return max(values + [self.stage(1, Phase.OPTIMIZER, batch)])


def _upper_hull(points: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Lines (a, s) that attain max_j (a_j + s_j * b) for some b >= 1 (monotone-chain upper hull in (s, a))."""
    if len(points) == 0:
        return ()
    order = np.lexsort((points[:, 0], points[:, 1]))  # by slope, then intercept
    best: dict[int, int] = {}
    for a, s in points[order].tolist():
        best[s] = max(best.get(s, a), a)
    hull: list[tuple[int, int]] = []
    for s, a in sorted(best.items()):
        while len(hull) >= 2:
            (s1, a1), (s2, a2) = hull[-2], hull[-1]
            # drop the middle line if it is never strictly above both neighbours
            if (a2 - a1) * (s - s1) <= (a - a1) * (s2 - s1):
                hull.pop()
            else:
                break
        hull.append((s, a))
    # for b >= 1 only: a line is useless if a steeper one is higher at b = 1
    lines = [(a, s) for s, a in hull]
    keep = [line for line in lines if not any(o[1] > line[1] and o[0] + o[1] >= line[0] + line[1] for o in lines)]
    return tuple(keep)


def _running_lines(t1: Timeline, t2: Timeline, b1: int) -> tuple[np.ndarray, np.ndarray]:
    n1 = np.array([s.nbytes for s in t1.storages], dtype=np.int64)
    n2 = np.array([s.nbytes for s in t2.storages], dtype=np.int64)
    slope = n2 - n1
    intercept = n1 - b1 * slope
    da = np.zeros(len(t1.events), dtype=np.int64)
    ds = np.zeros(len(t1.events), dtype=np.int64)
    for j, (kind, value) in enumerate(t1.events):
        if kind is EventKind.ALLOC:
            da[j], ds[j] = intercept[value], slope[value]
        elif kind is EventKind.FREE:
            da[j], ds[j] = -intercept[value], -slope[value]
    return np.cumsum(da), np.cumsum(ds)


def _aligned(t1: Timeline, t2: Timeline) -> bool:
    if len(t1.events) != len(t2.events) or len(t1.storages) != len(t2.storages) or t1.marks != t2.marks:
        return False
    return all(e1[0] == e2[0] and (e1[0] is not EventKind.OP or t1.ops[e1[1]].name == t2.ops[e2[1]].name)
               for e1, e2 in zip(t1.events, t2.events))


def _stage_bounds(timeline: Timeline) -> list[tuple[tuple[int, Phase], int, int]]:
    marks = timeline.marks
    bounds = []
    for i, (start, micro, phase) in enumerate(marks):
        end = marks[i + 1][0] if i + 1 < len(marks) else len(timeline.events)
        bounds.append(((micro, phase), start, end))
    return bounds


def _stage_peaks(timeline: Timeline) -> dict[tuple[int, Phase], int]:
    live = 0
    running = []
    for kind, value in timeline.events:
        if kind is EventKind.ALLOC:
            live += timeline.storages[value].nbytes
        elif kind is EventKind.FREE:
            live -= timeline.storages[value].nbytes
        running.append(live)
    return {key: max(running[start:end], default=running[start - 1] if start else 0)
            for key, start, end in _stage_bounds(timeline)}


def build_profile(t1: Timeline, t2: Timeline, precision: str, b1: int) -> StepProfile:
    """Stage envelopes from the same window simulated at micro-batch ``b1`` (``t1``) and ``b1 + 1`` (``t2``)."""
    if _aligned(t1, t2):
        a, s = _running_lines(t1, t2, b1)
        stages = {}
        for key, start, end in _stage_bounds(t1):
            lo = max(start - 1, 0)  # the live bytes entering the stage count too
            stages[key] = Envelope(_upper_hull(np.stack([a[lo:end], s[lo:end]], axis=1)))
        return StepProfile(stages, precision, exact=True)
    p1, p2 = _stage_peaks(t1), _stage_peaks(t2)
    slopes = {key: p2.get(key, p1[key]) - p1[key] for key in p1}
    stages = {key: Envelope(((p1[key] - b1 * slopes[key], slopes[key]),)) for key in p1}
    return StepProfile(stages, precision, exact=False)
