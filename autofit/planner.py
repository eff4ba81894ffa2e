"""``autofit.plan``: the pipeline's stages, composed (docs/architecture.md).

    request -> quick path -> for each rung of the ladder: analyse -> models -> search + verify -> finish -> Plan
                          -> else the smallest budget over the rungs tried, as an error

:func:`make_request` validates everything once and resolves the device; the quick path (Note [the quick path],
solve/quick.py) proves the fastest configuration with one estimate when it fits; otherwise the planner climbs the
ladder (Note [the ladder], solve/ladder.py): each rung's precisions are analysed, turned into memory and time models,
searched, and the winner verified by a full estimate (solve/estimator.py, solve/verify.py), then finished
(solve/finish.py). With ``world_size > 1`` and no strategy given, DDP and FSDP2 are both planned and the faster wins.

Here the stages are composed; each has its own module: the request (autofit/request.py), the race of the layouts
(autofit/planning/race.py), one layout's climb up its ladder to a finished plan (autofit/planning/climb.py), and
the speed rungs, planned beside the ladder (Note [speed rungs], below).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from torch import nn

from autofit.capture.user_hooks import entry_keeps_hooks
from autofit.core.rng import keeps_user_rng
from autofit.features import OPT_IN
from autofit.analyse.table import Analysis
from autofit.core.errors import (HostMemoryError, InfeasibleBudgetError, UnsupportedFeatureError,
                                 UnsupportedPrecisionError)
from autofit.training.loss import LossFn
from autofit.training.batch import naming_inputs
from autofit.validate import as_inputs
from autofit.emit.plan import Plan
from autofit.options import BatchDim, Device, Layout, Options, Precision, Savers, Search, gather
from autofit.request import PlanRequest, make_request
from autofit.core.units import format_bytes
from autofit.planning.race import plan_layouts

__all__ = ["plan", "plan_with_analysis"]


def plan(
    model: nn.Module, sample: Any, budget: int | str = "8GB", *, batch_size: int | None = None, target: Any = None,
    loss_fn: LossFn | None = None, optimizer: Any = "adamw", clip_grad_norm: float | None = None,
    batch_dim: BatchDim | int | tuple[int, int] = 0,
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
    - ``batch_dim``: which rows of the sample are the batch (Note [the batch dimension], autofit/training/batch.py):
      an ``autofit.BatchDim(dim, shared=...)`` or its dim alone: 0 (the default), 1 for time-major sequences
      (``nn.LSTM``'s default), a pair (the inputs', the target's) when they differ. ``BatchDim.shared``: inputs that
      are not per-sample (positions of a tuple sample, keys of a dict sample), passed whole to every micro-batch.
      The plan records both (``plan.batch_dim``, ``plan.shared``).
    - ``device``, ``precision``, ``savers``, ``layout``, ``search``: the options by concern, each a value of
      autofit/options.py (every field documented there) or its shortcut: ``device="H100"``,
      ``precision="bf16"``, ``savers="none"``, ``layout=8`` (the world size), ``search="exact"``.

    The planner climbs the ladder (Note [the ladder], solve/ladder.py): the model's own dtype, then stored lower
    (``Precision.min_stored`` is the floor), then the states on the host (``Savers.offload``), then the opt-in rungs
    of ``Savers.allow``; the plan's notes say which rungs it climbed. When the fastest configuration fits, its full
    estimate is the whole plan (Note [the quick path]) and ``frontier`` is empty. With ``Layout.world_size > 1`` it
    plans one rank of a data-parallel job; with no strategy given, DDP and FSDP2's layouts are all planned and the
    fastest wins (docs/multi-gpu.md).

    The old flat keywords (``gpu=``, ``world_size=``, ``checkpoint=``, ``shared=``, ...) still work, with a
    ``FutureWarning`` naming the new spelling (Note [flat keywords], autofit/options.py)."""
    options = Options(**gather("plan", dict(device=device, precision=precision, savers=savers, layout=layout,
                                            search=search, batch_dim=batch_dim), deprecated))
    # plan keeps no front: its None is False, and the request takes the quick path first (Note [the quick path])
    options = replace(options, search=replace(options.search, alternatives=bool(options.search.alternatives)))
    with naming_inputs(lambda: as_inputs(sample, target, batch_dim=options.batch_dim)[0]):  # Note [the batch dimension]
        request = make_request(model, sample, budget, options=options, batch_size=batch_size, target=target,
                               loss_fn=loss_fn, optimizer=optimizer, clip_grad_norm=clip_grad_norm)
        return plan_with_analysis(request)[0]


@keeps_user_rng  # Note [the user's random state]
def plan_with_analysis(request: PlanRequest) -> tuple[Plan, dict[str, Analysis]]:
    """The plan of a request already made (:func:`autofit.request.make_request`), with the analysis of each
    precision considered (the CLI shows its layer table).

    A request whose options say ``Search(alternatives=False)`` (what :func:`plan` makes) is first checked at the
    fastest configuration the time model allows (see Note [the quick path]), and the analysis is skipped when it
    fits; the plan then has no front and no analyses. Otherwise (``None``, the default, or True) its front also holds
    the halving micro-batches (a checkpoint MILP each)."""
    # the model is the request's, not the first argument (restores_user_hooks'); make_request, which made it, keeps
    # the hooks too
    with entry_keeps_hooks(request.model):
        return _with_speed_rungs(request, plan_layouts)


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
