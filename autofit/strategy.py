"""How a data-parallel strategy is applied to a model: shared by the simulation (on a fake process group) and the
distributed trainer, so both shard exactly alike (see docs/multi-gpu.md)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["apply_fsdp2"]


def apply_fsdp2(model: nn.Module, units: tuple[str, ...], mesh, precision_dtype: torch.dtype | None) -> nn.Module:
    """``fully_shard`` each unit, then the root (FSDP2's recommended order: leaves before parents)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=precision_dtype, reduce_dtype=torch.float32) \
        if precision_dtype is not None else MixedPrecisionPolicy()
    for name in units:
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
