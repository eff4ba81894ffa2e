"""Data-parallel choices: which modules FSDP2 shards as units, and what the collectives cost per step.

Units follow FSDP2's documented practice (torchtitan's ``apply_fsdp``: one ``fully_shard`` per transformer block,
then the root): the children of the model's largest ``nn.ModuleList`` / ``nn.Sequential`` (by parameters) with at
least two parametrised children; failing that, every top-level child that holds parameters.

Collective time, ring algorithms (NCCL's documented bus bandwidth factors, "NCCL performance" docs): an all-reduce
moves 2 (N-1)/N of the buffer per rank, an all-gather or a reduce-scatter (N-1)/N. DDP all-reduces the gradients
once per optimizer step; FSDP2 all-gathers every unit's parameters in forward and again in backward for every
micro-batch (``reshard_after_forward=True``), and reduce-scatters the gradients once per optimizer step.
"""

from __future__ import annotations

from torch import nn

__all__ = ["shard_units", "collective_seconds"]


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def shard_units(model: nn.Module) -> tuple[str, ...]:
    best: tuple[int, tuple[str, ...]] = (0, ())
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and module is not model:
            children = [(f"{name}.{child}" if name else child, m) for child, m in module.named_children()]
            with_params = [n for n, m in children if _param_count(m) > 0]
            total = _param_count(module)
            if len(with_params) >= 2 and total > best[0]:
                best = (total, tuple(with_params))
    if best[1]:
        return best[1]
    return tuple(name for name, child in model.named_children() if _param_count(child) > 0)


def collective_seconds(strategy: str | None, world_size: int, param_bytes: int, grad_bytes: int,
                       micro_batches: int, bytes_per_second: float, *, reduce_every_micro_batch: bool = False) -> float:
    """Seconds of communication per optimizer step (no overlap with compute assumed: a ranking, not a forecast).
    ``reduce_every_micro_batch``: FSDP2 reduce-scatters after every micro-batch, not once per window (Note [gradient
    sync under accumulation], autofit/training/step.py)."""
    if strategy is None or world_size <= 1:
        return 0.0
    ring = (world_size - 1) / world_size
    if strategy == "ddp":
        return 2 * ring * grad_bytes / bytes_per_second
    gathers = 2 * micro_batches * ring * param_bytes  # forward and backward, every micro-batch
    reductions = micro_batches if reduce_every_micro_batch else 1
    return (gathers + reductions * ring * grad_bytes) / bytes_per_second
