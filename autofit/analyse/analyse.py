"""Compose the analysis: trace the graph, simulate the window at two batch sizes, fit per-sample figures."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from torch import nn

from autofit.analyse.boundaries import segment_problems
from autofit.analyse.layers import ForwardStats, LayerObserver
from autofit.analyse.profile import CallRecord, build_profile
from autofit.analyse.table import Analysis, LayerRow, LayerTable, OpCosts, precision_of
from autofit.training.batch import Batch
from autofit.capture.graph import capture_graph
from autofit.training.loss import LossFn
from autofit.training.recompute import op_selective_names, saved_op_names
from autofit.simulate.run import DeviceRules, Simulation, probes_kernels, simulate_step
from autofit.core.shared import shared
from autofit.simulate.sample_rows import SampleRows, each_step, sample_micro_batches
from autofit.simulate.timeline import EventKind, Phase
from autofit.training.step import StepConfig
from autofit.core.workers import run_all

__all__ = ["analyse_model", "SIZES", "op_costs"]

KEPT = saved_op_names()  # ops whose outputs a selective recomputation keeps (Note [selective recomputation])
OP_SELECTIVE = op_selective_names()  # what "op-selective" keeps, mm every other (Note [torchtitan's per-op policy])
SIZES = (2, 3)  # the two micro-batch sizes the analysis simulates; per-sample figures are their difference


def analyse_model(
    model: nn.Module, batch: Batch, target: Batch | None, loss_fn: LossFn | None, step: StepConfig, *,
    probe_kernels: bool = False, device_rules: DeviceRules | None = None,
) -> Analysis:
    """Graph, per-layer table and step profile of ``model`` trained as ``step`` says (its precision, optimizer,
    clipping, target device and data-parallel layout; its micro-batch, accumulation, recomputation and offload are
    the analysis' own).

    The window is simulated with two micro-batches (the second starts with gradients, as every later micro-batch
    of an accumulation window does) at b = 2 and b = 3 (see ``profile.py`` for why not 1), side by side where a
    second core allows (Note [parallel simulations], autofit/core/workers.py); where the step reads values of the
    sample's rows, at the sample's largest micro-batch of each size (Note [rows that differ]). CPU kernel probes run
    only with ``probe_kernels=True`` and a CPU step: the planner asks for them on CPU targets, so the scratch
    memory of CPU kernels is in its models; ``autofit.analyse`` does not. A step with a ``strategy`` simulates one
    rank of a data-parallel step (``parallel/simulated.py``).
    """
    # the same analysis for another card of the same rules (Note [one analysis for several cards])
    return shared("analyse_model", lambda: _analyse(model, batch, target, loss_fn, step, probe_kernels=probe_kernels,
                                                     device_rules=device_rules),
                  model=model, batch=batch, target=target, loss_fn=loss_fn, config=step, device_rules=device_rules,
                  extra=(probe_kernels,))


def _analyse(model: nn.Module, batch: Batch, target: Batch | None, loss_fn: LossFn | None, step: StepConfig, *,
             probe_kernels: bool, device_rules: DeviceRules | None) -> Analysis:
    graph = capture_graph(model, batch)
    precision = step.precision
    configs = [replace(step, micro_batch_size=size, accumulation_steps=2, checkpoint=(), offload=(),
                       optimizer_in_backward=False, held_rows=0) for size in SIZES]

    def job(config: StepConfig, rows: SampleRows | None = None):  # a worker sends back both, picklable
        def run() -> tuple[Simulation, LayerObserver]:
            observer = LayerObserver()
            inputs, labels = (batch, target) if rows is None else (rows.batch, rows.target)
            sim = simulate_step(model, inputs, labels, loss_fn, config, probe_kernels=probe_kernels,
                                observer=observer, device_rules=device_rules)
            return sim, observer
        return run

    def largest(config: StepConfig, first: tuple[Simulation, LayerObserver]) -> tuple[Simulation, LayerObserver]:
        """The largest micro-batch of the sample's at this size where the step reads its rows' values (Note [rows
        that differ], solve/estimator.py): the models are then built on the rows the plan must hold."""
        if first[0].row_reader is None:
            return first
        rows = sample_micro_batches(batch, target, batch.size, batch.size, config.micro_batch_size)
        steps = each_step(rows, first, lambda r: job(config, r)(), lambda result: result[0].row_program)
        return max((result for _, result in steps), key=lambda result: result[0].replay.peak_bytes)

    runs = run_all([job(c) for c in configs], fork=not probes_kernels(configs[0], probe_kernels))
    (sim1, obs1), (sim2, obs2) = (largest(c, first) for c, first in zip(configs, runs))
    profile = build_profile(sim1.timeline, sim2.timeline, precision.name, SIZES[0], _call_records(obs1, obs2))
    problems = segment_problems(model, graph)
    one, two = obs1.stats, obs2.stats
    rows = tuple(_row(name, module, one, two, problems) for name, module in model.named_modules())
    ops = op_costs(sim1.priced_timeline, sim2.priced_timeline)  # a compiled step's own ops (compiled_model.py)
    return Analysis(graph, LayerTable(rows, precision.name), profile, sim1.method, sim1.timeline, sim2.timeline, ops)


def op_costs(t1, t2, *, per_sample_from: int = SIZES[0]) -> OpCosts:
    """FLOPs and bytes of each op of the first micro-batch's forward and backward, linear in b (the two runs
    differ by one sample; if they did not align, or the same run is given twice, per-sample figures are the first
    run's divided by its micro-batch ``per_sample_from``)."""
    def ops_of(timeline):
        marks = timeline.marks
        start = next((s for s, m, p in marks if (m, p) == (0, Phase.FORWARD)), 0)
        end = next((s for s, m, p in marks if m == 1 or p is Phase.OPTIMIZER), len(timeline.events))
        return [timeline.ops[v] for k, v in timeline.events[start:end] if k is EventKind.OP]

    one, two = ops_of(t1), ops_of(t2)
    f1 = np.array([o.flops for o in one], dtype=np.float64)
    b1 = np.array([o.io_bytes for o in one], dtype=np.float64)
    if t1 is not t2 and len(one) == len(two) and all(a.name == b.name for a, b in zip(one, two)):
        f2 = np.array([o.flops for o in two], dtype=np.float64)
        b2 = np.array([o.io_bytes for o in two], dtype=np.float64)
        fs, bs = f2 - f1, b2 - b1
        size = SIZES[0]
    else:
        size = per_sample_from
        fs, bs = f1 / size, b1 / size
    return OpCosts(
        flops_fixed=f1 - size * fs, flops_per_sample=fs, bytes_fixed=b1 - size * bs, bytes_per_sample=bs,
        precision=tuple(precision_of(o.dtype) for o in one),
        forward=np.array([o.phase is Phase.FORWARD for o in one], dtype=bool),
        module=tuple(o.module for o in one),
        kept=np.array([o.name in KEPT for o in one], dtype=bool),
        op_selective=np.array([2 if o.name == "mm" else int(o.name in OP_SELECTIVE) for o in one], dtype=np.int8),
    )


def _call_records(obs1: LayerObserver, obs2: LayerObserver) -> tuple[CallRecord, ...]:
    """Calls of the smaller run, with their saved bytes fitted linearly against the same call in the larger run."""
    second = {c.key: c for c in obs2.calls}
    freed, freed2 = obs1.freed_at(), obs2.freed_at()
    never = 1 << 62
    records = []
    for call in obs1.calls:
        if call.end < 0:
            continue
        other = second.get(call.key)
        s1 = obs1.saved_bytes(call)
        s2 = obs2.saved_bytes(other) if other is not None else s1
        per_sample = s2 - s1
        kept, kept_op = (_fitted(obs1.kept_bytes(call, freed, policy),
                                 obs2.kept_bytes(other, freed2, policy) if other is not None else None)
                         for policy in ("selective", "op-selective"))
        inputs = []
        for i, sid in enumerate(call.input_sids):
            n1 = obs1.nbytes(sid)
            n2 = obs2.nbytes(other.input_sids[i]) if other is not None and i < len(other.input_sids) else n1
            inputs.append((freed.get(sid, never), n1 - SIZES[0] * (n2 - n1), n2 - n1))
        records.append(CallRecord(call.name, call.micro, call.start, call.end, call.recompute_at,
                                  call.backward_end, (s1 - SIZES[0] * per_sample, per_sample), tuple(inputs),
                                  kept, kept_op))
    return tuple(records)


def _fitted(one: int, two: int | None) -> tuple[int, int]:
    """(fixed, per_sample) of bytes measured at the two analysis sizes (consecutive); ``two`` None: the same."""
    two = one if two is None else two
    return one - SIZES[0] * (two - one), two - one


def _linear(one: dict[str, int], two: dict[str, int], name: str) -> tuple[int, int]:
    """(per_sample, fixed) of a figure measured at the two analysis sizes (consecutive: the slope is the difference)."""
    per_sample = two.get(name, 0) - one.get(name, 0)
    return per_sample, one.get(name, 0) - SIZES[0] * per_sample


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
