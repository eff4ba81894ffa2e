"""Memory against recompute cost per transformer block: nothing recomputed, selective recomputation (autofit's op
policy, autofit/training/recompute.py) and full recomputation, next to Korthikanti et al. 2022's formula.

For one block of each model, from one ``autofit.analyse`` (fake tensors, nothing allocated), at micro-batch b:

- **held**: bytes the block holds from its forward until its backward. none: its input plus what it saved for
  backward (``CallRecord.saved``); selective: its input plus the outputs it keeps (``CallRecord.kept``); full: its
  input only (non-reentrant checkpoint keeps the inputs).
- **recompute**: what backward runs again: FLOPs (PyTorch's flop registry, which counts matrix products and
  attention only), ops, and bytes those ops read and write (the cost of pointwise ops, which are bandwidth-bound).
- **Korthikanti**: "Reducing Activation Recomputation in Large Transformer Models" (Korthikanti et al. 2022),
  section 4 (tensor parallelism t = 1): 34·s·b·h + 5·a·s²·b bytes without recomputation, 34·s·b·h with their
  selective recomputation (which recomputes the attention core: QKᵀ, softmax, dropout, attention over V), 2·s·b·h
  with full recomputation (the block's input), all in 16-bit with 1-byte dropout masks.

Run: ``python benchmarks/selective_recompute.py [--seq 1024 --hidden 768 --heads 12 --batch 1]``. Prints a table,
asserts nothing. See docs/planner.md, "Selective recomputation", for the differences this shows.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import autofit  # noqa: E402
from autofit.analyse.recompute_costs import RecomputeCosts, recompute_costs  # noqa: E402


def _gpt2(seq: int, hidden: int, heads: int, attention: str):
    import transformers

    config = transformers.GPT2Config(vocab_size=1024, n_positions=seq, n_embd=hidden, n_layer=1, n_head=heads,
                                     bos_token_id=0, eos_token_id=0)
    config._attn_implementation = attention
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config), "transformer.h.0"


def _llama(seq: int, hidden: int, heads: int, attention: str):
    import transformers

    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads,
                                      max_position_embeddings=seq)
    config._attn_implementation = attention
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config), "model.layers.0"


def block_row(build, seq: int, hidden: int, heads: int, batch: int, attention: str, precision: str, device: str,
              gpu: str | None) -> RecomputeCosts:
    model, block = build(seq, hidden, heads, attention)
    ids = torch.zeros(2, seq, dtype=torch.long)
    analysis = autofit.analyse(model, {"input_ids": ids, "labels": ids}, precision=precision, device=device, gpu=gpu)
    return recompute_costs(analysis, block, batch)


def korthikanti(seq: int, hidden: int, heads: int, batch: int) -> tuple[int, int, int]:
    sbh = seq * batch * hidden
    return 34 * sbh + 5 * heads * seq * seq * batch, 34 * sbh, 2 * sbh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--gpu", default="A100-80GB", help="the CUDA target simulated (its autocast and SDPA kernels)")
    args = parser.parse_args()
    s, h, a, b = args.seq, args.hidden, args.heads, args.batch
    mib = 2 ** 20
    print(f"one block, s={s} h={h} a={a} b={b}; held MiB (none / selective / full), recompute per block\n")
    head = (f"{'block':<34} {'none':>8} {'select':>8} {'full':>8} {'sel/none':>8}  {'sel GFLOP':>9} {'full GFLOP':>10}"
            f" {'sel ops':>7} {'full ops':>8} {'sel MiB moved':>13} {'full MiB moved':>14}")
    print(head)
    print("-" * len(head))
    k = korthikanti(s, h, a, b)
    print(f"{'Korthikanti et al. (16-bit)':<34} {k[0] / mib:>8.1f} {k[1] / mib:>8.1f} {k[2] / mib:>8.1f} "
          f"{k[1] / k[0]:>8.2f}  {4 * b * s * s * h / 1e9:>9.2f} {24 * b * s * h * h / 1e9 + 4 * b * s * s * h / 1e9:>10.2f}")
    cases = [
        ("GPT-2 eager attention", _gpt2, "eager"), ("GPT-2 SDPA", _gpt2, "sdpa"),
        ("Llama eager attention", _llama, "eager"), ("Llama SDPA", _llama, "sdpa"),
    ]
    for label, build, attention in cases:
        for precision, device, gpu in (("bf16", "cuda", args.gpu), ("fp32", "cpu", None)):
            r = block_row(build, s, h, a, b, attention, precision, device, gpu)
            held = (r.held_none, r.held_selective, r.held_full)
            flops, ops = (0, r.selective_flops, r.full_flops), (0, r.selective_ops, r.full_ops)
            moved = (0, r.selective_bytes_moved, r.full_bytes_moved)
            name = f"{label} {precision} {device}"
            print(f"{name:<34} {held[0] / mib:>8.1f} {held[1] / mib:>8.1f} {held[2] / mib:>8.1f} "
                  f"{held[1] / held[0]:>8.2f}  {flops[1] / 1e9:>9.2f} {flops[2] / 1e9:>10.2f} {ops[1]:>7} {ops[2]:>8} "
                  f"{moved[1] / mib:>13.1f} {moved[2] / mib:>14.1f}")


if __name__ == "__main__":
    main()
