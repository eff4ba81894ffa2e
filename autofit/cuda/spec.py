"""What autofit knows of a GPU and of the machine it ships in: :class:`GPUSpec` and :class:`HostSpec`.

The figures of each catalog card, with their sources, are in :mod:`autofit.cuda.cards`; the lookup by name is
:mod:`autofit.cuda.catalog`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPUSpec", "HostSpec", "pcie_bytes_per_second", "workstation_host", "PCIE_EFFICIENCY", "GiB", "T"]

GiB = 2**30
T = 1e12


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """The host memory (RAM) of the machine a GPU ships in: ``memory_bytes`` for the ``gpus`` GPUs of one node, the
    system or instance it is read from (``source``), and whether it is an assumption rather than a published system
    (consumer and workstation cards: Note [the host of the target], autofit/validate.py)."""

    memory_bytes: int
    gpus: int
    source: str
    assumed: bool = False

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.gpus <= 0:
            raise ValueError(f"HostSpec needs positive memory and GPUs, got {self.memory_bytes} and {self.gpus}")

    @property
    def per_gpu_bytes(self) -> int:
        """One GPU's share of the node's host memory."""
        return self.memory_bytes // self.gpus

    def for_ranks(self, ranks: int) -> int:
        """The host memory the ``ranks`` of one node share: their GPUs' shares, at most the whole node (more ranks
        than the node's GPUs: their shares, the user's layout)."""
        share = self.per_gpu_bytes * ranks
        return share if ranks > self.gpus else min(share, self.memory_bytes)


def workstation_host(memory_bytes: int) -> HostSpec:
    """The assumed host of a card sold for workstations: one GPU, twice its memory in RAM rounded up to a power of
    two GiB (12 GB -> 32 GiB, 24 GB -> 64 GiB, 48 GB -> 128 GiB). No vendor publishes such a figure; it is an
    assumption, and the plan says so."""
    ram = 1
    while ram * GiB < 2 * memory_bytes:
        ram *= 2
    return HostSpec(memory_bytes=ram * GiB, gpus=1, assumed=True,
                    source=f"a workstation with {ram} GiB of RAM (twice the card's memory, rounded up to a power "
                           "of two; no published system)")


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """A GPU as autofit models it: memory in bytes, dense FLOP/s per precision, memory bandwidth and GPU-to-GPU
    bandwidth in bytes/s, compute capability, the platform (CUDA or ROCm), the host it ships in, and the datasheet the
    figures come from."""

    name: str
    memory_bytes: int
    fp32_flops: float
    tf32_flops: float  # 0 when the GPU has no TF32 tensor cores
    bf16_flops: float  # 0 when the GPU has no bf16 support (V100, T4): plan fp16 instead
    fp16_flops: float
    bandwidth: float  # bytes per second
    compute_capability: tuple[int, int]  # ROCm: what torch reports for the gfx target (gfx942: 9.4)
    source: str
    fp8_flops: float = 0.0  # dense fp8 tensor FLOP/s (0: no fp8 tensor cores, float8 refused); torchao _scaled_mm
    # GPU-to-GPU bandwidth per direction: NVLink on SXM data-centre parts (V100 150, A100 300, H100/H200 450 GB/s),
    # else PCIe 4.0 x16 (~25 GB/s usable)
    interconnect: float = 25e9
    # across nodes, per GPU per direction: the reference system's NICs shared by its GPUs (module docstring)
    network: float = 100e9 / 8 / 8
    pcie_generation: int = 4  # the host link, x16 (see the module docstring)
    # "cuda" or "rocm": PyTorch's ROCm build runs the same caching allocator through HIP; what differs is in
    # docs/cuda.md, "ROCm targets"
    platform: str = "cuda"
    host: HostSpec | None = None  # None: a card described by hand; workstation_host() of its memory is assumed

    def __post_init__(self) -> None:
        if self.platform not in ("cuda", "rocm"):
            raise ValueError(f"GPUSpec.platform must be 'cuda' or 'rocm', got {self.platform!r}")

    @property
    def host_transfer(self) -> float:
        """Usable host <-> device bytes per second per direction over the PCIe x16 link (see the module docstring)."""
        return pcie_bytes_per_second(self.pcie_generation)

    @property
    def supports_bf16(self) -> bool:
        return self.bf16_flops > 0

    @property
    def host_spec(self) -> HostSpec:
        """The host this card ships in: the catalog's, else the workstation assumption."""
        return self.host if self.host is not None else workstation_host(self.memory_bytes)


_PCIE_LANE_GT_PER_SECOND = {3: 8e9, 4: 16e9, 5: 32e9}  # PCI-SIG base specifications: transfers per lane
PCIE_EFFICIENCY = 0.8  # TLP/DLLP overhead and what pinned copies reach (autofit/cuda/cards.py docstring)


def pcie_bytes_per_second(generation: int, lanes: int = 16) -> float:
    """Usable bytes per second per direction of a PCIe link: lanes x rate x 128/130 (encoding) / 8 x efficiency."""
    return lanes * _PCIE_LANE_GT_PER_SECOND[generation] * 128 / 130 / 8 * PCIE_EFFICIENCY
