"""How long a whole ``autofit.plan()`` takes next to one ``autofit.estimate()`` of the same model.

The goal (issue: planner) is that a plan costs at most about two estimates. Two regimes:
- generous budget: the fastest configuration the time model allows (whole batch in one micro-batch, preferred
  precision, no recomputation) fits, which one full estimate shows: no analysis is needed (Note [the quick path]);
- tight budget, halfway between the smallest budget that works (with the states on the device) and what that
  fastest configuration needs, as the issue defines it: the planner simulates the window at two small micro-batches
  per precision, models every other configuration, solves, and verifies its winner with one full estimate.
The kernel-probe cache is cleared before each timing; the estimate timed is of the configuration the plan chose.
A second table splits each tight plan into its stages (from the planner's progress reports), in units of that one
estimate: what the ratio is made of (docs/planner.md, "How long a plan takes").

    python benchmarks/planning.py            # a few zoo models and a small Llama, CPU and CUDA planning
    python benchmarks/planning.py --hf       # also the issue's two Hugging Face rows (needs transformers):
                                             # GPT-2 and a Llama, 4 layers each, batch 32 x 128, from configs
    python benchmarks/planning.py --deep     # deep models at full size (needs transformers; minutes): Llama-3.1-8B
                                             # (from its config) on 8 A100s with FSDP2 and on one H100, the 70B shape
                                             # on 4 x 8 H100s; each plan with depth extrapolation "auto" (the
                                             # default) against extrapolate_depth=False (the old default), the
                                             # same run, next to one full estimate and one MemTracker step
    python benchmarks/planning.py --deep --no-base   # only the default (--only=70B: the cases so labelled)
    python benchmarks/planning.py --deep --base-70b  # also the 70B plan of the whole model (about an hour)
    python benchmarks/planning.py --against /path/to/base/checkout   # the deep rows, base against new, one run
                                             # (each plan a fresh process: start-up and imports counted)
    python benchmarks/planning.py --lora-7b  # issue 56's anchor: the CLI's LoRA plan of Qwen2.5-7B (one RTX 4090,
                                             # 64 x 4096) in a fresh process, against one MemTracker step of the
                                             # micro-batch it chose (add --against PATH for the base's plan too)

Measured with --lora-7b (two cores shared with other work, load 2 to 3, torch 2.13.0, 2026-11-29; the plan a fresh
process, imports and the model's build included; MemTracker in this process, after it):

    case                 which       wall s   CPU s  plan
    7B LoRA RTX 4090     new           47.6    58.1  2x32 19.21 GiB 139.083 s ckpt=28 sel=0 (states on the host)
    7B LoRA RTX 4090     MemTracker     2.9          one step of micro-batch 2, LoRA: crash (RuntimeError: a
                                                     gradient hook on a frozen parameter)
    7B LoRA RTX 4090     MemTr. full   22.3          one step of micro-batch 2, no adapter, nothing recomputed

Before issue 56's work (803d26e), the same command one run after the other on the same machine: 128.6 s wall, 125.0
CPU s, 80 checkpoint MILPs (80.1 s of them); after: 58.7 s wall, 56.4 CPU s, 10 MILPs (5.8 s), the same plan.

Measured with --deep (two cores, torch 2.13.0, AUTOFIT_WORKERS unset; seconds of one plan, "auto" is the default,
"whole model" extrapolate_depth=False, the two in the same run; a helper's tests ran beside the first two rows):

    case                 how          plan s  plan
    8B fsdp2 8xA100      auto           30.9  fsdp2 (ZeRO-3) 4x1 bf16 72.46 GiB 5.198 s ckpt=63 sel=15
    8B fsdp2 8xA100      whole model    89.2  fsdp2 (ZeRO-3) 4x1 bf16 74.16 GiB 5.086 s ckpt=69 sel=19
    8B one H100          auto           14.2  8x1 bf16 73.38 GiB 29.985 s ckpt=44 host
    8B one H100          whole model    64.7  8x1 bf16 74.40 GiB 29.955 s ckpt=41 sel=4 host

With --deep --against (each plan a fresh process, start-up, imports and exit included; two idle cores, torch 2.13.0,
2026-11-27; the 70B row also prints autofit.plan's own seconds). Base 83b4ef1 (before this issue's work; its 70B
plan opts in to depth extrapolation, without which it takes about an hour), then f00efc7 (before the layout
ordering, the climb that stops, the quick path's first cuts and the frozen exit), each in its own run:

    case                 which   wall s   CPU s  plan
    8B fsdp2 8xA100      new       26.5    31.7  4x1 fsdp2 72.46 GiB 5.198 s ckpt=63 sel=15
    8B fsdp2 8xA100      83b4ef1   90.2   139.8  4x1 fsdp2 74.16 GiB 5.086 s ckpt=69 sel=19
    8B one H100          new       23.1    29.5  8x1 73.38 GiB 29.985 s ckpt=44 sel=0
    8B one H100          83b4ef1   91.4   129.0  8x1 74.40 GiB 29.955 s ckpt=41 sel=4
    70B fsdp2 4x8 H100   new       25.4    34.6  1x1 fsdp2 (autofit.plan: 21.9 s) 73.92 GiB 21.407 s ckpt=81 sel=6
    70B fsdp2 4x8 H100   83b4ef1   30.5    40.7  1x1 fsdp2 (autofit.plan: 26.9 s) 74.19 GiB 21.457 s ckpt=81 sel=3

    8B fsdp2 8xA100      new       24.4    29.3  (the same plans as f00efc7's in every row)
    8B fsdp2 8xA100      f00efc7   34.6    39.4
    8B one H100          new       22.4    28.5
    8B one H100          f00efc7   27.0    35.0
    70B fsdp2 4x8 H100   new       24.6    32.2  (autofit.plan: 20.3 s)
    70B fsdp2 4x8 H100   f00efc7   28.1    37.0  (autofit.plan: 24.0 s)

In one run of --deep --no-base --only="one H100" (in one process): the plan 13.0 s, one autofit.estimate of the
configuration it chose 7.2 s, one MemTracker step of it 34.7 s.

The plans differ: with the analysis at 3 blocks the search ranks configurations on an extended analysis (Note
[extending an analysis in depth]) and finds a slightly slower one (+2.2 % predicted step on 8 A100s, +0.1 % on one
H100), each verified by its own full estimate. On a loaded machine (load 6 to 8) the single-H100 row took 54.3 s
(auto), 261.7 s (whole model), one estimate of the chosen configuration 44.7 s and one MemTracker step of it 310.3 s;
the 70B shape on 4 x 8 H100s planned in 192.6 s (auto; 1 x 1, bf16, resharded to 8 after forward, 73.92 GiB,
21.41 s predicted).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# the autofit timed: this checkout's, or with --against another checkout's, in a child process of this script
# (the cases, the zoo and the Llama are always this checkout's, so both sides plan the same models)
CHECKOUT = Path(os.environ.get("AUTOFIT_PLANNING_CHECKOUT", ROOT))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(CHECKOUT))

import autofit  # noqa: E402
from autofit.core import progress, workers  # noqa: E402
from autofit.core.workers import parallel_available  # noqa: E402
from autofit.simulate import run as simulation  # noqa: E402
from llama import Llama, LlamaConfig  # noqa: E402
from zoo import ZOO  # noqa: E402


def _cases(hf: bool = False):
    for name in ("resnet_bn", "gpt_sdpa", "lstm", "unet"):
        case = ZOO[name]()
        yield name, case.model, case.sample, case.target, case.loss_fn, 32
    torch.manual_seed(0)
    cfg = LlamaConfig(num_layers=4, hidden_size=256, intermediate_size=688, num_heads=4, vocab_size=4000)
    ids = torch.randint(0, 4000, (2, 256))
    yield "llama-4x256", Llama(cfg), ids, ids, None, 16
    if hf:  # the rows: Hugging Face models nobody here wrote, built from configs (no hub, no weights)
        import transformers

        torch.manual_seed(0)
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4))
        ids = torch.randint(0, gpt2.config.vocab_size, (2, 128))
        yield "hf-gpt2-4L", gpt2, {"input_ids": ids, "labels": ids.clone()}, None, None, 32
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=4, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=32000))
        ids = torch.randint(0, 32000, (2, 128))
        yield "hf-llama-4L", llama, {"input_ids": ids, "labels": ids.clone()}, None, None, 32


def _clear_probe_cache() -> None:
    simulation._PROBER.cache.clear()


def _timed(fn):
    _clear_probe_cache()
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _cpu() -> float:
    """CPU seconds of this process and of its children waited for (forked simulation workers): what a plan costs
    regardless of other work on the machine, which only adds wall time."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


STAGES = ("setup", "quick path", "analysis", "search", "verify", "finish")


def _stage_of(what: str, current: str, seen: set[str]) -> str:
    """The stage a progress report belongs to. A stage's first report names it; the reports inside it (a
    simulation's forward and backward, a memory model, a checkpoint MILP) keep the stage they are in. A full
    simulation before any analysis or search is the quick path's, later ones verify; what follows the last
    verification (the plan's notes, the even split, a table of rows by length) finishes."""
    if what.startswith("simulating micro-batch") and what.endswith("in full"):
        return "verify" if seen & {"analysis", "search"} else "quick path"
    if what.startswith("verifying"):
        return "verify"
    if what.startswith("analysing"):
        return "analysis"
    if what.startswith("searching") or what.startswith("checkpoint MILP"):
        return "search" if current != "verify" or what.startswith("searching") else current
    if what.startswith("rows") or what.startswith("the plan without") or what.startswith("optional fp32"):
        return "finish"
    return current


def _staged_plan(fn) -> tuple[object, float, dict[str, float], int, float]:
    """``fn()`` timed as ``_timed`` does, with the seconds spent in each stage (from the planner's progress reports),
    the number of full simulations after the quick path (verifications) and the CPU seconds (``_cpu``)."""
    marks: list[tuple[float, str]] = []
    seen: set[str] = set()
    full = [0]

    def listen(stage: progress.Stage) -> None:
        name = _stage_of(stage.what, marks[-1][1] if marks else "setup", seen)
        if stage.what.startswith("simulating micro-batch") and name == "verify":
            full[0] += 1
        seen.add(name)
        marks.append((time.perf_counter(), name))

    _clear_probe_cache()
    cpu = _cpu()
    start = time.perf_counter()
    with progress.listening(listen):
        result = fn()
    end = time.perf_counter()
    cpu = _cpu() - cpu
    spent = dict.fromkeys(STAGES, 0.0)
    edges = [start] + [t for t, _ in marks] + [end]
    names = ["setup"] + [n for _, n in marks]
    for name, a, b in zip(names, edges, edges[1:]):
        spent[name] += b - a
    return result, end - start, spent, full[0], cpu


def _device(gpu: str | None, **more) -> autofit.Device:
    return autofit.Device(gpu=gpu, **more) if gpu else autofit.Device(kind="cpu", **more)


def _step(micro_batch_size: int, **knobs) -> dict:
    """``estimate``'s step keywords in the form the autofit loaded understands: ``--against`` runs this script with
    an older checkout's, whose ``Step`` has no ``micro_batch_size`` (before issue 54 it was a keyword of its own), or
    which has no ``Step`` at all (f8a51ab, issue 54's base: every knob a keyword)."""
    if not hasattr(autofit, "Step"):
        return {"micro_batch_size": micro_batch_size, **knobs}
    if "micro_batch_size" in {f.name for f in dataclasses.fields(autofit.Step)}:
        return {"step": autofit.Step(micro_batch_size=micro_batch_size, **knobs)}
    return {"micro_batch_size": micro_batch_size, "step": autofit.Step(**knobs)}


def zoo_rows(hf: bool = False, only: str | None = None, repeat: int = 1):
    """Each zoo case on the CPU and an A100 at a generous and a tight budget: (name, device label, regime, plan
    seconds, estimate seconds, the plan in one line, stage seconds, verifications, a digest of the plan's JSON); the
    tight budget is halfway between the smallest that works (with the states on the device) and what the fastest
    configuration needs. Each time the fastest of ``repeat`` runs (the plan's stages those of its fastest run)."""
    for name, model, sample, target, loss_fn, batch in _cases(hf=hf):
        if only is not None and name != only:
            continue
        for gpu in (None, "A100-80GB"):
            kw = dict(target=target, loss_fn=loss_fn)
            # a generous budget over the A100's memory, which plan() refuses unless told (issue 30)
            over = _device(gpu, allow_over_capacity=True)
            autofit.estimate(model, sample, device=_device(gpu), **kw, **_step(1))  # first-use costs, untimed
            roomy, _ = _timed(lambda: autofit.plan(model, sample, "1TB", batch_size=batch, device=over, **kw))
            try:
                autofit.plan(model, sample, 1, batch_size=batch, device=_device(gpu), **kw,
                             **({"savers": autofit.Savers(offload=False)} if gpu else {}))
                raise AssertionError("a 1-byte budget fits")
            except autofit.InfeasibleBudgetError as e:
                smallest = e.min_budget_bytes
            tight = (smallest + roomy.device_bytes) // 2
            label = "cpu" if gpu is None else f"cuda {gpu}"
            for regime, budget in (("generous", "1TB"), ("tight", tight)):
                try:  # the fastest of ``repeat`` runs: other work on the machine only ever adds time
                    runs = [_staged_plan(lambda: autofit.plan(model, sample, budget, batch_size=batch, device=over,
                                                              **kw)) for _ in range(repeat)]
                except autofit.InfeasibleBudgetError:
                    yield name, label, regime, None, None, "infeasible halfway", {}, 0, "", None, None
                    continue
                plan, plan_s, spent, verifies, _ = min(runs, key=lambda run: run[1])
                plan_cpu = min(run[4] for run in runs)
                estimates = []
                for _ in range(repeat):
                    cpu = _cpu()
                    estimates.append((_timed(lambda: autofit.estimate(
                        model, sample, precision=plan.precision,
                        device=_device(gpu), **kw,
                        **_step(plan.micro_batch_size, accumulation_steps=plan.gradient_accumulation_steps,
                                checkpoint=plan.checkpoint)))[1], _cpu() - cpu))
                est_s, est_cpu = min(e[0] for e in estimates), min(e[1] for e in estimates)
                summary = (f"{plan.micro_batch_size}x{plan.gradient_accumulation_steps} {plan.precision.name} "
                           f"ckpt={len(plan.checkpoint)} {plan.device_bytes} B")
                digest = hashlib.sha1(plan.to_json().encode()).hexdigest()[:12]  # the whole plan, to compare
                yield name, label, regime, plan_s, est_s, summary, spent, verifies, digest, plan_cpu, est_cpu


def _repeat(default: int) -> int:
    """``--repeat=N``: each timing the fastest of N runs."""
    return next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--repeat=")), default)


def _median(values: list[float]) -> float:
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {parallel_available()} simulation(s) at once "
          f"(Note [parallel simulations]; {workers.ENV}=1 for one)")
    header = (f"{'case':<14} {'device':<18} {'budget':<8} {'plan s':>7} {'estimate s':>11} {'ratio':>6}  plan")
    print(header)
    print("-" * len(header))
    ratios = {"generous": [], "tight": []}
    breakdown = []
    for name, label, regime, plan_s, est_s, summary, spent, verifies, *_ in zoo_rows(hf="--hf" in sys.argv[1:],
                                                                                   repeat=_repeat(1)):
        if plan_s is None:
            print(f"{name:<14} {label:<18} {regime:<8} {summary}")
            continue
        ratios[regime].append(plan_s / est_s)
        if regime == "tight":
            breakdown.append((name, label, plan_s / est_s, {k: v / est_s for k, v in spent.items()}, verifies))
        print(f"{name:<14} {label:<18} {regime:<8} {plan_s:>7.2f} {est_s:>11.2f} {plan_s / est_s:>6.2f}  {summary}",
              flush=True)
    for regime, values in ratios.items():
        if values:
            print(f"{regime:<8} plan / estimate: median {_median(values):.2f}, max {max(values):.2f} over "
                  f"{len(values)} rows")
    print("the issue's goal for tight budgets: median at most 2, max at most 3")
    print()
    print("tight plans by stage, in units of the one estimate (verify: how many full simulations)")
    head = f"{'case':<14} {'device':<18} " + " ".join(f"{s:>12}" for s in STAGES) + f" {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for name, label, ratio, units, verifies in breakdown:
        cells = [f"{units[s]:>12.2f}" if s != "verify" else f"{units[s]:>8.2f} ({verifies})" for s in STAGES]
        print(f"{name:<14} {label:<18} " + " ".join(cells) + f" {ratio:>6.2f}")


def _deep_cases():
    """(label, model, sample, target, loss_fn, plan keywords): the planning-speed issue's deep rows."""
    from autofit.cli.specs import load_spec
    from benchmarks.multi_gpu_70b import llama3_70b_config

    spec = load_spec("hf:meta-llama/Llama-3.1-8B", input_shapes=[(4096,)])  # the CLI's model: config only, meta
    eight = dict(budget="80GB", batch_size=32, device="A100-80GB",
                 layout=autofit.Layout(world_size=8, strategy="fsdp2"))
    yield "8B fsdp2 8xA100", spec.model, spec.sample, spec.target, spec.loss_fn, eight
    yield "8B one H100", spec.model, spec.sample, spec.target, spec.loss_fn, dict(budget="80GB", batch_size=8,
                                                                                  device="H100-80GB")
    with torch.device("meta"):
        model = Llama(llama3_70b_config(max_seq_len=8192))
    ids = torch.zeros(1, 8192, dtype=torch.long)
    yield "70B fsdp2 4x8 H100", model, ids, ids, None, dict(
        budget="80GB", batch_size=32, device="H100-80GB",
        layout=autofit.Layout(world_size=32, gpus_per_node=8, strategy="fsdp2"))


def _summary(plan) -> str:
    layout = f"{plan.layout} " if plan.parallel.world_size > 1 else ""
    return (f"{layout}{plan.micro_batch_size}x{plan.gradient_accumulation_steps} {plan.precision.label} "
            f"{plan.device_bytes / 2**30:.2f} GiB {plan.predicted_step_seconds:.3f} s ckpt={len(plan.checkpoint)}"
            f"{' sel=' + str(len(plan.selective)) if plan.selective else ''}"
            f"{' host' if plan.parallel.offload_states else ''}")


def deep(base: bool = True, base_70b: bool = False) -> None:
    """Plan time of deep models, with depth extrapolation (the default) and without, in one run."""
    from benchmarks.memtracker_baseline import memtracker_estimate

    print(f"{'case':<20} {'how':<14} {'plan s':>7}  plan")
    print("-" * 100)
    only = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--only=")), None)
    for label, model, sample, target, loss_fn, kw in _deep_cases():
        if only is not None and only not in label:
            continue
        kw = dict(kw)
        budget = kw.pop("budget")
        whole = base and (base_70b or not label.startswith("70B"))
        exact = {"search": autofit.Search(extrapolate_depth=False)}
        runs = [("auto", {})] + ([("whole model", exact)] if whole else [])
        plans = {}
        for how, extra in runs:
            plan, seconds = _timed(lambda: autofit.plan(model, sample, budget, target=target, loss_fn=loss_fn,
                                                        **kw, **extra))
            plans[how] = plan
            print(f"{label:<20} {how:<14} {seconds:>7.1f}  {_summary(plan)}", flush=True)
        plan = plans["auto"]
        # estimate and MemTracker simulate one process: the single-GPU row
        if kw.get("layout", autofit.Layout()).world_size == 1:
            _, est_s = _timed(lambda: autofit.estimate(
                model, sample, precision=plan.precision,
                target=target, loss_fn=loss_fn, device=kw["device"],
                step=autofit.Step(micro_batch_size=plan.micro_batch_size,
                                  accumulation_steps=plan.gradient_accumulation_steps, checkpoint=plan.checkpoint,
                                  offload=plan.offload, offload_states=plan.parallel.offload_states,
                                  inputs="micro-batch")))
            print(f"{label:<20} {'one estimate':<14} {est_s:>7.1f}  (the plan's configuration, whole model)")
            tracked = memtracker_estimate(model, sample, micro_batch_size=plan.micro_batch_size, target=target,
                                          loss_fn=loss_fn, precision="bf16", checkpoint=plan.checkpoint)
            print(f"{label:<20} {'MemTracker':<14} {tracked.seconds:>7.1f}  (one step of the same micro-batch, "
                  f"{tracked.error or 'ran'})", flush=True)
        if "whole model" in plans:
            same = plans["whole model"].to_json() == plan.to_json()
            print(f"{'':<20} {'same plan' if same else 'plans differ'}")


# The deep rows as a user runs them, one fresh process each. The 8B rows are the command line; the 70B shape
# has no checkpoint to name, so a short script builds it (its config, on the meta device) and prints the plan's JSON.
_LLAMA_8B = ["hf:meta-llama/Llama-3.1-8B", "--budget", "80GB", "--input-shape", "4096", "--json", "--quiet"]
_AGAINST_CASES = (
    ("8B fsdp2 8xA100", [*_LLAMA_8B, "--batch-size", "32", "--gpu", "A100-80GB", "--world-size", "8",
                         "--strategy", "fsdp2"]),
    ("8B one H100", [*_LLAMA_8B, "--batch-size", "8", "--gpu", "H100-80GB"]),
    ("70B fsdp2 4x8 H100", None),
)
_PLAN_70B = """
import sys, warnings, torch, autofit
warnings.filterwarnings("ignore")
from benchmarks.llama import Llama
from benchmarks.multi_gpu_70b import llama3_70b_config
with torch.device("meta"):
    model = Llama(llama3_70b_config(max_seq_len=8192))
ids = torch.zeros(1, 8192, dtype=torch.long)
extra = {"search": autofit.Search(extrapolate_depth=True)} if sys.argv[1] == "opt-in" else {}
import time
start = time.perf_counter()
plan = autofit.plan(model, ids, "80GB", target=ids, batch_size=32, device="H100-80GB",
                    layout=autofit.Layout(world_size=32, gpus_per_node=8, strategy="fsdp2"), **extra)
print(f"autofit.plan: {time.perf_counter() - start:.1f} s", file=sys.stderr)
print(plan.to_json())
"""


# Issue 56's LoRA row: the commonest fine-tuning job, as the CLI runs it (peft's LoRA of rank 16 on the config's
# model, on the meta device); its anchor is one MemTracker step of the same model at the micro-batch the plan chose.
_LORA_7B = ["hf:Qwen/Qwen2.5-7B", "--lora", "16", "--budget", "24GB", "--batch-size", "64", "--input-shape", "4096",
            "--gpu", "RTX-4090", "--json", "--quiet"]


def lora_7b(base: Path | None = None) -> None:
    """The 7B LoRA plan's wall and CPU seconds (a fresh process: imports and the model's build counted), and
    ``base``'s in the same run, against MemTracker's one simulated step of that model and micro-batch."""
    from autofit.cli.adapters import Adapter
    from autofit.cli.specs import load_spec
    from benchmarks.memtracker_baseline import memtracker_estimate

    print(f"{'case':<20} {'which':<10} {'wall s':>7} {'CPU s':>7}  plan")
    print("-" * 100)
    chosen = None
    for which, repo in (("new", ROOT), *((("base", base),) if base is not None else ())):
        wall, cpu, summary = _run_plan(repo, _LORA_7B, opt_in=False)
        chosen = chosen or summary
        print(f"{'7B LoRA RTX 4090':<20} {which:<10} {wall:>7.1f} {cpu:>7.1f}  {summary}", flush=True)
    micro = int(chosen.split("x", 1)[0]) if chosen and chosen[0].isdigit() else 1
    # MemTracker registers a gradient hook on every parameter and dies on a frozen one (LoRA's base: "cannot
    # register a hook on a tensor that doesn't require gradient"): its one step of the model without the adapter
    # (every parameter trained) is the anchor then
    for which, adapter in (("MemTracker", Adapter(rank=16)), ("MemTr. full", None)):
        spec = load_spec("hf:Qwen/Qwen2.5-7B", input_shapes=[(4096,)], adapter=adapter)
        tracked = memtracker_estimate(spec.model, spec.sample, micro_batch_size=micro, target=spec.target,
                                      loss_fn=spec.loss_fn, precision="bf16")
        what = "LoRA" if adapter is not None else "no adapter, every parameter trained"
        print(f"{'7B LoRA RTX 4090':<20} {which:<10} {tracked.seconds:>7.1f} {'':>7}  (one step of micro-batch "
              f"{micro}, {what}, nothing recomputed: {tracked.error or 'ran'})", flush=True)
        if tracked.error is None:
            break


def _run_plan(repo: Path, args: list[str] | None, opt_in: bool) -> tuple[float, float, str]:
    """One plan in a fresh process of ``repo``'s autofit: wall seconds, CPU seconds (its forked workers included)
    and the plan in one line."""
    import json
    import os
    import resource
    import subprocess

    if args is None:
        command = [sys.executable, "-c", _PLAN_70B, "opt-in" if opt_in else "default"]
    else:
        command = [sys.executable, "-m", "autofit", "plan", *args]
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONWARNINGS="ignore")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        return wall, cpu, f"failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
    text = done.stdout
    plan = json.loads(text[text.index("{"):])
    layout = " fsdp2" if plan.get("world_size", 1) > 1 else ""
    inside = [line for line in done.stderr.splitlines() if line.startswith("autofit.plan: ")]
    layout += f" ({inside[-1]})" if inside else ""
    return wall, cpu, (f"{plan['micro_batch_size']}x{plan['gradient_accumulation_steps']}{layout} "
                       f"{plan['device_bytes'] / 2**30:.2f} GiB {plan['predicted_step_seconds']:.3f} s "
                       f"ckpt={len(plan['checkpoint'])} sel={len(plan.get('selective') or ())}")


def against(base: Path) -> None:
    """The deep rows' plan time, ``base`` (a checkout of an older autofit) against this one, alternating, one run.
    The base plans as its default does, except the 70B shape, which it plans with depth extrapolation opted in (its
    default, the whole model, takes about an hour)."""
    print(f"base {base}, new {ROOT}; wall and CPU seconds of one plan, a fresh process each (imports included)")
    print(f"{'case':<20} {'which':<6} {'wall s':>7} {'CPU s':>7}  plan")
    print("-" * 100)
    only = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--only=")), None)
    for label, args in _AGAINST_CASES:
        if only is not None and only not in label:
            continue
        for which, repo in (("new", ROOT), ("base", base)):
            wall, cpu, summary = _run_plan(repo, args, opt_in=which == "base")
            print(f"{label:<20} {which:<6} {wall:>7.1f} {cpu:>7.1f}  {summary}", flush=True)


def _zoo_side(repo: Path, only: str, repeat: int) -> list[dict]:
    """The zoo rows of case ``only`` planned by ``repo``'s autofit in a fresh process of this script."""
    import subprocess

    env = dict(os.environ, AUTOFIT_PLANNING_CHECKOUT=str(repo), PYTHONWARNINGS="ignore")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, __file__, "--rows-json", only, f"--repeat={repeat}"], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{repo}: {done.stderr.strip().splitlines()[-3:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def zoo_against(base: Path, repeat: int = 3) -> None:
    """The zoo rows, ``base`` (another checkout) against this one: each case a fresh process per side, the two
    sides one after the other, case by case, so that both see the same load; ratios, their medians and maxima,
    the tight plans' stages, and whether the two plans are the same."""
    print(f"base {base}, new {ROOT}; torch {torch.__version__}, {torch.get_num_threads()} threads; each case a "
          f"fresh process per side; each time the fastest of {repeat} runs")
    print(f"{'case':<12} {'device':<15} {'budget':<8} {'which':<5} {'plan s':>7} {'est. s':>7} {'ratio':>6} "
          f"{'CPU ratio':>9} {'verifies':>8}  plan")
    print("-" * 110)
    ratios: dict[tuple[str, str], list[float]] = {}
    stages: dict[str, dict[str, float]] = {}
    names = [c[0] for c in _cases()]
    for name in names:
        sides = {which: _zoo_side(repo, name, repeat) for which, repo in (("new", ROOT), ("base", base))}
        for new, old in zip(sides["new"], sides["base"]):
            for which, row in (("base", old), ("new", new)):
                if row["plan_s"] is None:
                    print(f"{row['name']:<12} {row['device'][:15]:<15} {row['regime']:<8} {which:<5} infeasible")
                    continue
                ratio, cpu_ratio = row["plan_s"] / row["est_s"], row["plan_cpu"] / row["est_cpu"]
                ratios.setdefault((row["regime"], which), []).append(ratio)
                ratios.setdefault((row["regime"] + " CPU", which), []).append(cpu_ratio)
                if row["regime"] == "tight":
                    for stage, seconds in row["spent"].items():
                        units = stages.setdefault(which, dict.fromkeys(STAGES, 0.0))
                        units[stage] += seconds / row["est_s"]
                same = "" if which == "base" else (" (same plan)" if new["plan"] == old["plan"] else " PLANS DIFFER")
                print(f"{row['name']:<12} {row['device'][:15]:<15} {row['regime']:<8} {which:<5} {row['plan_s']:>7.2f} "
                      f"{row['est_s']:>7.2f} {ratio:>6.2f} {cpu_ratio:>9.2f} {row['verifies']:>8}  {row['summary']}{same}",
                      flush=True)
    for (regime, which), values in sorted(ratios.items()):
        print(f"{regime:<12} {which:<5} plan / estimate: median {_median(values):.2f}, max {max(values):.2f} over "
              f"{len(values)} rows")
    for which, units in stages.items():
        count = len(ratios.get(("tight", which), [])) or 1
        print(f"tight {which:<5} mean stage, in estimates: " + ", ".join(
            f"{stage} {value / count:.2f}" for stage, value in units.items()))


def _rows_json(only: str, repeat: int) -> None:
    """Child of ``zoo_against``: the rows of case ``only`` as JSON lines, with the plan itself to compare."""
    for name, label, regime, plan_s, est_s, summary, spent, verifies, digest, plan_cpu, est_cpu in zoo_rows(
            only=only, repeat=repeat):
        print(json.dumps(dict(name=name, device=label, regime=regime, plan_s=plan_s, est_s=est_s, summary=summary,
                              plan=digest, spent=spent, verifies=verifies, plan_cpu=plan_cpu, est_cpu=est_cpu)),
              flush=True)


if __name__ == "__main__":
    if "--rows-json" in sys.argv[1:]:
        _rows_json(sys.argv[sys.argv.index("--rows-json") + 1], _repeat(3))
    elif "--against" in sys.argv[1:] and not ({"--deep", "--lora-7b"} & set(sys.argv[1:])):
        zoo_against(Path(sys.argv[sys.argv.index("--against") + 1]).resolve(), _repeat(3))
    elif "--lora-7b" in sys.argv[1:]:
        lora_7b(Path(sys.argv[sys.argv.index("--against") + 1]).resolve() if "--against" in sys.argv[1:] else None)
    elif "--against" in sys.argv[1:]:
        against(Path(sys.argv[sys.argv.index("--against") + 1]).resolve())
    elif "--deep" in sys.argv[1:]:
        deep(base="--no-base" not in sys.argv[1:], base_70b="--base-70b" in sys.argv[1:])
    else:
        main()
