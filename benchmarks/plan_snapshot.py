"""Plans of a fixed set of cases, as JSON: a refactor of the planner must leave every one unchanged, to the byte.

Each case is a ``plan.to_json()``, or for an infeasible budget the error's type, message and ``min_budget_bytes``.
The cases reach every rung of the planner's ladder: the quick path, the search at generous, halfway and tightest
budgets on the CPU and a GPU target, the optimizer step in backward, lower stored precisions, the states on the
host, both data-parallel strategies, tensor and sequence parallel, fp32 pins, and infeasible budgets (with and
without the host rung). A snapshot written before a group of cases was added differs by those cases: compare the
part both have with ``--only``, or write the base again with this file over the base's code.

    python benchmarks/plan_snapshot.py OUT.json            # write the snapshot
    python benchmarks/plan_snapshot.py OUT.json --compare BASE.json   # write, then compare case by case
    python benchmarks/plan_snapshot.py OUT.json --only a100,dp        # a part: the zoo on the A100, data parallel
    python benchmarks/plan_snapshot.py OUT.json --only tp             # tensor parallel alone
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import autofit  # noqa: E402
from benchmarks.llama import Llama, LlamaConfig  # noqa: E402
from autofit.options import Options  # noqa: E402
from autofit.planner import plan_with_analysis  # noqa: E402
from autofit.request import make_request  # noqa: E402
from zoo import ZOO  # noqa: E402

GiB = 2**30
GPU = dict(device="A100-80GB")
ROOMY = {"cpu": "1TB", "a100": "79GB"}  # generous, and under the card's memory (a budget above it is refused)


def _record(fn) -> dict:
    try:
        return {"plan": json.loads(fn().to_json())}
    except autofit.InfeasibleBudgetError as e:
        return {"error": type(e).__name__, "message": str(e), "min_budget_bytes": e.min_budget_bytes}
    except autofit.AutofitError as e:
        return {"error": type(e).__name__, "message": str(e)}


def _zoo_cases(only: set[str] | None = None):
    """Each zoo model on the CPU and an A100: 1 byte (infeasible), the smallest budget that works, halfway to what
    the fastest configuration needs, and a generous one (the quick path)."""
    for name in ("resnet_bn", "gpt_sdpa", "lstm", "hf_dict"):
        for where, kw in (("cpu", dict(device="cpu")), ("a100", GPU)):
            if only is not None and where not in only:
                continue
            def run(budget, name=name, kw=kw, **more):
                case = ZOO[name]()
                return autofit.plan(case.model, case.sample, budget, batch_size=16, target=case.target,
                                    loss_fn=case.loss_fn, **kw, **more)
            tiny = _record(lambda: run(1))
            yield f"{name}/{where}/1B", tiny
            roomy = _record(lambda: run(ROOMY[where]))
            yield f"{name}/{where}/{ROOMY[where]}", roomy
            if "min_budget_bytes" in tiny and "plan" in roomy:
                least = tiny["min_budget_bytes"]
                yield f"{name}/{where}/min", _record(lambda: run(least))
                half = (least + roomy["plan"]["device_bytes"]) // 2
                yield f"{name}/{where}/half", _record(lambda: run(half))
                case = ZOO[name]()
                yield f"{name}/{where}/half-alternatives", _record(lambda: plan_with_analysis(make_request(
                    case.model, case.sample, half, options=Options.of(**kw), batch_size=16, target=case.target,
                    loss_fn=case.loss_fn))[0])


def _meta_llama(**overrides):
    config = LlamaConfig(**{"vocab_size": 32000, "hidden_size": 1536, "intermediate_size": 4096, "num_layers": 2,
                            "num_heads": 12, "max_seq_len": 256, **overrides})
    with torch.device("meta"):
        model = Llama(config)
    return model, torch.zeros(1, config.max_seq_len, dtype=torch.long, device="meta")


def _mlp(width: int = 512, depth: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)],
                         nn.Linear(width, 10))


def _special_cases():
    # stored precision (tests/test_stored_planning.py): pure bf16, and a floor that keeps the master copy
    model, ids = _meta_llama()
    yield "llama-meta/stored-bf16", _record(lambda: autofit.plan(model, ids, int(2.2 * GiB), batch_size=4,
                                                                 target=ids, **GPU))
    yield "llama-meta/floor-master", _record(lambda: autofit.plan(
        model, ids, int(2.2 * GiB), batch_size=4, target=ids,
        precision=autofit.Precision(min_stored="fp32-master"), savers=autofit.Savers(offload=False), **GPU))
    yield "llama-meta/1B", _record(lambda: autofit.plan(model, ids, 1, batch_size=4, target=ids, **GPU))
    yield "llama-meta/1B-no-offload", _record(lambda: autofit.plan(model, ids, 1, batch_size=4, target=ids,
                                                                   savers=autofit.Savers(offload=False), **GPU))
    # the optimizer step in backward (tests/test_in_backward.py)
    mlp = _mlp()
    x, y = torch.randn(2, 512), torch.randint(0, 10, (2,))
    knobs = dict(target=y, device="cpu", precision="fp32", optimizer="adamw")
    yield "in-backward/1B", _record(lambda: autofit.plan(mlp, x, 1, **knobs))
    plain = autofit.estimate(mlp, x, step=autofit.Step(micro_batch_size=1, accumulation_steps=2), target=y).peak_bytes
    fused = autofit.estimate(mlp, x, target=y,
                             step=autofit.Step(micro_batch_size=2, optimizer_in_backward=True)).peak_bytes
    yield "in-backward/between", _record(lambda: autofit.plan(mlp, x, (plain + fused) // 2, **knobs))
    yield "in-backward/clipped", _record(lambda: autofit.plan(mlp, x, (plain + fused) // 2, clip_grad_norm=1.0,
                                                              **knobs))
    yield "in-backward/auto", _record(lambda: autofit.plan(mlp, x, (plain + fused) // 2, target=y, device="cpu"))
    # the states on the host (tests/test_offload.py)
    off = _mlp(256, 6)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    kw = dict(target=y, precision="fp32")  # and the default savers: checkpoint and offload "auto"
    t4 = autofit.Device(gpu="T4")
    without = _record(lambda: autofit.plan(off, x, 1, device=t4, savers=autofit.Savers(offload=False), **kw))
    yield "offload/1B-no-offload", without
    with_offload = _record(lambda: autofit.plan(off, x, 1, device=t4, **kw))
    yield "offload/1B", with_offload
    yield "offload/1B-host-small", _record(lambda: autofit.plan(
        off, x, 1, device=autofit.Device(gpu="T4", host_budget=10**6), **kw))
    budget = (with_offload["min_budget_bytes"] + without["min_budget_bytes"]) // 2
    yield "offload/between", _record(lambda: autofit.plan(
        off, x, budget, device=autofit.Device(gpu="T4", host_budget="1GB"), **kw))
    yield "offload/between-host-small", _record(lambda: autofit.plan(
        off, x, budget, device=autofit.Device(gpu="T4", host_budget=10**6), **kw))
    yield "offload/auto-precision-between", _record(lambda: autofit.plan(
        off, x, budget, target=y, device=autofit.Device(gpu="T4", host_budget="1GB")))
    # fp32 pins: named and "auto" (tests/test_stored_planning.py)
    case = ZOO["hf_dict"]()
    yield "pins/lm_head", _record(lambda: autofit.plan(case.model, case.sample, "1GB", batch_size=8,
                                                       precision=autofit.Precision(fp32_modules=["lm_head"]),
                                                       **GPU))
    yield "pins/auto", _record(lambda: autofit.plan(case.model, case.sample, "1GB", batch_size=8,
                                                    precision=autofit.Precision(fp32_modules="auto"), **GPU))
    yield "pins/auto-cpu-bf16", _record(lambda: autofit.plan(case.model, case.sample, "1GB", batch_size=8,
                                                             device="cpu", savers=autofit.Savers(checkpoint=None),
                                                             precision=autofit.Precision(compute="bf16",
                                                                                         fp32_modules="auto")))
    # an uneven batch (the even split for the exports) and a fixed checkpoint set
    case = ZOO["gpt_sdpa"]()
    tiny = _record(lambda: autofit.plan(case.model, case.sample, 1, batch_size=10, target=case.target, **GPU))
    if "min_budget_bytes" in tiny:
        yield "uneven/min", _record(lambda: autofit.plan(case.model, case.sample, tiny["min_budget_bytes"],
                                                         batch_size=10, target=case.target, **GPU))
    yield "fixed-checkpoint/1B", _record(lambda: autofit.plan(case.model, case.sample, 1, batch_size=10,
                                                              target=case.target,
                                                              savers=autofit.Savers(checkpoint=case.checkpoint), **GPU))


def _dp_cases():
    """Data parallel: both strategies planned, DDP and FSDP2 alone; 1 byte, the smallest budget, a generous one."""
    case = ZOO["gpt_sdpa"]()
    for strategy in (None, "ddp", "fsdp2"):
        def run(budget, strategy=strategy):
            return autofit.plan(case.model, case.sample, budget, batch_size=16, target=case.target,
                                layout=autofit.Layout(world_size=2, strategy=strategy), **GPU)
        tiny = _record(lambda: run(1))
        yield f"dp/{strategy}/1B", tiny
        if "min_budget_bytes" in tiny:
            yield f"dp/{strategy}/min", _record(lambda: run(tiny["min_budget_bytes"]))
        yield f"dp/{strategy}/79GB", _record(lambda: run("79GB"))


def _tp_cases():
    """Tensor parallel (tests/test_tensor_parallel_plan.py, tests/test_sequence_parallel.py): "auto" over two nodes
    of H100s, T 2 on the CPU, sequence parallel's plan, a user's mapping, an estimate of one rank, and clipping
    refused; each at a generous budget and one that fits nothing."""
    from sharded_models import tiny_llama, wide_blocks

    from autofit.parallel.tensor_parallel import sequence_parallel_plan

    case = tiny_llama("meta")
    sequence = sequence_parallel_plan(case.model)
    for budget in ("1GB", "30MB"):
        yield f"tp/auto-h100/{budget}", _record(lambda: autofit.plan(
            case.model, case.sample, budget, batch_size=16, device="H100",
            layout=autofit.Layout(world_size=8, gpus_per_node=4, strategy="fsdp2", tensor_parallel="auto")))
        yield f"tp/2-cpu/{budget}", _record(lambda: autofit.plan(
            case.model, case.sample, budget, batch_size=8, device="cpu", precision="fp32",
            layout=autofit.Layout(world_size=4, strategy="fsdp2", tensor_parallel=2)))
        yield f"tp/sequence-a100/{budget}", _record(lambda: autofit.plan(
            case.model, case.sample, budget, batch_size=8, device="A100-80GB",
            layout=autofit.Layout(world_size=4, strategy="fsdp2", tensor_parallel="auto",
                                  tensor_parallel_plan=sequence)))
    wide = wide_blocks("meta")
    mapping = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    yield "tp/mapping-cpu/1GB", _record(lambda: autofit.plan(
        wide.model, wide.sample, "1GB", batch_size=8, target=wide.target, loss_fn=wide.loss_fn, device="cpu",
        precision="fp32", layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2,
                                                tensor_parallel_plan=mapping)))
    yield "tp/clipped", _record(lambda: autofit.plan(
        case.model, case.sample, "1GB", batch_size=8, device="cpu", clip_grad_norm=1.0,
        layout=autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2)))


def snapshot(only: set[str] | None = None) -> dict:
    cases = {}
    if only is None:
        chosen = itertools.chain(_zoo_cases(), _special_cases(), _dp_cases(), _tp_cases())
    else:  # a part: the zoo on the targets named, the data-parallel and tensor-parallel cases if "dp", "tp" named
        chosen = itertools.chain(_zoo_cases(only), _dp_cases() if "dp" in only else (),
                                 _tp_cases() if "tp" in only else ())
    for name, record in chosen:
        cases[name] = record
        print(f"{name:<40} {'plan' if 'plan' in record else record['error']}", flush=True)
    return cases


def main() -> None:
    out = Path(sys.argv[1])
    start = time.perf_counter()
    only = set(sys.argv[sys.argv.index("--only") + 1].split(",")) if "--only" in sys.argv else None
    cases = snapshot(only)
    print(f"{len(cases)} cases in {time.perf_counter() - start:.1f} s (torch {torch.__version__})")
    out.write_text(json.dumps(cases, indent=1, sort_keys=True) + "\n")
    if "--compare" in sys.argv:
        base = json.loads(Path(sys.argv[sys.argv.index("--compare") + 1]).read_text())
        differ = [n for n in sorted(set(base) | set(cases)) if base.get(n) != cases.get(n)]
        print(f"compared with the base: {len(cases)} cases, {len(differ)} differ" + (": " + ", ".join(differ)
                                                                                        if differ else ""))
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
