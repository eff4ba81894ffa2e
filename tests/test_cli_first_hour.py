"""The command line in a new user's first hour (issue 40): Note names printed whole, output paths tried before
planning, help at 80 columns, a light --version, progress lines under a pipe, workers that die with the command, no
third-party import noise (the docs: tests/test_docs_agree.py)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from autofit.cli.app import app
from autofit.cli.messages import one_line_warnings, say

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    """This checkout first on the path (also in the subprocess), offline, one worker unless the test says."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "AUTOFIT_WORKERS": "1"}
    return {**env, **extra}

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


@pytest.mark.sim  # 5.1 CPU s on a slow machine (2026-11-27), over the quick tier's 5
@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc")
def test_a_plot_path_that_cannot_be_created_fails_before_planning(tmp_path):
    """/proc passes every permission check (for root too) but refuses new files: only a real write tells. The model
    here would take far longer to plan than the check, and is never built (a factory that sleeps)."""
    factory = tmp_path / "slow.py"
    factory.write_text("import time\n\ndef slow():\n    time.sleep(60)\n")
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "autofit", "plan", f"{factory}:slow", "--budget", "1GB",
                          "--batch-size", "2", "--device", "cpu", "--plot", "/proc/plan.png"],
                         capture_output=True, text=True, timeout=120, env=_env())
    took = time.monotonic() - started
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout.strip() == "error: --plot /proc/plan.png: cannot write there (No such file or directory); " \
                                 "choose another path", run.stdout
    assert took < 30, took  # the factory alone sleeps 60 s: it never ran


def test_a_writable_plot_path_is_left_as_it_was(tmp_path):
    from autofit.cli.outputs import check_output_path

    new, old = tmp_path / "new.png", tmp_path / "old.png"
    old.write_bytes(b"keep")
    check_output_path(new, "--plot")
    check_output_path(old, "--plot")
    assert not new.exists() and old.read_bytes() == b"keep"


def _option_names(command: str) -> list[str]:
    import typer.main

    params = typer.main.get_command(app).commands[command].params
    return [name for p in params for name in (*p.opts, *p.secondary_opts) if name.startswith("--")]


@pytest.mark.parametrize("command", ["plan", "estimate", "verify"])
def test_help_at_80_columns_keeps_every_option_name_whole(command):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output and max(map(len, result.output.splitlines())) <= 80
    listed = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", result.output))
    assert set(_option_names(command)) <= listed, set(_option_names(command)) - listed


def test_help_piped_keeps_option_names_whole():
    env = _env()
    env.pop("COLUMNS", None)  # a pipe: no terminal width, rich would assume 80
    run = subprocess.run([sys.executable, "-m", "autofit", "plan", "--help"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "…" not in run.stdout
    for name in ("--min-stored-precision", "--allow-over-capacity", "--reshard-after-forward"):
        assert re.search(rf"^\s+{name}\b", run.stdout, re.M), run.stdout


@pytest.mark.sim  # four interpreters start: seconds
def test_version_and_help_do_not_import_torch():
    """What is imported, not how long it takes (Note [a light import], autofit/__init__.py): torch's import is
    most of the seconds a cold start took."""
    probe = ("import sys\nfrom autofit.cli.app import main\nsys.argv = ['autofit', *sys.argv[1:]]\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'scipy', 'transformers'))\n"
             "print('heavy:', heavy[:5])\n")
    for args in (["--version"], ["--help"], ["plan", "--help"]):
        run = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, env=_env(),
                             timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines()[-1] == "heavy: []", (args, run.stdout[-500:])
    run = subprocess.run([sys.executable, "-c", "import autofit, sys; print('torch' in sys.modules)"],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert run.stdout.strip() == "False"


def test_the_light_cli_names_match_the_modules_they_stand_for():
    from autofit.cli import flags
    from autofit.cli.tasks import TASKS
    from autofit.emit.export import EXPORTERS

    assert flags.TASK_NAMES == TASKS and flags.EXPORT_NAMES == tuple(EXPORTERS)


SLOW_FORWARD = '''
import time
from torch import nn

class Slow(nn.Module):
    """A small classifier whose forward takes 0.05 s more: each simulation of a step does too."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
    def forward(self, x):
        time.sleep(0.05)
        return self.fc(x)

def slow():
    return Slow()
'''

STAGE_LINE = re.compile(r"^\s*\d+\.\d s  (simulating|analysing|searching|rows per micro-batch)", re.M)


@pytest.mark.sim
def test_a_plan_into_a_log_file_writes_its_stages_while_it_runs(tmp_path):
    """`autofit plan ... > log 2>&1`: the stage lines are in the file before the process ends."""
    factory = tmp_path / "slow.py"
    factory.write_text(SLOW_FORWARD)
    log_path = tmp_path / "log"
    args = [sys.executable, "-m", "autofit", "plan", f"{factory}:slow", "--task", "classification",
            "--input-shape", "16", "--budget", "1GB", "--batch-size", "8", "--device", "cpu", "--precision", "fp32"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=_env())
    seen_while_running = None
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            text = log_path.read_text()
            if STAGE_LINE.search(text) and proc.poll() is None:
                seen_while_running = text
                break
            time.sleep(0.05)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    final = log_path.read_text()
    assert proc.returncode == 0, final
    assert seen_while_running is not None, final
    assert "micro-batch" in final and re.search(r"^\s*\d+\.\d s  planning done$", final, re.M), final
    # --quiet: the same plan in this process (the runner's stderr is no terminal either), no stage line
    quiet = runner.invoke(app, [*args[3:], "--quiet"])
    assert quiet.exit_code == 0 and "micro-batch" in quiet.output and not STAGE_LINE.search(quiet.output), \
        quiet.output


def test_stage_lines_when_stderr_is_not_a_terminal():
    from autofit.cli.progress import planning_progress
    from autofit.core import progress

    log, screen = io.StringIO(), io.StringIO()
    with planning_progress(Console(file=screen), log=log) as stages:
        progress.report("analysing bf16: two small simulations", 0, 2)
    lines = log.getvalue().splitlines()
    assert [line.split(" s  ", 1)[1] for line in lines] == [
        "planning (fake tensors, no memory allocated)", "analysing bf16: two small simulations [1/2]",
        "planning done"]
    assert screen.getvalue() == "" and len(stages) == 1
    with planning_progress(Console(file=screen), log=log, quiet=True) as stages:
        progress.report("simulating")
    assert len(log.getvalue().splitlines()) == 3 and len(stages) == 1


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc: no psutil)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended; its new parent reaps it


SLOW_IN_A_WORKER = '''
import os
import time
from torch import nn

COMMAND = os.getpid()  # the factory is imported in the command's process; a forked worker has another pid


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x):
        if os.getpid() != COMMAND:
            time.sleep(120)  # a worker's simulation outlasts the test: only the kernel's signal ends it in time
        return self.fc(x).relu()


def slow():
    return nn.Sequential(*[Block() for _ in range(4)], nn.Linear(64, 4))
'''


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="worker processes run on Linux with two cores or more")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_workers_end_with_the_command(tmp_path, sig):
    """`autofit plan` with its simulation workers running: kill the command, and no worker remains (they were
    re-parented to PID 1 and ran on for minutes)."""
    factory = tmp_path / "slow_blocks.py"
    factory.write_text(SLOW_IN_A_WORKER)
    proc = subprocess.Popen([sys.executable, "-m", "autofit", "plan", f"{factory}:slow", "--task", "classification",
                             "--input-shape", "64", "--budget", "1GB", "--batch-size", "64", "--device", "cuda",
                             "--gpu", "T4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=_env(AUTOFIT_WORKERS="2"))
    children: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while not children and proc.poll() is None and time.monotonic() < deadline:
            children = _children(proc.pid)
            time.sleep(0.05)
        assert children, "the plan forked no worker"
        os.kill(proc.pid, getattr(signal, sig))
        proc.wait(timeout=30)
        gone = time.monotonic() + 5
        while any(map(_alive, children)) and time.monotonic() < gone:
            time.sleep(0.05)
        assert not any(map(_alive, children)), f"workers {children} outlived the command ({sig})"
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in children:  # a worker that outlived the command must not outlive the test
            if _alive(child):
                os.kill(child, signal.SIGKILL)


NOISE = re.compile(r"Failed to load|_pytree|is an Enum subclass|_C_mxfp8")


@pytest.mark.sim  # a subprocess that imports torch and every stage: seconds, not a quick test
def test_importing_autofit_prints_nothing():
    code = "import autofit\nautofit.plan, autofit.estimate, autofit.measure, autofit.Plan\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert run.returncode == 0 and run.stderr == "" and run.stdout == "", run.stderr


@pytest.mark.slow
def test_an_hf_plan_prints_no_third_party_import_noise():
    """With torchao installed, transformers imports it while building the model; its kernel-loading warnings and
    torch's pytree deprecation lines are not the user's business (Note [import noise])."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    run = subprocess.run([sys.executable, "-m", "autofit", "plan", "hf:gpt2", "--config", "n_layer=1", "--config",
                          "n_embd=64", "--config", "n_head=2", "--config", "vocab_size=1000", "--input-shape", "64",
                          "--budget", "1GB", "--batch-size", "4", "--gpu", "T4", "--json", "--quiet"],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "", run.stderr
    # the same import without autofit's filter does print them: the test checks something that happens
    bare = subprocess.run([sys.executable, "-c", "import transformers.modeling_utils"], capture_output=True,
                          text=True, env=_env(), timeout=300)
    assert NOISE.search(bare.stderr), "this torchao no longer prints the lines: the filter may go"


def test_the_filter_drops_only_the_known_lines():
    import logging

    from autofit.cli.quiet_imports import quiet_third_party_imports

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("torchao")
    keep = Keep()
    logger.addHandler(keep)
    try:
        with quiet_third_party_imports():
            logger.warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
            logger.warning("Failed to load the user's own config")
        logger.warning("Failed to load /x/torchao/_C_cutlass_90a.abi3.so: later, not at import")
    finally:
        logger.removeHandler(keep)
    assert seen == ["Failed to load the user's own config",
                    "Failed to load /x/torchao/_C_cutlass_90a.abi3.so: later, not at import"]


QUICK_EXIT = '''
import atexit, sys
atexit.register(lambda: print("atexit ran", file=sys.stderr))
sys.argv = ["autofit", *sys.argv[1:]]
from autofit.cli.app import run
run()
print("not reached", file=sys.stderr)
'''


@pytest.mark.sim  # three interpreters start, two plans: seconds
def test_the_command_ends_with_its_status_its_whole_output_and_atexit():
    """Note [a quick exit], autofit/cli/app.py: the command freezes the collector before it exits, and keeps each
    outcome's exit status, everything written to a pipe (a whole JSON plan) and the ``atexit`` handlers."""
    factory = f"{ROOT / 'examples' / 'factories.py'}:small_cnn"
    common = ["plan", factory, "--batch-size", "32", "--device", "cpu"]

    def command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", QUICK_EXIT, *common, *args], capture_output=True, text=True,
                              env=_env(), timeout=300)

    ok = command("--budget", "1GB", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout[ok.stdout.index("{"):])["batch_size"] == 32
    assert ok.stderr.splitlines()[-1] == "atexit ran"
    infeasible = command("--budget", "100KB")
    assert infeasible.returncode == 3 and "Smallest budget that works" in infeasible.stdout, infeasible.stdout
    bad = command("--budget", "8 gigs")
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1] == "atexit ran", bad.stderr
