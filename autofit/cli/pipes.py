"""A closed pipe ends the command quietly: ``autofit models | head -1`` or a plan piped to ``head``.

Note [a closed pipe]
    When the reader of stdout goes away (``head`` has its lines), the next write raises ``BrokenPipeError`` (Python
    ignores SIGPIPE). click then exits 1, the code the docs reserve for a fault with a traceback, and what is left in
    stdout's buffer raises again when the interpreter flushes it at exit ("Exception ignored ... BrokenPipeError").
    Here the command ends with :data:`EXIT_PIPE`, 141 = 128 + SIGPIPE, the status a shell reports for any command a
    closed pipe ends (``yes | head -1`` under ``set -o pipefail``), and stdout is pointed at /dev/null first so that
    the interpreter's last flush writes nowhere, as the Python docs advise (library/signal.html, "Note on SIGPIPE").
    Nothing is printed: the reader asked for no more.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator

import typer

__all__ = ["EXIT_PIPE", "quiet_closed_pipe"]

EXIT_PIPE = 141


def _closed(e: BaseException) -> bool:
    return isinstance(e, BrokenPipeError) or (isinstance(e, OSError) and e.errno == errno.EPIPE)


@contextlib.contextmanager
def quiet_closed_pipe() -> Iterator[None]:
    """Turn a write to a closed stdout inside the block (or the flush at its end) into a quiet exit with
    :data:`EXIT_PIPE` (Note [a closed pipe])."""
    try:
        try:
            yield
        finally:
            sys.stdout.flush()  # what is buffered fails here, not at the interpreter's exit
    except OSError as e:
        if not _closed(e):
            raise
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # a stdout with no file descriptor (a test's capture)
            pass
        raise typer.Exit(EXIT_PIPE) from None
