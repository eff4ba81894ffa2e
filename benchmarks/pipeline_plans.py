"""Pipeline plans of a Llama-3.1-8B shape (issue 59): what ``autofit.plan`` chooses for a given pipeline, and what
the plan costs.

A Hugging Face Llama built on the meta device from Llama-3.1-8B's config (as ``benchmarks/pipeline_estimates.py``:
32 layers, vocabulary 128256, head untied; no weights), bf16, AdamW, on 8 H100-80GB of one node, pipeline 2 x
FSDP2 4, a global batch of ``--batch`` rows of 4096 tokens (``--batch`` / 4 rows per pipeline rank per step), under
``--budget``. The plan chooses the schedule's micro-batches, their rows, whether every layer is recomputed and the
split (Note [planning a pipeline], autofit/planning/pipeline.py); each configuration it verifies simulates every
stage at full depth (no depth cut of the stages yet), so the seconds are mostly those verifications.

    .venv-test/bin/python benchmarks/pipeline_plans.py                         # 1F1B, 8 rows, 70 GB
    .venv-test/bin/python benchmarks/pipeline_plans.py --schedule GPipe --layers 8 --budget 40GB

Result (torch 2.13.0, 2 CPU cores, 2026-12-02; "rows" per micro-batch, "layers" per stage, "plan s" the whole plan):

    batch  micro-batches  rows  recomputed  layers    on device  step s  plan s  rank peaks (GiB allocated)
        8              2     1           0  (17, 15)  64.73 GiB   0.870    10.5  rank 0 49.71, rank 4 49.50
       32              8     1           0  (17, 15)  64.83 GiB   2.495    62.5  rank 0 62.49, rank 4 49.88

With 32 rows (8 a pipeline rank) the faster configurations missed the budget first: 4 micro-batches of 2 rows,
98.17 GiB with the balanced split and 93.09 GiB with the even one, each simulated whole; 12 configurations weighed.
The split gives the first stage 17 layers and the last (the head over 128,256 words and the loss) 15.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import autofit  # noqa: E402
from pipeline_estimates import _model  # noqa: E402

GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", default="70GB")
    parser.add_argument("--sequence", type=int, default=4096)
    args = parser.parse_args()
    model = _model(args.layers)
    ids = torch.randint(0, 128256, (1, args.sequence))
    print(f"Llama-3.1-8B shape, {args.layers} layers, 8 x H100-80GB: pp 2 x fsdp2 4 ({args.schedule}), "
          f"{args.batch} x {args.sequence} tokens a step, bf16, AdamW, budget {args.budget} (torch {torch.__version__})")
    layout = autofit.Layout(world_size=8, gpus_per_node=8, strategy="fsdp2", pipeline_parallel=2,
                            pipeline_schedule=args.schedule)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autofit.plan(model, ids, target=ids, budget=args.budget, batch_size=args.batch,
                            device=autofit.Device(gpu="H100-80GB"), precision="bf16", layout=layout)
    seconds = time.perf_counter() - start
    pp = plan.parallel.layout.placement("pp")
    print(f"{'layout':<34} {'micro-batches':>13} {'rows':>5} {'recomputed':>10} {'layers':>10} "
          f"{'on device':>10} {'step s':>7} {'plan s':>7}")
    print(f"{plan.parallel.label:<34} {plan.gradient_accumulation_steps:>13} {plan.micro_batch_size:>5} "
          f"{len(plan.checkpoint):>10} {str(pp.option('layers')):>10} {plan.device_bytes / GIB:>6.2f} GiB "
          f"{plan.predicted_step_seconds:>7.3f} {seconds:>7.1f}")
    print("rank peaks (GiB allocated): " + ", ".join(f"rank {r} {b / GIB:.2f}" for r, b in plan.estimate.rank_peaks))
    for note in plan.notes:
        if note.startswith("pipeline:"):
            print(note)


if __name__ == "__main__":
    main()
