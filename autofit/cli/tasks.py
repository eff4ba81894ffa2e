"""``--task``: the target and the loss of a common training task, for a MODEL that gives neither.

A factory that returns only a module (or ``(module, sample)``) has no target and no loss; ``--task`` supplies both,
the same way for every model:

- ``classification``: integer class labels, ``F.cross_entropy(logits, labels)``;
- ``regression``: one float target per row, ``F.mse_loss`` against every output of the row;
- ``causal-lm``: the input token ids shifted by one, ``F.cross_entropy`` over the vocabulary (next-token loss);
- ``masked-lm``: the input token ids, ``F.cross_entropy`` over the vocabulary at every position (a real masked LM
  sets most labels to -100; the loss's memory does not depend on which).

The losses read ``output.logits`` when the output has it (Hugging Face models), else the output itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autofit.core.errors import InvalidInputError, LossError

__all__ = ["TASKS", "LM_TASKS", "task_loss", "task_target", "vocab_size", "class_count",
           "causal_lm_loss", "masked_lm_loss", "regression_loss"]

TASKS = ("classification", "regression", "causal-lm", "masked-lm")
LM_TASKS = ("causal-lm", "masked-lm")


def _logits(output: Any) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)) and logits:
        logits = logits[0]
    if not isinstance(logits, torch.Tensor):
        raise LossError(f"--task needs the model to return a tensor (or an object with .logits), got "
                        f"{type(output).__name__}: pass your own target and loss from a factory instead")
    return logits


def classification_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (rows, classes) logits against integer labels."""
    return F.cross_entropy(_logits(output), target)


def regression_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of every output of a row against that row's target (broadcast, no copy)."""
    out = _logits(output)
    return F.mse_loss(out, target.to(out.dtype).view(-1, *([1] * (out.dim() - 1))).expand_as(out))


def causal_lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts token t + 1 (as Hugging Face's ForCausalLMLoss shifts)."""
    logits = _logits(output)
    return F.cross_entropy(logits[:, :-1].flatten(0, -2), target[:, 1:].flatten(), ignore_index=-100)


def masked_lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy at every position whose label is not -100."""
    logits = _logits(output)
    return F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=-100)


_LOSSES: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "classification": classification_loss, "regression": regression_loss,
    "causal-lm": causal_lm_loss, "masked-lm": masked_lm_loss,
}


def check_task(task: str) -> str:
    if task not in TASKS:
        raise InvalidInputError(f"unknown --task {task!r}: use one of {', '.join(TASKS)}")
    return task


def task_loss(task: str) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    return _LOSSES[check_task(task)]


def vocab_size(model: nn.Module) -> int | None:
    """Token ids must stay below the first embedding's size (the input embedding of a language model)."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    return None


def class_count(model: nn.Module) -> int:
    """Labels must stay below the number of outputs: read it from the last Linear layer (the head), else 1."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1].out_features if linears else 1


def task_target(task: str, model: nn.Module, sample: Any, rows: int) -> torch.Tensor:
    """The target ``--task`` trains against, ``rows`` rows (the sample's batch)."""
    check_task(task)
    if task == "classification":
        return torch.randint(0, class_count(model), (rows,))
    if task == "regression":
        return torch.randn(rows)
    ids = sample[0] if isinstance(sample, (tuple, list)) else sample
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2:
        raise InvalidInputError(f"--task {task} needs token ids as the first input: give --input-shape SEQ "
                                "(with --input-dtype int64, the default for this task)")
    return ids.clone().long()
