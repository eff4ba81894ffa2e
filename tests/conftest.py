"""Test tiers (README "Tests"): every test is in exactly one of three, chosen by marker.

- ``quick``: pure functions, the solver on hand-made tables, the CUDA model, units, architecture, CLI parsing. No
  marker needed: a test marked neither ``sim`` nor ``slow`` gets ``quick`` here, so ``pytest -m quick`` selects it.
- ``sim``: simulates a training step on fake tensors, or runs a small real one.
- ``slow``: real steps of larger models, gloo processes, 7B shapes, property tests.
"""

from __future__ import annotations

import pytest

TIERS = ("quick", "sim", "slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("sim") is None:
            item.add_marker(pytest.mark.quick)
