"""Layout dimensions as registered objects (Note [layout dimensions], autofit/parallel/dimension.py): a new dimension
is one registered object, and the enumeration, the rules, the mesh and the data ranks take it in without a change
to autofit/. The truths are hand counts: 8 ranks, a toy dimension of degree 2 whose ranks share their rows."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from fractions import Fraction
from types import SimpleNamespace

import pytest

from autofit.core.errors import InvalidInputError
from autofit.parallel import DIMENSIONS, Dimension, Placement, Registry, enumerate_layouts
from autofit.parallel.dimension import RankWork, WorkInputs
from autofit.parallel.layout import Parallel


class _Toy(Dimension):
    """Degree 2, its ranks share their rows (as context parallel's do), nothing to apply; it refuses HSDP."""

    def choices(self, space):
        return (Placement(self.name, 2),)

    def check(self, layout):
        if not layout.partial and layout.degree(self.name) > 1 and layout.degree("dp_replicate") > 1:
            raise InvalidInputError("toy_parallel does not compose with replicate > 1: leave replicate=1")

    def words(self, layout, placement, *, ranks=False, after_forward=""):
        return f"toy {placement.degree}"


TOY = _Toy(name="toy", mesh_rank=3, shares_rows=True, field="toy_parallel")  # between dp_shard (2) and tp (4)


def _registry() -> Registry:
    local = Registry(DIMENSIONS)  # autofit's dimensions, copied: the toy never reaches DIMENSIONS
    local.register(TOY)
    return local


# what the built-in dimensions read of a plan's request (autofit.request.PlanRequest's fields of the same names)
SPACE = SimpleNamespace(world_size=8, gpus_per_node=8, replicate_options=(1, 2), reshard_options=(True, False),
                        tensor_options=(1,), clip_grad_norm=None,
                        layout_options=SimpleNamespace(tensor_parallel_plan=None))


def test_layouts_enumerate_a_registered_dimension():
    found = enumerate_layouts(_registry(), 8, SPACE)
    # replicate 2 is refused by the toy's rule; the two reshard options stay: 2 layouts, each with the toy at 2
    assert [p.option("reshard_after_forward") for layout in found for p in layout.placements
            if p.dimension == "dp_shard"] == [True, False]
    for layout in found:
        assert layout.degree("toy") == 2
        assert layout.degree("dp_shard") == 4  # the ranks the others leave: 8 / 2
        assert layout.data_ranks == 4  # the toy's ranks share their rows: 8 / 2
        assert layout.mesh_shape == (4, 2) and layout.mesh_names == ("dp_shard", "toy")
    # its words, in mesh order after FSDP2's (over the 8 / 2 ranks the shard dim has)
    assert [layout.words(ranks=True) for layout in found] == ["fsdp2 (ZeRO-3) over 4 ranks x toy 2",
                                                              "fsdp2 (ZeRO-2) over 4 ranks x toy 2"]
    assert "toy" not in DIMENSIONS
    # the same request without the toy: replicate 2 (HSDP) is planned too, over every rank
    plain = enumerate_layouts(DIMENSIONS, 8, SPACE)
    assert [(layout.degree("dp_replicate"), layout.data_ranks) for layout in plain] == [(1, 8), (1, 8), (2, 8), (2, 8)]


def test_the_rules_and_the_mesh_take_it_in():
    local = _registry()
    with pytest.raises(InvalidInputError, match="toy_parallel does not compose with replicate"):
        local.layout(8, [Placement("dp_replicate", 2), Placement("dp_shard", None), Placement("toy", 2)])
    with pytest.raises(InvalidInputError, match="toy_parallel 3 does not divide world_size 8"):
        local.layout(8, [Placement("dp_shard", None), Placement("toy", 3)])
    # in mesh order whatever the order given: dp_shard (2), toy (3), tp (4); two dims share rows: 8 / (2 x 2)
    layout = local.layout(8, [Placement("tp", 2), Placement("toy", 2), Placement("dp_shard", None)])
    assert layout.mesh_shape == (2, 2, 2) and layout.mesh_names == ("dp_shard", "toy", "tp")
    assert layout.data_ranks == 2
    with pytest.raises(ValueError, match="registered twice"):
        local.register(TOY)
    with pytest.raises(ValueError, match="mesh position 3"):
        local.register(_Toy(name="other", mesh_rank=3, shares_rows=False, field="other"))


def test_the_step_layout_is_the_dimensions_placements():
    """``Parallel`` (the step's layout) derives its data ranks and mesh from the same placements: hand counts."""
    hsdp = Parallel(strategy="fsdp2", world_size=16, replicate=2, reshard_after_forward=4)
    assert hsdp.layout.mesh_shape == (2, 8) and hsdp.layout.mesh_names == ("dp_replicate", "dp_shard")
    assert hsdp.data_ranks == 16
    tp = Parallel(strategy="fsdp2", world_size=16, tensor_parallel=4, tensor_plan=(("w", "colwise"),))
    assert tp.layout.mesh_shape == (4, 4) and tp.data_ranks == 4
    alone = Parallel(strategy="fsdp2", world_size=4, tensor_parallel=4, tensor_plan=(("w", "colwise"),))
    assert alone.layout.mesh_names == ("tp",) and alone.data_ranks == 1
    assert Parallel(strategy="ddp", world_size=4).layout.mesh_shape == (4,)
    with pytest.raises(InvalidInputError, match="shard group size 8"):
        Parallel(strategy="fsdp2", world_size=16, replicate=2, reshard_after_forward=3)


def test_a_dimension_without_a_field_of_its_own_travels_in_the_step_layout(monkeypatch):
    """A dimension registered beyond the first ones adds no field to ``Parallel``: its placement rides in
    ``Parallel.more_dimensions`` from the planner's enumeration (``choices.layouts``) and from the user's layout of
    one step (``requested.step_layout``) to the mesh, the data ranks, the data-parallel part the collectives run over
    and a plan's JSON. Hand counts: FSDP2 over 8 ranks with the toy at 2, whose ranks share rows: 4 data ranks."""
    import json

    import torch
    from torch import nn

    from autofit.parallel.choices import layouts
    from autofit.parallel.layout_json import json_fields, layout_from_json
    from autofit.parallel.requested import step_layout

    monkeypatch.setitem(DIMENSIONS._dimensions, TOY.name, TOY)  # registered for this test only (``Registry``)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    request = SimpleNamespace(**{**vars(SPACE), "model": model, "replicate_options": (1,), "reshard_options": (True,)})
    (planned,) = layouts(request, "fsdp2")
    assert planned.more_dimensions == (Placement("toy", 2),)
    assert planned.layout.mesh_names == ("dp_shard", "toy") and planned.layout.mesh_shape == (4, 2)
    assert planned.data_ranks == 4 and planned.rank_rows(32) == 8
    assert planned.label == "fsdp2 (ZeRO-3) over 4 ranks x toy 2"
    assert planned.fully_sharded  # FSDP2 has the 4 ranks the toy leaves
    data = planned.data_parallel  # the toy's ranks share rows: the collectives run over the 4 data ranks
    assert (data.world_size, data.more_dimensions, data.layout.mesh_shape) == (4, (), (4,))
    # a plan's JSON: the toy's placement written where it is one, read back equal
    written = json.loads(json.dumps({k: v for after in ("estimate", "notes", "offload")
                                     for k, v in json_fields(planned, after).items()}))
    assert written["more_dimensions"] == [["toy", 2, []]]
    assert Parallel(**layout_from_json(written)) == planned
    assert "more_dimensions" not in json_fields(Parallel(strategy="fsdp2", world_size=8), "notes")
    # the user's layout of one step: the toy's choices over the step's values, as estimate reads them
    user = SimpleNamespace(world_size=8, strategy="fsdp2", reshard_after_forward=True, replicate=1,
                           tensor_parallel=1, tensor_parallel_plan=None, gpus_per_node=None)
    one = step_layout(model, user, SimpleNamespace(offload_states=False, reduce_every_micro_batch=False,
                                                   clip_grad_norm=None), [torch.zeros(8, 4)])
    assert one.more_dimensions == (Placement("toy", 2),) and one.data_ranks == 4
    # its rules run where the layout is built: the toy refuses HSDP, and so DDP's replicas beside it
    with pytest.raises(InvalidInputError, match="toy_parallel does not compose with replicate"):
        Parallel(strategy="fsdp2", world_size=8, replicate=2, more_dimensions=(Placement("toy", 2),))
    assert layouts(request, "ddp") == []


class _Either(_Toy):
    """The toy at degree 1 or 2, with no rule of its own."""

    def choices(self, space):
        return (Placement(self.name, 1), Placement(self.name, 2))

    def check(self, layout):
        pass


def test_a_dimension_without_a_field_of_its_own_joins_ddps_replicas(monkeypatch):
    """DDP's replicas take the ranks the further dimensions leave: over 8 ranks, DDP alone and DDP 4 x the toy 2 (the
    toy's ranks share rows: 4 data ranks, the all-reduce over them)."""
    from torch import nn

    from autofit.parallel.choices import layouts

    either = _Either(name="toy", mesh_rank=3, shares_rows=True, field="toy_parallel")
    monkeypatch.setitem(DIMENSIONS._dimensions, either.name, either)
    request = SimpleNamespace(**{**vars(SPACE), "model": nn.Linear(4, 4)})
    alone, beside = layouts(request, "ddp")
    assert alone == Parallel(strategy="ddp", world_size=8, gpus_per_node=8) and alone.layout.mesh_shape == (8,)
    assert beside.more_dimensions == (Placement("toy", 2),)
    assert beside.layout.mesh_names == ("dp_replicate", "toy") and beside.layout.mesh_shape == (4, 2)
    assert beside.data_ranks == 4 and beside.data_parallel == Parallel(strategy="ddp", world_size=4, gpus_per_node=8)
    assert beside.label == "ddp x toy 2"


class _Split(_Toy):
    """The toy splitting the model a rank computes with in two (as a pipeline's stages do), sharding nothing more."""

    def model_ways(self, layout, placement):
        return placement.degree


def test_a_dimensions_share_of_memory_is_the_layouts():
    """Note [a dimension's share of memory]: a rank's states are the whole over every dimension's ways, what it keeps
    gathered the shard dim's share of the rank's part of the model. Hand counts over 8 and 16 ranks."""
    local = Registry(DIMENSIONS)
    local.register(_Split(name="toy", mesh_rank=3, shares_rows=True, field="toy_parallel"))
    zero2 = local.layout(8, [Placement("dp_shard", None, (("reshard_after_forward", False),)), Placement("toy", 2)])
    # FSDP2 over 4 ranks of each half of the model: 1/8 of the states; ZeRO-2 keeps the rank's half gathered
    assert (zero2.model_ways, zero2.state_ways, zero2.kept_gathered) == (2, 8, Fraction(1, 2))
    zero3 = local.layout(8, [Placement("dp_shard", None), Placement("toy", 2)])
    assert (zero3.state_ways, zero3.kept_gathered) == (8, 0)
    # the built-in dimensions, through the step's layout: HSDP 2 x 8 resharding to 4 after forward
    hsdp = Parallel(strategy="fsdp2", world_size=16, replicate=2, reshard_after_forward=4)
    assert (hsdp.shard_group, hsdp.layout.kept_gathered) == (8, Fraction(1, 4))  # 16 // 2; a quarter of 8 shards
    # FSDP2 (ZeRO-2) x TP 4: a rank computes with a quarter of the model, keeps it gathered, its states over 16
    tp = Parallel(strategy="fsdp2", world_size=16, tensor_parallel=4, reshard_after_forward=False,
                  tensor_plan=(("w", "colwise"),))
    assert (tp.layout.model_ways, tp.shard_group, tp.layout.kept_gathered) == (4, 16, Fraction(1, 4))
    ddp = Parallel(strategy="ddp", world_size=4)  # whole replicas: nothing divided, nothing gathered apart
    assert (ddp.shard_group, ddp.layout.kept_gathered) == (1, 0)
    assert (Parallel().shard_group, Parallel().layout.kept_gathered) == (1, 0)


def test_the_layout_decides_where_gradients_wait_and_where_the_states_go_to_the_host():
    """``Parallel.defers_gradients`` (Note [gradient sync under accumulation]) and ``Parallel.states_on_host`` (Note
    [offload]): FSDP2 over data ranks defers unless told to reduce every micro-batch or keeping the states on the
    host; the host layout of FSDP2 is itself with CPUOffloadPolicy, of one process FSDP2 over itself, of DDP and
    tensor parallel none."""
    fsdp = Parallel(strategy="fsdp2", world_size=4)
    assert fsdp.defers_gradients
    assert not Parallel(strategy="fsdp2", world_size=4, reduce_every_micro_batch=True).defers_gradients
    assert not Parallel(strategy="ddp", world_size=4).defers_gradients
    tp_alone = Parallel(strategy="fsdp2", world_size=2, tensor_parallel=2, tensor_plan=(("w", "colwise"),))
    assert not tp_alone.defers_gradients  # no fully_shard: nothing sharded to reduce-scatter
    host = fsdp.states_on_host(lambda: pytest.fail("FSDP2's units are its own"))
    assert host == Parallel(strategy="fsdp2", world_size=4, offload_states=True) and not host.defers_gradients
    assert host.states_on_host(tuple) is None
    one = Parallel().states_on_host(lambda: ("0", "1"))
    assert (one.strategy, one.world_size, one.shard_units, one.offload_states) == ("fsdp2", 1, ("0", "1"), True)
    assert Parallel(strategy="ddp", world_size=4).states_on_host(tuple) is None
    assert Parallel(strategy="fsdp2", world_size=4, tensor_parallel=2,
                    tensor_plan=(("w", "colwise"),)).states_on_host(tuple) is None


class _Staged(_Toy):
    """The toy as a pipeline would take its share of the work: its half of the parameters, one second of sends."""

    def rank_work(self, layout, placement, work, inputs):
        return RankWork(work.ops, work.param_bytes // placement.degree, work.seconds + 1.0)


def test_a_dimensions_share_of_the_work_reaches_the_time_model_through_the_layout():
    """``Layout.rank_work`` folds each dimension's ``rank_work`` in mesh order: hand values, the built-in dimensions
    leaving the work as it is where they split nothing (FSDP2's collectives are priced apart, over the data ranks)."""
    local = Registry(DIMENSIONS)
    local.register(_Staged(name="toy", mesh_rank=3, shares_rows=True, field="toy_parallel"))
    layout = local.layout(8, [Placement("dp_shard", None), Placement("toy", 2), Placement("tp", 1)])
    inputs = WorkInputs(model=None, output_bytes=lambda name: 0.0, rows=4, link_bytes_per_second=1.0)
    ops = object()
    assert local.layout(8, [Placement("dp_shard", None)]).rank_work(RankWork(ops, 1000), inputs) == RankWork(ops, 1000)
    assert layout.rank_work(RankWork(ops, 1000, 0.5), inputs) == RankWork(ops, 500, 1.5)


def test_the_rows_a_rank_trains_follow_the_mesh():
    """Ranks fill the mesh row-major (``init_device_mesh``); the ranks along a dimension whose ranks share rows train
    the same rows. By hand, 8 ranks as dp_shard 2 x toy 2 x tp 2: rank r has coordinates (r // 4, r // 2 % 2, r % 2),
    and both the toy and tp share rows, so its rows are those of data rank r // 4, each row trained by 4 ranks."""
    layout = _registry().layout(8, [Placement("tp", 2), Placement("toy", 2), Placement("dp_shard", None)])
    assert [layout.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.row_copies == 4
    # without the toy, dp_shard 4 x tp 2: a tensor-parallel group is two consecutive ranks (the trainer's rank // T)
    plain = DIMENSIONS.layout(8, [Placement("dp_shard", None), Placement("tp", 2)])
    assert [plain.data_rank(r) for r in range(8)] == [r // 2 for r in range(8)] and plain.row_copies == 2
    # HSDP 2 x 4: every rank trains its own rows
    hsdp = DIMENSIONS.layout(8, [Placement("dp_replicate", 2), Placement("dp_shard", None)])
    assert [hsdp.data_rank(r) for r in range(8)] == list(range(8)) and hsdp.row_copies == 1
    with pytest.raises(ValueError, match="rank 8 is not one of the layout's 8 ranks"):
        plain.data_rank(8)
    # the rows one rank holds of a batch (the step's held_rows): a tensor-parallel group's ranks hold the same ones
    tp = Parallel(strategy="fsdp2", world_size=8, shard_units=("",), tensor_parallel=2, tensor_plan=(("a", "colwise"),))
    assert tp.rank_rows(32) == 8 and Parallel(strategy="ddp", world_size=8).rank_rows(32) == 4
    assert Parallel().rank_rows(32) == 32


def test_a_layout_in_words_names_one_process_as_its_reader_does():
    """``Layout.words``' ``alone`` is what a layout without placements (no strategy) says: "one process" by default,
    ``Plan.layout``'s "None"; DDP over one rank has a placement and stays "one process"."""
    assert Parallel().layout.words() == "one process"
    assert Parallel().layout.words(alone="None") == "None"
    assert Parallel(strategy="ddp", world_size=1).layout.words(alone="None") == "one process"
    assert Parallel(strategy="ddp", world_size=4).layout.words(alone="None") == "ddp"


class _Running(Dimension):
    """A toy that records what a running step asks of it: its apply, its context around each micro-batch, and a
    schedule of its own when ``schedules``."""

    def __init__(self, *, log: list, schedules: bool = False, **fields):
        super().__init__(**fields)
        object.__setattr__(self, "log", log)
        object.__setattr__(self, "schedules", schedules)

    def apply(self, model, layout, placement, inputs):
        self.log.append(("apply", self.name, inputs.shard_units))
        return (self.name, model)

    def micro_batch_context(self, model, layout, placement, *, last):
        @contextlib.contextmanager
        def around():
            self.log.append(("enter", self.name, last))
            yield
            self.log.append(("exit", self.name, last))
        return around()

    def schedule(self, layout, placement, micro_batches):
        return ("schedule of", self.name, micro_batches) if self.schedules else None


def test_a_running_step_asks_each_dimension_innermost_or_outermost_first():
    # the step's three entry points (autofit/parallel/apply.py, schedule.py) read the layout's placements only:
    # a layout of two toys over 4 ranks, outer (mesh position 0) and inner (position 3), each of degree 2
    from autofit.parallel.apply import apply_layout, gradient_sync
    from autofit.parallel.schedule import Sequential, Window, schedule_of

    log: list = []
    outer = _Running(log=log, name="outer", mesh_rank=0, shares_rows=False, field="outer_parallel")
    inner = _Running(log=log, name="inner", mesh_rank=3, shares_rows=True, field="inner_parallel", schedules=True)
    placed = Registry((inner, outer)).layout(4, (Placement("inner", 2), Placement("outer", 2)))
    assert placed.mesh_names == ("outer", "inner")
    step_layout = SimpleNamespace(layout=placed, shard_units=("block",))  # what a Parallel gives them
    # applied innermost first, each wrapping what the one inside made (torchtitan: TP, then FSDP, then DDP)
    assert apply_layout("model", step_layout) == ("outer", ("inner", "model"))
    assert log == [("apply", "inner", ("block",)), ("apply", "outer", ("block",))]
    log.clear()
    # a micro-batch's contexts: outermost entered first, left last; ``last`` as the schedule says
    for last in (False, True):
        with gradient_sync("model", step_layout, last=last):
            log.append(("body", last))
    assert log == [("enter", "outer", False), ("enter", "inner", False), ("body", False), ("exit", "inner", False),
                   ("exit", "outer", False), ("enter", "outer", True), ("enter", "inner", True), ("body", True),
                   ("exit", "inner", True), ("exit", "outer", True)]
    # the first dimension with a schedule of its own runs the window; none: sequential accumulation
    assert schedule_of(step_layout, 3) == ("schedule of", "inner", 3)
    alone = SimpleNamespace(layout=Registry((outer,)).layout(2, (Placement("outer", 2),)))
    assert schedule_of(alone, 3) == Sequential(3)
    # the sequential schedule runs each micro-batch inside the layout's contexts, the last one marked
    log.clear()
    window = Window(2, rows=lambda i: (f"rows {i}", None), place=lambda i: f"place {i}", loss=None,
                    body=lambda i, rows, target, place: log.append(("micro-batch", i, rows, place)) or i)
    assert Sequential(2).run("model", alone, window) == [0, 1]
    assert log == [("enter", "outer", False), ("micro-batch", 0, "rows 0", "place 0"), ("exit", "outer", False),
                   ("enter", "outer", True), ("micro-batch", 1, "rows 1", "place 1"), ("exit", "outer", True)]


@dataclasses.dataclass(frozen=True)
class _AllForwardsFirst:
    """GPipe's order on one stage (torch/distributed/pipelining/schedules.py, ``ScheduleGPipe``): every
    micro-batch's forward and loss, then every backward, each inside the layout's context. It computes the losses
    itself from the window's rows, shares and the step's loss, as torch's pipeline schedules do, and leaves the body."""

    micro_batches: int

    @property
    def in_flight(self) -> int:
        return self.micro_batches

    def simulated(self, window: int) -> int:
        return self.micro_batches

    def run(self, model, layout, window, *, count=None, sync=None):
        from autofit.parallel.apply import gradient_sync

        losses = []
        for i in range(window.size):
            inputs, target = window.rows(i)
            window.on_phase(i, "forward")
            losses.append(window.loss(inputs.call(model), None if target is None else target.value))
        for i, loss in enumerate(losses):
            window.on_phase(i, "backward")
            with (sync or gradient_sync)(model, layout, last=i == window.size - 1):
                (loss * window.place(i).weight).backward()
        return [loss.detach() for loss in losses]


@pytest.mark.sim
def test_a_schedule_that_orders_forwards_and_backwards_itself_trains_from_the_window(monkeypatch):
    """A schedule of a dimension's own (a pipeline's) gets what torch's pipeline schedules take, the window's rows,
    each micro-batch's share and the loss function (Note [one schedule]): run by the trainer over uneven
    micro-batches (4, 4, 2 rows), it steps the model as one full-batch step, written by hand here, does."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import autofit.emit.trainer as trainer_module
    from autofit.core.report import MemoryEstimate
    from autofit.emit.plan import Plan
    from autofit.training.precision import PrecisionPolicy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    x, y = torch.randn(10, 8), torch.randn(10, 1)
    reference = copy.deepcopy(model)
    full = F.mse_loss(reference(x), y)
    full.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()

    plan = Plan(micro_batch_size=4, gradient_accumulation_steps=3, batch_size=10, last_micro_batch_size=2,
                precision=PrecisionPolicy(name="fp32"), checkpoint=(), peak_bytes=1, device_bytes=1, budget_bytes=1,
                device="cpu", optimizer="sgd", predicted_step_seconds=0.0,
                estimate=MemoryEstimate(peak_bytes=1, breakdown={}))
    asked = []
    monkeypatch.setattr(trainer_module, "schedule_of", lambda layout, n: asked.append(n) or _AllForwardsFirst(n))
    trainer = plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.mse_loss)
    loss = trainer.step(x, y)
    trainer.unwrap()
    assert asked == [3]
    assert loss == pytest.approx(full.item(), rel=1e-6)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.sim
def test_a_schedule_that_orders_forwards_and_backwards_itself_is_simulated_as_measured(monkeypatch):
    """The same GPipe-ordered schedule in ``estimate``'s simulation and in ``measure``'s real step, neither caller
    changed: every micro-batch's activations are alive at once before the first backward, a higher peak than
    accumulation's, and the simulation sees the peak the CPU allocator measures."""
    import torch
    from torch import nn

    import autofit
    from autofit.measure import allocator
    from autofit.simulate import window as simulated_window

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    x, y = torch.randn(96, 64), torch.randint(0, 4, (96,))
    kw = dict(target=y, optimizer="sgd", step=autofit.Step(micro_batch_size=32, accumulation_steps=3))
    accumulated = autofit.measure(model, x, **kw).peak_bytes
    for module in (allocator, simulated_window):
        monkeypatch.setattr(module, "schedule_of", lambda layout, n: _AllForwardsFirst(n))
    measured = autofit.measure(model, x, **kw).peak_bytes
    assert measured > accumulated  # three micro-batches' saved activations at once, not one
    assert autofit.estimate(model, x, **kw).peak_bytes == measured
