"""``autofit.plan``: the pipeline's stages, composed (docs/architecture.md).

    request -> quick path -> for each rung of the ladder: analyse -> models -> search + verify -> finish -> Plan
                          -> else the smallest budget over the rungs tried, as an error

:func:`make_request` validates everything once and resolves the device; the quick path (Note [the quick path],
solve/quick.py) proves the fastest configuration with one estimate when it fits; otherwise the planner climbs the
ladder (Note [the ladder], solve/ladder.py): each rung's precisions are analysed, turned into memory and time models,
searched, and the winner verified by a full estimate (solve/estimator.py, solve/verify.py), then finished
(solve/finish.py). With ``world_size > 1`` and no strategy given, DDP and FSDP2 are both planned and the faster wins.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from torch import nn

from autofit.capture.user_hooks import restores_user_hooks
from autofit.core.rng import keeps_user_rng
from autofit.core import progress
from autofit.features import OPT_IN, feature_fields, feature_values
from autofit.analyse.table import Analysis
from autofit.core.report import MemoryEstimate
from autofit.core.errors import (AutofitError, HostMemoryError, InfeasibleBudgetError, UnsupportedFeatureError,
                                 UnsupportedModelError, UnsupportedPrecisionError)
from autofit.training.loss import LossFn, describe_loss
from autofit.capture.loss_probe import loss_reduction
from autofit.training.precision import built_precision, stored_dtype
from autofit.training.batch import naming_inputs
from autofit.validate import as_inputs
from autofit.emit.assemble import assemble_plan, selective_note
from autofit.emit.model_record import record_model
from autofit.emit.plan import Forgone, Plan, why_layout
from autofit.options import Device, Layout, Precision, Savers, Search, gather
from autofit.request import Parallel, PlanRequest, make_request
from autofit.solve.estimator import Estimator
from autofit.solve.host import check_host_before_analysis
from autofit.solve.finish import (even_split, no_rows_table_note, optional_pins, pin_cost_notes, rows_table,
                                  rung_notes, zero_grad_note, verify_beside_rows)
from autofit.solve.ladder import Stage, gpus_for_states, ladder, skipped_note, states_floor
from autofit.solve.quick import quick_path
from autofit.solve.search import Candidate, SearchSpace, module_level, search, time_floor
from autofit.solve.sharding import collective_floor, layouts
from autofit.solve.space import analyse_policies, searchable
from autofit.solve.terms import LARGE_SHARE, deferred_gradient_bytes, large_term_notes
from autofit.solve.verify import (Slower, Verified, host_checked, host_fits, infeasible, search_in_backward,
                                  search_verified, smallest_in_backward, smallest_verified, with_closed_rungs,
                                  with_offload_minimum)
from autofit.core.units import format_bytes

__all__ = ["plan", "plan_with_analysis"]


def plan(
    model: nn.Module, sample: Any, budget: int | str = "8GB", *, batch_size: int | None = None, target: Any = None,
    loss_fn: LossFn | None = None, optimizer: Any = "adamw", clip_grad_norm: float | None = None, shared: Any = None,
    batch_dim: Any = 0,
    device: Device | str = "cuda", precision: Precision | Any = "auto", savers: Savers | str | None = None,
    layout: Layout | int | None = None, search: Search | str | None = None, **deprecated: Any,
) -> Plan:
    """Choose micro-batch size, accumulation steps, precision and checkpointed modules so that one optimizer step
    over ``batch_size`` samples fits ``budget`` at the best predicted speed. ``model`` is never modified.

    - ``sample``: an example batch (a tensor, a tuple of positional inputs or a dict of keyword inputs; dim 0 is the
      batch), the largest shape trained on; ``target``: the loss's target, resized as the sample is.
    - ``budget``: bytes or "24GB", per device. A plan that cannot fit raises ``InfeasibleBudgetError`` naming the
      smallest budget that works.
    - ``batch_size``: the effective batch of one optimizer step, all ranks (default: the sample's).
    - ``loss_fn(output, target)`` (or ``loss_fn(output)``): the scalar loss; None: ``output.loss`` for Hugging Face
      models, else a documented default (autofit/training/loss.py).
    - ``optimizer``: "adamw", "adam", "sgd", an optimizer class or a callable ``params -> Optimizer``.
    - ``clip_grad_norm``: the step clips gradients to this norm (``clip_grad_norm_``), and so does the trainer.
    - ``savers=Savers(zero_grad=...)``: where the step clears the gradients, as the loop that will train runs it:
      "after-step" (after ``optimizer.step()``, the default: autofit's trainer, Hugging Face's Trainer),
      "before-forward" (the PyTorch tutorials' loop) or "after-forward" (Lightning's automatic optimization: the
      previous step's gradients stay allocated through the forward). The plan and its trainer keep it (Note [where
      zero_grad falls], autofit/training/step.py).
    - ``shared``: inputs that are not per-sample (positions of a tuple sample, keys of a dict sample), passed whole
      to every micro-batch (Note [the batch dimension], autofit/training/batch.py); the plan records them.
    - ``batch_dim``: the dim of the batch in the sample and target (default 0; 1 for time-major sequences,
      ``nn.LSTM``'s default; a pair (the inputs', the target's) when they differ); the plan records it.
    - ``device``, ``precision``, ``savers``, ``layout``, ``search``: the options by concern, each a value of
      autofit/options.py (every field documented there) or its shortcut: ``device="H100"``,
      ``precision="bf16"``, ``savers="none"``, ``layout=8`` (the world size), ``search="exact"``.

    The planner climbs the ladder (Note [the ladder], solve/ladder.py): the model's own dtype, then stored lower
    (``Precision.min_stored`` is the floor), then the states on the host (``Savers.offload``), then the opt-in rungs
    of ``Savers.allow``; the plan's notes say which rungs it climbed. When the fastest configuration fits, its full
    estimate is the whole plan (Note [the quick path]) and ``frontier`` is empty. With ``Layout.world_size > 1`` it
    plans one rank of a data-parallel job; with no strategy given, DDP and FSDP2's layouts are all planned and the
    fastest wins (docs/multi-gpu.md).

    The old flat keywords (``gpu=``, ``world_size=``, ``checkpoint=``, ...) still work, with a ``FutureWarning``
    naming the new spelling (Note [flat keywords], autofit/options.py)."""
    options = gather("plan", dict(device=device, precision=precision, savers=savers, layout=layout, search=search),
                     deprecated)
    options["search"] = replace(options["search"], alternatives=bool(options["search"].alternatives))
    with naming_inputs(lambda: as_inputs(sample, target, shared, batch_dim)[0]):  # Note [the batch dimension]
        return plan_with_analysis(
            model, sample, budget, batch_size=batch_size, target=target, loss_fn=loss_fn, optimizer=optimizer,
            clip_grad_norm=clip_grad_norm, shared=shared, batch_dim=batch_dim, **options,
        )[0]


@keeps_user_rng  # Note [the user's random state]
@restores_user_hooks  # Note [user hooks]
def plan_with_analysis(
    model: nn.Module, sample: Any, budget: int | str = "8GB", *, batch_size: int | None = None, target: Any = None,
    loss_fn: LossFn | None = None, optimizer: Any = "adamw", clip_grad_norm: float | None = None, shared: Any = None,
    batch_dim: Any = 0,
    device: Device | str = "cuda", precision: Precision | Any = "auto", savers: Savers | str | None = None,
    layout: Layout | int | None = None, search: Search | str | None = None, **deprecated: Any,
) -> tuple[Plan, dict[str, Analysis]]:
    """:func:`plan`, also returning the analysis of each precision considered (the CLI shows its layer table).

    With ``Search(alternatives=False)`` (what :func:`plan` runs) the planner first checks the fastest configuration
    the time model allows (see Note [the quick path]) and skips the analysis when it fits; the plan then has no
    front and no analyses. Otherwise (the default here) its front also holds the halving micro-batches (a
    checkpoint MILP each). The old ``alternatives=`` keyword is ``search=Search(alternatives=...)``."""
    options = gather("plan_with_analysis", dict(device=device, precision=precision, savers=savers, layout=layout,
                                                search=search), deprecated)
    alternatives = options["search"].alternatives
    request = make_request(model, sample, budget, batch_size=batch_size, target=target, loss_fn=loss_fn,
                           optimizer=optimizer, clip_grad_norm=clip_grad_norm, shared=shared, batch_dim=batch_dim,
                           quick=alternatives is False, **options)
    return _with_speed_rungs(request, _planned)


def _planned(request: PlanRequest) -> tuple[Plan, dict[str, Analysis]]:
    """The plan of ``request`` over every layout it allows (the fastest wins), with the analyses."""
    tally = _Tally()
    parallels = [p for name in request.strategies for p in layouts(request, name)]
    check_host_before_analysis(request, parallels)  # Note [the host of the target], autofit/validate.py
    order, climbs, floors, hopeless, host_only = _layout_order(request, parallels)
    deferred: list[Parallel] = []
    for position, parallel in enumerate(order):
        name, climb = parallel.label, climbs.pop(parallel)  # dropped after its turn (Note [bounded memory])
        if len(order) > 1:  # the layout race, how far (issue 56)
            progress.report(f"layout {name}", position, len(order))
        # when the layout that holds least misses the budget, the others' smallest budgets are no smaller, and only
        # the smallest is ever reported
        if parallel in hopeless and (tally.results or not parallel.least_memory):
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
        on_gpus = any(not r[0].offload_states for r in tally.results)
        _attempt(request, name, functools.partial(_plan_parallel, request, parallel, beat, on_gpus, climb), tally)
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
        list[Parallel], dict[Parallel, _Climb], dict[Parallel, int | None], set[Parallel], set[Parallel]]:
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
    climbs = {p: _Climb.of(request, p) for p in order}
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
        _attempt(request, parallel.label, functools.partial(_plan_parallel, request, parallel), tally, now=True)
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
    unplanned: list[tuple[str, _Unplanned]] = field(default_factory=list)
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
    a plan. ``fallback``: ``run`` is an ``_Unplanned``'s fallback, whose error naming the smallest budget (or a host
    too small) is kept for the error that says most; ``now``: a layout where nothing fits has its fallback run at
    once rather than kept for later (nothing else fits already). A model the layout's strategy cannot run raises
    when the user named the strategy (its other layouts would fail the same way), else it is recorded."""
    try:
        tally.results.append(run())
    except _Unplanned as e:
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


class _Unplanned(Exception):
    """A layout without a plan that could win (Note [layouts that cannot win]): ``why`` its rungs could only lose to
    a plan found already, or nothing fits and ``fallback()`` returns the plan of its smallest configuration or raises
    the error naming its smallest budget (a few more verifications, run only when no layout fits)."""

    def __init__(self, why: str, fallback: Callable[[], tuple[Plan, dict[str, Analysis]]] | None = None) -> None:
        super().__init__(why)
        self.fallback = fallback


# Note [layouts that cannot win]
#     With several layouts, each climbs its own ladder and the fastest plan wins. A plan's predicted time is that of
#     the configuration its search verified, and the search verifies in order of modelled time, so the first
#     configuration a rung would verify bounds the rung's plan from below. A rung whose bound is no faster than a
#     plan found already (``beat``) verifies nothing (``Slower``), and where even the floor of every configuration
#     (Note [pruned search], solve/search.py) loses, no checkpoint MILP is solved: the next rung is searched the same
#     way, as it is when nothing fits. Where the search did find the configuration that loses, the climb stops
#     there: its models fit that rung, a climb stops at the first rung that fits, so the layout's plan would be that
#     rung's, and lose. The later rungs, an analysis each, are for a rung that fits nothing; what stopping gives up is
#     a rung the models fit by more than its verification's corrections can mend, with a later rung of the same
#     layout then the fastest plan of all. A layout without a plan raises ``_Unplanned``; its smallest
#     budget, a few verifications more, is computed only if no layout fits at all (``_smallest``, from what the
#     climb carried). The layouts are planned in order of their bounds (Note [the layout to verify first]), else of
#     their collectives at one micro-batch (``collective_floor``, the same compute for all of them), so the likely
#     winner comes first.
#     Llama-3-70B-shaped on 4 x 8 H100s (benchmarks/multi_gpu_70b.py): three layouts verified in full, one of them
#     only to name a smallest budget nobody read, before this.
def _by_bound(order: list[Parallel], climbs: dict[Parallel, _Climb], last: set[Parallel]) -> list[Parallel]:
    """``order`` with the layouts searched by their models put in order of their bounds (Note [the layout to
    verify first]); those in ``last`` (planned only when nothing else fits) and those the quick path tries stay where
    they were."""
    ranked = [p for p in order if p not in last and not climbs[p].quick]
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


def _bound(climb: _Climb, best: float) -> float:
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
#     (``_Climb.searchable``) and the search that follows reuses them. The plan chosen is the same in any order,
#     since no layout passed over could have won (its verified time is at least its bound); only which layouts
#     the notes name as verified changes. Llama-3.1-8B on 8 A100s with FSDP2 (benchmarks/planning.py): ZeRO-2,
#     first by its collectives, was verified at 5.24 s and then ZeRO-3 at 5.20 s, two full estimates of 32 blocks;
#     ZeRO-3 first (bound 5.20 s against 5.24 s) needs one. A layout's bound is the rung its climb would verify:
#     where a rung's models fit nothing the climb goes on to the next, and so does the bound. The 405B plan of issue
#     56 once ranked its three ZeRO-3 x TP layouts all at inf (their deferring rungs fit nothing), raced them in the
#     order of their collectives and verified TP 8 (235 s) and TP 4 (155 s) before TP 2 (116 s), which won; ranked
#     by their reducing rungs, TP 2 is verified first and alone (4:55 -> 4:27 on two cores, the same plan).
def _plan_parallel(request: PlanRequest, parallel: Parallel, beat: float | None = None, on_gpus: bool = False,
                   climb: _Climb | None = None) -> tuple[Plan, dict[str, Analysis]]:
    """Quick path; else climb the ladder (Note [the ladder], solve/ladder.py): each rung analysed, searched and its
    winner verified; else ``_Unplanned``: no faster than ``beat``, the fastest plan found already, or without its
    states on the host where ``on_gpus`` says a plan keeps them on the GPUs (Note [layouts that cannot win]); or
    nothing fits (its ``fallback()``: the smallest budget over the rungs tried). ``climb`` is the layout's climb
    begun already (its analyses and searches kept: Note [the layout to verify first])."""
    climb = replace(climb or _Climb.of(request, parallel), beat=beat)  # the caches' dicts are shared, not copied
    request = climb.request
    if climb.quick:
        estimator = Estimator(request, parallel)
        found = quick_path(estimator, climb.fit)
        if found is not None:
            return _plan_of(estimator, found), {}
    carried = _Carried()
    for rung, stage in enumerate(climb.stages):
        if len(climb.stages) > 1 and not stage.skipped(climb.fit):  # the ladder's climb, how far
            progress.report(f"rung '{stage.what}' of {climb.parallel.label}", rung, len(climb.stages))
        if stage.skipped(climb.fit):  # not worth an analysis: its states alone miss the budget
            passed = f"{stage.what} ({stage.floor_bytes / 2**30:.1f} GiB)"
            if stage.deferral_misses(climb.fit):  # Note [a deferral that cannot fit], solve/ladder.py
                passed = (f"{stage.what}, deferring FSDP2's reduce-scatter ({stage.accumulating_floor / 2**30:.1f} "
                          "GiB with the unsharded gradients held across micro-batches; without accumulation it is "
                          "the step of the rung that reduces every micro-batch)")
            carried = replace(carried, skipped=(*carried.skipped, passed))
            continue
        if stage.host_check and on_gpus:  # a plan keeps its states on the GPUs: the CPU step cannot win
            carried = replace(carried, host_skipped=True)
            continue
        searched = _host_rung(climb, stage) if stage.host_check else _device_rung(climb, stage)
        below, carried = carried.tried, carried.after(searched)
        if isinstance(searched.found, Verified):
            reducing = _reducing_instead(climb, stage, searched)  # Note [defer or reduce every micro-batch]
            if isinstance(reducing, tuple):
                return reducing
            if reducing is not None:
                searched = replace(searched, found=replace(searched.found, notes=searched.found.notes + (reducing,)))
            plan, analysed = _rung_plan(climb, stage, carried, searched)
            return replace(plan, alternatives=_forgone(climb, stage, below, searched.found)), analysed
        if isinstance(searched.found, Slower) and searched.found.modelled_fit:
            break  # Note [layouts that cannot win]: this rung fits, so the layout's plan would be its, and lose
    if beat is not None:  # a plan exists: this layout's smallest budget would never be read
        raise _Unplanned(_why_not_faster(beat, carried))
    raise _Unplanned("nothing fits", fallback=functools.partial(_smallest, climb, carried))


# Note [speed rungs]
#     A rung that buys speed, not memory (OptInFeature.for_speed: float8's FP8 matmuls), is no step of the ladder,
#     which stops at the first rung that fits: a model that fits in bf16 would never reach it. Where plan(allow=...)
#     names it, the request is planned twice, without it and with it (every layout, each with its own ladder), and
#     the plan the time model predicts faster is taken, or the one that fits where only one does; the plan's notes say
#     which, with both plans' predicted step and peak. The feature changes numerics, so it is never taken unasked,
#     and a user who fixed it (Savers(float8=...)) plans once, with it.
def _with_speed_rungs(request: PlanRequest, planned: Callable[[PlanRequest], tuple[Plan, dict[str, Analysis]]]
                      ) -> tuple[Plan, dict[str, Analysis]]:
    """``planned(request)``, and for each speed rung ``plan(allow=...)`` opened, the request planned with it: the
    faster of the two, or the one that fits (Note [speed rungs])."""
    chosen, error = None, None
    try:
        chosen = planned(request)
    except (InfeasibleBudgetError, HostMemoryError) as e:
        error = e
    for feature in OPT_IN:
        value = feature.allowed(request)
        if not feature.for_speed or value is None or feature.in_force(request) is not None:
            continue
        try:
            rung = planned(feature.request_for(request, value))
        except (InfeasibleBudgetError, HostMemoryError, UnsupportedFeatureError, UnsupportedPrecisionError) as e:
            if chosen is not None:
                chosen = (_noted(chosen[0], f"rung {feature.name!r} not taken: {e}"), chosen[1])
            continue
        mine = rung[0]
        if chosen is None:
            chosen, error = (_noted(mine, f"{feature.climbed(value, request)}; nothing fits without it "
                                          f"({error})"), rung[1]), None
            continue
        other = chosen[0]
        versus = (f"predicted step {mine.predicted_step_seconds:.4g} s and peak {format_bytes(mine.peak_bytes)} "
                  f"with it, {other.predicted_step_seconds:.4g} s and {format_bytes(other.peak_bytes)} without")
        if mine.predicted_step_seconds < other.predicted_step_seconds:
            chosen = (_noted(mine, f"{feature.climbed(value, request)}: {versus}"), rung[1])
        else:
            chosen = (_noted(other, f"rung {feature.name!r} not taken, no faster: {versus}"), chosen[1])
    if chosen is None:
        raise error
    return chosen


def _noted(plan: Plan, note: str) -> Plan:
    return replace(plan, notes=plan.notes + (note,))


@dataclass(frozen=True)
class _Climb:
    """What stays the same while one layout climbs its ladder: the request as the layout runs it, the rungs, the
    plan to beat, and the caches the rungs share (``analyses`` per layout and opt-in rungs, by policy label,
    ``rows_known``, (candidate, policy) -> {(length, rows): bytes}, ``spaces``, each rung's search space by its
    position, and ``caches``, the search caches the rungs of one layout and features share: Note [one search cache
    per layout], solve/space.py), filled as rungs are searched."""

    request: PlanRequest
    parallel: Parallel
    stages: tuple[Stage, ...]
    beat: float | None
    analyses: dict[tuple, dict[str, Analysis]] = field(default_factory=dict)
    rows_known: dict[tuple, dict[tuple[int, int], int]] = field(default_factory=dict)
    spaces: dict[int, tuple[Estimator, SearchSpace, dict[str, Analysis]]] = field(default_factory=dict)
    caches: dict[tuple, tuple[dict, dict]] = field(default_factory=dict)  # Note [one search cache per layout]

    @classmethod
    def of(cls, request: PlanRequest, parallel: Parallel) -> _Climb:
        request = request.for_layout(parallel)  # with tensor parallel, a group's ranks share their rows
        return cls(request, parallel, ladder(request, parallel), None)

    @property
    def fit(self) -> int:
        return self.request.fit_bytes

    @property
    def quick(self) -> bool:
        """Whether the quick path is tried first (Note [the quick path]); the quick path's time model has no layer
        table to size tensor parallel's all-reduces by: analysed instead."""
        request = self.request
        return (request.quick and request.auto_precision and self.stages[0].floor_bytes <= self.fit
                and self.parallel.tensor_parallel == 1)

    def searchable(self, stage: Stage) -> tuple[Estimator, SearchSpace, dict[str, Analysis]]:
        """The rung's estimator, search space and analyses (``solve.space.searchable``), built once per rung: the
        space keeps the checkpoint MILPs solved in it (Note [the layout to verify first])."""
        key = next(i for i, s in enumerate(self.stages) if s is stage)
        if key not in self.spaces:
            self.spaces[key] = searchable(self.request, stage, self.analyses, self.caches)
        return self.spaces[key]


@dataclass(frozen=True)
class _Searched:
    """One rung searched: ``found`` (a verified plan, ``Slower`` than ``beat``, or None), the rung's estimator and
    analyses, the module-level candidate to compare a selective winner with, and what the smallest budget needs
    later: the device rung's space (``tried``), its in-backward space (``backward``), the host rung's smallest
    verified configuration (``on_host``); None where the rung has none."""

    found: Verified | Slower | None
    estimator: Estimator
    analysed: dict[str, Analysis]
    versus: Candidate | None = None
    tried: tuple[SearchSpace, Estimator] | None = None
    backward: SearchSpace | None = None
    on_host: tuple[Candidate, MemoryEstimate] | None = None


@dataclass(frozen=True)
class _Carried:
    """What the climb carries from rung to rung: the rungs ``skipped`` (named with their floors, for the plan's
    note), the last device rung's space and estimator (``tried``, the smallest budget's), the space of the
    configurations that may step in backward, the smallest verified configuration with the states on the host, the
    fastest bound of the rungs that could only lose to ``beat`` (``slower``), and whether the states on the host
    were not tried because a plan keeps them on the GPUs (``host_skipped``)."""

    skipped: tuple[str, ...] = ()
    tried: tuple[SearchSpace, Estimator] | None = None
    backward: SearchSpace | None = None
    on_host: tuple[Candidate, MemoryEstimate] | None = None
    slower: Slower | None = None
    host_skipped: bool = False

    def after(self, searched: _Searched) -> _Carried:
        """This record with what ``searched`` found: each of the smallest budget's inputs is the latest rung's that
        has one, and ``slower`` the fastest bound so far."""
        slower = self.slower
        if isinstance(searched.found, Slower):  # Note [layouts that cannot win]
            slower = searched.found if slower is None else min(slower, searched.found, key=lambda f: f.seconds)
        return replace(self, slower=slower,
                       tried=searched.tried if searched.tried is not None else self.tried,
                       backward=searched.backward if searched.backward is not None else self.backward,
                       on_host=searched.on_host if searched.on_host is not None else self.on_host)


def _device_rung(climb: _Climb, stage: Stage) -> _Searched:
    """The rung's search with the states on the GPUs; where nothing fits with every gradient alive and the rung
    allows it, the search with the optimizer stepped in backward."""
    request = climb.request
    estimator, space, analysed = climb.searchable(stage)
    progress.report("searching micro-batches, precisions and recomputed modules (checkpoint MILP)")
    found = search_verified(space, climb.fit, functools.partial(verify_beside_rows, estimator, climb.rows_known),
                            climb.beat, front=not request.quick)
    # the best module-level candidate, when the winner recomputes selectively: the plan says what selective saves
    versus = module_level(space, climb.fit) if isinstance(found, Verified) and found.candidate.selective else None
    backward = None
    if found is None and stage.in_backward:
        backward, found = _in_backward(climb, stage, space, estimator)
    return _Searched(found, estimator, analysed, versus, tried=(space, estimator), backward=backward)


def _in_backward(climb: _Climb, stage: Stage, space: SearchSpace,
                 estimator: Estimator) -> tuple[SearchSpace, Verified | None]:
    """Nothing fits with every gradient alive: the rung's in-backward precisions searched with the optimizer stepped
    in backward (Note [gradients before forward as a plan knob]); the space is kept for the smallest budget."""
    backward = replace(space, precisions=tuple(p.label for p in stage.in_backward))
    return backward, search_in_backward(backward, climb.fit, _gradient_bytes(climb.request.model), estimator.verify)


def _host_rung(climb: _Climb, stage: Stage) -> _Searched:
    """The rung with the states on the host, each candidate also checked against the host's memory; where the
    models find nothing, the smallest verified configuration, which may still fit (the models may be pessimistic)
    and names the smallest budget with the states offloaded otherwise."""
    request, parallel, fit = climb.request, climb.parallel, climb.fit
    estimator, space, analysed = climb.searchable(stage)
    progress.report("searching with the states on the host (checkpoint MILP)")
    found = search_verified(space, fit, host_checked(estimator.verify, fit, request.host_budget_bytes,
                                                     parallel.ranks_per_node), climb.beat, front=not request.quick)
    if found is not None:
        return _Searched(found, estimator, analysed)
    on_host = candidate, est = smallest_verified(space, estimator.verify)
    fitted = est.within(fit)
    if fitted is not None:
        found = Verified(candidate, host_fits(fitted, request.host_budget_bytes, parallel.ranks_per_node), (candidate,))
    return _Searched(found, estimator, analysed, on_host=on_host)


# Note [what a rung buys]
#     A plan that climbed the ladder past its first rungs (the states on the host, a lower stored precision, an
#     opt-in rung) pays for it: a slower step, rounding, numerics the user opted into. So the plan shows, beside it,
#     the best without that rung, from the work the climb did: the rung below's search space and estimator (the last
#     rung searched before it, which found nothing its verification kept), and the plan's own configuration (micro-
#     batch, accumulation, recomputed modules, and its compute precision where that rung has it) estimated there in
#     full, with that rung's modelled step time. One full estimate more (about a tenth of the 7B LoRA plan on an
#     RTX 4090); the figure is the one ``autofit.estimate`` gives for those knobs. The ladder climbs only where
#     nothing fit below, so it usually does not fit, and says by how much. Where every rung below was passed over by
#     arithmetic (its states alone miss the budget) nothing is estimated, and the row says so. For a multi-GPU job
#     whose states needed the host because their share alone missed the budget, also the fewest GPUs whose share
#     would fit (``gpus_for_states``, solve/ladder.py): a floor, below it offload is needed.
def _forgone(climb: _Climb, stage: Stage, below: tuple[SearchSpace, Estimator] | None,
             found: Verified) -> tuple[Forgone, ...]:
    """The best without the rung ``stage`` the plan was found on, where it is a climbed one (Note [what a rung
    buys]); () for the rungs of the model's own dtype."""
    if not (stage.host_check or stage.policies[0].stored or stage.features):
        return ()
    request, chosen = climb.request, found.candidate
    device = [s for s in climb.stages[:climb.stages.index(stage)] if not s.host_check]
    gpus = gpus_for_states(request, device) if stage.host_check and climb.parallel.world_size > 1 else None
    if gpus is not None and gpus <= climb.parallel.world_size:  # the states fit already: what needs the host is more
        gpus = None
    if below is None:  # every rung below passed over by its states' floor
        floor = states_floor(tuple(device)) if device else None
        return (Forgone(without=stage.what, fits=False, device_bytes=floor or 0, gpus=gpus),)
    space, estimator = below
    same = [p for p in space.precisions if p.split("/")[0] == chosen.precision.split("/")[0]]
    label = chosen.precision if chosen.precision in space.precisions else (same or list(space.precisions))[0]
    candidate = replace(chosen, precision=label, offload_states=space.offload_states, in_backward=False,
                        preallocated_grads=False)
    progress.report(f"the plan without {stage.what}, for comparison: micro-batch {chosen.micro_batch_size} x "
                    f"{chosen.accumulation_steps} ({label}), one full simulation")
    # the figure autofit.estimate gives: no second layout of the gradients tried (Note [gradients before forward as
    # a plan knob]), a comparison, not a plan
    try:
        est = estimator.estimate(candidate, estimator.policy(label))
    except AutofitError:  # a comparison only: a configuration the rung below cannot run leaves the plan as it is
        return ()
    seconds = space.time[label].step_time(label, chosen.micro_batch_size, chosen.accumulation_steps,
                                          chosen.checkpoint, chosen.last_micro_batch_size, chosen.offload,
                                          chosen.selective, chosen.op_selective).total
    fitted = est.within(request.fit_bytes)
    shown = fitted if fitted is not None else est
    return (Forgone(without=stage.what, fits=fitted is not None, precision=label,
                    micro_batch_size=chosen.micro_batch_size, gradient_accumulation_steps=chosen.accumulation_steps,
                    checkpoint=chosen.checkpoint, peak_bytes=shown.peak_bytes, device_bytes=shown.device_bytes,
                    step_seconds=seconds, gpus=gpus),)


def _rung_plan(climb: _Climb, stage: Stage, carried: _Carried, searched: _Searched,
               for_time: bool = False) -> tuple[Plan, dict[str, Analysis]]:
    """The plan of the rung's verified winner, its notes naming the rungs passed over and the rung's own
    (``for_time``: the rung was chosen for its speed, not because the rungs before it fit nothing)."""
    found = searched.found
    found = replace(found, notes=found.notes + skipped_note(stage, carried.skipped)
                    + rung_notes(climb.request, stage, searched.estimator, found, for_time=for_time))
    plan = _plan_of(searched.estimator, found, searched.analysed, climb.rows_known)
    if searched.versus is not None:
        plan = replace(plan, module_level_step_seconds=searched.versus.seconds, notes=plan.notes + (
            selective_note(plan, searched.versus),))
    return plan, searched.analysed


# Note [defer or reduce every micro-batch]
#     Under FSDP2 with accumulation the plan chooses how the gradients sync (Note [gradient sync under accumulation],
#     autofit/training/step.py) by cost. Memory first: where deferring to the last micro-batch fits nothing, the
#     ladder's next rung reduces every micro-batch (solve/ladder.py). Where deferring fits, step time: for the same
#     configuration deferring is faster (one reduce-scatter per step instead of one per micro-batch), but the
#     unsharded gradients it keeps (Note [deferred reduce-scatter], solve/terms.py) may be what forces a smaller
#     micro-batch or more recomputation. So when they are over a fifth of the winner's peak, the reducing rung is
#     searched too, with the winner's time to beat (Note [layouts that cannot win]: it verifies nothing unless its
#     models promise a faster step), and the faster plan is kept. Under a fifth, freeing them cannot buy back a
#     reduce-scatter per micro-batch often enough to be worth the rung's analysis. The plan's notes say which was
#     chosen and why. torchtitan reduce-scatters after every micro-batch: its ``Trainer.train_step``
#     (torchtitan/train.py) runs ``forward_backward_step`` per micro-batch, a plain ``loss.backward()``, and never
#     calls ``set_requires_gradient_sync``.
def _reducing_instead(climb: _Climb, stage: Stage,
                      searched: _Searched) -> tuple[Plan, dict[str, Analysis]] | str | None:
    """The plan of the reducing rung where it beats the deferring winner ``searched`` found on ``stage``; else the
    note saying it was weighed and lost, or None where it was not weighed (Note [defer or reduce every
    micro-batch])."""
    found = searched.found
    reducing = next((s for s in climb.stages if s.parallel.reduce_every_micro_batch
                     and s.policies == stage.policies), None)
    if reducing is None or stage.parallel.reduce_every_micro_batch or found.candidate.accumulation_steps < 2:
        return None
    config = searched.estimator.config(found.candidate, searched.estimator.policy(found.candidate.precision))
    term = deferred_gradient_bytes(climb.request.model, config)
    if term <= LARGE_SHARE * found.estimate.device_bytes:
        return None
    progress.report("weighing FSDP2 reducing every micro-batch against deferring (checkpoint MILP)")
    other = _device_rung(replace(climb, beat=found.candidate.seconds), reducing)
    if not isinstance(other.found, Verified) or other.found.candidate.seconds >= found.candidate.seconds:
        bound = other.found.seconds if isinstance(other.found, Slower) else None
        return ("FSDP2 defers the gradients' reduce-scatter to the last micro-batch: reducing every micro-batch was "
                f"searched too and is no faster{f' (at best {bound:.3g} s)' if bound else ''} than "
                f"{found.candidate.seconds:.3g} s (Note [defer or reduce every micro-batch])")
    why = (f"FSDP2 reduce-scatters after every micro-batch: {other.found.candidate.seconds:.3g} s per step against "
           f"{found.candidate.seconds:.3g} s deferring to the last micro-batch, whose unsharded gradients "
           f"({format_bytes(term)}) forced a slower configuration (Note [defer or reduce every micro-batch])")
    other = replace(other, found=replace(other.found, notes=other.found.notes + (why,)))
    return _rung_plan(climb, reducing, _Carried(), other, for_time=True)


def _why_not_faster(beat: float, carried: _Carried) -> str:
    """Why a layout has no plan when another has one: its bound loses to ``beat``, or nothing fits, and its states
    on the host were not tried (Note [layouts that cannot win])."""
    slower = carried.slower
    return ((f"its fastest configuration the models allow, {slower.seconds:.3g} s, is no faster than {beat:.3g} s"
             if slower is not None else "nothing fits")
            + (" with its states on the GPUs, and with them on the host it cannot beat a plan that keeps them there"
               if carried.host_skipped else ""))


def _smallest(climb: _Climb, carried: _Carried) -> tuple[Plan, dict[str, Analysis]]:
    """The plan of the smallest verified configuration where the models were pessimistic, else the error naming the
    smallest budget over the rungs tried. Run only when no layout fits (Note [layouts that cannot win])."""
    request, parallel = climb.request, climb.parallel
    tried = carried.tried
    if tried is None:  # every rung on the device was skipped: search the last, to name the smallest budget
        last = [s for s in climb.stages if not s.host_check][-1]
        rung_estimator, space, _ = climb.searchable(last)
        tried = space, rung_estimator
    space, rung_estimator = tried
    # Note [gradients before forward as a plan knob]
    least, est = smallest_verified(space, rung_estimator.verify_floor)
    stepped = smallest_in_backward(carried.backward, rung_estimator.verify) if carried.backward is not None else None
    if stepped is not None and stepped[1].min_device_bytes < est.min_device_bytes:
        least, est = stepped
    fitted = est.within(climb.fit)
    if fitted is not None:  # the models were pessimistic: the smallest configuration fits
        analysed = climb.analyses[(rung_estimator.parallel, *feature_values(rung_estimator.request))]
        return _plan_of(rung_estimator, Verified(least, fitted, (least,)), analysed), analysed
    at = f", {parallel.strategy} over {parallel.world_size} ranks" if parallel.strategy else ""
    error = infeasible(least, est, request.budget_bytes, at, margin=request.margin_bytes,
                       sharded_over=parallel.shard_ranks if parallel.shards_parameters else 0)
    if carried.on_host is not None:
        error = with_offload_minimum(error, carried.on_host, request.host_budget_bytes, request.margin_bytes,
                                     parallel.ranks_per_node)
    if parallel.strategy is None:  # the opt-in rungs this model could climb (Note [the ladder])
        error = with_closed_rungs(error, request.closed_rungs)
    raise error


def _plan_of(estimator: Estimator, found: Verified, analyses: dict[str, Analysis] | None = None,
             rows_known: dict[tuple, dict[tuple[int, int], int]] | None = None) -> Plan:
    """The Plan of a verified choice, finished (solve/finish.py): optional fp32 pins, the cost of each pin, the even
    split for the exports, the rows per micro-batch at shorter lengths."""
    request, parallel = estimator.request, estimator.parallel
    if found.estimate.preallocated_grads:  # the finishing estimates run the step the plan runs
        found = replace(found, candidate=replace(found.candidate, preallocated_grads=True))
    found, policy, pins = optional_pins(estimator, found, estimator.policy(found.candidate.precision))
    if policy.stored is None:  # the parameters stay as built: say in what (plan.precision reads fp32 otherwise)
        policy = replace(policy, built=built_precision(request.model.parameters()))
    chosen = found.candidate
    plan = assemble_plan(  # the plan carries the step its estimate simulated (Note [the plan's step])
        chosen, found.estimate, found.fitting, step=estimator.config(chosen, policy), budget_bytes=request.budget_bytes,
        margin_bytes=request.margin_bytes, batch_size=request.batch_size,
        notes=request.notes + found.notes + found.estimate.notes, host_budget_bytes=request.host_budget_bytes,
        features=feature_fields(request),
    )
    plan = replace(plan, min_rows=request.min_rows)  # Note [micro-batches a model refuses]
    analysis = (analyses or {}).get(policy.label)
    plan = replace(plan, notes=plan.notes + pin_cost_notes(
        estimator, plan.device_bytes, chosen, policy, analysis, request.pins + pins,
        analyse=lambda p: analyse_policies(request, parallel, (p,), {})[p.label]))
    order = zero_grad_note(estimator, chosen, policy, plan.peak_bytes)
    if order is not None:
        plan = replace(plan, notes=plan.notes + (order,))
    plan = replace(plan, notes=plan.notes + large_term_notes(  # Note [a large term and its knob], solve/terms.py
        request.model, estimator.config(chosen, policy), plan.device_bytes, request.device,
        flag="reducing every micro-batch (the ladder's rung 'FSDP2 reducing every micro-batch', Note [defer or "
             "reduce every micro-batch])", breakdown=plan.estimate.breakdown, planned=True))
    split, note = even_split(estimator, chosen, policy)
    if note is not None:
        plan = replace(plan, even_split=split, notes=plan.notes + (note,))
    spec, table = rows_table(estimator, chosen, policy, (rows_known or {}).get((chosen, policy), {}))
    unasked = no_rows_table_note(request, chosen)  # the table only on demand
    if unasked is not None:
        plan = replace(plan, notes=plan.notes + (unasked,))
    plan = replace(plan, loss=describe_loss(request.loss_fn), loss_fn=request.loss_fn,  # Note [the plan's loss]
                   shared=tuple(sorted(request.batch.shared, key=str)),
                   made_for=record_model(request.model),  # Note [the plan's model]
                   batch_dim=(request.batch.batch_dim,
                              request.batch.batch_dim if request.target is None else request.target.batch_dim))
    if loss_reduction(request.model, request.batch, request.target, request.loss_fn) == "sum":
        what = "loss_fn" if request.loss_fn is not None else "the model's own loss (its output's 'loss')"
        plan = replace(plan, loss_reduction="sum", notes=plan.notes + (
            f"{what} is a sum over rows (the loss of two rows is the sum of theirs): the trainer adds the "
            "micro-batches' losses unweighted, so a step equals one full-batch step (Note [sum-reduced losses])",))
    return replace(plan, lengths=spec) if table is None else replace(plan, lengths=spec, rows_by_length=table)


def _gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
