"""Data parallelism on PyTorch's own engine (DDP, FSDP2), 2 processes on gloo, spawned with timeouts."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autofit
from autofit.parallel.layout import Parallel
from autofit.training.batch import as_batch
from autofit.training.loss import compute_loss
from autofit.simulate.run import simulate_step
from autofit.training.step import make_step_config
from zoo import ZOO

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
MEMORY_CASES = ("gpt_sdpa", "resnet_bn", "tied_lm")


def _run(jobs: list[dict], tmp_path: Path) -> list[list[dict]]:
    """Spawn WORLD processes running tests/dist_workers.run_jobs (dist_workers.launch)."""
    import dist_workers

    return dist_workers.launch(jobs, tmp_path, WORLD)


def _plan(case, strategy: str, budget: str = "64MB", precision: str = "fp32"):
    return autofit.plan(case.model, case.sample, budget, batch_size=8 * WORLD, target=case.target,
                        loss_fn=case.loss_fn, device="cpu",
                        layout=autofit.Layout(world_size=WORLD, strategy=strategy), precision=precision,
                        optimizer="adamw")


def _assert_both_ranks_equal(model, result0, result1, strategy: str) -> None:
    """Both ranks' parameters after the step equal the reference model's (and so each other's)."""
    for name, p in model.named_parameters():
        got = torch.tensor(result0[0]["params"][name], dtype=p.dtype)
        torch.testing.assert_close(got, p.detach(), rtol=1e-5, atol=1e-6, msg=f"{strategy}: {name}")
        torch.testing.assert_close(torch.tensor(result1[0]["params"][name], dtype=p.dtype), got)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_one_step_equals_a_full_batch_step_with_accumulation(strategy, tmp_path):
    torch.manual_seed(0)
    case = ZOO["tied_lm"]()
    plan = _plan(case, strategy)
    # force accumulation over two micro-batches per rank, whatever the budget allowed
    plan = dataclasses.replace(plan, micro_batch_size=4, gradient_accumulation_steps=2, last_micro_batch_size=4)
    result0, result1 = _run([{"kind": "equivalence", "case": "tied_lm", "plan": plan.to_json(),
                              "optimizer": "sgd"}], tmp_path)
    torch.manual_seed(0)
    reference_case = ZOO["tied_lm"]()
    model = reference_case.model.eval()  # dropout off, as in the workers
    batch = as_batch(reference_case.sample).resize(plan.batch_size)
    target = as_batch(reference_case.target, what="target").resize(plan.batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = compute_loss(reference_case.loss_fn, batch.call(model), target.value)
    loss.backward()
    optimizer.step()
    _assert_both_ranks_equal(model, result0, result1, strategy)


# rank 0 trains rows 0-7 (97 real tokens), rank 1 rows 8-15 (20): weighting by rows, or by each rank's own count,
# moves the parameters differently from one full-batch step of the token-mean loss
PAD_LENGTHS = [16, 16, 15, 14, 1, 16, 3, 16, 2, 1, 5, 1, 1, 2, 7, 1]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_token_mean_loss_across_ranks_equals_a_full_batch_step(strategy, tmp_path):
    from dist_workers import pad_target

    torch.manual_seed(0)
    case = ZOO["tied_lm"]()
    plan = dataclasses.replace(_plan(case, strategy), micro_batch_size=3, gradient_accumulation_steps=3,
                               last_micro_batch_size=2)  # 3 + 3 + 2 rows per rank: an uneven last micro-batch
    result0, result1 = _run([{"kind": "equivalence", "case": "tied_lm", "plan": plan.to_json(), "optimizer": "sgd",
                              "pad_lengths": PAD_LENGTHS}], tmp_path)
    torch.manual_seed(0)
    reference_case = ZOO["tied_lm"]()
    model = reference_case.model.eval()  # dropout off, as in the workers
    batch = as_batch(reference_case.sample).resize(plan.batch_size)
    target = pad_target(as_batch(reference_case.target, what="target").resize(plan.batch_size).value, PAD_LENGTHS)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compute_loss(None, batch.call(model), target).backward()  # the default loss: cross-entropy, -100 ignored
    optimizer.step()
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[name]), f"{name}: the reference did not move it"
    _assert_both_ranks_equal(model, result0, result1, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_ranks_with_batches_of_different_lengths_run_the_same_micro_batches(strategy, tmp_path):
    """Rank 0 trains 8 rows at the full length 16 (2 rows per micro-batch: 4 micro-batches), rank 1 8 rows at length
    4 (8 rows fit: 1). DDP broadcasts buffers and FSDP2 gathers parameters in every forward, so rank 1 must run 4 too
    (a hang otherwise); the step still equals one full-batch step of the token mean over both ranks."""
    from autofit.training.batch import as_batch as batch_of
    from autofit.training.length import length_spec

    torch.manual_seed(0)
    case = ZOO["tied_lm"]()
    sample, target = batch_of(case.sample), batch_of(case.target, what="target")
    assert sample.value.shape[1] == 16
    plan = dataclasses.replace(_plan(case, strategy), micro_batch_size=2, gradient_accumulation_steps=4,
                               last_micro_batch_size=2, lengths=length_spec(sample, target),
                               rows_by_length=((16, 2), (8, 4), (4, 8)))
    result0, result1 = _run([{"kind": "lengths", "case": "tied_lm", "plan": plan.to_json(), "optimizer": "sgd",
                              "lengths": [16, 4]}], tmp_path)
    assert result0[0]["micro_batches"] == result1[0]["micro_batches"] == 4
    torch.manual_seed(0)
    reference_case = ZOO["tied_lm"]()
    model = reference_case.model.eval()
    ids = as_batch(reference_case.sample).resize(plan.batch_size).value
    labels = as_batch(reference_case.target, what="target").resize(plan.batch_size).value
    parts = [(ids[:8, :16], labels[:8, :16]), (ids[8:, :4], labels[8:, :4])]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    total = sum(t.numel() for _, t in parts)
    loss = sum(compute_loss(None, model(x), t) * t.numel() for x, t in parts) / total  # the token mean of both
    loss.backward()
    optimizer.step()
    _assert_both_ranks_equal(model, result0, result1, strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_per_rank_peak_matches_the_estimate(strategy, tmp_path):
    plans = {}
    for name in MEMORY_CASES:
        torch.manual_seed(0)
        plans[name] = _plan(ZOO[name](), strategy)
    jobs = [{"kind": "memory", "case": n, "plan": p.to_json(), "optimizer": "adamw"} for n, p in plans.items()]
    ranks = _run(jobs, tmp_path)
    for rank, results in enumerate(ranks):
        for name, result in zip(MEMORY_CASES, results):
            # gloo's worker threads occasionally allocate inside the profiling window: the steady state is the
            # lowest of three measured steps
            measured = min(result["peaks"])
            predicted = plans[name].peak_bytes
            assert abs(predicted - measured) <= 0.02 * measured, (
                f"{strategy} {name} rank {rank}: predicted {predicted}, measured {result['peaks']}"
            )


@pytest.mark.sim
def test_fsdp2_estimate_falls_with_world_size():
    case = ZOO["gpt_sdpa"]()
    from autofit.parallel.choices import shard_units

    units = shard_units(case.model)
    peaks, params = [], []
    for world in (2, 4, 8):
        config = make_step_config(micro_batch_size=4, optimizer="adamw",
                                  layout=Parallel(strategy="fsdp2", world_size=world, shard_units=units))
        sim = simulate_step(case.model, as_batch(case.sample), as_batch(case.target, what="target"), case.loss_fn,
                            config)
        peaks.append(sim.replay.peak_bytes)
        params.append(sim.replay.breakdown.get(autofit.Category.PARAMETERS, 0))
    assert peaks[0] > peaks[1] > peaks[2], peaks
    total = sum(p.numel() * p.element_size() for p in case.model.parameters())
    # each rank keeps 1/world of the parameters (FSDP2 pads dim 0 to a multiple of the world size)
    for world, local in zip((2, 4, 8), params):
        assert total / world <= local <= total / world * 1.25 + 1024, (world, local, total)


@pytest.mark.slow
def test_example_runs_under_torchrun():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
         str(ROOT / "examples" / "distributed.py")],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == WORLD, result.stdout[-2000:]
    for line in lines:
        error = float(line.rsplit("(", 1)[1].split("%")[0])
        assert abs(error) <= 2.0, line





def _reducing_plan():
    """A plan whose budget leaves no room for the unsharded gradients of a window (Note [gradient sync under
    accumulation]): it reduce-scatters after every micro-batch."""
    from sharded_models import wide_blocks

    case = wide_blocks()
    plan = autofit.plan(case.model, case.sample, 26 * 2**20, batch_size=8 * WORLD, target=case.target,
                        loss_fn=case.loss_fn, device="cpu", precision="fp32",
                        layout=autofit.Layout(world_size=WORLD, strategy="fsdp2"))
    assert plan.parallel.reduce_every_micro_batch and plan.gradient_accumulation_steps > 1
    return plan


@pytest.mark.slow
def test_fsdp2_reducing_every_micro_batch_equals_a_full_batch_step(tmp_path):
    from sharded_models import wide_blocks

    plan = _reducing_plan()
    result0, result1 = _run([{"kind": "equivalence", "case": "wide_blocks", "plan": plan.to_json(),
                              "optimizer": "sgd"}], tmp_path)
    reference = wide_blocks()
    batch = as_batch(reference.sample).resize(plan.batch_size)
    target = as_batch(reference.target, what="target").resize(plan.batch_size)
    optimizer = torch.optim.SGD(reference.model.parameters(), lr=0.1)
    reference.loss_fn(batch.call(reference.model), target.value).backward()
    optimizer.step()
    _assert_both_ranks_equal(reference.model, result0, result1, "fsdp2 reducing every micro-batch")


@pytest.mark.xfail(strict=False, reason=(
    "open (issue 26, part A report): on gloo the measured peak is the planned one plus n unsharded gradients of one "
    "unit (2,105,856 B each), n from 0 to 7 by timing: reduce-scatters still in flight hold their inputs, which the "
    "fake process group completes at once. Measured 2026-11-24 over three runs of six steps: 27,267,468 B once "
    "(planned 27,257,140 B), otherwise 31.5 to 48.3 MB"))
def test_fsdp2_reducing_every_micro_batch_peak_matches_the_allocator(tmp_path):
    """The lowest of six measured steps against the plan, within 0.5 %."""
    plan = _reducing_plan()
    ranks = _run([{"kind": "memory", "case": "wide_blocks", "plan": plan.to_json(), "optimizer": "adamw",
                   "repeats": 6}], tmp_path)
    for rank, results in enumerate(ranks):
        measured = min(results[0]["peaks"])
        assert abs(plan.peak_bytes - measured) <= 0.005 * measured, (rank, plan.peak_bytes, results[0]["peaks"])


@pytest.mark.sim
def test_dtensors_cached_shardings_are_kept_for_the_same_rank_and_left_empty_after_a_call():
    """Note [one process, several simulated ranks] (autofit/core/_torch.py), read off DTensor's own cache statistics
    (torch.distributed.tensor.debug): a second simulated session of the same rank of the same mesh finds the
    shardings the first cached (a hit, none computed again); another rank's session starts from an empty cache (its
    meshes' groups differ, which the cache key does not see); and after an entry point nothing is left that names a
    fake group's mesh, for the user's own DTensor ops."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import _get_fast_path_sharding_prop_cache_stats as fast_path
    from torch.distributed.tensor.debug import _get_python_sharding_prop_cache_info as python_cache

    from autofit.parallel.simulated import fake_mesh

    layout = Parallel(strategy="fsdp2", world_size=WORLD)

    def two_ops(rank: int) -> tuple[int, int]:
        """The (hits, misses) of DTensor's fast-path cache for two element-wise ops on rank ``rank``'s fake mesh."""
        with fake_mesh(layout, rank) as mesh:
            hits, misses = fast_path()
            shard = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
            _ = shard + shard, shard * 2.0
            after = fast_path()
        return after[0] - hits, after[1] - misses

    two_ops(0)
    assert two_ops(0) == (2, 0)  # the same rank again: both found
    assert two_ops(1) == (0, 2)  # another rank: computed for its own meshes
    case = ZOO["gpt_sdpa"]()
    autofit.estimate(case.model, case.sample, step=2, target=case.target, loss_fn=case.loss_fn,
                     layout=autofit.Layout(world_size=WORLD, strategy="fsdp2"))
    assert fast_path() == (0, 0) and python_cache().currsize == 0  # cleared, nothing of the fake meshes left
