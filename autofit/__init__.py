"""autofit: make PyTorch training fit in GPU memory without trial and error."""

from autofit.api import estimate, measure
from autofit.categories import Category
from autofit.errors import (
    AutofitError,
    ForwardError,
    InfeasibleBudgetError,
    InvalidInputError,
    LossError,
    UnsupportedModelError,
)
from autofit.precision import PrecisionPolicy
from autofit.report import Measurement, MemoryEstimate

__version__ = "0.1.0"

__all__ = [
    "AutofitError",
    "Category",
    "ForwardError",
    "InfeasibleBudgetError",
    "InvalidInputError",
    "LossError",
    "Measurement",
    "MemoryEstimate",
    "PrecisionPolicy",
    "UnsupportedModelError",
    "estimate",
    "measure",
]
