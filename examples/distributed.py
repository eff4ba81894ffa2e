"""Plan and train on several processes with DDP or FSDP2, then compare each rank's peak with the plan.

    torchrun --standalone --nproc-per-node=2 examples/distributed.py            # CPU (gloo) or GPUs (nccl)
    torchrun --standalone --nproc-per-node=2 examples/distributed.py --strategy fsdp2

Every rank plans before ``init_process_group`` (autofit simulates the other ranks with a fake process group, and
planning is deterministic, so all ranks agree), then joins the job, trains a few steps on its slice of each global
batch and reports the peak it measured next to the peak the plan predicted for one rank.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.measure.allocator import measure_callable


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, seq: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x, is_causal=False)
        return self.head(x)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default=None, help="default: autofit chooses")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")

    torch.manual_seed(0)  # same weights and data on every rank
    model = TinyGPT()
    sample = torch.randint(0, 256, (2, 32))
    batch_size = 16 * world_size
    plan = autofit.plan(model, sample, "64MB" if not cuda else "90%", batch_size=batch_size, target=sample,
                        loss_fn=loss_fn, device=device.type,
                        layout=autofit.Layout(world_size=world_size,
                                              strategy=args.strategy if world_size > 1 else None))
    if rank == 0:
        print(plan)

    if world_size > 1:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
    model = model.to(device)
    factory = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731 - FSDP2 builds it after sharding
    trainer = plan.wrap(model, factory if plan.parallel.strategy == "fsdp2" else factory(model.parameters()),
                        loss_fn=loss_fn)
    rows = batch_size // world_size
    global_ids = torch.randint(0, 256, (batch_size, 32))  # the same global batch on every rank (same seed)
    local_ids = global_ids[rank * rows:(rank + 1) * rows].to(device)  # this rank's slice, as a DistributedSampler gives

    def step() -> float:
        return trainer.step(local_ids, local_ids, local=True) if world_size > 1 else trainer.step(local_ids, local_ids)

    def local(t: torch.Tensor) -> torch.Tensor:
        return getattr(t, "_local_tensor", t)

    step()  # optimizer state exists from here on, as in the plan's steady state
    step()  # DDP rebuilds its gradient buckets after its first iteration
    # DDP's buckets (gradient_as_bucket_view) outlive every step, yet no tensor we hold points at them once
    # zero_grad(set_to_none=True) ran: on the CPU their bytes are added from the reducer's own sizes
    resident = 0
    if plan.parallel.strategy == "ddp" and not cuda:
        resident = sum(b.buffer().nbytes for b in trainer.model.reducer._get_zeros_like_grad_buckets())
    # the lowest of the steps' peaks: on the CPU the profiler also sees what gloo's communication threads allocate
    # when their work happens to overlap the window, which is not the step's own memory
    peaks = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            loss = step()
            peaks.append(torch.cuda.max_memory_allocated(device))
        else:
            live = [local(p) for p in trainer.model.parameters()] + [local_ids]
            live += [local(v) for s in trainer.optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor)]
            box = {}
            peaks.append(resident + measure_callable(lambda: box.setdefault("loss", step()), live))
            loss = box["loss"]
    peak = min(peaks)
    error = 100 * (plan.peak_bytes - peak) / peak
    # one write per line: the ranks share stdout, and print() writes the text and its newline separately
    sys.stdout.write(f"rank {rank}/{world_size} {plan.parallel.strategy or 'single'}: loss {loss:.4f}, predicted peak "
                     f"{plan.peak_bytes:,} B, measured {peak:,} B ({error:+.2f} %)\n")
    sys.stdout.flush()
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
