"""The planner's ladder (Note [the ladder], autofit/solve/ladder.py) is a pure function of the request: these tests
build requests by hand and simulate nothing. Truths: byte counts by hand (4 B per fp32 value, AdamW's two moments),
and the order of the rungs the docs give (docs/planner.md, "When nothing fits")."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from autofit.training.batch import as_batch
from autofit.device import resolve_device
from autofit.training.optim import as_optimizer_spec
from autofit.training.precision import PrecisionPolicy
from autofit.request import Parallel, PlanRequest
from autofit.solve.ladder import Stage, ladder, skipped_note, states_floor
from autofit.parallel.choices import shard_units

N = 3 * (64 * 64 + 64)  # parameters of the model below
BF16, FP32, FP16 = PrecisionPolicy(name="bf16"), PrecisionPolicy(name="fp32"), PrecisionPolicy(name="fp16")
MASTER, PURE = PrecisionPolicy(name="bf16", stored="bf16-master"), PrecisionPolicy(name="bf16", stored="bf16")


def _model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])


def _request(*, device: str = "cuda", gpu: str | None = "A100-80GB", policies=(BF16, FP32), stored=(MASTER, PURE),
             offload: bool = True, optimizer: str = "adamw", world_size: int = 1, clip: float | None = None,
             budget: int = 10**6) -> PlanRequest:
    x = torch.zeros(4, 64)
    return PlanRequest(
        model=_model(), batch=as_batch(x), target=None, loss_fn=None, device=resolve_device(device, gpu),
        budget_bytes=budget, margin_bytes=0, batch_size=4 * world_size, per_rank=4, world_size=world_size,
        strategies=(None,), policies=tuple(policies), optimizer=as_optimizer_spec(optimizer), fixed_checkpoint=None,
        clip_grad_norm=clip, quick=True, auto_precision=True, stored_options=tuple(stored), offload=offload,
    )


def test_one_gpu_climbs_low_precision_fp32_stored_lower_then_the_host():
    request = _request()
    rungs = ladder(request, Parallel())
    assert [s.policies for s in rungs] == [(BF16,), (BF16, FP32), (MASTER,), (PURE,), (BF16, FP32)]
    assert [s.what for s in rungs] == ["the model's own dtype", "the model's own dtype", "stored bf16-master",
                                       "stored bf16", "the states on the host"]
    # by hand, AdamW (two moments): fp32 4 + 4 + 8; bf16 with an fp32 master 2 + 2 + 4 + 8; pure bf16 2 + 2 + 4
    assert [s.floor_bytes for s in rungs] == [16 * N, 16 * N, 16 * N, 8 * N, None]
    # the optimizer may step in backward only on the last rung in the model's own dtype, before storing lower
    assert [s.in_backward for s in rungs] == [(), (BF16, FP32), (), (), ()]
    host = rungs[-1]
    assert host.host_check and not host.skippable
    assert host.parallel == Parallel(strategy="fsdp2", world_size=1, shard_units=shard_units(request.model),
                                     offload_states=True)
    assert all(s.parallel == Parallel() and s.skippable and not s.host_check for s in rungs[:-1])
    assert states_floor(rungs) is None  # the host rung has no floor on the device


def test_without_the_host_rung_the_last_is_never_skipped():
    rungs = ladder(_request(offload=False), Parallel())
    assert [s.skippable for s in rungs] == [True, True, True, False]
    assert [s.skipped(1) for s in rungs] == [True, True, True, False]  # 1 byte: all but the last pass over
    assert not any(s.skipped(16 * N) for s in rungs)  # floors are not over the budget: every rung is analysed
    assert states_floor(rungs) == 8 * N


def test_the_cpu_has_one_rung_and_sgd_keeps_one_buffer():
    rungs = ladder(_request(device="cpu", gpu=None, policies=(FP32, BF16), stored=(), offload=False,
                            optimizer="sgd"), Parallel())
    assert rungs == (Stage(what="the model's own dtype", policies=(FP32, BF16), parallel=Parallel(),
                           in_backward=(FP32, BF16), floor_bytes=12 * N, skippable=False),)  # momentum: 4 + 4 + 4


def test_clipping_ranks_and_grad_scaling_keep_the_optimizer_out_of_backward():
    assert all(not s.in_backward for s in ladder(_request(clip=1.0), Parallel()))
    ddp = Parallel(strategy="ddp", world_size=2)
    assert all(not s.in_backward for s in ladder(_request(world_size=2, offload=False), ddp))
    fp16 = ladder(_request(gpu="V100-32GB", policies=(FP16, FP32), stored=(), offload=False), Parallel())
    assert [s.in_backward for s in fp16] == [(), (FP32,)]  # fp16 needs a GradScaler, which steps after backward


def test_ddp_has_no_host_rung_and_fsdp2_shards_the_floor_then_offloads_every_rank():
    request = _request(world_size=2, stored=())
    fsdp2 = Parallel(strategy="fsdp2", world_size=2, shard_units=("0", "1", "2"))
    rungs = ladder(request, fsdp2)
    # then every precision again, reduce-scattering after every micro-batch (Note [gradient sync under accumulation]),
    # then every rank's shard of the states on its host (ZeRO-3 gathers one unit at a time: no floor)
    reducing = replace(fsdp2, reduce_every_micro_batch=True)
    host = replace(fsdp2, offload_states=True)
    assert [s.parallel for s in rungs] == [fsdp2, fsdp2, reducing, host]
    assert [s.floor_bytes for s in rungs] == [16 * N // 2] * 3 + [None]
    assert [s.skippable for s in rungs] == [True, True, True, False]
    assert rungs[-1].host_check
    # ZeRO-2 keeps every unit gathered from forward to backward, in bf16 at least (2 B); a reshard to 2 of 4 half
    zero2 = ladder(request, replace(fsdp2, reshard_after_forward=False))
    assert [s.floor_bytes for s in zero2] == [16 * N // 2 + 2 * N] * 3 + [2 * N]
    assert zero2[-1].host_check and zero2[-1].skipped(2 * N - 1) and not zero2[-1].skipped(2 * N)
    four = _request(world_size=4, stored=())
    assert ladder(four, replace(fsdp2, world_size=4, reshard_after_forward=2))[-1].floor_bytes == N
    assert not any(s.host_check for s in ladder(_request(world_size=2, stored=(), offload=False), fsdp2))
    ddp = ladder(request, Parallel(strategy="ddp", world_size=2))
    assert not any(s.host_check for s in ddp) and states_floor(ddp) == 16 * N


def test_a_deferring_rung_whose_unsharded_gradients_miss_the_budget_is_skipped():
    # Note [a deferral that cannot fit]: over 2 ranks the sharded states are 16 N / 2 B; deferring the reduce-scatter
    # holds every gradient unsharded in fp32 (4 N, FSDP2's reduce dtype under bf16 autocast; the fp32 policy's own
    # dtype is 4 B too) instead of the floor's sharded 4 N / 2: 8 N + 4 N - 2 N = 10 N in all
    request = _request(world_size=2, stored=(), offload=False)
    fsdp2 = Parallel(strategy="fsdp2", world_size=2, shard_units=("0", "1", "2"))
    rungs = ladder(request, fsdp2)
    assert [s.parallel.reduce_every_micro_batch for s in rungs] == [False, False, True]
    assert [s.accumulating_floor for s in rungs] == [10 * N, 10 * N, None]
    assert [s.skipped(10 * N - 1) for s in rungs] == [True, True, False]
    assert not any(s.skipped(10 * N) for s in rungs)
    # a bf16-built model: bf16 autocast still reduces in fp32 (4 N), the fp32 policy keeps bf16 gradients (2 N),
    # the rung of both policies takes the cheaper; the floor's sharded gradients are bf16 (2 N / 2)
    built = replace(request, model=_model().to(torch.bfloat16))
    floors = [s.accumulating_floor - s.floor_bytes for s in ladder(built, fsdp2)[:2]]
    assert floors == [4 * N - N, 2 * N - N]
    # one process: no FSDP2 over data ranks, nothing defers
    assert all(s.accumulating_floor is None for s in ladder(_request(stored=(), offload=False), Parallel()))


def test_skipped_rungs_are_named_once_in_the_note_of_the_rung_that_fits():
    request = _request()
    rungs = ladder(request, Parallel())
    assert skipped_note(rungs[1], []) == ()
    (note,) = skipped_note(rungs[3], ["the model's own dtype (1.0 GiB)", "the model's own dtype (1.0 GiB)"])
    assert note.startswith("skipped without analysis") and note.count("own dtype") == 1
    (note,) = skipped_note(rungs[-1], ["stored bf16 (0.5 GiB)"])
    assert "live in host memory" in note and "stored bf16 (0.5 GiB)" in note


def test_opt_in_rungs_follow_the_stored_precisions_cumulative_before_the_host():
    from dataclasses import replace

    from autofit.training.chunked_loss import LossChunks
    from autofit.training.optim import as_optimizer_spec

    eight = (as_optimizer_spec("adam"), "bitsandbytes.optim.AdamW8bit")  # any spec: the ladder only carries it
    chunks = LossChunks(head="2")
    request = replace(_request(), allow_chunked_loss=chunks, allow_eight_bit=eight)
    rungs = ladder(request, Parallel())
    assert [s.what for s in rungs] == ["the model's own dtype", "the model's own dtype", "stored bf16-master",
                                       "stored bf16", "chunked cross-entropy (8 chunks)", "8-bit optimizer state",
                                       "the states on the host"]
    assert [s.opt_in for s in rungs] == [(), (), (), (), ("chunked-loss",), ("chunked-loss", "8bit-optimizer"), ()]
    assert rungs[4].policies == rungs[5].policies == (PURE,)
    assert rungs[4].in_backward == rungs[5].in_backward == (PURE,)  # pure bf16 keeps no master copy
    # by hand, pure bf16 stepped in backward (no gradient kept): parameters 2 + AdamW's moments 2 + 2; 8-bit 1 + 1
    assert [rungs[4].floor_bytes, rungs[5].floor_bytes] == [6 * N, 4 * N]
    stepped = rungs[5].request_for(request)
    assert stepped.optimizer is eight[0] and stepped.low_bit_optimizer == eight[1] and stepped.chunked_loss == chunks
    assert rungs[0].request_for(request) is request
    # data-parallel layouts get no opt-in rung (the distributed trainers build neither)
    assert not any(s.opt_in for s in ladder(replace(request, world_size=2, offload=False),
                                            Parallel(strategy="ddp", world_size=2)))


def test_a_layout_with_no_reduce_scatter_to_move_has_no_reducing_rung():
    """Tensor parallel over every rank runs no fully_shard (its data ranks are 1): reducing every micro-batch would
    run the same step as the rung before it, so the ladder has no such rung; FSDP2 x TP over data ranks has one.
    (Before, the pure tensor-parallel ladder searched the same step twice, the second named "FSDP2 reducing every
    micro-batch".)"""
    request = _request(world_size=2, stored=(), offload=False)
    tp = Parallel(strategy="fsdp2", world_size=2, tensor_parallel=2, tensor_plan=(("0", "colwise"),))
    assert not tp.defers_gradients
    assert [s.parallel for s in ladder(request, tp)] == [tp, tp]  # the model's own dtype, both precisions
    both = Parallel(strategy="fsdp2", world_size=4, tensor_parallel=2, tensor_plan=(("0", "colwise"),))
    four = ladder(_request(world_size=4, stored=(), offload=False), both)
    assert [s.parallel.reduce_every_micro_batch for s in four] == [False, False, True]
