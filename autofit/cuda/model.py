"""The CUDA memory model: the CPU simulation's timeline, turned into what a CUDA process needs.

Terms, each in the estimate's breakdown (see docs/cuda.md for sources and what is not modelled):
- the tensors of the step, as the simulation saw them under CUDA's autocast policy and attention kernels
  (``autocast_policy.py``, ``kernels.py``);
- ``allocator_rounding``: the caching allocator rounds every block up to 512 bytes (``allocator.py``);
- ``cublas_workspace``: one cuBLAS workspace per (device, stream), allocated through the caching allocator on the
  first matmul and kept: 32 MiB on compute capability 9.x/10.x/12.x, else 4096 KiB x 2 + 16 KiB x 8 = 8,519,680 bytes
  (``aten/src/ATen/cuda/CublasHandlePool.cpp``, ``parseChosenWorkspaceSize``; ``CUBLAS_WORKSPACE_CONFIG`` overrides).
  cuBLASLt shares it (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``, on by default). ROCm builds keep hipBLAS's (128 MiB on
  the MI300 series) and hipBLASLt's (76 MiB) apart (``rocm_workspace_bytes``; docs/cuda.md, "ROCm targets");
- ``fragmentation``: segments reserved beyond the blocks in use at the peak, from replaying the allocator's
  best-fit / split / merge rules over the timeline (``max_memory_reserved - max_memory_allocated``);
- ``cuda_context``: the CUDA context, cuBLAS/cuDNN handles and loaded kernels, outside PyTorch's allocator. It
  depends on driver, CUDA version and lazy loading; autofit assumes ``CUDA_CONTEXT_BYTES`` (override with the
  environment variable ``AUTOFIT_CUDA_CONTEXT_MIB``) and ``benchmarks/gpu_validate.py`` measures it.
``peak_bytes`` (comparable with ``torch.cuda.max_memory_allocated``) is the first three; ``device_bytes`` (what
nvidia-smi shows on a card with room to spare) adds the last two.

A budget is not checked against ``device_bytes``: on a card (or under ``set_per_process_memory_fraction``) that
leaves the allocator less, it frees cached segments when a new one does not fit, and the step still runs unless the
blocks in use and the segments they pin leave no room (Note [allocating under a cap], allocator.py).
``cuda_memory_under`` replays the step under a budget; ``smallest_device_bytes`` is the smallest budget it runs
under (Note [the smallest cap]). Both can replay ``expandable_segments:True`` instead (Note [expandable segments],
``expandable.py``), which the plan sets where the default allocator's segments do not fit but the pages would
(Note [expandable segments as a plan knob], autofit/device.py).
"""

from __future__ import annotations

import os
import re

from autofit.core.categories import Category
from autofit.cuda.allocator import AllocatorReplay, replay_allocator, smallest_cap
from autofit.cuda.catalog import GPUSpec
from autofit.simulate.timeline import Replay, Timeline

__all__ = ["CUDA_CONTEXT_BYTES", "cublas_workspace_bytes", "rocm_workspace_bytes", "context_bytes", "cuda_memory", "cuda_memory_under",
           "smallest_device_bytes", "cudnn_workspace_note"]

# A typical CUDA 12 context with lazy module loading (CUDA_MODULE_LOADING=LAZY, the default since CUDA 11.7 in
# PyTorch) plus cuBLAS/cuDNN handles: a few hundred MiB (PyTorch docs, "CUDA semantics > Memory management").
CUDA_CONTEXT_BYTES = 512 * 2**20


def cublas_workspace_bytes(gpu: GPUSpec, config: str | None = None) -> int:
    """``parseChosenWorkspaceSize``: ``CUBLAS_WORKSPACE_CONFIG`` ":SIZE_KiB:COUNT..." pairs, else the default. On a
    ROCm target, :func:`rocm_workspace_bytes`."""
    if gpu.platform == "rocm":
        return rocm_workspace_bytes(gpu, config)
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if gpu.compute_capability[0] in (9, 10, 12):
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def rocm_workspace_bytes(gpu: GPUSpec, config: str | None = None, lt_kib: str | None = None) -> int:
    """The BLAS workspaces of PyTorch's ROCm build, both through the caching allocator and kept (CublasHandlePool.cpp):
    hipBLAS's, ``parseChosenWorkspaceSize`` under ``USE_ROCM`` (``CUBLAS_WORKSPACE_CONFIG``, else
    ``HIPBLAS_WORKSPACE_CONFIG``, else ``ROCBLAS_WORKSPACE_CONFIG``; default 128 MiB on gfx94x/gfx95x, the MI300
    series, else 32 MiB), plus hipBLASLt's, which ROCm does not unify with it (``parseCUDABlasLtWorkspaceSize``:
    ``CUBLASLT_WORKSPACE_SIZE`` or ``HIPBLASLT_WORKSPACE_SIZE`` in KiB, default 76 MiB)."""
    if config is None:
        config = next((os.environ[k] for k in ("CUBLAS_WORKSPACE_CONFIG", "HIPBLAS_WORKSPACE_CONFIG",
                                               "ROCBLAS_WORKSPACE_CONFIG") if os.environ.get(k)), "")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    gfx94_95 = gpu.compute_capability[0] == 9 and gpu.compute_capability[1] in (4, 5)
    hipblas = (sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs
               else (128 if gfx94_95 else 32) * 2**20)
    if lt_kib is None:
        lt_kib = os.environ.get("CUBLASLT_WORKSPACE_SIZE") or os.environ.get("HIPBLASLT_WORKSPACE_SIZE") or ""
    lt = int(lt_kib) * 1024 if lt_kib.strip().isdigit() else 76 * 2**20
    return hipblas + lt


def context_bytes() -> int:
    override = os.environ.get("AUTOFIT_CUDA_CONTEXT_MIB")
    return int(float(override) * 2**20) if override else CUDA_CONTEXT_BYTES


_CONVOLUTIONS = ("convolution", "convolution_backward", "_convolution", "cudnn_convolution",
                 "cudnn_convolution_transpose")


def cudnn_workspace_note(timeline: Timeline) -> str | None:
    """The documented bound for cuDNN convolution workspaces (docs/cuda.md, "cuDNN convolution workspaces"), as a
    note on estimates whose step runs convolutions; None when it runs none."""
    if not any(op.name in _CONVOLUTIONS for op in timeline.ops):
        return None
    return ("cuDNN convolution workspaces are not counted: each convolution allocates its engine's workspace for "
            "the duration of the call (Conv_v8.cpp run_conv_plan), and an engine whose workspace does not fit is "
            "skipped for the next (try_configs); with torch.backends.cudnn.benchmark=True the first step's search "
            "also takes up to the largest free cached block (generate_and_filter_plans). See docs/cuda.md")


def cuda_memory(timeline: Timeline, raw: Replay, gpu: GPUSpec, *,
                expandable: bool = False) -> tuple[int, int, dict[Category, int]]:
    """(peak_bytes, device_bytes, breakdown) of the simulated step on ``gpu``, the allocator unconstrained;
    ``expandable``: under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (Note [expandable segments])."""
    workspace = cublas_workspace_bytes(gpu)
    return _terms(replay_allocator(timeline, persistent=(workspace,), expandable=expandable), raw, workspace)


def cuda_memory_under(timeline: Timeline, raw: Replay, gpu: GPUSpec, device_budget: int, *,
                      expandable: bool = False) -> tuple[int, int, dict[Category, int], int] | None:
    """(peak_bytes, device_bytes, breakdown, segments freed) of the simulated step on ``gpu`` when the process may
    hold ``device_budget`` (the allocator's cap is that less the context); None when it runs out of memory.
    ``expandable``: under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (Note [expandable segments])."""
    workspace = cublas_workspace_bytes(gpu)
    replay = replay_allocator(timeline, persistent=(workspace,), cap_bytes=device_budget - context_bytes(),
                              expandable=expandable)
    if not replay.fits:
        return None
    return (*_terms(replay, raw, workspace), replay.released)


def smallest_device_bytes(timeline: Timeline, gpu: GPUSpec, *, expandable: bool = False) -> int:
    """The smallest budget (device bytes, context included) the simulated step runs under on ``gpu``, with the
    default allocator or with expandable segments."""
    cap, _ = smallest_cap(timeline, persistent=(cublas_workspace_bytes(gpu),), expandable=expandable)
    return cap + context_bytes()


def _terms(replay: AllocatorReplay, raw: Replay, workspace: int) -> tuple[int, int, dict[Category, int]]:
    peak = replay.peak_allocated
    breakdown: dict[Category, int] = dict(raw.breakdown)
    breakdown.pop(Category.WORKSPACE, None)  # CPU kernel scratch: not part of the CUDA model
    tensors = sum(breakdown.values())
    breakdown[Category.CUBLAS_WORKSPACE] = workspace
    breakdown[Category.ALLOCATOR_ROUNDING] = max(0, peak - workspace - tensors)
    breakdown[Category.FRAGMENTATION] = max(0, replay.peak_reserved - peak)
    context = context_bytes()
    breakdown[Category.CUDA_CONTEXT] = context
    return peak, max(replay.peak_reserved, peak) + context, breakdown
