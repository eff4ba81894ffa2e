"""Issue 56's largest jobs as a user runs them: each command a fresh `autofit` process under GNU time (`/usr/bin/time
-v`), its wall time, CPU time and peak resident memory, and what it printed (the layout, the step, the peak).

    python benchmarks/large_plans.py              # the 405B plan, then the same with every fork refused
    python benchmarks/large_plans.py --estimate   # also the 405B estimate whose deferred gradients are named

The plan: `autofit plan hf:meta-llama/Llama-3.1-405B --budget 90% --gpu H100-80GB --nodes 64 --gpus-per-node 8
--batch-size 512 --input-shape 8192 --tensor-parallel auto` (the model built on the meta device from its config; the
issue's goal: under 3 minutes and 4 GB resident on two cores). "fork refused" runs it with `os.fork` raising ENOMEM,
as a machine out of memory does: the plan must be the same, run in process, with one warning (Note [parallel
simulations], autofit/core/workers.py).

Measured (two cores, AVX-512 Xeon, torch 2.13.0, 2026-11-29, this script; max RSS as GNU time prints it, KiB):

    case                         wall s   CPU s   max RSS KiB  plan
    405B plan                     107.1   150.1     2,496,508  fsdp2 (ZeRO-3) x tp 2, 1 x 2, 116 s, 72,803.3 MiB
    405B plan, fork refused       136.8   152.3     2,383,560  the same, "warning: could not start a worker process"

The same command alone on an idle machine, before the script: 101.6 s wall, 2,454,720 KiB.

Before this session's two changes (7ae8003: the deferring rungs analysed, the checkpoint MILPs over all 126 blocks),
the same command: 268.6 s wall, 312.8 s CPU, 4,051,544 KiB, the same layout and step.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

PLAN = ["plan", "hf:meta-llama/Llama-3.1-405B", "--budget", "90%", "--gpu", "H100-80GB", "--nodes", "64",
        "--gpus-per-node", "8", "--batch-size", "512", "--input-shape", "8192", "--tensor-parallel", "auto"]
ESTIMATE = ["estimate", "hf:meta-llama/Llama-3.1-405B", "--input-shape", "8192", "-m", "1", "-n", "512", "--gpu",
            "H100-80GB", "--nodes", "64", "--gpus-per-node", "8", "--strategy", "fsdp2", "--precision", "bf16",
            "--checkpoint", "blocks", "--tensor-parallel", "8"]
# the CLI run in a child interpreter whose os.fork fails as it does without memory (ENOMEM)
REFUSED = ("import errno, os, sys\n"
           "def refused(*a, **k):\n"
           "    raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))\n"
           "os.fork = refused\n"
           "from autofit.cli.app import run\n"
           "sys.argv = ['autofit', *sys.argv[1:]]\n"
           "run()\n")


def timed(label: str, command: list[str]) -> tuple[subprocess.CompletedProcess, float, float, int]:
    """``command`` run under GNU time: what it printed, and its wall seconds, CPU seconds and peak resident KiB."""
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{label} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    stats = dict(re.findall(r"^\s*(.+?): (.+)$", done.stderr, flags=re.M))
    minutes, seconds = stats["Elapsed (wall clock) time (h:mm:ss or m:ss)"].rsplit(":", 1)
    wall = 60 * sum(float(x) * 60 ** i for i, x in enumerate(reversed(minutes.split(":")))) + float(seconds)
    cpu = float(stats["User time (seconds)"]) + float(stats["System time (seconds)"])
    return done, wall, cpu, int(stats["Maximum resident set size (kbytes)"])


def _timed(label: str, command: list[str]) -> tuple[str, float, float, int, str]:
    done, wall, cpu, rss = timed(label, command)
    return label, wall, cpu, rss, _summary(done.stdout, done.stderr)


def _summary(out: str, err: str) -> str:
    def row(name: str) -> str:
        found = re.search(rf"│ {name}\s*│ (.+?)\s*│", out)
        return found.group(1) if found else "?"
    if "autofit plan" in out:
        text = f"{row('world size')}; {row('micro-batch')} x {row('accumulation steps')}; " \
               f"{row('predicted step time')}; reserved {row('peak reserved')}"
    else:
        text = f"on the device {row('on the device')}"
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    return text + (f"; {warned[0]}" if warned else "")


def main() -> None:
    if shutil.which("/usr/bin/time") is None:
        raise SystemExit("needs GNU time at /usr/bin/time (apt install time): it reports the peak resident memory")
    cases = [("405B plan", [sys.executable, "-m", "autofit", *PLAN]),
             ("405B plan, fork refused", [sys.executable, "-c", REFUSED, *PLAN])]
    if "--estimate" in sys.argv[1:]:
        cases.append(("405B estimate", [sys.executable, "-m", "autofit", *ESTIMATE]))
    print(f"{'case':<26} {'wall s':>8} {'CPU s':>8} {'max RSS KiB':>13}  what it printed")
    for label, command in cases:
        label, wall, cpu, rss, summary = _timed(label, command)
        print(f"{label:<26} {wall:>8.1f} {cpu:>8.1f} {rss:>13,}  {summary}", flush=True)


if __name__ == "__main__":
    main()
