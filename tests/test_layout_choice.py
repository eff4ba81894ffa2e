"""The time model of each FSDP2 layout (ring collectives over NVLink and the network, hand-computed) and the
planner's choice among the layouts."""

from __future__ import annotations

import math

import pytest

import autofit
from autofit.cuda.catalog import gpu_spec
from autofit.core.errors import InvalidInputError
from autofit.parallel.collectives import Links
from autofit.parallel.layout import Parallel
from autofit.parallel.step_time import collective_seconds
from zoo import ZOO

GB = 1e9


H100_LINKS = Links(intra_bytes_per_second=450 * GB, inter_bytes_per_second=50 * GB)


def _h100(world: int, per_node: int, **kw) -> Parallel:
    return Parallel(strategy="fsdp2", world_size=world, gpus_per_node=per_node, **kw)


def test_catalog_links_are_the_datasheets_halved_and_the_nics_per_gpu():
    # NVLink totals (bidirectional) from the datasheets: A100 600 GB/s, H100 SXM 900 GB/s; one direction is half.
    # DGX A100: 8 x 200 Gb/s HDR per 8 GPUs; DGX H100: 8 x 400 Gb/s NDR per 8 GPUs.
    assert gpu_spec("A100-80GB").interconnect == 300 * GB and gpu_spec("A100-80GB").network == 25 * GB
    assert gpu_spec("H100-80GB").interconnect == 450 * GB and gpu_spec("H100-80GB").network == 50 * GB
    assert gpu_spec("V100-32GB").network == 6.25 * GB  # DGX-1: 4 x 100 Gb/s EDR for 8 GPUs


def test_zero3_zero2_and_int_reshard_collectives_by_hand():
    params = grads = 16 * GB  # an 8B model in bf16
    # one node of 8: ring factor 7/8, NVLink 450 GB/s; 4 micro-batches
    one_gather = 7 / 8 * 16e9 / 450e9
    zero3 = collective_seconds(_h100(8, 8), H100_LINKS, params, grads, 4)
    zero2 = collective_seconds(_h100(8, 8, reshard_after_forward=False), H100_LINKS, params, grads, 4)
    assert zero3 == pytest.approx(4 * 2 * one_gather + one_gather)  # gathers in forward and backward, one RS
    assert zero2 == pytest.approx(4 * one_gather + one_gather)  # the backward gather is gone
    # 4 nodes x 8: the shard ring crosses nodes, so it runs at the network's 50 GB/s
    slow = 31 / 32 * 16e9 / 50e9
    assert collective_seconds(_h100(32, 8), H100_LINKS, params, grads, 1) == pytest.approx(3 * slow)
    # reshard to one node after forward: the backward gather runs over 8 ranks on NVLink
    grouped = collective_seconds(_h100(32, 8, reshard_after_forward=8), H100_LINKS, params, grads, 1)
    assert grouped == pytest.approx(2 * slow + one_gather)


def test_hsdp_shards_within_a_node_and_all_reduces_shards_across_nodes():
    params = grads = 16 * GB
    # 4 nodes x 8, HSDP (replicate 4, shard 8): gathers and reduce-scatter on NVLink; then an all-reduce of each
    # rank's gradient shard (16 GB / 8) over the 4 replicas, 2 x 3/4 of it, on the network
    hsdp = collective_seconds(_h100(32, 8, replicate=4), H100_LINKS, params, grads, 2)
    one_gather = 7 / 8 * 16e9 / 450e9
    assert hsdp == pytest.approx(2 * 2 * one_gather + one_gather + 2 * 3 / 4 * 2e9 / 50e9)
    ddp = collective_seconds(Parallel(strategy="ddp", world_size=32, gpus_per_node=8), H100_LINKS, params, grads, 2)
    assert ddp == pytest.approx(2 * 31 / 32 * 16e9 / 50e9)


@pytest.mark.sim
def test_the_planner_keeps_the_faster_layout_and_says_why():
    case = ZOO["gpt_sdpa"]()
    plan = autofit.plan(case.model, case.sample, "64MB", batch_size=16, target=case.target, loss_fn=case.loss_fn,
                        device="cpu", layout=autofit.Layout(world_size=2, strategy="fsdp2"), precision="fp32")
    # both fit at the same micro-batch here; ZeRO-2 skips the backward all-gather, so it is faster
    assert plan.parallel.reshard_after_forward is False and plan.parallel.replicate == 1
    why = [n for n in plan.notes if "chosen" in n]
    assert why and "fsdp2 (ZeRO-3)" in why[0], plan.notes
    assert autofit.Plan.from_json(plan.to_json()).parallel.reshard_after_forward is False


@pytest.mark.parametrize("kwargs,words", [
    (dict(reshard_after_forward=3, world_size=4), "divisor of the shard group size 4"),
    (dict(replicate=3, world_size=4), "does not divide world_size 4"),
    (dict(gpus_per_node=3, world_size=4), "gpus_per_node 3 does not divide world_size 4"),
    (dict(reshard_after_forward=False, world_size=2, strategy="ddp"), "FSDP2 layouts"),
])
def test_bad_layouts_are_refused_before_any_simulation(kwargs, words):
    case = ZOO["gpt_sdpa"]()
    layout = autofit.Layout(**{"strategy": "fsdp2", **kwargs})
    with pytest.raises(InvalidInputError, match=words):
        autofit.plan(case.model, case.sample, "64MB", batch_size=8, target=case.target, loss_fn=case.loss_fn,
                     device="cpu", layout=layout)


def test_auto_layouts_across_nodes():
    """4 nodes x 8 with "auto": ZeRO-3, ZeRO-2 and the reshard to a node over all 32 ranks, and HSDP 4 x 8 with
    ZeRO-3 and ZeRO-2 (a reshard to 8 inside a shard group of 8 is no reshard: torch refuses it as an int)."""
    from autofit.parallel.choices import layouts
    from autofit.parallel.requested import fsdp2_layouts

    assert fsdp2_layouts(32, "fsdp2", 8, "auto", "auto") == (8, (True, False, 8), (1, 4))
    assert fsdp2_layouts(8, "fsdp2", None, "auto", "auto") == (8, (True, False), (1,))
    case = ZOO["gpt_sdpa"]()
    from autofit.options import Options
    from autofit.request import make_request

    options = Options.of(precision="auto", savers=autofit.Savers(checkpoint="auto"), device="cpu",
                         layout=autofit.Layout(world_size=32, gpus_per_node=8, strategy="fsdp2"),
                         search=autofit.Search(alternatives=False))
    request = make_request(case.model, case.sample, "1GB", options=options, batch_size=32, target=case.target,
                           loss_fn=case.loss_fn, optimizer="adamw")
    labels = [p.label for p in layouts(request, "fsdp2")]
    assert labels == ["fsdp2 (ZeRO-3) over 32 ranks", "fsdp2 (ZeRO-2) over 32 ranks",
                      "fsdp2 (resharded to 8) over 32 ranks", "hsdp 4 x 8 (ZeRO-3)", "hsdp 4 x 8 (ZeRO-2)"]


@pytest.mark.slow  # 60.8 CPU s on a slow machine (2026-11-27), over the sim tier's 60
def test_the_layout_whose_search_begins_fastest_is_verified_first_and_alone():
    """Note [the layout to verify first], autofit/planning/race.py. A 2-block Llama (hidden 1024) on 8 A100s with FSDP2
    under 2 GB: ZeRO-2 has fewer collectives, so it came first, but holding every gathered parameter it must run
    micro-batch 1 where ZeRO-3 runs 2. The plan of both layouts is the faster of the two planned alone, and only its
    full estimate runs: ZeRO-2's search begins slower than ZeRO-3's verified plan, so it is never verified."""
    import torch

    from autofit.core import progress
    from benchmarks.llama import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(num_layers=2, hidden_size=1024, intermediate_size=2816, num_heads=8,
                                  vocab_size=32000))
    ids = torch.zeros(1, 1024, dtype=torch.long)
    kw = dict(batch_size=16, target=ids, device=autofit.Device(kind="cuda", gpu="A100-80GB"),
              search=autofit.Search(alternatives=True))

    def planned(reshard):
        full = []
        with progress.listening(lambda s: full.append(s.what) if s.what.endswith("in full") else None):
            plan = autofit.plan(model, ids, "2GB", layout=autofit.Layout(world_size=8, strategy="fsdp2",
                                                                         reshard_after_forward=reshard), **kw)
        return plan, len(full)

    zero3, _ = planned(True)
    zero2, _ = planned(False)
    assert zero2.predicted_step_seconds > zero3.predicted_step_seconds and zero2.micro_batch_size == 1
    both, full = planned("auto")
    assert full == 1  # ZeRO-3's winner; ZeRO-2 first, as by its collectives, verified two
    same = ("micro_batch_size", "gradient_accumulation_steps", "checkpoint", "selective", "device_bytes",
            "predicted_step_seconds")
    assert [getattr(both, f) for f in same] == [getattr(zero3, f) for f in same]
    assert both.parallel.reshard_after_forward == zero3.parallel.reshard_after_forward
    assert any(n.startswith("fsdp2 (ZeRO-2) over 8 ranks not planned: its fastest configuration the models allow")
               for n in both.notes), both.notes


def test_tensor_parallel_layouts_have_no_int_reshard():
    """4 nodes x 8 with tensor_parallel="auto": beside T = 1's five layouts (test_auto_layouts_across_nodes), each T
    with ZeRO-3 and ZeRO-2 over the other dim, and never the reshard to a node's GPUs: torch refuses an int
    reshard_after_forward on tensor-parallel (DTensor) weights (torch 2.13, ``FSDPParam.to_sharded_post_forward``
    raises "Resharding to smaller mesh is not supported for DTensor parameters yet"), which a 405B plan learned by
    analysing three such layouts."""
    from autofit.options import Options
    from autofit.request import make_request
    from autofit.parallel.choices import layouts
    from sharded_models import wide_blocks

    case = wide_blocks("meta")
    mapping = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    options = Options.of(precision="auto", savers=autofit.Savers(checkpoint="auto"), device="cpu",
                         layout=autofit.Layout(world_size=32, gpus_per_node=8, strategy="fsdp2",
                                               tensor_parallel="auto", tensor_parallel_plan=mapping),
                         search=autofit.Search(alternatives=False))
    request = make_request(case.model, case.sample, "1GB", options=options, batch_size=32, target=case.target,
                           loss_fn=case.loss_fn, optimizer="adamw")
    found = layouts(request, "fsdp2")
    split = [p for p in found if p.tensor_parallel > 1]
    assert {p.tensor_parallel for p in split} == {2, 4, 8}
    assert sorted((p.tensor_parallel, p.reshard_after_forward) for p in split) == [
        (2, False), (2, True), (4, False), (4, True), (8, False), (8, True)]
    assert [p.label for p in found if p.tensor_parallel == 1] == [
        "fsdp2 (ZeRO-3) over 32 ranks", "fsdp2 (ZeRO-2) over 32 ranks", "fsdp2 (resharded to 8) over 32 ranks",
        "hsdp 4 x 8 (ZeRO-3)", "hsdp 4 x 8 (ZeRO-2)"]


def _two_linears_over(world: int, per_node: int, reshard, min_stored=None):
    """Two 1024 x 1024 linear layers (fp32, on meta) as one FSDP2 layout over ``world`` A100s, its climb."""
    import torch
    from torch import nn

    from autofit.options import Options
    from autofit.planning.climb import Climb
    from autofit.request import make_request
    from autofit.parallel.choices import layouts

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    options = Options.of(precision=autofit.Precision(compute="auto", min_stored=min_stored),
                         savers=autofit.Savers(checkpoint="auto"), device="A100-80GB",
                         layout=autofit.Layout(world_size=world, gpus_per_node=per_node, strategy="fsdp2",
                                               reshard_after_forward=reshard, replicate=1))
    request = make_request(model, torch.zeros(8, 1024, device="meta"), "8GB", options=options, batch_size=8 * world,
                           loss_fn=lambda out: out.sum(), optimizer="adamw")
    (parallel,) = layouts(request, "fsdp2")
    return request, Climb.of(request, parallel)


def test_collectives_alone_are_the_ring_count_at_one_micro_batch_in_the_fewest_stored_bytes():
    """Note [ruled out by arithmetic]: ZeRO-3 over 16 A100s on 2 nodes (the shard ring crosses them: the network's
    25 GB/s per GPU) at one micro-batch gathers the parameters twice and reduce-scatters them once, each moving 15/16
    of them per rank (nccl-tests PERFORMANCE.md), in the model's fp32; a rung that stores them in bf16 halves it."""
    from dataclasses import replace

    from autofit.planning.race import _collectives_alone
    from autofit.training.precision import PrecisionPolicy

    request, climb = _two_linears_over(16, 8, True)
    params = 2 * (1024 * 1024 + 1024)
    by_hand = 3 * 15 / 16 * (params * 4) / 25e9
    assert _collectives_alone(request, climb.parallel, climb.stages) == pytest.approx(by_hand)
    lower = replace(climb.stages[0], policies=(PrecisionPolicy(name="bf16", stored="bf16"),))
    assert _collectives_alone(request, climb.parallel, (*climb.stages, lower)) == pytest.approx(by_hand / 2)
    # ZeRO-2 gathers once: two passes, not three
    request, climb = _two_linears_over(16, 8, False)
    assert _collectives_alone(request, climb.parallel, climb.stages) == pytest.approx(by_hand * 2 / 3)


def test_a_layout_whose_collectives_alone_lose_is_ranked_without_analysis():
    """Note [ruled out by arithmetic]: ranking a layout against a best bound its collectives alone already miss
    returns that floor, and nothing is analysed (no search space built); against a slower bound it is analysed."""
    from autofit.planning.race import _bound, _collectives_alone

    request, climb = _two_linears_over(16, 8, True)
    floor = _collectives_alone(request, climb.parallel, climb.stages)
    assert _bound(climb, floor / 2) == floor and climb.spaces == {}


@pytest.mark.sim
def test_layouts_whose_collectives_alone_lose_are_never_simulated():
    """Note [ruled out by arithmetic]. 270.5 M parameters (a 262,144 x 1024 embedding and two 1024 x 1024 linears,
    fp32) with almost no compute, over 8 nodes x 8 A100s: HSDP 8 x 8 keeps its shard ring on NVLink and is planned
    first (0.0262 s a step). Every layout whose ring crosses the nodes (the network's 25 GB/s per GPU) moves the
    whole 1,082,138,624 bytes at least twice at one micro-batch: DDP's all-reduce is 2 x 63/64 x that / 25e9 =
    0.0852 s, ZeRO-3's two gathers and a reduce-scatter 0.128 s. Those four layouts are dropped unsimulated (before
    this, each ran a full simulation: 6 in all, the same plan), the notes giving the figures."""
    import torch
    from torch import nn

    from autofit.core import progress

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(262144, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    ids = torch.zeros(4, 16, dtype=torch.long, device="meta")
    seen = []
    with progress.listening(lambda s: seen.append(s.what)):
        plan = autofit.plan(model, ids, "79GB", batch_size=256, loss_fn=lambda out: out.float().mean(),
                            device="A100-80GB", layout=autofit.Layout(world_size=64, gpus_per_node=8))
    assert plan.layout == "hsdp 8 x 8 (ZeRO-2)"
    nbytes = (262144 * 1024 + 2 * (1024 * 1024 + 1024)) * 4
    assert nbytes == 1_082_138_624
    ring = 63 / 64 * nbytes / 25e9
    dropped = {n.split(" not planned")[0]: n for n in plan.notes if "collectives alone" in n}
    assert set(dropped) == {"ddp", "fsdp2 (ZeRO-2) over 64 ranks", "fsdp2 (resharded to 8) over 64 ranks",
                            "fsdp2 (ZeRO-3) over 64 ranks"}
    assert f"at least {2 * ring:.3g} s per step" in dropped["ddp"]
    assert f"at least {3 * ring:.3g} s per step" in dropped["fsdp2 (ZeRO-3) over 64 ranks"]
    assert all(f"no faster than the plan found, {plan.predicted_step_seconds:.3g} s" in n for n in dropped.values())
    assert sum(1 for w in seen if w.endswith("in full")) == 2  # the two HSDP layouts only


@pytest.mark.sim
def test_a_layout_where_nothing_fits_is_named_when_another_has_a_plan(monkeypatch):
    """With a plan found, a layout whose rungs' models fit nothing (its smallest budget left uncomputed) is still
    named in the notes: the 405B plan of issue 56 named none of its three ZeRO-3 x tensor-parallel layouts. Its
    climb is replaced by one where nothing fits; its fallback must never run."""
    from autofit.planning import race
    from autofit.planning.climb import Unplanned

    case = ZOO["gpt_sdpa"]()
    real = race.plan_layout

    def climb(request, parallel, *args, **kwargs):
        if parallel.reshard_after_forward is False:
            raise Unplanned("nothing fits", fallback=lambda: pytest.fail("the fallback ran"))
        return real(request, parallel, *args, **kwargs)

    monkeypatch.setattr(race, "plan_layout", climb)
    plan = autofit.plan(case.model, case.sample, "79GB", batch_size=16, target=case.target, device="A100-80GB",
                        layout=autofit.Layout(world_size=2, strategy="fsdp2"))
    assert plan.layout == "fsdp2 (ZeRO-3)"
    assert any(n.startswith("fsdp2 (ZeRO-2) over 2 ranks not planned: nothing fits with the models of its rungs on the GPUs")
               for n in plan.notes)


def test_a_layout_whose_first_rungs_fit_nothing_is_ranked_by_the_rung_its_climb_reaches(monkeypatch):
    """Note [the layout to verify first]: the race climbs past a rung whose models fit nothing (planning/climb.py
    ``plan_layout``), so a layout's bound is the first rung that fits something, not inf. The 405B plan of issue
    56 ranked its three ZeRO-3 x TP layouts all at inf (their deferring rungs fit nothing: each rank would hold its
    shard's unsharded gradients), raced them in the order of their collectives, and verified TP 8 (235 s) and TP 4
    (155 s) before TP 2 (116 s), which won. Rungs here are stand-ins; what is checked is the climb's order."""
    from types import SimpleNamespace

    from autofit.planning import race

    rungs = {"deferred": (math.inf, None), "fp32": (3.0, None), "reducing": (4.0, 5.0), "host": (1.0, 1.0)}
    stages = [SimpleNamespace(what=w, skipped=lambda fit: False, host_check=w == "host") for w in rungs]
    climb = SimpleNamespace(stages=stages, fit=1, request=None, parallel=None,
                            searchable=lambda stage: (None, stage.what, None))
    searched = []
    monkeypatch.setattr(race, "_collectives_alone", lambda *a: 0.0)
    monkeypatch.setattr(race, "time_floor", lambda space, fit: rungs[space][0])
    monkeypatch.setattr(race, "search", lambda space, fit: (searched.append(space) or (
        None if rungs[space][1] is None else SimpleNamespace(seconds=rungs[space][1])), []))
    # the deferring rung fits nothing even fully recomputed (no MILP); the fp32 rung's search finds nothing; the
    # reducing rung's is the bound; the host rung is never the bound (planned only when nothing fits on the GPUs)
    assert race._bound(climb, math.inf) == 5.0 and searched == ["fp32", "reducing"]
    # a floor that cannot beat the best bound so far is the bound, no MILP solved
    searched.clear()
    assert race._bound(climb, 3.5) == 4.0 and searched == ["fp32"]
    rungs["reducing"] = (4.0, None)
    assert race._bound(climb, math.inf) == math.inf


def test_once_a_layout_has_a_plan_the_others_smallest_budgets_and_slower_analyses_are_released():
    """Note [bounded memory]: after a layout's turn the tally keeps the fastest plan's analyses only, and drops the
    fallbacks (each holding a climb's analyses) that run only when no layout has a plan."""
    from types import SimpleNamespace

    from autofit.planning.climb import Unplanned as _Unplanned
    from autofit.planning.race import _Tally

    tally = _Tally()
    unplanned = _Unplanned("nothing fits", fallback=lambda: None)
    tally.unplanned.append(("tp 8", unplanned))
    tally.release()  # no plan yet: the smallest budget may still be needed
    assert unplanned.fallback is not None
    slow, fast = SimpleNamespace(predicted_step_seconds=2.0), SimpleNamespace(predicted_step_seconds=1.0)
    tally.results += [(slow, {"bf16": "slow's"}), (fast, {"bf16": "fast's"})]
    tally.release()
    assert unplanned.fallback is None and str(unplanned) == "nothing fits"
    assert tally.results == [(slow, {}), (fast, {"bf16": "fast's"})]
