"""``autofit.plan``: the pipeline stages (capture, analyse, simulate, solve), composed.

First the quick path (Note [the quick path]): the fastest configuration, checked with one full estimate, is the plan
when it fits. Otherwise: capture + analyse (per allowed precision) -> memory and time models -> search (MILP per
micro-batch) -> verify the winner with a full estimate -> Plan. If the verified peak overshoots the budget, the
overshoot is the models' error for that configuration: the search runs again under a budget lowered by it (at most
a few times). With ``world_size > 1`` and no strategy given, DDP and FSDP2 are both planned and the faster wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from autofit.analyse.analyse import SIZES, analyse_model
from autofit.analyse.table import Analysis
from autofit.api import _check_model, _inputs
from autofit.batch import Batch
from autofit.device import DeviceTarget, resolve_device
from autofit.errors import AutofitError, InfeasibleBudgetError, InvalidInputError, UnsupportedModelError
from autofit.loss import LossFn
from autofit.optim import OptimizerSpec, as_optimizer_spec
from autofit.plan import Alternative, Plan
from autofit.precision import PRECISION_NAMES, PrecisionPolicy, as_policy
from autofit.report import MemoryEstimate
from autofit.simulate.run import simulate_step
from autofit.solve.memory_model import MemoryModel
from autofit.solve.search import Candidate, SearchSpace, alternatives, pareto_front, search, smallest_peak
from autofit.solve.sharding import collective_seconds, shard_units
from autofit.solve.time_model import TimeModel
from autofit.step import forward_errors, make_step_config, resolve_modules
from autofit.units import format_bytes, parse_budget

__all__ = ["plan", "plan_with_analysis"]

_MAX_VERIFICATIONS = 4

# What to suggest when one category dominates the smallest reachable peak (one entry per Category an estimate can
# report; each is a sentence without its final period, which the message adds).
_ADVICE = {
    "optimizer_state": "Optimizer state dominates: use SGD (one buffer) instead of Adam (two), bf16/fp16 "
                       "parameters, or shard it across GPUs (FSDP2, world_size > 1)",
    "parameters": "Parameters dominate: keep them in bf16, or shard them (FSDP2, world_size > 1)",
    "gradients": "Gradients dominate: bf16 parameters halve them; sharding (FSDP2) splits them across ranks",
    "activations": "Activations dominate even in the configuration with the smallest peak: shorten the sequence "
                   "or image size, or use a lower precision",
    "temporaries": "Temporaries of backward or the optimizer step dominate: a lower precision or a smaller "
                   "largest layer helps",
    "inputs": "Inputs dominate: the trainer receives the whole batch at once, so the plan holds all of its rows; "
              "plan a smaller batch_size (or more ranks), or shorter sequences / smaller images",
    "buffers": "Buffers dominate (registered buffers and tensor attributes such as causal masks or rotary caches): "
               "size them for the sequence length you train at, or keep large constant tables off the model",
    "workspace": "CPU kernel scratch memory dominates (oneDNN reorders and scratchpads inside the largest "
                 "convolutions and matmuls): try another precision, or a smaller largest layer",
    "autocast_cache": "Autocast's low-precision copies of the weights dominate: they live until the forward's "
                      "autocast region exits; fp32 makes none, and neither do weights already in the autocast dtype",
    "cuda_context": "The CUDA context dominates: it is a constant (512 MiB unless AUTOFIT_CUDA_CONTEXT_MIB says "
                    "otherwise, see benchmarks/gpu_validate.py) that every budget on a GPU must hold",
    "cublas_workspace": "The cuBLAS workspace dominates: it is a constant per process (CUBLAS_WORKSPACE_CONFIG "
                        "sets its size) that every budget on a GPU must hold",
    "fragmentation": "The caching allocator's reserve dominates: segments reserved beyond the blocks in use are "
                     "part of what the process holds, so the budget must cover them",
    "allocator_rounding": "Allocator rounding dominates: every CUDA block is rounded up to 512 bytes, so many tiny "
                          "tensors cost more than their bytes",
}


def plan(
    model: nn.Module, sample: Any, budget: int | str = "8GB", *, batch_size: int | None = None, target: Any = None,
    loss_fn: LossFn | None = None, optimizer: Any = "adamw", precision: Any = "auto", checkpoint: Any = "auto",
    device: str = "cuda", gpu: str | None = None, world_size: int = 1, strategy: str | None = None,
    clip_grad_norm: float | None = None,
) -> Plan:
    """Choose micro-batch size, accumulation steps, precision and checkpointed modules so that one optimizer step
    over ``batch_size`` samples fits ``budget`` at the best predicted speed. ``model`` is never modified.

    ``world_size > 1`` plans one rank of a data-parallel job: ``batch_size`` is the global batch, ``budget`` is per
    device, and ``strategy`` is "ddp", "fsdp2" or None (autofit plans both and keeps the faster). When the fastest
    configuration fits, its full estimate is the whole plan (Note [the quick path]) and ``frontier`` is empty.
    ``clip_grad_norm``: the step clips gradients to this norm (``clip_grad_norm_``), and so does the trainer."""
    return plan_with_analysis(
        model, sample, budget, batch_size=batch_size, target=target, loss_fn=loss_fn, optimizer=optimizer,
        precision=precision, checkpoint=checkpoint, device=device, gpu=gpu, world_size=world_size, strategy=strategy,
        clip_grad_norm=clip_grad_norm, alternatives=False,
    )[0]


def plan_with_analysis(
    model: nn.Module, sample: Any, budget: int | str = "8GB", *, batch_size: int | None = None, target: Any = None,
    loss_fn: LossFn | None = None, optimizer: Any = "adamw", precision: Any = "auto", checkpoint: Any = "auto",
    device: str = "cuda", gpu: str | None = None, world_size: int = 1, strategy: str | None = None,
    clip_grad_norm: float | None = None, alternatives: bool = True,
) -> tuple[Plan, dict[str, Analysis]]:
    """:func:`plan`, also returning the analysis of each precision considered (the CLI shows its layer table).

    With ``alternatives=False`` the planner first checks the fastest configuration the time model allows (see
    Note [the quick path]) and skips the analysis when it fits; the plan then has no front and no analyses."""
    model = _check_model(model)
    batch, target_batch = _inputs(sample, target)
    target_device = resolve_device(device, gpu)
    budget_bytes = parse_budget(budget, device_total_bytes=target_device.total_bytes)
    notes: list[str] = []
    if target_device.note:
        notes.append(target_device.note)
    if batch_size is None:
        batch_size = batch.size
        notes.append(f"no batch_size given: planning for the sample's batch of {batch.size}")
    per_rank = _per_rank_batch(batch_size, world_size, strategy)
    ctx = _Context(model, batch, target_batch, loss_fn, target_device, budget_bytes, batch_size, per_rank,
                   world_size, _precisions(precision, target_device), as_optimizer_spec(optimizer),
                   _fixed_checkpoint(model, checkpoint), checkpoint == "auto", notes, quick=not alternatives,
                   auto_precision=isinstance(precision, str) or isinstance(precision, PrecisionPolicy),
                   clip_grad_norm=_clip(clip_grad_norm))
    strategies = [strategy] if strategy is not None or world_size == 1 else ["ddp", "fsdp2"]
    results, infeasible, failed = [], [], []
    for name in strategies:
        try:
            results.append(_plan_strategy(ctx, name))
        except InfeasibleBudgetError as e:
            infeasible.append(e)
        except AutofitError as e:
            if len(strategies) == 1:
                raise
            failed.append(f"{name} cannot run this model ({e})")  # e.g. FSDP2 and a weight used outside its module
    if not results:
        if infeasible:
            raise min(infeasible, key=lambda e: e.min_budget_bytes)
        raise UnsupportedModelError("no data-parallel strategy can run this model: " + "; ".join(failed))
    chosen, analyses = min(results, key=lambda r: r[0].predicted_step_seconds)
    if len(strategies) > 1:
        why = _why_strategy(chosen, [r[0] for r in results])
        chosen = replace(chosen, notes=chosen.notes + (why, *failed))
    return chosen, analyses


@dataclass(frozen=True)
class _Context:
    """The validated inputs every strategy's planning shares."""

    model: nn.Module
    batch: Batch
    target: Batch | None
    loss_fn: LossFn | None
    device: DeviceTarget
    budget: int
    batch_size: int
    per_rank: int
    world_size: int
    policies: list[PrecisionPolicy]
    optimizer: OptimizerSpec
    fixed_checkpoint: tuple[str, ...] | None
    allow_checkpoint: bool
    notes: list[str]
    quick: bool = False  # try the quick path first (see Note [the quick path])
    auto_precision: bool = True  # precision="auto": the first policy is the device's fastest
    clip_grad_norm: float | None = None  # max_norm of clip_grad_norm_ before each optimizer step


def _why_strategy(chosen: Plan, all_plans: list[Plan]) -> str:
    other = [p for p in all_plans if p is not chosen]
    if not other:
        return f"{chosen.strategy} chosen: it is the only strategy that fits the budget"
    o = other[0]
    return (f"{chosen.strategy} chosen over {o.strategy}: predicted step {chosen.predicted_step_seconds:.3g} s vs "
            f"{o.predicted_step_seconds:.3g} s (micro-batch {chosen.micro_batch_size} vs {o.micro_batch_size}; "
            "FSDP2 shards parameters, gradients and optimizer state but gathers parameters every micro-batch)")


def _plan_strategy(ctx: _Context, strategy: str | None) -> tuple[Plan, dict[str, Analysis]]:
    """Analyse, search and verify for one data-parallel strategy (None: a single process).

    Note [the quick path]
        The time model ranks the preferred precision (the first allowed one; for "auto" the device's fastest:
        bf16/fp16 on GPUs, fp32 on the CPU), one micro-batch for the whole batch and no recomputation (or the
        user's fixed checkpoint set) as the fastest configuration there is: every other precision is slower per
        op, every extra micro-batch adds launches and loses utilisation, every checkpointed module adds its forward
        again. So when that configuration's full estimate fits the budget, it is the plan, and the analysis (two
        simulations per precision) is not needed. Budgets are still monotonic: when it stops fitting, the search's
        winner is slower and, being under the smaller budget, lower.
    """
    units = shard_units(ctx.model) if strategy == "fsdp2" else ()
    parallel = dict(strategy=strategy, world_size=ctx.world_size if strategy else 1, shard_units=units,
                    clip_grad_norm=ctx.clip_grad_norm)
    target_device = ctx.device
    if ctx.quick and ctx.auto_precision:
        preferred = ctx.policies[0]
        config = make_step_config(micro_batch_size=ctx.per_rank, precision=preferred,
                                  checkpoint=ctx.fixed_checkpoint or (), optimizer=ctx.optimizer,
                                  device=target_device.kind, held_rows=ctx.per_rank, gpu=target_device.name,
                                  **parallel)
        from autofit.api import _to_estimate

        with forward_errors():
            sim = simulate_step(ctx.model, ctx.batch, ctx.target, ctx.loss_fn, config)
        est = _to_estimate(sim, config)
        if est.device_bytes <= ctx.budget:
            seconds = _quick_seconds(ctx, strategy, preferred, config, sim)
            best = Candidate(preferred.name, ctx.per_rank, 1, ctx.per_rank, config.checkpoint, est.device_bytes,
                             seconds)
            return _make_plan(best, est, [], ctx.budget, ctx.batch_size, parallel["world_size"], strategy,
                              {preferred.name: preferred}, target_device, ctx.optimizer.name,
                              list(ctx.notes) + list(est.notes), units, ctx.clip_grad_norm), {}

    probe = target_device.kind == "cpu"  # CPU kernels scratch memory the allocator sees (see simulate/probe.py)
    analyses: dict[str, Analysis] = {}
    policy_of = {p.name: p for p in ctx.policies}
    budget_bytes = ctx.budget

    def analysed(policies: list[PrecisionPolicy]) -> SearchSpace:
        with forward_errors():
            for p in policies:
                if p.name not in analyses:
                    analyses[p.name] = analyse_model(
                        ctx.model, ctx.batch, ctx.target, ctx.loss_fn, p, ctx.optimizer, probe_kernels=probe,
                        device=target_device.kind, gpu=target_device.name, **parallel)
        chosen = {p.name: analyses[p.name] for p in policies}
        return SearchSpace(
            batch_size=ctx.per_rank,
            memory={name: MemoryModel.from_analysis(a.profile, a.table, held_rows=ctx.per_rank,
                                                    row_bytes=_row_bytes(ctx.batch, ctx.target),
                                                    **_device_terms(a, target_device, ctx.per_rank))
                    for name, a in chosen.items()},
            time={name: _time_model(a.ops, a.table.row("").param_bytes, target_device, strategy, ctx.world_size)
                  for name, a in chosen.items()},
            precisions=tuple(p.name for p in policies),
            allow_checkpoint=ctx.allow_checkpoint,
            fixed_checkpoint=ctx.fixed_checkpoint,
        )

    def verify(c: Candidate) -> MemoryEstimate:
        config = make_step_config(micro_batch_size=c.micro_batch_size, accumulation_steps=c.accumulation_steps,
                                  precision=policy_of[c.precision], checkpoint=c.checkpoint, optimizer=ctx.optimizer,
                                  device=target_device.kind, held_rows=ctx.per_rank, gpu=target_device.name,
                                  **parallel)
        from autofit.api import _to_estimate

        with forward_errors():
            return _to_estimate(simulate_step(ctx.model, ctx.batch, ctx.target, ctx.loss_fn, config), config)

    def make(c: Candidate, est: MemoryEstimate, fitting: list[Candidate], notes: list[str]) -> Plan:
        return _make_plan(c, est, fitting, budget_bytes, ctx.batch_size, parallel["world_size"], strategy,
                          policy_of, target_device, ctx.optimizer.name, notes, units, ctx.clip_grad_norm)

    # On a GPU the preferred low precision is faster than fp32 for every configuration and saves activation memory,
    # so fp32 is analysed only when no low-precision configuration fits (the analysis is most of planning's cost).
    stages = [ctx.policies]
    if target_device.kind == "cuda" and ctx.auto_precision and len(ctx.policies) > 1:
        stages = [ctx.policies[:1], ctx.policies]
    notes = list(ctx.notes)
    for policies in stages:
        space = analysed(policies)
        correction = 0
        for _ in range(_MAX_VERIFICATIONS):
            best, fitting = search(space, budget_bytes - correction)
            if best is None:
                break
            est = verify(best)
            if est.device_bytes <= budget_bytes:
                fitting = fitting + alternatives(space, budget_bytes - correction)
                if correction:
                    notes.append(f"the first choices' verified peaks exceeded their modelled peaks; re-planned "
                                 f"with {format_bytes(correction)} of margin")
                return make(best, est, fitting, notes + list(est.notes)), analyses
            correction += max(est.device_bytes - best.peak_bytes, est.device_bytes - budget_bytes, 1)

    smallest = smallest_peak(space)
    est = verify(smallest)
    if est.device_bytes <= budget_bytes:  # the models were pessimistic: the smallest configuration does fit
        return make(smallest, est, [smallest], notes + list(est.notes)), analyses
    dominant = max(est.breakdown, key=est.breakdown.get)
    where = f", {strategy} over {ctx.world_size} ranks" if strategy else ""
    raise InfeasibleBudgetError(
        f"no configuration fits {format_bytes(budget_bytes)}: the smallest reachable peak is "
        f"{format_bytes(est.device_bytes)} ({est.device_bytes:,} bytes; micro-batch {smallest.micro_batch_size}, "
        f"{smallest.precision}, {len(smallest.checkpoint)} modules checkpointed{where}). "
        f"{_ADVICE.get(dominant, f'{dominant} dominates the smallest peak')}.",
        min_budget_bytes=est.device_bytes, budget_bytes=budget_bytes, dominant=dominant,
    )


def _clip(clip_grad_norm: Any) -> float | None:
    """Validated once, by the step's own rules (StepConfig), before any simulation."""
    return make_step_config(micro_batch_size=1, clip_grad_norm=clip_grad_norm).clip_grad_norm


def _per_rank_batch(batch_size: Any, world_size: Any, strategy: str | None) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidInputError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidInputError(f"world_size must be an int >= 1, got {world_size!r}")
    if strategy not in (None, "ddp", "fsdp2"):
        raise InvalidInputError(f"strategy must be 'ddp', 'fsdp2' or None (autofit chooses), got {strategy!r}")
    if strategy is not None and world_size == 1:
        raise InvalidInputError(f"strategy={strategy!r} needs world_size > 1 (the number of processes)")
    if batch_size % world_size:
        raise InvalidInputError(f"batch_size {batch_size} does not split evenly over world_size {world_size}")
    return batch_size // world_size


def _precisions(precision: Any, target: DeviceTarget) -> list[PrecisionPolicy]:
    if isinstance(precision, str) and precision.strip().lower() == "auto":
        return [PrecisionPolicy(name=n) for n in target.default_precisions()]
    if isinstance(precision, (list, tuple)):
        return [as_policy(p) for p in precision]
    policy = as_policy(precision)
    if policy.name not in PRECISION_NAMES:
        raise InvalidInputError(f"unknown precision {precision!r}")
    return [policy]


def _fixed_checkpoint(model: nn.Module, checkpoint: Any) -> tuple[str, ...] | None:
    """None: the planner chooses ("auto"); a tuple: exactly these modules (empty: no checkpointing)."""
    if checkpoint == "auto":
        return None
    if checkpoint in (None, False, "none"):
        return ()
    try:
        names = (checkpoint,) if isinstance(checkpoint, str) else tuple(checkpoint)
    except TypeError as e:
        raise InvalidInputError(
            f"checkpoint must be 'auto', None or a sequence of module names, got {checkpoint!r}"
        ) from e
    resolve_modules(model, names, what="checkpoint")
    return names


def _row_bytes(batch: Batch, target: Batch | None) -> int:
    """Bytes one sample adds to the inputs and targets (batch tensors only)."""
    total = 0
    for b in (batch, target):
        if b is None:
            continue
        for t in b.tensors():
            if t.dim() >= 1 and t.shape[0] == b.size:
                total += t[:1].nelement() * t.element_size()
    return total


def _quick_seconds(ctx: _Context, strategy: str | None, policy: PrecisionPolicy, config, sim) -> float:
    """The time model's figure for the quick path's plan, from the op costs of its own simulation."""
    from autofit.analyse.analyse import op_costs

    ops = op_costs(sim.timeline, sim.timeline, per_sample_from=config.micro_batch_size)
    params = sum(p.numel() * p.element_size() for p in ctx.model.parameters())
    model = _time_model(ops, params, ctx.device, strategy, ctx.world_size)
    return model.step_time(policy.name, config.micro_batch_size, 1, config.checkpoint).total


def _device_terms(analysis, target: DeviceTarget, batch: int) -> dict[str, float | int]:
    """CUDA: calibrate ``device_bytes = scale * tensor_bytes + constant``. The constant is the cuBLAS workspace and
    the context; the scale (allocator rounding and reserve) comes from replaying the caching allocator over the
    analysed window with every tensor sized for ``batch`` (sizes are linear in b, see analyse/profile.py)."""
    if target.kind != "cuda":
        return {}
    from autofit.analyse.profile import timeline_at
    from autofit.cuda.model import context_bytes, cublas_workspace_bytes, cuda_memory
    from autofit.simulate.timeline import replay

    timeline = timeline_at(analysis.timeline, analysis.timeline_next, SIZES[0], batch)
    raw = replay(timeline)
    _, device_bytes, _ = cuda_memory(timeline, raw, target.gpu)
    constant = context_bytes() + cublas_workspace_bytes(target.gpu)
    scale = max(1.0, (device_bytes - constant) / max(raw.peak_bytes, 1))
    return {"scale": scale, "constant": constant}


def _time_model(ops, params: int, target: DeviceTarget, strategy: str | None, world_size: int) -> TimeModel:
    """The roofline over ``ops``, the optimizer streaming ``params`` bytes four times, and the collectives."""
    optimizer_bytes = 4 * params // (world_size if strategy == "fsdp2" else 1)  # weight, grad, two states

    def collectives(micro_batches: int) -> float:
        return collective_seconds(strategy, world_size, params, params, micro_batches,
                                  target.interconnect_bytes_per_second)

    return TimeModel(target.throughput, ops, optimizer_bytes, collectives if strategy else None)


def _make_plan(best: Candidate, est: MemoryEstimate, fitting: list[Candidate], budget_bytes: int, batch_size: int,
               world_size: int, strategy: str | None, policy_of: dict[str, PrecisionPolicy],
               target: DeviceTarget, optimizer: str, notes: list[str], units: tuple[str, ...] = (),
               clip_grad_norm: float | None = None) -> Plan:
    front = tuple(
        Alternative(precision=c.precision, micro_batch_size=c.micro_batch_size,
                    gradient_accumulation_steps=c.accumulation_steps, checkpoint=c.checkpoint,
                    peak_bytes=c.peak_bytes, step_seconds=c.seconds)
        for c in pareto_front(fitting)
    )
    return Plan(
        micro_batch_size=best.micro_batch_size, gradient_accumulation_steps=best.accumulation_steps,
        batch_size=batch_size, last_micro_batch_size=best.last_micro_batch_size,
        precision=policy_of[best.precision], checkpoint=best.checkpoint, peak_bytes=est.peak_bytes,
        device_bytes=est.device_bytes, budget_bytes=budget_bytes, device=target.kind, optimizer=optimizer,
        predicted_step_seconds=best.seconds, estimate=est, world_size=world_size, strategy=strategy,
        gpu=target.name, frontier=front, notes=tuple(dict.fromkeys(notes)), shard_units=units,
        clip_grad_norm=clip_grad_norm, peak_reserved_bytes=est.peak_reserved_bytes,
    )
