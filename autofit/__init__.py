"""autofit: make PyTorch training fit in GPU memory without trial and error.

Note [a light import]
    ``import autofit`` loads nothing but this file: each public name is imported from its module when first used
    (PEP 562's module ``__getattr__``). The command line imports ``autofit.cli.app``, which runs this file first, and
    ``autofit --version`` or ``--help`` must answer without loading torch (seconds on a cold disk). The subpackages
    ``autofit.analyse`` and ``autofit.measure`` share their names with the functions :func:`autofit.analyse` and
    :func:`autofit.measure`: the import system binds a subpackage to its parent's attribute when it is first loaded,
    so :class:`_Package` refuses that binding for public names, and the attribute stays the function, as the eager
    ``from autofit.api import analyse, measure`` of earlier versions left it.
"""

import importlib as _importlib
import sys as _sys
import types as _types
import typing as _typing

__version__ = "0.1.0"

# public name -> the module that defines it
_WHERE = {
    "Alternative": "autofit.emit.plan_text",
    "Analysis": "autofit.analyse.table",
    "AutofitError": "autofit.core.errors",
    "BatchDim": "autofit.options",
    "CardRow": "autofit.compare",
    "Category": "autofit.core.categories",
    "Device": "autofit.options",
    "ForwardError": "autofit.core.errors",
    "HostMemoryError": "autofit.core.errors",
    "InfeasibleBudgetError": "autofit.core.errors",
    "InvalidInputError": "autofit.core.errors",
    "ItemMeanLoss": "autofit.training.normalisation",
    "LayerRow": "autofit.analyse.table",
    "Layout": "autofit.options",
    "LayerTable": "autofit.analyse.table",
    "LossError": "autofit.core.errors",
    "Measurement": "autofit.core.report",
    "MemoryEstimate": "autofit.core.report",
    "Plan": "autofit.emit.plan",
    "Precision": "autofit.options",
    "PrecisionPolicy": "autofit.training.precision",
    "Savers": "autofit.options",
    "Search": "autofit.options",
    "Step": "autofit.options",
    "UnsupportedModelError": "autofit.core.errors",
    "UnsupportedPrecisionError": "autofit.core.errors",
    "UnsupportedTorchError": "autofit.core.errors",
    "TrainConfig": "autofit.cli.configs.value",
    "analyse": "autofit.api",
    "check_config": "autofit.cli.configs.run",
    "compare": "autofit.compare",
    "estimate": "autofit.api",
    "gpu_spec": "autofit.cuda.catalog",
    "hf_model": "autofit.cli.hf_spec",
    "measure": "autofit.api",
    "plan": "autofit.planner",
    "plan_config": "autofit.cli.configs.run",
    "read_config": "autofit.cli.configs.detect",
}

__all__ = [
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

if _typing.TYPE_CHECKING:  # what type checkers and editors read; at run time, __getattr__ below
    from autofit.analyse.table import Analysis, LayerRow, LayerTable
    from autofit.api import analyse, estimate, measure
    from autofit.cli.hf_spec import hf_model
    from autofit.core.categories import Category
    from autofit.core.errors import (
        AutofitError,
        ForwardError,
        HostMemoryError,
        InfeasibleBudgetError,
        InvalidInputError,
        LossError,
        UnsupportedModelError,
        UnsupportedPrecisionError,
        UnsupportedTorchError,
    )
    from autofit.core.report import Measurement, MemoryEstimate
    from autofit.cuda.catalog import gpu_spec
    from autofit.emit.plan import Plan
    from autofit.emit.plan_text import Alternative
    from autofit.cli.configs.detect import read_config
    from autofit.cli.configs.run import check_config, plan_config
    from autofit.cli.configs.value import TrainConfig
    from autofit.options import BatchDim, Device, Layout, Precision, Savers, Search, Step
    from autofit.planner import plan
    from autofit.training.normalisation import ItemMeanLoss
    from autofit.training.precision import PrecisionPolicy


def __getattr__(name: str) -> object:
    """A public name, imported from its module on first use (Note [a light import])."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'autofit' has no attribute {name!r}")
    value = getattr(_importlib.import_module(where), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(_types.ModuleType):
    def __setattr__(self, name: str, value: object) -> None:
        if name in _WHERE and isinstance(value, _types.ModuleType):
            return  # the subpackage is sys.modules["autofit.analyse"]; autofit.analyse is the function
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
