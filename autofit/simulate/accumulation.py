"""The autograd engine's in-place gradient accumulation, which a dispatch mode suppresses. See Note [engine
accumulation].

Note [engine accumulation]
    When two gradients flow into the same input of a node (a tensor used twice in forward: ``deltaA[:, :, i]`` in a
    loop, ``x * x``), the engine sums them in its input buffer (``accumulate`` in
    torch/csrc/autograd/input_buffer.cpp). If the buffer holds the only reference to the old gradient and to its
    storage (``can_accumulate_inplace``: non-overlapping and dense, ``adjusted_use_count(v) == 1`` and
    ``v.storage().use_count() == 1``), it adds in place, ``old_var.add_(var)``: no new memory. Otherwise it allocates,
    ``old_var + var``. Under a Python dispatch mode every tensor that passes through Python has a Python object that
    holds a reference, so the reference counts are never 1 and the engine always allocates: the simulation would see
    a transient gradient-sized buffer at every accumulation the real run does in place (Mamba's slow selective scan
    accumulates sixteen ``select_backward`` gradients into one ``deltaA`` gradient per layer: +5.7 % on the
    peak of the tiny Mamba of tests/hf_archs.py, 6.9 % in the issue's configuration).

    The tracker restores the real behaviour. An engine accumulation is recognised as an ``add.Tensor`` during
    backward with grad mode off (the engine runs with ``create_graph=False``), both operands of the output's shape,
    dtype and a contiguous layout, whose first operand (the buffer's old gradient) is not a view (a view's base
    holds the storage too, so ``storage().use_count()`` is 2: ``TBackward0``'s ``grad.t()``) and was created under
    another autograd node than the current one (``torch._C._current_autograd_node``: the engine sets it for the whole
    of ``evaluate_function``, the node's apply *and* the accumulation of its outputs). If that old gradient's storage
    dies before the next op runs, nothing but the buffer held it: the real engine would have added in place. Its free
    is then moved before the output's allocation, so the timeline shows what the allocator sees: the result takes the
    old gradient's place, with no transient. The case where the engine steals the *new* gradient instead
    (``var.add_(old_var)``, when the old one is shared) is left as an allocation, an overestimate of one gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autofit.core._torch import current_autograd_node, is_view
from autofit.simulate.timeline import EventKind, Timeline

__all__ = ["AccumulationWatch"]

aten = torch.ops.aten


@dataclass(frozen=True)
class _Pending:
    alloc_event: int  # index of the output's ALLOC event
    op_event: int  # index of the op's OP event; frees after it happened before the next op
    old_sid: int  # storage of the buffer's old gradient


class AccumulationWatch:
    """Finds engine accumulations and corrects the timeline (Note [engine accumulation])."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self._node = None  # the autograd node running now (a strong reference, dropped when the node changes)
        self._epoch = 0  # counts node changes; storages remember the epoch they were created in
        self._epoch_of: dict[int, int] = {}
        self._pending: _Pending | None = None

    def before_op(self) -> int:
        """Settle the previous op and return the current node epoch (call first in each dispatch)."""
        self.settle()
        node = current_autograd_node()
        if node is not self._node:
            self._node = node
            self._epoch += 1
        return self._epoch

    def created(self, sid: int, epoch: int) -> None:
        self._epoch_of[sid] = epoch

    def after_op(self, func, args: tuple, out, epoch: int, sid_of, first_alloc_event: int) -> None:
        """Remember an op that may be an engine accumulation, to settle once its operands' fate is known."""
        if func is not aten.add.Tensor or len(args) != 2 or torch.is_grad_enabled() or self._node is None:
            return
        old, new = args
        if not all(isinstance(t, torch.Tensor) for t in (old, new, out)):
            return
        if not all(_same_dense(t, out) for t in (old, new)):
            return
        if is_view(old):  # an autograd view shares its storage with its base: storage().use_count() > 1
            return
        old_sid, out_sid = sid_of(old), sid_of(out)
        if old_sid is None or out_sid is None or self._epoch_of.get(old_sid, 0) == epoch:
            return
        events = self.timeline.events
        alloc = next((i for i in range(first_alloc_event, len(events)) if events[i] == (EventKind.ALLOC, out_sid)),
                     None)
        if alloc is not None:
            self._pending = _Pending(alloc, len(events) - 1, old_sid)

    def settle(self) -> None:
        """If the old gradient died right after the add, the real engine added in place: move its free before the
        output's allocation."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        events = self.timeline.events
        free = (EventKind.FREE, pending.old_sid)
        for i in range(pending.op_event + 1, len(events)):
            if events[i] == free:
                del events[i]
                events.insert(pending.alloc_event, free)
                return


def _same_dense(t: torch.Tensor, out: torch.Tensor) -> bool:
    return (t.shape == out.shape and t.dtype == out.dtype and t.stride() == out.stride()
            and t.is_contiguous() and t.untyped_storage().nbytes() == out.untyped_storage().nbytes())
