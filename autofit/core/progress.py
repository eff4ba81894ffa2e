"""What a long-running call is doing, for whoever listens (the CLI's progress display).

The planner reports each stage as it begins (``report("analysing bf16", done=1, total=3)``); nothing listens unless
a caller wraps the call in ``listening(callback)``. The listener is a context variable, so concurrent plans in other
threads or tasks do not see each other's stages, and a library user who never listens pays one lookup per stage.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["Stage", "report", "listening", "silence"]


@dataclass(frozen=True)
class Stage:
    """One step of a long call: what it is, and where it stands among its kind (``done`` of ``total``) when known."""

    what: str
    done: int | None = None
    total: int | None = None


_listener: contextvars.ContextVar[Callable[[Stage], None] | None] = contextvars.ContextVar("autofit_progress",
                                                                                           default=None)


def report(what: str, done: int | None = None, total: int | None = None) -> None:
    """Tell the listener, if any, that the stage ``what`` begins. A Ctrl-C recorded meanwhile is raised here, between
    two stages (Note [Ctrl-C at safe points], autofit/core/_torch.py)."""
    from autofit.core._torch import interruption_point  # here: the CLI's --help imports this module, not torch

    interruption_point()
    listener = _listener.get()
    if listener is not None:
        listener(Stage(what, done, total))


@contextlib.contextmanager
def listening(callback: Callable[[Stage], None]) -> Iterator[None]:
    """Send every stage reported inside the block to ``callback``."""
    token = _listener.set(callback)
    try:
        yield
    finally:
        _listener.reset(token)


def silence() -> None:
    """Stop reporting in this context for good (a forked worker: its parent's listener draws on the parent's
    terminal, see autofit/core/workers.py)."""
    _listener.set(None)
