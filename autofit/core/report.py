"""The memory figures ``estimate`` and ``measure`` hand back: a peak and where its bytes go."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from autofit.core.categories import Category
from autofit.core.units import format_bytes

__all__ = ["MemoryEstimate", "Measurement", "EXPANDABLE_SEGMENTS"]

# PYTORCH_CUDA_ALLOC_CONF that a plan sets where only expandable segments fit its budget (autofit/device.py)
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def _frozen(breakdown: Mapping) -> Mapping[str, int]:
    return MappingProxyType({str(k): int(v) for k, v in sorted(breakdown.items(), key=lambda kv: -kv[1]) if v})


def _table(title: str, peak: int, breakdown: Mapping[str, int]) -> str:
    lines = [f"{title}: {format_bytes(peak)} ({peak:,} bytes)"]
    width = max((len(k) for k in breakdown), default=0)
    for key, value in breakdown.items():
        share = 100 * value / peak if peak else 0.0
        lines.append(f"  {key:<{width}}  {format_bytes(value):>12}  {share:5.1f} %")
    return "\n".join(lines)


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak of one steady-state training step, as three figures (docs/cuda.md, "The three figures"):

    - ``peak_allocated_bytes``: bytes in allocated blocks at the peak, comparable with
      ``torch.cuda.max_memory_allocated()`` (CUDA: tensors rounded to 512 bytes plus the cuBLAS workspace) or the
      CPU allocator's high-water mark. ``peak_bytes`` is the same number, under the name the API began with.
    - ``peak_reserved_bytes``: what the caching allocator has reserved from the driver at that point, comparable with
      ``torch.cuda.max_memory_reserved()`` (allocated plus the ``fragmentation`` reserve).
    - ``device_bytes``: what the process holds on the device, comparable with nvidia-smi: reserved plus the CUDA
      context, on a card with room to spare. The breakdown adds up to it.

    And the one a budget is checked against: ``min_device_bytes``, the smallest budget the step runs under. On CUDA
    the caching allocator frees cached segments when a new one would not fit (Note [allocating under a cap] in
    autofit/cuda/allocator.py), so it can be below ``device_bytes``, never below allocated plus context;
    :meth:`within` is the estimate under a given budget. On the CPU there is no reserve and no context: all are equal.
    """

    peak_bytes: int
    breakdown: Mapping[str, int]
    device: str = "cpu"
    device_bytes: int = 0
    peak_reserved_bytes: int = 0
    peak_phase: str = ""  # "forward", "backward" or "optimizer"
    peak_at: str = ""  # the op and module at the peak, e.g. "convolution_backward in layer1.0.conv1"
    method: str = "fake"  # "fake" (fake tensors) or "real" (data-dependent model run on the CPU)
    notes: tuple[str, ...] = field(default_factory=tuple)
    # host memory an offloading step holds (Note [host storages]): its high-water mark, pinned by the CUDA engines
    # (save_on_cpu and FSDP2's CPUOffloadPolicy pin what they offload), with its breakdown; 0 when nothing offloads
    host_bytes: int = 0
    host_breakdown: Mapping[str, int] = field(default_factory=dict)
    min_device_bytes: int = 0  # the smallest budget the step runs under (0: device_bytes)
    # the PYTORCH_CUDA_ALLOC_CONF the figures assume: "" for the default allocator, "expandable_segments:True" where
    # only that fits the budget (Note [expandable segments as a plan knob], autofit/device.py)
    alloc_conf: str = ""  # "" or EXPANDABLE_SEGMENTS
    # the figures assume every gradient allocated before the first forward and kept between steps, where only that
    # fits the budget (Note [gradients before forward as a plan knob], autofit/solve/estimator.py)
    preallocated_grads: bool = False
    # rows of inputs and targets resident all step (Note [one configuration, one figure], autofit/emit/assemble.py):
    # the whole batch of micro_batch_size x accumulation_steps rows that trainer.step receives and slices
    # (estimate's default, inputs="batch", and every plan), or one micro-batch (inputs="micro-batch"); 0: unknown
    input_rows: int = 0
    # (global rank, its simulated peak of allocated bytes) of each rank whose step differs (a pipeline's stages),
    # where more than one does; every other figure is the highest one's (Layout.distinct_ranks)
    rank_peaks: tuple[tuple[int, int], ...] = ()
    # the estimate under a budget below device_bytes, or None when the step does not run under it; set by the
    # device model that can tell (CUDA), None elsewhere
    under: Callable[[int], MemoryEstimate | None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "breakdown", _frozen(self.breakdown))
        object.__setattr__(self, "host_breakdown", _frozen(self.host_breakdown))
        if not self.peak_reserved_bytes:  # the reserve beyond the allocated blocks is the fragmentation term
            reserved = self.peak_bytes + self.breakdown.get(str(Category.FRAGMENTATION), 0)
            object.__setattr__(self, "peak_reserved_bytes", reserved)
        if not self.device_bytes:
            object.__setattr__(self, "device_bytes", self.peak_reserved_bytes)
        if not self.min_device_bytes:
            object.__setattr__(self, "min_device_bytes", self.device_bytes)

    def within(self, budget: int) -> MemoryEstimate | None:
        """This step's estimate when the process may hold ``budget`` device bytes: itself when it holds no more
        unconstrained, the device model's estimate under the cap when that runs, else None (it runs out of
        memory)."""
        if self.device_bytes <= budget:
            return self
        return None if self.under is None else self.under(budget)

    def to_dict(self) -> dict:
        """The figures as plain JSON values (a plan's ``estimate``); :meth:`from_dict` reads them back."""
        return {
            "peak_bytes": self.peak_bytes, "device_bytes": self.device_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
            "breakdown": dict(self.breakdown), "device": self.device, "peak_phase": self.peak_phase,
            "peak_at": self.peak_at, "method": self.method, "notes": list(self.notes), "host_bytes": self.host_bytes,
            "host_breakdown": dict(self.host_breakdown), "min_device_bytes": self.min_device_bytes,
            "alloc_conf": self.alloc_conf, "preallocated_grads": self.preallocated_grads,
            "input_rows": self.input_rows,
        }

    @classmethod
    def from_dict(cls, est: Mapping) -> MemoryEstimate:
        """The estimate :meth:`to_dict` wrote (fields added later default when absent)."""
        return cls(
            peak_bytes=int(est["peak_bytes"]), breakdown=est["breakdown"], device=est["device"],
            device_bytes=int(est["device_bytes"]), peak_reserved_bytes=int(est.get("peak_reserved_bytes", 0)),
            peak_phase=est["peak_phase"], peak_at=est["peak_at"], method=est["method"], notes=tuple(est["notes"]),
            host_bytes=int(est.get("host_bytes", 0)), host_breakdown=est.get("host_breakdown", {}),
            min_device_bytes=int(est.get("min_device_bytes", 0)), alloc_conf=str(est.get("alloc_conf", "")),
            preallocated_grads=bool(est.get("preallocated_grads", False)), input_rows=int(est.get("input_rows", 0)),
        )

    @property
    def host_pinned_bytes(self) -> int:
        """The part of ``host_bytes`` in pinned (page-locked) memory: what the engines copy over PCIe, i.e. packed
        activations, parameter shards and offloaded gradients (save_on_cpu and FSDP2's CPUOffloadPolicy pin them).
        The rest, optimizer state and the CPU step's temporaries, is ordinary pageable memory made by CPU ops."""
        pinned = (str(Category.ACTIVATIONS), str(Category.PARAMETERS), str(Category.GRADIENTS))
        return sum(v for k, v in self.host_breakdown.items() if k in pinned)

    @property
    def peak_allocated_bytes(self) -> int:
        """``torch.cuda.max_memory_allocated()``'s counterpart: ``peak_bytes`` by its plain name."""
        return self.peak_bytes

    def __str__(self) -> str:
        title = f"estimated peak ({self.device}, at {self.peak_phase}: {self.peak_at})"
        if self.device_bytes != self.peak_bytes:  # CUDA: the breakdown adds up to what the process holds
            title = (f"{title}: allocated {format_bytes(self.peak_bytes)} ({self.peak_bytes:,} bytes), "
                     f"reserved {format_bytes(self.peak_reserved_bytes)} ({self.peak_reserved_bytes:,} bytes); "
                     f"on the device in all (reserved + CUDA context)")
        text = _table(title, self.device_bytes, self.breakdown)
        if self.host_bytes:
            text += "\n" + _table(f"host memory (offloaded; {format_bytes(self.host_pinned_bytes)} pinned)",
                                   self.host_bytes, self.host_breakdown)
        return "\n".join([text, *(f"  note: {n}" for n in self.notes)])


@dataclass(frozen=True)
class Measurement:
    """Measured peak of real training steps. CPU: the allocator's high-water mark during the steps plus the bytes
    alive before them. CUDA: ``torch.cuda.max_memory_allocated`` over the steps (every block of the process, rounded,
    the cuBLAS workspace included), with ``reserved_bytes`` from ``max_memory_reserved``.

    The allocator cannot say which of its blocks were activations or gradients, so the breakdown has the tensors
    that existed before the step by category and everything else at the peak under ``step``.
    """

    peak_bytes: int
    breakdown: Mapping[str, int]
    device: str = "cpu"
    reserved_bytes: int = 0  # CUDA: max_memory_reserved; CPU: equal to peak_bytes
    # a layout over several processes (measure/ranks.py): every rank's peak, in rank order; the other figures are
    # rank 0's, the rank an estimate simulates
    rank_peaks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "breakdown", _frozen(self.breakdown))
        if not self.reserved_bytes:
            object.__setattr__(self, "reserved_bytes", self.peak_bytes)

    def __str__(self) -> str:
        return _table(f"measured peak ({self.device})", self.peak_bytes, self.breakdown)
