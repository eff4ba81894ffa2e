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
- Consumer cards (RTX 3090 / 4090): no published system; a workstation is assumed (``workstation_host``: twice the
  card's memory, rounded up to a power of two GiB), and the plan says it assumed it.
Memory is the vendor's capacity read as GiB (16 GiB, 80 GiB; the H200's "141 GB" is ~141 GiB: nvidia-smi shows
143,771 MiB). torch reports a little less (``total_memory`` excludes what the driver keeps); "90%" budgets
are shares of these totals, or of the current device's ``total_memory`` when autofit runs on a GPU.
"""

from __future__ import annotations

from autofit.cuda.spec import GiB, T, GPUSpec, HostSpec, workstation_host

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
)
