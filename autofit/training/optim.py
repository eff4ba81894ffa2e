"""Optimizer specifications: a name, an optimizer class, or a callable ``params -> Optimizer``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from autofit.core.errors import InvalidInputError

__all__ = ["OptimizerSpec", "as_optimizer_spec", "OPTIMIZER_NAMES", "eight_bit_class", "eight_bit_possible",
           "eight_bit_spec",
           "to_eight_bit"]

# Default hyper-parameters matter for memory only through the state they create: SGD keeps a momentum buffer
# only when momentum != 0, so the named "sgd" uses momentum 0.9 as most training recipes do. Partials of the
# classes, not lambdas: a step's config pickles to the processes of a measured layout (autofit/measure/ranks.py).
_NAMED: dict[str, Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-3),
    "adam": functools.partial(torch.optim.Adam, lr=1e-3),
    "sgd": functools.partial(torch.optim.SGD, lr=1e-2, momentum=0.9),
}
OPTIMIZER_NAMES = tuple(_NAMED)


@dataclass(frozen=True)
class OptimizerSpec:
    """A factory building the optimizer over a parameter list, and a short name for tables."""

    name: str
    factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = self.factory(list(params))
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidInputError(
                f"optimizer factory {self.name!r} returned {type(optimizer).__name__}, not a torch.optim.Optimizer"
            )
        return optimizer

    def state_values_per_parameter(self) -> int:
        """Parameter-sized tensors of state the optimizer keeps per parameter (AdamW 2, SGD with momentum 1), read
        off one real step over a small parameter, so a custom factory is counted as it behaves."""
        p = torch.nn.Parameter(torch.zeros(8))
        p.grad = torch.ones(8)
        try:
            optimizer = self.build([p])
            optimizer.step()
        except Exception:  # noqa: BLE001 - a factory that cannot step here (a CUDA-only option): count no state,
            return 0  # so that no planning stage is skipped on its account (the count only ever skips stages)
        state = optimizer.state.get(p, {})
        return sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0) // 8


def as_optimizer_spec(optimizer: Any) -> OptimizerSpec:
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if isinstance(optimizer, str):
        key = optimizer.strip().lower()
        if key in _NAMED:
            return OptimizerSpec(key, _NAMED[key])
        raise InvalidInputError(
            f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZER_NAMES)}, an optimizer class "
            "such as torch.optim.AdamW, or a callable params -> Optimizer"
        )
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        cls = optimizer
        return OptimizerSpec(cls.__name__.lower(), functools.partial(cls, lr=1e-3))
    if isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            "optimizer must be a name, a class or a factory, not an optimizer instance (autofit builds its own "
            "over a copy of the parameters): pass type(opt) or lambda params: torch.optim.AdamW(params, lr=...)"
        )
    if callable(optimizer):
        return OptimizerSpec(getattr(optimizer, "__name__", "custom"), optimizer)
    raise InvalidInputError(
        f"optimizer must be a name ({', '.join(OPTIMIZER_NAMES)}), an optimizer class or a callable, "
        f"got {type(optimizer).__name__}"
    )


# Note [8-bit optimizer state]
#     The planner's opt-in rung "8-bit optimizer" (Note [the ladder], autofit/solve/ladder.py) swaps the user's
#     torch.optim.AdamW (or Adam without weight decay) for the same update with both moments stored in 8 bits,
#     blockwise quantized: about 2 bytes of state per parameter instead of 8 in fp32. Which implementation:
#     bitsandbytes' AdamW8bit / Adam8bit when bitsandbytes imports (it has CPU and CUDA kernels, and is what
#     torchtune's "8-bit AdamW" row and most recipes use; it keeps 32-bit state for parameters under
#     ``min_8bit_size`` = 4096 values), else torchao's AdamW8bit / Adam8bit (its state is a tensor subclass, 8-bit
#     for parameters of at least 4096 values whose size divides its block of 256). Neither installed: no rung, and
#     the plan's notes say so. Torch's Adam with weight decay adds it to the gradient (L2), which bitsandbytes'
#     Adam8bit does not (its kernels decay the weights, as AdamW): no rung for it either. The hyper-parameters
#     (lr, betas, eps, weight_decay) carry over; amsgrad has no 8-bit form. Both implementations' state is exact on
#     the CPU allocator (docs/fine-tuning.md, "Optimizers"), so the rung's estimate is as good as any other.
def eight_bit_class(kind: str) -> tuple[str, type] | None:
    """The 8-bit class for ``kind`` ("adamw" or "adam") as (dotted name, class), or None when neither bitsandbytes
    nor torchao imports (Note [8-bit optimizer state])."""
    name = {"adamw": "AdamW8bit", "adam": "Adam8bit"}[kind]
    try:
        import bitsandbytes.optim as bnb_optim

        return f"bitsandbytes.optim.{name}", getattr(bnb_optim, name)
    except ImportError:
        pass
    try:
        import torchao.optim as ao_optim

        return f"torchao.optim.{name}", getattr(ao_optim, name)
    except ImportError:
        return None


def _eight_bit_kind(optimizer: torch.optim.Optimizer) -> str | None:
    """"adamw" or "adam" when ``optimizer`` has an 8-bit twin with the same update, else None."""
    groups = optimizer.param_groups
    if any(g.get("amsgrad") for g in groups):
        return None
    if type(optimizer) is torch.optim.AdamW:
        return "adamw"
    if type(optimizer) is torch.optim.Adam and all(g.get("weight_decay", 0) == 0 for g in groups):
        return "adam"
    return None


def eight_bit_possible(spec: OptimizerSpec) -> bool:
    """Whether ``spec`` has an 8-bit twin here, without importing bitsandbytes or torchao (the hint of an
    infeasibility error, Note [the ladder])."""
    import importlib.util

    p = torch.nn.Parameter(torch.zeros(8))
    try:
        kind = _eight_bit_kind(spec.build([p]))
    except Exception:  # noqa: BLE001 - a factory that cannot build here has no known twin
        return False
    return kind is not None and any(importlib.util.find_spec(m) is not None for m in ("bitsandbytes", "torchao"))


def eight_bit_spec(spec: OptimizerSpec) -> tuple[OptimizerSpec, str] | None:
    """The 8-bit twin of ``spec`` (Note [8-bit optimizer state]) and its dotted class name, or None when it has none
    (not AdamW/Adam, or no library)."""
    p = torch.nn.Parameter(torch.zeros(8))
    try:
        probe = spec.build([p])
    except Exception:  # noqa: BLE001 - a factory that cannot build here has no known twin
        return None
    kind = _eight_bit_kind(probe)
    found = None if kind is None else eight_bit_class(kind)
    if found is None:
        return None
    path, _ = found

    def build(params):
        return to_eight_bit(spec.build(params), path)

    return OptimizerSpec(spec.name, build), path  # named as the user's: the plan states the swap apart


def to_eight_bit(optimizer: torch.optim.Optimizer, path: str) -> torch.optim.Optimizer:
    """A new ``path`` optimizer (a class :func:`eight_bit_class` names) over ``optimizer``'s parameter groups, with
    its hyper-parameters (Note [8-bit optimizer state]); ``optimizer``'s state, if any, is not carried over."""
    kind = _eight_bit_kind(optimizer)
    found = None if kind is None else eight_bit_class(kind)
    if found is None or found[0] != path:
        raise InvalidInputError(
            f"the plan swaps the optimizer for {path}, but this one is {type(optimizer).__name__}"
            + ("" if kind is None else f" and {path} cannot be imported here")
            + ": pass a torch.optim.AdamW (or Adam without weight decay), or plan without allow='8bit-optimizer'"
        )
    cls = found[1]
    keys = ("lr", "betas", "eps", "weight_decay")
    groups = [{"params": g["params"], **{k: g[k] for k in keys if k in g}} for g in optimizer.param_groups]
    for g in groups:  # a tensor lr (torch allows one) as the number the 8-bit kernels take
        if isinstance(g.get("lr"), torch.Tensor):
            g["lr"] = float(g["lr"])
    return cls(groups)
