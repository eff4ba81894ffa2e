"""Variable-length batches: which sizes of a batch are its "length", and how a batch is cut to a shorter one.

See Note [the length of a batch].

Note [the length of a batch]
    The sample given to ``plan()`` is the longest batch the user trains on: its non-batch sizes are the maxima. Its
    *length* ``L`` is dim 1 of its 2-D integer or boolean batch tensors, the token sequences (ids, attention masks,
    labels: ``[batch, length]``), the largest if they differ. A 2-D float tensor alone is not a sequence (``[batch,
    features]`` is the input of an MLP), nor is a 3-D one (``[batch, channels, time]`` for a 1-D convolution has its
    length in dim 2). Once ``L`` is known, every 2-D or 3-D batch tensor whose dim 1 equals ``L`` (a float mask,
    ``inputs_embeds`` ``[batch, length, hidden]``) is a length tensor too, and all are cut together. A sample
    without a token sequence (images, feature vectors, float-only audio features) has no length, and the plan holds
    one micro-batch size for every batch.

    A batch the trainer is given may be shorter: each of its tensors must have the sample's number of dims and
    non-batch sizes at most the sample's, and its length is dim 1 of the tensors at the positions of the sample's
    length tensors. A longer batch, or one of another structure, is refused (:func:`batch_length`): the plan cannot
    promise that it fits. A sample whose batch is not dim 0 (``batch_dim``, Note [the batch dimension]) has no
    length: its non-batch sizes are still the maxima a batch is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autofit.core._torch import pytree
from autofit.training.batch import Batch
from autofit.core.errors import InvalidInputError

__all__ = ["LengthSpec", "batch_length", "cut_to_length", "length_spec"]


@dataclass(frozen=True)
class LengthSpec:
    """The sample's maximum sizes: ``length`` (None: no length tensor) and the non-batch shape of each batch
    tensor of the inputs, then of the target, in pytree leaf order; ``length_tensors`` marks those cut together."""

    length: int | None
    shapes: tuple[tuple[int, ...], ...]
    length_tensors: tuple[bool, ...]


def _batch_leaves(batch: Batch | None) -> list[torch.Tensor]:
    if batch is None:
        return []
    return batch.per_sample_tensors()


def _non_batch_shapes(batch: Batch, target: Batch | None) -> tuple[tuple[int, ...], ...]:
    return tuple(b.non_batch_shape(t) for b in (batch, target) if b is not None for t in b.per_sample_tensors())


def _has_length(t: torch.Tensor) -> bool:
    return t.dim() in (2, 3)


def _is_sequence(t: torch.Tensor) -> bool:
    """Token ids, masks or labels: ``[batch, length]`` of integers or booleans."""
    return t.dim() == 2 and not t.is_floating_point() and not t.is_complex()


def length_spec(batch: Batch, target: Batch | None) -> LengthSpec:
    """The sample's maximum sizes (See Note [the length of a batch])."""
    leaves = _batch_leaves(batch) + _batch_leaves(target)
    dim_0 = all(b is None or b.batch_dim == 0 for b in (batch, target))
    lengths = [int(t.shape[1]) for t in leaves if _is_sequence(t)] if dim_0 else []
    length = max(lengths) if lengths else None
    return LengthSpec(
        length=length,
        shapes=_non_batch_shapes(batch, target),
        length_tensors=tuple(length is not None and _has_length(t) and t.shape[1] == length for t in leaves),
    )


def cut_to_length(batch: Batch | None, spec: LengthSpec, length: int) -> Batch | None:
    """``batch`` (shaped like the sample) with every length tensor cut to its first ``length`` positions."""
    if batch is None or spec.length is None or length == spec.length:
        return batch

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[:, :length].contiguous() if _has_length(t) and t.shape[1] == spec.length else t

    return batch.map_per_sample(cut)


def batch_length(spec: LengthSpec, batch: Batch, target: Batch | None) -> int | None:
    """The length of a batch the trainer is given, checked against the sample's maxima: a typed error naming both
    shapes when the batch is longer or shaped otherwise (See Note [the length of a batch])."""
    got = _non_batch_shapes(batch, target)
    if len(got) != len(spec.shapes) or any(len(g) != len(s) for g, s in zip(got, spec.shapes)):
        raise InvalidInputError(
            f"this batch's tensors have non-batch shapes {_shapes(got)} but the plan was made for {_shapes(spec.shapes)}:"
            " give batches with the same tensors as the sample given to plan()"
        )
    over = [(g, s) for g, s in zip(got, spec.shapes) if any(a > b for a, b in zip(g, s))]
    if over:
        g, s = over[0]
        raise InvalidInputError(
            f"batch is longer than the plan allows: a tensor of non-batch shape {g} against the planned maximum {s} "
            f"(all: {_shapes(got)} against {_shapes(spec.shapes)}); plan() with the longest batch you train on, or "
            "truncate this one"
        )
    if spec.length is None:
        return None
    return max(g[0] for g, is_length in zip(got, spec.length_tensors) if is_length)


def _shapes(shapes: tuple[tuple[int, ...], ...]) -> str:
    return ", ".join(str(tuple(s)) for s in shapes)
