"""The three memory figures (``peak_allocated_bytes``, ``peak_reserved_bytes``, ``device_bytes``) in the estimate,
the plan, its JSON, ``str(plan)`` and the CLI table. What each is compared with on a GPU: tests/test_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console
from torch import nn

import autofit
from autofit.cli.render import render_plan
from autofit.cuda.model import CUDA_CONTEXT_BYTES
from autofit.core.units import format_bytes

pytestmark = pytest.mark.sim  # the simulation tier (tests/conftest.py)

MiB = 1 << 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.sum()


def test_on_the_cpu_the_three_figures_are_the_allocators_peak():
    model, x = _model(), torch.randn(4, 256)
    kw = dict(step=4, loss_fn=_loss, device="cpu")
    est, meas = autofit.estimate(model, x, **kw), autofit.measure(model, x, **kw)
    assert est.peak_allocated_bytes == est.peak_reserved_bytes == est.device_bytes == est.peak_bytes \
        == meas.peak_bytes


def test_on_cuda_the_three_figures_by_hand():
    """One Linear(256, 256), 4 rows, loss ``sum``, SGD with momentum (autofit's "sgd"), on an A100, counted by hand
    from CUDACachingAllocator.cpp and CublasHandlePool.cpp, not from autofit's replay:

    - allocated at the peak (backward, when the gradients exist): parameters, gradients and the momentum buffer, each
      262,144 + 1,024 B (sizes are rounded up to 512 B, ``kMinBlockSize``: both already are); the input 4,096 B; the
      loss and the gradient of ``sum`` (one fp32 each: 4 B rounded up to 512); the cuBLAS workspace of a device below
      compute capability 9 (``parseChosenWorkspaceSize``: 4096 KiB x 2 + 16 KiB x 8).
    - reserved (``get_allocation_size``): a request <= 1 MiB (``kSmallSize``) takes a 2 MiB segment (``kSmallBuffer``),
      one of 1 to 10 MiB (``kMinLargeAlloc``) a 20 MiB segment (``kLargeBuffer``). The small tensors (794,624 B) fit
      one small segment; the workspace takes one large one: 22 MiB.
    - on the device: reserved plus the CUDA context."""
    est = autofit.estimate(nn.Linear(256, 256), torch.randn(4, 256), step=4, loss_fn=_loss,
                           optimizer="sgd", device="A100-80GB")
    states = 3 * (256 * 256 * 4 + 256 * 4)
    workspace = 4096 * 1024 * 2 + 16 * 1024 * 8
    assert est.peak_allocated_bytes == states + 4 * 256 * 4 + 2 * 512 + workspace == 9_314_304
    assert est.peak_reserved_bytes == 2 * MiB + 20 * MiB
    assert est.device_bytes == 22 * MiB + CUDA_CONTEXT_BYTES
    assert est.peak_bytes == est.peak_allocated_bytes  # the contract: peak_bytes is the allocated figure on CUDA
    assert sum(est.breakdown.values()) == est.device_bytes  # the categories add up to what the budget applies to
    assert f"reserved {format_bytes(est.peak_reserved_bytes)} ({est.peak_reserved_bytes:,} bytes)" in str(est)


def _cuda_plan() -> autofit.Plan:
    return autofit.plan(_model(), torch.randn(8, 256), "2GB", batch_size=8, loss_fn=_loss, device="T4")


def test_plan_json_and_tables_name_the_three_figures():
    plan = _cuda_plan()
    assert (plan.peak_allocated_bytes, plan.peak_reserved_bytes, plan.device_bytes) == (
        plan.estimate.peak_allocated_bytes, plan.estimate.peak_reserved_bytes, plan.estimate.device_bytes)
    assert plan.peak_allocated_bytes < plan.peak_reserved_bytes < plan.device_bytes <= plan.budget_bytes
    data = json.loads(plan.to_json())
    assert data["peak_allocated_bytes"] == data["peak_bytes"] == plan.peak_allocated_bytes
    assert data["peak_reserved_bytes"] == plan.peak_reserved_bytes
    assert data["device_bytes"] == plan.device_bytes
    assert data["estimate"]["peak_reserved_bytes"] == plan.peak_reserved_bytes
    again = autofit.Plan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json()
    text = str(plan)
    for label in ("peak allocated", "max_memory_allocated", "peak reserved", "max_memory_reserved", "on the device",
                  "nvidia-smi"):
        assert label in text
    console = Console(width=160, record=True)
    render_plan(console, plan, "mlp", None)
    table = console.export_text()
    assert "predicted peak " not in table.replace("predicted peak by category", "")  # the old unnamed row is gone
    for label, value in (("peak allocated", plan.peak_allocated_bytes), ("peak reserved", plan.peak_reserved_bytes),
                         ("on the device", plan.device_bytes)):
        line = next(line for line in table.splitlines() if label in line)
        assert f"{value / MiB:,.1f} MiB" in line, line


def test_a_plan_json_written_before_the_three_figures_still_loads():
    data = json.loads(_cuda_plan().to_json())
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "clip_grad_norm"):
        data.pop(key)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        data["estimate"].pop(key)
    plan = autofit.Plan.from_json(json.dumps(data))
    assert plan.clip_grad_norm is None
    # the reserve beyond the allocated blocks was recorded as the breakdown's fragmentation
    assert plan.peak_reserved_bytes == plan.estimate.peak_reserved_bytes \
        == plan.peak_bytes + plan.estimate.breakdown["fragmentation"] == _cuda_plan().peak_reserved_bytes


def test_cudnn_workspace_bound_is_stated_where_the_step_runs_convolutions():
    """Conv_v8.cpp: ``run_conv_plan`` allocates the engine's workspace for the call; ``try_configs`` skips engines
    whose workspace allocation fails. The estimate says so wherever a convolution runs, and only there."""
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())
    est = autofit.estimate(conv, torch.randn(2, 3, 8, 8), step=2, loss_fn=_loss, device="A100-80GB")
    assert any("cuDNN convolution workspaces" in note for note in est.notes)
    est = autofit.estimate(_model(), torch.randn(2, 256), step=2, loss_fn=_loss, device="A100-80GB")
    assert not any("cuDNN" in note for note in est.notes)
