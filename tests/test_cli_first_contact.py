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


# --- 2. a size says its unit ---------------------------------------------------------------------------------------

NEVER_BUILT = "tests_never_imported_module:factory"  # importing it would fail: a refusal before the model is built


@pytest.mark.parametrize(("flags", "meant"), [
    (["--budget", "16"], ["--budget 16 has no unit", "16GB (16x10^9 bytes)", "16GiB"]),
    (["--budget", "565000000"], ["'565000000B'"]),
    (["--budget", "8GB", "--gpu-memory", "12"], ["--gpu-memory 12 has no unit", "12GiB"]),
    (["--budget", "8GB", "--host-budget", "64"], ["--host-budget 64 has no unit", "64GB"]),
    (["--budget", "8GB", "--margin", "512"], ["--margin 512 has no unit", "512GB"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v[0].startswith("-") else None)
def test_a_size_without_a_unit_is_refused_before_the_model_is_built(flags, meant):
    result = runner.invoke(app, ["plan", NEVER_BUILT, *flags, "--batch-size", "8", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "cannot import" not in result.output and "Traceback" not in result.output, result.output
    assert all(m in result.output for m in meant), result.output


def test_verify_refuses_a_budget_without_a_unit_too():
    result = runner.invoke(app, ["verify", NEVER_BUILT, "--budget", "16", "--batch-size", "8"])
    assert result.exit_code == 2 and "16GiB" in result.output, result.output


def test_a_unitless_budget_is_refused_in_a_second_not_after_a_plan():
    """The issue's command: an hf: checkpoint and --budget 16 once ran a plan for 16 bytes (117 s) before failing."""
    run = _autofit("plan", "hf:Qwen/Qwen2.5-0.5B", "--budget", "16", "--batch-size", "8")
    assert run.returncode == 2 and "did you mean 16GB" in run.stdout + run.stderr, run.stdout + run.stderr
    assert "tracing" not in run.stdout + run.stderr


def test_bytes_with_their_unit_are_read_as_bytes():
    from autofit.cli.sizes import check_sizes
    from autofit.core.units import parse_budget

    check_sizes(budget="565000000B", margin="0", host_budget="64GiB", gpu_memory="12GiB")
    assert parse_budget("565000000B") == 565_000_000 and parse_budget(565_000_000) == 565_000_000


# --- 3. GB and GiB, one reading across the flags -------------------------------------------------------------------

def test_gb_is_ten_to_the_nine_on_every_size_flag():
    """--gpu-memory once read 12GB as GiB while --budget read it as 10^9: one command, two sizes."""
    from autofit.cli.flags import gpu_option
    from autofit.cuda.catalog import gpu_spec
    from autofit.validate import margin_for, resolve_host_budget
    from autofit.device import resolve_device

    assert gpu_spec(gpu_option(None, "12GB")).memory_bytes == 12 * 10**9
    assert gpu_spec(gpu_option("RTX-4070", "12GiB")).memory_bytes == 12 * 2**30
    target = resolve_device("cuda", "A100-80GB")
    assert resolve_host_budget("64GB", target)[0] == 64 * 10**9
    assert resolve_host_budget("64GiB", target)[0] == 64 * 2**30
    assert margin_for("512MB", 8 * 10**9, target, 1) == 512 * 10**6
    assert margin_for("512MiB", 8 * 10**9, target, 1) == 512 * 2**20


@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_the_help_says_what_gb_and_gib_mean(command):
    text = " ".join(runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output.split())
    assert "12GB is 12x10^9 bytes" in text, text
    top = " ".join(runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).output.split())
    assert "GB = 10^9 bytes, GiB = 2^30" in top


# --- 5. warnings on stderr, a closed pipe ends quietly -------------------------------------------------------------

WARNS = '''
import warnings

def noisy():
    warnings.warn("a third-party library has something to say", FutureWarning)
    raise ValueError("and then the factory fails")
'''


def test_a_warning_goes_to_stderr_never_stdout(tmp_path):
    (tmp_path / "noisy.py").write_text(WARNS)
    run = _autofit("plan", f"{tmp_path / 'noisy.py'}:noisy", "--budget", "1GB", "--batch-size", "2", "--device", "cpu")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "warning: a third-party library has something to say" in run.stderr, run.stderr
    assert "third-party" not in run.stdout and run.stdout.startswith("error: building MODEL"), run.stdout


def _into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    """The command with stdout a pipe whose reader is gone before it starts (head that has its line): every write
    fails, however fast or slow the command is."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "autofit", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, env=_env(), timeout=300)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [["--help"], [], ["plan", "-h"],
                                  ["plan", NEVER_BUILT, "--budget", "16", "--batch-size", "2"]], ids=" ".join)
def test_a_closed_pipe_exits_141_quietly(args):
    from autofit.cli.pipes import EXIT_PIPE

    run = _into_a_closed_pipe(*args)
    assert run.returncode == EXIT_PIPE == 141, run.stderr
    assert run.stderr == "", run.stderr  # no traceback, no "Exception ignored"


@pytest.mark.sim  # a small plan
@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["table", "json"])
def test_a_plan_piped_to_a_closed_reader_exits_141_quietly(json_flag):
    run = _into_a_closed_pipe("plan", "examples/factories.py:small_cnn", "--budget", "50MB", "--batch-size", "32",
                              "--device", "cpu", "--quiet", *json_flag)
    assert run.returncode == 141 and "Traceback" not in run.stderr and "Exception" not in run.stderr, run.stderr


@pytest.mark.sim  # transformers imported, each checkpoint's parameters counted: seconds
@pytest.mark.parametrize("args", [["models"], ["models", "qwen2.5-0.5b"]], ids=" ".join)
def test_the_models_list_into_a_closed_pipe_exits_141_quietly(args):
    run = _into_a_closed_pipe(*args)
    assert run.returncode == 141 and run.stderr == "", run.stderr


@pytest.mark.sim  # transformers imported: over the quick tier's 5 CPU seconds
def test_models_piped_to_head_as_a_user_types_it():
    """The shell's own pipe; the list may fit the pipe's buffer before head closes it (then 0)."""
    shell = subprocess.run(["bash", "-o", "pipefail", "-c", f"{sys.executable} -m autofit models qwen2.5-0.5b | "
                            "head -1; echo; echo status=$?"
                            "echo; echo status=$?"], capture_output=True, text=True, env=_env(), timeout=120)
    assert shell.stdout.splitlines()[-1] in ("status=0", "status=141"), shell.stdout  # 0: it all fit the pipe
    assert "Traceback" not in shell.stderr and "Exception" not in shell.stderr, shell.stderr


# --- 6. exports written as the files their frameworks read ---------------------------------------------------------

def _load(name: str, path: Path):
    """Each file through its framework's own reader (the truth: what that framework will train with)."""
    if name == "hf":
        transformers = pytest.importorskip("transformers")
        (args,) = transformers.HfArgumentParser(transformers.TrainingArguments).parse_json_file(str(path))
        return args
    if name == "accelerate":
        pytest.importorskip("accelerate")
        from accelerate.commands.config.config_args import load_config_from_file

        return load_config_from_file(str(path))
    if name == "deepspeed":
        import json

        return json.loads(path.read_text())
    if name == "torchtitan":
        import tomllib

        return tomllib.loads(path.read_text())
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(path.read_text())


def _transformers_warnings() -> list[str]:
    """The lines transformers' own logger writes from now on (it does not propagate to the root logger)."""
    import logging

    transformers = pytest.importorskip("transformers")
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    transformers.logging.get_logger("transformers").addHandler(Keep(logging.WARNING))
    return lines


def _tiny_gpt2_plan(precision: str):
    """A plan that recomputes (a module forced by Savers), bf16: every knob the files must carry is set."""
    import torch

    import autofit

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                                                 n_positions=32, use_cache=False))
    ids = torch.randint(0, 100, (2, 32))
    return autofit.plan(model, {"input_ids": ids, "labels": ids}, "4GB", batch_size=8, device="cpu",
                        precision=precision, savers=autofit.Savers(checkpoint=("transformer.h.0.mlp",)))


@pytest.mark.sim  # one small plan
def test_each_export_file_loads_with_its_frameworks_reader_and_carries_the_plan(tmp_path):
    import warnings

    from autofit.emit.export import EXPORTERS, export_file

    plan = _tiny_gpt2_plan("bf16")
    micro, steps = plan.micro_batch_size, plan.gradient_accumulation_steps
    assert plan.checkpoint and plan.parallel.world_size == 1 and plan.precision.name == "bf16"
    loaded = {}
    for name, suffix in (("hf", "json"), ("deepspeed", "json"), ("accelerate", "yaml"), ("lightning", "yaml"),
                         ("torchtitan", "toml")):
        path = tmp_path / f"{name}.{suffix}"
        path.write_text(export_file(plan, name)[0])
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # a deprecated key (gradient_checkpointing, fsdp="...")
            loaded[name] = _load(name, path)
    assert set(loaded) == set(EXPORTERS)

    hf = loaded["hf"]
    assert (hf.per_device_train_batch_size, hf.gradient_accumulation_steps) == (micro, steps)
    assert hf.bf16 and not hf.fp16 and hf.activation_checkpointing is True and not hf.fsdp  # one GPU: no FSDP

    ds = loaded["deepspeed"]
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (micro, steps)
    assert ds["train_batch_size"] == micro * steps and ds["bf16"]["enabled"] and "activation_checkpointing" in ds
    assert ds["zero_optimization"]["stage"] == 0 and not any(k.startswith("autofit") for k in ds)

    acc = loaded["accelerate"]
    assert acc.mixed_precision == "bf16" and acc.num_processes == 1 and acc.distributed_type.value == "NO"
    text = (tmp_path / "accelerate.yaml").read_text()
    assert f"micro-batch {micro}" in text and f"gradient_accumulation_steps={steps}" in text
    assert "recomputes 1 modules (transformer.h.0.mlp)" in text

    lightning = loaded["lightning"]
    assert lightning["trainer"] == {"precision": "bf16-mixed", "accumulate_grad_batches": steps}
    assert lightning["data"] == {"batch_size": micro}

    titan = loaded["torchtitan"]
    assert titan["training"]["local_batch_size"] == micro and titan["training"]["global_batch_size"] == micro * steps
    assert titan["training"]["mixed_precision_param"] == "bfloat16" and titan["activation_checkpoint"]["mode"] == "full"
    assert titan["parallelism"]["data_parallel_shard_degree"] == 1


@pytest.mark.sim  # one small plan
def test_a_sharded_plan_exports_fsdp2_with_current_keys(tmp_path):
    from dataclasses import replace

    from autofit.emit.export import export_file

    tiny = _tiny_gpt2_plan("fp32")
    plan = replace(tiny, parallel=replace(tiny.parallel, world_size=2, strategy="fsdp2"), batch_size=16)
    path = tmp_path / "hf.json"
    path.write_text(export_file(plan, "hf")[0])
    logged = _transformers_warnings()
    hf = _load("hf", path)
    assert hf.fsdp in (True, "True", "true") or hf.fsdp_config.get("version") == 2, hf.fsdp
    assert hf.fsdp_config["version"] == 2 and hf.fsdp_config["reshard_after_forward"] is True
    # under FSDP the plan's recomputation is FSDP's own, as transformers asks: the Trainer's switch would add an
    # all-gather per unit in backward (training_args.py warns "prefer fsdp_config['activation_checkpointing']")
    assert hf.fsdp_config["activation_checkpointing"] is True and not hf.activation_checkpointing
    assert not [line for line in logged if "activation_checkpointing" in line], logged
    path = tmp_path / "accelerate.yaml"
    path.write_text(export_file(plan, "accelerate")[0])
    acc = _load("accelerate", path)
    assert acc.distributed_type.value == "FSDP" and acc.num_processes == 2
    assert acc.fsdp_config["fsdp_version"] == 2 and acc.fsdp_config["fsdp_activation_checkpointing"] is True


@pytest.mark.sim  # a small plan
def test_several_exports_are_all_honoured(tmp_path):
    import json
    import tomllib

    paths = {name: tmp_path / f"{name}.{suffix}" for name, suffix in (("hf", "json"), ("accelerate", "yaml"),
                                                                     ("torchtitan", "toml"))}
    args = ["plan", "examples/factories.py:small_cnn", "--budget", "50MB", "--batch-size", "32", "--device", "cpu",
            "--quiet", "--json", *[f for n, p in paths.items() for f in ("--export", f"{n}={p}")],
            "--export", "deepspeed"]
    run = _autofit(*args, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    for name, path in paths.items():
        assert f"wrote: {path} ({name})" in run.stderr
    assert json.loads(paths["hf"].read_text())["per_device_train_batch_size"] == plan["micro_batch_size"]
    assert tomllib.loads(paths["torchtitan"].read_text())["training"]["local_batch_size"] == plan["micro_batch_size"]
    printed = run.stderr[run.stderr.index("{"):]  # the one without a path, printed as before (stderr with --json)
    assert json.loads(printed)["train_micro_batch_size_per_gpu"] == plan["micro_batch_size"]


@pytest.mark.parametrize(("export", "words"), [
    ("pytorch", "must be one of hf, deepspeed"), ("hf=", "give a file after '='"),
    ("hf=/no/such/folder/args.json", "does not exist"),
])
def test_a_bad_export_is_refused_before_the_model_is_built(export, words):
    result = runner.invoke(app, ["plan", NEVER_BUILT, "--budget", "1GB", "--batch-size", "8", "--export", export])
    assert result.exit_code == 2 and words in result.output and "cannot import" not in result.output, result.output


def test_two_exports_to_one_file_are_refused(tmp_path):
    same = str(tmp_path / "out.json")
    result = runner.invoke(app, ["plan", NEVER_BUILT, "--budget", "1GB", "--batch-size", "8",
                                 "--export", f"hf={same}", "--export", f"deepspeed={same}"])
    assert result.exit_code == 2 and "already the file of another --export" in result.output, result.output


# --- 4. a mistyped hf: name is answered offline, before the Hub -----------------------------------------------------

@pytest.fixture
def hub_calls(monkeypatch):
    """The network as reachable (HF_HUB_OFFLINE=0), but every Hub request of transformers' config loader recorded and
    refused: the truth is the list of names that reached it."""
    transformers = pytest.importorskip("transformers")
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls: list[str] = []
    real = transformers.AutoConfig.from_pretrained.__func__

    def from_pretrained(cls, name, *args, **kwargs):
        if kwargs.get("local_files_only"):
            return real(cls, name, *args, **kwargs)
        calls.append(str(name))
        raise OSError(f"blocked by the test: a Hub request for {name}")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(from_pretrained))
    return calls


@pytest.mark.parametrize("typo", ["Qwen/Qwen2.5-7b-instrct", "Qwen/Qwen2.5-7B-Instrcut", "meta-llama/Llama-3.1-8b"
                                  "-Instruc"])
def test_a_near_miss_name_is_answered_from_the_offline_table_without_the_hub(hub_calls, typo):
    result = runner.invoke(app, ["plan", f"hf:{typo}", "--budget", "24GB", "--batch-size", "8"])
    assert result.exit_code == 2, result.output
    assert "closest:" in result.output and "the Hub was not asked" in result.output, result.output
    assert hub_calls == [], hub_calls


def test_an_unrelated_unknown_name_still_asks_the_hub(hub_calls):
    """The control: the block above does see Hub requests (a name no table entry is near goes there)."""
    result = runner.invoke(app, ["plan", "hf:acme-labs/never-released-13B", "--budget", "24GB", "--batch-size", "8"])
    assert result.exit_code == 2, result.output
    assert hub_calls == ["acme-labs/never-released-13B"]


def test_near_miss_keeps_other_repositories_and_other_numbers_apart():
    from autofit.cli.hf_checkpoints import CHECKPOINTS
    from autofit.cli.hf_names import near_miss

    assert near_miss("Qwen/Qwen2.5-7b-instrct", CHECKPOINTS) == "Qwen/Qwen2.5-7B-Instruct"
    for other in ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct-AWQ", "Qwen/Qwen2-7B",
                  "meta-llama/Llama-3.2-8B", "acme-labs/never-released-13B"):
        assert near_miss(other, CHECKPOINTS) is None, other


def test_estimate_refuses_a_gpu_memory_without_a_unit():
    result = runner.invoke(app, ["estimate", NEVER_BUILT, "--micro-batch-size", "2", "--gpu-memory", "12"])
    assert result.exit_code == 2 and "--gpu-memory 12 has no unit" in result.output, result.output
