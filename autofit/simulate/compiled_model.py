"""A compiled model in a simulation: compiled by inductor on the fake copy, without kernels, and warmed up before the
tracked step (Note [inductor without kernels], autofit/core/_torch_compile.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from autofit.core._torch import compiled_modules
from autofit.core._torch_compile import compile_settings, simulated_compile
from autofit.training.step import run_micro_batch

__all__ = ["compiled_for_simulation", "warm_up", "compiled_note"]


@contextlib.contextmanager
def compiled_for_simulation(work: nn.Module, fake: bool, knob: bool = False) -> Iterator[bool]:
    """Compile the fake copy's compiled modules as inductor would (the kernels left out), and with ``knob``
    (``compile=True``) the copy itself unless the user compiled it already; yields whether any was compiled.
    A real run (Note [data-dependent models]) runs compiled code eagerly."""
    modules = compiled_modules(work) if fake else []
    whole = work if fake and knob and not any(name == "" for name, _ in modules) else None
    with simulated_compile(modules, whole):
        yield whole is not None or any(compile_settings(m).backend == "inductor" for _, m in modules)


def warm_up(work: nn.Module, micro, micro_target, loss_fn, config) -> None:
    """One forward and backward before tracking: dynamo compiles the forward on the first call and AOTAutograd the
    backward on the first backward, and neither compile belongs in the step's timeline. The gradients are dropped."""
    run_micro_batch(work, micro, micro_target, loss_fn, config, "cpu")
    for p in work.parameters():
        p.grad = None


def compiled_note(model: nn.Module, compiled: bool, knob: bool = False) -> str | None:
    """The estimate's note on the user's compiled modules, or on the ``compile=True`` knob."""
    names = [name or "the model" for name, _ in compiled_modules(model)]
    if knob and not names:
        names = ["the model (compile=True)"]
    if not names:
        return None
    if compiled:
        return (f"{', '.join(names)}: torch.compile'd; simulated as inductor compiles it for this CPU, the generated "
                "kernels left out (see Note [inductor without kernels]); on a GPU the saved activations carry over, "
                "inductor's Triton buffers may differ")
    return (f"{', '.join(names)}: torch.compile'd, simulated eagerly (a real run of a data-dependent step, or the "
            "'eager' backend): what compilation changes is not modelled (see Note [compiled code in a simulation])")
