"""One layout's climb up its ladder (Note [the ladder], solve/ladder.py), to a finished plan: the quick path, else
each rung analysed, searched and its winner verified, the plan finished (solve/finish.py) with what the rungs
passed over and what a climbed rung buys; or ``Unplanned``: no faster than the plan to beat, or nothing fits (its
smallest budget computed only when no layout fits: autofit/planning/race.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable

from torch import nn

from autofit.core import progress
from autofit.features import feature_fields, feature_values
from autofit.analyse.table import Analysis
from autofit.core.report import MemoryEstimate
from autofit.core.errors import AutofitError
from autofit.training.loss import describe_loss
from autofit.capture.loss_probe import loss_reduction
from autofit.training.precision import built_precision
from autofit.emit.assemble import assemble_plan, selective_note
from autofit.emit.model_record import record_model
from autofit.emit.plan import Plan
from autofit.emit.plan_text import Forgone
from autofit.parallel.rungs import (budget_error_at, more_gpus, one_process_features, priced_unanalysed,
                                    reducing_rival)
from autofit.request import Parallel, PlanRequest
from autofit.solve.candidate import Candidate, SearchSpace
from autofit.solve.estimator import Estimator
from autofit.solve.finish import (even_split, no_rows_table_note, optional_pins, pin_cost_notes, rows_table,
                                  rung_notes, zero_grad_note, verify_beside_rows)
from autofit.solve.ladder import Stage, gpus_for_states, ladder, skipped_note, states_floor
from autofit.solve.quick import quick_path
from autofit.solve.search import module_level
from autofit.solve.space import analyse_policies, searchable
from autofit.solve.terms import LARGE_SHARE, deferred_gradient_bytes, large_term_notes
from autofit.solve.verify import (Slower, Verified, host_checked, host_fits, infeasible, search_in_backward,
                                  search_verified, smallest_in_backward, smallest_verified, with_closed_rungs,
                                  with_offload_minimum)
from autofit.core.units import format_bytes

__all__ = ["Climb", "Unplanned", "plan_layout", "plan_of"]


class Unplanned(Exception):
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
#     layout then the fastest plan of all. A layout without a plan raises ``Unplanned``; its smallest
#     budget, a few verifications more, is computed only if no layout fits at all (``_smallest``, from what the
#     climb carried). The layouts are planned in order of their bounds (Note [the layout to verify first]), else of
#     their collectives at one micro-batch (``collective_floor``, the same compute for all of them), so the likely
#     winner comes first.
#     Llama-3-70B-shaped on 4 x 8 H100s (benchmarks/multi_gpu_70b.py): three layouts verified in full, one of them
#     only to name a smallest budget nobody read, before this.


def plan_layout(request: PlanRequest, parallel: Parallel, beat: float | None = None, on_gpus: bool = False,
                   climb: Climb | None = None) -> tuple[Plan, dict[str, Analysis]]:
    """Quick path; else climb the ladder (Note [the ladder], solve/ladder.py): each rung analysed, searched and its
    winner verified; else ``Unplanned``: no faster than ``beat``, the fastest plan found already, or without its
    states on the host where ``on_gpus`` says a plan keeps them on the GPUs (Note [layouts that cannot win]); or
    nothing fits (its ``fallback()``: the smallest budget over the rungs tried). ``climb`` is the layout's climb
    begun already (its analyses and searches kept: Note [the layout to verify first])."""
    climb = replace(climb or Climb.of(request, parallel), beat=beat)  # the caches' dicts are shared, not copied
    request = climb.request
    if climb.quick:
        estimator = Estimator(request, parallel)
        found = quick_path(estimator, climb.fit)
        if found is not None:
            return plan_of(estimator, found), {}
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
        raise Unplanned(_why_not_faster(beat, carried))
    raise Unplanned("nothing fits", fallback=functools.partial(_smallest, climb, carried))


@dataclass(frozen=True)
class Climb:
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
    def of(cls, request: PlanRequest, parallel: Parallel) -> Climb:
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
                and priced_unanalysed(self.parallel))

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


def _device_rung(climb: Climb, stage: Stage) -> _Searched:
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


def _in_backward(climb: Climb, stage: Stage, space: SearchSpace,
                 estimator: Estimator) -> tuple[SearchSpace, Verified | None]:
    """Nothing fits with every gradient alive: the rung's in-backward precisions searched with the optimizer stepped
    in backward (Note [gradients before forward as a plan knob]); the space is kept for the smallest budget."""
    backward = replace(space, precisions=tuple(p.label for p in stage.in_backward))
    return backward, search_in_backward(backward, climb.fit, _gradient_bytes(climb.request.model), estimator.verify)


def _host_rung(climb: Climb, stage: Stage) -> _Searched:
    """The rung with the states on the host, each candidate also checked against the host's memory; where the
    models find nothing, the smallest verified configuration, which may still fit (the models may be pessimistic)
    and names the smallest budget with the states offloaded otherwise."""
    request, parallel, fit = climb.request, climb.parallel, climb.fit
    estimator, space, analysed = climb.searchable(stage)
    progress.report("searching with the states on the host (checkpoint MILP)")
    found = search_verified(space, fit, host_checked(estimator.verify, fit, request.host_budget_bytes, parallel),
                            climb.beat, front=not request.quick)
    if found is not None:
        return _Searched(found, estimator, analysed)
    on_host = candidate, est = smallest_verified(space, estimator.verify)
    fitted = est.within(fit)
    if fitted is not None:
        found = Verified(candidate, host_fits(fitted, request.host_budget_bytes, parallel), (candidate,))
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
def _forgone(climb: Climb, stage: Stage, below: tuple[SearchSpace, Estimator] | None,
             found: Verified) -> tuple[Forgone, ...]:
    """The best without the rung ``stage`` the plan was found on, where it is a climbed one (Note [what a rung
    buys]); () for the rungs of the model's own dtype."""
    if not (stage.host_check or stage.policies[0].stored or stage.features):
        return ()
    request, chosen = climb.request, found.candidate
    device = [s for s in climb.stages[:climb.stages.index(stage)] if not s.host_check]
    # where the states fit the GPUs already, what needs the host is more than them: no GPUs to name
    gpus = more_gpus(climb.parallel, gpus_for_states(request, device)) if stage.host_check else None
    if below is None:  # every rung below passed over by its states' floor
        floor = states_floor(tuple(device)) if device else None
        return (Forgone(without=stage.what, fits=False, device_bytes=floor or 0, gpus=gpus),)
    space, estimator = below
    same = [p for p in space.precisions if p.split("/")[0] == chosen.precision.split("/")[0]]
    label = chosen.precision if chosen.precision in space.precisions else (same or list(space.precisions))[0]
    candidate = replace(chosen, precision=label, in_backward=False, preallocated_grads=False)
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


def _rung_plan(climb: Climb, stage: Stage, carried: _Carried, searched: _Searched,
               for_time: bool = False) -> tuple[Plan, dict[str, Analysis]]:
    """The plan of the rung's verified winner, its notes naming the rungs passed over and the rung's own
    (``for_time``: the rung was chosen for its speed, not because the rungs before it fit nothing)."""
    found = searched.found
    found = replace(found, notes=found.notes + skipped_note(stage, carried.skipped)
                    + rung_notes(climb.request, stage, searched.estimator, found, for_time=for_time))
    plan = plan_of(searched.estimator, found, searched.analysed, climb.rows_known)
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
def _reducing_instead(climb: Climb, stage: Stage,
                      searched: _Searched) -> tuple[Plan, dict[str, Analysis]] | str | None:
    """The plan of the reducing rung where it beats the deferring winner ``searched`` found on ``stage``; else the
    note saying it was weighed and lost, or None where it was not weighed (Note [defer or reduce every
    micro-batch])."""
    found = searched.found
    rival = reducing_rival(stage.parallel, found.candidate.accumulation_steps)
    reducing = next((s for s in climb.stages if s.parallel == rival and s.policies == stage.policies), None)
    if rival is None or reducing is None:
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


def _smallest(climb: Climb, carried: _Carried) -> tuple[Plan, dict[str, Analysis]]:
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
        return plan_of(rung_estimator, Verified(least, fitted, (least,)), analysed), analysed
    at, sharded_over = budget_error_at(parallel)
    error = infeasible(least, est, request.budget_bytes, at, margin=request.margin_bytes, sharded_over=sharded_over)
    if carried.on_host is not None:
        error = with_offload_minimum(error, carried.on_host, request.host_budget_bytes, request.margin_bytes,
                                     parallel)
    if one_process_features(parallel):  # the opt-in rungs this model could climb (Note [the ladder])
        error = with_closed_rungs(error, request.closed_rungs)
    raise error


def plan_of(estimator: Estimator, found: Verified, analyses: dict[str, Analysis] | None = None,
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
