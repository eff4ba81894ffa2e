"""DDP's bucket views (Note [DDP's bucket views], autofit/parallel/simulated.py; issue 39). A DDP plan counts the
gradients inside DDP's buckets (``gradient_as_bucket_view=True``, as autofit's trainer wraps the model); torch's
default keeps a second gradient-sized copy. The exports set the mode in each framework's own object, built here for
real; ``estimate`` takes either mode, says which, and is held to the CPU allocator of two gloo ranks in each."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import autofit
from autofit.emit.export import to_accelerate_config, to_hf_training_arguments, to_lightning_trainer

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


@pytest.fixture(scope="module")
def ddp_plan() -> autofit.Plan:
    """A small CPU plan laid out as DDP over two ranks (its layout replaced: the exports read the plan's fields)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    plan = autofit.plan(model, torch.randn(8, 16), "1GB", target=torch.randint(0, 4, (8,)),
                        loss_fn=nn.CrossEntropyLoss(), precision="fp32", device="cpu")
    return replace(plan, parallel=replace(plan.parallel, world_size=2, strategy="ddp"), batch_size=16)


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps its state in process-wide singletons: each test builds its own and leaves none behind."""
    state = pytest.importorskip("accelerate.state")
    yield
    state.AcceleratorState._reset_state(True)
    state.GradientState._reset_state()


@pytest.mark.sim
def test_lightning_export_builds_a_ddp_strategy_with_bucket_views(ddp_plan):
    strategies = pytest.importorskip("lightning.pytorch.strategies")
    out = to_lightning_trainer(ddp_plan)
    strategy = strategies.DDPStrategy(**out["ddp_strategy"])
    # what DDPStrategy passes to DistributedDataParallel (lightning/pytorch/strategies/ddp.py, _setup_model)
    assert strategy._ddp_kwargs["gradient_as_bucket_view"] is True
    assert not strategies.DDPStrategy()._ddp_kwargs.get("gradient_as_bucket_view", False)  # 'ddp' alone: off
    assert any("DDPStrategy(**ddp_strategy)" in n for n in out["autofit_notes"])


@pytest.mark.sim
def test_accelerate_export_builds_an_accelerator_with_bucket_views(ddp_plan, fresh_accelerate_state):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import DistributedDataParallelKwargs

    out = to_accelerate_config(ddp_plan)
    accelerator = accelerate.Accelerator(**out["accelerator"],
                                         kwargs_handlers=[DistributedDataParallelKwargs(**out["ddp_kwargs"])])
    # what Accelerator.prepare_model passes to DistributedDataParallel
    assert accelerator.ddp_handler.to_kwargs()["gradient_as_bucket_view"] is True
    assert out["config_file"]["distributed_type"] == "MULTI_GPU"


@pytest.mark.sim
def test_hf_export_sets_bucket_views_on_the_trainers_accelerator(ddp_plan, tmp_path, fresh_accelerate_state):
    transformers = pytest.importorskip("transformers")
    from autofit.integrations.hf import bucket_views, training_arguments

    out = to_hf_training_arguments(ddp_plan)
    assert out["ddp_kwargs"] == {"gradient_as_bucket_view": True}
    assert any("bucket_views(trainer)" in n for n in out["autofit_notes"])
    args = training_arguments(ddp_plan, output_dir=str(tmp_path), report_to=[], use_cpu=True)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    trainer = transformers.Trainer(model=model, args=args)
    before = trainer.accelerator.ddp_handler.to_kwargs()
    assert not before.get("gradient_as_bucket_view", False)  # the Trainer's own: torch's default
    assert bucket_views(trainer) is trainer
    after = trainer.accelerator.ddp_handler.to_kwargs()
    assert after == {**before, "gradient_as_bucket_view": True}  # the Trainer's other DDP settings kept
    with pytest.raises(autofit.InvalidInputError, match="transformers.Trainer"):
        bucket_views(object())


def test_a_bucket_mode_without_ddp_is_refused():
    model = nn.Linear(4, 2)
    with pytest.raises(autofit.InvalidInputError, match="strategy='ddp'"):
        autofit.estimate(model, torch.randn(2, 4), step=autofit.Step(micro_batch_size=2, gradient_as_bucket_view=False))


def _weight_heavy_mlp():
    """Three 256-wide layers at 2 rows per rank: the step peaks at the optimizer step, where the gradients live."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    return model, torch.randn(4, 256), dict(target=torch.randint(0, 4, (4,)), loss_fn=nn.CrossEntropyLoss(),
                                            micro_batch_size=2)


def _tiny_llama():
    from sharded_models import tiny_llama

    case = tiny_llama()
    return case.model, case.sample, dict(micro_batch_size=4)


# (model, accumulation steps, whether the bucket mode moves the peak)
CASES = [(_weight_heavy_mlp, 1, True), (_tiny_llama, 2, False), (_tiny_llama, 3, False)]


@pytest.mark.slow
@pytest.mark.parametrize("build,accumulation_steps,differ", CASES, ids=["mlp-1", "llama-2", "llama-3"])
def test_estimate_of_each_bucket_mode_is_the_allocators_on_gloo(build, accumulation_steps, differ):
    """Two gloo ranks of DDP: the estimate of one rank in each bucket mode against each rank's CPU allocator (held
    within 0.5 %, as every layout in tests/test_measure_layouts.py), and the mode named in the estimate's notes.
    The weight-heavy MLP peaks at the optimizer step: without bucket views its rank holds one more copy of the
    gradients, at least their bytes (fp32, a hand count of the parameters). Accumulating, the micro-batches before
    the last run under no_sync(), where the gradients live apart from the buckets in either mode, so the tiny
    Llama, which peaks in a later micro-batch, holds both copies either way (Note [DDP's bucket views])."""
    model, sample, kw = build()
    kw = dict(kw, layout=autofit.Layout(world_size=2, strategy="ddp"))
    rows = kw.pop("micro_batch_size")
    gradient_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    peaks = {}
    for views in (True, False):
        step = autofit.Step(micro_batch_size=rows, accumulation_steps=accumulation_steps,
                            gradient_as_bucket_view=views)
        est = autofit.estimate(model, sample, step=step, **kw)
        measured = autofit.measure(model, sample, step=step, **kw)
        assert any(f"gradient_as_bucket_view={views}" in n for n in est.notes), est.notes
        for rank, peak in enumerate(measured.rank_peaks):
            print(f"views={views} k={accumulation_steps} rank {rank}: predicted {est.peak_bytes} measured {peak}")
            assert abs(est.peak_bytes - peak) <= 0.005 * peak, (views, rank, est.peak_bytes, measured.rank_peaks)
        peaks[views] = measured.peak_bytes
    if differ:
        assert peaks[False] - peaks[True] >= gradient_bytes, (peaks, gradient_bytes)
    else:
        assert peaks[False] == peaks[True], peaks
