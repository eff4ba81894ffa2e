"""PyTorch's own estimator, run the way its docs and tests run it, as a baseline for autofit.

``torch.distributed._tools.mem_tracker.MemTracker`` is a private TorchDispatchMode that counts the storages of
parameters, buffers, gradients, optimizer state and every tensor an op makes, and keeps the high-water mark. Under
``FakeTensorMode`` it needs no memory. The recipe of its docstring and of PyTorch's
``test/distributed/_tools/test_mem_tracker.py``: build model, optimizer and inputs in a FakeTensorMode, run one
warm-up iteration so the optimizer state exists, ``track_external(model, optimizer, inputs)``, then track one
iteration and read ``get_tracker_snapshot("peak")``.

To be fair the step is autofit's own step code (``autofit.training.step``): the same checkpoint wrapping, autocast, loss,
``del output`` before backward, ``optimizer.step()`` and ``zero_grad(set_to_none=True)``. What differs is only the
estimator: MemTracker does not see tensors made outside the dispatcher (checkpoint's RNG state) nor kernel scratch
memory, and it cannot run code that reads tensor values (``.item()``, data-dependent branches) on fake tensors.
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from autofit.features import FEATURES
from autofit.training.batch import as_batch
from autofit.training.step import make_step_config, optimizer_step, patched_model, run_micro_batch

__all__ = ["MemTrackerResult", "memtracker_estimate"]


@dataclass(frozen=True)
class MemTrackerResult:
    """``peak_bytes`` is None when MemTracker failed; ``error`` then names the exception (``crash: <Name>``)."""

    peak_bytes: int | None
    seconds: float
    error: str = ""


def _plain_tensor_attributes(model: nn.Module):
    """Tensor attributes that are neither parameters nor buffers (rotary caches, masks): deepcopy would keep them
    real, so they are faked like the rest, and tracked as external tensors."""
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield value


def _fake_model(model: nn.Module, fake_mode: FakeTensorMode) -> nn.Module:
    """A deep copy whose parameters, buffers and tensor attributes are fake tensors of the same shape and dtype.
    Meta tensors become fake CPU tensors (MemTracker counts any device; the allocator we compare with is the CPU's)."""

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            with fake_mode:
                return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="cpu")
        return fake_mode.from_tensor(t.detach())

    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo.setdefault(id(p), nn.Parameter(fake(p), requires_grad=p.requires_grad))
    for b in model.buffers():
        memo.setdefault(id(b), fake(b))
    for t in _plain_tensor_attributes(model):
        memo.setdefault(id(t), fake(t))
    return copy.deepcopy(model, memo)


def memtracker_estimate(
    model: nn.Module, sample: Any, *, micro_batch_size: int, target: Any = None, loss_fn=None,
    optimizer: Any = "adamw", precision: str = "fp32", checkpoint: tuple[str, ...] = (),
) -> MemTrackerResult:
    """MemTracker's peak for autofit's step on the CPU, or the exception it died of. Seconds include the warm-up."""
    config = make_step_config(micro_batch_size=micro_batch_size, precision=precision, checkpoint=checkpoint,
                              optimizer=optimizer, device="cpu")
    start = time.perf_counter()
    try:
        peak = _run(model, sample, target, loss_fn, config)
    except Exception as e:  # noqa: BLE001 - a baseline's failure is a result to report, not a benchmark error
        return MemTrackerResult(None, time.perf_counter() - start, f"crash: {type(e).__name__}")
    finally:
        gc.collect()
    return MemTrackerResult(peak, time.perf_counter() - start)


def _run(model, sample, target, loss_fn, config) -> int:
    fake_mode = FakeTensorMode()
    work = _fake_model(model, fake_mode)
    micro = as_batch(sample).resize(config.micro_batch_size).map_tensors(fake_mode.from_tensor)
    micro_target = None
    if target is not None:
        micro_target = as_batch(target, what="target").resize(config.micro_batch_size).map_tensors(
            fake_mode.from_tensor)
    with fake_mode, patched_model(work, config, "cpu"):
        optim = config.optimizer.build(work.parameters())

        def step() -> None:
            run_micro_batch(work, micro, micro_target, loss_fn, config, "cpu", features=FEATURES)
            optimizer_step(optim)

        step()  # warm-up: creates the optimizer state, as in the steady state
        tracker = MemTracker()
        inputs = micro.tensors() + (micro_target.tensors() if micro_target is not None else [])
        tracker.track_external(work, optim, *inputs, *_plain_tensor_attributes(work))
        with tracker:
            step()
        peak = tracker.get_tracker_snapshot("peak")
    return sum(snap["Total"] for snap in peak.values())
