"""Pipeline stages (autofit/parallel/pipeline.py, Note [pipeline stages]): the stages of a Hugging Face decoder,
chained, compute the whole model's logits, loss and gradients."""

from __future__ import annotations

import pytest
import torch

import autofit
from autofit.core.errors import InvalidInputError, UnsupportedModelError
from autofit.parallel.pipeline import decoder_stages, layer_split

transformers = pytest.importorskip("transformers")


def test_the_split_is_even_with_the_remainder_first():
    assert layer_split(4, 2) == [range(0, 2), range(2, 4)]
    assert layer_split(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(UnsupportedModelError, match="at most 4 stages"):
        layer_split(4, 5)


def test_a_given_split_is_taken_as_given_and_checked_against_the_model():
    """``Layout(pipeline_layers=...)``: each stage's layer count in stage order; torchtitan's ``generate_split_points``
    of late 2024 put 126 layers over 8 stages as 15, six of 16, 15 (the even share first, the remainder in the
    middle: base 126 // 8 = 15, 6 extra)."""
    split = layer_split(126, 8, (15, 16, 16, 16, 16, 16, 16, 15))
    assert [len(r) for r in split] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert split[0] == range(0, 15) and split[-1] == range(111, 126)
    with pytest.raises(InvalidInputError, match=r"pipeline_layers \[1, 2\] gives 2 stages 3 layers.* 4 layers run "
                                                r"in 2 stages.* summing to 4"):
        layer_split(4, 2, (1, 2))
    with pytest.raises(InvalidInputError, match="gives 3 stages 4 layers.*in 2 stages"):
        layer_split(4, 2, (1, 2, 1))
    for bad in ((2, 0), "22", (2.0, 2), (True, 3), ()):
        with pytest.raises(InvalidInputError, match="pipeline_layers must be the decoder layers of each stage"):
            autofit.Layout(pipeline_parallel=2, pipeline_layers=bad)
    assert autofit.Layout(pipeline_parallel=2, pipeline_layers=[1, 3]).pipeline_layers == (1, 3)
    with pytest.raises(InvalidInputError, match="pipeline_parallel is 1: give pipeline_parallel=P too"):
        autofit.Layout(pipeline_layers=(1, 3))


@pytest.mark.parametrize("family", ["Llama", "Qwen3", "Mistral"])
@pytest.mark.parametrize("stages", [1, 2, 4])
def test_chained_stages_are_the_whole_model(family, stages):
    config = getattr(transformers, f"{family}Config")(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, use_cache=False)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    ids = torch.randint(0, 128, (2, 16))
    whole = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(whole.flatten(0, 1), ids.flatten())
    loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    cut = decoder_stages(model, stages)
    assert len(cut) == stages
    owned = [{id(p) for p in stage.parameters()} for stage in cut]
    assert sum(map(len, owned)) == len(list(model.parameters()))  # each parameter in exactly one stage
    x = ids
    for stage in cut:
        x = stage(x)
    assert torch.equal(x, whole)
    torch.nn.functional.cross_entropy(x.flatten(0, 1), ids.flatten()).backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, expected[n]), n
    assert len(model.model.layers) == 4 and not isinstance(model.model.norm, torch.nn.Identity)  # the model as it was


def test_a_model_without_a_pipeline_plan_is_refused():
    with pytest.raises(UnsupportedModelError, match="base_model_pp_plan"):
        decoder_stages(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2)


def _llama():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _loss(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _pipeline_rank(rank: int, world: int, schedule: str, out: str) -> None:
    """One pipeline rank on gloo: the model cut to its stage, torch's PipelineStage and ``schedule`` over 4
    micro-batches, its stage's gradients saved by the whole model's parameter names."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
    try:
        model = _llama()
        names = {id(p): n for n, p in model.named_parameters()}
        stage_module = decoder_stages(model, world)[rank]
        stage = pipelining.PipelineStage(stage_module, rank, world, torch.device("cpu"))
        run = getattr(pipelining, schedule)(stage, n_microbatches=4, loss_fn=_loss)
        torch.manual_seed(1)
        ids = torch.randint(0, 128, (8, 16))
        if rank == 0:
            run.step(ids, target=ids if world == 1 else None)
        elif rank == world - 1:
            run.step(target=ids)
        else:
            run.step()
        torch.save({names[id(p)]: p.grad for p in stage_module.parameters()}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_the_stages_under_torchs_schedule_give_the_full_batch_gradients(tmp_path, schedule):
    """Two gloo ranks, each the model cut to its stage, torch's schedule over 4 micro-batches of 2 rows: every
    parameter's gradient equals one full-batch step's (torch scales the micro-batches' sum by 1/4, scale_grads)."""
    import torch.multiprocessing as mp

    mp.spawn(_pipeline_rank, args=(2, schedule, str(tmp_path)), nprocs=2)
    model = _llama()
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (8, 16))
    _loss(model(input_ids=ids).logits, ids).backward()
    got = {**torch.load(tmp_path / "0.pt"), **torch.load(tmp_path / "1.pt")}
    assert set(got) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
