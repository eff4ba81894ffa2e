"""autofit at scale: the peak of one Llama-7B (or Llama-2-70B) training step, estimated on a CPU without weights.

The model is built on the meta device (no storage), its parameters in bf16; the step is AdamW, batch 1, sequence
2048, bf16 autocast, every decoder block checkpointed. The script prints the wall time of ``autofit.estimate``, the
peak and its breakdown, a back-of-the-envelope check of the weight-sized terms, and the process's max RSS, which
stays far below the ~13 GB of bf16 weights (let alone the ~54 GB of weights, gradients and AdamW state): nothing of
the model was allocated. The goals the issues set: an estimate in under 60 s (7B and 70B); a whole plan for the 7B
shape (fp32 as built, A100-80GB, effective batch 64 x 2048) in under 20 s and faster than MemTracker's one step.

    .venv/bin/python benchmarks/scale.py                     # autofit only
    .venv/bin/python benchmarks/scale.py --plan --memtracker # also a whole plan, and PyTorch's MemTracker (~20 s)
    .venv/bin/python benchmarks/scale.py --layers 4          # a shallower model (quick check)
    .venv/bin/python benchmarks/scale.py --shape 70b         # Llama-2-70B's shape: 80 x 8192, 69.0 B parameters
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import autofit  # noqa: E402
from autofit.core.units import format_bytes  # noqa: E402
from benchmarks.llama import Llama, llama_7b_config, llama_70b_config  # noqa: E402

GOAL_SECONDS = 60.0
PLAN_GOAL_SECONDS = 20.0


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def weight_sized_terms(model: torch.nn.Module) -> int:
    """Parameters + gradients + AdamW's exp_avg and exp_avg_sq, all in the parameters' dtype: 4 x the weights.
    (The per-parameter fp32 ``step`` scalars, activations and temporaries come on top.)"""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("7b", "70b"), default="7b",
                        help="Llama-7B (32 x 4096) or Llama-2-70B (80 x 8192, 8 key/value heads) (default: 7b)")
    parser.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the shape's)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (default: 2048)")
    parser.add_argument("--memtracker", action="store_true",
                        help="also time torch.distributed._tools.mem_tracker.MemTracker on the same step")
    parser.add_argument("--plan", action="store_true",
                        help="also time a whole autofit.plan for the model in fp32 on an A100-80GB at 90 %% of the card, "
                             "effective batch 64 x the sequence")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    shape = llama_70b_config if args.shape == "70b" else llama_7b_config
    cfg = shape(max_seq_len=args.seq, **({"num_layers": args.layers} if args.layers else {}))
    with torch.device("meta"):
        model = Llama(cfg).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq))
    keywords = dict(target=ids, optimizer="adamw", precision="bf16",
                    step=autofit.Step(micro_batch_size=1, checkpoint=[f"layers.{i}" for i in range(cfg.num_layers)]))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Llama: {cfg.num_layers} layers, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
          f"{cfg.num_heads} heads, vocab {cfg.vocab_size}; {n_params / 1e9:.2f} B parameters in bf16 on the meta "
          f"device; batch 1 x {args.seq} tokens, AdamW, bf16 autocast, every block checkpointed")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; max RSS before: "
          f"{format_bytes(max_rss_bytes())}")

    start = time.perf_counter()
    est = autofit.estimate(model, ids, device="cpu", **keywords)
    seconds = time.perf_counter() - start
    verdict = "within" if seconds < GOAL_SECONDS else "OVER"
    print(f"\nautofit.estimate: {seconds:.1f} s ({verdict} the {GOAL_SECONDS:.0f} s goal), method {est.method}")
    print(est)
    weights4 = weight_sized_terms(model)
    print(f"check: parameters + gradients + AdamW exp_avg/exp_avg_sq = 4 x bf16 weights = {format_bytes(weights4)}; "
          f"the estimate adds {format_bytes(est.peak_bytes - weights4)}")
    print(f"max RSS after the estimate: {format_bytes(max_rss_bytes())} (the peak it predicts: "
          f"{format_bytes(est.peak_bytes)}): no weights were allocated")

    plan_seconds = run_plan(cfg, args.seq) if args.plan else None
    if args.memtracker:
        tracker_seconds = run_memtracker(model, ids, keywords, est.peak_bytes)
        if plan_seconds is not None and tracker_seconds is not None:
            print(f"\na whole autofit.plan took {plan_seconds:.1f} s, MemTracker's one step {tracker_seconds:.1f} s: "
                  f"{plan_seconds / tracker_seconds:.2f} x (the issue's goals: the plan under {PLAN_GOAL_SECONDS:.0f} s "
                  "and faster than MemTracker)")


def run_plan(cfg, seq: int) -> float:
    """A whole plan, as a user would ask for it: the model as built (fp32), an A100-80GB at 90 %, 64 x ``seq``."""
    from autofit.core.progress import listening

    with torch.device("meta"):
        model = Llama(cfg)
    ids = torch.zeros(1, seq, dtype=torch.long)
    stages = []
    start = time.perf_counter()
    with listening(lambda stage: stages.append((time.perf_counter() - start, stage.what))):
        plan = autofit.plan(model, ids, "90%", batch_size=64, target=ids, device="A100-80GB")
    seconds = time.perf_counter() - start
    print(f"\nautofit.plan (fp32 model, A100-80GB at 90 %, effective batch 64 x {seq}): {seconds:.1f} s; "
          f"{plan.micro_batch_size} x {plan.gradient_accumulation_steps}, {plan.precision.label}, "
          f"{len(plan.checkpoint)} modules recomputed, {format_bytes(plan.device_bytes)} on the device")
    for i, (at, what) in enumerate(stages):  # where the time went, by the planner's own stages
        until = stages[i + 1][0] if i + 1 < len(stages) else seconds
        print(f"  {at:6.1f} s  +{until - at:5.1f} s  {what}")
    print(f"max RSS after the plan: {format_bytes(max_rss_bytes())}")
    return seconds


def run_memtracker(model, ids, keywords, autofit_peak: int) -> float | None:
    from benchmarks.memtracker_baseline import memtracker_estimate

    print("\nPyTorch MemTracker (FakeTensorMode, one warm-up step then one tracked step, same step code): "
          "this takes a minute or more ...", flush=True)
    result = memtracker_estimate(model, ids, **keywords)
    if result.peak_bytes is None:
        print(f"MemTracker: {result.error} after {result.seconds:.1f} s")
        return None
    diff = 100.0 * (result.peak_bytes - autofit_peak) / autofit_peak
    print(f"MemTracker: {result.seconds:.1f} s, peak {format_bytes(result.peak_bytes)} ({result.peak_bytes:,} bytes),"
          f" {diff:+.2f}% against autofit's estimate")
    print(f"max RSS after MemTracker: {format_bytes(max_rss_bytes())}")
    return result.seconds


if __name__ == "__main__":
    main()
