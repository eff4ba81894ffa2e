"""Predicted step time, for ranking configurations (a model, not a promise of wall-clock seconds).

Roofline per op (Williams et al. 2009, "Roofline: an insightful visual performance model"): each op of the analysed
forward and backward takes ``max(FLOPs / (peak at its dtype x utilisation), bytes / bandwidth)`` plus a fixed
launch cost. FLOPs come from PyTorch's ``flop_registry``, bytes from the tensors each op reads and writes; both are
linear in the micro-batch b (the analysis ran at two sizes). Small ops reach a fraction of peak: utilisation
``f / (f + knee)`` with ``knee`` the FLOPs at which a GPU reaches half its peak, which is why large micro-batches win
when they fit, together with the per-op launch cost paid once per micro-batch. A recomputed module costs its
forward ops again. The optimizer streams parameters, gradients and state once per step; with data parallelism
the layout's collectives are added, not overlapped with compute (the layout's part of the step,
``autofit/parallel/step_time.py``). Each op is costed at the precision of the dtype it computed in
(``precision_of``), so under autocast the ops that stay in fp32 cost fp32.
Assumptions, and what is not modelled (overlap, cuDNN algorithm choice, data loading): docs/planner.md.

Note [offload time]
    Offloading (Note [offload], step.py) adds PCIe transfers at the GPU's ``host_transfer`` bandwidth (catalog.py):
    - activations: each offloaded module's saved bytes go to the host in forward and come back in backward, per
      micro-batch: ``2 x saved / bandwidth``. Not overlapped: ``save_on_cpu`` packs with a plain ``copy_`` on the
      compute stream (torch/autograd/graph.py), and its unpack blocks the backward node that needs the tensor;
    - states (FSDP2 ``CPUOffloadPolicy``): the fp32 sharded parameters go to the device for each unit's forward and
      again for its backward (units reshard after forward), and the fp32 gradients come back, per micro-batch
      (offloading FSDP2 reduces every micro-batch and accumulates on the host): ``3 x shard`` each micro-batch.
      FSDP2 issues these copies with the collectives it runs on their own streams, so they hide behind compute:
      only ``max(0, transfers - compute)`` of each micro-batch is added. The optimizer then steps on the CPU, streaming
      parameters, gradients and state through host memory at ``HOST_OPTIMIZER_BYTES_PER_SECOND``, after backward
      (not overlapped). This part is the layout's: ``LayoutTime.optimizer_seconds``, autofit/parallel/step_time.py.
    Both are checked against hand computations in tests/test_offload.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from autofit.analyse.table import OpCosts
from autofit.device import DeviceTarget, Throughput
from autofit.parallel.collectives import Links
from autofit.parallel.layout import Parallel
# HOST_OPTIMIZER_BYTES_PER_SECOND is re-exported: it was this module's
from autofit.parallel.step_time import HOST_OPTIMIZER_BYTES_PER_SECOND, LayoutTime, layout_time

__all__ = ["TimeModel", "StepTime", "build_time_model", "HOST_OPTIMIZER_BYTES_PER_SECOND", "LayoutTime"]


@dataclass(frozen=True)
class StepTime:
    compute_seconds: float
    recompute_seconds: float
    overhead_seconds: float
    optimizer_seconds: float  # the optimizer step, and the gradient/parameter collectives of data parallelism
    transfer_seconds: float = 0.0  # host <-> device copies of offloading that compute does not hide

    @property
    def total(self) -> float:
        return (self.compute_seconds + self.recompute_seconds + self.overhead_seconds + self.optimizer_seconds
                + self.transfer_seconds)


@dataclass(frozen=True)
class TimeModel:
    throughput: Throughput
    ops: OpCosts
    # the layout's part (autofit/parallel/step_time.py): the optimizer's bytes on a rank, the collectives, and the
    # host copies of states kept on the host
    layout_time: LayoutTime = LayoutTime()
    # Note [offload time]: saved bytes of each module (fixed, per sample), the host link (None: no offloading)
    saved_bytes: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    host_transfer: float | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def offload_seconds(self, names: tuple[str, ...], batch: int) -> float:
        """Copies of the saved activations of ``names`` to the host and back, for one micro-batch of ``batch``."""
        if not names:
            return 0.0
        if self.host_transfer is None:
            raise ValueError("this device has no host link to offload over (a CPU target)")
        saved = sum(max(0.0, fixed + per * batch) for fixed, per in (self.saved_bytes[n] for n in names))
        return 2 * saved / self.host_transfer

    def recompute_seconds(self, name: str, batch: int, *, selective: bool = False, launches: bool = False,
                          policy: str | None = None) -> float:
        """What recomputing module ``name`` costs for one micro-batch of ``batch``: its forward ops again (with
        ``selective``, all but those whose outputs it keeps: Note [selective recomputation],
        autofit/training/recompute.py; ``policy`` names the policy instead: "full", "selective" or "op-selective");
        with ``launches``, their launch overhead too, as :meth:`step_time` counts it."""
        policy = policy or ("selective" if selective else "full")
        mask = self._module_mask(name)
        if policy == "selective":
            mask = mask & ~self._kept
        elif policy == "op-selective":
            mask = self._op_selective_mask((name,))
        overhead = int(mask.sum()) * self.throughput.op_overhead_seconds if launches else 0.0
        return float(self._op_seconds(batch)[mask].sum()) + overhead

    def _op_selective_mask(self, names: tuple[str, ...]) -> np.ndarray:
        """Bool per op: it runs again when ``names`` are recomputed by torchtitan's per-op policy (Note [torchtitan's
        per-op policy]): their forward ops but those it keeps and every other ``mm`` of each module, in order."""
        kind = self.ops.op_selective
        if kind is None:
            kind = np.zeros(len(self.ops.module), dtype=np.int8)
        mask = np.zeros(len(self.ops.module), dtype=bool)
        for name in names:
            under = self._module_mask(name)
            mask |= under & (kind == 0)
            mask[np.flatnonzero(under & (kind == 2))[1::2]] = True
        return mask

    @property
    def _kept(self) -> np.ndarray:
        kept = self.ops.kept
        return np.zeros(len(self.ops.module), dtype=bool) if kept is None else kept

    def cheapest_removal_seconds(self, names: tuple[str, ...], batch: int, allow_offload: bool,
                                 policies: tuple[str, ...] = ()) -> np.ndarray:
        """Per unit, the least time that getting its activations off the device costs for one micro-batch of
        ``batch``: recomputing it (by its policy, "full" when ``policies`` is empty), or with ``allow_offload`` and
        a host link, copying them out and back."""
        policies = policies or ("full",) * len(names)
        out = np.array([self.recompute_seconds(n, batch, policy=p) for n, p in zip(names, policies)])
        if allow_offload and self.host_transfer is not None:
            for i, n in enumerate(names):
                if n in self.saved_bytes:
                    out[i] = min(out[i], self.offload_seconds((n,), batch))
        return out

    def _module_mask(self, name: str) -> np.ndarray:
        key = ("mask", name)
        if key not in self._cache:
            self._cache[key] = self._recompute_mask((name,))
        return self._cache[key]

    def keep_recompute_or_offload(self, dropped: tuple[str, ...], batch: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Split modules whose activations must leave the device into (recomputed, offloaded), each by whichever
        costs less time (Note [offload time]). Without a host link every one is recomputed."""
        if self.host_transfer is None:
            return dropped, ()
        offloaded = tuple(n for n in dropped if n in self.saved_bytes
                          and self.offload_seconds((n,), batch) < self.recompute_seconds(n, batch))
        return tuple(n for n in dropped if n not in offloaded), offloaded

    def op_seconds(self, batch: int) -> np.ndarray:
        """Each op's seconds for one micro-batch of ``batch`` rows, by the roofline (a pipeline's stages sum their
        own: autofit/planning/pipeline.py)."""
        return self._op_seconds(batch)

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
                  last_batch: int | None = None, offload: tuple[str, ...] = (),
                  selective: tuple[str, ...] = (), op_selective: tuple[str, ...] = ()) -> StepTime:
        """Time of one optimizer step: ``accumulation_steps`` micro-batches (the last may be ``last_batch``);
        ``offload``: modules whose saved activations go to the host (Note [offload time]); ``selective``: those of
        ``checkpoint`` that rerun only the ops whose outputs they do not keep (autofit/training/recompute.py)."""
        del precision  # each op already carries the dtype it ran in
        sizes = [batch] * (accumulation_steps - 1) + [last_batch or batch]
        full = tuple(n for n in checkpoint if n not in selective and n not in op_selective)
        mask = self._recompute_mask(full) | (self._recompute_mask(tuple(selective)) & ~self._kept)
        mask |= self._op_selective_mask(tuple(n for n in op_selective if n in checkpoint))
        compute = recompute = transfer = 0.0
        per_micro = []
        for b in sizes:
            seconds = self._op_seconds(b)
            compute += float(seconds.sum())
            recompute += float(seconds[mask].sum())
            transfer += self.offload_seconds(offload, b)
            per_micro.append(float(seconds.sum()) + float(seconds[mask].sum()))
        launches = len(self.ops.precision) + int(mask.sum())
        overhead = len(sizes) * launches * self.throughput.op_overhead_seconds
        optimizer, exposed = self.layout_time.optimizer_seconds(self.throughput.bytes_per_second, self.host_transfer,
                                                                 per_micro)
        transfer += exposed  # 0.0 where the states stay on the device: the sum is unchanged
        return StepTime(compute, recompute, overhead, optimizer, transfer)

    def _recompute_mask(self, checkpoint: tuple[str, ...]) -> np.ndarray:
        if not checkpoint:
            return np.zeros(len(self.ops.module), dtype=bool)
        return self.ops.under(checkpoint) & self.ops.forward


def build_time_model(ops: OpCosts, param_bytes: int, target: DeviceTarget, parallel: Parallel = Parallel(), *,
                     saved_bytes: Mapping[str, tuple[float, float]] | None = None,
                     dimension_seconds: float = 0.0) -> TimeModel:
    """The roofline over ``ops`` on ``target``, with ``parallel``'s part of the step (``layout_time``,
    autofit/parallel/step_time.py: the optimizer's bytes on a rank, the data-parallel collectives and
    ``dimension_seconds``, the layout dimensions' own per optimizer step, the host copies of states kept on the host)
    and the offloaded activations' transfers (``saved_bytes``: each module's saved activations, fixed and per sample)
    over the target's host link (Note [offload time])."""
    return TimeModel(target.throughput, ops, layout_time(parallel, param_bytes, Links.of(target), dimension_seconds),
                     saved_bytes=dict(saved_bytes or {}),
                     host_transfer=target.throughput.host_transfer_bytes_per_second)
