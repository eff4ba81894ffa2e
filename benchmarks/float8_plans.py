"""Issue 58's float8 rung as a user meets it: `autofit plan ... --allow float8 --compile` for Llama-3.1-8B's shapes on
H100s, each command a fresh `autofit` process under GNU time (`/usr/bin/time -v`): the plan it printed (float8 taken
or not, micro-batch, layout, predicted step) and the rung's note, which gives both plans' predicted step and peak.

    python benchmarks/float8_plans.py            # 2 blocks on one H100, then the whole 8B on 8 H100s (~9 min)
    python benchmarks/float8_plans.py --quick    # the 2 blocks only (~2 min)

The models are built on the meta device from the config (`--config use_cache=false`: the KV cache would make every
layer a dynamo frame of its own). The H100's dense FP8 rate is 1979 TFLOP/s against 989 for bf16 (NVIDIA's H100
datasheet, cited in autofit/cuda/cards.py); torchao and torchtitan train float8 compiled (their casts fuse), which
the plans here do too.

Measured (two cores, AVX-512 Xeon, torch 2.13.0, torchao 0.18.0, 2026-12-01, alone; max RSS as GNU time prints it,
KiB):

    case                   wall s   max RSS KiB  step     rung                                       chosen
    8B, 2 blocks, 1 GPU      71.5       641,900  0.138 s  taken: 0.1377 s with it, 0.161 s without   tensorwise, 4 x 1, recomputed: none
    8B, 8 GPUs FSDP2        325.8     1,415,104  1.01 s   taken: 1.01 s with it, 1.381 s without     tensorwise, 4 x 1, recomputed: model.layers.*.mlp x 31 (full)

Before 085c6a6 (a simulation left dynamo entries that made later simulations run eagerly, Note [a simulation leaves
no cache entries]) the whole 8B plan did not take the rung: 3.29 s with float8 against 1.844 s without, 12:30 wall.
Between 085c6a6 and 4a16849 (the analysis modelled the compiled step where the verification takes the eager bound,
Note [compiled models on a GPU target]) it took it at 1 x 4 after 27.70 GiB of margin: 1.877 s against 2.201 s,
308.8 s, 1,070,844 KiB.
"""

from __future__ import annotations

import re
import shutil
import sys

from large_plans import timed  # this folder is the script's

TWO_BLOCKS = ["plan", "hf:meta-llama/Llama-3.1-8B", "--config", "use_cache=false", "--config", "num_hidden_layers=2",
              "--budget", "80GB", "--gpu", "H100-80GB", "--batch-size", "4", "--input-shape", "4096",
              "--allow", "float8", "--compile"]
WHOLE = ["plan", "hf:meta-llama/Llama-3.1-8B", "--config", "use_cache=false", "--budget", "80GB", "--gpu",
         "H100-80GB", "--world-size", "8", "--strategy", "fsdp2", "--precision", "bf16", "--batch-size", "32",
         "--input-shape", "4096", "--allow", "float8", "--compile"]


def _case(label: str, command: list[str]) -> tuple[str, float, int, str, str, str]:
    """The plan's row: wall seconds, peak resident KiB, what it chose, its predicted step, the rung's note."""
    done, wall, _, rss = timed(label, command)
    text = re.sub(r"\s+", " ", done.stdout)  # the table's rows and the notes, wrapped by rich, on one line
    float8 = re.search(r"│ float8 │ (\w+)", text)
    step = re.search(r"│ predicted step time │ ([\d.]+ s)", text)
    rung = re.search(r"rung 'float8' (taken|not taken)[^:]*: .*?predicted step ([\d.]+ s) and peak [\d.]+ \w+ with "
                     r"it, ([\d.]+ s)", text)
    verdict = f"{rung[1]}: {rung[2]} with it, {rung[3]} without" if rung else "no rung note"
    micro = re.search(r"│ micro-batch │ (\d+)", text)
    accumulation = re.search(r"│ accumulation steps │ (\d+)", text)
    recomputed = re.search(r"│ checkpointed modules │ (.+?) │", text)
    chosen = (f"{float8[1] if float8 else 'none'}, {micro[1] if micro else '?'} x "
              f"{accumulation[1] if accumulation else '1'}, recomputed: {recomputed[1] if recomputed else '?'}")
    return label, wall, rss, chosen, step[1] if step else "?", verdict


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if shutil.which("/usr/bin/time") is None:
        raise SystemExit("needs GNU time at /usr/bin/time (apt install time): it reports the peak resident memory")
    cases = [("8B, 2 blocks, 1 GPU", TWO_BLOCKS)] + ([] if "--quick" in argv else [("8B, 8 GPUs FSDP2", WHOLE)])
    print(f"{'case':20} {'wall s':>8} {'max RSS KiB':>13}  {'step':8} {'rung':48} chosen")
    for label, command in cases:
        name, wall, rss, chosen, step, verdict = _case(label, [sys.executable, "-m", "autofit", *command])
        print(f"{name:20} {wall:8.1f} {rss:13,}  {step:8} {verdict:48} {chosen}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
