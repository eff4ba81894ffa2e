"""Measure real training steps with the allocator's own record.

CPU: the step runs under ``torch.profiler.profile(activities=[CPU], profile_memory=True)``; its Allocation events
(``alloc_size`` negative on free) are replayed in time order, and the running sum's maximum plus the bytes alive
before the step is the peak. CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``.
"""

from __future__ import annotations

import contextlib

import gc
from typing import Any

import torch

from autofit.core._torch import (
    allocation_sizes,
    ddp_bucket_bytes,
    grad_scaler_state,
    high_water_mark,
    interruption_point,
    memory_profile,
    storage_tensors,
)
from autofit.training.batch import Batch
from autofit.capture.model_copy import attached_tensors, module_tensor_attributes, real_copy
from autofit.core.categories import Category
from autofit.features import FEATURES
from autofit.training.loss import LossFn
from autofit.training.normalisation import LossNormalisation
from autofit.core.report import Measurement
from autofit.training.stored import apply_stored
from autofit.training.strategy import gradient_sync, laid_out
from autofit.training.step import (
    StepConfig,
    new_grad_scaler,
    optimizer_step,
    patched_model,
    run_micro_batch,
)

__all__ = ["measure_step", "measure_callable"]


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``; a wrapper subclass (torchao's optimizer state) by the storages
    of its inner tensors, a DTensor by its local shard."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for inner in storage_tensors(t):
                st = inner.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _live_before(model, optimizer, scaler, micro: Batch, micro_target: Batch | None,
                 stored=None) -> dict[Category, int]:
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if stored is not None:  # the fp32 master copy (Note [stored precision])
        state += stored.master_tensors()
    if scaler is not None and scaler.is_enabled():
        state += grad_scaler_state(scaler)
    inputs = micro.tensors() + (micro_target.tensors() if micro_target is not None else [])
    buffers = list(model.buffers()) + [t for _, t in module_tensor_attributes(model)]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return {
        # with the quantization statistics of quantized layers (Note [quantized parameters])
        Category.PARAMETERS: _storage_bytes(list(model.parameters()) + [t for _, t in attached_tensors(model)]),
        Category.BUFFERS: _storage_bytes(buffers),
        Category.OPTIMIZER_STATE: _storage_bytes(state),
        Category.INPUTS: _storage_bytes(inputs),
        Category.GRADIENTS: _storage_bytes(grads),
    }


def measure_step(
    model: torch.nn.Module, batch: Batch, target: Batch | None, loss_fn: LossFn | None, config: StepConfig,
    *, steps: int = 1, lowest: bool = False,
) -> Measurement:
    """Run ``config`` for real on a copy of ``model``: one warm-up window (creates optimizer state), then ``steps``
    measured windows of ``accumulation_steps`` micro-batches each. Returns the highest peak; ``lowest``: the lowest,
    of the allocations made on this thread (a rank of a gloo job, Note [gloo's threads in the measured window],
    measure/ranks.py)."""
    device = torch.device(config.device)
    work = real_copy(model).to(device)
    # the rows resident all window (StepConfig.held_rows: the whole batch, as trainer.step receives it, or one
    # micro-batch), and the micro-batches as slices of them, as the trainer runs them
    rows = max(config.held_rows, config.micro_batch_size)
    whole = batch.map_tensors(lambda t: t.to(device)).resize(rows)
    whole_target = None if target is None else target.map_tensors(lambda t: t.to(device)).resize(rows)
    micro_batches = [_rows(whole, whole_target, i, config.micro_batch_size) for i in range(config.accumulation_steps)]
    # one rank of a parallel layout (measure/ranks.py runs one process per rank): DDP wraps the copy, FSDP2 and
    # tensor parallel replace its parameters in place; the knobs patch the copy itself, as the trainer patches its
    # model's inner module
    inner, work = work, laid_out(work, config, device.type)
    optimizer = config.optimizer.build(work.parameters())
    stored = apply_stored(inner, optimizer, config.precision.stored, config.precision.fp32_modules)
    scaler = new_grad_scaler(config, device.type)

    norm = LossNormalisation.of_rows((config.micro_batch_size,) * config.accumulation_steps)

    def window() -> None:
        for i, (micro, micro_target) in enumerate(micro_batches):
            interruption_point()  # a Ctrl-C between micro-batches (Note [Ctrl-C at safe points], core/_torch.py)
            with gradient_sync(work, config.layout, last=i == config.accumulation_steps - 1):
                run_micro_batch(work, micro, micro_target, loss_fn, config, device.type, weight=norm.weight(i),
                                scaler=scaler)
        interruption_point()
        optimizer_step(optimizer, scaler, clip_grad_norm=config.clip_grad_norm, stored=stored,
                       in_backward=config.optimizer_in_backward, keep_grads=config.preallocated_grads)

    with patched_model(inner, config, device.type), contextlib.ExitStack() as features:
        for feature in FEATURES:  # what each step feature does to a real model (Note [step features])
            features.enter_context(feature.real_context(config, inner))
        for feature in FEATURES:  # what each step feature holds around the step
            features.enter_context(feature.step_context(config, inner, optimizer))
        window()  # warm-up: optimizer state now exists, as in the steady state
        if config.layout.replicates_parameters:
            window()  # DDP rebuilds its gradient buckets in the order of the first backward, after it
        gc.collect()
        before = _live_before(inner, optimizer, scaler, whole, whole_target, stored)
        if config.layout.replicates_parameters:  # the buckets outlive every step; no gradient points at them after zero_grad
            before[Category.GRADIENTS] += ddp_bucket_bytes(work)
        if device.type == "cuda":
            return _measure_cuda(window, device, before, steps)
        peaks = [_measure_window(window, device, own_thread=lowest) for _ in range(steps)]
        peak_step = min(peaks) if lowest else max(peaks)
    breakdown = dict(before)
    breakdown[Category.STEP] = peak_step
    return Measurement(sum(before.values()) + peak_step, breakdown, device=config.device)


def _measure_cuda(window, device: torch.device, before: dict[Any, int], steps: int) -> Measurement:
    """``steps`` windows on a GPU, measured by the CUDA caching allocator's own figures: every block of the process,
    rounded, the cuBLAS workspace included; the step's share is the peak above what existed ``before``."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        window()
    torch.cuda.synchronize(device)
    peak, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    breakdown: dict[Any, int] = dict(before)
    breakdown[Category.STEP] = max(0, peak - sum(before.values()))
    return Measurement(peak, breakdown, device="cuda", reserved_bytes=reserved)


_WINDOW = "autofit::measured_window"


def _rows(whole: Batch, target: Batch | None, i: int, size: int) -> tuple[Batch, Batch | None]:
    """Micro-batch ``i`` of ``size`` rows as views of the resident rows (the first ``size`` again where fewer rows
    than the window's are resident)."""
    start = i * size if (i + 1) * size <= whole.size else 0
    return whole.slice(start, start + size), None if target is None else target.slice(start, start + size)


def _measure_window(window, device: torch.device, own_thread: bool = False) -> int:
    """High-water mark of the CPU allocator while ``window`` runs, above what was allocated before it;
    ``own_thread``: of the allocations made on this thread only (Note [gloo's threads in the measured window],
    autofit/measure/ranks.py)."""
    with memory_profile() as prof:
        with torch.profiler.record_function(_WINDOW) if own_thread else contextlib.nullcontext():
            window()
    return high_water_mark(allocation_sizes(prof, _WINDOW if own_thread else None))[0]


def measure_callable(fn, live: list[torch.Tensor], *, device: str = "cpu", own_thread: bool = False) -> int:
    """Peak bytes while ``fn()`` runs: the distinct storages of ``live`` (what exists before it: parameters,
    optimizer state, the batch) plus the allocator's high-water mark during the call. Used to check a trainer's
    real step against its plan. On CUDA the allocator's own ``max_memory_allocated`` (the whole process).
    ``own_thread``: on the CPU, only the allocations made on this thread (a rank of a gloo job, Note [gloo's threads
    in the measured window], autofit/measure/ranks.py)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _storage_bytes(live) + _measure_window(fn, torch.device(device), own_thread=own_thread)
