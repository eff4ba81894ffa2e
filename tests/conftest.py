"""Test tiers (README "Tests") and their time budgets.

Every test is in exactly one of three tiers, chosen by marker:

- ``quick``: pure functions, the solver on hand-made tables, the CUDA model, units, architecture, CLI parsing. No
  marker needed: a test marked neither ``sim`` nor ``slow`` gets ``quick`` here, so ``pytest -m quick`` selects it.
  It needs no test extra (a test that does asks with ``pytest.importorskip``).
- ``sim``: simulates a training step on fake tensors, or runs a small real one.
- ``slow``: real steps of larger models, gloo processes, 7B shapes, property tests, and any other test over about
  15 s on two cores (the newest torch's run in tests/matrix.sh leaves them out).

See Note [tier budgets] for how a tier stays what it says.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import resource
from collections.abc import Callable, Iterator

import pytest

# Note [tier budgets]
# ~~~~~~~~~~~~~~~~~~~
# A tier is only quick while nothing slow creeps into it, so each test's call is held to its tier's budget and fails
# with its figure and the marker to use when it goes over. The budget is CPU seconds (this process and the worker
# processes it waited for, from getrusage), not wall seconds: on a loaded machine the wall time of the same test
# grew from 4-9 s to 22-49 s, while the CPU time it needs stays nearly the same, so a CPU budget fails for a test
# that got slower, not for a machine that got busy. Fixtures' set-up is not counted (a session fixture pays once for
# every test that reads it). AUTOFIT_TEST_BUDGETS=0 switches the check off (a debugger, coverage, a profiler).
#
# Time alone would let a quick test simulate a tiny model in half a second, and the tier would fill with them. So the
# quick tier's definition is also checked as such: a quick test that starts a simulated step (simulate/run.py
# ``_simulate``) or a measured one (measure/allocator.py ``_measure_window``) is stopped there and fails, naming the
# marker. That check does not depend on the machine at all.
#
# CPU seconds still move with the CPU: on a machine about 1.5 times slower than the one the markers were set on, two
# tests went over (by 2 % and 23 %), and CI runs on whatever machine it gets. So the budgets are those of a reference
# machine, scaled by how much slower this one runs a fixed piece of pure Python (the simulation is mostly Python:
# dispatch modes over fake tensors), measured once per process as the best of five; never scaled below the nominal
# budget, so a fast machine holds the tiers to what they say. The reference is that piece's CPU seconds on the
# machine the markers were last set on.
BUDGETS = {"quick": 5.0, "sim": 60.0}  # CPU seconds of one test's call on the reference machine; slow tests have none
NEXT_TIER = {"quick": "@pytest.mark.sim (or @pytest.mark.slow)", "sim": "@pytest.mark.slow"}


# Note [the slowest first]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# The whole suite runs on one pytest-xdist worker per core (tests/matrix.sh). Its wall time is the busiest worker's,
# so what ends a run matters: a 4-minute test handed out last keeps one worker busy while the other idles. So the
# items are ordered by tier, slow first, then sim, then quick, and within the slow tier longest first: a test whose
# call takes about 40 s or more says so on its marker, ``@pytest.mark.slow(seconds=N)`` (its seconds in matrix.sh's
# run on two idle cores, which --durations prints, or its CPU seconds alone: a rough figure, only the order reads it),
# the others count as 0 and keep collection order (a stable sort). AUTOFIT_TEST_CPU_LOG=FILE appends each test call's
# CPU seconds, tier and id to FILE (a line a test, from every worker): run it on a few files' slow tests at a time.
# A fixture's set-up is not in either figure: a test that plans its truths on demand counts them (test_verdict.py).
# matrix.sh hands the list out with ``--dist worksteal``: the first half of the list goes to one worker, the second to
# the other, and an idle worker takes the back half of the busiest one's queue. The long tests so start at once and
# the run ends on short ones (the longest-processing-time-first rule). Measured on two idle cores before the
# longest-first order: the whole suite on torch 2.13 28:25, its last 3 % of tests (slow ones, in alphabetical order)
# took 2:45; the newest torch's not-slow run 7:31 with worksteal and 10:06 with ``--dist load``. Every worker collects
# the same list, which xdist requires: the order is a function of the collection alone. No test may depend on
# another's having run before it (each builds its own model).
_TIER_ORDER = {"slow": 0, "sim": 1, "quick": 2}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("sim") is None:
            item.add_marker(pytest.mark.quick)
    items.sort(key=_run_order)  # Note [the slowest first]


def _run_order(item: pytest.Item) -> tuple[int, float]:
    """Tier first (slow, sim, quick), then the slow tier's longest first (Note [the slowest first])."""
    slow = item.get_closest_marker("slow")
    return _TIER_ORDER[_tier(item)], -(slow.kwargs.get("seconds", 0) if slow is not None else 0)


def _tier(item: pytest.Item) -> str:
    return "slow" if item.get_closest_marker("slow") else "sim" if item.get_closest_marker("sim") else "quick"


def _calibration() -> None:
    total = 0
    for i in range(1_000_000):
        total += i * i % 7


# _calibration's best CPU seconds of five on the reference machine (2026-11-28, the machine on which two tests went
# over and moved up a tier, measured beside a running suite: high, if anything, so only a slower machine scales)
_REFERENCE_SECONDS = 0.105


@functools.cache
def _slowdown() -> float:
    """How many times slower this machine runs the calibration than the reference machine, at least 1 (Note [tier
    budgets])."""
    best = float("inf")
    for _ in range(5):
        began = _cpu_seconds()
        _calibration()
        best = min(best, _cpu_seconds() - began)
    return max(1.0, best / _REFERENCE_SECONDS)


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class _SimulatedInQuickTier(BaseException):
    """Raised where a quick test starts a step; a BaseException, so that no fallback in autofit catches it."""


@contextlib.contextmanager
def _no_steps() -> Iterator[list[str]]:
    """Within a quick test: starting a simulated or measured step stops the test (Note [tier budgets])."""
    # by import_module: ``autofit.measure`` is also the name of the public function, which hides the package
    allocator = importlib.import_module("autofit.measure.allocator")
    run = importlib.import_module("autofit.simulate.run")

    started: list[str] = []

    def stop(what: str):
        def refuse(*args, **kwargs):
            started.append(what)
            raise _SimulatedInQuickTier(what)
        return refuse

    saved = run._simulate, allocator._measure_window
    run._simulate, allocator._measure_window = stop("a simulated step"), stop("a measured step")
    try:
        yield started
    finally:
        run._simulate, allocator._measure_window = saved


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    tier, started = _tier(item), _cpu_seconds()
    checks = os.environ.get("AUTOFIT_TEST_BUDGETS", "1") != "0"
    with _no_steps() if tier == "quick" and checks else contextlib.nullcontext([]) as steps:
        try:
            result = yield
        except _SimulatedInQuickTier:
            result = None
    if steps:
        pytest.fail(f"a quick-tier test ran {steps[0]} (Note [tier budgets], tests/conftest.py): mark it "
                    f"{NEXT_TIER['quick']}", pytrace=False)
    spent = _cpu_seconds() - started
    if log := os.environ.get("AUTOFIT_TEST_CPU_LOG"):  # Note [the slowest first]: where a marker's seconds come from
        with open(log, "a") as f:
            f.write(f"{spent:.1f}\t{tier}\t{item.nodeid}\n")
    budget = BUDGETS.get(tier)
    if budget is not None and checks and spent > budget:
        scale = _slowdown()  # measured only when a test is over the nominal budget
        if spent > budget * scale:
            here = f" ({budget * scale:.1f} on this machine, {scale:.2f} times slower)" if scale > 1 else ""
            pytest.fail(f"a {tier}-tier test took {spent:.1f} CPU seconds, over its tier's {budget:.0f}{here} "
                        f"(Note [tier budgets], tests/conftest.py): mark it {NEXT_TIER[tier]} or make it cheaper",
                        pytrace=False)
    return result


# Note [shared zoo cases]
# ~~~~~~~~~~~~~~~~~~~~~~~
# The zoo (tests/zoo.py) builds a fresh, seeded model on every call, and some files build the same case dozens of
# times (test_accuracy.py: each of 16 cases for 8 configurations, twice). ``estimate``, ``measure`` and ``plan`` never
# modify the user's model (the README's promise; tests/test_unchanged.py checks it), so a test that only hands a case to
# them reads one session-wide copy. A test that trains, wraps or changes the model builds its own with ``ZOO[name]()``.
# The promise is checked here as well: every parameter and buffer of a shared case keeps its version counter (torch
# bumps it on every in-place write), and a shared case that a test changed fails the session's teardown by name.
@pytest.fixture(scope="session")
def zoo_case() -> Iterator[Callable[[str], object]]:
    """``zoo_case(name)``: the zoo case ``name``, built once per session, for tests that only read it."""
    try:
        from tests.zoo import ZOO
    except ImportError:  # tests/ on sys.path rather than the repository root
        from zoo import ZOO

    built: dict[str, tuple[object, list[int]]] = {}

    def versions(case) -> list[int]:
        return [t._version for t in (*case.model.parameters(), *case.model.buffers())]

    @functools.cache
    def case_of(name: str):
        case = ZOO[name]()
        built[name] = (case, versions(case))
        return case

    yield case_of
    changed = [name for name, (case, before) in built.items() if versions(case) != before]
    assert not changed, f"tests changed the shared zoo case(s) {changed} (Note [shared zoo cases]): build your own"
