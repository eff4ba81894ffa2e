"""What this machine's CPU kernels run natively: one place that asks, once per process (Note [CPU kernels]).

Note [CPU kernels]
    A training step on the CPU runs two libraries' kernels: ATen's own, vectorised for the instruction set that
    ``torch.backends.cpu.get_cpu_capability()`` names ("DEFAULT", "AVX2", "AVX512"), and oneDNN's (convolutions,
    matmuls, the LSTM layer). oneDNN has bf16 kernels only where its effective ISA is at least AVX512_CORE (bf16
    converted in AVX-512 registers, or AVX512_BF16 / AMX instructions where the CPU has them), and fp16 kernels
    from AVX512_CORE_FP16 (ideep's ``has_bf16_type_support`` / ``has_fp16_type_support``; autofit asks them through
    ``autofit.core._torch.onednn_low_precision``). The effective ISA is the CPU's, capped by ``ONEDNN_MAX_CPU_ISA``,
    which oneDNN reads once when it starts: ``ONEDNN_MAX_CPU_ISA=AVX2`` makes an AVX-512 machine count as one
    without bf16 kernels, which is how the tests emulate an AVX2-only CPU. ``cpuinfo``'s flags
    (``torch.cpu._is_avx512_bf16_supported``) describe the silicon and ignore that cap, so they are not used.

    Where oneDNN has no kernel for a dtype, ATen routes a bf16 matmul or convolution to its own slower kernels, but
    ops that exist only in oneDNN (``aten::mkldnn_*``: the LSTM layer CPU autocast calls) fail with oneDNN's "could
    not create a primitive descriptor". What that changes in autofit:

    - the CPU-target simulation raises :class:`UnsupportedPrecisionError` when such an op would run at a precision
      this CPU has no kernel for (:func:`require_kernel`), and ``measure`` turns oneDNN's message into the same error
      (:func:`translate_kernel_error`): both name the op and the module, and say what to do;
    - ``plan(precision="auto")`` on a CPU target considers only the precisions this CPU runs natively
      (``DeviceTarget.default_precisions``), and says so in the plan's notes;
    - kernel scratch (oneDNN's reorders and scratchpads, autofit/simulate/probe.py) depends on the ISA, so a
      CPU-target estimate is this machine's; the probes measure it here.

    A GPU-target estimate runs no CPU kernel (fake tensors, no probes) and does not depend on any of this
    (tests/test_cpu_kernels.py plans one under a reduced oneDNN ISA and compares the JSON).

    Float8 (torchao's ``Float8Linear``, autofit/features/float8.py) runs ``torch._scaled_mm``, which the CPU runs
    through oneDNN's float8 matmul: present on this AVX-512 machine, absent under ``ONEDNN_MAX_CPU_ISA=AVX2`` ("could
    not create a primitive descriptor for the matmul primitive"). Whether it runs is asked once, by running one small
    ``_scaled_mm`` (:func:`fp8_matmul`), and a CPU-target simulation without it raises as for bf16.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from autofit.core._torch import onednn_low_precision, scaled_mm
from autofit.core.errors import UnsupportedPrecisionError

__all__ = ["CpuKernels", "cpu_kernels", "fp8_matmul", "require_kernel", "translate_kernel_error", "ISA_VARIABLES"]

# oneDNN reads the first of these that is set (DNNL_MAX_CPU_ISA is the older name).
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_LOW = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# What a user recognises in an oneDNN-only op's name; others are named as they are.
_FRIENDLY = {"mkldnn_rnn_layer": "the LSTM layer", "mkldnn_rnn_layer_backward": "the LSTM layer's backward"}
# oneDNN's own words when it has no implementation for a primitive (dnnl.hpp, error::wrap_c_api's callers).
_ONEDNN_NO_PRIMITIVE = "could not create a primitive descriptor"


@dataclass(frozen=True)
class CpuKernels:
    """This CPU's kernels, as torch and oneDNN see them (Note [CPU kernels])."""

    capability: str  # ATen's vector ISA: torch.backends.cpu.get_cpu_capability() ("DEFAULT", "AVX2", "AVX512", ...)
    bf16: bool  # oneDNN has bf16 kernels (effective ISA >= AVX512_CORE, after ONEDNN_MAX_CPU_ISA)
    fp16: bool  # oneDNN has fp16 kernels (effective ISA >= AVX512_CORE_FP16)
    isa_cap: str | None = None  # ONEDNN_MAX_CPU_ISA as set in the environment, None when unset

    def native(self, precision: str) -> bool:
        """Whether compute in ``precision`` ("fp32", "bf16", "fp16") has oneDNN kernels on this CPU."""
        return precision == "fp32" or (precision == "bf16" and self.bf16) or (precision == "fp16" and self.fp16)

    def describe(self) -> str:
        """One phrase for messages: 'AVX2 (oneDNN without bf16 or fp16 kernels; ONEDNN_MAX_CPU_ISA=AVX2)'."""
        low = [p for p, has in (("bf16", self.bf16), ("fp16", self.fp16)) if has]
        missing = [p for p, has in (("bf16", self.bf16), ("fp16", self.fp16)) if not has]
        kernels = f"oneDNN with {' and '.join(low)} kernels" if low else "oneDNN"
        if missing:
            kernels += f"{' but' if low else ''} without {' or '.join(missing)} kernels"
        cap = f"; {ISA_VARIABLES[0]}={self.isa_cap}" if self.isa_cap else ""
        return f"{self.capability} ({kernels}{cap})"


@functools.cache
def cpu_kernels() -> CpuKernels:
    """This process's CPU kernels; asked once (oneDNN fixes its ISA when it starts, so the answer cannot change)."""
    bf16, fp16 = onednn_low_precision()
    cap = next((os.environ[v] for v in ISA_VARIABLES if os.environ.get(v)), None)
    return CpuKernels(capability=torch.backends.cpu.get_cpu_capability(), bf16=bf16, fp16=fp16, isa_cap=cap)


@functools.cache
def fp8_matmul() -> bool:
    """Whether this CPU runs ``torch._scaled_mm`` on float8 operands (oneDNN's float8 matmul; Note [CPU kernels]):
    one 16 x 16 product, run once per process."""
    try:
        a = torch.ones(16, 16, dtype=torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32)
        scaled_mm(a, a.t(), one, one, out_dtype=torch.float32)
    except (RuntimeError, AttributeError, TypeError):
        return False
    return True


_SCALED_MM = {"aten::_scaled_mm"}  # the float8 matmul torchao's Float8Linear runs


@functools.cache  # one answer per operator overload: the tracker asks for every op of a simulation
def _onednn_only(func) -> str | None:
    """The operator's name when it exists only as a oneDNN kernel (``aten::mkldnn_*``), else None."""
    name = func.name() if hasattr(func, "name") else str(func)
    short = name.removeprefix("aten::").split(".")[0]
    return short if name.startswith("aten::") and short.startswith("mkldnn_") else None


def require_kernel(func, tensors: list[torch.Tensor], module: str | None, *, planned_for_host: bool) -> None:
    """Raise :class:`UnsupportedPrecisionError` when ``func`` would run on this CPU at a precision oneDNN has no kernel
    for (``tensors``: its tensor arguments). ``planned_for_host``: the step is planned for this CPU; False when autofit
    runs a GPU-target step on this CPU for real (Note [data-dependent models], simulate/run.py)."""
    name = func.name() if hasattr(func, "name") else str(func)
    if name in _SCALED_MM and not fp8_matmul():
        raise _no_kernel("_scaled_mm", "fp8", module, planned_for_host)
    op = _onednn_only(func)
    if op is None:
        return
    dtype = next((t.dtype for t in tensors if t.dtype in _LOW), None)
    if dtype is None or cpu_kernels().native(_LOW[dtype]):
        return
    raise _no_kernel(op, _LOW[dtype], module, planned_for_host)


def translate_kernel_error(error: BaseException, precision: str,
                           module: str | None) -> UnsupportedPrecisionError | None:
    """The :class:`UnsupportedPrecisionError` that oneDNN's "could not create a primitive descriptor" means when a
    real step runs in ``precision`` on a CPU without oneDNN kernels for it; None for any other error. Matched on
    oneDNN's message because a real run has no dispatch mode to see the op: the exception is all ``measure`` gets."""
    if precision == "fp32" or cpu_kernels().native(precision) or _ONEDNN_NO_PRIMITIVE not in str(error):
        return None
    # "... primitive descriptor for the LSTM forward propagation primitive. Run workload with ..." -> its middle
    detail = str(error).split(_ONEDNN_NO_PRIMITIVE, 1)[1].split(".")[0].strip()
    detail = detail.removeprefix("for ").removeprefix("the ").removesuffix(" primitive").removesuffix(" propagation")
    return _no_kernel(f"oneDNN's {detail}" if detail else "a oneDNN kernel", precision, module, True)


def _no_kernel(op: str, precision: str, module: str | None, planned_for_host: bool) -> UnsupportedPrecisionError:
    what = _FRIENDLY.get(op, op if " " in op else f"aten::{op}")
    where = f" in module {module!r}" if module else ""
    if precision == "fp8":
        return UnsupportedPrecisionError(
            f"this CPU has no fp8 kernel for {what}{where} (torchao's Float8Linear): oneDNN has no float8 matmul for "
            f"{cpu_kernels().describe()}. Leave float8 out, or plan for a GPU target (device='cuda' needs no CPU "
            "kernel)", op=op, precision=precision, module=module)
    instead = ["precision='fp32'"]
    if planned_for_host:
        instead.append("plan for a GPU target (device='cuda' needs no CPU kernel)")
        why = ""
    else:
        why = "autofit runs this step for real on this CPU (its forward reads tensor values); "
    if module:
        instead.append(f"keep that module in fp32: precision=PrecisionPolicy(name={precision!r}, "
                       f"fp32_modules=({module!r},))")
    needs = "AVX-512" if precision == "bf16" else "AVX-512 FP16"
    return UnsupportedPrecisionError(
        f"this CPU has no {precision} kernel for {what}{where}: {why}oneDNN runs {precision} only on CPUs with "
        f"{needs}, and this one is {cpu_kernels().describe()}. Use {', or '.join(instead)}",
        op=op, precision=precision, module=module,
    )
