"""The device a plan targets: how much memory it has, how fast it is, and how an estimate maps onto it."""

from __future__ import annotations

import os
from dataclasses import dataclass

from autofit.errors import InvalidInputError
from autofit.solve.time_model import CPU, Throughput

__all__ = ["DeviceTarget", "resolve_device"]


@dataclass(frozen=True)
class DeviceTarget:
    kind: str  # "cpu" or "cuda"
    total_bytes: int | None  # what "90%" budgets are a share of
    throughput: Throughput
    name: str | None = None  # the GPU model, e.g. "A100-80GB"
    supports_bf16: bool = True
    gpu: object | None = None  # the GPUSpec for "cuda"
    note: str | None = None  # an assumption the plan should state (e.g. the default GPU)
    interconnect_bytes_per_second: float = 5e9  # between ranks (CPU processes: gloo over shared memory / TCP)

    def default_precisions(self) -> tuple[str, ...]:
        """"auto" precision, fastest first (the order the quick path and the search's tie-break use). On the CPU
        the time model rates bf16 at 0.8x and fp16 at 0.5x the fp32 FLOP rate (autocast adds casts and does not
        speed most CPU kernels up), so fp32 leads and bf16 wins only when the memory it saves buys a faster
        configuration: a larger micro-batch, or less recomputation. GPUs without bf16 (V100, T4) get fp16."""
        if self.kind == "cpu":
            return ("fp32", "bf16")
        return ("bf16", "fp32") if self.supports_bf16 else ("fp16", "fp32")


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def resolve_device(device: str, gpu: str | None = None) -> DeviceTarget:
    kind = str(device).split(":")[0]
    if kind == "cpu":
        if gpu is not None:
            raise InvalidInputError("gpu= names a GPU model; it only applies with device='cuda'")
        return DeviceTarget("cpu", _host_memory(), CPU)
    if kind == "cuda":
        from autofit.cuda.target import cuda_target

        return cuda_target(gpu)
    raise InvalidInputError(f"device must be 'cpu' or 'cuda', got {device!r}")
