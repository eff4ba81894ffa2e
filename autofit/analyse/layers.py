"""Per-module activation figures, observed while the analysis simulates the step.

During the first micro-batch's forward the observer records, per module call: the bytes of its tensor inputs and of
the new tensors it returned, and, through ``saved_tensors_hooks``, which tensors autograd saved for backward. A saved
tensor counts for the module that *created* it (the innermost module running when its storage was allocated) and
for all that module's ancestors; parameters and inputs of the step never count. FLOPs come from the tracker's
per-op count (PyTorch's ``flop_registry``), attributed the same way.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autofit.capture.module_stack import install_module_stack
from autofit.simulate.timeline import Phase
from autofit.simulate.tracker import StepTracker

__all__ = ["ForwardStats", "LayerObserver"]


@dataclass
class ForwardStats:
    """Subtree totals per module name over one forward at one micro-batch size."""

    saved: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    outputs: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    inputs: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def ancestors(name: str) -> list[str]:
    """'a.b.c' -> ['a.b.c', 'a.b', 'a', ''] (the root row holds the whole model)."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)] + [""]


class LayerObserver:
    """Attach to a simulation (``simulate_step(observer=...)``); read ``stats`` afterwards."""

    def __init__(self) -> None:
        self.stats = ForwardStats()
        self._tracker: StepTracker | None = None
        self._saved: set[int] = set()

    def _first_forward(self) -> bool:
        marks = self._tracker.timeline.marks
        return bool(marks) and marks[-1][1:] == (0, Phase.FORWARD)

    @contextlib.contextmanager
    def attach(self, tracker: StepTracker, model: nn.Module) -> Iterator[None]:
        self._tracker = tracker

        def on_enter(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._first_forward():
                self.stats.calls[name] += 1
                self.stats.inputs[name] += self._unique_bytes((args, kwargs), created_in=None)

        def on_exit(name: str, module: nn.Module, args: Any, output: Any) -> None:
            if self._first_forward():
                self.stats.outputs[name] += self._unique_bytes(output, created_in=name)

        def pack(t: torch.Tensor) -> torch.Tensor:
            if self._first_forward():
                sid = tracker.sid_of(t)
                if sid is not None:
                    self._saved.add(sid)
            return t

        handles = install_module_stack(model, [], on_enter=on_enter, on_exit=on_exit)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()
        self._collect()

    def _collect(self) -> None:
        timeline = self._tracker.timeline
        for sid in self._saved:
            record = timeline.storages[sid]
            if record.op >= 0 and record.phase is Phase.FORWARD:  # made by the forward: not a weight or input
                for name in ancestors(record.module):
                    self.stats.saved[name] += record.nbytes
        first_backward = next((start for start, micro, phase in timeline.marks if phase is not Phase.FORWARD),
                              len(timeline.events))
        forward_ops = {value for kind, value in timeline.events[:first_backward] if kind == 2}
        for index in forward_ops:
            op = timeline.ops[index]
            if op.flops and op.phase is Phase.FORWARD:
                for name in ancestors(op.module):
                    self.stats.flops[name] += op.flops

    def _unique_bytes(self, value: Any, *, created_in: str | None) -> int:
        """Bytes of the distinct storages of the tensors in ``value``; with ``created_in``, only those allocated
        inside that module's subtree (a module that returns its input returns nothing new)."""
        tracker = self._tracker
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
