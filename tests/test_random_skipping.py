"""Layers skipped at random in training (LayerDrop, stochastic depth by layer) are estimated with nothing skipped,
whatever the random state (Note [random layer skipping], autofit/simulate/randomness.py). The truth: the CPU
allocator on the same model with the skipping switched off."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import autofit
from autofit.simulate.randomness import draws_at


class LayerDropMLP(nn.Module):
    """Skips each block when a draw falls below ``p`` (transformers' LayerDrop), or, with ``survival``, keeps it only
    when a draw falls below the survival probability (the other common way to write it)."""

    def __init__(self, p: float, *, survival: bool = False, draw=lambda: torch.rand(())) -> None:
        super().__init__()
        self.p, self.survival, self.draw = p, survival, draw
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                    for _ in range(6))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.training:
                d = self.draw()
                skip = d >= self.p if self.survival else d < self.p
                if skip:
                    continue
            x = x + block(x)
        return self.head(x)


def test_draws_at_extremes() -> None:
    """Hand-checked: a decision-sized draw at the top stays below its upper bound, at the bottom equals its lower;
    noise-sized draws and draws with a size keep their values."""
    with draws_at("top") as top:
        assert 0.999 < float(torch.rand(())) < 1.0
        assert 2.99 < float(torch.empty(2).uniform_(-1, 3)[0]) < 3.0
        assert 0.999 < random.random() < 1.0 and 4.99 < random.uniform(2, 5) < 5.0
        assert 0.999 < np.random.random() < 1.0 and 0.999 < np.random.uniform(0, 1) < 1.0
        assert torch.rand(10_000).std() > 0.1 and np.random.rand(1000).std() > 0.1
    assert top.count == 6
    with draws_at("bottom") as bottom:
        assert float(torch.rand(())) == 0.0 and random.uniform(2, 5) == 2.0 and np.random.random() == 0.0
    assert bottom.count == 3
    assert random.random() != random.random()  # restored


def _sample() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


@pytest.mark.sim
@pytest.mark.parametrize("survival", [False, True], ids=["draw<p-skips", "draw<survival-keeps"])
def test_layerdrop_estimate_is_the_step_with_nothing_skipped(survival: bool) -> None:
    x, y = _sample()
    torch.manual_seed(0)
    model = LayerDropMLP(0.9 if survival else 0.5, survival=survival)
    never = LayerDropMLP(1.0 if survival else 0.0, survival=survival)  # the same model, no layer ever skipped
    never.load_state_dict(model.state_dict())
    truth = autofit.measure(never, x, target=y, step=32).peak_bytes
    for seed in range(4):
        torch.manual_seed(seed)
        est = autofit.estimate(model, x, target=y, step=32)
        assert est.peak_bytes == truth, (seed, est.peak_bytes, truth)  # an MLP is exact: equal, not only above
        assert any("random draws" in n for n in est.notes)


@pytest.mark.sim
def test_python_random_layerdrop_and_plan_note() -> None:
    x, y = _sample()
    torch.manual_seed(0)
    model = LayerDropMLP(0.5, draw=lambda: random.uniform(0, 1))
    never = LayerDropMLP(0.0)
    never.load_state_dict(model.state_dict())
    truth = autofit.measure(never, x, target=y, step=32).peak_bytes
    for seed in range(3):
        random.seed(seed)
        assert autofit.estimate(model, x, target=y, step=32).peak_bytes == truth
    plan = autofit.plan(model, x, truth, target=y, device="cpu", precision="fp32", savers=autofit.Savers(checkpoint=()))
    assert any("random draws" in n for n in plan.notes)


def _wav2vec2(layerdrop: float):
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        vocab_size=16, layerdrop=layerdrop)
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(config)


@pytest.mark.sim
@pytest.mark.slow
def test_wav2vec2_default_layerdrop_over_seeds() -> None:
    """transformers' default layerdrop=0.1 and SpecAugment (mask_time_prob=0.05, a real run): every seed's estimate
    is at least the allocator's step of the same model with layerdrop=0 (and equal, the model being otherwise
    exact)."""
    model, never = _wav2vec2(0.1), _wav2vec2(0.0)
    never.load_state_dict(model.state_dict())
    x = torch.randn(2, 4000, generator=torch.Generator().manual_seed(0))

    def loss(out):
        return out.logits.float().pow(2).mean()

    torch.manual_seed(0)
    np.random.seed(0)
    truth = autofit.measure(never, x, loss_fn=loss, step=2).peak_bytes
    for seed in (0, 4, 6):  # with the real generator, 4 and 6 skip a layer: 30,853,606 B against 40,210,742 B
        torch.manual_seed(seed)
        np.random.seed(seed)
        est = autofit.estimate(model, x, loss_fn=loss, step=2)
        assert est.peak_bytes >= truth, (seed, est.peak_bytes, truth)
        assert est.peak_bytes <= truth * 1.001, (seed, est.peak_bytes, truth)
        assert any("random draws" in n for n in est.notes)
