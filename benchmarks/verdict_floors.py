"""The smallest budget ``autofit plan`` names for full Llama-2-7B on an H200 (fp16, no offload), batch 1, 2, 4, 8.

Issue 30: the floor must not grow as the batch shrinks, and a plan at the floor must run. Each batch runs the CLI
(the model is built on meta from the bundled config; nothing is downloaded) at a budget below every floor, and the
floor is read from its "Smallest budget that works" line. ``--src`` runs another checkout's autofit (to compare a
change with what came before); ``--at-floor`` then plans each batch again at the floor it named and prints the plan's
allocated and device bytes (a plan must come back, holding at least what it allocates).

    python benchmarks/verdict_floors.py                      # this checkout
    python benchmarks/verdict_floors.py --src /tmp/base      # another one
    python benchmarks/verdict_floors.py --batches 8 --at-floor
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ARGS = ["hf:meta-llama/Llama-2-7b-hf", "--input-shape", "2048", "--gpu", "H200", "--precision", "fp16",
        "--no-offload"]
FLOOR = re.compile(r"Smallest budget that works: [^(]*\((\d+) bytes\)")


def _cli(src: Path, *args: str) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=str(src), COLUMNS="200")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", "import sys; from autofit.cli.app import main; sys.exit(main())",
                           "plan", *ARGS, *args], capture_output=True, text=True, env=env, cwd=src)
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--budget", default="125GiB,110GiB,100GiB",
                        help="budgets to try in turn until one is below the floor (the issue's command: 125GiB)")
    parser.add_argument("--at-floor", action="store_true")
    args = parser.parse_args()
    floors = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for budget in args.budget.split(","):
            rc, out, seconds = _cli(args.src, "--budget", budget, "--batch-size", str(batch), "--json")
            match = FLOOR.search(out)
            if match is not None:
                break
            if rc == 0:
                plan = json.JSONDecoder().raw_decode(out[out.index("{"):])[0]
                est = plan["estimate"]
                print(f"batch {batch}: fits {budget}: {plan['micro_batch_size']} x "
                      f"{plan['gradient_accumulation_steps']}, allocated {est['peak_allocated_bytes'] / 2**30:.2f} "
                      f"GiB, device {est['device_bytes'] / 2**30:.2f} GiB, {seconds:.0f} s", flush=True)
            else:
                print(f"batch {batch}: exit {rc} at {budget}, no floor in the output:\n{out[-2000:]}")
                break
        if match is None:
            continue
        floors[batch] = int(match.group(1))
        print(f"batch {batch}: floor {floors[batch] / 2**30:.2f} GiB ({floors[batch]:,} bytes), {seconds:.0f} s",
              flush=True)
        if args.at_floor:
            rc, out, seconds = _cli(args.src, "--budget", f"{floors[batch]}B", "--batch-size", str(batch), "--json")
            if rc != 0:
                print(f"  at the floor: exit {rc}\n{out[-2000:]}")
                continue
            plan = json.JSONDecoder().raw_decode(out[out.index("{"):])[0]
            est = plan["estimate"]
            print(f"  at the floor: {plan['micro_batch_size']} x {plan['gradient_accumulation_steps']}, "
                  f"allocated {est['peak_allocated_bytes'] / 2**30:.2f} GiB, device {est['device_bytes'] / 2**30:.2f}"
                  f" GiB, budget {plan['budget_bytes'] / 2**30:.2f} GiB, allocator "
                  f"{est.get('alloc_conf') or 'default'}, gradients "
                  f"{'before forward' if est.get('preallocated_grads') else 'made in backward'}, {seconds:.0f} s",
                  flush=True)
    batches = sorted(floors)
    monotone = all(floors[a] <= floors[b] for a, b in zip(batches, batches[1:]))
    print("floors never grow as the batch shrinks" if monotone else "NOT monotone: a smaller batch names more")


if __name__ == "__main__":
    main()
