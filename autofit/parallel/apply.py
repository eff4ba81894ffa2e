"""How a parallel layout is applied to a model (DDP, FSDP2, HSDP, tensor parallel composed with FSDP2): each
dimension through its ``apply`` and its ``micro_batch_context`` (autofit/parallel/dimension.py), and the one module
that builds a device mesh and calls ``init_device_mesh``, ``fully_shard``, ``DistributedDataParallel`` and (through
``tensor_parallel.apply_tensor_parallel``) ``parallelize_module``. The simulation (on a fake process group),
``measure`` and the distributed trainer all lay a model out through it, so all three lay it out exactly alike (see
docs/multi-gpu.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from autofit.core._torch import unset_fake_temporarily
from autofit.core.errors import UnsupportedModelError
from autofit.parallel.dimension import ApplyInputs

if TYPE_CHECKING:
    from autofit.parallel.layout import Parallel

__all__ = ["apply_layout", "apply_fsdp2", "bitsandbytes_parameters", "device_mesh", "wrap_ddp",
           "sub_meshes", "laid_out", "gradient_sync", "no_gradient_sync"]


def apply_layout(model: nn.Module, layout: Parallel, *, mesh=None, param_dtype: torch.dtype | None = None,
                 pin_memory: bool = False, gradient_as_bucket_view: bool = True,
                 device_ids: list[int] | None = None) -> nn.Module:
    """``layout`` applied to ``model`` on this rank: each dimension's :meth:`~autofit.parallel.Dimension.apply`,
    innermost first (torchtitan's order: tensor parallel over the "tp" dim, then FSDP2 over the data-parallel dims;
    DDP wraps what the others made), over ``mesh`` as :func:`device_mesh` lays it out (None for DDP: the default
    group). The rest are :class:`~autofit.parallel.dimension.ApplyInputs`' fields."""
    placed = layout.layout
    inputs = ApplyInputs(mesh=mesh, shard_units=layout.shard_units, param_dtype=param_dtype, pin_memory=pin_memory,
                         gradient_as_bucket_view=gradient_as_bucket_view, device_ids=device_ids)
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


# The one place a mesh is built and a model wrapped in DDP: the simulation (on a fake process group,
# parallel/simulated.py), measure (``laid_out``) and the distributed trainer (emit/distributed.py) all lay a model out
# through this module, so a layout is applied one way wherever it runs.
def device_mesh(device_type: str, layout: Parallel):
    """The device mesh of ``layout`` over the default process group: one dim per dimension of degree > 1, named as
    the dimension, in mesh order (``Layout.mesh_shape``, ``Layout.mesh_names``, autofit/parallel/dimension.py):
    (dp_shard) for FSDP2, (dp_replicate, dp_shard) for HSDP (FSDP2 shards over the last dim and replicates over the
    first: ``fully_shard``'s docstring), (dp_shard, tp) with tensor parallel, (tp) for tensor parallel alone
    (torchtitan's ``ParallelDims``: the "tp" dim last, so a tensor-parallel group is consecutive ranks, one node's
    GPUs)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.layout.mesh_shape, mesh_dim_names=layout.layout.mesh_names)


def wrap_ddp(model: nn.Module, gradient_as_bucket_view: bool, device_ids: list[int] | None = None) -> nn.Module:
    """``model`` in DistributedDataParallel with the step's bucket mode (Note [DDP's bucket views],
    parallel/simulated.py)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=gradient_as_bucket_view)


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


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module):
    """FSDP2's ``set_requires_gradient_sync(False)`` for the context's length: the reduce-scatter deferred."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def apply_fsdp2(model: nn.Module, units: tuple[str, ...], mesh, precision_dtype: torch.dtype | None, *,
                offload: bool = False, pin_memory: bool = False,
                reshard_after_forward: bool | int = True, tensor_parallel: bool = False) -> nn.Module:
    """``fully_shard`` each unit, then the root (FSDP2's recommended order: leaves before parents). ``offload``:
    FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer state in host memory; Note [offload]).
    ``tensor_parallel``: some parameters are already tensor-parallel DTensors (parallel/tensor_parallel.py); FSDP2
    then shards them over ``mesh``, the 1-D "dp_shard" sub-mesh, into 2-D DTensors. ``reshard_after_forward``
    applies to the units (True: ZeRO-3, False: ZeRO-2, an int: reshard to groups of that size); the root keeps torch's default, which does not reshard it (``FSDPState._lazy_init``: backward needs it at
    once), as torchtitan's ``apply_fsdp`` does. ``mesh`` is 1-D (FSDP) or 2-D (replicate, shard): HSDP."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    quantized = bitsandbytes_parameters(model)
    if quantized:
        raise UnsupportedModelError(
            f"FSDP2 cannot shard the {len(quantized)} bitsandbytes quantized weights of this model ({quantized[0]!r}"
            f"{', ...' if len(quantized) > 1 else ''}): fully_shard turns each parameter into a plain nn.Parameter "
            "DTensor (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _init_sharded_param), dropping Params4bit's "
            "quant_state; Accelerate leaves such weights out of sharding (ignored_params, accelerate#3987), which "
            "autofit does not simulate. Plan a 4-bit or 8-bit model on one process without the states on the host "
            "(plan(savers=autofit.Savers(offload=False)), --no-offload; estimate without offload_states / "
            "--offload-states)")
    policy = MixedPrecisionPolicy(param_dtype=precision_dtype, reduce_dtype=torch.float32) \
        if precision_dtype is not None else MixedPrecisionPolicy()
    offload_policy = CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy()
    # an int builds the smaller post-forward mesh from the mesh's rank tensor (``_get_post_forward_mesh_info`` calls
    # ``tolist()``), and a tensor-parallel parameter's 2-D mesh is built from the two meshes' rank tensors
    # (``FSDPParam._init_sharding_spec_tp``): under a simulation's fake mode those tensors must be read for real. The
    # parameters stay fake: a fake tensor dispatches to its own mode whether or not one is active.
    grouped = not isinstance(reshard_after_forward, bool) or tensor_parallel
    for name in units:
        with unset_fake_temporarily() if grouped else contextlib.nullcontext():
            fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=policy, offload_policy=offload_policy,
                        reshard_after_forward=reshard_after_forward)
    with unset_fake_temporarily() if tensor_parallel else contextlib.nullcontext():
        fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload_policy)
    return model


def bitsandbytes_parameters(model: nn.Module) -> list[str]:
    """The names of ``model``'s bitsandbytes quantized weights (``Params4bit``, ``Int8Params``): parameter subclasses
    whose metadata (the quantization state) FSDP2 does not carry through sharding. Found by their layers
    (``Linear4bit``, ``Linear8bitLt``), which a simulation's fake copy of the model keeps."""
    return [f"{name}.weight" for name, m in model.named_modules()
            if type(m).__module__.split(".")[0] == "bitsandbytes" and getattr(m, "weight", None) is not None]


def sub_meshes(mesh, tensor_parallel: int) -> tuple[object | None, object]:
    """(the mesh FSDP2 shards over, or None when tensor parallel runs alone; the tensor-parallel mesh) of a mesh
    :func:`device_mesh` laid out with ``tensor_parallel`` > 1. Slicing a mesh reads its rank tensor: done outside
    any fake mode."""
    with unset_fake_temporarily():
        if mesh.mesh_dim_names == ("tp",):
            return None, mesh
        return mesh["dp_shard"], mesh["tp"]
