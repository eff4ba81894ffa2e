"""The search over micro-batch, accumulation, precision and checkpoint sets, on the models (no simulation).

For each allowed precision and each micro-batch b (one per distinct accumulation count k = ceil(B / b)), the
checkpoint MILP finds the cheapest set of recomputed modules that brings the modelled peak under the budget; the
time model ranks the survivors. The winner is the fastest; ties go to the lower peak, then to the earlier
precision in the allowed order (the more accurate one). See Note [monotonic budgets].
The candidates, and one option evaluated with its cheapest checkpoint set: autofit/solve/candidate.py.

Note [monotonic budgets]
    For a fixed precision and b, the MILP's feasible sets under a budget contain those under any smaller budget, so
    its minimal cost can only grow as the budget falls, and so can the best time over all (precision, b). The peak
    of the winner can only fall: if the old winner still fits, it stays the winner (same candidates, same
    tie-break); if not, the new winner fits under the smaller budget, below the old peak.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from autofit.core import progress
from autofit.solve.candidate import (Candidate, SearchSpace, batch_options, checkpoint_problem, evaluate, fits_as_is,
                                     micro_batch_window, space_memory)
from autofit.solve.checkpoint_milp import most_freeing_checkpoint

__all__ = ["alternatives", "search", "smallest_peaks", "pareto_front", "module_level", "time_floor", "fits_somewhere",
           "whole_batch"]


def _rank(space: SearchSpace, c: Candidate) -> tuple:
    return (round(c.seconds, 12), c.peak_bytes, space.precisions.index(c.precision), -c.micro_batch_size)


def _options(space: SearchSpace, budget: int) -> list[tuple[str, int, int, int]]:
    """(precision, b, k, last) worth evaluating: for each precision, micro-batches from the largest down to the first
    that fits with no (further) module recomputed."""
    options = []
    for precision in space.precisions:
        for b, k, last in batch_options(space.batch_size, space.min_rows):
            options.append((precision, b, k, last))
            if fits_as_is(space, precision, b, k, last, budget):
                break
    return options


def time_floor(space: SearchSpace, budget: int) -> float:
    """No configuration of ``space`` under ``budget`` steps faster than this (Note [pruned search]): the least of
    the options' floors, with no checkpoint MILP solved."""
    return min((_time_floor(space, *o, budget) for o in _options(space, budget)), default=math.inf)


def fits_somewhere(space: SearchSpace, budget: int) -> bool:
    """Whether the models fit some configuration of ``space`` under ``budget``, found without a checkpoint MILP: one
    that fits as it is, or with every unit recomputed. A sufficient test (recomputing everything is not always the
    lowest peak), for a rung that loses on its time floor alone (Note [layouts that cannot win], planning/climb.py)."""
    for precision, b, k, last in _options(space, budget):
        if fits_as_is(space, precision, b, k, last, budget):
            return True
        if not space.allow_checkpoint or space.fixed_checkpoint is not None:
            continue
        memory = space_memory(space, precision, k)
        tensor_budget = memory.tensor_budget(budget)
        peak = memory.peak(b, k, tuple(u.name for u in memory.units), ())
        if memory.optimizer_peak(b) <= tensor_budget and peak <= tensor_budget and memory.to_device(peak) <= budget:
            return True
    return False


def search(space: SearchSpace, budget: int, *, prune: bool = True) -> tuple[Candidate | None, list[Candidate]]:
    """The best candidate under ``budget`` (None if none fits) and the candidates that fit among those evaluated.

    For each precision, micro-batches from the largest down to the first that fits with no (further) module
    recomputed: smaller ones with the same checkpointing only add per-micro-batch overhead. With ``prune`` they are
    evaluated cheapest time floor first, and those whose floor cannot beat the best found are skipped (Note [pruned
    search]): the same winner, fewer checkpoint MILPs, and fewer candidates in ``fitting``."""
    options = _options(space, budget)
    floors = {}
    if prune:
        floors = {o: _time_floor(space, *o, budget) for o in options}
        options.sort(key=lambda o: floors[o])
    fitting: list[Candidate] = []
    best = None
    for i, o in enumerate(options):
        if prune and best is not None and floors[o] > round(best.seconds, 12):
            break  # sorted by floor: no later option can win either
        _report_milp(space, o, budget, i, len(options))
        candidate = evaluate(space, *o, budget)
        if candidate is None:
            continue
        fitting.append(candidate)
        if best is None or _rank(space, candidate) < _rank(space, best):
            best = candidate
    return best, fitting


def _report_milp(space: SearchSpace, option: tuple[str, int, int, int], budget: int, done: int | None,
                 total: int | None, what: str = "") -> None:
    """Tell the progress listener a checkpoint MILP is about to be solved for ``option`` (issue 56: a MILP can take
    minutes on a large model, and the search solves several); nothing when its result is cached."""
    if budget in space.evaluated.get(option, {}):
        return
    precision, b, k, _ = option
    progress.report(f"checkpoint MILP for the {what}micro-batch {b} x {k} ({precision})", done, total)


# Note [pruned search]
#     Recomputing or offloading a module only adds time (its forward ops again, or its PCIe copies), and a set that
#     fits must free, in every stretch of the window over the budget, at least that stretch's excess. So the
#     modelled time of (precision, b) with nothing recomputed, plus the cheapest fractional way to free the worst
#     stretch's excess (a fractional knapsack: units by time per byte freed there, the last one in part; nesting and
#     the bytes a unit adds elsewhere ignored, which can only lower it), is a floor for every checkpoint set the MILP
#     could choose. Options are evaluated in order of their floors; once a floor exceeds the best time found, no
#     later option can win (the rank's first key is the time), so their MILPs are not solved and the winner is the
#     same. On the Llama-7B plan of benchmarks/scale.py --plan (A100-80GB), the search solved 7 programs instead
#     of 15 and took 0.8 s instead of 5.1 s.
def _time_floor(space: SearchSpace, precision: str, b: int, k: int, last: int, budget: int) -> float:
    time = space.time[precision]
    floor = time.step_time(precision, b, k, space.fixed_checkpoint or (), last, (), space.fixed_selective,
                           space.fixed_op_selective).total
    if space.fixed_checkpoint is None and space.allow_checkpoint:
        problem = checkpoint_problem(space, precision, b, k)
        excess = problem.base - space_memory(space, precision, k).tensor_budget(budget)
        if np.any(excess > 0):
            for size, times in ((b, k - 1), (last, 1)):
                seconds = time.cheapest_removal_seconds(problem.names, size, space.allow_offload,
                                                        problem.policies)
                floor += times * _knapsack_floor(problem, excess, seconds)
    return round(floor, 12)


def _knapsack_floor(problem, excess: np.ndarray, seconds: np.ndarray) -> float:
    """The least time to free ``excess`` bytes in the worst stretch, units taken fractionally (Note [pruned
    search]); infinite when even every unit at once cannot."""
    worst = 0.0
    for i in np.flatnonzero(excess > 0):
        freed = -problem.coef[i]
        useful = freed > 0
        freed, cost = freed[useful], seconds[useful]
        if freed.sum() < excess[i]:
            return math.inf
        per_byte = cost / freed
        order = np.argsort(per_byte, kind="stable")
        taken = np.cumsum(freed[order])
        j = min(int(np.searchsorted(taken, excess[i])), len(order) - 1)  # the unit that completes it, in part
        before = float(taken[j - 1]) if j else 0.0
        worst = max(worst, float(cost[order][:j].sum()) + (float(excess[i]) - before) * float(per_byte[order][j]))
    return worst


def alternatives(space: SearchSpace, budget: int) -> list[Candidate]:
    """Candidates for the memory/time front beyond those the search needed: for each precision, micro-batches
    halving from the batch size down to 1 (each with the cheapest checkpoint set that fits), those with a micro-batch
    the model refuses left out."""
    out = []
    for precision in space.precisions:
        b = space.batch_size
        while True:
            window = micro_batch_window(space.batch_size, b, space.min_rows)
            if window is not None:
                _report_milp(space, (precision, *window), budget, None, None, what="alternative ")
            candidate = evaluate(space, precision, *window, budget) if window is not None else None
            if candidate is not None:
                out.append(candidate)
            if b == 1:
                break
            b = max(1, b // 2)
    return out


def whole_batch(space: SearchSpace, budget: int) -> list[Candidate]:
    """The candidates of one micro-batch per step (the whole batch at once) that fit ``budget``, one per precision
    at most: what ``search`` would find among its options of one micro-batch, without the MILPs of the others (the
    optimizer can step in backward only there, Note [optimizer step in backward])."""
    found = []
    for i, precision in enumerate(space.precisions):
        option = (precision, space.batch_size, 1, space.batch_size)
        _report_milp(space, option, budget, i, len(space.precisions), what="whole-batch ")
        candidate = evaluate(space, *option, budget)
        if candidate is not None:
            found.append(candidate)
    return found


def smallest_peaks(space: SearchSpace, *, whole_batch: bool = False) -> list[Candidate]:
    """Every precision and micro-batch (with ``whole_batch``, only the micro-batch of the whole batch), each with its
    most freeing checkpoint set, lowest modelled peak first. (Micro-batch 1 is not always lowest: accumulation keeps
    gradients through every micro-batch, which can cost more than the activations it saves when parameters
    dominate.)"""
    found = []
    options = [(precision, *o) for precision in space.precisions
               for o in batch_options(space.batch_size, space.min_rows) if not whole_batch or o[1] == 1]
    for i, (precision, b, k, last) in enumerate(options):
        time = space.time[precision]
        # one option at a time, counted for the progress line (issue 56: minutes on a 405B model)
        progress.report(f"the smallest budget: the most freeing checkpoint set for micro-batch {b} x {k} "
                        f"({precision})", i, len(options))
        memory = space_memory(space, precision, k)
        names: tuple[str, ...] = space.fixed_checkpoint or ()
        if space.allow_checkpoint and space.fixed_checkpoint is None:
            # the set that lowers forward and backward most: it also lowers the whole step's peak most (the
            # optimizer stage is the same for all), and where that stage dominates it still lowers what a GPU
            # keeps reserved (MemoryModel.window_problem)
            chosen = most_freeing_checkpoint(memory.window_problem(b, k, selective=False))
            names = tuple(memory.units[u].name for u in chosen)
        fixed = space.fixed_checkpoint is not None
        selective = space.fixed_selective if fixed else ()
        op_selective = space.fixed_op_selective if fixed else ()
        peak = memory.to_device(memory.peak(b, k, names, selective, op_selective))
        offload: tuple[str, ...] = ()
        if space.allow_offload and space.fixed_checkpoint is None:
            names, offload = time.keep_recompute_or_offload(names, b)
        seconds = time.step_time(precision, b, k, names, last, offload, selective, op_selective).total
        found.append(Candidate(precision, b, k, last, names, peak, seconds, offload=offload, selective=selective,
                               op_selective=op_selective))
    return sorted(found, key=lambda c: c.peak_bytes)


def module_level(space: SearchSpace, budget: int) -> Candidate | None:
    """The best candidate under ``budget`` when every recomputed module reruns all of its forward (no selective
    recomputation): what the plan is compared with when its winner recomputes selectively."""
    return search(replace(space, allow_selective=False), budget)[0]


def pareto_front(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Candidates no other beats on both peak and time, sorted from the fastest (and largest) to the smallest."""
    front: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.seconds, c.peak_bytes)):
        if not front or c.peak_bytes < front[-1].peak_bytes:
            front.append(c)
    return front
