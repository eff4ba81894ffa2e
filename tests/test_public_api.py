"""The public surface is explicit: ``autofit.__all__`` is pinned here, and so is the version."""

from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path

import pytest

import autofit

PUBLIC = [
    "Alternative",
    "Analysis",
    "AutofitError",
    "BatchDim",
    "CardRow",
    "Category",
    "Device",
    "ForwardError",
    "HostMemoryError",
    "InfeasibleBudgetError",
    "InvalidInputError",
    "ItemMeanLoss",
    "LayerRow",
    "LayerTable",
    "Layout",
    "LossError",
    "Measurement",
    "MemoryEstimate",
    "Plan",
    "Precision",
    "PrecisionPolicy",
    "Savers",
    "Search",
    "Step",
    "TrainConfig",
    "UnsupportedModelError",
    "UnsupportedPrecisionError",
    "UnsupportedTorchError",
    "analyse",
    "check_config",
    "compare",
    "estimate",
    "gpu_spec",
    "hf_model",
    "measure",
    "plan",
    "plan_config",
    "read_config",
]


def test_all_is_pinned() -> None:
    assert autofit.__all__ == PUBLIC


def test_all_is_sorted() -> None:
    assert autofit.__all__ == sorted(autofit.__all__)


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_is_importable(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from autofit import {name}", namespace)
    assert namespace[name] is getattr(autofit, name)


def test_every_public_attribute_is_in_all() -> None:
    """Nothing public leaks from ``autofit/__init__.py`` without being listed (submodules aside)."""
    for name in autofit.__all__:  # each is imported on first use (Note [a light import], autofit/__init__.py)
        getattr(autofit, name)
    public = {n for n, v in vars(autofit).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert public == set(autofit.__all__)


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from autofit import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(PUBLIC)


def test_errors_share_a_base() -> None:
    for name in ("ForwardError", "InfeasibleBudgetError", "InvalidInputError", "LossError", "UnsupportedModelError",
                 "UnsupportedPrecisionError", "UnsupportedTorchError"):
        assert issubclass(getattr(autofit, name), autofit.AutofitError), name
    assert issubclass(autofit.AutofitError, Exception)


def test_version() -> None:
    assert isinstance(autofit.__version__, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", autofit.__version__)
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text())["project"]
    if "version" in project:  # a static version must be the one the package reports
        assert project["version"] == autofit.__version__
