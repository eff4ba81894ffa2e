"""The GPU catalog: the cards of :mod:`autofit.cuda.cards` by name, and the lookup ``gpu=`` and ``--gpu`` use.

:class:`GPUSpec` and :class:`HostSpec` live in :mod:`autofit.cuda.spec`; every figure and its source is in
:mod:`autofit.cuda.cards`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import fields, replace

from autofit.core.errors import InvalidInputError
from autofit.core.units import parse_budget
from autofit.cuda.cards import CARDS
from autofit.cuda.spec import GiB, GPUSpec, HostSpec, pcie_bytes_per_second, workstation_host

__all__ = ["GPUSpec", "HostSpec", "GPUS", "pcie_bytes_per_second", "gpu_spec", "resolve_alias", "normalise_gpu_name",
           "workstation_host", "custom_gpu", "card_memory", "catalog_key", "LIKE_DEFAULT"]

LIKE_DEFAULT = "A100-80GB"  # the card whose figures a described card takes where it names none

GPUS: dict[str, GPUSpec] = {spec.name: spec for spec in CARDS}

_ALIASES = {"h100": "H100-80GB", "h100-sxm": "H100-80GB", "a100": "A100-80GB", "v100": "V100-32GB",
            "3090": "RTX-3090", "4090": "RTX-4090", "rtx3090": "RTX-3090", "rtx4090": "RTX-4090",
            "3060": "RTX-3060", "4070": "RTX-4070", "4070ti": "RTX-4070-Ti", "4080": "RTX-4080", "5080": "RTX-5080",
            "5090": "RTX-5090", "a6000": "RTX-A6000", "6000ada": "RTX-6000-Ada", "rtx6000": "RTX-6000-Ada",
            "h100pcie80gb": "H100-PCIe", "h100nvl94gb": "H100-NVL", "b200180gb": "B200", "h2096gb": "H20"}
_VENDOR_WORDS = ("nvidia", "geforce", "amd", "instinct", "tesla")
_MEMORY_SUFFIX = re.compile(r"-?(\d+)gb$")  # in a normalised catalog name ("a100-40gb")
_NAMED_MEMORY = re.compile(r"[\s_-]+(\d+)\s*gi?b$")  # in a user's name, before normalising ("RTX 3060 12GB")


def normalise_gpu_name(name: str) -> str:
    """A GPU name as the catalog compares names: lower case, no spaces, "-" for "_", no vendor words ("NVIDIA",
    "GeForce", "AMD", "Instinct", "Tesla")."""
    name = name.lower().replace(" ", "").replace("_", "-")
    for word in _VENDOR_WORDS:
        name = name.replace(word, "")
    return name.strip("-")


def _key(name: str) -> str:
    return normalise_gpu_name(name).replace("-", "")


def catalog_key(spec_name: str) -> str:
    """The part of a catalog name a device name contains: the name without a memory suffix ("A100-40GB" -> "a100",
    "RTX-4070-Ti" -> "rtx4070ti", "H100-PCIe" -> "h100pcie")."""
    return _MEMORY_SUFFIX.sub("", normalise_gpu_name(spec_name)).replace("-", "")


def _find(wanted: str) -> GPUSpec | None:
    key = wanted.replace("-", "")
    for spec_name, spec in GPUS.items():
        if _key(spec_name) == key:
            return spec
    if key in _ALIASES:
        return GPUS[_ALIASES[key]]
    if wanted in _ALIASES:
        return GPUS[_ALIASES[wanted]]
    return None


def gpu_spec(name: str | GPUSpec | Mapping) -> GPUSpec:
    """The catalog entry for a GPU name, case-, space- and underscore-insensitive, vendor words optional
    ("A100-40GB", "a100 80gb", "NVIDIA H200", "RTX 4090", "AMD Instinct MI300X"), with its memory as a suffix
    ("RTX 3060 12GB", "H100 PCIe 80GB"), or an alias ("H100": the 80 GB SXM, "A100": 80 GB, "V100": 32 GB, "4070 Ti").
    A :class:`GPUSpec` is returned as is; a mapping describes a card not in the catalog (:func:`custom_gpu`). An
    unknown name raises ``InvalidInputError`` listing the catalog."""
    if isinstance(name, GPUSpec):
        return name
    if isinstance(name, Mapping):
        return custom_gpu(name)
    if not isinstance(name, str):
        raise InvalidInputError(f"gpu must be a GPU name such as 'A100-80GB', a GPUSpec or a mapping, got "
                                f"{type(name).__name__}")
    found = _find(normalise_gpu_name(name))
    suffix = _NAMED_MEMORY.search(name.lower().strip())
    if found is None and suffix is not None:  # "RTX 3060 12GB": the card, if its memory is the one named
        found = _find(normalise_gpu_name(name.strip()[:suffix.start()]))
        if found is not None and found.memory_bytes != int(suffix.group(1)) * GiB:
            found = None
    if found is None:
        raise InvalidInputError(f"unknown GPU {name!r}{_closest(name)}: autofit knows {', '.join(GPUS)}; describe "
                                "another card with gpu={'memory': '12GB', 'like': 'RTX-4070'} (CLI: --gpu-memory 12GB)")
    return found


_FORMS = ("pcie", "nvl", "sxm")  # form factors of one part: the same GPU in another board


def _bare(key: str) -> str:
    return key[3:] if key.startswith("rtx") else key


def _closest(name: str) -> str:
    """", did you mean 'L40S'?" for the catalog name (or alias) closest to ``name``, else ""."""
    import difflib

    keys = {_key(n): n for n in GPUS} | {a.replace("-", ""): GPUS[p].name for a, p in _ALIASES.items()}
    close = difflib.get_close_matches(_key(name), list(keys), n=1, cutoff=0.6)
    return f", did you mean {keys[close[0]]!r}?" if close else ""


def resolve_alias(name: str) -> tuple[str, tuple[str, ...]] | None:
    """For an alias, the part :func:`gpu_spec` picks and the other parts the same words name: the same GPU with
    other memory ("A100": 40 and 80 GB) or in another board ("H100": SXM, PCIe, NVL); None for an exact catalog
    name, and for an alias that names its part alone ("RTX4090", "4090": one card, nothing to choose) unless it
    names it by other words ("rtx6000" is the RTX-6000-Ada)."""
    wanted = normalise_gpu_name(name) if isinstance(name, str) else ""
    if wanted not in _ALIASES:
        return None
    picked = _ALIASES[wanted]
    said = _bare(wanted.replace("-", ""))
    others = tuple(n for n in GPUS if n != picked and _bare(catalog_key(n)) in (said, *(said + f for f in _FORMS)))
    if not others and _bare(catalog_key(picked)) == said:
        return None
    return picked, others


def card_memory(memory: int | str) -> int:
    """A card's memory in bytes: bytes, or a size string read as every size is (autofit/core/units.py): "12GB" is
    12 x 10^9 bytes, "12GiB" 12 x 2^30. A vendor's "12 GB" card has 12 GiB (12,288 MiB): write 12GiB for it."""
    if isinstance(memory, str) and memory.strip().endswith("%"):
        raise InvalidInputError(f"gpu memory must be bytes or a size such as '12GiB', got {memory!r}")
    return parse_budget(memory, device_total_bytes=None)


def custom_gpu(description: Mapping) -> GPUSpec:
    """A card not in the catalog: ``{"memory": "12GB"}`` (bytes or a size string, :func:`card_memory`), optionally
    ``"like"``: the
    catalog card whose other figures it takes (default the A100-80GB's throughput, kernels and links), ``"name"``,
    and any :class:`GPUSpec` field to override. Its host is the catalog card's when ``like`` is given, else an
    assumed workstation (``workstation_host``)."""
    items = dict(description)
    names = {f.name for f in fields(GPUSpec)}
    unknown = sorted(set(items) - names - {"memory", "like"})
    if unknown:
        raise InvalidInputError(f"gpu: unknown field(s) {', '.join(map(repr, unknown))}; give 'memory', 'like', "
                                f"'name' or GPUSpec fields ({', '.join(sorted(names))})")
    like = items.pop("like", None)
    base = gpu_spec(like) if like is not None else GPUS[LIKE_DEFAULT]
    if "memory" in items:
        items["memory_bytes"] = card_memory(items.pop("memory"))
    if "memory_bytes" not in items:
        raise InvalidInputError("gpu: a card not in the catalog needs its memory, e.g. {'memory': '12GB'}")
    size = f"{items['memory_bytes'] / GiB:.3g}GiB"
    items.setdefault("name", f"{base.name}-like {size}" if like is not None else f"GPU {size}")
    items.setdefault("source", f"described by hand; other figures of {base.name}")
    if like is None:
        items.setdefault("host", workstation_host(items["memory_bytes"]))
    try:
        return replace(base, **items)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"gpu: {e}") from e
