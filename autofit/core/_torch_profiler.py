"""The torch boundary for the profiler's memory record, beside ``_torch.py``: what a ``profile_memory=True`` CPU
profile recorded, read from its event tree (``kineto_results.experimental_event_tree``, the allocator's own record;
no public API names it): every allocation and free in time order, one thread's memory (Note [gloo's threads in the
measured window], measure/ranks.py) with the frees the profiler missed put back (Note [a free the profiler did not
record]), each ``record_function`` window's high-water mark; and the profile itself without Kineto's stderr lines
(:class:`memory_profile`, :func:`quiet_native_output`). The private symbol it reads (``EventType``) is checked at
import in ``_torch.py``.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from autofit.core._torch import EventType

__all__ = [
    "allocation_sizes", "window_memory", "thread_memory", "high_water_mark", "memory_profile", "quiet_native_output",
]


def _allocation_events(prof: torch.profiler.profile, thread_of: str | None,
                       span: str | None = None) -> tuple[list[tuple[int, int, int, int]], set[int], list[tuple[int, int]]]:
    """``(time, size, thread id, address)`` of every Allocation event a ``profile_memory=True`` CPU profile
    recorded, in time order (negative size on free), read from the profiler's event tree (``kineto_results.
    experimental_event_tree``), the allocator's own record; the thread ids that ran the ``record_function`` named
    ``thread_of``; and the (start, end) times of the ``record_function`` calls named ``span``, in order."""
    events: list[tuple[int, int, int, int]] = []
    marks: set[int] = set()
    spans: list[tuple[int, int]] = []
    waits: list[tuple[int, int]] = []  # (thread id, end) of each collective wait
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == EventType.Allocation:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, node.start_tid, fields.ptr))
        elif thread_of is not None and node.name == thread_of:
            marks.add(node.start_tid)
        elif span is not None and node.name == span:
            spans.append((node.start_time_ns, node.end_time_ns))
        elif thread_of is not None and node.name.endswith("wait_tensor"):
            waits.append((node.start_tid, node.end_time_ns))
        stack.extend(node.children)
    events.sort(key=lambda e: e[0])
    if thread_of is not None:
        events = _freed_at_completion(events, marks, sorted(end for tid, end in waits if tid in marks))
    return events, marks, sorted(spans)


# Note [a free the profiler did not record]
#     The CPU profiler records an allocator event on the threads it follows; a tensor of the rank's whose last
#     reference gloo's worker drops can be freed on a thread it does not follow, and then no free is recorded at all.
#     A CI run measured sequence parallel's rank 1 32,768 B high in all three windows: one all-gather's 32 KiB tensor
#     allocated on the rank's thread, no free event, its address handed out again 35 events later (a rank measured
#     alongside other gloo jobs on two cores; the same tensor idle is freed on the rank's thread before its wait
#     ends). The allocator hands out no address still in use, so an allocation at an address the rank allocated and
#     never freed proves the free: it is put at the end of the rank's first collective wait after the allocation
#     (where the collective that held it completed, as for the frees gloo's thread does record), or just before the
#     reuse where no wait comes between. An unrecorded free whose address is not reused inside the window stays
#     unseen.
UNRECORDED_THREAD = -1  # the thread id of an inferred free: no thread the profiler followed


def _freed_at_completion(events: list[tuple[int, int, int, int]], marks: set[int],
                         waits: list[int]) -> list[tuple[int, int, int, int]]:
    """The events with each free that another thread made of a marked thread's allocation moved back to the end of
    the marked thread's last collective wait before it (and after the allocation). gloo's worker signals a
    collective complete, then drops the work and the rank's tensors it holds: on a loaded machine the rank's thread
    has allocated its next tensors by then, and the free landing after them counted a tensor the step no longer
    held (a CI run measured a tensor-parallel rank 32,768 B high in each of three windows: Note [gloo's threads in
    the measured window], measure/ranks.py). The wait's end is when the step let go of it, as NCCL's job does. And a
    free the profiler did not record at all is put back where an address the marked thread holds is handed out
    again (Note [a free the profiler did not record])."""
    allocated_by_mark: dict[int, tuple[int, int]] = {}  # address -> (time, bytes) of a marked thread's allocation
    moved = []
    for time, size, tid, ptr in events:
        if size > 0:
            if ptr in allocated_by_mark:  # its free went unrecorded (Note [a free the profiler did not record])
                allocated, nbytes = allocated_by_mark.pop(ptr)
                first = bisect.bisect_right(waits, allocated)  # the first wait ending after the allocation
                moved.append((waits[first] if first < len(waits) and waits[first] < time else time, -nbytes,
                              UNRECORDED_THREAD, ptr))
            if tid in marks:
                allocated_by_mark[ptr] = time, size
        elif ptr in allocated_by_mark:
            allocated, _ = allocated_by_mark.pop(ptr)
            if tid not in marks:  # gloo's worker dropped it: back to the rank's last wait before the free
                i = bisect.bisect_left(waits, time) - 1
                if i >= 0 and waits[i] > allocated:
                    time = waits[i]
        moved.append((time, size, tid, ptr))
    moved.sort(key=lambda e: e[0])  # stable: a free moved to a wait's end stays after what came before it there
    return moved


def allocation_sizes(prof: torch.profiler.profile, thread_of: str | None = None) -> list[int]:
    """Bytes of every Allocation event a ``profile_memory=True`` CPU profile recorded, in time order; negative on
    free: the ground truth where there is no GPU (docs/accuracy.md). ``thread_of``: only the memory of the thread
    that ran the ``record_function`` of that name (the profiler's own thread ids), as :func:`thread_memory` reads it.
    The profiler reports no free of memory allocated while no memory profile ran (Note [memory from before the
    window], measure/allocator.py)."""
    events, marks, _ = _allocation_events(prof, thread_of)
    if thread_of is None:
        return [size for _, size, _, _ in events]
    return thread_memory([(size, tid, ptr) for _, size, tid, ptr in events], marks)


def window_memory(prof: torch.profiler.profile, span: str, thread_of: str | None = None,
                  known: Sequence[set[int]] = ()) -> list[tuple[dict[int, int], int]]:
    """Of a ``profile_memory=True`` CPU profile whose code ran ``record_function(span)`` one or more times, one after
    another, for each span: what the profile had seen allocated and not freed when it began (``{address: bytes}``),
    and its high-water mark above the bytes alive then. One profile holds what comes before the spans and the spans
    themselves, so no free between them goes unseen (Note [memory from before the window], measure/allocator.py).
    ``thread_of``: only the memory of the thread that ran the ``record_function`` of that name, as
    :func:`thread_memory` counts it; and of what was alive when a span began, only the ``known`` addresses (the
    step's own tensors, read before each span: one set per span) count, and the frees of the rest do not: a rank's tensor still alive when a window begins
    may be in gloo's hands, freed by its thread whenever it gets there (Note [gloo's threads in the measured
    window])."""
    events, marks, spans = _allocation_events(prof, thread_of, span)
    if not spans:
        raise AssertionError(f"the profile ran no record_function({span!r})")
    ours = (lambda tid: True) if thread_of is None else (lambda tid: tid in marks)
    live: dict[int, int] = {}  # address -> bytes of what counts and is not freed yet
    windows: list[tuple[dict[int, int], int]] = []
    position = 0
    for i, (start, end) in enumerate(spans):
        while position < len(events) and events[position][0] < start:
            _count(events[position], live, ours)
            position += 1
        unknown: set[int] = set()  # alive at the start, not the step's own: neither it nor its free counts
        if thread_of is not None:
            ours_then = known[i] if i < len(known) else set()
            unknown = {a for a in live if a not in ours_then}
            for address in unknown:
                del live[address]
        at_start, running, peak = dict(live), 0, 0
        while position < len(events) and events[position][0] <= end:
            event = events[position]
            position += 1
            if event[3] in unknown:
                unknown.discard(event[3])
                if event[1] < 0:
                    continue
            running += _count(event, live, ours)
            peak = max(peak, running)
        windows.append((at_start, peak))
    return windows


def _count(event: tuple[int, int, int, int], live: dict[int, int], ours: Callable[[int], bool]) -> int:
    """Apply one allocation event to ``live`` (what counts and is not freed yet); the bytes it counts: an allocation
    by one of ``ours`` threads, a free on one of them, and a free of what they allocated (:func:`thread_memory`)."""
    _, size, tid, ptr = event
    if size > 0:
        if not ours(tid):
            live.pop(ptr, None)  # the address now holds another thread's tensor
            return 0
        live[ptr] = size
        return size
    if live.pop(ptr, None) is None and not ours(tid):
        return 0  # another thread's free of what is not ours
    return size


def thread_memory(events: list[tuple[int, int, int]], marks: set[int]) -> list[int]:
    """Of ``(size, thread id, address)`` allocation events in time order (negative size on free), the sizes that are
    the memory of the threads in ``marks``: their allocations and every free on them, and the frees of their
    allocations on any other thread (matched by address). Note [gloo's threads in the measured window]
    (measure/ranks.py): gloo's worker can drop the last reference to a tensor the rank's thread allocated, and
    counted by thread that free would be lost, the window keeping its bytes for good. Another thread's
    allocations do not count."""
    mine: set[int] = set()  # addresses the marked threads allocated and have not seen freed
    sizes = []
    for size, tid, ptr in events:
        if size > 0:
            if tid in marks:
                mine.add(ptr)
                sizes.append(size)
            else:
                mine.discard(ptr)  # the address now holds another thread's tensor
        elif ptr in mine:
            mine.discard(ptr)
            sizes.append(size)
        elif tid in marks:
            sizes.append(size)
    return sizes


def high_water_mark(sizes: list[int]) -> tuple[int, int]:
    """(highest running sum, final running sum) of allocation sizes (negative on free), in order."""
    running = peak = 0
    for size in sizes:
        running += size
        peak = max(peak, running)
    return peak, running


@contextlib.contextmanager
def quiet_native_output(fds: tuple[int, ...] = (2,)) -> Iterator[None]:
    """Send what native code writes to these file descriptors to /dev/null for a while. Kineto prints a
    'profiler_start' / 'profiler_stop' line on the C stderr each time a profiler starts and stops, whatever its log
    level (autofit starts one per kernel probe); HiGHS prints solver internals on stdout."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {}
    try:
        for fd in fds:
            saved[fd] = os.dup(fd)
    except OSError:  # no such descriptor (embedded interpreters): nothing to silence
        for fd in saved.values():
            os.close(fd)
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            for fd in fds:
                os.dup2(devnull.fileno(), fd)
        yield
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


class memory_profile:  # noqa: N801 - used like torch.profiler.profile
    """``torch.profiler.profile(activities=[CPU], profile_memory=True)`` without Kineto's stderr lines."""

    def __enter__(self):
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with quiet_native_output():
            self._prof.__enter__()
        return self._prof

    def __exit__(self, *exc):
        with quiet_native_output():
            return self._prof.__exit__(*exc)
