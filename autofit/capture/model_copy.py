"""Copies of the user's model that autofit can run without touching the original.

The fake copy shares no storage with the original and allocates nothing: ``copy.deepcopy`` is handed a memo that
maps every parameter, buffer and tensor attribute to a fake tensor of the same shape, stride and dtype, so the copy's
structure, hooks and Python attributes are the user's own while its tensors live in a ``FakeTensorMode``. This works
the same for models on CPU, on CUDA and on the meta device (``with torch.device("meta"): model = ...``).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator

import torch
from torch import nn

from autofit._torch import FakeTensorMode
from autofit.errors import UnsupportedModelError

__all__ = ["fake_copy", "fake_input", "real_copy", "module_tensor_attributes", "has_meta_tensors"]


def module_tensor_attributes(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Plain tensor attributes of modules that are neither parameters nor buffers (causal masks, rotary caches)."""
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield (f"{name}.{attr}" if name else attr), value


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


def _fake_like(t: torch.Tensor, device: str) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device=device)


def fake_input(fake_mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    """A fake CPU twin of an input tensor (inputs on the meta device or a GPU included); call inside ``fake_mode``."""
    if t.is_meta:
        return _fake_like(t, "cpu")
    return fake_mode.from_tensor(t.detach().cpu() if t.device.type != "cpu" else t)


def fake_copy(model: nn.Module, fake_mode: FakeTensorMode, *, device: str = "cpu") -> nn.Module:
    """A structural copy of ``model`` whose tensors are fake tensors on ``device`` (shape, stride, dtype kept)."""
    memo: dict[int, object] = {}
    with fake_mode:
        for p in model.parameters():
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(_fake_like(p, device), requires_grad=p.requires_grad)
        for b in model.buffers():
            if id(b) not in memo:
                memo[id(b)] = _fake_like(b, device)
        for _, t in module_tensor_attributes(model):
            if id(t) not in memo:
                memo[id(t)] = _fake_like(t, device)
    try:
        return _deepcopy(model, memo)
    except Exception as e:  # noqa: BLE001 - any deepcopy failure means the same thing to the user
        raise UnsupportedModelError(
            f"autofit could not copy the model ({type(e).__name__}: {e}); it copies the module tree to simulate "
            "without touching your model: make sure copy.deepcopy works on it"
        ) from e


def real_copy(model: nn.Module) -> nn.Module:
    """A deep copy with real weights, for steps that must really run (``measure``, data-dependent models)."""
    if has_meta_tensors(model):
        raise UnsupportedModelError(
            "this needs real weights, but the model has tensors on the meta device: build it on the CPU "
            "(or call model.to_empty(device='cpu') and initialise it)"
        )
    return _deepcopy(model, {})


def _deepcopy(model: nn.Module, memo: dict[int, object]) -> nn.Module:
    """``copy.deepcopy``, plus the functions stored on the modules themselves (see Note [copied closures])."""
    result = copy.deepcopy(model, memo)
    for module in result.modules():
        for key, value in list(vars(module).items()):
            if isinstance(value, types.FunctionType) and value.__closure__:
                module.__dict__[key] = _copy_closure(value, memo)
    return result


# Note [copied closures]
#     copy.deepcopy returns functions as they are. A function the user stored on a module instance, typically a
#     wrapped forward (``orig = m.forward; m.forward = lambda *a, **k: orig(*a, **k)``), still closes over the
#     ORIGINAL module after the copy, so running the copy would run the user's module: real gradients and BatchNorm
#     statistics on the user's model, or fake gradients on it during a simulation. Such functions are rebuilt with
#     their closure cells deep-copied through the same memo, so they reach the copy's modules and tensors instead.
#     A cell that cannot be deep-copied keeps the original value (then that one object stays shared), and a captured
#     tensor that is not a parameter, buffer or tensor attribute is copied for real, even into the fake copy.
def _copy_closure(fn: types.FunctionType, memo: dict[int, object]) -> types.FunctionType:
    if id(fn) in memo:
        return memo[id(fn)]  # type: ignore[return-value]
    cells = tuple(types.CellType() for _ in fn.__closure__)
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    new.__kwdefaults__, new.__qualname__, new.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    new.__dict__.update(fn.__dict__)
    memo[id(fn)] = new
    memo.setdefault(id(memo), []).append(fn)  # keep fn alive while its id is a memo key, as deepcopy does
    for old_cell, cell in zip(fn.__closure__, cells):
        try:
            value = old_cell.cell_contents
        except ValueError:  # an empty cell (a variable not yet assigned in the enclosing scope)
            continue
        if isinstance(value, types.FunctionType) and value.__closure__:
            cell.cell_contents = _copy_closure(value, memo)
            continue
        try:
            cell.cell_contents = copy.deepcopy(value, memo)
        except Exception:  # noqa: BLE001 - see Note [copied closures]
            cell.cell_contents = value
    return new
