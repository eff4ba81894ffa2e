"""Resolve ``device="cuda"`` into a :class:`~autofit.device.DeviceTarget` (see issue: CUDA memory model)."""

from __future__ import annotations

from autofit.errors import InvalidInputError


def cuda_target(gpu: str | None):
    raise InvalidInputError(
        "device='cuda' planning needs autofit's CUDA memory model, which is not in this version yet: "
        "plan with device='cpu' for now"
    )
