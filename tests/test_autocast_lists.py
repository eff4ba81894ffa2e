"""CUDA autocast's op lists come from the running torch build (``autofit/cuda/autocast_lists.py``).

The independent truth is torch's source: the lists below are ``aten/src/ATen/autocast_mode.h`` (``AT_FORALL_LOWER_
PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``,
``AT_FORALL_PROMOTE``) and ``autocast_mode.cpp`` (the CUDA-only registrations and the banned
``binary_cross_entropy``) as torch 2.13 registers them. The hand-copied
table autofit used to carry had ``linalg_vector_norm`` and ``linalg_matrix_norm`` under fp32; ``autocast_mode.h``
has them under ``AT_FORALL_FP32_SET_OPT_DTYPE``, which is what the observation finds.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autofit.cuda import autocast_policy
from autofit.cuda.autocast_lists import autocast_cuda_lists, cuda_autocast_state, observed_policy, ops_with_kernel

# CastPolicy::lower_precision_fp: run in fp16/bf16 (tensor-core ops)
LOWER_PRECISION_FP = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)
# CastPolicy::fp32: numerically sensitive ops run in fp32
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa", "rms_norm",
)
# CastPolicy::fp32_set_opt_dtype: redispatched with dtype=float32 when no dtype is given
FP32_SET_OPT_DTYPE = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "sum",
                      "sum.dim_IntList", "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord")
# CastPolicy::fp32_append_dtype: redispatched to the overload that takes a dtype, with float32
FP32_APPEND_DTYPE = ("norm.Scalar", "norm.ScalarOpt_dim")
# CastPolicy::promote: run in the widest floating type among the inputs
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "tensordot",
           "scatter_add", "vdot")
# Banned under CUDA autocast (raises): binary_cross_entropy is unsafe in low precision
BANNED = ("binary_cross_entropy",)

REFERENCE = {"lower_precision_fp": LOWER_PRECISION_FP, "fp32": FP32, "fp32_set_opt_dtype": FP32_SET_OPT_DTYPE,
             "fp32_append_dtype": FP32_APPEND_DTYPE, "promote": PROMOTE, "banned": BANNED}


def test_every_op_with_an_autocast_cuda_kernel_is_classified():
    lists = autocast_cuda_lists()
    assert lists.unclassified == ()
    ours = [name for names in lists.by_policy.values() for name in names]
    assert sorted(ours) == list(ops_with_kernel("AutocastCUDA"))


def test_observed_policies_agree_with_autocast_mode_h():
    """Every op of the source's lists that this build registers has the source's policy; an op the build registers
    beyond them (torch 2.15: ``_cudnn_rnn``, ``linalg_matrix_sqrth``) is classified by observation alone."""
    registered = set(ops_with_kernel("AutocastCUDA"))
    for policy, names in REFERENCE.items():
        for name in names:
            if name in registered:
                assert autocast_policy.policy_of(name) == policy, name
    if torch.__version__.startswith("2.13"):  # the build the reference was copied for: nothing more, nothing less
        assert registered == {n for names in REFERENCE.values() for n in names}


def test_module_lists_are_the_observed_ones():
    for attribute, policy in (("LOWER_PRECISION_FP", "lower_precision_fp"), ("FP32", "fp32"),
                              ("FP32_SET_OPT_DTYPE", "fp32_set_opt_dtype"), ("PROMOTE", "promote")):
        assert getattr(autocast_policy, attribute) == autocast_cuda_lists().by_policy[policy]
    with pytest.raises(AttributeError):
        autocast_policy.NOT_A_LIST


@pytest.mark.parametrize("name, fn, dtype_in, dtype_out", [
    # what each policy means for the output dtype, observed on the real AutocastCUDA kernels (fake CUDA tensors)
    ("mm", lambda x: torch.mm(x, x), torch.float32, torch.float16),
    ("exp", torch.exp, torch.float16, torch.float32),
    ("linalg_vector_norm", torch.linalg.vector_norm, torch.float16, torch.float32),
    ("sum", torch.sum, torch.float16, torch.float32),
])
def test_policy_and_real_cuda_autocast_output_dtype(name, fn, dtype_in, dtype_out):
    assert observed_policy(name) is not None
    with FakeTensorMode():
        x = torch.zeros(4, 4, dtype=dtype_in, device="cuda")
        with cuda_autocast_state(torch.float16):
            assert fn(x).dtype == dtype_out


def test_set_opt_dtype_keeps_the_input_in_low_precision():
    """fp32_set_opt_dtype passes dtype=float32 down instead of casting the input: no fp32 copy of the input is made
    (the memory difference to fp32), as ``linalg_vector_norm``'s AutocastCUDA kernel shows on fake CUDA tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with FakeTensorMode():
        x = torch.zeros(4, 4, dtype=torch.float16, device="cuda")
        with cuda_autocast_state(torch.float16), Record():
            torch.linalg.vector_norm(x)
    assert torch.ops.aten._to_copy.default not in seen
