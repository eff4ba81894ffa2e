"""Full estimates of a deep model from simulations of the same model cut to a few blocks: the line through the cut
models' estimates carried to all the blocks.

See Note [depth extrapolation] in autofit/capture/depth.py: which models, which configurations, how it is checked.
The cuts (``DepthRun``, ``DepthGrid``) and the step as the cut model runs it: autofit/solve/depth.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from autofit.capture.depth import Blocks
from autofit.core.categories import Category
from autofit.core.report import MemoryEstimate
from autofit.simulate.timeline import Timeline, segment_peaks
from autofit.solve.depth import DepthGrid, DepthRun


__all__ = ["extrapolate_grid", "extrapolate", "fallback_note", "overtaken", "SEGMENT_TOLERANCE", "OFF_LINE_CLEARANCE"]

# The CUDA figures built on segments (reserved, device, the smallest budget, fragmentation) move in steps of the
# caching allocator's segments: up to kLargeBuffer (20 MiB, c10/cuda/CUDACachingAllocator.cpp) per step. The line
# through two depths must predict the third within one such step; tensor figures must agree to the byte.
SEGMENT_TOLERANCE = 20 << 20
_SEGMENT_FIGURES = ("device_bytes", "peak_reserved_bytes", "min_device_bytes")
_SEGMENT_CATEGORIES = {str(Category.FRAGMENTATION), str(Category.ALLOCATOR_ROUNDING)}


def extrapolate_grid(grid: DepthGrid, ests: tuple[MemoryEstimate, ...]) -> MemoryEstimate | None:
    """The estimate at all the blocks from the grid's (in ``grid.keeps`` order): each figure the base's plus, per run,
    the step one block more adds times the blocks it misses; None when for some run and figure the second step
    differs from the first (to the byte; segment figures within SEGMENT_TOLERANCE)."""
    base, axes = ests[0], [(ests[1 + 2 * i], ests[2 + 2 * i]) for i in range(len(grid.runs))]

    def carried(values: list[tuple[int, int, int]], tolerance: int) -> int | None:
        total = values[0][0]
        for i, (v0, v1, v2) in enumerate(values):
            if abs((v2 - v1) - (v1 - v0)) > tolerance:
                return None
            total += (v1 - v0) * grid.missing(i)
        return total

    figures = {}
    for attr in ("peak_bytes", "host_bytes", *_SEGMENT_FIGURES):
        value = carried([(getattr(base, attr), getattr(a, attr), getattr(b, attr)) for a, b in axes],
                        SEGMENT_TOLERANCE if attr in _SEGMENT_FIGURES else 0)
        if value is None:
            return None
        figures[attr] = value
    maps = {}
    for attr, loose in (("breakdown", _SEGMENT_CATEGORIES), ("host_breakdown", set())):
        out = {}
        for key in sorted(set().union(*(getattr(e, attr) for e in ests))):
            value = carried([(getattr(base, attr).get(key, 0), getattr(a, attr).get(key, 0),
                              getattr(b, attr).get(key, 0)) for a, b in axes],
                            SEGMENT_TOLERANCE if key in loose else 0)
            if value is None:
                return None
            if value:
                out[key] = value
        maps[attr] = out
    note = (f"depth extrapolation: simulated with {', '.join(map(str, grid.depths))} of the {grid.blocks.count} "
            f"identical blocks of {grid.blocks.path}, each of its {len(grid.runs)} runs of blocks treated alike cut "
            f"to {grid.base} blocks in turn grown by one and two, and carried to all of them (the first step of each "
            f"run predicts its second: tensor figures to the byte, reserved ones within 20 MiB; Note [cutting every "
            f"run], autofit/solve/depth.py)")
    return _carried(base, figures, maps["breakdown"], maps["host_breakdown"], note, grid.depths[0])


def overtaken(run: DepthRun, timelines: tuple[Timeline, Timeline, Timeline]) -> bool:
    """Whether a segment of the step whose peak is below the step's at the cut depths overtakes it at the full
    depth (Note [a stage that overtakes]); ``timelines`` are the cut models', in ``run.keeps`` order.

    Note [a stage that overtakes]
        A step's peak is the maximum over its stages, each on its own line in the depth, so the peak is on a line
        only from the depth where one stage dominates: three depths on a line do not show a stage that overtakes
        further out. The 12-block Llama with blocks 0-5 recomputed and 6-11 not, cut along the recomputed run (8,
        9, 10 blocks), peaks at the end of the step on a line that carries to 8,469,604 B; at 12 blocks the peak is
        in the recomputation of block 0, 8,606,116 B on the CPU allocator. So each segment of the step is carried on
        its own line: a stage (between two marks of the timeline) and the block it runs, as the run's first or
        last period, a block between them, a block before or after the run, or outside the blocks (the run's middle
        blocks grow in number with the depth; the ends are where a peak that moves along the run stands). Where the
        largest carried segment is above the carried peak, a segment overtakes: the extrapolation is not used (the
        next cut is tried, else the whole model simulated). Carried peaks of the segments are tensor bytes, the
        same for the CPU and CUDA targets (the segments' reserve moves with them)."""
    peaks = [segment_peaks(t, run.role(i)) for i, t in enumerate(timelines)]
    steps = run.steps
    overall = [max(p.values(), default=0) for p in peaks]
    carried = overall[2] + (overall[2] - overall[1]) * steps
    keys = set(peaks[1]) & set(peaks[2])
    return any(peaks[2][k] + (peaks[2][k] - peaks[1][k]) * steps > carried for k in keys)


def _line(values: tuple[int, int, int], steps: int, tolerance: int) -> int | None:
    """The value ``steps`` periods past the third, on the line through the second and third; None when the line
    through the first two misses the third by more than ``tolerance``."""
    a, b, c = values
    if abs((b + (b - a)) - c) > tolerance:
        return None
    return c + (c - b) * steps


_ROUNDING = str(Category.ALLOCATOR_ROUNDING)
_FRAGMENTATION = str(Category.FRAGMENTATION)


def _jittery(values: tuple[int, int, int], steps: int) -> int:
    """The CUDA allocator's rounding (tensors rounded up to 512 bytes) carried ``steps`` periods past the third: its
    largest value plus the growth from the first to the third, per period, when it grows. It alternates between
    depths (Llama-3-70B-shaped, states on the host: 9,372, 42,204, 9,500, 42,332, 9,628 bytes at 8 to 12 blocks),
    so it is carried above its line rather than along it; a few KiB either way."""
    return max(values) + max(0, (values[2] - values[0]) // 2) * steps


def _mapping(ests: tuple[MemoryEstimate, ...], attr: str, steps: int) -> dict[str, int] | None:
    """Each category of ``attr`` (a breakdown) carried along its line, to the byte; the allocator's rounding carried
    by ``_jittery`` and the fragmentation left out (``_carried`` makes it the reserve above the allocated peak)."""
    maps = [getattr(e, attr) for e in ests]
    out = {}
    for key in sorted(set().union(*maps) - {_FRAGMENTATION}):
        values = tuple(m.get(key, 0) for m in maps)
        value = _jittery(values, steps) if key == _ROUNDING else _line(values, steps, 0)
        if value is None:
            return None
        if value:
            out[key] = value
    return out


# How far from the budget a smallest budget carried with segment figures off their line must be to be kept: five
# times the error measured on the 70B-shaped plan (Note [segment figures in depth]); nearer, the allocator is
# replayed over the whole step's timeline, else the model simulated whole.
OFF_LINE_CLEARANCE = 0.01


def extrapolate(run: DepthRun, ests: tuple[MemoryEstimate, ...], fit_bytes: int | None = None,
                whole: Callable[[], MemoryEstimate | None] | None = None) -> MemoryEstimate | None:
    """The estimate at ``run.blocks.count`` blocks from the estimates at ``run.depths``, or None when some tensor
    figure is not on a line, or a segment figure is not and the smallest budget so carried is within
    OFF_LINE_CLEARANCE of ``fit_bytes`` (the caller tries larger depths, then the full simulation), unless
    ``whole`` gives the device's estimate of the whole step's timeline built from the cuts' (Note [a timeline
    extended in depth], autofit/simulate/depth.py): its figures are then the segment figures, exact.

    Note [segment figures in depth]
        The tensor figures (the allocated peak less the allocator's rounding, the host bytes, each category) must be
        on their line to the byte. The segment figures (reserved, device, smallest budget) are the larger of their
        own line and the allocated peak's line plus the deepest depth's reserve above it: a small model's segments
        fill in steps, and their line can fall below the allocated bytes; the reserve beyond the allocated blocks
        never shrinks with more blocks. Where a segment figure is off its line (by more than SEGMENT_TOLERANCE),
        it is the allocated peak's line plus the largest reserve above the allocated peak at the three depths: the
        caching allocator reuses its cached segments, so the reserve stops growing once a few blocks fill them.
        Llama-3-70B-shaped, 8 x H100 with the states on the host, micro-batch 2 x 2: the reserved bytes at 8 to 12
        blocks were 65.48, 67.19, 67.96, 68.13, 68.13 GB, the allocated 46.08 GB plus 268.4 MB per block (the
        reserve above it 19.39, 20.84, 21.34, 21.24, 20.97 GB); the smallest budget 0.91, 0.91, 0.91, 0.88, 0.84 GB
        above the allocated. The full simulation of that step at 80 blocks (benchmarks/multi_gpu_70b.py --nodes 1
        --check-depth): allocated 65,411,135,488 B (carried 32,704 B above: the rounding), host bytes
        equal, smallest budget 66,431,483,904 B against 66,322,823,104 B carried (-0.16 %: its reserve above the
        allocated grew to 1.02 GB), reserved 89.74 GB against 86.75 GB carried (-3.3 %). So the carried figures
        are approximate, and only the smallest budget decides whether a step fits (``MemoryEstimate.within``): a
        carried one within OFF_LINE_CLEARANCE of the budget is not trusted. The caller then passes ``whole``: the
        caching allocator replayed over the whole step's timeline built from the cuts' (Note [a timeline extended
        in depth], autofit/simulate/depth.py), whose figures are the whole simulation's to the byte on that
        70B-shaped plan (80 blocks from 8, 9, 10; smallest budget 79,253,471,232 B, reserved 108,026,396,672 B,
        both equal) for the cost of a few replays instead of a simulation of 80 blocks. Where the timeline cannot be
        built, the step is simulated in full."""
    steps = run.steps
    rounding = tuple(e.breakdown.get(_ROUNDING, 0) for e in ests)
    exact = _line(tuple(e.peak_bytes - r for e, r in zip(ests, rounding)), steps, 0)
    host_bytes = _line(tuple(e.host_bytes for e in ests), steps, 0)
    breakdown = _mapping(ests, "breakdown", steps)
    host = _mapping(ests, "host_breakdown", steps)
    if exact is None or host_bytes is None or breakdown is None or host is None:
        return None
    figures = {"peak_bytes": exact + _jittery(rounding, steps), "host_bytes": host_bytes}
    off = []
    for attr in _SEGMENT_FIGURES:
        value = _line(tuple(getattr(e, attr) for e in ests), steps, SEGMENT_TOLERANCE)
        if value is None:  # Note [segment figures in depth]
            value = figures["peak_bytes"] + max(getattr(e, attr) - e.peak_bytes for e in ests)
            off.append(attr)
        figures[attr] = value
    if off and fit_bytes is not None and abs(figures["min_device_bytes"] - fit_bytes) < OFF_LINE_CLEARANCE * fit_bytes:
        exact = whole() if whole is not None else None
        return None if exact is None else _replayed(run, exact, figures, host, ests[-1])
    note = (f"depth extrapolation: simulated with {', '.join(map(str, run.depths))} of the {run.blocks.count} "
            f"identical blocks of {run.blocks.path} and carried to all of them along the line through the last two "
            f"(the first predicts the third: tensor figures to the byte, reserved ones within 20 MiB; Note [depth "
            f"extrapolation], autofit/capture/depth.py)")
    if off:
        note += (f"; {', '.join(off)} off their line: the allocated peak's line plus the largest reserve above it at "
                 "those depths (Note [segment figures in depth], autofit/solve/extrapolate.py)")
    return _carried(ests[-1], figures, breakdown, host, note, run.depths[-1])


def _replayed(run: DepthRun, exact: MemoryEstimate, figures: dict[str, int], host: dict[str, int],
              last: MemoryEstimate) -> MemoryEstimate:
    """The estimate of the whole model whose device figures are ``exact``'s (the allocator replayed over the whole
    step's timeline built from the cuts'), its host figures carried along their lines (the host's events are not
    extended), its peak named as the deepest cut's."""
    note = (f"depth extrapolation: simulated with {', '.join(map(str, run.depths))} of the {run.blocks.count} "
            f"identical blocks of {run.blocks.path}; the whole step's allocations built from theirs, each period "
            f"they add copied, and replayed through the caching allocator (Note [a timeline extended in depth], "
            f"autofit/simulate/depth.py)")
    notes = last.notes + (note,)
    carried = dict(host_bytes=figures["host_bytes"], host_breakdown=host, peak_phase=last.peak_phase,
                   peak_at=f"{last.peak_at} (at {run.depths[-1]} blocks)" if last.peak_at else "")

    def under(budget: int) -> MemoryEstimate | None:  # the replay under the budget: exact too
        inner = None if exact.under is None else exact.under(budget)
        if inner is None:
            return None
        return replace(inner, **carried, notes=notes + inner.notes[len(exact.notes):], under=None)
    return replace(exact, **carried, notes=notes, under=under)


def _carried(last: MemoryEstimate, figures: dict[str, int], breakdown: dict[str, int], host: dict[str, int],
             note: str, depth: int) -> MemoryEstimate:
    """The estimate of the whole model from the cut model's ``last`` (simulated at ``depth`` blocks) and the
    figures carried to all blocks."""
    growth = figures["peak_bytes"] - last.peak_bytes
    for attr in _SEGMENT_FIGURES:
        figures[attr] = max(figures[attr], getattr(last, attr) + growth)
    _set_fragmentation(breakdown, figures["peak_reserved_bytes"], figures["peak_bytes"],
                       new=figures["peak_reserved_bytes"] > figures["peak_bytes"])
    shift = {attr: figures[attr] - getattr(last, attr) for attr in figures}
    return replace(last, breakdown=breakdown, host_breakdown=host, notes=last.notes + (note,),
                   peak_at=f"{last.peak_at} (at {depth} blocks)" if last.peak_at else "",
                   under=_under(last, shift, _by_category(last.breakdown, breakdown, sign=-1),
                                _by_category(last.host_breakdown, host, sign=-1), note), **figures)


def _set_fragmentation(breakdown: dict[str, int], reserved: int, peak: int, *, new: bool = False) -> None:
    """``breakdown``'s fragmentation, in place: the reserve above the allocated peak, where the breakdown has the
    category (or ``new``: where it should gain it)."""
    fragmentation = str(Category.FRAGMENTATION)
    if fragmentation in breakdown or new:
        breakdown[fragmentation] = reserved - peak


def _by_category(first: Mapping[str, int], second: Mapping[str, int], *, sign: int = 1) -> dict[str, int]:
    """``second`` plus ``sign`` times ``first``, category by category, in the order ``first``'s then ``second``'s
    categories come: each category's growth from a cut model's breakdown to the whole model's (``sign=-1``), or a
    breakdown grown by such a growth."""
    return {key: sign * first.get(key, 0) + second.get(key, 0) for key in dict.fromkeys([*first, *second])}


def fallback_note(blocks: Blocks, tried: tuple[DepthRun, ...], cheaper_only: bool = False) -> str:
    """What the estimate's notes say when depth extrapolation was allowed but not used (``cheaper_only``: cuts of
    as many blocks in all as the whole model were not tried)."""
    if cheaper_only:
        tried = tuple(r for r in tried if sum(r.depths) < blocks.count)
    if not tried:
        why = "no run of blocks repeating the configuration's modules with a period is long enough to cut"
        if cheaper_only:
            why = ("no run of blocks repeating the configuration's modules with a period cuts to fewer blocks in "
                   "all than the whole model")
    else:
        why = ("the figures at " + "; ".join(", ".join(map(str, r.depths)) for r in tried) + " blocks are not on a "
               "line, or a stage of the step overtakes the peak beyond them (Note [a stage that overtakes])")
    return (f"depth extrapolation not used ({why}): all {blocks.count} blocks of {blocks.path} simulated "
            "(Note [depth extrapolation], autofit/capture/depth.py)")


def _under(last: MemoryEstimate, shift: dict[str, int], grown: dict[str, int], host_grown: dict[str, int],
           note: str):
    """The estimate under a budget: the deepest simulation's replay under the budget less the extrapolated growth,
    shifted by that growth, its figures and each category of its breakdowns (approximate: the cap's effect on the
    extra blocks' segments is the same as on theirs). The breakdowns were once left as the cut model's: a 3B
    model's plan under its budget read 2.64 GiB of parameters for 6.4 GB (tests/test_fine_tuning_plans.py)."""
    if last.under is None:
        return None

    def under(budget: int) -> MemoryEstimate | None:
        inner = last.under(budget - shift["device_bytes"])
        if inner is None:
            return None
        moved = {attr: getattr(inner, attr) + delta for attr, delta in shift.items()}
        breakdown, host = _by_category(inner.breakdown, grown), _by_category(inner.host_breakdown, host_grown)
        _set_fragmentation(breakdown, moved.get("peak_reserved_bytes", inner.peak_reserved_bytes),
                           moved.get("peak_bytes", inner.peak_bytes))
        return replace(inner, notes=inner.notes + (note + "; under the budget, the deepest simulation's allocator "
                                                   "replay under the budget less that growth (approximate)",),
                       under=None, breakdown=breakdown, host_breakdown=host, **moved)
    return under
