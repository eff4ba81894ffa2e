"""Library messages in the command line's words: flags instead of keyword arguments, one-line warnings, and a
note when a GPU name stands for several parts. :func:`say` is the one place a message reaches the console: its text
is escaped, so a ``Note [name]`` it cites is printed whole (rich would read ``[name]`` as a style and drop it)."""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from collections.abc import Iterator

from rich.console import Console
from rich.markup import escape

from autofit.cuda.catalog import resolve_alias

__all__ = ["cli_words", "one_line_warnings", "gpu_note", "say", "console_for", "PIPE_WIDTH"]

# Piped output has no terminal width to fit: rich would assume 80 columns and fold module names mid-word. Give it
# room for the widest table instead (tables only take the width their content needs).
PIPE_WIDTH = 240


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """rich exits 1 here, the code of a fault: raise, for :func:`autofit.cli.pipes.quiet_closed_pipe` to end
        the command as Note [a closed pipe] says."""
        self.quiet = True
        raise BrokenPipeError(32, "stdout closed")


def console_for(*, stderr: bool = False) -> Console:
    """The command's console: the terminal's width on a terminal, :data:`PIPE_WIDTH` columns when piped."""
    console = _Console(stderr=stderr)
    if not console.is_terminal:
        console = _Console(stderr=stderr, width=PIPE_WIDTH)
    return console

# The library's keyword arguments the command line spells as flags (planner.py and step.py messages name them).
_FLAGS = {
    "world_size": "--world-size", "batch_size": "--batch-size", "input_shape": "--input-shape",
    "input_dtype": "--input-dtype", "loss_fn": "--task", "strategy=": "--strategy ",
    "allow:": "--allow:",  # validate.allow_names: 'allow: unknown rung ...' (a bare 'allow' is also an English word)
    "host_budget=": "--host-budget ", "host_budget": "--host-budget",
}
_WORDS = re.compile(r"(?<![\w-])(" + "|".join(re.escape(k) for k in _FLAGS) + r")(?![\w])")


def cli_words(message: str) -> str:
    """'batch_size 30 does not split evenly over world_size 4' -> '--batch-size 30 ... over --world-size 4'."""
    return _WORDS.sub(lambda m: _FLAGS[m.group(1)], message)


def say(console: Console, label: str, text: str, style: str = "dim", *, flags: bool = True) -> None:
    """Print ``label: text`` (``error:``, ``warning:``, ``note:``, ``model:``), the label in ``style``, the text as it
    is: escaped, never read as markup, in the command line's words (``flags``), on one line however long."""
    words = cli_words(text) if flags else text
    console.print(f"[{style}]{label}:[/] {escape(words)}", soft_wrap=True, highlight=False)


@contextlib.contextmanager
def one_line_warnings(console: Console) -> Iterator[None]:
    """Print each warning as one line ``warning: ...`` on stderr (Python's default adds the source file, line and
    code)."""
    # on stderr whatever stream the command prints on: a warning is not the plan, and a pipe reads the plan
    err = console_for(stderr=True) if console.file is sys.stdout else console

    def show(message, category, filename, lineno, file=None, line=None):
        text = " ".join(str(message).split())
        say(err, "warning", text, "yellow")

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        yield


def gpu_note(gpu: str | None) -> str | None:
    """For a name that stands for several parts ('A100': 40 and 80 GB), which one the plan uses and the flag value
    of each other part; None for a name of one card ('RTX4090')."""
    if gpu is None:
        return None
    alias = resolve_alias(gpu)
    if alias is None:
        return None
    picked, others = alias
    other = ("; for the " + ", for the ".join(f"{o} say --gpu {o}" for o in others)) if others else ""
    return f"--gpu {gpu} means the {picked}{other}"
