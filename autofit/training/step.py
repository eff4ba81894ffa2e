"""One training step, the same code for ``estimate``, ``measure`` and the emitted trainer.

For one micro-batch: forward and loss (under autocast when the precision asks for it), backward of the loss weighted
by the micro-batch's share of the effective batch; after the last micro-batch of the window, optional gradient
clipping (``clip_grad_norm_``, after the GradScaler unscaled the gradients for fp16), ``optimizer.step()`` (through
the GradScaler for fp16) then ``zero_grad(set_to_none=True)`` (``set_to_none=False`` with gradients allocated
before forward: Note [gradients allocated before forward], training/grads.py), or ``zero_grad`` where the step's
order puts it (Note [where zero_grad falls]). See "What the step is" in docs/memory-model.md.

Note [where zero_grad falls]
    Training loops differ in where they clear the gradients, and with ``set_to_none=True`` that decides whether one
    step's gradients are still allocated while the next one runs (``StepConfig.zero_grad``):
    - "after-step" (the default): ``optimizer.step()`` then ``zero_grad``, as autofit's trainer and Hugging Face's
      Trainer (transformers/trainer.py: ``model.zero_grad()`` after ``optimizer.step()``) run it. The next forward
      starts without gradients;
    - "before-forward": ``zero_grad`` first, then forward, backward and step, as the PyTorch tutorials' loop. The
      gradients live from one backward to the next step's start, where they are freed before anything else is
      allocated: the same peak as "after-step", one gradient set more between steps;
    - "after-forward": forward and loss, then ``zero_grad``, then backward and step: Lightning's automatic
      optimization (src/lightning/pytorch/loops/optimization/automatic.py: the closure runs the training step, then
      the zero-grad function, then the backward function) and Fabric scripts written in that order. The previous
      step's gradients are alive through the whole forward, so wherever forward holds the peak it is one gradient
      set higher.
    With accumulation the clearing runs once per window, at its first micro-batch, as Lightning's does
    (``_make_zero_grad_fn``: only where ``batch_idx % accumulate_grad_batches == 0``). The simulation keeps the zero
    gradients its warm-up step made (simulate/state.py) as the previous step's, and ``measure`` and the trainer run
    the same order, so all three see the same lifetimes. Gradients that are not kept between steps carry nothing:
    the optimizer stepping in backward frees them, and DDP's buckets hold them (``gradient_as_bucket_view``)
    whatever the order. On a GPU the previous step's gradients sit where its backward placed them, which the
    allocator replay runs a second step for (Note [the next step's allocator], autofit/cuda/allocator.py).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint

from autofit.core._torch import (
    PASSTHROUGH_ERRORS,
    NormBase,
    module_call_codes,
    tree_map,
)
from autofit.parallel.wrappers import held_names
from autofit.training.batch import Batch
from autofit.training.config import (  # noqa: F401 - the step's value, re-exported
    StepConfig, ZeroGrad, make_step_config, overridden_forwards, resolve_modules,
)
from autofit.core.cpu import translate_kernel_error
from autofit.core.errors import ForwardError
from autofit.training.loss import LossFn, StepLoss, compute_loss
from autofit.training.precision import PrecisionPolicy
from autofit.training.recompute import BufferWrites, context_of
from autofit.training.stored import StoredState

if TYPE_CHECKING:
    from autofit.training.normalisation import LossNormalisation

__all__ = ["StepConfig", "make_step_config", "patched_model", "WindowPlace", "run_micro_batch", "optimizer_step",
           "new_grad_scaler", "forward_errors"]


class LossFeature(Protocol):
    """What the step asks of each step feature it is given (``run_micro_batch(features=...)``): the loss it computes
    in ``config``'s step in place of the model's output and the loss function, or None. The step receives the
    features (``autofit.features.FEATURES``) from whoever runs it, the simulation, ``measure`` and the trainer, so
    that the step's folder does not import the features' (they are built on it)."""

    def step_loss(self, config: StepConfig) -> StepLoss | None: ...


def _copy_containers(tree: Any) -> Any:
    """The same leaves (tensors included: no tensor memory) in new lists, tuples and dicts."""
    return tree_map(lambda leaf: leaf, tree)


def _checkpointed_forward(module: torch.nn.Module, forward, policy: str, *args, **kwargs):
    """See Note [checkpoint arguments] and Note [recomputed BatchNorm]; ``policy``: "full", or which op outputs to
    keep (Note [selective recomputation], autofit/training/recompute.py)."""
    # Always non-reentrant (docs/memory-model.md): it supports keyword arguments, nesting and inputs that need no grad.
    args, kwargs = _copy_containers((args, kwargs))
    args, kwargs = _without_kv_cache(forward, args, kwargs)
    runs = itertools.count()
    writes = BufferWrites(module)  # Note [buffers under recomputation], training/recompute.py

    def run(args: tuple, kwargs: dict):
        recompute = next(runs) > 0
        with writes.run(recompute), _running_stats_frozen(module) if recompute else contextlib.nullcontext():
            return forward(*_copy_containers(args), **_copy_containers(kwargs))

    # The arguments travel as two positional values: torch.utils.checkpoint stashes the RNG state of the devices of
    # its positional tensors only (_checkpoint_without_reentrant_generator: get_device_states(*args)), so tensors
    # given by keyword would leave a CUDA dropout mask unrestored in the recomputation; and it takes keywords named
    # debug, context_fn, determinism_check or preserve_rng_state as its own.
    context_fn = context_of(policy)
    if context_fn is not None:
        return _checkpoint(run, args, kwargs, use_reentrant=False, context_fn=context_fn)
    return _checkpoint(run, args, kwargs, use_reentrant=False)


# "cache" is transformers >= 5.24's name for what 5.23 called "past_key_values" (GPT2Block.forward).
_KV_CACHE_KEYWORDS = ("past_key_values", "layer_past", "cache")


def _without_kv_cache(forward, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """See Note [checkpoint arguments]: a recomputed layer is not given the KV cache, which it would update twice.
    The cache may come by keyword (GPT-2's attention) or by position (GPT2Model calls each block with it second)."""
    try:
        names = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):  # a builtin or C forward: no named cache to drop
        names = []
    args = tuple(None if i < len(names) and names[i] in _KV_CACHE_KEYWORDS else a for i, a in enumerate(args))
    kwargs = {k: None if k in _KV_CACHE_KEYWORDS else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


@contextlib.contextmanager
def _running_stats_frozen(module: torch.nn.Module) -> Iterator[None]:
    """See Note [recomputed BatchNorm]."""
    norms = [(m, m.momentum, m.num_batches_tracked) for m in module.modules()
             if isinstance(m, NormBase) and m.training and m.track_running_stats]
    for m, _, _ in norms:
        m.momentum, m.num_batches_tracked = 0.0, None
    try:
        yield
    finally:
        for m, momentum, tracked in norms:
            m.momentum, m.num_batches_tracked = momentum, tracked


# Note [checkpoint arguments]
#     Non-reentrant checkpoint keeps references to the arguments a module was called with and calls the module on
#     them again in backward (torch/utils/checkpoint.py, _checkpoint_without_reentrant_generator: ``recompute_fn``
#     closes over ``args`` and ``kwargs``). A list is a reference: a caller that appends to it after the call
#     (torchvision's _DenseBlock appends each layer's output to the ``features`` list every layer receives) makes the
#     recomputation see a longer list than the first forward saw, which fails on a shape, or with a shape that
#     happens to fit, trains on the wrong input. So the containers (lists, tuples, dicts, any pytree node) are
#     copied when the module is called, and each run (forward, then recomputation) gets its own copy of that
#     snapshot, in case the module itself mutates its arguments. Only containers are copied: the leaves, tensors
#     among them, are the same objects, so no tensor memory is added, and the simulation, which runs this same
#     wrapper, sees exactly what the real step allocates. Leaves that are not containers (an object with state)
#     are not copied. One such object is a Hugging Face KV cache (``DynamicCache``, which GPT-2 and others create in
#     training when ``config.use_cache`` is True): each layer appends its keys and values to it, so the recomputation
#     would append them again and attend over twice the length. Training never reads the cache, and transformers'
#     own checkpointed layers drop it (transformers/modeling_layers.py, ``GradientCheckpointingLayer.__call__``:
#     ``use_cache=False``, ``past_key_values=None``, ``layer_past=None`` under gradient checkpointing; from
#     transformers 5.24 the argument is named ``cache``); a checkpointed module here is called the same way.

# Note [recomputed BatchNorm]
#     A BatchNorm in training mode updates its running statistics in place on every forward
#     (torch/nn/modules/batchnorm.py, _BatchNorm.forward: num_batches_tracked += 1, and F.batch_norm blends the batch
#     statistics into running_mean / running_var with the momentum). The recomputation is a second forward, so under
#     checkpointing the statistics would move twice per micro-batch. So would an InstanceNorm's that tracks running
#     statistics (F.instance_norm blends them in through batch_norm). While it recomputes, the norms inside the
#     checkpointed module run with momentum 0 and no num_batches_tracked: the update becomes
#     ``running = 0 * batch + 1 * running``, exact in floating point (aten/src/ATen/native/Normalization.cpp,
#     batch_norm_cpu_update_stats_template), and no counter moves. The running buffers are still passed to the
#     kernel, so the recomputation saves the same tensors as the first forward (torch.utils.checkpoint checks that),
#     and its output, normalised with the batch's own statistics in training mode, is the same.


def _fp32_forward(forward, device_type: str, *args, **kwargs):
    def to_fp32(x):
        return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    args, kwargs = tree_map(to_fp32, (args, kwargs))
    with torch.autocast(device_type, enabled=False):
        return forward(*args, **kwargs)


# Note [offload]
#     Three ways to hold less on the GPU than a step needs, each PyTorch's own engine (docs/offload.md):
#     - activations: ``torch.autograd.graph.save_on_cpu`` around a module's forward packs every tensor autograd
#       saves inside it into host memory (pinned on a GPU) as it is saved, and copies it back when backward
#       unpacks it (torch/autograd/graph.py). The device holds no saved tensor of the module between its forward
#       and its backward, at the price of two PCIe copies of those bytes; the pack's device-to-host copy is a plain
#       ``copy_`` on the compute stream (synchronous), so the time model does not overlap it;
#     - parameters, gradients and optimizer state: FSDP2's ``CPUOffloadPolicy``, at world size 1 too. The sharded
#       fp32 parameters live in pinned host memory, each unit's are copied to the GPU and gathered in the compute
#       dtype for its forward and again for its backward, reduced gradients are copied back to the host and the
#       optimizer steps there, on the CPU. Under accumulation every micro-batch reduces (no
#       ``set_requires_gradient_sync(False)``): FSDP2 then adds each micro-batch's shards into the host gradients
#       (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, ``foreach_reduce``), where skipping the sync would
#       keep a whole model's unsharded gradients on the device until the last micro-batch;
#     - the optimizer step in backward (Note [optimizer step in backward]), which keeps no gradient alive.
#     A module keeps, recomputes or offloads its activations, never two of them at once.


# Note [gradient sync under accumulation]
#     FSDP2 with ``set_requires_gradient_sync(False)`` on every micro-batch but the last (what DDP's ``no_sync`` is
#     to DDP) skips the reduce-scatters until the window's last backward, but it keeps every unit's unsharded
#     gradient alive until then, accumulated in the reduce dtype (``FSDPParam.to_accumulated_grad_if_needed`` and
#     ``unsharded_accumulated_grad`` in torch/distributed/fsdp/_fully_shard/_fsdp_param.py): a whole model's
#     gradients in fp32 on every rank, which undoes most of what sharding saves. Reducing after every micro-batch
#     (``reduce_every_micro_batch``) keeps only the sharded gradients between micro-batches, at the price of one
#     reduce-scatter per micro-batch instead of one per window. The planner tries the first, and the second as the
#     next rung of its ladder (solve/ladder.py) when nothing fits; the trainer applies the plan's choice
#     (emit/distributed.py). torchtitan reduces every micro-batch (it never disables gradient sync).


@contextlib.contextmanager
def patched_model(model: torch.nn.Module, config: StepConfig, device_type: str) -> Iterator[torch.nn.Module]:
    """Apply the step's module-level knobs (checkpointed and fp32-pinned modules) and undo them on exit; the
    offloaded modules are a step feature's (autofit/features/activation_offload.py).

    The knobs are instance-level ``forward`` overrides, so the class, the parameters and the user's hooks stay as
    they are, and leaving the context restores the module exactly (``forward`` removed from the instance dict).
    """
    # a pipeline rank holds only its stage's modules (parallel/pipeline.py): the knobs of the others are theirs
    pinned = resolve_modules(model, held_names(model, config.precision.fp32_modules), what="precision.fp32_modules")
    checkpoint = held_names(model, config.checkpoint)
    ckpt = resolve_modules(model, checkpoint, what="checkpoint")
    names = {id(m): n for m, n in zip(ckpt, checkpoint)}
    overrides = [(m, lambda forward: functools.partial(_fp32_forward, forward, device_type)) for m in pinned]
    overrides += [(m, lambda forward, m=m: functools.partial(_checkpointed_forward, m, forward,
                                                             config.policy(names[id(m)]))) for m in ckpt]
    with overridden_forwards(overrides):
        yield model


def new_grad_scaler(config: StepConfig, device_type: str) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler(device_type) if config.precision.needs_grad_scaler else None


@dataclass(frozen=True)
class WindowPlace:
    """What a micro-batch does as the micro-batch of its accumulation window it is: ``weight``, its share of the
    effective batch (its rows, or the items a token-mean loss averages over, out of the batch's:
    :class:`autofit.training.normalisation.LossNormalisation`), so that summing the weighted mean losses of the
    micro-batches gives the mean loss of the whole batch (and its gradient); ``clear``, the optimizer whose gradients
    it clears where ``config.zero_grad`` puts it (the window's first micro-batch; Note [where zero_grad falls]),
    None where it clears none. The default: a window of one micro-batch that clears nothing."""

    weight: float = 1.0
    clear: torch.optim.Optimizer | None = None

    @classmethod
    def of(cls, index: int, norm: LossNormalisation, optimizer: torch.optim.Optimizer) -> WindowPlace:
        """The ``index``-th micro-batch of a window whose shares are ``norm``'s: the first clears ``optimizer``'s
        gradients."""
        return cls(norm.weight(index), optimizer if index == 0 else None)


def run_micro_batch(
    model: torch.nn.Module, batch: Batch, target: Batch | None, loss_fn: LossFn | None, config: StepConfig,
    device_type: str, *, place: WindowPlace = WindowPlace(), scaler: torch.amp.GradScaler | None = None,
    on_phase: Callable[[str], None] | None = None, features: Sequence[LossFeature],
) -> torch.Tensor:
    """Forward, loss and backward of one micro-batch; gradients accumulate into ``.grad``. Returns the loss, detached.

    ``place``: what the micro-batch does as the one of its window it is (its loss's weight, the gradients it clears).
    ``on_phase`` is told "forward" and "backward" as they start (the simulator files allocations by phase).
    ``features``: the step features in force (``autofit.features.FEATURES``), asked for the loss they compute.
    """
    policy, clear = config.precision, place.clear
    if clear is not None and config.zero_grad is ZeroGrad.BEFORE_FORWARD:
        clear.zero_grad(set_to_none=not config.preallocated_grads)
    if on_phase is not None:
        on_phase("forward")
    with torch.autocast(device_type, dtype=policy.dtype, enabled=policy.autocast):
        # a step feature may compute the loss in place of the model's output and loss_fn (Note [step features])
        feature_loss = next((run for f in features if (run := f.step_loss(config)) is not None), None)
        if feature_loss is not None:
            loss = feature_loss(model, batch, None if target is None else target.value, policy)
            loss = compute_loss(lambda value: value, loss, None)  # the checks every loss passes
        else:
            output = batch.call(model)
            loss = compute_loss(loss_fn, output, None if target is None else target.value)
            del output  # the logits need not outlive the loss (whatever backward needs, autograd saved)
    if clear is not None and config.zero_grad is ZeroGrad.AFTER_FORWARD:
        clear.zero_grad(set_to_none=not config.preallocated_grads)
    scaled = loss if place.weight == 1.0 else loss * place.weight
    if scaler is not None:
        scaled = scaler.scale(scaled)
    if on_phase is not None:
        on_phase("backward")
    scaled.backward()
    return loss.detach()


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None, *,
                   clip_grad_norm: float | None = None, stored: StoredState | None = None,
                   in_backward: bool = False, keep_grads: bool = False, zero_grad: bool = True) -> None:
    """Clip (optionally), step, zero the gradients. Clipping follows the AMP recipe (PyTorch "Automatic Mixed
    Precision examples", "Gradient clipping"): ``scaler.unscale_`` first, so the norm is that of the true gradients;
    ``scaler.step`` then does not unscale again. ``clip_grad_norm_`` picks its own implementation (foreach where
    ``torch/utils/_foreach_utils.py::_has_foreach_support`` allows, as on CUDA). With an fp32 master copy
    (``stored``, Note [stored precision]) the gradients move to the master copy first, so unscaling, clipping and the
    step all see fp32, and the stepped master copy is copied back into the parameters last. ``in_backward``: backward
    has stepped every parameter already (Note [optimizer step in backward]); only the zeroing is left. ``keep_grads``:
    the gradients are zeroed in place, not freed (Note [gradients allocated before forward], training/grads.py).
    ``zero_grad``: False where the step's order clears the gradients at the next window's start instead (Note
    [where zero_grad falls]: ``config.zero_grad is ZeroGrad.AFTER_STEP``)."""
    if in_backward:
        optimizer.zero_grad(set_to_none=True)
        return
    if stored is not None:
        stored.before_step()
    if clip_grad_norm is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if zero_grad:
        optimizer.zero_grad(set_to_none=not keep_grads)
    if stored is not None:
        stored.after_step()


# Frames of ``Module.__call__``: while an exception unwinds, its traceback still holds one per module call it left.
_CALL_CODES = module_call_codes()


@contextlib.contextmanager
def forward_errors(precision: PrecisionPolicy | None = None) -> Iterator[None]:
    """Turn an exception raised by the user's forward or loss while autofit runs them on its own copy of the model
    into a :class:`ForwardError` naming the innermost module that was running. ``precision``: the precision of a step
    that runs for real on this CPU, whose oneDNN may have no kernel for it (an :class:`UnsupportedPrecisionError`
    then, Note [CPU kernels] in autofit/core/cpu.py).

    The module is read off the traceback (the ``Module.__call__`` frames it unwound through), so nothing is installed
    on the model. The trainer, which runs the user's own model, does not use this: its exceptions stay the user's.
    Exceptions raised outside any forward or loss, and :data:`PASSTHROUGH_ERRORS`, propagate unchanged.
    """
    try:
        yield
    except PASSTHROUGH_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001 - only failures located in a forward or the loss are rewrapped below
        in_loss, root, innermost = False, None, None
        tb = e.__traceback__
        while tb is not None:  # outermost frame first
            code = tb.tb_frame.f_code
            if code is compute_loss.__code__:
                in_loss = True  # modules called from here on belong to the loss, not the model
            elif code in _CALL_CODES and not in_loss:
                module = tb.tb_frame.f_locals.get("self")
                if isinstance(module, torch.nn.Module):
                    root = module if root is None else root
                    innermost = module
            tb = tb.tb_next
        if in_loss:
            raise ForwardError(
                f"the loss raised {type(e).__name__}: {e}; check loss_fn (or the default loss) against the model's "
                "output and the target"
            ) from e
        if root is None:
            raise
        name = next((n for n, m in root.named_modules() if m is innermost), "")
        no_kernel = translate_kernel_error(e, precision.name, name or None) if precision is not None else None
        if no_kernel is not None:
            raise no_kernel from e
        where = f"module {name!r}" if name else "the model's top-level forward"
        raise ForwardError(
            f"{where} raised {type(e).__name__}: {e}; check that the model runs on this sample outside autofit",
            module=name or None,
        ) from e
