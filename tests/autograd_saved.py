"""What an autograd graph keeps for backward: the truth the CUDA model's saved-tensor rules are checked against."""

from __future__ import annotations

import torch

__all__ = ["saved_tensors"]


def saved_tensors(out: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor an autograd node of ``out``'s graph saved for backward: the ``_saved_*`` attributes of aten
    nodes, and ``saved_tensors`` of Python ``autograd.Function`` nodes."""
    seen, stack, saved = set(), [out.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "saved_tensors"):  # a Python autograd.Function
            saved += [t for t in fn.saved_tensors if t is not None]
        saved += [getattr(fn, a) for a in dir(fn) if a.startswith("_saved_")
                  and isinstance(getattr(fn, a), torch.Tensor)]
        stack += [f for f, _ in fn.next_functions]
    return saved
