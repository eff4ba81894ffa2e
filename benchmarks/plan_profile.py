"""Where an FSDP2 plan's time goes: the Llama-3-70B shape of ``multi_gpu_70b.py`` at a few layers, planned under
cProfile, its time split by stage (the layer analysis, the full estimates, the rest) and, inside the simulations, by
the dispatch layer that spends it (fake tensors, autofit's tracker and value twins, FSDP2's own Python). A report,
not a test: it says what sharing work between layouts could save.

    .venv/bin/python benchmarks/plan_profile.py                    # 4 layers, 8 x 1 (two layouts)
    .venv/bin/python benchmarks/plan_profile.py --nodes 4          # 4 x 8 (five layouts)
    .venv/bin/python benchmarks/plan_profile.py --layers 8 --dump /tmp/plan.prof   # keep the profile
    .venv/bin/python benchmarks/plan_profile.py --deep "8B fsdp2"  # a deep row of benchmarks/planning.py, whole
                                                                   # ("8B fsdp2", "8B one H100", "70B fsdp2")

Every simulation runs in this process (``AUTOFIT_WORKERS=1``), so that the profile sees it: the seconds are one
core's, and the profiler's own overhead about doubles pure-Python parts. The first line times what a fresh process
pays before planning anything (``import autofit`` and its torch), in a child process.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import autofit  # noqa: E402
from benchmarks.llama import Llama  # noqa: E402
from benchmarks.multi_gpu_70b import llama3_70b_config  # noqa: E402

# (label, file suffix, function): cumulative seconds of each, read from the profile
STAGES = (
    ("the layouts, each planned on its own", "autofit/planning/climb.py", "plan_layout"),
    ("  layer analysis (the small simulations)", "autofit/analyse/analyse.py", "analyse_model"),
    ("  full estimates (quick path, verification)", "autofit/solve/estimator.py", "simulate"),
    ("  the search (checkpoint MILP, with its verification)", "autofit/solve/verify.py", "search_verified"),
    ("every simulation", "autofit/simulate/run.py", "simulate_step"),
    ("  value twins' mode (and all below it)", "autofit/simulate/value_twins.py", "__torch_dispatch__"),
    ("  the tracker's mode (and all below it)", "autofit/simulate/tracker.py", "__torch_dispatch__"),
    ("  fake tensors' dispatch", "torch/_subclasses/fake_tensor.py", "dispatch"),
    ("  FSDP2's hooks (all-gather, reduce-scatter)", "torch/distributed/fsdp/_fully_shard/_fsdp_common.py",
     "wrapper"),
    ("  the optimizer's step (on fake tensors)", "autofit/training/step.py", "optimizer_step"),
    ("the CUDA caching allocator's replays (smallest budget)", "autofit/cuda/allocator.py", "replay_allocator"),
    ("the checkpoint MILPs (HiGHS)", "scipy/optimize/_milp.py", "milp"),
)


def _cumulative(stats: pstats.Stats, suffix: str, name: str) -> tuple[int, float]:
    calls, seconds = 0, 0.0
    for (path, _, function), (_, ncalls, _, cumtime, _) in stats.stats.items():
        if function == name and path.endswith(suffix):
            calls, seconds = calls + ncalls, max(seconds, cumtime)  # recursive entries repeat the outer time
    return calls, seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--nodes", type=int, choices=(1, 4), default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--dump", type=Path, default=None, help="also write the cProfile stats here (pstats)")
    parser.add_argument("--deep", default=None, help="profile this row of benchmarks/planning.py --deep instead")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    os.environ["AUTOFIT_WORKERS"] = "1"  # every simulation in this process, where the profiler sees it
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import autofit, autofit.cli"], check=True, cwd=ROOT)
    print(f"a fresh process importing autofit (and torch) and its command line: {time.perf_counter() - start:.1f} s")
    if args.deep is not None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from planning import _deep_cases  # the rows as planning.py plans them

        label, model, sample, target, loss_fn, kw = next(c for c in _deep_cases() if c[0].startswith(args.deep))
        kw = dict(kw)
        budget = kw.pop("budget")

        def run():
            return autofit.plan(model, sample, budget, target=target, loss_fn=loss_fn, **kw)
    else:
        label = f"{args.layers} layers, {args.nodes} x 8 H100-80GB, sequence {args.seq}"
        with torch.device("meta"):
            model = Llama(llama3_70b_config(max_seq_len=args.seq, num_layers=args.layers))
        ids = torch.zeros(1, args.seq, dtype=torch.long)

        def run():
            return autofit.plan(model, ids, "80GB", batch_size=32, target=ids, device="H100-80GB",
                                layout=autofit.Layout(world_size=8 * args.nodes, gpus_per_node=8, strategy="fsdp2"))
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    plan = run()
    profile.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(profile)
    if args.dump is not None:
        stats.dump_stats(args.dump)
    print(f"{label}: planned in {wall:.1f} s under the profiler (chose {plan.layout}, micro-batch "
          f"{plan.micro_batch_size} x {plan.gradient_accumulation_steps}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print("| part | calls | seconds | share of the plan |\n| --- | --- | --- | --- |")
    for label, suffix, name in STAGES:
        calls, seconds = _cumulative(stats, suffix, name)
        print(f"| {label} | {calls} | {seconds:.1f} | {100 * seconds / wall:.0f} % |")
    print("\n(cumulative times: a row includes the rows indented under it; simulations run in this process here, "
          "so the profile sees them)")


if __name__ == "__main__":
    main()
