"""The one layout of a step that ``estimate`` and ``measure`` describe, from the user's ``autofit.Layout`` and the
step's knobs that place states (``Step.offload_states``, ``Step.reduce_every_micro_batch``).

``plan`` enumerates layouts (``enumerate_layouts``, autofit/parallel/dimension.py); a step has one, so its "auto"
values read as the plain layout (ZeRO-3 without replication) and the planner's own choices are refused. This is the
only place that turns the user's layout fields into the :class:`~autofit.parallel.layout.Parallel` of a step: the
rules are the layout's (:func:`~autofit.parallel.layout.check_layout`, each dimension's ``check``), run before any
module is resolved or anything simulated, so that a bad layout is named first (docs/multi-gpu.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from autofit.core.errors import InvalidInputError, require_int
from autofit.parallel.layout import Parallel, Strategy, as_strategy, check_layout
from autofit.parallel.sequence_parallel import require_sequence_split
from autofit.parallel.tensor_parallel import resolve_tensor_plan

__all__ = ["one_layout", "step_layout", "estimate_notes"]


def one_layout(layout: Any, function: str) -> Any:
    """``layout`` (the user's ``autofit.Layout``: options.py stands above this layer, so its fields are read, not its
    type imported) as one step lays it out: ``reshard_after_forward="auto"`` is ZeRO-3 and ``replicate="auto"`` no
    replication; ``tensor_parallel="auto"`` is refused, naming ``function``, because a step has one degree."""
    if layout.tensor_parallel == "auto":
        raise InvalidInputError(f"{function}: tensor_parallel='auto' is the planner's choice; a step has one "
                                "degree: give Layout(tensor_parallel=T)")
    reshard = True if layout.reshard_after_forward == "auto" else layout.reshard_after_forward
    return dataclasses.replace(layout, reshard_after_forward=reshard,
                               replicate=1 if layout.replicate == "auto" else layout.replicate)


def step_layout(model: nn.Module, layout: Any, step: Any, *, tensors: Iterable[torch.Tensor],
                shard_units: tuple[str, ...]) -> Parallel:
    """The :class:`Parallel` of one step: ``layout`` as :func:`one_layout` made it; of ``step`` (the user's
    ``autofit.Step``) the knobs that place states: ``offload_states`` (FSDP2's CPUOffloadPolicy on one process,
    sharding the planner's units: Note [offload]) and ``reduce_every_micro_batch``; ``tensors`` (the sample's, which
    sequence parallel must split evenly) and ``shard_units`` (the modules FSDP2 shards as units, as ``plan`` shards
    them: ``autofit.solve.sharding.shard_units``; unused without sharding)."""
    world_size, tensor_parallel = layout.world_size, layout.tensor_parallel
    offload_states, reduce_every_micro_batch = step.offload_states, step.reduce_every_micro_batch
    require_int("world_size", world_size)
    strategy = as_strategy(layout.strategy)  # the user's string, read once: its properties from here on
    sharded = strategy is not None and strategy.shards_parameters
    if world_size > 1 and strategy is None:
        raise InvalidInputError(f"world_size={world_size} needs strategy='ddp' or 'fsdp2': an estimate describes one "
                                "layout (plan() chooses between them)")
    if strategy is not None and world_size == 1 and not (sharded and offload_states):
        raise InvalidInputError(f"strategy={strategy!r} needs world_size > 1 (the number of processes)")
    if offload_states:
        strategy, sharded = Strategy.FSDP2, True
    check_layout(strategy, world_size, reshard_after_forward=layout.reshard_after_forward, replicate=layout.replicate,
                 tensor_parallel=tensor_parallel, offload_states=offload_states)
    if layout.tensor_parallel_plan is not None and tensor_parallel == 1:
        raise InvalidInputError("tensor_parallel_plan is given but tensor_parallel is 1: pass tensor_parallel=T, the "
                                "number of ranks that split each layer")
    tensor_plan = resolve_tensor_plan(model, tensor_parallel, layout.tensor_parallel_plan)
    require_sequence_split(tensor_plan, tensor_parallel, tensors, "the sample")
    return Parallel(strategy=strategy, world_size=world_size, shard_units=shard_units if sharded else (),
                    offload_states=bool(offload_states), reduce_every_micro_batch=bool(reduce_every_micro_batch),
                    reshard_after_forward=layout.reshard_after_forward, replicate=layout.replicate,
                    tensor_parallel=tensor_parallel, tensor_plan=tuple(tensor_plan))


def estimate_notes(layout: Parallel, gradient_as_bucket_view: bool) -> tuple[str, ...]:
    """What an estimate of a step laid out as ``layout`` says it assumed of the layout: under DDP, which bucket mode
    (Note [DDP's bucket views], autofit/parallel/simulated.py; ``Step.gradient_as_bucket_view``)."""
    if not layout.replicates_parameters:
        return ()
    if gradient_as_bucket_view:
        return ("DDP with gradient_as_bucket_view=True (as autofit's trainer wraps it): every gradient is a view into "
                "the communication buckets; with torch's default (False: Lightning's DDPStrategy, Hugging Face's "
                "Trainer and Accelerate unless set) the buckets hold one more gradient-sized copy",)
    return ("DDP with gradient_as_bucket_view=False (torch's default): the gradients live apart from the "
            "communication buckets, which hold a second gradient-sized copy",)
