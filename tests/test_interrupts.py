"""A Ctrl-C in the first plan of a process leaves it able to plan again, with the same plan, and leaves no worker
process behind (Note [lazy imports and Ctrl-C], core/_torch_interrupts.py; Note [Ctrl-C and workers], core/workers.py).
The truth: the JSON of the same plan made by a fresh, uninterrupted process, and /proc's list of this process's
children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("_interrupted_plan.py")
BUDGET = "565000000B"  # between the full batch's device bytes and those of 8 x 8 on a T4: the planner searches


def _as_from_a_terminal() -> None:
    """The child starts with SIGINT as a shell gives it: default disposition, not blocked. A signal's disposition
    SIG_IGN and its blocked mask survive exec, and Python installs its KeyboardInterrupt handler only where SIGINT is
    not ignored at start-up; an xdist worker late in the whole suite passed on one or the other (a CI run: the child's
    real SIGINT never arrived, "interrupted": false; the test alone, and a process after plans and measures, start
    clean), so the truth here would be the worker's history, not a fresh process's."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _run(mode: str) -> dict:
    env = dict(os.environ, AUTOFIT_WORKERS="2", PYTHONPATH=os.pathsep.join(
        [str(SCRIPT.parent.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT), mode, BUDGET], capture_output=True, text=True, env=env,
                          timeout=900, preexec_fn=_as_from_a_terminal)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.sim
@pytest.mark.slow(seconds=45)
def test_interrupted_first_plan_then_the_same_plan() -> None:
    fresh = _run("none")
    for mode in ("import", "workers"):
        got = _run(mode)
        assert got["interrupted"] is True, mode
        assert got["children"] == [] and got["children_after"] == [], (mode, got["children"])
        assert got["plan"] == fresh["plan"], mode


STORM = Path(__file__).with_name("_interrupt_storm.py")
INTERRUPTS = 200  # about 70 in each of plan, estimate and measure


def _storm(*args: str) -> dict:
    env = dict(os.environ, AUTOFIT_WORKERS="2", STORM_SEED="7", PYTHONPATH=os.pathsep.join(
        [str(STORM.parent.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(STORM), *args], capture_output=True, text=True, env=env, timeout=900,
                          preexec_fn=_as_from_a_terminal)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    # an abort (SIGABRT: "terminate called after throwing an instance of 'python_error'") ends the child with -6
    assert done.returncode == 0 and lines, (done.returncode, done.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.sim
@pytest.mark.slow(seconds=100)  # 140 s wall, 119 s CPU on two cores shared with other jobs (load 6)
def test_hundreds_of_interrupts_at_random_points() -> None:
    """Real SIGINTs at random points of plan, estimate and measure, one in four doubled into the cleanup of the first
    (Note [Ctrl-C at safe points], core/_torch_interrupts.py). Each reaches the caller as a KeyboardInterrupt (never
    lost, never another error, never an abort), and afterwards nothing of autofit is left in the process: torch's mode
    stacks are empty, the functions autofit patches and the grad mode are torch's again, the model is as it was, the
    next plan equals a fresh process's, and a plain training step runs no autofit code and makes the same calls as
    before."""
    fresh = _storm("fresh")
    got = _storm("storm", str(INTERRUPTS))
    assert got["sent"] >= INTERRUPTS
    assert got["other"] == [], got["other"][:5]  # no ForwardError or other wrapper of a KeyboardInterrupt
    assert got["lost"] == 0, got  # every interrupted call raised; Python once dropped some in weakref callbacks
    assert got["completed"] > 0  # some calls ended before their interrupt: the interrupts spread over whole calls
    assert got["dispatch_modes"] == 0 and got["function_modes"] == 0
    assert got["process_changed"] == {}, got["process_changed"]
    assert got["model_unchanged"] and got["pending"] == 0
    assert got["autofit_in_plain_step"] == []
    # a mode left on the stack once made plain steps 2.5x slower: a plain step makes the same calls as before the storm
    assert got["plain_step_changed"] == {}, got["plain_step_changed"]
    assert got["children"] == []
    assert got["plan"] == fresh["plan"]
