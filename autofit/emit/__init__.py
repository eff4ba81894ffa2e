"""Stage 5, emit: the plan, and the training wrapper that executes it."""

from autofit.emit.apply import wrap
from autofit.emit.plan import use_wrap
from autofit.emit.trainer import Trainer

use_wrap(wrap)  # what Plan.wrap calls (Note [the plan is data], autofit/emit/plan.py)

__all__ = ["Trainer", "wrap"]
