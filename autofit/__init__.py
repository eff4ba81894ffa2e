"""autofit: make PyTorch training fit in GPU memory without trial and error."""

from autofit.analyse import Analysis, LayerRow, LayerTable
from autofit.api import analyse, estimate, measure
from autofit.categories import Category
from autofit.cuda.catalog import gpu_spec
from autofit.errors import (
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
from autofit.normalisation import ItemMeanLoss
from autofit.plan import Alternative, Plan
from autofit.planner import plan
from autofit.precision import PrecisionPolicy
from autofit.report import Measurement, MemoryEstimate

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
