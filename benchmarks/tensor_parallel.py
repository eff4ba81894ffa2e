"""FSDP2 against FSDP2 x tensor parallel, as the planner weighs them: a Hugging Face Llama built from a Llama-3-70B
config (dim 8192, 64 heads, 8 key/value heads, intermediate 28672, vocab 128256; a few of its 80 layers, on the meta
device, no weights) planned for 8 x H100-80GB with ``tensor_parallel="auto"`` (T = 2, 4 beside plain FSDP2; tensor
parallel alone, T = 8, is refused on CUDA: docs/multi-gpu.md). Prints every layout's predicted step and memory per
GPU from the plan's notes, and the planner's wall time. Not a test: the time model ranks, it does not forecast.

    .venv/bin/python benchmarks/tensor_parallel.py                  # 2 layers, sequence 4096, global batch 16
    .venv/bin/python benchmarks/tensor_parallel.py --layers 4 --seq 8192
    .venv/bin/python benchmarks/tensor_parallel.py --sequence-parallel  # the tensor-parallel layouts with sequence
                                                                        # parallel (Note [sequence parallel])
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import autofit  # noqa: E402
from autofit.core.units import format_bytes  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    parser.add_argument("--budget", default="80GB")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="the model's tensor-parallel plan with its blocks' norms sequence-parallel")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=args.layers,
                         num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=args.seq,
                         rope_theta=500000.0, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(1, args.seq, dtype=torch.long)
    n = sum(p.numel() for p in model.parameters())
    print(f"Llama-3-70B shape, {args.layers} layers: {n / 1e9:.2f} B parameters (fp32, meta); sequence {args.seq}, "
          f"global batch {args.batch}; 8 x H100-80GB, budget {args.budget}; torch {torch.__version__}"
          + ("; sequence parallel" if args.sequence_parallel else ""))
    start = time.perf_counter()
    mapping = None
    if args.sequence_parallel:
        from autofit.parallel.tensor_parallel import sequence_parallel_plan

        mapping = sequence_parallel_plan(model)
    plan = autofit.plan(model, {"input_ids": ids, "labels": ids}, args.budget, batch_size=args.batch,
                        device="H100-80GB",
                        layout=autofit.Layout(world_size=8, strategy="fsdp2", tensor_parallel="auto",
                                              tensor_parallel_plan=mapping))
    seconds = time.perf_counter() - start
    print(f"planned in {seconds:.1f} s: {plan.layout}, micro-batch {plan.micro_batch_size} x "
          f"{plan.gradient_accumulation_steps}, {plan.precision.label}, {len(plan.checkpoint)} modules recomputed, "
          f"{format_bytes(plan.device_bytes)} per GPU, predicted step {plan.predicted_step_seconds:.3f} s")
    for note in plan.notes:
        if "chosen" in note:
            print(f"why: {note}")


if __name__ == "__main__":
    main()
