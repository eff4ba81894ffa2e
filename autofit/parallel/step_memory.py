"""The layout's share of a step's memory, as the ladder's floors and the large-term notes ask for it
(``autofit/solve/ladder.py``, ``autofit/solve/terms.py``, ``autofit/solve/host.py``): one rank's share of the
parameters, gradients and optimizer state, what the layout keeps gathered between forward and backward, the unsharded
gradients a deferring FSDP2 step holds, the ranks that would shard the states into a budget, and what one node's ranks
keep on the host. Each takes what the caller counted of the model, whole, and returns the finished term, so that the
memory model and the ladder compute no share of the layout themselves (Note [a dimension's share of memory],
autofit/parallel/dimension.py): the pattern of the layout's part of a step's time (``LayoutTime``,
autofit/parallel/step_time.py). Which rungs a layout has (its states on the host, reducing every micro-batch) and
whether it runs what is planned for one process, the ladder asks autofit/parallel/rungs.py. What a parameter weighs
in a precision stays the caller's (this layer does not import the precisions, autofit/training/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from autofit.parallel.collectives import Links, ring_seconds
from autofit.parallel.layout import Parallel
from autofit.parallel.tensor import split_parameters

__all__ = ["rank_states_bytes", "gathered_bytes", "deferred_floor_bytes", "gpus_for_states_bytes", "node_bytes",
           "deferred_gradients_bytes", "DeferredTrade", "deferred_trade", "rung_what", "reducing_notes",
           "host_states_note", "analysis_words"]


def rank_states_bytes(parallel: Parallel, whole: int) -> int:
    """One rank's share of ``whole`` bytes of parameters, gradients and optimizer state: the whole over the ways the
    layout shards them (``Layout.state_ways``, FSDP2's shard group; 1 for a whole copy)."""
    return whole // parallel.shard_group


def gathered_bytes(parallel: Parallel, whole: Callable[[], int]) -> int:
    """What ``parallel`` keeps gathered between forward and backward at the end of forward: its ``kept_gathered``
    share of ``whole()``, the model's bytes in the gathering precision (ZeRO-2 all of a rank's tensor-parallel share,
    an int reshard its group's part, ZeRO-3 and DDP nothing: then ``whole`` is not called)."""
    share = parallel.layout.kept_gathered
    if not share:
        return 0
    return whole() * share.numerator // share.denominator


def deferred_floor_bytes(parallel: Parallel, unsharded: int, sharded: int) -> int:
    """What a step of ``parallel`` deferring FSDP2's reduce-scatter adds at least to its states floor: the
    ``unsharded`` gradients over the ways the layout splits the model (tensor parallel's degree), less the
    ``sharded`` gradients' share the floor counts already (Note [a deferral that cannot fit], solve/ladder.py)."""
    return max(unsharded // parallel.layout.model_ways - sharded // parallel.shard_group, 0)


def gpus_for_states_bytes(parallel: Parallel, rank_states: Callable[[], int], room: Callable[[], int]) -> int | None:
    """The fewest GPUs over which ``parallel``'s FSDP2 would shard the states so that one rank's share
    (``rank_states()`` now) and what it keeps gathered fit ``room()`` (the budget less the gathered bytes, which more
    ranks do not divide); more replicas and tensor parallel stay as they are. None where more ranks shard nothing
    (one process, DDP) or no room is left."""
    if not parallel.shards_parameters or parallel.world_size < 2:
        return None
    whole = rank_states() * parallel.shard_group
    left = room()
    if left <= 0:
        return None
    group = max(parallel.shard_group, -(-whole // left))
    return group * parallel.world_size // parallel.shard_group


def node_bytes(parallel: Parallel, rank_bytes: int) -> int:
    """What the ranks of one node keep in its host memory, each ``rank_bytes``: the host budget is a node's."""
    return rank_bytes * parallel.ranks_per_node


def deferred_gradients_bytes(parallel: Parallel, model: nn.Module, accumulation_steps: int, autocast: bool) -> int:
    """The unsharded gradients one rank holds across the micro-batches of a step with FSDP2's reduce-scatter deferred
    to the last (Note [deferred reduce-scatter], autofit/solve/terms.py): every trained parameter's tensor-parallel
    share, in fp32 under ``autocast``, else its own dtype; 0 where the step does not defer (no FSDP2 over data
    ranks, one micro-batch, reducing every micro-batch, the states on the host)."""
    if not parallel.defers_gradients or accumulation_steps < 2:
        return 0
    tp = parallel.tensor_parallel
    return sum((p.numel() // tp if cut else p.numel()) * (4 if autocast else p.element_size())
               for p, cut in split_parameters(model, parallel.tensor_plan) if p.requires_grad)


@dataclass(frozen=True)
class DeferredTrade:
    """What reducing every micro-batch trades against ``term`` deferred unsharded gradients: it keeps ``kept``
    bytes (their ``share`` over FSDP2's ranks, in words: "1/8"), for ``seconds`` more of reduce-scatters per step,
    and the gradients are those of the rank's ``whole`` ("model", or its "tensor-parallel shard")."""

    share: str
    kept: int
    seconds: float
    whole: str


def deferred_trade(parallel: Parallel, term: int, accumulation_steps: int, target) -> DeferredTrade:
    """:class:`DeferredTrade` of ``term`` deferred gradient bytes over a step of ``accumulation_steps`` micro-batches
    laid out as ``parallel``, its reduce-scatters priced over ``target``'s links (the device model)."""
    shard = parallel.shard_ranks
    kept = term // max(shard, 1)
    links = Links.of(target)
    data = parallel.data_parallel if parallel.tensor_parallel > 1 else parallel  # the FSDP2 dim's ranks
    seconds = (accumulation_steps - 1) * ring_seconds("reduce_scatter", shard, term, links.bandwidth(data, shard))
    whole = "tensor-parallel shard" if parallel.tensor_parallel > 1 else "model"
    return DeferredTrade(f"1/{shard}", kept, seconds, whole)


def rung_what(parallel: Parallel, what: str) -> str:
    """How the plan's notes name a rung of ``parallel`` whose precisions name it ``what``: the rung that
    reduce-scatters every micro-batch by that (Note [the ladder], solve/ladder.py)."""
    return "FSDP2 reducing every micro-batch" if parallel.reduce_every_micro_batch else what


def reducing_notes(parallel: Parallel, accumulation_steps: int) -> tuple[str, ...]:
    """The note of a plan whose layout ``parallel`` reduce-scatters after every micro-batch of its
    ``accumulation_steps`` (Note [gradient sync under accumulation]); none where it does not, or has one."""
    if parallel.reduce_every_micro_batch and accumulation_steps > 1:
        return ("FSDP2 reduce-scatters the gradients after every micro-batch: with the sync left to the last "
                "micro-batch every rank would hold the whole model's unsharded gradients until then, and nothing "
                "fit (Note [gradient sync under accumulation])",)
    return ()


def host_states_note(parallel: Parallel, skipped: str) -> str | None:
    """The note of a plan found with ``parallel`` keeping the states in host memory (FSDP2's CPUOffloadPolicy) after
    the rungs ``skipped`` (in words, each with its floor) were passed over: why they live there; None where the
    layout keeps them on the GPU (the ladder's own note then, solve/ladder.py)."""
    if not parallel.offload_states:
        return None
    return ("nothing fits with the parameters, gradients and optimizer state on the GPU (" + skipped + "): they "
            "live in host memory and the optimizer steps on the CPU (FSDP2 CPUOffloadPolicy, see docs/offload.md)")


def analysis_words(parallel: Parallel) -> str:
    """``parallel`` as the progress line of an analysis names it: ' (states on the host)', ' (fsdp2 over 8)',
    ' (fsdp2 over 8, reducing every micro-batch)', '' for one process."""
    return " (states on the host)" if parallel.offload_states else (
        f" ({parallel.strategy} over {parallel.world_size}"
        f"{', reducing every micro-batch' if parallel.reduce_every_micro_batch else ''})" if parallel.strategy else "")
