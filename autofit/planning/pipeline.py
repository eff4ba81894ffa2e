"""A pipelined layout's plan (issue 59): the micro-batches of torch's schedule, their rows and the recomputation,
chosen by the schedule's own time and verified by simulating every stage. See Note [planning a pipeline].

Note [planning a pipeline]
    A pipeline's ranks run different steps (their stages' layers; Note [pipeline stages], parallel/pipeline.py), and
    what a stage holds depends on how many micro-batches the schedule keeps in flight there, which is the schedule's
    order over all of them: the memory model the search of any other layout fits to an analysis of two micro-batches
    (Note [the ladder]) does not describe it. So a pipelined layout is planned by a search of its own, small enough
    to verify in order of time:
      - the candidates: every micro-batch of ``b`` rows dividing the rows a rank trains per step (``M`` = rows / b
        micro-batches, the schedule's micro-batches: torch's schedules run whole ones), where the schedule takes
        ``M`` (``micro_batch_rule``: 1F1B at least P, the interleaved schedules whole rounds; rules, not hangs),
        with nothing recomputed or every decoder layer recomputed (torchtitan's "full" activation checkpointing,
        what PP runs at scale use), in the request's preferred precision;
      - each one's time: the schedule's order run with each stage's forward and backward seconds
        (:func:`autofit.parallel.pipeline.pipeline_time`, Note [a schedule's time]), the stage's ops priced by the
        roofline of the planner's time model over the whole model's analysis (the ops under the stage's modules, each
        with its launch; the forward ops under none, the loss and the decoder's rotary embedding, on the last stage;
        the backward ops the analysis names no module of, autograd's, most of the backward, shared in proportion to
        the stages' forward), a recomputed layer's forward again in its backward, the backward's two halves (input
        and weight gradients, which the zero-bubble schedules run apart) taken as equal halves (a linear's two
        backward matmuls have equal FLOPs), the hand-off
        between stages one micro-batch's hidden states over the link between the stages' ranks (the inter-node link
        where a stage's ranks fill a node, else within one), plus the optimizer and FSDP2's collectives of the
        heaviest stage's parameters, gathered and reduced once per step as the schedule's stages run them
        (Note [pipeline stage memory]);
      - each with the even split and, where the user gave none, the balanced one (Note [a balanced split]);
      - verified in that order: the first whose simulation of every stage fits the budget is the plan, the rank
        with the highest peak its figure. Nothing fits: the smallest budget is the peak of the candidate that holds
        least (one micro-batch's smallest rows, every layer recomputed), simulated.
    Where the user leaves the schedule or the degree to the planner (``pipeline_schedule="auto"``,
    ``pipeline_parallel="auto"``) each schedule torch has and each degree is a layout of its own in the planner's
    race, beside the layouts without a pipeline (docs/multi-gpu.md, "How the planner chooses"), and the fastest plan
    wins. Where the stages hold several identical blocks, each verification simulates them cut in depth (Note [a
    pipeline cut in depth]). Not planned yet: a recomputation other than none or every layer, precisions other than
    the preferred one (the ladder's lower stored precisions), offload.

Note [a balanced split]
    The stages run in lock-step, so the slowest one sets the pace: an even split by layers leaves the first stage
    (the embedding) and, more, the last (the final norm, the head over the vocabulary and the loss) slower than the
    middle ones, which is why torchtitan's default counts the embedding and the head as a layer each
    (``pipeline_parallel_first_stage_less_layers``, ``..._last_stage_less_layers``) and Megatron-Bridge users
    rebalance by hand (Megatron-Bridge#5077). :func:`balanced_split` starts from the even split and moves one layer
    at a time off a slowest stage to whichever stage makes the slowest stage fastest, by the stages' seconds of
    this candidate (its micro-batch rows and recomputation), until no move helps. The stages' times are the
    planner's roofline, so the split is as good as those; its memory is not modelled but simulated: a balanced
    split that moves layers onto a stage that then misses the budget loses to the even split of the same
    configuration, verified after it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autofit.analyse.table import Analysis
from autofit.core import progress
from autofit.core.errors import InvalidInputError
from autofit.core.units import format_bytes
from autofit.emit.plan import Plan
from autofit.parallel.collectives import Links
from autofit.parallel.dimension import RankWork, WorkInputs
from autofit.parallel.layout import Parallel
from autofit.parallel.pipeline import SCHEDULES, StageSeconds, decoder_names, layer_split, micro_batch_rule, \
    pipeline_time
from autofit.parallel.rungs import budget_error_at
from autofit.parallel.step_time import layout_time
from autofit.planning.climb import Climb, Unplanned, plan_of
from autofit.request import PlanRequest
from autofit.core.report import MemoryEstimate
from autofit.solve.candidate import Candidate
from autofit.solve.depth import DepthRun
from autofit.solve.extrapolate import extrapolate
from autofit.solve.estimator import Estimator
from autofit.solve.space import analyse_policies
from autofit.solve.time_model import TimeModel, build_time_model
from autofit.solve.verify import Verified, infeasible

__all__ = ["PipelineCandidate", "balanced_split", "pipeline_candidates", "plan_pipeline", "pipelined"]


def pipelined(parallel: Parallel) -> bool:
    """Whether ``parallel`` cuts the model into pipeline stages (planned here, not by the ladder's search)."""
    return parallel.layout.degree("pp") > 1


@dataclass(frozen=True)
class PipelineCandidate:
    """One configuration of a pipelined step and its time by the schedule's order (Note [planning a pipeline]):
    ``parallel`` the layout with its split (each stage's layers), ``compute_seconds`` the schedule's step,
    ``idle_share`` the share of it the least idle rank waits, ``optimizer_seconds`` the optimizer and FSDP2's
    collectives of the heaviest stage; ``balanced``: the split is the planner's, not the even one."""

    candidate: Candidate
    parallel: Parallel
    compute_seconds: float
    idle_share: float
    optimizer_seconds: float
    balanced: bool = False


def balanced_split(stage_seconds: Callable[[tuple[int, ...]], list[StageSeconds]], counts: tuple[int, ...],
                   ) -> tuple[int, ...]:
    """The layers of each stage that make the slowest stage fastest (Note [a balanced split]), from ``counts`` (the
    even split); ``stage_seconds(counts)``: each stage's seconds for a split."""
    def slowest(split: tuple[int, ...]) -> float:
        return max(s.forward + s.backward_input + s.backward_weight for s in stage_seconds(split))

    best, worst = counts, slowest(counts)
    while True:
        times = [s.forward + s.backward_input + s.backward_weight for s in stage_seconds(best)]
        moves = [(slowest(split), split) for src in range(len(best)) if best[src] > 1 and times[src] == max(times)
                 for dst in range(len(best)) if dst != src
                 for split in [tuple(n - (i == src) + (i == dst) for i, n in enumerate(best))]]
        if not moves:
            return best
        seconds, split = min(moves)
        if seconds >= worst:
            return best
        best, worst = split, seconds


def _stage_seconds(time: TimeModel, batch: int, stage_names: list[tuple[str, ...]], recomputed: frozenset[str],
                   ) -> list[StageSeconds]:
    """Each stage's forward and backward halves for one micro-batch of ``batch`` rows (Note [planning a
    pipeline]): the ops under its modules (each with its launch); the forward ops under none (the loss) on the last
    stage; the backward ops the analysis names no module of (autograd's, most of them) shared in proportion to the
    stages' forward; the recomputed modules' forward again in the backward."""
    ops = time.ops
    seconds = time.op_seconds(batch) + time.throughput.op_overhead_seconds  # each op's launch, on its stage's rank
    masks = [ops.under(names) for names in stage_names]
    owned = masks[0].copy()
    for mask in masks[1:]:
        owned |= mask
    masks[-1] = masks[-1] | (~owned & ops.forward)
    unnamed = float(seconds[~owned & ~ops.forward].sum())
    forwards = [float(seconds[mask & ops.forward].sum()) for mask in masks]
    again = ops.under(recomputed) & ops.forward if recomputed else None
    stages = []
    for mask, forward in zip(masks, forwards):
        backward = float(seconds[mask & ~ops.forward].sum()) + unnamed * forward / (sum(forwards) or 1.0)
        if again is not None:
            backward += float(seconds[mask & again].sum())
        stages.append(StageSeconds(forward, backward / 2, backward / 2))
    return stages


def pipeline_candidates(request: PlanRequest, parallel: Parallel, analysis: Analysis) -> list[PipelineCandidate]:
    """Every configuration of ``parallel``'s pipeline the planner weighs, fastest first (Note [planning a
    pipeline]), priced over ``analysis`` (the whole model's, in the preferred precision)."""
    placement = parallel.layout.placement("pp")
    kind, ranks = SCHEDULES[placement.option("schedule", "1f1b")], placement.degree
    model, rows = request.model, request.per_rank
    layers, outside = decoder_names(model)
    even = tuple(len(run) for run in layer_split(len(layers), ranks * kind.per_rank, placement.option("layers")))
    # the planner's own split where the user gave none (Note [a balanced split])
    balance = getattr(request.layout_options, "pipeline_layers", None) is None

    def names_of(counts: tuple[int, ...]) -> list[tuple[str, ...]]:
        split = layer_split(len(layers), len(counts), counts)
        return [tuple(layers[i] for i in run) + (outside["first"] if s == 0 else ())
                + (outside["last"] if s == len(split) - 1 else ()) for s, run in enumerate(split)]
    stage_names = names_of(even)
    # one rank's share of the work: tensor parallel's split ops and its all-reduces (Dimension.rank_work), the
    # all-reduces of the whole model's layers, of which a stage runs its own
    table = analysis.table
    row = {r.name: r for r in table.rows}
    work = parallel.layout.rank_work(RankWork(analysis.ops, row[""].param_bytes), WorkInputs(
        model=model, output_bytes=lambda name: table.row(name).output_bytes_per_sample, rows=rows,
        link_bytes_per_second=request.device.interconnect_bytes_per_second))
    time = build_time_model(work.ops, work.param_bytes, request.device)
    heaviest = max(sum(row[n].param_bytes for n in names if n in row) for names in stage_names)
    heaviest = heaviest * work.param_bytes // max(1, row[""].param_bytes)  # tensor parallel's share
    # the optimizer over the heaviest stage's share and FSDP2's collectives of it, once per step (the stages gather
    # and reduce once: Note [pipeline stage memory], parallel/pipeline.py), over the data-parallel ranks it leaves
    stage_layout = replace(parallel, more_dimensions=tuple(p for p in parallel.more_dimensions if p.dimension != "pp"),
                           world_size=parallel.world_size // ranks)
    links = Links.of(request.device)
    per_stage = layout_time(stage_layout, heaviest, links, work.seconds / len(even) * kind.per_rank)
    optimizer, _ = per_stage.optimizer_seconds(request.device.throughput.bytes_per_second, None, [0.0])
    # a hand-off: one micro-batch's hidden states per row (the first layer's output), over the link between ranks
    # (the pp dim is the mesh's outermost: neighbouring stages are world_size / P ranks apart, on other nodes where
    # a stage's ranks fill one)
    hidden = row[layers[0]].output_bytes_per_sample if layers[0] in row else 0.0
    across = parallel.gpus_per_node and parallel.world_size // ranks >= parallel.gpus_per_node
    between = links.inter_bytes_per_second if across else links.intra_bytes_per_second
    policy = request.policies[0]
    found = []
    for b in (b for b in range(request.min_rows, rows + 1) if rows % b == 0):
        micro = rows // b
        if micro_batch_rule(kind, ranks, micro) is not None:
            continue
        for checkpoint in ((), tuple(layers)):
            def seconds_of(counts, b=b, recomputed=frozenset(checkpoint)):
                return _stage_seconds(time, b, names_of(counts), recomputed)
            splits = [even] + ([split] if balance and (split := balanced_split(seconds_of, even)) != even else [])
            for counts in splits:
                step = pipeline_time(kind.title.lower(), ranks, micro, seconds_of(counts), hidden * b / between)
                seconds = step.step_seconds + optimizer
                found.append(PipelineCandidate(Candidate(policy.label, b, micro, b, checkpoint, 0, seconds),
                                               _with_split(parallel, counts), step.step_seconds, step.idle_share,
                                               optimizer, balanced=counts != even))
    return sorted(found, key=lambda c: (c.candidate.seconds, -c.candidate.micro_batch_size))


def _with_split(parallel: Parallel, counts: tuple[int, ...]) -> Parallel:
    """``parallel`` with its pipeline's stages holding ``counts`` layers each."""
    placed = tuple(replace(p, options=tuple((k, counts if k == "layers" else v) for k, v in p.options))
                   if p.dimension == "pp" else p for p in parallel.more_dimensions)
    return replace(parallel, more_dimensions=placed)


# the whole model's analysis by (precision, rows per rank, device), per request model: every pipelined layout of one
# plan (each schedule, ZeRO-2 and ZeRO-3 under "auto") prices its stages over the same one
_ANALYSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _whole_model_analysis(request: PlanRequest, policy: Any) -> dict[str, Analysis]:
    """The analysis of the whole model on one process in ``policy`` (the stages' ops), made once per plan."""
    key = (policy.label, request.per_rank, request.device.name, request.device.kind)
    known = _ANALYSES.setdefault(request.model, {})
    if key not in known:
        progress.report(f"analysing the whole model for the pipeline's stage times ({policy.label})")
        known[key] = analyse_policies(request, Parallel(), (policy,), {})
    return known[key]


def plan_pipeline(request: PlanRequest, parallel: Parallel, beat: float | None = None, on_gpus: bool = False,
                  climb: Climb | None = None) -> tuple[Plan, dict[str, Analysis]]:
    """The plan of the pipelined layout ``parallel`` (Note [planning a pipeline]), or ``Unplanned``: no faster
    than ``beat`` (the fastest plan found already) or nothing fits (its fallback names the smallest budget).
    ``on_gpus`` and ``climb`` as the race hands every layout (a pipeline keeps its states on the GPUs)."""
    request = request.for_layout(parallel)
    placement = parallel.layout.placement("pp")
    kind = SCHEDULES[placement.option("schedule", "1f1b")]
    policy = request.policies[0]
    analysed = _whole_model_analysis(request, policy)
    candidates = pipeline_candidates(request, parallel, analysed[policy.label])
    if not candidates:
        raise InvalidInputError(
            f"{parallel.label}: no micro-batch count of the {request.per_rank} rows a rank trains per step suits "
            f"{kind.title} over {placement.degree} stages ({micro_batch_rule(kind, placement.degree, 1)}): raise "
            "batch_size or use pipeline_schedule='GPipe'")
    # a whole simulation never cuts the model's run of blocks (Note [depth extrapolation]), which the stages' split
    # names: a pipeline's cut is its own, every stage cut alike (Note [a pipeline cut in depth], _in_depth)
    whole = replace(request, blocks=None)
    tried = []
    for position, found in enumerate(candidates):
        c = found.candidate
        estimator = Estimator(whole, found.parallel)
        if beat is not None and c.seconds >= beat:
            raise Unplanned(f"its fastest configuration left, {c.seconds:.3g} s by the schedule's order, is no "
                            f"faster than {beat:.3g} s")
        progress.report(f"verifying {kind.title} with {c.accumulation_steps} micro-batches of {c.micro_batch_size} "
                        f"row{'s' if c.micro_batch_size > 1 else ''}"
                        f"{', every layer recomputed' if c.checkpoint else ''}, layers "
                        f"{found.parallel.layout.placement('pp').option('layers')} (every stage simulated)",
                        position, len(candidates))
        est = _in_depth(request, found.parallel, c, policy) if request.blocks is not None else None
        est = est if est is not None else estimator.estimate(c, policy)
        fitted = est.within(request.fit_bytes)
        if fitted is None:
            tried.append((found, est))
            continue
        note = _chosen_note(kind.title, placement.degree, found, tried, len(candidates))
        chosen = Verified(replace(c, peak_bytes=fitted.device_bytes), fitted, (c,), (note,))
        return plan_of(estimator, chosen, analysed), analysed
    least_c, least = min(tried, key=lambda t: t[1].min_device_bytes)
    at, sharded_over = budget_error_at(least_c.parallel)
    error = infeasible(least_c.candidate, least, request.budget_bytes, at, margin=request.margin_bytes,
                       sharded_over=sharded_over)
    raise Unplanned("nothing fits", fallback=functools.partial(_raise, error))


def _raise(error: Exception) -> tuple[Plan, dict[str, Analysis]]:
    """The fallback of a pipeline where nothing fits: its smallest budget, simulated already (the race reports the
    least of every layout's)."""
    raise error


# Note [a pipeline cut in depth]
#     A stage's figures grow by the same bytes with each layer it holds (its parameters, gradients, optimizer state
#     and FSDP2 units; every micro-batch in flight saves the layer's activations), and the schedule's order, so the
#     micro-batches in flight, does not depend on the layers. So where each stage holds several of the model's
#     identical blocks, the stages are simulated cut: every stage missing the same D layers (the first ones of its
#     run kept), at three cuts one layer apart (n_s - D - 2, n_s - D - 1, n_s - D for a stage of n_s layers, the
#     smallest at 1, 2 and 3), and each rank's figures carried D steps along its line, as a whole model's are (Note
#     [depth extrapolation], autofit/capture/depth.py; ``extrapolate``: tensor figures on their line to the byte,
#     the third cut checking the first two). The figures are those of the rank the cuts found highest at all three
#     and whose carried peak is highest of every rank's; where another rank's line overtakes it, or a figure is off
#     its line, the stages are simulated whole. On the CPU allocator, every rank's carried peak equals the whole
#     simulation's to the byte (tests/test_pipeline.py).
def _in_depth(request: PlanRequest, parallel: Parallel, c: Candidate, policy: Any) -> MemoryEstimate | None:
    """The estimate of ``c`` on ``parallel``'s pipeline from its stages cut in depth (Note [a pipeline cut in
    depth]), or None where that cannot be done or is not cheaper: the stages are then simulated whole."""
    blocks = request.blocks
    pp = parallel.layout.placement("pp")
    counts = pp.option("layers")
    layers, _ = decoder_names(request.model)
    if counts is None or blocks.count != len(layers) or min(counts) < 4:
        return None
    missing = min(counts) - 3
    runs = layer_split(len(layers), len(counts), counts)
    keeps = tuple(tuple(i for n, run in zip(counts, runs) for i in run[:n - missing - 2 + j]) for j in range(3))
    if request.cheaper_cuts_only and sum(map(len, keeps)) >= blocks.count:
        return None  # three cuts of more layers than the whole model: simulated whole (exact, and cheaper)
    ests = []
    for j, keep in enumerate(keeps):
        # the cut's split; FSDP2's units and the recomputed layers are renamed by the cut (config_at_depth)
        cut = _with_split(parallel, tuple(n - missing - 2 + j for n in counts))
        progress.report(f"stages cut to {[n - missing - 2 + j for n in counts]} layers", j, 3)
        ests.append(request.device.estimate(Estimator(request, cut).simulate(c, policy, depth=keep)))
    worst = [dict(e.rank_peaks) for e in ests]
    ranks = list(worst[0])
    carried = {}
    for r in ranks:
        values = [w[r] for w in worst]
        if values[1] - values[0] != values[2] - values[1]:
            return None
        carried[r] = values[2] + missing * (values[2] - values[1])
    top = max(ranks, key=carried.__getitem__)
    if any(max(w, key=w.__getitem__) != top for w in worst):  # the estimates are another rank's at some cut
        return None
    run = DepthRun(blocks, 1, keeps, missing, 0, blocks.count)
    est = extrapolate(run, tuple(ests), request.fit_bytes)
    if est is None or est.peak_bytes - est.breakdown.get("allocator_rounding", 0) > carried[top]:
        return None
    return replace(est, rank_peaks=tuple((r, carried[r]) for r in ranks))


def _chosen_note(title: str, ranks: int, found: PipelineCandidate, tried: list, weighed: int) -> str:
    """What the plan says of its pipeline: the schedule's micro-batches, the bubble, what did not fit before it."""
    c = found.candidate
    missed = "; ".join(f"{t.candidate.accumulation_steps} x {t.candidate.micro_batch_size} "
                       f"row{'s' if t.candidate.micro_batch_size > 1 else ''}"
                       f"{' recomputed' if t.candidate.checkpoint else ''}"
                       f"{' balanced' if t.balanced else ''} {format_bytes(e.device_bytes)}" for t, e in tried)
    layers = found.parallel.layout.placement("pp").option("layers")
    split = (f"layers {list(layers)} per stage, balanced by their times (Note [a balanced split])" if found.balanced
             else f"layers {list(layers)} per stage")
    return (f"pipeline: {title} over {ranks} stages, {c.accumulation_steps} micro-batch"
            f"{'es' if c.accumulation_steps > 1 else ''} of {c.micro_batch_size} "
            f"row{'s' if c.micro_batch_size > 1 else ''}{', every decoder layer recomputed' if c.checkpoint else ''}, "
            f"{split}; "
            f"by the schedule's order the step is {found.compute_seconds:.4g} s of compute, every rank waiting at "
            f"least {found.idle_share:.1%} of it, and {found.optimizer_seconds:.3g} s of optimizer and collectives "
            f"(Note [planning a pipeline]); {weighed} configurations weighed"
            + (f", faster ones over the budget: {missed}" if missed else ""))
