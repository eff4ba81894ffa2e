"""Optimizers whose code reads tensor values, simulated on fake tensors all the same.

Note [optimizers that read values]
    Fake tensors have no values, so an optimizer that reads one (``.item()``, ``.tolist()``) raises
    DataDependentOutputException in a simulation. Three ways out, per optimizer, each read from its source:
    - values read while it is *built* (bitsandbytes' 8-bit optimizers compute their quantization maps with
      ``create_dynamic_map(...).tolist()`` in ``Optimizer8bit.__init__``, bitsandbytes/optim/optimizer.py): the
      simulation builds every optimizer outside the fake mode (``unset_fake_temporarily``). Its parameters are fake
      already, so only tensors made from constants (the maps, 256 fp32 values each) are real, and those are counted
      like any state tensor (a real tensor's storage has its real size).
    - values read in the *step* that only become Python scalars of the update, never a size or a branch that
      allocates: ``VALUE_FREE_STEPS`` below lists such optimizers with the lines that read. While their step runs
      (the warm-up step that creates the state, and the step of the simulated window) ``.item()`` on a fake tensor
      answers 1 (``ValueFreeStep``): the same ops run on the same shapes, so the memory is exact; the numbers the
      step computes are not, and nothing reads them.
    - any other optimizer that reads values in its step: the step runs for real (Note [data-dependent models],
      simulate/run.py), or, where that cannot be (a model on the meta device), autofit raises
      UnsupportedModelError naming the optimizer.
    Paged bitsandbytes optimizers (``PagedAdamW8bit``) keep their state in CUDA managed memory on a GPU
    (``get_state_buffer``: ``F.get_paged`` for parameters of 1e5 elements or more), which
    ``torch.cuda.max_memory_allocated`` does not see; on the CPU they fall back to ordinary tensors (the same
    function), so a CPU estimate counts their state as optimizer state, exactly, and a GPU estimate counts it too:
    an upper bound on the device's allocated figure (see docs/fine-tuning.md).
"""

from __future__ import annotations

import torch

from autofit.core._torch import FakeTensor, TorchDispatchMode, pytree

__all__ = ["VALUE_FREE_STEPS", "ValueFreeStep", "reads_values_harmlessly"]

# optimizer class (module.qualname, matched along the MRO) -> where its step reads values, and why no size depends
# on them (Note [optimizers that read values])
VALUE_FREE_STEPS: dict[str, str] = {
    "torch.optim._adafactor.Adafactor": (
        "torch/optim/_adafactor.py, _single_tensor_adafactor: step_t.item(), param.norm(2).item() and "
        "update.norm(2).item() become the Python floats rho_t, alpha and the clipping denominator"),
    "torchao.optim.adam._AdamBase": (
        "torchao/optim/quant_utils.py, create_dynamic_map: .tolist() builds the 256-entry quantization map when "
        "a low-bit state is created (subclass_8bit.py, subclass_4bit.py: OptimStateNbit.zeros)"),
}


def reads_values_harmlessly(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s class, or a base class, is in VALUE_FREE_STEPS."""
    return any(f"{c.__module__}.{c.__qualname__}" in VALUE_FREE_STEPS for c in type(optimizer).__mro__)


class ValueFreeStep(TorchDispatchMode):
    """``.item()`` on a fake tensor answers 1 (1.0, True) instead of raising; every other op runs as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and any(
                isinstance(t, FakeTensor) for t in pytree.tree_leaves(args)):
            dtype = args[0].dtype
            if dtype is torch.bool:
                return True
            return 1.0 if (dtype.is_floating_point or dtype.is_complex) else 1
        return func(*args, **kwargs)
