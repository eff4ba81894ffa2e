"""How a parallel layout is applied to a model (DDP, FSDP2, HSDP, tensor parallel composed with FSDP2): the one
module that builds a device mesh (``init_device_mesh``) and asks each dimension, in order, to apply itself and to
give the context a micro-batch runs in (``Dimension.apply``, ``Dimension.micro_batch_context``,
autofit/parallel/dimension.py), which call ``fully_shard``, ``DistributedDataParallel`` and ``parallelize_module``
through autofit/parallel/wrappers.py and tensor_parallel.py. The simulation (on a fake process group), ``measure``
and the distributed trainer all lay a model out through it, so all three lay it out exactly alike (see
docs/multi-gpu.md)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from autofit.parallel.dimension import ApplyInputs

if TYPE_CHECKING:
    from autofit.parallel.layout import Parallel

__all__ = ["apply_layout", "device_mesh", "laid_out", "gradient_sync"]


def apply_layout(model: nn.Module, layout: Parallel, *, mesh=None, param_dtype: torch.dtype | None = None,
                 pin_memory: bool = False, gradient_as_bucket_view: bool = True,
                 device_ids: list[int] | None = None) -> nn.Module:
    """``layout`` applied to ``model`` on this rank: each dimension's :meth:`~autofit.parallel.Dimension.cut`,
    outermost first (a pipeline rank's stage), then each one's :meth:`~autofit.parallel.Dimension.apply`,
    innermost first (torchtitan's order: tensor parallel over the "tp" dim, then FSDP2 over the data-parallel dims;
    DDP wraps what the others made), over ``mesh`` as :func:`device_mesh` lays it out (None for DDP: the default
    group). The rest are :class:`~autofit.parallel.dimension.ApplyInputs`' fields."""
    placed = layout.layout
    inputs = ApplyInputs(mesh=mesh, shard_units=layout.shard_units, param_dtype=param_dtype, pin_memory=pin_memory,
                         gradient_as_bucket_view=gradient_as_bucket_view, device_ids=device_ids)
    for placement in placed.placements:  # what each rank holds, outermost first: a pipeline's stage
        model = placed.registry[placement.dimension].cut(model, placed, placement, inputs)
    roots = next((found for p in placed.placements if (found := placed.registry[p.dimension].runs(model, placed, p))),
                 ())
    inputs = dataclasses.replace(inputs, roots=roots)
    for placement in reversed(placed.placements):
        model = placed.registry[placement.dimension].apply(model, placed, placement, inputs)
    return model


def laid_out(model: nn.Module, layout: Parallel, device_type: str, *, gradient_as_bucket_view: bool,
             param_dtype: torch.dtype | None) -> nn.Module:
    """``model`` laid out as ``layout`` says over the default process group, which must be initialised with
    ``layout.world_size`` ranks: DDP (``gradient_as_bucket_view`` as the step says: True, as the trainer wraps it)
    or the FSDP2 / tensor-parallel layout on a mesh of ``device_type``. One process: ``model`` itself."""
    if layout.world_size == 1 and not layout.offload_states:
        return model
    mesh = None if layout.replicates_parameters else device_mesh(device_type, layout)  # DDP: the default group
    return apply_layout(model, layout, mesh=mesh, param_dtype=param_dtype,
                        gradient_as_bucket_view=gradient_as_bucket_view)


# The one place a mesh is built: the simulation (on a fake process group, parallel/simulated.py), measure
# (``laid_out``) and the distributed trainer (emit/distributed.py) all lay a model out through this module, so a layout
# is applied one way wherever it runs.
def device_mesh(device_type: str, layout: Parallel):
    """The device mesh of ``layout`` over the default process group: one dim per dimension of degree > 1, named as
    the dimension, in mesh order (``Layout.mesh_shape``, ``Layout.mesh_names``, autofit/parallel/dimension.py):
    (dp_shard) for FSDP2, (dp_replicate, dp_shard) for HSDP (FSDP2 shards over the last dim and replicates over the
    first: ``fully_shard``'s docstring), (dp_shard, tp) with tensor parallel, (tp) for tensor parallel alone
    (torchtitan's ``ParallelDims``: the "tp" dim last, so a tensor-parallel group is consecutive ranks, one node's
    GPUs)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.layout.mesh_shape, mesh_dim_names=layout.layout.mesh_names)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, layout: Parallel, *, last: bool) -> Iterator[None]:
    """The context one micro-batch of an accumulation window runs in under ``layout``: each dimension's
    :meth:`~autofit.parallel.Dimension.micro_batch_context`, outermost first (DDP's ``no_sync``, FSDP2's deferred
    reduce-scatter: gradients reduced across ranks on the last micro-batch only; tensor parallel alone reduces
    nothing across ranks)."""
    placed = layout.layout
    with contextlib.ExitStack() as stack:
        for placement in placed.placements:
            stack.enter_context(placed.registry[placement.dimension].micro_batch_context(model, placed, placement,
                                                                                        last=last))
        yield
