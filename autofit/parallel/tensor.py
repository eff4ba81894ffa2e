"""Tensor parallel (torch's ``parallelize_module``, Megatron-LM's split of each block's matmuls): the ranks of one
group split every layer's weights and work on the same rows; composed with FSDP2 over the other dim (torchtitan's
layout), its group is consecutive ranks within one node, the mesh's last dim. Sequence parallel is its option (the
resolved plan's styles, Note [sequence parallel])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autofit.core.errors import AutofitError, InvalidInputError
from autofit.parallel.dimension import Dimension, ExportFragment, ExportInputs, Layout, Placement, StepKnobs
from autofit.parallel.sequence_parallel import is_sequence_parallel, require_sequence_split
from autofit.parallel.tensor_parallel import resolve_tensor_plan

__all__ = ["TENSOR"]


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
                plan = resolve_tensor_plan(space.model, tp, space.tensor_parallel_plan)
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
        if 1 < tp == world_size and step.device.foreach_by_default:
            raise InvalidInputError(
                f"tensor parallel alone (world_size == tensor_parallel == {world_size}) on CUDA: the embedding, "
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
