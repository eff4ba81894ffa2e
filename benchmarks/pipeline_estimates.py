"""Pipeline estimates of a Llama-3.1-8B shape (issue 59): every stage's peak under each schedule, and what it costs.

A Hugging Face Llama built on the meta device from Llama-3.1-8B's config (32 layers, hidden 4096, MLP 14336, 32
heads, 8 KV heads, vocabulary 128256, head untied as in the released model; no weights), bf16 autocast, AdamW, on 8
H100-80GB of one node: pipeline 2 x FSDP2 4, one row of 4096 tokens per micro-batch, 8 micro-batches, every block
recomputed. ``autofit.estimate`` simulates one rank per stage with torch's own schedule (docs/multi-gpu.md,
"Pipeline parallel"); the table prints each stage's simulated peak of allocated bytes, the worst stage's bytes on the
device (the CUDA caching allocator's reserve and context included) and the seconds the estimate took. The planner
does not choose pipelines yet: this is what one estimate costs, the figure its search would have to afford.

    .venv-test/bin/python benchmarks/pipeline_estimates.py                      # the five schedules, 32 layers
    .venv-test/bin/python benchmarks/pipeline_estimates.py --layers 8 --schedules 1F1B,GPipe

Result (torch 2.13.0, 2 shared CPU cores, another job beside it, 2026-12-01):

    schedule         stage peaks (GiB allocated)               worst on device  seconds
    GPipe            rank 0 39.04, rank 4 67.96                      79.24 GiB     52.7
    1F1B             rank 0 35.97, rank 4 37.36                      49.14 GiB     69.7
    Interleaved1F1B  rank 0 38.01, rank 4 39.87                      51.02 GiB     56.6
    ZBVZeroBubble    rank 0 37.98, rank 4 67.18                      74.14 GiB     97.7

    DualPipeV        rank 0 43.59, rank 4 76.84                      83.60 GiB    125.7   (2026-12-02, beside ZBV's
    ZBVZeroBubble    rank 0 37.98, rank 4 67.18                      74.14 GiB    125.4    same figures again)

GPipe's last stage holds all eight micro-batches' activations and their logits' saved tensors (128256 words each);
1F1B's holds its warm-up's one; ZBV puts the first and the last stage on one rank (rank 0: stages 0 and 3), and the
middle stages (rank 4) hold the most, in the order torch's ZBV schedule runs them. DualPipeV, the same V placement,
holds more on both ranks, in the order its schedule runs (its overlapped actions' halves one after the other, as
torch runs them without a registered overlap). Neither is decomposed here; both schedules are checked against the
allocator at small size in tests/test_pipeline.py. One estimate takes one to two minutes (16 blocks x 8
micro-batches per stage, simulated whole): a planner that tries pipelines needs each stage cut in depth, as whole
models are (Note [depth extrapolation]).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import autofit  # noqa: E402

GIB = 2**30


def _model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--schedules", default="GPipe,1F1B,Interleaved1F1B,ZBVZeroBubble,DualPipeV")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=4096)
    args = parser.parse_args()
    model = _model(args.layers)
    ids = torch.randint(0, 128256, (args.micro_batches, args.sequence))
    checkpoint = tuple(f"model.layers.{i}" for i in range(args.layers))
    print(f"Llama-3.1-8B shape, {args.layers} layers, 8 x H100-80GB: pp 2 x fsdp2 4, 1 x {args.sequence} tokens x "
          f"{args.micro_batches} micro-batches, bf16, AdamW, every block recomputed (torch {torch.__version__})")
    print(f"{'schedule':<16} {'stage peaks (GiB allocated)':<40} {'worst on device':>16} {'seconds':>8}")
    for schedule in args.schedules.split(","):
        layout = autofit.Layout(world_size=8, gpus_per_node=8, strategy="fsdp2", pipeline_parallel=2,
                                pipeline_schedule=schedule)
        step = autofit.Step(micro_batch_size=1, accumulation_steps=args.micro_batches, checkpoint=checkpoint)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = autofit.estimate(model, ids, target=ids, device="H100-80GB", precision="bf16", layout=layout,
                                   step=step)
        seconds = time.perf_counter() - start
        peaks = ", ".join(f"rank {r} {b / GIB:.2f}" for r, b in est.rank_peaks)
        print(f"{schedule:<16} {peaks:<40} {est.device_bytes / GIB:>12.2f} GiB {seconds:>8.1f}")


if __name__ == "__main__":
    main()
