"""Offloading as the simulation sees it (Note [offload] in step.py, Note [host storages] in timeline.py).

The simulation runs on CPU fake tensors whatever the target, so a copy to the host is a no-op there
(``tensor.cpu()`` returns the tensor itself) and a copy back costs nothing. On a CUDA target that would hide both
what offloading frees on the device and what it brings back, so the simulation runs twins of the two engines'
transfers that allocate what the GPU run allocates, and files host memory apart:

- ``save_on_cpu`` (activations): packing copies the saved tensor into a new host tensor (``torch.empty`` then
  ``copy_``, as ``save_on_cpu`` does with ``pin_memory=True``); unpacking makes a new device tensor (the
  host-to-device copy ``packed.to(device)``), which backward frees when it is done with it;
- FSDP2's ``CPUOffloadPolicy`` (states): the sharded parameters and the optimizer state are host memory; a unit's
  sharded parameters are copied to the device before they are cast and gathered (``FSDPParam.all_gather_inputs``:
  ``self._sharded_param_data.to(self.device)``); each reduced gradient goes to the host once its unit's
  post-backward has run (``foreach_reduce``: ``new_sharded_grad.to(torch.device("cpu"))``), freeing the device
  copy; and the optimizer step, with clipping and unscaling, runs on the host.

On a CPU target host and device are one memory: the step runs the engines as they are, and everything counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from autofit.core._torch import fsdp_internals, patch_lock
from autofit.simulate.tracker import StepTracker

__all__ = ["tracked_save_on_cpu", "offloaded_states", "host_optimizer"]


def tracked_save_on_cpu(tracker: StepTracker) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of ``save_on_cpu`` twins for a CUDA target (the ``to_host`` of ``Feature.step_context``,
    autofit/features/base.py)."""

    def pack(tensor: torch.Tensor):
        tracker.on_host = True
        try:  # torch/autograd/graph.py, save_on_cpu.pack_to_cpu with pin_memory=True
            packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout)
            packed.copy_(tensor)
        finally:
            tracker.on_host = False
        return packed

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        return packed.clone()  # the copy back to the device: a new device tensor (packed.to(device))

    return lambda: torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@contextlib.contextmanager
def offloaded_states(tracker: StepTracker) -> Iterator[None]:
    """FSDP2's ``CPUOffloadPolicy`` on a CUDA target: the device copy of each unit's sharded parameters before its
    all-gather, and its reduced gradients moved to the host after its post-backward."""
    fsdp_param, fsdp_group = fsdp_internals()
    gather_inputs = fsdp_param.__dict__["all_gather_inputs"]
    post_backward = fsdp_group.post_backward

    def staged_inputs(self) -> list[torch.Tensor]:
        if not self.offload_to_cpu:
            return gather_inputs.fget(self)
        host = self._sharded_param_data
        self._sharded_param_data = host.clone()  # .to(self.device): a device copy of the host shard
        try:
            return gather_inputs.fget(self)
        finally:
            self._sharded_param_data = host

    def post_backward_to_host(self, *args, **kwargs):
        result = post_backward(self, *args, **kwargs)
        for p in self.fsdp_params:
            grad = p.sharded_param.grad
            if p.offload_to_cpu and grad is not None:
                tracker.move_to_host(grad)
        return result

    with patch_lock():
        fsdp_param.all_gather_inputs = property(staged_inputs)
        fsdp_group.post_backward = post_backward_to_host
        try:
            yield
        finally:
            fsdp_param.all_gather_inputs = gather_inputs
            fsdp_group.post_backward = post_backward


@contextlib.contextmanager
def host_optimizer(tracker: StepTracker, on_host: bool) -> Iterator[None]:
    """The optimizer step (with unscaling and clipping) runs on the host's tensors: what it allocates is host memory."""
    tracker.on_host = on_host
    try:
        yield
    finally:
        tracker.on_host = False
