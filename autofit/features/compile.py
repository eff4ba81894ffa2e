"""The step feature "compile": the step's model runs as ``torch.compile`` (inductor, default options) compiles it.
This module says what each stage does with it (Note [step features], autofit/features/base.py); the simulation's
compile without kernels is autofit/simulate/compiled_model.py (Note [inductor without kernels]).

Note [compile as a knob]
    ``compile=True`` runs the step's model as ``torch.compile`` (inductor, default options) compiles it: the
    simulation compiles its fake copy without kernels (Note [inductor without kernels], core/_torch_compile.py) and
    ``measure`` and the trainer call ``nn.Module.compile()`` on their real model (which keeps the module's names and
    parameters, so checkpointed or pinned module names still resolve; the trainer takes it back on ``unwrap()``). A
    model the user compiled is simulated as compiled whatever the knob says, and stays as the user compiled it. The
    planner does not pick compilation on its own, although it changes no numerics beyond float reassociation: it
    costs compile time the time model does not price (seconds to minutes, per new input shape), the trainer's shorter
    micro-batches and other lengths recompile with dynamic shapes, whose buffers are not the static ones simulated,
    and code dynamo cannot trace fails or breaks the graph only when the user runs it. Compile is the user's choice,
    which ``plan`` then honours for every candidate.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from autofit.core._torch import compiled_modules
from autofit.core._torch_compile import compiled_calls
from autofit.features.base import Feature

if TYPE_CHECKING:
    from torch import nn

    from autofit.training.config import StepConfig

__all__ = ["COMPILE", "Compile"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compile(Feature):
    """Compilation of the whole model; its value is a flag the user sets (``plan(compile=True)``). The simulation
    reads ``StepConfig.compile`` itself: it compiles its fake copy as inductor would, the kernels left out, and
    says so in a note (autofit/simulate/compiled_model.py)."""

    def real_context(self, config: StepConfig, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        if not config.compile or compiled_modules(model):  # a model the user compiled stays as it is
            return contextlib.nullcontext()
        return compiled_calls(model)

    def plan_rows(self, plan: Any) -> tuple[tuple[str, str], ...]:
        if not plan.compile:
            return ()
        return (("compile", "torch.compile (inductor), applied by the trainer"),)


COMPILE = Compile(name="compile", field="compile", row_after="optimizer", user_setting=True)
