"""The search over micro-batch, accumulation, precision and checkpoint sets, on the models (no simulation).

For each allowed precision and each micro-batch b (one per distinct accumulation count k = ceil(B / b)), the
checkpoint MILP finds the cheapest set of recomputed modules that brings the modelled peak under the budget; the
time model ranks the survivors. The winner is the fastest; ties go to the lower peak, then to the earlier
precision in the allowed order (the more accurate one). See Note [monotonic budgets].

Note [monotonic budgets]
    For a fixed precision and b, the MILP's feasible sets under a budget contain those under any smaller budget, so
    its minimal cost can only grow as the budget falls, and so can the best time over all (precision, b). The peak
    of the winner can only fall: if the old winner still fits, it stays the winner (same candidates, same
    tie-break); if not, the new winner fits under the smaller budget, below the old peak.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from autofit.capture.depth import Blocks
from autofit.core import progress
from autofit.solve.checkpoint_milp import most_freeing_checkpoint
from autofit.solve.depth import grouped_by_block, solve_in_block_groups
from autofit.solve.memory_model import MemoryModel
from autofit.solve.time_model import TimeModel

__all__ = ["Candidate", "SearchSpace", "alternatives", "batch_options", "search", "smallest_peaks", "pareto_front",
           "module_level", "time_floor", "fits_somewhere", "whole_batch"]


@dataclass(frozen=True)
class Candidate:
    precision: str
    micro_batch_size: int
    accumulation_steps: int
    last_micro_batch_size: int
    checkpoint: tuple[str, ...]
    peak_bytes: int  # modelled
    seconds: float  # modelled step time for the whole effective batch
    in_backward: bool = False  # the optimizer steps each parameter in backward (Note [optimizer step in backward])
    offload: tuple[str, ...] = ()  # modules whose saved activations go to the host (Note [offload])
    offload_states: bool = False  # parameters, gradients and optimizer state on the host (FSDP2 CPUOffloadPolicy)
    selective: tuple[str, ...] = ()  # those of ``checkpoint`` recomputed selectively (autofit/training/recompute.py)
    # those of ``checkpoint`` recomputed by torchtitan's per-op policy: the user's fixed choice, never searched
    op_selective: tuple[str, ...] = ()
    # gradients allocated before the first forward (Note [gradients before forward as a plan knob], estimator.py)
    preallocated_grads: bool = False


@dataclass(frozen=True)
class SearchSpace:
    """Everything the search needs, per allowed precision (in order of preference)."""

    batch_size: int  # samples per rank per optimizer step
    memory: Mapping[str, MemoryModel]
    time: Mapping[str, TimeModel]
    precisions: tuple[str, ...]
    allow_checkpoint: bool = True  # False: the planner may not add checkpointed modules
    fixed_checkpoint: tuple[str, ...] | None = None  # the user's own set: used as is, never searched
    # a module whose activations must leave the device may go to the host instead of being recomputed, whichever
    # the time model says is faster (Note [offload time]); the memory model counts it as recomputed, which holds
    # at least as much on the device (an offloaded module keeps not even its inputs, and brings its saved tensors
    # back one backward node at a time), so the verifying estimate can only come out lower
    allow_offload: bool = False
    # a recomputed module may keep its matmul and attention outputs and rerun the rest (autofit/training/recompute.py)
    allow_selective: bool = True
    fixed_selective: tuple[str, ...] = ()  # with fixed_checkpoint: those of the user's set recomputed selectively
    fixed_op_selective: tuple[str, ...] = ()  # with fixed_checkpoint: those of it under torchtitan's per-op policy
    offload_states: bool = False  # every candidate keeps its states on the host (the planner's last stage)
    # the model's run of identical blocks when estimates extrapolate in depth: the MILP's recomputed units are then
    # grouped by block (Note [recomputation grouped by block], depth.py)
    blocks: Blocks | None = None
    # the fewest rows any micro-batch may hold, the last one's included (Note [micro-batches a model refuses],
    # autofit/capture/rows.py)
    min_rows: int = 1
    # what _evaluate found for (precision, b, k, last), by budget: the search, the front and the verification loop
    # ask for the same configurations again, and each may cost a checkpoint MILP
    evaluated: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    problems: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # (precision, b, k) -> MILP

    def sharing(self, caches: tuple[dict, dict]) -> SearchSpace:
        """This space, its caches (``evaluated``, ``problems``) being ``caches``: those of the other spaces whose
        models of each precision are built from the same analyses under the same settings (the ladder's rungs of
        one layout and one set of step features, Note [one search cache per layout]). ``dataclasses.replace``
        gives a space fresh caches, as a space with other settings needs."""
        object.__setattr__(self, "evaluated", caches[0])
        object.__setattr__(self, "problems", caches[1])
        return self


def batch_options(batch_size: int, min_rows: int = 1) -> list[tuple[int, int, int]]:
    """(b, k, last) for every distinct accumulation count k: b = ceil(B / k), the last micro-batch takes the rest.
    A rest below ``min_rows`` takes rows from the micro-batch before (the trainer's ``_bounds``), so ``last`` is
    ``min_rows`` then; a ``b`` that cannot spare them is left out (Note [micro-batches a model refuses])."""
    options, seen = [], set()
    for k in range(1, batch_size + 1):
        b = math.ceil(batch_size / k)
        if b in seen:
            continue
        seen.add(b)
        window = _window(batch_size, b, min_rows)
        if window is not None:
            options.append(window)
    return options


def _window(batch_size: int, b: int, min_rows: int) -> tuple[int, int, int] | None:
    """(b, k, last) of micro-batches of ``b`` over ``batch_size`` rows, the last taking the rest, or rows from the
    micro-batch before up to ``min_rows`` (the trainer's ``_bounds``); None where that one cannot spare them."""
    steps = math.ceil(batch_size / b)
    last = batch_size - b * (steps - 1)
    if steps > 1 and last < min_rows:
        if b - (min_rows - last) < min_rows:
            return None
        last = min_rows
    return b, steps, last


def _evaluate(space: SearchSpace, precision: str, b: int, k: int, last: int, budget: int) -> Candidate | None:
    known = space.evaluated.setdefault((precision, b, k, last), {})
    if budget not in known:
        known[budget] = _reused(_memory(space, precision, k), b, known, budget) or _evaluated(space, precision, b, k, last,
                                                                                         budget)
    return known[budget][0]


def _reused(memory: MemoryModel, b: int, known: dict[int, tuple[Candidate | None, int]], budget: int):
    """What an evaluation under a larger budget already says about ``budget`` (the verification loop lowers the
    budget and searches again), or None: the feasible checkpoint sets under ``budget`` are a subset of those under
    any larger one, so nothing fitting there means nothing fits here, and a cheapest set found there that passes
    here the checks ``_evaluated`` makes is the cheapest here too (within the MILP's relative gap, which the larger
    budget's optimum only tightens)."""
    tensor_budget = memory.tensor_budget(budget)
    for larger, (found, tensor_peak) in known.items():
        if larger < budget:
            continue
        if found is None:
            return None, 0
        if tensor_peak <= tensor_budget and memory.optimizer_peak(b) <= tensor_budget and found.peak_bytes <= budget:
            return found, tensor_peak
    return None


def _evaluated(space: SearchSpace, precision: str, b: int, k: int, last: int,
               budget: int) -> tuple[Candidate | None, int]:
    """The candidate of (precision, b) under ``budget`` with the cheapest checkpoint set (or None), and its modelled
    tensor peak. Where selective recomputation is allowed, the cheapest set with it and the cheapest without are
    both found, and the faster kept (Note [pricing selective units])."""
    found = _evaluated_with(space, precision, b, k, last, budget, space.allow_selective)
    if not space.allow_selective or space.fixed_checkpoint is not None or not space.allow_checkpoint:
        return found
    whole = _evaluated_with(space, precision, b, k, last, budget, False)
    if found[0] is None or (whole[0] is not None and (round(whole[0].seconds, 12), whole[0].peak_bytes)
                            <= (round(found[0].seconds, 12), found[0].peak_bytes)):
        return whole
    return found


def _evaluated_with(space: SearchSpace, precision: str, b: int, k: int, last: int, budget: int,
                    selective_units: bool) -> tuple[Candidate | None, int]:
    memory, time = _memory(space, precision, k), space.time[precision]
    device_budget, budget = budget, memory.tensor_budget(budget)  # the models below count tensor bytes
    if memory.optimizer_peak(b) > budget:
        return None, 0
    selective: tuple[str, ...] = ()
    op_selective = space.fixed_op_selective if space.fixed_checkpoint is not None else ()
    if space.fixed_checkpoint is not None:
        names, selective = space.fixed_checkpoint, space.fixed_selective
        peak = memory.peak(b, k, names, selective, op_selective)
    else:
        problem = _problem(space, precision, b, k, selective_units)
        if not space.allow_checkpoint:
            chosen = () if problem.peak(()) <= budget else None
        else:
            chosen = solve_in_block_groups(problem, budget, space.blocks)  # Note [identical blocks solved in groups]
        if chosen is None:
            return None, 0
        if space.blocks is not None:
            chosen = grouped_by_block(problem, chosen, space.blocks, budget)
        names, selective = chosen_names(problem, chosen)
        peak = problem.peak(chosen)
    if peak > budget:
        return None, 0
    offload: tuple[str, ...] = ()
    if space.allow_offload and space.fixed_checkpoint is None:
        names, offload = time.keep_recompute_or_offload(names, b)
        selective = tuple(n for n in selective if n in names)
    seconds = time.step_time(precision, b, k, names, last, offload, selective, op_selective).total
    device_peak = memory.to_device(peak)
    if device_peak > device_budget:
        return None, 0
    return Candidate(precision, b, k, last, names, device_peak, seconds, offload=offload,
                     offload_states=space.offload_states, selective=selective, op_selective=op_selective), peak


def chosen_names(problem, chosen) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(recomputed modules, those of them recomputed selectively) of the MILP's chosen units."""
    names = tuple(problem.names[i] for i in chosen)
    return names, tuple(problem.names[i] for i in chosen if problem.policy(i) == "selective")


def _rank(space: SearchSpace, c: Candidate) -> tuple:
    return (round(c.seconds, 12), c.peak_bytes, space.precisions.index(c.precision), -c.micro_batch_size)


def _options(space: SearchSpace, budget: int) -> list[tuple[str, int, int, int]]:
    """(precision, b, k, last) worth evaluating: for each precision, micro-batches from the largest down to the first
    that fits with no (further) module recomputed."""
    options = []
    for precision in space.precisions:
        for b, k, last in batch_options(space.batch_size, space.min_rows):
            options.append((precision, b, k, last))
            if _fits_as_is(space, precision, b, k, last, budget):
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
        if _fits_as_is(space, precision, b, k, last, budget):
            return True
        if not space.allow_checkpoint or space.fixed_checkpoint is not None:
            continue
        memory = _memory(space, precision, k)
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
        candidate = _evaluate(space, *o, budget)
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


def _fits_as_is(space: SearchSpace, precision: str, b: int, k: int, last: int, budget: int) -> bool:
    """Whether (precision, b) fits with the user's fixed set, or with nothing recomputed: what ``_evaluate`` finds
    without a MILP."""
    memory = _memory(space, precision, k)
    tensor_budget = memory.tensor_budget(budget)
    if memory.optimizer_peak(b) > tensor_budget:
        return False
    if space.fixed_checkpoint is not None:
        peak = memory.peak(b, k, space.fixed_checkpoint, space.fixed_selective, space.fixed_op_selective)
    else:
        peak = _problem(space, precision, b, k).peak(())
    return peak <= tensor_budget and memory.to_device(peak) <= budget


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
        problem = _problem(space, precision, b, k)
        excess = problem.base - _memory(space, precision, k).tensor_budget(budget)
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


def _memory(space: SearchSpace, precision: str, k: int) -> MemoryModel:
    """The memory model of ``precision`` for a window of ``k`` micro-batches (:meth:`MemoryModel.window`)."""
    return space.memory[precision].window(k)


def _problem(space: SearchSpace, precision: str, b: int, k: int, selective: bool | None = None):
    selective = space.allow_selective if selective is None else selective
    key = (precision, b, k, selective)
    if key not in space.problems:
        progress.step(f"the memory model of micro-batch {b} x {k} ({precision})")  # 0.1 to 0.3 s each on a 7B model
        problem = _memory(space, precision, k).problem(b, k, selective=selective)
        space.problems[key] = _priced(problem, space.time[precision], b)
    return space.problems[key]


def _priced(problem, time: TimeModel, b: int):
    """The problem with each selective unit's cost scaled from its module's FLOPs by the time model's ratio of
    selective to full recomputation: the ops it does not rerun are the FLOP-heavy ones, and what it reruns
    (pointwise, memory-bound) costs time the FLOP count does not show (Note [pricing selective units])."""
    if not problem.policies or "selective" not in problem.policies:
        return problem
    costs = problem.costs.copy()
    for i, (name, policy) in enumerate(zip(problem.names, problem.policies)):
        if policy == "selective":
            full = time.recompute_seconds(name, b, launches=True)
            costs[i] *= time.recompute_seconds(name, b, selective=True, launches=True) / full if full > 0 else 1.0
    return replace(problem, costs=costs)


# Note [pricing selective units]
#     The MILP minimises recompute cost in FLOPs (PyTorch's flop registry), which counts matrix products and
#     attention only. A selective recomputation reruns only ops the registry counts as free, so in FLOPs it would
#     cost nothing, and the MILP's second stage (the lowest peak among sets of the same cost) would recompute every
#     module selectively whether needed or not. Its cost is therefore its module's FLOPs times the time model's
#     ratio of the two recomputations' seconds (bandwidth-bound ops costed by their bytes): in the MILP's own unit,
#     what the search's ranking will charge for it, launches included (a selective recomputation reruns many small
#     ops). The ratio is exact only where a module's FLOPs and seconds are proportional, so for each (precision, b)
#     the search also solves the program without selective units and keeps whichever set the time model ranks
#     faster: a plan with selective recomputation is never slower, in the model, than the best module-level one.


def alternatives(space: SearchSpace, budget: int) -> list[Candidate]:
    """Candidates for the memory/time front beyond those the search needed: for each precision, micro-batches
    halving from the batch size down to 1 (each with the cheapest checkpoint set that fits), those with a micro-batch
    the model refuses left out."""
    out = []
    for precision in space.precisions:
        b = space.batch_size
        while True:
            window = _window(space.batch_size, b, space.min_rows)
            if window is not None:
                _report_milp(space, (precision, *window), budget, None, None, what="alternative ")
            candidate = _evaluate(space, precision, *window, budget) if window is not None else None
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
        candidate = _evaluate(space, *option, budget)
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
        memory = _memory(space, precision, k)
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
        found.append(Candidate(precision, b, k, last, names, peak, seconds, offload=offload,
                               offload_states=space.offload_states, selective=selective,
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
