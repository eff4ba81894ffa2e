"""The optimizer step fused into backward. See Note [optimizer step in backward].

Note [optimizer step in backward]
    A post-accumulate-grad hook (``Tensor.register_post_accumulate_grad_hook``, which autograd calls once a leaf's
    ``.grad`` is complete for this backward) steps each parameter as soon as its gradient is ready and frees that
    gradient, so the gradients never all live at once: the step's peak loses up to all of their bytes (PyTorch
    tutorial "How to save memory by fusing the optimizer step into the backward pass", about 6 GB down to about 4 GB
    for vit_l_16). Valid only when each gradient is final after one backward, so without accumulation
    (``accumulation_steps == 1``), and when the update of one parameter needs no other's gradient, so without
    clipping by the total norm and without a GradScaler's all-parameter inf check (fp16), and without a master copy.

    The tutorial builds one optimizer per parameter. Here the user's own optimizer steps, restricted for the
    duration of the hook to the one parameter's group holding just that parameter: its state (keyed by the
    parameter), its hyperparameters and an LR scheduler attached to it all stay what the user made. The same code
    runs in the simulation, in ``measure`` and in the trainer (``autofit/training/step.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from autofit.core.errors import InvalidInputError

__all__ = ["check_in_backward", "stepping_in_backward"]


def check_in_backward(*, accumulation_steps: int, clip_grad_norm: float | None, grad_scaler: bool,
                      master_copy: bool) -> None:
    """A typed error when the step cannot run the optimizer in backward (See Note [optimizer step in backward])."""
    why = []
    if accumulation_steps > 1:
        why.append(f"{accumulation_steps} accumulation steps (each gradient must be final after one backward)")
    if clip_grad_norm is not None:
        why.append("gradient clipping by the total norm (it needs every gradient before any step)")
    if grad_scaler:
        why.append("fp16 loss scaling (GradScaler skips a step when any gradient is inf, so it needs all of them)")
    if master_copy:
        why.append("an fp32 master copy (its optimizer steps the copies, not the parameters)")
    if why:
        raise InvalidInputError("optimizer_in_backward=True cannot run with " + "; ".join(why) + ": drop one or "
                                "the other")


@contextlib.contextmanager
def stepping_in_backward(model: nn.Module, optimizer: torch.optim.Optimizer,
                         stepped: set[int] | None = None) -> Iterator[None]:
    """Within this context, backward steps ``optimizer`` parameter by parameter and frees each gradient; ``stepped``
    collects the ids of the parameters stepped. The hooks are removed on exit."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def step_one(p: torch.Tensor) -> None:
        group = group_of.get(id(p))
        if group is None or p.grad is None:
            return
        saved = [g["params"] for g in optimizer.param_groups]
        try:
            for g in optimizer.param_groups:
                g["params"] = [p] if g is group else []
            optimizer.step()
        finally:
            for g, params in zip(optimizer.param_groups, saved):
                g["params"] = params
        p.grad = None
        if stepped is not None:
            stepped.add(id(p))

    handles = [p.register_post_accumulate_grad_hook(step_one) for p in model.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
