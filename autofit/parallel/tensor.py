"""Tensor parallel (torch's ``parallelize_module``, Megatron-LM's split of each block's matmuls): the ranks of one
group split every layer's weights and work on the same rows; composed with FSDP2 over the other dim (torchtitan's
layout), its group is consecutive ranks within one node, the mesh's last dim. Sequence parallel is its option (the
resolved plan's styles, Note [sequence parallel])."""

from __future__ import annotations

from typing import Any

from autofit.core.errors import AutofitError, InvalidInputError
from autofit.parallel.dimension import Dimension, Layout, Placement
from autofit.parallel.sequence_parallel import require_sequence_split
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


TENSOR = _Tensor(name="tp", mesh_rank=4, shares_rows=True, field="tensor_parallel")
