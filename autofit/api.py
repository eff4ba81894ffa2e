"""The public entry points. Each reads as the pipeline stages it composes (docs/index.md, "The pipeline")."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autofit.analyse.analyse import analyse_model
from autofit.analyse.table import Analysis
from autofit.batch import Batch, as_batch
from autofit.categories import Category
from autofit.errors import InvalidInputError
from autofit.loss import LossFn
from autofit.measure.allocator import measure_step
from autofit.report import Measurement, MemoryEstimate
from autofit.simulate.run import simulate_step
from autofit.simulate.timeline import Phase
from autofit.optim import as_optimizer_spec
from autofit.precision import as_policy
from autofit.step import StepConfig, forward_errors, make_step_config

__all__ = ["analyse", "estimate", "measure"]


def _check_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def _inputs(sample: Any, target: Any) -> tuple[Batch, Batch | None]:
    batch = as_batch(sample)
    if target is None:
        return batch, None
    target_batch = as_batch(target, what="target")
    if target_batch.size != batch.size:
        raise InvalidInputError(
            f"target has {target_batch.size} rows along dim 0 but the sample has {batch.size}: "
            "give one target row per sample row"
        )
    return batch, target_batch


def _config(micro_batch_size, accumulation_steps, precision, checkpoint, optimizer, device, gpu=None,
            clip_grad_norm=None) -> StepConfig:
    return make_step_config(micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps,
                            precision=precision, checkpoint=checkpoint, optimizer=optimizer, device=device, gpu=gpu,
                            clip_grad_norm=clip_grad_norm)


def estimate(
    model: nn.Module, sample: Any, *, micro_batch_size: int, target: Any = None, loss_fn: LossFn | None = None,
    optimizer: Any = "adamw", precision: Any = "fp32", checkpoint: Any = (), device: str = "cpu",
    accumulation_steps: int = 1, gpu: str | None = None, clip_grad_norm: float | None = None,
) -> MemoryEstimate:
    """Predict the peak memory of one steady-state training step, without allocating the model or its activations.

    The step (docs/memory-model.md): forward and loss under the precision's autocast, backward; after
    ``accumulation_steps`` micro-batches, ``optimizer.step()`` and ``zero_grad(set_to_none=True)``. Parameters,
    buffers, optimizer state, inputs and targets (one micro-batch of them) are counted. ``model`` may live on the
    meta device. It is never modified. ``clip_grad_norm``: clip the gradients to this norm before the step
    (``torch.nn.utils.clip_grad_norm_``; Hugging Face's Trainer clips at 1.0); None does not clip. The optimizer
    runs the implementation torch picks on ``device`` (foreach on CUDA, unless the optimizer sets foreach/fused).

    ``device="cuda"`` adds the CUDA model (``autofit.cuda``) for ``gpu`` (a catalog name; default: this machine's
    GPU, else A100-80GB) and three figures: ``peak_allocated_bytes`` (= ``peak_bytes``, comparable with
    ``torch.cuda.max_memory_allocated``), ``peak_reserved_bytes`` (``max_memory_reserved``) and ``device_bytes``
    (nvidia-smi: reserved plus the CUDA context; budgets apply to it). On the CPU the three are equal.
    """
    model = _check_model(model)
    batch, target_batch = _inputs(sample, target)
    config = _config(micro_batch_size, accumulation_steps, precision, checkpoint, optimizer, device, gpu,
                     clip_grad_norm)
    sim = simulate_step(model, batch, target_batch, loss_fn, config)
    return _to_estimate(sim, config)


def _to_estimate(sim, config: StepConfig) -> MemoryEstimate:
    ops = sim.timeline.ops
    at = ""
    if 0 <= sim.replay.peak_op < len(ops):
        op = ops[sim.replay.peak_op]
        at = f"{op.name} in {op.module or 'top level'}"
    phase = {Phase.SETUP: "start", Phase.FORWARD: "forward", Phase.BACKWARD: "backward",
             Phase.OPTIMIZER: "optimizer"}[sim.replay.peak_phase]
    if config.device == "cuda":
        from autofit.cuda.model import cuda_memory, cudnn_workspace_note
        from autofit.cuda.target import resolve_gpu

        gpu, note = resolve_gpu(config.gpu)
        peak, device_bytes, breakdown = cuda_memory(sim.timeline, sim.replay, gpu)
        notes = sim.notes + tuple(n for n in (note, cudnn_workspace_note(sim.timeline)) if n)
        reserved = device_bytes - breakdown[Category.CUDA_CONTEXT]  # cuda_memory: reserved + context
        return MemoryEstimate(peak_bytes=peak, breakdown=breakdown, device="cuda", device_bytes=device_bytes,
                              peak_reserved_bytes=reserved, peak_phase=phase, peak_at=at, method=sim.method,
                              notes=notes)
    return MemoryEstimate(
        peak_bytes=sim.replay.peak_bytes, breakdown=sim.replay.breakdown, device=config.device,
        peak_phase=phase, peak_at=at, method=sim.method, notes=sim.notes,
    )


def measure(
    model: nn.Module, sample: Any, *, micro_batch_size: int, target: Any = None, loss_fn: LossFn | None = None,
    optimizer: Any = "adamw", precision: Any = "fp32", checkpoint: Any = (), device: str = "cpu",
    accumulation_steps: int = 1, steps: int = 1, clip_grad_norm: float | None = None,
) -> Measurement:
    """Run the same step for real on a copy of ``model`` on ``device`` and measure its peak with the allocator."""
    model = _check_model(model)
    batch, target_batch = _inputs(sample, target)
    config = _config(micro_batch_size, accumulation_steps, precision, checkpoint, optimizer, device,
                     clip_grad_norm=clip_grad_norm)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("measure(device='cuda') needs a CUDA device; this machine has none")
    with forward_errors():
        return measure_step(model, batch, target_batch, loss_fn, config, steps=steps)


def analyse(
    model: nn.Module, sample: Any, *, target: Any = None, loss_fn: LossFn | None = None, precision: Any = "fp32",
    optimizer: Any = "adamw", device: str = "cpu", gpu: str | None = None,
) -> Analysis:
    """Trace the forward and tabulate every module: parameter bytes, bytes saved for backward, output bytes and
    FLOPs (per sample and fixed), and whether it may be a checkpoint segment; plus the step's peak per stage as a
    function of the micro-batch. Fake tensors only, unless the forward reads tensor values (then a real copy runs at
    the analysis' micro-batches, 2 and 3). No CPU kernel probes (``plan`` adds them for CPU targets), so on the CPU
    the profile leaves out kernel scratch memory. ``model`` is never modified."""
    model = _check_model(model)
    batch, target_batch = _inputs(sample, target)
    config = make_step_config(micro_batch_size=1, precision=precision, optimizer=optimizer, device=device, gpu=gpu)
    with forward_errors():  # the graph capture runs the forward outside the simulator's own error handling
        return analyse_model(model, batch, target_batch, loss_fn, config.precision, config.optimizer,
                             device=config.device, gpu=config.gpu)
