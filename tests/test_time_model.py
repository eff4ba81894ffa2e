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
    model = TimeModel(tp, ops, optimizer_bytes=0)
    for i in range(12):
        assert model.recompute_seconds(f"layers.{i}", 1) == pytest.approx(1e-3)
    assert model.recompute_seconds("layers.1.mlp", 1) == pytest.approx(1e-3)
    plain = model.step_time("fp32", 1, 1).total
    assert model.step_time("fp32", 1, 1, ("layers.1",)).total - plain == pytest.approx(1e-3)
    assert model.step_time("fp32", 1, 1, ("layers.1", "layers.11")).total - plain == pytest.approx(2e-3)
