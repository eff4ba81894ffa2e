"""Per-module and per-call activation figures, observed while the analysis simulates the step.

During each micro-batch's forward the observer records every module call: the events it spans, the bytes of its
tensor inputs and of the new tensors it returned, and, through ``saved_tensors_hooks``, which tensors autograd saved
for backward. It also tags the autograd nodes each call created (``node.metadata``), so that during backward it can
tell where each call's backward begins: the moment checkpointing would recompute it (see ``solve``).

A saved tensor counts for the call that *created* it (its storage was allocated while the call ran) and for that
call's ancestors; parameters and inputs of the step never count. FLOPs come from the tracker's per-op count
(PyTorch's ``flop_registry``), attributed to the innermost module and its ancestors.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from autofit.core._torch import current_autograd_node, pytree
from autofit.capture.module_stack import install_module_stack
from autofit.training.recompute import op_selective_names, saved_op_names
from autofit.simulate.timeline import EventKind, Phase
from autofit.simulate.tracker import StepTracker

__all__ = ["ForwardStats", "LayerObserver", "CallObservation", "ancestors"]

_TAG = "autofit_calls"
_KEPT_OPS = saved_op_names()
_OP_SELECTIVE_OPS = op_selective_names()


@dataclass
class ForwardStats:
    """Subtree totals per module name over the first micro-batch's forward."""

    saved: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    outputs: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    inputs: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))


@dataclass
class CallObservation:
    name: str
    micro: int
    index: int  # k for the k-th call of this module in this micro-batch
    start: int
    first_sid: int  # storages with ids >= this were created during the call
    last_sid: int = 1 << 62  # ... and with ids < this (set when the call returns)
    end: int = -1
    recompute_at: int = -1
    backward_end: int = -1  # last event of the call's backward
    input_sids: tuple[int, ...] = ()
    saved: set[int] = field(default_factory=set)
    returned: set[int] = field(default_factory=set)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.name, self.micro, self.index)


def ancestors(name: str) -> list[str]:
    """'a.b.c' -> ['a.b.c', 'a.b', 'a', ''] (the root row holds the whole model)."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)] + [""]


class LayerObserver:
    """Attach to a simulation (``simulate_step(observer=...)``); read ``stats`` and ``calls`` afterwards."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """What a run observes; each attach starts afresh (a simulation may run the step again, and the last run
        is the one it reports: Note [random layer skipping], autofit/simulate/randomness.py)."""
        self.stats = ForwardStats()
        self.calls: list[CallObservation] = []
        self._tracker: StepTracker | None = None
        self._saved: set[int] = set()
        self._stack: list[CallObservation] = []
        self._counts: dict[tuple[str, int], int] = defaultdict(int)
        self._packed_outside: dict[int, set[int]] = defaultdict(set)  # sid -> ids of calls NOT running at a pack

    def _stage(self) -> tuple[int, Phase] | None:
        marks = self._tracker.timeline.marks
        return marks[-1][1:] if marks else None

    @contextlib.contextmanager
    def attach(self, tracker: StepTracker, model: nn.Module) -> Iterator[None]:
        self._reset()
        self._tracker = tracker
        handles = install_module_stack(model, [], on_enter=self._enter, on_exit=self._exit)
        tracker.op_listeners.append(self._on_op)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()
            tracker.op_listeners.remove(self._on_op)
        self._collect()

    # ---- hooks ---------------------------------------------------------------------------------------------------
    def _enter(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        stage = self._stage()
        if stage is None or stage[1] is not Phase.FORWARD:
            return
        micro = stage[0]
        timeline = self._tracker.timeline
        index = self._counts[(name, micro)]
        self._counts[(name, micro)] += 1
        call = CallObservation(name, micro, index, len(timeline.events), len(timeline.storages))
        call.input_sids = tuple(dict.fromkeys(
            sid for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
            for sid in [self._tracker.sid_of(t)] if sid is not None))
        call.inputs = (args, kwargs)  # grad_fns of the inputs bound the call's autograd nodes
        self.calls.append(call)
        self._stack.append(call)
        if micro == 0:
            self.stats.calls[name] += 1
            self.stats.inputs[name] += self._unique_bytes((args, kwargs), created_in=None)

    def _exit(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack or self._stack[-1].name != name:
            return
        call = self._stack.pop()
        call.end = len(self._tracker.timeline.events) - 1
        call.last_sid = len(self._tracker.timeline.storages)
        call.returned = {sid for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)
                         for sid in [self._tracker.sid_of(t)] if sid is not None}
        _tag_nodes(output, call.inputs, id(call))
        del call.inputs
        if call.micro == 0:
            self.stats.outputs[name] += self._unique_bytes(output, created_in=name)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        sid = self._tracker.sid_of(t)
        if sid is None:
            return t
        if self._stack and self._stack[-1].micro == 0:
            self._saved.add(sid)
        running = {id(call) for call in self._stack}
        for call in self._stack:
            if sid >= call.first_sid:
                call.saved.add(sid)
        # remember saves from outside a call that made the tensor: checkpointing that call would not free it
        for call in self.calls:
            if id(call) not in running and sid >= call.first_sid and call.end >= 0 and sid < call.last_sid:
                self._packed_outside[sid].add(id(call))
        return t

    def _on_op(self, op_index: int) -> None:
        if self._tracker.phase is not Phase.BACKWARD:
            return
        node = current_autograd_node()
        if node is None:
            return
        tagged = node.metadata.get(_TAG)
        if not tagged:
            return
        by_id = self._by_id
        for call_id in tagged:
            call = by_id.get(call_id)
            if call is None:
                continue
            if call.recompute_at < 0:
                call.recompute_at = self._tracker.op_first_event
            call.backward_end = len(self._tracker.timeline.events)

    @property
    def _by_id(self) -> dict[int, CallObservation]:
        if getattr(self, "_ids", None) is None or len(self._ids) != len(self.calls):
            self._ids = {id(c): c for c in self.calls}
        return self._ids

    # ---- a worker's results travel pickled (autofit/core/workers.py) ---------------------------------------------------
    def __getstate__(self) -> dict:
        """What the analysis reads after the run: the results and the timeline they index, without the tracker, the
        hooks or any fake tensor. Calls are referred to by their position, as ids do not survive pickling."""
        state = dict(self.__dict__)
        position = {id(c): i for i, c in enumerate(self.calls)}
        state["calls"] = [_without_inputs(c) for c in self.calls]
        state["_packed_outside"] = {sid: {position[i] for i in ids if i in position}
                                    for sid, ids in self._packed_outside.items()}
        state["_tracker"] = _Detached(self._tracker.timeline) if self._tracker is not None else None
        state["_stack"], state["_ids"] = [], None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        ids = [id(c) for c in self.calls]
        self._packed_outside = defaultdict(set, {sid: {ids[i] for i in positions}
                                                 for sid, positions in state["_packed_outside"].items()})

    # ---- results -------------------------------------------------------------------------------------------------
    def _collect(self) -> None:
        timeline = self._tracker.timeline
        for sid in self._saved:
            record = timeline.storages[sid]
            if record.op >= 0 and record.phase is Phase.FORWARD:  # made by the forward: not a weight or input
                for name in ancestors(record.module):
                    self.stats.saved[name] += record.nbytes
        first_backward = next((start for start, micro, phase in timeline.marks if phase is not Phase.FORWARD),
                              len(timeline.events))
        for kind, value in timeline.events[:first_backward]:
            if kind is EventKind.OP:
                op = timeline.ops[value]
                if op.flops and op.phase is Phase.FORWARD:
                    for name in ancestors(op.module):
                        self.stats.flops[name] += op.flops

    def freed_at(self) -> dict[int, int]:
        """Storage id -> index of the event that freed it (storages alive at the end are absent)."""
        return {value: j for j, (kind, value) in enumerate(self._tracker.timeline.events) if kind is EventKind.FREE}

    def nbytes(self, sid: int) -> int:
        return self._tracker.timeline.storages[sid].nbytes

    def saved_bytes(self, call: CallObservation) -> int:
        """What checkpointing the call drops: bytes it made that autograd saved only from inside it. A tensor it
        returns is dropped too unless an op after the call saves it (then it stays alive either way)."""
        storages = self._tracker.timeline.storages
        return sum(storages[sid].nbytes for sid in self._dropped(call))

    def kept_bytes(self, call: CallObservation, freed: dict[int, int], policy: str = "selective") -> int:
        """What a selective recomputation of the call keeps until its backward begins (Note [selective
        recomputation], autofit/training/recompute.py): the outputs of its matmul and attention ops (storages they made
        while the call ran) that full checkpointing would drop, or that the plain run frees before the call's
        backward; outputs that stay alive past it anyway (returned, or saved from outside) cost nothing more.
        ``policy`` "op-selective": the outputs of torchtitan's save list, of its ``mm`` calls the 1st, 3rd, ... of
        the call (Note [torchtitan's per-op policy]; ops matched by name here, not overload)."""
        timeline = self._tracker.timeline
        storages, ops, dropped = timeline.storages, timeline.ops, self._dropped(call)
        names = _OP_SELECTIVE_OPS if policy == "op-selective" else _KEPT_OPS
        never = 1 << 62
        total = 0
        matmuls: dict[int, int] = {}  # mm op -> its place among the call's mm calls (from 1)
        for sid in range(call.first_sid, min(call.last_sid, len(storages))):
            record = storages[sid]
            if record.op < 0 or record.phase is not Phase.FORWARD or ops[record.op].name not in names:
                continue
            if policy == "op-selective" and ops[record.op].name == "mm":
                if matmuls.setdefault(record.op, len(matmuls) + 1) % 2 == 0:
                    continue
            if sid in dropped or freed.get(sid, never) < call.recompute_at:
                total += record.nbytes
        return total

    def _dropped(self, call: CallObservation) -> set[int]:
        return {sid for sid in call.saved if id(call) not in self._packed_outside.get(sid, ())}

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


@dataclass(frozen=True)
class _Detached:
    """The part of a tracker a finished observer reads: its timeline."""

    timeline: Any


def _without_inputs(call: CallObservation) -> CallObservation:
    """A call that never returned still holds its (fake) inputs; its copy for pickling does not."""
    return replace(call) if "inputs" in call.__dict__ else call


def _tag_nodes(output: Any, inputs: Any, call_id: int) -> None:
    """Mark the autograd nodes between the call's outputs and its inputs as belonging to the call."""
    stop = {t.grad_fn for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    todo = [t.grad_fn for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or node in stop:
            continue
        seen.add(id(node))
        if type(node).__name__ == "AccumulateGrad":
            continue  # a parameter's accumulator is shared by every call that uses the parameter
        node.metadata.setdefault(_TAG, []).append(call_id)
        todo.extend(fn for fn, _ in node.next_functions)
