"""The example batch: a tensor, a tuple of positional inputs, or a dict of keyword inputs. See Note [the batch
dimension].

autofit never trusts the sample's own batch size: every stage resizes it to the micro-batch it simulates or runs.
Resizing repeats the sample's rows cyclically (row ``i`` of the new batch is row ``i % n`` of the sample), so real
data stays real data and a larger batch can be made from a single example.

Note [the batch dimension]
    One rule, applied to every tensor of the inputs and of the target (docs/api.md, "sample"):
    1. inputs named in ``shared`` (positions of a tuple sample, keys of a dict sample) are passed whole to every
       micro-batch, whatever their shape;
    2. the batch size N is dim 0 of the target's first tensor when a target is given, else dim 0 of the first
       tensor of the inputs not named in ``shared`` (positional inputs first, then keyword inputs in order);
    3. every other tensor whose dim 0 is N is per-sample: sliced into micro-batches and resized along dim 0; the
       rest (a shared mask of another size, a scalar option) and non-tensor values are passed whole.
    "dim 0" is the default batch dimension. ``batch_dim=d`` (``plan``, ``estimate``, ``measure``, ``analyse``, the
    CLI's ``--batch-dim``; the plan records it for its trainer) reads dim d instead, for the inputs and the target
    alike: time-major sequences, ``nn.LSTM``'s default ``(seq, batch, feature)``, are ``batch_dim=1``, and split along
    dim 0 they would be cut along time (a model that reads its last step then trains on another loss). A target whose
    batch is another dim than the inputs' (one label per sequence, ``(batch,)``): ``batch_dim=(1, 0)``, the inputs'
    then the target's. A sample with another batch dim has no length (Note [the length of a batch]). The dim and
    ``shared`` say the same thing, which rows of the sample are the batch, so ``plan``, ``estimate`` and ``measure``
    take them as one value, ``batch_dim=autofit.BatchDim(dim, shared=...)`` (autofit/options.py; an int or a pair is
    the dim alone); ``analyse`` and the trainer still take ``shared`` beside it.
    Rule 2 reads the target first because a target has one row per sample by definition, where an input may be a
    one-element option (``forward(scale, x)`` with ``scale = torch.tensor([2.])``). A shared tensor whose dim 0
    happens to equal N (a (seq, seq) mask with seq == N) cannot be told apart from a per-sample one: name it in
    ``shared``. Errors about sizes list which tensors were taken as per-sample and which were passed whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from autofit.core._torch import pytree
from autofit.core.errors import ForwardError, InvalidInputError

__all__ = ["Batch", "as_batch", "as_batches", "as_shared", "as_batch_dims", "micro_batch_bounds", "naming_inputs"]


@dataclass(frozen=True)
class Batch:
    """Positional and keyword inputs of one forward call, with the batch size their batch tensors share."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    size: int
    kind: str = "tuple"  # how the user gave it: "tensor", "tuple" or "dict"
    shared: frozenset[int | str] = field(default_factory=frozenset)  # inputs passed whole (Note [the batch dimension])
    batch_dim: int = 0  # the dim of the batch in every per-sample tensor (Note [the batch dimension])

    @property
    def value(self) -> Any:
        """The batch in the form the user gave it (how a target reaches the loss function)."""
        if self.kind == "tensor":
            return self.args[0]
        return dict(self.kwargs) if self.kind == "dict" else self.args

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in pytree.tree_leaves((self.args, self.kwargs)) if isinstance(t, torch.Tensor)]

    def _is_row_tensor(self, leaf: Any) -> bool:
        dim = self.batch_dim
        return isinstance(leaf, torch.Tensor) and leaf.dim() > dim and leaf.shape[dim] == self.size

    def _inputs(self) -> list[tuple[int | str, Any]]:
        return [*enumerate(self.args), *self.kwargs.items()]

    def per_sample_tensors(self) -> list[torch.Tensor]:
        """The tensors split along the batch dim (rule 3 of Note [the batch dimension]), in argument order."""
        return [t for key, value in self._inputs() if key not in self.shared
                for t in pytree.tree_leaves(value) if self._is_row_tensor(t)]

    def map_per_sample(self, fn) -> Batch:
        """Apply ``fn`` to every per-sample tensor; shared inputs and the other values stay as they are."""
        def visit(leaf: Any) -> Any:
            return fn(leaf) if self._is_row_tensor(leaf) else leaf

        args = tuple(a if i in self.shared else pytree.tree_map(visit, a) for i, a in enumerate(self.args))
        kwargs = {k: v if k in self.shared else pytree.tree_map(visit, v) for k, v in self.kwargs.items()}
        return dataclasses.replace(self, args=args, kwargs=kwargs)

    def layout(self) -> str:
        """Which tensors were taken as per-sample and which passed whole, with their shapes, for messages."""
        rows, whole = [], []
        for key, value in self._inputs():
            name = f"input {key}" if isinstance(key, int) else repr(key)
            if self.kind == "tensor":
                name = "the tensor"
            for path, leaf in pytree.tree_flatten_with_path(value)[0]:
                if isinstance(leaf, torch.Tensor):
                    label = f"{name}{pytree.keystr(path)} {tuple(leaf.shape)}"
                    (whole if key in self.shared or not self._is_row_tensor(leaf) else rows).append(label)
        text = f"per-sample (dim {self.batch_dim} = {self.size}): {', '.join(rows) or 'none'}"
        return text + (f"; passed whole: {', '.join(whole)}" if whole else "")

    def resize(self, size: int) -> Batch:
        """A new batch of ``size`` rows, each a contiguous tensor of its own (as a data loader would hand it)."""
        if size < 1:
            raise InvalidInputError(f"micro-batch size must be >= 1, got {size}")

        def take(t: torch.Tensor) -> torch.Tensor:
            if size == self.size:
                return t.clone(memory_format=torch.contiguous_format)
            index = torch.arange(size, device=t.device) % self.size
            return t.index_select(self.batch_dim, index).contiguous()

        return dataclasses.replace(self.map_per_sample(take), size=size)

    def slice(self, start: int, stop: int) -> Batch:
        """Rows ``start:stop`` as views (the trainer's micro-batches of a real batch)."""
        return dataclasses.replace(self.map_per_sample(lambda t: t.narrow(self.batch_dim, start, stop - start)),
                                   size=stop - start)

    def non_batch_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """``t``'s shape without its batch dim."""
        return tuple(int(s) for i, s in enumerate(t.shape) if i != self.batch_dim)

    def map_tensors(self, fn) -> Batch:
        """Apply ``fn`` to every tensor (batch or not): device moves, fake conversion."""
        args, kwargs = pytree.tree_map_only(torch.Tensor, fn, (self.args, self.kwargs))
        return dataclasses.replace(self, args=args, kwargs=kwargs)

    def call(self, module: torch.nn.Module) -> Any:
        return module(*self.args, **self.kwargs)


def micro_batch_bounds(batch_rows: int, rows: int, least: int = 1) -> list[tuple[int, int]]:
    """The row ranges one process's trainer cuts from a batch of ``batch_rows``: ``rows`` each, the last one taking
    the rest; a rest shorter than ``least`` takes rows from the micro-batch before (Note [micro-batches a model
    refuses], autofit/capture/rows.py), so none holds more than ``rows``. ``Trainer._bounds`` (emit/trainer.py)
    cuts by it, and the planner reads it to know the micro-batches the sample makes (Note [rows that differ])."""
    bounds = [(start, min(start + rows, batch_rows)) for start in range(0, batch_rows, rows)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < least:
        (a, b), (_, end) = bounds[-2], bounds[-1]
        moved = least - (end - b)
        if b - moved - a >= least:
            bounds[-2:] = [(a, b - moved), (b - moved, end)]
    return bounds


def as_shared(shared: Any) -> frozenset[int | str]:
    """``shared=`` as a set of input positions (ints) and keys (strings); None or () for none."""
    if shared is None:
        return frozenset()
    items = (shared,) if isinstance(shared, (int, str)) else shared
    if not isinstance(items, Iterable) or isinstance(items, Mapping):
        raise InvalidInputError(f"shared must name inputs: a position, a key, or a tuple of them; got {shared!r}")
    items = tuple(items)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise InvalidInputError(
                f"shared must name inputs by position (int, for a tuple sample) or key (str, for a dict sample); "
                f"got {item!r}"
            )
    return frozenset(items)


def as_batch_dims(batch_dim: Any) -> tuple[int, int]:
    """``batch_dim=`` as (the inputs' batch dim, the target's): an int for both, or a pair (Note [the batch
    dimension])."""
    dims = (batch_dim, batch_dim) if isinstance(batch_dim, int) and not isinstance(batch_dim, bool) else batch_dim
    if (not isinstance(dims, (tuple, list)) or len(dims) != 2
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims)):
        raise InvalidInputError(
            f"batch_dim must be the dim of the batch, an int >= 0 (1 for time-major sequences, nn.LSTM's default "
            f"(seq, batch, feature)), or a pair (the inputs', the target's), e.g. (1, 0); got {batch_dim!r}"
        )
    return int(dims[0]), int(dims[1])


def as_batch(sample: Any, *, what: str = "sample", shared: Any = None, size: int | None = None,
             batch_dim: int = 0) -> Batch:
    """Normalise a user's sample (tensor, tuple/list of inputs, dict of keyword inputs) into a :class:`Batch`, its
    batch size read by Note [the batch dimension]: ``size`` when the caller knows it (the target's rows), else dim
    ``batch_dim`` of the first tensor of an input not in ``shared``."""
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
    shared = as_shared(shared)
    _check_shared(shared, kind, args, kwargs, what)
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise InvalidInputError(f"{what} holds no tensor: give at least one input tensor whose dim 0 is the batch")
    candidates = [t for key, value in [*enumerate(args), *kwargs.items()] if key not in shared
                  for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    if not candidates:
        raise InvalidInputError(
            f"every tensor of the {what} is named in shared={sorted(shared, key=str)}: at least one input must be "
            "per-sample (its dim 0 the batch)"
        )
    batch = Batch(args, kwargs, 0, kind, shared, batch_dim)
    if size is None:
        first = candidates[0]
        if first.dim() == 0:
            raise InvalidInputError(
                f"{what} tensor is a scalar (shape ()): autofit needs dim {batch_dim} to be the batch; "
                "add one with x.unsqueeze(0) for a single example, or name it in shared="
            )
        if first.dim() <= batch_dim:
            raise InvalidInputError(
                f"{what}'s first tensor has shape {tuple(first.shape)}, no dim {batch_dim}, which batch_dim names as "
                "the batch (Note [the batch dimension]): give the batch dim of each (batch_dim=(inputs', target's)), "
                "or name the tensor in shared="
            )
        size = int(first.shape[batch_dim])
    batch = dataclasses.replace(batch, size=size)
    if size == 0:
        raise InvalidInputError(
            f"{what} has 0 rows along dim {batch_dim} (the batch; Note [the batch dimension]: {batch.layout()}): give at least "
            "one example"
        )
    return batch


def as_batches(sample: Any, target: Any, *, shared: Any = None, what: str = "sample",
               batch_dim: Any = 0) -> tuple[Batch, Batch | None]:
    """The inputs and the target as batches of the same rows (Note [the batch dimension]: the target's rows, when
    given, are the batch size); ``batch_dim``: an int, or (the inputs', the target's)."""
    dim, target_dim = as_batch_dims(batch_dim)
    if target is None:
        return as_batch(sample, what=what, shared=shared, batch_dim=dim), None
    target_batch = as_batch(target, what="target", batch_dim=target_dim)
    batch = as_batch(sample, what=what, shared=shared, size=target_batch.size, batch_dim=dim)
    if not batch.per_sample_tensors():
        first = as_batch(sample, what=what, shared=shared, batch_dim=dim)
        raise InvalidInputError(
            f"target has {target_batch.size} rows along dim {target_dim} but the {what} has {first.size}: give one "
            f"target row per {what} row (no input tensor has {target_batch.size} rows along dim {dim}; "
            f"{first.layout()}; another batch dim: batch_dim=, Note [the batch dimension])"
        )
    return batch, target_batch


def _check_shared(shared: frozenset[int | str], kind: str, args: tuple, kwargs: dict, what: str) -> None:
    if not shared:
        return
    if kind == "tensor":
        raise InvalidInputError(f"shared={sorted(shared, key=str)} names inputs, but the {what} is a single tensor: "
                                "it is the per-sample input")
    if kind == "tuple":
        unknown = [s for s in shared if isinstance(s, str) or not 0 <= s < len(args)]
    else:
        unknown = [s for s in shared if s not in kwargs]
    if unknown:
        names = f"positions 0 to {len(args) - 1}" if kind == "tuple" else f"keys {sorted(kwargs)}"
        raise InvalidInputError(f"shared names {sorted(unknown, key=str)}, which the {what} does not have: its inputs "
                                f"are {names}")


@contextlib.contextmanager
def naming_inputs(batch: Callable[[], Batch]) -> Iterator[None]:
    """A :class:`ForwardError` raised inside says which tensors were taken as per-sample (a shape error in a forward
    is often a shared input sliced as a batch, or the other way round). ``batch`` builds the inputs' Batch (only when
    needed). The error keeps its module, its cause and its traceback."""
    try:
        yield
    except ForwardError as e:
        if e.args and "Note [the batch dimension]" not in str(e.args[0]):
            try:
                layout = batch().layout()
            except InvalidInputError:
                raise e from e.__cause__
            e.args = (f"{e.args[0]}. The inputs, by Note [the batch dimension] (autofit/training/batch.py): "
                      f"{layout}; name inputs that are not per-sample in shared=", *e.args[1:])
        raise
