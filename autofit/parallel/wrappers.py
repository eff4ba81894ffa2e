"""The torch calls that lay a model out, each a dimension's (autofit/parallel/dimension.py, ``Dimension.apply`` and
``Dimension.micro_batch_context``): FSDP2's ``fully_shard`` and its deferred gradient sync, DDP's wrapper, and the
sub-meshes tensor parallel and FSDP2 take of the layout's mesh. ``autofit/parallel/apply.py`` builds the mesh and asks
the dimensions in order; these read no layout, so the dimensions' modules import them without importing it."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from autofit.core._torch import unset_fake_temporarily
from autofit.core.errors import UnsupportedModelError

__all__ = ["wrap_ddp", "no_gradient_sync", "apply_fsdp2", "bitsandbytes_parameters", "sub_meshes", "data_mesh",
           "held_names"]


def wrap_ddp(model: nn.Module, gradient_as_bucket_view: bool, device_ids: list[int] | None = None) -> nn.Module:
    """``model`` in DistributedDataParallel with the step's bucket mode (Note [DDP's bucket views],
    parallel/simulated.py)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=gradient_as_bucket_view)


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
                reshard_after_forward: bool | int = True, tensor_parallel: bool = False,
                roots: tuple[nn.Module, ...] = ()) -> nn.Module:
    """``fully_shard`` each unit, then the root (FSDP2's recommended order: leaves before parents). ``offload``:
    FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer state in host memory; Note [offload]).
    ``tensor_parallel``: some parameters are already tensor-parallel DTensors (parallel/tensor_parallel.py); FSDP2
    then shards them over ``mesh``, the 1-D "dp_shard" sub-mesh, into 2-D DTensors. ``reshard_after_forward``
    applies to the units (True: ZeRO-3, False: ZeRO-2, an int: reshard to groups of that size); the root keeps torch's default, which does not reshard it (``FSDPState._lazy_init``: backward needs it at
    once), as torchtitan's ``apply_fsdp`` does. ``mesh`` is 1-D (FSDP) or 2-D (replicate, shard): HSDP. ``roots``:
    the modules the step calls where they are not ``model`` (a pipeline rank's stages, each a root of its own, as
    torchtitan shards each model part)."""
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
    for root in roots or (model,):
        with unset_fake_temporarily() if tensor_parallel else contextlib.nullcontext():
            fully_shard(root, mesh=mesh, mp_policy=policy, offload_policy=offload_policy)
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
        # beside a pipeline the mesh has its "pp" dim too, and no "dp_shard" where tensor parallel takes the rest
        return (mesh["dp_shard"] if "dp_shard" in mesh.mesh_dim_names else None), mesh["tp"]


def data_mesh(mesh):
    """The data-parallel dims ("dp_replicate", "dp_shard") of a mesh with others (a pipeline's "pp"), as the 1-D or
    2-D mesh FSDP2 shards over. Slicing a mesh reads its rank tensor: done outside any fake mode."""
    names = tuple(n for n in mesh.mesh_dim_names if n in ("dp_replicate", "dp_shard"))
    with unset_fake_temporarily():
        return mesh[names if len(names) > 1 else names[0]]


def held_names(model: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """Of the module ``names`` a step's knobs name on the whole model (recomputed, fp32-pinned modules), those this
    rank's ``model`` still holds: a dimension's cut (``Dimension.cut``: a pipeline stage's) left the others on other
    ranks, and records them on the model it cut."""
    gone = getattr(model, "_autofit_cut_away", ())
    return tuple(n for n in names if not any(n == g or n.startswith(g + ".") for g in gone))
