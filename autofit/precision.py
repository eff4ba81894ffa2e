"""Precision policies: which dtype autocast uses around forward and loss, and which modules stay in fp32.

"fp32" runs without autocast. "bf16" and "fp16" run forward and loss under ``torch.autocast(device, dtype)``, whose
own op lists decide what runs in low precision (matmuls, convolutions) and what stays in fp32 (softmax, norms, losses).
A policy can pin modules to fp32: their forward runs with autocast disabled and floating inputs cast back to fp32.
fp16 needs loss scaling (``torch.amp.GradScaler``); bf16 does not (same exponent range as fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autofit.errors import InvalidInputError

__all__ = ["PrecisionPolicy", "as_policy", "PRECISION_NAMES"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_NAMES = tuple(_DTYPES)


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """``name`` is "fp32", "bf16" or "fp16"; ``fp32_modules`` are qualified module names kept out of autocast."""

    name: str = "fp32"
    fp32_modules: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.name not in _DTYPES:
            raise InvalidInputError(
                f"PrecisionPolicy.name: unknown precision {self.name!r}; use one of {', '.join(PRECISION_NAMES)}"
            )
        object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def autocast(self) -> bool:
        return self.name != "fp32"

    @property
    def needs_grad_scaler(self) -> bool:
        return self.name == "fp16"

    def __str__(self) -> str:
        pinned = f", fp32 modules: {', '.join(self.fp32_modules)}" if self.fp32_modules else ""
        return f"{self.name}{' autocast' if self.autocast else ''}{pinned}"


def as_policy(precision: str | PrecisionPolicy) -> PrecisionPolicy:
    """Accept a precision name or a policy; anything else is a typed error naming the choices."""
    if isinstance(precision, PrecisionPolicy):
        return precision
    if isinstance(precision, str):
        key = precision.strip().lower()
        aliases = {"float32": "fp32", "32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
        key = aliases.get(key, key)
        if key in _DTYPES:
            return PrecisionPolicy(name=key)
    raise InvalidInputError(
        f"unknown precision {precision!r}: use 'fp32', 'bf16', 'fp16' or an autofit.PrecisionPolicy"
    )
