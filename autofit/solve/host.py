"""The host budget checked before any analysis (Note [the host of the target], autofit/validate.py): when the
parameters, gradients and optimizer state cannot stay on the GPU in any rung of the ladder, they go to the host,
and when they alone exceed the host budget no plan can fit, whatever the analysis would find."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autofit.core.errors import HostMemoryError
from autofit.core.units import format_bytes
from autofit.parallel.step_memory import node_bytes
from autofit.solve.ladder import ladder, states_bytes

if TYPE_CHECKING:
    from autofit.request import PlanRequest
    from autofit.parallel.layout import Parallel

__all__ = ["host_floor", "check_host_before_analysis", "host_budget_words"]

GiB = 2**30


def host_budget_words(node_bytes: int) -> str:
    """A host budget that holds ``node_bytes``, as ``plan(host_budget=...)`` takes it: whole GiB, rounded up."""
    return f'host_budget="{math.ceil(node_bytes / GiB)}GiB"'


def host_floor(request: PlanRequest, parallel: Parallel) -> tuple[int, int] | None:
    """(GPU floor, host floor per node) when ``parallel`` can fit only with its states on the host: the least any
    rung on the GPU needs (its states, over the budget), and the states the host rung keeps there for the ranks of
    one node. None when a rung on the GPU may fit, when there is no host rung (offload not allowed), or when the
    budget cannot hold even the host rung's least on the GPU (its gathered parameters, the CUDA context and cuBLAS
    workspace): then the GPU budget is the first thing short, and the analysis names the smallest that works."""
    request = request.for_layout(parallel)
    stages = ladder(request, parallel)
    host = stages[-1]
    on_gpu = [s.floor_bytes for s in stages[:-1]]
    if not host.host_check or None in on_gpu or not on_gpu or min(on_gpu) <= request.fit_bytes:
        return None
    from autofit.cuda.model import context_bytes, cublas_workspace_bytes  # the host rung exists only on a GPU

    if (host.floor_bytes or 0) + context_bytes() + cublas_workspace_bytes(request.device.gpu) > request.fit_bytes:
        return None
    k = request.optimizer.state_values_per_parameter()
    per_rank = states_bytes(request, host.parallel, host.policies[0], k)
    return min(on_gpu), node_bytes(host.parallel, per_rank)  # the ranks of one node share its host


def check_host_before_analysis(request: PlanRequest, parallels: list[Parallel]) -> None:
    """Raise ``HostMemoryError`` when every layout fits only with its states on the host and those alone exceed
    the host budget (before any simulation); the message names the smallest host budget and GPU budget that could
    work."""
    budget = request.host_budget_bytes
    if budget is None or not parallels:
        return
    floors = [host_floor(request, p) for p in parallels]
    if any(f is None or f[1] <= budget for f in floors):
        return
    gpu, node = min(floors, key=lambda f: f[1])
    least_gpu = min(f[0] for f in floors) + request.margin_bytes
    raise HostMemoryError(
        f"the parameters, gradients and optimizer state alone need at least {format_bytes(least_gpu)} per GPU, more "
        f"than the budget {format_bytes(request.budget_bytes)}, so they must live in host memory, where they need "
        f"{format_bytes(node)} ({node:,} bytes) per node, more than the host budget {format_bytes(budget)} "
        f"({budget:,} bytes). Known before any analysis: give the training machine's RAM, at least "
        f"{host_budget_words(node)} (what the activations keep on the host comes on top), or a budget of at least "
        f"{format_bytes(least_gpu)}, or more GPUs (FSDP2 over world_size ranks)",
        host_bytes=node, host_budget_bytes=budget,
    )
