"""Python's and NumPy's random draws in a simulated step: taken at their extremes where autofit reaches them, refused
where it does not (Note [random draws outside torch]). This module steers them; the draws it could not reach are
found, refused and located by unsteered_draws.py.

Note [random draws outside torch]
    The dispatch mode of Note [random layer skipping] (randomness.py) sees every torch draw; Python's ``random`` and
    NumPy's draws never reach it. A model that picks a branch with ``random.choice`` or a NumPy generator was
    simulated on whatever the generator gave: the lowest estimate over six seeds was 4.3x below the step that takes
    the wide branch. While a simulation runs, the draws autofit can reach return the same extremes as torch's
    (``randomness._RULES``: the top, then the bottom of their range; normal draws ten standard deviations from the
    mean; a draw of more than ``DECISION_ELEMENTS`` values is noise and keeps its values):
    - Python's module functions are bound methods of one hidden ``random.Random`` (``random._inst``), so a name
      imported from ``random`` is one of them too. While the step runs that instance's class is a subclass
      (``_SteeredRandom``) whose primitives return the extreme: ``random()`` (behind ``uniform``, ``choices``,
      ``triangular``, ``expovariate``), ``_randbelow`` and ``getrandbits`` (``choice``, ``randint``,
      ``randrange``, ``shuffle``), ``gauss`` and ``normalvariate``, ``sample`` (the first or the last k). Its state
      is not touched. The samplers that reject draws until one fits (``gammavariate``, ``betavariate``,
      ``vonmisesvariate``, ``binomialvariate``, ``paretovariate``, ``weibullvariate``, ``lognormvariate``) would loop
      for ever on a constant: they are refused. ``random.random`` is a C method the subclass cannot reach: it is
      patched on the module. ``random.Random`` instances the model's modules hold, or that their ``forward``'s
      globals name, take the subclass too. Draws made by torch's or autofit's own code (torch's distributed meta
      kernels draw unique ids with ``random.randint`` until one is free: a constant loops for ever) stay real: the
      first caller outside ``random`` decides (``_internal``), and the state they advance is the new baseline.
    - NumPy's legacy functions (``np.random.rand``, ``choice``, ``randint``, ``randn``, ``normal``,
      ``permutation``, ...) are patched on ``np.random``. A ``Generator`` or ``RandomState`` that the model's modules
      hold, that their ``forward``'s globals name, or that ``np.random.default_rng`` makes during the step is replaced
      by a proxy (``_SteeredGenerator``) whose draws are steered the same way; a method it does not know that returns
      a decision-sized draw is refused.
    What autofit cannot reach (``from random import random``, a name imported from ``numpy.random``, a generator
    held elsewhere) advances the state of Python's or NumPy's global generator, which no steered call does. So the
    states are compared before and after the step, and a change no noise-sized draw explains is refused with
    UnsupportedModelError: the step would otherwise follow one random outcome. To name the module, the step is
    simulated once more with the states compared around every module's forward (``locate``), which is slower, and
    only runs when the step is refused.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import random
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from torch import nn

from autofit.core._torch import patch, patch_lock
from autofit.core.errors import UnsupportedModelError
from autofit.simulate.unsteered_draws import locate_draws, Watch

__all__ = ["steered_host_draws"]

# the generators behind the modules' functions (read before anything is patched): Python's hidden random.Random and
# the RandomState behind np.random's functions
_PYTHON_GLOBAL: random.Random = random.random.__self__
_NUMPY_GLOBAL: np.random.RandomState = np.random.random_sample.__self__
SPREAD = 10.0  # normal draws: this many standard deviations from the mean (randomness.NORMAL_SPREAD)
_REJECTION = ("gammavariate", "betavariate", "vonmisesvariate", "binomialvariate", "paretovariate",
              "weibullvariate", "lognormvariate")


MAX_UNIT_DRAWS = 1_000_000  # forced random() calls in one step beyond which a sampler is taken to loop for ever


class _Steering:
    """The extreme of one simulation, and its count of forced draws (randomness.Draws)."""

    def __init__(self, draws: Any, decision_elements: int) -> None:
        self.draws, self.top, self.limit = draws, draws.extreme == "top", decision_elements
        self.units = 0
        self.rebase: Callable[[], None] = lambda: None  # the watch's (Watch.rebase), once it exists

    def unit(self, low: float = 0.0, high: float = 1.0) -> float:
        self.draws.count += 1
        self.units += 1
        if self.units > MAX_UNIT_DRAWS:  # a rejection sampler reached through a name imported from random
            _refused("random")(None)
        return high - (high - low) * 2.0 ** -52 if self.top else low

    def normal(self, mu: float = 0.0, sigma: float = 1.0) -> float:
        self.draws.count += 1
        return mu + (SPREAD if self.top else -SPREAD) * sigma

    def below(self, n: int) -> int:
        self.draws.count += 1
        return n - 1 if self.top else 0

    def ordered(self, items: list, k: int) -> list:
        """k distinct items: the last k, last first, or the first k."""
        self.draws.count += 1
        return list(reversed(items))[:k] if self.top else list(items)[:k]


_STEERING: _Steering | None = None  # the running simulation's (set under the patch lock)


def _steering() -> _Steering:
    assert _STEERING is not None, "a steered generator used outside a simulation"
    return _STEERING


_INTERNAL = ("torch", "autofit")  # packages whose own draws are not the model's decisions
_PASSING = ("random", __name__, "autofit.core._torch")  # frames a draw passes through: random's, ours, patch()'s


def _internal() -> bool:
    """Whether the draw being made comes from torch's or autofit's own code (torch's distributed meta kernels draw
    unique ids with ``random.randint`` until one is free: a constant would loop for ever), found by the first frame
    outside ``random``, this module and the patch wrapper."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_globals.get("__name__") in _PASSING:
        frame = frame.f_back
    return frame is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] in _INTERNAL


def _real(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of random.Random itself for torch's and autofit's draws (the state they advance is taken as the
    new baseline), the steered one for the model's."""
    original = getattr(random.Random, method.__name__)

    @functools.wraps(method)
    def draw(self, *args: Any, **kwargs: Any) -> Any:
        if _internal():
            out = original(self, *args, **kwargs)
            _steering().rebase()
            return out
        return method(self, *args, **kwargs)
    return draw


class _SteeredRandom(random.Random):
    """``random.Random`` whose draws are the extremes of the running simulation; its state is never advanced."""

    @_real
    def random(self) -> float:
        return _steering().unit()

    @_real
    def getrandbits(self, k: int) -> int:
        return (1 << k) - 1 if _steering().below(2) else 0

    @_real
    def _randbelow(self, n: int) -> int:
        return _steering().below(n)

    @_real
    def gauss(self, mu: float = 0.0, sigma: float = 1.0) -> float:
        return _steering().normal(mu, sigma)

    @_real
    def normalvariate(self, mu: float = 0.0, sigma: float = 1.0) -> float:
        return _steering().normal(mu, sigma)

    @_real
    def sample(self, population, k, *, counts=None):
        if counts is not None:
            population = [x for x, c in zip(population, counts) for _ in range(c)]
        return _steering().ordered(list(population), k)

    @_real
    def randbytes(self, n: int) -> bytes:
        return bytes([255 if _steering().below(2) else 0]) * n


def _module_random(original: Callable[[], float]) -> float:
    """``random.random()``: the steered extreme, or for torch's and autofit's own code the real draw."""
    if _internal():
        out = original()
        _steering().rebase()
        return out
    return _steering().unit()


def _refused(name: str) -> Callable[..., Any]:
    def draw(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedModelError(
            f"the model draws with random.{name}, a sampler that rejects draws until one fits (or draws more than "
            f"{MAX_UNIT_DRAWS:,} times in one step), so it has no extreme "
            "autofit can return (Note [random draws outside torch], autofit/simulate/host_draws.py): draw the "
            "decision with random.random() or torch.rand(()), or estimate the step with the randomness switched off")
    return draw


for _name in _REJECTION:
    setattr(_SteeredRandom, _name, _refused(_name))


def _size(size: Any) -> int:
    if size is None:
        return 0
    return math.prod(size) if isinstance(size, (tuple, list)) else int(size)


def _shape(size: Any) -> tuple[int, ...]:
    return tuple(size) if isinstance(size, (tuple, list)) else (int(size),)


class _NumpyDraws:
    """NumPy's draws, steered (Note [random draws outside torch]); ``real`` is the generator (or the ``np.random``
    module) that makes noise-sized draws, and ``noise()`` is called after each such draw."""

    def __init__(self, real: Any, noise: Callable[[], None]) -> None:
        self._real, self._noise = real, noise

    def _fill(self, size: Any, value: Callable[[], Any], original: Callable[[], Any], dtype: Any = None) -> Any:
        """A scalar extreme, an array of them (a decision), or the real draw (noise)."""
        if size is None:
            return value()
        if _size(size) > _steering().limit:
            out = original()
            self._noise()
            return out
        return np.full(_shape(size), value(), dtype=dtype)

    def random(self, size=None, *args, **kwargs):
        return self._fill(size, lambda: _steering().unit(), lambda: self._real.random(size, *args, **kwargs))

    random_sample = ranf = sample = random

    def rand(self, *dims):
        return self._fill(dims or None, lambda: _steering().unit(), lambda: self._real.rand(*dims))

    def uniform(self, low=0.0, high=1.0, size=None):
        return self._fill(size, lambda: _steering().unit(float(low), float(high)),
                          lambda: self._real.uniform(low, high, size))

    def standard_normal(self, size=None, *args, **kwargs):
        return self._fill(size, lambda: _steering().normal(), lambda: self._real.standard_normal(size, *args, **kwargs))

    def randn(self, *dims):
        return self._fill(dims or None, lambda: _steering().normal(), lambda: self._real.randn(*dims))

    def normal(self, loc=0.0, scale=1.0, size=None):
        return self._fill(size, lambda: _steering().normal(float(loc), float(scale)),
                          lambda: self._real.normal(loc, scale, size))

    def integers(self, low, high=None, size=None, dtype=np.int64, endpoint=False):
        low, high = (0, low) if high is None else (low, high)
        def value():
            return low + _steering().below(int(high) - int(low) + (1 if endpoint else 0))
        return self._fill(size, value, lambda: self._real.integers(low, high, size, dtype, endpoint), dtype)

    def randint(self, low, high=None, size=None, dtype=int):
        low, high = (0, low) if high is None else (low, high)
        return self._fill(size, lambda: low + _steering().below(int(high) - int(low)),
                          lambda: self._real.randint(low, high, size, dtype), dtype)

    def binomial(self, n, p, size=None):
        return self._fill(size, lambda: int(n) if _steering().below(2) else 0, lambda: self._real.binomial(n, p, size))

    def exponential(self, scale=1.0, size=None):
        return self._fill(size, lambda: float(scale) * (1.0 + SPREAD) if _steering().below(2) else 0.0,
                          lambda: self._real.exponential(scale, size))

    def choice(self, a, size=None, replace=True, p=None, *args, **kwargs):
        items = np.arange(a) if isinstance(a, (int, np.integer)) else np.asarray(a)
        if p is not None:  # never a category that cannot be drawn
            items = items[np.asarray(p) > 0]
        if size is not None and _size(size) > _steering().limit:
            out = self._real.choice(a, size, replace, p, *args, **kwargs)
            self._noise()
            return out
        if size is None:
            return items[_steering().below(len(items))]
        if replace:
            return np.full(_shape(size), items[_steering().below(len(items))], dtype=items.dtype)
        return np.asarray(_steering().ordered(list(items), _size(size)), dtype=items.dtype).reshape(_shape(size))

    def permutation(self, x):
        items = np.arange(x) if isinstance(x, (int, np.integer)) else np.asarray(x)
        if len(items) > _steering().limit:
            out = self._real.permutation(x)
            self._noise()
            return out
        return items[::-1].copy() if _steering().below(2) else items.copy()

    def shuffle(self, x, *args, **kwargs):
        if len(x) > _steering().limit:
            self._real.shuffle(x, *args, **kwargs)
            self._noise()
        elif _steering().below(2):
            x[:] = x[::-1].copy() if isinstance(x, np.ndarray) else list(reversed(x))


_LEGACY = ("random", "random_sample", "ranf", "sample", "rand", "uniform", "standard_normal", "randn", "normal",
           "randint", "binomial", "exponential", "choice", "permutation", "shuffle")


class _SteeredGenerator(_NumpyDraws):
    """A NumPy ``Generator`` or ``RandomState`` whose draws are steered; what it does not know it passes to the real
    one, refusing a decision-sized result (Note [random draws outside torch])."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if not callable(value) or name.startswith("_") or name in ("bit_generator", "spawn", "get_state",
                                                                   "set_state", "seed"):
            return value

        def draw(*args: Any, **kwargs: Any) -> Any:
            out = value(*args, **kwargs)
            if np.ndim(out) == 0 or np.size(out) <= _steering().limit:
                raise UnsupportedModelError(
                    f"the model draws with a NumPy generator's {name}(), which autofit cannot take at an extreme "
                    "(Note [random draws outside torch], autofit/simulate/host_draws.py): draw the decision with "
                    "random(), integers(), choice() or normal(), or with torch (torch.rand(()) < p)")
            self._noise()
            return out
        return draw


def _global_names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return names


@contextlib.contextmanager
def steered_host_draws(draws: Any, model: nn.Module | None, decision_elements: int, *,
                       locate: bool = False) -> Iterator[None]:
    """Python's and NumPy's draws at ``draws.extreme`` while the code inside runs; an unsteered draw raises
    :class:`UnsteeredDraw` on exit (with ``locate``, at the module that made it). See Note [random draws outside
    torch]."""
    global _STEERING
    with patch_lock(), contextlib.ExitStack() as stack:
        previous, _STEERING = _STEERING, _Steering(draws, decision_elements)
        stack.callback(lambda: globals().__setitem__("_STEERING", previous))
        watch = Watch()
        _STEERING.rebase = watch.rebase
        legacy = _NumpyDraws(_NUMPY_GLOBAL, watch.rebase)
        for name in _LEGACY:
            stack.enter_context(patch(np.random, name, lambda original, name=name: getattr(legacy, name)))
        stack.enter_context(patch(np.random, "default_rng",
                                  lambda original: lambda *a, **k: _SteeredGenerator(original(*a, **k), watch.rebase)))
        stack.enter_context(patch(random, "random", lambda original: lambda: _module_random(original)))
        for name in _REJECTION:  # the module's functions are bound to the original class's methods
            if hasattr(random, name):
                stack.enter_context(patch(random, name, lambda original, name=name:
                                          lambda *a, **k: _refused(name)(None, *a, **k)))
        _steer_random(_PYTHON_GLOBAL, stack)
        modules = list(model.named_modules()) if model is not None else []
        classes: set[type] = set()
        for _, module in modules:
            _steer_holdings(module, watch, stack, classes)
        if locate:
            locate_draws(modules, watch, stack)
        yield
        watch.check(None)


def _steer_random(rng: random.Random, stack: contextlib.ExitStack) -> None:
    if type(rng) is random.Random:
        rng.__class__ = _SteeredRandom
        stack.callback(setattr, rng, "__class__", random.Random)


def _steer_holdings(module: nn.Module, watch: Watch, stack: contextlib.ExitStack, classes: set[type]) -> None:
    """The generators ``module`` holds (on autofit's copy: replaced) and those its forward's globals name (the
    user's: replaced until the step ends; once per class, in ``classes``)."""
    for attr, value in list(vars(module).items()):
        if isinstance(value, (np.random.Generator, np.random.RandomState)):
            module.__dict__[attr] = _SteeredGenerator(value, watch.rebase)
        elif type(value) is random.Random:
            _steer_random(value, stack)
            watch.add(f"the random.Random at .{attr}", value.getstate)
    if type(module) in classes:
        return
    classes.add(type(module))
    forward = getattr(type(module).forward, "__code__", None)
    scope = getattr(type(module).forward, "__globals__", {})
    for name in _global_names(forward) if forward is not None else ():
        value = scope.get(name)
        if isinstance(value, (np.random.Generator, np.random.RandomState)):
            scope[name] = _SteeredGenerator(value, watch.rebase)
            stack.callback(scope.__setitem__, name, value)
        elif type(value) is random.Random:
            _steer_random(value, stack)
            watch.add(f"the random.Random {name}", value.getstate)
