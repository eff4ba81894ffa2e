"""The size flags (``--budget``, ``--gpu-memory``, ``--host-budget``, ``--margin``) read before anything is built: a
plan can take minutes, and ``--budget 16`` (16 bytes? 16 GB?) should cost none of them (issue 57).

Every size flag reads units one way (autofit/core/units.py): GB, MB, KB, TB are powers of 1000, GiB, MiB, KiB, TiB
powers of 1024, and a number without a unit is refused with its likely meaning; bytes are written ``565000000B``."""

from __future__ import annotations

from autofit.core.errors import InvalidInputError
from autofit.core.units import parse_budget, parse_bytes, unitless_hint

__all__ = ["check_sizes", "SIZE_UNITS"]

SIZE_UNITS = "GB = 10^9 bytes, GiB = 2^30 (as in every size flag); a number needs its unit (bytes: 565000000B)"


def check_sizes(*, budget: str | None = None, gpu_memory: str | None = None, host_budget: str | None = None,
                margin: str | None = None) -> None:
    """Raise :class:`InvalidInputError` naming the flag for a size the planner would refuse later, or read as
    something other than what was likely meant. Percentages are checked for form only (their total is known later)."""
    flags = (("--budget", budget, True), ("--gpu-memory", gpu_memory, False), ("--host-budget", host_budget, False),
             ("--margin", margin, True))
    for flag, value, share in flags:
        if value is None or (flag == "--margin" and value.strip() in ("0", "0%", "0B")):
            continue
        hint = unitless_hint(value, flag)
        if hint is not None:
            raise InvalidInputError(hint)
        try:
            if share:
                parse_budget(value, device_total_bytes=100)  # the form of a percentage; the total comes later
            elif value.strip().endswith("%"):
                raise InvalidInputError(f"{flag} is a size such as '64GB', not a share, got {value!r}")
            else:
                parse_bytes(value, what=flag)
        except InvalidInputError as e:
            message = str(e).replace("cannot read budget", f"cannot read {flag}")
            raise InvalidInputError(message if flag in message else f"{flag}: {message}") from None
