"""How the losses of the micro-batches add up to the loss of the whole batch. See Note [loss normalisation].

Note [loss normalisation]
    A loss is a mean: over rows (``F.mse_loss`` of a per-row prediction) or over items that rows hold in different
    numbers (tokens whose label is not -100: ``F.cross_entropy`` skips ``ignore_index`` and divides by the number of
    targets it kept, torch/nn/functional.py ``cross_entropy``, aten ``nll_loss`` with reduction "mean"). The mean of
    the whole batch is ``sum_i n_i * mean_i / N``, where ``n_i`` counts what micro-batch ``i`` averages over and
    ``N = sum_i n_i`` (over every rank). So each micro-batch's loss is weighted by ``n_i / N``: rows for a row mean,
    items for an item mean. Weighting token means by rows is the gradient-accumulation bug transformers fixed in
    4.46 (huggingface/transformers#34191). Data parallelism averages gradients over ranks (DDP's allreduce and
    FSDP2's reduce-scatter divide by the world size), so a rank multiplies its weights by the world size.

    The counts come from the batch itself, before the first micro-batch runs, through an item counter
    ``(inputs, target) -> count`` of some rows:
    - the default cross-entropy (integer target): targets that are not -100;
    - a Hugging Face model given ``labels``: labels that are not -100, after the shift of causal LM losses, counted
      as transformers' own Trainer counts ``num_items_in_batch`` (transformers/trainer.py,
      ``Trainer._get_num_items_in_batch``). Its loss is then the mean over the micro-batch's tokens, weighted by
      ``n_i / N``: the same number as passing ``num_items_in_batch=N`` (``sum_i / N``), on every transformers
      version and whether or not the model's forward passes that keyword on to its loss;
    - a user's ``loss_fn`` with a ``count_items(inputs, target)`` attribute (:class:`ItemMeanLoss` builds one);
    - anything else: rows.
    A micro-batch with no item (all padding) gets weight 0; its mean is 0/0 = nan, but with weight 0 no gradient
    reaches it and cross-entropy's backward skips ignored targets (aten ``nll_loss_backward``), so gradients stay
    finite. A batch with no item at all has no mean: that is an error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autofit.training.batch import Batch
from autofit.core.errors import InvalidInputError
from autofit.training.loss import LossFn

__all__ = ["IGNORE_INDEX", "LOSS_REDUCTIONS", "ItemMeanLoss", "LossNormalisation", "count_items", "hf_token_mean",
           "item_counter", "reduction_of"]

LOSS_REDUCTIONS = ("mean", "sum")

# F.cross_entropy's default ignore_index (torch/nn/functional.py, cross_entropy), which Hugging Face losses use too
# (transformers/loss/loss_utils.py, fixed_cross_entropy).
IGNORE_INDEX = -100

ItemCounter = Callable[[Any, Any], "int | torch.Tensor"]


@dataclass(frozen=True)
class ItemMeanLoss:
    """A ``loss_fn`` that averages over items (tokens, pixels, boxes) rather than rows, with the function that counts
    them, so that accumulation weights each micro-batch by its share of the batch's items.

    ``loss(output, target)`` (or ``loss(output)``) returns the mean over the items of the rows it is given;
    ``count_items(inputs, target)`` returns how many items those rows hold (an int or an integer tensor); ``inputs``
    and ``target`` come in the form the trainer was given them. Any callable with a ``count_items`` attribute
    follows the same protocol."""

    loss: LossFn
    count_items: ItemCounter

    def __post_init__(self) -> None:
        if not callable(self.loss):
            raise InvalidInputError(f"ItemMeanLoss.loss must be callable, got {type(self.loss).__name__}")
        if not callable(self.count_items):
            raise InvalidInputError(
                "ItemMeanLoss.count_items must be callable (inputs, target) -> int, "
                f"got {type(self.count_items).__name__}"
            )

    def __call__(self, *args: Any) -> torch.Tensor:
        return self.loss(*args)


@dataclass(frozen=True)
class LossNormalisation:
    """The weight of each micro-batch's loss in one optimizer step, computed once per batch (See Note [loss
    normalisation]). ``counts``: what each micro-batch of this process averages over; ``total``: the same over the
    whole batch and every rank; ``ranks``: the number of ranks gradients are averaged over."""

    unit: str  # "rows" or "items"
    counts: tuple[int, ...]
    total: int
    ranks: int = 1
    summed: bool = False  # the loss is a sum over rows (loss_reduction="sum"): micro-batch sums add up unweighted

    def __post_init__(self) -> None:
        if self.total <= 0:
            raise InvalidInputError(
                f"the batch holds no {self.unit} the loss averages over (every target is {IGNORE_INDEX}?): "
                "its mean loss is undefined; drop the batch or fix its labels"
            )

    @classmethod
    def of_rows(cls, rows: tuple[int, ...]) -> LossNormalisation:
        """Row means in one process: micro-batch ``i`` weighs ``rows[i] / sum(rows)``."""
        return cls("rows", tuple(rows), sum(rows))

    def weight(self, i: int) -> float:
        """What micro-batch ``i``'s loss is multiplied by before backward."""
        if self.summed:  # the batch's sum is the sum of the micro-batches' sums; ranks: undo DDP's average
            return float(self.ranks)
        return self.ranks * self.counts[i] / self.total

    def local_mean(self, losses: list[float]) -> float:
        """The mean loss over this process's rows, from the micro-batches' means (skipping empty ones)."""
        if self.summed:
            return sum(losses)
        local = sum(self.counts)
        return sum(loss * n / local for loss, n in zip(losses, self.counts) if n)


def item_counter(model: nn.Module, loss_fn: LossFn | None, batch: Batch, target: Batch | None) -> ItemCounter | None:
    """The counter of what the loss averages over, or None when it is a mean over rows."""
    if loss_fn is not None:
        count = getattr(loss_fn, "count_items", None)
        if count is not None and not callable(count):
            raise InvalidInputError("loss_fn.count_items must be a callable (inputs, target) -> int")
        return count
    if _hf_labels(model, batch) is not None:
        return _hf_counter(model)
    if target is not None and isinstance(target.value, torch.Tensor) and not target.value.is_floating_point():
        return _cross_entropy_count  # the default loss is cross-entropy against this target
    return None


def count_items(counter: ItemCounter | None, batch: Batch, target: Batch | None,
                bounds: list[tuple[int, int]]) -> tuple[int, ...]:
    """Items (or rows, without a counter) of each micro-batch ``batch[start:stop]``."""
    if counter is None:
        return tuple(stop - start for start, stop in bounds)
    counts = []
    for start, stop in bounds:
        rows = batch.slice(start, stop)
        rows_target = None if target is None else target.slice(start, stop).value
        n = counter(rows.value, rows_target)
        try:
            n = int(n)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidInputError(f"count_items returned {n!r}; it must return an int or a one-element tensor") from e
        if n < 0:
            raise InvalidInputError(f"count_items returned {n}; a count of items must be >= 0")
        counts.append(n)
    return tuple(counts)


def _cross_entropy_count(inputs: Any, target: torch.Tensor) -> torch.Tensor:
    return target.ne(IGNORE_INDEX).sum()


def _hf_labels(model: nn.Module, batch: Batch) -> torch.Tensor | None:
    """The ``labels`` a Hugging Face model computes its own loss from, if this is one and it was given them."""
    labels = batch.kwargs.get("labels") if batch.kind == "dict" else None
    if not isinstance(labels, torch.Tensor) or not _is_hf_model(model):
        return None
    return labels


def hf_token_mean(model: nn.Module, batch: Batch) -> bool:
    """Whether the default loss is a Hugging Face model's own, from ``labels``: a mean over tokens (transformers'
    ``fixed_cross_entropy`` divides by the tokens it kept when no ``num_items_in_batch`` is passed)."""
    return _hf_labels(model, batch) is not None


def _is_hf_model(model: nn.Module) -> bool:
    if "transformers" not in sys.modules:  # a model of that library means it is imported already
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _hf_counter(model: nn.Module) -> ItemCounter:
    shifts = _hf_loss_shifts_labels(model)

    def count(inputs: Mapping[str, Any], target: Any) -> torch.Tensor:
        # transformers/trainer.py, Trainer._get_num_items_in_batch: a collator's own shift_labels as they are,
        # else labels[..., 1:] for a causal LM loss, else labels
        if isinstance(inputs.get("shift_labels"), torch.Tensor):
            labels = inputs["shift_labels"]
        else:
            labels = inputs["labels"][..., 1:] if shifts else inputs["labels"]
        return labels.ne(IGNORE_INDEX).sum()

    return count


def _hf_loss_shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss is ``ForCausalLMLoss``, which predicts label t+1 from position t.

    transformers' Trainer decides this from ``LOSS_MAPPING[model.loss_type]`` (trainer.py, ``_loss_shifts_labels``);
    here the lookup follows ``PreTrainedModel.loss_function`` (modeling_utils.py) exactly, which falls back to
    ``ForCausalLMLoss`` when ``loss_type`` is unknown (GPT2LMHeadModel's is None). Encoder-decoder models align
    labels with the decoder's shifted inputs, so their labels count unshifted. Versions before the loss registry
    (< 4.46) shifted inside the *ForCausalLM / *LMHeadModel classes."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        name = type(model).__name__
        return "CausalLM" in name or "LMHead" in name
    custom = model.__dict__.get("_loss_function")
    if custom is not None:
        return custom is ForCausalLMLoss
    return LOSS_MAPPING.get(getattr(model, "loss_type", None), ForCausalLMLoss) is ForCausalLMLoss


# Note [sum-reduced losses]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Weighting micro-batch losses by n_i / N assumes each is a mean. A loss summed over rows (``reduction="sum"``)
# weighted so gives exactly 1/accumulation of the full-batch gradient, in silence. With ``loss_reduction="sum"``
# (``plan.wrap``, or what ``plan`` found) each micro-batch's sum weighs 1 (times the ranks DDP averages over), and
# ``step`` returns the batch's sum. ``plan`` finds out where it is cheap and certain, wherever the loss comes from:
# a user's loss without ``count_items``, or without one the model's own loss (``{"loss": BCE(reduction="sum")}``,
# the pytorch/examples VAE recipe; ``output.loss``), on a model with real weights, on two rows of the sample, in eval
# mode (no dropout draw, BatchNorm on its running statistics: each row's loss depends on that row only) and without
# gradients, on a copy of the model with every random draw a constant (Note [the loss probe],
# capture/loss_probe.py). A mean gives loss(both rows) = (loss(row 0) + loss(row 1)) / 2, a sum loss(row 0) +
# loss(row 1); only a loss that matches the sum and not the mean is taken as a sum, and the plan's notes say so.
# Anything else (a loss that couples rows, a model or sample on the meta device, a forward that fails here or writes
# into the weights) stays a mean.


def reduction_of(loss_of: Callable[[int, int], float]) -> str:
    """"sum" when the loss of rows 0:2 is the sum of those of rows 0:1 and 1:2 and not their mean, else "mean"
    (Note [sum-reduced losses]). ``loss_of(start, stop)`` is the loss of those rows."""
    whole, first, second = loss_of(0, 2), loss_of(0, 1), loss_of(1, 2)
    total = first + second
    scale = max(abs(whole), abs(total))
    if not scale > 0 or scale != scale:  # zero or nan: nothing to tell
        return "mean"
    as_sum = abs(whole - total) <= 1e-4 * scale
    as_mean = abs(whole - total / 2) <= 1e-4 * scale
    return "sum" if as_sum and not as_mean else "mean"
