"""Compose the analysis: trace the graph, measure forwards at two batch sizes, fit the linear per-sample figures."""

from __future__ import annotations

from torch import nn

from autofit.analyse.boundaries import segment_problems
from autofit.analyse.layers import ForwardStats, forward_stats
from autofit.analyse.table import Analysis, LayerRow, LayerTable
from autofit.batch import Batch
from autofit.capture.graph import capture_graph
from autofit.loss import LossFn
from autofit.precision import PrecisionPolicy
from autofit.simulate.run import DATA_DEPENDENT_ERRORS

__all__ = ["analyse_model"]


def analyse_model(
    model: nn.Module, batch: Batch, target: Batch | None, loss_fn: LossFn | None, precision: PrecisionPolicy,
) -> Analysis:
    graph = capture_graph(model, batch)
    fake = graph.method != "dispatch-real"
    try:
        one = forward_stats(model, batch, target, loss_fn, precision, 1, fake=fake)
        two = forward_stats(model, batch, target, loss_fn, precision, 2, fake=fake)
    except DATA_DEPENDENT_ERRORS:  # traced by symbolic_trace, yet reads values when it runs
        one = forward_stats(model, batch, target, loss_fn, precision, 1, fake=False)
        two = forward_stats(model, batch, target, loss_fn, precision, 2, fake=False)
    problems = segment_problems(model, graph)
    rows = tuple(_row(name, module, one, two, problems) for name, module in model.named_modules())
    return Analysis(graph, LayerTable(rows, precision.name))


def _linear(one: dict[str, int], two: dict[str, int], name: str) -> tuple[int, int]:
    """(per_sample, fixed) of a figure measured at b = 1 and b = 2."""
    per_sample = two.get(name, 0) - one.get(name, 0)
    return per_sample, one.get(name, 0) - per_sample


def _row(name: str, module: nn.Module, one: ForwardStats, two: ForwardStats, problems: dict[str, str]) -> LayerRow:
    params = {id(p): p.nelement() * p.element_size() for p in module.parameters()}
    saved = _linear(one.saved, two.saved, name)
    out = _linear(one.outputs, two.outputs, name)
    inp = _linear(one.inputs, two.inputs, name)
    flops = _linear(one.flops, two.flops, name)
    calls = one.calls.get(name, 0) if name else 1
    reason = problems.get(name, "") if calls else "never called in forward"
    return LayerRow(
        name=name, type=type(module).__name__, calls=calls, param_bytes=sum(params.values()),
        saved_bytes_per_sample=saved[0], saved_bytes_fixed=saved[1],
        output_bytes_per_sample=out[0], output_bytes_fixed=out[1],
        input_bytes_per_sample=inp[0], input_bytes_fixed=inp[1],
        flops_per_sample=flops[0], flops_fixed=flops[1],
        checkpointable=not reason, reason=reason,
    )
