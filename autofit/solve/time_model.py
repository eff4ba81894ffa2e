"""Predicted step time, for ranking configurations (a model, not a promise of wall-clock seconds).

Roofline per op (Williams et al. 2009, "Roofline: an insightful visual performance model"): each op of the analysed
forward and backward takes ``max(FLOPs / (peak at its dtype x utilisation), bytes / bandwidth)`` plus a fixed
launch cost. FLOPs come from PyTorch's ``flop_registry``, bytes from the tensors each op reads and writes; both are
linear in the micro-batch b (the analysis ran at two sizes). Small ops reach a fraction of peak: utilisation
``f / (f + knee)`` with ``knee`` the FLOPs at which a GPU reaches half its peak, which is why large micro-batches win
when they fit, together with the per-op launch cost paid once per micro-batch. A recomputed module costs its
forward ops again. The optimizer streams parameters, gradients and state once per step; with data parallelism
the strategy's collectives (``sharding.py``) are added, not overlapped with compute. Each op is costed at the
precision of the dtype it computed in (``precision_of``), so under autocast the ops that stay in fp32 cost fp32.
Assumptions, and what is not modelled (overlap, cuDNN algorithm choice, data loading): docs/planner.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autofit.analyse.table import OpCosts
from autofit.device import DeviceTarget, Throughput
from autofit.solve.sharding import collective_seconds

__all__ = ["TimeModel", "StepTime", "build_time_model"]


@dataclass(frozen=True)
class StepTime:
    compute_seconds: float
    recompute_seconds: float
    overhead_seconds: float
    optimizer_seconds: float  # the optimizer step, and the gradient/parameter collectives of data parallelism

    @property
    def total(self) -> float:
        return self.compute_seconds + self.recompute_seconds + self.overhead_seconds + self.optimizer_seconds


@dataclass(frozen=True)
class TimeModel:
    throughput: Throughput
    ops: OpCosts
    optimizer_bytes: int  # bytes the optimizer step reads and writes
    collectives: object = None  # micro_batches -> seconds of communication per step (data parallelism)
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def _op_seconds(self, batch: int) -> np.ndarray:
        if batch not in self._cache:
            ops, tp = self.ops, self.throughput
            flops = np.maximum(ops.flops_fixed + ops.flops_per_sample * batch, 0.0)
            nbytes = np.maximum(ops.bytes_fixed + ops.bytes_per_sample * batch, 0.0)
            peak = np.array([tp.flops_per_second[p] for p in ops.precision])
            util = flops / (flops + tp.saturation_flops) if tp.saturation_flops > 0 else np.ones_like(flops)
            compute = np.divide(flops, peak * np.maximum(util, 1e-9), out=np.zeros_like(flops), where=flops > 0)
            self._cache[batch] = np.maximum(compute, nbytes / tp.bytes_per_second)
        return self._cache[batch]

    def step_time(self, precision: str, batch: int, accumulation_steps: int, checkpoint: tuple[str, ...] = (),
                  last_batch: int | None = None) -> StepTime:
        """Time of one optimizer step: ``accumulation_steps`` micro-batches (the last may be ``last_batch``)."""
        del precision  # each op already carries the dtype it ran in
        sizes = [batch] * (accumulation_steps - 1) + [last_batch or batch]
        mask = self._recompute_mask(checkpoint)
        compute = recompute = 0.0
        for b in sizes:
            seconds = self._op_seconds(b)
            compute += float(seconds.sum())
            recompute += float(seconds[mask].sum())
        launches = len(self.ops.precision) + int(mask.sum())
        overhead = len(sizes) * launches * self.throughput.op_overhead_seconds
        optimizer = self.optimizer_bytes / self.throughput.bytes_per_second
        if self.collectives is not None:
            optimizer += self.collectives(len(sizes))
        return StepTime(compute, recompute, overhead, optimizer)

    def _recompute_mask(self, checkpoint: tuple[str, ...]) -> np.ndarray:
        if not checkpoint:
            return np.zeros(len(self.ops.module), dtype=bool)
        prefixes = tuple(checkpoint) + tuple(n + "." for n in checkpoint)
        inside = np.array([m in checkpoint or m.startswith(prefixes) for m in self.ops.module], dtype=bool)
        return inside & self.ops.forward




def build_time_model(ops: OpCosts, param_bytes: int, target: DeviceTarget, strategy: str | None,
                     world_size: int) -> TimeModel:
    """The roofline over ``ops`` on ``target``, the optimizer streaming the parameters four times (weight, grad, two
    states; FSDP2 streams one shard), and the data-parallel collectives of ``strategy``."""
    optimizer_bytes = 4 * param_bytes // (world_size if strategy == "fsdp2" else 1)

    def collectives(micro_batches: int) -> float:
        return collective_seconds(strategy, world_size, param_bytes, param_bytes, micro_batches,
                                  target.interconnect_bytes_per_second)

    return TimeModel(target.throughput, ops, optimizer_bytes, collectives if strategy else None)
