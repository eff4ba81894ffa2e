"""Resolve ``device="cuda"`` (and ``gpu=``) into the GPU a plan or an estimate targets."""

from __future__ import annotations

import torch

from autofit.cuda.catalog import GPUS, GPUSpec, gpu_spec, normalise_gpu_name

__all__ = ["resolve_gpu", "resolve_target_gpu", "DEFAULT_GPU"]

DEFAULT_GPU = "A100-80GB"


def _detect() -> GPUSpec | None:
    """The current device, when this machine has one: the catalog entry of that model (the closest in memory when
    several share the name: A100 40/80 GB), else the default entry's throughput with the device's own name, memory
    and compute capability. torch reports less memory than the nominal size (ECC on GDDR boards takes 1/16)."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    name = normalise_gpu_name(props.name).replace("-", "")
    # the device name contains the family ("a100sxm480gb" contains "a100"); RTX names keep their number
    matches = [spec for spec in GPUS.values()
               if normalise_gpu_name(spec.name if spec.name.startswith("RTX") else spec.name.split("-")[0])
               .replace("-", "") in name]
    if matches:
        spec = min(matches, key=lambda s: abs(s.memory_bytes - props.total_memory))
        return GPUSpec(**{**spec.__dict__, "memory_bytes": props.total_memory})
    base = GPUS[DEFAULT_GPU]
    return GPUSpec(**{**base.__dict__, "name": props.name, "memory_bytes": props.total_memory,
                      "compute_capability": (props.major, props.minor),
                      "source": f"detected device; throughput of {DEFAULT_GPU} assumed"})


def resolve_gpu(gpu: str | GPUSpec | None) -> tuple[GPUSpec, str | None]:
    """(spec, note): the named GPU, else the detected one, else the default (with a note saying so)."""
    spec, note, _ = resolve_target_gpu(gpu)
    return spec, note


def resolve_target_gpu(gpu: str | GPUSpec | None) -> tuple[GPUSpec, str | None, bool]:
    """(spec, note, local): :func:`resolve_gpu`, and whether the target is this machine's own GPU: detected, or
    named and the same model as the one detected. Defaults of the host (its RAM) come from this machine only then
    (Note [the host of the target], autofit/validate.py)."""
    detected = _detect()
    if gpu is not None:
        spec = gpu_spec(gpu)
        return spec, None, detected is not None and detected.name == spec.name
    if detected is not None:
        return detected, None, True
    return GPUS[DEFAULT_GPU], f"no gpu given and no CUDA device here: assumed {DEFAULT_GPU}", False
