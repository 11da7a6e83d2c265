"""Amounts as users read them: memory (plain integers, or sizes such as "32GiB" converted to
bytes) and counts of things ("1 micro-batch", "2 micro-batches")."""

from __future__ import annotations

import re

__all__ = ["count", "format_memory", "parse_memory"]

MAX_MEMORY = 2**60  # bytes (1 EiB) or plan units: sums over devices and steps stay in int64
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}
_SIZE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([KMGTP]i?B|B)\s*$", re.IGNORECASE)


def parse_memory(value: int | str) -> tuple[int, bool]:
    """(amount, is_size): integers stay as they are, sizes become bytes."""
    if isinstance(value, bool):
        raise ValueError("memory must be an integer or a size")
    if isinstance(value, int):
        amount, is_size = value, False
    else:
        match = _SIZE.match(str(value))
        if not match:
            raise ValueError(f"not a memory size: {value!r}")
        number, unit = match.groups()
        amount, is_size = round(float(number) * _UNITS[unit.upper()]), True
    if abs(amount) > MAX_MEMORY:
        shown = f"{value!r} ({amount:,} bytes)" if is_size else f"{amount:,}"
        raise ValueError(f"{shown} is more than the largest supported amount, 2^60 "
                         f"({MAX_MEMORY:,})")
    return amount, is_size


def format_memory(amount: int | None, is_size: bool) -> str:
    """Show an amount in the plan's unit: bytes as a binary size, integers as they are."""
    if amount is None:
        return "unlimited"
    if not is_size:
        return str(amount)
    sign = "-" if amount < 0 else ""
    value = float(abs(amount))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            text = f"{value:.2f}".rstrip("0").rstrip(".") if unit != "B" else f"{int(value)}"
            return f"{sign}{text}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def count(n: int, noun: str) -> str:
    """"1 device", "4 devices", "1 micro-batch", "16 micro-batches"."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}es" if noun.endswith(("ch", "sh", "s", "x")) else f"{n} {noun}s"
