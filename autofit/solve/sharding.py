"""Data-parallel choices: which modules FSDP2 shards as units, and what the collectives cost per step.

Units follow FSDP2's documented practice (torchtitan's ``apply_fsdp``: one ``fully_shard`` per transformer block,
then the root): the children of the model's largest ``nn.ModuleList`` / ``nn.Sequential`` (by parameters) with at
least two parametrised children; failing that, every top-level child that holds parameters.

The collectives' time of a layout is its dimensions' (``collective_seconds``, autofit/parallel/layout.py, over
``autofit/parallel/collectives.py``'s links and rings); here, what the planner derives from it: the floor that
orders layouts, and tensor parallel's activation all-reduces, which need the analysis' sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from autofit.parallel import DIMENSIONS, enumerate_layouts
from autofit.parallel.collectives import Links, ring_seconds  # re-exported
from autofit.parallel.layout import Parallel, Strategy, collective_seconds, from_layout, layout_words, ranks_per_node  # re-exported: the layout's home is autofit/parallel/

if TYPE_CHECKING:
    from autofit.device import DeviceTarget
    from autofit.training.batch import Batch

__all__ = ["Parallel", "LayoutRequest", "layouts", "tensor_group_bytes", "tensor_reduce_bytes", "split_ops", "layout_words", "shard_units", "collective_seconds", "collective_floor", "ranks_per_node", "Links", "Strategy", "ring_seconds"]


class LayoutRequest(Protocol):
    """What :func:`layouts` (through the layout dimensions, autofit/parallel/) and :func:`collective_floor` read of the request
    (``autofit.request.PlanRequest`` has these fields). The request is built after this stage in the import order,
    so this module names the fields it reads instead of importing the request (no import against the pipeline,
    annotations included: tests/test_architecture.py)."""

    @property
    def model(self) -> nn.Module: ...
    @property
    def batch(self) -> Batch: ...
    @property
    def device(self) -> DeviceTarget: ...
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
    def tensor_parallel_plan(self) -> Mapping[str, Any] | None: ...
    @property
    def clip_grad_norm(self) -> float | None: ...




def layouts(request: LayoutRequest, strategy: str | None) -> list[Parallel]:
    """The layouts of ``strategy`` to plan (docs/multi-gpu.md, "How the planner chooses"): one process, DDP, or
    FSDP2's, the layout dimensions' enumeration (``autofit.parallel.enumerate_layouts``: every tensor-parallel
    degree, HSDP replicate size and reshard option the request allows that the dimensions' rules accept)."""
    if strategy is None:
        return [Parallel()]
    base = Parallel(strategy=strategy, world_size=request.world_size, gpus_per_node=request.gpus_per_node)
    if not base.shards_parameters:
        return [base]
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
    over its parameters split T ways under tensor parallel, each floating one in the fewest bytes of its own and
    ``stored_itemsizes`` (the stored precisions a plan may choose; none: as the model holds them). With none, the
    order the planner tries layouts in (Note [layouts that cannot win], planning/climb.py); with a layout's rungs' stored
    precisions, a floor of every rung's modelled step, which adds them to the compute, not overlapped
    (solve/time_model.py; Note [ruled out by arithmetic], planning/race.py). Tensor parallel's all-reduces, which need the
    analysis' activation sizes, are left out."""
    if parallel.strategy is None or parallel.data_ranks <= 1:
        return 0.0
    least = min(stored_itemsizes, default=None)
    nbytes = sum(p.numel() * (min(p.element_size(), least) if least is not None and p.is_floating_point()
                              else p.element_size()) for p in request.model.parameters()) // parallel.tensor_parallel
    return collective_seconds(parallel.data_parallel, Links.of(request.device), nbytes, nbytes, 1)


def tensor_group_bytes(model: nn.Module, parallel: Parallel) -> int:
    """Parameter bytes one tensor-parallel group's rank holds before FSDP2 shards them: the split weights (and
    column-parallel biases) over T, everything else whole (a row-parallel linear layer replicates its bias; the
    vocabulary-split embedding has its weight only)."""
    split = {name: style for name, style in parallel.tensor_plan}
    total = 0
    for name, module in model.named_modules():
        style = split.get(name)
        for pname, p in module.named_parameters(recurse=False):
            nbytes = p.numel() * p.element_size()
            cut = style in _SPLIT_ALL or (style in _SPLIT_WEIGHT and pname == "weight")
            total += nbytes // parallel.tensor_parallel if cut else nbytes
    return total


# styles whose module's parameters are all split T ways, and those that split the weight only (a row-parallel
# layer's bias is replicated); sequence parallel's norms are replicated (Note [sequence parallel])
_SPLIT_ALL = ("colwise", "colwise_rep", "embedding_rowwise")
_SPLIT_WEIGHT = ("rowwise", "rowwise_sequence")


def tensor_reduce_bytes(model: nn.Module, parallel: Parallel, output_bytes) -> float:
    """Bytes all-reduced per sample in one forward and backward of tensor parallel (Megatron-LM, Shoeybi et al.
    2019, section 3: per transformer block two all-reduces of the activations in forward, after the attention's and
    the MLP's row-parallel layers, and two in backward, of the gradients entering their column-parallel layers).
    torch's styles reduce per layer: ``RowwiseParallel`` its output in forward, ``ColwiseParallel`` its input's
    gradient in backward (``DTensor.from_local``'s backward), so a Llama block reduces 2 + 5 times (q, k, v, gate
    and up separately, where Megatron fuses them into 2). ``output_bytes(name)``: the module's output bytes per
    sample as simulated (row-parallel: whole; column-parallel: its local 1/T, scaled back to its input's size).
    The vocabulary-split embedding all-reduces its output in forward (its input, token ids, has no gradient); the
    output head's "colwise_rep" all-gathers its output in forward, counted as half an all-reduce of the whole
    (a ring all-gather moves (T - 1) / T of it per rank, an all-reduce twice that: nccl-tests PERFORMANCE.md), and
    all-reduces its input's gradient in backward as "colwise" does.

    Sequence parallel (Note [sequence parallel]; Korthikanti et al. 2022, section 4.2.2) swaps each all-reduce for
    an all-gather and a reduce-scatter, each half of it: a row-parallel layer reduce-scatters its output in forward
    and all-gathers its gradient in backward; the module that holds it (the attention, the MLP) all-gathers its
    input in forward and reduce-scatters the summed gradient of its column-parallel layers in backward, so those no
    longer reduce one by one. Each pair is counted on the row-parallel layer, twice its whole output (the residual
    stream's width, the module's input too); the first block all-gathers its input's gradient in backward, the
    final norm gathers its input in forward (half its whole output each); the norms move nothing."""
    sequence = {name for name, style in parallel.tensor_plan if style == "sequence_gather"}
    total = 0.0
    for name, style in parallel.tensor_plan:
        module = model.get_submodule(name)
        out = output_bytes(name)
        if style in ("rowwise", "embedding_rowwise"):
            total += out
        elif style == "colwise_rep":  # the output is whole here
            total += out / 2 + out * module.in_features / module.out_features
        elif style == "rowwise_sequence":  # its output is the rank's 1/T of the sequence
            total += 2 * out * parallel.tensor_parallel
        elif style == "sequence_shard":
            total += out * parallel.tensor_parallel / 2
        elif style == "sequence_gather_whole":
            total += out / 2
        elif style == "colwise" and name.rpartition(".")[0] not in sequence:
            total += out * module.in_features * parallel.tensor_parallel / module.out_features
    return total


def split_ops(ops, parallel: Parallel):
    """``ops`` (OpCosts) with the FLOPs and bytes of the ops inside split modules divided by T: the analysis counts
    a tensor-parallel layer's matmuls at their global shapes, one rank runs its 1/T."""
    if parallel.tensor_parallel == 1:
        return ops
    import numpy as np

    # sequence parallel's first block and final norm only re-lay out an input: their other ops are not split
    inside = ops.under(name for name, style in parallel.tensor_plan
                       if style not in ("sequence_shard", "sequence_gather_whole"))
    scale = np.where(inside, 1.0 / parallel.tensor_parallel, 1.0)
    return replace(ops, flops_fixed=ops.flops_fixed * scale, flops_per_sample=ops.flops_per_sample * scale,
                   bytes_fixed=ops.bytes_fixed * scale, bytes_per_sample=ops.bytes_per_sample * scale)
