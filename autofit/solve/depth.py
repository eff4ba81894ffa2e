"""Full estimates of a deep model from simulations of the same model cut to a few blocks.

See Note [depth extrapolation] in autofit/capture/depth.py: which models, which configurations, how it is checked.
This module holds the pure parts: the depths a configuration is simulated at, the step as the cut model runs it,
and the line through the cut models' estimates carried to all the blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
from torch import nn

from autofit.analyse.table import OpCosts
from autofit.capture.depth import Blocks, block_of, names_at_depth, period_of, periodic_runs
from autofit.core.categories import Category
from autofit.core.report import MemoryEstimate
from autofit.simulate.timeline import Timeline, segment_peaks
from autofit.solve.checkpoint_milp import CheckpointProblem, solve_checkpoint, tied
from autofit.training.step import StepConfig


__all__ = ["DepthRun", "DepthGrid", "grouped_by_block", "solve_in_block_groups", "depth_runs", "depth_grid",
           "extrapolate_grid", "analysis_depth", "parameter_ratios", "config_at_depth", "extrapolate", "extended_ops",
           "period_ranges", "fallback_note", "overtaken", "SEGMENT_TOLERANCE", "OFF_LINE_CLEARANCE"]

# The CUDA figures built on segments (reserved, device, the smallest budget, fragmentation) move in steps of the
# caching allocator's segments: up to kLargeBuffer (20 MiB, c10/cuda/CUDACachingAllocator.cpp) per step. The line
# through two depths must predict the third within one such step; tensor figures must agree to the byte.
SEGMENT_TOLERANCE = 20 << 20
_SEGMENT_FIGURES = ("device_bytes", "peak_reserved_bytes", "min_device_bytes")
_SEGMENT_CATEGORIES = {str(Category.FRAGMENTATION), str(Category.ALLOCATOR_ROUNDING)}
_STARTS = (2, 4)  # the first depths tried, in periods: (2, 3, 4) periods, then (4, 5, 6)


@dataclass(frozen=True)
class DepthRun:
    """Simulate the model cut to the blocks of each of ``keeps`` and extrapolate to all ``blocks.count``: each keeps
    the blocks outside one periodic run whole, and of the run its first blocks, one ``period`` more each time;
    ``steps`` periods of the run are missing from the last."""

    blocks: Blocks
    period: int
    keeps: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    steps: int
    start: int = 0  # the run cut: its first block, and how many blocks it has in the full model
    length: int = 0

    def role(self, cut: int) -> Callable[[str], tuple]:
        """Where a module of the model cut to ``keeps[cut]`` stands, for Note [a stage that overtakes]: outside the
        blocks, a block before or after the run (counted from the run), the run's first or last block, or one
        between them (their peaks taken together)."""
        kept = len(self.keeps[cut]) - (self.blocks.count - self.length)  # the run's blocks in this cut

        def role(name: str) -> tuple:
            found = block_of(name, self.blocks)
            if found is None:
                return ("outside",)
            b = found[0]
            if b < self.start:
                return ("before", b)
            if b >= self.start + kept:
                return ("after", b - self.start - kept)
            if b < self.start + self.period:
                return ("first", b - self.start)
            if b >= self.start + kept - self.period:
                return ("last", b - self.start - kept + self.period)
            return ("between", (b - self.start) % self.period)
        return role

    @property
    def depths(self) -> tuple[int, ...]:
        return tuple(len(k) for k in self.keeps)

    @property
    def template(self) -> range:
        """Positions, in the deepest cut model, of the run's last kept period (what the missing periods repeat)."""
        keep = self.keeps[-1]
        end = next((n for n in range(1, len(keep)) if keep[n] != keep[n - 1] + 1), len(keep))
        return range(end - self.period, end)

    def original(self, position: int) -> int:
        """The full model's index of the deepest cut model's block at ``position``."""
        return self.keeps[-1][position]

    def ops(self, ops_of: Callable[[tuple[int, ...]], OpCosts]) -> OpCosts:
        """Per-op costs of the whole model from the cut models' (``ops_of(keep)``): the deepest one's, with one period
        of the run appended for each missing one."""
        shallow, deep = ops_of(self.keeps[1]), ops_of(self.keeps[2])
        ranges = period_ranges(shallow, deep, self.blocks, self.template)
        return extended_ops(deep, ranges, self.steps, self.blocks, self.period, keep=self.keeps[-1])


@dataclass(frozen=True)
class DepthGrid:
    """Cut every run of alike blocks at once: a base cut keeps ``base`` blocks of each run ``(start, end)`` (and every
    block outside them); each run then also one and two blocks longer, the others as in the base.

    Note [cutting every run]
        A plan's recomputed set is often two or three runs of blocks treated alike (all of the block recomputed,
        then only its norms; Note [recomputation grouped by block]). ``DepthRun`` cuts the longest and keeps the
        others whole: on the 70B-shaped Llama, 7 to 13 blocks kept whole, so 9 to 19 blocks per simulation. Every
        figure of the step is, where one stage of it dominates, affine in the number of blocks of each run (each
        block of a run adds the same bytes to it), so the grid simulates a base with every run cut to 2 blocks and,
        per run, that run at 3 and 4: 1 + 2 x runs simulations of a few blocks each. A figure is the base's plus, per
        run, the step its third block added times the blocks the run misses; the step the fourth adds must equal it
        (to the byte for tensor figures, within SEGMENT_TOLERANCE for segment figures), else the single-run cuts
        and then the full simulation are tried. The same approximation as Note [depth extrapolation]: agreeing steps
        make a change of the dominant stage further out unlikely, not impossible; the tests compare with the CPU
        allocator at full depth. On the CPU only: a CUDA target's segment figures move in allocator segments and are
        not yet on their lines at a few blocks per run. The 70B-shaped Llama's plan (runs of 67 and 11 blocks,
        FSDP2 resharded to 8 over 32 ranks): from a base of 2 blocks per run the reserved bytes stepped
        by 30 MiB then 1.03 GiB; from a base of 4 the allocated and reserved figures were on their lines to the byte
        but the smallest budget stepped by 454 then 406 MiB (over SEGMENT_TOLERANCE), so both grids were
        simulated for nothing before the single-run cut at 15 to 19 blocks."""

    blocks: Blocks
    runs: tuple[tuple[int, int], ...]
    base: int

    def keep(self, longer: int | None = None, by: int = 0) -> tuple[int, ...]:
        """The blocks kept: of each run its first ``base`` (``base + by`` for run ``longer``), every other block."""
        kept, position = [], 0
        for i, (start, end) in enumerate(self.runs):
            kept.extend(range(position, start))
            kept.extend(range(start, start + self.base + (by if i == longer else 0)))
            position = end
        kept.extend(range(position, self.blocks.count))
        return tuple(kept)

    @property
    def keeps(self) -> tuple[tuple[int, ...], ...]:
        return (self.keep(),) + tuple(self.keep(i, by) for i in range(len(self.runs)) for by in (1, 2))

    @property
    def depths(self) -> tuple[int, ...]:
        return tuple(len(k) for k in self.keeps)

    def missing(self, i: int) -> int:
        start, end = self.runs[i]
        return end - start - self.base

    def ops(self, ops_of: Callable[[tuple[int, ...]], OpCosts]) -> OpCosts:
        """Per-op costs of the whole model: the base cut's, and for each run its missing blocks' ops, copied from the
        block the cut one block longer adds (its forward, its backward: ``period_ranges``), named as the blocks
        they stand for (the time model prices a recomputed module by its ops' names)."""
        base_keep = self.keep()
        shallow = ops_of(base_keep)
        parts = [_full_names(shallow, self.blocks, base_keep)]
        for i, (start, _) in enumerate(self.runs):
            keep = self.keep(i, 1)
            deep = ops_of(keep)
            added = start + self.base  # the block the longer cut adds, as the full model numbers it
            at = keep.index(added)
            ranges = period_ranges(shallow, deep, self.blocks, range(at, at + 1))
            template = _rows(_full_names(deep, self.blocks, keep), [j for lo, hi in ranges for j in range(lo, hi)])
            parts.extend(_renamed(template, self.blocks, lambda b, k=k: b + k if b == added else b)
                         for k in range(self.missing(i)))
        return _concatenate(parts)


# Note [identical blocks solved in groups]
#     Above a few hundred units the checkpoint MILP stops at its 10 s limit (Note [no set in time],
#     solve/checkpoint_milp.py), and identical blocks are why: any set's treatments can be moved between blocks at
#     the same cost, so the solver meets thousands of equivalent sets and a weak bound. The 405B plan of issue 56
#     (126 blocks, 885 units with the selective ones, 6,581 stretches) solved twelve such programs, 6 to 13 s each,
#     and some of those with selective units found no set at all. Such a program is solved instead with the units of
#     consecutive blocks tied: one unit per (group of blocks, module within the block, policy), its cost and bytes
#     the sums over the group (``tied``), the groups sized to bring the program to about ``TIED_UNITS`` units. A set
#     of the tied program is a set of the whole one with the same peak and cost, so what it returns fits; it forgoes
#     the sets that treat the blocks of one group differently. Those matter little: the treatments are
#     rearranged into runs of blocks anyway (Note [recomputation grouped by block]), and a run's end can then only
#     fall on a group's. Measured on the four programs of that plan's TP 4 layout (two micro-batches, each with
#     and without selective units; one run, two cores), before -> tied (groups of 7 blocks, 129 units; of 5, 132):
#     with selective units, no set in 16.7 s and in 21.2 s (the depth level set was taken, 6.719e15 recompute
#     FLOPs) -> 6.469e15 in 1.0 and 1.2 s; without, 6.612e15 in 10.7 s -> 6.505e15 in 1.5 s, and 6.452e15 in 9.4 s
#     -> the same in 1.1 s. The whole program, stopped at its limit, found no cheaper set in any of them. Where the
#     tied program finds nothing, the whole program is solved as before.
TIED_UNITS = 128  # about this many units in blocks, in the tied program
_LARGE_PROGRAM = 400  # units: above, the whole program stops at its time limit (scipy's HiGHS, two cores)


def solve_in_block_groups(problem: CheckpointProblem, budget: int, blocks: Blocks | None) -> tuple[int, ...] | None:
    """``solve_checkpoint(problem, budget)``, with the units of consecutive identical ``blocks`` tied in groups
    where the program is large (Note [identical blocks solved in groups]); the whole program where the tied one
    finds no set."""
    parts = _block_groups(problem, blocks)
    if parts is not None:
        chosen = solve_checkpoint(tied(problem, parts), budget)
        if chosen is not None:
            return tuple(sorted(u for i in chosen for u in parts[i]))
    return solve_checkpoint(problem, budget)


def _block_groups(problem: CheckpointProblem, blocks: Blocks | None) -> list[list[int]] | None:
    """The units of ``problem`` partitioned into groups: those of one module and policy over consecutive blocks
    together, each other unit alone; None where the program is small enough to solve whole or the groups would be
    single blocks."""
    if blocks is None or len(problem.names) <= _LARGE_PROGRAM:
        return None
    where = [block_of(name, blocks) for name in problem.names]
    inside = sum(1 for found in where if found is not None and found[0] < blocks.count)
    per = math.ceil(inside / TIED_UNITS)  # blocks per group
    if per < 2:
        return None
    index: dict[tuple, int] = {}
    parts: list[list[int]] = []
    for u, found in enumerate(where):
        key = (found[0] // per, found[1], problem.policy(u)) if found is not None and found[0] < blocks.count \
            else ("alone", u)
        if key not in index:
            index[key] = len(parts)
            parts.append([])
        parts[index[key]].append(u)
    return parts


def grouped_by_block(problem: CheckpointProblem, chosen: tuple[int, ...], blocks: Blocks,
                     budget: float) -> tuple[int, ...]:
    """``chosen`` (units of ``problem``) with the identical blocks' treatments rearranged so that blocks treated alike
    are neighbours, when an arrangement keeps the modelled peak under ``budget`` at the same recompute cost; the
    arrangement with the lowest peak. Else ``chosen`` as it is.

    Note [recomputation grouped by block]
        The blocks are identical, so the checkpoint MILP is indifferent to which of them takes which treatment (all
        of it recomputed, selectively, only the MLP, nothing) but for the positional peak, and over many units it
        stops at a 1 % gap: on the 70B-shaped Llama it recomputed 11 of the 80 blocks selectively, scattered over
        blocks 0 to 70. Such a set repeats with no period, so its verification simulated 57 of the 80 blocks, three
        times (Note [depth extrapolation]: about 45 s per depth on two cores). The same treatments in contiguous
        runs cost the same FLOPs and the same step time (the time model prices a module by its name's ops, which are
        the same in every block); the longest run is then cut, the others kept whole. Heaviest recomputation first
        and lightest first are both priced by the MILP's own constraints (every stretch of the window), and the
        lower peak kept if under the budget; the verification that follows simulates the arrangement planned."""
    index: dict[tuple[int, str, str], int] = {}
    units: list[set[tuple[str, str]]] = [set() for _ in range(blocks.count)]
    for i, name in enumerate(problem.names):
        found = block_of(name, blocks)
        if found is not None and found[0] < blocks.count:
            index[(found[0], found[1], problem.policy(i))] = i
            units[found[0]].add((found[1], problem.policy(i)))
    if any(u != units[0] for u in units):  # a block lacks a unit the others have: not identical to the MILP
        return chosen
    treatment: list[list[tuple[str, str]]] = [[] for _ in range(blocks.count)]
    outside = []
    for i in chosen:
        found = block_of(problem.names[i], blocks)
        if found is None or found[0] >= blocks.count:
            outside.append(i)
        else:
            treatment[found[0]].append((found[1], problem.policy(i)))
    kinds = [tuple(sorted(t)) for t in treatment]
    if len(set(kinds)) < 2:
        return chosen
    weight = {k: sum(problem.costs[index[(b, *u)]] for u in k) for b, k in enumerate(kinds)}
    best, best_peak = chosen, None
    for heaviest_first in (True, False):
        order = sorted(kinds, key=lambda k: (-weight[k] if heaviest_first else weight[k], k))
        arranged = tuple(sorted(outside + [index[(b, *u)] for b, k in enumerate(order) for u in k]))
        if not problem.allowed(arranged) or problem.cost(arranged) > problem.cost(chosen) * (1 + 1e-9):
            continue
        peak = problem.peak(arranged)
        if peak <= budget and (best_peak is None or peak < best_peak):
            best, best_peak = arranged, peak
    return best


def _name_lists(config: StepConfig) -> tuple[tuple[str, ...], ...]:
    """Each list of module names the step treats specially (each must repeat over the blocks on its own)."""
    return (config.checkpoint, config.selective, config.op_selective, config.offload, config.layout.shard_units,
            config.precision.fp32_modules)


def _period(config: StepConfig, blocks: Blocks) -> int | None:
    period = 1
    for names in _name_lists(config):
        p = period_of(names, blocks)
        if p is None:
            return None
        period = math.lcm(period, p)
    return period if period <= blocks.count // 2 else None


def depth_runs(config: StepConfig, blocks: Blocks) -> tuple[DepthRun, ...]:
    """The cuts worth trying for ``config`` in order: the run of blocks over which its module names repeat with a
    period (periodic_runs) that the cut shortens most, cut to 2, 3, 4 periods, then 4, 5, 6, the other blocks kept whole (empty: the run
    is too short for the cut to be worth it)."""
    def removed(run):  # blocks the deepest cut leaves out of the run
        start, end, period = run
        return (end - start) - ((end - start) % period + period * (_STARTS[0] + 2))
    start, end, period = max(periodic_runs(_name_lists(config), blocks), key=removed, default=(0, 0, 1))
    length = end - start
    outside = tuple(range(start)), tuple(range(end, blocks.count))
    runs = []
    for first in _STARTS:
        lengths = tuple(length % period + period * (first + i) for i in range(3))
        if lengths[-1] < length:
            keeps = tuple(outside[0] + tuple(range(start, start + n)) + outside[1] for n in lengths)
            runs.append(DepthRun(blocks, period, keeps, (length - lengths[-1]) // period, start, length))
    return tuple(runs)


def depth_grid(config: StepConfig, blocks: Blocks) -> DepthGrid | None:
    """The grid that cuts every run of blocks treated alike (period 1) long enough to cut, when there are two or
    more (Note [cutting every run]); None otherwise (one run: ``depth_runs``)."""
    base = _STARTS[0]
    runs = tuple((start, end) for start, end, period in periodic_runs(_name_lists(config), blocks, max_period=1)
                 if end - start > base + 2)
    return DepthGrid(blocks, runs, base) if len(runs) >= 2 else None


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


def analysis_depth(config: StepConfig, blocks: Blocks) -> tuple[int, int] | None:
    """(depth, period) the analysis of ``config`` runs the cut model at (four periods, the third one the template
    of the blocks it adds, a block in the steady state: Note [extending an analysis in depth]); None: analyse the
    whole model."""
    period = _period(config, blocks)
    if period is None:
        return None
    depth = blocks.count % period + 4 * period
    return (depth, period) if depth < blocks.count else None


def parameter_ratios(full: nn.Module, cut: nn.Module) -> tuple[float, float, float]:
    """(all, trainable) parameter bytes and trainable parameter tensors of ``full`` over ``cut``'s."""
    def size(model, trainable):
        return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trainable)

    def count(model):
        return sum(1 for p in model.parameters() if p.requires_grad)
    return (size(full, False) / max(size(cut, False), 1), size(full, True) / max(size(cut, True), 1),
            count(full) / max(count(cut), 1))


def config_at_depth(config: StepConfig, blocks: Blocks, depth: int | tuple[int, ...]) -> StepConfig:
    """``config`` as the model cut to ``depth`` blocks (or to the blocks ``depth``) runs it: the module names under
    blocks not kept dropped, the others renumbered."""
    def cut(names):
        return names_at_depth(names, blocks, depth)
    precision = replace(config.precision, fp32_modules=cut(config.precision.fp32_modules))
    # the blocks take alike tensor-parallel styles, so the cut's k blocks take the plan's first k as they are named:
    # no renumbering, and the first block's sequence shard (Note [sequence parallel]) stays on the cut's first
    # block; names of blocks past the cut go (parallelize_module warns once for each name it cannot resolve)
    first = depth if isinstance(depth, int) else len(depth)
    tensor_plan = tuple(pair for pair in config.layout.tensor_plan if names_at_depth((pair[0],), blocks, first))
    layout = replace(config.layout, shard_units=cut(config.layout.shard_units), tensor_plan=tensor_plan)
    return replace(config, checkpoint=cut(config.checkpoint), selective=cut(config.selective),
                   op_selective=cut(config.op_selective), offload=cut(config.offload), precision=precision,
                   layout=layout)


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
                 "those depths (Note [segment figures in depth], autofit/solve/depth.py)")
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


def extended_ops(ops: OpCosts, ranges: tuple[tuple[int, int], ...], copies: int, blocks: Blocks,
                 period: int, keep: tuple[int, ...] | None = None, first: int | None = None) -> OpCosts:
    """Per-op costs of the cut model with ``copies`` more copies of each op range ``[lo, hi)`` (one period of
    blocks: their forward, their backward), appended; an op of template block t is renamed to block t + period * k in
    the k-th copy. Order within the array does not matter to the time model (it sums per precision and masks the
    recomputed modules' forward ops by name)."""
    if keep is not None:  # the cut model's block numbers, as the full model names them
        ops = _full_names(ops, blocks, keep)
    template = _rows(ops, [j for lo, hi in ranges for j in range(lo, hi)])  # named before the shift below
    if first is not None:  # blocks from ``first`` on come after the copies
        ops = _renamed(ops, blocks, lambda b: b + copies * period if b >= first else b)
    if not template.module or not copies:
        return ops
    return _concatenate([ops] + [_renamed(template, blocks, lambda b, k=k: b + period * k)
                                 for k in range(1, copies + 1)])


def _renamed(ops: OpCosts, blocks: Blocks, index: Callable[[int], int]) -> OpCosts:
    """``ops`` with the ops of block b named as block ``index(b)``."""
    return replace(ops, module=tuple(m if (f := block_of(m, blocks)) is None else f"{blocks.path}.{index(f[0])}{f[1]}"
                                     for m in ops.module))


def _full_names(ops: OpCosts, blocks: Blocks, keep: tuple[int, ...]) -> OpCosts:
    """``ops`` of the model cut to the blocks ``keep``, its blocks named as the full model numbers them."""
    return _renamed(ops, blocks, keep.__getitem__)


def _rows(ops: OpCosts, take: list[int]) -> OpCosts:
    """The ops at positions ``take``, in that order."""
    idx = np.array(take, dtype=np.int64)

    def pick(a):
        return None if a is None else a[idx]
    return OpCosts(pick(ops.flops_fixed), pick(ops.flops_per_sample), pick(ops.bytes_fixed),
                   pick(ops.bytes_per_sample), tuple(ops.precision[j] for j in take), pick(ops.forward),
                   tuple(ops.module[j] for j in take), pick(ops.kept), pick(ops.op_selective))


def _concatenate(parts: list[OpCosts]) -> OpCosts:
    """The ops of ``parts`` one after the other (no op kept where a part has no ``kept`` array)."""
    def cat(attr):
        arrays = [getattr(p, attr) for p in parts]
        if all(a is None for a in arrays):
            return None
        return np.concatenate([a if a is not None else np.zeros(len(p.module), dtype=bool)
                               for a, p in zip(arrays, parts)])
    return OpCosts(cat("flops_fixed"), cat("flops_per_sample"), cat("bytes_fixed"), cat("bytes_per_sample"),
                   tuple(x for p in parts for x in p.precision), cat("forward"),
                   tuple(m for p in parts for m in p.module), cat("kept"), cat("op_selective"))


def period_ranges(shallow: OpCosts, deep: OpCosts, blocks: Blocks, template: range) -> tuple[tuple[int, int], ...]:
    """The op ranges of one period of blocks in ``deep`` (the cut model at ``depth`` blocks), from ``shallow`` (one
    period fewer): the forward ops of its last period's blocks, and the backward ops ``deep`` has beyond
    ``shallow``'s, where the two backward sequences part (backward ops carry no module name). ``template``: the
    positions of that period's blocks in ``deep``."""
    forward = [j for j, m in enumerate(deep.module) if deep.forward[j] and (f := block_of(m, blocks)) is not None
               and f[0] in template]
    previous = [j for j, m in enumerate(deep.module) if deep.forward[j] and (f := block_of(m, blocks)) is not None
                and f[0] == template[0] - 1]
    if not forward:
        return ()
    # start to start: the forward ops that run between the previous block and the template (FSDP2's gather copies)
    # belong to the period too
    first = previous[-1] + 1 if previous else forward[0]
    back_deep = [j for j in range(len(deep.module)) if not deep.forward[j]]
    back_shallow = [j for j in range(len(shallow.module)) if not shallow.forward[j]]
    extra = len(back_deep) - len(back_shallow)
    common = 0
    while (common < len(back_shallow) and common < len(back_deep)
           and _same_op(deep, back_deep[common], shallow, back_shallow[common])):
        common += 1
    ranges = [(first, forward[-1] + 1)]
    if extra > 0 and common + extra <= len(back_deep):
        ranges.append((back_deep[common], back_deep[common + extra - 1] + 1))
    return tuple(ranges)


def _same_op(a: OpCosts, i: int, b: OpCosts, j: int) -> bool:
    return (a.precision[i] == b.precision[j] and a.flops_per_sample[i] == b.flops_per_sample[j]
            and a.bytes_per_sample[i] == b.bytes_per_sample[j])
