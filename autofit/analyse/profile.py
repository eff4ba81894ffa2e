"""The step's live bytes after every event, as an exact linear function of the micro-batch size.

The analysis simulates the accumulation window (two micro-batches and the optimizer step) at two consecutive batch
sizes, b = 2 and b = 3 (not 1: a batch dimension of size 1 makes transposed tensors contiguous, and PyTorch then
picks other kernels, so b = 1 is not on the same line). When both runs made the same allocations in the same order
(they do on fake tensors unless control flow depends on the batch size), every storage's size and every kernel's
scratch is linear in b, so the live bytes after event j are ``A_j + S_j * b`` (prefix sums). Any stage's peak at
any b is then one vectorised maximum, and checkpointing can be modelled by editing these lines (``solve``).

When the runs do not align (data-dependent models), each stage gets the straight line through its two simulated
peaks, spread over the smaller run's events; ``exact`` is False and the planner leans on its verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autofit.simulate.timeline import EventKind, Phase, StorageRecord, Timeline

__all__ = ["CallRecord", "StepProfile", "build_profile", "live_lines", "timeline_at"]


@dataclass(frozen=True)
class CallRecord:
    """One call of a module in the simulated window, in event indices of the profile."""

    name: str  # module qualified name
    micro: int  # micro-batch index (0, or 1 for a micro-batch that starts with gradients)
    start: int  # first event of the call
    end: int  # last event of the call
    recompute_at: int  # first event of the call's backward (where checkpointing would recompute it), -1 if none
    backward_end: int  # last event of the call's backward: checkpoint releases its inputs and RNG stash there
    saved: tuple[int, int]  # (fixed, per_sample) bytes saved for backward that the call made and did not return
    inputs: tuple[tuple[int, int, int], ...] = ()  # (event that frees it, fixed, per_sample) per tensor input
    # (fixed, per_sample) bytes a selective recomputation keeps until the call's backward: the outputs of its matmul
    # and attention ops that checkpointing would otherwise drop, or that the plain run frees before the call's
    # backward (Note [selective recomputation], autofit/training/recompute.py)
    kept: tuple[int, int] = (0, 0)
    # the same for torchtitan's per-op policy, "op-selective" (Note [torchtitan's per-op policy])
    kept_op: tuple[int, int] = (0, 0)

    def input_bytes(self, index: int, batch: int) -> int:
        _, fixed, per_sample = self.inputs[index]
        return max(0, fixed + per_sample * batch)

    def saved_bytes(self, batch: int) -> int:
        return max(0, self.saved[0] + self.saved[1] * batch)

    def kept_bytes(self, batch: int, policy: str = "selective") -> int:
        fixed, per_sample = self.kept_op if policy == "op-selective" else self.kept
        return max(0, fixed + per_sample * batch)


@dataclass(frozen=True)
class StepProfile:
    intercepts: np.ndarray  # live bytes after event j, at batch b: intercepts[j] + slopes[j] * b
    slopes: np.ndarray
    marks: tuple[tuple[int, int, Phase], ...]  # (first event, micro-batch, phase) of each stage
    precision: str
    exact: bool
    calls: tuple[CallRecord, ...] = field(default_factory=tuple)

    def live(self, batch: int) -> np.ndarray:
        return self.intercepts + self.slopes * batch

    def bounds(self, micro: int, phase: Phase) -> tuple[int, int]:
        """Event range [start, end) of a stage; the event before ``start`` (entering state) belongs to it too."""
        for i, (start, m, p) in enumerate(self.marks):
            if (m, p) == (micro, phase):
                end = self.marks[i + 1][0] if i + 1 < len(self.marks) else len(self.intercepts)
                return max(start - 1, 0), end
        return 0, 0

    def stage(self, micro: int, phase: Phase, batch: int) -> int:
        lo, hi = self.bounds(micro, phase)
        if hi <= lo:
            return 0
        return int((self.intercepts[lo:hi] + self.slopes[lo:hi] * batch).max())

    def internal_bytes(self, call: CallRecord, batch: int) -> int:
        """High-water mark of the call's forward above the bytes live when it started (what recomputing it
        allocates at once, saved tensors included)."""
        first = max(call.start - 1, 0)  # only the call's events: the whole line per call made a search quadratic
        live = self.intercepts[first:call.end + 1] + self.slopes[first:call.end + 1] * batch
        before = live[0] if call.start > 0 else 0
        inside = live[1:] if call.start > 0 else live
        return max(0, int(inside.max(initial=before)) - int(before))

    def micro_batches(self, accumulation_steps: int) -> tuple[int, ...]:
        return (0, 1) if accumulation_steps > 1 else (0,)

    def peak(self, batch: int, accumulation_steps: int) -> int:
        """Peak of the window without checkpointing."""
        values = [self.stage(m, p, batch) for m in self.micro_batches(accumulation_steps)
                  for p in (Phase.FORWARD, Phase.BACKWARD)]
        return max(values + [self.stage(1, Phase.OPTIMIZER, batch)])


def live_lines(t1: Timeline, t2: Timeline, b1: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefix sums of the per-event byte changes, as intercept and slope arrays (``t2`` ran at ``b1 + 1``).
    An op's kernel scratch is counted at its own event only (it is freed before the op returns)."""
    n1 = np.array([s.nbytes for s in t1.storages], dtype=np.int64)
    n2 = np.array([s.nbytes for s in t2.storages], dtype=np.int64)
    slope = n2 - n1
    intercept = n1 - b1 * slope
    count = len(t1.events)
    da, ds = np.zeros(count, dtype=np.int64), np.zeros(count, dtype=np.int64)
    wa, ws = np.zeros(count, dtype=np.int64), np.zeros(count, dtype=np.int64)
    for j, ((kind, value), (_, value2)) in enumerate(zip(t1.events, t2.events)):
        if kind is EventKind.ALLOC:
            da[j], ds[j] = intercept[value], slope[value]
        elif kind is EventKind.FREE:
            da[j], ds[j] = -intercept[value], -slope[value]
        else:
            w1, w2 = t1.ops[value].workspace, t2.ops[value2].workspace
            ws[j] = w2 - w1
            wa[j] = w1 - b1 * ws[j]
    return np.cumsum(da) + wa, np.cumsum(ds) + ws


def aligned(t1: Timeline, t2: Timeline) -> bool:
    if len(t1.events) != len(t2.events) or len(t1.storages) != len(t2.storages) or t1.marks != t2.marks:
        return False
    return all(e1[0] == e2[0] and (e1[0] is not EventKind.OP or t1.ops[e1[1]].name == t2.ops[e2[1]].name)
               for e1, e2 in zip(t1.events, t2.events))


def _live_one(timeline: Timeline) -> np.ndarray:
    live, out = 0, np.zeros(len(timeline.events), dtype=np.int64)
    for j, (kind, value) in enumerate(timeline.events):
        if kind is EventKind.ALLOC:
            live += timeline.storages[value].nbytes
        elif kind is EventKind.FREE:
            live -= timeline.storages[value].nbytes
        out[j] = live + (timeline.ops[value].workspace if kind is EventKind.OP else 0)
    return out


def build_profile(t1: Timeline, t2: Timeline, precision: str, b1: int,
                  calls: tuple[CallRecord, ...] = ()) -> StepProfile:
    """The profile of the window simulated at micro-batch ``b1`` (``t1``) and ``b1 + 1`` (``t2``)."""
    marks = tuple(t1.marks)
    if aligned(t1, t2):
        a, s = live_lines(t1, t2, b1)
        return StepProfile(a, s, marks, precision, True, calls)
    # Fallback: the smaller run's events, each stage lifted by the slope between the two runs' stage peaks.
    live1, live2 = _live_one(t1), _live_one(t2)
    slopes = np.zeros(len(live1), dtype=np.int64)
    bounds2 = {(m, p): i for i, (_, m, p) in enumerate(t2.marks)}
    for i, (start, m, p) in enumerate(marks):
        end = marks[i + 1][0] if i + 1 < len(marks) else len(live1)
        j = bounds2.get((m, p))
        if j is None:
            continue
        s2 = t2.marks[j][0]
        e2 = t2.marks[j + 1][0] if j + 1 < len(t2.marks) else len(live2)
        peak1 = live1[max(start - 1, 0):end].max(initial=0)
        peak2 = live2[max(s2 - 1, 0):e2].max(initial=0)
        slopes[start:end] = peak2 - peak1
    return StepProfile(live1 - slopes * b1, slopes, marks, precision, False, calls)


def timeline_at(t1: Timeline, t2: Timeline | None, b1: int, batch: int) -> Timeline:
    """``t1``'s events with every storage sized for ``batch`` (from the line through ``t1`` at ``b1`` and ``t2`` at
    ``b1 + 1``); ``t1`` itself when the two runs do not align."""
    if t2 is None or not aligned(t1, t2):
        return t1
    storages = [
        StorageRecord(max(0, s1.nbytes + (s2.nbytes - s1.nbytes) * (batch - b1)), s1.category, s1.op, s1.module,
                      s1.phase, s1.stream)
        for s1, s2 in zip(t1.storages, t2.storages)
    ]
    return Timeline(storages, t1.ops, t1.events, t1.marks)
