"""Sequence parallel (Note [sequence parallel], autofit/parallel/tensor_parallel.py): the blocks' norms given
"sequence_parallel" next to a tiny Llama's own block plan. The truth: the CPU allocator's record on every rank of a
gloo job (tests/dist_workers.py) for the per-rank estimate, one single-process full-batch SGD step for the
parameters after a step, and hand counts of what sequence parallel keeps per rank and moves per sample."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autofit
from autofit.core.errors import UnsupportedModelError
from autofit.emit.plan import Plan
from autofit.parallel.layout import Parallel
from autofit.parallel.choices import shard_units
from autofit.training.precision import as_policy
from autofit.parallel.tensor_parallel import resolve_tensor_plan
from sharded_models import tiny_llama

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

ROWS, TOKENS, HIDDEN = 4, 32, 64  # rows per micro-batch per tensor-parallel group; tiny_llama's shape
NORMS = {"model.layers.*.input_layernorm": "sequence_parallel",
         "model.layers.*.post_attention_layernorm": "sequence_parallel"}


def _mapping(model, **extra) -> dict[str, object]:
    """Llama's own plan for its blocks (config.base_model_tp_plan, keys under ``model.``) plus the blocks' norms."""
    return {**{f"model.{k}": v for k, v in model.config.base_model_tp_plan.items()}, **NORMS, **extra}


def test_the_norms_imply_the_rest_of_the_layout():
    """From the norms alone: the attention and the MLP gather their input, their row-parallel layers
    reduce-scatter, the first block shards its input, the final norm gathers it back; torch's
    ``SequenceParallel()`` object names the same style as transformers' "sequence_parallel"."""
    from torch.distributed.tensor.parallel import SequenceParallel

    case = tiny_llama("meta")
    plan = dict(resolve_tensor_plan(case.model, 2, _mapping(case.model)))
    assert plan["model.layers.0"] == "sequence_shard" and "model.layers.1" not in plan
    assert plan["model.layers.1.input_layernorm"] == "sequence_parallel"
    assert plan["model.layers.1.self_attn"] == plan["model.layers.1.mlp"] == "sequence_gather"
    assert plan["model.layers.0.self_attn.o_proj"] == plan["model.layers.1.mlp.down_proj"] == "rowwise_sequence"
    assert plan["model.layers.0.self_attn.q_proj"] == "colwise"
    assert plan["model.norm"] == "sequence_gather_whole" and "lm_head" not in plan
    objects = _mapping(case.model, **{k: SequenceParallel() for k in NORMS})
    assert dict(resolve_tensor_plan(case.model, 2, objects)) == plan
    # the final norm named too (torchtitan's plan does): it is still the place the sequence is gathered
    assert dict(resolve_tensor_plan(case.model, 2, _mapping(case.model, **{"model.norm": "sequence_parallel"}))) \
        == plan


def test_structures_it_does_not_cover_are_refused_naming_the_module():
    case = tiny_llama("meta")
    blocks = {f"model.{k}": v for k, v in case.model.config.base_model_tp_plan.items()}
    with pytest.raises(UnsupportedModelError, match="block 'model.layers.1' has no 'sequence_parallel' norm"):
        resolve_tensor_plan(case.model, 2, {**blocks, "model.layers.0.input_layernorm": "sequence_parallel"})
    with pytest.raises(UnsupportedModelError, match="on the norms of the blocks of one nn.ModuleList"):
        resolve_tensor_plan(case.model, 2, {**blocks, "model.norm": "sequence_parallel"})
    with pytest.raises(UnsupportedModelError, match="parameters are 1-D"):
        resolve_tensor_plan(case.model, 2, {**blocks, "model.layers.*.mlp": "sequence_parallel"})
    with pytest.raises(UnsupportedModelError, match="'model.layers.0.mlp' holds column-parallel layers and 0"):
        resolve_tensor_plan(case.model, 2, {**_mapping(case.model), "model.layers.*.mlp.down_proj": "colwise"})
    with pytest.raises(UnsupportedModelError, match="SequenceParallel"):
        from torch.distributed.tensor.parallel import SequenceParallel

        resolve_tensor_plan(case.model, 2, _mapping(case.model, **{
            "model.layers.*.input_layernorm": SequenceParallel(use_local_output=True)}))


@pytest.mark.sim
def test_a_rank_keeps_the_residual_stream_and_norms_of_its_share_of_the_tokens():
    """Per rank, against tensor parallel alone on the same split: the estimate's activations fall (the residual
    stream and each norm's saved input hold 1/T of the tokens), the parameters stay (norms are replicated)."""
    case = tiny_llama()
    blocks = {f"model.{k}": v for k, v in case.model.config.base_model_tp_plan.items()}
    layout = dict(world_size=2, strategy="fsdp2", tensor_parallel=2)
    alone = autofit.estimate(case.model, case.sample, step=ROWS,
                             layout=autofit.Layout(**layout, tensor_parallel_plan=blocks))
    sequence = autofit.estimate(case.model, case.sample, step=ROWS,
                                layout=autofit.Layout(**layout, tensor_parallel_plan=_mapping(case.model)))
    assert sequence.breakdown["parameters"] == alone.breakdown["parameters"]
    assert sequence.peak_bytes < alone.peak_bytes


def _plan(world: int, tp: int, batch_size: int, checkpoint: tuple[str, ...] = ()) -> Plan:
    """A plan of the layout, made by hand around the estimate (the estimate is what is under test)."""
    case = tiny_llama()
    mapping = _mapping(case.model)
    est = autofit.estimate(case.model, case.sample,
                           layout=autofit.Layout(world_size=world, strategy="fsdp2", tensor_parallel=tp,
                                                 tensor_parallel_plan=mapping),
                           step=autofit.Step(micro_batch_size=ROWS, checkpoint=checkpoint or None))
    return Plan(micro_batch_size=ROWS, gradient_accumulation_steps=batch_size // (ROWS * (world // tp)),
                batch_size=batch_size, last_micro_batch_size=ROWS, precision=as_policy("fp32"), checkpoint=checkpoint,
                peak_bytes=est.peak_bytes, device_bytes=est.device_bytes, budget_bytes=2**30, device="cpu",
                optimizer="adamw", predicted_step_seconds=0.0, estimate=est,
                parallel=Parallel(world_size=world, strategy="fsdp2", shard_units=shard_units(case.model),
                                  tensor_parallel=tp, tensor_plan=resolve_tensor_plan(case.model, tp, mapping)))


@pytest.mark.slow(seconds=40)
@pytest.mark.parametrize("world,tp,checkpoint", [
    (2, 2, ()), (4, 2, ()),  # tp alone; FSDP2 2 x tp 2
    (2, 2, ("model.layers.0", "model.layers.1.mlp")),  # recomputed: the block that shards its input, and an MLP
])
def test_sequence_parallel_peak_matches_the_allocator_and_a_step_a_full_batch_step(world, tp, checkpoint, tmp_path):
    """One gloo job: every rank's measured peak (the CPU allocator, lowest of eight steady-state steps) against the
    estimate; then two micro-batches per data-parallel rank, whose parameters after one trainer step on every rank
    equal those after one SGD step over the whole batch in one process (the norms' gradients, partial sums over
    each rank's tokens, included)."""
    import dist_workers

    data = world // tp
    memory = _plan(world, tp, ROWS * data, checkpoint)
    equivalence = _plan(world, tp, 2 * ROWS * data, checkpoint)
    # the lowest of 8 windows, not 3: recomputing a block reruns its collectives, and on a loaded machine gloo's
    # worker threads can hold a collective's 32 KiB input past the window (seen: 5 of 12 windows at the estimate,
    # the others 32 to 160 KiB above it, every extra byte a free that came after the window ended)
    ranks = dist_workers.launch(
        [{"kind": "memory", "case": "tiny_llama", "plan": memory.to_json(), "optimizer": "adamw", "repeats": 8},
         {"kind": "equivalence", "case": "tiny_llama", "plan": equivalence.to_json(), "optimizer": "sgd"},
         {"kind": "odd length", "case": "tiny_llama", "plan": memory.to_json(), "optimizer": "sgd", "length": 31}],
        Path(tmp_path), world)
    dist_workers.check_memory_and_equivalence(ranks, memory, equivalence, tiny_llama(),
                                              f" recomputing {checkpoint}" if checkpoint else "")
    for results in ranks:  # 31 tokens over a group of 2: refused by the trainer before anything runs
        assert "this batch has 31 there" in results[2]["refused"], results[2]


def _output_bytes(case, plan):
    from autofit.analyse.analyse import analyse_model
    from autofit.training.batch import as_batch
    from autofit.training.step import make_step_config

    step = make_step_config(micro_batch_size=1,
                            layout=Parallel(strategy="fsdp2", world_size=2, tensor_parallel=2, tensor_plan=plan))
    table = analyse_model(case.model, as_batch(case.sample), None, None, step).table
    return lambda name: table.row(name).output_bytes_per_sample


@pytest.mark.sim
def test_collectives_counted_by_hand():
    """Per sample of 32 tokens x 64 hidden in fp32 (X = 8,192 B): tensor parallel alone all-reduces 2 x 7 X (each
    block's two row-parallel outputs and five column-parallel input gradients); with sequence parallel each block's
    attention and MLP move 2 X each (an all-gather and a reduce-scatter in forward, the same in backward, each half
    an all-reduce), the first block's input gradient X / 2 and the final norm's input X / 2: 9 X. The split
    weights per rank are the same."""
    from autofit.parallel.layout import Parallel
    from autofit.parallel.tensor import tensor_group_bytes, tensor_reduce_bytes

    x = TOKENS * HIDDEN * 4
    case = tiny_llama()
    blocks = {f"model.{k}": v for k, v in case.model.config.base_model_tp_plan.items()}
    figures = {}
    for name, mapping in (("alone", blocks), ("sequence", _mapping(case.model))):
        plan = resolve_tensor_plan(case.model, 2, mapping)
        parallel = Parallel(strategy="fsdp2", world_size=2, tensor_parallel=2, tensor_plan=plan)
        figures[name] = (tensor_reduce_bytes(case.model, parallel, _output_bytes(case, plan)),
                         tensor_group_bytes(case.model, parallel))
    assert figures["alone"][0] == 2 * 7 * x
    assert figures["sequence"][0] == 9 * x
    assert figures["sequence"][1] == figures["alone"][1]


@pytest.mark.slow
def test_collectives_are_the_ones_torch_runs(tmp_path):
    """The time model's bytes per sample against the functional collectives torch's DTensor calls in one forward
    and backward on 2 gloo ranks (counted by a dispatch mode in each rank, tests/dist_workers.py), for tensor
    parallel alone and with sequence parallel, ROWS samples each."""
    import dist_workers

    case = tiny_llama()
    blocks = {f"model.{k}": v for k, v in case.model.config.base_model_tp_plan.items()}
    jobs, expected = [], []
    from autofit.parallel.layout import Parallel
    from autofit.parallel.tensor import tensor_reduce_bytes

    for mapping in (blocks, _mapping(case.model)):
        plan = resolve_tensor_plan(case.model, 2, mapping)
        parallel = Parallel(strategy="fsdp2", world_size=2, tensor_parallel=2, tensor_plan=plan)
        expected.append(ROWS * tensor_reduce_bytes(case.model, parallel, _output_bytes(case, plan)))
        est = autofit.estimate(case.model, case.sample, step=ROWS,
                               layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2,
                                                     tensor_parallel_plan=mapping))
        memory = Plan(micro_batch_size=ROWS, gradient_accumulation_steps=1, batch_size=ROWS,
                      last_micro_batch_size=ROWS, precision=as_policy("fp32"), checkpoint=(),
                      peak_bytes=est.peak_bytes, device_bytes=est.device_bytes, budget_bytes=2**30, device="cpu",
                      optimizer="adamw", predicted_step_seconds=0.0, estimate=est,
                      parallel=Parallel(world_size=2, strategy="fsdp2", shard_units=shard_units(case.model),
                                        tensor_parallel=2, tensor_plan=plan))
        jobs.append({"kind": "collectives", "case": "tiny_llama", "plan": memory.to_json(), "optimizer": "sgd"})
    ranks = dist_workers.launch(jobs, Path(tmp_path), 2)
    for rank, results in enumerate(ranks):
        print(f"rank {rank}: {[r['calls'] for r in results]}")
        assert [r["moved"] for r in results] == expected, rank


def test_the_helper_adds_the_blocks_norms_to_the_model_plan():
    """``sequence_parallel_plan``: the config's plan plus each block's 1-D-parameter children, the same resolved
    plan as the mapping written by hand."""
    from autofit.parallel.tensor_parallel import sequence_parallel_plan

    case = tiny_llama("meta")
    helped = sequence_parallel_plan(case.model)
    assert {k for k, v in helped.items() if v == "sequence_parallel"} == {
        f"model.layers.{i}.{norm}" for i in (0, 1) for norm in ("input_layernorm", "post_attention_layernorm")}
    assert resolve_tensor_plan(case.model, 2, helped) == resolve_tensor_plan(case.model, 2, _mapping(case.model))
    from sharded_models import wide_blocks

    with pytest.raises(UnsupportedModelError, match="carries none"):
        sequence_parallel_plan(wide_blocks("meta").model)


@pytest.mark.sim
def test_a_sequence_that_the_group_does_not_divide_is_refused_before_anything_runs():
    """31 tokens over 2 ranks: torch's ``DTensor.from_local`` would take each rank's shard as half of a whole of
    62 (the simulation failed deep in the attention's broadcast before this check). estimate, plan with T given,
    and the trainer's step (in the gloo job above) each name the length and the fix; plan with "auto" plans the
    other layouts."""
    from autofit.parallel.tensor_parallel import sequence_parallel_plan

    case = tiny_llama()
    ids = case.sample["input_ids"][:, :31]
    odd = {"input_ids": ids, "labels": ids.clone()}
    mapping = sequence_parallel_plan(case.model)
    with pytest.raises(autofit.InvalidInputError, match="has 31 there .* pad it to a multiple of 2"):
        autofit.estimate(case.model, odd, step=ROWS,
                         layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2,
                                               tensor_parallel_plan=mapping))
    with pytest.raises(autofit.InvalidInputError, match="has 31 there"):
        autofit.plan(case.model, odd, "1GB", batch_size=8, device="cpu",
                     layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2,
                                           tensor_parallel_plan=mapping))
    plan = autofit.plan(case.model, odd, "1GB", batch_size=8, device="cpu",
                        layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel="auto",
                                              tensor_parallel_plan=mapping))
    assert plan.parallel.tensor_parallel == 1  # the trainer's refusal: the gloo test above ("odd length" job)


@pytest.mark.slow(seconds=45)
@pytest.mark.filterwarnings("error:Parallelize plan key:UserWarning")
def test_depth_extrapolation_plans_sequence_parallel_as_the_whole_model():
    """A 10-block Llama, FSDP2 2 x tp 2 with sequence parallel: the plan from cut models (2, 3, 4 blocks; only the
    first block shards its input, whichever block comes first in a cut) equals the plan of every block simulated.
    A cut model's plan names only its own blocks: torch warned once for every name past the cut (539 warnings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from autofit.parallel.tensor_parallel import sequence_parallel_plan

    config = LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=10,
                         num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, TOKENS))
    plans = [autofit.plan(model, {"input_ids": ids, "labels": ids}, "1GB", batch_size=8, device="cpu",
                          precision="fp32",
                          layout=autofit.Layout(world_size=4, strategy="fsdp2", reshard_after_forward=True,
                                                tensor_parallel=2, tensor_parallel_plan=sequence_parallel_plan(model)),
                          search=autofit.Search(extrapolate_depth=extrapolate)) for extrapolate in (False, True)]
    assert any("depth extrapolation: simulated" in n for n in plans[1].notes)
    assert plans[0].layout == plans[1].layout == "fsdp2 (ZeRO-3) x tp 2 + sequence parallel"
    assert (plans[0].micro_batch_size, plans[0].peak_bytes) == (plans[1].micro_batch_size, plans[1].peak_bytes)


@pytest.mark.sim
def test_exports_say_what_the_other_tools_run_instead():
    """torchtitan runs its norms sequence-parallel whatever the export says, and splits the embedding and head: with
    sequence parallel in the plan its note names only the vocabulary split; Accelerate's tp_size applies the model's
    own plan, without sequence parallel: a note says so. Lightning's note points at the plan's styles."""
    from autofit.emit.export import to_accelerate_config, to_lightning_trainer, to_torchtitan_config

    plan = _plan(4, 2, 2 * ROWS)
    assert plan.layout == "fsdp2 (ZeRO-3) x tp 2 + sequence parallel"
    titan = " ".join(to_torchtitan_config(plan)["autofit"]["notes"])
    assert "splits the embedding and the output head" in titan and "sequence-parallel" not in titan
    assert any("without this plan's sequence parallel" in n for n in to_accelerate_config(plan)["autofit_notes"])
    assert any("torch_style" in n for n in to_lightning_trainer(plan)["autofit_notes"])
