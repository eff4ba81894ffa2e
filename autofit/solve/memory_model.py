"""Predicted peak of a configuration, from the analysis alone (no simulation per candidate).

Without checkpointing, the profile gives the live bytes after every event of the window as a line in the
micro-batch b (``analyse/profile.py``), so any stage's peak is exact. Checkpointing a module m edits those lines,
call by call (non-reentrant ``torch.utils.checkpoint``; see Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost", for the idea):
- from the end of the call's forward until its backward begins, what it saved for backward and did not return is
  gone: ``saved_c(b)`` comes off every event in between;
- when its backward begins, the call's forward runs again: its saved tensors are back from then on (as in the
  plain run), and its non-saved intermediates come and go at that instant (the call's high-water mark above what
  it saved);
- non-reentrant checkpoint keeps the call's inputs and a copy of the CPU RNG state (``torch.get_rng_state()``)
  until the call's backward is done: an input the plain run frees earlier lives longer.
A selectively recomputed call (autofit/training/recompute.py) is the same edit with less dropped: from the end of its forward
to its backward it keeps its matmul and attention outputs (``CallRecord.kept``), so ``saved_c(b) - kept_c(b)``
comes off. Its recompute spike is counted as the full one's (an upper bound: it reruns fewer ops).
The optimizer stage does not change. The planner verifies its winner with a full simulation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch

from autofit.analyse.profile import CallRecord, StepProfile
from autofit.analyse.table import LayerTable
from autofit.simulate.timeline import Phase
from autofit.solve.checkpoint_milp import CheckpointProblem, nested_pairs

__all__ = ["CheckpointUnit", "MemoryModel", "Edit", "rng_state_bytes", "contained_sums", "window_max",
           "nested_pairs"]


def rng_state_bytes() -> int:
    """Bytes of ``torch.get_rng_state()`` (5056 on current builds): stashed per checkpointed call."""
    return torch.get_rng_state().numel()


@dataclass(frozen=True)
class CheckpointUnit:
    """A module that may be recomputed: its calls in the window and the FLOPs recomputing one forward costs."""

    name: str
    calls: tuple[CallRecord, ...]
    flops_fixed: int
    flops_per_sample: int

    def flops(self, batch: int) -> int:
        return max(0, self.flops_fixed + self.flops_per_sample * batch)


@dataclass(frozen=True)
class Edit:
    """What checkpointing one call does to the live-bytes line, at one batch size."""

    unit: int  # index of the unit
    start: int  # the RNG stash is live from here...
    end: int  # ...saved bytes leave after this event...
    recompute_at: int  # ...and come back here, where the recompute's own intermediates also peak
    stage_end: int  # the call's backward is over here (exclusive): inputs and RNG stash are released
    saved: int
    spike: int
    kept: tuple[tuple[int, int], ...] = ()  # (event the plain run frees it, bytes) of inputs held longer


def units_from(profile: StepProfile, table: LayerTable) -> tuple[CheckpointUnit, ...]:
    by_name: dict[str, list[CallRecord]] = {}
    for call in profile.calls:
        by_name.setdefault(call.name, []).append(call)
    units = []
    for row in table.rows:
        calls = tuple(c for c in by_name.get(row.name, ()) if c.recompute_at >= 0)
        if not row.checkpointable or not calls:
            continue
        if all(c.saved[0] <= 0 and c.saved[1] <= 0 for c in calls):
            continue  # nothing to drop: recomputing it would only cost time
        units.append(CheckpointUnit(row.name, calls, row.flops_fixed, row.flops_per_sample))
    return tuple(units)


@dataclass(frozen=True)
class MemoryModel:
    profile: StepProfile
    units: tuple[CheckpointUnit, ...]
    rng_bytes: int
    held_rows: int = 0  # rows of the batch resident all window (the trainer slices micro-batches from them)
    row_bytes: int = 0  # input + target bytes per row
    # Device terms on top of the tensors (CUDA: allocator reserve, cuBLAS workspace, context), as an affine map
    # calibrated on the analysis run: device_bytes = scale * tensor_bytes + constant.
    scale: float = 1.0
    constant: int = 0
    # the model of a step of one micro-batch where this window's first micro-batch is not that step (FSDP2 skips its
    # gradient sync there: Note [an accumulation-free FSDP2 step], solve/space.py); None: this model prices it too
    single: MemoryModel | None = None

    def window(self, accumulation_steps: int) -> MemoryModel:
        """The model that prices a window of ``accumulation_steps`` micro-batches: :attr:`single` for one, where set."""
        return self.single if accumulation_steps == 1 and self.single is not None else self

    def to_device(self, tensor_bytes: int) -> int:
        return int(round(tensor_bytes * self.scale)) + self.constant

    def tensor_budget(self, device_budget: int) -> int:
        """The tensor bytes that map to ``device_budget`` device bytes (the inverse of ``to_device``)."""
        return int((device_budget - self.constant) / self.scale)

    @classmethod
    def from_analysis(cls, profile: StepProfile, table: LayerTable, *, held_rows: int = 0, row_bytes: int = 0,
                      scale: float = 1.0, constant: int = 0, single: MemoryModel | None = None) -> MemoryModel:
        return cls(profile, units_from(profile, table), rng_state_bytes(), held_rows, row_bytes, scale, constant,
                   single)

    def held_bytes(self, batch: int) -> int:
        """Input rows resident beyond the micro-batch's own (the profile already counts those)."""
        return max(0, self.held_rows - batch) * self.row_bytes

    def index(self, name: str) -> int:
        for i, u in enumerate(self.units):
            if u.name == name:
                return i
        raise KeyError(name)

    # ---- the pieces the search and the MILP use -----------------------------------------------------------------
    def activation_ranges(self, accumulation_steps: int) -> list[tuple[int, int]]:
        """Event ranges of the forward and backward stages the window runs (checkpointing acts on these)."""
        ranges = []
        for micro in self.profile.micro_batches(accumulation_steps):
            lo, _ = self.profile.bounds(micro, Phase.FORWARD)
            _, hi = self.profile.bounds(micro, Phase.BACKWARD)
            if hi > lo:
                ranges.append((lo, hi))
        return ranges

    def optimizer_peak(self, batch: int) -> int:
        return self.profile.stage(1, Phase.OPTIMIZER, batch) + self.held_bytes(batch)

    def variables(self, batch: int, selective: bool = True, always: frozenset[str] = frozenset(),
                  op_selective: frozenset[str] = frozenset()) -> tuple[tuple[int, str], ...]:
        """The MILP's units as (module unit, policy): every module fully recomputed, and, with ``selective``, each
        module whose selective recomputation differs from the full one (it keeps something) and drops something
        (some call saves more than it keeps), or is named in ``always``; and the modules named in ``op_selective``
        under torchtitan's per-op policy (the user's choice only, never searched)."""
        full = tuple((u, "full") for u in range(len(self.units)))
        ops = tuple((u, "op-selective") for u, unit in enumerate(self.units) if unit.name in op_selective)
        if not selective:
            return full + ops
        return full + tuple(
            (u, "selective") for u, unit in enumerate(self.units) if unit.name in always
            or (any(c.kept_bytes(batch) > 0 for c in unit.calls)
                and any(c.saved_bytes(batch) > c.kept_bytes(batch) for c in unit.calls))) + ops

    def edits(self, batch: int, accumulation_steps: int, units: Iterable[int | tuple[int, str]]) -> list[Edit]:
        """The edits of ``units`` (module units, fully recomputed, or (unit, policy) pairs); ``Edit.unit`` is the
        position in ``units``."""
        micros = self.profile.micro_batches(accumulation_steps)
        edits = []
        for v, spec in enumerate(units):
            u, policy = spec if isinstance(spec, tuple) else (spec, "full")
            for call in self.units[u].calls:
                if call.micro not in micros:
                    continue
                saved = call.saved_bytes(batch)
                spike = max(0, self.profile.internal_bytes(call, batch) - saved)
                if policy != "full":
                    saved -= call.kept_bytes(batch, policy)
                release = call.backward_end + 1
                kept = tuple((f, call.input_bytes(i, batch)) for i, (f, _, _) in enumerate(call.inputs)
                             if f < release)
                edits.append(Edit(v, call.start, call.end, call.recompute_at, release, saved, spike, kept))
        return edits

    # ---- the constraints of the checkpoint MILP, and the prediction --------------------------------------------
    def problem(self, batch: int, accumulation_steps: int, *, selective: bool = True,
                always: frozenset[str] = frozenset(), op_selective: frozenset[str] = frozenset()) -> CheckpointProblem:
        """Constraints ``base_i + coef_i . x`` over the stretches of the window where the set of checkpoint edits in
        force is constant (so each stretch's peak is its plain peak plus a constant), the recompute instants, and
        the optimizer stage (which checkpointing does not touch). Units: every module fully recomputed, then (with
        ``selective``) those that may be recomputed selectively (:meth:`variables`); a selective unit costs its
        module's FLOPs until the search prices it (candidate.py)."""
        live = self.profile.live(batch)
        variables = self.variables(batch, selective, always, op_selective)
        n_units = len(variables)
        edits = self.edits(batch, accumulation_steps, variables)
        unit = np.array([e.unit for e in edits], dtype=np.int64)
        start = np.array([e.start for e in edits], dtype=np.int64)
        end = np.array([e.end for e in edits], dtype=np.int64)
        rec = np.array([e.recompute_at for e in edits], dtype=np.int64)
        send = np.array([e.stage_end for e in edits], dtype=np.int64)
        saved = np.array([e.saved for e in edits], dtype=np.int64)
        spike = np.array([e.spike for e in edits], dtype=np.int64)
        onehot = np.zeros((len(edits), n_units))
        onehot[np.arange(len(edits)), unit] = 1.0
        # inputs held longer than in the plain run: one pseudo-edit each, from its plain free to the release
        k_unit = np.array([e.unit for e in edits for _ in e.kept], dtype=np.int64)
        k_from = np.array([f for e in edits for f, _ in e.kept], dtype=np.int64)
        k_to = np.array([e.stage_end for e in edits for _ in e.kept], dtype=np.int64)
        k_bytes = np.array([n for e in edits for _, n in e.kept], dtype=np.int64)

        def coefficients(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
            # Note [coefficients by intervals]
            return contained_sums(lo, hi, ((end + 1, rec, unit, -saved),  # dropped until recomputed
                                           (start, send, unit, np.full(len(unit), self.rng_bytes, dtype=np.int64)),
                                           (k_from, k_to, k_unit, k_bytes)), n_units).astype(np.float64)

        los, his = [], []
        for lo, hi in self.activation_ranges(accumulation_steps):
            cuts = np.concatenate([[lo, hi], end + 1, rec, start, send, k_from, k_to])
            cuts = np.unique(cuts[(cuts >= lo) & (cuts <= hi)])
            los.append(cuts[:-1])
            his.append(cuts[1:])
        lo = np.concatenate(los) if los else np.zeros(0, dtype=np.int64)
        hi = np.concatenate(his) if his else np.zeros(0, dtype=np.int64)
        base = window_max(live, lo, hi).astype(np.float64)
        coef = coefficients(lo, hi) if len(edits) else np.zeros((len(lo), n_units))
        # the recompute instants: the call's saved tensors are back, its own intermediates peak on top
        spike_coef = coefficients(rec, rec + 1) + onehot * (spike[:, None])
        held = self.held_bytes(batch)
        rows_base = np.concatenate([base + held, live[rec].astype(np.float64) + held,
                                    [float(self.optimizer_peak(batch))]])
        rows_coef = np.vstack([coef, spike_coef, np.zeros((1, n_units))])
        names = tuple(self.units[u].name for u, _ in variables)
        exclusive = nested_pairs(names)
        costs = np.array([float(self.units[u].flops(batch)) for u, _ in variables])
        policies = tuple(p for _, p in variables)
        by_unit: dict[int, list[int]] = {}
        for v, (u, _) in enumerate(variables):
            by_unit.setdefault(u, []).append(v)
        groups = tuple(tuple(by_unit[u]) for u in range(len(self.units)) if len(by_unit.get(u, ())) > 1)
        return CheckpointProblem(names, costs, rows_base, rows_coef, exclusive, policies, groups)

    def window_problem(self, batch: int, accumulation_steps: int, *, selective: bool = True) -> CheckpointProblem:
        """:meth:`problem` without the optimizer stage's row: the forward and backward stretches alone. Where the
        optimizer step holds the peak, every checkpoint set has the same modelled peak, but not the same device
        bytes: the caching allocator keeps the segments the activations needed reserved through the optimizer step
        (cuda/allocator.py), so the set that lowers the window most is the one the smallest budget needs."""
        full = self.problem(batch, accumulation_steps, selective=selective)
        return replace(full, base=full.base[:-1], coef=full.coef[:-1])

    def peak(self, batch: int, accumulation_steps: int, checkpoint: Iterable[str] = (),
             selective: Iterable[str] = (), op_selective: Iterable[str] = ()) -> int:
        """Modelled peak of the window with ``checkpoint`` recomputed, those in ``selective`` selectively, those in
        ``op_selective`` by torchtitan's per-op policy."""
        names, selective, op_selective = list(checkpoint), set(selective), frozenset(op_selective)
        known = {u.name for u in self.units}
        problem = self.problem(batch, accumulation_steps, selective=bool(selective), always=frozenset(selective),
                               op_selective=op_selective)
        where = {(n, p): i for i, (n, p) in enumerate(zip(problem.names, problem.policies))}
        policy = {n: "selective" for n in selective} | {n: "op-selective" for n in op_selective}
        chosen = [where[(n, policy.get(n, "full"))] for n in names if n in known]
        # modules the user forces that the analysis saw nothing to gain from still stash the RNG state
        extra = sum(1 for n in names if n not in known) * self.rng_bytes
        return problem.peak(chosen) + extra


# Note [coefficients by intervals]
#     A row of the checkpoint MILP is a stretch [lo, hi] of events (or a recompute instant [r, r + 1]); an edit
#     (its dropped bytes, its RNG stash, an input it holds longer) counts in a row when its interval [a, b] holds the
#     stretch: lo >= a and hi <= b. Tested densely, that is rows x edits booleans per term, times a one-hot matrix:
#     GPT-2-XL's plan on a T4 (48 blocks, states on the host) spent 13.1 CPU s building the 26 problems of its first
#     search. The rows sorted by lo (then hi) never have their hi fall (the stretches cut a window into consecutive
#     pieces; the instants are one event long), so the rows an interval holds are one run [first lo >= a, last
#     hi <= b]: each edit adds its bytes to its unit at the run's start and takes them off past its end, and one
#     running sum down the rows gives every coefficient (1.5 CPU s for the same 26). The bytes are integers, summed
#     exactly in int64 (the float64 product of integers below 2 ** 53 was exact too), so the coefficients are the
#     same numbers; rows whose hi does fall take the dense test (tests/test_memory_model_rows.py).
def contained_sums(lo: np.ndarray, hi: np.ndarray, terms, n_units: int) -> np.ndarray:
    """``out[r, u]``: for each term ``(a, b, unit, value)`` (arrays over intervals), the sum of ``value[e]`` over
    the intervals ``[a[e], b[e]]`` of unit ``u`` that hold the row ``[lo[r], hi[r]]`` (``lo[r] >= a[e]`` and
    ``hi[r] <= b[e]``), in int64. See Note [coefficients by intervals]."""
    rows = len(lo)
    out = np.zeros((rows, n_units), dtype=np.int64)
    if not rows:
        return out
    order = np.lexsort((hi, lo))
    los, his = lo[order], hi[order]
    if np.any(his[1:] < his[:-1]):  # not one run per interval: the dense test
        for a, b, unit, value in terms:
            inside = (lo[:, None] >= a[None, :]) & (hi[:, None] <= b[None, :])
            for u in np.unique(unit):
                out[:, u] += (inside[:, unit == u] * value[unit == u][None, :]).sum(axis=1)
        return out
    steps = np.zeros((rows + 1, n_units), dtype=np.int64)
    for a, b, unit, value in terms:
        first = np.searchsorted(los, a, side="left")  # rows from here on start at or after a
        past = np.searchsorted(his, b, side="right")  # rows before here end at or before b
        hit = first < past
        np.add.at(steps, (first[hit], unit[hit]), value[hit])
        np.add.at(steps, (past[hit], unit[hit]), -value[hit])
    sums = np.cumsum(steps[:-1], axis=0)
    if np.array_equal(order, np.arange(rows)):
        return sums
    out[order] = sums
    return out


def window_max(live: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``live[lo[i]:hi[i]].max()`` for every i (each window non-empty)."""
    if not len(lo):
        return np.zeros(0, dtype=live.dtype)
    padded = np.append(live, live[-1:])  # reduceat's indices must lie inside the array: hi may be its length
    return np.maximum.reduceat(padded, np.ravel(np.column_stack([lo, hi])))[::2]
