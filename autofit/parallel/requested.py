"""What the user's layout options ask for: the one layout of a step that ``estimate`` and ``measure`` describe, and
the layouts a ``plan`` may choose among (the request's), from the user's ``autofit.Layout`` (options.py stands above
this layer, so its fields are read, not its type imported) and the step's knobs that place states
(``Step.offload_states``, ``Step.reduce_every_micro_batch``). Beyond this, only a dimension reads the user's
``Layout``, for its own options (``Dimension.choices``: tensor parallel's plan).

``plan`` enumerates layouts (``enumerate_layouts``, autofit/parallel/dimension.py) over the choices
:func:`planned_layouts` expands "auto" to; a step has one layout, so :func:`one_layout` reads its "auto" values as the
plain layout (ZeRO-3 without replication) and refuses the planner's own choices. Either way the layout's rules
(:func:`~autofit.parallel.layout.check_layout`, each dimension's ``check``) run here, before any module is resolved
or anything simulated, so that a bad layout is named first (docs/multi-gpu.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from autofit.core.errors import InvalidInputError, require_int
from autofit.parallel.choices import shard_units
from autofit.parallel.dimension import Placement
from autofit.parallel.layout import Parallel, Strategy, as_strategy, check_layout, further_dimensions
from autofit.parallel.replicate import replicate_choices
from autofit.parallel.sequence_parallel import require_sequence_split
from autofit.parallel.shard import reshard_choices
from autofit.parallel.tensor_parallel import resolve_tensor_plan

__all__ = ["one_layout", "step_layout", "estimate_notes", "planned_layouts", "fsdp2_layouts", "tensor_options",
           "TENSOR_DEGREES"]


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


def step_layout(model: nn.Module, layout: Any, step: Any, tensors: Iterable[torch.Tensor]) -> Parallel:
    """The :class:`Parallel` of one step: ``layout`` as :func:`one_layout` made it; of ``step`` (the user's
    ``autofit.Step``) the knobs that place states: ``offload_states`` (FSDP2's CPUOffloadPolicy on one process,
    sharding the planner's units: Note [offload]) and ``reduce_every_micro_batch``; ``tensors`` (the sample's, which
    sequence parallel must split evenly). FSDP2 shards the units ``plan`` shards (:func:`shard_units`)."""
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
    space = _StepSpace(model=model, world_size=world_size, gpus_per_node=layout.gpus_per_node or 0,
                       reshard_options=(layout.reshard_after_forward,), replicate_options=(layout.replicate,),
                       tensor_options=(tensor_parallel,), layout_options=layout, clip_grad_norm=step.clip_grad_norm)
    return Parallel(strategy=strategy, world_size=world_size, shard_units=shard_units(model) if sharded else (),
                    offload_states=bool(offload_states), reduce_every_micro_batch=bool(reduce_every_micro_batch),
                    reshard_after_forward=layout.reshard_after_forward, replicate=layout.replicate,
                    tensor_parallel=tensor_parallel, tensor_plan=tuple(tensor_plan), more_dimensions=_more(space))


@dataclasses.dataclass(frozen=True)
class _StepSpace:
    """The one layout of a step as the space a dimension's ``choices`` read (the request's fields a plan gives them,
    ``choices.LayoutRequest``), each of the first dimensions' options fixed to the user's value."""

    model: nn.Module
    world_size: int
    gpus_per_node: int
    reshard_options: tuple[Any, ...]
    replicate_options: tuple[Any, ...]
    tensor_options: tuple[Any, ...]
    layout_options: Any  # the user's autofit.Layout
    clip_grad_norm: float | None


def _more(space: _StepSpace) -> tuple[Placement, ...]:
    """The placements the user's layout asks of the registered dimensions ``Parallel`` has no field for
    (``Parallel.more_dimensions``): each one's ``choices`` over the step's ``space``, which must be one (several
    are the planner's to choose among: refused, as ``tensor_parallel="auto"`` is); a degree of 1 is no part."""
    found = []
    for dimension in further_dimensions():
        choices = tuple(dimension.choices(space))
        if len(choices) > 1:
            raise InvalidInputError(f"{dimension.field}: a step has one layout, and this asks for {len(choices)} "
                                    f"(the planner's choice): give one value of {dimension.field}")
        found += [p for p in choices if p.degree != 1]
    return tuple(found)


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


def planned_layouts(model: nn.Module, layout: Any, batch_size: int, tensors: Sequence[torch.Tensor],
                    check_step: Callable[[Parallel], object]) -> dict[str, Any]:
    """The request's fields of the layouts a plan may choose among (docs/multi-gpu.md): the ranks, the rows per
    rank, the strategies, the ranks per node, the FSDP2 reshards and replicates, the tensor-parallel degrees, and the
    user's ``layout`` as given; each checked against the model and the sample's ``tensors`` here. ``check_step``:
    the step's rules on a tensor-parallel layout the user fixed (clipping: the request's ``StepConfig`` names why)."""
    world_size = layout.world_size
    require_int("world_size", world_size)
    strategy = as_strategy(layout.strategy)  # the user's string, read once: a Strategy from here on
    if strategy is not None and world_size == 1:
        raise InvalidInputError(f"strategy={strategy!r} needs world_size > 1 (the number of processes)")
    if batch_size % world_size:
        raise InvalidInputError(f"batch_size {batch_size} does not split evenly over world_size {world_size}")
    per_node, reshards, replicates = fsdp2_layouts(world_size, strategy, layout.gpus_per_node,
                                                   layout.reshard_after_forward, layout.replicate)
    degrees = tensor_options(model, world_size, per_node, strategy, layout.tensor_parallel,
                             layout.tensor_parallel_plan, tensors)
    if degrees != (1,) and layout.tensor_parallel != "auto":
        check_step(Parallel(strategy="fsdp2", world_size=world_size, tensor_parallel=degrees[0],
                            tensor_plan=(("", "colwise"),)))
    return dict(world_size=world_size, per_rank=batch_size // world_size,
                strategies=(strategy,) if strategy is not None or world_size == 1 else tuple(Strategy),
                gpus_per_node=per_node, reshard_options=reshards, replicate_options=replicates,
                tensor_options=degrees, layout_options=layout)


def fsdp2_layouts(world_size: int, strategy: Strategy | str | None, gpus_per_node: int | None, reshard_after_forward: Any,
                  replicate: Any) -> tuple[int, tuple[bool | int, ...], tuple[int, ...]]:
    """The ranks per node and the FSDP2 layouts to plan (docs/multi-gpu.md, "How the planner chooses"): with "auto",
    ZeRO-3 and ZeRO-2, and across nodes also the reshard to one node's GPUs and HSDP (replicate across nodes)."""
    per_node = world_size if gpus_per_node is None else require_int("gpus_per_node", gpus_per_node)
    if world_size % per_node:
        raise InvalidInputError(f"gpus_per_node {per_node} does not divide world_size {world_size}: world_size is "
                                "nodes x gpus_per_node")
    strategy = as_strategy(strategy)
    if strategy is Strategy.DDP and (reshard_after_forward != "auto" or replicate != "auto"):
        raise InvalidInputError("reshard_after_forward and replicate are FSDP2 layouts: leave them 'auto' with "
                                "strategy='ddp', or use strategy='fsdp2'")
    # "auto" as each dimension expands it (autofit/parallel/replicate.py, shard.py)
    replicates = replicate_choices(replicate, world_size, per_node)
    reshards = reshard_choices(reshard_after_forward, world_size, per_node)
    if world_size > 1 and strategy is not Strategy.DDP:  # the explicit ones are checked here, before any simulation
        for raf in reshards:
            for r in replicates:
                if reshard_after_forward != "auto" or replicate != "auto":
                    check_layout(Strategy.FSDP2, world_size, reshard_after_forward=raf, replicate=r)
    return per_node, reshards, replicates


TENSOR_DEGREES = (2, 4, 8)  # "auto": the tensor-parallel degrees tried, each dividing one node's GPUs


def tensor_options(model: nn.Module, world_size: int, per_node: int, strategy: Strategy | None,
                   tensor_parallel: Any, user_plan: Mapping[str, Any] | None = None,
                   sample: Sequence[torch.Tensor] = ()) -> tuple[int, ...]:
    """``plan(tensor_parallel=...)``: 1 (none, the default), an int T (plan FSDP2 x tensor parallel T only; the
    model's plan resolved here, so a model that cannot be split is named before any simulation), or "auto" (also
    each of 2, 4, 8 that divides one node's GPUs, for a model that carries a plan; docs/multi-gpu.md). ``user_plan``:
    ``plan(tensor_parallel_plan=...)``, for a model without its own; with sequence parallel in it, the ``sample``'s
    tensors must split evenly along the sequence (``require_sequence_split``; "auto" skips the degrees that do
    not, ``tensor_layouts``)."""
    if user_plan is not None and tensor_parallel == 1:
        raise InvalidInputError("tensor_parallel_plan is given but tensor_parallel is 1: pass tensor_parallel=T or "
                                "'auto'")
    if tensor_parallel == "auto":
        return (1,) + tuple(t for t in TENSOR_DEGREES if t <= per_node and per_node % t == 0)
    require_int("tensor_parallel", tensor_parallel)
    if tensor_parallel == 1:
        return (1,)
    check_layout(strategy, world_size, tensor_parallel=tensor_parallel)
    if per_node % tensor_parallel:
        raise InvalidInputError(
            f"tensor_parallel {tensor_parallel} does not divide the {per_node} GPUs of a node: its all-reduces run in "
            "every layer and must stay on NVLink; choose a divisor of gpus_per_node")
    resolved = resolve_tensor_plan(model, tensor_parallel, user_plan)
    require_sequence_split(resolved, tensor_parallel, sample, "the sample")
    return (tensor_parallel,)
