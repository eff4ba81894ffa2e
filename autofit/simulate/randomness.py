"""Training-time random decisions taken at their extremes in a simulation (Note [random layer skipping]).

Note [random layer skipping]
    LayerDrop (Fan et al. 2019) and stochastic depth by layer skip whole layers at random while training: transformers'
    speech encoders draw ``torch.rand([])`` per layer and skip it when the draw is below ``config.layerdrop`` (0.1 by
    default in wav2vec2, wav2vec2-conformer, hubert), some models draw with Python's ``random.uniform(0, 1)`` or
    NumPy's ``np.random.random()``, and hand-written blocks keep a layer when a draw is below a survival
    probability. The peak of one real step then depends on the draws: a simulation that used the real random
    generator (a real run, or the fake run's value twins, Note [value twins]) reported one lucky draw. So while a
    simulation runs, every draw small enough to be a decision (at most ``DECISION_ELEMENTS`` elements) returns one
    extreme of its range: first the top, and if the step made any such draw, once more the bottom; the simulation
    with the larger peak is the estimate, and its notes say so. The extremes, per kind of draw (``_RULES``):
    uniform (``rand``, ``rand_like``, ``uniform_``) just below its upper bound or its lower bound; normal (``randn``,
    ``randn_like``, ``normal``, ``normal_``) ten standard deviations above or below its mean (a ``randn() > t``
    test for any threshold a model uses); integers (``randint``, ``randint_like``, ``random_``) the highest or the
    lowest value; ``bernoulli`` all ones or all zeros; ``multinomial`` and ``randperm`` the last or the first
    categories in order; ``exponential_`` ten standard deviations above its mean, or 0. A small draw of a kind with
    no rule (``poisson``, ``geometric_``, ``cauchy_``, ``log_normal_``, gamma, binomial, Dirichlet) is refused with
    UnsupportedModelError naming the module. Python's and NumPy's draws are steered the same way where autofit can
    reach them, and refused where it cannot (Note [random draws outside torch], host_draws.py). Larger draws
    (noise, per-element masks) keep their values: their memory does not depend on them. The two extremes cover a
    model whose decisions all go one way at one end of their range (skip at the top, keep at the bottom, or the
    reverse); a model that mixes both conventions, or picks a middle branch of three, gets the larger of the two
    extremes, not a proven bound. A compiled step (a model run as inductor compiles it) keeps its real draws: under
    dynamo the dispatch mode and the patched functions made dynamo skip the model's frames for good, and the user's
    later compile ran eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
from torch import nn

from autofit.core._torch import TorchDispatchMode, disable_current_modes, op_schema
from autofit.core.errors import UnsupportedModelError
from autofit.simulate.host_draws import steered_host_draws
from autofit.simulate.unsteered_draws import UnsteeredDraw

__all__ = ["DECISION_ELEMENTS", "Draws", "draws_at", "worst_of_extremes"]

S = TypeVar("S")  # a Simulation (simulate/run.py), read by its fields only

DECISION_ELEMENTS = 256  # draws of at most this many elements are decisions (one per layer), not noise
_aten = torch.ops.aten
NORMAL_SPREAD = 10.0  # a normal draw's extremes: this many standard deviations from its mean


@dataclass
class Draws:
    """How many random decisions a simulation forced to ``extreme``."""

    extreme: str
    count: int = 0


def _value(low: float, high: float, extreme: str, eps: float) -> float:
    """The extreme of ``[low, high)``: ``low``, or ``high`` less one step of the dtype's precision."""
    return low if extreme == "bottom" else high - (high - low) * eps


def _bound(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by name, defaults filled in."""
    bound = {}
    for i, a in enumerate(op_schema(func).arguments):
        if a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif i < len(args) and not a.kwarg_only:
            bound[a.name] = args[i]
        elif a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def _sequence(out: torch.Tensor, n: int, extreme: str) -> torch.Tensor:
    """``out`` (of k <= n elements along its last dim) filled with the first k of 0..n-1, or the last k, highest
    first: distinct categories, as a draw without replacement gives."""
    k = out.shape[-1] if out.dim() else 1
    with disable_current_modes():  # a constant of at most DECISION_ELEMENTS values, not the step's memory
        order = torch.arange(n - 1, n - 1 - k, -1) if extreme == "top" else torch.arange(k)
    return out.copy_(order.to(out.dtype).expand(out.shape) if out.dim() else order[0].to(out.dtype))


def _uniform(out, a, extreme):
    low, high = float(a.get("from", 0.0)), float(a.get("to", 1.0))
    return out.fill_(_value(low, high, extreme, torch.finfo(out.dtype).eps))


def _normal(out, a, extreme):
    mean, std = a.get("mean", 0.0), a.get("std", 1.0)
    sign = NORMAL_SPREAD if extreme == "top" else -NORMAL_SPREAD
    if not isinstance(mean, torch.Tensor) and not isinstance(std, torch.Tensor):
        return out.fill_(float(mean) + sign * float(std))
    out.copy_(mean) if isinstance(mean, torch.Tensor) else out.fill_(float(mean))
    return out.add_(std, alpha=sign) if isinstance(std, torch.Tensor) else out.add_(sign * float(std))


def _integers(out, a, extreme):
    if extreme == "bottom":
        return out.fill_(int(a.get("low", a.get("from", 0)) or 0))
    high = a.get("high", a.get("to"))
    if high is None:  # random_() over the dtype's range
        high = torch.iinfo(out.dtype).max + 1 if not out.is_floating_point() else 2 ** (torch.finfo(out.dtype).nmant + 1)
    if isinstance(high, torch.Tensor):
        return out.copy_(high).sub_(1)
    return out.fill_(int(high) - 1)


def _bernoulli(out, a, extreme):
    return out.fill_(1 if extreme == "top" else 0)


def _multinomial(out, a, extreme):
    n = a["self"].shape[-1]
    if a.get("replacement", False):
        return out.fill_(n - 1 if extreme == "top" else 0)
    return _sequence(out, n, extreme)


def _randperm(out, a, extreme):
    return _sequence(out, int(a["n"]), extreme)


def _exponential(out, a, extreme):
    return out.fill_((1.0 + NORMAL_SPREAD) / float(a.get("lambd", 1.0)) if extreme == "top" else 0.0)


_RULES: dict[Any, Callable[[torch.Tensor, dict, str], torch.Tensor]] = {
    _aten.rand: _uniform, _aten.rand_like: _uniform, _aten.uniform: _uniform, _aten.uniform_: _uniform,
    _aten.randn: _normal, _aten.randn_like: _normal, _aten.normal: _normal, _aten.normal_: _normal,
    _aten.randint: _integers, _aten.randint_like: _integers, _aten.random_: _integers,
    _aten.bernoulli: _bernoulli, _aten.bernoulli_: _bernoulli,
    _aten.multinomial: _multinomial, _aten.randperm: _randperm, _aten.exponential_: _exponential,
}
# draws with no rule: refused when small enough to be a decision (Note [random layer skipping])
_REFUSED = {getattr(_aten, n) for n in ("poisson", "geometric_", "geometric", "cauchy_", "cauchy", "log_normal_",
                                       "log_normal", "exponential", "_standard_gamma", "binomial",
                                       "_sample_dirichlet") if hasattr(_aten, n)}


class _ForcedDraws(TorchDispatchMode):
    """Fills every small random draw with the extreme value after the op allocated it as usual."""

    def __init__(self, draws: Draws, where: Callable[[], str]) -> None:
        super().__init__()
        self.draws, self.where = draws, where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet not in _RULES and packet not in _REFUSED or not isinstance(out, torch.Tensor) \
                or out.numel() > DECISION_ELEMENTS:
            return out
        if packet in _REFUSED:
            where = self.where()
            raise UnsupportedModelError(
                f"{f'module {where!r}' if where else 'the model'} draws {out.numel()} random value(s) with "
                f"aten.{packet.__name__}, small enough to be a decision that changes what the step runs, and autofit "
                "has no extreme for that distribution: it takes uniform, normal, integer, Bernoulli, multinomial, "
                "permutation and exponential draws at both ends of their range (Note [random layer skipping]); draw "
                "the decision with one of those (torch.rand(()) < p), or estimate the step with the randomness "
                "switched off and autofit.measure it"
            )
        self.draws.count += 1
        return _RULES[packet](out, _bound(func, args, kwargs), self.draws.extreme)


@contextlib.contextmanager
def draws_at(extreme: str, model: nn.Module | None = None, where: Callable[[], str] = lambda: "", *,
             locate: bool = False) -> Iterator[Draws]:
    """Every random decision of the code run inside at ``extreme`` ("top" or "bottom"); yields the count of forced
    draws (See Note [random layer skipping]). ``model`` (autofit's copy) is searched for the Python and NumPy
    generators it holds, ``where()`` names the module running; a draw autofit could not steer raises UnsteeredDraw
    on exit, or with ``locate`` the refusal naming its module (Note [random draws outside torch], host_draws.py)."""
    draws = Draws(extreme)
    with steered_host_draws(draws, model, DECISION_ELEMENTS, locate=locate), _ForcedDraws(draws, where):
        yield draws


def worst_of_extremes(run: Callable[..., S], *, observed: bool) -> S:
    """``run(extreme=...)`` with the random decisions at the top of their range and, if the step made any, at the
    bottom: the larger peak, with a note (Note [random layer skipping], randomness.py). An observer keeps what it
    saw last, so the top run is repeated when it wins after the bottom one ran observed. A draw autofit cannot steer
    is refused, naming the module found by one more run that watches every module (Note [random draws outside
    torch], host_draws.py)."""
    try:
        top = run(extreme="top")
        if not top.random_draws:
            return top
        bottom = run(extreme="bottom")
    except UnsteeredDraw as e:
        try:
            run(extreme="top", locate=True)
        except UnsteeredDraw as located:
            raise located.refusal() from e
        raise e.refusal() from e
    worst = bottom if bottom.replay.peak_bytes > top.replay.peak_bytes else top
    if worst is top and observed:
        worst = run(extreme="top")
    why = ("at the bottom of its range (a layer kept while 'draw < survival' is always kept)" if worst is bottom
           else "at the top of its range (LayerDrop's 'draw < p' skips no layer)")
    note = (f"{worst.random_draws} random draws decided what the step runs (layers skipped or branches chosen at random): simulated "
            f"with every draw {why}, the larger peak of the two extremes (see Note [random layer skipping])")
    return replace(worst, notes=worst.notes + (note,))
