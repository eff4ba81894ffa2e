"""The race of the layouts (docs/architecture.md, "The planner"): every layout the request allows, put in order
(the states' floors, the collectives' floors, then the bound of the configuration each one's search would verify
first), each climbing its ladder in turn (autofit/planning/climb.py) with the fastest plan found so far to beat; the
fastest plan wins. Layouts ruled out by arithmetic are named, not analysed; when no layout fits, the error that says
most (a host too small, else the smallest budget of any layout)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Callable

from autofit.core import progress
from autofit.analyse.table import Analysis
from autofit.core.errors import (AutofitError, HostMemoryError, InfeasibleBudgetError, InvalidInputError,
                                 UnsupportedModelError)
from autofit.training.precision import stored_dtype
from autofit.emit.plan import Plan, why_layout
from autofit.request import Parallel, PlanRequest
from autofit.solve.host import check_host_before_analysis
from autofit.solve.ladder import Stage, ladder, states_floor
from autofit.solve.search import search, time_floor
from autofit.parallel.choices import collective_floor, layouts
from autofit.parallel.rungs import host_rung_loses, names_smallest_budget
from autofit.core.units import format_bytes

from autofit.planning.climb import Climb, Unplanned, plan_layout
from autofit.planning.pipeline import pipelined, plan_pipeline

__all__ = ["plan_layouts"]


def plan_layouts(request: PlanRequest) -> tuple[Plan, dict[str, Analysis]]:
    """The plan of ``request`` over every layout it allows (the fastest wins), with the analyses."""
    tally = _Tally()
    parallels = [p for name in request.strategies for p in layouts(request, name)]
    if not parallels:  # every layout the rules accept is one torch refuses to run (Dimension.plannable)
        raise InvalidInputError(
            f"no layout of the {request.world_size} ranks asked for can be planned: each one the layout's rules "
            "accept is one torch refuses to run (tensor parallel over every rank the other dimensions leave, so no "
            "FSDP2 to make every parameter a DTensor, with torch's foreach optimizers on CUDA; an int reshard of "
            "tensor-parallel weights): leave ranks to FSDP2 (a smaller tensor_parallel or pipeline_parallel, or a "
            "larger world_size)")
    check_host_before_analysis(request, parallels)  # Note [the host of the target], autofit/validate.py
    order, climbs, floors, hopeless, host_only = _layout_order(request, parallels)
    deferred: list[Parallel] = []
    # where no layout is known to hold least at any configuration (a further dimension's: a pipeline's), the one
    # whose states floor is least names the smallest budget when nothing fits
    namer = None if any(p.least_memory for p in parallels) else min(hopeless, key=lambda p: floors[p] or 0,
                                                                    default=None)
    for position, parallel in enumerate(order):
        name, climb = parallel.label, climbs.pop(parallel)  # dropped after its turn (Note [bounded memory])
        if len(order) > 1:  # the layout race, how far (issue 56)
            progress.report(f"layout {name}", position, len(order))
        # when the layout that holds least misses the budget, the others' smallest budgets are no smaller, and only
        # the smallest is ever reported
        names = names_smallest_budget(parallel, planned=bool(tally.results)) or (parallel is namer
                                                                                  and not tally.results)
        if parallel in hopeless and not names:
            tally.failed.append(_states_alone(request, parallel, floors[parallel]))
            continue
        if parallel in hopeless and tally.unplanned:  # Note [ruled out by arithmetic]
            deferred.append(parallel)
            continue
        if parallel in host_only and tally.results:
            tally.failed.append(f"{name} not planned: it fits only with its states on the host, slower than a "
                                "layout that keeps them on the GPUs")
            continue
        beat = min(r[0].predicted_step_seconds for r in tally.results) if tally.results else None
        alone = _collectives_alone(request, parallel, climb.stages)
        if beat is not None and alone >= beat:  # Note [ruled out by arithmetic]
            tally.failed.append(_collectives_note(parallel, alone, f"the plan found, {beat:.3g} s"))
            continue
        on_gpus = host_rung_loses(r[0].parallel for r in tally.results)
        planned = plan_pipeline if pipelined(parallel) else plan_layout  # Note [planning a pipeline]
        _attempt(request, name, functools.partial(planned, request, parallel, beat, on_gpus, climb), tally)
        tally.release()  # Note [bounded memory]
    if not tally.results:
        _fallbacks(request, tally, deferred, floors)
    else:  # every layout left is named, with why (its smallest budget is computed only when no layout fits)
        tally.failed += [f"{label} not planned: {e} with the models of its rungs on the GPUs (its smallest budget, "
                         "a few full simulations, is computed only when no layout fits)" for label, e in tally.unplanned]
        tally.failed += [_states_alone(request, p, floors[p]) for p in deferred]
    results, failed = tally.results, tally.failed
    chosen, analyses = min(results, key=lambda r: r[0].predicted_step_seconds)
    if len(parallels) > 1:
        why = why_layout(chosen, [r[0] for r in results])
        chosen = replace(chosen, notes=chosen.notes + (why, *failed))
    return chosen, analyses


def _layout_order(request: PlanRequest, parallels: list[Parallel]) -> tuple[
        list[Parallel], dict[Parallel, Climb], dict[Parallel, int | None], set[Parallel], set[Parallel]]:
    """The layouts in the order they are planned, each one's climb, and (with several layouts) each one's states
    floor, those whose states alone miss the budget (hopeless) and those that fit only with their states on the host.

    A hopeless layout is planned last (the smallest floor first), and only when nothing else fits: its analysis would only name its smallest
    budget, which the error needs only if no layout fits. One that fits only with its states on the host (the
    ladder's last rung, much the slowest) is planned only when no layout fits with them on the GPUs. Before them,
    Note [layouts that cannot win]: the layouts whose collectives cost least first, so that a fast plan found early
    lets the others stop before verifying anything; then Note [the layout to verify first]."""
    ladders = {p: ladder(request.for_layout(p), p) for p in parallels} if len(parallels) > 1 else {}
    floors = {p: states_floor(stages) for p, stages in ladders.items()}
    hopeless = {p for p, floor in floors.items() if floor is not None and floor > request.fit_bytes}
    host_only = {p for p, stages in ladders.items() if stages[-1].host_check
                 and states_floor(stages[:-1]) > request.fit_bytes}
    # the hopeless by their floors, least first: the one most likely to name the smallest budget comes before the
    # others, which its budget may then rule out by arithmetic (Note [ruled out by arithmetic])
    order = sorted(parallels, key=lambda p: (p in hopeless, floors[p] if p in hopeless else 0, p in host_only,
                                             collective_floor(request, p)))
    climbs = {p: Climb.of(request, p) for p in order}
    return _by_bound(order, climbs, hopeless | host_only), climbs, floors, hopeless, host_only


def _collectives_alone(request: PlanRequest, parallel: Parallel, stages: tuple[Stage, ...]) -> float:
    """``parallel``'s collectives floor over its parameters in the fewest bytes any of its rungs ``stages`` stores
    them in (Note [ruled out by arithmetic])."""
    return collective_floor(request, parallel, [stored_dtype(p.stored).itemsize for s in stages
                                                for p in s.policies if p.stored])


def _collectives_note(parallel: Parallel, seconds: float, than: str) -> str:
    """The note of a layout whose collectives alone rule it out (Note [ruled out by arithmetic])."""
    return (f"{parallel.label} not planned: its data-parallel collectives alone take at least {seconds:.3g} s per "
            f"step (one micro-batch, counted from the parameters, nothing simulated), no faster than {than}")


def _states_alone(request: PlanRequest, parallel: Parallel, floor: int | None) -> str:
    """The note of a layout ruled out by arithmetic (Note [ruled out by arithmetic])."""
    return (f"{parallel.label} not planned: its parameters, gradients and optimizer state (with them on the host, its "
            f"gathered parameters) alone need at least {format_bytes(floor or 0)} per rank, over the budget "
            f"{format_bytes(request.fit_bytes)} (counted from the parameters, nothing simulated)")


# Note [bounded memory]
#     A layout's climb holds its rungs' analyses (the fake step's timelines, the layer table: hundreds of MB for a
#     405B model cut in depth), kept from the ranking (Note [the layout to verify first]) to its turn in the race.
#     Once raced, nothing reads its climb again but the fallback that names its smallest budget, which runs only
#     when no layout has a plan; and of the plans found, only the fastest is returned with its analyses. So each
#     climb is dropped after its turn, and once some layout has a plan, the others' fallbacks and the slower plans'
#     analyses go: the planner holds the climbs not yet raced and one plan's analyses, not every layout's.
# Note [ruled out by arithmetic]
#     A layout whose states alone (parameters, gradients and optimizer state per rank, counted from the parameters:
#     ``states_floor``, solve/ladder.py) exceed the budget on every rung can never fit; its analysis would only name
#     its smallest budget, which is at least that floor. So it is planned only when nothing fits and its floor is
#     below the smallest budget the other layouts named: otherwise that budget is the one the error reports anyway.
#     DDP over 512 ranks of a 405B model (6.5 TB of states per rank against 72 GB) was analysed and searched for 6 to 8
#     minutes before this, to name a budget no one read.
#     Time has a floor too: the time model adds a layout's data-parallel collectives to its compute, not overlapped
#     (solve/time_model.py), and they are fewest at one micro-batch, over the parameters in the fewest bytes any of
#     its rungs stores them in (``_collectives_alone``). A layout whose collectives alone take as long as a plan
#     found already cannot win: it is dropped before its analysis, with the figure. Ranking the layouts (Note [the
#     layout to verify first]) takes the same floor as a layout's bound, unanalysed, when it already loses to the
#     best bound so far; the race then drops it, or analyses it when the plan it meets is slower than that bound.
def _fallbacks(request: PlanRequest, tally: _Tally, deferred: list[Parallel] = (),
               floors: dict[Parallel, int | None] | None = None) -> list[tuple[Plan, dict[str, Analysis]]]:
    """When no layout was planned: the plans of the layouts' smallest configurations (the models were pessimistic),
    or the error that says most: a layout that fits the GPU but not the host says more than the smallest budget of
    one that fits neither; else the smallest budget of any; else why no strategy can run the model. A layout in
    ``deferred`` (its states alone miss the budget) is planned only where its floor is below every smallest budget
    the others named so far (Note [ruled out by arithmetic])."""
    for label, e in tally.unplanned:
        _attempt(request, label, e.fallback, tally, fallback=True)
    floors = floors or {}
    ruled_out = []
    for parallel in deferred:
        floor = floors.get(parallel) or 0
        smallest = tally.smallest_budget()  # the errors so far, the deferred layouts' before this one included
        if tally.results or tally.over_host() or (smallest is not None and floor >= smallest):
            ruled_out.append(_states_alone(request, parallel, floor))
            continue
        planned = plan_pipeline if pipelined(parallel) else plan_layout
        _attempt(request, parallel.label, functools.partial(planned, request, parallel), tally, now=True)
    tally.failed += ruled_out
    if tally.results:
        return tally.results
    over_host = tally.over_host()
    if over_host:
        raise _saying(min(over_host, key=lambda e: e.host_bytes), ruled_out)
    if tally.errors:
        raise _saying(min(tally.errors, key=lambda e: e.min_budget_bytes), ruled_out)
    raise UnsupportedModelError("no data-parallel strategy can run this model: " + "; ".join(tally.failed))


@dataclass
class _Tally:
    """What planning the layouts left: their plans (``results``), why a layout has none (``failed``, for the notes),
    the layouts whose smallest budget waits until no layout fits (``unplanned``, by label), and the errors naming a
    smallest budget, or a host too small, of those whose smallest budget was asked (``errors``)."""

    results: list[tuple[Plan, dict[str, Analysis]]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    unplanned: list[tuple[str, Unplanned]] = field(default_factory=list)
    errors: list[InfeasibleBudgetError | HostMemoryError] = field(default_factory=list)

    def release(self) -> None:
        """Drop what can no longer be read (Note [bounded memory]): once a layout has a plan, the smallest budgets
        of those without one are never computed, so their climbs go; of the plans, only the fastest keeps its
        analyses (the plan returned needs them; the others are compared by their step time alone)."""
        if not self.results:
            return
        for _, unplanned in self.unplanned:
            unplanned.fallback = None
        fastest = min(range(len(self.results)), key=lambda i: self.results[i][0].predicted_step_seconds)
        self.results = [(plan, analyses if i == fastest else {}) for i, (plan, analyses) in enumerate(self.results)]

    def smallest_budget(self) -> int | None:
        return min((e.min_budget_bytes for e in self.errors if isinstance(e, InfeasibleBudgetError)), default=None)

    def over_host(self) -> list[HostMemoryError]:
        return [e for e in self.errors if isinstance(e, HostMemoryError)]


def _attempt(request: PlanRequest, label: str, run: Callable[[], tuple[Plan, dict[str, Analysis]]], tally: _Tally,
             *, fallback: bool = False, now: bool = False) -> None:
    """Plan one layout (``run``), or record in ``tally`` why not: the one place the planner handles a layout without
    a plan. ``fallback``: ``run`` is an ``Unplanned``'s fallback, whose error naming the smallest budget (or a host
    too small) is kept for the error that says most; ``now``: a layout where nothing fits has its fallback run at
    once rather than kept for later (nothing else fits already). A model the layout's strategy cannot run raises
    when the user named the strategy (its other layouts would fail the same way), else it is recorded."""
    try:
        tally.results.append(run())
    except Unplanned as e:
        if e.fallback is None:
            tally.failed.append(f"{label} not planned: {e}")
        elif now:
            _attempt(request, label, e.fallback, tally, fallback=True)
        else:
            tally.unplanned.append((label, e))
    except AutofitError as e:
        if fallback and isinstance(e, (InfeasibleBudgetError, HostMemoryError)):
            tally.errors.append(e)
        elif len(request.strategies) == 1:
            raise
        else:  # e.g. FSDP2 and a weight used outside its module
            tally.failed.append(f"{label} cannot run this model ({e})")


def _saying(error: AutofitError, ruled_out: list[str]) -> AutofitError:
    """``error`` with the layouts ruled out by arithmetic named after its message (the plan's notes would have)."""
    if ruled_out:
        error.args = (f"{str(error).rstrip('.')}; " + "; ".join(ruled_out), *error.args[1:])
    return error


def _by_bound(order: list[Parallel], climbs: dict[Parallel, Climb], last: set[Parallel]) -> list[Parallel]:
    """``order`` with the layouts searched by their models put in order of their bounds (Note [the layout to
    verify first]); those in ``last`` (planned only when nothing else fits) and those the quick path tries stay where
    they were."""
    ranked = [p for p in order if p not in last and not climbs[p].quick and not pipelined(p)]
    if len(ranked) < 2:
        return order
    bounds: dict[Parallel, float] = {}
    for position, parallel in enumerate(ranked):
        progress.report(f"ranking the layouts by where their search begins: {parallel.label}", position, len(ranked))
        try:
            bounds[parallel] = _bound(climbs[parallel], min(bounds.values(), default=math.inf))
        except AutofitError:  # planned first, where it raises again and is reported as it always was
            bounds[parallel] = -math.inf
    return sorted(order, key=lambda p: (p in last, bounds.get(p, -math.inf)))  # stable: ties keep their order


def _bound(climb: Climb, best: float) -> float:
    """The modelled step time of the first configuration this layout's search would verify: that of the first rung
    searched on the GPUs whose models fit something, as the climb goes up the rungs (a rung that fits nothing
    passes the search to the next one); or that rung's time floor where the floor alone cannot beat ``best`` (no
    checkpoint MILP solved); inf where no rung on the GPUs fits or every rung is passed over."""
    stages = [s for s in climb.stages if not s.skipped(climb.fit) and not s.host_check]
    if not stages:
        return math.inf
    alone = _collectives_alone(climb.request, climb.parallel, climb.stages)
    if alone >= best:  # a floor of every rung's step, known without analysis (Note [ruled out by arithmetic])
        return alone
    for stage in stages:
        _, space, _ = climb.searchable(stage)
        floor = time_floor(space, climb.fit)
        if floor == math.inf:  # not even every unit recomputed fits: the climb goes on to the next rung
            continue
        if floor >= best:
            return floor
        found, _ = search(space, climb.fit)  # what search_verified finds first, its MILPs kept in the space
        if found is not None:
            return found.seconds
    return math.inf


# Note [the layout to verify first]
#     A layout verified first sets the time the others must beat (Note [layouts that cannot win]), and a full
#     estimate is most of a layout's cost, so the layout to verify first is the one whose search would verify the
#     fastest configuration. That is known once each layout is analysed and searched, which each layout planned
#     needs anyway before it can be passed over: its analysis and its checkpoint MILPs are kept in its climb
#     (``Climb.searchable``) and the search that follows reuses them. The plan chosen is the same in any order,
#     since no layout passed over could have won (its verified time is at least its bound); only which layouts
#     the notes name as verified changes. Llama-3.1-8B on 8 A100s with FSDP2 (benchmarks/planning.py): ZeRO-2,
#     first by its collectives, was verified at 5.24 s and then ZeRO-3 at 5.20 s, two full estimates of 32 blocks;
#     ZeRO-3 first (bound 5.20 s against 5.24 s) needs one. A layout's bound is the rung its climb would verify:
#     where a rung's models fit nothing the climb goes on to the next, and so does the bound. The 405B plan of issue
#     56 once ranked its three ZeRO-3 x TP layouts all at inf (their deferring rungs fit nothing), raced them in the
#     order of their collectives and verified TP 8 (235 s) and TP 4 (155 s) before TP 2 (116 s), which won; ranked
#     by their reducing rungs, TP 2 is verified first and alone (4:55 -> 4:27 on two cores, the same plan).
