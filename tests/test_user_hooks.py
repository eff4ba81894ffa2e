"""Hooks of the user's model that keep tensors (feature extraction) during estimate, plan and measure: what they keep
is counted, and what they reach is given back as it was, never holding autofit's fake or copied tensors (Note [user
hooks], autofit/capture/user_hooks.py). Truths: the CPU allocator (autofit.measure) and a hand count of the kept
output."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

import autofit
from autofit.capture.user_hooks import user_hooks_restored
from autofit.core._torch import FakeTensor
from steady_truth import plain_steps_peak

FEATURES: dict[str, list] = defaultdict(list)  # a module-level store, as feature-extraction code often has


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def _sample() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


class Keeper:
    def __init__(self) -> None:
        self.outputs: dict[str, torch.Tensor] = {}

    def hook(self, module, args, output) -> None:
        self.outputs["head"] = output
        self.last = output


def _fakes(*stores) -> list:
    found = []
    for store in stores:
        values = store.values() if isinstance(store, dict) else store
        for v in values:
            found += _fakes(v) if isinstance(v, (list, dict)) else [v] if isinstance(v, FakeTensor) else []
    return found


def test_hook_state_is_given_back() -> None:
    model, (x, _) = _model(), _sample()
    kept, earlier = [], torch.ones(1)
    kept.append(earlier)
    model[1].register_forward_hook(lambda m, a, out: kept.append(out))
    with user_hooks_restored(model) as record:
        model(x)
        assert len(kept) == 2
    assert kept == [earlier] and kept[0] is earlier
    assert record.kept == ["forward hook on '1'"]


@pytest.mark.sim
def test_kept_outputs_counted_and_no_fake_tensor_left() -> None:
    model, (x, y) = _model(), _sample()
    kept: list = []
    keeper = Keeper()
    handles = [model[1].register_forward_hook(lambda m, a, out: kept.append(out)),
               model[0].register_forward_hook(lambda m, a, out: FEATURES["linear"].append(out)),
               model[2].register_forward_hook(keeper.hook)]
    hooked_est = autofit.estimate(model, x, target=y, step=32)
    assert kept == [] and not FEATURES and keeper.outputs == {} and not hasattr(keeper, "last")
    assert any("kept tensors during the step" in n for n in hooked_est.notes)
    plan = autofit.plan(model, x, 10**6, target=y, device="cpu", precision="fp32")
    assert _fakes(kept, FEATURES, keeper.outputs) == [] and kept == [] and not FEATURES
    assert plan.peak_bytes <= 10**6
    # the figures of the hooks that append (the keeper replaces its tensor each step: the measured steady step frees
    # the warm-up's one inside the window, a term of the step before that neither figure is about)
    handles.pop().remove()
    appending = autofit.estimate(model, x, target=y, step=32).peak_bytes
    hooked = autofit.measure(model, x, target=y, step=32).peak_bytes  # the allocator, hooks running
    assert kept == [] and not FEATURES  # measure's copy gives its real tensors back too
    # the steady step: the lists hold the step before's outputs too (Note [kept across steps]); the truth is a plain
    # loop's second step under the profiler, which sees the earlier step's tensors made inside its window
    steady = plain_steps_peak(model, x, y, reset=lambda: (kept.clear(), FEATURES.clear()))
    kept.clear()
    FEATURES.clear()
    for h in handles:
        h.remove()
    plain = autofit.measure(model, x, target=y, step=32).peak_bytes
    assert appending == steady
    assert hooked == steady  # measure counts what its warm-up left alive once (Note [memory from before the window])
    assert hooked > plain  # what the hooks keep costs memory in the real step, and the estimate has it
    assert autofit.estimate(model, x, target=y, step=32).peak_bytes == plain
