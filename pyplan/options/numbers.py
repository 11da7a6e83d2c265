"""The numeric options' one check: each option declares its range where it is declared, as its
argparse type (`whole(1, 10**9)`, `number(0, 1e6, above=True)`), and a value outside it (nan,
inf, a number too large for a timeout or for torch) is refused while the command line is read,
before any worker starts, in one line that names the option:

    error: --lr 'nan' is not a number above 0 and at most 1e+06

argparse gives a type only the text, so pyplan.cli.main names each option's type after
declaring it (`name_numbers`); the type raises PlanError, which argparse lets through (it
would print its usage for a ValueError). --config's values go through the same types.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Callable

from pyplan.errors import PlanError

__all__ = ["SEED", "Number", "Steps", "duration", "name_numbers", "number", "parse_duration",
           "whole"]


class Number:
    """An argparse type: text -> int (`integral`) or float in [low, high], low excluded when
    `above`; `words` maps texts that are not numbers (--eval-batches all) to their value;
    `parse` reads the text (float or int by default)."""

    def __init__(self, low: float, high: float, *, integral: bool, above: bool = False,
                 words: dict[str, object] | None = None,
                 parse: Callable[[str], float] | None = None, what: str | None = None,
                 option: str | None = None) -> None:
        if not (math.isfinite(low) and math.isfinite(high) and low <= high):
            raise ValueError(f"a range of finite numbers, not {low} .. {high}")
        self.low, self.high, self.integral, self.above = low, high, integral, above
        self.words = dict(words or {})
        self.parse = parse
        self.what = what
        self.option = option

    def named(self, option: str) -> Number:
        """This type for the option `option` (its messages name it)."""
        return Number(self.low, self.high, integral=self.integral, above=self.above,
                      words=self.words, parse=self.parse, what=self.what, option=option)

    def describe(self) -> str:
        """What a value must be, in words: "a whole number from 1 to 1,000,000"."""
        if self.what:
            text = self.what.format(low=self.low, high=self.high)
        elif self.integral:
            text = f"a whole number from {self.low:,} to {self.high:,}"
        elif self.above:
            text = f"a number above {self.low:g} and at most {self.high:g}"
        else:
            text = f"a number from {self.low:g} to {self.high:g}"
        return " or ".join([text, *(repr(w) for w in self.words)])

    def value(self, text: str):
        """The value of `text`; ValueError when it is not one in range."""
        text = text.strip()
        if text in self.words:
            return self.words[text]
        if self.parse is not None:
            value = self.parse(text)
        elif self.integral:
            value = int(text, 10)
        else:
            value = float(text)
        if not (self.low < value if self.above else self.low <= value) or \
                not value <= self.high:  # false for nan too
            raise ValueError(text)
        return value

    def __call__(self, text: str):
        try:
            return self.value(text)
        except (ValueError, OverflowError):
            name = f"{self.option} " if self.option else ""
            shown = text if len(text) <= 40 else text[:37] + "..."  # one short line
            raise PlanError(f"{name}{shown!r} is not {self.describe()}") from None


class Steps:
    """An argparse type: a comma-separated list of whole numbers from `low` to `high`
    (--profile-steps 3,5), as a sorted tuple without repeats; Number's interface."""

    def __init__(self, low: int, high: int, option: str | None = None) -> None:
        self.one = Number(low, high, integral=True)
        self.option = option

    def named(self, option: str) -> Steps:
        return Steps(self.one.low, self.one.high, option=option)

    def describe(self) -> str:
        return f"whole numbers from {self.one.low:,} to {self.one.high:,}, separated by commas"

    def value(self, text: str) -> tuple[int, ...]:
        parts = text.split(",")
        if len(parts) > 1000:  # (a bounded list: far more than anyone profiles)
            raise ValueError(text)
        return tuple(sorted({self.one.value(part) for part in parts}))

    __call__ = Number.__call__


def whole(low: int, high: int, **words) -> Number:
    """A whole number from `low` to `high`; `words`: texts that stand for a value."""
    return Number(low, high, integral=True, words=words)


def number(low: float, high: float, *, above: bool = False) -> Number:
    """A finite number from `low` (or above it) to `high`."""
    return Number(low, high, integral=False, above=above)


def duration(high: float) -> Number:
    """A positive duration of at most `high` seconds (parse_duration)."""
    return Number(0, high, integral=False, above=True, parse=parse_duration,
                  what="a duration of at most {high:g} s: seconds (5400), units (90m, 1h30m) "
                  "or [D-]HH:MM:SS")


SEED = whole(0, 2**63 - 1)
"""A seed: any whole number torch's generators take (pyplan hashes it with what it seeds)."""


def name_numbers(parser: argparse.ArgumentParser) -> None:
    """Give each numeric option's type its option's name, for its messages."""
    for action in parser._actions:
        if isinstance(action.type, (Number, Steps)) and action.option_strings:
            action.type = action.type.named(action.option_strings[0])


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in `text`: a number of seconds ("5400"), units ("90m", "1h30m", "2d", "45s") or
    SLURM's [[D-]HH:]MM:SS ("1:30:00", "2-00:00:00"). ValueError when it is none of them or
    not positive."""
    text = text.strip()
    seconds = None
    if re.fullmatch(r"\d+(\.\d+)?([eE][-+]?\d+)?", text):  # (a worker is given repr(seconds))
        seconds = float(text)
    elif re.fullmatch(r"(\d+(\.\d+)?[smhd])+", text):
        seconds = sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smhd])",
                                                                   text))
    else:
        found = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text)
        if found:
            days, hours, minutes, secs = (int(x or 0) for x in found.groups())
            seconds = ((days * 24 + hours) * 60 + minutes) * 60 + secs
    if seconds is None or not seconds > 0:
        raise ValueError(text)
    return seconds
