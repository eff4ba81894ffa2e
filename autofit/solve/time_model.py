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
      (not overlapped).
    Both are checked against hand computations in tests/test_offload.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from autofit.analyse.table import OpCosts
from autofit.device import DeviceTarget, Throughput
from autofit.solve.sharding import Links, collective_seconds
from autofit.parallel.layout import Parallel

__all__ = ["TimeModel", "StepTime", "build_time_model", "HOST_OPTIMIZER_BYTES_PER_SECOND"]

# What a CPU optimizer step streams per second through host memory: torch's for-loop (single-tensor) Adam on CPU
# tensors, which is what a CPU-offloaded FSDP2 step runs (foreach kernels are CUDA-only: torch/utils/_foreach_utils.py).
# An assumption for ranking, not a measurement: a few GB/s, well under a server's memory bandwidth, as the per-tensor
# loop and its temporaries cost several passes over memory (the ZeRO-Offload paper, Ren et al. 2021, section 5.1,
# reports PyTorch's CPU Adam several times slower than its vectorised CPU-Adam for the same reason).
HOST_OPTIMIZER_BYTES_PER_SECOND = 5e9


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
    optimizer_bytes: int  # bytes the optimizer step reads and writes
    collectives: object = None  # micro_batches -> seconds of communication per step (data parallelism)
    # Note [offload time]: saved bytes of each module (fixed, per sample), the host link (None: no offloading),
    # and for FSDP2's CPUOffloadPolicy the host copy of the parameters (fp32 shards) and gradients it moves
    saved_bytes: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    host_transfer: float | None = None
    offload_states: bool = False
    state_param_bytes: int = 0
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

    def _states_transfer(self, compute_per_micro: list[float]) -> tuple[float, float]:
        """(exposed transfer seconds, CPU optimizer seconds) of FSDP2's CPUOffloadPolicy (Note [offload time])."""
        link = self.host_transfer
        # each micro-batch gathers every unit for forward and for backward (2 shards in), and reduces its fp32
        # gradients to the host (1 shard out): FSDP2 syncs every micro-batch when offloading (Note [offload])
        per_micro = 3 * self.state_param_bytes / link
        exposed = sum(max(0.0, per_micro - c) for c in compute_per_micro)
        return exposed, 4 * self.state_param_bytes / HOST_OPTIMIZER_BYTES_PER_SECOND

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
        optimizer = self.optimizer_bytes / self.throughput.bytes_per_second
        if self.offload_states:
            exposed, optimizer = self._states_transfer(per_micro)
            transfer += exposed
        if self.collectives is not None:
            optimizer += self.collectives(len(sizes))
        return StepTime(compute, recompute, overhead, optimizer, transfer)

    def _recompute_mask(self, checkpoint: tuple[str, ...]) -> np.ndarray:
        if not checkpoint:
            return np.zeros(len(self.ops.module), dtype=bool)
        return self.ops.under(checkpoint) & self.ops.forward




def build_time_model(ops: OpCosts, param_bytes: int, target: DeviceTarget, parallel: Parallel = Parallel(), *,
                     saved_bytes: Mapping[str, tuple[float, float]] | None = None,
                     dimension_seconds: float = 0.0) -> TimeModel:
    """The roofline over ``ops`` on ``target``, the optimizer streaming the parameters four times (weight, grad, two
    states; FSDP2 streams one shard), the data-parallel collectives of ``parallel`` (its data-parallel part:
    ``Parallel.data_parallel``), and offloading's transfers (``saved_bytes``: each module's saved activations, fixed
    and per sample; ``parallel.offload_states``: FSDP2's CPUOffloadPolicy) over the target's host link (Note [offload
    time]); offloading FSDP2 reduce-scatters every micro-batch (Note [offload]), as ``reduce_every_micro_batch`` does
    (Note [gradient sync under accumulation], autofit/training/step.py); ``dimension_seconds``: the layout
    dimensions' own collectives per optimizer step (``Layout.rank_work``: tensor parallel's all-reduces)."""
    world_size = parallel.world_size
    optimizer_bytes = 4 * param_bytes // parallel.shard_group
    if parallel.offload_states:
        parallel = replace(parallel, reduce_every_micro_batch=True)
    links = Links.of(target)

    def collectives(micro_batches: int) -> float:
        return collective_seconds(parallel, links, param_bytes, param_bytes, micro_batches) + dimension_seconds

    # one rank holds 1/world_size of the fp32 parameters (FSDP2 keeps fp32 shards whatever it gathers in)
    shard = param_bytes // parallel.shard_group
    return TimeModel(target.throughput, ops, optimizer_bytes,
                     collectives if (parallel.strategy and world_size > 1) or dimension_seconds else None,
                     saved_bytes=dict(saved_bytes or {}),
                     host_transfer=target.throughput.host_transfer_bytes_per_second,
                     offload_states=parallel.offload_states,
                     state_param_bytes=shard if parallel.offload_states else 0)
