"""Measure real training steps with the allocator's own record.

CPU: the step runs under ``torch.profiler.profile(activities=[CPU], profile_memory=True)``; its Allocation events
(``alloc_size`` negative on free) are replayed in time order, and the running sum's maximum plus the bytes alive
before the step is the peak. CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``.

Note [memory from before the window]
    The CPU profiler reports a free only for memory allocated while a memory profile ran: c10's
    ``ProfiledCPUMemoryReporter`` (c10/core/CPUAllocator.cpp) records an allocation's size in its table only while
    profiling memory (``New``), and ``Delete`` of an address missing from that table reports nothing ("Memory block
    of unknown size was allocated before the profiling started"). A tensor that an earlier step left alive and the
    measured step replaces (a module attribute kept across steps, a retained gradient) was then counted twice: in
    the bytes alive before the window, and again when its successor was allocated, its own free never seen.
    So one memory profile runs from the warm-up to the end of the measured windows: whatever the warm-up leaves
    alive is in the table, and its free in a measured window is reported. The same record says what was alive when
    the first window began: what no category holds (a backward hook's list of gradients, a retained gradient:
    tensors only the user's code reaches) is counted as ``kept``, instead of being missed. One profile, not one for
    the warm-up and one for the windows: gloo's worker thread can free a rank's tensor just after the warm-up, and
    between two profiles that free would go unseen while the tensor was counted as kept. What was alive is read at
    the start of each window, and a rank keeps its lowest window whole. A rank (Note [gloo's threads in the measured
    window], measure/ranks.py) counts of what was alive only the step's own tensors (the categories), and their
    frees: a tensor of the rank's that gloo still holds when a window begins is freed by gloo's thread whenever it
    gets there (a tensor-parallel rank measured 32 to 113 KiB high, a DDP rank 4 or 64 B), and a GPU job's NCCL
    holds no such tensor. The step's own tensors are read again before each window, not once after the warm-up:
    what a step keeps for the next may be new tensors every step (a V schedule's hand-offs between its two stages on
    one rank, torch's ``set_local_fwd_input``: the last step's activations and input gradients, 8 x 8 KiB on a tiny
    Llama), and when the allocator put a successor at another address, the first reading counted the old tensors
    before the window and their successors again inside it (a CI run measured a ZBV rank 65,536 B high in all three
    windows; idle machines reuse the address and hid it).
"""

from __future__ import annotations

import contextlib
import functools

import gc
from typing import Any

import torch

from autofit.core._torch import (
    grad_scaler_state,
    storage_tensors,
)
from autofit.core._torch_interrupts import interruption_point
from autofit.core._torch_profiler import memory_profile, window_memory
from autofit.training.batch import Batch
from autofit.capture.model_copy import attached_tensors, module_tensor_attributes, real_copy
from autofit.core.categories import Category
from autofit.features import FEATURES, convert_model
from autofit.training.loss import LossFn, compute_loss
from autofit.training.normalisation import LossNormalisation
from autofit.core.report import Measurement
from autofit.parallel.step_rules import kept_between_steps, kept_buckets, warm_up_windows
from autofit.training.stored import apply_stored
from autofit.parallel.apply import laid_out
from autofit.parallel.schedule import Window, schedule_of
from autofit.training.step import (
    StepConfig,
    WindowPlace,
    new_grad_scaler,
    optimizer_step,
    patched_model,
    run_micro_batch,
)

__all__ = ["measure_step", "measure_callable"]


def _storages(tensors) -> dict[int, int]:
    """``{address: bytes}`` of the distinct storages of ``tensors``; a wrapper subclass (torchao's optimizer state)
    by the storages of its inner tensors, a DTensor by its local shard."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for inner in storage_tensors(t):
                st = inner.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return seen


def _storage_bytes(tensors) -> int:
    return sum(_storages(tensors).values())


def _categories(model, optimizer, scaler, micro: Batch, micro_target: Batch | None,
                stored=None) -> dict[Category, dict[int, int]]:
    """The storages alive before the measured window, by category, as ``{address: bytes}``."""
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
        Category.PARAMETERS: _storages(list(model.parameters()) + [t for _, t in attached_tensors(model)]),
        Category.BUFFERS: _storages(buffers),
        Category.OPTIMIZER_STATE: _storages(state),
        Category.INPUTS: _storages(inputs),
        Category.GRADIENTS: _storages(grads),
    }


def _live_before(categories: dict[Category, dict[int, int]], alive: dict[int, int],
                 buckets: list[int]) -> dict[Category, int]:
    """Bytes alive before the measured window by category; of ``alive`` (what the allocator's record saw alive
    then), what no category holds is ``kept`` (Note [memory from before the window]). ``buckets``: the sizes of
    DDP's gradient buckets, counted as gradients: the reducer holds them and no tensor of ours reaches them; the
    warm-up rebuilt them, so one block of each size in ``alive`` is theirs, not kept."""
    before = {category: sum(storages.values()) for category, storages in categories.items()}
    before[Category.GRADIENTS] += sum(buckets)
    counted = set().union(*categories.values())
    kept = sorted(size for address, size in alive.items() if address not in counted)
    for size in buckets:
        if size in kept:
            kept.remove(size)
    if kept:
        before[Category.KEPT] = sum(kept)
    return before


def measure_step(
    model: torch.nn.Module, batch: Batch, target: Batch | None, loss_fn: LossFn | None, config: StepConfig,
    *, steps: int = 1, lowest: bool = False,
) -> Measurement:
    """Run ``config`` for real on a copy of ``model``: one warm-up window (creates optimizer state), then ``steps``
    measured windows of ``accumulation_steps`` micro-batches each. Returns the highest peak; ``lowest``: the lowest,
    of the allocations made on this thread (a rank of a gloo job, Note [gloo's threads in the measured window],
    measure/ranks.py)."""
    device = torch.device(config.device)
    work = convert_model(config, real_copy(model).to(device))
    # the rows resident all window (StepConfig.held_rows: the whole batch, as trainer.step receives it, or one
    # micro-batch), and the micro-batches as slices of them, as the trainer runs them
    rows = max(config.held_rows, config.micro_batch_size)
    whole = batch.map_tensors(lambda t: t.to(device)).resize(rows)
    whole_target = None if target is None else target.map_tensors(lambda t: t.to(device)).resize(rows)
    micro_batches = [_rows(whole, whole_target, i, config.micro_batch_size) for i in range(config.accumulation_steps)]
    # one rank of a parallel layout (measure/ranks.py runs one process per rank): DDP wraps the copy, FSDP2 and
    # tensor parallel replace its parameters in place; the knobs patch the copy itself, as the trainer patches its
    # model's inner module
    inner, work = work, laid_out(work, config.layout, device.type, gradient_as_bucket_view=config.gradient_as_bucket_view,
                                   param_dtype=config.precision.param_dtype)
    optimizer = config.optimizer.build(work.parameters())
    stored = apply_stored(inner, optimizer, config.precision.stored, config.precision.fp32_modules)
    scaler = new_grad_scaler(config, device.type)

    norm = LossNormalisation.of_rows((config.micro_batch_size,) * config.accumulation_steps)

    def window() -> None:  # in the step's order: the gradients cleared where config.zero_grad puts it
        def one(i: int, micro: Batch, micro_target: Batch | None, place: WindowPlace) -> None:
            # a Ctrl-C between micro-batches (Note [Ctrl-C at safe points], core/_torch_interrupts.py)
            interruption_point()
            run_micro_batch(work, micro, micro_target, loss_fn, config, device.type, place=place, scaler=scaler,
                            features=FEATURES)

        window = Window(config.accumulation_steps, rows=micro_batches.__getitem__,
                        place=lambda i: WindowPlace.of(i, norm, optimizer),
                        loss=functools.partial(compute_loss, loss_fn), body=one)
        schedule_of(config.layout, config.accumulation_steps).run(work, config.layout, window)  # Note [one schedule]
        interruption_point()
        optimizer_step(optimizer, scaler, clip_grad_norm=config.clip_grad_norm, stored=stored,
                       in_backward=config.optimizer_in_backward, keep_grads=config.preallocated_grads,
                       zero_grad=config.zero_grad == "after-step")

    with patched_model(inner, config, device.type), contextlib.ExitStack() as features:
        for feature in FEATURES:  # what each step feature does to a real model (Note [step features])
            features.enter_context(feature.real_context(config, inner))
        for feature in FEATURES:  # what each step feature holds around the step
            features.enter_context(feature.step_context(config, inner, optimizer))

        def warm_up() -> None:
            for _ in range(warm_up_windows(config.layout)):  # the optimizer state, DDP's rebuilt buckets
                window()

        def settle() -> tuple[tuple[dict[Category, dict[int, int]], list[int]], set[int]]:
            gc.collect()
            # the buckets outlive every step; no gradient points at them after zero_grad
            buckets = kept_buckets(config.layout, work)
            categories = _categories(inner, optimizer, scaler, whole, whole_target, stored)
            # what the layout's machinery holds across steps (a pipeline's receive buffers) is the step's own
            categories[Category.BUFFERS].update(_storages(kept_between_steps(config.layout, work)))
            return (categories, buckets), set().union(*categories.values())

        if device.type == "cuda":
            warm_up()
            (categories, buckets), _ = settle()
            return _measure_cuda(window, device, _live_before(categories, {}, buckets), steps)
        windows, settled = _measure_window(window, device, own_thread=lowest, warm_up=warm_up, settle=settle,
                                           windows=steps)
        # each window: what was alive when it began, and its high-water mark above that; the highest, or for a rank
        # the lowest (Note [gloo's threads in the measured window]: what gloo's thread has not freed yet is a race)
        measured = [(_live_before(categories, alive, buckets), peak)
                    for (alive, peak), (categories, buckets) in zip(windows, settled)]
        before, peak_step = (min if lowest else max)(measured, key=lambda m: sum(m[0].values()) + m[1])
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


_SPAN = "autofit::measured_window_span"


def _measure_window(window, device: torch.device, own_thread: bool = False, *, warm_up=None, settle=None,
                    windows: int = 1) -> tuple[list[tuple[dict[int, int], int]], list[Any]]:
    """Under one CPU memory profile: ``warm_up()``, then ``windows`` times ``settle()`` and a run of ``window``.
    Returns, for each window, what the allocator's record saw alive when it began (``{address: bytes}``: Note
    [memory from before the window]) and its high-water mark above that; and what ``settle`` returned before each
    (the step's own tensors then: a step may keep new ones for the next). ``own_thread``: of the allocations made
    on this thread only (Note [gloo's threads in the measured window], autofit/measure/ranks.py)."""
    settled, known = [], []
    with memory_profile() as prof:
        with torch.profiler.record_function(_WINDOW) if own_thread else contextlib.nullcontext():
            if warm_up is not None:
                warm_up()
            for _ in range(windows):
                result, addresses = settle() if settle is not None else (None, set())
                settled.append(result)
                known.append(addresses)
                with torch.profiler.record_function(_SPAN):
                    window()
    return window_memory(prof, _SPAN, _WINDOW if own_thread else None, known), settled


def measure_callable(fn, live: list[torch.Tensor], *, device: str = "cpu", own_thread: bool = False,
                     warm_up=None) -> int:
    """Peak bytes while ``fn()`` runs: the distinct storages of ``live`` (what exists before it: parameters,
    optimizer state, the batch) plus the allocator's high-water mark during the call. Used to check a trainer's
    real step against its plan. On CUDA the allocator's own ``max_memory_allocated`` (the whole process).
    ``own_thread``: on the CPU, only the allocations made on this thread (a rank of a gloo job, Note [gloo's threads
    in the measured window], autofit/measure/ranks.py). ``warm_up``: a call run first (an earlier step) under the
    same allocator's record, so that what it leaves alive and ``fn`` frees is seen freed, and what it leaves alive
    outside ``live`` is counted (Note [memory from before the window]); without it, a tensor an earlier step left
    alive and ``fn`` replaces is counted twice."""
    if torch.device(device).type == "cuda":
        if warm_up is not None:
            warm_up()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    def settle() -> tuple[dict[int, int], set[int]]:
        gc.collect()
        counted = _storages(live)
        return counted, set(counted)

    [(alive, peak)], [counted] = _measure_window(fn, torch.device(device), own_thread, warm_up=warm_up,
                                                 settle=settle)
    kept = sum(size for address, size in alive.items() if address not in counted)
    return sum(counted.values()) + kept + peak
