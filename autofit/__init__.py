"""autofit: make PyTorch training fit in GPU memory without trial and error."""

from autofit.analyse import Analysis, LayerRow, LayerTable
from autofit.api import analyse, estimate, measure
from autofit.core.categories import Category
from autofit.cuda.catalog import gpu_spec
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
from autofit.training.normalisation import ItemMeanLoss
from autofit.emit.plan import Alternative, Plan
from autofit.planner import plan
from autofit.training.precision import PrecisionPolicy
from autofit.core.report import Measurement, MemoryEstimate

__version__ = "0.1.0"

__all__ = [
    "Alternative",
    "Analysis",
    "AutofitError",
    "Category",
    "ForwardError",
    "HostMemoryError",
    "InfeasibleBudgetError",
    "InvalidInputError",
    "ItemMeanLoss",
    "LayerRow",
    "LayerTable",
    "LossError",
    "Measurement",
    "MemoryEstimate",
    "Plan",
    "PrecisionPolicy",
    "UnsupportedModelError",
    "UnsupportedPrecisionError",
    "UnsupportedTorchError",
    "analyse",
    "estimate",
    "gpu_spec",
    "measure",
    "plan",
]
