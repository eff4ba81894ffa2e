"""Real values for the fake tensors that derive only from constants and the inputs (Note [value twins]).

Note [value twins]
    A fake tensor has no values, so a forward that reads one (``bool(mask == causal).all()``, ``.item()``,
    ``torch.equal``) stops a fake simulation with DataDependentOutputException. Many such reads do not depend on the
    model's weights at all: torch's ``nn.Transformer`` checks whether the ``tgt_mask`` it is given is causal
    (``_detect_is_causal_mask`` in torch/nn/modules/transformer.py) by comparing it with a mask it builds itself,
    and the mask a model builds in its forward (``nn.Transformer.generate_square_subsequent_mask``) comes from
    ``torch.full`` and ``torch.triu`` of constants. :class:`ValueTwins`, a dispatch mode above the tracker, keeps a
    real twin beside every fake tensor whose every tensor input has one: the micro-batch's inputs (the sample's
    rows), a clone of each real buffer of the user's model, real tensors the code holds as constants, and what
    factory ops make from nothing. Each such op runs twice: on the fake tensors (what the tracker records) and on
    the twins, for real, on the CPU, outside every mode (so nothing of it is counted). A value read whose inputs all
    have twins is answered from the twins; any other one still raises, marked as depending on the weights (or the
    gradients), which is what the refusal then says (simulate/run.py). A compiled graph's code computes no values in a
    simulation (its kernels are skipped): while it runs, the twins stand aside, and what it writes loses its twin
    (Note [values inside compiled code], core/_torch_compile.py). An op that writes into a tensor whose twin it
    cannot update (its other inputs have none) takes the twin away from every tensor on that storage. A twin is kept
    only while its op's outputs hold at most ``MAX_TWIN_BYTES``, so a large computation on the inputs (a 4-D
    attention mask over long sequences) costs no real memory; a value read on it refuses as before. A twin made
    from the sample's rows (or from a tensor that was) is marked so: a value read answered from one is counted in
    ``sample_reads`` and names the module in ``sample_reader``, since another micro-batch's rows may answer it
    otherwise (Note [rows that differ], autofit/solve/estimator.py).
    A read answered from the twins decides what the step runs by the sample's values (``if x.mean() > 0:``, a
    padding mask that is all ones, a size read with ``.item()``): another batch can take another branch, with
    another peak. So the modules whose code read such values are recorded (``readers``: the innermost module running
    at the read, from the tracker's module stack) and the estimate's and the plan's notes name them
    (``reader_note``); the simulated step is the one the sample's values take, not a bound over every batch.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from autofit.core._torch import (
    DATA_DEPENDENT_ERRORS, FakeTensor, TorchDispatchMode, disable_current_modes, op_schema, pytree,
)
from autofit.core._torch_compile import hearing_skipped_writes, running_compiled_code

__all__ = ["ValueTwins", "RowProgram", "MAX_TWIN_BYTES", "WEIGHT_READ", "reader_note"]

MAX_TWIN_BYTES = 64 * 2**20  # outputs of one op above this get no twin (Note [value twins])
MAX_PROGRAM_BYTES = 256 * 2**20  # twins a RowProgram may keep alive (Note [rows that differ])
WEIGHT_READ = "autofit_reads_weights"  # set on a data-dependent error whose inputs have no twins


class RowProgram:
    """The ops a fake step ran on values of the sample's rows, in order, and the answers its value reads got: run
    again on another micro-batch's rows, it tells whether every read gets the same answer, and so whether that
    micro-batch runs the same simulated step (Note [rows that differ], autofit/solve/estimator.py). Ops are kept
    by reference, so a program does not cross processes: unpickled (a simulation sent back by a worker), it is
    empty and answers nothing (``usable`` False)."""

    def __init__(self) -> None:
        self.steps: list[tuple[Any, Any, list[Any], Any]] = []  # (op, args' spec, encoded leaves, answer or _NONE)
        self.inputs = 0  # input tensors, in the order of ``Batch.tensors()`` of the micro-batch, then its target's
        self.usable = True
        self.unpickled = False  # sent from another process: its steps stayed there
        self.kept: set[int] = set()  # ids of the twins the steps hold
        self.kept_bytes = 0  # their storages' bytes (at most MAX_PROGRAM_BYTES)

    def __reduce__(self):
        return _unusable, ()

    def same_answers(self, inputs: list[torch.Tensor]) -> bool:
        """Whether the reads, run on ``inputs`` (the tensors of another micro-batch, in the recorded order), all get
        the answers recorded; False where anything differs or fails."""
        if not self.usable or len(inputs) != self.inputs:
            return False
        outs: dict[int, list[torch.Tensor]] = {}
        with disable_current_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
            for index, (func, spec, encoded, answer) in enumerate(self.steps):
                leaves = [_decode(e, inputs, outs, func) for e in encoded]
                args, kwargs = pytree.tree_unflatten(leaves, spec)
                try:
                    out = func(*args, **kwargs)
                except Exception:  # noqa: BLE001 - other rows the ops refuse: not known to be the same step
                    return False
                if answer is not _NONE:
                    try:
                        if bool(out != answer):
                            return False
                    except Exception:  # noqa: BLE001 - an answer that does not compare: not known to be the same
                        return False
                else:
                    outs[index] = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        return True


_NONE = object()  # a step that is not a value read


def _unusable() -> RowProgram:
    program = RowProgram()
    program.usable, program.unpickled = False, True
    return program


def _decode(encoded: Any, inputs: list[torch.Tensor], outs: dict[int, list[torch.Tensor]], func) -> Any:
    """A leaf of a recorded step for a run on other rows: an input, an output of an earlier step, or the constant
    recorded (cloned where the op writes into it, so that the record stays as it was)."""
    if isinstance(encoded, _Ref):
        return inputs[encoded.index] if encoded.step < 0 else outs[encoded.step][encoded.index]
    if isinstance(encoded, _Const):
        return encoded.value.clone() if encoded.written else encoded.value
    return encoded


class _Ref:
    """A tensor of the sample's rows: input ``index`` (``step`` -1) or output ``index`` of step ``step``."""

    __slots__ = ("step", "index")

    def __init__(self, step: int, index: int) -> None:
        self.step, self.index = step, index


class _Const:
    """A tensor with a twin not made from the sample's rows: its twin, as the step read it."""

    __slots__ = ("value", "written")

    def __init__(self, value: torch.Tensor, written: bool) -> None:
        self.value, self.written = value, written


class ValueTwins(TorchDispatchMode):
    """Real twins of fake tensors that depend only on constants and inputs (Note [value twins])."""

    def __init__(self, max_bytes: int = MAX_TWIN_BYTES, *, where: Callable[[], str] | None = None) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.where = where  # the module running now (the tracker's), or None: who read values is not recorded
        self.readers: dict[str, None] = {}  # modules whose value reads the twins answered, in order (an ordered set)
        self._twins: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(fake) -> (its weak reference, twin)
        self._by_storage: dict[int, set[int]] = {}  # id(fake storage) -> ids of the fakes on it that have twins
        self._from_sample: dict[int, _Ref] = {}  # id(fake) -> where in ``program`` its twin (of the rows) was made
        self.program = RowProgram()  # the ops on the rows' values and the answers of its reads
        self.answered = 0  # value reads answered from twins
        self.sample_reads = 0  # of those, reads of values derived from the sample's rows
        self.sample_reader = ""  # the module of the first such read (``where()``), "" at the top level
        self._hearing = contextlib.ExitStack()

    def __enter__(self) -> ValueTwins:
        self._hearing.enter_context(hearing_skipped_writes(self._stale_all))  # Note [values inside compiled code]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._hearing.close()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """A compiled model's code runs compiled under the twins (Note [inductor without kernels],
        core/_torch_compile.py); with this False, dynamo skips the frame and never compiles its code again."""
        return True

    def add(self, fake: torch.Tensor, real: torch.Tensor, *, from_sample: bool = False,
            _ref: _Ref | None = None) -> None:
        """Give ``fake`` the real twin ``real`` (same shape and dtype); ``from_sample``: it is one of the sample's
        rows' tensors (the program's next input, counted even where it gets no twin: a meta tensor)."""
        if from_sample and _ref is None:
            _ref = _Ref(-1, self.program.inputs)
            self.program.inputs += 1
        if (not isinstance(fake, FakeTensor) or real.is_meta or tuple(fake.shape) != tuple(real.shape)
                or fake.dtype != real.dtype):
            return
        key, storage = id(fake), id(fake.untyped_storage())
        twins, by_storage, from_rows = self._twins, self._by_storage, self._from_sample

        def forget(_ref, key=key, storage=storage) -> None:
            twins.pop(key, None)
            from_rows.pop(key, None)
            by_storage.get(storage, set()).discard(key)

        twins[key] = (weakref.ref(fake, forget), real)
        by_storage.setdefault(storage, set()).add(key)
        if _ref is not None:
            from_rows[key] = _ref
        else:
            from_rows.pop(key, None)

    def twin(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s real twin; a plain real CPU tensor (a constant the code holds) is its own; None where unknown."""
        if isinstance(t, FakeTensor):
            entry = self._twins.get(id(t))
            return entry[1] if entry is not None and entry[0]() is t else None
        if type(t) is torch.Tensor and t.device.type == "cpu":
            return t
        return None  # a DTensor, a meta tensor, another subclass: no values known

    def _stale(self, t: torch.Tensor) -> None:
        """``t`` was written without its twin: every fake on its storage loses its twin."""
        if isinstance(t, FakeTensor):
            for key in self._by_storage.pop(id(t.untyped_storage()), set()):
                self._twins.pop(key, None)
                self._from_sample.pop(key, None)

    def _stale_all(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self._stale(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if running_compiled_code():  # no values inside (Note [values inside compiled code])
            out = func(*args, **kwargs)
            self._stale_all(_written(func, args, kwargs))
            return out
        leaves, spec = pytree.tree_flatten((args, kwargs))
        real_leaves = self._real_leaves(func, leaves)
        try:
            out = func(*args, **kwargs)
        except DATA_DEPENDENT_ERRORS as e:
            real = self._run_real(func, real_leaves, spec) if real_leaves is not None else None
            if real is None or any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(real)):
                setattr(e, WEIGHT_READ, real_leaves is None)
                raise
            self.answered += 1
            if self.where is not None:
                self.readers.setdefault(self.where(), None)
            if self._reads_sample(leaves):  # Note [rows that differ]
                if not self.sample_reads and self.where is not None:
                    self.sample_reader = self.where()
                self.sample_reads += 1
                self._record(func, spec, leaves, real_leaves, real)
            return real  # a value read (a scalar, a bool) answered from the twins
        written = _written(func, args, kwargs)
        outs = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        small = sum(x.numel() * x.element_size() for x in outs) <= self.max_bytes
        real = self._run_real(func, real_leaves, spec) if real_leaves is not None and small else None
        if real is None:
            for t in written:
                self._stale(t)
            return out
        real_outs = [x for x in pytree.tree_leaves(real) if isinstance(x, torch.Tensor)]
        if len(real_outs) == len(outs):
            step = self._record(func, spec, leaves, real_leaves) if self._reads_sample(leaves) else None
            for i, (fake, twin) in enumerate(zip(outs, real_outs)):
                self.add(fake, twin, _ref=None if step is None else _Ref(step, i))
        return out

    def _record(self, func, spec, leaves: list[Any], real_leaves: list[Any], answer: Any = _NONE) -> int:
        """Append the op to the program (Note [rows that differ]): each tensor of the rows by where it was made, the
        others by their twins; returns its step. The twins a program keeps alive are at most ``MAX_PROGRAM_BYTES``:
        past that it stops and is not usable (every micro-batch with values of its own is then simulated)."""
        program = self.program
        if not program.usable:
            return -2  # still the rows' values, for ``sample_reads``; never run
        written = {id(t) for t in _written(func, *pytree.tree_unflatten(leaves, spec))}
        encoded = []
        for x, r in zip(leaves, real_leaves):
            if isinstance(x, torch.Tensor):
                ref = self._from_sample.get(id(x)) if isinstance(x, FakeTensor) else None
                if ref is None and id(r) not in program.kept:
                    program.kept.add(id(r))
                    program.kept_bytes += r.untyped_storage().nbytes()
                encoded.append(ref if ref is not None else _Const(r, id(x) in written))
            else:
                encoded.append(x)
        if program.kept_bytes > MAX_PROGRAM_BYTES:
            program.usable, program.steps, program.kept = False, [], set()
            return -2
        program.steps.append((func, spec, encoded, answer))
        return len(program.steps) - 1

    def _reads_sample(self, leaves: list[Any]) -> bool:
        """Whether a tensor among ``leaves`` has a twin derived from the sample's rows."""
        return bool(self._from_sample) and any(
            isinstance(x, FakeTensor) and id(x) in self._from_sample for x in leaves)

    def _real_leaves(self, func, leaves: list[Any]) -> list[Any] | None:
        """The op's arguments with each tensor replaced by its twin, or None when one has none."""
        if func.namespace not in ("aten", "prims"):
            return None
        real = list(leaves)
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                twin = self.twin(x)
                if twin is None:
                    return None
                real[i] = twin
        return real

    def _run_real(self, func, real_leaves: list[Any], spec) -> Any:
        """The op on the twins, for real, outside every mode (the tracker counts nothing of it); None if it fails."""
        args, kwargs = pytree.tree_unflatten(real_leaves, spec)
        try:
            with disable_current_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        except Exception:  # noqa: BLE001 - no twin then: a later read of it refuses as without twins
            return None


def reader_note(readers: list[str]) -> str:
    """The note of a step whose branches or sizes followed values of the sample (Note [value twins])."""
    named = ", ".join(repr(m) if m else "the model's top-level forward (or the loss)" for m in readers[:5])
    more = f" and {len(readers) - 5} more" if len(readers) > 5 else ""
    return (f"{'module ' if readers[0] else ''}{named}{more} read tensor values computed from the inputs (a branch "
            "such as `if x.mean() > 0:`, a mask check, `.item()`): the step was simulated on the path the sample's "
            "values take, and a batch with other values can take another path with another peak (see Note [value "
            "twins])")


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func`` writes into (its schema's mutable arguments)."""
    written = []
    for i, a in enumerate(op_schema(func).arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        written += [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]
    return written
