"""CUDA autocast's op lists, read off the installed torch rather than copied from its source.

Which ops CUDA autocast handles is whatever ``aten/src/ATen/autocast_mode.cpp`` registered for the ``AutocastCUDA``
dispatch key in this build: the dispatcher answers that (``torch._C._dispatch_has_kernel_for_dispatch_key``). What
each kernel does is observed, see Note [observing a cast policy]. A hand-copied table goes stale with every release
(torch 2.15 added ``_cudnn_rnn`` and ``linalg_matrix_sqrth``); this does not.

Note [observing a cast policy]
    Forward ops run on fake CUDA tensors even on CPU-only builds, and ``torch.autocast("cuda")`` is emulated by
    setting the AutocastCUDA thread-local state as ``torch.autocast.__enter__`` does (``torch/amp/autocast_mode.py``).
    The op is called with fake 2x2 CUDA tensors for its tensor arguments (defaults or simple values for the rest)
    under fp16 autocast, below a dispatch mode that records the first aten op the autocast kernel sends down and
    stops there (no kernel runs, so shapes need not be valid). The ``CastPolicy``
    (``aten/src/ATen/autocast_mode.h``) follows from three calls:

    - fp32 inputs: a first op ``_to_copy(dtype=float16)`` is ``lower_precision_fp``;
    - for ops with a ``dtype`` argument, fp16 inputs with no dtype versus dtype=float16 given: autocast changed what
      was sent down only if it set the dtype itself, ``fp32_set_opt_dtype``;
    - fp16 inputs: ``_to_copy(dtype=float32)`` is ``fp32``; another overload of the same op is
      ``fp32_append_dtype`` (``norm.Scalar`` -> ``norm.ScalarOpt_dtype``);
    - fp32 then fp16 inputs: ``_to_copy(dtype=float32)`` of the fp16 one is ``promote``;
    - "unsafe to autocast" raised by the kernel is ``banned`` (``binary_cross_entropy``).
    An op none of these describe is returned under ``unclassified`` (tests require there be none).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from autofit.core._torch import (
    FakeTensorMode,
    TorchDispatchMode,
    all_aten_op_names,
    has_dispatch_kernel,
    op_schema,
)

__all__ = ["AutocastLists", "autocast_cuda_lists", "ops_with_kernel", "cuda_autocast_state", "observed_policy"]

POLICIES = ("lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned")


@dataclass(frozen=True)
class AutocastLists:
    """Op names ("mm", "pow.Tensor_Scalar") by CUDA cast policy."""

    by_policy: dict[str, tuple[str, ...]]
    unclassified: tuple[str, ...]


def ops_with_kernel(key: str) -> tuple[str, ...]:
    """aten ops ("mm", "norm.Scalar") with a kernel registered for dispatch key ``key`` in this build."""
    return tuple(sorted(name for name in all_aten_op_names() if has_dispatch_kernel(name, key)))


@contextlib.contextmanager
def cuda_autocast_state(dtype: torch.dtype) -> Iterator[None]:
    """CUDA autocast without a CUDA device: the thread-local state ``torch.autocast.__enter__`` sets (it switches
    itself off when CUDA is unavailable, ``torch/amp/autocast_mode.py``)."""
    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)


class _Sent(Exception):
    """The first aten op below the autocast kernel, with its arguments."""

    def __init__(self, func, args, kwargs) -> None:
        super().__init__(str(func))
        self.func, self.args, self.kwargs = func, args, kwargs


class _StopAtFirstOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "prim":  # metadata queries (prim.device) of the fake tensors themselves
            return func(*args, **(kwargs or {}))
        raise _Sent(func, args, kwargs or {})


def _argument(arg, tensors: Iterator[torch.Tensor]):
    kind = str(arg.type)
    if kind in ("Tensor", "Optional[Tensor]"):
        return next(tensors)
    if kind in ("List[Tensor]", "List[Optional[Tensor]]"):
        return [next(tensors), next(tensors)]
    if kind == "Optional[int]":
        return 0  # a dim: ``cross`` warns when it has to guess one
    if arg.has_default_value():
        return arg.default_value
    simple = {"int": 1, "SymInt": 1, "List[int]": [1], "List[SymInt]": [1], "float": 1.0, "List[float]": [1.0],
              "number": 1.0, "bool": False, "List[bool]": [False], "str": "ij,jk->ik"}
    return None if kind.startswith("Optional") else simple.get(kind)


def _first_op(op, dtypes: list[torch.dtype], dtype_arg: torch.dtype | None = None) -> object:
    """The first aten op ``op``'s AutocastCUDA kernel sends down (a :class:`_Sent`), or the exception it raised."""
    with FakeTensorMode():
        made = [torch.zeros(2, 2, dtype=d, device="cuda") for d in dtypes]

        def tensors() -> Iterator[torch.Tensor]:
            i = 0
            while True:
                yield made[min(i, len(made) - 1)]
                i += 1

        source = tensors()
        args, kwargs = [], {}
        for arg in op_schema(op).arguments:
            value = dtype_arg if arg.name == "dtype" and dtype_arg is not None else _argument(arg, source)
            if arg.kwarg_only:
                kwargs[arg.name] = value
            else:
                args.append(value)
        with cuda_autocast_state(torch.float16), _StopAtFirstOp():
            try:
                op(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - _Sent, or what the kernel raised: both are the observation
                return e
    return None


def _signature(seen: object) -> object:
    if not isinstance(seen, _Sent):
        return type(seen).__name__

    def plain(v):
        return v.dtype if isinstance(v, torch.Tensor) else v

    return seen.func, tuple(plain(v) for v in seen.args), tuple(sorted((k, plain(v)) for k, v in seen.kwargs.items()))


def _is_cast(seen: object, dtype: torch.dtype) -> bool:
    return (isinstance(seen, _Sent) and seen.func is torch.ops.aten._to_copy.default
            and seen.kwargs.get("dtype") == dtype)


def _overload(name: str):
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def observed_policy(name: str) -> str | None:
    """See Note [observing a cast policy]."""
    op = _overload(name)
    f32, f16 = torch.float32, torch.float16
    # calls run only as far as needed: an op body that does run (no cast) may print a deprecation warning
    a = _first_op(op, [f32])
    if _is_cast(a, f16):
        return "lower_precision_fp"
    b, c = _first_op(op, [f16]), _first_op(op, [f32, f16])
    if any("unsafe to autocast" in str(r) for r in (a, b, c) if not isinstance(r, _Sent)):
        return "banned"
    if any(arg.name == "dtype" for arg in op_schema(op).arguments):
        if _signature(b) != _signature(_first_op(op, [f16], dtype_arg=f16)):
            return "fp32_set_opt_dtype"
    if _is_cast(b, f32):
        return "fp32"
    if isinstance(b, _Sent) and b.func.overloadpacket is op.overloadpacket and b.func is not op:
        return "fp32_append_dtype"
    if _is_cast(c, f32):
        return "promote"
    return None


# Ops whose AutocastCUDA kernel cannot be observed on fake tensors without a CUDA device, with the policy their
# source gives. Used only when observation finds nothing, so a build where observation works still decides.
UNOBSERVABLE = {
    # aten/src/ATen/cudnn/AutocastRNN.cpp, _cudnn_rnn_cast_reflatten: casts the input, hx, cx and every weight to the
    # autocast dtype (and reflattens the weights into one buffer); it asks cuDNN for the flat weight size first, so it
    # needs a device. Registered for AutocastCUDA from torch 2.15 on.
    "_cudnn_rnn": "lower_precision_fp",
}


@functools.cache
def autocast_cuda_lists() -> AutocastLists:
    """The ops with an AutocastCUDA kernel in this build, by observed policy (computed once, about a second)."""
    by_policy: dict[str, list[str]] = {p: [] for p in POLICIES}
    unclassified = []
    for name in ops_with_kernel("AutocastCUDA"):
        policy = observed_policy(name) or UNOBSERVABLE.get(name)
        (by_policy[policy] if policy else unclassified).append(name)
    return AutocastLists({p: tuple(names) for p, names in by_policy.items()}, tuple(unclassified))
