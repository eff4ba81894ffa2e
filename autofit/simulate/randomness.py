"""Training-time random decisions taken at their extremes in a simulation (Note [random layer skipping]).

Note [random layer skipping]
    LayerDrop (Fan et al. 2019) and stochastic depth by layer skip whole layers at random while training: transformers'
    speech encoders draw ``torch.rand([])`` per layer and skip it when the draw is below ``config.layerdrop`` (0.1 by
    default in wav2vec2, wav2vec2-conformer, hubert), some models draw with Python's ``random.uniform(0, 1)`` or
    NumPy's ``np.random.random()``, and hand-written blocks keep a layer when a draw is below a survival
    probability. The peak of one real step then depends on the draws: a simulation that used the real random
    generator (a real run, or the fake run's value twins, Note [value twins]) reported one lucky draw. So while a
    simulation runs, every uniform draw small enough to be a decision (a ``rand``, ``rand_like`` or ``uniform_``
    of at most ``DECISION_ELEMENTS`` elements, and Python's and NumPy's scalar ``random``/``uniform`` draws) returns
    one extreme of its range: first the top (just below the upper bound: ``draw < p`` skips nothing), and if the
    step made any such draw, once more the bottom (a draw below a survival probability keeps every layer); the
    simulation with the larger peak is the estimate, and its notes say so. Larger draws (noise, per-element masks)
    keep their values: their memory does not depend on them. The two extremes cover a model whose layers all skip
    the same way; a model that mixes both conventions gets the larger of two partial skips, not a proven bound.
    A compiled step (a model run as inductor compiles it) keeps its real draws: under dynamo the dispatch mode and
    the patched functions made dynamo skip the model's frames for good, and the user's later compile ran eager.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import torch

from autofit.core._torch import TorchDispatchMode, patch

__all__ = ["DECISION_ELEMENTS", "Draws", "draws_at", "worst_of_extremes"]

S = TypeVar("S")  # a Simulation (simulate/run.py), read by its fields only

DECISION_ELEMENTS = 256  # draws of at most this many elements are decisions (one per layer), not noise
_aten = torch.ops.aten
_UNIFORM = {_aten.rand, _aten.rand_like, _aten.uniform_, _aten.uniform}


@dataclass
class Draws:
    """How many random decisions a simulation forced to ``extreme``."""

    extreme: str
    count: int = 0


def _value(low: float, high: float, extreme: str, eps: float) -> float:
    """The extreme of ``[low, high)``: ``low``, or ``high`` less one step of the dtype's precision."""
    return low if extreme == "bottom" else high - (high - low) * eps


class _ForcedDraws(TorchDispatchMode):
    """Fills every small uniform draw with the extreme value after the op allocated it as usual."""

    def __init__(self, draws: Draws) -> None:
        super().__init__()
        self.draws = draws

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket not in _UNIFORM or not isinstance(out, torch.Tensor) or not out.is_floating_point() \
                or out.numel() > DECISION_ELEMENTS:
            return out
        low, high = 0.0, 1.0
        if func.overloadpacket in (_aten.uniform_, _aten.uniform):
            low = float(kwargs.get("from", args[1] if len(args) > 1 else 0.0))
            high = float(kwargs.get("to", args[2] if len(args) > 2 else 1.0))
        self.draws.count += 1
        return out.fill_(_value(low, high, self.draws.extreme, torch.finfo(out.dtype).eps))


@contextlib.contextmanager
def draws_at(extreme: str) -> Iterator[Draws]:
    """Every random decision of the code run inside at ``extreme`` ("top" or "bottom"); yields the count of forced
    draws (See Note [random layer skipping])."""
    draws = Draws(extreme)

    def forced(bounds):
        """A replacement that returns the extreme for a scalar call (``bounds(args, kwargs)`` gives its range) and
        leaves any other call (with a size) to the original."""
        def make(original):
            def draw(*args, **kwargs):
                if args and not isinstance(args[0], (int, float)) or kwargs.get("size") is not None:
                    return original(*args, **kwargs)
                rng = bounds(*args, **kwargs)
                if rng is None:
                    return original(*args, **kwargs)
                draws.count += 1
                return _value(*rng, extreme, 2.0 ** -52)
            return draw
        return make

    unit = lambda *a, **k: None if a or k else (0.0, 1.0)  # noqa: E731 - random(), rand(): [0, 1)
    between = lambda low=0.0, high=1.0, size=None: (float(low), float(high))  # noqa: E731 - uniform(a, b)
    with contextlib.ExitStack() as stack:
        for owner, name, bounds in ((random, "random", unit), (random, "uniform", between),
                                    (np.random, "random", unit), (np.random, "random_sample", unit),
                                    (np.random, "rand", unit), (np.random, "uniform", between)):
            stack.enter_context(patch(owner, name, forced(bounds)))
        stack.enter_context(_ForcedDraws(draws))
        yield draws


def worst_of_extremes(run: Callable[..., S], *, observed: bool) -> S:
    """``run(extreme=...)`` with the random decisions at the top of their range and, if the step made any, at the
    bottom: the larger peak, with a note (Note [random layer skipping], randomness.py). An observer keeps what it
    saw last, so the top run is repeated when it wins after the bottom one ran observed."""
    top = run(extreme="top")
    if not top.random_draws:
        return top
    bottom = run(extreme="bottom")
    worst = bottom if bottom.replay.peak_bytes > top.replay.peak_bytes else top
    if worst is top and observed:
        worst = run(extreme="top")
    why = ("at the bottom of its range (a layer kept while 'draw < survival' is always kept)" if worst is bottom
           else "at the top of its range (LayerDrop's 'draw < p' skips no layer)")
    note = (f"{worst.random_draws} random draws decided what the step runs (layers skipped at random): simulated "
            f"with every draw {why}, the larger peak of the two extremes (see Note [random layer skipping])")
    return replace(worst, notes=worst.notes + (note,))
