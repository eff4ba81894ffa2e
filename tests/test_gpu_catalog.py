"""The catalog cards of issue 40, each figure against the vendor's published one (typed here from the datasheet or
product page named beside it, not read from the catalog), the name lookup, cards described by hand, the local
device as the default target (CUDA and ROCm, by monkeypatching torch.cuda), and ROCm's BLAS workspaces."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import autofit
from autofit.cuda.catalog import GPUS, gpu_spec
from autofit.cuda.model import cublas_workspace_bytes, rocm_workspace_bytes
from autofit.cuda.target import resolve_target_gpu
from autofit.device import resolve_device

GiB, MiB, T = 2**30, 2**20, 1e12

# name: (memory GiB, fp32, bf16 = fp16, fp8 dense TFLOPS, bandwidth GB/s, PCIe generation, platform, source)
PUBLISHED = {
    # GeForce: fp32 = 2 x CUDA cores x boost GHz (NVIDIA's product pages), tensor rates per the architecture
    # whitepapers for GeForce (fp16/bf16 with fp32 accumulate 2x fp32; Ada and Blackwell fp8 4x)
    "RTX-3060": (12, 2 * 3584 * 1.777e-3, 2 * 2 * 3584 * 1.777e-3, 0, 360, 4, "cuda", "RTX 3060 page: 3584 cores, "
                 "1.777 GHz, 12 GB 192-bit 15 Gbps"),
    "RTX-4070": (12, 2 * 5888 * 2.475e-3, 4 * 5888 * 2.475e-3, 8 * 5888 * 2.475e-3, 504, 4, "cuda",
                 "RTX 4070 page: 5888 cores, 2.475 GHz, 192-bit 21 Gbps"),
    "RTX-4070-Ti": (12, 2 * 7680 * 2.61e-3, 4 * 7680 * 2.61e-3, 8 * 7680 * 2.61e-3, 504, 4, "cuda",
                    "RTX 4070 Ti page: 7680 cores, 2.61 GHz, 192-bit 21 Gbps"),
    "RTX-4080": (16, 48.7, 97.5, 194.9, 716.8, 4, "cuda", "Ada whitepaper appendix: RTX 4080"),
    "RTX-5080": (16, 2 * 10752 * 2.617e-3, 4 * 10752 * 2.617e-3, 8 * 10752 * 2.617e-3, 960, 5, "cuda",
                 "RTX 5080 page: 10752 cores, 2.617 GHz, 256-bit 30 Gbps"),
    "RTX-5090": (32, 104.8, 209.5, 419, 1792, 5, "cuda", "RTX 5090 page: 21760 cores, 2.407 GHz, 512-bit 28 Gbps"),
    "RTX-A6000": (48, 38.7, 309.7 / 2, 0, 768, 4, "cuda", "RTX A6000 datasheet: 309.7 tensor TFLOPS with sparsity"),
    "RTX-6000-Ada": (48, 91.1, 1457.0 / 4, 1457.0 / 2, 960, 4, "cuda",
                     "RTX 6000 Ada datasheet: 1457 fp8 tensor TFLOPS with sparsity"),
    "L40": (48, 90.5, 181.05, 362, 864, 4, "cuda", "L40 datasheet"),
    "L40S": (48, 91.6, 362.05, 733, 864, 4, "cuda", "L40S datasheet"),
    "H100-PCIe": (80, 51, 1513 / 2, 3026 / 2, 2000, 5, "cuda", "H100 datasheet, PCIe: with sparsity"),
    "H100-NVL": (94, 60, 1671 / 2, 3341 / 2, 3900, 5, "cuda", "H100 datasheet, NVL: with sparsity"),
    "H20": (96, 44, 148, 296, 4000, 5, "cuda", "HGX H20 product brief"),
    "B200": (180, 600 / 8, 36000 / 8 / 2, 72000 / 8 / 2, 8000, 5, "cuda",
             "HGX B200: 8 GPUs 600 TF fp32, 36 PF bf16, 72 PF fp8 with sparsity; DGX B200 1,440 GB"),
    "MI300X": (192, 163.4, 1307.4, 2614.9, 5300, 5, "rocm", "AMD Instinct MI300X datasheet"),
    "MI325X": (256, 163.4, 1307.4, 2614.9, 6000, 5, "rocm", "AMD Instinct MI325X datasheet"),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_new_cards_have_their_published_figures(name):
    memory, fp32, bf16, fp8, gbs, pcie, platform, source = PUBLISHED[name]
    spec = gpu_spec(name)
    assert spec.memory_bytes == memory * GiB, source
    assert spec.fp32_flops == pytest.approx(fp32 * T, rel=2e-3), source
    assert spec.bf16_flops == pytest.approx(bf16 * T, rel=2e-3) and spec.fp16_flops == spec.bf16_flops, source
    assert spec.fp8_flops == pytest.approx(fp8 * T, rel=2e-3), source
    assert spec.bandwidth == pytest.approx(gbs * 1e9, rel=1e-3), source
    assert (spec.pcie_generation, spec.platform) == (pcie, platform)
    assert spec.host is not None and spec.source


# Links per GPU and direction: NVLink / Infinity Fabric halved from the datasheets' bidirectional totals; cards
# whose bridges join pairs only, or have none, talk over their PCIe link (usable x16: 128/130 x GT/s x 16 / 8 x 0.8)
LINKS = {"B200": 1800e9 / 2, "H20": 900e9 / 2, "MI300X": 7 * 128e9 / 2, "MI325X": 7 * 128e9 / 2,
         "H100-PCIe": 128 / 130 * 32e9 * 16 / 8 * 0.8, "H100-NVL": 128 / 130 * 32e9 * 16 / 8 * 0.8,
         "RTX-5090": 128 / 130 * 32e9 * 16 / 8 * 0.8, "RTX-A6000": 25e9, "RTX-3060": 25e9}
# Hosts per node and GPUs: DGX B200 user guide 2 TB for 8; Azure ND MI300X v5 1,850 GiB for 8; Azure NC H100 v5
# 640 GiB for 2 H100 NVL; consumer cards an assumed workstation of twice their memory, rounded up to 2^n GiB
HOSTS = {"B200": (2048 * GiB, 8, False), "MI300X": (1850 * GiB, 8, False), "H100-NVL": (640 * GiB, 2, False),
         "RTX-3060": (32 * GiB, 1, True), "RTX-5090": (64 * GiB, 1, True), "RTX-A6000": (128 * GiB, 1, True),
         "MI325X": (1850 * GiB, 8, True), "H20": (2048 * GiB, 8, True)}


@pytest.mark.parametrize("name", list(LINKS))
def test_links(name):
    assert gpu_spec(name).interconnect == pytest.approx(LINKS[name], rel=1e-9)


@pytest.mark.parametrize("name", list(HOSTS))
def test_hosts(name):
    host = gpu_spec(name).host
    assert (host.memory_bytes, host.gpus, host.assumed) == HOSTS[name]


@pytest.mark.parametrize("given,name", [
    ("RTX-3060", "RTX-3060"), ("RTX 3060 12GB", "RTX-3060"), ("rtx3060", "RTX-3060"), ("3060", "RTX-3060"),
    ("NVIDIA GeForce RTX 4070 Ti", "RTX-4070-Ti"), ("4070 Ti", "RTX-4070-Ti"), ("RTX 4070", "RTX-4070"),
    ("rtx-4080", "RTX-4080"), ("RTX 5080", "RTX-5080"), ("5090", "RTX-5090"), ("RTX A6000", "RTX-A6000"),
    ("RTX 6000 Ada", "RTX-6000-Ada"), ("L40", "L40"), ("l40s", "L40S"), ("H100 PCIe", "H100-PCIe"),
    ("H100-NVL", "H100-NVL"), ("h20", "H20"), ("H200", "H200"), ("NVIDIA B200", "B200"), ("B200 180GB", "B200"),
    ("MI300X", "MI300X"), ("AMD Instinct MI300X", "MI300X"), ("mi325x", "MI325X"), ("H100 80GB", "H100-80GB"),
])
def test_name_lookup(given, name):
    assert gpu_spec(given).name == name


def test_a_memory_suffix_must_be_the_cards():
    with pytest.raises(autofit.InvalidInputError, match="gpu-memory"):
        gpu_spec("RTX 3060 8GB")  # the 8 GB RTX 3060 is not the catalog's: describe it


def test_a_card_described_by_its_memory():
    card = gpu_spec({"memory": "12GiB"})  # a vendor's "12 GB" card: 12 GiB
    assert card.memory_bytes == 12 * GiB and card.fp16_flops == GPUS["A100-80GB"].fp16_flops
    assert card.host.assumed and card.host.memory_bytes == 32 * GiB
    like = gpu_spec({"memory": "12GiB", "like": "RTX-4070", "name": "RTX 4070 laptop"})
    assert (like.name, like.memory_bytes, like.bf16_flops) == ("RTX 4070 laptop", 12 * GiB, GPUS["RTX-4070"].bf16_flops)
    assert gpu_spec({"memory": 12_000_000_000}).memory_bytes == 12_000_000_000
    device = resolve_device("cuda", {"memory": "12GiB"})
    assert device.total_bytes == 12 * GiB and not device.local
    assert gpu_spec({"memory": "12GB"}).memory_bytes == 12 * 10**9  # GB is 10^9 here as in every size
    with pytest.raises(autofit.InvalidInputError, match="memory"):
        gpu_spec({"like": "T4"})
    with pytest.raises(autofit.InvalidInputError, match="'vram'"):
        gpu_spec({"vram": "12GB"})


def _device(monkeypatch, name: str, mib: int, major: int, minor: int, hip: str | None = None) -> None:
    props = SimpleNamespace(name=name, total_memory=mib * MiB, major=major, minor=minor, gcnArchName="gfx942")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.version, "hip", hip)


def test_a_local_rocm_device_is_the_default_target(monkeypatch):
    # what torch's ROCm build reports for an MI300X: its name, 191.98 GiB, gfx942 as 9.4
    _device(monkeypatch, "AMD Instinct MI300X", 196_592, 9, 4, hip="6.4.0")
    spec, note, local = resolve_target_gpu(None)
    assert (spec.name, spec.platform, spec.memory_bytes, local, note) == ("MI300X", "rocm", 196_592 * MiB, True, None)
    device = resolve_device("cuda")
    assert device.local and device.total_bytes == 196_592 * MiB and "ROCm" in device.note


def test_an_unknown_local_rocm_device_keeps_its_platform(monkeypatch):
    _device(monkeypatch, "AMD Radeon PRO W7900", 46_064, 11, 0, hip="6.4.0")
    spec, _, local = resolve_target_gpu(None)
    assert (spec.name, spec.platform, spec.compute_capability, local) == ("AMD Radeon PRO W7900", "rocm", (11, 0),
                                                                          True)


def test_a_cuda_device_never_matches_a_rocm_card(monkeypatch):
    _device(monkeypatch, "NVIDIA GeForce RTX 5090", 32_120, 12, 0)
    assert resolve_target_gpu(None)[0].name == "RTX-5090"


def test_rocm_blas_workspaces(monkeypatch):
    """CublasHandlePool.cpp under USE_ROCM: hipBLAS 128 MiB on gfx94x/95x (else 32 MiB), hipBLASLt 76 MiB apart."""
    for key in ("CUBLAS_WORKSPACE_CONFIG", "HIPBLAS_WORKSPACE_CONFIG", "ROCBLAS_WORKSPACE_CONFIG",
                "CUBLASLT_WORKSPACE_SIZE", "HIPBLASLT_WORKSPACE_SIZE"):
        monkeypatch.delenv(key, raising=False)
    mi300x = gpu_spec("MI300X")
    assert cublas_workspace_bytes(mi300x) == 128 * MiB + 76 * MiB
    other = gpu_spec({"memory": "48GB", "like": "MI300X", "compute_capability": (11, 0)})
    assert cublas_workspace_bytes(other) == 32 * MiB + 76 * MiB
    assert rocm_workspace_bytes(mi300x, ":4096:2", "1024") == 8 * MiB + MiB
    monkeypatch.setenv("HIPBLASLT_WORKSPACE_SIZE", "0")
    assert cublas_workspace_bytes(mi300x) == 128 * MiB
