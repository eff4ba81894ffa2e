"""Registry of the places where a fake kernel disagrees with the CPU kernel, and how each is corrected.

A fake (meta) kernel is written for shape inference and for the device its authors had in mind; the CPU kernel the
allocator sees can differ. Two kinds of correction exist:

- ``fake``: the fake kernel refuses inputs the CPU kernel accepts, or returns other shapes, strides or dtypes that a
  probe cannot repair because the fake kernel raises first, or outputs that share a storage (FakeTensorMode's
  dispatch cache splits those on a hit but not on the first call). The registered function *replaces* the fake
  kernel: it builds the CPU kernel's outputs as empty fake tensors.
- ``probe``: the fake kernel runs, and the CPU kernel probe (``probe.py``) measures the real outputs; the tracker
  replaces the fake outputs by them (``_match_real_outputs`` in ``tracker.py``). ``probe_inputs`` may give the probe
  other values than the default fill, for kernels whose memory depends on the data (a worst case).

One small function per aten op, registered with :func:`correction`, which refuses duplicates
(``torch/utils/flop_counter.py`` keeps its FLOP formulas the same way). Each docstring names the torch source.
An op the probe had to correct that is not registered here is reported in the estimate's notes.

Ops of other libraries (``bitsandbytes::gemm_4bit``) are registered by their qualified name, a string, so that
this module does not import the library: the op exists only once the library is imported. The CPU kernel probe
runs on ``aten`` ops and on the ops registered here, no others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autofit.core._torch import FakeTensor

__all__ = ["Correction", "CORRECTIONS", "FakeKernelStricter", "correction", "fake_kernel", "probe_inputs",
           "registered"]

aten = torch.ops.aten


@dataclass(frozen=True, kw_only=True)
class Correction:
    op: Any  # torch._ops.OpOverload, or the qualified name of another library's op ("bitsandbytes::gemm_4bit")
    kind: str  # "fake" (replaces the fake kernel) or "probe" (outputs taken from the CPU kernel probe)
    doc: str  # what differs, and the torch source
    fake: Callable[..., Any] | None = None  # (*args, **kwargs) -> outputs, on fake tensors
    probe_inputs: Callable[..., tuple[tuple, dict]] | None = None  # real args, kwargs for the probe


CORRECTIONS: dict[Any, Correction] = {}


class FakeKernelStricter(Exception):
    """An op's fake kernel raised where its CPU kernel accepts the same inputs, and no correction is registered:
    the simulation cannot go on with fake tensors, so the step runs for real (Note [data-dependent models])."""

    def __init__(self, op: str, error: Exception) -> None:
        super().__init__(f"the fake kernel of {op} raised {type(error).__name__}: {str(error).splitlines()[0]}; "
                         "its CPU kernel accepts these inputs, and autofit/capture/corrections.py has no correction for it")
        self.op = op


def correction(*ops, kind: str, probe_inputs: Callable | None = None):
    """Register the decorated function as the correction of ``ops`` (a ``fake`` kernel, or for ``probe`` kinds a
    function whose docstring documents the disagreement). Refuses an op registered twice."""
    if kind not in ("fake", "probe"):
        raise ValueError(f"correction kind must be 'fake' or 'probe', got {kind!r}")

    def register(fn: Callable) -> Callable:
        for op in ops:
            if op in CORRECTIONS:
                raise ValueError(f"a correction for {op} is already registered ({CORRECTIONS[op].doc[:60]}...)")
        doc = (fn.__doc__ or "").strip()
        if not doc:
            raise ValueError(f"correction {fn.__name__} needs a docstring citing its torch source")
        for op in ops:
            CORRECTIONS[op] = Correction(op=op, kind=kind, doc=doc, fake=fn if kind == "fake" else None,
                                         probe_inputs=probe_inputs)
        return fn

    return register


def registered(func) -> Correction | None:
    """The correction registered for ``func`` (an OpOverload), by the op itself or by its qualified name."""
    entry = CORRECTIONS.get(func)
    if entry is None and func.namespace != "aten":
        entry = CORRECTIONS.get(func.name())
    return entry


def fake_kernel(func, args: tuple, kwargs: dict) -> Callable | None:
    """The registered replacement of ``func``'s fake kernel, if the call is on fake tensors."""
    entry = registered(func)
    if entry is None or entry.fake is None:
        return None
    if not any(isinstance(a, FakeTensor) for a in args):
        return None  # a real run (Note [data-dependent models]) runs the real kernel
    return entry.fake


def probe_inputs(func) -> Callable | None:
    entry = registered(func)
    return entry.probe_inputs if entry is not None else None


# ---- grouped GEMM (mixture-of-experts layers) ----------------------------------------------------------------------
def _grouped_mm_worst_case(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Offsets that put every row in the first group: the largest single GEMM the routing allows, so the scratch
    the probe measures bounds any routing (the CPU kernel runs one ``mm`` per group, see below). The default probe
    fill (zeros) would make every group empty and measure no GEMM at all."""
    mat_a, mat_b, *rest = args
    offs = rest[0] if rest else kwargs.get("offs")
    if offs is None:
        return args, kwargs
    # the dimension the offsets split: rows of mat_a (2d x 3d), the contraction (2d x 2d), columns of mat_b (3d x 2d)
    rows = {(2, 3): mat_a.shape[0], (2, 2): mat_a.shape[1], (3, 2): mat_b.shape[1]}.get((mat_a.dim(), mat_b.dim()))
    if rows is None:
        return args, kwargs
    full = torch.full(tuple(offs.shape), rows, dtype=offs.dtype)
    if rest:
        return (mat_a, mat_b, full, *rest[1:]), kwargs
    return args, {**kwargs, "offs": full}


@correction(aten._grouped_mm.default, kind="fake", probe_inputs=_grouped_mm_worst_case)
def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The meta kernel (torch/_meta_registrations.py, ``_meta_grouped_mm_common``) implements the CUDA checks and
    refuses anything but bf16; the CPU kernel (aten/src/ATen/native/Blas.cpp ``_grouped_mm``, checks in
    GroupedMMUtils.h ``_grouped_mm_validate_inputs``) accepts fp32, bf16 and fp16, with the output in ``mat_a``'s
    dtype (``_resolve_grouped_mm_out_dtype``). Its output is ``create_grouped_gemm_output_tensor``: the last
    dimension's stride padded to 16 bytes (the meta kernel pads only on CUDA builds). The memory of the kernel
    itself does not depend on the routing: the output shape is fixed by the rows, and ``_grouped_mm_fallback`` runs
    one ``mm_out`` per group into slices of it."""
    valid = (torch.float32, torch.bfloat16, torch.float16)
    torch._check(mat_a.dtype in valid and mat_b.dtype in valid,
                 lambda: f"Expected mat_a and mat_b to be Float32, BFloat16 or Float16, got {mat_a.dtype}, "
                         f"{mat_b.dtype}")
    torch._check(out_dtype is None or out_dtype == mat_a.dtype,
                 lambda: "Grouped gemm output dtype must match `mat_a` dtype")
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    elif a2:
        size = [mat_a.shape[0], mat_b.shape[-1]]
    elif b2:
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    alignment = 16 // mat_a.element_size()
    padded = (size[-1] + alignment - 1) // alignment * alignment
    stride = [padded, 1] if a2 != b2 else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=mat_a.dtype, device=mat_a.device)


# ---- corrected from the probe's real outputs (see _match_real_outputs in tracker.py) --------------------------------
@correction(aten.mkldnn_rnn_layer.default, kind="probe")
def _mkldnn_rnn_layer():
    """The fake kernel returns an empty workspace; the CPU kernel (aten/src/ATen/native/mkldnn/RNN.cpp,
    ``mkldnn_rnn_layer``) returns oneDNN's training workspace, kept for backward (why MemTracker is low on
    ``nn.LSTM``). Corrected to the probed size."""


@correction(aten.mkldnn_rnn_layer_backward.default, kind="fake")
def _mkldnn_rnn_layer_backward(*args):
    """The meta kernel (torch/_meta_registrations.py, ``mkldnn_rnn_layer_backward``) returns one tensor for both bias
    gradients; the CPU kernel (aten/src/ATen/native/mkldnn/RNN.cpp, ``mkldnn_rnn_layer_backward``) returns them in
    storages of their own. FakeTensorMode's dispatch cache does not keep outputs aliased either: a cache hit returns
    them apart, the first (uncached) call together, so before this replacement the first simulation of an LSTM in a
    process (on a GPU target, where no probe corrects it) differed from every later one. The replacement returns
    the meta kernel's shapes and dtypes with the two bias gradients apart, every time."""
    # the op's 23 positional arguments by their schema names (input, weight1..weight4, hx_, cx_tmp, ..., mode,
    # hidden_size, ...): the replacement reads 8 of them
    arg = dict(zip((a.name for a in aten.mkldnn_rnn_layer_backward.default._schema.arguments), args))
    input, hx, cx = arg["input"], arg["hx_"], arg["cx_tmp"]
    diff_x = input.new_empty(input.shape, dtype=torch.float)
    diff_hx = hx.new_empty(hx.shape, dtype=torch.float)
    diff_cx = cx.new_empty(cx.shape, dtype=torch.float)
    diff_w1 = arg["weight1"].new_empty(arg["weight1"].shape, dtype=torch.float)
    diff_w2 = arg["weight2"].new_empty(arg["weight2"].shape, dtype=torch.float)
    gru = 3  # the GRU mode: its shuffled bias has 4 x hidden entries; LSTM and RNN keep bias_ih's size
    bias = arg["weight3"]
    bias_size = 4 * arg["hidden_size"] if arg["mode"] == gru else bias.shape[0]
    diff_b1 = bias.new_empty([bias_size], dtype=torch.float)
    diff_b2 = bias.new_empty([bias_size], dtype=torch.float)
    return diff_x, diff_w1, diff_w2, diff_b1, diff_b2, diff_hx, diff_cx


@correction(aten.mse_loss.default, kind="probe")
def _mse_loss():
    """The CPU kernel (aten/src/ATen/native/Loss.cpp, ``mse_loss``) computes the element-wise loss into a buffer as
    large as the input and returns the reduced 0-dim result as a view of it; the fake kernel returns one element.
    Tracked at the buffer's size."""


@correction(aten.native_batch_norm.default, aten.native_layer_norm.default, aten.native_group_norm.default,
            aten.native_group_norm_backward.default, kind="probe")
def _mixed_dtype_norms():
    """With low-precision input and fp32 weight (autocast leaves the parameters in fp32), the CPU kernels return fp32
    statistics and parameter gradients (aten/src/ATen/native/mixed_dtype.h ``is_mixed_type`` /
    ``param_scalar_type``, used by Normalization.cpp ``batch_norm_cpu``, layer_norm.cpp ``layer_norm_cpu``,
    group_norm.cpp ``native_group_norm``); the fake kernels return them in the input's dtype. Output dtypes
    corrected."""


# ---- torch's functional collectives (the simulation's fake process group) ------------------------------------------
@correction("_c10d_functional::wait_tensor", kind="fake")
def _wait_tensor(tensor):
    """``wait_tensor`` waits for the collective that writes ``tensor`` and returns that same tensor
    (torch/csrc/distributed/c10d/Functional.cpp, ``wait_tensor``: ``return tensor``), but its fake kernel returns a
    new one (``empty_like``), so a simulated collective held its output twice until both died: a tensor-parallel
    output head gathering its logits ("colwise_rep", ``ColwiseParallel(output_layouts=Replicate())``) was priced
    a whole gathered logits tensor high (Note [tensor parallel plan], autofit/parallel/tensor_parallel.py). The
    input is returned, as the CPU kernel does."""
    return tensor


# ---- other libraries' ops, by qualified name ------------------------------------------------------------------------
@correction("bitsandbytes::gemm_4bit", "bitsandbytes::gemv_4bit", "bitsandbytes::dequantize_4bit",
            "bitsandbytes::dequantize_blockwise", kind="probe")
def _bitsandbytes_dequantizing_kernels():
    """bitsandbytes' 4-bit matmul dequantizes the whole weight inside one op: the CPU kernel of ``gemm_4bit``
    (bitsandbytes/backends/default/ops.py, ``_gemm_4bit_default_impl``, registered for CompositeExplicitAutograd)
    dequantizes the 8-bit absmax of double quantization (``dequantize_blockwise`` plus the offset: two fp32 tensors
    of one value per block), then the weight (``dequantize_4bit``: an [out, in] tensor in the input's dtype), and
    multiplies; its fake kernel (bitsandbytes/_ops.py) returns only the product, so the probe measures the
    dequantized weight as the op's scratch. ``gemv_4bit`` does the same (``default/ops.py``), and the CPU kernels of
    ``dequantize_4bit`` and ``dequantize_blockwise`` (``backends/cpu/ops.py``) fall back to a Python
    implementation with int32 and fp32 temporaries of the weight's size for odd shapes and, with AVX-512, block
    sizes from 2048."""


@correction("bitsandbytes::optimizer_update_8bit_blockwise", "bitsandbytes::optimizer_update_32bit", kind="probe")
def _bitsandbytes_optimizer_updates():
    """bitsandbytes' optimizer updates mutate the state in place and return nothing, so their fake kernels
    (bitsandbytes/_ops.py) allocate nothing; on the CPU the 8-bit update (bitsandbytes/backends/cpu/ops.py,
    ``_optimizer_update_8bit_blockwise_cpu``) dequantizes both moments to fp32, updates them and the parameter, and
    quantizes them back, with fp32 temporaries of several parameter sizes. The probe measures them."""
