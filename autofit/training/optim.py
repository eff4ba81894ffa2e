"""Optimizer specifications: a name, an optimizer class, or a callable ``params -> Optimizer``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from autofit.core.errors import InvalidInputError

__all__ = ["OptimizerSpec", "as_optimizer_spec", "OPTIMIZER_NAMES"]

# Default hyper-parameters matter for memory only through the state they create: SGD keeps a momentum buffer
# only when momentum != 0, so the named "sgd" uses momentum 0.9 as most training recipes do.
_NAMED: dict[str, Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
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
        return OptimizerSpec(cls.__name__.lower(), lambda params: cls(params, lr=1e-3))
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
