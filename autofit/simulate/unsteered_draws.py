"""The draws autofit could not steer in a simulated step (Note [random draws outside torch], host_draws.py): the
global generators' states watched around the step and compared with what steered calls left them (``Watch``), the
error a change raises (:class:`UnsteeredDraw`) and the refusal it becomes, and, when the step is refused, the module
whose forward made the draw (``locate_draws``).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from typing import Any

import numpy as np
from torch import nn

from autofit.core.errors import UnsupportedModelError

__all__ = ["UnsteeredDraw", "Watch", "locate_draws"]


class UnsteeredDraw(Exception):
    """A draw autofit could not steer changed a global generator's state during the step (Note [random draws
    outside torch]); ``module`` is where, when the step ran with ``locate``."""

    def __init__(self, source: str, module: str | None = None) -> None:
        super().__init__(source)
        self.source, self.module = source, module

    def refusal(self) -> UnsupportedModelError:
        where = "the step" if self.module is None else (f"module {self.module!r}" if self.module
                                                         else "the model's top-level forward")
        return UnsupportedModelError(
            f"{where} drew from {self.source} with a call autofit cannot steer (a name imported from the module, "
            "such as `from random import random`, a distribution it has no extreme for, such as np.random.poisson, "
            "or a generator it cannot reach), so the estimate would follow one "
            "random outcome of the step, not its largest. Draw decisions through the module (random.random(), "
            "random.choice(), np.random.rand(), a NumPy Generator the module holds or makes with "
            "np.random.default_rng) or with torch (torch.rand(()) < p): autofit takes those at both ends of their "
            "range (Note [random draws outside torch], autofit/simulate/host_draws.py)"
        )


def _numpy_state() -> tuple:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return name, keys.tobytes(), pos, has_gauss, cached


class Watch:
    """The global generators' states, compared with what steered calls left them (Note [random draws outside
    torch]); ``extra`` Random instances that took the steered class are watched too."""

    def __init__(self) -> None:
        self.sources: list[tuple[str, Callable[[], Any]]] = [("Python's random module", random.getstate),
                                                            ("NumPy's global generator (np.random)", _numpy_state)]
        self.baseline: list[Any] = []
        self.rebase()

    def add(self, name: str, state: Callable[[], Any]) -> None:
        self.sources.append((name, state))
        self.baseline.append(state())

    def rebase(self) -> None:
        self.baseline = [state() for _, state in self.sources]

    def check(self, module: str | None) -> None:
        for (name, state), before in zip(self.sources, self.baseline):
            if state() != before:
                draw = UnsteeredDraw(name, module)
                # inside a forward (``locate``): the refusal itself, which the step's error handling passes on
                raise draw.refusal() if module is not None else draw


def locate_draws(modules: list[tuple[str, nn.Module]], watch: Watch, stack: contextlib.ExitStack) -> None:
    """States compared around every module's forward: the first change names the module running then."""
    running: list[str] = []

    def pre(name: str) -> Callable[..., None]:
        def hook(module, args) -> None:
            watch.check(running[-1] if running else "")
            running.append(name)
        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(module, args, output) -> None:
            watch.check(name)
            if running:
                running.pop()
        return hook

    for name, module in modules:
        stack.callback(module.register_forward_pre_hook(pre(name)).remove)
        stack.callback(module.register_forward_hook(post(name)).remove)
