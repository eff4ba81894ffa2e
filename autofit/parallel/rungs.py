"""The layout's answers to the planner (issue 54): which rungs of the ladder a layout has (autofit/solve/ladder.py),
what its search and race may skip (autofit/planning/), and the words its errors use. The planner asks each question
here, named by what it decides, and reads no field of the layout; each rule is the layout's, beside the fields it
reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from autofit.core.units import format_bytes
from autofit.parallel.layout import Parallel

__all__ = ["one_process_features", "reducing_rival", "analysed_windows", "ladder_rungs", "priced_unanalysed",
           "climbed_for_memory", "host_rung_loses", "names_smallest_budget", "budget_error_at", "more_gpus",
           "node_host_words"]


def one_process_features(parallel: Parallel) -> bool:
    """Whether a plan laid out as ``parallel`` may use what is planned for one process only: the ladder's opt-in
    rungs, the optimizer stepped in backward, the gradients allocated before forward. Only where no strategy wraps
    the model: DDP's buckets and FSDP2's shards (on one process too, with the states on the host) own the gradients,
    and the distributed trainers build none of those steps (``Parallel.refuse_laid_out`` refuses them there)."""
    return parallel.strategy is None


def reducing_rival(parallel: Parallel, micro_batches: int) -> Parallel | None:
    """The layout a step of ``parallel`` over ``micro_batches`` micro-batches (at most) is weighed against: the same
    reduce-scattering after every micro-batch (Note [gradient sync under accumulation], autofit/training/step.py).
    None where the two are one step: ``parallel`` defers no reduce-scatter (``Parallel.defers_gradients``), or
    there is one micro-batch, which is the last and reduces anyway."""
    return None if micro_batches < 2 else parallel.reducing_every_micro_batch()


def analysed_windows(parallel: Parallel, rows: int) -> tuple[bool, Parallel | None]:
    """Which analyses price the steps of ``parallel`` over ``rows`` rows per rank (Note [an accumulation-free FSDP2
    step], autofit/solve/space.py): whether its own window is analysed, and the layout whose analysis prices its step
    of one micro-batch where its own cannot (None: its own does). A deferring FSDP2 step of one micro-batch is the
    step of the same layout reducing every micro-batch; with one row per rank it is the only step, and the own window
    is not analysed."""
    single = parallel.reducing_every_micro_batch()
    return single is None or rows > 1, single


def ladder_rungs(parallel: Parallel, rows: int, host_allowed: bool,
                 units: Callable[[], tuple[str, ...]]) -> tuple[Parallel | None, Parallel | None]:
    """The layouts of ``parallel``'s own rungs of the ladder (Note [the ladder], autofit/solve/ladder.py), each None
    where it has none: the rung reducing every micro-batch (:func:`reducing_rival` over ``rows`` rows per rank, at
    most that many micro-batches), and the last rung, its states on the host (``Parallel.states_on_host``, ``units()``
    the FSDP2 units of one process) where the request ``host_allowed`` it."""
    return reducing_rival(parallel, rows), parallel.states_on_host(units) if host_allowed else None


def priced_unanalysed(parallel: Parallel) -> bool:
    """Whether the quick path's time model can price ``parallel``'s step with no analysis (Note [the quick path],
    autofit/solve/quick.py): not with tensor parallel, whose all-reduces are sized by the layer table, nor with a
    further dimension (``Parallel.more_dimensions``), whose share of the work (``Dimension.rank_work``) may read it."""
    return parallel.tensor_parallel == 1 and not parallel.more_dimensions


def climbed_for_memory(parallel: Parallel) -> bool:
    """Whether ``parallel`` is a layout the ladder climbs to for memory, at a cost in time (Note [the ladder]): its
    states on the host (the optimizer steps on the CPU), or FSDP2 reduce-scattering after every micro-batch (more
    collectives). A plan's step holds the latter only where it accumulates (``Parallel.for_micro_batches``)."""
    return parallel.offload_states or parallel.reduce_every_micro_batch


def host_rung_loses(found: Iterable[Parallel]) -> bool:
    """Whether a rung keeping its states on the host cannot win against plans found laid out as ``found``: one of
    them keeps its states on the GPUs, whose step beats an optimizer step on the CPU (Note [layouts that cannot
    win], autofit/planning/climb.py)."""
    return any(not p.offload_states for p in found)


def names_smallest_budget(parallel: Parallel, planned: bool) -> bool:
    """Whether the smallest budget of ``parallel``, a layout whose states alone miss the budget, may be the one the
    error reports (Note [ruled out by arithmetic], autofit/planning/race.py): not once another layout has a plan
    (``planned``: no error then), and only for the layout that holds least at any configuration
    (``Parallel.least_memory``), below whose smallest budget no other layout's falls."""
    return not planned and parallel.least_memory


def budget_error_at(parallel: Parallel) -> tuple[str, int]:
    """What an infeasible plan's error says of ``parallel``: where its smallest budget was found (', fsdp2 (ZeRO-3)
    over 8 ranks'; '' for one process), and the ranks FSDP2 shards the states over, whose advice it gives (0: not
    sharded, the advice of one copy)."""
    at = f", {parallel.label_with_ranks}" if parallel.strategy else ""
    return at, parallel.shard_ranks if parallel.shards_parameters else 0


def more_gpus(parallel: Parallel, gpus: int | None) -> int | None:
    """``gpus`` (the fewest whose share of the states would fit each GPU) where they are more than ``parallel`` runs
    on; None where they are not: the states fit its GPUs already, and what needs the host is more than them."""
    return None if gpus is None or gpus <= parallel.world_size else gpus


def node_host_words(parallel: Parallel, rank_bytes: int) -> str:
    """``rank_bytes`` of host memory on each rank of ``parallel``, in words: one process's, or a rank's and its
    node's."""
    ranks = parallel.ranks_per_node
    if ranks == 1:
        return f"{format_bytes(rank_bytes)} ({rank_bytes:,} bytes)"
    node = rank_bytes * ranks
    return (f"{format_bytes(rank_bytes)} per rank, {format_bytes(node)} ({node:,} bytes) for the {ranks} ranks "
            "of a node")
