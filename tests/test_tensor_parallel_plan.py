"""Tensor parallel planned (docs/multi-gpu.md, "Tensor parallel"): the layouts the planner adds, the time of its
all-reduces counted by hand, the plan's per-rank figure against the estimate, the exports and the CLI flag."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autofit
from autofit.analyse.analyse import analyse_model
from autofit.core.errors import InvalidInputError, UnsupportedModelError
from autofit.emit.export import to_deepspeed_config, to_torchtitan_config
from autofit.parallel.layout import Parallel
from autofit.parallel.collectives import ring_seconds
from autofit.parallel.tensor import tensor_group_bytes, tensor_reduce_bytes
from autofit.training.batch import as_batch
from autofit.training.step import make_step_config
from autofit.parallel.tensor_parallel import resolve_tensor_plan
from sharded_models import tiny_llama, wide_blocks

TOKENS, HIDDEN, MLP, VOCAB = 32, 64, 128, 128  # tiny_llama's shape


@pytest.mark.sim
def test_all_reduced_bytes_per_sample_counted_by_hand():
    """Per layer torch's styles all-reduce o_proj's and down_proj's outputs in forward and the input gradients of
    q, k, v, gate and up in backward: 7 tensors of 32 tokens x 64 features in fp32, 2 layers."""
    case = tiny_llama()
    plan = resolve_tensor_plan(case.model, 2)
    step = make_step_config(micro_batch_size=1,
                            layout=Parallel(strategy="fsdp2", world_size=2, tensor_parallel=2, tensor_plan=plan))
    analysis = analyse_model(case.model, as_batch(case.sample), None, None, step)
    parallel = Parallel(strategy="fsdp2", world_size=2, tensor_parallel=2, tensor_plan=plan)
    per_sample = tensor_reduce_bytes(case.model, parallel, lambda n: analysis.table.row(n).output_bytes_per_sample)
    assert per_sample == 2 * 7 * TOKENS * HIDDEN * 4
    # a ring all-reduce over 2 ranks moves 2 (2 - 1) / 2 = 1 buffer per rank (nccl-tests PERFORMANCE.md)
    assert ring_seconds("all_reduce", 2, per_sample, 1e9) == per_sample / 1e9
    # each rank of a group holds half of every split weight, all of the embedding, head and norms
    split = 2 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * MLP)
    whole = 2 * VOCAB * HIDDEN + 5 * HIDDEN
    assert tensor_group_bytes(case.model, parallel) == 4 * (split // 2 + whole)


@pytest.mark.sim
def test_plan_with_tensor_parallel_matches_the_estimate_of_its_rank():
    """world 4 = FSDP2 over 2 x tensor parallel 2, batch 8: each rank trains 8 / 2 = 4 rows; the plan's figure is
    the estimate of exactly its configuration, and the trainer gets the layout."""
    case = tiny_llama("meta")
    plan = autofit.plan(case.model, case.sample, "1GB", batch_size=8, device="cpu", precision="fp32",
                        layout=autofit.Layout(world_size=4, strategy="fsdp2", reshard_after_forward=True,
                                              tensor_parallel=2))
    assert (plan.parallel.tensor_parallel, plan.layout) == (2, "fsdp2 (ZeRO-3) x tp 2")
    assert plan.micro_batch_size * plan.gradient_accumulation_steps == 4
    assert dict(plan.parallel.tensor_plan) == dict(resolve_tensor_plan(case.model, 2))
    est = autofit.estimate(case.model, case.sample,
                           precision=plan.precision,
                           layout=autofit.Layout(world_size=4, strategy="fsdp2", tensor_parallel=2),
                           step=autofit.Step(micro_batch_size=plan.micro_batch_size,
                                             accumulation_steps=plan.gradient_accumulation_steps,
                                             checkpoint=plan.checkpoint))
    assert est.peak_bytes == plan.peak_bytes
    again = autofit.Plan.from_json(plan.to_json())
    assert again.parallel.tensor_plan == plan.parallel.tensor_plan and again.parallel.tensor_parallel == 2


def test_explicit_tensor_parallel_is_refused_where_it_cannot_run():
    blocks = wide_blocks("meta")
    with pytest.raises(UnsupportedModelError, match="carries none"):
        autofit.plan(blocks.model, blocks.sample, "1GB", batch_size=8, target=blocks.target, loss_fn=blocks.loss_fn,
                     device="cpu", layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2))
    case = tiny_llama("meta")
    with pytest.raises(InvalidInputError, match="does not divide the 2 GPUs of a node"):
        autofit.plan(case.model, case.sample, "1GB", batch_size=8, device="cpu",
                     layout=autofit.Layout(world_size=8, gpus_per_node=2, strategy="fsdp2", tensor_parallel=4))
    with pytest.raises(InvalidInputError, match="strategy='fsdp2'"):
        autofit.plan(case.model, case.sample, "1GB", batch_size=8, device="cpu",
                     layout=autofit.Layout(world_size=2, strategy="ddp", tensor_parallel=2))


@pytest.mark.sim
def test_exports_name_the_tensor_parallel_degree():
    """torchtitan's [parallelism] takes tensor_parallel_degree, the shard degree is the other dim, and the global
    batch counts data-parallel ranks only; DeepSpeed's config has no training tensor parallelism: a note says so."""
    case = tiny_llama("meta")
    plan = autofit.plan(case.model, case.sample, "1GB", batch_size=8, device="cpu", precision="fp32",
                        layout=autofit.Layout(world_size=2, strategy="fsdp2"))
    plan = replace(plan, parallel=replace(plan.parallel, world_size=4, tensor_parallel=2,
                                         tensor_plan=resolve_tensor_plan(case.model, 2)))
    titan = to_torchtitan_config(plan)
    assert titan["parallelism"]["tensor_parallel_degree"] == 2
    assert titan["parallelism"]["data_parallel_shard_degree"] == 2
    assert titan["training"]["global_batch_size"] == 8
    deepspeed = to_deepspeed_config(plan)
    assert deepspeed["train_batch_size"] == 8
    assert any("tensor parallel 2 is not exported" in n for n in deepspeed["autofit_notes"])


@pytest.mark.sim
def test_the_cli_takes_tensor_parallel():
    from typer.testing import CliRunner

    from autofit.cli.app import app

    config = [f"--config={k}={v}" for k, v in (("vocab_size", VOCAB), ("hidden_size", HIDDEN),
                                               ("intermediate_size", MLP), ("num_hidden_layers", 2),
                                               ("num_attention_heads", 4), ("num_key_value_heads", 4))]
    result = CliRunner().invoke(app, ["plan", "hf:llama", *config, "--budget", "1GB", "--batch-size", "8",
                                      "--input-shape", str(TOKENS), "--device", "cpu", "--precision", "fp32",
                                      "--world-size", "2", "--strategy", "fsdp2", "--tensor-parallel", "2", "--json"])
    assert result.exit_code == 0, result.output
    plan = autofit.Plan.from_json(result.stdout)
    assert (plan.parallel.tensor_parallel, plan.layout) == (2, "tp 2")


@pytest.mark.sim
def test_clipping_leaves_tensor_parallel_out():
    """clip_grad_norm_ cannot combine the split and whole parameters' DTensors (different meshes): an explicit T
    is refused naming it; with "auto" the planner plans the other layouts only."""
    case = tiny_llama("meta")
    with pytest.raises(InvalidInputError, match="clip_grad_norm with tensor_parallel"):
        autofit.plan(case.model, case.sample, "1GB", batch_size=8, device="cpu",
                     layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2), clip_grad_norm=1.0)
    plan = autofit.plan(case.model, case.sample, "1GB", batch_size=8, device="cpu", precision="fp32",
                        layout=autofit.Layout(world_size=2, strategy="fsdp2", reshard_after_forward=True,
                                              tensor_parallel="auto"),
                        clip_grad_norm=1.0)
    assert plan.parallel.tensor_parallel == 1


@pytest.mark.sim
def test_a_user_plan_is_planned_for_a_model_without_one():
    """WideBlocks' MLPs split by the user's mapping: the plan carries the resolved pairs and its figure is the
    estimate of its rank with the same mapping."""
    case = wide_blocks("meta")
    mapping = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    plan = autofit.plan(case.model, case.sample, "1GB", batch_size=8, target=case.target, loss_fn=case.loss_fn,
                        device="cpu", precision="fp32",
                        layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2,
                                              tensor_parallel_plan=mapping),
                        savers=autofit.Savers(checkpoint=None))
    assert plan.layout == "tp 2" and len(plan.parallel.tensor_plan) == 8
    # the group's two ranks share all 8 rows, one micro-batch of them (1 GB is generous)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (8, 1)
    est = autofit.estimate(case.model, case.sample, target=case.target, loss_fn=case.loss_fn,
                           layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2,
                                                 tensor_parallel_plan=mapping),
                           step=autofit.Step(micro_batch_size=plan.micro_batch_size,
                                             accumulation_steps=plan.gradient_accumulation_steps))
    assert est.peak_bytes == plan.peak_bytes
