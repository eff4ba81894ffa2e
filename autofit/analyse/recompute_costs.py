"""What recomputing one module costs and frees, per policy: none, selective (autofit/training/recompute.py), full.

Read off an :class:`Analysis` (no further simulation): the module's first call in the first micro-batch
(``CallRecord``: saved, kept and input bytes, each fixed + per sample) and the ops of its forward (``OpCosts``:
FLOPs and bytes moved, and whether the selective policy keeps each op's outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autofit.analyse.table import Analysis
from autofit.core.errors import InvalidInputError

__all__ = ["RecomputeCosts", "recompute_costs"]


@dataclass(frozen=True, kw_only=True)
class RecomputeCosts:
    """One call of a module at micro-batch ``batch``. ``held_*``: bytes it holds from its forward until its backward
    (its inputs included: non-reentrant checkpoint keeps them); ``*_flops`` / ``*_ops`` / ``*_bytes_moved``: what
    backward runs again (FLOPs from PyTorch's flop registry, which counts matrix products and attention only)."""

    module: str
    batch: int
    held_none: int
    held_selective: int
    held_full: int
    selective_flops: float
    full_flops: float
    selective_ops: int
    full_ops: int
    selective_bytes_moved: float
    full_bytes_moved: float


def recompute_costs(analysis: Analysis, module: str, batch: int) -> RecomputeCosts:
    call = next((c for c in analysis.profile.calls if c.name == module and c.micro == 0), None)
    if call is None or analysis.ops is None:
        raise InvalidInputError(f"recompute_costs: module {module!r} has no call in the analysed forward")
    inputs = sum(call.input_bytes(i, batch) for i in range(len(call.inputs)))
    ops = analysis.ops
    inside = np.array([m == module or m.startswith(module + ".") for m in ops.module], dtype=bool)
    forward = inside & ops.forward
    kept = ops.kept if ops.kept is not None else np.zeros(len(ops.module), dtype=bool)
    rerun = forward & ~kept
    flops = np.maximum(ops.flops_fixed + ops.flops_per_sample * batch, 0.0)
    moved = np.maximum(ops.bytes_fixed + ops.bytes_per_sample * batch, 0.0)
    return RecomputeCosts(
        module=module, batch=batch, held_none=inputs + call.saved_bytes(batch),
        held_selective=inputs + call.kept_bytes(batch), held_full=inputs,
        selective_flops=float(flops[rerun].sum()), full_flops=float(flops[forward].sum()),
        selective_ops=int(rerun.sum()), full_ops=int(forward.sum()),
        selective_bytes_moved=float(moved[rerun].sum()), full_bytes_moved=float(moved[forward].sum()),
    )
