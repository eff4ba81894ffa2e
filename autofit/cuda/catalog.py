"""The GPU catalog: the cards of :mod:`autofit.cuda.cards` by name, and the lookup ``gpu=`` and ``--gpu`` use.

:class:`GPUSpec` and :class:`HostSpec` live in :mod:`autofit.cuda.spec`; every figure and its source is in
:mod:`autofit.cuda.cards`.
"""

from __future__ import annotations

from autofit.core.errors import InvalidInputError
from autofit.cuda.cards import CARDS
from autofit.cuda.spec import GPUSpec, HostSpec, pcie_bytes_per_second, workstation_host

__all__ = ["GPUSpec", "HostSpec", "GPUS", "pcie_bytes_per_second", "gpu_spec", "resolve_alias", "normalise_gpu_name",
           "workstation_host"]

GPUS: dict[str, GPUSpec] = {spec.name: spec for spec in CARDS}

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
