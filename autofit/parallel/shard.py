"""Sharding (FSDP2's ``fully_shard``): parameters, gradients and optimizer state split over the ranks of the shard
dim, each training other rows; its options are FSDP2's ``reshard_after_forward`` (ZeRO-3, ZeRO-2, or an int group to
reshard to) and the states on the host. Its degree is the ranks the other dimensions leave (torchtitan's
``dp_shard=-1``)."""

from __future__ import annotations

import contextlib
from fractions import Fraction
from typing import Any

from torch import nn

from autofit.core.errors import InvalidInputError
from autofit.parallel.collectives import Links, ring_seconds
from autofit.parallel.dimension import ApplyInputs, Dimension, Layout, Placement, StepKnobs
from autofit.parallel.exports import ExportFragment, ExportInputs, rank_count
from autofit.parallel.wrappers import apply_fsdp2, data_mesh, held_names, no_gradient_sync, sub_meshes

__all__ = ["SHARD", "reshard_choices"]

# torchtitan's JobConfig (torchtitan/config/job_config.py): Parallelism.fsdp_reshard_after_forward is "default",
# "always" or "never"; "default" reshards every block but the last
_TITAN_RESHARD = {True: "always", False: "never"}


def reshard_choices(reshard_after_forward: Any, world_size: int, per_node: int) -> tuple[bool | int, ...]:
    """What ``reshard_after_forward`` expands to over ``world_size`` ranks of ``per_node`` each: a value given is
    itself; "auto" is ZeRO-3 and ZeRO-2 and, across nodes, the reshard to one node's GPUs (the backward's all-gather
    within a node, over NVLink)."""
    if reshard_after_forward != "auto":
        return (reshard_after_forward,)
    if world_size // per_node > 1 and per_node > 1:
        return (True, False, per_node)
    return (True, False)


class _Shard(Dimension):
    def choices(self, space: Any):
        """One placement per ``reshard_after_forward`` the request allows, over the ranks the others leave."""
        return tuple(Placement(self.name, None, (("reshard_after_forward", raf),)) for raf in space.reshard_options)

    def check(self, layout: Layout) -> None:
        placement = layout.placement(self.name)
        if placement is None or layout.partial:
            return
        shard, raf = placement.degree, placement.option("reshard_after_forward", True)
        if not isinstance(raf, bool) and (raf <= 1 or raf >= shard or shard % raf):
            raise InvalidInputError(
                f"reshard_after_forward={raf} must be a divisor of the shard group size {shard} other than 1 and "
                f"{shard} (torch's fully_shard; use False for 1 and True for {shard}), e.g. the GPUs per node")

    def check_step(self, layout: Layout, placement: Placement, step: StepKnobs) -> None:
        """With the states on the host, the parameters stay as FSDP2 keeps them: fp32 shards."""
        if placement.option("offload_states", False) and step.precision.stored not in (None, "fp32"):
            raise InvalidInputError(
                f"offload_states with stored precision {step.precision.stored!r}: FSDP2 keeps fp32 sharded "
                "parameters on the host and gathers them in the compute dtype, so leave stored=None"
            )

    def state_ways(self, layout: Layout, placement: Placement) -> int:
        """Each rank keeps 1/S of its part of the parameters, gradients and optimizer state at rest."""
        return placement.degree

    def kept_gathered(self, layout: Layout, placement: Placement) -> Fraction:
        """From the end of forward to backward: ZeRO-3 nothing (FSDP2 reshards each unit after its forward),
        ZeRO-2 every parameter, an int reshard to k ranks its 1/k (torch's ``_get_post_forward_mesh_info``)."""
        raf = placement.option("reshard_after_forward", True)
        return Fraction(0) if raf is True else Fraction(1) if raf is False else Fraction(1, raf)

    def apply(self, model: nn.Module, layout: Layout, placement: Placement, inputs: ApplyInputs) -> nn.Module:
        """FSDP2's ``fully_shard`` on each unit, then the root, where it runs (:func:`_fully_shards`): over the
        data-parallel mesh dims, (dp_replicate, dp_shard) for HSDP, the "dp_shard" sub-mesh beside tensor
        parallel."""
        if not _fully_shards(layout, placement):
            return model
        tensor = layout.degree("tp")
        mesh = inputs.mesh if tensor == 1 else sub_meshes(inputs.mesh, tensor)[0]
        if tensor == 1 and set(inputs.mesh.mesh_dim_names) - {"dp_replicate", "dp_shard"}:
            mesh = data_mesh(inputs.mesh)  # the data-parallel dims of a mesh with others (a pipeline's "pp")
        # a pipeline rank shards the units its stages hold (apply.held_names), each stage a root of its own
        return apply_fsdp2(model, held_names(model, inputs.shard_units), mesh, inputs.param_dtype,
                           offload=placement.option("offload_states", False), pin_memory=inputs.pin_memory,
                           reshard_after_forward=placement.option("reshard_after_forward", True),
                           tensor_parallel=tensor > 1, roots=inputs.roots)

    def micro_batch_context(self, model: nn.Module, layout: Layout, placement: Placement, *, last: bool
                            ) -> contextlib.AbstractContextManager[Any]:
        """The reduce-scatter deferred to the window's last micro-batch (``set_requires_gradient_sync(False)``
        before it), except with the states on the host (Note [offload]: skipping it would keep a full set of
        unsharded gradients on the device) and with ``reduce_every_micro_batch`` (Note [gradient sync under
        accumulation], autofit/training/step.py)."""
        if last or placement.option("offload_states", False) or placement.option("reduce_every_micro_batch", False) \
                or not _fully_shards(layout, placement):
            return contextlib.nullcontext()
        return no_gradient_sync(model)

    def words(self, layout: Layout, placement: Placement, *, ranks: bool = False, after_forward: str = "") -> str:
        """'fsdp2 (ZeRO-3)', 'fsdp2 (ZeRO-2)', 'fsdp2 (resharded to 8)' (``ranks``: with ' over S ranks'), or HSDP
        with the replicate dim's degree, 'hsdp 2 x 4 (ZeRO-2)'; nothing where the other dimensions take every rank
        (tensor parallel, a pipeline: ``fully_shard`` does not run)."""
        shard = placement.degree
        if shard == 1 and layout.world_size > 1 and not _fully_shards(layout, placement):
            return ""
        raf = placement.option("reshard_after_forward", True)
        zero = "ZeRO-3" if raf is True else "ZeRO-2" if raf is False else f"resharded to {raf}{after_forward}"
        replicate = layout.degree("dp_replicate")
        if replicate > 1:
            return f"hsdp {replicate} x {shard} ({zero})"
        return f"fsdp2 ({zero})" + (f" over {rank_count(shard)}" if ranks else "")

    def collective_seconds(self, layout: Layout, placement: Placement, links: Links, param_bytes: float,
                           grad_bytes: float, micro_batches: int) -> float:
        """FSDP2 over its S ranks: an all-gather of the parameters in every micro-batch's forward; in backward
        another over S (ZeRO-3), none (ZeRO-2: they stayed gathered), or one over the smaller reshard group k (an
        int); one reduce-scatter of the gradients per step, or one per micro-batch with
        ``reduce_every_micro_batch``."""
        shard = placement.degree
        on_shard = links.bandwidth(layout, shard)
        seconds = micro_batches * ring_seconds("all_gather", shard, param_bytes, on_shard)
        raf = placement.option("reshard_after_forward", True)
        if raf is True:
            seconds += micro_batches * ring_seconds("all_gather", shard, param_bytes, on_shard)
        elif raf is not False:
            seconds += micro_batches * ring_seconds("all_gather", raf, param_bytes, links.bandwidth(layout, raf))
        reductions = micro_batches if placement.option("reduce_every_micro_batch", False) else 1
        seconds += reductions * ring_seconds("reduce_scatter", shard, grad_bytes, on_shard)
        return seconds


    def export(self, framework: str, layout: Layout, placement: Placement, inputs: ExportInputs) -> ExportFragment:
        """FSDP2 in ``framework``'s terms: its reshard, the states on the host, and (Lightning, Accelerate, whose
        FSDP plugins take it) HSDP's replicate degree; a note where the framework's nearest setting differs."""
        return _EXPORTS[framework](layout, placement, inputs)


def _fully_shards(layout: Layout, placement: Placement) -> bool:
    """``fully_shard`` runs: over more than one data-parallel rank (tensor parallel or a pipeline alone leave
    none), or on one process to keep the states on the host."""
    return layout.degree("dp_replicate") * placement.degree > 1 or placement.option("offload_states", False)


def _hf(layout: Layout, placement: Placement, inputs: ExportInputs) -> ExportFragment:
    # TrainingArguments(fsdp=True, fsdp_config={...}): FSDP2 through Accelerate; fsdp as a string ("full_shard")
    # is deprecated in transformers 5 (training_args.py, _translate_legacy_fsdp)
    raf = placement.option("reshard_after_forward", True)
    settings = {"training_arguments": {"fsdp": True, "fsdp_config": {
        "version": 2, "reshard_after_forward": raf if isinstance(raf, bool) else True,
        "cpu_offload": bool(placement.option("offload_states", False))}}}
    notes = ()
    if layout.world_size == 1:
        # Accelerate applies FSDP only in a process group (state.py: FSDP is set for MULTI_GPU, which needs
        # LOCAL_RANK): under plain `python` the Trainer runs without it, the states on the GPU
        notes = ("FSDP on one GPU (the states on the host) needs a launcher: accelerate launch "
                 "--num_processes 1 train.py or torchrun --nproc_per_node 1 train.py; under plain python the "
                 "Trainer runs without FSDP and keeps the states on the GPU",)
    return ExportFragment(settings, notes)


def _deepspeed(layout: Layout, placement: Placement, inputs: ExportInputs) -> ExportFragment:
    # ZeRO stage of the plan's sharding (DeepSpeed's config JSON documentation, "ZeRO Optimizations"): FSDP2 shards
    # parameters, gradients and optimizer state, which is stage 3 (DDP and one process: stage 0, the export's
    # default); states on the host are ZeRO-Offload of the parameters and the optimizer
    # ZeRO-2 (reshard_after_forward=False) is stage 2's communication; DeepSpeed's stage 2 keeps every parameter
    # whole for the whole step, FSDP2's only from forward to backward (a note says so)
    raf = placement.option("reshard_after_forward", True)
    zero: dict[str, Any] = {"stage": 2 if raf is False else 3}
    if placement.option("offload_states", False):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    notes = ()
    if raf is not True:
        notes = (f"reshard_after_forward={raf!r}: DeepSpeed's stage {zero['stage']} is the nearest; its memory "
                 "differs from the plan's (stage 2 holds whole parameters all step; an int group is ZeRO++'s "
                 "zero_hpz_partition_size)",)
    return ExportFragment({"zero_optimization": zero}, notes)


def _lightning(layout: Layout, placement: Placement, inputs: ExportInputs) -> ExportFragment:
    """``lightning.pytorch.strategies.FSDPStrategy`` keyword arguments (its docstring: ``sharding_strategy``
    "FULL_SHARD" / "SHARD_GRAD_OP" / "HYBRID_SHARD" / "_HYBRID_SHARD_ZERO2", ``device_mesh`` a tuple (replication
    size, sharding size), ``cpu_offload``). That strategy runs FSDP1; ``ModelParallelStrategy(data_parallel_size,
    tensor_parallel_size)`` runs FSDP2, applied by the user's ``configure_model``, which the notes spell out (the
    tensor dimension writes its size)."""
    raf = placement.option("reshard_after_forward", True)
    replicate = layout.degree("dp_replicate")
    units = inputs.shard_units
    notes = [f"ModelParallelStrategy (FSDP2): in configure_model call fully_shard(block, mesh=self.device_mesh"
             f"['data_parallel'], reshard_after_forward={raf!r}) on each of {', '.join(units[:2])}"
             f"{', ...' if len(units) > 2 else ''}, then on the model"]
    if replicate > 1:
        sharding = "HYBRID_SHARD" if raf is not False else "_HYBRID_SHARD_ZERO2"
    else:
        sharding = "SHARD_GRAD_OP" if raf is False else "FULL_SHARD"
    if not isinstance(raf, bool):
        notes.append(f"reshard_after_forward={raf} (reshard to groups of {raf}) has no FSDP1 sharding strategy: "
                     "FSDPStrategy gets FULL_SHARD (more all-gathers, less memory); ModelParallelStrategy with the "
                     "fully_shard call above runs the plan exactly")
    kwargs: dict[str, Any] = {"sharding_strategy": sharding,
                              "cpu_offload": placement.option("offload_states", False)}
    if replicate > 1:
        # a tuple: FSDPStrategy turns only a tuple into a DeviceMesh (setup_environment)
        kwargs["device_mesh"] = (replicate, layout.world_size // replicate)
    return ExportFragment({"trainer": {"strategy": "fsdp"},  # Lightning's name
                           "fsdp_strategy": kwargs,
                           "model_parallel_strategy": {"data_parallel_size": layout.data_ranks}}, tuple(notes))


def _accelerate(layout: Layout, placement: Placement, inputs: ExportInputs) -> ExportFragment:
    raf = placement.option("reshard_after_forward", True)
    replicate = layout.degree("dp_replicate")
    config: dict[str, Any] = {"distributed_type": "FSDP", "fsdp_config": {
        "fsdp_version": 2,
        # FSDP_RESHARD_AFTER_FORWARD is read as a bool for version 2 (FullyShardedDataParallelPlugin)
        "fsdp_reshard_after_forward": raf if isinstance(raf, bool) else True,
        "fsdp_offload_params": placement.option("offload_states", False),
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        # on when the plan recomputes: FSDP's switch recomputes every wrapped layer, at most the plan's memory
        # (following the file alone must not run out of memory); the plan's own modules are in the notes
        "fsdp_activation_checkpointing": inputs.recomputes,
    }}
    if replicate > 1:
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": replicate,
            "parallelism_config_dp_shard_size": layout.world_size // replicate,
        }
    notes = []
    if not isinstance(raf, bool):
        notes.append(f"reshard_after_forward={raf}: Accelerate's FSDP2 plugin takes a bool only; exported as "
                     "True (ZeRO-3: less memory, the backward all-gather over every shard rank)")
    units = inputs.shard_units
    notes.append("TRANSFORMER_BASED_WRAP wraps the model's _no_split_modules; the plan's FSDP2 units are "
                 + ", ".join(units[:3]) + (" ..." if len(units) > 3 else ""))
    return ExportFragment({"config_file": config}, tuple(notes))


def _torchtitan(layout: Layout, placement: Placement, inputs: ExportInputs) -> ExportFragment:
    raf = placement.option("reshard_after_forward", True)
    notes = ()
    if not isinstance(raf, bool):
        notes = (f"reshard_after_forward={raf} is not a torchtitan policy (default / always / never): "
                 "exported as 'always' (ZeRO-3)",)
    # mixed_precision_param is FSDP's parameter dtype, bfloat16 unless told: an fp32 plan says float32
    return ExportFragment({"parallelism": {"data_parallel_shard_degree": placement.degree,
                                           "fsdp_reshard_after_forward": _TITAN_RESHARD.get(raf, "always")},
                           "training": {"mixed_precision_param": "bfloat16" if inputs.precision == "bf16"
                                        else "float32"}}, notes)


_EXPORTS = {"hf": _hf, "deepspeed": _deepspeed, "lightning": _lightning, "accelerate": _accelerate,
            "torchtitan": _torchtitan}


SHARD = _Shard(name="dp_shard", mesh_rank=2, shares_rows=False, field="world_size")
