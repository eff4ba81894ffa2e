"""Stored precision: the dtype the parameters, gradients and optimizer state are kept in. See Note [stored precision].

Note [stored precision]
    Mixed precision has two halves. The compute half is autocast's (``PrecisionPolicy.name``): which dtype each op
    runs in. The stored half (``PrecisionPolicy.stored``) is what lives between steps:

    - ``None``, as loaded: the parameters stay in the dtype the user built them in; gradients follow them, and so does
      the optimizer state (torch's optimizers make ``exp_avg`` like the parameter: ``torch/optim/adamw.py``,
      ``_init_group``, ``torch.zeros_like(p, memory_format=torch.preserve_format)``).
    - ``"fp32"``: the parameters are converted to fp32 (the usual autocast setup: 4 + 4 + 8 = 16 bytes per parameter
      with Adam, plus autocast's low-precision copy of each weight while forward runs).
    - ``"bf16-master"`` / ``"fp16-master"``: the parameters (and so their gradients) are bf16 / fp16, and the
      optimizer steps an fp32 *master copy* of them, the "weight backup" of the classic mixed-precision recipe
      (Micikevicius et al. 2018, "Mixed Precision Training"; apex's ``FP16_Optimizer``; DeepSpeed's bf16/fp16 modes).
      Before each step the low-precision gradients are copied into fp32 gradients of the master copy (each freed as
      it is copied), the optimizer (with fp32 state) steps the master copy, and the result is copied back into the
      parameters. 2 + 2 + 4 + 8 = 16 bytes per parameter with Adam, the same as fp32, but no autocast weight copies
      and only low-precision weights read in forward. fp16 adds loss scaling (``torch.amp.GradScaler``, which unscales
      the fp32 master gradients).
    - ``"bf16"``, pure bf16: parameters, gradients and optimizer state all bf16 (2 + 2 + 4 = 8 bytes per parameter with
      Adam). Updates smaller than bf16's resolution at a weight's magnitude are lost, so it ranks last. Pure fp16 is
      never offered: without a master copy fp16 updates underflow, and its gradients need loss scaling.

    The master copy lives inside the optimizer: its ``param_groups`` hold the fp32 copies instead of the parameters
    (and its state is keyed by them), so the user's optimizer, scheduler and ``state_dict`` see fp32 tensors, as with
    DeepSpeed. Modules pinned to fp32 (``PrecisionPolicy.fp32_modules``) keep fp32 parameters: they run outside
    autocast. Low-precision storage needs autocast of the same dtype, so that inputs and fp32-pinned outputs meet
    low-precision weights in ops autocast casts. The same code runs in the simulation, in ``measure`` and in the
    trainer (``autofit/training/step.py``), so the estimate counts exactly what the trainer holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autofit.training.precision import stored_dtype

__all__ = ["StoredState", "apply_stored", "stored_bytes_per_parameter"]


def stored_bytes_per_parameter(stored: str, state_per_parameter: int) -> int:
    """Bytes a parameter holds between steps: itself, its gradient, its optimizer state (``state_per_parameter``
    values of the state's dtype, 2 for Adam/AdamW, 1 for SGD with momentum) and the fp32 master copy if any."""
    low = stored_dtype(stored).itemsize
    if stored.endswith("-master"):
        return low + low + 4 + 4 * state_per_parameter
    return low + low + low * state_per_parameter


@dataclass
class StoredState:
    """What :func:`apply_stored` changed on the model and optimizer, to run the step and to undo it."""

    model_dtypes: list[tuple[nn.Parameter, torch.dtype]]  # converted parameters and their dtype before
    masters: list[tuple[nn.Parameter, torch.Tensor]]  # (parameter, its fp32 master copy) for "-master"
    optimizer: torch.optim.Optimizer | None

    def master_tensors(self) -> list[torch.Tensor]:
        return [m for _, m in self.masters]

    def state_key(self, p: nn.Parameter) -> torch.Tensor:
        """The tensor the optimizer keys ``p``'s state by (its master copy, if it has one)."""
        if not hasattr(self, "_master_of"):
            self._master_of = {id(q): m for q, m in self.masters}
        return self._master_of.get(id(p), p)

    def before_step(self) -> None:
        """The parameters' gradients become fp32 gradients of the master copies, each freed as it is copied."""
        for p, m in self.masters:
            if p.grad is not None:
                m.grad = p.grad.to(torch.float32)
                p.grad = None

    def after_step(self) -> None:
        """The stepped master copies are copied back into the (low-precision) parameters."""
        with torch.no_grad():
            for p, m in self.masters:
                p.copy_(m)

    def restore(self) -> None:
        """Parameters back in their dtype (from the master copy where there is one, else converted back, values
        rounded to the low precision), and the optimizer back on the parameters, its state converted with them."""
        with torch.no_grad():
            masters = {id(m): p for p, m in self.masters}
            if self.optimizer is not None and self.masters:
                for group in self.optimizer.param_groups:
                    group["params"] = [masters.get(id(t), t) for t in group["params"]]
                for _, m in self.masters:
                    p = masters[id(m)]
                    if m in self.optimizer.state:
                        self.optimizer.state[p] = self.optimizer.state.pop(m)
            master_of = {id(p): m for p, m in self.masters}
            for p, dtype in self.model_dtypes:
                m = master_of.get(id(p))
                p.data = (m if m is not None else p.data).to(dtype)
                p.grad = None if p.grad is None else p.grad.to(dtype)
                if self.optimizer is not None and not self.masters and p in self.optimizer.state:
                    state = self.optimizer.state[p]
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                            state[k] = v.to(dtype)


def _pinned_parameters(model: nn.Module, fp32_modules: tuple[str, ...]) -> set[int]:
    named = dict(model.named_modules())
    return {id(p) for name in fp32_modules if name in named for p in named[name].parameters()}


def apply_stored(model: nn.Module, optimizer: torch.optim.Optimizer | None, stored: str | None,
                 fp32_modules: tuple[str, ...] = ()) -> StoredState | None:
    """Convert ``model``'s floating parameters to ``stored``'s dtype in place (the Parameter objects stay, so the
    optimizer built over them still holds them) and, for ``"-master"``, give ``optimizer`` fp32 master copies in
    their place. None when nothing changes. See Note [stored precision]."""
    if stored is None:
        return None
    dtype = stored_dtype(stored)
    pinned = _pinned_parameters(model, fp32_modules)
    converted = []
    masters = []
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point() or id(p) in pinned:
                continue
            if stored.endswith("-master"):
                masters.append((p, p.detach().to(torch.float32, copy=True)))
            if p.dtype != dtype:
                converted.append((p, p.dtype))
                p.data = p.data.to(dtype)
                if p.grad is not None:
                    p.grad = p.grad.to(dtype)
    if masters and optimizer is not None:
        master_of = {id(p): m for p, m in masters}
        for group in optimizer.param_groups:
            group["params"] = [master_of.get(id(p), p) for p in group["params"]]
        for p, m in masters:
            if p in optimizer.state:
                state = optimizer.state.pop(p)
                optimizer.state[m] = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point()
                                      and v.dim() > 0 else v for k, v in state.items()}
    return StoredState(converted, masters, optimizer)
