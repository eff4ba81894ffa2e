"""Offloading (Note [offload], docs/offload.md): activations through ``save_on_cpu``, parameters, gradients and
optimizer state through FSDP2's ``CPUOffloadPolicy``. Truths: a plain full-batch step for the trained parameters, the
CPU allocator, hand counts of the tensors ``save_on_cpu`` packs, and hand computations of the transfer terms."""

from __future__ import annotations

import copy
import sys
import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import autofit
from autofit.analyse.table import OpCosts
from autofit.cuda.catalog import GPUS, pcie_bytes_per_second
from autofit.device import resolve_device
from autofit.core.errors import InvalidInputError
from autofit.parallel.layout import Parallel
from autofit.parallel.choices import shard_units
from autofit.solve.time_model import HOST_OPTIMIZER_BYTES_PER_SECOND, LayoutTime, TimeModel

BLOCKS = [str(i) for i in range(6)]


def _model(width: int = 256) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(6)], nn.Linear(width, 10))


def _data(rows: int, width: int = 256):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=g), torch.randint(0, 10, (rows,), generator=g)


def _reference(model: nn.Module, x, y, steps: int = 2, micro_batches: int = 1) -> nn.Module:
    """Plain AdamW steps on the whole batch: what every offloaded configuration must train. ``micro_batches``: the
    batch's mean loss as equal micro-batches accumulated (each loss over its rows times its share), the same
    gradient summed in the order an accumulating step sums it; in fp32 the whole batch at once rounds otherwise, and
    AdamW's first steps divide each gradient by its own magnitude, so a rounding of 1e-7 in a near-zero component can
    move the update by 1e-5 (seen on an AVX-512 CPU: 1.006e-05)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            (nn.functional.cross_entropy(ref(xs), ys) / micro_batches).backward()
        opt.step()
    return ref


def _cpu_plan(model, x, y, **changes) -> autofit.Plan:
    base = autofit.plan(model, x, "1GB", target=y, device="cpu", precision="fp32",
                        savers=autofit.Savers(checkpoint=None))
    return dataclasses.replace(base, **changes)


# ---- activations: save_on_cpu ------------------------------------------------------------------------------------
@pytest.mark.sim
def test_offloaded_activations_train_exactly_the_plain_step_and_unwrap_restores_forward():
    x, y = _data(16)
    model = _model()
    ref = _reference(model, x, y, micro_batches=2)
    plan = _cpu_plan(model, x, y, micro_batch_size=8, gradient_accumulation_steps=2, last_micro_batch_size=8,
                     offload=("1", "3"), checkpoint=("0",))
    trained = {}
    for offload in ((), ("1", "3")):
        mine = copy.deepcopy(model)
        trainer = dataclasses.replace(plan, offload=offload).wrap(mine, torch.optim.AdamW(mine.parameters(), lr=1e-2))
        for _ in range(2):
            trainer.step(x, y)
        assert trainer.micro_batches == 2
        out = trainer.unwrap()
        assert all("forward" not in m.__dict__ for m in out.modules())
        trained[offload] = out
    for a, b, c in zip(ref.parameters(), trained[()].parameters(), trained[("1", "3")].parameters()):
        assert torch.equal(c, b)  # offloading changes no number of the step
        torch.testing.assert_close(c, a, rtol=0, atol=1e-5)  # and the window trains the full batch


@pytest.mark.sim
def test_on_the_cpu_offloading_activations_is_free_and_estimate_equals_measure():
    """On a CPU target host and device are one memory: save_on_cpu's pack returns the tensor itself
    (``tensor.cpu()``), so the measured peak does not move, and the estimate follows the allocator."""
    x, y = _data(64)
    model = _model()
    kw = dict(target=y)
    plain = autofit.measure(model, x, step=64, **kw).peak_bytes
    measured = autofit.measure(model, x, step=autofit.Step(micro_batch_size=64, offload=BLOCKS), **kw).peak_bytes
    assert measured == plain
    assert autofit.estimate(model, x, step=autofit.Step(micro_batch_size=64,
                                                        offload=BLOCKS), **kw).peak_bytes == measured


@pytest.mark.sim
def test_on_a_gpu_the_host_holds_exactly_what_save_on_cpu_packs():
    """Hand count, fp32, rows r = 512, width 256: each Linear saves its input (r x 256 x 4 = 524,288 B) and, when
    its input needs a gradient, its weight (256 x 256 x 4 = 262,144 B); each GELU saves its input (524,288 B).
    Block 0's input needs no gradient, so it saves no weight. All six blocks' packs are alive at the end of forward:
    5 x 1,310,720 + 1,048,576 = 7,602,176 B of host memory."""
    x, y = _data(512)
    model = _model()
    kw = dict(target=y, device="T4")
    plain = autofit.estimate(model, x, step=512, **kw)
    offloaded = autofit.estimate(model, x, step=autofit.Step(micro_batch_size=512, offload=BLOCKS), **kw)
    assert plain.host_bytes == 0
    assert offloaded.host_bytes == 5 * (524_288 + 262_144 + 524_288) + (524_288 + 524_288) == 7_602_176
    assert offloaded.peak_bytes < plain.peak_bytes  # the saved activations left the device
    recomputed = autofit.estimate(model, x, step=autofit.Step(micro_batch_size=512, checkpoint=BLOCKS), **kw)
    # the memory model counts an offloaded module as recomputed: that must never be below what offloading holds
    assert offloaded.peak_bytes <= recomputed.peak_bytes


@pytest.mark.sim
def test_a_module_cannot_be_both_recomputed_and_offloaded():
    x, y = _data(4)
    with pytest.raises(InvalidInputError, match="both recomputed and offloaded"):
        autofit.estimate(_model(), x, target=y,
                         step=autofit.Step(micro_batch_size=4, checkpoint=["1"], offload=["1.0"]))
    with pytest.raises(InvalidInputError, match="no module named|not a module|offload"):
        autofit.estimate(_model(), x, target=y, step=autofit.Step(micro_batch_size=4, offload=["nope"]))


# ---- states: FSDP2 CPUOffloadPolicy on one process ------------------------------------------------------------------
@pytest.mark.sim
def test_offloaded_states_train_exactly_the_plain_step_on_one_process():
    x, y = _data(8, 32)
    model = _model(32)
    ref = _reference(model, x, y)
    plan = _cpu_plan(model, x, y, micro_batch_size=4, gradient_accumulation_steps=2, last_micro_batch_size=4,
                     parallel=Parallel(strategy="fsdp2", offload_states=True, shard_units=shard_units(model)))
    hook = sys.excepthook
    trainer = plan.wrap(copy.deepcopy(model), lambda params: torch.optim.AdamW(params, lr=1e-2))
    for _ in range(2):
        trainer.step(x, y)
    assert trainer.micro_batches == 2
    assert all(p.to_local().device.type == "cpu" for p in trainer.model.parameters())
    out = trainer.unwrap()
    assert not dist.is_initialized()  # the one-process group the trainer made is gone
    assert sys.excepthook is hook  # and tracebacks are not left prefixed with "[rank0]" by init_process_group
    for a, b in zip(ref.parameters(), out.parameters()):
        torch.testing.assert_close(b.full_tensor(), a, rtol=1e-5, atol=1e-6)


@pytest.mark.sim
def test_offloaded_states_live_on_the_host_of_a_gpu_target():
    """Hand count, AdamW, fp32: 6 x (256 x 256 + 256) + 256 x 10 + 10 = 397,322 parameters; on the host their
    shards (4 B each), their gradients (4 B) and the two moments (8 B)."""
    x, y = _data(512)
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    assert n == 397_322
    kw = dict(target=y, device="T4")
    plain = autofit.estimate(model, x, step=512, **kw)
    states = autofit.estimate(model, x, step=autofit.Step(micro_batch_size=512, offload_states=True), **kw)
    host = dict(states.host_breakdown)
    assert host["parameters"] == 4 * n
    assert host["gradients"] == 4 * n
    assert host["optimizer_state"] - 8 * n < 1024  # plus AdamW's step counters
    assert states.peak_bytes < plain.peak_bytes
    assert "optimizer_state" not in states.breakdown  # no optimizer state on the device
    # pinned: what crosses PCIe (shards and gradients); the state and the CPU step's temporaries are pageable
    assert states.host_pinned_bytes == 8 * n
    # under accumulation FSDP2 reduces every micro-batch into the host gradients (Note [offload]): the first
    # micro-batch leaves nothing on the device but a scalar's 512-byte block, where keeping its unsharded gradients
    # for the last micro-batch would add 4 n = 1.59 MB
    one, two = (autofit.estimate(model, x, target=y, device="T4",
                                 step=autofit.Step(micro_batch_size=256,
                                                   accumulation_steps=k, offload_states=True, inputs="micro-batch"))
                for k in (1, 2))  # one micro-batch of inputs resident: what differs is the gradients alone
    assert two.peak_bytes - one.peak_bytes <= 512
    assert dict(two.host_breakdown)["gradients"] == 4 * n


def test_measure_refuses_offloaded_states_with_a_reason():
    x, y = _data(4)
    with pytest.raises(InvalidInputError, match="through plan.wrap"):
        autofit.measure(_model(), x, target=y, step=autofit.Step(micro_batch_size=4, offload_states=True))


# ---- time model: transfer terms against hand computations ---------------------------------------------------------
def test_pcie_bandwidth_from_the_link_generation():
    # Gen3 x16: 16 lanes x 8 GT/s x 128/130 / 8 bits = 15.75 GB/s, x 0.8 usable
    assert pcie_bytes_per_second(3) == pytest.approx(16 * 8e9 * 128 / 130 / 8 * 0.8)
    assert GPUS["T4"].host_transfer == pytest.approx(12.6e9, rel=1e-3)
    assert GPUS["A100-80GB"].host_transfer == pytest.approx(2 * GPUS["T4"].host_transfer)
    assert GPUS["H100-80GB"].host_transfer == pytest.approx(4 * GPUS["T4"].host_transfer)
    assert resolve_device("cpu").throughput.host_transfer_bytes_per_second is None


def _hand_model(**kw) -> TimeModel:
    """Two forward ops of 1 GFLOP (per sample 0) in module "a", one backward op of 2 GFLOP, on a device of
    1 TFLOP/s, infinite bandwidth, no launch cost, a 10 GB/s host link."""
    from autofit.device import Throughput

    tp = Throughput(name="hand", flops_per_second={"fp32": 1e12}, bytes_per_second=float("inf"),
                    op_overhead_seconds=0.0, host_transfer_bytes_per_second=10e9)
    ops = OpCosts(flops_fixed=np.array([1e9, 1e9, 2e9]), flops_per_sample=np.zeros(3),
                  bytes_fixed=np.zeros(3), bytes_per_sample=np.zeros(3), precision=("fp32",) * 3,
                  forward=np.array([True, True, False]), module=("a", "a", "a"))
    return TimeModel(tp, ops, host_transfer=10e9, **kw)


def test_activation_offload_time_is_two_copies_not_overlapped():
    # module a saves 10 MB fixed + 1 MB per sample; at 4 samples 14 MB, out and back at 10 GB/s: 2.8 ms per
    # micro-batch; two micro-batches: 5.6 ms on top of 2 x 4 ms of compute
    model = _hand_model(saved_bytes={"a": (10e6, 1e6)})
    t = model.step_time("fp32", 4, 2, offload=("a",))
    assert t.transfer_seconds == pytest.approx(2 * (2 * 14e6 / 10e9))
    assert t.compute_seconds == pytest.approx(2 * 4e-3)
    assert t.total == pytest.approx(8e-3 + 5.6e-3)
    # recomputing a costs its two forward ops again: 2 ms per micro-batch, less than 2.8 ms of copies
    assert model.recompute_seconds("a", 4) == pytest.approx(2e-3)
    assert model.keep_recompute_or_offload(("a",), 4) == (("a",), ())
    cheap = _hand_model(saved_bytes={"a": (1e6, 0.0)})  # 1 MB: 0.2 ms of copies beat 2 ms of recompute
    assert cheap.keep_recompute_or_offload(("a",), 4) == ((), ("a",))


def test_state_offload_time_hides_copies_behind_compute_and_adds_the_cpu_step():
    # 1 GB of fp32 shards: gathered twice per micro-batch and the gradients sent back each micro-batch (3 GB,
    # 0.3 s at 10 GB/s) against 4 ms of compute, so 0.296 s exposed per micro-batch; the CPU step streams 4 GB
    model = _hand_model(layout_time=LayoutTime(host_state_bytes=10**9))
    t = model.step_time("fp32", 4, 2)
    assert t.transfer_seconds == pytest.approx(2 * (0.3 - 4e-3))
    assert t.optimizer_seconds == pytest.approx(4e9 / HOST_OPTIMIZER_BYTES_PER_SECOND)
    small = _hand_model(layout_time=LayoutTime(host_state_bytes=10**6))  # 0.2 ms of copies: hidden entirely
    assert small.step_time("fp32", 4, 1).transfer_seconds == 0.0


# ---- the planner -------------------------------------------------------------------------------------------------
@pytest.mark.sim
def test_plan_keeps_states_on_the_host_when_nothing_else_fits_and_checks_the_host_budget():
    x, y = _data(64)
    model = _model()
    kw = dict(target=y, precision="fp32")
    savers = autofit.Savers(checkpoint="auto")
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(model, x, 1, device="T4", savers=autofit.Savers(checkpoint="auto", offload=False), **kw)
    without = info.value.min_budget_bytes
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(model, x, 1, device="T4", savers=savers, **kw)
    assert "offloaded to the host" in str(info.value) and "without offloading" in str(info.value)
    with_offload = info.value.min_budget_bytes
    assert with_offload < without
    budget = (with_offload + without) // 2
    hook = sys.excepthook
    plan = autofit.plan(model, x, budget, device=autofit.Device(gpu="T4", host_budget="1GB"), savers=savers, **kw)
    assert sys.excepthook is hook  # the simulation's fake process group left no "[rank0]" traceback prefix
    assert plan.parallel.offload_states and plan.parallel.strategy == "fsdp2" and plan.parallel.world_size == 1
    assert plan.device_bytes <= budget
    assert plan.host_bytes >= 16 * 397_322  # parameters, gradients, two moments (fp32)
    assert "host memory" in str(plan)
    assert autofit.Plan.from_json(plan.to_json()).parallel.offload_states
    with pytest.raises(autofit.HostMemoryError, match="host_budget"):
        autofit.plan(model, x, budget, device=autofit.Device(gpu="T4", host_budget=10**6), savers=savers, **kw)
    # below what offloading reaches, with too little host memory for it: the budget that works is the one without
    with pytest.raises(autofit.InfeasibleBudgetError, match="more than host_budget") as info:
        autofit.plan(model, x, 1, device=autofit.Device(gpu="T4", host_budget=10**6), savers=savers, **kw)
    assert info.value.min_budget_bytes >= without > with_offload  # the states stay on the GPU in what it names


@pytest.mark.slow
def test_fsdp2_ranks_keep_their_shards_on_the_host_when_nothing_else_fits():
    """FSDP2 over 2 ranks on T4s, 6 x (1024 x 1024 + 1024) + 1024 x 10 + 10 = 6,307,850 parameters, every dimension
    even: a rank's host holds half of each fp32 parameter (4 B), gradient (4 B) and two moments (8 B). The two ranks
    of one node share its host memory; on two nodes of one GPU each host holds one rank's."""
    x, y = _data(64, 1024)
    model = _model(1024)
    n = sum(p.numel() for p in model.parameters())
    assert n == 6_307_850
    kw = dict(target=y, precision="fp32")
    fsdp2 = autofit.Layout(world_size=2, strategy="fsdp2")
    savers = autofit.Savers(checkpoint="auto")
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(model, x, 1, device=autofit.Device(gpu="T4", margin=0),
                     savers=autofit.Savers(checkpoint="auto", offload=False), layout=fsdp2, **kw)
    without = info.value.min_budget_bytes
    budget = without - 2**20  # nothing fits with the states on the GPUs
    plan = autofit.plan(model, x, budget, device=autofit.Device(gpu="T4", margin=0, host_budget="1GB"), savers=savers,
                        layout=fsdp2, **kw)
    assert plan.parallel.offload_states and plan.parallel.strategy == "fsdp2" and plan.parallel.world_size == 2
    assert plan.device_bytes <= budget
    host = dict(plan.estimate.host_breakdown)
    assert host["parameters"] == host["gradients"] == 4 * n // 2
    assert host["optimizer_state"] - 8 * n // 2 < 1024  # plus AdamW's step counters
    assert "for the 2 ranks of a node" in str(plan)
    one_rank = plan.host_bytes
    short = autofit.Device(gpu="T4", margin=0, host_budget=one_rank + one_rank // 2)
    with pytest.raises(autofit.HostMemoryError, match="for the 2 ranks of a node"):
        autofit.plan(model, x, budget, device=short, savers=savers, layout=fsdp2, **kw)
    apart = autofit.plan(model, x, budget, device=short, savers=savers,
                         layout=autofit.Layout(world_size=2, strategy="fsdp2", gpus_per_node=1), **kw)
    assert apart.parallel.offload_states and apart.host_bytes == one_rank


@pytest.mark.slow(seconds=420)
def test_gpt2_xl_on_a_t4_plans_with_its_states_on_the_host():
    """Issue 15's case: GPT-2-XL (48 x 1600, 1,557,611,200 parameters, fp32 on meta), a 16 GB T4 (no bf16: fp16),
    effective batch 32 x 1024, 90 % of the card; a T4 machine with 64 GB of RAM. Without offload the states alone
    (16 B/param, 23.2 GiB) exceed the card."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=48, n_embd=1600, n_head=25, n_positions=1024, use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == 1_557_611_200
    ids = torch.zeros(32, 1024, dtype=torch.long)
    plan = autofit.plan(model, {"input_ids": ids, "labels": ids}, "90%",
                        device=autofit.Device(gpu="T4", host_budget="64GB"))
    assert plan.parallel.offload_states and plan.precision.name == "fp16"
    assert plan.device_bytes <= plan.budget_bytes == int(0.9 * 16 * 2**30)
    assert plan.host_bytes >= 16 * 1_557_611_200
    assert "host memory" in str(plan)


@pytest.mark.sim
def test_planning_with_fsdp2_repeats_none_of_its_warnings_about_user_code():
    """FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip the all-gather). The last
    stage simulates FSDP2 on every configuration it tries: the warning is about training code, not a plan."""
    import warnings

    from zoo import ZOO

    case = ZOO["lstm"]()  # nn.LSTM's output is a view
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(autofit.InfeasibleBudgetError, match="offloaded to the host"):
            autofit.plan(case.model, case.sample, 1, batch_size=32, target=case.target, device="A100-80GB")
    assert not [w for w in caught if "returned a view tensor" in str(w.message)]
