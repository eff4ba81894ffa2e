"""``measure`` with a parallel layout (autofit/measure/ranks.py): world_size processes on gloo, each rank's step laid
out for real and measured by its own CPU allocator. The truth is that allocator; the estimate of one rank, which
simulates the same layout on a fake process group, is held to it within 0.5 % (the issue's goal for every layout),
and the measured rank agrees with the trainer's own gloo measurement (tests/test_tensor_parallel.py measures the
same 2 x tp 2 layout through plan.wrap: 1,586,460 B)."""

from __future__ import annotations

import pytest
import torch

import autofit
from autofit.core.errors import InvalidInputError
from autofit.training.precision import PrecisionPolicy
from sharded_models import tiny_llama

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

ROWS = 4

# (layout keywords of estimate and measure, id): DDP, FSDP2 ZeRO-3, ZeRO-2 accumulating two micro-batches (the
# gradient sync skipped on the first), tensor parallel 2 under FSDP2 over 2 data-parallel ranks
LAYOUTS = [
    (dict(world_size=2, strategy="ddp"), "ddp-2"),
    (dict(world_size=2, strategy="fsdp2"), "zero3-2"),
    (dict(world_size=2, strategy="fsdp2", reshard_after_forward=False, accumulation_steps=2), "zero2-2-accumulating"),
    (dict(world_size=4, strategy="fsdp2", tensor_parallel=2), "zero3-2-x-tp2"),
    # tensor parallel alone with sequence parallel: Llama's block plan and its blocks' norms, by name
    # (the plan is built in the test, from transformers' LlamaConfig: see _sequence_parallel_plan)
    (dict(world_size=2, strategy="fsdp2", tensor_parallel=2), "tp2-sequence-parallel"),
]


def _sequence_parallel_plan() -> dict[str, str]:
    """Llama's block plan as transformers declares it, and its blocks' norms sequence-parallel, by name."""
    from transformers import LlamaConfig

    return {**{f"model.{k}": v for k, v in LlamaConfig.base_model_tp_plan.items()},
            "model.layers.*.input_layernorm": "sequence_parallel",
            "model.layers.*.post_attention_layernorm": "sequence_parallel"}


@pytest.mark.slow
@pytest.mark.parametrize("layout,name", LAYOUTS, ids=[name for _, name in LAYOUTS])
def test_every_rank_measured_and_the_estimate_within_half_a_percent(layout, name):
    case = tiny_llama()
    if name == "tp2-sequence-parallel":
        layout = {**layout, "tensor_parallel_plan": _sequence_parallel_plan()}
    knobs = {k: v for k, v in layout.items() if k == "accumulation_steps"}  # the step's own knob, not the layout's
    options = autofit.Layout(**{k: v for k, v in layout.items() if k not in knobs})
    knobs = dict(step=autofit.Step(micro_batch_size=ROWS, **knobs))
    before = {n: p.clone() for n, p in case.model.state_dict().items()}
    measured = autofit.measure(case.model, case.sample, layout=options, **knobs)
    predicted = autofit.estimate(case.model, case.sample, layout=options, **knobs).peak_bytes
    assert len(measured.rank_peaks) == layout["world_size"]
    assert measured.peak_bytes == measured.rank_peaks[0]
    for rank, peak in enumerate(measured.rank_peaks):
        print(f"{layout} rank {rank}: predicted {predicted} measured {peak} ({(predicted - peak) / peak:+.3%})")
        assert abs(predicted - peak) <= 0.005 * peak, (layout, rank, predicted, measured.rank_peaks)
    # the trainer's measurements of these layouts, rank 0 (tests/test_tensor_parallel.py, test_sequence_parallel.py)
    trainer = {"zero3-2-x-tp2": 1_586_460, "tp2-sequence-parallel": 1_652_124}
    if name in trainer:
        assert measured.peak_bytes == trainer[name]
    # the processes trained copies: the caller's model is as it was
    for name, tensor in case.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_what_cannot_travel_to_the_ranks_or_run_there_is_refused_before_any_process_starts():
    case = tiny_llama()
    kw = dict(step=ROWS, layout=autofit.Layout(world_size=2, strategy="ddp"))
    with pytest.raises(InvalidInputError, match="pickle"):
        autofit.measure(case.model, case.sample, loss_fn=lambda out, target: out.logits.mean(), **kw)
    with pytest.raises(InvalidInputError, match="one process only"):
        autofit.measure(case.model, case.sample, precision=PrecisionPolicy(name="bf16", stored="bf16"), **kw)
    with pytest.raises(InvalidInputError, match="world_size=2 needs strategy"):
        autofit.measure(case.model, case.sample, step=ROWS, layout=autofit.Layout(world_size=2))


def _dies_on_rank_1(output, target=None):
    """A loss under which rank 1 ends without a Python error (as a rank killed for memory does)."""
    import os

    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(3)
    return output.logits.float().mean()


@pytest.mark.slow
def test_a_rank_that_dies_is_a_typed_error():
    """torch.multiprocessing does not export the base of its process errors (ProcessException): catching that
    name raised AttributeError while a rank was dying."""
    case = tiny_llama()
    with pytest.raises(autofit.UnsupportedModelError, match="ended abnormally"):
        autofit.measure(case.model, case.sample, step=ROWS,
                        layout=autofit.Layout(world_size=2, strategy="ddp"), loss_fn=_dies_on_rank_1)


@pytest.mark.slow
def test_zero3_of_a_llama_without_hugging_face_within_half_a_percent():
    """benchmarks/llama.py's Llama (hidden 64, 2 layers, untied head), FSDP2 ZeRO-3 over 2 ranks, 2 rows of 32: every
    rank measures 1,896,444 B, at the backward prefetch of layers.0, where its gathered parameters, gloo's staging copy
    of them (Note [gloo's staging copies], parallel/simulated.py) and layers.1's are alive at once. Without that copy
    the estimate was 1,846,780 B (-2.6 %); the Hugging Face tiny Llama above peaks elsewhere. The gloo profile of
    rank 0 showed the copy: an ``aten::empty`` of 147,968 B (36,992 fp32 parameters of a layer) inside
    ``c10d::_allgather_base_``, freed by the next event."""
    from benchmarks.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2))
    ids = torch.randint(0, 256, (4, 32))
    kw = dict(target=ids, step=2, layout=autofit.Layout(world_size=2, strategy="fsdp2"))
    predicted = autofit.estimate(model, ids, **kw).peak_bytes
    measured = autofit.measure(model, ids, **kw)
    for peak in measured.rank_peaks:
        assert abs(predicted - peak) <= 0.005 * peak, (predicted, measured.rank_peaks)
    # by hand, the layer gloo copies: q and o 64 x 64, k and v 64 x 32, gate, up and down 64 x 128, two norms of 64
    assert sum(p.numel() for p in model.layers[0].parameters()) == 2 * 4096 + 2 * 2048 + 3 * 8192 + 128 == 36_992
