"""The time model's pricing of recomputed modules by name, against hand computations."""

from __future__ import annotations

import numpy as np
import pytest

from autofit.analyse.table import OpCosts
from autofit.device import Throughput
from autofit.solve.time_model import TimeModel


def test_a_block_is_not_priced_with_its_siblings_that_share_its_prefix():
    """Twelve blocks, one forward op of 1 GFLOP each, on 1 TFLOP/s: recomputing "layers.1" costs 1 ms, not the 3 ms
    of layers.1, layers.10 and layers.11 (a name is a prefix of its submodules' names only up to a dot)."""
    names = tuple(f"layers.{i}.mlp" for i in range(12))
    tp = Throughput(name="hand", flops_per_second={"fp32": 1e12}, bytes_per_second=float("inf"),
                    op_overhead_seconds=0.0)
    ops = OpCosts(flops_fixed=np.full(12, 1e9), flops_per_sample=np.zeros(12), bytes_fixed=np.zeros(12),
                  bytes_per_sample=np.zeros(12), precision=("fp32",) * 12, forward=np.ones(12, dtype=bool),
                  module=names)
    model = TimeModel(tp, ops)
    for i in range(12):
        assert model.recompute_seconds(f"layers.{i}", 1) == pytest.approx(1e-3)
    assert model.recompute_seconds("layers.1.mlp", 1) == pytest.approx(1e-3)
    plain = model.step_time("fp32", 1, 1).total
    assert model.step_time("fp32", 1, 1, ("layers.1",)).total - plain == pytest.approx(1e-3)
    assert model.step_time("fp32", 1, 1, ("layers.1", "layers.11")).total - plain == pytest.approx(2e-3)


def _four_blocks(names=("layers.0", "layers.1", "layers.2", "layers.3", "norm")):
    """Units: four identical blocks and a module outside them, each costing 1. Stretch s (the backward of block s)
    holds 10 bytes; recomputing block u drops its 2 saved bytes from stretch u on and adds a 1-byte spike at u."""
    from autofit.solve.checkpoint_milp import CheckpointProblem

    coef = np.zeros((4, len(names)))
    for u, name in enumerate(names):
        if name.startswith("layers."):
            b = int(name.split(".")[1])
            coef[b:, u] -= 2
            coef[b, u] += 1
    return CheckpointProblem(names=names, costs=np.ones(len(names)), base=np.full(4, 10.0), coef=coef)


def test_recomputed_blocks_grouped_into_a_run_by_hand():
    """Blocks 0 and 2 recomputed (peak 9 at stretch 0): as blocks 0, 1 (heaviest first) the stretches hold 9, 7, 6, 6;
    as blocks 2, 3 (lightest first) 10, 10, 9, 7. Under a budget of 9 the first is kept; under 8.9 neither fits and
    the MILP's set stays; a block that lacks a unit the others have leaves the set as it is."""
    from autofit.capture.depth import Blocks
    from autofit.solve.block_groups import grouped_by_block

    blocks = Blocks("layers", 4)
    problem = _four_blocks()
    assert problem.peak((0, 2, 4)) == 9
    assert grouped_by_block(problem, (0, 2, 4), blocks, 9) == (0, 1, 4)
    assert grouped_by_block(problem, (0, 2, 4), blocks, 10) == (0, 1, 4)
    assert grouped_by_block(problem, (0, 2, 4), blocks, 8.9) == (0, 2, 4)
    assert grouped_by_block(problem, (0, 1, 4), blocks, 9) == (0, 1, 4)
    uneven = _four_blocks(("layers.0", "layers.1", "layers.2", "norm"))  # block 3 has no unit
    assert grouped_by_block(uneven, (0, 2), blocks, 10) == (0, 2)


def test_ops_under_a_set_of_modules_is_the_per_op_prefix_test() -> None:
    """``OpCosts.under`` tests each distinct module once: the same mask as testing every op's module in turn."""
    rng = np.random.default_rng(0)
    names = ["", "head", "layers", "layers.1", "layers.10", "layers.1.mlp", "layers.1.mlp.up", "layers.2.attn",
             "layers.11", "norm"]
    module = tuple(names[i] for i in rng.integers(0, len(names), 500))
    n = len(module)
    ops = OpCosts(flops_fixed=np.zeros(n), flops_per_sample=np.zeros(n), bytes_fixed=np.zeros(n),
                  bytes_per_sample=np.zeros(n), precision=("fp32",) * n, forward=np.ones(n, dtype=bool), module=module)
    for chosen in [(), ("layers.1",), ("layers.1", "layers.10"), ("layers",), ("layers.1.mlp", "norm"), ("",),
                   ("layers.2",)]:
        prefixes = tuple(c + "." for c in chosen)
        expected = np.array([m in chosen or m.startswith(prefixes) for m in module], dtype=bool)
        np.testing.assert_array_equal(ops.under(chosen), expected)
        np.testing.assert_array_equal(ops.under(iter(chosen)), expected)  # a generator, as sharding.py passes
