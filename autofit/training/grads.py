"""Gradients allocated before the first forward and kept between steps (Note [gradients allocated before forward]).

Note [gradients allocated before forward]
    By default a step ends with ``zero_grad(set_to_none=True)``, and the next backward creates every gradient anew:
    ``AccumulateGrad`` steals the tensor backward computed (``accumulateGrad`` in
    torch/csrc/autograd/functions/accumulate_grad.h: ``variable_grad`` undefined and the new gradient stealable ->
    ``update_grad(new_grad.detach())``). On a GPU that tensor comes from the caching allocator in the middle of
    backward, wherever a block of its size is free: between activations. The gradients then outlive the activations
    (to the optimizer step), so the segments they land in stay partly in use, and which segments those are depends
    on the micro-batch. Under a budget the allocator can release only wholly free segments (Note [allocating under a
    cap], autofit/cuda/allocator.py), so the smallest budget the optimizer step runs under grew as the batch shrank
    (Note [the smallest budget], autofit/solve/verify.py).

    With ``preallocated_grads`` every trainable parameter gets ``p.grad = torch.zeros_like(p)`` once, in parameter
    order, before the first forward (the trainer does it in ``wrap``), and each step ends with
    ``zero_grad(set_to_none=False)`` (``_foreach_zero_`` in place: nothing allocated). Backward then takes the other
    branch of ``accumulateGrad``: ``variable_grad += new_grad``, in place, the new gradient a temporary freed when
    the engine drops it, as every micro-batch after the first of an accumulation window already does. So the
    gradients live in blocks allocated before any activation, next to the parameters, and when the optimizer step
    runs, the activations' segments hold nothing: under a budget the allocator frees them, and what the step needs
    no longer depends on the micro-batch. One tensor per parameter is enough (no flat buffer): a gradient of more
    than 1 MiB gets a segment of its own size (rounded to 2 MiB) or a slice of a 20 MiB one shared only with
    blocks allocated in the same order, all of which live all step; ``zeros_like`` keeps the parameter's strides,
    which ``accumulateGrad``'s layout contract asks for.

    The price: the gradients exist during forward and the first backward of the window (with ``set_to_none`` they
    appear during that backward), and each backward holds one new gradient beside its buffer until the add. With
    accumulation the second micro-batch pays this already, so the tensor peak does not change; with one
    micro-batch per step it rises wherever forward or backward holds it. The planner therefore uses it only where
    the budget needs it (Note [gradients before forward as a plan knob], autofit/solve/estimator.py). Not with the
    optimizer stepping in backward (it frees each gradient), a fp32 master copy (whose step moves the gradients to
    the master parameters), or DDP and FSDP2 (which own their gradients' storage: DDP's buckets, FSDP2's shards).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["allocate_grads"]


def allocate_grads(model: nn.Module) -> list[nn.Parameter]:
    """Give every trainable parameter without a gradient a zero one, in parameter order (Note [gradients allocated
    before forward]); returns the parameters it gave one, so that the caller can take them back."""
    given = []
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                given.append(p)
    return given
