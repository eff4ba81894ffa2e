"""Tokens per second of a length-adapted plan against a fixed-rows plan, over a long-tailed length distribution.

A Llama-shaped decoder (benchmarks/llama.py, on the meta device) is planned once for an A100-80GB at its longest
batch, 32 sequences of 1024 tokens, under a budget the whole batch misses. Then a stream of batches is drawn:
sequence lengths log-normal (median 200 tokens, sigma 0.9, cut to 16..1024), grouped into batches of 32 either by
transformers' ``get_length_grouped_indices`` (what ``LengthGroupedSampler`` does; random batches when transformers is
absent) or at random, each padded to its longest sequence. Each batch runs

- fixed rows: ``plan.micro_batch_size`` rows per micro-batch whatever its length (the trainer before variable-length
  plans);
- length-adapted: ``plan.micro_batch_size_for(length)`` rows (Note [rows by length], autofit/solve/lengths.py).

Seconds come from the planner's own time model (solve/time_model.py: a roofline per op plus a launch cost per op and
micro-batch), with one assumption of this benchmark: an op's FLOPs and bytes at length ``l`` are those of
``rows * l / L`` rows at length ``L`` (linear in tokens; attention's quadratic part makes short batches cheaper still,
for both plans alike). Tokens counted are real ones (padding excluded). Prints a table; asserts nothing.

    python benchmarks/variable_length.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autofit  # noqa: E402
from autofit.device import resolve_device  # noqa: E402
from autofit.options import Options  # noqa: E402
from autofit.planner import plan_with_analysis  # noqa: E402
from autofit.request import make_request  # noqa: E402
from autofit.solve.time_model import build_time_model  # noqa: E402
from benchmarks.llama import Llama, LlamaConfig  # noqa: E402

GPU, ROWS, LENGTH, BATCHES = "A100-80GB", 32, 1024, 2000
CONFIG = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8,
                     max_seq_len=LENGTH)


def lengths(generator: torch.Generator) -> torch.Tensor:
    drawn = torch.distributions.LogNormal(math.log(200.0), 0.9).sample((ROWS * BATCHES,))
    return drawn.clamp(16, LENGTH).long()


def grouped(seq: torch.Tensor, generator: torch.Generator, by_length: bool) -> list[torch.Tensor]:
    order = torch.randperm(len(seq), generator=generator)
    if by_length:
        try:
            from transformers.trainer_pt_utils import get_length_grouped_indices

            order = torch.tensor(get_length_grouped_indices(seq.tolist(), ROWS, generator=generator))
        except ImportError:
            print("transformers not installed: length-grouped batches are random batches")
    return [seq[order[i:i + ROWS]] for i in range(0, len(seq), ROWS)]


def step_seconds(time_model, plan, rows: int, length: int) -> float:
    steps = -(-ROWS // rows)
    last = ROWS - rows * (steps - 1)
    scale = length / LENGTH
    return time_model.step_time(plan.precision.name, rows * scale, steps, plan.checkpoint, last * scale).total


def main() -> None:
    with torch.device("meta"):
        model = Llama(CONFIG)
    ids = torch.zeros(ROWS, LENGTH, dtype=torch.long, device="meta")
    full = autofit.estimate(model, ids, target=ids, step=ROWS, precision="bf16", device=GPU)
    budget = full.device_bytes // 4
    plan, analyses = plan_with_analysis(make_request(
        model, ids, budget, options=Options.of(device=GPU, search=autofit.Search(variable_length=True)), target=ids))
    analysis = analyses[plan.precision.name]
    time_model = build_time_model(analysis.ops, analysis.table.row("").param_bytes, resolve_device("cuda", GPU))
    print(f"{CONFIG.num_layers} x {CONFIG.hidden_size} decoder, batch {ROWS} x {LENGTH}, {GPU}, budget "
          f"{budget / 2**30:.2f} GiB (the whole batch at once needs {full.device_bytes / 2**30:.2f} GiB)")
    print(f"plan: micro-batch {plan.micro_batch_size} x {plan.gradient_accumulation_steps}, {plan.precision}, "
          f"{len(plan.checkpoint)} modules recomputed")
    print("rows per micro-batch by length: " + plan.rows_by_length_text())
    print()
    print(f"{'batches':<15} {'median len':>10} {'fixed rows tok/s':>17} {'adapted tok/s':>14} {'speed-up':>9} "
          f"{'micro-batches fixed/adapted':>28}")
    generator = torch.Generator().manual_seed(0)
    seq = lengths(generator)
    for name, by_length in (("length-grouped", True), ("random", False)):
        tokens = fixed = adapted = 0.0
        n_fixed = n_adapted = 0
        batch_lengths = []
        for batch in grouped(seq, generator, by_length):
            length = int(batch.max())
            batch_lengths.append(length)
            tokens += float(batch.sum())
            fixed += step_seconds(time_model, plan, plan.micro_batch_size, length)
            rows = plan.micro_batch_size_for(length)
            adapted += step_seconds(time_model, plan, rows, length)
            n_fixed += -(-ROWS // plan.micro_batch_size)
            n_adapted += -(-ROWS // rows)
        median = sorted(batch_lengths)[len(batch_lengths) // 2]
        print(f"{name:<15} {median:>10} {tokens / fixed:>17,.0f} {tokens / adapted:>14,.0f} "
              f"{fixed / adapted:>8.2f}x {n_fixed:>15,} / {n_adapted:,}")


if __name__ == "__main__":
    main()
