"""``autofit models`` (what hf:NAME knows offline) and the check of output paths before planning, through typer's
runner as a user types them."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autofit.planner
import autofit.cli.specs
from autofit.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
FACTORY = f"{ROOT / 'examples' / 'factories.py'}:small_cnn"
runner = CliRunner()


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --- autofit models ---------------------------------------------------------------------------------------------

# Pythia's model card lists each model's exact total; the list prints millions to one decimal.
PYTHIA_CARD = {"70m": 70_426_624, "160m": 162_322_944, "410m": 405_334_016, "1b": 1_011_781_632,
               "1.4b": 1_414_647_808, "2.8b": 2_775_208_960, "6.9b": 6_857_302_016, "12b": 11_846_072_320}


def test_models_lists_the_matching_checkpoints_with_their_published_size():
    pytest.importorskip("transformers")
    result = runner.invoke(app, ["models", "pythia"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    printed = {}
    for line in result.output.splitlines():
        found = re.search(r"EleutherAI/pythia-([\w.]+)\s.*?([\d.]+) ([MB])\s", line)
        if found:
            printed[found.group(1)] = float(found.group(2)) * (1e9 if found.group(3) == "B" else 1e6)
    assert printed.keys() == PYTHIA_CARD.keys(), result.output
    for size, published in PYTHIA_CARD.items():
        half_unit = 0.005e9 if published >= 1e9 else 0.05e6  # "1.41 B", "162.3 M"
        assert abs(printed[size] - published) <= half_unit, (size, printed[size], published)
    assert "GPTNeoXForCausalLM" in result.output and "EleutherAI/pythia-160m-deduped" in result.output
    assert "8 checkpoints" in result.output


def test_models_finds_the_issues_names_by_family_and_alias():
    pytest.importorskip("transformers")
    result = runner.invoke(app, ["models", "mixtral"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "mistralai/Mixtral-8x7B-v0.1" in result.output and "46.70 B" in result.output  # "46.7B" (Mistral AI)
    result = runner.invoke(app, ["models", "gemma-2-2b-it"], catch_exceptions=False)
    assert result.exit_code == 0 and "google/gemma-2-2b " in result.output and "2.61 B" in result.output


def test_models_without_a_match_is_one_line_and_exit_2():
    result = runner.invoke(app, ["models", "no-such-model"], catch_exceptions=False)
    assert result.exit_code == 2
    assert _lines(result.output) == ["error: no checkpoint of the offline table matches 'no-such-model'; "
                                     "'autofit models' lists them all"]


def test_plan_help_says_how_to_list_the_offline_checkpoints():
    result = runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())
    assert "'autofit models' lists those known offline" in text, text


# --- output paths are checked before planning -------------------------------------------------------------------

@pytest.fixture
def planner_must_not_run(monkeypatch):
    """Fail the test if the command gets as far as building the model or planning."""
    def refuse(*args, **kwargs):
        raise AssertionError("planning ran although the output path was bad")

    monkeypatch.setattr(autofit.planner, "plan_with_analysis", refuse)
    monkeypatch.setattr(autofit.cli.specs, "load_spec", refuse)  # app.py imports it when a command runs


def _bad_paths(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    return {"missing folder": (Path("/nonexistent/dir/x.png"), "folder /nonexistent/dir does not exist"),
            "a folder": (tmp_path, "is a folder: give a file name"),
            "under a file": (a_file / "x.png", "is a file, not a folder")}


@pytest.mark.parametrize("case", ["missing folder", "a folder", "under a file"])
@pytest.mark.parametrize("as_json", [False, True])
def test_a_bad_plot_path_is_one_line_and_exit_2_before_planning(tmp_path, planner_must_not_run, case, as_json):
    path, words = _bad_paths(tmp_path)[case]
    args = ["plan", "hf:Qwen/Qwen2.5-0.5B", "--budget", "24GB", "--batch-size", "8", "--gpu", "RTX-4090",
            "--plot", str(path), *(["--json"] if as_json else [])]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    lines = _lines(result.output)
    assert len(lines) == 1 and lines[0].startswith("error: --plot ") and words in lines[0], result.output
    assert "Traceback" not in result.output
    if as_json:
        assert result.stdout == ""  # stdout holds the plan's JSON or nothing


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused_before_planning(tmp_path, planner_must_not_run):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        result = runner.invoke(app, ["plan", FACTORY, "--budget", "50MB", "--batch-size", "32", "--device", "cpu",
                                     "--plot", str(folder / "x.png")], catch_exceptions=False)
    finally:
        folder.chmod(0o700)
    assert result.exit_code == 2 and "is not writable" in result.output, result.output


@pytest.mark.sim
def test_a_write_that_fails_after_planning_is_one_line_too(tmp_path, monkeypatch):
    """The path was fine when checked; the disk filled meanwhile."""
    pytest.importorskip("matplotlib")

    def full(path, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    import autofit.cli.plot

    monkeypatch.setattr(autofit.cli.plot, "write_plot", full)
    result = runner.invoke(app, ["plan", FACTORY, "--budget", "50MB", "--batch-size", "32", "--device", "cpu",
                                 "--plot", str(tmp_path / "x.png")], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert _lines(result.output)[-1] == f"error: --plot {tmp_path / 'x.png'}: {os.strerror(errno.ENOSPC)}"
    assert "Traceback" not in result.output
