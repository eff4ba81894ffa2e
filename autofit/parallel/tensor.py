"""Tensor parallel (torch's ``parallelize_module``, Megatron-LM's split of each block's matmuls): the ranks of one
group split every layer's weights and work on the same rows; composed with FSDP2 over the other dim (torchtitan's
layout), its group is consecutive ranks within one node, the mesh's last dim. Sequence parallel is its option (the
resolved plan's styles, Note [sequence parallel])."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
from torch import nn

from autofit.core.errors import AutofitError, InvalidInputError
from autofit.parallel.collectives import ring_seconds
from autofit.parallel.dimension import ApplyInputs, Dimension, Layout, Placement, RankWork, StepKnobs, WorkInputs
from autofit.parallel.exports import ExportFragment, ExportInputs
from autofit.parallel.sequence_parallel import is_sequence_parallel, require_sequence_split
from autofit.parallel.tensor_parallel import apply_tensor_parallel, resolve_tensor_plan
from autofit.parallel.wrappers import held_names, sub_meshes

__all__ = ["TENSOR", "Split", "tensor_group_bytes", "tensor_reduce_bytes", "split_ops", "split_parameters"]


class Split(Protocol):
    """What one rank's share reads of a layout (``autofit.parallel.layout.Parallel``, which imports this module's
    registry): the degree and the resolved plan."""

    tensor_parallel: int
    tensor_plan: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class _Share:
    """A placement of this dimension read as a :class:`Split`: the degree and the resolved plan."""

    tensor_parallel: int
    tensor_plan: tuple[tuple[str, str], ...]


class _Tensor(Dimension):
    def choices(self, space: Any):
        """Each degree the request allows that divides one node's GPUs (its all-reduces run in every layer, over
        NVLink: never across nodes) and splits the model: its plan resolved, the sample's sequence split evenly
        where the plan is sequence parallel. Clipping the gradient norm is refused with tensor parallel
        (``StepConfig``, named by the request), so no degree is tried then."""
        per_node = space.gpus_per_node or space.world_size
        for tp in space.tensor_options:
            if tp == 1:
                yield Placement(self.name)
                continue
            if per_node % tp or space.world_size % tp or space.clip_grad_norm is not None:
                continue
            try:
                plan = resolve_tensor_plan(space.model, tp, space.layout_options.tensor_parallel_plan)
                require_sequence_split(plan, tp, space.batch.tensors(), "the sample")
            except AutofitError:  # no plan, or heads / features / the sequence T does not divide: the other
                continue          # layouts are still planned
            yield Placement(self.name, tp, (("plan", plan),))

    def check(self, layout: Layout) -> None:
        tp = layout.degree(self.name)
        if tp == 1:
            return
        if layout.world_size % tp:
            raise InvalidInputError(
                f"tensor_parallel {tp} does not divide world_size {layout.world_size}: the mesh is "
                "(world_size // tensor_parallel, tensor_parallel); use a divisor such as the GPUs of one node")
        if layout.partial:
            return
        shard = layout.placement("dp_shard")
        offload = shard is not None and shard.option("offload_states", False)
        if layout.degree("dp_replicate") != 1 or offload:
            raise InvalidInputError(
                f"tensor_parallel={tp} with {'offload_states' if offload else 'replicate'}: autofit simulates "
                "tensor parallel with FSDP2 over one shard dim only (no HSDP, no CPU offload); leave replicate=1 "
                "and offload_states=False")

    def check_step(self, layout: Layout, placement: Placement, step: StepKnobs) -> None:
        """Over every rank, not on CUDA's foreach optimizers; never with clipping."""
        tp, world_size = placement.degree, layout.world_size
        if tp > 1 and layout.data_ranks == 1 and step.device.foreach_by_default:
            raise InvalidInputError(
                f"tensor parallel without FSDP2 (tensor_parallel {tp} and the other dims take world_size {world_size}) "
                "on CUDA: the embedding, "
                "norms and head stay plain tensors beside the split DTensors, and torch's foreach optimizers (the "
                "default on CUDA) cannot step the two together (aten._foreach_*: mixed torch.Tensor and DTensor); "
                f"compose it with FSDP2 (world_size = 2 x {tp} or more), which makes every parameter a DTensor")
        if tp > 1 and step.clip_grad_norm is not None:
            raise InvalidInputError(
                "clip_grad_norm with tensor_parallel: the gradients are DTensors over different meshes (split and "
                "replicated parameters), which torch.nn.utils.clip_grad_norm_ does not combine; leave clipping out")

    def plannable(self, layout: Layout, space: Any) -> bool:
        """Not an int reshard: torch refuses it on tensor-parallel weights (``FSDPParam.to_sharded_post_forward``,
        torch 2.13: "Resharding to smaller mesh is not supported for DTensor parameters yet"), so the layout's
        analysis could only fail; nor tensor parallel over every rank with foreach optimizers (refused by
        ``StepConfig``)."""
        if layout.degree(self.name) == 1:
            return True
        shard = layout.placement("dp_shard")
        raf = True if shard is None else shard.option("reshard_after_forward", True)
        if not isinstance(raf, bool):
            return False
        return not (layout.data_ranks == 1 and space.device.foreach_optimizers)

    def rank_work(self, layout: Layout, placement: Placement, work: RankWork, inputs: WorkInputs) -> RankWork:
        """One rank of the group runs its 1/T of the split layers' ops (:func:`split_ops`), holds their 1/T
        (:func:`tensor_group_bytes`), and all-reduces the activations of every split layer over the group's ring
        within one node (:func:`tensor_reduce_bytes`, for the rows one rank trains)."""
        if placement.degree == 1:
            return work
        split = _Share(placement.degree, placement.option("plan", ()))
        reduced = inputs.rows * tensor_reduce_bytes(inputs.model, split, inputs.output_bytes)
        return RankWork(split_ops(work.ops, split), tensor_group_bytes(inputs.model, split),
                        work.seconds + ring_seconds("all_reduce", split.tensor_parallel, reduced,
                                                    inputs.link_bytes_per_second))

    def model_ways(self, layout: Layout, placement: Placement) -> int:
        """A rank computes with 1/T of the split layers, counted as 1/T of the model (Note [a dimension's share of
        memory]: a floor's arithmetic; the exact shares are ``split_parameters``')."""
        return placement.degree

    def apply(self, model: nn.Module, layout: Layout, placement: Placement, inputs: ApplyInputs) -> nn.Module:
        """torch's ``parallelize_module`` with the resolved plan over the "tp" mesh dim, in place, before FSDP2
        shards what it split (torchtitan's order)."""
        if placement.degree > 1:  # the plan's modules this rank holds (a pipeline stage's: wrappers.held_names)
            held = set(held_names(model, tuple(name for name, _ in placement.option("plan", ()))))
            apply_tensor_parallel(model, tuple((n, s) for n, s in placement.option("plan", ()) if n in held),
                                  sub_meshes(inputs.mesh, placement.degree)[1])
        return model

    def words(self, layout: Layout, placement: Placement, *, ranks: bool = False, after_forward: str = "") -> str:
        """'tp 8', 'tp 8 + sequence parallel' (its plan's styles split the sequence, or the words are asked for
        a layout said to be so)."""
        if placement.degree == 1:
            return ""
        sequence = placement.option("sequence_parallel", False) or is_sequence_parallel(placement.option("plan", ()))
        return f"tp {placement.degree}" + (" + sequence parallel" if sequence else "")

    def trade(self, layouts: Sequence[Layout]) -> str:
        """Where a layout of the race splits layers: the split against the all-reduces it adds; with sequence
        parallel, what that changes."""
        used = [layout.placement(self.name) for layout in layouts if layout.degree(self.name) > 1]
        if not used:
            return ""
        words = ("tensor parallel T splits the block's linear layers over T GPUs of a node (1/T of their weights, "
                 "compute and activations per rank, each group's ranks training the same rows) at the cost of "
                 "all-reducing the activations in every block, forward and backward, over NVLink")
        if any(is_sequence_parallel(p.option("plan", ())) for p in used):
            words += ("; sequence parallel also splits the norms and the residual stream along the sequence, each "
                      "all-reduce becoming an all-gather and a reduce-scatter")
        return words

    def export(self, framework: str, layout: Layout, placement: Placement, inputs: ExportInputs) -> ExportFragment:
        """Tensor parallel in ``framework``'s terms: torchtitan's and Lightning's degree (1 included), Accelerate's
        ``tp_size``, with a note where the framework's own plan splits other modules than this plan's; DeepSpeed's
        config has none (a note says so); Hugging Face's export writes nothing."""
        tp, plan = placement.degree, placement.option("plan", ())
        if framework == "torchtitan":
            styles = {style for _, style in plan}
            missing = [what for what, present in (
                ("splits the embedding and the output head", {"embedding_rowwise", "colwise_rep"} <= styles),
                ("runs the norms sequence-parallel", "sequence_parallel" in styles)) if not present]
            notes = ()
            if tp > 1 and missing:
                notes = (f"torchtitan's tensor-parallel plan also {' and '.join(missing)}, which this plan does "
                         "not: its memory per GPU is below this plan's",)
            return ExportFragment({"parallelism": {"tensor_parallel_degree": tp}}, notes)
        if framework == "lightning":  # ModelParallelStrategy(data_parallel_size, tensor_parallel_size)
            notes = ()
            if tp > 1:
                notes = (f"tensor parallel {tp}: FSDPStrategy (FSDP1) has none; in ModelParallelStrategy's "
                         "configure_model call parallelize_module(model, self.device_mesh['tensor_parallel'], plan) "
                         f"first, with the torch style of each of the plan's {len(plan)} modules (plan.tensor_plan; "
                         "autofit.parallel.tensor_parallel.torch_style names each)",)
            return ExportFragment({"model_parallel_strategy": {"tensor_parallel_size": tp}}, notes)
        if tp == 1:
            return ExportFragment()
        if framework == "accelerate":  # Accelerate's ParallelismConfig: tp_size, the model's own tp_plan applied
            notes = ()
            if is_sequence_parallel(plan):
                notes = ("Accelerate's tp_size applies the model's own tp_plan, without this plan's sequence "
                         "parallel: its activations per GPU are above this plan's",)
            return ExportFragment({"config_file": {"parallelism_config": {
                "parallelism_config_dp_shard_size": layout.data_ranks, "parallelism_config_tp_size": tp}}}, notes)
        if framework == "deepspeed":  # no training TP in DeepSpeed's config (AutoTP shards models for inference)
            return ExportFragment(unexpressed=(
                f"tensor parallel {tp} is not exported: DeepSpeed's config has no training tensor parallelism "
                "(Megatron-DeepSpeed does it in the model code); this config is ZeRO over the data-parallel ranks "
                "only, and its memory is not the plan's",))
        return ExportFragment()


TENSOR = _Tensor(name="tp", mesh_rank=4, shares_rows=True, field="tensor_parallel")


# ---- one rank's share of the step under tensor parallel (what the planner's models read: solve/space.py) ---------
def tensor_group_bytes(model: nn.Module, parallel: Split) -> int:
    """Parameter bytes one tensor-parallel group's rank holds before FSDP2 shards them: the split weights (and
    column-parallel biases) over T, everything else whole (a row-parallel linear layer replicates its bias; the
    vocabulary-split embedding has its weight only)."""
    return sum(p.numel() * p.element_size() // (parallel.tensor_parallel if cut else 1)
               for p, cut in split_parameters(model, parallel.tensor_plan))


def split_parameters(model: nn.Module,
                     tensor_plan: tuple[tuple[str, str], ...]) -> Iterator[tuple[nn.Parameter, bool]]:
    """Every parameter of ``model`` (each module's own, in ``named_modules`` order) and whether ``tensor_plan``
    splits it T ways: all of a column-parallel or vocabulary-split module's, a row-parallel layer's weight (not its
    bias, which every rank of the group holds whole); the rest whole."""
    split = dict(tensor_plan)
    for name, module in model.named_modules():
        style = split.get(name)
        for pname, p in module.named_parameters(recurse=False):
            yield p, style in _SPLIT_ALL or (style in _SPLIT_WEIGHT and pname == "weight")


# styles whose module's parameters are all split T ways, and those that split the weight only (a row-parallel
# layer's bias is replicated); sequence parallel's norms are replicated (Note [sequence parallel])
_SPLIT_ALL = ("colwise", "colwise_rep", "embedding_rowwise")
_SPLIT_WEIGHT = ("rowwise", "rowwise_sequence")


def tensor_reduce_bytes(model: nn.Module, parallel: Split, output_bytes) -> float:
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


def split_ops(ops: Any, parallel: Split) -> Any:
    """``ops`` (OpCosts) with the FLOPs and bytes of the ops inside split modules divided by T: the analysis counts
    a tensor-parallel layer's matmuls at their global shapes, one rank runs its 1/T."""
    if parallel.tensor_parallel == 1:
        return ops
    # sequence parallel's first block and final norm only re-lay out an input: their other ops are not split
    inside = ops.under(name for name, style in parallel.tensor_plan
                       if style not in ("sequence_shard", "sequence_gather_whole"))
    scale = np.where(inside, 1.0 / parallel.tensor_parallel, 1.0)
    return replace(ops, flops_fixed=ops.flops_fixed * scale, flops_per_sample=ops.flops_per_sample * scale,
                   bytes_fixed=ops.bytes_fixed * scale, bytes_per_sample=ops.bytes_per_sample * scale)
