"""The step feature "allocator-setting": the caching allocator's setting a plan needs (``PYTORCH_CUDA_ALLOC_CONF``,
today ``expandable_segments:True``) where only it fits the budget (Note [expandable segments as a plan knob],
autofit/device.py, which decides it in the estimate). This module says what each stage does with it (Note [step
features], autofit/features/base.py): the trainer (and a callback of another training loop) puts it in place before
the model touches the GPU, the plan shows it, and the exports say to launch with it."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from autofit.core._torch import allocator_settings, set_allocator_settings
from autofit.core.errors import AllocatorSettingError
from autofit.features.base import Feature

__all__ = ["ALLOCATOR_SETTING", "AllocatorSetting", "put_in_place"]


def put_in_place(setting: str, why: str) -> None:
    """Make the caching allocator run with ``setting`` (``"expandable_segments:True"``): already in force (the
    environment's ``PYTORCH_CUDA_ALLOC_CONF``/``PYTORCH_ALLOC_CONF``, or an earlier call), nothing to do; no CUDA
    memory allocated yet, set it; otherwise an :class:`AllocatorSettingError` that says ``why`` it is needed and what
    to export before the process starts. It governs segments allocated after it is set."""
    if setting in allocator_settings():
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 0:
        raise AllocatorSettingError(
            f"{why} PYTORCH_CUDA_ALLOC_CONF={setting}, and CUDA memory was allocated before it could be set: export "
            f"PYTORCH_CUDA_ALLOC_CONF={setting} before starting Python (or set it with "
            f"torch.cuda.memory._set_allocator_settings before the model goes to the GPU)")
    set_allocator_settings(",".join(s for s in (allocator_settings(), setting) if s))


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllocatorSetting(Feature):
    """The caching allocator's setting; its value is ``""`` (the default allocator) or the setting, on the plan the
    estimate's."""

    def before_wrap(self, plan: Any) -> None:
        """Put the setting in place, or refuse: it governs segments allocated after it is set, and the plan's figures
        assume every block of the step, parameters included, lives in such segments. Already in force (the
        environment's ``PYTORCH_CUDA_ALLOC_CONF``/``PYTORCH_ALLOC_CONF``, or an earlier call): nothing to do. No CUDA
        memory allocated yet: set it. Otherwise an :class:`AllocatorSettingError` names what to export before the
        process starts."""
        if not plan.alloc_conf or not plan.device.caching_allocator:
            return
        put_in_place(plan.alloc_conf, "this plan's figures (and its budget) hold with")

    def plan_rows(self, plan: Any) -> tuple[tuple[str, str], ...]:
        if not plan.alloc_conf:
            return ()
        return (("CUDA allocator", f"PYTORCH_CUDA_ALLOC_CONF={plan.alloc_conf} (the default allocator's segments do "
                                   "not fit the budget; wrap() sets it before the step allocates)"),)

    def export_notes(self, plan: Any, framework: str) -> tuple[str, ...]:
        # no framework's config sets it: the process must start with it
        if not plan.alloc_conf:
            return ()
        return (f"launch with PYTORCH_CUDA_ALLOC_CONF={plan.alloc_conf} in the environment (before the first CUDA "
                f"allocation): the budget fits only with it, the default allocator's segments do not",)


ALLOCATOR_SETTING = AllocatorSetting(name="allocator-setting", field="alloc_conf", row_after="device")
