"""The docs say what the code does (issue 40, item 10): the extras they name, the torch floor, the exit codes of
docs/cli.md and the README's printed plan, each checked against pyproject.toml or a real run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autofit.cli.app import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _package(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def test_every_extra_the_docs_name_exists_with_the_packages_they_list():
    extras = _pyproject()["optional-dependencies"]
    named = set()
    for doc in DOCS:
        for group in re.findall(r"(?:torch-autofit|[\"' ]\.)\[([a-z,]+)\]", doc.read_text()):
            named |= set(group.split(","))
    assert named and named <= set(extras), named - set(extras)
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    extras_table = quickstart[quickstart.index("| extra | adds | for |"):].split("\n\n", 1)[0]
    table = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", extras_table, re.M)
    assert {name for name, _ in table} == set(extras)
    for name, adds in table:
        assert {a.strip().lower() for a in adds.split(",")} == {_package(r) for r in extras[name]}, name


def test_the_readme_says_lora_needs_the_finetune_extra():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Fine-tuning with LoRA"):]
    section = section[:section.index("\n## ", 1)]
    assert "from peft import" in section and '".[hf,finetune]"' in section
    assert "peft" in {_package(r) for r in _pyproject()["optional-dependencies"]["finetune"]}


def test_the_torch_floor_in_the_docs_is_pyprojects():
    floor = next(r for r in _pyproject()["dependencies"] if _package(r) == "torch")
    floor = re.search(r">=\s*([\d.]+)", floor).group(1)
    stated = {(doc.name, v) for doc in DOCS for v in re.findall(r"torch\s*>=\s*([\d.]+)", doc.read_text())}
    assert stated and all(v == floor for _, v in stated), stated


def _exit_codes() -> dict[int, str]:
    text = (ROOT / "docs" / "cli.md").read_text()
    table = text[text.index("## Exit codes and errors"):]
    return {int(code): words for code, words in re.findall(r"^\| (\d) \| (.+) \|$", table, re.M)}


FACTORY = f"{ROOT / 'examples' / 'factories.py'}:small_cnn"
RAISES = "def broken():\n    raise ValueError('no such layer size')\n"


@pytest.mark.sim
def test_exit_codes_in_docs_cli_are_the_real_ones(tmp_path):
    """Each case runs for real; the row of docs/cli.md for the code it exits with names the case."""
    raising = tmp_path / "raising.py"
    raising.write_text(RAISES)
    small = ["--batch-size", "32", "--device", "cpu", "--quiet"]
    cases = {  # words the docs' row says -> command line
        "the plan": ["plan", FACTORY, "--budget", "1GB", *small],
        "a factory that raises": ["plan", f"{raising}:broken", "--budget", "1GB", *small],
        "an unreadable budget": ["plan", FACTORY, "--budget", "8 gigs", *small],
        "`--allow` rung": ["plan", FACTORY, "--budget", "1GB", "--allow", "fast-math", *small],
        "the budget is infeasible": ["plan", FACTORY, "--budget", "1MB", *small],
    }
    codes = _exit_codes()
    assert set(codes) == {0, 1, 2, 3, 4}
    for words, args in cases.items():
        result = runner.invoke(app, args)
        assert words in codes[result.exit_code], (words, result.exit_code, result.output)
        assert "Traceback" not in result.output
        if result.exit_code == 2:
            errors = [line for line in result.output.splitlines() if line.startswith("error:")]
            assert len(errors) == 1, result.output
    raised = runner.invoke(app, cases["a factory that raises"])
    assert "error: building MODEL" in raised.output and "ValueError: no such layer size" in raised.output
    allow = runner.invoke(app, cases["`--allow` rung"])
    assert "error: --allow: unknown rung 'fast-math'" in allow.output, allow.output


@pytest.mark.slow
def test_the_readme_shows_every_row_its_first_command_prints():
    """The rows of the README's printed plan (its knob table) are those the command prints, in order."""
    pytest.importorskip("transformers")
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"&& autofit (plan hf:gpt2 [^\n]+)", readme).group(1).split()
    printed = readme[readme.index("## What the first command prints"):]
    printed = printed[printed.index("```text"):printed.index("```\n", printed.index("```text") + 7)]

    def knob_labels(text: str) -> list[str]:
        table = text[text.index("autofit plan"):text.index("predicted peak by category")]
        return re.findall(r"^│ (\w[\w ]*?)\s+│", table, re.M)

    result = runner.invoke(app, [*command, "--quiet"], env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 0, result.output
    assert knob_labels(printed) == knob_labels(result.output)
    assert "rows by length" in knob_labels(printed) and "gradient clipping" in knob_labels(printed)


def _command_options() -> dict[str, set[str]]:
    """Each command's option names as its --help lists them (click's parameters: the names and the --no- forms)."""
    import typer

    group = typer.main.get_command(app)
    ctx = group.make_context("autofit", ["plan", "--help"], resilient_parsing=True)
    options = {"": {n for p in group.get_params(ctx) for n in (*p.opts, *p.secondary_opts)}}
    for name, command in group.commands.items():
        sub = command.make_context(name, [], parent=ctx, resilient_parsing=True)
        options[name] = {n for p in command.get_params(sub) for n in (*p.opts, *p.secondary_opts)
                         if n.startswith("-")}
    return options


def _documented_options() -> set[str]:
    """The option names in the first column of docs/cli.md's option tables."""
    text = (ROOT / "docs" / "cli.md").read_text()
    cells = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| `-")]
    return {name for cell in cells for name in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", cell)}


def test_every_option_the_help_lists_is_in_docs_cli():
    text = (ROOT / "docs" / "cli.md").read_text()
    for command, names in _command_options().items():
        help_text = runner.invoke(app, [*([command] if command else []), "--help"], env={"COLUMNS": "200"}).output
        for name in names:
            assert name in help_text, (command, name)  # the help lists it ...
            assert re.search(rf"`{re.escape(name)}(?![\w-])", text), f"docs/cli.md lacks {name} ({command or 'autofit'})"


def test_every_option_docs_cli_lists_exists():
    real = set().union(*_command_options().values())
    documented = _documented_options()
    assert {"--budget", "--allow", "--offload", "--min-stored-precision", "-h", "-V"} <= documented, documented
    assert documented <= real, documented - real


def test_the_readme_tier_times_are_for_the_commands_beside_them():
    """A time measured with `-n 2` belongs beside a command with `-n 2` (issue 57: the quick tier's 39 s was for a
    command with -n 2 that the README's lacked)."""
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(quick|sim|slow)`[^|]*\|[^|]*\| `([^`]+)` \| ([^|]+) \|$", readme, re.M)
    assert [tier for tier, _, _ in rows] == ["quick", "sim", "slow"], rows
    for tier, command, time in rows:
        workers = re.search(r"-n (\d+)", command)
        timed = re.search(r"`-n (\d+)`", time)
        assert timed is None or (workers is not None and workers.group(1) == timed.group(1)), (tier, command, time)
