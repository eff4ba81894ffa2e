"""What a long-running call is doing, for whoever listens (the CLI's progress display).

The planner reports each stage as it begins (``report("analysing bf16", done=1, total=3)``); nothing listens unless
a caller wraps the call in ``listening(callback)``. The listener is a context variable, so concurrent plans in other
threads or tasks do not see each other's stages, and a library user who never listens pays one lookup per stage.
A stage that can run long on a large model also says how far it is inside itself (``step("micro-batch 1 of 2")``:
a simulation's micro-batches), as a step ``within`` the stage reported last, so that no stretch of a plan goes
without a word for more than a few seconds (issue 56: a 7B plan's analysis and verification ran 10 to 16 s
between two lines).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["Stage", "report", "step", "listening", "silence"]


@dataclass(frozen=True)
class Stage:
    """One step of a long call: what it is, and where it stands among its kind (``done`` of ``total``) when known;
    ``within``: the stage it is a step of (reported by :func:`step`), None for a stage of the planner."""

    what: str
    done: int | None = None
    total: int | None = None
    within: Stage | None = None


_listener: contextvars.ContextVar[Callable[[Stage], None] | None] = contextvars.ContextVar("autofit_progress",
                                                                                           default=None)
_current: contextvars.ContextVar[Stage | None] = contextvars.ContextVar("autofit_progress_stage", default=None)


def report(what: str, done: int | None = None, total: int | None = None) -> None:
    """Tell the listener, if any, that the stage ``what`` begins. A Ctrl-C recorded meanwhile is raised here, between
    two stages (Note [Ctrl-C at safe points], autofit/core/_torch_interrupts.py)."""
    _send(Stage(what, done, total), begins=True)


def step(what: str, done: int | None = None, total: int | None = None) -> None:
    """Tell the listener, if any, how far the current stage is: ``what`` is a step within the stage reported last
    (a simulation's micro-batch, say). Also a point where a recorded Ctrl-C is raised."""
    _send(Stage(what, done, total, within=_current.get()), begins=False)


def _send(stage: Stage, *, begins: bool) -> None:
    # here: the CLI's --help imports this module, not torch
    from autofit.core._torch_interrupts import interruption_point

    interruption_point()
    listener = _listener.get()
    if listener is not None:
        if begins:
            _current.set(stage)
        listener(stage)


@contextlib.contextmanager
def listening(callback: Callable[[Stage], None]) -> Iterator[None]:
    """Send every stage reported inside the block to ``callback``."""
    token, current = _listener.set(callback), _current.set(None)
    try:
        yield
    finally:
        _current.reset(current)
        _listener.reset(token)


def silence() -> None:
    """Stop reporting in this context for good (a forked worker: its parent's listener draws on the parent's
    terminal, see autofit/core/workers.py)."""
    _listener.set(None)
