"""The allocation timeline of one simulated step, and its replay into a peak with a breakdown.

The tracker (``tracker.py``) appends events while the step runs on fake tensors; categories and kernel workspaces
can be settled afterwards (a storage only turns out to be a gradient once backward has finished), so the peak is
computed by replaying the finished timeline, not on the fly. See Note [peak inside a kernel] below.

Note [peak inside a kernel]
    The CPU allocator sees a kernel's outputs *and* the scratch memory it allocates and frees before returning
    (oneDNN reorders and scratchpads, type-promotion buffers). Each op therefore ends with an ``OP`` event: at that
    instant the live bytes are everything allocated so far plus the op's ``workspace``, the transient bytes the
    kernel needs beyond its outputs. The peak of the step is the maximum over all events.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import IntEnum

from autofit.core.categories import Category

__all__ = ["Phase", "EventKind", "StorageRecord", "OpRecord", "Timeline", "Replay", "replay", "host_replay",
           "segment_peaks"]


class Phase(IntEnum):
    SETUP = 0  # tensors alive before the step: parameters, buffers, optimizer state, inputs
    FORWARD = 1
    BACKWARD = 2
    OPTIMIZER = 3


class EventKind(IntEnum):
    ALLOC = 0  # value: storage id
    FREE = 1  # value: storage id
    OP = 2  # value: op index; the op's workspace is transiently live here


@dataclass(slots=True)
class StorageRecord:
    nbytes: int
    category: Category
    op: int  # index of the op that created it, -1 for tensors that existed before the step
    module: str  # innermost module running when it was created ("" at top level)
    phase: Phase
    stream: int = 0  # the stream current when it was allocated, 0 the default (Note [one pool per stream])


@dataclass(slots=True)
class OpRecord:
    name: str
    module: str
    phase: Phase
    workspace: int = 0
    flops: int = 0
    io_bytes: int = 0  # bytes of the tensors it reads and writes (for the roofline time model)
    dtype: str = ""  # floating dtype it computes in ("float32", "bfloat16", ...), "" if none


@dataclass
class Timeline:
    storages: list[StorageRecord] = field(default_factory=list)
    ops: list[OpRecord] = field(default_factory=list)
    events: list[tuple[EventKind, int]] = field(default_factory=list)
    # (index of the first event, micro-batch index, phase): where each stage of the window begins
    marks: list[tuple[int, int, Phase]] = field(default_factory=list)
    # Host memory (Note [host storages]): storages that live in the host's RAM, not on the device. Their ALLOC and
    # FREE events go here, in order, never into ``events``, so every device replay ignores them.
    host_events: list[tuple[EventKind, int]] = field(default_factory=list)
    host_sids: set[int] = field(default_factory=set)
    # Set when the tracker exits (Note [a closed timeline]): frees after that are the simulation's teardown
    closed: bool = False
    # the previous step's gradients the step frees (Note [where zero_grad falls], training/step.py) -> the gradient
    # the step leaves for the same parameter in its place: what the next step frees (Note [the next step's
    # allocator], autofit/cuda/allocator.py); empty where a step keeps none
    carried: dict[int, int] = field(default_factory=dict)

    def mark(self, micro_batch: int, phase: Phase) -> None:
        self.marks.append((len(self.events), micro_batch, phase))

    def new_storage(self, record: StorageRecord, *, host: bool = False) -> int:
        self.storages.append(record)
        sid = len(self.storages) - 1
        if host:
            self.host_sids.add(sid)
            self.host_events.append((EventKind.ALLOC, sid))
        else:
            self.events.append((EventKind.ALLOC, sid))
        return sid

    def free(self, sid: int) -> None:
        if self.closed:
            return
        if sid in self.host_sids:
            self.host_events.append((EventKind.FREE, sid))
            return
        events, at = self.events, len(self.events)
        if self.storages[sid].category is Category.AUTOCAST_CACHE:  # see Note [autocast cache frees]
            floor = self.marks[-1][0] if self.marks else 0
            while at > floor and self._cache_free_after(events[at - 1], sid):
                at -= 1
        events.insert(at, (EventKind.FREE, sid))

    def _cache_free_after(self, event: tuple[EventKind, int], sid: int) -> bool:
        kind, value = event
        return kind is EventKind.FREE and value > sid and self.storages[value].category is Category.AUTOCAST_CACHE


# Note [autocast cache frees]
#     Leaving an autocast region frees the low-precision copies of the weights it cached all at once, in the order of
#     a hash map keyed by ``TensorImpl*`` (``cached_casts`` in aten/src/ATen/autocast_mode.cpp), so by address, which
#     changes from run to run. Nothing is allocated between those frees, so their order changes no peak, and the
#     caching allocator ends in the same state whatever the order; but two simulations of one step listed them in
#     other orders (CPU targets, bf16: 11 of the accuracy zoo's models). A run of consecutive autocast-cache frees is
#     therefore kept sorted by storage id (creation order), so a simulation's timeline is the same, event for event,
#     in every run and every process (tests/test_plan_speed.py). A free only moves back past other cache frees of
#     the same clear, never past the last stage mark, and no hook records an event index in the middle of a clear.

    def move_to_host(self, sid: int) -> None:
        """The storage's bytes were copied to the host and its device memory freed (FSDP2's CPU offload of a
        reduced gradient): it ends on the device here and lives on in host memory until it is freed."""
        if sid in self.host_sids:
            return
        self.events.append((EventKind.FREE, sid))
        self.host_sids.add(sid)
        self.host_events.append((EventKind.ALLOC, sid))

    def new_op(self, record: OpRecord) -> int:
        self.ops.append(record)
        index = len(self.ops) - 1
        self.events.append((EventKind.OP, index))
        return index


@dataclass(frozen=True)
class Replay:
    peak_bytes: int
    breakdown: dict[Category, int]  # live bytes per category at the peak (sums to peak_bytes)
    peak_op: int  # index of the op at (or just before) the peak, -1 if the peak is the starting state
    peak_phase: Phase


def host_replay(timeline: Timeline) -> tuple[int, dict[Category, int]]:
    """The host-memory high-water mark of the timeline's host storages, with its breakdown by category."""
    live: dict[Category, int] = {c: 0 for c in Category}
    total = peak = 0
    best: dict[Category, int] = {}
    for kind, sid in timeline.host_events:
        record = timeline.storages[sid]
        sign = 1 if kind is EventKind.ALLOC else -1
        live[record.category] += sign * record.nbytes
        total += sign * record.nbytes
        if total > peak:
            peak, best = total, dict(live)
    return peak, {c: b for c, b in best.items() if b}


def replay(timeline: Timeline) -> Replay:
    """Walk the events in order, keeping live bytes per category, and return the state at the highest point."""
    live: dict[Category, int] = {c: 0 for c in Category}
    total = 0
    peak = -1
    best: dict[Category, int] = {}
    peak_op, last_op, peak_phase = -1, -1, Phase.SETUP
    storages, ops = timeline.storages, timeline.ops
    for kind, value in timeline.events:
        if kind is EventKind.ALLOC:
            record = storages[value]
            live[record.category] += record.nbytes
            total += record.nbytes
            candidate = total
            workspace = 0
        elif kind is EventKind.FREE:
            record = storages[value]
            live[record.category] -= record.nbytes
            total -= record.nbytes
            continue
        else:
            last_op = value
            workspace = ops[value].workspace
            candidate = total + workspace
        if candidate > peak:
            peak = candidate
            best = dict(live)
            best[Category.WORKSPACE] = workspace
            peak_op = last_op
            peak_phase = storages[value].phase if kind is EventKind.ALLOC else ops[value].phase
    if peak < 0:
        return Replay(0, {}, -1, Phase.SETUP)
    return Replay(peak, {c: b for c, b in best.items() if b}, peak_op, peak_phase)


def segment_peaks(timeline: Timeline, role: Callable[[str], Hashable]) -> dict[tuple[int, Hashable], int]:
    """The tensor peak (live bytes, an op's workspace at its own event) of each segment of the step: a segment is a
    stage (the events between two marks, index 0 before the first) and the ``role`` of the module that runs (an op's
    or a new storage's module; a free belongs to the segment of the event before it). What Note [a stage that
    overtakes] (autofit/solve/extrapolate.py) lines up across depths."""
    peaks: dict[tuple[int, Hashable], int] = {}
    marks = [start for start, _, _ in timeline.marks]
    storages, ops = timeline.storages, timeline.ops
    roles: dict[str, Hashable] = {}
    stage, total, key = 0, 0, (0, role(""))
    for i, (kind, value) in enumerate(timeline.events):
        while stage < len(marks) and marks[stage] <= i:
            stage += 1
        if kind is EventKind.FREE:
            total -= storages[value].nbytes
            continue
        module = storages[value].module if kind is EventKind.ALLOC else ops[value].module
        if module not in roles:
            roles[module] = role(module)
        key = (stage, roles[module])
        if kind is EventKind.ALLOC:
            total += storages[value].nbytes
            candidate = total
        else:
            candidate = total + ops[value].workspace
        if candidate > peaks.get(key, -1):
            peaks[key] = candidate
    return peaks
