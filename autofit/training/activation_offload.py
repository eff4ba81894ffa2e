"""Activation offload, the step's part: PyTorch's ``save_on_cpu`` around the forward of each offloaded module (Note
[offload], autofit/training/step.py). The step feature "activation-offload" (autofit/features/activation_offload.py)
holds it around the step; the simulation hands in its tracked twin of ``save_on_cpu`` (autofit/simulate/offload.py)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from autofit.training.config import StepConfig, overridden_forwards, resolve_modules

__all__ = ["HostContext", "offloaded_forwards", "saved_on_host"]

# makes the context that holds a module's saved tensors in host memory while its forward runs
HostContext = Callable[[], contextlib.AbstractContextManager]


def saved_on_host(device_type: str) -> contextlib.AbstractContextManager:
    """PyTorch's own activation offload (Note [offload]): saved tensors packed into (pinned, on a GPU) host memory
    and brought back for backward."""
    return torch.autograd.graph.save_on_cpu(pin_memory=device_type == "cuda" and torch.cuda.is_available())


def _offloaded_forward(forward, to_host: HostContext, *args, **kwargs):
    with to_host():
        return forward(*args, **kwargs)


@contextlib.contextmanager
def offloaded_forwards(model: torch.nn.Module, config: StepConfig,
                       to_host: HostContext | None = None) -> Iterator[None]:
    """``config.offload``'s modules of ``model`` run their forward under ``to_host`` (default :func:`saved_on_host`
    for the step's device), as an instance-level ``forward`` override undone on exit, the way ``patched_model``
    (step.py) applies the other module-level knobs; a module that is also pinned to fp32 runs pinned inside it."""
    modules = resolve_modules(model, config.offload, what="offload")
    if to_host is None:
        to_host = functools.partial(saved_on_host, str(config.device))
    with overridden_forwards((m, lambda forward: functools.partial(_offloaded_forward, forward, to_host))
                             for m in modules):
        yield
