"""The command line at first contact (issue 57): help from a bare ``autofit`` and ``-h``, ``-V``, budgets that say
their unit, one reading of GB and GiB, near-miss ``hf:`` names answered offline, a quiet closed pipe, and exports
written as the files their frameworks read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autofit.cli.app import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("plan", "verify", "estimate", "models")


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "AUTOFIT_WORKERS": "1"}
    return {**env, **extra}


def _autofit(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autofit", *args], capture_output=True, text=True, env=_env(),
                          timeout=120, **kwargs)


# --- 1. help and version -------------------------------------------------------------------------------------------

def test_bare_autofit_prints_the_help_and_exits_0():
    run = _autofit()
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Usage:") and all(c in run.stdout for c in COMMANDS), run.stdout


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_short_and_long_help_print_the_same_help(flag):
    result = runner.invoke(app, [flag], terminal_width=120)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and all(c in result.output for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_dash_h(command):
    short = runner.invoke(app, [command, "-h"], terminal_width=120)
    long = runner.invoke(app, [command, "--help"], terminal_width=120)
    assert short.exit_code == 0, short.output
    assert short.output == long.output and f" {command} " in short.output


def test_dash_capital_v_prints_the_version_as_dash_dash_version_does():
    short, long = runner.invoke(app, ["-V"]), runner.invoke(app, ["--version"])
    assert short.exit_code == long.exit_code == 0, short.output
    assert short.output == long.output and short.output.startswith("autofit ")
