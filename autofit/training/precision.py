"""Precision policies: which dtype autocast uses around forward and loss, and which modules stay in fp32.

"fp32" runs without autocast. "bf16" and "fp16" run forward and loss under ``torch.autocast(device, dtype)``, whose
own op lists decide what runs in low precision (matmuls, convolutions) and what stays in fp32 (softmax, norms, losses).
A policy can pin modules to fp32: their forward runs with autocast disabled and floating inputs cast back to fp32.
fp16 needs loss scaling (``torch.amp.GradScaler``); bf16 does not (same exponent range as fp32).
``stored`` is the other half: the dtype parameters, gradients and optimizer state are kept in between steps, with or
without an fp32 master copy (See Note [stored precision] in autofit/training/stored.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autofit.core.errors import InvalidInputError

__all__ = ["PrecisionPolicy", "as_policy", "built_precision", "PRECISION_NAMES", "STORED_NAMES", "stored_dtype"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_NAMES = tuple(_DTYPES)

# Stored precisions, from the highest (the least risk) to the lowest: the planner prefers the first that fits.
# Pure fp16 is not one of them (Note [stored precision]).
_STORED_DTYPES = {"fp32": torch.float32, "bf16-master": torch.bfloat16, "fp16-master": torch.float16,
                  "bf16": torch.bfloat16}
STORED_NAMES = tuple(_STORED_DTYPES)
_STORED_COMPUTE = {"bf16-master": "bf16", "fp16-master": "fp16", "bf16": "bf16"}  # the autocast each one needs


def stored_dtype(stored: str) -> torch.dtype:
    """The dtype of the parameters (and their gradients) under the stored precision ``stored``."""
    return _STORED_DTYPES[stored]


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """``name`` is "fp32", "bf16" or "fp16"; ``fp32_modules`` are qualified module names kept out of autocast;
    ``stored`` is the stored precision (None: as the model was built; else one of :data:`STORED_NAMES`)."""

    name: str = "fp32"
    fp32_modules: tuple[str, ...] = field(default_factory=tuple)
    stored: str | None = None
    # with stored=None: the dtype(s) the model's parameters were built in, when not fp32 ("bf16", "fp64",
    # "bf16 + fp32"); a description only (the step keeps them as they are), so it takes no part in equality
    built: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.name not in _DTYPES:
            raise InvalidInputError(
                f"PrecisionPolicy.name: unknown precision {self.name!r}; use one of {', '.join(PRECISION_NAMES)}"
                + _FLOAT8_HINT.get(str(self.name).lower(), "")
            )
        object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))
        if self.stored is None:
            return
        if self.stored == "fp16":
            raise InvalidInputError(
                "PrecisionPolicy.stored='fp16' (pure fp16) is not offered: fp16 updates underflow without an fp32 "
                "master copy; use stored='fp16-master'"
            )
        if self.stored not in _STORED_DTYPES:
            raise InvalidInputError(
                f"PrecisionPolicy.stored: unknown stored precision {self.stored!r}; use None (as loaded) or one of "
                f"{', '.join(STORED_NAMES)}"
            )
        needs = _STORED_COMPUTE.get(self.stored)
        if needs is not None and self.name != needs:
            raise InvalidInputError(
                f"stored precision {self.stored!r} keeps {needs} parameters, which need {needs} autocast: use "
                f"PrecisionPolicy(name={needs!r}, stored={self.stored!r})"
            )

    @property
    def label(self) -> str:
        """The compute precision, and the stored one when it is set: how plans and tables name this policy."""
        return self.name if self.stored is None else f"{self.name}/{self.stored}"

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def autocast(self) -> bool:
        return self.name != "fp32"

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype FSDP2 gathers parameters in under this policy (its ``MixedPrecisionPolicy(param_dtype=...)``,
        autofit/parallel/apply.py): the autocast dtype, or None (as stored) without autocast."""
        return self.dtype if self.autocast else None

    @property
    def needs_grad_scaler(self) -> bool:
        return self.name == "fp16"

    def __str__(self) -> str:
        pinned = f", fp32 modules: {', '.join(self.fp32_modules)}" if self.fp32_modules else ""
        stored = f", stored {_STORED_TEXT[self.stored]}" if self.stored is not None else (
            f", stored {self.built} (as built)" if self.built else "")
        return f"{self.name}{' autocast' if self.autocast else ''}{stored}{pinned}"


_STORED_TEXT = {"fp32": "fp32", "bf16-master": "bf16 with fp32 master copy",
                "fp16-master": "fp16 with fp32 master copy", "bf16": "pure bf16 (parameters, gradients, state)"}


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def built_precision(parameters) -> str | None:
    """The dtype(s) floating ``parameters`` are stored in, most bytes first ("bf16", "fp64", "bf16 + fp32"), or
    None when all are fp32 (what a policy without ``stored`` otherwise implies)."""
    sizes: dict[torch.dtype, int] = {}
    for p in parameters:
        if p.is_floating_point():
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel() * p.element_size()
    if set(sizes) <= {torch.float32}:
        return None
    ordered = sorted(sizes, key=lambda d: -sizes[d])
    return " + ".join(_DTYPE_NAMES.get(d, str(d).removeprefix("torch.")) for d in ordered)


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
        + _FLOAT8_HINT.get(str(precision).strip().lower(), "")
    )


# float8 is no autocast precision: the linear layers are converted (torchao), the rest computes in the precision given
_FLOAT8_HINT = dict.fromkeys(("fp8", "float8", "float8_e4m3fn"), "; float8 training of the linear layers is "
                             "float8='tensorwise' (or 'rowwise', 'rowwise_with_gw_hp') beside precision='bf16' "
                             "(docs/float8.md)")
