"""Reference tests: ``estimate`` against ``measure`` (the CPU allocator's own record) on every zoo architecture.

The matrix is every zoo case x precision {fp32, bf16} x checkpoint {none, the case's blocks} x optimizer {adam, sgd},
plus a handful of gradient-accumulation and fp16 (GradScaler) configurations. The tolerance is 1 % of the measured
peak, the accuracy PyTorch's MemTracker reaches on plain CNNs and transformers (docs/accuracy.md).
"""

from __future__ import annotations

import dataclasses

import pytest

import autofit

try:
    from tests.zoo import ZOO, ZooCase, cpu_cannot_run
except ImportError:  # tests/ on sys.path rather than the repository root
    from zoo import ZOO, ZooCase, cpu_cannot_run

TOLERANCE = 0.01

PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adam", "sgd")
CHECKPOINTING = ("none", "blocks")


def _compare(case: ZooCase, **knobs) -> None:
    # the truth is a real step on this CPU: where it cannot run (no bf16 LSTM without AVX-512), there is none
    reason = cpu_cannot_run(case.name, knobs.get("precision", "fp32"))
    if reason is not None:
        pytest.skip(reason)
    step = dataclasses.replace(knobs["step"], micro_batch_size=case.micro_batch_size)  # the case's rows
    kwargs = dict(target=case.target, loss_fn=case.loss_fn, device="cpu", **dict(knobs, step=step))
    meas = autofit.measure(case.model, case.sample, **kwargs)
    est = autofit.estimate(case.model, case.sample, **kwargs)
    error = (est.peak_bytes - meas.peak_bytes) / meas.peak_bytes
    config = ", ".join(f"{k}={v!r}" for k, v in knobs.items())
    assert abs(error) <= TOLERANCE, (
        f"{case.name} [{config}]: estimated {est.peak_bytes:,} B vs measured {meas.peak_bytes:,} B "
        f"({100 * error:+.2f} %, diff {est.peak_bytes - meas.peak_bytes:+,} B)\n{est}\n{meas}"
    )


@pytest.mark.sim
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_estimate_matches_measure(name: str, precision: str, checkpointing: str, optimizer: str, zoo_case) -> None:
    case = zoo_case(name)  # estimate and measure leave the model as it was (Note [shared zoo cases])
    checkpoint = case.checkpoint if checkpointing == "blocks" else ()
    _compare(case, precision=precision, step=autofit.Step(checkpoint=checkpoint), optimizer=optimizer)


# A handful beyond the main matrix: accumulation (gradients alive across micro-batches) and fp16 (GradScaler state,
# unscale and inf checks in the optimizer step).
EXTRA = [
    ("resnet_bn", dict(precision="fp32", optimizer="adamw", accumulation_steps=2)),
    ("gpt_sdpa", dict(precision="bf16", optimizer="adam", accumulation_steps=2, checkpoint="blocks")),
    ("lstm", dict(precision="fp32", optimizer="sgd", accumulation_steps=2)),
    ("hf_dict", dict(precision="fp32", optimizer="adamw", accumulation_steps=3)),
    ("data_dependent", dict(precision="fp32", optimizer="adam", accumulation_steps=2)),
    ("resnet_bn", dict(precision="fp16", optimizer="adam")),
    ("gpt_sdpa", dict(precision="fp16", optimizer="adamw")),
    ("unet", dict(precision="fp16", optimizer="sgd", checkpoint="blocks")),
    ("tied_lm", dict(precision="fp16", optimizer="adam", accumulation_steps=2)),
    ("gru", dict(precision="fp16", optimizer="sgd")),
]


@pytest.mark.sim
@pytest.mark.parametrize(("name", "knobs"), EXTRA, ids=[
    f"{name}-" + "-".join(f"{k}={v}" for k, v in knobs.items()) for name, knobs in EXTRA
])
def test_estimate_matches_measure_extra(name: str, knobs: dict, zoo_case) -> None:
    case = zoo_case(name)
    knobs = dict(knobs)  # the step's knobs in its Step, the rest as keywords
    step = {k: knobs.pop(k) for k in ("accumulation_steps", "checkpoint") if k in knobs}
    if step.get("checkpoint") == "blocks":
        step["checkpoint"] = case.checkpoint
    _compare(case, step=autofit.Step(**step), **knobs)


def test_zoo_is_deterministic_and_complete() -> None:
    assert len(ZOO) >= 14
    for name, factory in ZOO.items():
        a, b = factory(), factory()
        assert a.name == name and a.checkpoint, name
        modules = dict(a.model.named_modules())
        assert all(c in modules for c in a.checkpoint), (name, a.checkpoint)
        for (pa, ta), (pb, tb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
            assert pa == pb and ta.equal(tb), (name, pa)
