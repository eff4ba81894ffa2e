"""What a layout dimension declares, the registry of them, and the layout value they make. See Note [layout
dimensions].

Note [layout dimensions]
    A step is split across GPUs along dimensions: data-parallel replication (DDP, HSDP's replicate dim), sharding
    (FSDP2), tensor parallel; pipeline, context and expert parallel come next. torchtitan's ``ParallelDims`` holds
    their degrees as data, validated once, the mesh built once with one named dim per dimension in a fixed order
    (pp, dp_replicate, dp_shard, cp, tp) and every stage asking for its dim by name. autofit does the same with a
    registry, as it does for step features (Note [step features], autofit/features/base.py): each dimension is one
    module of ``autofit/parallel/`` holding one frozen :class:`Dimension`, and :data:`DIMENSIONS` registers them
    (a name registered twice is refused). Of every dimension:
      - the planner's choices (:meth:`Dimension.choices`): what the request's options ("auto" included, already
        expanded by the request) make of it, one :class:`Placement` each, its degree and its own options;
      - its rules (:meth:`Dimension.check`), run on every :class:`Layout` built, the messages naming the user's field;
      - its rules on the step's knobs (:meth:`Dimension.check_step`: clipping under tensor parallel, say), run with
        the layout's own (``Parallel.check_step``) where a step is built;
      - what the enumeration skips although the rules allow it (:meth:`Dimension.plannable`: a combination torch
        refuses at run time, or one that cannot be planned for this request);
      - whether its ranks share their rows (:attr:`Dimension.shares_rows`: tensor and context parallel split a row's
        work, data parallel splits the rows), and where its dim sits in the mesh (:attr:`Dimension.mesh_rank`);
      - its collectives' time in a step (:meth:`Dimension.collective_seconds`, summed by
        ``autofit.parallel.step_time.collective_seconds``), and its share of one rank's work, what the time model
        prices (:meth:`Dimension.rank_work`, folded by :meth:`Layout.rank_work`: tensor parallel's split ops and
        parameters and its all-reduces);
      - its share of the step's memory (Note [a dimension's share of memory]): how many ways it splits the model a
        rank computes with (:meth:`Dimension.model_ways`), how many more it shards what a rank keeps at rest
        (:meth:`Dimension.state_ways`), and what it keeps gathered from forward to backward
        (:meth:`Dimension.kept_gathered`), from which the :class:`Layout` derives one rank's share;
      - what it trades, in words, for the note saying why a layout won the planner's race (:meth:`Dimension.trade`);
      - its part of each framework's export (:meth:`Dimension.export`, one of :data:`FRAMEWORKS`): an
        :class:`ExportFragment` of settings in the framework's own keys, the notes saying how the framework runs it
        (or the nearest setting it has, and how its memory differs), and, apart, what the framework cannot express of
        it at all. ``autofit/emit/export.py`` writes what every plan shares (the batch, the precision, the
        recomputation), places the ranks and nodes every layout states (``Parallel.export_ranks``) and asks
        :meth:`Layout.export` for the rest, which merges the layout's dimensions' fragments: the settings outermost
        first (the frameworks lay their keys out in mesh order: torchtitan's replicate, shard, then tensor degree;
        Accelerate's ``parallelism_config``), a mapping merged into a mapping key by key (:func:`merge_settings`); the
        notes innermost first, the order a user applies the dimensions (tensor parallel, then FSDP: torchtitan's
        ``parallelize_llama``, Lightning's ``configure_model``), then what cannot be expressed. A dimension that a
        framework expresses as an option of another's setting is written by the one that owns the setting: Lightning's
        and Accelerate's HSDP are options of their FSDP plugins, so the shard dimension writes them, reading the
        replicate degree. The dimensions see the plan's plain values only (:class:`ExportInputs`), never the ``Plan``:
        this layer is below ``emit/``.
    A :class:`Layout` is the placements of one layout in mesh order: it derives the world size, the mesh's shape and
    names, and the data ranks (the ranks that train different rows), the only place that divides the world size
    by the dimensions that share rows. :func:`enumerate_layouts` is the planner's enumeration: the product of every
    registered dimension's choices, in registration order (the first outermost), each combination kept when every
    dimension's rules pass and every dimension finds it plannable.

    What a dimension does to a running step, the same in the simulation, ``measure`` and the trainers
    (autofit/parallel/apply.py, autofit/parallel/schedule.py):
      - what it cuts of the model before any dimension is applied (:meth:`Dimension.cut`), outermost first: a
        pipeline rank keeps only its stage, and tensor parallel and FSDP2 then split that (torchtitan's
        ``pipeline_llm`` cuts each stage before ``parallelize_llama`` runs on it);
      - how it is applied to a model (:meth:`Dimension.apply`), innermost dimension first, as torchtitan's
        ``parallelize_llama`` applies tensor parallel before FSDP and DDP wraps what the others made;
      - whether the ranks along it run different steps (:meth:`Dimension.ranks_differ`: a pipeline's stages hold
        different layers), so that the simulation runs one rank per coordinate (``Layout.distinct_ranks``) where
        otherwise one rank stands for all;
      - the context one micro-batch runs in (:meth:`Dimension.micro_batch_context`: DDP's ``no_sync``, FSDP2's
        deferred reduce-scatter), entered outermost first around each micro-batch;
      - the schedule of the micro-batches (:meth:`Dimension.schedule`): none by default, sequential accumulation;
        a pipeline dimension returns its own (Note [one schedule]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Protocol

from autofit.core.errors import InvalidInputError
from autofit.parallel.collectives import Links
from autofit.parallel.exports import FRAMEWORKS, ExportFragment, ExportInputs, merge_settings

if TYPE_CHECKING:
    from torch import nn

__all__ = ["Dimension", "ApplyInputs", "Placement", "Layout", "Registry", "enumerate_layouts", "StepKnobs", "RankWork",
           "WorkInputs", "Schedule"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """One dimension's part of a layout: its degree (the ranks along its mesh dim; None while the layout is being
    built: the ranks the other dimensions leave, as torchtitan's ``dp_shard=-1``) and its own options, as
    (name, value) pairs (FSDP2's ``reshard_after_forward``, tensor parallel's resolved plan)."""

    dimension: str
    degree: int | None = 1
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        """The value of option ``name``, or ``default``."""
        return dict(self.options).get(name, default)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ApplyInputs:
    """What a dimension reads where it is applied to a model (:meth:`Dimension.apply`) besides its placement: the
    device mesh (None for DDP: the default group), FSDP2's units, the dtype it gathers in (the autocast dtype; None:
    as stored), whether its host copies are pinned, DDP's bucket mode and device ids, the modules the step calls."""

    mesh: Any = None  # a torch DeviceMesh
    shard_units: tuple[str, ...] = ()
    param_dtype: Any = None
    pin_memory: bool = False
    gradient_as_bucket_view: bool = True
    device_ids: list[int] | None = None
    # the modules the rank's step calls, each its own root, where a dimension's cut made them (a pipeline's stages:
    # ``Dimension.runs``); () where the model itself is called
    roots: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class RankWork:
    """One rank's work in a step as the time model prices it (``solve.time_model.build_time_model``): ``ops`` the
    op costs it computes (an ``OpCosts``, analysed at the model's whole shapes), ``param_bytes`` the parameter bytes
    its data-parallel collectives move, ``seconds`` the dimensions' own collectives per optimizer step (tensor
    parallel's all-reduces, which need the analysis' activation sizes). Each dimension takes its share in
    :meth:`Dimension.rank_work`."""

    ops: Any
    param_bytes: int
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkInputs:
    """What a dimension's share of a rank's work reads besides the layout: the model, each module's output bytes
    per sample as analysed (``output_bytes(name)``), the rows one rank trains per optimizer step, and the bandwidth
    of the links within a node, where a group whose collectives run in every layer is placed."""

    model: Any
    output_bytes: Callable[[str], float]
    rows: int
    link_bytes_per_second: float


class StepKnobs(Protocol):
    """What the layout's step rules read of a step (``autofit.training.config.StepConfig``, whose layer stands on
    this one): the device kind, clipping, DDP's bucket mode and the precision."""

    device: Any  # a DeviceKind: ``foreach_by_default`` says whether torch's optimizers run foreach there
    clip_grad_norm: float | None
    gradient_as_bucket_view: bool
    precision: Any  # a PrecisionPolicy: ``stored``, ``needs_grad_scaler``
    accumulation_steps: int  # the window's micro-batches
    zero_grad: str  # where the gradients are cleared (a ZeroGrad: "after-step", ...)


class Schedule(Protocol):
    """What a schedule answers (Note [one schedule], autofit/parallel/schedule.py): ``Sequential``'s, and a
    dimension's own (:meth:`Dimension.schedule`). ``layout``: the step's ``Parallel`` (layout.py imports this);
    ``window``: the step's micro-batches, a ``schedule.Window`` (which imports this)."""

    micro_batches: int
    in_flight: int

    def simulated(self, window: int) -> int: ...

    def note(self) -> str: ...  # what the schedule costs in time, for the estimate's notes ("" where nothing)

    def run(self, model: nn.Module, layout: Any, window: Any, *, count: int | None = None,
            sync: Callable[..., contextlib.AbstractContextManager[Any]] = ...) -> list[Any]: ...


# Note [a dimension's share of memory]
#     The floors of the planner's ladder (autofit/solve/ladder.py) and the terms that name a large share of the peak
#     (autofit/solve/terms.py) need one rank's share of the parameters, gradients and optimizer state, and what the
#     layout keeps gathered between forward and backward, before any simulation. Each dimension declares its part
#     and the :class:`Layout` multiplies them, so that a new dimension's share reaches every floor without an edit
#     there:
#       - ``model_ways``: the ways a dimension splits the model a rank computes with (tensor parallel: its degree;
#         counted over the whole model, though only the split layers are, as a floor may be: Note [ruled out by
#         arithmetic], autofit/planning/race.py); 1 where each rank computes with every parameter (data parallel);
#       - ``state_ways``: the ways it further shards what a rank keeps at rest, the parameters, gradients and
#         optimizer state of its part of the model (FSDP2's shard dim: its degree); replicas divide nothing;
#       - ``kept_gathered``: the share of its part of the model a rank keeps gathered (whole) from the end of
#         forward to backward, in the compute dtype: FSDP2's ZeRO-2 all of it, a reshard to groups of k 1/k, ZeRO-3
#         nothing (one unit at a time, which the simulation counts).
#     One rank's states are the whole over ``Layout.state_ways`` (the product of every dimension's two ways: FSDP2's
#     shard group, ``Parallel.shard_group``), what it keeps gathered ``Layout.kept_gathered`` of the whole model.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dimension:
    """A way a step is split across GPUs (Note [layout dimensions]): one frozen instance per module of
    ``autofit/parallel/``. The defaults plan nothing and refuse nothing; a dimension overrides what it decides."""

    name: str  # its mesh dim's name (torchtitan's: "dp_replicate", "dp_shard", "tp")
    mesh_rank: int  # where its dim sits in the mesh: lower is outer (torchtitan: pp, dp_replicate, dp_shard, cp, tp)
    shares_rows: bool  # its ranks work on the same rows (tensor, context parallel) rather than different ones
    field: str  # the option a user sets its degree with, as messages name it ("tensor_parallel")

    def choices(self, space: Any) -> Iterable[Placement]:
        """The placements the planner tries for this dimension, read from ``space`` (the plan's request): one of
        degree 1 (the dimension unused) by default."""
        return (Placement(self.name),)

    def check(self, layout: Layout) -> None:
        """Raise :class:`~autofit.core.errors.InvalidInputError` naming :attr:`field` where ``layout`` breaks this
        dimension's rules (its degree and options against the others')."""

    def check_step(self, layout: Layout, placement: Placement, step: StepKnobs) -> None:
        """Raise :class:`~autofit.core.errors.InvalidInputError` where ``step``'s knobs cannot run under this
        dimension's ``placement`` (``Parallel.check_step``, which ``StepConfig`` runs where it is built), the message
        naming the knob and the fix: nothing by default."""

    def plannable(self, layout: Layout, space: Any) -> bool:
        """Whether the planner tries ``layout`` (valid by every rule) for ``space``: False skips what torch refuses
        at run time, or what this request cannot run."""
        return True

    def collective_seconds(self, layout: Layout, placement: Placement, links: Links, param_bytes: float,
                           grad_bytes: float, micro_batches: int) -> float:
        """Seconds of this dimension's collectives in one optimizer step of ``micro_batches`` over ``links`` (no
        overlap with compute assumed: a ranking, not a forecast), of parameters and gradients of ``param_bytes`` and
        ``grad_bytes`` whole; ``layout`` is the data-parallel part of a step's layout (tensor parallel's all-reduces,
        which need the analysis' activation sizes, are counted apart: :meth:`rank_work`)."""
        return 0.0

    def rank_work(self, layout: Layout, placement: Placement, work: RankWork, inputs: WorkInputs) -> RankWork:
        """``work`` with this dimension's share taken (the ops one rank of its group computes, the parameter bytes
        it holds, its own collectives' seconds added): unchanged by default."""
        return work

    def model_ways(self, layout: Layout, placement: Placement) -> int:
        """The ways this dimension splits the model one rank computes with (Note [a dimension's share of memory]):
        1 by default, every rank computing with every parameter."""
        return 1

    def state_ways(self, layout: Layout, placement: Placement) -> int:
        """The ways this dimension shards a rank's parameters, gradients and optimizer state at rest, beyond
        :meth:`model_ways` (Note [a dimension's share of memory]): 1 by default."""
        return 1

    def kept_gathered(self, layout: Layout, placement: Placement) -> Fraction:
        """The share of its part of the model one rank keeps gathered from the end of forward to backward (Note [a
        dimension's share of memory]): nothing by default."""
        return Fraction(0)

    def cut(self, model: nn.Module, layout: Layout, placement: Placement, inputs: ApplyInputs) -> nn.Module:
        """``model`` (this rank's own copy) with what this rank does not hold removed, before any dimension is
        applied (``apply.apply_layout``, outermost first): unchanged by default."""
        return model

    def kept_between_steps(self, model: nn.Module, layout: Layout, placement: Placement) -> list[Any]:
        """The tensors this dimension's machinery keeps from one step of the laid-out ``model`` to the next (a
        pipeline's receive buffers), which ``measure`` counts as the step's own: none by default."""
        return []

    def runs(self, model: nn.Module, layout: Layout, placement: Placement) -> tuple[nn.Module, ...]:
        """The modules this rank's step calls on the cut ``model``, each a root of its own (FSDP2 shards each as
        torchtitan shards each model part of a pipeline): () by default, the model itself."""
        return ()

    def ranks_differ(self, layout: Layout, placement: Placement) -> bool:
        """Whether the ranks along this dimension run different steps (a pipeline's stages), each simulated
        (:attr:`Layout.distinct_ranks`): False by default, one rank standing for the others."""
        return False

    def apply(self, model: nn.Module, layout: Layout, placement: Placement, inputs: ApplyInputs) -> nn.Module:
        """``model`` (an ``nn.Module``) with this dimension applied on this rank (``apply.apply_layout``, after
        the dimensions inside it in the mesh): unchanged by default."""
        return model

    def micro_batch_context(self, model: nn.Module, layout: Layout, placement: Placement, *, last: bool
                            ) -> contextlib.AbstractContextManager[Any]:
        """The context one micro-batch runs in on the laid-out ``model`` (``last``: the window's last): none."""
        return contextlib.nullcontext()

    def schedule(self, layout: Layout, placement: Placement, micro_batches: int) -> Schedule | None:
        """The schedule that runs a window's ``micro_batches`` under this dimension (``schedule.schedule_of``), or
        None where it leaves them to sequential accumulation (the default)."""
        return None

    def words(self, layout: Layout, placement: Placement, *, ranks: bool = False, after_forward: str = "") -> str:
        """This dimension's part of the layout in words (``Layout.words``: plan notes, ``Parallel.label``,
        ``Plan.layout``), or "" where it says nothing (degree 1, or another dimension words it); ``ranks``: with
        the rank count where the dimension gives one, ``after_forward`` after an int reshard's group."""
        return ""

    def trade(self, layouts: Sequence[Layout]) -> str:
        """What this dimension trades, memory against time, in words, for the note that says why a layout won
        the planner's race (``emit.plan.why_layout``) over ``layouts``, the race's layouts: "" where none uses it
        (the default: the data-parallel dims share one sentence there)."""
        return ""

    def export(self, framework: str, layout: Layout, placement: Placement, inputs: ExportInputs) -> ExportFragment:
        """This dimension's part of ``framework``'s export (one of :data:`FRAMEWORKS`) for ``layout``, of which
        ``placement`` is its own (degree 1 included: the frameworks that name every degree write 1), with the plan's
        plain values ``inputs``: nothing by default."""
        return ExportFragment()


class Registry:
    """The layout dimensions in force, in enumeration order (:func:`enumerate_layouts`); a name registered twice is
    refused. :data:`autofit.parallel.DIMENSIONS` is autofit's; a test builds its own."""

    def __init__(self, dimensions: Iterable[Dimension] = ()) -> None:
        self._dimensions: dict[str, Dimension] = {}
        for dimension in dimensions:
            self.register(dimension)

    def register(self, dimension: Dimension) -> Dimension:
        if dimension.name in self._dimensions:
            raise ValueError(f"layout dimension {dimension.name!r} is registered twice: each dimension is one module "
                             "of autofit/parallel/ with its own mesh dim name")
        if any(d.mesh_rank == dimension.mesh_rank for d in self._dimensions.values()):
            raise ValueError(f"layout dimension {dimension.name!r} takes mesh position {dimension.mesh_rank}, "
                             "which another holds: each dimension has its own place in the mesh")
        self._dimensions[dimension.name] = dimension
        return dimension

    def __iter__(self) -> Iterator[Dimension]:
        return iter(self._dimensions.values())

    def __getitem__(self, name: str) -> Dimension:
        return self._dimensions[name]

    def __contains__(self, name: object) -> bool:
        return name in self._dimensions

    def in_mesh_order(self, names: Iterable[str]) -> list[Dimension]:
        return sorted((self._dimensions[n] for n in names), key=lambda d: d.mesh_rank)

    def layout(self, world_size: int, placements: Iterable[Placement], gpus_per_node: int = 0) -> Layout:
        """The layout of ``placements`` over ``world_size`` ranks (``gpus_per_node`` of them per node; 0: one node),
        checked: the placement whose degree is None takes the ranks the others leave; every dimension's rules
        run."""
        placements = list(placements)
        rest = [p for p in placements if p.degree is None]
        if len(rest) > 1:
            raise ValueError(f"only one dimension takes the ranks the others leave, got {[p.dimension for p in rest]}")
        for p in placements:  # the degrees as given: each dimension names its own field when it does not divide
            if p.degree is not None:
                self[p.dimension].check(Layout(world_size, (p,), self, partial=True))
        fixed = math.prod(p.degree for p in placements if p.degree is not None)
        if world_size % fixed:
            names = " x ".join(f"{self[p.dimension].field} {p.degree}" for p in placements if p.degree is not None)
            raise InvalidInputError(f"{names} does not divide world_size {world_size}: the mesh's dims multiply to "
                                    "the ranks; choose degrees whose product divides it")
        placements = [dataclasses.replace(p, degree=world_size // fixed) if p.degree is None else p
                      for p in placements]
        order = {d.name: i for i, d in enumerate(self.in_mesh_order(p.dimension for p in placements))}
        layout = Layout(world_size, tuple(sorted(placements, key=lambda p: order[p.dimension])), self, gpus_per_node)
        if math.prod(p.degree for p in layout.placements) != world_size:
            raise InvalidInputError(
                f"the degrees {', '.join(f'{self[p.dimension].field} {p.degree}' for p in layout.placements)} "
                f"multiply to {math.prod(p.degree for p in layout.placements)}, not world_size {world_size}")
        for p in layout.placements:
            self[p.dimension].check(layout)
        return layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """The placements of one layout, in mesh order (Note [layout dimensions]). ``partial``: one placement checked
    alone, before the others are known (its degree against the world size)."""

    world_size: int
    placements: tuple[Placement, ...]
    registry: Registry = dataclasses.field(compare=False, repr=False)
    gpus_per_node: int = 0  # ranks per node (their collectives run over NVLink); 0: every rank on one node
    partial: bool = dataclasses.field(default=False, compare=False, repr=False)

    def placement(self, name: str) -> Placement | None:
        """The placement of dimension ``name``, or None where the layout does not use it."""
        return next((p for p in self.placements if p.dimension == name), None)

    def degree(self, name: str) -> int:
        """The degree of dimension ``name`` (1 where the layout does not use it)."""
        p = self.placement(name)
        return 1 if p is None else p.degree

    @property
    def data_ranks(self) -> int:
        """The ranks that train different rows: the world size over :attr:`row_copies` (one tensor-parallel group
        trains the same rows)."""
        return self.world_size // self.row_copies

    @property
    def row_copies(self) -> int:
        """How many ranks train each row: the product of the degrees of the dimensions whose ranks share rows (a
        tensor-parallel group's T ranks count the group's rows T times over)."""
        return math.prod(p.degree for p in self.placements if self.registry[p.dimension].shares_rows)

    def data_rank(self, rank: int) -> int:
        """Which of the :attr:`data_ranks` global ``rank`` is: the index of the rows it trains. Ranks fill the mesh
        row-major, the last dim fastest (``init_device_mesh``); the ranks along a dimension whose ranks share rows
        train the same rows, so only the other dims' coordinates count (dp_shard x tp: ``rank // T``, a
        tensor-parallel group being consecutive ranks)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not one of the layout's {self.world_size} ranks")
        index, stride = 0, 1
        for p in reversed(self.placements):  # the last dim first: its coordinate is the rank modulo its degree
            if not self.registry[p.dimension].shares_rows:
                index += (rank % p.degree) * stride
                stride *= p.degree
            rank //= p.degree
        return index

    def rank_work(self, work: RankWork, inputs: WorkInputs) -> RankWork:
        """One rank's share of ``work`` (the whole model's, as analysed): each dimension's
        (:meth:`Dimension.rank_work`) taken in mesh order."""
        for p in self.placements:
            work = self.registry[p.dimension].rank_work(self, p, work, inputs)
        return work

    @property
    def model_ways(self) -> int:
        """The ways the model one rank computes with is split: the product of its dimensions'
        (:meth:`Dimension.model_ways`; tensor parallel's degree), Note [a dimension's share of memory]."""
        return math.prod(self.registry[p.dimension].model_ways(self, p) for p in self.placements)

    @property
    def state_ways(self) -> int:
        """The ways one rank's parameters, gradients and optimizer state are a share of the whole: :attr:`model_ways`
        times every dimension's :meth:`Dimension.state_ways` (FSDP2's shard group, ``Parallel.shard_group``)."""
        return self.model_ways * math.prod(self.registry[p.dimension].state_ways(self, p) for p in self.placements)

    @property
    def kept_gathered(self) -> Fraction:
        """The share of the whole model one rank keeps gathered from the end of forward to backward: the
        dimensions' (:meth:`Dimension.kept_gathered`) of its part of the model, over :attr:`model_ways`."""
        return sum((self.registry[p.dimension].kept_gathered(self, p) for p in self.placements),
                   Fraction(0)) / self.model_ways

    @property
    def distinct_ranks(self) -> tuple[int, ...]:
        """The global ranks whose steps differ, one per coordinate along the dimensions whose ranks differ
        (:meth:`Dimension.ranks_differ`), every other coordinate 0; ``(0,)`` where one rank stands for all. Ranks
        fill the mesh row-major, the last dim fastest (``init_device_mesh``)."""
        ranks, stride = [0], 1
        for p in reversed(self.placements):
            if self.registry[p.dimension].ranks_differ(self, p):
                ranks = [r + c * stride for c in range(p.degree) for r in ranks]
            stride *= p.degree
        return tuple(sorted(ranks))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh: one dim per dimension of degree > 1, in mesh order; ``(world_size,)`` when none is."""
        return tuple(p.degree for p in self.placements if p.degree > 1) or (self.world_size,)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        """The mesh dims' names, as :attr:`mesh_shape` lays them out (the dimensions' names)."""
        return tuple(p.dimension for p in self.placements if p.degree > 1) or (self.placements[0].dimension
                                                                               if self.placements else "world",)

    def words(self, *, ranks: bool = False, after_forward: str = "", alone: str = "one process") -> str:
        """The layout in words: its dimensions' (:meth:`Dimension.words`) in mesh order, joined by " x " ('ddp',
        'fsdp2 (ZeRO-3) over 8 ranks', 'hsdp 2 x 4 (ZeRO-2)', 'fsdp2 (ZeRO-3) x tp 8', 'tp 8 + sequence
        parallel'); ``alone`` without placements (no strategy: ``Plan.layout`` says "None"), "one process" where
        every dimension has degree 1 (DDP over one rank)."""
        if not self.placements:
            return alone
        parts = [self.registry[p.dimension].words(self, p, ranks=ranks, after_forward=after_forward)
                 for p in self.placements]
        return " x ".join(part for part in parts if part) or "one process"

    def export(self, framework: str, inputs: ExportInputs) -> ExportFragment:
        """This layout's part of ``framework``'s export: its dimensions' fragments (:meth:`Dimension.export`)
        merged, the settings outermost first, the notes innermost first, then what the framework cannot express
        (Note [layout dimensions]); nothing for one process (no placements)."""
        if framework not in FRAMEWORKS:
            raise ValueError(f"unknown export framework {framework!r}: one of {', '.join(FRAMEWORKS)}")
        fragments = [self.registry[p.dimension].export(framework, self, p, inputs) for p in self.placements]
        settings: dict[str, Any] = {}
        for fragment in fragments:
            merge_settings(settings, fragment.settings)
        return ExportFragment(settings, tuple(n for f in reversed(fragments) for n in f.notes),
                              tuple(n for f in reversed(fragments) for n in f.unexpressed))


def enumerate_layouts(registry: Registry, world_size: int, space: Any) -> list[Layout]:
    """Every layout the planner tries over ``world_size`` ranks: the product of each registered dimension's
    :meth:`~Dimension.choices` for ``space``, in registration order (the first outermost), keeping those every
    dimension's rules accept and every dimension finds plannable; equal layouts once."""
    found: dict[Layout, None] = {}
    for combination in itertools.product(*(tuple(d.choices(space)) for d in registry)):
        try:
            layout = registry.layout(world_size, combination)
        except InvalidInputError:  # e.g. a reshard to one node's GPUs when HSDP's shard group is one node
            continue
        if all(registry[p.dimension].plannable(layout, space) for p in layout.placements):
            found.setdefault(layout)
    return list(found)
