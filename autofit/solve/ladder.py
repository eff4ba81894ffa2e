"""The planner's ladder: the stages it climbs when the fastest configuration does not fit, as data.

Note [the ladder]
    Each rung saves memory at some cost the ones above it do not pay, so the planner tries them in order and stops at
    the first whose search finds a verified configuration (autofit/planning/climb.py):
      1. the model's own dtype: on a GPU with precision="auto", the preferred low precision alone, then every allowed
         one (fp32 is analysed only when no low-precision configuration fits: the analysis is most of planning's
         cost); the last of these may step the optimizer in backward (Note [optimizer step in backward]), which
         changes no number of the update, before anything is stored lower;
      2. with FSDP2 over several ranks, every allowed precision again with the gradients reduce-scattered after
         every micro-batch (Note [gradient sync under accumulation]): more collectives, no unsharded gradients
         held across micro-batches. It changes no number of the update, so it comes before storing lower;
      3. each lower stored precision, one at a time and in order of risk (Note [stored precision]);
      4. the rungs that change numerics, each only where ``plan(allow=...)`` names it, cumulative, in the precisions
         of the last rung above (the lowest stored precision allowed), the optimizer free to step in backward:
         one rung per step feature allowed, in the registry's order (autofit/features/__init__.py, Note [step
         features]): "chunked-loss", the output head and the cross-entropy in chunks of tokens (Note [chunked
         cross-entropy]; float rounding only, so first), then "8bit-optimizer", AdamW's moments in 8 bits (Note
         [8-bit optimizer state]). They come before the host rung, whose optimizer steps on the CPU, much the
         slowest, and a user who allows them asked for them;
      5. the parameters, gradients and optimizer state in host memory (Note [offload]), where allowed
         (offload="auto", a GPU target): FSDP2's CPUOffloadPolicy on one process, or on every rank of an FSDP2
         layout without tensor parallel. Its estimates must also fit the host budget, which the ranks of one node
         share: a rank's host bytes times the ranks per node.
    A rung whose parameters, gradients and optimizer state alone (and what an FSDP2 layout keeps gathered between
    forward and backward: ZeRO-2 every parameter, an int reshard its group's share) exceed the budget is skipped
    without analysis, as long as a later rung may still fit: the rungs on the device skip when the host rung follows, and every rung
    but the last otherwise (the last is analysed anyway, to name the smallest budget). A new way to save memory is
    one more :class:`Stage` here, placed by its risk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from autofit.features import OPT_IN, OptInFeature
from autofit.training.precision import PrecisionPolicy
from autofit.training.precision import stored_dtype
from autofit.parallel.choices import shard_units
from autofit.parallel.wrappers import bitsandbytes_parameters
from autofit.parallel.rungs import ladder_rungs, one_process_features
from autofit.parallel.step_memory import (deferred_floor_bytes, gathered_bytes, gpus_for_states_bytes,
                                          host_states_note, rank_states_bytes, rung_what)
from autofit.training.stored import stored_bytes_per_parameter

if TYPE_CHECKING:  # the request is built after this stage in the import order; only its values are read here
    from autofit.request import PlanRequest
    from autofit.parallel.layout import Parallel

__all__ = ["Stage", "gpus_for_states", "ladder", "skipped_note", "states_bytes", "states_floor"]


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One rung of the ladder (Note [the ladder])."""

    what: str  # how the plan's notes name it: "the model's own dtype", "stored bf16", "the states on the host"
    policies: tuple[PrecisionPolicy, ...]  # the precisions analysed and searched, preferred first
    parallel: Parallel  # the layout: one process, DDP / FSDP2 over the ranks, or FSDP2 with the states on the host
    # the policies that may step the optimizer in backward when nothing fits with every gradient alive: one
    # process, no clipping, no GradScaler, no master copy; () where the optimizer steps after backward only
    in_backward: tuple[PrecisionPolicy, ...] = ()
    # a floor of any step's peak on this rung: the parameters, gradients and optimizer state on one device; with
    # the states on the host, what the layout keeps gathered (ZeRO-2, an int reshard); None: no floor (ZeRO-3)
    floor_bytes: int | None = None
    skippable: bool = False  # a later rung may fit where this one cannot: skip it when its floor misses the budget
    # on a rung that defers FSDP2's reduce-scatter, ahead of the rung that reduces every micro-batch: the floor with
    # the unsharded gradients it holds across micro-batches; over the budget, the rung is skipped (Note [a deferral
    # that cannot fit]). None elsewhere
    accumulating_floor: int | None = None
    # the step features (plan(allow=...)) in force on this rung, each with its value, in registry order (Note [step
    # features]); (): the user's loss and optimizer
    features: tuple[tuple[OptInFeature, Any], ...] = ()
    # the rung whose layout keeps the states on the host (the last: the layout's ``ladder_rungs``): a fitting estimate
    # must fit the host budget too
    host_check: bool = False

    @property
    def opt_in(self) -> tuple[str, ...]:
        """The names of the opt-in rungs in force here, as ``plan(allow=...)`` gives them."""
        return tuple(feature.name for feature, _ in self.features)

    def request_for(self, request: PlanRequest) -> PlanRequest:
        """``request`` as this rung runs it: each feature in force applied (the chunked loss, the optimizer's twin)."""
        for feature, value in self.features:
            request = feature.request_for(request, value)
        return request

    def skipped(self, fit_bytes: int) -> bool:
        """Whether the rung is passed over without analysis under ``fit_bytes``: its states alone miss it, or it
        defers a reduce-scatter whose unsharded gradients miss it (Note [a deferral that cannot fit])."""
        if self.deferral_misses(fit_bytes):
            return True
        return self.skippable and self.floor_bytes is not None and self.floor_bytes > fit_bytes

    def deferral_misses(self, fit_bytes: int) -> bool:
        """Whether the states and the unsharded gradients a deferring rung holds miss ``fit_bytes``."""
        return self.accumulating_floor is not None and self.accumulating_floor > fit_bytes


def ladder(request: PlanRequest, parallel: Parallel) -> tuple[Stage, ...]:
    """The rungs for ``request`` laid out as ``parallel``, in the order the planner climbs them (Note [the ladder]).
    Pure: reads the request's values (model parameters, precisions, optimizer, device), simulates nothing."""
    k = request.optimizer.state_values_per_parameter()
    stages = _precision_stages(request)
    reducing, host = _layout_rungs(request, parallel)
    own = len(stages) - len(request.stored_options) - 1  # the last rung in the model's own dtype
    layouts = [parallel] * len(stages)
    if reducing is not None:  # after the model's own dtype, before anything is stored lower
        stages.insert(own + 1, request.policies)
        layouts.insert(own + 1, reducing)
    rungs = []
    for i, (policies, layout) in enumerate(zip(stages, layouts)):
        what = f"stored {policies[0].stored}" if policies[0].stored else "the model's own dtype"
        rungs.append(Stage(
            what=rung_what(layout, what),
            policies=policies, parallel=layout,
            in_backward=_in_backward(request, layout, policies) if i == own else (),
            floor_bytes=states_bytes(request, layout, policies[0], k) + _gathered_bytes(request, layout, policies),
        ))
    if reducing is not None:  # the layout defers: Note [a deferral that cannot fit]
        rungs[:own + 1] = [replace(r, accumulating_floor=r.floor_bytes + _deferred_gradients_floor(request, r))
                           for r in rungs[:own + 1]]
    rungs += _opt_in(request, parallel, stages[-1], k)
    rungs = [replace(r, skippable=host is not None or i < len(rungs) - 1) for i, r in enumerate(rungs)]
    if host is not None:
        gathered = _gathered_bytes(request, host, request.policies)
        # skipped when what its layout keeps gathered misses the budget; ZeRO-3 has no floor and is always searched
        rungs.append(Stage(what="the states on the host", policies=request.policies, parallel=host,
                           floor_bytes=gathered or None, skippable=bool(gathered), host_check=True))
    return tuple(rungs)


def _opt_in(request: PlanRequest, parallel: Parallel, policies: tuple[PrecisionPolicy, ...], k: int) -> list[Stage]:
    """The rungs ``plan(allow=...)`` opened, one per step feature allowed, cumulative in the registry's order (Note
    [the ladder], Note [step features]); the optimizer may step in backward on each. One process only: the
    distributed trainers build none of them."""
    if not one_process_features(parallel):
        return []
    rungs, in_force, state_bytes = [], [], None
    in_backward = _in_backward(request, parallel, policies)
    for feature in OPT_IN:
        value = feature.allowed(request)
        if value is None or feature.for_speed:  # a speed rung is the planner's (Note [speed rungs], planner.py)
            continue
        in_force.append((feature, value))
        state_bytes = feature.state_bytes if feature.state_bytes is not None else state_bytes
        rungs.append(Stage(what=feature.rung_what(value), policies=policies, parallel=parallel,
                           in_backward=in_backward, features=tuple(in_force),
                           floor_bytes=_opt_in_floor(request, parallel, policies[0], in_backward, state_bytes, k)))
    return rungs


def _opt_in_floor(request: PlanRequest, parallel: Parallel, policy: PrecisionPolicy,
                  in_backward: tuple[PrecisionPolicy, ...], state_bytes: int | None, k: int) -> int:
    """A floor of an opt-in rung's peak: the parameters in ``policy``'s stored precision, the optimizer state
    (``k`` values per trainable parameter of ``state_bytes`` each; None: the stored dtype's, or the parameter's),
    the fp32 master copy if any, and the gradients unless the optimizer may step in backward, which frees each as
    it goes."""
    total = 0
    for p in request.model.parameters():
        low = p.element_size() if policy.stored is None or not p.is_floating_point() else (
            stored_dtype(policy.stored).itemsize)
        total += p.numel() * low
        if p.requires_grad:
            master = 4 if str(policy.stored).endswith("-master") else 0
            state = k * (state_bytes if state_bytes is not None else (4 if master else low))
            total += p.numel() * (state + master + (0 if policy in in_backward else low))
    return rank_states_bytes(parallel, total)


def skipped_note(stage: Stage, skipped: Sequence[str]) -> tuple[str, ...]:
    """The note of a plan found on ``stage`` after the rungs ``skipped`` (each named with its floor) were passed
    over; none when nothing was."""
    if not skipped:
        return ()
    listed = "; ".join(dict.fromkeys(skipped))
    host = host_states_note(stage.parallel, listed)  # the layout's words where it keeps the states on the host
    if host is not None:
        return (host,)
    return ("skipped without analysis, as their parameters, gradients and optimizer state alone miss the budget: "
            + listed,)


def states_floor(stages: tuple[Stage, ...]) -> int | None:
    """The smallest floor over ``stages``, or None when a rung has none (ZeRO-3 with the states on the host)."""
    floors = [s.floor_bytes for s in stages]
    return None if None in floors else min(floors)


def gpus_for_states(request: PlanRequest, stages: Sequence[Stage]) -> int | None:
    """The fewest GPUs of a multi-GPU job whose share of the states would fit each GPU on some rung of ``stages``
    that keeps them there: each rung's floor is its sharded states (``states_bytes``, the whole over the shard group)
    plus what its layout keeps gathered, which more ranks do not divide; more replicas and tensor parallel stay as
    they are. A floor (Note [ruled out by arithmetic]): with fewer, the states need the host; with that many, the
    activations may still not fit. None: one process, or no rung where more ranks would do."""
    k = request.optimizer.state_values_per_parameter()
    best = None
    for stage in stages:
        if stage.host_check:
            continue
        gpus = gpus_for_states_bytes(
            stage.parallel, lambda s=stage: states_bytes(request, s.parallel, s.policies[0], k),
            lambda s=stage: request.fit_bytes - _gathered_bytes(request, s.parallel, s.policies))
        if gpus is None:  # one process, DDP, or no room beside what the layout keeps gathered
            continue
        best = gpus if best is None else min(best, gpus)
    return best


def states_bytes(request: PlanRequest, parallel: Parallel, policy: PrecisionPolicy, k: int) -> int:
    """Parameters, gradients and optimizer state (``k`` parameter-sized tensors per parameter) of ``policy``'s stored
    precision on one rank (FSDP2 shards them): a floor of any step's peak."""
    total = 0
    for p in request.model.parameters():
        if not p.requires_grad:  # frozen (LoRA's base weights): no gradient, no optimizer state
            total += p.numel() * (p.element_size() if policy.stored is None or not p.is_floating_point()
                                  else stored_dtype(policy.stored).itemsize)
        elif policy.stored is None or not p.is_floating_point():
            size = p.element_size()
            total += p.numel() * size * (2 + k)
        else:
            total += p.numel() * stored_bytes_per_parameter(policy.stored, k)
    return rank_states_bytes(parallel, total)


def _precision_stages(request: PlanRequest) -> list[tuple[PrecisionPolicy, ...]]:
    """The precisions of the rungs on the device: the model's own dtype, then each lower stored precision. At equal
    fit the higher stored precision wins (Note [stored precision])."""
    if request.device.precision_rungs and request.auto_precision and len(request.policies) > 1:
        stages = [request.policies[:1], request.policies]
    else:
        stages = [request.policies]
    return stages + [(p,) for p in request.stored_options]


def _layout_rungs(request: PlanRequest, parallel: Parallel) -> tuple[Parallel | None, Parallel | None]:
    """The layouts of ``parallel``'s own rungs, each None where it has none (the layout's ``ladder_rungs``):

    - FSDP2 reduce-scattering after every micro-batch (Note [gradient sync under accumulation],
      autofit/training/step.py); none where it changes nothing: a layout that defers no reduce-scatter
      (``Parallel.defers_gradients``: no FSDP2 over data ranks, tensor parallel over every rank included, whose step
      has no reduce-scatter to move; the states on the host, which reduce every micro-batch already), or one row per
      rank (no accumulation possible);
    - FSDP2's CPUOffloadPolicy (Note [offload]): on this one process, or on each rank of an FSDP2 layout, each rank
      keeping its shard of the states in its node's host memory; none where it does not apply: offload not allowed
      (or a CPU target), DDP (which keeps whole replicas), tensor parallel (refused with offload, StepConfig), a model
      with bitsandbytes quantized weights (QLoRA: FSDP2 drops their quantization state, parallel/apply.py). One
      process is planned only where the request has one rank (``PlanRequest.strategies``)."""
    allowed = request.offload and not bitsandbytes_parameters(request.model)  # (apply_fsdp2 says why)
    return ladder_rungs(parallel, request.per_rank, allowed, lambda: shard_units(request.model))


def _gathered_bytes(request: PlanRequest, parallel: Parallel, policies: tuple[PrecisionPolicy, ...]) -> int:
    """What the layout keeps gathered between forward and backward at the end of forward, every parameter in the
    lowest compute precision of ``policies`` (FSDP2's MixedPrecisionPolicy gathers in it): the layout's
    ``kept_gathered`` share of the model (Note [a dimension's share of memory], autofit/parallel/dimension.py:
    ZeRO-2 all of a rank's tensor-parallel share, an int reshard its group's part, ZeRO-3 and DDP nothing). Part
    of every floor of the layout, on top of the sharded states (or alone, with them on the host)."""
    def whole() -> int:  # the model in the gathering precision: counted only where the layout keeps a share
        low = min(p.dtype.itemsize for p in policies)
        return sum(p.numel() * (low if p.is_floating_point() else p.element_size())
                   for p in request.model.parameters())
    return gathered_bytes(parallel, whole)


# Note [a deferral that cannot fit]
#     With FSDP2 over several ranks the rungs in the model's own dtype defer the gradients' reduce-scatter to the
#     last micro-batch, and the rung after them reduces every micro-batch, in the same precisions or more (Note
#     [gradient sync under accumulation], autofit/training/step.py). A deferring step that accumulates holds every
#     trained parameter's gradient unsharded until its last backward (Note [deferred reduce-scatter],
#     solve/terms.py): with the sharded states, a floor of its peak. Where that floor misses the budget, the rung can
#     fit only without accumulation, one micro-batch of every row, where deferring and reducing are one step, the
#     same bytes and the same collectives; the reducing rung searches that step too. So the rung is skipped without
#     its analysis and search, and the plan's notes name it with the floor. The 405B plan of issue 56 (ZeRO-3 x TP
#     2 to 8 over 512 H100s): 189 to 754 GiB of unsharded gradients against a 72 GB budget, two rungs analysed and
#     searched per layout before this, about 13 s each on two cores, to find nothing.
def _deferred_gradients_floor(request: PlanRequest, stage: Stage) -> int:
    """What a rung that defers FSDP2's reduce-scatter adds at least to its states floor when it accumulates: the
    unsharded gradients one rank holds (``deferred_gradient_bytes``, solve/terms.py: every trained parameter's
    gradient, here divided by the ways the layout splits the model, tensor parallel's degree, though only the split
    layers are (Note [a dimension's share of memory]), in the reduce dtype of
    the rung's cheapest policy, fp32 under autocast, else the parameter's own), less the sharded gradients the
    floor counts already (which a step that set them to None does not hold meanwhile)."""
    unsharded = sharded = 0
    for p in request.model.parameters():
        if p.requires_grad:
            unsharded += p.numel() * min(4 if policy.autocast else p.element_size() for policy in stage.policies)
            sharded += p.numel() * p.element_size()
    return deferred_floor_bytes(stage.parallel, unsharded, sharded)


def _in_backward(request: PlanRequest, parallel: Parallel,
                 policies: tuple[PrecisionPolicy, ...]) -> tuple[PrecisionPolicy, ...]:
    """The policies that may step the optimizer in backward (Note [optimizer step in backward])."""
    if not one_process_features(parallel) or request.clip_grad_norm is not None:
        return ()
    return tuple(p for p in policies if not p.needs_grad_scaler and not str(p.stored).endswith("-master"))
