"""Typed errors. Each message says what is wrong and what to do next."""

from __future__ import annotations

__all__ = [
    "AutofitError",
    "InvalidInputError",
    "ForwardError",
    "LossError",
    "UnsupportedModelError",
    "UnsupportedPrecisionError",
    "UnsupportedFeatureError",
    "InfeasibleBudgetError",
    "UnsupportedTorchError",
    "AllocatorSettingError",
    "TrainerStateError",
    "ModelMismatchError",
    "STRATEGIES",
    "require_int",
    "require_strategy",
    "HostMemoryError",
]


class AutofitError(Exception):
    """Base class of every error autofit raises on purpose."""


class InvalidInputError(AutofitError, ValueError):
    """An argument is malformed: a sample without a batch dimension, an unknown name, a bad size string."""


class ForwardError(AutofitError, RuntimeError):
    """The model's forward (or the loss) raised; ``module`` names the innermost module that was running."""

    def __init__(self, message: str, *, module: str | None = None) -> None:
        super().__init__(message)
        self.module = module


class LossError(AutofitError, ValueError):
    """The loss is not a differentiable scalar, or no loss could be derived from the model's output."""


class UnsupportedModelError(AutofitError, RuntimeError):
    """The model cannot be simulated the way it was given (for example data-dependent code on the meta device)."""


class UnsupportedPrecisionError(AutofitError, RuntimeError):
    """This CPU has no kernel for an op at the precision asked (oneDNN's bf16 and fp16 kernels need AVX-512, see
    Note [CPU kernels] in autofit/core/cpu.py). ``op`` names the operator, ``module`` the innermost module running it (None
    when not known), ``precision`` the precision name ("bf16", "fp16")."""

    def __init__(self, message: str, *, op: str, precision: str, module: str | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.precision = precision
        self.module = module


class UnsupportedFeatureError(AutofitError, RuntimeError):
    """A step feature cannot run as asked: the library it needs is missing or too old (torchao for float8), or the
    target card lacks the hardware (FP8 tensor cores); the message names what to install or choose instead."""


class InfeasibleBudgetError(AutofitError):
    """No configuration fits the budget. ``min_budget_bytes`` is the smallest budget any allowed one reaches."""

    def __init__(self, message: str, *, min_budget_bytes: int, budget_bytes: int, dominant: str | None = None) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes
        self.budget_bytes = budget_bytes
        self.dominant = dominant


class HostMemoryError(AutofitError):
    """A plan that fits the GPU would keep more in host memory than ``host_budget`` allows (Note [offload])."""

    def __init__(self, message: str, *, host_bytes: int, host_budget_bytes: int) -> None:
        super().__init__(message)
        self.host_bytes = host_bytes
        self.host_budget_bytes = host_budget_bytes


class UnsupportedTorchError(AutofitError, ImportError):
    """The installed torch lacks an internal autofit relies on (see autofit/core/_torch.py); the message names it and the
    supported range."""


class AllocatorSettingError(AutofitError, RuntimeError):
    """The plan needs a caching-allocator setting (``PYTORCH_CUDA_ALLOC_CONF``) that can no longer take effect in
    this process: CUDA memory was allocated before it. The message names the setting and where to put it."""


class TrainerStateError(AutofitError, RuntimeError):
    """A trainer was used in a state that cannot train: stepped after ``unwrap()``, or a second trainer wrapped a
    model that a live one has patched. The message says which, and what to call first."""


class ModelMismatchError(InvalidInputError):
    """``wrap`` was given a model other than the one the plan was made for (other parameters, or the same ones in
    wider dtypes or with more of them trainable: Note [the plan's model], autofit/emit/model_record.py). The message
    says what differs and to plan the model given."""


# ---- validation shared by every value that holds these fields (StepConfig, Plan, the plan request) -----------------
STRATEGIES = (None, "ddp", "fsdp2")


def require_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum`` (bools are not ints here), else an InvalidInputError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInputError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def require_strategy(value: object, name: str = "strategy") -> None:
    if value not in STRATEGIES:
        raise InvalidInputError(f"{name} must be 'ddp', 'fsdp2' or None (None: one process, or autofit chooses "
                                f"when world_size > 1), got {value!r}")
