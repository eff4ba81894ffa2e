"""Plan and train a small ResNet-style CNN inside a memory budget, then check the prediction against the allocator.

    python examples/cnn.py

What it shows:
1. ``autofit.estimate``: the peak of one training step at the full batch, without allocating anything;
2. ``autofit.plan``: micro-batch, accumulation, precision and checkpointing for a budget 60 % of that peak;
3. ``plan.wrap(model, optimizer)``: two real training steps over the full batch, as planned;
4. ``autofit.measure``: the same step run for real, its peak read from the CPU allocator, next to the estimate.

Everything runs on the CPU in a few seconds (for a GPU, plan with device="cuda", see docs/cuda.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autofit

BATCH_SIZE = 32  # samples per optimizer step (the effective batch)
IMAGE = (3, 16, 16)  # small images keep the example fast
CLASSES = 10


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (a projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer2(self.layer1(self.stem(x)))
        return self.head(h.mean(dim=(2, 3)))


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    torch.manual_seed(0)
    model = ResNet()
    # An example batch: its size does not matter, autofit resizes it to every micro-batch it simulates.
    sample = torch.randn(4, *IMAGE)
    labels = torch.randint(0, CLASSES, (4,))  # integer targets: the default loss is cross-entropy

    # 1. The whole batch at once, fp32, no checkpointing: how much would one step need?
    full = autofit.estimate(model, sample, target=labels, step=BATCH_SIZE, device="cpu")
    print(f"one step at batch {BATCH_SIZE}, fp32: {mib(full.peak_bytes)} (peak in {full.peak_phase})")

    # 2. Ask for a plan that fits 60 % of that.
    budget = int(0.6 * full.peak_bytes)
    plan = autofit.plan(model, sample, budget, batch_size=BATCH_SIZE, target=labels, optimizer="adamw",
                        device="cpu")
    print(plan)
    print()

    # 3. Train with the emitted wrapper: each step takes the whole batch and splits it as planned.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with plan.wrap(model, optimizer) as trainer:  # leaving the block unwraps the model
        for step in range(2):
            images = torch.randn(BATCH_SIZE, *IMAGE)
            targets = torch.randint(0, CLASSES, (BATCH_SIZE,))
            loss = trainer.step(images, targets)
            print(f"step {step}: loss {loss:.4f}")

    # 4. The planned step, estimated and measured with the same knobs (measure runs it for real on a copy).
    knobs = dict(precision=plan.precision, optimizer="adamw", target=labels,
                 device="cpu", step=autofit.Step(micro_batch_size=plan.micro_batch_size,
                                                 accumulation_steps=plan.gradient_accumulation_steps,
                                                 checkpoint=plan.checkpoint))
    predicted = autofit.estimate(model, sample, **knobs).peak_bytes
    measured = autofit.measure(model, sample, **knobs).peak_bytes
    print(f"predicted peak {mib(predicted)}, measured peak {mib(measured)} "
          f"({100 * (predicted - measured) / measured:+.2f} %), budget {mib(budget)}")


if __name__ == "__main__":
    main()
