"""What a layout keeps in host memory (issue 54): as the plan records it (the plan asks the layout whether its host
budget applies, rather than reading where the layout keeps the states; ``Parallel.host_rows`` shows the rows), and as
a step on a target device runs it (where the states live and where the optimizer steps them: the simulation asks
these, Note [offload])."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from autofit.parallel.layout import Parallel

# the step's DeviceKind (autofit/training/config.py), which the layout's home does not import: training imports it
DeviceKind = TypeVar("DeviceKind")

__all__ = ["recorded_host_budget", "optimizer_runs_on", "states_off_device", "host_words"]


def recorded_host_budget(layout: Parallel, host_budget_bytes: int | None, *, activations: bool) -> int | None:
    """The host budget a plan of ``layout`` records: ``host_budget_bytes`` where its step keeps anything in host
    memory, the saved activations it offloads (``activations``) or the layout's parameters, gradients and optimizer
    state (FSDP2 CPUOffloadPolicy, Note [offload]); None where it keeps nothing there."""
    return host_budget_bytes if (activations or layout.offload_states) else None


def optimizer_runs_on(layout: Parallel, device: DeviceKind) -> DeviceKind:
    """The device whose implementation a step's optimizer and clipping run on a ``device`` target: the host's where
    ``layout`` keeps the states in host memory (FSDP2's CPUOffloadPolicy steps them there, Note [offload]), the
    target's otherwise (torch's pick there: foreach on CUDA)."""
    return device.host if layout.offload_states else device


def states_off_device(layout: Parallel, device: DeviceKind) -> bool:
    """The step's parameters, gradients and optimizer state live in host memory apart from ``device``'s (Note [host
    storages]): ``layout`` keeps them on the host and the target is not the host itself (a GPU); the device's
    figures then do not hold them."""
    return layout.offload_states and not device.is_host


def host_words(layout: Parallel) -> str:
    """What ``layout`` keeps on the host, in words after the layout's own (``autofit compare``'s rows): ", states on
    the host" where it keeps the parameters, gradients and optimizer state there, "" otherwise."""
    return ", states on the host" if layout.offload_states else ""
