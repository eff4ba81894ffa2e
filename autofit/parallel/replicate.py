"""Data-parallel replication: whole copies of the model (or of a shard group, HSDP's replicate dim), each training
other rows. Alone it is DDP; with sharding it is HSDP's outer mesh dim (replicate across nodes, shard within)."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from autofit.core.errors import InvalidInputError
from autofit.parallel.collectives import Links, ring_seconds
from autofit.parallel.dimension import ApplyInputs, Dimension, Layout, Placement
from autofit.parallel.exports import ExportFragment, ExportInputs
from autofit.parallel.wrappers import wrap_ddp

__all__ = ["REPLICATE", "DDP_KWARGS", "replicate_choices"]

# DistributedDataParallel's keyword that a DDP plan's memory depends on (Note [DDP's bucket views],
# autofit/parallel/simulated.py)
DDP_KWARGS = {"gradient_as_bucket_view": True}


def replicate_choices(replicate: Any, world_size: int, per_node: int) -> tuple[int, ...]:
    """What ``replicate`` expands to over ``world_size`` ranks of ``per_node`` each: a size given is itself; "auto"
    is 1 (plain FSDP) and, across nodes, one replica per node (HSDP, each shard group one node)."""
    if replicate != "auto":
        return (replicate,)
    nodes = world_size // per_node
    return (1, nodes) if nodes > 1 else (1,)


class _Replicate(Dimension):
    def choices(self, space: Any):
        """HSDP's replicate sizes the request allows (1: plain FSDP; "auto" across nodes: also one per node)."""
        return tuple(Placement(self.name, r) for r in space.replicate_options)

    def check(self, layout: Layout) -> None:
        replicate = layout.degree(self.name)
        if layout.world_size % replicate:
            raise InvalidInputError(f"replicate {replicate} does not divide world_size {layout.world_size}: HSDP's "
                                    "mesh is (replicate, world_size // replicate); use the number of nodes")

    def apply(self, model: nn.Module, layout: Layout, placement: Placement, inputs: ApplyInputs) -> nn.Module:
        """Alone, DistributedDataParallel around what the other dimensions made, with the step's bucket mode (Note
        [DDP's bucket views], autofit/parallel/simulated.py); HSDP's replicate dim is FSDP2's mesh dim, applied by
        the shard dimension."""
        if layout.placement("dp_shard") is not None:
            return model
        return wrap_ddp(model, inputs.gradient_as_bucket_view, device_ids=inputs.device_ids)

    def micro_batch_context(self, model: nn.Module, layout: Layout, placement: Placement, *, last: bool
                            ) -> contextlib.AbstractContextManager[Any]:
        """DDP all-reduces on the window's last micro-batch only: ``no_sync`` before it."""
        if last or layout.placement("dp_shard") is not None:
            return contextlib.nullcontext()
        return model.no_sync()

    def words(self, layout: Layout, placement: Placement, *, ranks: bool = False, after_forward: str = "") -> str:
        """'ddp' alone; HSDP's replicate dim is worded by the shard dim ('hsdp 2 x 4 (...)')."""
        return "ddp" if layout.placement("dp_shard") is None and placement.degree > 1 else ""

    def collective_seconds(self, layout: Layout, placement: Placement, links: Links, param_bytes: float,
                           grad_bytes: float, micro_batches: int) -> float:
        """DDP (no shard dim): one all-reduce of the gradients per step over every rank. HSDP: each rank's gradient
        shard (grad_bytes / S, S the shard dim's ranks) all-reduced across the replicate groups, over the network
        (a replicate group spans nodes)."""
        replicate = placement.degree
        if replicate <= 1:
            return 0.0
        shard = layout.placement("dp_shard")
        if shard is None:
            return ring_seconds("all_reduce", replicate, grad_bytes, links.bandwidth(layout, replicate))
        return ring_seconds("all_reduce", replicate, grad_bytes / shard.degree,
                            links.bandwidth(layout, replicate, contiguous=False))


    def export(self, framework: str, layout: Layout, placement: Placement, inputs: ExportInputs) -> ExportFragment:
        """DDP (no shard dim): the framework's DDP with ``gradient_as_bucket_view=True`` (Note [DDP's bucket
        views]), set where the framework takes it and a note saying how. Beside a shard dim (HSDP's replicate dim):
        torchtitan's replicate degree; DeepSpeed has no HSDP (a note says so); Lightning's and Accelerate's HSDP
        are options of their FSDP plugins, written by the shard dimension."""
        if layout.placement("dp_shard") is None:
            return _ddp_export(framework, placement, inputs)
        if framework == "torchtitan":
            return ExportFragment({"parallelism": {"data_parallel_replicate_degree": placement.degree}})
        if framework == "deepspeed" and placement.degree > 1:
            shard = layout.degree("dp_shard")
            return ExportFragment(unexpressed=(f"HSDP {placement.degree} x {shard}: DeepSpeed's nearest is MiCS "
                                               f"(mics_shard_size {shard}), not exported",))
        return ExportFragment()


def _bucket_note(gradient_bytes: int, how: str) -> str:
    return (f"DDP with gradient_as_bucket_view=True (the plan counts the gradients inside DDP's buckets; torch's "
            f"default keeps one more gradient-sized copy, {gradient_bytes:,} bytes per GPU at this plan's "
            f"peak): {how}")


def _ddp_export(framework: str, placement: Placement, inputs: ExportInputs) -> ExportFragment:
    """DDP over every rank, in ``framework``'s terms."""
    if framework == "hf":
        # TrainingArguments has no field for it: Trainer._build_accelerator_args builds DistributedDataParallelKwargs
        # from ddp_find_unused_parameters, ddp_bucket_cap_mb, ddp_broadcast_buffers and ddp_static_graph only
        return ExportFragment({"ddp_kwargs": dict(DDP_KWARGS)}, (_bucket_note(
            inputs.gradient_bytes, "TrainingArguments cannot set it; after building the Trainer, call "
                                   "autofit.integrations.hf.bucket_views(trainer) before trainer.train()"),))
    if framework == "lightning":  # lightning's DDPStrategy(**kwargs) passes them to DDP
        return ExportFragment({"trainer": {"strategy": "ddp"}, "ddp_strategy": dict(DDP_KWARGS)}, (_bucket_note(
            inputs.gradient_bytes, "pass Trainer(strategy=DDPStrategy(**ddp_strategy)); strategy='ddp' builds "
                                   "DDPStrategy() without it"),))
    if framework == "accelerate":
        # the config file has no DDP keyword: the Accelerator's handler
        return ExportFragment({"config_file": {"distributed_type": "MULTI_GPU"}, "ddp_kwargs": dict(DDP_KWARGS)},
                              (_bucket_note(inputs.gradient_bytes, "Accelerator(kwargs_handlers=["
                                                                   "DistributedDataParallelKwargs(**ddp_kwargs)], "
                                                                   "...)"),))
    if framework == "torchtitan":  # torchtitan replicates when the shard degree is 1
        return ExportFragment({"parallelism": {"data_parallel_replicate_degree": placement.degree}})
    return ExportFragment()  # DeepSpeed: ZeRO stage 0, the export's own default


REPLICATE = _Replicate(name="dp_replicate", mesh_rank=1, shares_rows=False, field="replicate")
