"""The parallel layout of a step, as one value: the strategy, its ranks, FSDP2's reshard and HSDP's replicate, tensor
and sequence parallel, and the states on the host.

It lives here, low in the import order, so that the request (``autofit/request.py``), the search (``solve/``) and
the step (``training/config.py``) all import it downward; it is validated once, where it is built, and travels nested
in the ``StepConfig``. Users still give the strategy as a string, "ddp" or "fsdp2": :func:`as_strategy` turns it into
a :class:`Strategy`, whose properties are what the core branches on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from autofit.core.errors import InvalidInputError, require_int, require_strategy
from autofit.parallel import DIMENSIONS
from autofit.parallel.dimension import Dimension, Layout, Placement, StepKnobs
from autofit.parallel.exports import ExportFragment, ExportInputs, rank_count

__all__ = ["Strategy", "as_strategy", "check_layout", "placements", "from_layout", "Parallel", "ranks_per_node", "layout_words",
           "FIELD_DIMENSIONS", "further_dimensions", "trade_words"]


class Strategy(StrEnum):
    """A data-parallel strategy. A ``StrEnum``: it equals, hashes, formats and serialises as its name ("ddp",
    "fsdp2"), so plans and messages read as they did when it was a string."""

    DDP = "ddp"  # DistributedDataParallel: whole replicas, gradients all-reduced in buckets
    FSDP2 = "fsdp2"  # fully_shard: parameters, gradients and state sharded (ZeRO-2/3, HSDP, composed with TP)

    @property
    def shards_parameters(self) -> bool:
        """Each rank holds a shard of the parameters, gradients and optimizer state (FSDP2)."""
        return self is Strategy.FSDP2

    @property
    def replicates_parameters(self) -> bool:
        """Each rank holds the whole model and all-reduces the gradients (DDP)."""
        return self is Strategy.DDP

    def __repr__(self) -> str:  # messages name it as the user wrote it: 'fsdp2'
        return repr(self.value)


def as_strategy(value: object, name: str = "strategy") -> Strategy | None:
    """The strategy a user's value names: None (one process), "ddp", "fsdp2" or a :class:`Strategy`."""
    require_strategy(value, name)
    return None if value is None else Strategy(value)


def check_layout(strategy: object, world_size: int, *, reshard_after_forward: object = True, replicate: object = 1,
                 tensor_parallel: object = 1, offload_states: bool = False) -> None:
    """The rules of a parallel layout given as the user's fields (docs/multi-gpu.md). :class:`Parallel` runs them
    where it is built; the request, ``estimate`` and the planner's enumeration of layouts run them on a layout before
    its modules are resolved, so that a bad one is named before any simulation. Here: the fields' types and which
    strategy each needs; the rules between degrees and options are the dimensions' own (``Dimension.check``,
    autofit/parallel/), run on the :func:`placements` these fields make.

    - ``reshard_after_forward``: True (ZeRO-3), False (ZeRO-2) or an int group size to reshard to, a non-trivial
      divisor of the shard group (torch's ``_get_post_forward_mesh_info``); ``replicate`` > 1 is HSDP, a (replicate,
      shard) mesh whose replicate size divides ``world_size``. Both are FSDP2's.
    - ``tensor_parallel`` T: an int dividing ``world_size``; T > 1 needs FSDP2 (over the other ``world_size // T``
      ranks, none when T == world_size) and neither HSDP nor the states on the host."""
    strategy = as_strategy(strategy)
    sharded = strategy is not None and strategy.shards_parameters
    require_int("replicate", replicate)
    raf = reshard_after_forward
    if not isinstance(raf, (bool, int)):
        raise InvalidInputError(f"reshard_after_forward must be True (ZeRO-3), False (ZeRO-2) or an int group "
                                f"size, got {raf!r}")
    if not sharded and (raf is not True or replicate != 1):
        raise InvalidInputError(
            f"reshard_after_forward={raf!r} and replicate={replicate!r} are FSDP2 layouts: they need "
            f"strategy='fsdp2', got {strategy!r} (leave them at True and 1 for DDP or one process)")
    require_int("tensor_parallel", tensor_parallel)
    if tensor_parallel != 1 and not sharded:
        raise InvalidInputError(
            f"tensor_parallel={tensor_parallel} composes with FSDP2 (torchtitan's layout): pass "
            f"strategy='fsdp2' (with world_size == tensor_parallel for tensor parallel alone), got {strategy!r}")
    DIMENSIONS.layout(world_size, placements(strategy, world_size, reshard_after_forward=raf, replicate=replicate,
                                             tensor_parallel=tensor_parallel, offload_states=offload_states))


def placements(strategy: Strategy | None, world_size: int, *, reshard_after_forward: bool | int = True,
               replicate: int = 1, tensor_parallel: int = 1, offload_states: bool = False,
               reduce_every_micro_batch: bool = False, tensor_plan: tuple[tuple[str, str], ...] = (),
               sequence_parallel: bool = False) -> tuple[Placement, ...]:
    """The dimensions' placements a layout's fields make (Note [layout dimensions]): none for one process, DDP's
    replication over every rank, or FSDP2's replicate (HSDP), shard and tensor-parallel dims, the shard dim taking
    the ranks the others leave."""
    if strategy is None:
        return ()
    if not strategy.shards_parameters:  # DDP's replicas: the ranks the other dimensions leave (all, alone)
        return (Placement("dp_replicate", None),)
    shard = (("reshard_after_forward", reshard_after_forward),) + ((("offload_states", True),) if offload_states
                                                                    else ()) \
        + ((("reduce_every_micro_batch", True),) if reduce_every_micro_batch else ())
    tensor = ((("plan", tensor_plan),) if tensor_plan else ()) + ((("sequence_parallel", True),)
                                                                  if sequence_parallel else ())
    return (Placement("dp_replicate", replicate), Placement("dp_shard", None, shard),
            Placement("tp", tensor_parallel, tensor))


# the dimensions whose placements Parallel's own fields give (:func:`placements`); any other's is one of its
# ``more_dimensions``
FIELD_DIMENSIONS = ("dp_replicate", "dp_shard", "tp")


def further_dimensions() -> list[Dimension]:
    """The registered dimensions ``Parallel`` has no field for, in registration order: those whose placements are its
    ``more_dimensions`` (the planner's choices of them: ``choices.layouts``; a step's: ``requested.step_layout``)."""
    return [d for d in DIMENSIONS if d.name not in FIELD_DIMENSIONS]


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """How one rank's step is distributed: no strategy (one process), DDP or FSDP2 over ``world_size`` ranks.
    Validated once, here; the strategy may be given as a string and is held as a :class:`Strategy`."""

    strategy: Strategy | None = None
    world_size: int = 1
    shard_units: tuple[str, ...] = ()  # FSDP2: the modules fully_shard wraps before the root
    offload_states: bool = False  # FSDP2's CPUOffloadPolicy: parameters, gradients and state on the host
    # FSDP2 reduce-scatters after every micro-batch, not only the window's last (Note [gradient sync under
    # accumulation], autofit/training/step.py): the ladder's rung after the model's own dtype
    reduce_every_micro_batch: bool = False
    # FSDP2 layout (docs/multi-gpu.md): True ZeRO-3, False ZeRO-2, an int the group parameters are resharded to after
    # forward; replicate > 1: HSDP over a (replicate, world_size // replicate) mesh
    reshard_after_forward: bool | int = True
    replicate: int = 1
    gpus_per_node: int = 0  # ranks per node (their collectives run over NVLink); 0: all ranks on one node
    # tensor parallel degree and its resolved (module, style) pairs (Note [tensor parallel plan]);
    # FSDP2 then runs over the other world_size // tensor_parallel ranks
    tensor_parallel: int = 1
    tensor_plan: tuple[tuple[str, str], ...] = ()
    # the placements of the registered dimensions that have no field above (Note [layout dimensions]), as the
    # enumeration (``from_layout``) or the user's layout (``requested.step_layout``) gave them: a dimension added to
    # the registry adds no field here, and its part reaches the mesh, the data ranks and the plan's JSON through
    # ``layout``. The fields above are the first dimensions', which plans and users have always read by name.
    more_dimensions: tuple[Placement, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", as_strategy(self.strategy))
        require_int("world_size", self.world_size)
        require_int("gpus_per_node", self.gpus_per_node, minimum=0)
        check_layout(self.strategy, self.world_size, reshard_after_forward=self.reshard_after_forward,
                     replicate=self.replicate, tensor_parallel=self.tensor_parallel,
                     offload_states=self.offload_states)
        if (self.tensor_parallel > 1) != bool(self.tensor_plan):
            raise InvalidInputError("tensor_plan (the modules to split) and tensor_parallel > 1 go together: resolve "
                                    "the plan with autofit.parallel.tensor_parallel.resolve_tensor_plan")
        if self.offload_states and not self.shards_parameters:
            raise InvalidInputError(
                "offload_states keeps parameters, gradients and optimizer state in host memory with FSDP2's "
                f"CPUOffloadPolicy, so it needs strategy='fsdp2' (world_size 1 included), got {self.strategy!r}"
            )
        if self.reduce_every_micro_batch and not self.shards_parameters:
            raise InvalidInputError(
                "reduce_every_micro_batch reduce-scatters FSDP2's gradients after every micro-batch so that no "
                f"unsharded gradients wait for the last one; it needs strategy='fsdp2', got {self.strategy!r} (DDP "
                "keeps whole gradients either way)"
            )
        if self.more_dimensions:  # the whole layout's rules, each dimension's own (the fields' ran above)
            self.layout  # noqa: B018 - computed and kept: the check is its construction

    @property
    def shards_parameters(self) -> bool:
        """FSDP2 runs (on one process too, with the states on the host)."""
        return self.strategy is not None and self.strategy.shards_parameters

    @property
    def replicates_parameters(self) -> bool:
        """DDP runs."""
        return self.strategy is not None and self.strategy.replicates_parameters

    @property
    def fully_sharded(self) -> bool:
        """FSDP2's ``fully_shard`` runs: over the data-parallel ranks (those tensor parallel and the further
        dimensions leave, when more than one), or on one process to keep the states on the host."""
        return self.shards_parameters and (self.world_size > self.tensor_parallel * self._more_degree
                                            or self.offload_states)

    @property
    def _more_degree(self) -> int:
        """The ranks the dimensions of :attr:`more_dimensions` take together (1: none)."""
        return math.prod(p.degree for p in self.more_dimensions)

    @property
    def defers_gradients(self) -> bool:
        """FSDP2 over data ranks reduce-scatters the gradients at a window's last micro-batch only, each rank holding
        its unsharded gradients until then (Note [gradient sync under accumulation], autofit/training/step.py): not
        when it reduces every micro-batch, nor with the states on the host (CPUOffloadPolicy reduces every one)."""
        return self.fully_sharded and not self.reduce_every_micro_batch and not self.offload_states

    def reducing_every_micro_batch(self) -> Parallel | None:
        """This layout reduce-scattering after every micro-batch (Note [gradient sync under accumulation],
        autofit/training/step.py), or None where that changes nothing: it defers no reduce-scatter
        (:attr:`defers_gradients`)."""
        return replace(self, reduce_every_micro_batch=True) if self.defers_gradients else None

    def for_micro_batches(self, accumulation_steps: int) -> Parallel:
        """The layout a step of ``accumulation_steps`` micro-batches runs: reducing after every micro-batch only where
        there is more than one (with one, every micro-batch is the last and reduces anyway: the same step)."""
        if self.reduce_every_micro_batch and accumulation_steps == 1:
            return replace(self, reduce_every_micro_batch=False)
        return self

    def states_on_host(self, units: Callable[[], tuple[str, ...]]) -> Parallel | None:
        """This layout with the parameters, gradients and optimizer state in host memory, FSDP2's CPUOffloadPolicy
        (Note [offload], autofit/training/step.py): each rank of FSDP2 over several keeps its shard there; one
        process becomes FSDP2 over itself, its units ``units()`` (the modules ``fully_shard`` wraps). None where it
        does not apply: there already, DDP (whole replicas), tensor parallel (refused with offload), a further
        dimension (``more_dimensions``: not tried, its own rules would have to allow it)."""
        if self.offload_states or self.more_dimensions:  # a further dimension's states: not tried on the host
            return None
        if self.shards_parameters and self.world_size > 1 and self.tensor_parallel == 1:
            return replace(self, offload_states=True)
        if self.strategy is not None:
            return None
        return replace(self, strategy=Strategy.FSDP2, shard_units=units(), offload_states=True)

    @property
    def shard_group(self) -> int:
        """The ranks one parameter is sharded over: world_size // replicate under FSDP2 (tensor parallel's and the
        shard dim's ranks), else 1 (a whole copy): :attr:`Layout.state_ways` (Note [a dimension's share of
        memory])."""
        return self.layout.state_ways

    @property
    def shard_ranks(self) -> int:
        """The ranks of FSDP2's shard dim, over which one rank's tensor-parallel share of a parameter is sharded:
        world_size // (replicate x tensor_parallel) (the layout's "dp_shard" degree); 1 without FSDP2."""
        return self.layout.degree("dp_shard")

    @functools.cached_property  # a frozen value: computed once (kept in the instance's __dict__, not a field)
    def layout(self) -> Layout:
        """This layout as the dimensions' placements in mesh order (Note [layout dimensions]): what derives the
        mesh and the data ranks."""
        return DIMENSIONS.layout(self.world_size, placements(
            self.strategy, self.world_size, reshard_after_forward=self.reshard_after_forward,
            replicate=self.replicate, tensor_parallel=self.tensor_parallel, offload_states=self.offload_states,
            reduce_every_micro_batch=self.reduce_every_micro_batch, tensor_plan=self.tensor_plan)
            + self.more_dimensions, self.gpus_per_node)

    @property
    def data_ranks(self) -> int:
        """The ranks that train different rows (:attr:`Layout.data_ranks`: the world size over the degrees of the
        dimensions whose ranks share rows, tensor parallel's; the mesh is ``layout.mesh_shape``)."""
        return self.layout.data_ranks

    def rank_rows(self, batch_size: int) -> int:
        """The rows of a batch of ``batch_size`` that one rank holds (``StepConfig.held_rows``, the trainer's slice):
        its share among the :attr:`data_ranks` (the ranks of a tensor-parallel group hold the same rows)."""
        return batch_size // self.data_ranks

    @property
    def nodes(self) -> int:
        """The hosts the job spans: ``world_size`` over the ranks per node (1 for one process)."""
        return self.world_size // self.ranks_per_node

    @property
    def data_parallel(self) -> Parallel:
        """The layout the data-parallel collectives run over: FSDP2 over the :attr:`data_ranks` (world_size //
        tensor_parallel, and over the ranks the further dimensions whose ranks share rows leave), and one process
        when those take every rank (their own collectives are counted apart: ``Layout.rank_work``)."""
        sharing = tuple(p for p in self.more_dimensions if DIMENSIONS[p.dimension].shares_rows)
        if self.tensor_parallel == 1 and not sharing:
            return self
        if self.data_ranks == 1:
            return Parallel(gpus_per_node=self.gpus_per_node)
        return replace(self, world_size=self.data_ranks, tensor_parallel=1, tensor_plan=(),
                       more_dimensions=tuple(p for p in self.more_dimensions if p not in sharing))

    @property
    def label(self) -> str:
        """The layout in words: 'fsdp2 (ZeRO-3) over 8 ranks', 'hsdp 2 x 4 (ZeRO-2)', 'ddp'."""
        return self.layout.words(ranks=True)

    @property
    def label_with_ranks(self) -> str:
        """The layout in words with the processes it runs on: 'ddp over 4 ranks', 'tp 2 over 2 ranks', 'fsdp2 (ZeRO-3)
        over 8 ranks', 'fsdp2 (ZeRO-3) x tp 2 over 4 ranks' (what an infeasible plan's message names)."""
        return f"{self.layout.words()} over {rank_count(self.world_size)}"

    @property
    def ranks_per_node(self) -> int:
        """The ranks that share one host's memory (what offloaded states must fit together): 1 for one process."""
        return ranks_per_node(self.world_size, self.gpus_per_node)

    def check_step(self, step: StepKnobs) -> None:
        """The rules between this layout and ``step``'s knobs (``StepConfig`` runs them where it is built), each
        message naming the knob: the layout's own (what needs DDP), then each of its dimensions'
        (``Dimension.check_step``), in mesh order. A step feature's rules on the layout are the feature's (Float8's
        all-gather needs FSDP2 over several ranks: its value's ``check_step``, which ``StepConfig`` runs), so the
        layout names no feature."""
        if not step.gradient_as_bucket_view and not self.replicates_parameters:
            raise InvalidInputError("gradient_as_bucket_view=False describes DDP's buckets: it needs strategy='ddp' "
                                    "(leave it out for one process or FSDP2)")
        layout = self.layout
        for placement in layout.placements:
            DIMENSIONS[placement.dimension].check_step(layout, placement, step)

    def refuse_laid_out(self, why: str) -> None:
        """Raise ``why`` (a typed error) where this is a layout at all: a step feature planned for one process only
        (its ``Feature.one_process``) refuses a plan laid out over processes when it is wrapped."""
        if self.strategy is not None:
            raise InvalidInputError(why)

    def refuse_for_callback(self, callback: str) -> None:
        """Raise :class:`InvalidInputError` where ``callback`` (a loop other than ``wrap()``'s: autofit's callbacks,
        ``plan_patches``) cannot apply this layout: FSDP2's (over several ranks, or one process with the states on
        the host: Note [offload]) fits only as FSDP2 lays the model out, which only ``wrap()`` does; another loop
        would train the whole model on the GPU, over the budget."""
        if self.shards_parameters:
            how = ("keeps the parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy)"
                   if self.offload_states else f"shards the model over {self.world_size} ranks")
            raise InvalidInputError(f"this plan {how}, which {callback} does not apply: train it with "
                                    "plan.wrap(model, optimizer)")

    def other_ranks(self, ranks: int, words: str) -> str | None:
        """Where a job of ``ranks`` processes (a Trainer's, a launcher's) cannot run this layout, ``words`` saying so,
        formatted with ``ranks`` and ``planned`` (the processes this layout runs on); None where it can."""
        return None if ranks == self.world_size else words.format(ranks=ranks, planned=self.world_size)

    def table_rows(self, batch_size: int, words: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """The rows a plan's table shows of this layout (``Plan.summary_rows``), as (name, value): those after the
        effective batch (the processes and nodes, in ``words``, with the rows each trains: a tensor-parallel group's
        ranks share theirs; FSDP2's units), and those after the accumulation steps (how the gradients sync)."""
        head: list[tuple[str, str]] = []
        if self.world_size > 1:
            nodes = (f" ({self.nodes} nodes x {self.gpus_per_node})"
                     if self.gpus_per_node and self.gpus_per_node < self.world_size else "")
            head.append(("world size", f"{self.world_size} processes{nodes}, {words}, "
                                       f"{batch_size // self.data_ranks} samples each"))
            if self.shard_units:
                head.append(("FSDP2 units", f"{len(self.shard_units)}: {', '.join(self.shard_units[:4])}"
                                            + (" ..." if len(self.shard_units) > 4 else "")))
        sync = [("gradient sync", "reduce-scatter after every micro-batch")] if self.reduce_every_micro_batch else []
        return head, sync

    def host_rows(self, host_bytes: int, pinned_bytes: int, host_budget_bytes: int | None,
                  fmt: Callable[[int], str]) -> list[tuple[str, str]]:
        """The rows a plan's table shows of what one rank keeps in host memory (``host_bytes``, ``pinned_bytes`` of
        them pinned, out of ``host_budget_bytes`` per node, or None): the states, where this layout keeps them there
        (FSDP2's CPUOffloadPolicy), and the host's bytes, for every rank of a node where several share it."""
        rows = []
        if self.offload_states:
            rows.append(("offloaded states", "parameters, gradients, optimizer state; the optimizer steps on the CPU "
                                             "(FSDP2 CPUOffloadPolicy)"))
        if host_bytes:
            allowed = "" if host_budget_bytes is None else f" of {fmt(host_budget_bytes)} allowed"
            ranks = self.ranks_per_node
            node = "" if ranks == 1 else f" per rank, {fmt(ranks * host_bytes)} for the {ranks} ranks of a node"
            rows.append(("host memory", f"{fmt(host_bytes)} ({fmt(pinned_bytes)} pinned, "
                                        f"{fmt(host_bytes - pinned_bytes)} pageable){node}{allowed}"))
        return rows

    def export(self, framework: str, inputs: ExportInputs) -> ExportFragment:
        """This layout's part of ``framework``'s export (:meth:`Layout.export`), its dimensions given its FSDP2 units
        beside the plan's values ``inputs``."""
        return self.layout.export(framework, replace(inputs, shard_units=self.shard_units))

    def export_ranks(self, framework: str, micro_batch_size: int, accumulation_steps: int) -> dict[str, Any]:
        """What every layout writes in ``framework``'s export, in its keys (``emit/export.py`` places them among its
        own): an optimizer step's samples over the data ranks (DeepSpeed's ``train_batch_size``, torchtitan's
        ``global_batch_size``: a tensor-parallel group trains the same rows), the processes and nodes (Accelerate's;
        Lightning's devices per node and nodes, with a strategy); nothing for Hugging Face (its launcher's)."""
        batch, per_node = micro_batch_size * accumulation_steps * self.data_ranks, self.gpus_per_node or self.world_size
        nodes = {"num_nodes": self.nodes} if per_node < self.world_size else {}
        return {"hf": {}, "deepspeed": {"train_batch_size": batch},
                "lightning": {"trainer": {"devices": per_node, **nodes}} if self.strategy is not None else {},
                "accelerate": {"config_file": {"num_machines": self.nodes, "num_processes": self.world_size}},
                "torchtitan": {"training": {"global_batch_size": batch}}}[framework]

    def batch_words(self, micro_batch_size: int, accumulation_steps: int) -> str:
        """The samples of an optimizer step over the data ranks, in words: '3 x 1 x 8 = 24 samples per step'."""
        data = self.data_ranks
        return (f"{micro_batch_size} x {accumulation_steps} x {data} = {micro_batch_size * accumulation_steps * data}"
                " samples per step")

    @property
    def least_memory(self) -> bool:
        """DDP, or FSDP2's layout that holds least at any configuration: ZeRO-3 over every rank (ZeRO-2 and the int
        reshard hold more of each unit between forward and backward, HSDP a larger shard). Not claimed of a layout
        with a further dimension (``more_dimensions``), whose share this layer does not know."""
        return not self.shards_parameters or (self.reshard_after_forward is True and self.replicate == 1
                                              and self.tensor_parallel == 1 and not self.more_dimensions)


def from_layout(layout: Layout, *, gpus_per_node: int = 0, shard_units: tuple[str, ...] = ()) -> Parallel:
    """The FSDP2 layout the dimensions' placements describe (an :func:`autofit.parallel.enumerate_layouts` result),
    as the step holds it. Tensor parallel over every rank leaves FSDP2 nothing to reshard: ZeRO-3's flag then."""
    shard, tensor = layout.placement("dp_shard"), layout.placement("tp")
    raf = True if shard is None else shard.option("reshard_after_forward", True)
    if tensor is not None and tensor.degree > 1 and layout.data_ranks == 1:
        raf = True
    return Parallel(strategy=Strategy.FSDP2, world_size=layout.world_size, gpus_per_node=gpus_per_node,
                    shard_units=shard_units, reshard_after_forward=raf, replicate=layout.degree("dp_replicate"),
                    tensor_parallel=layout.degree("tp"), tensor_plan=() if tensor is None else tensor.option("plan", ()),
                    more_dimensions=tuple(p for p in layout.placements
                                          if p.dimension not in FIELD_DIMENSIONS and p.degree != 1))


def trade_words(parallels: Iterable[Parallel]) -> tuple[str, ...]:
    """What each registered dimension that a layout of ``parallels`` uses trades (``Dimension.trade``), in
    registration order: the sentences of the note saying why a layout won the race."""
    layouts = [p.layout for p in parallels]
    return tuple(words for words in (d.trade(layouts) for d in DIMENSIONS) if words)


def ranks_per_node(world_size: int, gpus_per_node: int) -> int:
    """The ranks of a job of ``world_size`` on one node (``gpus_per_node`` 0: every rank on one node)."""
    return min(gpus_per_node or world_size, world_size)


def layout_words(strategy: str, world_size: int, reshard_after_forward: bool | int, replicate: int, *,
                 ranks: bool = False, after_forward: str = "", tensor_parallel: int = 1,
                 sequence_parallel: bool = False) -> str:
    """A layout given by its fields in words (plan notes, ``Parallel.label``, ``Plan.layout``, the CLI's estimate):
    its dimensions' (``Layout.words``): 'ddp', 'fsdp2 (ZeRO-3)', 'fsdp2 (resharded to 8)', 'hsdp 2 x 4 (ZeRO-2)',
    'tp 8', 'fsdp2 (ZeRO-3) x tp 8', 'tp 8 + sequence parallel'; ``ranks`` adds FSDP2's rank count,
    ``after_forward`` follows an int reshard's group."""
    strategy = Strategy(strategy)
    layout = DIMENSIONS.layout(world_size, placements(
        strategy, world_size, reshard_after_forward=reshard_after_forward, replicate=replicate,
        tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel))
    return layout.words(ranks=ranks, after_forward=after_forward)
