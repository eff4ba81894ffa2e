"""The allocator's expandable segments as an input of ``estimate``, ``measure``, ``plan`` and the CLI (issue 58, Note
[expandable segments as an input] in autofit/device.py): the reserved figure against a hand count of pages, and
against the allocator models replayed over the allocations of the same step run for real under the CPU profiler."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import autofit
from autofit.core.errors import InvalidInputError
from autofit.core.report import EXPANDABLE_SEGMENTS
from autofit.cuda.allocator import replay_allocator
from autofit.cuda.catalog import gpu_spec
from autofit.cuda.model import cublas_workspace_bytes
from tests.test_allocator_cap import _timeline

MiB = 2**20
ROWS, WIDTH, HIDDEN = 1024, 1024, 5120  # fp32: the input 4 MiB, each weight and each hidden activation 20 MiB


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN, bias=False), nn.ReLU(), nn.Linear(HIDDEN, WIDTH, bias=False))


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)  # no state; on CUDA _foreach_add_ in place, on the CPU add_ in place


def _estimate(expandable: bool | None):
    return autofit.estimate(_mlp(), torch.randn(ROWS, WIDTH), step=ROWS, loss_fn=_loss, optimizer=_sgd,
                            device=autofit.Device(gpu="H100", expandable_segments=expandable))


def _profiled_steps() -> list[tuple[str, str, int]]:
    """The allocations of one plain training step after a warm-up one, from the CPU profiler's Allocation events
    (time order, paired by address), after the parameters and the input: what the CUDA allocator would be asked."""
    model, x = _mlp(), torch.randn(ROWS, WIDTH)
    opt = _sgd(model.parameters())

    def step() -> None:
        loss = _loss(model(x))
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
        stack.extend(node.children)
    steps = [("alloc", f"held{i}", t.untyped_storage().nbytes()) for i, t in enumerate([*model.parameters(), x])]
    live: dict[int, str] = {}
    for n, (_, size, ptr) in enumerate(sorted(events)):
        if size > 0:
            live[ptr] = f"t{n}"
            steps.append(("alloc", live[ptr], size))
        elif ptr in live:
            steps.append(("free", live.pop(ptr), 0))
    return steps


@pytest.mark.sim
def test_estimate_with_expandable_segments_reserves_whole_pages() -> None:
    plain, expandable, off = _estimate(None), _estimate(True), _estimate(False)
    # by hand: allocated at the peak (backward) the cuBLAS workspace (32 MiB on an H100), the two weights (40 MiB),
    # the input (4 MiB), the saved hidden activation, its gradient's two 20 MiB buffers and the first weight's
    # gradient (80 MiB): 156 MiB, all in the large pool but the loss's scalars (1 KiB in the small pool).
    # Expandable segments map 20 MiB pages (kLargeBuffer) as the segment grows, and without a cap never unmap, so
    # reserved is the large pool's high-water mark in whole pages (160 MiB) plus one 2 MiB small-pool page.
    assert cublas_workspace_bytes(gpu_spec("H100")) == 32 * MiB
    assert plain.peak_bytes == expandable.peak_bytes == 156 * MiB + 1024
    assert expandable.peak_reserved_bytes == 8 * 20 * MiB + 2 * MiB
    assert expandable.alloc_conf == EXPANDABLE_SEGMENTS and plain.alloc_conf == off.alloc_conf == ""
    # the default allocator keeps plain segments that live blocks pin: 12 MiB more here
    assert plain.peak_reserved_bytes == off.peak_reserved_bytes == 174 * MiB
    # the independent truth: the allocations of the same step run for real (CPU profiler), replayed through both
    # allocator models (hand-checked in tests/test_allocator_expandable.py and tests/test_allocator_cap.py)
    timeline, workspace = _timeline(_profiled_steps()), (32 * MiB,)
    for est, expandable_segments in ((plain, False), (expandable, True)):
        replay = replay_allocator(timeline, persistent=workspace, expandable=expandable_segments)
        assert (est.peak_bytes, est.peak_reserved_bytes) == (replay.peak_allocated, replay.peak_reserved)


def test_expandable_segments_is_refused_on_the_cpu() -> None:
    with pytest.raises(InvalidInputError, match="CUDA caching allocator"):
        autofit.estimate(_mlp(), torch.randn(4, WIDTH), step=4, loss_fn=_loss,
                         device=autofit.Device(kind="cpu", expandable_segments=True))
    with pytest.raises(InvalidInputError, match="expandable_segments"):
        autofit.Device(gpu="H100", expandable_segments="yes")


@pytest.mark.sim
def test_cli_estimate_takes_expandable_segments() -> None:
    from typer.testing import CliRunner

    from autofit.cli.app import app
    from tests.test_cli_estimate import MLP

    args = ["estimate", MLP, "--input-shape", "128", "-m", "4", "--device", "cuda", "--gpu", "H100-80GB", "--json"]
    runner = CliRunner()
    plain, expandable = (runner.invoke(app, args + extra) for extra in ([], ["--expandable-segments"]))
    assert plain.exit_code == expandable.exit_code == 0, plain.output + expandable.output
    plain, expandable = (json.loads(r.stdout[r.stdout.index("{"):]) for r in (plain, expandable))
    assert (plain["alloc_conf"], expandable["alloc_conf"]) == ("", EXPANDABLE_SEGMENTS)
    assert plain["peak_allocated_bytes"] == expandable["peak_allocated_bytes"]
    # the workspace (32 MiB) in 20 MiB pages, the tensors in one 2 MiB small-pool page: 40 + 2 MiB
    assert expandable["peak_reserved_bytes"] == 42 * MiB
    refused = runner.invoke(app, ["estimate", MLP, "--input-shape", "128", "-m", "4", "--device", "cpu",
                                  "--expandable-segments"])
    assert refused.exit_code != 0 and "CUDA caching allocator" in refused.output, refused.output


def test_measure_refuses_it_on_the_cpu() -> None:
    with pytest.raises(InvalidInputError, match="CUDA caching allocator"):
        autofit.measure(_mlp(), torch.randn(4, WIDTH), step=4, loss_fn=_loss,
                        device=autofit.Device(kind="cpu", expandable_segments=True))


@pytest.mark.sim
def test_a_plan_told_the_setting_runs_with_it() -> None:
    x = torch.randn(ROWS, WIDTH)
    kw = dict(loss_fn=_loss, optimizer=_sgd, precision="fp32")
    told = autofit.plan(_mlp(), x, "80GB", device=autofit.Device(gpu="H100", expandable_segments=True), **kw)
    plain = autofit.plan(_mlp(), x, "80GB", device=autofit.Device(gpu="H100"), **kw)
    # the same configuration; the told plan carries the setting to its trainer and reserves whole pages
    assert (told.micro_batch_size, told.checkpoint) == (plain.micro_batch_size, plain.checkpoint)
    assert told.alloc_conf == EXPANDABLE_SEGMENTS and plain.alloc_conf == ""
    assert told.peak_reserved_bytes < plain.peak_reserved_bytes
