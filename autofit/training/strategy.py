"""How a data-parallel strategy is applied to a model: shared by the simulation (on a fake process group) and the
distributed trainer, so both shard exactly alike (see docs/multi-gpu.md)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["apply_fsdp2"]


def apply_fsdp2(model: nn.Module, units: tuple[str, ...], mesh, precision_dtype: torch.dtype | None, *,
                offload: bool = False, pin_memory: bool = False) -> nn.Module:
    """``fully_shard`` each unit, then the root (FSDP2's recommended order: leaves before parents). ``offload``:
    FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer state in host memory; Note [offload])."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=precision_dtype, reduce_dtype=torch.float32) \
        if precision_dtype is not None else MixedPrecisionPolicy()
    offload_policy = CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy()
    for name in units:
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=policy, offload_policy=offload_policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload_policy)
    return model
