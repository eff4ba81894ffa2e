"""CUDA's autocast op policy, applied to the CPU simulation.

The simulation runs on fake CPU tensors (a fake CUDA backward aborts the process on CPU-only builds), but CPU
autocast casts other ops than CUDA autocast: CPU keeps ``layer_norm``, ``softmax`` or ``exp`` in bf16, CUDA runs
them in fp32, so activations differ in size. While a CUDA step is simulated, the AutocastCPU kernels of every op
below are replaced (``torch.library``, removed afterwards) by Python kernels with CUDA's policy, and every op CPU
autocast handles that CUDA does not falls through unchanged (the ops it decomposes into still meet the policy).

The lists are those of the running torch build: the ops with an ``AutocastCUDA`` kernel (``aten/src/ATen/
autocast_mode.cpp``, ``TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m)``), each with the ``CastPolicy`` its kernel is seen to
apply on fake CUDA tensors (``autocast_lists.py``). ``tests/test_autocast_lists.py`` checks them against
``autocast_mode.h``'s lists; ``tests/test_cuda_model.py`` against the dtypes CUDA autocast really produces.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from autofit.core._torch import (
    all_aten_op_names,
    destroy_library,
    exclude_dispatch_key,
    has_dispatch_kernel,
    is_view,
    patch,
    pytree,
    op_schema,
)
from autofit.cuda.autocast_lists import autocast_cuda_lists

__all__ = ["LOWER_PRECISION_FP", "FP32", "FP32_SET_OPT_DTYPE", "FP32_APPEND_DTYPE", "PROMOTE", "BANNED",
           "cuda_autocast_policy", "policy_of"]

# The lists by CastPolicy, as this torch build registers and runs them (``autocast_lists.py``, Note [observing a cast
# policy]); module attributes computed on first use, so importing autofit stays cheap.
_LIST_NAMES = {
    "LOWER_PRECISION_FP": "lower_precision_fp",  # run in fp16/bf16 (tensor-core ops)
    "FP32": "fp32",  # numerically sensitive ops run in fp32
    "FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype",  # redispatched with dtype=float32 when no dtype is given
    "FP32_APPEND_DTYPE": "fp32_append_dtype",  # redispatched to the overload that takes a dtype, with float32
    "PROMOTE": "promote",  # run in the widest floating type among the inputs
    "BANNED": "banned",  # raises under CUDA autocast (binary_cross_entropy is unsafe in low precision)
}


def __getattr__(name: str) -> tuple[str, ...]:
    if name in _LIST_NAMES:
        return autocast_cuda_lists().by_policy[_LIST_NAMES[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")




def policy_of(name: str) -> str | None:
    """The CUDA cast policy of an op ("mm", "pow.Tensor_Scalar") or None when CUDA autocast leaves it alone."""
    for policy, names in autocast_cuda_lists().by_policy.items():
        if name in names:
            return policy
    return None


def _overload(name: str):
    op, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, op)
    return getattr(packet, overload or "default")


def _eligible(t: object) -> bool:
    # autocast_mode.h, is_autocast_eligible + is_eligible: floating, defined, not double
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class _Caster:
    """The Python twin of autocast's ``cached_cast``: low-precision copies of leaf weights are cached until the
    autocast region exits (``clear`` is called then), exactly like ``at::autocast::cached_casts``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def lower(self, t: object) -> object:
        if not _eligible(t) or t.dtype == self.dtype:
            return t
        cacheable = t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not is_view(t)
        if cacheable:
            hit = self.cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
        cast = t.to(self.dtype)
        if cacheable:
            self.cache[id(t)] = (t, cast)
        return cast

    def clear(self) -> None:
        self.cache.clear()


def _kernel(op, policy: str, caster: _Caster):
    def call(*args, **kwargs):
        with exclude_dispatch_key("AutocastCPU"):
            if policy == "lower_precision_fp":
                args, kwargs = pytree.tree_map(caster.lower, (args, kwargs))
            elif policy in ("fp32", "fp32_append_dtype"):
                args, kwargs = pytree.tree_map(lambda t: t.float() if _eligible(t) else t, (args, kwargs))
            elif policy == "fp32_set_opt_dtype":
                first = next((t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)), None)
                if _eligible(first) and kwargs.get("dtype") is None and not _has_dtype_arg(op, args):
                    kwargs = dict(kwargs, dtype=torch.float32)
            elif policy == "promote":
                floats = [t.dtype for t in pytree.tree_leaves((args, kwargs)) if _eligible(t)]
                if floats:
                    widest = max(floats, key=lambda d: torch.finfo(d).bits)
                    args, kwargs = pytree.tree_map(lambda t: t.to(widest) if _eligible(t) else t, (args, kwargs))
            elif policy == "banned":
                raise RuntimeError(
                    f"{op} is unsafe to autocast on CUDA (autocast_mode.cpp bans it): use "
                    "binary_cross_entropy_with_logits / BCEWithLogitsLoss, which is safe under autocast"
                )
            return op(*args, **kwargs)

    return call


def _has_dtype_arg(op, args: tuple) -> bool:
    names = [a.name for a in op_schema(op).arguments]
    return "dtype" in names and names.index("dtype") < len(args) and args[names.index("dtype")] is not None


@contextlib.contextmanager
def cuda_autocast_policy(dtype: torch.dtype, *, require_clear: bool = False) -> Iterator[_Caster]:
    """Within this context CPU autocast follows CUDA's op policy. Yields the caster (call ``clear()`` when the
    autocast region of a micro-batch exits, as torch.autocast clears its cache)."""
    caster = _Caster(dtype)
    lib = torch.library.Library("aten", "IMPL")
    cuda_names = {name for names in autocast_cuda_lists().by_policy.values() for name in names}
    cpu_only = [n for n in all_aten_op_names() if has_dispatch_kernel(n, "AutocastCPU") and n not in cuda_names]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
        for name in sorted(cuda_names):
            try:
                op = _overload(name)
            except AttributeError:  # an op this torch version does not have
                continue
            lib.impl(name, _kernel(op, policy_of(name), caster), "AutocastCPU")
        for name in cpu_only:
            # fall through to the next key *without* excluding AutocastCPU: a composite op (cross_entropy,
            # conv2d with padding="same") must still meet CUDA's policy for the ops it decomposes into
            lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
    # torch.autocast's __exit__ calls torch.clear_autocast_cache() when the outermost region closes: the forward's
    # region, and also each region non-reentrant checkpoint opens to recompute a module during backward
    def clear_both(clear_cache):
        def clear() -> None:
            caster.clear()
            clear_cache()
        return clear

    try:
        with patch(torch, "clear_autocast_cache", clear_both) as cleared:
            yield caster
        if require_clear:  # a simulation ran a forward under torch.autocast, whose exit must have cleared the cache
            cleared.require_hit("torch.autocast clears its weight-cast cache through it when a region exits, and the "
                                "emulated CUDA cache must be cleared with it")
    finally:
        caster.clear()
        destroy_library(lib)
