"""The example batch: a tensor, a tuple of positional inputs, or a dict of keyword inputs; dim 0 is the batch.

autofit never trusts the sample's own batch size: every stage resizes it to the micro-batch it simulates or runs.
Resizing repeats the sample's rows cyclically (row ``i`` of the new batch is row ``i % n`` of the sample), so real
data stays real data and a larger batch can be made from a single example. Tensors whose first dimension is not the
batch size (a shared mask, a scalar option) and non-tensor values pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autofit.core._torch import pytree
from autofit.core.errors import InvalidInputError

__all__ = ["Batch", "as_batch"]


@dataclass(frozen=True)
class Batch:
    """Positional and keyword inputs of one forward call, with the batch size their batch tensors share."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    size: int
    kind: str = "tuple"  # how the user gave it: "tensor", "tuple" or "dict"

    @property
    def value(self) -> Any:
        """The batch in the form the user gave it (how a target reaches the loss function)."""
        if self.kind == "tensor":
            return self.args[0]
        return dict(self.kwargs) if self.kind == "dict" else self.args

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(t, torch.Tensor)]

    def _map_batch(self, fn) -> Batch:
        def visit(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == self.size:
                return fn(leaf)
            return leaf

        args, kwargs = pytree.tree_map(visit, (self.args, self.kwargs))
        return args, kwargs

    def resize(self, size: int) -> Batch:
        """A new batch of ``size`` rows, each a contiguous tensor of its own (as a data loader would hand it)."""
        if size < 1:
            raise InvalidInputError(f"micro-batch size must be >= 1, got {size}")

        def take(t: torch.Tensor) -> torch.Tensor:
            if size == self.size:
                return t.clone(memory_format=torch.contiguous_format)
            index = torch.arange(size, device=t.device) % self.size
            return t.index_select(0, index).contiguous()

        args, kwargs = self._map_batch(take)
        return Batch(args, kwargs, size, self.kind)

    def slice(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` as views (the trainer's micro-batches of a real batch)."""
        args, kwargs = self._map_batch(lambda t: t[start:stop])
        return Batch(args, kwargs, stop - start, self.kind)

    def map_tensors(self, fn) -> Batch:
        """Apply ``fn`` to every tensor (batch or not): device moves, fake conversion."""
        args, kwargs = pytree.tree_map_only(torch.Tensor, fn, (self.args, self.kwargs))
        return Batch(args, kwargs, self.size, self.kind)

    def call(self, module: torch.nn.Module) -> Any:
        return module(*self.args, **self.kwargs)


def as_batch(sample: Any, *, what: str = "sample") -> Batch:
    """Normalise a user's sample (tensor, tuple/list of inputs, dict of keyword inputs) into a :class:`Batch`."""
    if isinstance(sample, Batch):
        return sample
    if isinstance(sample, torch.Tensor):
        args, kwargs, kind = (sample,), {}, "tensor"
    elif isinstance(sample, (tuple, list)):
        args, kwargs, kind = tuple(sample), {}, "tuple"
    elif isinstance(sample, Mapping):
        kwargs, kind = dict(sample), "dict"
        if not all(isinstance(k, str) for k in kwargs):
            raise InvalidInputError(f"{what} dict keys must be the forward's keyword names (strings)")
        args = ()
    else:
        raise InvalidInputError(
            f"{what} must be a tensor, a tuple of positional inputs or a dict of keyword inputs, "
            f"got {type(sample).__name__}"
        )
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise InvalidInputError(f"{what} holds no tensor: give at least one input tensor whose dim 0 is the batch")
    first = tensors[0]
    if first.dim() == 0:
        raise InvalidInputError(
            f"{what} tensor is a scalar (shape ()): autofit needs dim 0 to be the batch; "
            "add one with x.unsqueeze(0) for a single example"
        )
    if first.shape[0] == 0:
        raise InvalidInputError(
            f"{what} has 0 rows along dim 0 (the batch, read from its first tensor, shape {tuple(first.shape)}): "
            "give at least one example"
        )
    return Batch(args, kwargs, int(first.shape[0]), kind)
