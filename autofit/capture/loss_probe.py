"""Whether the loss is a sum over rows, found on a copy of the model (Note [sum-reduced losses],
autofit/training/normalisation.py; Note [the loss probe] for how it runs without touching the user's model)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autofit.capture.model_copy import shared_weights_copy
from autofit.core._torch import TorchDispatchMode, op_schema, pytree
from autofit.core._torch_compile import compiled_code_runs_eagerly
from autofit.training.batch import Batch
from autofit.training.loss import LossFn, own_loss
from autofit.training.normalisation import hf_token_mean, reduction_of

__all__ = ["loss_reduction"]

# Note [the loss probe]
# ~~~~~~~~~~~~~~~~~~~~~
# The probe runs the forward for real, with values, three times on one or two rows, so it must not run the user's
# model: a forward that counts its calls in a buffer or keeps its inputs in a list would change the model that
# ``plan`` promises to leave alone. It runs a copy instead (``shared_weights_copy``): its buffers, tensor
# attributes and Python state are its own, and its parameters read the user's storage rather than doubling the
# weights on their device. So a dispatch mode (``_ProbeGuard``) refuses any op that would write into that storage
# (the probe then answers "mean", uncertain), and the inputs are copies too. The loss is copied through the same
# memo when it is a module or a bound method of the model, so it reaches the copy.
#
# The rows must each have a loss of their own for the sum test to mean anything. Eval mode leaves dropout out and
# BatchNorm on its running statistics; a draw the forward makes anyway (a VAE's ``torch.randn_like`` in its
# reparameterisation, the pytorch/examples recipe) would give rows 0:2 other noise than rows 0:1 and 1:2 and hide
# the sum. So every random op (those torch tags ``nondeterministic_seeded``) returns a constant instead: the same
# value in every row, whatever the call (``_FILL``); an integer draw (``randint``, ``randperm``) has no constant
# that keeps its meaning, and makes the probe uncertain. The generators are left as the entry point found them
# anyway (Note [the user's random state], core/rng.py).
_FILL = 0.5  # what a floating random draw returns in the probe: any constant makes a row's loss its own


class _Uncertain(Exception):
    """The probe cannot tell: the loss stays a mean."""


class _ProbeGuard(TorchDispatchMode):
    """Refuses writes into the user's parameter storage, and makes every random draw a constant (Note [the loss
    probe])."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = op_schema(func)
        if schema is not None and schema.is_mutable and any(
                _storage(t) in self.storages for t in _written(schema, args, kwargs)):
            raise _Uncertain(f"{func} writes into the model's parameters")
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                raise _Uncertain(f"{func} draws values no constant stands for")
            out.fill_(_FILL)
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _written(schema: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    written = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        written += [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]
    return written


def loss_reduction(model: nn.Module, batch: Batch, target: Batch | None, loss_fn: LossFn | None) -> str:
    """How the loss reduces over rows, "sum" or "mean", found by running it on a copy of the model (Note [sum-reduced
    losses], Note [the loss probe]): a ``loss_fn`` without ``count_items``, or without one the model's own loss
    (``output["loss"]``, ``output.loss``). "mean" where not certain."""
    if loss_fn is not None and getattr(loss_fn, "count_items", None) is not None:
        return "mean"
    if loss_fn is None and hf_token_mean(model, batch):  # a token mean by construction: three forwards saved
        return "mean"
    tensors = [*model.parameters(), *model.buffers()]
    inputs = batch.tensors() + ([] if target is None else target.tensors())
    if not tensors or any(t.is_meta for t in tensors + inputs):
        return "mean"
    device = tensors[0].device
    storages = {_storage(p) for p in model.parameters() if p.numel()}
    try:
        work, loss = shared_weights_copy(model, loss_fn)
    except Exception:  # noqa: BLE001 - a model the copy cannot take: the simulation says what is wrong with it
        return "mean"
    two = batch.resize(2).map_tensors(lambda t: t.to(device, copy=True))
    two_target = None if target is None else target.resize(2).map_tensors(lambda t: t.to(device, copy=True))

    def loss_of(start: int, stop: int) -> float:
        rows_target = None if two_target is None else two_target.slice(start, stop).value
        output = two.slice(start, stop).call(work)
        if loss is None:
            value = own_loss(output)
            if value is None:  # the default loss of a prediction is a mean (training/loss.py)
                raise _Uncertain("no loss of the model's own")
        else:
            value = loss(output) if rows_target is None else loss(output, rows_target)
        return float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else float("nan")

    work.eval()
    try:
        with torch.no_grad(), compiled_code_runs_eagerly(), _ProbeGuard(storages):
            return reduction_of(loss_of)
    except Exception:  # noqa: BLE001 - not certain: the simulation reports a forward that fails
        return "mean"
