"""What a layout keeps in host memory, as the plan records it (issue 54): the plan asks the layout whether its host
budget applies, rather than reading where the layout keeps the states (``Parallel.host_rows`` shows the rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autofit.parallel.layout import Parallel

__all__ = ["recorded_host_budget"]


def recorded_host_budget(layout: Parallel, host_budget_bytes: int | None, *, activations: bool) -> int | None:
    """The host budget a plan of ``layout`` records: ``host_budget_bytes`` where its step keeps anything in host
    memory, the saved activations it offloads (``activations``) or the layout's parameters, gradients and optimizer
    state (FSDP2 CPUOffloadPolicy, Note [offload]); None where it keeps nothing there."""
    return host_budget_bytes if (activations or layout.offload_states) else None
