"""The planner's stages on the terminal, for plans that take more than about two seconds.

A plan that finishes quickly prints nothing but its result; a longer one shows rich's progress line (spinner, the
stage the planner reported through ``autofit.core.progress``, its count, the time so far), removed when the plan is done.
A timer starts the display, so a long first stage shows up too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from autofit.core.progress import Stage, listening

__all__ = ["SHOW_AFTER_SECONDS", "planning_progress"]

SHOW_AFTER_SECONDS = 2.0


def _describe(stage: Stage) -> str:
    if stage.total:
        return f"{stage.what} [{stage.done + 1}/{stage.total}]"
    return stage.what


@contextlib.contextmanager
def planning_progress(console: Console, first: str = "planning (fake tensors, no memory allocated)",
                      delay: float = SHOW_AFTER_SECONDS) -> Iterator[list[Stage]]:
    """Show the stages reported inside the block once it has run ``delay`` seconds. Yields the list of stages seen
    (in order), which the tests read."""
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
