"""Use a plan inside your own training loop: a DataLoader, epochs, and ``unwrap()`` at the end.

    python examples/custom_loop.py

The loop stays yours: the DataLoader hands out batches of ``plan.batch_size`` samples and ``trainer.step(x, y)``
runs one optimizer step over each, split into ``plan.micro_batch_size`` micro-batches with gradient accumulation
(the accumulated gradient equals the gradient of the mean loss over the whole batch). A last, shorter batch is fine:
the trainer splits whatever it gets. ``trainer.unwrap()`` hands the model back exactly as it was before ``wrap``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autofit

FEATURES, CLASSES = 32, 4
HIDDEN = 256
BATCH_SIZE = 512  # samples per optimizer step


def make_dataset(n: int = 4096) -> TensorDataset:
    """A learnable toy problem: the class is the argmax of a fixed random projection of the features."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=generator)
    projection = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(x, (x @ projection).argmax(dim=1))


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN),
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN),
        nn.Linear(HIDDEN, CLASSES),
    )
    loss_fn = nn.CrossEntropyLoss()  # any loss_fn(output, target) -> scalar; give the same one to plan and wrap
    dataset = make_dataset()
    sample, target = dataset[:8]  # a few rows: autofit resizes them to the micro-batches it plans

    # How much would one step over the whole batch need? Ask for a plan that fits in 40 % of it.
    full = autofit.estimate(model, sample, target=target, loss_fn=loss_fn, step=BATCH_SIZE,
                            optimizer="sgd", device="cpu")
    plan = autofit.plan(model, sample, int(0.4 * full.peak_bytes), batch_size=BATCH_SIZE, target=target,
                        loss_fn=loss_fn, optimizer="sgd", precision="fp32", device="cpu")
    print(f"one step over {BATCH_SIZE} samples needs {full.peak_bytes / 2**20:.2f} MiB; "
          f"budget {plan.budget_bytes / 2**20:.2f} MiB")
    print(f"plan: {plan.gradient_accumulation_steps} micro-batches of {plan.micro_batch_size}"
          + (f" (the last {plan.last_micro_batch_size})"
             if plan.last_micro_batch_size != plan.micro_batch_size else "")
          + f", {plan.precision}, checkpointed: {', '.join(plan.checkpoint) or 'none'}, "
            f"predicted peak {plan.peak_bytes / 2**20:.2f} MiB")

    loader = DataLoader(dataset, batch_size=plan.batch_size, shuffle=True)
    # "sgd" in the plan means SGD with momentum (one state buffer per parameter): build the same kind here.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = plan.wrap(model, optimizer, loss_fn=loss_fn)
    for epoch in range(3):
        losses = [trainer.step(x, y) for x, y in loader]
        print(f"epoch {epoch}: mean loss {sum(losses) / len(losses):.4f} over {len(losses)} steps")

    model = trainer.unwrap()  # checkpointing patches removed: the plain model, trained
    patched = [name for name, m in model.named_modules() if "forward" in vars(m)]
    print(f"unwrapped: {len(patched)} modules still patched")
    with torch.no_grad():
        x, y = dataset[:]
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    print(f"training accuracy after 3 epochs: {100 * accuracy:.1f} %")


if __name__ == "__main__":
    main()
