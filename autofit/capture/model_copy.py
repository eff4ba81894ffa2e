"""Copies of the user's model that autofit can run without touching the original.

The fake copy shares no storage with the original and allocates nothing: ``copy.deepcopy`` is handed a memo that
maps every parameter, buffer and tensor attribute to a fake tensor of the same shape, stride and dtype, so the copy's
structure, hooks and Python attributes are the user's own while its tensors live in a ``FakeTensorMode``. This works
the same for models on CPU, on CUDA and on the meta device (``with torch.device("meta"): model = ...``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autofit.errors import UnsupportedModelError

__all__ = ["fake_copy", "real_copy", "module_tensor_attributes", "has_meta_tensors"]


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
        return copy.deepcopy(model, memo)
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
    return copy.deepcopy(model)
