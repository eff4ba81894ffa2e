"""A rung's search space: each of its precisions analysed (two small simulations), then turned into the memory and
time models the search reads (docs/planner.md)."""

from __future__ import annotations

from dataclasses import replace

from typing import TYPE_CHECKING

from autofit.core import progress
from autofit.analyse.analyse import analyse_model
from autofit.analyse.depth import extend_analysis
from autofit.capture.depth import truncated
from autofit.analyse.table import Analysis
from autofit.training.precision import PrecisionPolicy
from autofit.solve.depth import analysis_depth, config_at_depth, extended_ops, parameter_ratios
from autofit.solve.estimator import Estimator
from autofit.solve.ladder import Stage
from autofit.solve.memory_model import MemoryModel
from autofit.solve.search import SearchSpace
from autofit.solve.sharding import ring_seconds, split_ops, tensor_group_bytes, tensor_reduce_bytes
from autofit.solve.time_model import build_time_model
from autofit.training.step import forward_errors

if TYPE_CHECKING:  # the request is built after this stage in the import order; only its values are read here
    from autofit.request import Parallel, PlanRequest

__all__ = ["analyse_policies", "search_space", "searchable"]


def analyse_policies(request: PlanRequest, parallel: Parallel, policies: tuple[PrecisionPolicy, ...],
                     done: dict[str, Analysis]) -> dict[str, Analysis]:
    """The analysis of every policy not analysed yet. CPU targets probe kernels for their scratch memory (see
    simulate/probe.py); the CUDA model has its own terms."""
    todo = [p for p in policies if p.label not in done]
    where = " (states on the host)" if parallel.offload_states else (
        f" ({parallel.strategy} over {parallel.world_size}"
        f"{', reducing every micro-batch' if parallel.reduce_every_micro_batch else ''})" if parallel.strategy else "")
    analyses = {}
    with forward_errors():
        for i, p in enumerate(todo):
            progress.report(f"analysing {p.label}{where}: two small simulations", i, len(todo))
            step = replace(request.step(parallel), precision=p)
            cut = analysis_depth(step, request.blocks) if request.blocks is not None else None
            if cut is None:
                analyses[p.label] = analyse_model(
                    request.model, request.batch, request.target, request.loss_fn, step,
                    probe_kernels=request.device.kind == "cpu", device_rules=request.device.simulation_rules)
                continue
            depth, period = cut  # Note [extending an analysis in depth], autofit/analyse/depth.py
            model = truncated(request.model, request.blocks, depth)
            a = analyse_model(model, request.batch, request.target, request.loss_fn,
                              config_at_depth(step, request.blocks, depth),
                              probe_kernels=request.device.kind == "cpu", device_rules=request.device.simulation_rules)
            analyses[p.label] = extend_analysis(
                a, request.blocks, depth, period, parameter_ratios(request.model, model),
                extend_ops=lambda ops, ranges, copies, first, q=period: extended_ops(ops, ranges, copies, request.blocks,
                                                                          q, first=first))
    return analyses


def search_space(request: PlanRequest, parallel: Parallel, policies: tuple[PrecisionPolicy, ...],
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
        ops, param_bytes, strategy, ranks, tensor = a.ops, a.table.row("").param_bytes, parallel.strategy, \
            parallel.world_size, 0.0
        if parallel.tensor_parallel > 1:  # one rank's share of the split layers, FSDP2 over the other dim
            tp = parallel.tensor_parallel
            ops, param_bytes = split_ops(a.ops, parallel), tensor_group_bytes(request.model, parallel)
            ranks = parallel.world_size // tp
            strategy = strategy if ranks > 1 else None
            reduced = rows * tensor_reduce_bytes(request.model, parallel,
                                                 lambda name: a.table.row(name).output_bytes_per_sample)
            tensor = ring_seconds("all_reduce", tp, reduced, request.device.interconnect_bytes_per_second)
        time[p.label] = build_time_model(ops, param_bytes, request.device, strategy, ranks, saved_bytes=saved,
                                        offload_states=parallel.offload_states,
                                        reduce_every_micro_batch=parallel.reduce_every_micro_batch,
                                        reshard_after_forward=parallel.reshard_after_forward,
                                        replicate=parallel.replicate, gpus_per_node=parallel.gpus_per_node,
                                        tensor_seconds=tensor)
    return SearchSpace(batch_size=rows, memory=memory, time=time, precisions=tuple(p.label for p in policies),
                       allow_checkpoint=request.allow_checkpoint, fixed_checkpoint=request.fixed_checkpoint,
                       fixed_selective=request.fixed_selective,
                       allow_offload=request.offload, offload_states=parallel.offload_states)


def searchable(request: PlanRequest, stage: Stage,
                analyses: dict[tuple, dict[str, Analysis]]) -> tuple[Estimator, SearchSpace, dict[str, Analysis]]:
    """The rung's estimator and search space, its precisions analysed unless done before in its layout with its
    opt-in rungs; the request as the rung runs it (its chunked loss and optimizer)."""
    request = stage.request_for(request)
    done = analyses.setdefault((stage.parallel, request.chunked_loss, request.low_bit_optimizer), {})
    done.update(analyse_policies(request, stage.parallel, stage.policies, done))
    return Estimator(request, stage.parallel), search_space(request, stage.parallel, stage.policies, done), done
