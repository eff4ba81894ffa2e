"""The training wrapper a plan emits: it runs exactly the step the estimate simulated.

``trainer.step(inputs, target)`` splits the batch into micro-batches of ``plan.micro_batch_size_for`` its length
(``plan.micro_batch_size`` at the sample's length, more rows for a shorter batch, see Note [rows by length] in
autofit/solve/lengths.py; the last one may be shorter); a batch longer than the sample given to ``plan()`` is refused
before anything runs (Note [the length of a batch], autofit/training/length.py). It moves each to the device of the model's
parameters, runs it through
:func:`autofit.training.step.run_micro_batch` with the weight n_i / N, so the accumulated gradient equals the gradient of the
mean loss over the whole batch (n_i counts rows, or the items a token-mean loss averages over: See Note [loss
normalisation] in autofit/training/normalisation.py), and drops its loss before the next; then it steps the optimizer (through
the GradScaler for fp16: steps with inf/NaN gradients are skipped and the scale backs off) and zeroes the gradients;
with ``plan.clip_grad_norm`` it first clips the (unscaled) gradients to that norm. Gradients found on the parameters
before the first micro-batch, and those of a window whose micro-batch raised, are cleared, and the caller's autocast
does not reach the step (Note [the trainer owns its window]). Autocast runs for the device type of the model's
parameters. Checkpointed and fp32-pinned modules are patched on the model while the trainer is active; ``unwrap()``
restores it. ``wrap`` first checks that the optimizer steps exactly the model's trainable parameters and that no
live trainer has patched the model (Note [one trainer per model], autofit/emit/wrapping.py).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autofit.core._torch import BatchNormBase, SpectralNormParametrization
from autofit.training.batch import Batch, as_batches, as_shared, micro_batch_bounds
from autofit.core.errors import InvalidInputError, TrainerStateError
from autofit.features import FEATURES, before_wrap, convert_model
from autofit.emit.wrapping import check_optimizer, claim, refuse_wrapped, release
from autofit.training.length import batch_length
from autofit.parallel.schedule import Window, schedule_of
from autofit.parallel.processes import computes_on, require_split_batch
from autofit.training.loss import LossFn, compute_loss
from autofit.training.normalisation import (
    LOSS_REDUCTIONS, LossNormalisation, count_items, item_counter, refusing_ignored_targets,
)
from autofit.training.optim import OptimizerSpec
from autofit.training.step import (
    WindowPlace,
    new_grad_scaler,
    optimizer_step,
    patched_model,
    run_micro_batch,
)
from autofit.training.stored import apply_stored

if TYPE_CHECKING:
    from autofit.emit.plan import Plan

__all__ = ["Trainer"]

_BATCH_NORMS = (BatchNormBase, nn.SyncBatchNorm)


# Note [the trainer owns its window]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# One step's gradient is the sum of its micro-batches' weighted gradients, and nothing else. Gradients already on
# the parameters when a step starts were made by someone else: a GAN's generator loss runs through the
# discriminator, so with one trainer per network the generator's step leaves gradients in the discriminator; a
# sanity-check ``loss.backward()`` before training leaves some everywhere. The standard loop clears them with
# ``optimizer.zero_grad()`` before each step (pytorch/examples dcgan: ``netD.zero_grad()``, ``netG.zero_grad()``),
# so the trainer does too, before its first micro-batch, rather than refusing them: refusing would make the standard
# GAN loop an error, and what it would protect (a gradient meant to be added to the step's) is not a step of the
# plan. It also keeps the plan's memory: the plan counts no gradient before the first backward (freed) or exactly
# the preallocated ones (zeroed in place). In an order that keeps the last step's gradients into the next forward
# (Lightning's, Note [where zero_grad falls]) the gradients this trainer's last step left, untouched since (the same
# tensors at the same version), are its own and stay until the order clears them. A micro-batch that raises (an
# out-of-memory error the caller catches) leaves the earlier micro-batches' gradients behind; they are cleared before
# the exception leaves ``step``, so the memory is free for what the caller does next and the next step is a plain step.
# Backward and the optimizer step run outside any autocast the caller is in (``torch.autocast(device, enabled=False)``
# around the window where the caller's is on; the forward enters the plan's own): the engine runs backward ops under
# the calling thread's autocast state, so an outer bf16 region would round an fp32 plan's gradients. Leaving the
# context restores the caller's state.


def _outside_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for ``device_type`` where the caller turned it on; nothing otherwise. Only then: any autocast
    region, even a disabled one, counts in autocast's nesting, and the cache of low-precision weight copies is
    cleared only when the outermost region exits (``torch.autocast.__exit__``), so a region around every step would
    keep the plan's casts alive from one micro-batch's forward to the end of the window (a bf16 hf_dict plan measured
    17,216 B over its 371,600 B)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class Trainer:
    """Executes a single-process :class:`~autofit.Plan` on the user's model and optimizer (an instance built over
    ``model.parameters()``); :meth:`Plan.wrap <autofit.Plan.wrap>` builds it. Also a context manager that unwraps on
    exit. With BatchNorm layers and more than one micro-batch it warns: batch statistics are then per micro-batch."""

    def __init__(self, plan: Plan, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 loss_fn: LossFn | None = None, loss_reduction: str | None = None, shared: Any = None) -> None:
        loss_reduction = plan.loss_reduction if loss_reduction is None else loss_reduction
        if loss_reduction not in LOSS_REDUCTIONS:
            raise InvalidInputError(f"loss_reduction must be 'mean' or 'sum' (over rows), got {loss_reduction!r}")
        if not isinstance(model, nn.Module):
            raise InvalidInputError(f"wrap() needs the model (an nn.Module), got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidInputError(
                f"wrap() needs the optimizer instance built over model.parameters(), got {type(optimizer).__name__}"
            )
        inner = getattr(self, "_inner", model)  # the user's model (the distributed trainer's lies inside DDP/FSDP2)
        refuse_wrapped(inner)  # Note [one trainer per model]
        check_optimizer(inner, optimizer)
        before_wrap(plan)  # what the step features need in place first (the allocator's setting)
        convert_model(plan.step, inner)  # the step features' conversions (Float8), before the layout where it has one
        for feature in FEATURES:  # the optimizer a step feature builds in place of the user's (Note [step features])
            optimizer = feature.trainer_optimizer(plan, optimizer)
        self.plan = plan
        self.model = model
        self.optimizer = optimizer  # the 8-bit one where the plan swapped it: step, save and load this one
        self.loss_fn = loss_fn
        self.loss_reduction = loss_reduction
        self.shared = frozenset(plan.shared) if shared is None else as_shared(shared)  # Note [the batch dimension]
        # where the step computes: the parameters' device, but a plan whose parameters live in host memory (FSDP2
        # CPUOffloadPolicy, Note [offload]) computes on the plan's device
        self.device_type = computes_on(plan.parallel, plan.device, _device_type(model))
        # the step the plan's estimate verified (Note [the plan's step], emit/plan.py), with the two things only the
        # real run knows: the device the step computes on (a plan made for a GPU trains where the parameters are;
        # autocast follows it) and the optimizer given to wrap(), which the planner's factory stood for
        self.config = replace(plan.step, device=self.device_type,
                              optimizer=OptimizerSpec(plan.optimizer, lambda params: optimizer))
        self.scaler = new_grad_scaler(self.config, self.device_type)
        if plan.gradient_accumulation_steps > 1:
            _warn_per_forward_state(model, plan)
        # stored precision: parameters converted in place, the optimizer on fp32 master copies (Note [stored
        # precision]); unwrap() undoes both
        self._stored = apply_stored(inner, optimizer, plan.precision.stored, plan.precision.fp32_modules)
        self._patch = contextlib.ExitStack()
        self._active = True
        try:
            self._patch.enter_context(patched_model(inner, self.config, self.device_type))
            for feature in FEATURES:  # what each step feature does to the real model (Note [step features])
                self._patch.enter_context(feature.real_context(self.config, inner))
            for feature in FEATURES:  # what each step feature holds around the steps
                self._patch.enter_context(feature.step_context(self.config, inner, optimizer))
        except BaseException:
            self.unwrap()  # a wrap that fails halfway leaves the model as it found it
            raise
        claim(inner, self)
        self.micro_batches = 0  # how many micro-batches the last step ran (fewer for shorter batches)
        self._left: tuple | None = None  # the gradients the last step left (_grads_now), None before the first

    def step(self, inputs: Any, target: Any = None) -> float:
        """One optimizer step over one batch; returns the batch's mean loss (over rows, or over the items a
        token-mean loss averages over)."""
        if not self._active:
            raise TrainerStateError("this trainer was unwrapped, so the model no longer runs the plan's step: "
                                    "call plan.wrap(model, optimizer) again for a new trainer")
        batch, target_batch = as_batches(inputs, target, shared=self.shared, what="inputs",
                                         batch_dim=self.plan.batch_dim)  # Note [the batch dimension]
        batch, target_batch = self._shard(batch, target_batch)
        require_split_batch(self.plan.parallel, batch.tensors(), "this batch")
        device = self._input_device()
        bounds = self._bounds(batch.size, self._rows_for(batch, target_batch))
        if self.plan.optimizer_in_backward and len(bounds) > 1:  # each backward would step the optimizer again
            raise InvalidInputError(
                f"this plan steps the optimizer in backward, so a step takes one micro-batch of at most "
                f"{self.plan.micro_batch_size} rows; this batch has {batch.size}: give batches of at most that size"
            )
        self.micro_batches = len(bounds)
        norm = self._normalisation(batch, target_batch, bounds)
        loss_fn = refusing_ignored_targets(self.loss_fn, norm, len(bounds))  # Note [losses that ignore an index]
        # the plan's precision, whatever autocast the caller is in (Note [the trainer owns its window]): the forward
        # enters the plan's own autocast inside this, and backward and the optimizer step run without one
        with _outside_autocast(self.device_type):
            self._clear_grads_not_left()  # Note [the trainer owns its window]: gradients it did not make are not trained on
            def rows(i: int) -> tuple[Batch, Batch | None]:
                start, stop = bounds[i]
                micro = batch.slice(start, stop).map_tensors(lambda t: t.to(device))
                if target_batch is None:
                    return micro, None
                return micro, target_batch.slice(start, stop).map_tensors(lambda t: t.to(device))

            def one(i: int, micro: Batch, micro_target: Batch | None, place: WindowPlace) -> float:
                loss = run_micro_batch(self.model, micro, micro_target, loss_fn, self.config, self.device_type,
                                       place=place, scaler=self.scaler, features=FEATURES)
                # a float: a loss can hold a buffer as large as the output (CPU mse_loss), not into the next
                return float(loss)

            # Note [where zero_grad falls]: the window's first micro-batch clears the optimizer's gradients
            window = Window(len(bounds), rows=rows, place=lambda i: WindowPlace.of(i, norm, self.optimizer),
                            loss=functools.partial(compute_loss, loss_fn), body=one)
            try:  # the schedule owns the loop and the gradient sync between micro-batches (Note [one schedule])
                run = schedule_of(self.config.layout, len(bounds)).run(self.model, self.config.layout, window)
                losses = [float(loss) for loss in run]  # a schedule of its own may give detached tensors
            except BaseException:
                self._clear_grads()  # a failed window leaves no partial gradient behind
                self._left = None
                raise
            optimizer_step(self.optimizer, self.scaler, clip_grad_norm=self.config.clip_grad_norm,
                           stored=self._stored, in_backward=self.plan.optimizer_in_backward,
                           keep_grads=self.plan.preallocated_grads, zero_grad=self.config.zero_grad == "after-step")
        self._left = self._grads_now()
        return norm.local_mean(losses)

    def _grads_now(self) -> tuple:
        """Which gradient each parameter holds now, and at which version: what a later step compares with."""
        return tuple(None if p.grad is None else (id(p.grad), p.grad._version) for p in self.model.parameters())

    def _clear_grads_not_left(self) -> None:
        """Clear the gradients before the window's first micro-batch unless they are exactly the ones this trainer's
        last step left, untouched since: an order that keeps them into the next forward (Lightning's, Note [where
        zero_grad falls]) clears them where it says; anything else (another network's backward, a backward of the
        caller's) is not this window's, and is cleared now (Note [the trainer owns its window])."""
        if self.config.zero_grad == "after-step" or self._left != self._grads_now():
            self._clear_grads()

    def _clear_grads(self) -> None:
        """Drop every gradient of the model's parameters and the optimizer's (the fp32 master copies), as the step
        leaves them: freed, or zeroed in place where the plan allocates them before forward."""
        set_to_none = not self.plan.preallocated_grads
        self.model.zero_grad(set_to_none=set_to_none)
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _input_device(self) -> torch.device:
        """Where the micro-batches go: the parameters' device."""
        return _parameter_device(self.model)

    def _normalisation(self, batch: Batch, target: Batch | None, bounds: list[tuple[int, int]]) -> LossNormalisation:
        """Each micro-batch's weight, from the whole batch before the first runs (See Note [loss normalisation])."""
        counter = item_counter(getattr(self, "_inner", self.model), self.loss_fn, batch, target)
        counts = count_items(counter, batch, target, bounds)
        total, ranks = self._across_ranks(sum(counts))
        if self.loss_reduction == "sum":  # Note [sum-reduced losses]: sums add up, whatever the rows hold
            return LossNormalisation("rows", counts, total, ranks, summed=True)
        return LossNormalisation("rows" if counter is None else "items", counts, total, ranks)

    def _rows_for(self, batch: Batch, target: Batch | None) -> int:
        """Rows per micro-batch at this batch's length; a longer batch is refused here, before anything runs."""
        if self.plan.lengths is None:  # a plan written before variable-length batches: its one size
            return self.plan.micro_batch_size
        length = batch_length(self.plan.lengths, batch, target)
        return self.plan.micro_batch_size if length is None else self.plan.micro_batch_size_for(length)

    # ---- hooks the distributed trainer overrides ---------------------------------------------------------------
    def _bounds(self, batch_rows: int, rows: int) -> list[tuple[int, int]]:
        """The micro-batches' row ranges (:func:`~autofit.training.batch.micro_batch_bounds`, which the planner
        reads to know which micro-batches the sample makes, Note [rows that differ])."""
        return micro_batch_bounds(batch_rows, rows, getattr(self.plan, "min_rows", 1))

    def _shard(self, batch, target):
        """The rows this process trains on (all of them without data parallelism)."""
        return batch, target

    def _across_ranks(self, count: int | float) -> tuple[int | float, int]:
        """The count over every rank, and the number of ranks gradients are averaged over (one process: itself)."""
        return count, 1

    def unwrap(self) -> nn.Module:
        """Undo the plan's patches (checkpointing, fp32 pins) and its stored precision: parameters back in their
        dtype (from the fp32 master copy when the plan keeps one; after pure bf16 their values stay rounded to bf16),
        the optimizer back on the parameters with its state in their dtype; gradients ``wrap`` allocated are dropped
        (None, as ``zero_grad(set_to_none=True)`` leaves them). The model is as before ``wrap``, trained."""
        if self._active:
            self._active = False
            self._patch.__exit__(None, None, None)
            if self._stored is not None:
                self._stored.restore()
            release(getattr(self, "_inner", self.model), self)
        return self.model

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.unwrap()


def _warn_per_forward_state(model: nn.Module, plan: Plan) -> None:
    """Warn about layers whose forward in training depends on, or moves, state per forward: under accumulation they
    see micro-batches where one large step sees the batch, so training differs from the full-batch step."""
    window = f"the plan accumulates {plan.gradient_accumulation_steps} micro-batches of {plan.micro_batch_size}"
    if any(isinstance(m, _BATCH_NORMS) for m in model.modules()):
        warnings.warn(
            f"the model has BatchNorm layers and {window}: batch statistics are computed per micro-batch, not over "
            "the whole batch, so training differs from one large batch (consider GroupNorm/LayerNorm or "
            "SyncBatchNorm semantics, or a budget that fits the batch at once)", stacklevel=3,
        )
    spectral = [name for name, m in model.named_modules() if _has_spectral_norm(m)]
    if spectral:
        # torch/nn/utils/parametrizations.py, _SpectralNorm.forward (and the older hook, spectral_norm.py,
        # SpectralNorm.compute_weight): one power iteration on u and v per forward in training
        warnings.warn(
            f"the model has spectral norm on {_listed(spectral)} and {window}: spectral norm runs one power "
            "iteration per forward in training, so the weight is normalised by a different estimate of its norm "
            "in each micro-batch and training differs from one large batch (a budget that fits the batch at once "
            "keeps it exact)", stacklevel=3,
        )


def _has_spectral_norm(module: nn.Module) -> bool:
    if isinstance(module, SpectralNormParametrization):
        return False  # named by the module it parametrizes
    parametrizations = getattr(module, "parametrizations", None)
    if isinstance(parametrizations, nn.ModuleDict) and any(
            isinstance(p, SpectralNormParametrization) for p in parametrizations.modules()):
        return True
    # the older torch.nn.utils.spectral_norm (a forward pre-hook) registers <name>_orig, <name>_u and <name>_v
    buffers = dict(module.named_buffers(recurse=False))
    params = dict(module.named_parameters(recurse=False))
    return any(n.endswith("_u") and f"{n[:-2]}_v" in buffers and f"{n[:-2]}_orig" in params for n in buffers)


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _parameter_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _device_type(model: nn.Module) -> str:
    return _parameter_device(model).type
