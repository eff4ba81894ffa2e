"""Typed errors. Each message says what is wrong and what to do next."""

from __future__ import annotations

__all__ = [
    "AutofitError",
    "InvalidInputError",
    "ForwardError",
    "LossError",
    "UnsupportedModelError",
    "UnsupportedPrecisionError",
    "InfeasibleBudgetError",
    "UnsupportedTorchError",
    "AllocatorSettingError",
    "TrainerStateError",
    "STRATEGIES",
    "require_int",
    "require_strategy",
    "HostMemoryError",
    "require_layout",
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


def require_layout(strategy: object, world_size: int, reshard_after_forward: object, replicate: object,
                   prefix: str = "") -> None:
    """The FSDP2 layout knobs (docs/multi-gpu.md): ``reshard_after_forward`` True (ZeRO-3), False (ZeRO-2) or an int
    group size to reshard to, a non-trivial divisor of the shard group (torch's ``_get_post_forward_mesh_info``);
    ``replicate`` > 1 is HSDP, a (replicate, shard) mesh whose replicate size divides ``world_size``."""
    require_int(f"{prefix}replicate", replicate)
    raf = reshard_after_forward
    if not isinstance(raf, (bool, int)):
        raise InvalidInputError(f"{prefix}reshard_after_forward must be True (ZeRO-3), False (ZeRO-2) or an int group "
                                f"size, got {raf!r}")
    if strategy != "fsdp2" and (raf is not True or replicate != 1):
        raise InvalidInputError(
            f"{prefix}reshard_after_forward={raf!r} and replicate={replicate!r} are FSDP2 layouts: they need "
            f"strategy='fsdp2', got {strategy!r} (leave them at True and 1 for DDP or one process)")
    if world_size % replicate:
        raise InvalidInputError(f"{prefix}replicate {replicate} does not divide world_size {world_size}: HSDP's mesh "
                                "is (replicate, world_size // replicate); use the number of nodes")
    shard = world_size // replicate
    if not isinstance(raf, bool) and (raf <= 1 or raf >= shard or shard % raf):
        raise InvalidInputError(
            f"{prefix}reshard_after_forward={raf} must be a divisor of the shard group size {shard} other than 1 and "
            f"{shard} (torch's fully_shard; use False for 1 and True for {shard}), e.g. the GPUs per node")
