"""Repetition the simulator skips, against simulating it: the micro-batches of an accumulation window.

Every micro-batch after the first starts from the same live set (parameters, optimizer state, accumulated
gradients) and runs the same ops on a batch of the same shape, so the simulator runs two (``WINDOW_MICRO_BATCHES``)
and takes the window's peak from them. Here the truth is the same simulation run over every micro-batch: the peak,
its breakdown, where it falls and (on a GPU target) the caching allocator's reserve and the device total must be
equal to the byte, with recomputed modules and accumulation, on architectures of the accuracy zoo.
"""

from __future__ import annotations

import pytest
from torch import nn

import autofit
from autofit.simulate import window as simulation

pytestmark = pytest.mark.sim  # the simulation tier (tests/conftest.py)

CASES = ["resnet_bn", "gpt_sdpa", "lstm", "torch_encoder", "unet", "hf_dict", "shared_twice"]


def _recomputed(model: nn.Module) -> list[str]:
    """Two modules with parameters, one level below the root or deeper: what a plan would checkpoint."""
    names = [n for n, m in model.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    return names[1:3]


def _estimates(case, monkeypatch, **kw):
    monkeypatch.setattr(simulation, "WINDOW_MICRO_BATCHES", 2)
    short = autofit.estimate(case.model, case.sample, target=case.target, loss_fn=case.loss_fn, **kw)
    monkeypatch.setattr(simulation, "WINDOW_MICRO_BATCHES", 10**6)  # every micro-batch
    full = autofit.estimate(case.model, case.sample, target=case.target, loss_fn=case.loss_fn, **kw)
    return short, full


def _same(short, full) -> None:
    assert short.peak_bytes == full.peak_bytes
    assert dict(short.breakdown) == dict(full.breakdown)
    assert (short.peak_phase, short.peak_at) == (full.peak_phase, full.peak_at)
    assert short.peak_reserved_bytes == full.peak_reserved_bytes
    assert short.device_bytes == full.device_bytes


@pytest.mark.parametrize("name", CASES)
def test_two_micro_batches_decide_the_window_on_the_cpu(name, monkeypatch, zoo_case):
    case = zoo_case(name)
    short, full = _estimates(case, monkeypatch, device="cpu",
                             step=autofit.Step(micro_batch_size=2,
                                               accumulation_steps=5, checkpoint=_recomputed(case.model)))
    _same(short, full)


@pytest.mark.parametrize("name", ["gpt_sdpa", "resnet_bn", "torch_encoder"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_micro_batches_decide_the_window_on_a_gpu(name, precision, monkeypatch, zoo_case):
    """The CUDA model replays the caching allocator over the window: its reserve after the second micro-batch is the
    one every later micro-batch finds."""
    case = zoo_case(name)
    short, full = _estimates(case, monkeypatch, precision=precision, device="A100-80GB",
                             step=autofit.Step(micro_batch_size=2,
                                               accumulation_steps=4, checkpoint=_recomputed(case.model)))
    _same(short, full)
