"""A verified choice of the solve stage made into a :class:`~autofit.emit.plan.Plan`: its knobs, its estimate, its
memory/time front, and what selective recomputation bought against module-level recomputation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from types import MappingProxyType
from typing import Any

from autofit.core.report import MemoryEstimate
from autofit.emit.plan import Plan
from autofit.emit.plan_text import Alternative
from autofit.parallel.host import recorded_host_budget
from autofit.solve.candidate import Candidate
from autofit.solve.search import pareto_front
from autofit.training.config import StepConfig

__all__ = ["assemble_plan", "front_with", "selective_note"]


def assemble_plan(chosen: Candidate, est: MemoryEstimate, fitting: tuple[Candidate, ...], *, step: StepConfig,
                  budget_bytes: int, batch_size: int, notes: tuple[str, ...], host_budget_bytes: int | None = None,
                  margin_bytes: int = 0, features: Mapping[str, Any] = MappingProxyType({})) -> Plan:
    """The Plan of a verified choice: ``step`` is the step its full estimate ``est`` simulated (the chosen
    configuration's, ``Estimator.config``), which the plan carries as ``Plan.step`` and takes its knobs and layout
    from (Note [the plan's step], emit/plan.py); ``fitting`` (configurations that fit the models) gives its
    memory/time front, in which the chosen configuration's row carries its verified figure (See Note [one
    configuration, one figure]); ``features``: each step feature's value by its field
    (``autofit.features.feature_fields``; Note [step features])."""
    front = tuple(
        Alternative(precision=c.precision, micro_batch_size=c.micro_batch_size,
                    gradient_accumulation_steps=c.accumulation_steps, checkpoint=c.checkpoint,
                    peak_bytes=c.peak_bytes, step_seconds=c.seconds, selective=c.selective,
                    op_selective=c.op_selective)
        for c in front_with(chosen, est, fitting)
    )
    plan = Plan(
        micro_batch_size=step.micro_batch_size, gradient_accumulation_steps=step.accumulation_steps,
        batch_size=batch_size, last_micro_batch_size=chosen.last_micro_batch_size, precision=step.precision,
        checkpoint=step.checkpoint, peak_bytes=est.peak_bytes, device_bytes=est.device_bytes,
        budget_bytes=budget_bytes, device=step.device, optimizer=step.optimizer.name,
        predicted_step_seconds=chosen.seconds, estimate=replace(est, under=None), parallel=step.layout, gpu=step.gpu,
        frontier=front, notes=tuple(dict.fromkeys(notes)), clip_grad_norm=step.clip_grad_norm, zero_grad=step.zero_grad,
        optimizer_in_backward=step.optimizer_in_backward, offload=step.offload,
        host_budget_bytes=recorded_host_budget(step.layout, host_budget_bytes, activations=bool(step.offload)),
        peak_reserved_bytes=est.peak_reserved_bytes, margin_bytes=margin_bytes, selective=step.selective,
        op_selective=step.op_selective,
        **features, verified_step=step,
    )
    if plan.step != step:  # the plan's fields must give back the step verified: what a loaded plan runs
        differ = [f.name for f in fields(StepConfig) if getattr(plan.step, f.name) != getattr(step, f.name)]
        raise AssertionError(f"the plan's fields give another step than the one its estimate verified, in "
                             f"{', '.join(differ)} (Note [the plan's step], autofit/emit/plan.py)")
    return plan


# Note [one configuration, one figure]
#     A configuration's figure is what its full estimate puts on the device (``device_bytes``, what a budget is
#     checked against), with the inputs the trainer holds: the whole batch of one rank, since ``trainer.step``
#     receives it at once and slices the micro-batches from it (``StepConfig.held_rows``). ``autofit.estimate``
#     (``inputs="batch"``, its default), the plan's verification, its table, JSON and ``autofit verify`` all read
#     that estimate. The front ranks the other configurations by the search's models, which are cheaper and can
#     differ from their full estimates (GPT-2 on a T4, fp16 8 x 4: modelled 14,961.3 MiB, verified 14,618.0 MiB);
#     the chosen configuration has been verified, so its row shows the verified figure, never the modelled one,
#     and the plot's front passes through the point it marks as chosen.
def front_with(chosen: Candidate, est: MemoryEstimate, fitting: tuple[Candidate, ...]) -> list[Candidate]:
    """The memory/time front of ``fitting`` with ``chosen`` at its verified figure (``est.device_bytes``) in place
    of its modelled one, and always on it (See Note [one configuration, one figure])."""
    if not fitting:  # the quick path has no front (Note [the quick path], solve/quick.py)
        return []
    verified = replace(chosen, peak_bytes=est.device_bytes)
    front = pareto_front([c for c in fitting if c.configuration() != chosen.configuration()] + [verified])
    if verified not in front:  # a modelled tie in time with a smaller modelled peak: the plan is still this one
        front = sorted(front + [verified], key=lambda c: (c.seconds, -c.peak_bytes))
    return front


def selective_note(plan: Plan, versus: Candidate) -> str:
    """What selective recomputation bought, against the best plan recomputing whole modules only."""
    return (f"selective recomputation of {len(plan.selective)} modules (matmul and attention outputs kept, the rest "
            f"rerun): predicted step {plan.predicted_step_seconds:.3g} s; recomputing whole modules only, the best "
            f"under this budget is {versus.seconds:.3g} s (micro-batch {versus.micro_batch_size}, "
            f"{len(versus.checkpoint)} modules)")
