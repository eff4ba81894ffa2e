"""Common training GPUs: memory, dense throughput per precision, memory bandwidth.

Figures are NVIDIA's published datasheet numbers for dense (not 2:4 sparse) math, SXM/PCIe variant as named:
- V100: "NVIDIA Tesla V100 GPU Architecture" whitepaper (2017), table 1 (SXM2: 15.7 TFLOPS fp32, 125 tensor fp16).
- T4: "NVIDIA T4 Tensor Core GPU" datasheet (8.1 TFLOPS fp32, 65 fp16 tensor, 320 GB/s).
- A10G: AWS G5 instance documentation / A10 datasheet (31.2 TFLOPS fp32, 125 bf16/fp16 tensor dense, 600 GB/s).
- L4: "NVIDIA L4 Tensor Core GPU" datasheet (30.3 fp32, 121 bf16/fp16 dense, 300 GB/s).
- L40S: "NVIDIA L40S" datasheet (91.6 fp32, 362 bf16/fp16 dense, 864 GB/s).
- A100: "NVIDIA A100 Tensor Core GPU" datasheet (19.5 fp32, 156 tf32, 312 bf16/fp16; 1555 GB/s 40GB, 2039 GB/s 80GB).
- H100 SXM: "NVIDIA H100 Tensor Core GPU" datasheet (67 fp32, 495 tf32, 989 bf16/fp16 dense; 3.35 TB/s).
- H200: "NVIDIA H200 Tensor Core GPU" datasheet (same compute as H100 SXM; 141 GB, 4.8 TB/s).
- RTX 3090: GA102 whitepaper (35.6 fp32, 71 fp16/bf16 tensor dense with fp32 accumulate; 936 GB/s).
- RTX 4090: AD102 whitepaper (82.6 fp32, 165 fp16/bf16 tensor dense with fp32 accumulate; 1008 GB/s).
Host-to-device bandwidth (``host_transfer``, what offloading pays over PCIe) is the PCIe link each datasheet names,
x16: a Gen3 lane moves 8 GT/s, Gen4 16, Gen5 32, with 128b/130b encoding (PCI-SIG base specifications 3.0-5.0), so
15.75 / 31.5 / 63 GB/s per direction, times 0.8 for transaction-layer packet headers and flow control (a 256-byte
payload carries about 24 bytes of TLP and DLLP overhead, and copies from pinned memory reach about 80 % of the link
in NVIDIA's bandwidthTest sample; pageable memory is slower and is not what the offload engines use). V100 and T4:
PCIe Gen3; A10G, L4, L40S, A100, RTX 3090/4090: Gen4; H100 SXM, H200: Gen5.
GPU-to-GPU links, per GPU and per direction (``interconnect`` within a node, ``network`` across nodes):
- NVLink, the datasheets' total bidirectional bandwidth halved: V100 SXM2 300 GB/s (whitepaper table 1) -> 150;
  A100 SXM 600 GB/s ("NVIDIA A100 Tensor Core GPU" datasheet) -> 300; H100 SXM and H200 900 GB/s (their datasheets,
  "NVLink: 900GB/s") -> 450. Parts without NVLink reach each other over PCIe: 25 GB/s (Gen4 x16, usable).
- Network, the reference system's NICs per GPU: DGX-1 (V100) datasheet, 4x 100 Gb/s EDR InfiniBand for 8 GPUs ->
  6.25 GB/s; DGX A100 datasheet, 8x single-port ConnectX-6 200 Gb/s HDR InfiniBand -> 25 GB/s; DGX H100 and DGX
  H200 datasheets, 8x single-port ConnectX-7 400 Gb/s -> 50 GB/s. PCIe cards have no such reference system: the
  AWS instance pages' 8-GPU sizes (g4dn.metal T4, g5.48xlarge A10G, g6.48xlarge L4: 100 Gb/s per instance;
  g6e.48xlarge L40S: 400 Gb/s) -> 1.5625 GB/s per GPU (6.25 for L40S); consumer cards take the 100 Gb/s one.
Memory is the vendor's capacity read as GiB (16 GiB, 80 GiB; the H200's "141 GB" is ~141 GiB: nvidia-smi shows
143,771 MiB). torch reports a little less (``total_memory`` excludes what the driver keeps); "90%" budgets
are shares of these totals, or of the current device's ``total_memory`` when autofit runs on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from autofit.core.errors import InvalidInputError

__all__ = ["GPUSpec", "GPUS", "pcie_bytes_per_second", "gpu_spec", "resolve_alias", "normalise_gpu_name"]

GiB = 2**30
T = 1e12


@dataclass(frozen=True, kw_only=True)
class GPUSpec:
    """A GPU as autofit models it: memory in bytes, dense FLOP/s per precision, memory bandwidth and GPU-to-GPU
    bandwidth in bytes/s, compute capability, and the datasheet the figures come from."""

    name: str
    memory_bytes: int
    fp32_flops: float
    tf32_flops: float  # 0 when the GPU has no TF32 tensor cores
    bf16_flops: float  # 0 when the GPU has no bf16 support (V100, T4): plan fp16 instead
    fp16_flops: float
    bandwidth: float  # bytes per second
    compute_capability: tuple[int, int]
    source: str
    # GPU-to-GPU bandwidth per direction: NVLink on SXM data-centre parts (V100 150, A100 300, H100/H200 450 GB/s),
    # else PCIe 4.0 x16 (~25 GB/s usable)
    interconnect: float = 25e9
    # across nodes, per GPU per direction: the reference system's NICs shared by its GPUs (module docstring)
    network: float = 100e9 / 8 / 8
    pcie_generation: int = 4  # the host link, x16 (see the module docstring)

    @property
    def host_transfer(self) -> float:
        """Usable host <-> device bytes per second per direction over the PCIe x16 link (see the module docstring)."""
        return pcie_bytes_per_second(self.pcie_generation)

    @property
    def supports_bf16(self) -> bool:
        return self.bf16_flops > 0


_PCIE_LANE_GT_PER_SECOND = {3: 8e9, 4: 16e9, 5: 32e9}  # PCI-SIG base specifications: transfers per lane
PCIE_EFFICIENCY = 0.8  # TLP/DLLP overhead and what pinned copies reach (module docstring)


def pcie_bytes_per_second(generation: int, lanes: int = 16) -> float:
    """Usable bytes per second per direction of a PCIe link: lanes x rate x 128/130 (encoding) / 8 x efficiency."""
    return lanes * _PCIE_LANE_GT_PER_SECOND[generation] * 128 / 130 / 8 * PCIE_EFFICIENCY


GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        GPUSpec(name="V100-16GB", memory_bytes=16 * GiB, fp32_flops=15.7 * T, tf32_flops=0, bf16_flops=0,
                fp16_flops=125 * T, bandwidth=900e9, compute_capability=(7, 0),
                source="V100 whitepaper, table 1", interconnect=150e9,
                network=4 * 100e9 / 8 / 8, pcie_generation=3),
        GPUSpec(name="V100-32GB", memory_bytes=32 * GiB, fp32_flops=15.7 * T, tf32_flops=0, bf16_flops=0,
                fp16_flops=125 * T, bandwidth=900e9, compute_capability=(7, 0),
                source="V100 whitepaper, table 1", interconnect=150e9,
                network=4 * 100e9 / 8 / 8, pcie_generation=3),
        GPUSpec(name="T4", memory_bytes=16 * GiB, fp32_flops=8.1 * T, tf32_flops=0, bf16_flops=0,
                fp16_flops=65 * T, bandwidth=320e9, compute_capability=(7, 5), source="T4 datasheet",
                pcie_generation=3),
        GPUSpec(name="A10G", memory_bytes=24 * GiB, fp32_flops=31.2 * T, tf32_flops=62.5 * T, bf16_flops=125 * T,
                fp16_flops=125 * T, bandwidth=600e9, compute_capability=(8, 6), source="A10 datasheet"),
        GPUSpec(name="L4", memory_bytes=24 * GiB, fp32_flops=30.3 * T, tf32_flops=60 * T, bf16_flops=121 * T,
                fp16_flops=121 * T, bandwidth=300e9, compute_capability=(8, 9), source="L4 datasheet"),
        GPUSpec(name="L40S", memory_bytes=48 * GiB, fp32_flops=91.6 * T, tf32_flops=183 * T, bf16_flops=362 * T,
                fp16_flops=362 * T, bandwidth=864e9, compute_capability=(8, 9), source="L40S datasheet",
                network=400e9 / 8 / 8),
        GPUSpec(name="A100-40GB", memory_bytes=40 * GiB, fp32_flops=19.5 * T, tf32_flops=156 * T, bf16_flops=312 * T,
                fp16_flops=312 * T, bandwidth=1555e9, compute_capability=(8, 0),
                source="A100 datasheet", interconnect=300e9,
                network=200e9 / 8),
        GPUSpec(name="A100-80GB", memory_bytes=80 * GiB, fp32_flops=19.5 * T, tf32_flops=156 * T, bf16_flops=312 * T,
                fp16_flops=312 * T, bandwidth=2039e9, compute_capability=(8, 0),
                source="A100 datasheet", interconnect=300e9,
                network=200e9 / 8),
        GPUSpec(name="H100-80GB", memory_bytes=80 * GiB, fp32_flops=67 * T, tf32_flops=495 * T, bf16_flops=989 * T,
                fp16_flops=989 * T, bandwidth=3.35e12, compute_capability=(9, 0),
                source="H100 SXM datasheet", interconnect=450e9, network=400e9 / 8,
                pcie_generation=5),
        GPUSpec(name="H200", memory_bytes=141 * GiB, fp32_flops=67 * T, tf32_flops=495 * T, bf16_flops=989 * T,
                fp16_flops=989 * T, bandwidth=4.8e12, compute_capability=(9, 0),
                source="H200 datasheet", interconnect=450e9, network=400e9 / 8,
                pcie_generation=5),
        GPUSpec(name="RTX-3090", memory_bytes=24 * GiB, fp32_flops=35.6 * T, tf32_flops=35.6 * T,
                bf16_flops=71 * T, fp16_flops=71 * T, bandwidth=936e9, compute_capability=(8, 6),
                source="GA102 whitepaper"),
        GPUSpec(name="RTX-4090", memory_bytes=24 * GiB, fp32_flops=82.6 * T, tf32_flops=82.6 * T,
                bf16_flops=165 * T, fp16_flops=165 * T, bandwidth=1008e9, compute_capability=(8, 9),
                source="AD102 whitepaper"),
    )
}

_ALIASES = {"h100": "H100-80GB", "h100-sxm": "H100-80GB", "a100": "A100-80GB", "v100": "V100-32GB",
            "3090": "RTX-3090", "4090": "RTX-4090", "rtx3090": "RTX-3090", "rtx4090": "RTX-4090"}


def normalise_gpu_name(name: str) -> str:
    """A GPU name as the catalog compares names: lower case, no spaces, "-" for "_", no "NVIDIA"/"GeForce"."""
    return name.lower().replace(" ", "").replace("_", "-").replace("nvidia", "").replace("geforce", "").strip("-")




def gpu_spec(name: str) -> GPUSpec:
    """The catalog entry for a GPU name, case-, space- and underscore-insensitive, "NVIDIA" optional ("A100-40GB",
    "a100 80gb", "NVIDIA H200", "RTX 4090"), or an alias ("H100": the 80 GB SXM, "A100": 80 GB, "V100": 32 GB).
    A :class:`GPUSpec` is returned as is. An unknown name raises ``InvalidInputError`` listing the catalog."""
    if isinstance(name, GPUSpec):
        return name
    if not isinstance(name, str):
        raise InvalidInputError(f"gpu must be a GPU name such as 'A100-80GB', got {type(name).__name__}")
    wanted = normalise_gpu_name(name)
    for spec_name, spec in GPUS.items():
        if normalise_gpu_name(spec_name) == wanted or normalise_gpu_name(spec_name).replace("-", "") == wanted.replace("-", ""):
            return spec
    if wanted in _ALIASES:
        return GPUS[_ALIASES[wanted]]
    raise InvalidInputError(f"unknown GPU {name!r}: autofit knows {', '.join(GPUS)}")


def resolve_alias(name: str) -> tuple[str, tuple[str, ...]] | None:
    """For an alias that stands for several catalog parts ("A100": 40 and 80 GB), the part :func:`gpu_spec` picks
    and the other parts of that family; None for an exact catalog name or a name naming one part only."""
    wanted = normalise_gpu_name(name) if isinstance(name, str) else ""
    if wanted not in _ALIASES:
        return None
    picked = _ALIASES[wanted]
    family = picked.split("-")[0]
    others = tuple(n for n in GPUS if n != picked and n.split("-")[0] == family)
    return (picked, others) if others else None
