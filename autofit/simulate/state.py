"""What a simulated step holds besides its activations: the steady state before it (optimizer state made by one step
over zero gradients, then registered with the parameters, buffers and inputs as resident), the rows of the batch
held beside the micro-batch, the state a real optimizer never makes (dropped), and the RNG state checkpointing
stashes.

Note [checkpoint RNG state]
    Non-reentrant checkpointing stashes the CPU RNG state (``torch.get_rng_state()``, a 5056-byte tensor on current
    builds) when a checkpointed module runs forward, keeps it until that region's backward, and takes another copy
    while it recomputes (``torch.random.fork_rng``). Those tensors are made outside the dispatcher, so the tracker
    would not see them; during the simulation ``get_rng_state`` returns a tensor of the real state's size made by an
    op (so it is tracked with the same lifetime) and ``set_rng_state`` ignores fake tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from autofit.capture.model_copy import attached_tensors, module_tensor_attributes
from autofit.core._torch import grad_scaler_state, patch, storage_tensors
from autofit.core.categories import Category
from autofit.simulate.tracker import StepTracker
from autofit.training.batch import Batch
from autofit.training.step import StepConfig, optimizer_step

__all__ = ["tracked_rng_state", "create_optimizer_state", "register_state", "held_rows", "drop_phantom_state"]


@contextlib.contextmanager
def tracked_rng_state(fake: bool) -> Iterator[None]:
    """See Note [checkpoint RNG state]."""
    size = torch.get_rng_state().numel()

    def tracked_get_state(get_state):
        def get() -> torch.Tensor:
            state = torch.empty(size, dtype=torch.uint8)
            if not fake:
                state.copy_(get_state())
            return state
        return get

    def tracked_set_state(set_state):
        def set_(state: torch.Tensor) -> None:
            if not fake:
                set_state(state)
        return set_

    with patch(torch, "get_rng_state", tracked_get_state), patch(torch, "set_rng_state", tracked_set_state):
        yield


def create_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, scaler, stored=None, *,
                           keep_grads: bool = False) -> None:
    """Steady state: one optimizer step over zero gradients creates every piece of state a real step would. It is
    the trainer's step (``optimizer_step``); a GradScaler's scale tensor is made first, as the first ``scale`` of a
    loss would (``scaler.step`` unscales by itself, leaving the same per-device ``found_inf``). ``keep_grads``: the
    zero gradients stay, as the trainer allocates them before the first forward (Note [gradients allocated before
    forward], training/grads.py)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    if scaler is not None:
        scaler.scale(torch.ones((), device="cpu"))  # creates the scale tensor
    optimizer_step(optimizer, scaler, stored=stored, keep_grads=keep_grads)


def register_state(tracker: StepTracker, model, optimizer, scaler, micro: Batch, micro_target, stored=None, *,
                    host_states: bool = False) -> None:
    for p in model.parameters():
        tracker.register(p, Category.PARAMETERS, host=host_states)
    for _, t in attached_tensors(model):  # quantization statistics (Note [quantized parameters])
        tracker.register(t, Category.PARAMETERS, host=host_states)
    for p in model.parameters():  # kept between steps (Note [gradients allocated before forward]), after the
        if p.grad is not None:  # parameters and before the optimizer state, as the trainer allocates them
            tracker.register(p.grad, Category.GRADIENTS, host=host_states)
    for b in model.buffers():
        tracker.register(b, Category.BUFFERS)
    for _, t in module_tensor_attributes(model):
        tracker.register(t, Category.BUFFERS)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tracker.register(value, Category.OPTIMIZER_STATE, host=host_states)
    if scaler is not None:
        for value in grad_scaler_state(scaler):
            tracker.register(value, Category.OPTIMIZER_STATE)
    if stored is not None:  # the fp32 master copy is the optimizer's (Note [stored precision])
        for value in stored.master_tensors():
            tracker.register(value, Category.OPTIMIZER_STATE)
        for value in stored.master_tensors():  # its gradients, kept for the next step (Note [where zero_grad falls])
            if value.grad is not None:
                tracker.register(value.grad, Category.GRADIENTS)
    for t in micro.tensors():
        tracker.register(t, Category.INPUTS)
    if micro_target is not None:
        for t in micro_target.tensors():
            tracker.register(t, Category.INPUTS)


def held_rows(micro: Batch, micro_target: Batch | None, config: StepConfig) -> list[torch.Tensor]:
    """Rows of the batch beyond the micro-batch that stay resident (see StepConfig.held_rows), counted as inputs."""
    extra = config.held_rows - config.micro_batch_size
    if extra <= 0:
        return []
    rows = [micro] + ([micro_target] if micro_target is not None else [])
    return [t for b in rows for t in b.resize(extra).per_sample_tensors()]


def drop_phantom_state(tracker: StepTracker, model, optimizer, received_grad: set[int], stored=None, *,
                       carried: dict[int, int | None] | None = None) -> None:
    """State created by the zero-gradient warm-up for parameters that never get a gradient does not exist in a real
    run (optimizers skip parameters whose grad is None); it was alive all step, so removing it is exact. So with
    ``carried`` (id of a parameter -> the storage of the gradient the warm-up left it, Note [where zero_grad
    falls]): a gradient a parameter never receives is not the previous step's either."""
    for p in model.parameters():
        sid = (carried or {}).get(id(p))
        if sid is not None and id(p) not in received_grad:
            tracker.timeline.storages[sid].nbytes = 0
    for p in model.parameters():
        key = p if stored is None else stored.state_key(p)
        if id(p) in received_grad or key not in optimizer.state:
            continue
        for value in optimizer.state[key].values():
            if isinstance(value, torch.Tensor):
                for inner in storage_tensors(value):  # a low-bit state by its inner tensors
                    sid = tracker.sid_of(inner)
                    if sid is not None:
                        tracker.timeline.storages[sid].nbytes = 0
