"""Byte quantities at the edges: ``parse_bytes``, ``parse_budget`` and ``format_bytes``.

Decimal suffixes are powers of 1000 and binary suffixes powers of 1024 (the Hugging Face convention, see the
module's docstring); percentages are shares of a device total; anything else is an ``InvalidInputError`` that quotes
the value and shows the accepted forms.
"""

from __future__ import annotations

import pytest

import autofit
from autofit.core.units import format_bytes, parse_budget, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8GB", 8 * 10**9),
        ("8GiB", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512MB", 512 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 * 2**29),
        ("2TB", 2 * 10**12),
        ("1TiB", 2**40),
        ("64KB", 64_000),
        ("64KiB", 65_536),
        ("10B", 10),
        ("1000B", 1000),
        (".5GB", 500_000_000),
        (" 8 GB ", 8 * 10**9),
        ("8gb", 8 * 10**9),
        ("8gib", 8 * 2**30),
        (123, 123),
        (4096.0, 4096),
    ],
    ids=repr,
)
def test_parse_bytes(text, expected: int) -> None:
    value = parse_bytes(text)
    assert value == expected
    assert type(value) is int


def test_decimal_and_binary_units_differ() -> None:
    assert parse_bytes("8GiB") - parse_bytes("8GB") == 8 * (2**30 - 10**9)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("8 gigs", "'gigs'"),
        ("8GBs", "'GBs'"),
        ("", "'8GB'"),
        ("   ", "'8GB'"),
        ("GB", "'GB'"),
        ("1.2.3GB", "'1.2.3GB'"),
        ("0x10", "'0x10'"),
        ("eight GB", "'eight GB'"),
        ("-1GB", "positive"),
        ("-5", "positive"),
        ("0", "positive"),
        ("0GB", "positive"),
        (0, "positive"),
        (-1, "positive"),
        (-0.5, "positive"),
        ("nan", "nan"),
        ("inf", "finite"),
        (float("inf"), "finite"),
        ("1e400", "finite"),
        (True, "True"),
        (None, "NoneType"),
        ([8], "list"),
    ],
    ids=repr,
)
def test_parse_bytes_rejects(value, fragment: str) -> None:
    with pytest.raises(autofit.InvalidInputError) as info:
        parse_bytes(value, what="budget")
    message = str(info.value)
    assert "budget" in message, message  # names what was being read
    assert fragment in message, message


@pytest.mark.parametrize(("text", "meant"), [("16", ("16GB", "16GiB", "16B")), ("2.5", ("2.5GB", "2.5GiB")),
                                             ("565000000", ("565000000B",)), ("1e9", ("1000000000B",))], ids=repr)
def test_a_string_without_a_unit_is_refused_with_its_likely_meaning(text, meant) -> None:
    """Numbers are bytes (10, 1e9); text says its unit: "16" was read as 16 bytes and failed minutes later."""
    with pytest.raises(autofit.InvalidInputError) as info:
        parse_budget(text)
    message = str(info.value)
    assert "no unit" in message and all(m in message for m in meant), message
    assert parse_bytes(meant[0]) == {"16GB": 16 * 10**9, "2.5GB": 2_500_000_000, "565000000B": 565_000_000,
                                     "1000000000B": 10**9}[meant[0]]


@pytest.mark.parametrize(
    ("text", "total", "expected"),
    [("90%", 80 * 10**9, 72 * 10**9), ("100%", 12_345, 12_345), ("12.5%", 800, 100), (" 50 % ", 1000, 500)],
)
def test_parse_budget_percentage(text: str, total: int, expected: int) -> None:
    assert parse_budget(text, device_total_bytes=total) == expected


@pytest.mark.parametrize("value", ["8GB", "8GiB", 10**9, 1e9])
def test_parse_budget_without_percent_is_parse_bytes(value) -> None:
    assert parse_budget(value) == parse_bytes(value)
    assert parse_budget(value, device_total_bytes=1) == parse_bytes(value)  # the total only matters for "%"


def test_percentage_needs_a_device_total() -> None:
    with pytest.raises(autofit.InvalidInputError) as info:
        parse_budget("90%")
    message = str(info.value)
    assert "'90%'" in message and "gpu=" in message and "'8GB'" in message


@pytest.mark.parametrize("text", ["0%", "101%", "-5%", "abc%", "%", "nan%", "inf%"], ids=repr)
def test_bad_percentage(text: str) -> None:
    with pytest.raises(autofit.InvalidInputError) as info:
        parse_budget(text, device_total_bytes=10**9)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (512 * 2**20, "512.00 MiB"),
        (3 * 2**29, "1.50 GiB"),
        (8 * 10**9, "7.45 GiB"),
        (-(2**20), "-1.00 MiB"),
    ],
)
def test_format_bytes(n: int, expected: str) -> None:
    assert format_bytes(n) == expected


@pytest.mark.parametrize("n", [1024, 5_000, 123_456_789, 8 * 10**9, 3 * 2**40 + 7])
def test_format_then_parse_round_trips(n: int) -> None:
    """What a table prints reads back (``"1.50 GiB"`` is a valid budget) within its two decimals."""
    back = parse_bytes(format_bytes(n))
    assert abs(back - n) <= 0.005 * n


def test_format_mib_by_hand() -> None:
    from autofit.core.units import format_mib

    assert format_mib(3 * 2**19) == "1.5"  # 1.5 MiB
    assert format_mib(14_230_810_624) == "13,571.6"  # 14,230,810,624 / 1,048,576 = 13,571.56
    assert format_mib(2**20, 2) == "1.00"
