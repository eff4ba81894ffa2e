"""CUDA kernels whose memory differs from the CPU simulation's, chosen as PyTorch chooses them on the GPU.

Scaled dot-product attention (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, ``select_sdp_backend``):
PyTorch tries flash attention, then memory-efficient attention, then the math path.
- flash: needs sm80 or newer, fp16/bf16 inputs, no explicit attention mask, equal head dims <= 256
  (``attention.cpp`` pads them to a multiple of 8). It saves the output and an fp32 logsumexp (B, H, S) for
  backward: no S x S matrix.
- memory-efficient: sm50 or newer (bf16 needs sm80), fp16/bf16/fp32, any mask, no grouped-query attention, head dim
  a multiple of ``minimum_gemm_alignment``: 8 for fp16/bf16 on tensor cores, 4 for fp32 on sm80+, 1 for fp32 on
  sm7x. It also saves the output and an fp32 logsumexp.
- math: everything else; it materialises the attention matrix, upcasting fp16/bf16 to fp32 unless
  ``allowFP16BF16ReductionMathSDP`` is set (``_scaled_dot_product_attention_math``).
During a CUDA simulation ``aten::scaled_dot_product_attention`` is re-registered (CompositeImplicitAutograd, removed
afterwards) to call the chosen kernel's aten op on the fake CPU tensors; their meta kernels give CUDA's shapes.

The flash backward also allocates scratch that its meta kernel does not (``flash_backward_scratch``): the CUDA
wrapper ``_flash_attention_backward`` (aten/src/ATen/native/transformers/cuda/attention_backward.cu) makes
``grad_out`` and ``out`` contiguous in (batch, seq, heads, dim) layout, and ``mha_bwd`` (.../flash_attn/flash_api.cpp)
allocates an fp32 ``softmax_d`` (batch, heads, seq_q rounded up to 128) and an fp32 ``dq_accum`` (batch, seq_q rounded
to 128, heads, head dim rounded to 32, or 64 above 128), plus q-sized ``dk_expanded`` / ``dv_expanded`` when key and
value have fewer heads (grouped-query attention). They live for the duration of the kernel.

Softmax of fp16 into fp32 (``softmax(x, dim, dtype=torch.float32)``, which CUDA autocast also asks for): on CUDA
``softmax`` and ``log_softmax`` (aten/src/ATen/native/SoftMax.cpp) call ``_softmax(x, dim, half_to_float=True)``, one
kernel reading fp16 and writing fp32, and its backward returns the fp16 gradient directly; everywhere else (and for
bf16 on CUDA) they convert the input to fp32 first, a full fp32 copy, and backward goes through that cast too. During
a simulation ``softmax.int`` and ``log_softmax.int`` take CUDA's branch.

Not modelled (documented in docs/cuda.md): the cuDNN attention backend, cuDNN convolution workspaces (chosen by
cuDNN at run time), the cuDNN batch-norm reserve space of NHWC persistent kernels (0 for the default NCHW path).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from autofit.core._torch import destroy_library, exclude_dispatch_key
from autofit.cuda.catalog import GPUSpec

__all__ = ["cuda_kernels", "flash_backward_scratch", "kernel_key", "sdpa_backend", "softmax_cuda"]

aten = torch.ops.aten


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                 gpu: GPUSpec, *, enable_gqa: bool = False) -> str:
    """"flash", "efficient" or "math", as ``select_sdp_backend`` would pick on ``gpu``."""
    dtype = query.dtype
    head = query.shape[-1]
    same_heads = key.shape[-1] == head and value.shape[-1] == head
    four_d = query.dim() == 4 and key.dim() == 4 and value.dim() == 4
    sm = gpu.compute_capability
    if (four_d and sm >= (8, 0) and dtype in (torch.float16, torch.bfloat16) and attn_mask is None and same_heads
            and head <= 256):
        return "flash"
    dtype_ok = dtype == torch.float32 or dtype == torch.float16 or (dtype == torch.bfloat16 and sm >= (8, 0))
    if four_d and sm >= (5, 0) and dtype_ok and not enable_gqa and head % _gemm_alignment(dtype, sm) == 0:
        return "efficient"
    return "math"


def kernel_key(gpu: GPUSpec) -> tuple:
    """What of ``gpu`` the kernels of a simulation read (``sdpa_backend``'s thresholds of the compute capability, and
    the platform): cards with the same key run the same simulated step (Note [one analysis for several cards],
    autofit/core/shared.py)."""
    sm = gpu.compute_capability
    return (gpu.platform, sm >= (8, 0), sm >= (7, 0), sm >= (5, 0))


def _gemm_alignment(dtype: torch.dtype, sm: tuple[int, int]) -> int:
    """``minimum_gemm_alignment`` (sdp_utils.cpp): 4 on sm80+, raised to 128 bits / scalar width where tensor cores
    are used (sm80+ always, sm7x for fp16/bf16)."""
    half = dtype in (torch.float16, torch.bfloat16)
    tensor_cores = sm >= (8, 0) or (sm >= (7, 0) and half)
    alignment = 4 if sm >= (8, 0) else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def flash_backward_scratch(batch: int, heads: int, seq_q: int, head_dim: int, seq_k: int, kv_heads: int,
                           dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """(shape, dtype) of every buffer ``mha_bwd`` allocates beyond dq, dk, dv (flash_api.cpp, non-deterministic
    path: ``loop`` is always true there)."""
    head_rounded = _round_up(head_dim, 32 if head_dim <= 128 else 64)
    seq_q_rounded = _round_up(seq_q, 128)
    scratch = [((batch, heads, seq_q_rounded), torch.float32),  # softmax_d
               ((batch, seq_q_rounded, heads, head_rounded), torch.float32)]  # dq_accum
    if kv_heads != heads:  # dk_expanded, dv_expanded, summed into dk, dv afterwards
        scratch += [((batch, seq_k, heads, head_dim), dtype)] * 2
    return tuple(scratch)


def _flash_backward(grad_out, query, key, value, out, *rest, scale=None):
    """``_scaled_dot_product_flash_attention_backward`` as CUDA runs it: the meta kernel's gradients plus the
    buffers the CUDA kernel holds while it runs. Registered for AutogradCPU during a simulation, so the forward's
    native autograd node (and what it saves) is untouched. ``rest``: the op's other arguments (logsumexp, the
    cumulative sequence lengths, the maximum lengths, dropout_p, is_causal, the philox seed and offset), passed on
    as they came: this replacement reads none of them."""
    # attention_backward.cu, _flash_attention_backward: "CUDA code assumes that dout is contiguous" (in the
    # (batch, seq, heads, dim) layout _scaled_dot_product_flash_attention_backward_cuda transposes to)
    grad_bshd = grad_out.transpose(1, 2).contiguous()
    out_bshd = out.transpose(1, 2).contiguous()
    batch, heads, seq_q, head_dim = query.shape
    scratch = [query.new_empty(shape, dtype=dtype) for shape, dtype in flash_backward_scratch(
        batch, heads, seq_q, head_dim, key.shape[2], key.shape[1], query.dtype)]
    with exclude_dispatch_key("AutogradCPU"):
        grads = aten._scaled_dot_product_flash_attention_backward(
            grad_bshd.transpose(1, 2), query, key, value, out_bshd.transpose(1, 2), *rest, scale=scale)
    del scratch, grad_bshd, out_bshd  # freed when the kernel returns
    return grads


def _softmax_like(fused):
    def kernel(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        if x.dtype == torch.float16 and dtype == torch.float32:
            try:
                return fused(x, dim, True)  # SoftMax.cpp: the CUDA fp16 -> fp32 kernel, no fp32 copy of x
            except RuntimeError:  # a real CPU tensor (data-dependent models run for real): CPU has no such kernel
                pass
        return fused(x.to(dtype) if dtype is not None else x, dim, False)

    return kernel


softmax_cuda = _softmax_like(aten._softmax)
_log_softmax_cuda = _softmax_like(aten._log_softmax)


@contextlib.contextmanager
def cuda_kernels(gpu: GPUSpec) -> Iterator[None]:
    """Route SDPA to the kernel PyTorch would run on ``gpu``, and softmax to CUDA's fp16 -> fp32 kernel, for the
    duration of a simulation."""

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        backend = sdpa_backend(query, key, value, attn_mask, gpu, enable_gqa=enable_gqa)
        if backend == "flash":
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                            scale=scale)[0]
        if backend == "efficient":
            needs_grad = query.requires_grad or key.requires_grad or value.requires_grad
            return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, needs_grad,
                                                                dropout_p, is_causal, scale=scale)[0]
        return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, None,
                                                       scale=scale, enable_gqa=enable_gqa)[0]

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("scaled_dot_product_attention", attention, "CompositeImplicitAutograd")
        lib.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, "AutogradCPU")
        lib.impl("softmax.int", softmax_cuda, "CompositeImplicitAutograd")
        lib.impl("log_softmax.int", _log_softmax_cuda, "CompositeImplicitAutograd")
    try:
        yield
    finally:
        destroy_library(lib)
