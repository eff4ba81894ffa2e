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

from autofit.core._torch import FakeTensor, destroy_library

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


@cuda_path("_fused_rms_norm")
def fused_rms_norm(input: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
                   eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten/src/ATen/native/layer_norm.cpp``, ``rms_norm_symint``: after its checks (channels-last, complex and a
    weight of another dtype take ``rms_norm_composite`` on every device) it calls ``_fused_rms_norm``, which on CUDA
    is one kernel (``_fused_rms_norm_cuda``) whose autograd node (``derivatives.yaml``) keeps the input, the weight
    and ``rstd``: one accumulation-type value per normalised row. On the CPU ``_fused_rms_norm`` is the composite,
    which keeps an fp32 copy of a 16-bit input and the normalised fp32 rows before the weight. Fake inputs only:
    a step that runs for real (Note [data-dependent models]) keeps the CPU's composite, whose values are right."""
    if not all(isinstance(t, FakeTensor) for t in (input, weight) if t is not None):
        return _rms_norm_composite(input, normalized_shape, weight, eps)
    return _FusedRmsNorm.apply(input, tuple(normalized_shape), weight)


def _rms_norm_composite(input, normalized_shape, weight, eps):
    """``rms_norm_composite`` (layer_norm.cpp): upcast 16-bit inputs, normalise, scale, cast back."""
    dims = tuple(range(-len(normalized_shape), 0))
    upcast = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
    eps = torch.finfo(upcast.dtype).eps if eps is None else eps
    rstd = torch.rsqrt(upcast.pow(2).mean(dims, keepdim=True).add_(eps))
    out = upcast.mul(rstd)
    if weight is not None:
        out = out.mul(weight)
    return out.contiguous().type_as(input), rstd.contiguous()


def _accumulate_type(dtype: torch.dtype) -> torch.dtype:
    """``at::toAccumulateType(dtype, /*is_cuda=*/true)``: fp32 for the 16-bit types."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _FusedRmsNorm(torch.autograd.Function):
    """``_fused_rms_norm`` on CUDA, on fake tensors: the output and ``rstd`` (the input's leading dims, 1 for each
    normalised one), and ``_fused_rms_norm_backward``'s meta kernel for the gradients."""

    @staticmethod
    def forward(ctx, input, normalized_shape, weight):
        axis = input.dim() - len(normalized_shape)
        out = torch.empty_like(input, memory_format=torch.contiguous_format)
        rstd = input.new_empty(tuple(input.shape[:axis]) + (1,) * len(normalized_shape),
                               dtype=_accumulate_type(input.dtype))
        ctx.save_for_backward(input, rstd, weight)
        ctx.normalized_shape = list(normalized_shape)
        ctx.mark_non_differentiable(rstd)
        return out, rstd

    @staticmethod
    def backward(ctx, grad_out, _grad_rstd):
        input, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2]]
        grad_input, grad_weight = aten._fused_rms_norm_backward(grad_out, input, ctx.normalized_shape, rstd, weight,
                                                                mask)
        return (grad_input if mask[0] else None), None, (grad_weight if mask[1] else None)


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
