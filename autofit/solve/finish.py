"""What the planner adds to a verified choice before it becomes a Plan: the optional fp32 pins, the cost of each pin,
the even split the exports use, and the rows per micro-batch at shorter lengths. Each is a few full estimates of the
chosen configuration, varied (solve/estimator.py), and hands back values the planner writes into the plan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from autofit.core import progress
from autofit.analyse.table import Analysis
from autofit.training.length import LengthSpec, length_spec
from autofit.training.config import ZeroGrad
from autofit.training.precision import PrecisionPolicy
from autofit.core.errors import ForwardError
from autofit.core.report import MemoryEstimate
from autofit.simulate.run import probes_kernels
from autofit.parallel.step_memory import reducing_notes
from autofit.solve.estimator import Estimator, with_rows
from autofit.solve.lengths import first_guesses, rows_by_length
from autofit.solve.candidate import Candidate
from autofit.solve.ladder import Stage
from autofit.solve.verify import Verified
from autofit.core.units import format_bytes
from autofit.core.workers import parallel_available, run_all

__all__ = ["optional_pins", "pin_cost_notes", "even_split", "rows_table", "verify_beside_rows", "rung_notes",
           "zero_grad_note", "wants_rows_table", "no_rows_table_note"]

if TYPE_CHECKING:  # built after this stage in the import order: only read here
    from autofit.request import PlanRequest

Pins = tuple[tuple[str, tuple[str, ...]], ...]  # (what the user named, the qualified names it resolved to)


def optional_pins(estimator: Estimator, found: Verified,
                  policy: PrecisionPolicy) -> tuple[Verified, PrecisionPolicy, Pins]:
    """``plan(fp32_modules="auto")``: the final norm and the output head (``request.optional_pins``) are kept in fp32
    when the chosen configuration still fits with them, shown by a full estimate; otherwise the plan stays as found
    and a note says why."""
    request = estimator.request
    names = tuple(n for _, group in request.optional_pins for n in group if n not in policy.fp32_modules)
    if not names or not policy.autocast:
        return found, policy, ()
    pinned = replace(policy, fp32_modules=policy.fp32_modules + names)
    est = estimator.estimate(found.candidate, pinned)
    fitted = est.within(request.fit_bytes)
    if fitted is None:
        note = (f"fp32 pins {', '.join(names)} left out: with them the plan needs "
                f"{format_bytes(est.min_device_bytes)}, over the budget {format_bytes(request.fit_bytes)}")
        return replace(found, notes=found.notes + (note,)), policy, ()
    return replace(found, estimate=fitted), pinned, request.optional_pins


# Note [the cost of an fp32 pin]
#     A module the user keeps in fp32 (plan(fp32_modules=...)) costs memory and time. Memory: one full estimate of the
#     chosen configuration without that pin, against the plan's own; exact for that configuration. Time: the
#     roofline of the module's FLOPs at fp32's peak against the autocast dtype's, an upper bound: under autocast some
#     of its ops (norms, softmax) would run in fp32 anyway. The analysis files backward ops under no module, so the
#     module's backward is counted as twice its forward FLOPs (a matmul's input and weight gradients: the
#     6 x parameters x tokens rule of Kaplan et al. 2020, "Scaling Laws for Neural Language Models", 2.1).
def pin_cost_notes(estimator: Estimator, device_bytes: int, chosen: Candidate, policy: PrecisionPolicy,
                   analysis: Analysis | None, pins: Pins,
                   analyse: Callable[[PrecisionPolicy], Analysis]) -> tuple[str, ...]:
    """A note per pin with its memory and time cost; ``device_bytes`` is the plan's own, ``analyse`` gives the
    per-op costs of ``policy`` when the plan has no analysis (the quick path made it)."""
    if not pins or not policy.autocast:
        return ()
    notes = []
    throughput = estimator.request.device.throughput
    for label, names in pins:
        unpinned = replace(policy, fp32_modules=tuple(n for n in policy.fp32_modules if n not in names))
        saved = device_bytes - estimator.estimate(chosen, unpinned).device_bytes
        if analysis is None:
            analysis = analyse(policy)
        flops = _pinned_flops(analysis, names, chosen)
        fp32, low = throughput.flops_per_second["fp32"], throughput.flops_per_second[policy.name]
        seconds = flops * (1 / fp32 - 1 / low) if fp32 and low else 0.0
        sign = "+" if saved >= 0 else "-"
        notes.append(f"fp32 pin {label} ({len(names)} module{'s' if len(names) > 1 else ''}): "
                     f"{sign}{format_bytes(abs(saved))} on the device ({saved:+,} B), {seconds * 1e3:+.3g} ms per "
                     "step at most (Note [the cost of an fp32 pin])")
    return tuple(notes)


def _pinned_flops(analysis: Analysis, names: tuple[str, ...], chosen: Candidate) -> float:
    """FLOPs of one optimizer step (every micro-batch) in the pinned modules, forward and backward (See Note [the
    cost of an fp32 pin])."""
    ops = analysis.ops
    inside = ops.under(names) & ops.forward.astype(bool)
    total = 0.0
    for i, hit in enumerate(inside):
        if hit:
            total += max(ops.flops_fixed[i] + ops.flops_per_sample[i] * chosen.micro_batch_size, 0.0)
    return 3 * total * chosen.accumulation_steps


# Note [even split]
#     The trainer runs an uneven window (micro-batches of b rows and a last one of fewer), which keeps the effective
#     batch exactly as asked. Hugging Face's Trainer, DeepSpeed and Lightning cannot express that: their effective
#     batch is micro x accumulation (x world). An export of an uneven plan therefore carries the largest b' <= b that
#     divides the rows one rank trains per step, with the same precision and recomputed modules: the same
#     effective batch in equal micro-batches. Its peak is verified by one full estimate, as the plan's own was; a
#     smaller b' is tried when it does not fit (the CPU's kernel scratch need not fall with the micro-batch).
def even_split(estimator: Estimator, chosen: Candidate,
               policy: PrecisionPolicy) -> tuple[tuple[int, int] | None, str | None]:
    """The verified even split of an uneven plan and its note; ``(None, note)`` when none fits, ``(None, None)``
    when the plan is even already (or steps in backward, one micro-batch)."""
    request = estimator.request
    rows = request.per_rank
    if chosen.last_micro_batch_size == chosen.micro_batch_size or chosen.in_backward:
        return None, None
    refused = []
    for micro in [d for d in range(chosen.micro_batch_size - 1, request.min_rows - 1, -1) if rows % d == 0][:3]:
        even = replace(chosen, micro_batch_size=micro, accumulation_steps=rows // micro, last_micro_batch_size=micro)
        progress.report(f"verifying the even split {micro} x {rows // micro} for the exports")
        try:
            fitted = estimator.estimate(even, policy).within(request.fit_bytes)
        except ForwardError as e:  # the model refuses that many rows (BatchNorm at 1): not a split it can train
            refused.append(f"{micro} x {rows // micro} ({e})")
            continue
        if fitted is not None:
            device_bytes = fitted.device_bytes
            return (micro, rows // micro), (
                f"frameworks need equal micro-batches: the exports use {micro} x {rows // micro} (= {rows} per "
                f"rank), verified at {format_bytes(device_bytes)} (Note [even split])")
    why = f"; the model refuses {', '.join(refused)}" if refused else ""
    return None, ("no even split of the batch into equal micro-batches was verified to fit" + why + ": the exports "
                  "carry the plan's micro-batch and accumulation, whose effective batch differs; train with "
                  "plan.wrap()")


def rows_table(estimator: Estimator, chosen: Candidate, policy: PrecisionPolicy,
               known: dict[tuple[int, int], int]) -> tuple[LengthSpec, tuple[tuple[int, int], ...] | None]:
    """The sample's lengths and the rows each shorter length fits (Note [rows by length], solve/lengths.py): full
    estimates of the winner's precision and recomputed modules on the sample cut to that length; None when there is
    nothing to tabulate (no length, or the whole batch already runs in one micro-batch). ``known`` holds the
    estimates made beside the verification, ``(length, rows) -> bytes`` (Note [rows beside the verification])."""
    request = estimator.request
    spec = length_spec(request.batch, request.target)
    if spec.length is None or chosen.micro_batch_size >= request.per_rank or not wants_rows_table(request):
        return spec, None
    peak = functools.partial(_rows_peak, estimator, chosen, policy)
    probing = probes_kernels(estimator.config(with_rows(chosen, request.per_rank, chosen.micro_batch_size), policy))

    def peaks(points: list[tuple[int, int]]) -> list[int]:  # side by side (Note [parallel simulations])
        return run_all([functools.partial(peak, length, micro) for length, micro in points], fork=not probing)

    progress.report("rows per micro-batch at shorter lengths (full simulations)")
    return spec, rows_by_length(spec.length, chosen.micro_batch_size, request.per_rank, request.fit_bytes, peak,
                                peaks, known)


def wants_rows_table(request: PlanRequest) -> bool:
    """Whether the user asked for the rows-by-length table (``Search(variable_length=True)``, ``autofit plan
    --variable-length``): a dozen full estimates, which a 405B plan spent 450 s on, so only on demand."""
    return request.options.search.variable_length


def no_rows_table_note(request: PlanRequest, chosen: Candidate) -> str | None:
    """The note of a plan whose sample has a length and runs several micro-batches, but whose table was not asked
    for: shorter batches run the same rows per micro-batch, and how to ask."""
    spec = length_spec(request.batch, request.target)
    if spec.length is None or chosen.micro_batch_size >= request.per_rank or wants_rows_table(request):
        return None
    return (f"shorter batches run {chosen.micro_batch_size} rows per micro-batch too: for batches of varying length, "
            "plan with search=Search(variable_length=True) (autofit plan --variable-length) to tabulate the rows that "
            "fit at 1/2, 1/4 and 1/8 of the length (docs/variable-length.md)")


# Note [rows beside the verification]
#     The rows-by-length table (Note [rows by length]) begins with full estimates at the first guess of each shorter
#     length, whatever the others show. Where workers run simulations side by side (Note [parallel simulations]),
#     the planner's verification of a search winner runs the first of those guesses for that winner beside it, one
#     per free worker: if the winner fits it becomes the plan, and its table starts with those estimates done. If it
#     does not fit, they are dropped, having cost little wall time: they ran while the verification did. A guess is
#     the same full estimate the table would have made later, so the table, and the plan, are the same as without
#     workers (tests/test_plan_speed.py); one that fails is simply left for the table to estimate, and to report.
def guesses_beside(estimator: Estimator, c: Candidate, policy: PrecisionPolicy) -> list[tuple[int, int]]:
    """The table's first guesses to estimate beside the verification of ``c``: as many as there are free workers."""
    request = estimator.request
    if not wants_rows_table(request):
        return []
    spec = length_spec(request.batch, request.target)
    if spec.length is None or c.micro_batch_size >= request.per_rank or c.in_backward:
        return []
    free = parallel_available() - 1
    if free < 1 or probes_kernels(estimator.config(with_rows(c, request.per_rank, c.micro_batch_size), policy)):
        return []
    return first_guesses(spec.length, c.micro_batch_size, request.per_rank)[:free]


def verify_beside_rows(estimator: Estimator, rows_known: dict, c: Candidate) -> MemoryEstimate:
    """The full estimate of a search winner, with the rows table's first guesses for it beside (Note [rows beside the
    verification]), kept in ``rows_known`` by (candidate, policy): the verification of a rung whose states stay on
    the GPUs (the host rung's checks the host's memory too and guesses nothing beside: planning/climb.py,
    ``_host_rung``)."""
    policy = estimator.policy(c.precision)
    beside = guesses_beside(estimator, c, policy)
    if not beside:
        return estimator.verify(c)
    est, *peaks = run_all([functools.partial(estimator.verify, c), *guessed_peaks(estimator, c, policy, beside)])
    rows_known[(c, policy)] = {point: peak for point, peak in zip(beside, peaks) if peak is not None}
    return est


def guessed_peaks(estimator: Estimator, c: Candidate, policy: PrecisionPolicy,
                  beside: list[tuple[int, int]]) -> list[Callable[[], int | None]]:
    """The jobs that estimate ``beside`` (``guesses_beside``), each None when it fails."""
    return [functools.partial(_guessed_peak, estimator, c, policy, length, micro) for length, micro in beside]


def _rows_peak(estimator: Estimator, chosen: Candidate, policy: PrecisionPolicy, length: int, micro: int) -> int:
    """Device bytes of a full estimate of ``chosen`` at ``micro`` rows per micro-batch, on the sample cut to
    ``length``."""
    return estimator.estimate(with_rows(chosen, estimator.request.per_rank, micro), policy, length).device_bytes


def _guessed_peak(estimator: Estimator, chosen: Candidate, policy: PrecisionPolicy, length: int,
                  micro: int) -> int | None:
    """``_rows_peak`` beside a verification: None when it fails (the table estimates it again, and reports it)."""
    try:
        return _rows_peak(estimator, chosen, policy, length, micro)
    except Exception:  # noqa: BLE001 - a guess is never needed: the table estimates it again if this is the plan
        return None


def rung_notes(request: PlanRequest, stage: Stage, estimator: Estimator, found: Verified,
               for_time: bool = False) -> tuple[str, ...]:
    """What the rung a plan was found on did: FSDP2's gradient sync every micro-batch, and what each opt-in rung in
    force saved (Note [the ladder]): the same configuration estimated in full without it, one more simulation per
    rung."""
    # the layout's own note (FSDP2 reducing every micro-batch); a plan for time names none
    notes = [] if for_time else list(reducing_notes(stage.parallel, found.candidate.accumulation_steps))
    policy = estimator.policy(found.candidate.precision)
    peak = found.estimate.device_bytes
    for feature, value in stage.features:  # Note [step features]
        without = feature.request_without(estimator.request, request)
        what = feature.climbed(value, request)
        other = Estimator(without, estimator.parallel).estimate(found.candidate, policy).device_bytes
        notes.append(f"{what}; this configuration needs {format_bytes(other)} without it ({other:,} B), "
                     f"{format_bytes(peak)} with it: it saves {format_bytes(other - peak)} ({other - peak:,} B)")
    return tuple(notes)


_ORDER_WORDS = {
    ZeroGrad.BEFORE_FORWARD: ("zero_grad before forward (the PyTorch tutorials' order)",
                              "last step's gradients live until the next step clears them"),
    ZeroGrad.AFTER_FORWARD: ("zero_grad after forward (Lightning's order)",
                             "last step's gradients live through forward"),
}


def zero_grad_note(estimator: Estimator, chosen: Candidate, policy: PrecisionPolicy, peak: int) -> str | None:
    """The note naming the step's order when it raises the plan's peak (Note [where zero_grad falls],
    training/step.py), with by how much: the same configuration estimated in full with ``zero_grad`` after the
    optimizer step, one more simulation; None for the default order, or where the order changes no peak."""
    order = estimator.request.zero_grad
    if not order.carries_grads:
        return None
    after_step = replace(estimator.request, zero_grad=ZeroGrad.AFTER_STEP)
    other = Estimator(after_step, estimator.parallel).estimate(chosen, policy).peak_bytes
    if peak <= other:
        return None
    which, why = _ORDER_WORDS[order]
    return (f"{which}: {why}: +{format_bytes(peak - other)} at the peak ({peak - other:,} B; "
            f"{format_bytes(other)} with zero_grad after the optimizer step)")
