"""Config files written back by autofit, loaded by the framework's own config loader (issue 57, "Must show").

The truth is the framework's loader, not autofit's readers: torchtune's recipe parser
(``torchtune.config._parse.TuneRecipeArgumentParser`` then ``_merge_yaml_and_cli_args``, what ``@config.parse``
hands a recipe's ``main(cfg)``), torchtitan's ``ConfigManager().parse_args(["--job.config_file", FILE])`` (the
``JobConfig`` a ``torchtitan.train`` run reads), and DeepSpeed's ``DeepSpeedConfig`` (what
``deepspeed.initialize`` validates a config with). The values the loader returns are compared with the plan's (the
knobs autofit wrote) and with the file's own keys counted by hand.

None of these packages is in a test extra (docs/configs/index.md, "the frameworks' own loaders"): torchtune 0.6.1's
package ``__init__`` imports its models, which need a torchao older than the one autofit's finetune extra installs;
torchtitan's TOML loader is in 0.2.2 only (0.3.0 replaced TOML files by Python config registries), and its package
``__init__`` imports triton; DeepSpeed installs from an sdist. The tests skip without them. To run them, install
the loaders beside the test environment, e.g.
``pip install --target DIR --no-deps torchtune==0.6.1 torchtitan==0.2.2 omegaconf tyro docstring-parser
typeguard shtab deepspeed hjson msgpack py-cpuinfo einops`` (DS_BUILD_OPS=0, --no-build-isolation for DeepSpeed)
and put DIR on PYTHONPATH.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tomllib
import types
from pathlib import Path

import pytest

from autofit.cli.configs.detect import read_config
from autofit.cli.configs.writeback import FsdpKnobs, PlanKnobs, plan_changes, write_config

HERE = Path(__file__).parent / "configs"


def _config_module(package: str, module: str):
    """``package.module`` imported; where the package's ``__init__`` fails on something the config loader does not
    use (torchtune's models on a newer torchao, torchtitan's quantization on triton), the loader's modules are
    imported without that ``__init__`` (an empty package object over the same folder). Skips without the package."""
    if package in sys.modules:  # imported already, whole or as the loader's stub
        return importlib.import_module(f"{package}.{module}")
    spec = importlib.util.find_spec(package)
    if spec is None:
        pytest.skip(f"{package} is not installed (see this file's docstring)")
    try:
        return importlib.import_module(f"{package}.{module}")
    except ImportError:
        pass
    saved = {k: v for k, v in sys.modules.items() if k == package or k.startswith(package + ".")}
    for k in saved:
        del sys.modules[k]
    stub = types.ModuleType(package)
    stub.__path__ = list(spec.submodule_search_locations)
    sys.modules[package] = stub
    try:
        return importlib.import_module(f"{package}.{module}")
    except ImportError as e:
        pytest.skip(f"{package}.{module} does not import here: {e}")


def _torchtune_load(path: Path):
    """The ``DictConfig`` ``tune run RECIPE --config path`` hands the recipe's main (torchtune/config/_parse.py)."""
    pytest.importorskip("omegaconf")
    parse = _config_module("torchtune", "config._parse")
    utils = _config_module("torchtune", "config._utils")
    parser = parse.TuneRecipeArgumentParser()
    yaml_args, cli_args = parser.parse_known_args(["--config", str(path)])
    return utils._merge_yaml_and_cli_args(yaml_args, cli_args)


def _torchtitan_load(path: Path):
    """The ``JobConfig`` ``torchtitan.train --job.config_file path`` runs with (torchtitan/config/manager.py)."""
    pytest.importorskip("tyro")
    manager = _config_module("torchtitan", "config.manager")
    if not hasattr(manager.ConfigManager, "_maybe_load_toml"):
        pytest.skip("this torchtitan reads no TOML job files (0.3.0 and later: Python config registries); "
                    "install torchtitan==0.2.2")
    return manager.ConfigManager().parse_args(["--job.config_file", str(path)])


# a plan's knobs by hand: the config's effective batch as 1 row x (micro x accumulation), recomputation flipped,
# 8-bit AdamW, the states on the host
def _knobs(c, **kw):
    total = c.micro_batch_size * c.accumulation_steps
    return PlanKnobs(micro_batch_size=1, accumulation_steps=total, data_ranks=c.data_ranks, precision=c.precision,
                     stored=None, checkpointing=c.checkpointing == "none", eight_bit_optimizer=True, **kw)


@pytest.mark.parametrize("name", ["torchtune_full.yaml", "torchtune_qlora_8b.yaml"])
def test_torchtune_loader_reads_the_written_knobs(tmp_path, name):
    c = read_config(HERE / name)
    out = write_config(c.path, plan_changes(c, _knobs(c)), tmp_path / name)
    cfg = _torchtune_load(out)
    original = _torchtune_load(HERE / name)
    # the fixtures by hand: torchtune_full 2 x 8, no recomputation; torchtune_qlora_8b 2 x 8, recomputation on
    assert (original.batch_size, original.gradient_accumulation_steps) == (2, 8)
    assert (cfg.batch_size, cfg.gradient_accumulation_steps) == (1, 16)
    assert cfg.enable_activation_checkpointing is (name == "torchtune_full.yaml")
    assert cfg.optimizer._component_ == "bitsandbytes.optim.AdamW8bit"
    # every other key as the file had it, interpolations included (output_dir: ${output_dir})
    assert cfg.checkpointer.output_dir == original.checkpointer.output_dir
    assert cfg.model == original.model and cfg.dtype == original.dtype == "bf16"


@pytest.mark.parametrize("name", ["torchtitan_full.toml", "torchtitan_8b.toml"])
def test_torchtitan_loader_reads_the_written_knobs(tmp_path, name):
    c = read_config(HERE / name)
    knobs = _knobs(c, fsdp=FsdpKnobs(reshard_after_forward=False, offload=True))
    out = write_config(c.path, plan_changes(c, knobs), tmp_path / name)
    job = _torchtitan_load(out)
    # by hand: torchtitan_full 4 x 8 on one rank (global 32), torchtitan_8b 1 x 8 on 8 ranks (global 64)
    ranks, total = (1, 32) if name == "torchtitan_full.toml" else (8, 64)
    assert job.training.local_batch_size == 1
    assert job.training.global_batch_size == total  # the effective batch unchanged
    # torchtitan's accumulation: global / (local x data ranks) (torchtitan/train.py)
    shard = job.parallelism.data_parallel_shard_degree
    assert job.training.global_batch_size // (job.training.local_batch_size * (ranks if shard < 0 else shard)) == \
        knobs.accumulation_steps == total // ranks
    assert job.activation_checkpoint.mode == "none"  # the fixtures recompute (selective); the knobs turn it off
    assert job.training.enable_cpu_offload is True
    assert job.parallelism.fsdp_reshard_after_forward == "never"
    assert job.model.hf_assets_path == tomllib.loads((HERE / name).read_text())["model"]["hf_assets_path"]


def test_torchtitan_loader_keeps_a_minus_one_global_batch(tmp_path):
    """A file without a global batch (-1: local x data ranks, no accumulation) states one when the plan accumulates."""
    path = tmp_path / "t.toml"
    text = (HERE / "torchtitan_full.toml").read_text()
    path.write_text(text.replace("global_batch_size = 32", "global_batch_size = -1"))
    c = read_config(path)
    assert (c.micro_batch_size, c.accumulation_steps) == (4, 1)
    knobs = PlanKnobs(micro_batch_size=1, accumulation_steps=4, data_ranks=1, precision="bf16", stored=None,
                      checkpointing=True, selective=True)
    job = _torchtitan_load(write_config(path, plan_changes(c, knobs), tmp_path / "out.toml"))
    assert (job.training.local_batch_size, job.training.global_batch_size) == (1, 4)


@pytest.mark.sim
@pytest.mark.slow
@pytest.mark.parametrize("name", ["torchtune_full.yaml", "torchtitan_full.toml"])
def test_planned_config_loads_with_the_frameworks_loader(tmp_path, name):
    """``autofit.plan_config`` of the fixture (its model swapped for tests/configs/tiny-llama), written back: the
    framework's loader returns the plan's split and recomputation."""
    import autofit
    from test_configs import tiny

    load = _torchtune_load if name.startswith("torchtune") else _torchtitan_load
    load(HERE / name)  # skips before planning where the loader is not installed
    source = tiny(tmp_path, name)
    out = tmp_path / f"planned{source.suffix}"
    result = autofit.plan_config(source, "700MiB", gpu="RTX-4090", write=out)
    micro, steps = result.plan.even_split or (result.plan.micro_batch_size, result.plan.gradient_accumulation_steps)
    recomputes = bool(result.plan.checkpoint)
    if name.startswith("torchtune"):
        cfg = load(out)
        assert (cfg.batch_size, cfg.gradient_accumulation_steps) == (micro, steps)
        assert cfg.enable_activation_checkpointing is recomputes
        assert cfg.batch_size * cfg.gradient_accumulation_steps == 16  # the fixture's 2 x 8
    else:
        job = load(out)
        assert job.training.local_batch_size == micro
        assert job.training.global_batch_size == micro * steps == 32  # the fixture's global batch
        assert (job.activation_checkpoint.mode != "none") is recomputes


# ---- a one-GPU plan with its states on the host: the exports as the frameworks read them ----------------------------
@pytest.fixture(scope="module")
def one_gpu_offload_plan():
    """A plan for one T4 that fits only with the parameters, gradients and optimizer state on the host (as in
    tests/test_offload.py): FSDP2 on one process with CPUOffloadPolicy."""
    import torch
    from torch import nn

    import autofit

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)], nn.Linear(256, 10))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    kw = dict(target=y, precision="fp32")
    budgets = []
    for offload in (False, "auto"):
        with pytest.raises(autofit.InfeasibleBudgetError) as info:
            autofit.plan(model, x, 1, device="T4", savers=autofit.Savers(checkpoint="auto", offload=offload), **kw)
        budgets.append(info.value.min_budget_bytes)
    plan = autofit.plan(model, x, sum(budgets) // 2, device=autofit.Device(gpu="T4", host_budget="1GB"),
                        savers=autofit.Savers(checkpoint="auto"), **kw)
    assert plan.parallel.offload_states and plan.parallel.world_size == 1 and plan.parallel.strategy == "fsdp2"
    return plan


def _split(plan):
    return plan.even_split or (plan.micro_batch_size, plan.gradient_accumulation_steps)


@pytest.mark.sim
def test_one_gpu_offload_plan_exports_deepspeed_zero3_offload_for_one_gpu(one_gpu_offload_plan):
    """DeepSpeed's one-GPU form of states on the host: ZeRO-3 with parameters and optimizer offloaded to the CPU,
    a batch for one rank. DeepSpeedConfig (what deepspeed.initialize validates with; world size 1 without a process
    group) reads it."""
    config_module = pytest.importorskip("deepspeed.runtime.config")
    from autofit.emit.export import to_deepspeed_config

    plan = one_gpu_offload_plan
    exported = {k: v for k, v in to_deepspeed_config(plan).items() if not k.startswith("autofit_")}
    ds = config_module.DeepSpeedConfig(exported)
    micro, steps = _split(plan)
    assert ds.world_size == 1
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (
        plan.batch_size, micro, steps)
    assert ds.zero_optimization_stage == 3
    assert (ds.zero_config.offload_param.device, ds.zero_config.offload_optimizer.device) == ("cpu", "cpu")


@pytest.mark.sim
def test_one_gpu_offload_plan_exports_one_process_fsdp_accelerate_reads(one_gpu_offload_plan, tmp_path, monkeypatch):
    """Accelerate's config file for one process, FSDP2 with its parameters offloaded (``accelerate launch`` starts
    FSDP under torchrun for one process too: commands/launch.py, use_fsdp -> multi_gpu_launcher), read back by
    Accelerate's own loader and FSDP plugin."""
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import FullyShardedDataParallelPlugin

    from autofit.emit.export import export_file, to_hf_training_arguments

    text, _ = export_file(one_gpu_offload_plan, "accelerate")
    (tmp_path / "accelerate.yaml").write_text(text)
    config = load_config_from_file(str(tmp_path / "accelerate.yaml"))
    assert (config.num_processes, config.num_machines, config.distributed_type.value) == (1, 1, "FSDP")
    assert config.fsdp_config["fsdp_offload_params"] is True
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    plugin = FullyShardedDataParallelPlugin()
    assert type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"  # FSDP2's: parameters, gradients, optimizer
    hf = to_hf_training_arguments(one_gpu_offload_plan)
    assert hf["training_arguments"]["fsdp_config"]["cpu_offload"] is True
    assert any("--nproc_per_node 1" in n for n in hf["autofit_notes"])  # plain python would run without FSDP
