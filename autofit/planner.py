"""``autofit.plan``: the pipeline's stages, composed (docs/architecture.md).

    request -> quick path -> analyse -> models -> search + verify -> rows by length -> Plan

:func:`make_request` validates everything once and resolves the device; the quick path (Note [the quick path],
solve/quick.py) proves the fastest configuration with one estimate when it fits; otherwise each allowed precision is
analysed, turned into memory and time models, searched, and the winner verified by a full simulation
(solve/verify.py). With ``world_size > 1`` and no strategy given, DDP and FSDP2 are both planned and the faster wins.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from torch import nn

from autofit import progress
from autofit.analyse.analyse import analyse_model
from autofit.analyse.table import Analysis
from autofit.errors import AutofitError, HostMemoryError, InfeasibleBudgetError, UnsupportedModelError
from autofit.length import cut_to_length, length_spec
from autofit.loss import LossFn
from autofit.plan import Plan, assemble_plan
from autofit.precision import PrecisionPolicy
from autofit.report import MemoryEstimate
from autofit.request import Parallel, PlanRequest, make_request
from autofit.simulate.run import probes_kernels, simulate_step
from autofit.solve.lengths import first_guesses, rows_by_length
from autofit.solve.memory_model import MemoryModel
from autofit.solve.quick import quick_path
from autofit.solve.search import Candidate, SearchSpace
from autofit.solve.sharding import shard_units
from autofit.solve.time_model import build_time_model
from autofit.solve.verify import (
    Verified,
    infeasible,
    search_in_backward,
    search_verified,
    smallest_in_backward,
    smallest_verified,
)
from autofit.step import StepConfig, forward_errors, make_step_config
from autofit.stored import stored_bytes_per_parameter
from autofit.units import format_bytes
from autofit.workers import parallel_available, run_all

__all__ = ["plan", "plan_with_analysis"]


def plan(
    model: nn.Module, sample: Any, budget: int | str = "8GB", *, batch_size: int | None = None, target: Any = None,
    loss_fn: LossFn | None = None, optimizer: Any = "adamw", precision: Any = "auto", checkpoint: Any = "auto",
    device: str = "cuda", gpu: str | None = None, world_size: int = 1, strategy: str | None = None,
    clip_grad_norm: float | None = None, min_stored_precision: str | None = None, fp32_modules: Any = None,
    offload: Any = "auto", host_budget: int | str | None = None, margin: int | str | None = None,
    allow_over_capacity: bool = False,
) -> Plan:
    """Choose micro-batch size, accumulation steps, precision and checkpointed modules so that one optimizer step
    over ``batch_size`` samples fits ``budget`` at the best predicted speed. ``model`` is never modified.

    ``world_size > 1`` plans one rank of a data-parallel job: ``batch_size`` is the global batch, ``budget`` is per
    device, and ``strategy`` is "ddp", "fsdp2" or None (autofit plans both and keeps the faster). When the fastest
    configuration fits, its full estimate is the whole plan (Note [the quick path]) and ``frontier`` is empty.
    ``clip_grad_norm``: the step clips gradients to this norm (``clip_grad_norm_``), and so does the trainer.

    With ``precision="auto"`` on one GPU, when nothing fits with the parameters in the dtype the model was built in
    (fp32), the planner stores them lower, in order of risk: bf16 (or fp16) with an fp32 master copy, then pure bf16
    (Note [stored precision] in autofit/stored.py). ``min_stored_precision`` is the floor: "fp32" (never lower),
    "fp32-master" (low-precision parameters only with an fp32 master copy) or "bf16" (the default: any).

    ``fp32_modules``: module classes, class names or qualified names that must compute in fp32 (say the final norm
    and the LM head); the plan's notes give each one's memory and time cost (Note [the cost of an fp32 pin]).
    ``"auto"``: the final norm and the output head, kept in fp32 when the plan still fits with them.

    ``offload`` (GPU targets; docs/offload.md): with "auto" (or True) a module whose activations must leave the GPU
    is offloaded to host memory instead of recomputed where the time model finds the PCIe copies cheaper, and when
    nothing fits with the parameters, gradients and optimizer state on the GPU, they live in host memory and the
    optimizer steps on the CPU (FSDP2's CPUOffloadPolicy on one process). ``plan.host_bytes`` is the host memory it
    pins; a plan needing more than ``host_budget`` (bytes or "64GB"; default this machine's RAM) is refused with a
    ``HostMemoryError``. False: never offload.

    ``margin``: bytes kept free for what the estimate does not model (bytes, "512MB" or a share of the budget such
    as "5%"); the default is 0 except on GPUs with ``world_size > 1``, where NCCL's buffers live outside the
    caching allocator (Note [the margin], autofit/request.py). A budget above the GPU's memory is refused unless
    ``allow_over_capacity=True``."""
    return plan_with_analysis(
        model, sample, budget, batch_size=batch_size, target=target, loss_fn=loss_fn, optimizer=optimizer,
        precision=precision, checkpoint=checkpoint, device=device, gpu=gpu, world_size=world_size, strategy=strategy,
        clip_grad_norm=clip_grad_norm, alternatives=False, min_stored_precision=min_stored_precision,
        fp32_modules=fp32_modules, offload=offload, host_budget=host_budget, margin=margin,
        allow_over_capacity=allow_over_capacity,
    )[0]


def plan_with_analysis(
    model: nn.Module, sample: Any, budget: int | str = "8GB", *, batch_size: int | None = None, target: Any = None,
    loss_fn: LossFn | None = None, optimizer: Any = "adamw", precision: Any = "auto", checkpoint: Any = "auto",
    device: str = "cuda", gpu: str | None = None, world_size: int = 1, strategy: str | None = None,
    clip_grad_norm: float | None = None, alternatives: bool = True, min_stored_precision: str | None = None,
    fp32_modules: Any = None, offload: Any = "auto", host_budget: int | str | None = None,
    margin: int | str | None = None, allow_over_capacity: bool = False,
) -> tuple[Plan, dict[str, Analysis]]:
    """:func:`plan`, also returning the analysis of each precision considered (the CLI shows its layer table).

    With ``alternatives=False`` the planner first checks the fastest configuration the time model allows (see
    Note [the quick path]) and skips the analysis when it fits; the plan then has no front and no analyses."""
    request = make_request(model, sample, budget, batch_size=batch_size, target=target, loss_fn=loss_fn,
                           optimizer=optimizer, precision=precision, checkpoint=checkpoint, device=device, gpu=gpu,
                           world_size=world_size, strategy=strategy, quick=not alternatives,
                           clip_grad_norm=clip_grad_norm, min_stored_precision=min_stored_precision,
                           fp32_modules=fp32_modules, offload=offload, host_budget=host_budget, margin=margin,
                           allow_over_capacity=allow_over_capacity)
    results, infeasible_errors, failed = [], [], []
    parallels = [_parallel(request, name) for name in request.strategies]
    # a strategy whose states alone miss the budget in every stage is planned last, and only when nothing else fits:
    # its analysis would only name its smallest budget, which the error needs only if no strategy fits
    floors = {p.strategy: _states_floor(request, p) for p in parallels} if len(parallels) > 1 else {}
    hopeless = {name for name, floor in floors.items() if floor is not None and floor > request.fit_bytes}
    for parallel in sorted(parallels, key=lambda p: p.strategy in hopeless):
        name = parallel.strategy
        if name in hopeless and results:
            failed.append(f"{name} not planned: its parameters, gradients and optimizer state alone need at least "
                          f"{format_bytes(floors[name])} per rank, over the budget")
            continue
        try:
            results.append(_plan_parallel(request, parallel))
        except InfeasibleBudgetError as e:
            infeasible_errors.append(e)
        except AutofitError as e:
            if len(request.strategies) == 1:
                raise
            failed.append(f"{name} cannot run this model ({e})")  # e.g. FSDP2 and a weight used outside its module
    if not results:
        if infeasible_errors:
            raise min(infeasible_errors, key=lambda e: e.min_budget_bytes)
        raise UnsupportedModelError("no data-parallel strategy can run this model: " + "; ".join(failed))
    chosen, analyses = min(results, key=lambda r: r[0].predicted_step_seconds)
    if len(request.strategies) > 1:
        why = _why_strategy(chosen, [r[0] for r in results])
        chosen = replace(chosen, notes=chosen.notes + (why, *failed))
    return chosen, analyses


def _plan_parallel(request: PlanRequest, parallel: Parallel) -> tuple[Plan, dict[str, Analysis]]:
    """Quick path, else analyse -> models -> search + verify, for one data-parallel setting."""
    policy_of = {p.label: p for p in request.policies + request.stored_options}

    def simulate(config: StepConfig):
        progress.report(f"simulating micro-batch {config.micro_batch_size} x {config.accumulation_steps} "
                        f"({config.precision.label}) in full")
        with forward_errors():
            return simulate_step(request.model, request.batch, request.target, request.loss_fn, config,
                                 device_rules=request.device.simulation_rules)

    def verify_in(where: Parallel, c: Candidate) -> MemoryEstimate:
        return request.device.estimate(simulate(_config(request, where, c, policy_of[c.precision])))

    def verify(c: Candidate) -> MemoryEstimate:
        return verify_in(parallel, c)

    rows_known: dict[tuple, dict[tuple[int, int], int]] = {}  # (candidate, policy) -> {(length, rows): bytes}

    def verify_beside_rows(c: Candidate) -> MemoryEstimate:  # Note [rows beside the verification]
        policy = policy_of[c.precision]
        beside = _guesses_beside(request, parallel, c, policy)
        if not beside:
            return verify(c)
        jobs = [functools.partial(verify, c)] + [
            functools.partial(_guessed_peak, request, parallel, c, policy, length, micro) for length, micro in beside]
        est, *peaks = run_all(jobs)
        rows_known[(c, policy)] = {point: peak for point, peak in zip(beside, peaks) if peak is not None}
        return est

    state_values = request.optimizer.state_values_per_parameter()  # read off one real step, once
    if request.quick and request.auto_precision and \
            _states_bytes(request, parallel, request.policies[0], state_values) <= request.fit_bytes:
        fastest = _fastest(request)
        params = sum(p.numel() * p.element_size() for p in request.model.parameters())
        found = quick_path(_config(request, parallel, fastest, request.policies[0]), simulate, request.device,
                           request.fit_bytes, params)
        if found is not None:
            return _plan_of(request, parallel, found, policy_of), {}

    analyses: dict[str, Analysis] = {}
    space = None
    stages = _precision_stages(request)
    skipped = []
    loaded_space = None  # the last space of the model's own dtype (where the optimizer may step in backward)
    # with host offload as the last stage, any stage whose states alone miss the budget can be skipped
    last = len(stages) if _offloaded_states(request, parallel) is not None else len(stages) - 1
    for i, policies in enumerate(stages):
        floor = _states_bytes(request, parallel, policies[0], state_values)
        if i < last and floor > request.fit_bytes:
            # not worth an analysis: parameters, gradients and optimizer state alone miss the budget
            what = (f"stored {policies[0].stored}" if policies[0].stored else "the model's own dtype")
            skipped.append(f"{what} ({floor / 2**30:.1f} GiB)")
            continue
        analyses.update(_analyse(request, parallel, policies, analyses))
        space = _search_space(request, parallel, policies, analyses)
        progress.report("searching micro-batches, precisions and recomputed modules (checkpoint MILP)")
        found = search_verified(space, request.fit_bytes, verify_beside_rows)
        if found is None and i == len(stages) - len(request.stored_options) - 1:
            # the model's own dtype does not fit with every gradient alive: step the optimizer in backward before
            # storing anything lower, as it changes no number of the update
            loaded_space = space
            narrowed = _in_backward_space(request, parallel, space, policy_of)
            if narrowed is not None:
                found = search_in_backward(narrowed, request.fit_bytes, _gradient_bytes(request.model), verify)
        if found is not None:
            if skipped:
                found = replace(found, notes=found.notes + (
                    "skipped without analysis, as their parameters, gradients and optimizer state alone miss the "
                    "budget: "
                    + "; ".join(dict.fromkeys(skipped)),))
            return _plan_of(request, parallel, found, policy_of, analyses, rows_known), analyses

    offloaded = _offloaded_states(request, parallel)
    off_smallest = None
    if offloaded is not None:  # the last stage: parameters, gradients and optimizer state in host memory
        off_analyses = _analyse(request, offloaded, request.policies, {})
        off_space = _search_space(request, offloaded, request.policies, off_analyses)
        off_verify = _host_checked(request, lambda c: verify_in(offloaded, c))
        progress.report("searching with the states on the host (checkpoint MILP)")
        found = search_verified(off_space, request.fit_bytes, off_verify)
        if found is None:  # the models may be pessimistic: the smallest verified configuration may still fit
            off_smallest = smallest_verified(off_space, lambda c: verify_in(offloaded, c))
            candidate, est = off_smallest
            if est.device_bytes <= request.fit_bytes:
                found = Verified(candidate, _host_fits(request, est), (candidate,))
        if found is not None:
            found = replace(found, notes=found.notes + (
                "nothing fits with the parameters, gradients and optimizer state on the GPU (" + "; ".join(
                    dict.fromkeys(skipped)) + "): they live in host memory and the optimizer steps on the CPU "
                "(FSDP2 CPUOffloadPolicy, see docs/offload.md)",) if skipped else found.notes)
            return _plan_of(request, offloaded, found, policy_of, off_analyses), off_analyses

    if space is None:  # every stage was skipped: analyse the last, to name the smallest budget
        analyses.update(_analyse(request, parallel, stages[-1], analyses))
        space = _search_space(request, parallel, stages[-1], analyses)
    smallest, est = smallest_verified(space, verify)
    narrowed = _in_backward_space(request, parallel, loaded_space, policy_of)
    in_backward = smallest_in_backward(narrowed, verify) if narrowed is not None else None
    if in_backward is not None and in_backward[1].device_bytes < est.device_bytes:
        smallest, est = in_backward
    if est.device_bytes <= request.fit_bytes:  # the models were pessimistic: the smallest configuration fits
        return _plan_of(request, parallel, Verified(smallest, est, (smallest,)), policy_of, analyses), analyses
    where = f", {parallel.strategy} over {parallel.world_size} ranks" if parallel.strategy else ""
    error = infeasible(smallest, est, request.budget_bytes, where, margin=request.margin_bytes)
    if off_smallest is not None:
        error = _with_offload_minimum(error, off_smallest, request.host_budget_bytes, request.margin_bytes)
    raise error


# ---- the stages' inputs and outputs ----------------------------------------------------------------------------------
def _parallel(request: PlanRequest, strategy: str | None) -> Parallel:
    if strategy is None:
        return Parallel()
    units = shard_units(request.model) if strategy == "fsdp2" else ()
    return Parallel(strategy=strategy, world_size=request.world_size, shard_units=units)


def _offloaded_states(request: PlanRequest, parallel: Parallel) -> Parallel | None:
    """The setting of the planner's last stage, FSDP2's CPUOffloadPolicy on this one process (Note [offload]), or
    None where it does not apply: offload not allowed (or a CPU target), or a data-parallel plan (its own stages)."""
    if not request.offload or parallel.strategy is not None or request.world_size != 1:
        return None
    return Parallel(strategy="fsdp2", world_size=1, shard_units=shard_units(request.model), offload_states=True)


def _host_checked(request: PlanRequest, verify):
    """``verify``, where an estimate that fits the GPU but whose host memory exceeds ``host_budget`` raises
    ``HostMemoryError`` (nothing fit with the states on the GPU: this was the last way)."""
    def checked(c: Candidate) -> MemoryEstimate:
        est = verify(c)
        return _host_fits(request, est) if est.device_bytes <= request.fit_bytes else est
    return checked


def _host_fits(request: PlanRequest, est: MemoryEstimate) -> MemoryEstimate:
    """``est``, or ``HostMemoryError`` when its host memory exceeds ``host_budget``."""
    limit = request.host_budget_bytes
    if limit is not None and est.host_bytes > limit:
        raise HostMemoryError(
            f"the plan that fits the GPU keeps {format_bytes(est.host_bytes)} ({est.host_bytes:,} bytes) in host "
            f"memory (parameters, gradients and optimizer state; {format_bytes(est.host_pinned_bytes)} pinned), "
            f"more than host_budget {format_bytes(limit)} ({limit:,} bytes), and nothing fits with them on the GPU: "
            "give the machine's RAM as host_budget=... (--host-budget), or use SGD, or more GPUs (FSDP2 over "
            "world_size ranks)",
            host_bytes=est.host_bytes, host_budget_bytes=limit,
        )
    return est


def _with_offload_minimum(error: InfeasibleBudgetError, smallest: tuple[Candidate, MemoryEstimate],
                          host_budget: int | None, margin: int) -> InfeasibleBudgetError:
    """The infeasibility error naming the smallest budget with the states offloaded as well as without. The
    offloaded one counts as a budget that works only when its host memory fits ``host_budget``."""
    candidate, est = smallest
    with_offload = est.device_bytes + margin
    host_fits = host_budget is None or est.host_bytes <= host_budget
    minimum = min(error.min_budget_bytes, with_offload) if host_fits else error.min_budget_bytes
    host = f"{format_bytes(est.host_bytes)} of host memory"
    if not host_fits:
        host += f", more than host_budget {format_bytes(host_budget)}"
    return InfeasibleBudgetError(
        f"{error} With parameters, gradients and optimizer state offloaded to the host (FSDP2 CPUOffloadPolicy) the "
        f"smallest is {format_bytes(with_offload)} ({with_offload:,} bytes; micro-batch {candidate.micro_batch_size},"
        f" {candidate.precision}, {len(candidate.checkpoint)} modules checkpointed, {len(candidate.offload)} "
        f"offloaded; {host}); without offloading it is {format_bytes(error.min_budget_bytes)}.",
        min_budget_bytes=minimum, budget_bytes=error.budget_bytes, dominant=error.dominant,
    )


def _fastest(request: PlanRequest) -> Candidate:
    """The configuration the time model ranks first (Note [the quick path]); its peak and time are not known yet."""
    b = request.per_rank
    return Candidate(request.policies[0].label, b, 1, b, request.fixed_checkpoint or (), 0, 0.0)


def _config(request: PlanRequest, parallel: Parallel, c: Candidate, policy: PrecisionPolicy) -> StepConfig:
    return make_step_config(
        micro_batch_size=c.micro_batch_size, accumulation_steps=c.accumulation_steps, precision=policy,
        checkpoint=c.checkpoint, optimizer=request.optimizer, device=request.device.kind,
        held_rows=request.per_rank, gpu=request.device.name, strategy=parallel.strategy,
        world_size=parallel.world_size, shard_units=parallel.shard_units, clip_grad_norm=request.clip_grad_norm,
        optimizer_in_backward=c.in_backward, offload=c.offload, offload_states=parallel.offload_states,
    )


def _in_backward_space(request: PlanRequest, parallel: Parallel, space: SearchSpace | None,
                       policy_of: dict[str, PrecisionPolicy]) -> SearchSpace | None:
    """The part of ``space`` whose configurations may step the optimizer in backward (Note [optimizer step in
    backward]): one process, no clipping, no GradScaler, no master copy; None when nothing is left."""
    if space is None or parallel.strategy is not None or request.clip_grad_norm is not None:
        return None
    allowed = tuple(name for name in space.precisions if not policy_of[name].needs_grad_scaler
                    and not str(policy_of[name].stored).endswith("-master"))
    return replace(space, precisions=allowed) if allowed else None


def _precision_stages(request: PlanRequest) -> list[tuple[PrecisionPolicy, ...]]:
    """On a GPU the preferred low precision is faster than fp32 for every configuration and saves activation memory,
    so fp32 is analysed only when no low-precision configuration fits (the analysis is most of planning's cost).
    Then each lower stored precision, one at a time and in order of risk, only when nothing above it fits: at equal
    fit the higher stored precision wins (Note [stored precision])."""
    if request.device.kind == "cuda" and request.auto_precision and len(request.policies) > 1:
        stages = [request.policies[:1], request.policies]
    else:
        stages = [request.policies]
    return stages + [(p,) for p in request.stored_options]


def _states_floor(request: PlanRequest, parallel: Parallel) -> int | None:
    """The smallest states-only floor over the precision stages of ``parallel`` (``_states_bytes``), or None when a
    stage with the states in host memory follows, which no such floor bounds."""
    if _offloaded_states(request, parallel) is not None:
        return None
    k = request.optimizer.state_values_per_parameter()
    return min(_states_bytes(request, parallel, stage[0], k) for stage in _precision_stages(request))


def _gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _states_bytes(request: PlanRequest, parallel: Parallel, policy: PrecisionPolicy, k: int) -> int:
    """Parameters, gradients and optimizer state (``k`` parameter-sized tensors per parameter) of ``policy``'s stored
    precision on one rank (FSDP2 shards them): a floor of any step's peak."""
    total = 0
    for p in request.model.parameters():
        if policy.stored is None or not p.is_floating_point():
            size = p.element_size()
            total += p.numel() * size * (2 + k)
        else:
            total += p.numel() * stored_bytes_per_parameter(policy.stored, k)
    return total // parallel.world_size if parallel.strategy == "fsdp2" else total


def _analyse(request: PlanRequest, parallel: Parallel, policies: tuple[PrecisionPolicy, ...],
             done: dict[str, Analysis]) -> dict[str, Analysis]:
    """The analysis of every policy not analysed yet. CPU targets probe kernels for their scratch memory (see
    simulate/probe.py); the CUDA model has its own terms."""
    todo = [p for p in policies if p.label not in done]
    where = " (states on the host)" if parallel.offload_states else (
        f" ({parallel.strategy} over {parallel.world_size})" if parallel.strategy else "")
    analyses = {}
    with forward_errors():
        for i, p in enumerate(todo):
            progress.report(f"analysing {p.label}{where}: two small simulations", i, len(todo))
            analyses[p.label] = analyse_model(
                request.model, request.batch, request.target, request.loss_fn, p, request.optimizer,
                probe_kernels=request.device.kind == "cpu", device=request.device.kind, gpu=request.device.name,
                strategy=parallel.strategy, world_size=parallel.world_size, shard_units=parallel.shard_units,
                clip_grad_norm=request.clip_grad_norm, device_rules=request.device.simulation_rules,
                offload_states=parallel.offload_states)
    return analyses


def _search_space(request: PlanRequest, parallel: Parallel, policies: tuple[PrecisionPolicy, ...],
                  analyses: dict[str, Analysis]) -> SearchSpace:
    """The memory and time models of each policy, over the rows one rank trains per step."""
    rows = request.per_rank
    memory, time = {}, {}
    for p in policies:
        a = analyses[p.label]
        terms = request.device.memory_terms(a, rows)
        memory[p.label] = MemoryModel.from_analysis(a.profile, a.table, held_rows=rows, row_bytes=request.row_bytes,
                                                   scale=terms.scale, constant=terms.constant)
        # what save_on_cpu would copy: the module's saved activations, and its weights (it packs every saved tensor)
        saved = {r.name: (float(r.saved_bytes_fixed + r.param_bytes), float(r.saved_bytes_per_sample))
                 for r in a.table.rows if r.name}
        time[p.label] = build_time_model(a.ops, a.table.row("").param_bytes, request.device, parallel.strategy,
                                        parallel.world_size, saved_bytes=saved,
                                        offload_states=parallel.offload_states)
    return SearchSpace(batch_size=rows, memory=memory, time=time, precisions=tuple(p.label for p in policies),
                       allow_checkpoint=request.allow_checkpoint, fixed_checkpoint=request.fixed_checkpoint,
                       allow_offload=request.offload, offload_states=parallel.offload_states)


def _plan_of(request: PlanRequest, parallel: Parallel, found: Verified,
             policy_of: dict[str, PrecisionPolicy], analyses: dict[str, Analysis] | None = None,
             rows_known: dict[tuple, dict[tuple[int, int], int]] | None = None) -> Plan:
    policy = policy_of[found.candidate.precision]
    found, policy, pins = _with_optional_pins(request, parallel, found, policy)
    plan = assemble_plan(
        found.candidate, found.estimate, found.fitting, budget_bytes=request.budget_bytes,
        margin_bytes=request.margin_bytes,
        batch_size=request.batch_size, world_size=parallel.world_size, strategy=parallel.strategy,
        policy=policy, device=request.device.kind, gpu=request.device.name,
        optimizer=request.optimizer.name, notes=request.notes + found.notes + found.estimate.notes,
        shard_units=parallel.shard_units, clip_grad_norm=request.clip_grad_norm,
        host_budget_bytes=request.host_budget_bytes,
    )
    plan = _with_pin_costs(request, parallel, plan, found.candidate, policy, (analyses or {}).get(policy.label),
                           request.pins + pins)
    known = (rows_known or {}).get((found.candidate, policy), {})
    plan = _with_even_split(request, parallel, plan, found.candidate, policy)
    return _with_rows_by_length(request, parallel, plan, found.candidate, policy, known)


# Note [even split]
#     The trainer runs an uneven window (micro-batches of b rows and a last one of fewer), which keeps the effective
#     batch exactly as asked. Hugging Face's Trainer, DeepSpeed and Lightning cannot express that: their effective
#     batch is micro x accumulation (x world). An export of an uneven plan therefore carries the largest b' <= b that
#     divides the rows one rank trains per step, with the same precision and recomputed modules: the same
#     effective batch in equal micro-batches. Its peak is verified by one full estimate, as the plan's own was; a
#     smaller b' is tried when it does not fit (the CPU's kernel scratch need not fall with the micro-batch).
def _with_even_split(request: PlanRequest, parallel: Parallel, plan: Plan, chosen: Candidate,
                     policy: PrecisionPolicy) -> Plan:
    rows = request.per_rank
    if chosen.last_micro_batch_size == chosen.micro_batch_size or chosen.in_backward:
        return plan
    for micro in [d for d in range(chosen.micro_batch_size - 1, 0, -1) if rows % d == 0][:3]:
        even = replace(chosen, micro_batch_size=micro, accumulation_steps=rows // micro, last_micro_batch_size=micro)
        progress.report(f"verifying the even split {micro} x {rows // micro} for the exports")
        with forward_errors():
            sim = simulate_step(request.model, request.batch, request.target, request.loss_fn,
                                _config(request, parallel, even, policy), device_rules=request.device.simulation_rules)
        device_bytes = request.device.estimate(sim).device_bytes
        if device_bytes <= request.fit_bytes:
            note = (f"frameworks need equal micro-batches: the exports use {micro} x {rows // micro} (= {rows} per "
                    f"rank), verified at {format_bytes(device_bytes)} (Note [even split])")
            return replace(plan, even_split=(micro, rows // micro), notes=plan.notes + (note,))
    note = ("no even split of the batch into equal micro-batches was verified to fit: the exports carry the plan's "
            "micro-batch and accumulation, whose effective batch differs; train with plan.wrap()")
    return replace(plan, notes=plan.notes + (note,))


def _with_optional_pins(request: PlanRequest, parallel: Parallel, found: Verified, policy: PrecisionPolicy):
    """``plan(fp32_modules="auto")``: the final norm and the output head (``request.optional_pins``) are kept in fp32
    when the chosen configuration still fits with them, shown by a full estimate; otherwise the plan stays as found
    and a note says why."""
    names = tuple(n for _, group in request.optional_pins for n in group if n not in policy.fp32_modules)
    if not names or not policy.autocast:
        return found, policy, ()
    pinned = replace(policy, fp32_modules=policy.fp32_modules + names)
    with forward_errors():
        sim = simulate_step(request.model, request.batch, request.target, request.loss_fn,
                            _config(request, parallel, found.candidate, pinned),
                            device_rules=request.device.simulation_rules)
    est = request.device.estimate(sim)
    if est.device_bytes > request.fit_bytes:
        note = (f"fp32 pins {', '.join(names)} left out: with them the plan needs {format_bytes(est.device_bytes)}, "
                f"over the budget {format_bytes(request.fit_bytes)}")
        return replace(found, notes=found.notes + (note,)), policy, ()
    return replace(found, estimate=est), pinned, request.optional_pins


# Note [the cost of an fp32 pin]
#     A module the user keeps in fp32 (plan(fp32_modules=...)) costs memory and time. Memory: one full estimate of the
#     chosen configuration without that pin, against the plan's own; exact for that configuration. Time: the
#     roofline of the module's FLOPs at fp32's peak against the autocast dtype's, an upper bound: under autocast some
#     of its ops (norms, softmax) would run in fp32 anyway. The analysis files backward ops under no module, so the
#     module's backward is counted as twice its forward FLOPs (a matmul's input and weight gradients: the
#     6 x parameters x tokens rule of Kaplan et al. 2020, "Scaling Laws for Neural Language Models", 2.1).
def _with_pin_costs(request: PlanRequest, parallel: Parallel, plan: Plan, chosen: Candidate,
                    policy: PrecisionPolicy, analysis: Analysis | None, pins) -> Plan:
    if not pins or not policy.autocast:
        return plan
    notes = []
    throughput = request.device.throughput
    for label, names in pins:
        unpinned = replace(policy, fp32_modules=tuple(n for n in policy.fp32_modules if n not in names))
        with forward_errors():
            sim = simulate_step(request.model, request.batch, request.target, request.loss_fn,
                                _config(request, parallel, chosen, unpinned),
                                device_rules=request.device.simulation_rules)
        saved = plan.device_bytes - request.device.estimate(sim).device_bytes
        if analysis is None:  # the quick path made the plan: the per-op costs of its policy, once
            analysis = _analyse(request, parallel, (policy,), {})[policy.label]
        flops = _pinned_flops(analysis, names, chosen)
        fp32, low = throughput.flops_per_second["fp32"], throughput.flops_per_second[policy.name]
        seconds = flops * (1 / fp32 - 1 / low) if fp32 and low else 0.0
        sign = "+" if saved >= 0 else "-"
        notes.append(f"fp32 pin {label} ({len(names)} module{'s' if len(names) > 1 else ''}): "
                     f"{sign}{format_bytes(abs(saved))} on the device ({saved:+,} B), {seconds * 1e3:+.3g} ms per "
                     "step at most (Note [the cost of an fp32 pin])")
    return replace(plan, notes=plan.notes + tuple(notes))


def _pinned_flops(analysis: Analysis, names: tuple[str, ...], chosen: Candidate) -> float:
    """FLOPs of one optimizer step (every micro-batch) in the pinned modules, forward and backward (See Note [the
    cost of an fp32 pin])."""
    ops = analysis.ops
    prefixes = tuple(names) + tuple(n + "." for n in names)
    inside = [bool(f) and (m in names or m.startswith(prefixes)) for m, f in zip(ops.module, ops.forward)]
    total = 0.0
    for i, hit in enumerate(inside):
        if hit:
            total += max(ops.flops_fixed[i] + ops.flops_per_sample[i] * chosen.micro_batch_size, 0.0)
    return 3 * total * chosen.accumulation_steps


def _with_rows_by_length(request: PlanRequest, parallel: Parallel, plan: Plan, chosen: Candidate,
                         policy: PrecisionPolicy, known: dict[tuple[int, int], int]) -> Plan:
    """The plan with the rows each shorter length fits (Note [rows by length], solve/lengths.py): full estimates of
    the winner's precision and recomputed modules on the sample cut to that length. Without a length, or when the
    whole batch already runs in one micro-batch, there is nothing to tabulate. ``known`` holds the estimates made
    beside the verification, ``(length, rows) -> bytes`` (Note [rows beside the verification])."""
    spec = length_spec(request.batch, request.target)
    if spec.length is None or chosen.micro_batch_size >= request.per_rank:
        return replace(plan, lengths=spec)
    peak = functools.partial(_rows_peak, request, parallel, chosen, policy)
    probing = probes_kernels(_rows_config(request, parallel, chosen, policy, chosen.micro_batch_size))

    def peaks(points: list[tuple[int, int]]) -> list[int]:  # side by side (Note [parallel simulations])
        return run_all([functools.partial(peak, length, micro) for length, micro in points], fork=not probing)

    progress.report("rows per micro-batch at shorter lengths (full simulations)")
    table = rows_by_length(spec.length, chosen.micro_batch_size, request.per_rank, request.fit_bytes, peak, peaks,
                           known)
    return replace(plan, lengths=spec, rows_by_length=table)


# Note [rows beside the verification]
#     The rows-by-length table (Note [rows by length]) begins with full estimates at the first guess of each shorter
#     length, whatever the others show. Where workers run simulations side by side (Note [parallel simulations]),
#     the planner's verification of a search winner runs the first of those guesses for that winner beside it, one
#     per free worker: if the winner fits it becomes the plan, and its table starts with those estimates done. If it
#     does not fit, they are dropped, having cost little wall time: they ran while the verification did. A guess is
#     the same full estimate the table would have made later, so the table, and the plan, are the same as without
#     workers (tests/test_plan_speed.py); one that fails is simply left for the table to estimate, and to report.
def _guesses_beside(request: PlanRequest, parallel: Parallel, c: Candidate,
                    policy: PrecisionPolicy) -> list[tuple[int, int]]:
    """The table's first guesses to estimate beside the verification of ``c``: as many as there are free workers."""
    spec = length_spec(request.batch, request.target)
    if spec.length is None or c.micro_batch_size >= request.per_rank or c.in_backward or c.offload_states:
        return []
    free = parallel_available() - 1
    if free < 1 or probes_kernels(_rows_config(request, parallel, c, policy, c.micro_batch_size)):
        return []
    return first_guesses(spec.length, c.micro_batch_size, request.per_rank)[:free]


def _rows_config(request: PlanRequest, parallel: Parallel, chosen: Candidate, policy: PrecisionPolicy,
                 micro: int) -> StepConfig:
    """``chosen`` with ``micro`` rows per micro-batch, over the rows one rank trains per step."""
    rows = request.per_rank
    steps = -(-rows // micro)
    return _config(request, parallel, replace(chosen, micro_batch_size=micro, accumulation_steps=steps,
                                              last_micro_batch_size=rows - micro * (steps - 1)), policy)


def _rows_peak(request: PlanRequest, parallel: Parallel, chosen: Candidate, policy: PrecisionPolicy, length: int,
               micro: int) -> int:
    """Device bytes of a full estimate of ``chosen`` at ``micro`` rows per micro-batch, on the sample cut to
    ``length``."""
    spec = length_spec(request.batch, request.target)
    with forward_errors():
        sim = simulate_step(request.model, cut_to_length(request.batch, spec, length),
                            cut_to_length(request.target, spec, length), request.loss_fn,
                            _rows_config(request, parallel, chosen, policy, micro),
                            device_rules=request.device.simulation_rules)
    return request.device.estimate(sim).device_bytes


def _guessed_peak(request: PlanRequest, parallel: Parallel, chosen: Candidate, policy: PrecisionPolicy, length: int,
                  micro: int) -> int | None:
    """``_rows_peak`` beside a verification: None when it fails (the table estimates it again, and reports it)."""
    try:
        return _rows_peak(request, parallel, chosen, policy, length, micro)
    except Exception:  # noqa: BLE001 - a guess is never needed: the table estimates it again if this is the plan
        return None


def _why_strategy(chosen: Plan, all_plans: list[Plan]) -> str:
    other = [p for p in all_plans if p is not chosen]
    if not other:
        return f"{chosen.strategy} chosen: it is the only strategy that fits the budget"
    o = other[0]
    return (f"{chosen.strategy} chosen over {o.strategy}: predicted step {chosen.predicted_step_seconds:.3g} s vs "
            f"{o.predicted_step_seconds:.3g} s (micro-batch {chosen.micro_batch_size} vs {o.micro_batch_size}; "
            "FSDP2 shards parameters, gradients and optimizer state but gathers parameters every micro-batch)")
