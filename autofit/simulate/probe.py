"""CPU kernel probes: what a real kernel allocates that its fake twin does not show.

A fake tensor says what an op *returns*; the CPU allocator also sees what the kernel allocates *inside* and frees
before returning: oneDNN's weight and activation reorders and its matmul scratchpad (bf16/fp16 GEMMs, convolutions),
type-promotion buffers of mixed-dtype element-wise ops, reduction buffers of low-precision means. Some fake kernels
also return other shapes than the CPU kernel (``mkldnn_rnn_layer``'s workspace is empty on fake tensors but a few
hundred KiB on the CPU, which is why PyTorch's MemTracker is 16 % low on ``nn.LSTM``), other dtypes (mixed-dtype
norms return fp32 statistics on the CPU, bf16 ones on fake tensors), aliased outputs the CPU kernel returns apart
(``mkldnn_rnn_layer_backward``'s bias gradients), or storages larger than their shape (CPU ``mse_loss`` returns a
0-dim view of a buffer as large as its input).

Those sizes depend on the oneDNN version, the instruction set and the thread count, so they are not written down
here: the prober runs the real kernel once per distinct signature (op, shapes, strides, dtypes, other arguments) on
real tensors of the full shapes and strides, floats filled with 0.5 and integers and booleans with 0 (see
``_real_like``), under the CPU profiler, and reads what the allocator saw, which is exactly the term the estimate
needs. Results are cached per process. Kernels whose tensor arguments (the storage each spans, outputs not counted)
together exceed ``max_probe_bytes`` are not probed (their scratch is small next to tensors that size); the estimate
lists how many were skipped. Creation, view and copy ops, and ops outside ``aten`` that autofit/capture/corrections.py
does not list, are never probed. A GEMM in a dtype this CPU's oneDNN has no kernel for is probed small first (Note
[small GEMM probes]).

Note [small GEMM probes]
    Where oneDNN has no kernel for a GEMM's dtype (bf16 or fp16 on a CPU without AVX-512, Note [CPU kernels] in
    autofit/core/cpu.py), ATen runs its reference loops (aten/src/ATen/native/cpu/BlasKernel.cpp, ``gemm_notrans_`` and
    its transposed siblings): about 1 GFLOP/s on two AVX2 cores, so probing one 2048 x 4096 x 11008 GEMM of a
    Llama-7B block takes minutes (issue 28: a 7B estimate ran for over 7 minutes where AVX-512 takes 11 s). Those
    loops keep their fp32 accumulators in ``std::make_unique`` buffers, which the CPU allocator never sees; what it can
    see are the contiguous copies ``addmm_impl_cpu_`` makes of operands whose layout the loops cannot read, a choice
    made on strides and on which sizes are 1, not on how large the sizes are. So the prober first runs the GEMM with
    every size above 1 cut to ``_SMALL`` and each tensor in the same memory order: when that allocates nothing
    beyond plain outputs, the full-size kernel takes the same path and has no scratch either, and is not run. When
    the small one does allocate (a copy), or an operand is not dense, the full-size probe runs as before. Estimates
    are byte-identical either way (tests/test_cpu_kernels.py compares them); where oneDNN has the kernel, its
    scratchpad depends on the sizes, and GEMMs are probed at full size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from autofit.core._torch import (
    disable_current_modes,
    pytree,
)
from autofit.core._torch_profiler import allocation_sizes, memory_profile
from autofit.capture.corrections import probe_inputs, registered
from autofit.core.cpu import cpu_kernels

__all__ = ["ProbeResult", "RealOutput", "KernelProber", "real_kernel_accepts"]

aten = torch.ops.aten

# Ops that allocate nothing beyond their outputs (or nothing at all): creation, views, metadata.
_NEVER_PROBE = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.zeros.default,
    aten.zeros_like.default, aten.ones.default, aten.ones_like.default, aten.full.default, aten.full_like.default,
    aten.scalar_tensor.default, aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.detach.default,
    aten.alias.default, aten._local_scalar_dense.default, aten.set_.source_Storage_storage_offset,
    aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
    aten.new_empty_strided.default, aten.resize_.default, aten.copy_.default, aten._to_copy.default,
    aten.clone.default, aten.zero_.default, aten.fill_.Scalar,
}


@dataclass(frozen=True)
class RealOutput:
    """What the CPU kernel really returned for one output."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    storage_bytes: int  # can exceed the shape's bytes (CPU mse_loss returns a 0-dim view of a full-size buffer)
    alias_of: int | None  # index of an earlier output sharing its storage, None if it has its own


@dataclass(frozen=True)
class ProbeResult:
    workspace: int  # bytes allocated and freed inside the kernel, beyond its outputs
    outputs: tuple[RealOutput | None, ...]  # per pytree leaf of the output, None for non-tensors


# GEMMs ATen runs with its reference loops where oneDNN has no kernel for their dtype (Note [small GEMM probes])
_GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.addbmm.default,
          aten.mv.default, aten.addmv.default, aten.dot.default}
_SMALL = 16  # sizes above 1 are cut to this in a small GEMM probe
_LOW_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class KernelProber:
    max_probe_bytes: int = 256 * 2**20  # a kernel whose tensor arguments span more bytes is not probed
    cache: dict[Any, ProbeResult | None] = field(default_factory=dict)
    skipped: int = 0  # kernels too large to probe in the last simulation
    failed: int = 0
    small: int = 0  # GEMMs a small probe showed to have no scratch, not run at full size (Note [small GEMM probes])

    def probe(self, func, args: tuple, kwargs: dict) -> ProbeResult | None:
        # another library's op is probed only where its correction asks for the probe ("fake" ones replace the kernel)
        if func in _NEVER_PROBE or func.is_view or (func.namespace != "aten" and getattr(registered(func), "kind",
                                                                                         None) != "probe"):
            return None
        leaves = pytree.tree_leaves((args, kwargs))
        key = (func, tuple(_signature(x) for x in leaves), pytree.tree_structure((args, kwargs)))
        if key in self.cache:
            return self.cache[key]
        size = sum(_extent(x) * x.element_size() for x in leaves if isinstance(x, torch.Tensor))
        if size > self.max_probe_bytes:
            self.skipped += 1
            return None
        try:
            if _reference_gemm(func, leaves) and _no_scratch_when_small(func, args, kwargs):
                self.small += 1
                result = None  # no workspace, outputs as the fake kernel gives them
            else:
                result = _run_probe(func, args, kwargs)
        except Exception:  # noqa: BLE001 - a kernel that rejects these inputs keeps its fake size, no workspace
            self.failed += 1
            result = None
        self.cache[key] = result
        return result


def _reference_gemm(func, leaves: list) -> bool:
    """A GEMM ATen runs with its reference loops on this CPU: its dtype has no oneDNN kernel here."""
    if func not in _GEMMS:
        return False
    dtype = next((x.dtype for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()), None)
    return dtype in _LOW_PRECISION and not cpu_kernels().native(_LOW_PRECISION[dtype])


def _no_scratch_when_small(func, args: tuple, kwargs: dict) -> bool:
    """Whether the GEMM, run with every size above 1 cut to ``_SMALL`` and each tensor in the same memory order,
    allocates nothing beyond plain outputs (Note [small GEMM probes]). False when an operand is not dense (its copy
    could depend on the gaps) or the small run allocates scratch or returns other outputs than a plain GEMM."""
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not all(_dense(t) for t in leaves):
        return False
    with disable_current_modes():
        small_args, small_kwargs = pytree.tree_map_only(torch.Tensor, _shrunk, (args, kwargs))
    result = _run_probe(func, small_args, small_kwargs)
    dtype = leaves[0].dtype
    return result.workspace == 0 and all(
        o is None or (o.alias_of is None and o.dtype == dtype and o.storage_bytes == _numel(o.shape) * dtype.itemsize)
        for o in result.outputs
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and without gaps: some order of its dims is contiguous (broadcast and size-1 dims aside)."""
    dims = sorted((d for d in range(t.dim()) if t.shape[d] > 1), key=lambda d: t.stride(d))
    expected = 1
    for d in dims:
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _shrunk(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor like ``t`` with every size above 1 cut to ``_SMALL``, dense in ``t``'s memory order. One map for
    every operand, so sizes that match (the shared k of two GEMM operands) still match."""
    shape = tuple(min(s, _SMALL) for s in t.shape)
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), d))
    stride, step = [0] * t.dim(), 1
    for d in order:
        stride[d] = step
        step *= shape[d]
    return torch.empty_strided(shape, tuple(stride), dtype=t.dtype, device="meta")


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.stride(), x.dtype, x.requires_grad)
    if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                      torch.memory_format)):
        return x
    return type(x).__name__


def _extent(t: torch.Tensor) -> int:
    """Elements of storage the tensor's shape and strides reach (0 for an empty tensor)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _real_like(t: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor with ``t``'s shape, strides and dtype. Floats are 0.5 (valid for logs, square roots and
    probabilities; random numbers would cost more than most kernels), integers and booleans are zero (valid indices
    and targets)."""
    if t.numel() == 0:
        return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype)
    fill = 0.5 if (t.dtype.is_floating_point or t.dtype.is_complex) else 0
    base = torch.full((_extent(t),), fill, dtype=t.dtype)
    return base.as_strided(tuple(t.shape), t.stride())


def _run_probe(func, args: tuple, kwargs: dict) -> ProbeResult:
    # Grad mode stays as it is: some kernels (mkldnn_rnn_layer) only return their workspace when it is enabled;
    # the inputs do not require grad, so no graph is recorded either way.
    with disable_current_modes(), torch.autocast("cpu", enabled=False):
        real_args, real_kwargs = pytree.tree_map_only(torch.Tensor, _real_like, (args, kwargs))
        worst_case = probe_inputs(func)  # kernels whose memory depends on values (autofit/capture/corrections.py)
        if worst_case is not None:
            real_args, real_kwargs = worst_case(real_args, real_kwargs)
        with memory_profile() as prof:
            out = func(*real_args, **real_kwargs)
        running, internal_peak = 0, 0
        for size in allocation_sizes(prof):
            running += size
            internal_peak = max(internal_peak, running)
        outputs, first_of = [], {}
        for i, o in enumerate(pytree.tree_leaves(out)):
            if not isinstance(o, torch.Tensor):
                outputs.append(None)
                continue
            key = o.untyped_storage().data_ptr() if o.untyped_storage().nbytes() else None
            alias = first_of.get(key) if key is not None else None
            if key is not None and alias is None:
                first_of[key] = i
            outputs.append(RealOutput(tuple(o.shape), o.stride(), o.dtype, o.untyped_storage().nbytes(), alias))
        del out
    # running is what the op left allocated (its new outputs); the rest of the high-water mark was scratch.
    return ProbeResult(workspace=max(0, internal_peak - running), outputs=tuple(outputs))




def real_kernel_accepts(func, args: tuple, kwargs: dict, max_bytes: int = 256 * 2**20) -> bool:
    """Whether the CPU kernel runs on real tensors shaped like these (fake) arguments: tells a fake kernel that is
    stricter than the CPU kernel from a genuine error. Arguments spanning more than ``max_bytes`` are not tried."""
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if sum(_extent(x) * x.element_size() for x in leaves) > max_bytes:
        return False
    with disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
        real_args, real_kwargs = pytree.tree_map_only(torch.Tensor, _real_like, (args, kwargs))
        try:
            func(*real_args, **real_kwargs)
        except Exception:  # noqa: BLE001 - the real kernel refuses them too: the error is genuine
            return False
    return True
