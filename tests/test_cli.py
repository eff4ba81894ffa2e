"""The ``autofit`` command through typer's runner: model specs, JSON, exports, exit codes and their messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autofit
from autofit.cli.app import app
from autofit.cli.specs import load_spec, parse_overrides, parse_shape
from autofit.core.errors import InvalidInputError

ROOT = Path(__file__).resolve().parent.parent
FACTORY = f"{ROOT / 'examples' / 'factories.py'}:small_cnn"
runner = CliRunner()


def _plan(*args: str):
    return runner.invoke(app, ["plan", *args], catch_exceptions=False)


@pytest.mark.sim
def test_factory_spec_prints_the_plan_tables():
    result = _plan(FACTORY, "--budget", "50MB", "--batch-size", "32", "--device", "cpu")
    assert result.exit_code == 0, result.output
    for text in ("micro-batch", "accumulation steps", "predicted peak", "MiB", "largest layers"):
        assert text in result.output, result.output


@pytest.mark.sim
def test_json_parses_and_round_trips_into_a_plan():
    result = _plan(FACTORY, "--budget", "50MB", "--batch-size", "32", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    start = result.stdout.index("{")
    data = json.loads(result.stdout[start:])
    plan = autofit.Plan.from_json(json.dumps(data))
    assert plan.batch_size == 32 and plan.budget_bytes == 50_000_000
    assert isinstance(data["peak_bytes"], int) and plan.peak_bytes == data["peak_bytes"] <= 50_000_000
    assert plan.to_json() == autofit.Plan.from_json(plan.to_json()).to_json()


@pytest.mark.sim
@pytest.mark.parametrize("name,key", [("hf", "training_arguments"), ("deepspeed", "train_micro_batch_size_per_gpu"),
                                      ("lightning", "trainer")])
def test_exports_are_plain_dicts(name, key):
    result = _plan(FACTORY, "--budget", "50MB", "--batch-size", "32", "--device", "cpu", "--json", "--export", name)
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout[result.stdout.index("{"):])
    exported = json.loads(result.stderr[result.stderr.index("{"):])
    assert key in exported
    if name == "deepspeed":
        assert exported["train_batch_size"] == plan["micro_batch_size"] * plan["gradient_accumulation_steps"]


@pytest.mark.parametrize("budget", ["8 gigs", "-1GB", "", "12XB"])
def test_bad_budget_exits_2_without_traceback(budget):
    result = runner.invoke(app, ["plan", FACTORY, "--budget", budget, "--batch-size", "32", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "budget" in result.output.lower()
    assert len([line for line in result.output.splitlines() if line.strip()]) <= 3  # one clear message


@pytest.mark.sim
def test_budget_below_the_floor_exits_3_naming_the_minimum():
    result = runner.invoke(app, ["plan", FACTORY, "--budget", "100KB", "--batch-size", "32", "--device", "cpu"])
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    assert "Smallest budget that works" in result.output
    minimum = int(result.output.split("Smallest budget that works:")[1].split("(")[1].split(" bytes")[0])
    assert minimum > 100_000
    # and that minimum does plan
    ok = runner.invoke(app, ["plan", FACTORY, "--budget", f"{minimum}B", "--batch-size", "32", "--device", "cpu"])
    assert ok.exit_code == 0, ok.output


def test_unknown_model_spec_exits_2():
    result = runner.invoke(app, ["plan", "no_such_module_xyz:factory", "--budget", "1GB", "--batch-size", "4"])
    assert result.exit_code == 2 and "Traceback" not in result.output and "no_such_module_xyz" in result.output


@pytest.mark.sim
def test_module_only_factory_needs_an_input_shape():
    spec = f"{ROOT / 'examples' / 'factories.py'}:mlp"
    result = runner.invoke(app, ["plan", spec, "--budget", "10MB", "--batch-size", "8", "--device", "cpu"])
    assert result.exit_code == 2 and "--input-shape" in result.output
    result = runner.invoke(app, ["plan", spec, "--budget", "10MB", "--batch-size", "8", "--device", "cpu",
                                 "--input-shape", "128"])
    assert result.exit_code == 0, result.output


@pytest.mark.sim
def test_world_size_and_strategy_options():
    result = _plan(FACTORY, "--budget", "50MB", "--batch-size", "32", "--device", "cpu", "--world-size", "2",
                   "--strategy", "ddp", "--json")
    assert result.exit_code == 0, result.output
    plan = autofit.Plan.from_json(result.stdout[result.stdout.index("{"):])
    layout = plan.parallel
    rows = plan.micro_batch_size * plan.gradient_accumulation_steps
    assert (layout.world_size, layout.strategy, rows) == (2, "ddp", 16)


@pytest.mark.sim
def test_cuda_plan_for_a_named_gpu_with_a_percentage_budget():
    result = _plan(FACTORY, "--budget", "90%", "--batch-size", "32", "--device", "cuda", "--gpu", "T4", "--json")
    assert result.exit_code == 0, result.output
    plan = autofit.Plan.from_json(result.stdout[result.stdout.index("{"):])
    assert plan.gpu == "T4" and plan.precision.name == "fp16"  # T4 has no bf16
    assert plan.budget_bytes == int(0.9 * 16 * 2**30) and plan.device_bytes <= plan.budget_bytes


@pytest.mark.sim
def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    result = _plan(FACTORY, "--budget", "50MB", "--batch-size", "32", "--device", "cpu", "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.sim  # plans resnet18: simulated steps (skipped, so unnoticed in the quick tier, without torchvision)
def test_torchvision_spec():
    pytest.importorskip("torchvision")
    result = _plan("torchvision:resnet18", "--budget", "16GB", "--batch-size", "8", "--input-shape", "3,64,64",
                   "--device", "cuda", "--gpu", "T4", "--json")
    assert result.exit_code == 0, result.output


@pytest.mark.sim
def test_hf_spec_builds_from_a_config_without_downloading():
    pytest.importorskip("transformers")
    result = _plan("hf:gpt2", "--config", "n_layer=1", "--config", "n_embd=32", "--config", "n_head=2",
                   "--config", "vocab_size=100", "--input-shape", "16", "--budget", "1GB", "--batch-size", "4",
                   "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    plan = autofit.Plan.from_json(result.stdout[result.stdout.index("{"):])
    assert plan.batch_size == 4


def test_spec_helpers():
    assert parse_shape("3,224,224") == (3, 224, 224) == parse_shape("3x224x224")
    assert parse_overrides(["n_layer=2", "name=tiny", "flag=true"]) == {"n_layer": 2, "name": "tiny", "flag": True}
    with pytest.raises(InvalidInputError, match="key=value"):
        parse_overrides(["oops"])
    with pytest.raises(InvalidInputError, match="positive"):
        parse_shape("3,0")
    with pytest.raises(InvalidInputError, match="MODEL"):
        load_spec("just-a-name")


@pytest.mark.slow
def test_variable_length_table_for_a_causal_lm_under_a_tight_budget():
    """The rows-per-micro-batch table at 1/8, 1/4, 1/2 and the full length (Note [rows by length]); its figures are
    the plan's own (the library's table is checked against the allocator in tests/test_variable_length.py)."""
    pytest.importorskip("transformers")
    spec = ["hf:gpt2", "--config", "n_layer=1", "--config", "n_embd=32", "--config", "n_head=2",
            "--config", "vocab_size=100", "--input-shape", "64", "--batch-size", "16", "--device", "cpu",
            "--precision", "fp32", "--variable-length"]
    loose = _plan(*spec, "--budget", "1GB", "--json")
    assert loose.exit_code == 0, loose.output
    full = autofit.Plan.from_json(loose.stdout[loose.stdout.index("{"):])
    assert full.micro_batch_size == 16 and full.rows_by_length == ()  # one micro-batch: nothing to tabulate
    tight = _plan(*spec, "--budget", f"{full.device_bytes // 4}B", "--json")
    assert tight.exit_code == 0, tight.output
    plan = autofit.Plan.from_json(tight.stdout[tight.stdout.index("{"):])
    assert plan.micro_batch_size < 16 and [n for n, _ in plan.rows_by_length] == [64, 32, 16, 8]
    shown = _plan(*spec, "--budget", f"{full.device_bytes // 4}B")
    assert "rows per micro-batch by length" in shown.stdout
    for length, rows in plan.rows_by_length:
        assert any(line.split()[:1] == [str(length)] and str(rows) in line.split() for line in
                   shown.stdout.replace("│", " ").splitlines()), (length, rows, shown.stdout)


@pytest.mark.sim
def test_progress_shows_the_planners_stages_only_on_long_plans():
    """The planner reports each stage (autofit/core/progress.py); the CLI's display starts after SHOW_AFTER_SECONDS."""
    import io
    import time

    from rich.console import Console

    from autofit.cli.progress import planning_progress
    from autofit.cli.specs import load_spec

    spec = load_spec(FACTORY)
    kw = dict(batch_size=32, target=spec.target, device="cpu", precision="fp32")
    # a budget the fastest configuration misses: the planner analyses, then simulates its winner in full
    full = autofit.estimate(spec.model, spec.sample, step=32, target=spec.target, precision="fp32")
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with planning_progress(console, delay=0.0) as stages:
        time.sleep(0.05)  # let the timer start the display
        autofit.plan(spec.model, spec.sample, full.peak_bytes // 2, **kw)
    whats = [s.what for s in stages]
    assert whats[0].startswith("simulating micro-batch 32 x 1 (fp32)")  # the quick path's check comes first
    assert any(w.startswith("analysing fp32") for w in whats), whats
    # the winner's verification ends it, or, for an uneven winner, the verification of its even split for the
    # exports (Note [even split])
    verifications = [w for w in whats if w.startswith("simulating") and "in full" in w]
    assert len(verifications) >= 2 and whats.index(verifications[-1]) >= len(whats) - 2, whats
    assert whats[-1] == verifications[-1] or whats[-1].startswith("verifying the even split"), whats
    assert "analysing fp32" in out.getvalue()  # shown on the terminal
    # a plan that is over before the delay shows nothing (a delay no plan reaches: the test must not depend on how
    # fast this machine plans, which under load can pass the default 2 s)
    quiet = io.StringIO()
    with planning_progress(Console(file=quiet, force_terminal=True), delay=3600.0) as stages:
        autofit.plan(spec.model, spec.sample, "1GB", **kw)
    assert stages and quiet.getvalue() == ""


@pytest.mark.slow
def test_nodes_and_gpus_per_node_plan_a_multi_node_layout():
    import tomllib

    result = _plan(FACTORY, "--budget", "50MB", "--batch-size", "32", "--device", "cpu", "--nodes", "2",
                   "--gpus-per-node", "2", "--strategy", "fsdp2", "--replicate", "2", "--reshard-after-forward",
                   "false", "--json", "--export", "torchtitan")
    assert result.exit_code == 0, result.output
    plan = autofit.Plan.from_json(result.stdout[result.stdout.index("{"):])
    layout = plan.parallel
    assert (layout.world_size, layout.gpus_per_node, layout.replicate, layout.reshard_after_forward) == (4, 2, 2, False)
    titan = tomllib.loads(result.stderr[result.stderr.index("[parallelism]"):])
    assert titan["parallelism"]["data_parallel_replicate_degree"] == 2
    assert titan["parallelism"]["fsdp_reshard_after_forward"] == "never"


@pytest.mark.parametrize("args,words", [
    (["--nodes", "2"], "--nodes needs --gpus-per-node"),
    (["--nodes", "2", "--gpus-per-node", "2", "--world-size", "8"], "disagrees"),
    (["--world-size", "2", "--strategy", "fsdp2", "--reshard-after-forward", "sometimes"], "--reshard-after-forward"),
])
def test_bad_layout_options_exit_2_naming_the_option(args, words):
    result = _plan(FACTORY, "--budget", "50MB", "--batch-size", "32", "--device", "cpu", *args)
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output
