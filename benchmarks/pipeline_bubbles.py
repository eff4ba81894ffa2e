"""What each pipeline schedule costs in time (issue 59): the step of torch's own order of actions, every rank's
share of it spent waiting, and torchtitan's Table 5 throughput ratio rebuilt.

``autofit.parallel.pipeline.pipeline_time`` runs each rank's actions in the order torch runs them (Note [a
schedule's time], autofit/parallel/pipeline.py). Here every stage computes alike: per micro-batch a forward of 1 and
a backward of 2 per rank (1 + 1 where a schedule splits it into its input and weight halves), the multi-stage
schedules' two stages per rank each half of that; the hand-off between ranks is free unless ``--transfer`` gives it,
in units of one rank's forward (the first table and Table 5's equal row). The first table is the step in those units
and the share of it the least idle rank waits; the second rebuilds torchtitan's Table 5 (Llama 3.1 405B, FSDP 8 x TP
8 x PP 8, 8 micro-batches; 1F1B 100 and Interleaved 1F1B 128 tokens/s/GPU,
benchmarks/llama3_h100_202412_torchtitan.md in pytorch/torchtitan): the ratio of the two steps, with equal stages
and with the split torchtitan's ``generate_split_points`` of late 2024 gave (15, 16 x 6, 15 layers for 1F1B; 7, 8 x
14, 7 interleaved), each stage's time its layers (the head, on the last stage, about 0.57 of a layer by FLOPs: 2 x
16384 x 128256 against 2 x (4 x 16384^2 + 3 x 16384 x 53248) per token, attention left out).

    .venv-test/bin/python benchmarks/pipeline_bubbles.py
    .venv-test/bin/python benchmarks/pipeline_bubbles.py --ranks 4,8 --micro 1,2,4 --transfer 0.05

Result (``--ranks 8 --micro 1,2``, torch 2.13.0, 2026-12-02), without transfers:

    ranks  micro-batches  schedule                  step    waits
    8      8              GPipe                     45.0   46.7%
    8      8              1F1B                      45.0   46.7%
    8      8              Interleaved1F1B           34.5   30.4%
    8      8              LoopedBFS                 34.5   30.4%
    8      8              InterleavedZeroBubble     27.5   12.7%
    8      8              ZBVZeroBubble             31.0   22.6%
    8      16             GPipe                     69.0   30.4%
    8      16             1F1B                      69.0   30.4%
    8      16             Interleaved1F1B           58.5   17.9%
    8      16             LoopedBFS                 58.5   17.9%
    8      16             InterleavedZeroBubble     51.5    6.8%
    8      16             ZBVZeroBubble             51.5    6.8%
    8      16             DualPipeV                 51.5    6.8%

    Table 5 (405B, PP 8, 8 micro-batches)    1F1B step  Interleaved step  ratio  measured (tokens/s)
    equal stages                                  45.0              34.5  1.304  1.28 (128 / 100)
    late-2024 split, head 0.57 layer             714.4             538.7  1.326  1.28 (128 / 100)

The orders give Interleaved 1F1B 2 to 4 % more than torchtitan measured: what they leave out is the same in both rows
but for the hand-offs, twice as many interleaved (a 134 MB micro-batch shard over 50 GB/s is 2.7 ms against a
stage's forward of about a second: ``--transfer 0.003`` makes the equal row 1.303), and FSDP2's and tensor
parallel's collectives inside each stage, which a longer step hides better. The zero-bubble and V schedules wait
only for the first forward to reach their middle rank ((P - 1) x 1/2 here), from 2P micro-batches on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autofit.parallel.pipeline import SCHEDULES, StageSeconds, micro_batch_rule, pipeline_time  # noqa: E402

HEAD = 2 * 16384 * 128256 / (2 * (4 * 16384**2 + 3 * 16384 * 53248))  # the 405B head in layers, by FLOPs


def _equal(schedule: str, ranks: int, micro: int, transfer: float):
    per_rank = SCHEDULES[schedule].per_rank
    stage = StageSeconds(1 / per_rank, 1 / per_rank, 1 / per_rank)
    return pipeline_time(schedule, ranks, micro, [stage] * (ranks * per_rank), transfer)


def _by_layers(schedule: str, layers: list[int]):
    """Table 5's stages timed by their layers, the head on the last: forward 1, backward 2 per layer."""
    work = [count + (HEAD if s == len(layers) - 1 else 0) for s, count in enumerate(layers)]
    return pipeline_time(schedule, 8, 8, [StageSeconds(w, w, w) for w in work])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="4,8", help="pipeline degrees, comma-separated")
    parser.add_argument("--micro", default="1,2,4", help="micro-batches per rank, comma-separated multiples")
    parser.add_argument("--transfer", type=float, default=0.0, help="a hand-off, in units of one rank's forward")
    args = parser.parse_args()
    print(f"{'ranks':<7}{'micro-batches':<15}{'schedule':<23}{'step':>7}{'waits':>9}")
    for ranks in (int(r) for r in args.ranks.split(",")):
        for micro in sorted({int(m) * ranks for m in args.micro.split(",")}):
            for name, kind in SCHEDULES.items():
                if micro_batch_rule(kind, ranks, micro) is not None:
                    continue
                timed = _equal(name, ranks, micro, args.transfer)
                print(f"{ranks:<7}{micro:<15}{kind.title:<23}{timed.step_seconds:>7.1f}{timed.idle_share:>8.1%}")
    print()
    print(f"{'Table 5 (405B, PP 8, 8 micro-batches)':<40}{'1F1B step':>10}{'Interleaved step':>18}{'ratio':>7}"
          "  measured (tokens/s)")
    rows = (("equal stages", _equal("1f1b", 8, 8, args.transfer), _equal("interleaved1f1b", 8, 8, args.transfer)),
            (f"late-2024 split, head {HEAD:.2f} layer", _by_layers("1f1b", [15] + [16] * 6 + [15]),
             _by_layers("interleaved1f1b", [7] + [8] * 14 + [7])))
    for label, one, interleaved in rows:
        print(f"{label:<40}{one.step_seconds:>10.1f}{interleaved.step_seconds:>18.1f}"
              f"{one.step_seconds / interleaved.step_seconds:>7.3f}  1.28 (128 / 100)")


if __name__ == "__main__":
    main()
