"""Composite ops whose CUDA branch differs from the CPU's (autofit/cuda/device_paths.py; docs/cuda.md, "Ops whose
CUDA path differs from the CPU's"): each modelled op against the ATen source's branch and a hand count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import autofit
from autofit.core._torch import has_dispatch_kernel
from autofit.core.categories import Category
from autofit.cuda.device_paths import CUDA_PATHS, cuda_path, cuda_paths
from autograd_saved import saved_tensors

MiB = 2**20
ROWS, DIM = 4096, 1024


def _saved(out: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    fn = out.grad_fn
    return [(tuple(getattr(fn, a).shape), getattr(fn, a).dtype) for a in dir(fn)
            if a.startswith("_saved_") and isinstance(getattr(fn, a), torch.Tensor)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_on_cuda_saves_a_bool_mask_not_the_noise(dtype):
    # Dropout.cpp: on CUDA dropout -> native_dropout, whose backward (derivatives.yaml) keeps the bool mask `result1`;
    # on the CPU _dropout_impl multiplies by a noise tensor of the input's dtype, which mul keeps.
    with FakeTensorMode():
        x = torch.randn(ROWS, DIM, dtype=dtype, requires_grad=True)
        cpu = _saved(F.dropout(x, 0.1))
        with cuda_paths():
            cuda = _saved(F.dropout(x, 0.1))
            assert "NativeDropoutBackward" in type(F.dropout(x, 0.1).grad_fn).__name__
    assert cpu == [((ROWS, DIM), dtype)]
    assert cuda == [((ROWS, DIM), torch.bool)]  # 4096 x 1024 x 1 byte = 4 MiB


def test_dropout_keeps_the_composite_branches_on_cuda():
    # Dropout.cpp: p == 0 or eval returns the input itself; dropout_ (in place), feature_dropout, alpha_dropout and
    # feature_alpha_dropout call _dropout_impl on every device, so they keep the noise tensor.
    with FakeTensorMode(), cuda_paths():
        x = torch.randn(8, 4, 6, requires_grad=True)
        assert F.dropout(x, 0.0) is x
        assert F.dropout(x, 0.5, training=False) is x
        assert _saved(F.dropout1d(x, 0.1)) == [((8, 4, 1), torch.float32)]  # make_feature_noise: (N, C, 1...)
        alpha = F.alpha_dropout(x, 0.1, training=True).grad_fn  # (input * noise).add_(b)
        assert "AddBackward" in type(alpha).__name__ and "MulBackward" in type(alpha.next_functions[0][0]).__name__
        assert "MulBackward" in type(F.dropout(x.clone(), 0.1, inplace=True).grad_fn).__name__


def test_dropout_path_is_removed_after_the_context():
    with FakeTensorMode():
        x = torch.randn(4, 4, requires_grad=True)
        with cuda_paths():
            pass
        assert "MulBackward" in type(F.dropout(x, 0.1).grad_fn).__name__


def test_a_second_cuda_path_for_an_op_is_refused():
    with pytest.raises(RuntimeError, match="already has a CUDA path"):
        cuda_path("dropout")(lambda *a: None)
    assert set(CUDA_PATHS) == {"dropout", "_fused_rms_norm"}


class _Dropped(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(p), nn.Linear(DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.sim
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_estimate_of_dropout_counts_the_mask(dtype):
    # Linear -> Dropout(0.1) -> Linear at 4096 rows. Without dropout the second Linear keeps the first one's output;
    # with it, it keeps dropout's output (the same size) and dropout adds its mask: 4096 x 1024 bool = 4 MiB in
    # fp32 and bf16 alike (the CPU's noise would be 16 MiB and 8 MiB).
    x = torch.randn(ROWS, DIM, dtype=dtype)

    def est(p: float, device: str):
        return autofit.estimate(_Dropped(p).to(dtype), x, step=ROWS, loss_fn=lambda o: o.float().sum(),
                                device=device)

    off, on = est(0.0, "cuda"), est(0.1, "cuda")
    act = Category.ACTIVATIONS.value
    assert on.breakdown[act] - off.breakdown[act] == ROWS * DIM
    assert on.peak_allocated_bytes - off.peak_allocated_bytes == 4 * MiB
    cpu_off, cpu_on = est(0.0, "cpu"), est(0.1, "cpu")
    assert cpu_on.breakdown[act] - cpu_off.breakdown[act] == ROWS * DIM * x.element_size()


def _saved_graph(out: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in saved_tensors(out)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_cuda_keeps_the_input_and_one_rstd_per_row(dtype):
    # layer_norm.cpp rms_norm_symint -> _fused_rms_norm; derivatives.yaml: the node keeps input, weight and
    # result1 (rstd, fp32 for 16-bit inputs). The CPU composite keeps the fp32 upcast and the normalised rows.
    with FakeTensorMode():
        x = torch.randn(ROWS, DIM, dtype=dtype, requires_grad=True)
        w = torch.ones(DIM, dtype=dtype, requires_grad=True)
        cpu = _saved_graph(F.rms_norm(x, (DIM,), w))
        with cuda_paths():
            y = F.rms_norm(x, (DIM,), w)
            cuda = _saved_graph(y)
            gx, gw = torch.autograd.grad(y.float().sum(), (x, w))
    assert sorted(cuda, key=str) == sorted([((ROWS, DIM), dtype), ((ROWS, 1), torch.float32), ((DIM,), dtype)],
                                           key=str)
    assert (tuple(gx.shape), gx.dtype, tuple(gw.shape)) == ((ROWS, DIM), dtype, (DIM,))
    # the CPU composite keeps the fp32 rows twice (pow's and mul's input, the normalised rows before the weight),
    # where this build's CPU has no kernel of its own for _fused_rms_norm (torch 2.13's CPU builds have none)
    if not has_dispatch_kernel("aten::_fused_rms_norm", "CPU"):
        assert sum(1 for shape, d in cpu if shape == (ROWS, DIM) and d == torch.float32) >= 2


def test_rms_norm_on_real_tensors_keeps_the_composite_values():
    # a step that runs for real (data-dependent models) must compute right values: the composite's
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    w = torch.rand(8, dtype=torch.bfloat16)
    expected = F.rms_norm(x, (8,), w, eps=1e-6)
    with cuda_paths():
        got = F.rms_norm(x, (8,), w, eps=1e-6)
    torch.testing.assert_close(got, expected)


class _Normed(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, DIM), nn.RMSNorm(DIM) if norm else nn.Identity(), nn.Linear(DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.sim
def test_cuda_estimate_of_rms_norm_by_hand():
    # Linear -> RMSNorm -> Linear, bf16, 4096 rows, on CUDA. Against Linear -> Identity -> Linear: the norm keeps
    # the first Linear's output (kept by the second Linear without it), the second Linear keeps the norm's output
    # (4096 x 1024 x 2 bytes = 8 MiB) and the norm keeps rstd (4096 x 4 bytes = 16 KiB).
    x = torch.randn(ROWS, DIM, dtype=torch.bfloat16)

    def est(norm: bool):
        return autofit.estimate(_Normed(norm).to(torch.bfloat16), x, step=ROWS,
                                loss_fn=lambda o: o.float().sum(), device="cuda")

    act = Category.ACTIVATIONS.value
    assert est(True).breakdown[act] - est(False).breakdown[act] == ROWS * DIM * 2 + ROWS * 4
