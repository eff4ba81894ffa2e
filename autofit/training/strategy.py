"""How a data-parallel strategy is applied to a model: shared by the simulation (on a fake process group) and the
distributed trainer, so both shard exactly alike (see docs/multi-gpu.md)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from autofit.core._torch import unset_fake_temporarily

__all__ = ["apply_fsdp2", "mesh_shape"]


def apply_fsdp2(model: nn.Module, units: tuple[str, ...], mesh, precision_dtype: torch.dtype | None, *,
                offload: bool = False, pin_memory: bool = False,
                reshard_after_forward: bool | int = True) -> nn.Module:
    """``fully_shard`` each unit, then the root (FSDP2's recommended order: leaves before parents). ``offload``:
    FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer state in host memory; Note [offload]).
    ``reshard_after_forward`` applies to the units (True: ZeRO-3, False: ZeRO-2, an int: reshard to groups of that
    size); the root keeps torch's default, which does not reshard it (``FSDPState._lazy_init``: backward needs it at
    once), as torchtitan's ``apply_fsdp`` does. ``mesh`` is 1-D (FSDP) or 2-D (replicate, shard): HSDP."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=precision_dtype, reduce_dtype=torch.float32) \
        if precision_dtype is not None else MixedPrecisionPolicy()
    offload_policy = CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy()
    # an int builds the smaller post-forward mesh from the mesh's rank tensor (``_get_post_forward_mesh_info`` calls
    # ``tolist()``): under a simulation's fake mode that tensor must be read for real. The parameters stay fake: a
    # fake tensor dispatches to its own mode whether or not one is active.
    grouped = not isinstance(reshard_after_forward, bool)
    for name in units:
        with unset_fake_temporarily() if grouped else contextlib.nullcontext():
            fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=policy, offload_policy=offload_policy,
                        reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload_policy)
    return model


def mesh_shape(world_size: int, replicate: int = 1) -> tuple[int, ...]:
    """The device mesh of a layout: ``(world_size,)`` for FSDP and DDP, ``(replicate, world_size // replicate)`` for
    HSDP (FSDP2 shards over the last dim and replicates over the first: ``fully_shard``'s docstring)."""
    return (world_size,) if replicate == 1 else (replicate, world_size // replicate)
