"""The whole step's timeline built from three cuts a period apart (Note [a timeline extended in depth],
autofit/simulate/depth.py), against its truth: the simulation of the whole model. The caching allocator replayed over
the built timeline gives the whole simulation's CUDA figures to the byte, the segment figures included, which the
line through the cuts does not (Note [segment figures in depth], autofit/solve/extrapolate.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import autofit
from autofit.options import Options
from autofit.request import make_request
from autofit.simulate.depth import extend_checked
from autofit.simulate.timeline import replay
from autofit.solve.candidate import Candidate
from autofit.solve.depth import depth_runs
from autofit.solve.estimator import Estimator
from autofit.solve.extrapolate import extrapolate
from autofit.parallel.choices import layouts
from benchmarks.llama import Llama, LlamaConfig

LAYERS = 12
# blocks' tensors of a few MiB, so that they take the caching allocator's large segments
CFG = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1376, num_layers=LAYERS, num_heads=8,
                  max_seq_len=1024)
BLOCKS = tuple(f"layers.{i}" for i in range(LAYERS))


def _loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _estimator(world_size: int = 1, strategy: str | None = None) -> Estimator:
    with torch.device("meta"):
        model = Llama(CFG)
    ids = torch.zeros(2, CFG.max_seq_len, dtype=torch.long)
    options = Options.of(precision="bf16", savers=autofit.Savers(checkpoint="auto"), device="H100-80GB",
                         layout=autofit.Layout(world_size=world_size, strategy=strategy),
                         search=autofit.Search(extrapolate_depth=True))
    request = make_request(model, ids, "80GB", options=options, batch_size=2 * world_size, target=ids, loss_fn=_loss,
                           optimizer="adamw")
    return Estimator(request, layouts(request, strategy)[0])


CASES = {
    "plain": (1, None, (), 1),
    "every-block-recomputed": (1, None, BLOCKS, 1),
    "fsdp2-front-recomputed-two-micro-batches": (2, "fsdp2", BLOCKS[:5], 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_allocator_over_the_built_timeline_equals_the_whole_simulation(case):
    world_size, strategy, checkpoint, accumulation = CASES[case]
    estimator = _estimator(world_size, strategy)
    policy = estimator.request.policies[0]
    c = Candidate(policy.label, 2, accumulation, 2 * accumulation, checkpoint, 0, 0.0)
    run = depth_runs(estimator.config(c, policy), estimator.request.blocks)[0]
    sims = [estimator.simulate(c, policy, depth=keep) for keep in run.keeps]
    timeline = extend_checked(tuple(s.timeline for s in sims), run.steps, "layers")
    assert timeline is not None
    device = estimator.request.device
    built = device.estimate(dataclasses.replace(sims[-1], timeline=timeline, replay=replay(timeline)))
    whole = device.estimate(estimator.simulate(c, policy))
    for attr in ("peak_bytes", "peak_reserved_bytes", "device_bytes", "min_device_bytes"):
        assert getattr(built, attr) == getattr(whole, attr), attr
    assert dict(built.breakdown) == dict(whole.breakdown)


def test_extension_refused_where_the_deeper_cut_is_not_the_shallower_with_ranges_added():
    from autofit.simulate.depth import extended_timeline
    from autofit.simulate.timeline import EventKind, StorageRecord, Timeline
    from autofit.core.categories import Category
    from autofit.simulate.timeline import Phase

    def timeline(sizes):
        t = Timeline()
        for n in sizes:
            sid = t.new_storage(StorageRecord(n, Category.ACTIVATIONS, -1, "layers.0", Phase.FORWARD))
            t.free(sid)
        return t
    # a period of one 4 KiB allocation: extended by two periods
    ext = extended_timeline(timeline([1, 4096, 2]), timeline([1, 4096, 4096, 2]), 2, "layers")
    assert [ext.storages[v].nbytes for k, v in ext.events if k is EventKind.ALLOC] == [1] + [4096] * 4 + [2]
    # the deeper one changes an allocation: nothing to copy
    assert extended_timeline(timeline([1, 4096, 2]), timeline([1, 8192, 4096, 3]), 2, "layers") is None


def test_near_the_budget_off_their_line_the_segment_figures_are_the_replays():
    """Note [segment figures in depth] by hand (80 blocks from 8, 9, 10): the reserve steps 19, 21, 20 GB, off its
    line; with a budget within OFF_LINE_CLEARANCE of the smallest budget carried, the estimate is the replay's over
    the built timeline (``whole``), its host figures still carried along their line; without a replay, None."""
    from autofit.capture.depth import Blocks
    from autofit.core.report import MemoryEstimate
    from autofit.solve.depth import DepthRun

    def figures(blocks, reserve, floor):
        peak = 10**9 + blocks * 10**8
        return MemoryEstimate(peak_bytes=peak, breakdown={"activations": peak, "fragmentation": reserve},
                              device_bytes=peak + reserve, peak_reserved_bytes=peak + reserve,
                              min_device_bytes=peak + floor, host_bytes=blocks * 1000)
    run = DepthRun(Blocks("layers", 80), 1, (tuple(range(8)), tuple(range(9)), tuple(range(10))), 70)
    ests = (figures(8, 19 * 10**9, 900 * 10**6), figures(9, 21 * 10**9, 920 * 10**6),
            figures(10, 20 * 10**9, 910 * 10**6))
    carried = extrapolate(run, ests)
    replayed = MemoryEstimate(peak_bytes=9 * 10**9, breakdown={"activations": 9 * 10**9}, device_bytes=10**10,
                              peak_reserved_bytes=10**10, min_device_bytes=9_500_000_000,
                              under=lambda budget: None)
    fit = carried.min_device_bytes
    assert extrapolate(run, ests, fit) is None
    est = extrapolate(run, ests, fit, whole=lambda: replayed)
    assert (est.peak_bytes, est.device_bytes, est.min_device_bytes) == (9 * 10**9, 10**10, 9_500_000_000)
    assert est.host_bytes == 80 * 1000
    assert any("replayed through the caching allocator" in n for n in est.notes)
    assert est.within(10**10) is est and est.within(9_600_000_000) is None
    # far from the budget: the figures carried along their lines, as before
    assert extrapolate(run, ests, 2 * fit, whole=lambda: replayed).min_device_bytes == carried.min_device_bytes


def test_under_a_budget_the_breakdown_is_carried_with_the_figures():
    """A depth-extrapolated estimate under a budget (``within``) is the deepest cut's replay under the cap shifted by
    the growth to all blocks: each category of its breakdown too. By hand, 80 blocks from 8, 9, 10: parameters 10^8
    per block (8 GB at 80), activations 10^9 + 10^8 per block (9 GB), a 2 GB reserve on every cut; under an 18 GB
    cap the reserve above the 17 GB of tensors is 1 GB. Before, the breakdown was the 10-block cut's (1 GB of
    parameters under a plan of 80 blocks)."""
    from dataclasses import replace

    from autofit.capture.depth import Blocks
    from autofit.core.report import MemoryEstimate
    from autofit.solve.depth import DepthRun

    def figures(blocks):
        params, acts, reserve = blocks * 10**8, 10**9 + blocks * 10**8, 2 * 10**9
        peak = params + acts
        est = MemoryEstimate(peak_bytes=peak, breakdown={"parameters": params, "activations": acts,
                                                         "fragmentation": reserve},
                             device_bytes=peak + reserve, peak_reserved_bytes=peak + reserve,
                             min_device_bytes=peak + 10**8)

        def under(budget):  # the cap frees cached segments: the same tensors, less reserve
            if budget < peak + 10**8:
                return None
            return replace(est, device_bytes=budget, peak_reserved_bytes=budget,
                           breakdown={"parameters": params, "activations": acts, "fragmentation": budget - peak})
        return replace(est, under=under)
    run = DepthRun(Blocks("layers", 80), 1, (tuple(range(8)), tuple(range(9)), tuple(range(10))), 70)
    carried = extrapolate(run, (figures(8), figures(9), figures(10)))
    assert carried.device_bytes == 19 * 10**9 and carried.breakdown["parameters"] == 8 * 10**9
    capped = carried.within(18 * 10**9)
    assert capped.device_bytes == 18 * 10**9
    assert capped.breakdown == {"parameters": 8 * 10**9, "activations": 9 * 10**9, "fragmentation": 10**9}
