"""Which of the user's functions (the data, the loss...) this process is running now: what the
fault watchdog (pyplan.train.faults) names when one does not return, instead of a rank that
waits forever with its heartbeat still beating."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator

__all__ = ["Running", "running", "now"]

_now: "Running | None" = None
_called: set[Hashable] = set()


class Running:
    def __init__(self, name: Callable[[], str], first: bool) -> None:
        self.name = name
        """() -> "the data function pkg.mod:fn (plan.yaml model.data)": made when needed."""
        self.since = time.monotonic()
        self.first = first
        """Its first call, which may load what later calls use (a dataset, a tokenizer)."""


@contextmanager
def running(key: Hashable, name: Callable[[], str]) -> Iterator[None]:
    """Mark the user's function `key` as running in this block (nested calls restore the
    outer one)."""
    global _now
    outer, _now = _now, Running(name, key not in _called)
    try:
        yield
    finally:
        _now = outer
        _called.add(key)


def now() -> Running | None:
    return _now
