"""Full estimates of a deep model from simulations of the same model cut to a few blocks: the cuts.

See Note [depth extrapolation] in autofit/capture/depth.py: which models, which configurations, how it is checked.
This module holds the pure parts of the cut: the depths a configuration is simulated at (``DepthRun``,
``DepthGrid``), the step as the cut model runs it, and the per-op costs of the whole model from the cut models'.
The line through the cut models' estimates carried to all the blocks: autofit/solve/extrapolate.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from torch import nn

from autofit.analyse.table import OpCosts
from autofit.capture.depth import Blocks, block_of, names_at_depth, period_of, periodic_runs
from autofit.parallel.depth import at_depth, renamed_in_depth
from autofit.training.step import StepConfig


__all__ = ["DepthRun", "DepthGrid", "depth_runs", "depth_grid", "analysis_depth", "parameter_ratios",
           "config_at_depth", "extended_ops", "period_ranges"]

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


def _name_lists(config: StepConfig) -> tuple[tuple[str, ...], ...]:
    """Each list of module names the step treats specially (each must repeat over the blocks on its own)."""
    return (config.checkpoint, config.selective, config.op_selective, config.offload,
            *renamed_in_depth(config.layout), config.precision.fp32_modules)


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
    first = depth if isinstance(depth, int) else len(depth)  # the tensor plan's modules kept as named (at_depth)
    layout = at_depth(config.layout, cut, lambda name: bool(names_at_depth((name,), blocks, first)))
    return replace(config, checkpoint=cut(config.checkpoint), selective=cut(config.selective),
                   op_selective=cut(config.op_selective), offload=cut(config.offload), precision=precision,
                   layout=layout)


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
