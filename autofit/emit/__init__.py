"""Stage 5, emit: the training wrapper that executes a plan."""

from autofit.emit.trainer import Trainer

__all__ = ["Trainer"]
