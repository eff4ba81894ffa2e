"""The layout's choices for the planner (Note [layout dimensions], autofit/parallel/dimension.py): the layouts of a
strategy to plan, which modules FSDP2 shards as units, and the floor of a layout's collectives that orders them.

Units follow FSDP2's documented practice (torchtitan's ``apply_fsdp``: one ``fully_shard`` per transformer block,
then the root): the children of the model's largest ``nn.ModuleList`` / ``nn.Sequential`` (by parameters) with at
least two parametrised children; failing that, every top-level child that holds parameters.

The collectives' time of a layout is its dimensions' (``collective_seconds``, autofit/parallel/step_time.py, over
``autofit/parallel/collectives.py``'s links and rings); here, what the planner derives from it: the floor that
orders layouts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Protocol

from torch import nn

from autofit.parallel import DIMENSIONS, enumerate_layouts
from autofit.parallel.collectives import Links
from autofit.core.errors import InvalidInputError
from autofit.parallel.layout import Parallel, from_layout, further_dimensions
from autofit.parallel.step_time import collective_seconds

__all__ = ["LayoutRequest", "layouts", "shard_units", "collective_floor"]


class LayoutRequest(Protocol):
    """What :func:`layouts` (through the layout dimensions' choices and rules) and :func:`collective_floor` read of
    the request (``autofit.request.PlanRequest`` has these fields). The request is built after this layer in the
    import order, and so are the batch and the device target, so this module names the fields it reads instead of
    importing their types (no import against the pipeline, annotations included: tests/test_architecture.py)."""

    @property
    def model(self) -> nn.Module: ...
    @property
    def batch(self) -> Any: ...  # autofit.training.batch.Batch
    @property
    def device(self) -> Any: ...  # autofit.device.DeviceTarget: its links (``Links.of``)
    @property
    def world_size(self) -> int: ...
    @property
    def gpus_per_node(self) -> int: ...  # ranks per node (0: one node)
    @property
    def reshard_options(self) -> tuple[bool | int, ...]: ...
    @property
    def replicate_options(self) -> tuple[int, ...]: ...
    @property
    def tensor_options(self) -> tuple[int, ...]: ...
    @property
    def layout_options(self) -> Any: ...  # the user's autofit.Layout as given (options.py stands above this layer)
    @property
    def clip_grad_norm(self) -> float | None: ...


def layouts(request: LayoutRequest, strategy: str | None) -> list[Parallel]:
    """The layouts of ``strategy`` to plan (docs/multi-gpu.md, "How the planner chooses"): one process, DDP, or
    FSDP2's, the layout dimensions' enumeration (``autofit.parallel.enumerate_layouts``: every tensor-parallel
    degree, HSDP replicate size and reshard option the request allows that the dimensions' rules accept). The
    dimensions registered after the first ones (``Parallel.more_dimensions``) join DDP's replicas and FSDP2's layouts
    alike, where their rules accept them."""
    if strategy is None:
        return [Parallel()]
    base = Parallel(strategy=strategy, world_size=request.world_size, gpus_per_node=request.gpus_per_node)
    if not base.shards_parameters:  # DDP's replicas, beside each combination of the further dimensions' choices
        found = []
        for more in itertools.product(*(d.choices(request) for d in further_dimensions())):
            try:
                found.append(replace(base, more_dimensions=tuple(p for p in more if p.degree != 1)))
            except InvalidInputError:  # a further dimension's rules refuse replicas beside it
                continue
        return found
    units = shard_units(request.model)
    found = (from_layout(layout, gpus_per_node=request.gpus_per_node, shard_units=units)
             for layout in enumerate_layouts(DIMENSIONS, request.world_size, request))
    return list(dict.fromkeys(found))


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def shard_units(model: nn.Module) -> tuple[str, ...]:
    best: tuple[int, tuple[str, ...]] = (0, ())
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and module is not model:
            children = [(f"{name}.{child}" if name else child, m) for child, m in module.named_children()]
            with_params = [n for n, m in children if _param_count(m) > 0]
            total = _param_count(module)
            if len(with_params) >= 2 and total > best[0]:
                best = (total, tuple(with_params))
    if best[1]:
        return best[1]
    return tuple(name for name, child in model.named_children() if _param_count(child) > 0)


def collective_floor(request: LayoutRequest, parallel: Parallel, stored_itemsizes: Iterable[int] = ()) -> float:
    """Seconds of ``parallel``'s data-parallel collectives in a step of one micro-batch (the fewest all-gathers),
    over the part of the parameters a rank computes with (``Layout.model_ways``: split T ways under tensor parallel,
    Note [a dimension's share of memory]), each floating one in the fewest bytes of its own and
    ``stored_itemsizes`` (the stored precisions a plan may choose; none: as the model holds them). With none, the
    order the planner tries layouts in (Note [layouts that cannot win], planning/climb.py); with a layout's rungs'
    stored precisions, a floor of every rung's modelled step, which adds them to the compute, not overlapped
    (solve/time_model.py; Note [ruled out by arithmetic], planning/race.py). Tensor parallel's all-reduces, which
    need the analysis' activation sizes, are left out."""
    if parallel.strategy is None or parallel.data_ranks <= 1:
        return 0.0
    least = min(stored_itemsizes, default=None)
    nbytes = sum(p.numel() * (min(p.element_size(), least) if least is not None and p.is_floating_point()
                              else p.element_size()) for p in request.model.parameters()) // parallel.layout.model_ways
    return collective_seconds(parallel.data_parallel, Links.of(request.device), nbytes, nbytes, 1)
