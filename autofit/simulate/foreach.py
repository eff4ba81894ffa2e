"""Make the simulated optimizer and gradient clipping take the implementation torch picks on the target device.

The simulation runs on fake CPU tensors, but torch chooses the optimizer's implementation from the parameters'
device and type, so left alone it would pick what a CPU step with tensor subclasses picks. See
Note [optimizer implementation on the target].

Note [optimizer implementation on the target]
    ``torch/optim/optimizer.py::_default_to_fused_or_foreach`` (called by every optimizer's functional API when the
    user set neither ``foreach`` nor ``fused``: ``adam.py::adam``, ``sgd.py::sgd``, ``adamw`` through ``adam``, ...)
    returns foreach=True when nothing is differentiable and every parameter is of a type in
    ``torch.optim.optimizer._foreach_supported_types`` on a device in
    ``torch/utils/foreach_utils.py::_get_foreach_kernels_supported_devices`` (cuda, xpu, mtia, privateuse1; not
    cpu). ``torch.nn.utils.clip_grad_norm_`` asks ``foreach_utils._has_foreach_support``: the device (cpu included
    there) and every gradient's type in ``foreach_utils._foreach_supported_types``.

    Two things differ in the simulation: the tensors are ``FakeTensor`` (not ``torch.Tensor`` or ``Parameter``, so
    the type checks fail on both targets) and the device is cpu (so the optimizer's device check fails for a CUDA
    target). While a step is simulated, :func:`target_implementation` lets fake tensors pass the type checks (they
    stand in for plain tensors) and, for a CUDA target, lets cpu pass the optimizer's device check, so torch's own
    selection runs and decides, user flags (``foreach=False``, ``fused=True``, ``differentiable=True``) included.
    The ``_foreach_*`` ops then run on fake CPU tensors and allocate their outputs as the CUDA multi-tensor kernels
    do (one output tensor per input, same shape and dtype).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from autofit.core._torch import FakeTensor, foreach_devices_include, foreach_types_include

if TYPE_CHECKING:
    from autofit.training.config import DeviceKind

__all__ = ["target_implementation"]


@contextlib.contextmanager
def target_implementation(device: DeviceKind) -> Iterator[None]:
    """See Note [optimizer implementation on the target]."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(foreach_types_include(FakeTensor))
        if device.foreach_by_default:  # the simulation's cpu tensors stand for the device's
            stack.enter_context(foreach_devices_include("cpu"))
        yield
