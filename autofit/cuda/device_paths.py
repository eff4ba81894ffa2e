"""Composite ops that take another path on a CUDA tensor than on a CPU one, and what a CUDA simulation runs instead.

The step is simulated on fake CPU tensors (docs/cuda.md, "How a CUDA estimate is made"). Where an ATen composite op
asks the input's device which kernels to call, the simulation would take the CPU's branch and keep the CPU's saved
tensors. Each op below gets, for the duration of a CUDA simulation, a CompositeImplicitAutograd kernel that takes the
CUDA branch on the fake CPU tensors (the aten ops of that branch have CPU and meta kernels, so the shapes and dtypes
are CUDA's). One small function per op, registered once, with its source: the audit of every device branch, modelled
or not, is the table in docs/cuda.md ("Ops whose CUDA path differs from the CPU's").
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch

from autofit.core._torch import destroy_library

__all__ = ["CUDA_PATHS", "cuda_paths", "cuda_path"]

aten = torch.ops.aten

# op overload name -> the kernel the CUDA branch amounts to (CompositeImplicitAutograd during a CUDA simulation)
CUDA_PATHS: dict[str, Callable] = {}


def cuda_path(op: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as what ``aten::<op>`` runs on CUDA; one kernel per op (a second registration is a bug)."""

    def register(fn: Callable) -> Callable:
        if op in CUDA_PATHS:
            raise RuntimeError(f"aten::{op} already has a CUDA path ({CUDA_PATHS[op].__name__})")
        CUDA_PATHS[op] = fn
        return fn

    return register


@cuda_path("dropout")
def dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten/src/ATen/native/Dropout.cpp``, ``dropout``: ``native_dropout`` when ``is_fused_kernel_acceptable``
    (a CUDA input, 0 < p < 1, not empty) or the input is nested; it saves a bool mask (1 byte an element) for
    ``native_dropout_backward``. The CPU's ``_dropout_impl`` saves a noise tensor in the input's dtype instead.
    ``dropout_``, ``feature_dropout``, ``alpha_dropout`` and ``feature_alpha_dropout`` take ``_dropout_impl`` on
    every device and are left alone."""
    if not 0 <= p <= 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    if input.is_nested or (train and 0 < p < 1 and input.numel() > 0):
        return aten.native_dropout(input, p, train)[0]
    if p == 0 or not train or input.numel() == 0:  # _dropout_impl returns its input
        return input
    return input.mul(torch.zeros((), dtype=input.dtype, device=input.device))  # p == 1


@contextlib.contextmanager
def cuda_paths() -> Iterator[None]:
    """Every op of ``CUDA_PATHS`` takes its CUDA branch until the context exits."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        for op, fn in CUDA_PATHS.items():
            lib.impl(op, fn, "CompositeImplicitAutograd")
    try:
        yield
    finally:
        destroy_library(lib)
