"""Memory amounts: plain integers, or sizes such as "32GiB" converted to bytes."""

from __future__ import annotations

import re

__all__ = ["format_memory", "parse_memory"]

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}
_SIZE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([KMGTP]i?B|B)\s*$", re.IGNORECASE)


def parse_memory(value: int | str) -> tuple[int, bool]:
    """(amount, is_size): integers stay as they are, sizes become bytes."""
    if isinstance(value, bool):
        raise ValueError("memory must be an integer or a size")
    if isinstance(value, int):
        return value, False
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"not a memory size: {value!r}")
    number, unit = match.groups()
    return round(float(number) * _UNITS[unit.upper()]), True


def format_memory(amount: int | None, is_size: bool) -> str:
    """Show an amount in the plan's unit: bytes as a binary size, integers as they are."""
    if amount is None:
        return "unlimited"
    if not is_size:
        return str(amount)
    sign = "-" if amount < 0 else ""
    value = float(abs(amount))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            text = f"{value:.2f}".rstrip("0").rstrip(".") if unit != "B" else f"{int(value)}"
            return f"{sign}{text}{unit}"
        value /= 1024
    raise AssertionError("unreachable")
