"""Model factories for the ``autofit`` command line (``MODEL`` given as ``path/to/file.py:factory``).

    autofit plan examples/factories.py:small_cnn --budget 50MB --batch-size 32 --device cpu
    autofit plan examples/factories.py:tiny_lm --budget 20MB --batch-size 16 --device cpu --json
    autofit plan examples/factories.py:mlp --input-shape 128 --budget 10MB --batch-size 64 --device cpu

A factory takes no arguments and returns one of
- ``(model, sample, target)``: the target is handed to the loss (integer target: cross-entropy; float: MSE);
- ``(model, sample)``: the model's output is the loss, or has a ``loss`` (as Hugging Face models do);
- ``model``: the command line makes a random sample from ``--input-shape`` (and ``--input-dtype``), with no target.
``sample`` is an example batch whose dim 0 is the batch; its size does not matter, autofit resizes it.

    python examples/factories.py   # plans each factory once, without the command line
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Conv2d(cin, cout, 1, bias=False) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.skip(x))


class SmallCNN(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.block1 = _ConvBlock(3, width)
        self.block2 = _ConvBlock(width, 2 * width)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(self.block1(x), 2)
        return self.head(self.block2(h).mean(dim=(2, 3)))


def small_cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A two-block residual CNN on 32x32 RGB images, 10 classes: ``(model, images, labels)``."""
    torch.manual_seed(0)
    return SmallCNN(), torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))


class _TinyLM(nn.Module):
    """Embedding, one pre-norm Transformer encoder layer with a causal mask, tied output projection. Returns the mean
    next-token cross-entropy of its own input, so the factory needs no target."""

    def __init__(self, vocab: int = 512, dim: int = 64, seq: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t - 1)
        h = self.layer(self.embed(ids[:, :-1]) + self.pos[: t - 1], src_mask=mask, is_causal=True)
        logits = self.norm(h) @ self.embed.weight.T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def tiny_lm() -> tuple[nn.Module, torch.Tensor]:
    """A one-layer causal language model that returns its own loss: ``(model, token ids)``."""
    torch.manual_seed(0)
    return _TinyLM(), torch.randint(0, 512, (2, 33))


def mlp() -> nn.Module:
    """Only a module: the command line builds the sample from ``--input-shape 128``. With no target, the default
    loss needs a scalar output, so the model ends in a mean."""
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 1), nn.Flatten(0), _Mean())


class _Mean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean()


if __name__ == "__main__":
    import autofit

    for name, budget, batch in (("small_cnn", "50MB", 32), ("tiny_lm", "20MB", 16)):
        made = globals()[name]()
        model, sample, target = made if len(made) == 3 else (*made, None)
        plan = autofit.plan(model, sample, budget, batch_size=batch, target=target, device="cpu")
        print(f"{name}: micro-batch {plan.micro_batch_size} x {plan.gradient_accumulation_steps}, "
              f"{plan.precision}, checkpointed: {', '.join(plan.checkpoint) or 'none'}, "
              f"predicted peak {plan.peak_bytes / 2**20:.2f} MiB of {plan.budget_bytes / 2**20:.2f} MiB")
