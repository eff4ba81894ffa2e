"""A verified choice of the solve stage made into a :class:`~autofit.emit.plan.Plan`: its knobs, its estimate, its
memory/time front, and what selective recomputation bought against module-level recomputation."""

from __future__ import annotations

from dataclasses import replace

from autofit.core.report import MemoryEstimate
from autofit.emit.plan import Alternative, Plan
from autofit.solve.search import Candidate, pareto_front
from autofit.training.chunked_loss import LossChunks
from autofit.training.precision import PrecisionPolicy

__all__ = ["assemble_plan", "selective_note"]


def assemble_plan(chosen: Candidate, est: MemoryEstimate, fitting: tuple[Candidate, ...], *, budget_bytes: int,
                  batch_size: int, world_size: int, strategy: str | None, policy: PrecisionPolicy, device: str,
                  gpu: str | None, optimizer: str, notes: tuple[str, ...], shard_units: tuple[str, ...],
                  clip_grad_norm: float | None = None, host_budget_bytes: int | None = None,
                  margin_bytes: int = 0, reduce_every_micro_batch: bool = False,
                  reshard_after_forward: bool | int = True, replicate: int = 1, gpus_per_node: int = 0,
                  chunked_loss: LossChunks | None = None, low_bit_optimizer: str | None = None,
                  tensor_parallel: int = 1, tensor_plan: tuple[tuple[str, str], ...] = (),
                  compile: bool = False) -> Plan:
    """The Plan of a verified choice; ``fitting`` (configurations that fit the models) gives its memory/time front."""
    front = tuple(
        Alternative(precision=c.precision, micro_batch_size=c.micro_batch_size,
                    gradient_accumulation_steps=c.accumulation_steps, checkpoint=c.checkpoint,
                    peak_bytes=c.peak_bytes, step_seconds=c.seconds, selective=c.selective)
        for c in pareto_front(list(fitting))
    )
    return Plan(
        micro_batch_size=chosen.micro_batch_size, gradient_accumulation_steps=chosen.accumulation_steps,
        batch_size=batch_size, last_micro_batch_size=chosen.last_micro_batch_size, precision=policy,
        checkpoint=chosen.checkpoint, peak_bytes=est.peak_bytes, device_bytes=est.device_bytes,
        budget_bytes=budget_bytes, device=device, optimizer=optimizer, predicted_step_seconds=chosen.seconds,
        estimate=replace(est, under=None), world_size=world_size, strategy=strategy, gpu=gpu, frontier=front,
        notes=tuple(dict.fromkeys(notes)), shard_units=shard_units, clip_grad_norm=clip_grad_norm,
        optimizer_in_backward=chosen.in_backward, offload=chosen.offload, offload_states=chosen.offload_states,
        host_budget_bytes=host_budget_bytes if (chosen.offload or chosen.offload_states) else None,
        peak_reserved_bytes=est.peak_reserved_bytes, margin_bytes=margin_bytes,
        reduce_every_micro_batch=reduce_every_micro_batch and chosen.accumulation_steps > 1,
        reshard_after_forward=reshard_after_forward, replicate=replicate, gpus_per_node=gpus_per_node,
        selective=chosen.selective,
        chunked_loss=chunked_loss, low_bit_optimizer=low_bit_optimizer,
        tensor_parallel=tensor_parallel, tensor_plan=tensor_plan, compile=compile,
    )


def selective_note(plan: Plan, versus: Candidate) -> str:
    """What selective recomputation bought, against the best plan recomputing whole modules only."""
    return (f"selective recomputation of {len(plan.selective)} modules (matmul and attention outputs kept, the rest "
            f"rerun): predicted step {plan.predicted_step_seconds:.3g} s; recomputing whole modules only, the best "
            f"under this budget is {versus.seconds:.3g} s (micro-batch {versus.micro_batch_size}, "
            f"{len(versus.checkpoint)} modules)")
