"""Resolve ``device="cuda"`` (and ``gpu=``) into the GPU a plan or an estimate targets."""

from __future__ import annotations

from dataclasses import replace

import torch

from autofit.cuda.catalog import GPUS, GPUSpec, catalog_key, gpu_spec

__all__ = ["resolve_gpu", "resolve_target_gpu", "DEFAULT_GPU"]

DEFAULT_GPU = "A100-80GB"


def _detect() -> GPUSpec | None:
    """The current device, when this machine has one (CUDA, or ROCm through the same ``torch.cuda`` API): the
    catalog entry whose name the device's name contains, the longest such name winning ("NVIDIA L40S" is the L40S,
    not the L40; "NVIDIA H100 PCIe" the H100-PCIe, not the SXM H100-80GB), the closest in memory among entries of one
    name (A100 40/80 GB), with the memory the device reports; else the default entry's throughput with the device's
    own name, memory, compute capability and platform. torch reports less memory than the nominal size (ECC on GDDR
    boards takes 1/16)."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    platform = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    name = catalog_key(props.name or getattr(props, "gcnArchName", "") or "")
    matches = [spec for spec in GPUS.values() if catalog_key(spec.name) in name and spec.platform == platform]
    if matches:
        longest = max(len(catalog_key(s.name)) for s in matches)
        named = [s for s in matches if len(catalog_key(s.name)) == longest]
        spec = min(named, key=lambda s: abs(s.memory_bytes - props.total_memory))
        return replace(spec, memory_bytes=props.total_memory)
    base = GPUS[DEFAULT_GPU]
    return replace(base, name=props.name, memory_bytes=props.total_memory, compute_capability=(props.major, props.minor),
                   platform=platform, host=None,
                   source=f"detected device; throughput of {DEFAULT_GPU} assumed")


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
