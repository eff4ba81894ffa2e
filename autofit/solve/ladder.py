"""The planner's ladder: the stages it climbs when the fastest configuration does not fit, as data.

Note [the ladder]
    Each rung saves memory at some cost the ones above it do not pay, so the planner tries them in order and stops at
    the first whose search finds a verified configuration (planner.py):
      1. the model's own dtype: on a GPU with precision="auto", the preferred low precision alone, then every allowed
         one (fp32 is analysed only when no low-precision configuration fits: the analysis is most of planning's
         cost); the last of these may step the optimizer in backward (Note [optimizer step in backward]), which
         changes no number of the update, before anything is stored lower;
      2. with FSDP2 over several ranks, every allowed precision again with the gradients reduce-scattered after
         every micro-batch (Note [gradient sync under accumulation]): more collectives, no unsharded gradients
         held across micro-batches. It changes no number of the update, so it comes before storing lower;
      3. each lower stored precision, one at a time and in order of risk (Note [stored precision]);
      4. the parameters, gradients and optimizer state in host memory (Note [offload]), where allowed: one GPU,
         offload="auto". Its estimates must also fit the host budget.
    A rung whose parameters, gradients and optimizer state alone exceed the budget is skipped without analysis, as
    long as a later rung may still fit: the rungs on the device skip when the host rung follows, and every rung
    but the last otherwise (the last is analysed anyway, to name the smallest budget). A new way to save memory is
    one more :class:`Stage` here, placed by its risk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from autofit.training.precision import PrecisionPolicy
from autofit.solve.sharding import shard_units
from autofit.training.stored import stored_bytes_per_parameter

if TYPE_CHECKING:  # the request is built after this stage in the import order; only its values are read here
    from autofit.request import Parallel, PlanRequest

__all__ = ["Stage", "ladder", "skipped_note", "states_bytes", "states_floor"]


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One rung of the ladder (Note [the ladder])."""

    what: str  # how the plan's notes name it: "the model's own dtype", "stored bf16", "the states on the host"
    policies: tuple[PrecisionPolicy, ...]  # the precisions analysed and searched, preferred first
    parallel: Parallel  # the layout: one process, DDP / FSDP2 over the ranks, or FSDP2 with the states on the host
    # the policies that may step the optimizer in backward when nothing fits with every gradient alive: one
    # process, no clipping, no GradScaler, no master copy; () where the optimizer steps after backward only
    in_backward: tuple[PrecisionPolicy, ...] = ()
    host_check: bool = False  # the states live on the host: a fitting estimate must fit the host budget too
    # parameters, gradients and optimizer state on one device, a floor of any step's peak; None: they are on the host
    floor_bytes: int | None = None
    skippable: bool = False  # a later rung may fit where this one cannot: skip it when its floor misses the budget

    def skipped(self, fit_bytes: int) -> bool:
        """Whether the rung is passed over without analysis under ``fit_bytes``: its states alone miss it."""
        return self.skippable and self.floor_bytes is not None and self.floor_bytes > fit_bytes


def ladder(request: PlanRequest, parallel: Parallel) -> tuple[Stage, ...]:
    """The rungs for ``request`` laid out as ``parallel``, in the order the planner climbs them (Note [the ladder]).
    Pure: reads the request's values (model parameters, precisions, optimizer, device), simulates nothing."""
    k = request.optimizer.state_values_per_parameter()
    stages = _precision_stages(request)
    host = _host_layout(request, parallel)
    own = len(stages) - len(request.stored_options) - 1  # the last rung in the model's own dtype
    layouts = [parallel] * len(stages)
    reducing = _reducing_layout(request, parallel)
    if reducing is not None:  # after the model's own dtype, before anything is stored lower
        stages.insert(own + 1, request.policies)
        layouts.insert(own + 1, reducing)
    rungs = []
    for i, (policies, layout) in enumerate(zip(stages, layouts)):
        what = f"stored {policies[0].stored}" if policies[0].stored else "the model's own dtype"
        rungs.append(Stage(
            what="FSDP2 reducing every micro-batch" if layout.reduce_every_micro_batch else what,
            policies=policies, parallel=layout,
            in_backward=_in_backward(request, layout, policies) if i == own else (),
            floor_bytes=states_bytes(request, layout, policies[0], k),
            skippable=host is not None or i < len(stages) - 1,
        ))
    if host is not None:
        rungs.append(Stage(what="the states on the host", policies=request.policies, parallel=host, host_check=True))
    return tuple(rungs)


def skipped_note(stage: Stage, skipped: list[str]) -> tuple[str, ...]:
    """The note of a plan found on ``stage`` after the rungs ``skipped`` (each named with its floor) were passed
    over; none when nothing was."""
    if not skipped:
        return ()
    listed = "; ".join(dict.fromkeys(skipped))
    if stage.parallel.offload_states:
        return ("nothing fits with the parameters, gradients and optimizer state on the GPU (" + listed + "): they "
                "live in host memory and the optimizer steps on the CPU (FSDP2 CPUOffloadPolicy, see docs/offload.md)",)
    return ("skipped without analysis, as their parameters, gradients and optimizer state alone miss the budget: "
            + listed,)


def states_floor(stages: tuple[Stage, ...]) -> int | None:
    """The smallest states floor over ``stages``, or None when a rung keeps the states on the host (no such floor
    bounds it)."""
    floors = [s.floor_bytes for s in stages]
    return None if None in floors else min(floors)


def states_bytes(request: PlanRequest, parallel: Parallel, policy: PrecisionPolicy, k: int) -> int:
    """Parameters, gradients and optimizer state (``k`` parameter-sized tensors per parameter) of ``policy``'s stored
    precision on one rank (FSDP2 shards them): a floor of any step's peak."""
    total = 0
    for p in request.model.parameters():
        if policy.stored is None or not p.is_floating_point():
            size = p.element_size()
            total += p.numel() * size * (2 + k)
        else:
            total += p.numel() * stored_bytes_per_parameter(policy.stored, k)
    return total // (parallel.world_size // parallel.replicate) if parallel.strategy == "fsdp2" else total


def _precision_stages(request: PlanRequest) -> list[tuple[PrecisionPolicy, ...]]:
    """The precisions of the rungs on the device: the model's own dtype, then each lower stored precision. At equal
    fit the higher stored precision wins (Note [stored precision])."""
    if request.device.kind == "cuda" and request.auto_precision and len(request.policies) > 1:
        stages = [request.policies[:1], request.policies]
    else:
        stages = [request.policies]
    return stages + [(p,) for p in request.stored_options]


def _host_layout(request: PlanRequest, parallel: Parallel) -> Parallel | None:
    """FSDP2's CPUOffloadPolicy on this one process (Note [offload]), or None where it does not apply: offload not
    allowed (or a CPU target), or a data-parallel plan (its own rungs)."""
    if not request.offload or parallel.strategy is not None or request.world_size != 1:
        return None
    return replace(parallel, strategy="fsdp2", world_size=1, shard_units=shard_units(request.model),
                   offload_states=True)


def _reducing_layout(request: PlanRequest, parallel: Parallel) -> Parallel | None:
    """FSDP2 reduce-scattering after every micro-batch (Note [gradient sync under accumulation], autofit/training/step.py), or
    None where it changes nothing: not FSDP2 over several ranks, the states on the host (which reduce every
    micro-batch already), or one row per rank (no accumulation possible)."""
    if parallel.strategy != "fsdp2" or parallel.world_size < 2 or parallel.offload_states or request.per_rank < 2:
        return None
    return replace(parallel, reduce_every_micro_batch=True)


def _in_backward(request: PlanRequest, parallel: Parallel,
                 policies: tuple[PrecisionPolicy, ...]) -> tuple[PrecisionPolicy, ...]:
    """The policies that may step the optimizer in backward (Note [optimizer step in backward])."""
    if parallel.strategy is not None or request.clip_grad_norm is not None:
        return ()
    return tuple(p for p in policies if not p.needs_grad_scaler and not str(p.stored).endswith("-master"))
