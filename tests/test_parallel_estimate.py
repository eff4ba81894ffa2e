"""``autofit.estimate`` takes the parallel layout ``plan`` takes (world_size, strategy): one rank's step, the same
figure the planner verified its plan with. The gloo comparison with the CPU allocator is in
tests/test_distributed.py."""

from __future__ import annotations

import pytest

import autofit
from autofit.core.errors import InvalidInputError
from sharded_models import wide_blocks

MiB = 2**20
ROW_BYTES = 64 * 128 * 4 + 8  # one row of WideBlocks' input (fp32) and its class target (int64)


@pytest.mark.sim
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_estimate_at_world_size_2_is_the_plans_per_rank_figure(strategy):
    case = wide_blocks("meta")
    plan = autofit.plan(case.model, case.sample, "1GB", batch_size=8, target=case.target, loss_fn=case.loss_fn,
                        device="cpu", precision="fp32", layout=autofit.Layout(world_size=2, strategy=strategy))
    assert plan.gradient_accumulation_steps == 1  # the plan holds one micro-batch of rows, as an estimate does
    est = autofit.estimate(case.model, case.sample, target=case.target,
                           loss_fn=case.loss_fn, precision=plan.precision,
                           layout=autofit.Layout(world_size=2, strategy=strategy,
                                                 reshard_after_forward=plan.parallel.reshard_after_forward,
                                                 replicate=plan.parallel.replicate),
                           step=autofit.Step(micro_batch_size=plan.micro_batch_size, checkpoint=plan.checkpoint))
    assert est.peak_bytes == plan.peak_bytes
    single = autofit.estimate(case.model, case.sample, target=case.target,
                              loss_fn=case.loss_fn, precision=plan.precision,
                              step=autofit.Step(micro_batch_size=plan.micro_batch_size, checkpoint=plan.checkpoint))
    assert est.peak_bytes != single.peak_bytes  # the layout is simulated, not ignored


@pytest.mark.sim
def test_estimate_of_an_fsdp2_plan_reducing_every_micro_batch():
    """The plan holds all of its rank's rows (the trainer slices micro-batches from them), an estimate with
    inputs="micro-batch" one micro-batch: they differ by the other rows' bytes, counted by hand."""
    case = wide_blocks("meta")
    plan = autofit.plan(case.model, case.sample, 26 * MiB, batch_size=16, target=case.target, loss_fn=case.loss_fn,
                        device="cpu", precision="fp32", layout=autofit.Layout(world_size=2, strategy="fsdp2"))
    assert plan.parallel.reduce_every_micro_batch and plan.gradient_accumulation_steps > 1
    est = autofit.estimate(case.model, case.sample, target=case.target,
                           loss_fn=case.loss_fn, precision=plan.precision,
                           layout=autofit.Layout(world_size=2, strategy="fsdp2"),
                           step=autofit.Step(micro_batch_size=plan.micro_batch_size,
                                             accumulation_steps=plan.gradient_accumulation_steps,
                                             checkpoint=plan.checkpoint, reduce_every_micro_batch=True,
                                             inputs="micro-batch"))
    assert est.peak_bytes + (8 - plan.micro_batch_size) * ROW_BYTES == plan.peak_bytes
    # estimate's default holds the rank's whole batch, as the trainer does: the plan's own figure (issue 39)
    assert plan.micro_batch_size * plan.gradient_accumulation_steps == 8
    whole = autofit.estimate(case.model, case.sample, target=case.target,
                             loss_fn=case.loss_fn, precision=plan.precision,
                             layout=autofit.Layout(world_size=2, strategy="fsdp2"),
                             step=autofit.Step(micro_batch_size=plan.micro_batch_size,
                                               accumulation_steps=plan.gradient_accumulation_steps,
                                               checkpoint=plan.checkpoint, reduce_every_micro_batch=True))
    assert whole.peak_bytes == plan.peak_bytes and whole.input_rows == 8


def test_a_layout_without_its_other_half_is_refused():
    case = wide_blocks("meta")
    with pytest.raises(InvalidInputError, match="needs strategy"):
        autofit.estimate(case.model, case.sample, step=2, layout=autofit.Layout(world_size=2))
    with pytest.raises(InvalidInputError, match="needs world_size"):
        autofit.estimate(case.model, case.sample, step=2, layout=autofit.Layout(strategy="ddp"))
    with pytest.raises(InvalidInputError, match="reduce_every_micro_batch"):
        autofit.estimate(case.model, case.sample,
                         layout=autofit.Layout(world_size=2, strategy="ddp"),
                         step=autofit.Step(micro_batch_size=2, reduce_every_micro_batch=True))


@pytest.mark.sim
def test_dtensor_specs_flattened_once_give_the_same_fsdp2_estimate(monkeypatch):
    """Note [DTensor's tuple strategies in linear time]: the optimizer's foreach ops over FSDP2's sharded parameters
    propagate with each schema's specs flattened once; the truth is torch's own propagation, the patch switched off."""
    import contextlib

    from autofit.core import _torch
    from autofit.parallel import simulated as parallel

    case = wide_blocks("meta")

    def figures():
        est = autofit.estimate(case.model, case.sample, step=4, target=case.target, loss_fn=case.loss_fn,
                               precision="bf16", device="H100-80GB",
                               layout=autofit.Layout(world_size=8, strategy="fsdp2"))
        return est.peak_bytes, est.device_bytes, est.peak_reserved_bytes, est.breakdown

    with _torch.dtensor_specs_once():
        pass  # the context enters and leaves cleanly without a simulation
    patched = figures()
    monkeypatch.setattr(parallel, "dtensor_specs_once", contextlib.nullcontext)
    assert figures() == patched


@pytest.mark.sim
def test_deferred_unsharded_gradients_are_named_and_the_flag_removes_them():
    """Issue 56: FSDP2 deferring its reduce-scatter to the last micro-batch keeps every rank's unsharded fp32
    gradients (torch's FSDPParam.to_accumulated_grad_if_needed, Note [deferred reduce-scatter]). The term's bytes
    against a hand count, and the estimate reducing every micro-batch lower by it, less the 1/8 shard it keeps,
    within one block's unsharded gradients (the reducing step peaks with one unit's reduce-scatter in flight)."""
    import torch

    from sharded_models import WideBlocks

    with torch.device("meta"):
        model = WideBlocks(hidden=512, layers=16)
    x, y = torch.randn(8, 64 * 128), torch.randint(0, 10, (8,))
    # by hand: 16 blocks of Linear(128, 512) and Linear(512, 128), a Linear(128, 10) head, fp32 gradients (4 B)
    params = 16 * (128 * 512 + 512 + 512 * 128 + 128) + 128 * 10 + 10
    term, block = params * 4, (128 * 512 + 512 + 512 * 128 + 128) * 4
    assert term == 8_434_728
    kw = dict(target=y, loss_fn=torch.nn.functional.cross_entropy,
              device="cpu", precision="bf16", layout=autofit.Layout(world_size=8, strategy="fsdp2"))
    deferred = autofit.estimate(model, x, step=autofit.Step(micro_batch_size=1, accumulation_steps=4), **kw)
    reducing = autofit.estimate(model, x, step=autofit.Step(micro_batch_size=1,
                                                            accumulation_steps=4, reduce_every_micro_batch=True), **kw)
    named = [n for n in deferred.notes if n.startswith("unsharded fp32 gradients held across 4 micro-batches")]
    assert len(named) == 1 and "8.04 MiB" in named[0] and "reduce_every_micro_batch=True" in named[0], deferred.notes
    assert term > deferred.device_bytes / 5 and deferred.breakdown["temporaries"] >= term
    saved = deferred.device_bytes - reducing.device_bytes
    assert abs(saved - (term - term // 8)) <= block, (saved, term - term // 8, block)
    assert not any("deferred reduce-scatter" in n for n in reducing.notes)
