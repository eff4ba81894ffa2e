"""A rung's search space: each of its precisions analysed (two small simulations), then turned into the memory and
time models the search reads (docs/planner.md)."""

from __future__ import annotations

from dataclasses import replace

from typing import TYPE_CHECKING

from autofit.core import progress
from autofit.features import feature_values
from autofit.analyse.analyse import analyse_model
from autofit.analyse.depth import extend_analysis
from autofit.capture.depth import truncated
from autofit.analyse.table import Analysis
from autofit.training.precision import PrecisionPolicy
from autofit.solve.depth import analysis_depth, config_at_depth, extended_ops, parameter_ratios
from autofit.solve.estimator import Estimator
from autofit.solve.ladder import Stage
from autofit.solve.memory_model import MemoryModel
from autofit.solve.candidate import SearchSpace
from autofit.parallel.dimension import RankWork, WorkInputs
from autofit.parallel.rungs import analysed_windows
from autofit.parallel.step_memory import analysis_words
from autofit.solve.time_model import build_time_model
from autofit.training.step import forward_errors

if TYPE_CHECKING:  # the request is built after this stage in the import order; only its values are read here
    from autofit.request import PlanRequest
    from autofit.parallel.layout import Parallel

__all__ = ["analyse_policies", "search_space", "searchable"]


def analyse_policies(request: PlanRequest, parallel: Parallel, policies: tuple[PrecisionPolicy, ...],
                     done: dict[str, Analysis]) -> dict[str, Analysis]:
    """The analysis of every policy not analysed yet. CPU targets probe kernels for their scratch memory (see
    simulate/probe.py); the CUDA model has its own terms."""
    todo = [p for p in policies if p.label not in done]
    where = analysis_words(parallel)
    analyses = {}
    with forward_errors():
        for i, p in enumerate(todo):
            progress.report(f"analysing {p.label}{where}: two small simulations", i, len(todo))
            step = replace(request.step(parallel), precision=p)
            cut = analysis_depth(step, request.blocks) if request.blocks is not None else None
            if cut is None:
                analyses[p.label] = analyse_model(
                    request.model, request.batch, request.target, request.loss_fn, step,
                    probe_kernels=request.device.own_kernels, device_rules=request.device.simulation_rules)
                continue
            depth, period = cut  # Note [extending an analysis in depth], autofit/analyse/depth.py
            model = truncated(request.model, request.blocks, depth)
            a = analyse_model(model, request.batch, request.target, request.loss_fn,
                              config_at_depth(step, request.blocks, depth),
                              probe_kernels=request.device.own_kernels, device_rules=request.device.simulation_rules)
            analyses[p.label] = extend_analysis(
                a, request.blocks, depth, period, parameter_ratios(request.model, model),
                extend_ops=lambda ops, ranges, copies, first, q=period: extended_ops(ops, ranges, copies, request.blocks,
                                                                          q, first=first))
    return analyses


# Note [an accumulation-free FSDP2 step]
#     The analysis simulates a window of two micro-batches (analyse/analyse.py), and a step of one micro-batch is
#     priced from its first. FSDP2 reducing on the last micro-batch only (set_requires_gradient_sync, Note [gradient
#     sync under accumulation]) skips the reduce-scatter on that first micro-batch and keeps every unit's unsharded
#     gradients to the end of its backward: the right window for accumulation, not the step of one micro-batch,
#     which reduce-scatters each unit's gradients and frees them as it goes. That step is the one FSDP2 reducing
#     every micro-batch runs with one micro-batch, so it is priced from that layout's analysis (shared with the
#     ladder's rung of that layout, Note [the ladder]): exactly, where its own window would have held the gradients
#     of the whole model unsharded (at 80 layers of a 70B model, hundreds of GiB). With one row per rank there is no
#     other step, and the layout's own window is not analysed at all. Which windows a rung analyses is the layout's
#     to say (``analysed_windows``, autofit/parallel/rungs.py).
def search_space(request: PlanRequest, parallel: Parallel, policies: tuple[PrecisionPolicy, ...],
                 analyses: dict[str, Analysis], single: dict[str, Analysis] | None = None) -> SearchSpace:
    """The memory and time models of each policy, over the rows one rank trains per step; ``single``: the analyses
    that price a step of one micro-batch where ``analyses`` cannot (Note [an accumulation-free FSDP2 step]), and the
    only ones with one row per rank."""
    rows = request.per_rank

    def memory_model(a: Analysis, one: MemoryModel | None = None) -> MemoryModel:
        terms = request.device.memory_terms(a, rows)
        return MemoryModel.from_analysis(a.profile, a.table, held_rows=rows, row_bytes=request.row_bytes,
                                         scale=terms.scale, constant=terms.constant, single=one)

    memory, time = {}, {}
    for p in policies:
        one = memory_model(single[p.label]) if single is not None else None
        if one is not None and p.label not in analyses:
            memory[p.label], a = one, single[p.label]
        else:
            a = analyses[p.label]
            memory[p.label] = memory_model(a, one)
        # what save_on_cpu would copy: the module's saved activations, and its weights (it packs every saved tensor)
        saved = {r.name: (float(r.saved_bytes_fixed + r.param_bytes), float(r.saved_bytes_per_sample))
                 for r in a.table.rows if r.name}
        # one rank's share of the whole model's work: each dimension's (tensor parallel's split layers and
        # all-reduces, Dimension.rank_work), then FSDP2's collectives over the data-parallel part
        work = parallel.layout.rank_work(RankWork(a.ops, a.table.row("").param_bytes), WorkInputs(
            model=request.model, output_bytes=lambda name, t=a.table: t.row(name).output_bytes_per_sample,
            rows=rows, link_bytes_per_second=request.device.interconnect_bytes_per_second))
        time[p.label] = build_time_model(work.ops, work.param_bytes, request.device, parallel,
                                        saved_bytes=saved, dimension_seconds=work.seconds)
    return SearchSpace(batch_size=rows, memory=memory, time=time, precisions=tuple(p.label for p in policies),
                       allow_checkpoint=request.allow_checkpoint, fixed_checkpoint=request.fixed_checkpoint,
                       fixed_selective=request.fixed_selective, fixed_op_selective=request.fixed_op_selective,
                       allow_offload=request.offload, blocks=request.blocks,
                       min_rows=request.min_rows)


# Note [one search cache per layout]
#     A search space keeps what its checkpoint MILPs found, by precision label, micro-batch and budget (candidate.py).
#     The ladder's rungs of one layout and one set of step features build their models of a precision from the same
#     analysis (``analyses`` is keyed by the layout and the features), under the same settings (rows, checkpoint and
#     offload permissions, blocks), so their spaces share one cache: the rung of every allowed precision after the
#     rung of the preferred one alone (Note [the ladder]) asks the preferred one's MILPs again, and the search with
#     the optimizer stepped in backward asks the whole batch's. The LoRA plan of Qwen2.5-7B on an RTX 4090 solved the
#     same two programs of bf16 (11 s) twice before this.
def searchable(request: PlanRequest, stage: Stage, analyses: dict[tuple, dict[str, Analysis]],
               caches: dict[tuple, tuple[dict, dict]] | None = None,
               ) -> tuple[Estimator, SearchSpace, dict[str, Analysis]]:
    """The rung's estimator, its search space and its analyses by precision (``analyses``' entry for the rung's
    layout and step features: its precisions are analysed unless they were before); the estimator holds the request
    as the rung runs it (each step feature in force, Note [step features]). ``caches``: the search caches by the
    same key, shared by the rungs that have one (Note [one search cache per layout])."""
    request = stage.request_for(request)
    own_window, single = analysed_windows(stage.parallel, request.per_rank)
    single_analysed = None
    if single is not None:  # Note [an accumulation-free FSDP2 step]
        single_analysed = analyses.setdefault((single, *feature_values(request)), {})
        single_analysed.update(analyse_policies(request, single, stage.policies, single_analysed))
    analysed = analyses.setdefault((stage.parallel, *feature_values(request)), {})
    if own_window:
        analysed.update(analyse_policies(request, stage.parallel, stage.policies, analysed))
    else:  # one row per rank: the step of one micro-batch is the only one
        analysed.update(single_analysed)
    space = search_space(request, stage.parallel, stage.policies, analysed if own_window else {}, single_analysed)
    if caches is not None:
        space = space.sharing(caches.setdefault((stage.parallel, *feature_values(request)), ({}, {})))
    return Estimator(request, stage.parallel), space, analysed
