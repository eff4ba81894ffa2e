"""The scratch memory of CUDA's flash-attention backward, which its meta kernel does not allocate.

Hand computation from aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp (``mha_bwd``): an fp32
``softmax_d`` of (batch, heads, seq_q rounded up to 128) and an fp32 ``dq_accum`` of (batch, seq_q rounded to 128,
heads, head dim rounded to 32, or to 64 above 128); with fewer key/value heads, q-sized ``dk_expanded`` and
``dv_expanded``. attention_backward.cu makes ``grad_out`` contiguous in (batch, seq, heads, dim) layout first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autofit.cuda.catalog import gpu_spec
from autofit.cuda.kernels import cuda_kernels, flash_backward_scratch


def test_scratch_shapes_by_hand():
    # vit_l_16 at batch 2: 16 heads of 64 over 197 tokens
    assert flash_backward_scratch(2, 16, 197, 64, 197, 16, torch.bfloat16) == (
        ((2, 16, 256), torch.float32), ((2, 256, 16, 64), torch.float32))
    # head dim 80 rounds to 96 (multiple of 32), 192 to 192 (multiple of 64); seq 128 stays 128
    assert flash_backward_scratch(1, 8, 128, 80, 128, 8, torch.float16)[1] == ((1, 128, 8, 96), torch.float32)
    assert flash_backward_scratch(1, 8, 129, 192, 129, 8, torch.float16)[1] == ((1, 256, 8, 192), torch.float32)
    # grouped-query attention: 32 query heads over 8 key/value heads adds two q-sized buffers in the input dtype
    gqa = flash_backward_scratch(1, 32, 4096, 128, 4096, 8, torch.bfloat16)
    assert gqa[2:] == (((1, 4096, 32, 128), torch.bfloat16),) * 2


class _Allocations(TorchDispatchMode):
    """Every tensor an op returns, with the bytes of its own new storage."""

    def __init__(self) -> None:
        super().__init__()
        self.fp32 = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and func in (
                torch.ops.aten.new_empty.default, torch.ops.aten.empty.memory_format):
            self.fp32.append(out.untyped_storage().nbytes())
        return out


def test_flash_backward_allocates_the_scratch_on_the_simulated_gpu():
    batch, heads, seq, dim = 2, 16, 197, 64
    with FakeTensorMode(), cuda_kernels(gpu_spec("A100-80GB")):
        q, k, v = (torch.randn(batch, heads, seq, dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v)
        recorder = _Allocations()
        with recorder:
            out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
    # hand computation: softmax_d 2*16*256*4 = 32,768 bytes; dq_accum 2*256*16*64*4 = 2,097,152 bytes
    assert sorted(recorder.fp32) == [32_768, 2_097_152]


def test_memory_efficient_backend_has_no_flash_scratch():
    # fp32 attention on an A100 takes the memory-efficient kernel (flash needs fp16/bf16): no flash scratch
    with FakeTensorMode(), cuda_kernels(gpu_spec("A100-80GB")):
        q = torch.randn(1, 4, 64, 64, requires_grad=True)
        out = F.scaled_dot_product_attention(q, q, q)
        recorder = _Allocations()
        with recorder:
            out.sum().backward()
    assert 1 * 4 * 128 * 4 not in recorder.fp32
