"""Per-module activation figures, measured on forwards over fake tensors at two micro-batch sizes.

For each module call the forward records: FLOPs of the ops that ran inside it (PyTorch's ``flop_registry``), bytes
of its tensor inputs and of the new tensors it returned, and, through ``saved_tensors_hooks``, which tensors
autograd saved for backward. A saved tensor counts for the module that *created* it (the innermost module running
when its storage was allocated) and for all that module's ancestors; parameters and inputs of the step never count.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autofit.batch import Batch
from autofit.capture.model_copy import fake_copy, real_copy
from autofit.capture.module_stack import install_module_stack
from autofit.categories import Category
from autofit.loss import LossFn, compute_loss
from autofit.precision import PrecisionPolicy
from autofit.simulate.timeline import Phase
from autofit.simulate.tracker import StepTracker

__all__ = ["ForwardStats", "forward_stats"]


@dataclass
class ForwardStats:
    """Subtree totals per module name at one micro-batch size."""

    saved: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    outputs: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    inputs: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def _ancestors(name: str) -> list[str]:
    """'a.b.c' -> ['a.b.c', 'a.b', 'a', ''] (the root row holds the whole model)."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)] + [""]


def forward_stats(
    model: nn.Module, batch: Batch, target: Batch | None, loss_fn: LossFn | None, precision: PrecisionPolicy,
    micro_batch: int, *, fake: bool = True,
) -> ForwardStats:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    work = fake_copy(model, fake_mode) if fake else real_copy(model).cpu()
    stats = ForwardStats()
    with fake_mode if fake else contextlib.nullcontext():
        convert = (lambda t: _fake(fake_mode, t)) if fake else (lambda t: t.cpu())
        micro = batch.map_tensors(convert).resize(micro_batch)
        micro_target = None if target is None else target.map_tensors(convert).resize(micro_batch)
        tracker = StepTracker(prober=None, count_flops=True)
        for p in work.parameters():
            tracker.register(p, Category.PARAMETERS)
        for b in work.buffers():
            tracker.register(b, Category.BUFFERS)
        for t in micro.tensors() + (micro_target.tensors() if micro_target is not None else []):
            tracker.register(t, Category.INPUTS)
        saved_sids: set[int] = set()

        def on_enter(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
            stats.calls[name] += 1
            stats.inputs[name] += _unique_bytes(tracker, (args, kwargs), created_in=None)

        def on_exit(name: str, module: nn.Module, args: Any, output: Any) -> None:
            stats.outputs[name] += _unique_bytes(tracker, output, created_in=name)

        def pack(t: torch.Tensor) -> torch.Tensor:
            sid = tracker.sid_of(t)
            if sid is not None:
                saved_sids.add(sid)
            return t

        handles = install_module_stack(work, tracker.module_stack, on_enter=on_enter, on_exit=on_exit)
        tracker.phase = Phase.FORWARD
        try:
            with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast(
                "cpu", dtype=precision.dtype, enabled=precision.autocast
            ):
                output = micro.call(work)
                loss = compute_loss(loss_fn, output, None if micro_target is None else micro_target.value)
        finally:
            for h in handles:
                h.remove()
        del loss, output
    for sid in saved_sids:
        record = tracker.timeline.storages[sid]
        if record.op >= 0:  # created by the forward, not a parameter or input
            for name in _ancestors(record.module):
                stats.saved[name] += record.nbytes
    for op in tracker.timeline.ops:
        if op.flops:
            for name in _ancestors(op.module):
                stats.flops[name] += op.flops
    return stats


def _fake(fake_mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    if t.is_meta:
        return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="cpu")
    return fake_mode.from_tensor(t.cpu())


def _unique_bytes(tracker: StepTracker, value: Any, *, created_in: str | None) -> int:
    """Bytes of the distinct storages of the tensors in ``value``; with ``created_in``, only those allocated inside
    that module's subtree (a module that returns its input returns nothing new)."""
    seen: set[int] = set()
    total = 0
    for t in pytree.tree_leaves(value):
        if not isinstance(t, torch.Tensor):
            continue
        sid = tracker.sid_of(t)
        if sid is None or sid in seen:
            continue
        seen.add(sid)
        record = tracker.timeline.storages[sid]
        if created_in is not None and (record.op < 0 or not (
                record.module == created_in or record.module.startswith(created_in + "."))):
            continue
        total += record.nbytes
    return total
