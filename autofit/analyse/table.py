"""Typed results of the analysis: one row per module, and the table and graph they came from."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from autofit.analyse.profile import StepProfile
from autofit.capture.graph import Graph
from autofit.simulate.timeline import Timeline
from autofit.core.units import format_bytes

__all__ = ["LayerRow", "LayerTable", "Analysis", "OpCosts", "precision_of"]


# float8 operands: the _scaled_mm kernels of torchao's Float8Linear (Note [Float8 training], features/float8.py)
_PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp32",
                       "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8"}


@dataclass(frozen=True)
class OpCosts:
    """Per-op FLOPs and bytes of one micro-batch's forward and backward, linear in b: fixed + per_sample * b."""

    flops_fixed: np.ndarray
    flops_per_sample: np.ndarray
    bytes_fixed: np.ndarray
    bytes_per_sample: np.ndarray
    precision: tuple[str, ...]  # "fp32" / "bf16" / "fp16" per op
    forward: np.ndarray  # bool per op
    module: tuple[str, ...]  # innermost module per op
    # bool per op: a selective recomputation keeps its outputs and does not run it again (autofit/training/recompute.py);
    # None: no op is kept
    kept: np.ndarray | None = None
    # int per op under torchtitan's per-op policy ("op-selective", autofit/training/recompute.py): 1 its outputs
    # are kept, 2 an ``mm`` (of a recomputed module's, the 1st, 3rd, ... are kept), 0 it runs again; None: all 0
    op_selective: np.ndarray | None = None

    def under(self, names) -> np.ndarray:
        """Bool per op: its module is one of ``names`` or inside one ("layers.1.mlp" under "layers.1"; never a
        sibling sharing the prefix, "layers.10")."""
        names = frozenset(names)
        prefixes = tuple(n + "." for n in names)
        distinct, index = self._modules
        return np.array([m in names or m.startswith(prefixes) for m in distinct], dtype=bool)[index]

    @cached_property
    def _modules(self) -> tuple[list[str], np.ndarray]:
        """The distinct module names and, per op, the index of its own: ``under`` tests each name once, not once
        per op (a 70B-shaped Llama's ops name about 1,300 modules over 136,000 ops, and the search asks for hundreds
        of sets)."""
        position: dict[str, int] = {}
        index = np.fromiter((position.setdefault(m, len(position)) for m in self.module), dtype=np.int64,
                            count=len(self.module))
        return list(position), index


def precision_of(dtype: str) -> str:
    return _PRECISION_OF_DTYPE.get(dtype, "fp32")


@dataclass(frozen=True, kw_only=True)
class LayerRow:
    """One module (totals over its whole subtree and all its calls in one forward).

    Activation figures are linear in the micro-batch ``b``: ``fixed + per_sample * b``, fitted on simulations at b = 2
    and b = 3. "Saved" bytes are tensors created inside the module that autograd keeps for backward: what
    checkpointing the module frees during forward (its outputs and inputs stay, see ``checkpoint_savings``).
    """

    name: str  # qualified name; "" is the whole model
    type: str
    calls: int  # times the module ran in one forward
    param_bytes: int
    saved_bytes_per_sample: int
    saved_bytes_fixed: int
    output_bytes_per_sample: int
    output_bytes_fixed: int
    input_bytes_per_sample: int
    input_bytes_fixed: int
    flops_per_sample: int  # forward FLOPs
    flops_fixed: int
    checkpointable: bool
    reason: str = ""  # why the module cannot be a checkpoint segment ("" when it can)

    def saved_bytes(self, batch: int) -> int:
        return self.saved_bytes_fixed + self.saved_bytes_per_sample * batch

    def output_bytes(self, batch: int) -> int:
        return self.output_bytes_fixed + self.output_bytes_per_sample * batch

    def input_bytes(self, batch: int) -> int:
        return self.input_bytes_fixed + self.input_bytes_per_sample * batch

    def flops(self, batch: int) -> int:
        return self.flops_fixed + self.flops_per_sample * batch

    def checkpoint_savings(self, batch: int) -> int:
        """Bytes checkpointing this module frees during forward: what it saves, except what it returns."""
        return max(0, self.saved_bytes(batch) - self.output_bytes(batch))


@dataclass(frozen=True)
class LayerTable:
    rows: tuple[LayerRow, ...]
    precision: str

    def row(self, name: str) -> LayerRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def largest(self, n: int = 10, *, batch: int = 1, leaves_only: bool = True) -> list[LayerRow]:
        """The ``n`` modules that save the most activation memory at ``batch`` (leaf modules by default)."""
        names = [r.name for r in self.rows]
        leaves = [r for r in self.rows if r.name and not any(o.startswith(r.name + ".") for o in names)]
        pool = leaves if leaves_only else [r for r in self.rows if r.name]
        return sorted(pool, key=lambda r: -r.saved_bytes(batch))[:n]

    def format(self, batch: int = 1, limit: int | None = None) -> str:
        head = f"{'module':<40} {'type':<22} {'params':>11} {'saved/b':>11} {'output/b':>11} {'GFLOP/b':>9} ckpt"
        lines = [head, "-" * len(head)]
        for r in self.rows[: limit or len(self.rows)]:
            lines.append(
                f"{(r.name or '(model)')[:40]:<40} {r.type[:22]:<22} {format_bytes(r.param_bytes):>11} "
                f"{format_bytes(r.saved_bytes(batch)):>11} {format_bytes(r.output_bytes(batch)):>11} "
                f"{r.flops(batch) / 1e9:>9.3f} {'yes' if r.checkpointable else 'no'}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


@dataclass(frozen=True)
class Analysis:
    """What ``autofit.analyse`` returns: the traced graph, the per-layer table and the valid checkpoint segments."""

    graph: Graph
    table: LayerTable
    profile: StepProfile  # peak of each stage of the step as a function of the micro-batch (no checkpointing)
    method: str = "fake"  # how the step was simulated: "fake", or "real" for data-dependent models
    timeline: Timeline | None = None  # the simulated window at the smaller analysis size
    timeline_next: Timeline | None = None  # ... and at the larger one
    ops: OpCosts | None = None  # per-op FLOPs and bytes of one micro-batch (the roofline time model's input)

    @property
    def boundaries(self) -> tuple[str, ...]:
        """Modules that may be checkpoint segments: their inputs and outputs are the only tensors crossing them."""
        return tuple(r.name for r in self.table.rows if r.name and r.checkpointable)

    @property
    def layers(self) -> tuple[LayerRow, ...]:
        return self.table.rows

    def __str__(self) -> str:
        return f"graph captured by {self.graph.method}, {len(list(self.graph.graph.nodes))} nodes\n{self.table}"
