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
    - torch's ``cross_entropy`` or ``nll_loss`` (function, module, or ``functools.partial``) given as ``loss_fn``
      with an integer target: the targets it does not ignore, or their class weights (Note [losses that ignore an
      index]);
    - anything else: rows.
    A micro-batch with no item (all padding) gets weight 0; its mean is 0/0 = nan, but with weight 0 no gradient
    reaches it and cross-entropy's backward skips ignored targets (aten ``nll_loss_backward``), so gradients stay
    finite. A batch with no item at all has no mean: that is an error.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autofit.training.batch import Batch
from autofit.core.errors import InvalidInputError, LossError
from autofit.training.loss import LossFn

__all__ = ["IGNORE_INDEX", "LOSS_REDUCTIONS", "ItemMeanLoss", "LossNormalisation", "count_items", "hf_token_mean",
           "item_counter", "reduction_of", "refusing_ignored_targets"]

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
    counts: tuple[int | float, ...]  # float: a class-weighted mean's sums of weights
    total: int | float
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
        if count is None and target is not None and isinstance(target.value, torch.Tensor) \
                and not target.value.is_floating_point():
            return _index_loss_counter(loss_fn)
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
            # a class-weighted mean divides by a sum of weights (Note [losses that ignore an index])
            n = float(n) if isinstance(n, (float, torch.Tensor)) and _is_floating(n) else int(n)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidInputError(f"count_items returned {n!r}; it must return an int or a one-element tensor") from e
        if n < 0:
            raise InvalidInputError(f"count_items returned {n}; a count of items must be >= 0")
        counts.append(n)
    return tuple(counts)


def _is_floating(n: float | torch.Tensor) -> bool:
    return isinstance(n, float) or n.is_floating_point()


def _cross_entropy_count(inputs: Any, target: torch.Tensor) -> torch.Tensor:
    return target.ne(IGNORE_INDEX).sum()


# Note [losses that ignore an index]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's losses over class indices, ``cross_entropy`` and ``nll_loss`` (and their modules ``nn.CrossEntropyLoss``,
# ``nn.NLLLoss``), skip targets equal to ``ignore_index`` and, with reduction "mean", divide by what they kept: the
# number of those targets, or with a class ``weight`` the sum of their weights (torch/nn/functional.py and aten
# LossNLL.cpp, ``nll_loss_forward_out_cpu_template``: ``total_weight``; label smoothing divides the same way,
# Loss.cpp ``cross_entropy_loss_label_smoothing``). Given as ``loss_fn`` itself (or through ``functools.partial``),
# such a loss is called on the target as the trainer was given it, so what it averages over is known before the
# first micro-batch: the counter below reads the loss's own ``ignore_index``, ``weight`` and ``reduction``. A
# function that calls one of them on something it derives from the target (a shift, a reshape, a mask) cannot be
# read that way: it says what it counts with ``count_items`` (:class:`ItemMeanLoss`). Weighted by rows instead, it
# would be off the full-batch step wherever micro-batches keep different shares of their targets, in silence; so
# while a step weights by rows over more than one micro-batch (or rank), the trainer watches the calls such a
# function makes to ``cross_entropy`` and ``nll_loss`` (a ``TorchFunctionMode`` around the loss alone, not the
# forward: a few calls per micro-batch) and refuses, before that micro-batch's backward, a mean over class indices
# whose target holds its ``ignore_index`` (:func:`refusing_ignored_targets`). Its error names the fix.
_INDEX_LOSSES = (torch.nn.functional.cross_entropy, torch.nn.functional.nll_loss)
_INDEX_LOSS_MODULES = (nn.CrossEntropyLoss, nn.NLLLoss)


def refusing_ignored_targets(loss_fn: LossFn | None, norm: LossNormalisation, micro_batches: int) -> LossFn | None:
    """``loss_fn``, or, where the step weights a user's function by rows over more than one micro-batch or rank, the
    same function refusing a mean of torch's index-ignoring losses over a target that holds its ignore index (Note
    [losses that ignore an index])."""
    if loss_fn is None or norm.unit != "rows" or norm.summed or (micro_batches == 1 and norm.ranks == 1):
        return loss_fn

    @functools.wraps(loss_fn)  # inspect.signature follows __wrapped__: the arity check sees the user's function
    def watched(*args: Any) -> torch.Tensor:
        with _IgnoredTargets() as seen:
            loss = loss_fn(*args)
        if seen.found is not None:
            name, ignore, count = seen.found
            raise LossError(
                f"loss_fn calls {name} with reduction='mean', which averages over the targets that are not "
                f"ignore_index={ignore}, and {count} target(s) of this micro-batch are {ignore}: the trainer cannot "
                "count what your function passes to it, so it would weight the micro-batches by rows and the step "
                "would differ from the full-batch step. Pass the loss itself (loss_fn=F.cross_entropy, "
                "nn.CrossEntropyLoss(...)), whose targets the trainer counts, or say what it averages over: "
                "loss_fn=autofit.ItemMeanLoss(loss_fn, count_items=lambda inputs, target: <how many targets it keeps>)"
                " (See Note [losses that ignore an index], autofit/training/normalisation.py)"
            )
        return loss

    return watched


class _IgnoredTargets(TorchFunctionMode):
    """Records the first mean of ``cross_entropy`` / ``nll_loss`` over class indices that skips some of them."""

    def __init__(self) -> None:
        super().__init__()
        self.found: tuple[str, int, int] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INDEX_LOSSES and self.found is None:
            try:
                bound = inspect.signature(func).bind(*args, **kwargs)
            except TypeError:
                return func(*args, **kwargs)  # not a call this reads: the loss raises its own error
            bound.apply_defaults()
            options = bound.arguments
            target = options["target"]
            legacy = options.get("size_average") is not None or options.get("reduce") is not None
            if (not legacy and options["reduction"] == "mean" and isinstance(target, torch.Tensor)
                    and not target.is_floating_point()):
                ignored = int(target.eq(options["ignore_index"]).sum())
                if ignored:
                    self.found = (f"F.{func.__name__}", options["ignore_index"], ignored)
        return func(*args, **kwargs)


def _index_loss_counter(loss_fn: LossFn) -> ItemCounter | None:
    """The counter of a torch loss over class indices given as ``loss_fn`` (Note [losses that ignore an index]), or
    None for any other loss."""
    fn, options = loss_fn, {}
    while isinstance(fn, functools.partial):
        if fn.args:  # a bound positional argument moves the target: not the call this counter reads
            return None
        options = {**fn.keywords, **options}
        fn = fn.func
    if type(fn) in _INDEX_LOSS_MODULES:  # exactly torch's: a subclass may call it on something else
        options = {"ignore_index": fn.ignore_index, "weight": fn.weight, "reduction": fn.reduction, **options}
    elif fn not in _INDEX_LOSSES:
        return None
    if options.get("reduction", "mean") != "mean":
        return None  # a sum or per-element loss: not a mean over items (a sum is Note [sum-reduced losses]')
    ignore, weight = options.get("ignore_index", IGNORE_INDEX), options.get("weight")

    def count(inputs: Any, target: torch.Tensor) -> torch.Tensor:
        kept = target.ne(ignore)
        if weight is None:
            return kept.sum()
        return weight.to(target.device)[target[kept]].sum()  # weighted: the mean divides by the kept weights

    return count


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
