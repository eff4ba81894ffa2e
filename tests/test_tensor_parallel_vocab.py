"""The vocabulary split of tensor parallel (Note [tensor parallel plan], autofit/parallel/tensor_parallel.py): the
embedding ("embedding_rowwise": torch's ``RowwiseParallel(input_layouts=Replicate())`` on an nn.Embedding) and the
output head ("colwise_rep" = "colwise_gather_output": ``ColwiseParallel(output_layouts=Replicate())``) split T ways
next to the blocks' linear layers, on a tiny Llama with a 512-word vocabulary. The truth: the CPU allocator's record
on every rank of a gloo job (tests/dist_workers.py) for the per-rank estimate, one single-process full-batch SGD step
for the parameters after a step, and hand counts of the split parameters; styles autofit does not simulate are
refused naming them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autofit
from autofit.core.errors import UnsupportedModelError
from autofit.emit.plan import Plan
from autofit.parallel.layout import Parallel
from autofit.parallel.choices import shard_units
from autofit.training.batch import as_batch
from autofit.training.precision import as_policy
from autofit.parallel.tensor_parallel import resolve_tensor_plan
from sharded_models import tiny_llama, tiny_llama_vocab

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

ROWS, HIDDEN, MLP, VOCAB = 4, 64, 128, 512  # rows per micro-batch per tensor-parallel group; tiny_llama_vocab's shape


def _mapping(model) -> dict[str, str]:
    """Llama's own plan for its blocks (config.base_model_tp_plan, keys under ``model.``) plus the vocabulary split,
    in transformers' names."""
    blocks = {f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()}
    return {**blocks, "model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}


def test_names_and_torch_styles_resolve_alike():
    """transformers' names and torch's style objects with the same layouts give the same plan; the head's two
    transformers names ("colwise_rep", "colwise_gather_output") are one style."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    case = tiny_llama_vocab("meta")
    by_name = dict(resolve_tensor_plan(case.model, 2, _mapping(case.model)))
    assert by_name["model.embed_tokens"] == "embedding_rowwise" and by_name["lm_head"] == "colwise_rep"
    assert by_name["model.layers.0.self_attn.q_proj"] == "colwise"
    objects = {**_mapping(case.model), "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
               "lm_head": ColwiseParallel(output_layouts=Replicate())}
    assert dict(resolve_tensor_plan(case.model, 2, objects)) == by_name
    assert dict(resolve_tensor_plan(case.model, 2, {**_mapping(case.model), "lm_head": "colwise_rep"})) == by_name


def test_a_config_plan_with_the_embedding_split_is_read():
    """A model whose config.base_model_tp_plan names "embedding_rowwise" (as 21 of transformers' configs do) is
    split from its own plan: no user mapping needed."""
    case = tiny_llama_vocab("meta")
    case.model.config.base_model_tp_plan = {**case.model.config.base_model_tp_plan,
                                            "embed_tokens": "embedding_rowwise"}
    plan = dict(resolve_tensor_plan(case.model, 2))
    assert plan["model.embed_tokens"] == "embedding_rowwise" and "lm_head" not in plan


@pytest.mark.sim
def test_parameters_per_rank_are_the_vocabulary_split_counted_by_hand():
    """hidden 64, MLP 128, vocab 512, 2 layers, fp32: the blocks' 4 attention (64 x 64) and 3 MLP (64 x 128)
    weights, the embedding and the head (512 x 64 each) are split T ways; the 5 norms (64) stay whole; FSDP2 then
    shards everything over world / T."""
    case = tiny_llama_vocab("meta")
    split = 2 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * MLP) + 2 * VOCAB * HIDDEN
    whole = 5 * HIDDEN
    for world, tp in [(2, 2), (4, 2), (4, 4)]:
        est = autofit.estimate(case.model, case.sample, step=ROWS,
                               layout=autofit.Layout(world_size=world, strategy="fsdp2", tensor_parallel=tp,
                                                     tensor_parallel_plan=_mapping(case.model)))
        assert est.breakdown["parameters"] == 4 * (split // tp + whole) // (world // tp), (world, tp)


@pytest.mark.parametrize("style", ["rowwise_rep", "rowwise_split_input", "embedding_colwise", "packed_colwise"])
def test_styles_not_simulated_are_refused_naming_them(style):
    case = tiny_llama_vocab("meta")
    with pytest.raises(UnsupportedModelError, match=f"tensor parallel style '{style}' for 'model.embed_tokens'"):
        resolve_tensor_plan(case.model, 2, {**_mapping(case.model), "model.embed_tokens": style})


def test_what_the_vocabulary_split_cannot_do_is_refused():
    """A style on the other module type, a vocabulary that T does not divide, a padding row (torch's sharded
    embedding does not re-index it) and a head tied to the embedding (torch would distribute it twice)."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    case = tiny_llama_vocab("meta")
    with pytest.raises(UnsupportedModelError,
                       match="'lm_head' \\(Linear\\) 'embedding_rowwise', a style for Embedding"):
        resolve_tensor_plan(case.model, 2, {**_mapping(case.model), "lm_head": "embedding_rowwise"})
    # torch's RowwiseParallel() takes its input split by the last dim: on an embedding that would split the ids
    with pytest.raises(UnsupportedModelError,
                       match="'model.embed_tokens' \\(Embedding\\) 'rowwise', a style for Linear"):
        resolve_tensor_plan(case.model, 2, {**_mapping(case.model), "model.embed_tokens": RowwiseParallel()})
    odd = tiny_llama("meta", vocab=510)
    with pytest.raises(UnsupportedModelError, match="'lm_head' has 510 output features, which tensor_parallel=4"):
        resolve_tensor_plan(odd.model, 4, {"lm_head": "colwise_rep"})
    with pytest.raises(UnsupportedModelError, match="'model.embed_tokens' has 510 vocabulary rows"):
        resolve_tensor_plan(odd.model, 4, {"model.embed_tokens": "embedding_rowwise"})
    padded = tiny_llama("meta", vocab=512, pad_token_id=0)
    with pytest.raises(UnsupportedModelError, match="padding_idx"):
        resolve_tensor_plan(padded.model, 2, _mapping(padded.model))
    tied = tiny_llama("meta", vocab=512, tie_word_embeddings=True)
    assert tied.model.lm_head.weight is tied.model.model.embed_tokens.weight
    with pytest.raises(UnsupportedModelError, match="tied weights"):
        resolve_tensor_plan(tied.model, 2, _mapping(tied.model))


def _plan(world: int, tp: int, batch_size: int) -> Plan:
    """A plan of the layout, made by hand around the estimate (the estimate is what is under test)."""
    case = tiny_llama_vocab()
    mapping = _mapping(case.model)
    est = autofit.estimate(case.model, case.sample, step=ROWS,
                           layout=autofit.Layout(world_size=world, strategy="fsdp2", tensor_parallel=tp,
                                                 tensor_parallel_plan=mapping))
    return Plan(micro_batch_size=ROWS, gradient_accumulation_steps=batch_size // (ROWS * (world // tp)),
                batch_size=batch_size, last_micro_batch_size=ROWS, precision=as_policy("fp32"), checkpoint=(),
                peak_bytes=est.peak_bytes, device_bytes=est.device_bytes, budget_bytes=2**30, device="cpu",
                optimizer="adamw", predicted_step_seconds=0.0, estimate=est,
                parallel=Parallel(world_size=world, strategy="fsdp2", shard_units=shard_units(case.model),
                                  tensor_parallel=tp, tensor_plan=resolve_tensor_plan(case.model, tp, mapping)))


@pytest.mark.slow
@pytest.mark.parametrize("world,tp", [(2, 2), (4, 2)])  # tp alone; FSDP2 2 x tp 2
def test_vocabulary_split_peak_matches_the_allocator_and_a_step_a_full_batch_step(world, tp, tmp_path):
    """One gloo job: every rank's measured peak (the CPU allocator, this thread's allocations, lowest of three
    steady-state steps) against the estimate; then two micro-batches per data-parallel rank, whose parameters after
    one trainer step on every rank equal those after one SGD step over the whole batch in one process (the
    gradients of the split embedding and head included: SGD moves each parameter by 0.1 x its gradient)."""
    import dist_workers

    data = world // tp
    memory, equivalence = _plan(world, tp, ROWS * data), _plan(world, tp, 2 * ROWS * data)
    assert dict(memory.parallel.tensor_plan)["lm_head"] == "colwise_rep"
    ranks = dist_workers.launch(
        [{"kind": "memory", "case": "tiny_llama_vocab", "plan": memory.to_json(), "optimizer": "adamw"},
         {"kind": "equivalence", "case": "tiny_llama_vocab", "plan": equivalence.to_json(), "optimizer": "sgd"}],
        Path(tmp_path), world)
    dist_workers.check_memory_and_equivalence(ranks, memory, equivalence, tiny_llama_vocab(), " + vocabulary split")


@pytest.mark.sim
def test_vocabulary_split_collectives_counted_by_hand():
    """Per sample of 32 tokens in fp32: the blocks' 2 x 7 all-reduces of 32 x 64 (tests/test_tensor_parallel_plan.py),
    the embedding's all-reduced output (32 x 64), and the head's all-gathered logits (32 x 512, priced as half an
    all-reduce) plus the all-reduced gradient of its input (32 x 64). Each rank holds 1/2 of every split weight."""
    from autofit.analyse.analyse import analyse_model
    from autofit.parallel.layout import Parallel
    from autofit.parallel.tensor import tensor_group_bytes, tensor_reduce_bytes
    from autofit.training.step import make_step_config

    tokens = 32
    case = tiny_llama_vocab()
    plan = resolve_tensor_plan(case.model, 2, _mapping(case.model))
    step = make_step_config(micro_batch_size=1,
                            layout=Parallel(strategy="fsdp2", world_size=2, tensor_parallel=2, tensor_plan=plan))
    analysis = analyse_model(case.model, as_batch(case.sample), None, None, step)
    parallel = Parallel(strategy="fsdp2", world_size=2, tensor_parallel=2, tensor_plan=plan)
    per_sample = tensor_reduce_bytes(case.model, parallel, lambda n: analysis.table.row(n).output_bytes_per_sample)
    blocks = 2 * 7 * tokens * HIDDEN * 4
    assert per_sample == blocks + tokens * HIDDEN * 4 + tokens * VOCAB * 4 / 2 + tokens * HIDDEN * 4
    split = 2 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * MLP) + 2 * VOCAB * HIDDEN
    assert tensor_group_bytes(case.model, parallel) == 4 * (split // 2 + 5 * HIDDEN)
