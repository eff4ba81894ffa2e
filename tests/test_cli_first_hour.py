"""The command line in a new user's first hour (issue 40): Note names printed whole, output paths tried before
planning, help at 80 columns, a light --version, progress lines under a pipe, workers that die with the command, no
third-party import noise, and docs that say what the code does."""

from __future__ import annotations

import io
import re
import warnings

from rich.console import Console
from typer.testing import CliRunner

from autofit.cli.app import app
from autofit.cli.messages import one_line_warnings, say

runner = CliRunner()

RAISES_NOTE = '''
from autofit.core.errors import InvalidInputError

def broken():
    raise InvalidInputError("the layout is refused (see Note [sequence parallel]); [bold]x[/bold] stays too")
'''


def test_a_message_citing_a_note_prints_the_note_name(tmp_path):
    factory = tmp_path / "notes.py"
    factory.write_text(RAISES_NOTE)
    result = runner.invoke(app, ["plan", f"{factory}:broken", "--budget", "1GB", "--batch-size", "2",
                                 "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "(see Note [sequence parallel]); [bold]x[/bold] stays too" in result.output
    out = io.StringIO()
    with one_line_warnings(Console(file=out, width=80)):
        warnings.warn("recomputed twice (Note [liveness])", stacklevel=1)
    say(Console(file=out, width=80), "note", "see Note [rows by length]")
    assert out.getvalue().splitlines() == ["warning: recomputed twice (Note [liveness])",
                                           "note: see Note [rows by length]"]
