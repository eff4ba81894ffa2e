"""The candidates the search ranks: the space it searches, the micro-batch windows, and one option (precision,
micro-batch, accumulation) evaluated under a budget with the cheapest checkpoint set the MILP finds, its selective
units priced by the time model (Note [pricing selective units]). The search over the options: autofit/solve/search.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from autofit.capture.depth import Blocks
from autofit.core import progress
from autofit.solve.block_groups import grouped_by_block, solve_in_block_groups
from autofit.solve.memory_model import MemoryModel
from autofit.solve.time_model import TimeModel

__all__ = ["Candidate", "SearchSpace", "batch_options", "evaluate", "fits_as_is", "space_memory", "checkpoint_problem",
           "micro_batch_window"]


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
    selective: tuple[str, ...] = ()  # those of ``checkpoint`` recomputed selectively (autofit/training/recompute.py)
    # those of ``checkpoint`` recomputed by torchtitan's per-op policy: the user's fixed choice, never searched
    op_selective: tuple[str, ...] = ()
    # gradients allocated before the first forward (Note [gradients before forward as a plan knob], estimator.py)
    preallocated_grads: bool = False

    def configuration(self) -> tuple:
        """What makes two candidates of one search space the same configuration: every knob but the figures (the
        verification may allocate gradients before forward where only that fits: the same knobs, laid out otherwise).
        Where the states live is the space's layout's, the same for all of them (the estimator's ``parallel``)."""
        return (self.precision, self.micro_batch_size, self.accumulation_steps, self.last_micro_batch_size,
                self.checkpoint, self.selective, self.op_selective, self.in_backward, self.offload)


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
    # the model's run of identical blocks when estimates extrapolate in depth: the MILP's recomputed units are then
    # grouped by block (Note [recomputation grouped by block], block_groups.py)
    blocks: Blocks | None = None
    # the fewest rows any micro-batch may hold, the last one's included (Note [micro-batches a model refuses],
    # autofit/capture/rows.py)
    min_rows: int = 1
    # what evaluate found for (precision, b, k, last), by budget: the search, the front and the verification loop
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
        window = micro_batch_window(batch_size, b, min_rows)
        if window is not None:
            options.append(window)
    return options


def micro_batch_window(batch_size: int, b: int, min_rows: int) -> tuple[int, int, int] | None:
    """(b, k, last) of micro-batches of ``b`` over ``batch_size`` rows, the last taking the rest, or rows from the
    micro-batch before up to ``min_rows`` (the trainer's ``_bounds``); None where that one cannot spare them."""
    steps = math.ceil(batch_size / b)
    last = batch_size - b * (steps - 1)
    if steps > 1 and last < min_rows:
        if b - (min_rows - last) < min_rows:
            return None
        last = min_rows
    return b, steps, last


def evaluate(space: SearchSpace, precision: str, b: int, k: int, last: int, budget: int) -> Candidate | None:
    known = space.evaluated.setdefault((precision, b, k, last), {})
    if budget not in known:
        known[budget] = (_reused(space_memory(space, precision, k), b, known, budget)
                         or _evaluated(space, precision, b, k, last, budget))
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
    memory, time = space_memory(space, precision, k), space.time[precision]
    device_budget, budget = budget, memory.tensor_budget(budget)  # the models below count tensor bytes
    if memory.optimizer_peak(b) > budget:
        return None, 0
    selective: tuple[str, ...] = ()
    op_selective = space.fixed_op_selective if space.fixed_checkpoint is not None else ()
    if space.fixed_checkpoint is not None:
        names, selective = space.fixed_checkpoint, space.fixed_selective
        peak = memory.peak(b, k, names, selective, op_selective)
    else:
        problem = checkpoint_problem(space, precision, b, k, selective_units)
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
                     selective=selective, op_selective=op_selective), peak


def chosen_names(problem, chosen) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(recomputed modules, those of them recomputed selectively) of the MILP's chosen units."""
    names = tuple(problem.names[i] for i in chosen)
    return names, tuple(problem.names[i] for i in chosen if problem.policy(i) == "selective")


def fits_as_is(space: SearchSpace, precision: str, b: int, k: int, last: int, budget: int) -> bool:
    """Whether (precision, b) fits with the user's fixed set, or with nothing recomputed: what ``evaluate`` finds
    without a MILP."""
    memory = space_memory(space, precision, k)
    tensor_budget = memory.tensor_budget(budget)
    if memory.optimizer_peak(b) > tensor_budget:
        return False
    if space.fixed_checkpoint is not None:
        peak = memory.peak(b, k, space.fixed_checkpoint, space.fixed_selective, space.fixed_op_selective)
    else:
        peak = checkpoint_problem(space, precision, b, k).peak(())
    return peak <= tensor_budget and memory.to_device(peak) <= budget


def space_memory(space: SearchSpace, precision: str, k: int) -> MemoryModel:
    """The memory model of ``precision`` for a window of ``k`` micro-batches (:meth:`MemoryModel.window`)."""
    return space.memory[precision].window(k)


def checkpoint_problem(space: SearchSpace, precision: str, b: int, k: int, selective: bool | None = None):
    selective = space.allow_selective if selective is None else selective
    key = (precision, b, k, selective)
    if key not in space.problems:
        progress.step(f"the memory model of micro-batch {b} x {k} ({precision})")  # 0.1 to 0.3 s each on a 7B model
        problem = space_memory(space, precision, k).problem(b, k, selective=selective)
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
