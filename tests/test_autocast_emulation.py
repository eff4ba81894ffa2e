"""The CPU simulation's CUDA autocast emulation runs the same aten ops in the same dtypes as CUDA autocast itself.

The truth is torch's own AutocastCUDA kernels, run on fake CUDA tensors (forward only: a fake CUDA backward aborts on
CPU-only builds). For each small composite below, the sequence of (aten op, output dtype) that CUDA autocast
dispatches must equal the one the emulation dispatches on fake CPU tensors: every cast copy the GPU makes (an fp32
op's upcast, the next fp16 matmul's downcast) is then a copy the simulation allocates too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autofit.cuda.autocast_lists import cuda_autocast_state
from autofit.cuda.autocast_policy import cuda_autocast_policy
from autofit.cuda.catalog import gpu_spec
from autofit.cuda.kernels import cuda_kernels

_IGNORED = ("prim.", "aten.detach", "aten.t.", "aten.view", "aten._unsafe_view", "aten.expand", "aten.transpose")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if not name.startswith(_IGNORED):
            first = out[0] if isinstance(out, tuple) else out
            self.seen.append((name, getattr(first, "dtype", None)))
        return out


def _cross_entropy(x, w, t):
    return F.cross_entropy(F.linear(x, w), t)  # logits fp16 from the matmul; log_softmax keeps them fp16


def _layer_norm_then_linear(x, w, t):
    return F.linear(F.layer_norm(x, (x.shape[-1],)), w)  # fp32 layer_norm, then a downcast for the matmul


def _softmax_then_matmul(x, w, t):
    scores = F.linear(x, w)
    return torch.matmul(torch.softmax(scores, dim=-1), scores.transpose(0, 1))  # fp32 softmax cast back to fp16


def _softmax_to_fp32_outside_autocast(x, w, t):
    # eager attention in many Hugging Face models: softmax(scores, dtype=torch.float32).to(query.dtype)
    return torch.softmax(x.half(), dim=-1, dtype=torch.float32).to(torch.float16)


def _gelu_mse(x, w, t):
    y = F.gelu(F.linear(x, w))  # gelu is not on any list: it stays fp16
    return F.mse_loss(y, torch.zeros_like(y))  # mse_loss is fp32


@pytest.mark.parametrize("fn", [_cross_entropy, _layer_norm_then_linear, _softmax_then_matmul, _gelu_mse,
                                _softmax_to_fp32_outside_autocast])
def test_emulation_dispatches_what_cuda_autocast_dispatches(fn):
    def run(device: str) -> list[tuple[str, torch.dtype | None]]:
        recorder = _Ops()
        with FakeTensorMode():
            x = torch.zeros(8, 16, device=device)
            w = torch.zeros(32, 16, device=device)  # no requires_grad: autograd on fake CUDA aborts the process
            t = torch.zeros(8, dtype=torch.long, device=device)
            if device == "cuda":
                with cuda_autocast_state(torch.float16), recorder:
                    fn(x, w, t)
            else:
                with (cuda_kernels(gpu_spec("A100-80GB")), cuda_autocast_policy(torch.float16),
                      torch.autocast("cpu", dtype=torch.float16), recorder):
                    fn(x, w, t)
        return recorder.seen

    assert run("cpu") == run("cuda")


def test_fp16_softmax_backward_returns_fp16_without_an_fp32_copy():
    """SoftMax.cpp's CUDA branch: _softmax(x, dim, half_to_float=True) forward, and _softmax_backward_data hands back
    the fp16 gradient itself; the CPU path would make an fp32 copy of x forward and an fp32 gradient backward."""
    recorder = _Ops()
    with FakeTensorMode(), cuda_kernels(gpu_spec("A100-80GB")):
        x = torch.zeros(4, 64, dtype=torch.float16, requires_grad=True)
        with recorder:
            y = torch.softmax(x, dim=-1, dtype=torch.float32)
            y.sum().backward()
        assert x.grad.dtype == torch.float16
    assert ("aten._softmax.default", torch.float32) in recorder.seen
    assert ("aten._softmax_backward_data.default", torch.float16) in recorder.seen
    assert not any(name == "aten._to_copy.default" for name, _ in recorder.seen)
