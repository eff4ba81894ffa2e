"""End-to-end: every script of ``examples/`` runs and says what it should, the command line plans the example
factories, and the documentation builds with warnings as errors (and names every public name)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autofit
from autofit.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs"
TIMEOUT = 600  # seconds per script; each takes well under a minute on two CPU cores

# text each script must print (besides exiting with 0)
EXPECTED = {
    "cnn.py": ["autofit plan", "step 1: loss", "measured peak"],
    "transformer_lm.py": ["autofit plan", "step 1: loss", "plan JSON round-trips"],
    "custom_loop.py": ["epoch 2: mean loss", "unwrapped: 0 modules still patched"],
    "distributed.py": ["autofit plan", "rank 0/1 single: loss"],  # one process here; tests/test_distributed.py runs 2
    "factories.py": ["small_cnn: micro-batch", "tiny_lm: micro-batch"],
    "variable_length.py": ["rows by length", "1 micro-batch(es) of up to", "length-adapted:"],
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_every_example_has_expectations() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


def _run_example(name: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"examples/{name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    for text in EXPECTED[name]:
        assert text in proc.stdout, f"examples/{name} did not print {text!r}:\n{proc.stdout}"
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str) -> None:
    out = _run_example(name)
    if name == "custom_loop.py":  # the loss goes down over the epochs
        losses = [float(x) for x in re.findall(r"epoch \d+: mean loss ([0-9.]+)", out)]
        assert len(losses) == 3 and losses[-1] < losses[0], out
    if name == "cnn.py":  # the estimate of the planned step lands on the allocator's peak
        error = float(re.search(r"measured peak [0-9.]+ MiB \(([-+0-9.]+) %\)", out).group(1))
        assert abs(error) <= 1.0, out


# ---- the command line on examples/factories.py ---------------------------------------------------------------------
def _cli(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, f"autofit {' '.join(args)} exited {result.exit_code}:\n{result.output}"
    return result


@pytest.mark.slow
def test_cli_plans_small_cnn() -> None:
    result = _cli("plan", "examples/factories.py:small_cnn", "--budget", "50MB", "--batch-size", "32",
                  "--device", "cpu")
    assert "micro-batch" in result.stdout and "predicted peak" in result.stdout


@pytest.mark.slow
def test_cli_plans_tiny_lm_as_json_with_export() -> None:
    result = _cli("plan", "examples/factories.py:tiny_lm", "--budget", "20MB", "--batch-size", "16",
                  "--device", "cpu", "--json", "--export", "hf", "--quiet")  # no stage lines on stderr
    plan = autofit.Plan.from_json(result.stdout)  # stdout is exactly one plan
    assert plan.batch_size == 16 and plan.device == "cpu"
    assert plan.micro_batch_size * plan.gradient_accumulation_steps >= 16
    assert plan.device_bytes <= plan.budget_bytes == 20 * 10**6
    exported = json.loads(result.stderr)  # the export goes to stderr when --json holds stdout
    assert exported["training_arguments"]["per_device_train_batch_size"] == plan.micro_batch_size


@pytest.mark.sim
def test_cli_plans_module_only_factory_with_input_shape() -> None:
    result = _cli("plan", "examples/factories.py:mlp", "--input-shape", "128", "--budget", "10MB",
                  "--batch-size", "64", "--device", "cpu", "--precision", "fp32", "--json")
    plan = autofit.Plan.from_json(result.stdout)
    assert plan.batch_size == 64 and plan.precision.name == "fp32"


# ---- the documentation ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_docs_build_without_warnings(tmp_path: Path) -> None:
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT,
    )
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "html" / "api.html").exists()


def test_api_page_names_every_public_name() -> None:
    text = (DOCS / "api.md").read_text()
    missing = [name for name in autofit.__all__ if f"autofit.{name}" not in text]
    assert not missing, f"docs/api.md does not document: {', '.join(missing)}"


def test_docs_pages_are_in_the_toctree() -> None:
    index = (DOCS / "index.md").read_text()
    toctree = index[index.index("```{toctree}"):]
    for page in DOCS.glob("*.md"):
        if page.name != "index.md":
            assert f"\n{page.stem}\n" in toctree, f"docs/{page.name} is not in the toctree of docs/index.md"
