"""Predicted step time, for ranking configurations (not a promise of wall-clock seconds).

For one micro-batch of b samples: the forward's FLOPs F(b) from the analysis, backward ~ 2 F(b) (the usual
fwd:bwd = 1:2 of Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1), plus the forward of
every recomputed module; divided by the device's throughput at that precision and by its utilisation at that size.
Each micro-batch also pays a fixed cost per op launched (Python, dispatcher, kernel launch), which is why larger
micro-batches win when they fit. The optimizer step streams parameters, gradients and state once per window.
See docs/planner.md for the assumptions; ``autofit.gpu`` supplies the GPU figures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["Throughput", "CPU", "TimeModel"]


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """What the device does per second, by precision name ("fp32", "bf16", "fp16")."""

    name: str
    flops_per_second: Mapping[str, float]
    bytes_per_second: float  # memory bandwidth
    op_overhead_seconds: float  # fixed cost of launching one op
    saturation_flops: float = 0.0  # FLOPs per op at which the device reaches half its peak (0: always at peak)

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops_per_second", MappingProxyType(dict(self.flops_per_second)))

    def utilisation(self, flops_per_op: float) -> float:
        """Fraction of peak reached by ops of this size (1 / (1 + knee / size), a roofline-style knee)."""
        if self.saturation_flops <= 0:
            return 1.0
        return flops_per_op / (flops_per_op + self.saturation_flops)


# A nominal CPU: autocast to bf16 or fp16 does not make CPU matmuls faster by itself, so the CPU ranking is decided by
# memory (micro-batch size) and overhead; the absolute numbers only scale the printed seconds.
CPU = Throughput(
    name="cpu", flops_per_second={"fp32": 1.0e11, "bf16": 1.0e11, "fp16": 0.5e11}, bytes_per_second=2.0e10,
    op_overhead_seconds=1.0e-5,
)


@dataclass(frozen=True)
class StepTime:
    compute_seconds: float
    recompute_seconds: float
    overhead_seconds: float
    optimizer_seconds: float

    @property
    def total(self) -> float:
        return self.compute_seconds + self.recompute_seconds + self.overhead_seconds + self.optimizer_seconds


@dataclass(frozen=True)
class TimeModel:
    throughput: Throughput
    flops_fixed: int  # forward FLOPs of one micro-batch: fixed + per_sample * b
    flops_per_sample: int
    ops_per_micro_batch: int  # ops launched by one forward + backward
    optimizer_bytes: int  # bytes the optimizer step reads and writes
    recompute_flops: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # module -> (fixed, per_sample)

    def step_time(self, precision: str, batch: int, accumulation_steps: int, checkpoint: tuple[str, ...] = (),
                  last_batch: int | None = None) -> StepTime:
        """Time of one optimizer step: ``accumulation_steps`` micro-batches (the last may be ``last_batch``)."""
        sizes = [batch] * (accumulation_steps - 1) + [last_batch or batch]
        peak = self.throughput.flops_per_second[precision]
        compute = recompute = 0.0
        for b in sizes:
            forward = self.flops_fixed + self.flops_per_sample * b
            extra = sum(f + s * b for f, s in (self.recompute_flops[n] for n in checkpoint))
            per_op = 3 * forward / max(self.ops_per_micro_batch, 1)
            rate = peak * self.throughput.utilisation(per_op)
            compute += 3 * forward / rate
            recompute += extra / rate
        overhead = len(sizes) * self.ops_per_micro_batch * self.throughput.op_overhead_seconds
        optimizer = self.optimizer_bytes / self.throughput.bytes_per_second
        return StepTime(compute, recompute, overhead, optimizer)
