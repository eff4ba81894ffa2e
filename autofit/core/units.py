"""Byte quantities at the edges: parsing budget strings and formatting tables.

Inside autofit every size is an ``int`` of bytes. Units appear only here, so there is one place that decides what
"8GB" means. The convention follows the Hugging Face ecosystem (accelerate's ``convert_file_size_to_int``):
decimal suffixes are powers of 1000 ("8GB" = 8e9 bytes), binary suffixes are powers of 1024 ("8GiB" = 8 * 2**30).
Percentages ("90%") are resolved against a device total by the caller, see :func:`parse_budget`.

Numbers are bytes: ``8_000_000_000`` (an ``int``) and ``8e9`` (a ``float``). A *string* says its unit: ``"16"`` is
refused (:func:`unitless_hint`), because text is what people type, and "16" meant 16 GB far more often than 16
bytes (issue 57: ``--budget 16`` was read as 16 bytes and failed after two minutes). Bytes as text are ``"16B"``.
"""

from __future__ import annotations

import math
import re

from autofit.core.errors import InvalidInputError

__all__ = ["parse_bytes", "parse_budget", "format_bytes", "format_mib", "unitless_hint", "MiB"]

MiB = 2**20

_DECIMAL = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_BINARY = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: int | float | str, *, what: str = "size") -> int:
    """Turn ``8GB``, ``8GiB``, ``512MiB``, ``1e9`` or an int into a number of bytes."""
    if isinstance(value, bool):
        raise InvalidInputError(f"{what} must be a number of bytes or a string like '8GB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise InvalidInputError(f"{what} must be positive, got {value}")
        return value
    if isinstance(value, float):
        if not value > 0 or not math.isfinite(value):
            raise InvalidInputError(f"{what} must be a positive, finite number of bytes, got {value}")
        return int(value)
    if not isinstance(value, str):
        raise InvalidInputError(f"{what} must be an int or a string like '8GB', got {type(value).__name__}")
    try:
        number = float(value)
    except ValueError:
        return _parse_suffixed(value, what)
    hint = unitless_hint(value, what)
    if hint is not None:
        raise InvalidInputError(hint)
    return parse_bytes(number, what=what)  # zero, negative or not finite: says which


def unitless_hint(text: str, what: str = "size") -> str | None:
    """For a string that is a number without a unit ("16", "1e9"), the refusal with its likely meaning; else None.
    Zero and negatives are left to the positivity check, which says what is wrong with them."""
    try:
        number = float(text)
    except ValueError:
        return None
    if not math.isfinite(number) or number <= 0:
        return None
    shown = text.strip()
    if number >= MiB:  # a count this large was meant as bytes
        return (f"{what} {shown} has no unit: write bytes as '{int(number)}B', or a size such as "
                f"'{_round(number / 10**9)}GB' (10^9 bytes) or '{_round(number / 2**30)}GiB' (2^30 bytes)")
    return (f"{what} {shown} has no unit: did you mean {shown}GB ({shown}x10^9 bytes) or {shown}GiB ({shown}x2^30 "
            f"bytes)? Write bytes as '{shown}B'")


def _round(x: float) -> str:
    return f"{x:.3g}"


def _parse_suffixed(value: str, what: str) -> int:
    match = _PATTERN.match(value)
    if match is None and value.strip().startswith("-"):
        raise InvalidInputError(f"{what} must be positive, got {value!r}")
    if match is None:
        raise InvalidInputError(
            f"cannot read {what} {value!r}: write a number with a unit, e.g. '8GB' (10^9), '8GiB' (2^30) or '512MiB'"
        )
    number, unit = float(match.group(1)), match.group(2).upper() or "B"
    factor = _DECIMAL.get(unit) or _BINARY.get(unit)
    if factor is None:
        raise InvalidInputError(
            f"unknown unit {match.group(2)!r} in {what} {value!r}: use B, KB, MB, GB, TB (powers of 1000) "
            "or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    if not math.isfinite(number * factor):
        raise InvalidInputError(f"{what} {value!r} is not a finite number of bytes")
    result = int(number * factor)
    if result <= 0:
        raise InvalidInputError(f"{what} must be positive, got {value!r}")
    return result


def parse_budget(value: int | float | str, *, device_total_bytes: int | None = None) -> int:
    """A budget in bytes: anything :func:`parse_bytes` reads, or a percentage of ``device_total_bytes``."""
    if isinstance(value, str) and value.strip().endswith("%"):
        text = value.strip()[:-1]
        try:
            percent = float(text)
        except ValueError as e:
            raise InvalidInputError(f"cannot read budget {value!r}: a percentage looks like '90%'") from e
        if not 0 < percent <= 100:
            raise InvalidInputError(f"budget percentage must be in (0, 100], got {value!r}")
        if device_total_bytes is None:
            raise InvalidInputError(
                f"budget {value!r} is a percentage, but no device memory is known: name the GPU, "
                "device='A100-80GB' or device=autofit.Device(gpu='A100-80GB') (--gpu A100-80GB), or give a size, e.g. "
                "'8GB'"
            )
        return int(device_total_bytes * percent / 100)
    return parse_bytes(value, what="budget")


def format_bytes(n: int) -> str:
    """Binary units, as ``torch.cuda.memory_summary`` prints them: ``1.50 GiB``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{sign}{n / factor:.2f} {unit}"
    return f"{sign}{n} B"


def format_mib(n: int, digits: int = 1) -> str:
    """A number of bytes in MiB with thousands separators, for table columns headed "MiB": ``13,571.3``."""
    return f"{n / MiB:,.{digits}f}"
