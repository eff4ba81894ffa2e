"""Every exporter's output for a fixed set of layouts, as JSON: a refactor of ``autofit/emit/export.py`` (or of the
layout dimensions it asks, issue 54) must leave every one unchanged, to the byte, key order included (the CLI prints
the dicts as YAML, TOML and JSON in their order).

One plan is planned on the CPU (the ``plan8`` fixture of tests/test_layout_exports.py: FSDP2 over 8 ranks on 2 nodes
of 4); each case replaces its layout (and, for a few, its precision, recomputed modules or split), the exporters
reading the plan's fields only. For each case: the five exporters' dicts (``EXPORTERS``), the torchtitan TOML and
``export_file`` for each framework.

    python benchmarks/export_snapshot.py OUT.json                   # write the snapshot
    python benchmarks/export_snapshot.py OUT.json --compare BASE.json   # write, then compare case by case
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import autofit  # noqa: E402
from autofit.emit.export import EXPORTERS, export_file, to_torchtitan_toml  # noqa: E402
from autofit.parallel.layout import Parallel  # noqa: E402
from autofit.training.precision import PrecisionPolicy  # noqa: E402
from zoo import ZOO  # noqa: E402

# a tensor-parallel plan by hand (Parallel checks only that one is given with tensor_parallel > 1): the styles the
# exports read (torchtitan's note names the embedding / head split and the sequence-parallel norms)
TP_PLAN = (("blocks.0.attn.qkv", "colwise"), ("blocks.0.attn.proj", "rowwise"), ("blocks.0.mlp.fc", "colwise"),
           ("blocks.0.mlp.proj", "rowwise"))
TP_FULL_PLAN = (("embed", "embedding_rowwise"),) + TP_PLAN + (("head", "colwise_rep"),)
SP_PLAN = TP_PLAN + (("blocks.0.norm", "sequence_parallel"),)


def _layouts(units: tuple[str, ...]) -> dict[str, Parallel]:
    fsdp = dict(strategy="fsdp2", world_size=8, gpus_per_node=4, shard_units=units)
    return {
        "one-process": Parallel(),
        "ddp4": Parallel(strategy="ddp", world_size=4),
        "ddp8-2nodes": Parallel(strategy="ddp", world_size=8, gpus_per_node=4),
        "fsdp8-zero3": Parallel(**fsdp),
        "fsdp8-zero2": Parallel(**fsdp, reshard_after_forward=False),
        "fsdp8-raf4": Parallel(**fsdp, reshard_after_forward=4),
        "fsdp8-raf2-many-units": Parallel(**{**fsdp, "shard_units": units * 2}, reshard_after_forward=2),
        "fsdp8-reduce-every": Parallel(**fsdp, reduce_every_micro_batch=True),
        "hsdp2x4-zero3": Parallel(**fsdp, replicate=2),
        "hsdp2x4-zero2": Parallel(**fsdp, replicate=2, reshard_after_forward=False),
        "fsdp1-offload": Parallel(strategy="fsdp2", world_size=1, shard_units=units[:1], offload_states=True),
        "fsdp4-offload": Parallel(strategy="fsdp2", world_size=4, shard_units=units, offload_states=True),
        "tp2-fsdp4": Parallel(**fsdp, tensor_parallel=2, tensor_plan=TP_PLAN),
        "tp2-fsdp4-zero2": Parallel(**fsdp, tensor_parallel=2, tensor_plan=TP_PLAN, reshard_after_forward=False),
        "tp2-fsdp4-titan-plan": Parallel(**fsdp, tensor_parallel=2, tensor_plan=TP_FULL_PLAN),
        "tp2-fsdp4-sp": Parallel(**fsdp, tensor_parallel=2, tensor_plan=SP_PLAN),
        "tp4-alone": Parallel(strategy="fsdp2", world_size=4, gpus_per_node=4, shard_units=units, tensor_parallel=4,
                              tensor_plan=TP_PLAN),
        "tp2-alone-sp": Parallel(strategy="fsdp2", world_size=2, shard_units=units, tensor_parallel=2,
                                 tensor_plan=SP_PLAN),
    }


def _variants(plan: autofit.Plan) -> dict[str, autofit.Plan]:
    """The plan as planned, and with what the layout parts of the exports read beside the layout: lower precision,
    recomputed modules (FSDP's and the Trainer's switches), a stored precision, an uneven split."""
    units = plan.parallel.shard_units or ("blocks.0", "blocks.1")
    checkpoint = tuple(units[:2])
    return {
        "planned": plan,
        "bf16-recompute": dataclasses.replace(plan, precision=PrecisionPolicy(name="bf16"), checkpoint=checkpoint),
        "fp16-selective": dataclasses.replace(plan, precision=PrecisionPolicy(name="fp16"), checkpoint=checkpoint,
                                              selective=checkpoint[:1]),
        "stored-bf16": dataclasses.replace(plan, precision=PrecisionPolicy(name="bf16", stored="bf16")),
        "uneven": dataclasses.replace(plan, micro_batch_size=3, gradient_accumulation_steps=1,
                                      last_micro_batch_size=1, even_split=None),
    }


def _exports(plan: autofit.Plan) -> dict:
    out: dict = {}
    for name, exporter in EXPORTERS.items():
        try:
            out[name] = exporter(plan)
        except Exception as e:  # noqa: BLE001 - recorded: a refactor must fail the same way
            out[name] = {"error": type(e).__name__, "message": str(e)}
        try:
            text, notes = export_file(plan, name)
            out[f"{name}/file"] = {"text": text, "notes": notes}
        except Exception as e:  # noqa: BLE001
            out[f"{name}/file"] = {"error": type(e).__name__, "message": str(e)}
    out["torchtitan/toml"] = to_torchtitan_toml(plan)
    return out


def snapshot() -> dict:
    case = ZOO["gpt_sdpa"]()
    base = autofit.plan(case.model, case.sample, "64MB", batch_size=16, target=case.target, loss_fn=case.loss_fn,
                        device="cpu",
                        layout=autofit.Layout(world_size=8, gpus_per_node=4, strategy="fsdp2",
                                              reshard_after_forward=True, replicate=1), precision="fp32")
    cases = {}
    for layout_name, parallel in _layouts(base.parallel.shard_units).items():
        plan = dataclasses.replace(base, parallel=parallel)
        for variant, p in _variants(plan).items():
            cases[f"{layout_name}/{variant}"] = _exports(p)
    return cases


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    cases = snapshot()
    # no sort_keys: the key order is part of what must not change
    out.write_text(json.dumps(cases, indent=1, default=repr) + "\n")
    print(f"{len(cases)} cases written to {out}")
    if "--compare" in argv:
        base = json.loads(Path(argv[argv.index("--compare") + 1]).read_text(), object_pairs_hook=list)
        now = json.loads(out.read_text(), object_pairs_hook=list)
        base_d, now_d = dict(base), dict(now)
        differ = [k for k in base_d.keys() | now_d.keys() if base_d.get(k) != now_d.get(k)]
        for k in sorted(differ):
            print("DIFFERS:", k)
        print(f"{len(base_d)} cases before, {len(now_d)} now, {len(differ)} differ")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
