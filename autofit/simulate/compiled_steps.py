"""Optimizer steps that run as compiled code: their memory measured on a real copy of one parameter's tensors.

Note [compiled optimizer steps]
    torchao's low-bit optimizers (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``; torchao/optim/adam.py,
    ``_AdamBase.step``) step each parameter with ``torch.compile(single_param_adam, fullgraph=True,
    dynamic=False)``: inductor fuses the dequantization, the update and the quantization, so what the step allocates
    is the compiled kernel's, not the eager ops' (eager is 57 % above the compiled step on two 1024 x 1024 linears
    with ``AdamW8bit``, 5 % below with ``AdamW4bit``). Compiled code cannot run on fake tensors (inductor's kernels
    read the data pointers: the process segfaults), so a simulation runs compiled code eagerly (Note [compiled code
    in a simulation], simulate/run.py), and a step function listed in ``COMPILED_STEPS`` is replaced while it
    simulates: for each distinct signature (shapes, strides, dtypes of the arguments, the low-bit states'
    inner tensors included) the function is compiled as the optimizer compiles it and run twice on real tensors of
    those shapes (zeros; the first run compiles), the second under the CPU profiler; the allocator's high-water mark
    during it is the step's scratch, and the simulation allocates and frees exactly that much in its place. The
    state itself is created by the optimizer's own code on fake tensors, exact. A real copy of one parameter, its
    gradient and its state is what this costs in host memory, and one compilation per distinct parameter shape in
    time (as the first real step pays). The step functions free their scratch before the next parameter's, so the
    parameter-by-parameter sequence is the real one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from autofit.core._torch import (
    disable_current_modes,
    patch,
    storage_tensors,
    unset_fake_temporarily,
)
from autofit.core._torch_profiler import allocation_sizes, high_water_mark, memory_profile
from autofit.core._torch_compile import compile_in_this_thread

__all__ = ["COMPILED_STEPS", "measured_compiled_steps"]

# module -> (function name, how the optimizer compiles it): the step functions Note [compiled optimizer steps] covers
COMPILED_STEPS: dict[str, tuple[str, dict[str, Any]]] = {
    "torchao.optim.adam": ("single_param_adam", dict(fullgraph=True, dynamic=False)),
}

_SCRATCH: dict[Any, int] = {}  # signature -> bytes, per process (the machine and the torch build decide them)


@contextlib.contextmanager
def measured_compiled_steps() -> Iterator[None]:
    """While a simulation runs: each listed step function that is imported allocates its measured scratch instead
    of running (see Note [compiled optimizer steps])."""
    with contextlib.ExitStack() as stack:
        for module_name, (name, options) in COMPILED_STEPS.items():
            module = sys.modules.get(module_name)
            if module is not None and callable(getattr(module, name, None)):
                stack.enter_context(patch(module, name, lambda fn, options=options: _measured(fn, options)))
        yield


def _measured(fn: Callable, options: dict[str, Any]) -> Callable:
    def step(*args: Any) -> None:
        key = (fn, tuple(_signature(a) for a in args))
        if key not in _SCRATCH:
            _SCRATCH[key] = _scratch(fn, options, args)
        if _SCRATCH[key]:  # allocated and freed at once: the tracker records the step's high-water mark
            torch.empty(_SCRATCH[key], dtype=torch.uint8, device=_device(args))
    return step


def _device(args: tuple) -> torch.device:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (type(x).__name__, tuple(x.shape), x.stride(), x.dtype,
                tuple((tuple(t.shape), t.stride(), t.dtype) for t in storage_tensors(x)))
    return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype)) else type(x).__name__


def _scratch(fn: Callable, options: dict[str, Any], args: tuple) -> int:
    with unset_fake_temporarily(), disable_current_modes(), torch.compiler.set_stance("default"), \
            compile_in_this_thread():
        real = tuple(_real_zeros(a) if isinstance(a, torch.Tensor) else a for a in args)
        compiled = torch.compile(fn, **options)
        compiled(*real)  # compiles
        with memory_profile() as prof:
            compiled(*real)
    return high_water_mark(allocation_sizes(prof))[0]


def _real_zeros(t: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor like ``t`` (fake), zeros; a wrapper subclass rebuilt around real inner tensors."""
    inner = storage_tensors(t)
    if len(inner) == 1 and inner[0] is t:
        return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype).zero_()
    names, context = t.__tensor_flatten__()
    real = {name: _real_zeros(getattr(t, name)) for name in names}
    return type(t).__tensor_unflatten__(real, context, tuple(t.shape), t.stride())
