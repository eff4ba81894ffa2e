"""Tensor parallel (Note [tensor parallel plan], autofit/parallel/tensor_parallel.py), alone and under FSDP2, on a tiny
Llama built from its config. The truth: the CPU allocator's record on every rank of a gloo job (tests/dist_workers.py)
for the per-rank estimate, one single-process full-batch step for the parameters after a step, and hand counts of the
split parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autofit
from autofit.core.errors import InvalidInputError, UnsupportedModelError
from autofit.emit.plan import Plan
from autofit.parallel.layout import Parallel
from autofit.parallel.choices import shard_units
from autofit.training.precision import as_policy
from autofit.parallel.tensor_parallel import resolve_tensor_plan
from sharded_models import tiny_llama

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

ROWS = 4  # rows per micro-batch, per tensor-parallel group


def _plan(world: int, tp: int, batch_size: int) -> Plan:
    """A plan of the layout, made by hand around the estimate (the estimate is what is under test)."""
    case = tiny_llama()
    est = autofit.estimate(case.model, case.sample, step=ROWS,
                           layout=autofit.Layout(world_size=world, strategy="fsdp2", tensor_parallel=tp))
    return Plan(micro_batch_size=ROWS, gradient_accumulation_steps=batch_size // (ROWS * (world // tp)),
                batch_size=batch_size, last_micro_batch_size=ROWS, precision=as_policy("fp32"), checkpoint=(),
                peak_bytes=est.peak_bytes, device_bytes=est.device_bytes, budget_bytes=2**30, device="cpu",
                optimizer="adamw", predicted_step_seconds=0.0, estimate=est,
                parallel=Parallel(world_size=world, strategy="fsdp2", shard_units=shard_units(case.model),
                                  tensor_parallel=tp, tensor_plan=resolve_tensor_plan(case.model, tp)))


def _run(jobs: list[dict], tmp_path: Path, world: int) -> list[list[dict]]:
    import dist_workers

    return dist_workers.launch(jobs, tmp_path, world)


def test_the_plan_comes_from_the_model_config():
    """Llama's ``base_model_tp_plan``: q, k, v, gate and up split by columns, o and down by rows, in every layer;
    the embedding, the norms and the head are left whole."""
    case = tiny_llama("meta")
    plan = dict(resolve_tensor_plan(case.model, 2))
    assert len(plan) == 2 * 7
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.0.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert "lm_head" not in plan and "model.embed_tokens" not in plan


@pytest.mark.sim
def test_parameters_per_rank_are_the_split_counted_by_hand():
    """hidden 64, MLP 128, vocab 128, 2 layers, fp32: each layer's 4 attention (64 x 64) and 3 MLP (64 x 128)
    weights are split T ways; embedding and head (128 x 64 each) and 5 norms (64) are whole; FSDP2 then shards
    everything over world / T."""
    case = tiny_llama("meta")
    split = 2 * (4 * 64 * 64 + 3 * 64 * 128)
    whole = 2 * 128 * 64 + 5 * 64
    for world, tp in [(2, 2), (4, 4), (4, 2)]:
        est = autofit.estimate(case.model, case.sample, step=ROWS,
                               layout=autofit.Layout(world_size=world, strategy="fsdp2", tensor_parallel=tp))
        assert est.breakdown["parameters"] == 4 * (split // tp + whole) // (world // tp), (world, tp)


@pytest.mark.sim
def test_the_summary_counts_the_rows_each_process_trains():
    """4 ranks, tensor parallel 2, batch 16: the two ranks of a group share their rows, so each process trains 16 / (4
    / 2) = 8 of them (ROWS x accumulation 2), not 16 / 4 = 4 (what the summary said before ``Parallel.data_ranks``)."""
    plan = _plan(4, 2, 16)
    assert plan.parallel.data_ranks == 2 and ROWS * plan.gradient_accumulation_steps == 8
    row = next(line for line in str(plan).splitlines() if "world size" in line)
    assert "4 processes" in row and "8 samples each" in row, row


def test_what_cannot_be_split_is_refused():
    case = tiny_llama("meta", heads=4, kv_heads=2)
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads = 2 is not divisible by tensor_parallel=4"):
        autofit.estimate(case.model, case.sample, step=ROWS,
                         layout=autofit.Layout(world_size=4, strategy="fsdp2", tensor_parallel=4))
    from sharded_models import wide_blocks

    blocks = wide_blocks("meta")
    with pytest.raises(UnsupportedModelError, match="carries none"):
        autofit.estimate(blocks.model, blocks.sample, target=blocks.target, loss_fn=blocks.loss_fn,
                         step=2, layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2))
    with pytest.raises(InvalidInputError, match="match no module"):
        autofit.estimate(blocks.model, blocks.sample, target=blocks.target, loss_fn=blocks.loss_fn,
                         step=2,
                         layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2,
                                               tensor_parallel_plan={"blocks.*.upp": "colwise"}))
    with pytest.raises(InvalidInputError, match="does not divide world_size"):
        autofit.estimate(case.model, case.sample, step=ROWS,
                         layout=autofit.Layout(world_size=4, strategy="fsdp2", tensor_parallel=3))
    with pytest.raises(InvalidInputError, match="strategy='fsdp2'"):
        autofit.estimate(case.model, case.sample, step=ROWS,
                         layout=autofit.Layout(world_size=2, strategy="ddp", tensor_parallel=2))


@pytest.mark.sim
def test_a_user_plan_splits_a_model_without_one():
    """WideBlocks' MLPs split by the user's mapping: the split weights' bytes leave each rank, counted by hand."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from sharded_models import wide_blocks

    case = wide_blocks("meta")
    est = autofit.estimate(case.model, case.sample, target=case.target, loss_fn=case.loss_fn, step=2,
                           layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2,
                                                 tensor_parallel_plan={"blocks.*.up": ColwiseParallel(),
                                                                       "blocks.*.down": RowwiseParallel()}))
    # per block: up 128 x 2048 + 2048 bias (split), down 2048 x 128 (split) + 128 bias (whole); head 128 x 10 + 10
    split = 4 * (128 * 2048 + 2048 + 2048 * 128)
    whole = 4 * 128 + 128 * 10 + 10
    assert est.breakdown["parameters"] == 4 * (split // 2 + whole)


LAYOUTS = [(2, 2), (4, 2), (4, 4)]  # (world, tensor parallel): tp alone at 2 and 4, fsdp2 2 x tp 2


@pytest.mark.slow
@pytest.mark.parametrize("world,tp", LAYOUTS)
def test_per_rank_peak_matches_the_allocator_and_a_step_a_full_batch_step(world, tp, tmp_path):
    """One gloo job per layout (its processes import transformers once): every rank's measured peak (the CPU
    allocator, lowest of three steady-state steps: gloo's threads occasionally allocate in the window) against the
    estimate; then two micro-batches per data-parallel rank, whose parameters after one trainer step on every rank
    equal those after one SGD step over the whole batch in one process."""
    data = world // tp
    memory, equivalence = _plan(world, tp, ROWS * data), _plan(world, tp, 2 * ROWS * data)
    ranks = _run([{"kind": "memory", "case": "tiny_llama", "plan": memory.to_json(), "optimizer": "adamw"},
                  {"kind": "equivalence", "case": "tiny_llama", "plan": equivalence.to_json(), "optimizer": "sgd"}],
                 tmp_path, world)
    import dist_workers

    dist_workers.check_memory_and_equivalence(ranks, memory, equivalence, tiny_llama())


@pytest.mark.sim
def test_tensor_parallel_alone_on_cuda_is_refused_and_the_model_is_left_alone():
    """On CUDA the foreach optimizer cannot step plain tensors and DTensors together (torch's own error when the
    simulation tries: 'got mixed torch.Tensor and DTensor'): refused up front, naming the fix. Estimating never
    turns the user's parameters into DTensors."""
    case = tiny_llama("meta")
    with pytest.raises(InvalidInputError, match="compose it with FSDP2"):
        autofit.estimate(case.model, case.sample, step=ROWS,
                         layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2),
                         device="H100-80GB", precision="bf16")
    autofit.estimate(case.model, case.sample, step=ROWS,
                     layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2))
    assert all(type(p) is torch.nn.Parameter for p in case.model.parameters())
