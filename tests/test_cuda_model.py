"""The CUDA memory model (``autofit.cuda``), one term at a time, each against the PyTorch or NVIDIA source it models.

No GPU is needed. Two facts about CPU-only builds shape these tests:

- Fake CUDA tensors (``FakeTensorMode`` + ``device="cuda"``) run *forward* ops, so CUDA autocast's real C++ kernels
  (the ``AutocastCUDA`` dispatch key) can be observed on them. Anything that records autograd history on a fake CUDA
  tensor aborts the process (``AccumulateGrad`` asks for a CUDA device guard; so does backward): fake CUDA tensors
  here never require grad.
- ``torch.autocast("cuda")`` switches itself off when CUDA is unavailable (``torch/amp/autocast_mode.py``), so
  :func:`_cuda_autocast` sets the AutocastCUDA thread-local state directly, as ``autocast.__enter__`` does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import autofit
from autofit.core.categories import Category
from autofit.cuda import autocast_policy
from autofit.cuda.allocator import (
    CachingAllocator,
    replay_allocator,
    round_size,
    segment_size,
)
from autofit.cuda.autocast_lists import cuda_autocast_state
from autofit.cuda.autocast_policy import cuda_autocast_policy, policy_of
from autofit.cuda.catalog import GPUS, gpu_spec
from autofit.cuda.kernels import cuda_kernels, sdpa_backend
from autofit.cuda.model import (
    CUDA_CONTEXT_BYTES,
    context_bytes,
    cublas_workspace_bytes,
    cuda_memory,
)
from autofit.cuda.target import DEFAULT_GPU, resolve_gpu
from autofit.simulate.timeline import Phase, StorageRecord, Timeline, replay
from autograd_saved import saved_tensors

KiB, MiB = 1 << 10, 1 << 20
LOW = [torch.bfloat16, torch.float16]


def _ops_with_kernel(key: str) -> set[str]:
    return {name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names()
            if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)}


# ---- autocast policy ---------------------------------------------------------------------------------------------
# Source: aten/src/ATen/autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m), grouped by CastPolicy.
POLICY_LISTS = {
    "lower_precision_fp": autocast_policy.LOWER_PRECISION_FP, "fp32": autocast_policy.FP32,
    "fp32_set_opt_dtype": autocast_policy.FP32_SET_OPT_DTYPE, "fp32_append_dtype": autocast_policy.FP32_APPEND_DTYPE,
    "promote": autocast_policy.PROMOTE, "banned": autocast_policy.BANNED,
}


def test_policy_lists_are_exactly_the_autocast_cuda_kernels_of_this_build():
    # autocast_mode.cpp registers one AutocastCUDA kernel per listed op (KERNEL_CUDA / KERNEL_DIFFERENT_REDISPATCH_
    # SIGNATURE / the banned-function registration); the dispatcher knows which ops have one.
    ours = [name for names in POLICY_LISTS.values() for name in names]
    assert len(ours) == len(set(ours)), "an op is listed under two policies"
    registered = _ops_with_kernel("AutocastCUDA")
    assert registered, "this build registers no AutocastCUDA kernels"
    assert set(ours) == registered, (sorted(registered - set(ours)), sorted(set(ours) - registered))
    for policy, names in POLICY_LISTS.items():
        assert all(policy_of(name) == policy for name in names)
    assert policy_of("relu") is None


def _lin(x, w):
    return F.linear(x, w)


# op, then the argument shapes and dtypes: None is the autocast dtype under test (inputs already in low precision,
# to show fp32 ops upcast them), a dtype is that dtype (fp32 inputs, to show lower-precision ops downcast them).
OPS = {
    # CastPolicy::lower_precision_fp
    "linear": (_lin, [((4, 8), torch.float32), ((6, 8), torch.float32)]),
    "mm": (torch.mm, [((4, 8), torch.float32), ((8, 6), torch.float32)]),
    "matmul": (torch.matmul, [((4, 8), torch.float32), ((8, 6), torch.float32)]),
    "bmm": (torch.bmm, [((2, 4, 8), torch.float32), ((2, 8, 6), torch.float32)]),
    "baddbmm": (torch.baddbmm, [((2, 4, 6), torch.float32), ((2, 4, 8), torch.float32), ((2, 8, 6), torch.float32)]),
    "conv2d": (F.conv2d, [((1, 3, 8, 8), torch.float32), ((4, 3, 3, 3), torch.float32)]),
    # CastPolicy::fp32
    "layer_norm": (lambda x: F.layer_norm(x, (8,)), [((4, 8), None)]),
    "group_norm": (lambda x: F.group_norm(x, 2), [((2, 4, 3, 3), None)]),
    "rms_norm": (lambda x: F.rms_norm(x, (8,)), [((4, 8), None)]),
    "exp": (torch.exp, [((4, 8), None)]),
    "pow": (lambda x: x.pow(2), [((4, 8), None)]),
    "mse_loss": (F.mse_loss, [((4, 8), None), ((4, 8), None)]),
    "bce_with_logits": (F.binary_cross_entropy_with_logits, [((4, 8), None), ((4, 8), None)]),
    "upsample_nearest2d": (lambda x: F.interpolate(x, scale_factor=2.0), [((1, 2, 4, 4), None)]),
    # CastPolicy::fp32_set_opt_dtype / fp32_append_dtype
    "softmax": (lambda x: torch.softmax(x, -1), [((4, 8), None)]),
    "log_softmax": (lambda x: torch.log_softmax(x, -1), [((4, 8), None)]),
    "sum": (torch.sum, [((4, 8), None)]),
    "cumsum": (lambda x: x.cumsum(0), [((4, 8), None)]),
    "norm": (lambda x: x.norm(), [((4, 8), None)]),
    # CastPolicy::promote
    "addcmul": (torch.addcmul, [((4, 8), torch.float32), ((4, 8), None), ((4, 8), None)]),
    # no AutocastCUDA kernel: runs in its inputs' dtype (CPU autocast casts these to fp32, CUDA does not)
    "relu": (torch.relu, [((4, 8), None)]),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2), [((1, 2, 4, 4, 4), None)]),
    "reflection_pad2d": (lambda x: F.pad(x, (1, 1, 1, 1), mode="reflect"), [((1, 2, 4, 4), None)]),
}


def _args(specs, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    return [torch.randn(shape, dtype=d or dtype, device=device) for shape, d in specs]


def _cuda_dtype(fn, specs, dtype: torch.dtype) -> torch.dtype:
    """What CUDA autocast really produces: the AutocastCUDA C++ kernels on fake CUDA tensors (forward only)."""
    with FakeTensorMode():
        args = _args(specs, dtype, "cuda")
        with cuda_autocast_state(dtype):
            return fn(*args).dtype


def _emulated_dtype(fn, specs, dtype: torch.dtype) -> torch.dtype:
    """What autofit's simulation produces: CPU autocast under CUDA's policy, on fake CPU tensors."""
    with FakeTensorMode(), cuda_autocast_policy(dtype):
        args = _args(specs, dtype, "cpu")
        with torch.autocast("cpu", dtype=dtype):
            return fn(*args).dtype


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(OPS))
def test_emulated_policy_matches_cuda_autocast_on_fake_cuda_tensors(name, dtype):
    # Source: autocast_mode.cpp (AutocastCUDA registrations) and autocast_mode.h (cached_cast, CastPolicy).
    fn, specs = OPS[name]
    assert _emulated_dtype(fn, specs, dtype) == _cuda_dtype(fn, specs, dtype)


# Composite ops with an AutocastCPU kernel but none for AutocastCUDA: on CUDA they decompose with autocast still on
# (the dispatcher's fallthrough for AutocastCUDA, autocast_mode.cpp `m.fallback(makeFallthrough())`), so their inner
# ops follow CUDA's policy: cross_entropy -> log_softmax in fp32, conv2d(padding="same") -> convolution in low
# precision. The emulation's "passthrough" kernel runs them under an ExcludeDispatchKeyGuard(AutocastCPU), which
# switches autocast off for the inner ops too.
COMPOSITE_OPS = {
    "cross_entropy": (lambda x: F.cross_entropy(x, torch.zeros(4, dtype=torch.long, device=x.device)),
                      [((4, 8), None)]),
    "conv2d_padding_same": (lambda x, w: F.conv2d(x, w, padding="same"),
                            [((1, 3, 8, 8), torch.float32), ((4, 3, 3, 3), torch.float32)]),
}


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(COMPOSITE_OPS))
def test_emulated_policy_matches_cuda_autocast_inside_composite_ops(name, dtype):
    fn, specs = COMPOSITE_OPS[name]
    assert _emulated_dtype(fn, specs, dtype) == _cuda_dtype(fn, specs, dtype)


def test_cpu_autocast_differs_from_cuda_without_the_emulation():
    # The emulation is needed: plain CPU autocast keeps layer_norm / softmax in bf16 (CPU's fp32 list is shorter),
    # CUDA runs them in fp32, and CPU autocast casts max_pool3d to fp32 where CUDA leaves it alone.
    for name in ("layer_norm", "softmax", "max_pool3d"):
        fn, specs = OPS[name]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = fn(*_args(specs, torch.bfloat16, "cpu")).dtype
        assert plain != _cuda_dtype(fn, specs, torch.bfloat16), name


def test_emulation_is_removed_after_the_context():
    # The emulation overrides AutocastCPU kernels through torch.library and must restore CPU autocast afterwards,
    # also when the body raises.
    def cpu_dtypes() -> list[torch.dtype]:
        out = []
        for name in ("layer_norm", "softmax", "max_pool3d", "linear"):
            fn, specs = OPS[name]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out.append(fn(*_args(specs, torch.bfloat16, "cpu")).dtype)
        return out

    before = cpu_dtypes()
    with cuda_autocast_policy(torch.bfloat16):
        inside = cpu_dtypes()
    assert inside != before
    assert cpu_dtypes() == before
    with pytest.raises(ValueError), cuda_autocast_policy(torch.bfloat16):
        raise ValueError("body fails")
    assert cpu_dtypes() == before


class _CountCasts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.casts += 1
        return func(*args, **(kwargs or {}))


def test_weight_casts_are_cached_within_an_autocast_region():
    # autocast_mode.cpp, cached_cast: an fp32 leaf that requires grad is cast to the low dtype once per autocast
    # region and reused (at::autocast::get_cached_casts), until the region exits (clear_cache). The input is not a
    # leaf parameter: it is cast on every call. (Not compared with fake CUDA: the cast records autograd history.)
    with FakeTensorMode():
        linear, x = nn.Linear(8, 6), torch.randn(4, 8)
        with cuda_autocast_policy(torch.bfloat16) as caster, torch.autocast("cpu", dtype=torch.bfloat16):
            with _CountCasts() as first:
                y1, y2 = linear(x), linear(x)
            assert (y1.dtype, y2.dtype) == (torch.bfloat16, torch.bfloat16)
            assert first.casts == 2 + 2  # weight and bias once, the input twice
            caster.clear()  # what torch.autocast does when its region exits
            with _CountCasts() as second:
                linear(x)
            assert second.casts == 3


def test_binary_cross_entropy_is_banned_undercuda_autocast_state():
    # autocast_mode.cpp: binary_cross_entropy is registered to `binary_cross_entropy_banned` for AutocastCUDA.
    assert policy_of("binary_cross_entropy") == "banned"
    with FakeTensorMode():
        x, y = torch.rand(4, 8, device="cuda"), torch.rand(4, 8, device="cuda")
        with cuda_autocast_state(torch.bfloat16), pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(x, y)
    with FakeTensorMode(), cuda_autocast_policy(torch.bfloat16):
        x, y = torch.rand(4, 8), torch.rand(4, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="with_logits"):
            F.binary_cross_entropy(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast itself allows it
        F.binary_cross_entropy(torch.rand(4, 8), torch.rand(4, 8))


# ---- scaled dot-product attention --------------------------------------------------------------------------------
# Source: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (select_sdp_backend: flash, then efficient, then
# math; check_flash_attention_hardware_support sm80+, check_dtypes_low_precision, check_for_attn_mask,
# check_head_dim_size_flash <= 256; check_mem_efficient_hardware_support sm50+, minimum_gemm_alignment,
# check_batch_size_and_num_heads_dense<supports_gqa>; sdp_utils_cpp.h check_tensor_shapes: 4-D inputs).
def _qkv(dtype, *, head_dim=64, heads=4, kv_heads=None, dims=4):
    shape = (2, heads, 16, head_dim)[-dims:]
    kv_shape = (2, kv_heads or heads, 16, head_dim)[-dims:]
    with torch.device("meta"):
        return torch.empty(shape, dtype=dtype), torch.empty(kv_shape, dtype=dtype), torch.empty(kv_shape, dtype=dtype)


MASK = torch.empty(16, 16, dtype=torch.bool, device="meta")

BACKENDS = [
    # gpu, dtype, keywords for _qkv, mask, enable_gqa, expected backend
    ("A100-80GB", torch.bfloat16, {}, None, False, "flash"),
    ("A100-80GB", torch.float16, {}, None, False, "flash"),
    ("H100-80GB", torch.bfloat16, {}, None, False, "flash"),
    ("L4", torch.float16, {"head_dim": 128}, None, False, "flash"),
    ("A100-80GB", torch.bfloat16, {}, MASK, False, "efficient"),  # flash takes no explicit mask
    ("A100-80GB", torch.bfloat16, {"head_dim": 320}, None, False, "efficient"),  # flash: head dim <= 256
    ("A100-80GB", torch.float32, {}, None, False, "efficient"),  # flash: fp16/bf16 only
    ("H100-80GB", torch.float32, {}, MASK, False, "efficient"),
    ("T4", torch.float16, {}, None, False, "efficient"),  # flash: sm80+
    ("V100-16GB", torch.float16, {}, None, False, "efficient"),
    ("T4", torch.float32, {}, None, False, "efficient"),
    ("A100-80GB", torch.bfloat16, {"heads": 8, "kv_heads": 2}, None, True, "flash"),  # flash supports GQA
    ("T4", torch.bfloat16, {}, None, False, "math"),  # efficient: bf16 needs sm80
    ("T4", torch.float16, {"head_dim": 6}, None, False, "math"),  # efficient: fp16 head dim % 8 on sm75
    ("A100-80GB", torch.float32, {"head_dim": 6}, None, False, "math"),  # efficient: fp32 head dim % 4 on sm80
    # efficient had no GQA support up to torch 2.13 (supports_gqa = false; pytorch#191085 adds it later)
    ("T4", torch.float16, {"heads": 8, "kv_heads": 2}, None, True, "math"),
    ("A100-80GB", torch.bfloat16, {"dims": 3}, None, False, "math"),  # fused kernels need 4-D inputs
]


@pytest.mark.parametrize(("gpu", "dtype", "shape", "mask", "gqa", "expected"), BACKENDS,
                         ids=[f"{b[0]}-{str(b[1])[6:]}-{b[5]}-{i}" for i, b in enumerate(BACKENDS)])
def test_sdpa_backend_follows_select_sdp_backend(gpu, dtype, shape, mask, gqa, expected):
    q, k, v = _qkv(dtype, **shape)
    assert sdpa_backend(q, k, v, mask, gpu_spec(gpu), enable_gqa=gqa) == expected


@pytest.mark.parametrize(("gpu", "dtype", "expected"), [
    # attention.cpp pads q/k/v to a multiple of 8 (pad_last_dim<8>) before _scaled_dot_product_flash_attention;
    # check_head_dim_size_flash only asks for equal head dims <= 256
    ("A100-80GB", torch.bfloat16, "flash"),
    # minimum_gemm_alignment: sm7x without tensor cores for fp32 -> alignment 1, so any head dim runs efficient
    ("T4", torch.float32, "efficient"),
], ids=["flash-pads-head-dim", "sm75-fp32-alignment-1"])
def test_sdpa_backend_head_dim_not_multiple_of_8(gpu, dtype, expected):
    q, k, v = _qkv(dtype, head_dim=6)
    assert sdpa_backend(q, k, v, None, gpu_spec(gpu)) == expected


def test_flash_attention_saves_output_and_fp32_logsumexp_not_the_attention_matrix():
    # attention.cu _flash_attention_forward returns softmax_lse (B, H, S) fp32; derivatives.yaml saves query, key,
    # value, output and logsumexp for _scaled_dot_product_flash_attention_backward.
    b, h, s, d = 2, 4, 128, 64
    with FakeTensorMode(), cuda_kernels(gpu_spec("A100-80GB")):
        q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert "FlashAttentionBackward" in type(out.grad_fn).__name__
        assert "ForCpu" not in type(out.grad_fn).__name__
        saved = {(tuple(t.shape), t.dtype) for t in saved_tensors(out)}
    assert ((b, h, s), torch.float32) in saved  # logsumexp
    assert ((b, h, s, d), torch.bfloat16) in saved  # output (and q, k, v)
    assert not any(shape[-2:] == (s, s) for shape, _ in saved)


def test_math_attention_saves_the_attention_matrix():
    # sdp_utils.cpp: on T4 with head dim 6 neither fused kernel applies; _scaled_dot_product_attention_math saves
    # the (B, H, S, S) softmax for backward.
    b, h, s, d = 2, 2, 128, 6
    with FakeTensorMode(), cuda_kernels(gpu_spec("T4")):
        q, k, v = (torch.randn(b, h, s, d, dtype=torch.float16, requires_grad=True) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v)
        saved = [tuple(t.shape) for t in saved_tensors(out)]
    assert any(shape[-2:] == (s, s) for shape in saved)


def test_cuda_kernels_are_removed_after_the_context():
    with FakeTensorMode():
        q = torch.randn(1, 1, 8, 8, requires_grad=True)
        with cuda_kernels(gpu_spec("A100-80GB")):
            inside = type(F.scaled_dot_product_attention(q, q, q).grad_fn).__name__
        after = type(F.scaled_dot_product_attention(q, q, q).grad_fn).__name__
    assert "Efficient" in inside  # fp32 on sm80: memory-efficient kernel
    assert "ForCpu" in after


class _Attention(nn.Module):
    """Nothing but a projection and SDPA, so attention's saved tensors dominate the activations."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)


def _attention_activations(gpu: str, dim: int, heads: int, precision: str, seq: int) -> int:
    x = torch.randn(2, seq, dim)
    est = autofit.estimate(_Attention(dim, heads), x, target=torch.randn(2, seq, dim), loss_fn=F.mse_loss,
                           step=2, precision=precision, device=autofit.Device(gpu=gpu))
    return est.breakdown[Category.ACTIVATIONS.value]


@pytest.mark.sim
def test_estimate_activations_grow_linearly_with_fused_attention_and_quadratically_with_math():
    # flash (A100, bf16, head dim 64) keeps O(S) per head; math (T4, fp16, head dim 6) keeps the S x S matrix.
    flash = [_attention_activations("A100-80GB", 64, 1, "bf16", s) for s in (256, 1024)]
    math = [_attention_activations("T4", 12, 2, "fp16", s) for s in (256, 1024)]
    assert 3.5 < flash[1] / flash[0] < 5  # 4x the sequence, ~4x the activations
    assert math[1] / math[0] > 12  # ~16x


# ---- caching allocator -------------------------------------------------------------------------------------------
# Source: c10/cuda/CUDACachingAllocator.cpp (round_size, get_allocation_size, get_free_block, should_split,
# try_merge_blocks; kMinBlockSize 512, kSmallSize 1 MiB, kSmallBuffer 2 MiB, kLargeBuffer 20 MiB,
# kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB).
@pytest.mark.parametrize(("size", "rounded"), [
    (0, 512), (1, 512), (511, 512), (512, 512), (513, 1024), (1024, 1024), (1025, 1536),
    (MiB - 1, MiB), (MiB, MiB), (MiB + 1, MiB + 512),
])
def test_round_size(size, rounded):
    assert round_size(size) == rounded


@pytest.mark.parametrize(("size", "segment"), [
    (512, 2 * MiB), (MiB, 2 * MiB),  # small pool: kSmallBuffer
    (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),  # large, under kMinLargeAlloc: kLargeBuffer
    (10 * MiB, 10 * MiB), (10 * MiB + 512, 12 * MiB), (21 * MiB, 22 * MiB),  # else rounded up to kRoundLarge
])
def test_segment_size(size, segment):
    assert segment_size(size) == segment


def test_allocator_reuses_a_freed_small_block_best_fit():
    a = CachingAllocator()
    first = a.malloc(1000)  # 1024 bytes from a new 2 MiB small segment, the rest split off
    a.malloc(512)
    assert (a.allocated, a.reserved) == (1536, 2 * MiB)
    a.free(first)
    assert a.allocated == 512
    again = a.malloc(1024)  # best fit: the freed 1024-byte block, not the 2 MiB - 1536 rest
    assert (again.segment, again.offset) == (first.segment, 0)
    assert (a.allocated, a.reserved) == (1536, 2 * MiB)


def test_allocator_splits_small_blocks_down_to_512_bytes():
    a = CachingAllocator()
    a.malloc(MiB)  # 2 MiB small segment, 1 MiB rest (>= 512 bytes: split)
    a.malloc(MiB)  # takes the rest exactly
    assert (a.allocated, a.reserved) == (2 * MiB, 2 * MiB)
    a.malloc(512)  # nothing free: a second small segment
    assert (a.allocated, a.reserved, a.segments) == (2 * MiB + 512, 4 * MiB, 2)


def test_allocator_splits_large_blocks_only_when_more_than_1_mib_remains():
    a = CachingAllocator()
    a.malloc(MiB + 512 * 3)  # 20 MiB segment; the rest (> 1 MiB) is split off
    assert (a.allocated, a.reserved) == (MiB + 1536, 20 * MiB)
    b = CachingAllocator()
    b.malloc(19 * MiB + 512)  # >= 10 MiB: a 20 MiB segment; 1 MiB - 512 would remain: not split
    assert (b.allocated, b.reserved) == (20 * MiB, 20 * MiB)  # the whole block counts as allocated
    b.malloc(512 * 1024 + 512)  # the small pool never borrows from the large one
    assert b.reserved == 22 * MiB


def test_allocator_opens_a_new_segment_when_nothing_fits():
    a = CachingAllocator()
    for _ in range(2):
        a.malloc(4 * MiB)  # 20 MiB segment: 4 + 4 used, 12 free
    a.malloc(12 * MiB)  # fits the rest exactly
    assert (a.allocated, a.reserved, a.segments) == (20 * MiB, 20 * MiB, 1)
    a.malloc(2 * MiB)  # nothing free: a new 20 MiB segment
    assert (a.allocated, a.reserved, a.segments) == (22 * MiB, 40 * MiB, 2)


def test_allocator_merges_freed_neighbours():
    a = CachingAllocator()
    x, y, z = a.malloc(4 * MiB), a.malloc(4 * MiB), a.malloc(12 * MiB)  # one full 20 MiB segment
    a.free(x)
    a.free(y)  # merges with x: one free 8 MiB block
    a.malloc(8 * MiB)  # fits the merged block: no new segment
    assert (a.allocated, a.reserved, a.segments) == (20 * MiB, 20 * MiB, 1)
    b = CachingAllocator()
    x, y, z = b.malloc(4 * MiB), b.malloc(4 * MiB), b.malloc(12 * MiB)
    b.free(x)
    b.free(z)
    b.free(y)  # merges with both neighbours: the whole segment is one free block again
    b.malloc(20 * MiB)
    assert (b.allocated, b.reserved, b.segments) == (20 * MiB, 20 * MiB, 1)
    c = CachingAllocator()
    x, y, z = c.malloc(4 * MiB), c.malloc(4 * MiB), c.malloc(12 * MiB)
    c.free(x)
    c.free(z)  # 4 MiB and 12 MiB free, not adjacent
    c.malloc(16 * MiB)
    assert c.segments == 2


def _storage(nbytes: int) -> StorageRecord:
    return StorageRecord(nbytes=nbytes, category=Category.ACTIVATIONS, op=-1, module="", phase=Phase.FORWARD)


def _timeline() -> Timeline:
    t = Timeline()
    small = t.new_storage(_storage(1000))
    big = t.new_storage(_storage(12_451_840))  # exactly what the workspace's 20 MiB segment has left
    t.free(big)
    t.new_storage(_storage(12_451_841))  # 512 bytes too many: a new 12 MiB segment, not split
    t.free(small)
    return t


def test_replay_allocator_over_a_timeline_with_the_cublas_workspace():
    workspace = 8_519_680  # persistent: 20 MiB large segment, 12,451,840 bytes split off
    replay_ = replay_allocator(_timeline(), persistent=(workspace,))
    assert replay_.peak_allocated == workspace + 1024 + 12 * MiB
    assert replay_.peak_reserved == 20 * MiB + 2 * MiB + 12 * MiB
    assert replay_.raw_at_peak == workspace + 1000 + 12_451_841


def test_cuda_memory_terms_add_up(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("AUTOFIT_CUDA_CONTEXT_MIB", raising=False)
    timeline = _timeline()
    peak, device_bytes, breakdown = cuda_memory(timeline, replay(timeline), gpu_spec("A100-80GB"))
    workspace = 8_519_680
    assert peak == workspace + 1024 + 12 * MiB
    assert breakdown[Category.CUBLAS_WORKSPACE] == workspace
    assert breakdown[Category.ACTIVATIONS] == 1000 + 12_451_841
    assert breakdown[Category.ALLOCATOR_ROUNDING] == peak - workspace - (1000 + 12_451_841)
    assert breakdown[Category.FRAGMENTATION] == 34 * MiB - peak
    assert breakdown[Category.CUDA_CONTEXT] == CUDA_CONTEXT_BYTES
    assert device_bytes == 34 * MiB + CUDA_CONTEXT_BYTES == sum(breakdown.values())


# ---- cuBLAS workspace and CUDA context ---------------------------------------------------------------------------
# Source: aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize: ":4096:2:16:8" by default, 32 MiB
# (4096 KiB x 8) on compute capability 9.x / 10.x / 12.x; CUBLAS_WORKSPACE_CONFIG ":SIZE_KiB:COUNT" pairs override.
def test_cublas_workspace_default_per_architecture(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    for name in ("V100-16GB", "T4", "A10G", "L4", "L40S", "A100-40GB", "A100-80GB", "RTX-3090", "RTX-4090"):
        assert cublas_workspace_bytes(gpu_spec(name)) == 8_519_680, name
    for name in ("H100-80GB", "H200"):
        assert cublas_workspace_bytes(gpu_spec(name)) == 33_554_432, name


@pytest.mark.sim
def test_cublas_workspace_config(monkeypatch):
    a100 = gpu_spec("A100-80GB")
    assert cublas_workspace_bytes(a100, ":4096:2:16:8") == 4096 * KiB * 2 + 16 * KiB * 8 == 8_519_680
    assert cublas_workspace_bytes(gpu_spec("H100"), ":4096:2:16:8") == 8_519_680  # overrides the sm90 default
    assert cublas_workspace_bytes(a100, ":16:8") == 16 * KiB * 8  # the deterministic-mode setting
    assert cublas_workspace_bytes(a100, ":4096:8") == 32 * MiB
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert cublas_workspace_bytes(a100) == 131_072
    est = autofit.estimate(_Attention(16, 2), torch.randn(2, 8, 16), step=2, loss_fn=lambda o: o.sum(),
                           device="A100-80GB")
    assert est.breakdown["cublas_workspace"] == 131_072


@pytest.mark.sim
def test_context_bytes_override(monkeypatch):
    monkeypatch.delenv("AUTOFIT_CUDA_CONTEXT_MIB", raising=False)
    assert context_bytes() == CUDA_CONTEXT_BYTES
    monkeypatch.setenv("AUTOFIT_CUDA_CONTEXT_MIB", "300")
    assert context_bytes() == 300 * MiB
    monkeypatch.setenv("AUTOFIT_CUDA_CONTEXT_MIB", "0.5")
    assert context_bytes() == MiB // 2
    monkeypatch.setenv("AUTOFIT_CUDA_CONTEXT_MIB", "300")
    est = autofit.estimate(_Attention(16, 2), torch.randn(2, 8, 16), step=2, loss_fn=lambda o: o.sum(),
                           device="A100-80GB")
    assert est.breakdown["cuda_context"] == 300 * MiB


# ---- GPU catalog -------------------------------------------------------------------------------------------------
# Source: NVIDIA datasheets / architecture whitepapers (cited per entry in autofit/cuda/catalog.py); compute
# capabilities from NVIDIA's "CUDA GPUs" table.
GiB = 1 << 30
CATALOG = {
    "V100-16GB": (16 * GiB, (7, 0), False), "V100-32GB": (32 * GiB, (7, 0), False), "T4": (16 * GiB, (7, 5), False),
    "A10G": (24 * GiB, (8, 6), True), "L4": (24 * GiB, (8, 9), True), "L40S": (48 * GiB, (8, 9), True),
    "A100-40GB": (40 * GiB, (8, 0), True), "A100-80GB": (80 * GiB, (8, 0), True),
    # NVIDIA's "141GB" is the same unit as the H100's "80GB": nvidia-smi shows 143,771 MiB (H100: 81,559 MiB)
    "H100-80GB": (80 * GiB, (9, 0), True), "H200": (141 * GiB, (9, 0), True),
    "RTX-3090": (24 * GiB, (8, 6), True), "RTX-4090": (24 * GiB, (8, 9), True),
    # the cards of issue 40 (figures and sources in tests/test_gpu_catalog.py)
    "RTX-3060": (12 * GiB, (8, 6), True), "RTX-4070": (12 * GiB, (8, 9), True),
    "RTX-4070-Ti": (12 * GiB, (8, 9), True), "RTX-4080": (16 * GiB, (8, 9), True),
    "RTX-5080": (16 * GiB, (12, 0), True), "RTX-5090": (32 * GiB, (12, 0), True),
    "RTX-A6000": (48 * GiB, (8, 6), True), "RTX-6000-Ada": (48 * GiB, (8, 9), True), "L40": (48 * GiB, (8, 9), True),
    "H100-PCIe": (80 * GiB, (9, 0), True), "H100-NVL": (94 * GiB, (9, 0), True), "H20": (96 * GiB, (9, 0), True),
    "B200": (180 * GiB, (10, 0), True), "MI300X": (192 * GiB, (9, 4), True), "MI325X": (256 * GiB, (9, 4), True),
}

@pytest.mark.parametrize("name", list(CATALOG))
def test_catalog_entry(name):
    spec = gpu_spec(name)
    memory, capability, bf16 = CATALOG[name]
    assert (spec.name, spec.memory_bytes, spec.compute_capability, spec.supports_bf16) == (name, memory, capability,
                                                                                          bf16)
    assert spec.fp32_flops > 0 and spec.fp16_flops > spec.fp32_flops and spec.bandwidth > 0 and spec.source
    assert (spec.tf32_flops > 0) == (capability >= (8, 0))  # TF32 tensor cores arrived with Ampere


# What torch.cuda.get_device_properties reports (name, total_memory in MiB, compute capability), about 0.5 GiB
# below nvidia-smi's total; ECC-enabled GDDR boards (T4, A10G, L4, L40S) expose 1/16 less than their nominal size.
DEVICES = [
    ("Tesla T4", 15_101, (7, 5), "T4"),
    ("Tesla V100-SXM2-16GB", 16_151, (7, 0), "V100-16GB"),
    ("Tesla V100-SXM2-32GB", 32_501, (7, 0), "V100-32GB"),
    ("NVIDIA A10G", 22_563, (8, 6), "A10G"),
    ("NVIDIA L4", 22_478, (8, 9), "L4"),
    ("NVIDIA L40S", 45_488, (8, 9), "L40S"),
    ("NVIDIA A100-SXM4-40GB", 40_536, (8, 0), "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", 81_251, (8, 0), "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", 81_090, (9, 0), "H100-80GB"),
    ("NVIDIA H200", 143_156, (9, 0), "H200"),
    ("NVIDIA GeForce RTX 3090", 24_268, (8, 6), "RTX-3090"),
    ("NVIDIA GeForce RTX 4090", 24_210, (8, 9), "RTX-4090"),
    # issue 40's cards: the nominal size less 512 MiB (no report at hand); the name decides the entry
    ("NVIDIA GeForce RTX 3060", 11_776, (8, 6), "RTX-3060"),
    ("NVIDIA GeForce RTX 4070 Ti", 11_776, (8, 9), "RTX-4070-Ti"),
    ("NVIDIA GeForce RTX 4070", 11_776, (8, 9), "RTX-4070"),
    ("NVIDIA RTX 6000 Ada Generation", 48_640, (8, 9), "RTX-6000-Ada"),
    ("NVIDIA L40", 48_640, (8, 9), "L40"),
    ("NVIDIA H100 PCIe", 81_408, (9, 0), "H100-PCIe"),
    ("NVIDIA H100 NVL", 95_744, (9, 0), "H100-NVL"),
    ("NVIDIA B200", 183_808, (10, 0), "B200"),
]


@pytest.mark.parametrize(("device_name", "mib", "capability", "expected"), DEVICES)
def test_resolve_gpu_detects_the_current_device(monkeypatch, device_name, mib, capability, expected):
    # target._detect: the catalog entry whose model name and memory match torch.cuda.get_device_properties
    props = SimpleNamespace(name=device_name, total_memory=mib * MiB, major=capability[0], minor=capability[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    spec, note = resolve_gpu(None)
    assert note is None
    assert spec.name == expected
    assert spec.memory_bytes == mib * MiB  # the device's own figure, for "90%" budgets
    assert spec.fp16_flops == gpu_spec(expected).fp16_flops


def test_resolve_gpu_on_an_unknown_device_keeps_its_name_memory_and_capability(monkeypatch):
    # (the B200, once unknown here, is in the catalog since issue 40: a card that is not stands in)
    props = SimpleNamespace(name="NVIDIA B300", total_memory=182_642 * MiB, major=10, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    spec, _ = resolve_gpu(None)
    assert (spec.name, spec.memory_bytes, spec.compute_capability) == ("NVIDIA B300", 182_642 * MiB, (10, 0))
    assert spec.fp16_flops == gpu_spec(DEFAULT_GPU).fp16_flops
    assert cublas_workspace_bytes(spec, config="") == 33_554_432  # sm 10.x: the 32 MiB default


def test_catalog_aliases_and_spellings():
    assert set(GPUS) == set(CATALOG)
    assert gpu_spec("a100 80gb").name == "A100-80GB"
    assert gpu_spec("A100_40GB").name == "A100-40GB"
    assert gpu_spec("H100").name == "H100-80GB"
    assert gpu_spec("NVIDIA H200").name == "H200"
    assert gpu_spec("RTX 4090").name == "RTX-4090"
    assert gpu_spec("v100").name == "V100-32GB"
    assert gpu_spec(gpu_spec("T4")) is gpu_spec("T4")


def test_unknown_gpu_lists_the_catalog():
    with pytest.raises(autofit.InvalidInputError) as info:
        gpu_spec("Z9000")
    message = str(info.value)
    assert "Z9000" in message and all(name in message for name in CATALOG)
    with pytest.raises(autofit.InvalidInputError, match="Z9000"):
        autofit.estimate(nn.Linear(4, 4), torch.randn(2, 4), step=2, loss_fn=lambda o: o.sum(),
                         device="Z9000")


def test_resolve_gpu_without_a_device_assumes_the_default():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: resolve_gpu(None) detects it")
    spec, note = resolve_gpu(None)
    assert spec.name == DEFAULT_GPU and DEFAULT_GPU in note
    assert resolve_gpu("T4") == (gpu_spec("T4"), None)


# ---- estimate and plan for a GPU ---------------------------------------------------------------------------------
CUDA_TERMS = ("cublas_workspace", "allocator_rounding", "fragmentation", "cuda_context")


@pytest.mark.sim
def test_cuda_estimate_fixed_terms_by_hand(zoo_case):
    """The terms of a CUDA estimate that do not depend on the model, each computed by hand from its source."""
    case = zoo_case("gpt_sdpa")
    est = autofit.estimate(case.model, case.sample, target=case.target, step=4, precision="bf16",
                           device="A100-80GB")
    assert est.device == "cuda"
    assert all(term in est.breakdown for term in CUDA_TERMS)
    assert "workspace" not in est.breakdown  # CPU kernel scratch is not part of the CUDA model
    # aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize: compute capability 8.0 (A100) is not 9.x/10.x/
    # 12.x, so the default ":4096:2:16:8" applies: 4096 KiB x 2 + 16 KiB x 8
    assert est.breakdown["cublas_workspace"] == 4096 * 1024 * 2 + 16 * 1024 * 8 == 8_519_680
    assert est.breakdown["cuda_context"] == 512 * MiB  # the documented assumption (docs/cuda.md, CUDA_CONTEXT_BYTES)
    # c10/cuda/CUDACachingAllocator.cpp: every block is rounded to kMinBlockSize (512 B), and every segment is
    # kSmallBuffer (2 MiB), kLargeBuffer (20 MiB) or a multiple of kRoundLarge (2 MiB), so reserved is whole 2 MiB
    assert est.peak_bytes % 512 == 0
    assert est.peak_reserved_bytes % (2 * MiB) == 0
    assert est.peak_bytes <= est.peak_reserved_bytes
    assert est.device_bytes == est.peak_reserved_bytes + 512 * MiB  # nvidia-smi: reserved + the context


@pytest.mark.sim
@pytest.mark.parametrize("name", ["gpt_sdpa", "resnet_bn"])
def test_plan_for_a_gpu(name, zoo_case):
    case = zoo_case(name)
    plan = autofit.plan(case.model, case.sample, budget="90%", device="A100-40GB", batch_size=16,
                        target=case.target, loss_fn=case.loss_fn)
    assert (plan.device, plan.gpu) == ("cuda", "A100-40GB")
    assert abs(plan.budget_bytes - 0.9 * 40 * GiB) <= 1  # "90%" of the catalog's memory
    assert plan.precision.name == "bf16"  # A100 has bf16 tensor cores: the fastest choice
    assert plan.peak_bytes <= plan.device_bytes <= plan.budget_bytes
    assert plan.micro_batch_size * plan.gradient_accumulation_steps >= 16
    assert all(term in plan.estimate.breakdown for term in CUDA_TERMS)


@pytest.mark.sim
def test_plan_on_t4_chooses_fp16(zoo_case):
    case = zoo_case("gpt_sdpa")
    plan = autofit.plan(case.model, case.sample, budget="90%", device="T4", batch_size=16,
                        target=case.target)
    assert plan.precision.name == "fp16"  # T4 has no bf16: "auto" falls back to fp16 autocast
    assert plan.device_bytes <= plan.budget_bytes


@pytest.mark.sim
def test_plan_for_a_gpu_respects_a_binding_budget(zoo_case):
    case = zoo_case("gpt_sdpa")
    kwargs = dict(device="A100-40GB", batch_size=256, target=case.target)
    roomy = autofit.plan(case.model, case.sample, budget="90%", **kwargs)
    # Below what the fastest plan reserves with room to spare, but above the smallest budget it runs under (the
    # allocator frees its cached segments, Note [allocating under a cap]): the same plan, holding what the cap allows.
    needs = roomy.estimate.min_device_bytes
    assert needs < roomy.device_bytes - 3 * MiB
    same = autofit.plan(case.model, case.sample, budget=roomy.device_bytes - 3 * MiB, **kwargs)
    assert (same.micro_batch_size, same.checkpoint) == (roomy.micro_batch_size, roomy.checkpoint)
    assert same.peak_bytes + CUDA_CONTEXT_BYTES <= same.device_bytes <= same.budget_bytes
    assert any("frees" in n and "cached segment" in n for n in same.estimate.notes)
    budget = needs - 3 * MiB  # below what the fastest plan needs
    tight = autofit.plan(case.model, case.sample, budget=budget, **kwargs)
    assert tight.device_bytes <= tight.budget_bytes == budget
    assert (tight.micro_batch_size, tight.checkpoint) != (roomy.micro_batch_size, roomy.checkpoint)
    # (the plan's figures against a real GPU's allocator: tests/test_gpu.py, pytest -m gpu)
    assert "A100-40GB" in str(tight)


# ---- benchmarks/gpu_validate.py ----------------------------------------------------------------------------------
def test_gpu_validate_without_cuda_says_so_and_exits_0():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run benchmarks/gpu_validate.py itself")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_validate.py")], capture_output=True,
                          text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no CUDA device: nothing to validate"


def test_weight_cast_cache_is_cleared_when_an_autocast_region_closes():
    # torch/amp/autocast_mode.py: __exit__ calls torch.clear_autocast_cache() when the outermost region closes. That
    # includes the region non-reentrant checkpoint opens to recompute a module during backward; the emulation's own
    # cache must be emptied then too, or recomputed weight casts would pile up through backward.
    layer = torch.nn.Linear(8, 8)
    with cuda_autocast_policy(torch.bfloat16) as caster:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(torch.randn(2, 8))
            assert len(caster.cache) == 2  # the weight and the bias, cast once each
        assert len(caster.cache) == 0
