"""Each layout's exports against the frameworks' own documented keys: torchtitan's JobConfig (field names copied
from torchtitan/config/job_config.py, commit 6404b93), Lightning's FSDPStrategy / ModelParallelStrategy and
Accelerate's config file and launcher, both installed here and built for real."""

from __future__ import annotations

import dataclasses
import inspect
import tomllib

import pytest

import autofit
from autofit.emit.export import to_accelerate_config, to_lightning_trainer, to_torchtitan_config, to_torchtitan_toml
from zoo import ZOO

# torchtitan/config/job_config.py (pytorch/torchtitan @ 6404b932): class Parallelism and class Training, the fields
# the export may write
TITAN_PARALLELISM = {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                     "tensor_parallel_degree", "enable_compiled_autograd", "disable_loss_parallel",
                     "pipeline_parallel_degree", "context_parallel_degree", "expert_parallel_degree"}
TITAN_TRAINING = {"local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "enable_cpu_offload",
                  "mixed_precision_param", "mixed_precision_reduce", "compile", "dataset"}
TITAN_RESHARD = {"default", "always", "never"}  # Literal of Parallelism.fsdp_reshard_after_forward


@pytest.fixture(scope="module")
def plan8():
    """An FSDP2 plan over 8 ranks (2 nodes x 4) on the CPU, its layout replaced per test."""
    case = ZOO["gpt_sdpa"]()
    return autofit.plan(case.model, case.sample, "64MB", batch_size=16, target=case.target, loss_fn=case.loss_fn,
                        device="cpu",
                        layout=autofit.Layout(world_size=8, gpus_per_node=4, strategy="fsdp2",
                                              reshard_after_forward=True, replicate=1), precision="fp32")


LAYOUTS = [(True, 1), (False, 1), (4, 1), (True, 2), (False, 2)]


@pytest.mark.parametrize("raf,replicate", LAYOUTS)
def test_torchtitan_toml_has_its_parallelism_keys(plan8, raf, replicate):
    plan = dataclasses.replace(plan8, parallel=dataclasses.replace(plan8.parallel, reshard_after_forward=raf,
                                                                   replicate=replicate))
    parsed = tomllib.loads(to_torchtitan_toml(plan))
    assert parsed == {k: v for k, v in to_torchtitan_config(plan).items() if k != "autofit"}
    par, training = parsed["parallelism"], parsed["training"]
    assert set(par) <= TITAN_PARALLELISM and set(training) <= TITAN_TRAINING
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == 8
    assert par["data_parallel_replicate_degree"] == replicate
    assert par["fsdp_reshard_after_forward"] in TITAN_RESHARD
    assert par["fsdp_reshard_after_forward"] == {True: "always", False: "never"}.get(raf, "always")
    # torchtitan: global_batch_size / (local_batch_size x data-parallel degree) accumulation steps
    assert training["global_batch_size"] == plan.batch_size == 16
    assert training["global_batch_size"] // (training["local_batch_size"] * 8) == plan.gradient_accumulation_steps
    if not isinstance(raf, bool):
        assert "not a torchtitan policy" in to_torchtitan_toml(plan)


@pytest.mark.parametrize("raf,replicate,expected", [
    (True, 1, "FULL_SHARD"), (False, 1, "SHARD_GRAD_OP"), (4, 1, "FULL_SHARD"), (True, 2, "HYBRID_SHARD"),
    (False, 2, "_HYBRID_SHARD_ZERO2")])
def test_lightning_strategies_accept_the_export(plan8, raf, replicate, expected):
    pytest.importorskip("lightning", reason="the test extras' lightning reads the export")
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    plan = dataclasses.replace(plan8, parallel=dataclasses.replace(plan8.parallel, reshard_after_forward=raf,
                                                                   replicate=replicate))
    out = to_lightning_trainer(plan)
    strategy = FSDPStrategy(**out["fsdp_strategy"])
    assert strategy.sharding_strategy.name == expected
    if replicate > 1:
        assert strategy.kwargs["device_mesh"] == (2, 4)  # (replication size, sharding size), Lightning's docstring
    parallel = ModelParallelStrategy(**out["model_parallel_strategy"])
    assert parallel._data_parallel_size == 8 and parallel._tensor_parallel_size == 1
    assert out["trainer"]["devices"] == 4 and out["trainer"]["num_nodes"] == 2
    assert any(f"reshard_after_forward={raf!r}" in n for n in out["autofit_notes"])


@pytest.mark.parametrize("raf,replicate", LAYOUTS)
def test_accelerate_reads_the_config_file(plan8, raf, replicate, monkeypatch):
    pytest.importorskip("accelerate", reason="the test extras' accelerate reads the export")
    from accelerate import Accelerator
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin

    plan = dataclasses.replace(plan8, parallel=dataclasses.replace(plan8.parallel, reshard_after_forward=raf,
                                                                   replicate=replicate))
    out = to_accelerate_config(plan)
    config = out["config_file"]
    assert set(config) <= set(ClusterConfig.__dataclass_fields__)
    launch_args = {a.dest for a in launch_command_parser()._actions}
    assert set(config["fsdp_config"]) <= launch_args
    assert set(config.get("parallelism_config", {})) <= launch_args
    assert (config["num_machines"], config["num_processes"]) == (2, 8)
    assert set(out["accelerator"]) <= set(inspect.signature(Accelerator).parameters)
    # what `accelerate launch` puts in the environment (utils/launch.py) is what the FSDP2 plugin reads back
    fsdp = config["fsdp_config"]
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", str(fsdp["fsdp_version"]))
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", str(fsdp["fsdp_reshard_after_forward"]).lower())
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is (raf if isinstance(raf, bool) else True)
    if replicate > 1:
        assert config["parallelism_config"] == {"parallelism_config_dp_replicate_size": 2,
                                                "parallelism_config_dp_shard_size": 4}
