"""The catalog's cards: memory, dense throughput per precision, memory bandwidth, links, and the host they ship in.

Figures are the vendors' published datasheet numbers for dense (not 2:4 sparse) math, SXM/PCIe variant as named:
- V100: "NVIDIA Tesla V100 GPU Architecture" whitepaper (2017), table 1 (SXM2: 15.7 TFLOPS fp32, 125 tensor fp16).
- T4: "NVIDIA T4 Tensor Core GPU" datasheet (8.1 TFLOPS fp32, 65 fp16 tensor, 320 GB/s).
- A10G: AWS G5 instance documentation / A10 datasheet (31.2 TFLOPS fp32, 125 bf16/fp16 tensor dense, 600 GB/s).
- L4: "NVIDIA L4 Tensor Core GPU" datasheet (30.3 fp32, 121 bf16/fp16 dense, 242.5 fp8 dense, 300 GB/s).
- L40S: "NVIDIA L40S" datasheet (91.6 fp32, 362 bf16/fp16 dense, 733 fp8 dense, 864 GB/s).
- A100: "NVIDIA A100 Tensor Core GPU" datasheet (19.5 fp32, 156 tf32, 312 bf16/fp16; 1555 GB/s 40GB, 2039 GB/s 80GB).
- H100 SXM: "NVIDIA H100 Tensor Core GPU" datasheet (67 fp32, 495 tf32, 989 bf16/fp16, 1979 fp8 dense; 3.35 TB/s).
- H200: "NVIDIA H200 Tensor Core GPU" datasheet (same compute as H100 SXM; 141 GB, 4.8 TB/s).
- RTX 3090: GA102 whitepaper (35.6 fp32, 71 fp16/bf16 tensor dense with fp32 accumulate; 936 GB/s).
- RTX 4090: AD102 whitepaper (82.6 fp32, 165 fp16/bf16 tensor dense with fp32 accumulate, 330 fp8 with fp32
  accumulate; 1008 GB/s).
- RTX 3060 (12 GB), 4070, 4070 Ti, 4080, 5080, 5090: NVIDIA's product specification pages (CUDA cores, boost
  clock, memory size, width and speed: 3584 x 1.777 GHz, 12 GB 192-bit 15 Gbps = 360 GB/s; 5888 x 2.475 GHz, 12 GB
  192-bit 21 Gbps = 504 GB/s; 7680 x 2.61 GHz, 12 GB 192-bit 21 Gbps = 504 GB/s; 9728 x 2.505 GHz, 16 GB 256-bit
  22.4 Gbps = 716.8 GB/s; 10752 x 2.617 GHz, 16 GB 256-bit 30 Gbps = 960 GB/s; 21760 x 2.407 GHz, 32 GB 512-bit
  28 Gbps = 1792 GB/s); fp32 = 2 x cores x clock; the tensor rates per fp32 rate of their architecture's
  whitepaper for GeForce parts (GA102: fp16/bf16 with fp32 accumulate 2x; AD102 and GB202: 2x, and fp8 with fp32
  accumulate 4x): RTX 3060 12.7 fp32 / 25.5 bf16; 4070 29.1 / 58.3 / 116.6 fp8; 4070 Ti 40.1 / 80.2 / 160.4; 4080
  48.7 / 97.5 / 194.9 (AD102 whitepaper appendix); 5080 56.3 / 112.6 / 225.1; 5090 104.8 / 209.5 / 419.
- RTX A6000: "NVIDIA RTX A6000" datasheet (38.7 fp32, 309.7 tensor with sparsity -> 154.8 bf16/fp16 dense, 77.4
  tf32 dense; 48 GB, 768 GB/s). Its NVLink bridge joins two cards only: collectives run over PCIe.
- RTX 6000 Ada: "NVIDIA RTX 6000 Ada Generation" datasheet (91.1 fp32, 1457 fp8 tensor with sparsity -> 728.5 fp8,
  364.2 bf16/fp16, 182.1 tf32 dense; 48 GB, 960 GB/s; no NVLink).
- L40: "NVIDIA L40" datasheet (90.5 fp32, 90.5 tf32, 181 bf16/fp16, 362 fp8 dense; 48 GB, 864 GB/s).
- H100 PCIe and H100 NVL: "NVIDIA H100 Tensor Core GPU" datasheet, PCIe and NVL columns (PCIe: 51 fp32, 756 tf32,
  1513 bf16/fp16, 3026 fp8 with sparsity, 80 GB, 2 TB/s; NVL: 60 fp32, 835 tf32, 1671 bf16/fp16, 3341 fp8 with
  sparsity, 94 GB, 3.9 TB/s). Their NVLink bridges join pairs of cards (600 GB/s): collectives over more run on PCIe
  Gen5 (``pcie_bytes_per_second(5)``, 50.4 GB/s).
- H20: NVIDIA's HGX H20 product brief as reported at launch (44 fp32, 74 tf32, 148 bf16/fp16, 296 fp8 dense; 96 GB
  HBM3, 4.0 TB/s; NVLink 900 GB/s; PCIe Gen5).
- B200: NVIDIA HGX B200 specifications (8 GPUs: 600 TFLOPS fp32, 18 PFLOPS tf32, 36 PFLOPS bf16/fp16 and 72 fp8,
  tensor figures with sparsity -> per GPU 75 fp32, 1125 tf32, 2250 bf16/fp16, 4500 fp8 dense; 64 TB/s -> 8 TB/s per
  GPU; NVLink 5 1.8 TB/s); DGX B200 user guide (8 x 180 GB = 1,440 GB GPU memory, 2 TB system memory, 8x ConnectX-7
  400 Gb/s, PCIe Gen5 CPUs).
- AMD Instinct MI300X and MI325X: AMD's datasheets (163.4 fp32 matrix, 653.7 tf32, 1307.4 bf16/fp16, 2614.9 fp8
  dense; MI300X 192 GB HBM3 at 5.3 TB/s, MI325X 256 GB HBM3E at 6 TB/s; 7 Infinity Fabric links of 128 GB/s
  (bidirectional) to the other GPUs of an 8-GPU platform -> 448 GB/s per direction; PCIe Gen5 x16). torch reports
  the gfx942 target as compute capability 9.4; ``platform="rocm"`` (docs/cuda.md, "ROCm targets").
The datasheets print tensor figures "with sparsity" (an asterisk); dense is half of those.
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
Host memory (``host``: Note [the host of the target], autofit/validate.py), per node, read in binary units as DIMMs
and the cloud pages' GiB are (a DGX H100's "2 TB" is 32 x 64 GB DIMMs, 2 TiB):
- V100: DGX-1 datasheet, 512 GB for 8 GPUs. T4: AWS g4dn.metal, 384 GiB for 8. A10G: AWS g5.48xlarge, 768 GiB
  for 8. L4: AWS g6.48xlarge, 768 GiB for 8. L40S: AWS g6e.48xlarge, 1,536 GiB for 8.
- A100-40GB: DGX A100 (320 GB) datasheet, 1 TB for 8 (AWS p4d.24xlarge: 1,152 GiB). A100-80GB: DGX A100 (640 GB)
  datasheet, 2 TB for 8. H100 SXM: DGX H100 datasheet, 2 TB for 8 (AWS p5.48xlarge 2,048 GiB; GCP a3-highgpu-8g
  1,872 GB; Azure ND H100 v5 1,900 GiB). H200: DGX H200 datasheet, 2 TB for 8.
- B200: DGX B200 user guide, 2 TB for 8. MI300X: Azure ND MI300X v5, 1,850 GiB for 8 (and 8x 400 Gb/s
  InfiniBand, the network figure).
- Assumed, and said so in the plan: H100 PCIe and H20 as a DGX H100 (2 TB for 8: the same HGX / PCIe servers);
  H100 NVL: Azure NC H100 v5, 640 GiB for 2; L40 as the L40S's AWS g6e.48xlarge (the same servers); MI325X as the
  MI300X's platform. Consumer and workstation cards (RTX 3060 ... 5090, RTX A6000, RTX 6000 Ada): no published
  system; a workstation is assumed (``workstation_host``: twice the card's memory, rounded up to a power of two
  GiB).
Memory is the vendor's capacity read as GiB (16 GiB, 80 GiB; the H200's "141 GB" is ~141 GiB: nvidia-smi shows
143,771 MiB). torch reports a little less (``total_memory`` excludes what the driver keeps); "90%" budgets
are shares of these totals, or of the current device's ``total_memory`` when autofit runs on a GPU.
"""

from __future__ import annotations

from autofit.cuda.spec import GiB, T, GPUSpec, HostSpec, pcie_bytes_per_second, workstation_host

__all__ = ["CARDS"]

TiB = 1024 * GiB

_DGX1 = HostSpec(memory_bytes=512 * GiB, gpus=8, source="DGX-1 datasheet: 512 GB for 8 V100")
_DGX_A100_320 = HostSpec(memory_bytes=1 * TiB, gpus=8, source="DGX A100 (320 GB) datasheet: 1 TB for 8 A100-40GB")
_DGX_A100_640 = HostSpec(memory_bytes=2 * TiB, gpus=8, source="DGX A100 (640 GB) datasheet: 2 TB for 8 A100-80GB")
_DGX_H100 = HostSpec(memory_bytes=2 * TiB, gpus=8, source="DGX H100 datasheet: 2 TB for 8 H100 (AWS p5.48xlarge: "
                                                          "2,048 GiB)")
_DGX_H200 = HostSpec(memory_bytes=2 * TiB, gpus=8, source="DGX H200 datasheet: 2 TB for 8 H200")


def _aws(instance: str, gib: int, card: str) -> HostSpec:
    return HostSpec(memory_bytes=gib * GiB, gpus=8, source=f"AWS {instance}: {gib:,} GiB for 8 {card}")


def _like(host: HostSpec, card: str) -> HostSpec:
    """``host`` assumed for ``card``, which has no published system of its own (the plan says so)."""
    return HostSpec(memory_bytes=host.memory_bytes, gpus=host.gpus, assumed=True,
                    source=f"{host.source} (no published system for the {card}: assumed the same)")


_DGX_B200 = HostSpec(memory_bytes=2 * TiB, gpus=8, source="DGX B200 user guide: 2 TB for 8 B200")
_ND_MI300X = HostSpec(memory_bytes=1850 * GiB, gpus=8, source="Azure ND MI300X v5: 1,850 GiB for 8 MI300X")
_NC_H100_NVL = HostSpec(memory_bytes=640 * GiB, gpus=2, source="Azure NC H100 v5: 640 GiB for 2 H100 NVL")
_G6E = _aws("g6e.48xlarge", 1536, "L40S")
_PCIE5 = pcie_bytes_per_second(5)  # the x16 Gen5 link between cards without NVLink (collectives)
_INFINITY_FABRIC = 7 * 128e9 / 2  # 7 links of 128 GB/s bidirectional to the other 7 GPUs, per direction


def _geforce(name: str, gib: int, fp32: float, bandwidth: float, capability: tuple[int, int], *,
             fp8: bool, pcie: int, source: str) -> GPUSpec:
    """A GeForce card: bf16/fp16 tensor math with fp32 accumulate at 2x the fp32 rate (and fp8 at 4x from Ada on),
    TF32 at the fp32 rate, collectives over PCIe, an assumed workstation host (module docstring)."""
    return GPUSpec(name=name, memory_bytes=gib * GiB, fp32_flops=fp32 * T, tf32_flops=fp32 * T,
                   bf16_flops=2 * fp32 * T, fp16_flops=2 * fp32 * T, fp8_flops=4 * fp32 * T if fp8 else 0.0,
                   bandwidth=bandwidth, compute_capability=capability, source=source, pcie_generation=pcie,
                   interconnect=_PCIE5 if pcie == 5 else 25e9, host=workstation_host(gib * GiB))


CARDS: tuple[GPUSpec, ...] = (
    GPUSpec(name="V100-16GB", memory_bytes=16 * GiB, fp32_flops=15.7 * T, tf32_flops=0, bf16_flops=0,
            fp16_flops=125 * T, bandwidth=900e9, compute_capability=(7, 0),
            source="V100 whitepaper, table 1", interconnect=150e9,
            network=4 * 100e9 / 8 / 8, pcie_generation=3, host=_DGX1),
    GPUSpec(name="V100-32GB", memory_bytes=32 * GiB, fp32_flops=15.7 * T, tf32_flops=0, bf16_flops=0,
            fp16_flops=125 * T, bandwidth=900e9, compute_capability=(7, 0),
            source="V100 whitepaper, table 1", interconnect=150e9,
            network=4 * 100e9 / 8 / 8, pcie_generation=3, host=_DGX1),
    GPUSpec(name="T4", memory_bytes=16 * GiB, fp32_flops=8.1 * T, tf32_flops=0, bf16_flops=0,
            fp16_flops=65 * T, bandwidth=320e9, compute_capability=(7, 5), source="T4 datasheet",
            pcie_generation=3, host=_aws("g4dn.metal", 384, "T4")),
    GPUSpec(name="A10G", memory_bytes=24 * GiB, fp32_flops=31.2 * T, tf32_flops=62.5 * T, bf16_flops=125 * T,
            fp16_flops=125 * T, bandwidth=600e9, compute_capability=(8, 6), source="A10 datasheet",
            host=_aws("g5.48xlarge", 768, "A10G")),
    GPUSpec(name="L4", memory_bytes=24 * GiB, fp32_flops=30.3 * T, tf32_flops=60 * T, bf16_flops=121 * T,
            fp16_flops=121 * T, fp8_flops=242.5 * T, bandwidth=300e9, compute_capability=(8, 9),
            source="L4 datasheet", host=_aws("g6.48xlarge", 768, "L4")),
    GPUSpec(name="L40S", memory_bytes=48 * GiB, fp32_flops=91.6 * T, tf32_flops=183 * T, bf16_flops=362 * T,
            fp16_flops=362 * T, fp8_flops=733 * T, bandwidth=864e9, compute_capability=(8, 9),
            source="L40S datasheet", network=400e9 / 8 / 8, host=_aws("g6e.48xlarge", 1536, "L40S")),
    GPUSpec(name="A100-40GB", memory_bytes=40 * GiB, fp32_flops=19.5 * T, tf32_flops=156 * T, bf16_flops=312 * T,
            fp16_flops=312 * T, bandwidth=1555e9, compute_capability=(8, 0),
            source="A100 datasheet", interconnect=300e9,
            network=200e9 / 8, host=_DGX_A100_320),
    GPUSpec(name="A100-80GB", memory_bytes=80 * GiB, fp32_flops=19.5 * T, tf32_flops=156 * T, bf16_flops=312 * T,
            fp16_flops=312 * T, bandwidth=2039e9, compute_capability=(8, 0),
            source="A100 datasheet", interconnect=300e9,
            network=200e9 / 8, host=_DGX_A100_640),
    GPUSpec(name="H100-80GB", memory_bytes=80 * GiB, fp32_flops=67 * T, tf32_flops=495 * T, bf16_flops=989 * T,
            fp16_flops=989 * T, fp8_flops=1979 * T, bandwidth=3.35e12, compute_capability=(9, 0),
            source="H100 SXM datasheet", interconnect=450e9, network=400e9 / 8,
            pcie_generation=5, host=_DGX_H100),
    GPUSpec(name="H200", memory_bytes=141 * GiB, fp32_flops=67 * T, tf32_flops=495 * T, bf16_flops=989 * T,
            fp16_flops=989 * T, fp8_flops=1979 * T, bandwidth=4.8e12, compute_capability=(9, 0),
            source="H200 datasheet", interconnect=450e9, network=400e9 / 8,
            pcie_generation=5, host=_DGX_H200),
    GPUSpec(name="RTX-3090", memory_bytes=24 * GiB, fp32_flops=35.6 * T, tf32_flops=35.6 * T,
            bf16_flops=71 * T, fp16_flops=71 * T, bandwidth=936e9, compute_capability=(8, 6),
            source="GA102 whitepaper", host=workstation_host(24 * GiB)),
    GPUSpec(name="RTX-4090", memory_bytes=24 * GiB, fp32_flops=82.6 * T, tf32_flops=82.6 * T,
            bf16_flops=165 * T, fp16_flops=165 * T, fp8_flops=330 * T, bandwidth=1008e9,
            compute_capability=(8, 9), source="AD102 whitepaper", host=workstation_host(24 * GiB)),
    # consumer cards (module docstring: fp32 = 2 x CUDA cores x boost clock; the tensor rates per fp32 rate)
    _geforce("RTX-3060", 12, 12.74, 360e9, (8, 6), fp8=False, pcie=4,
             source="RTX 3060 specifications (3584 cores, 1.777 GHz); GA102 whitepaper rates"),
    _geforce("RTX-4070", 12, 29.15, 504e9, (8, 9), fp8=True, pcie=4,
             source="RTX 4070 specifications (5888 cores, 2.475 GHz); AD102 whitepaper rates"),
    _geforce("RTX-4070-Ti", 12, 40.09, 504e9, (8, 9), fp8=True, pcie=4,
             source="RTX 4070 Ti specifications (7680 cores, 2.61 GHz); AD102 whitepaper rates"),
    _geforce("RTX-4080", 16, 48.74, 716.8e9, (8, 9), fp8=True, pcie=4,
             source="RTX 4080 specifications (9728 cores, 2.505 GHz); AD102 whitepaper appendix"),
    _geforce("RTX-5080", 16, 56.28, 960e9, (12, 0), fp8=True, pcie=5,
             source="RTX 5080 specifications (10752 cores, 2.617 GHz); RTX Blackwell whitepaper rates"),
    _geforce("RTX-5090", 32, 104.8, 1792e9, (12, 0), fp8=True, pcie=5,
             source="RTX 5090 specifications (21760 cores, 2.407 GHz); RTX Blackwell whitepaper rates"),
    # workstation and data-centre PCIe cards of 48 GB
    GPUSpec(name="RTX-A6000", memory_bytes=48 * GiB, fp32_flops=38.7 * T, tf32_flops=77.4 * T,
            bf16_flops=154.8 * T, fp16_flops=154.8 * T, bandwidth=768e9, compute_capability=(8, 6),
            source="RTX A6000 datasheet", host=workstation_host(48 * GiB)),
    GPUSpec(name="RTX-6000-Ada", memory_bytes=48 * GiB, fp32_flops=91.1 * T, tf32_flops=182.1 * T,
            bf16_flops=364.2 * T, fp16_flops=364.2 * T, fp8_flops=728.5 * T, bandwidth=960e9,
            compute_capability=(8, 9), source="RTX 6000 Ada Generation datasheet", host=workstation_host(48 * GiB)),
    GPUSpec(name="L40", memory_bytes=48 * GiB, fp32_flops=90.5 * T, tf32_flops=90.5 * T, bf16_flops=181 * T,
            fp16_flops=181 * T, fp8_flops=362 * T, bandwidth=864e9, compute_capability=(8, 9),
            source="L40 datasheet", network=400e9 / 8 / 8, host=_like(_G6E, "L40")),
    # Hopper and Blackwell
    GPUSpec(name="H100-PCIe", memory_bytes=80 * GiB, fp32_flops=51 * T, tf32_flops=378 * T, bf16_flops=756 * T,
            fp16_flops=756 * T, fp8_flops=1513 * T, bandwidth=2.0e12, compute_capability=(9, 0),
            source="H100 datasheet, PCIe column", interconnect=_PCIE5, pcie_generation=5,
            host=_like(_DGX_H100, "H100 PCIe")),
    GPUSpec(name="H100-NVL", memory_bytes=94 * GiB, fp32_flops=60 * T, tf32_flops=417.5 * T, bf16_flops=835.5 * T,
            fp16_flops=835.5 * T, fp8_flops=1670.5 * T, bandwidth=3.9e12, compute_capability=(9, 0),
            source="H100 datasheet, NVL column", interconnect=_PCIE5, pcie_generation=5, host=_NC_H100_NVL),
    GPUSpec(name="H20", memory_bytes=96 * GiB, fp32_flops=44 * T, tf32_flops=74 * T, bf16_flops=148 * T,
            fp16_flops=148 * T, fp8_flops=296 * T, bandwidth=4.0e12, compute_capability=(9, 0),
            source="HGX H20 product brief (as reported)", interconnect=450e9, network=400e9 / 8,
            pcie_generation=5, host=_like(_DGX_H100, "H20")),
    GPUSpec(name="B200", memory_bytes=180 * GiB, fp32_flops=75 * T, tf32_flops=1125 * T, bf16_flops=2250 * T,
            fp16_flops=2250 * T, fp8_flops=4500 * T, bandwidth=8e12, compute_capability=(10, 0),
            source="HGX B200 specifications; DGX B200 user guide", interconnect=900e9, network=400e9 / 8,
            pcie_generation=5, host=_DGX_B200),
    # AMD Instinct (ROCm)
    GPUSpec(name="MI300X", memory_bytes=192 * GiB, fp32_flops=163.4 * T, tf32_flops=653.7 * T,
            bf16_flops=1307.4 * T, fp16_flops=1307.4 * T, fp8_flops=2614.9 * T, bandwidth=5.3e12,
            compute_capability=(9, 4), source="AMD Instinct MI300X datasheet", interconnect=_INFINITY_FABRIC,
            network=400e9 / 8, pcie_generation=5, platform="rocm", host=_ND_MI300X),
    GPUSpec(name="MI325X", memory_bytes=256 * GiB, fp32_flops=163.4 * T, tf32_flops=653.7 * T,
            bf16_flops=1307.4 * T, fp16_flops=1307.4 * T, fp8_flops=2614.9 * T, bandwidth=6.0e12,
            compute_capability=(9, 4), source="AMD Instinct MI325X datasheet", interconnect=_INFINITY_FABRIC,
            network=400e9 / 8, pcie_generation=5, platform="rocm", host=_like(_ND_MI300X, "MI325X")),
)
