"""The quick path: when the fastest configuration fits, one full estimate is the whole plan.

Note [the quick path]
    The time model ranks the preferred precision (the first allowed one; for "auto" the device's fastest:
    bf16/fp16 on GPUs, fp32 on the CPU), one micro-batch for the whole batch and no recomputation (or the
    user's fixed checkpoint set) as the fastest configuration there is: every other precision is slower per
    op, every extra micro-batch adds launches and loses utilisation, every checkpointed module adds its forward
    again. So when that configuration's full estimate fits the budget, it is the plan, and the analysis (two
    simulations per precision) is not needed. Budgets are still monotonic: when it stops fitting, the search's
    winner is slower and, being under the smaller budget, lower.
"""

from __future__ import annotations

from dataclasses import replace

from typing import TYPE_CHECKING

from autofit.solve.candidate import Candidate
from autofit.solve.estimator import Estimator, announce
from autofit.solve.time_model import build_time_model
from autofit.solve.verify import Verified

if TYPE_CHECKING:  # the request is built after this stage in the import order; only its values are read here
    from autofit.request import PlanRequest

__all__ = ["quick_path", "fastest"]


def fastest(request: PlanRequest) -> Candidate:
    """The configuration the time model ranks first (Note [the quick path]): the whole per-rank batch in one
    micro-batch, the preferred precision, nothing recomputed but what the user fixed; its peak and time are not known
    yet."""
    b = request.per_rank
    return Candidate(request.policies[0].label, b, 1, b, request.fixed_checkpoint or (), 0, 0.0,
                     selective=request.fixed_selective, op_selective=request.fixed_op_selective)


def quick_path(estimator: Estimator, budget: int) -> Verified | None:
    """The request's fastest configuration verified, with its modelled time, if it fits ``budget``; else None."""
    candidate, policy = fastest(estimator.request), estimator.request.policies[0]
    param_bytes = sum(p.numel() * p.element_size() for p in estimator.request.model.parameters())
    config = estimator.config(candidate, policy)
    announce(candidate, policy)
    target = estimator.request.device
    misses, known = estimator.misses(candidate, policy, budget)  # Note [a step that misses by its first cuts]
    if misses:
        return None
    est, ops = estimator.estimate_and_ops(candidate, policy, known)
    est = est.within(budget)
    if est is None:
        return None
    # the quick path's time counts the layout's collectives, not offloading's transfers (as it always has)
    layout = replace(estimator.parallel, offload_states=False, reduce_every_micro_batch=False)
    time = build_time_model(ops, param_bytes, target, layout)
    seconds = time.step_time(config.precision.label, config.micro_batch_size, 1, config.checkpoint,
                             selective=config.selective, op_selective=config.op_selective).total
    b = config.micro_batch_size
    return Verified(Candidate(config.precision.label, b, 1, b, config.checkpoint, est.device_bytes, seconds,
                              selective=config.selective, op_selective=config.op_selective), est, ())
