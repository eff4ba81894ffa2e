"""Plan and train a small GPT-style language model: tied input/output embeddings, causal SDPA attention.

    python examples/transformer_lm.py

The sample is a batch of token ids and the target the same ids shifted by one, so autofit's default loss applies
(integer target: cross-entropy over the last dimension of the logits). The plan is asked for an effective batch of
32 sequences under a budget the whole batch does not fit at once, on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import autofit

VOCAB, SEQ, DIM, HEADS, LAYERS = 256, 64, 64, 4, 2
BATCH_SIZE = 32  # sequences per optimizer step
BUDGET = "6MB"  # 6 * 10**6 bytes; "6MiB" would be 6 * 2**20


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = CausalSelfAttention()
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.tok.weight  # tied embeddings: one parameter, counted once
        for embedding in (self.tok, self.pos):
            nn.init.normal_(embedding.weight, std=0.02)  # GPT-2's initialisation keeps the first logits small

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def batch_of(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random sequences and their next-token targets."""
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main() -> None:
    torch.manual_seed(0)
    model = GPT()
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT: {params:,} parameters ({LAYERS} layers, dim {DIM}, vocab {VOCAB}, sequence {SEQ}, tied embeddings)")

    sample, target = batch_of(2)  # two rows are enough: autofit resizes the sample to each micro-batch
    plan = autofit.plan(model, sample, BUDGET, batch_size=BATCH_SIZE, target=target, optimizer="adamw",
                        device="cpu")
    print(plan)
    print()
    print(f"plan: {plan.gradient_accumulation_steps} micro-batch(es) of {plan.micro_batch_size} per step, "
          f"{plan.precision.name}, checkpointed: {', '.join(plan.checkpoint) or 'none'}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trainer = plan.wrap(model, optimizer)
    inputs, targets = batch_of(BATCH_SIZE)
    for step in range(2):
        loss = trainer.step(inputs, targets)  # the same batch twice: the loss must fall
        print(f"step {step}: loss {loss:.4f}")
    trainer.unwrap()

    # The JSON form round-trips: a plan made once can be saved and loaded where training runs.
    again = autofit.Plan.from_json(plan.to_json())
    assert again == plan
    print(f"plan JSON round-trips ({len(plan.to_json())} characters)")


if __name__ == "__main__":
    main()
