"""The planner's stages as the command runs, on a terminal or in a log.

On a terminal, a plan that finishes quickly prints nothing but its result; a longer one shows rich's progress line
(spinner, the stage the planner reported through ``autofit.core.progress``, its count, the time so far), removed when
the plan is done. A timer starts the display, so a long first stage shows up too.

When stderr is not a terminal (``> log 2>&1``, nohup, slurm, CI), nothing can be redrawn: each stage is one plain
line on stderr as it begins, with the seconds since planning began, flushed at once, so a log shows work going on
(a hang and a long plan look different), and a last line when planning ends. A step within a stage (a simulation's
phases, the model of each micro-batch) gets a line when no line came for a second: a log never stays silent long
while the planner works, nor fills with steps. ``--quiet`` prints neither.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from autofit.core.progress import Stage, listening

__all__ = ["SHOW_AFTER_SECONDS", "STEP_LINE_SECONDS", "planning_progress"]

SHOW_AFTER_SECONDS = 2.0
STEP_LINE_SECONDS = 1.0  # in a log, a step within a stage (progress.step) gets a line when none came for this long


def _describe(stage: Stage) -> str:
    what = f"{stage.what} [{stage.done + 1}/{stage.total}]" if stage.total else stage.what
    return what if stage.within is None else f"{_describe(stage.within)}: {what}"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or an object without isatty
        return False


@contextlib.contextmanager
def planning_progress(console: Console, first: str = "planning (fake tensors, no memory allocated)",
                      delay: float = SHOW_AFTER_SECONDS, *, quiet: bool = False,
                      log: TextIO | None = None) -> Iterator[list[Stage]]:
    """Show the stages reported inside the block: on ``console`` after ``delay`` seconds when it is a terminal,
    else as lines on ``log`` (stderr by default) when that is not a terminal either; nothing with ``quiet``. Yields
    the list of the planner's stages seen (in order), which the tests read; the steps within a stage
    (``progress.step``) are shown, not listed."""
    log = sys.stderr if log is None else log
    if quiet:
        stages: list[Stage] = []
        with listening(lambda stage: stages.append(stage) if stage.within is None else None):
            yield stages
    elif console.is_terminal:
        with _live(console, first, delay) as stages:
            yield stages
    elif not _is_terminal(log):
        with _lines(log, first) as stages:
            yield stages
    else:  # stdout redirected, stderr a terminal: the display goes there
        with _live(Console(file=log), first, delay) as stages:
            yield stages


@contextlib.contextmanager
def _lines(log: TextIO, first: str) -> Iterator[list[Stage]]:
    stages: list[Stage] = []
    started = time.monotonic()
    last = [started]

    def line(text: str) -> None:
        last[0] = time.monotonic()
        log.write(f"{last[0] - started:7.1f} s  {text}\n")
        log.flush()

    def on_stage(stage: Stage) -> None:
        if stage.within is None:
            stages.append(stage)
        elif time.monotonic() - last[0] < STEP_LINE_SECONDS:
            return  # a step within a stage: a line a second at most, enough to show work going on
        line(_describe(stage))

    line(first)
    with listening(on_stage):
        yield stages
    line("planning done")


@contextlib.contextmanager
def _live(console: Console, first: str, delay: float) -> Iterator[list[Stage]]:
    stages: list[Stage] = []
    display = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                       transient=True)
    task = display.add_task(first, total=None)
    lock = threading.Lock()
    state = {"shown": False, "over": False}

    def show() -> None:
        with lock:  # the block may end while the timer fires: never start a display after it stopped
            if not state["over"]:
                display.start()
                state["shown"] = True

    def on_stage(stage: Stage) -> None:
        if stage.within is None:
            stages.append(stage)
        display.update(task, description=_describe(stage))

    timer = threading.Timer(delay, show)
    timer.daemon = True
    timer.start()
    try:
        with listening(on_stage):
            yield stages
    finally:
        timer.cancel()
        with lock:
            state["over"] = True
            if state["shown"]:
                display.stop()
