"""What a solve may spend, passed down every stage: wall time (the plan's time limit), Z3
resource units (a deterministic allowance: the same answer on every run, unlike a timeout),
template work (instances laid out in Python), and cancellation (Ctrl-C during a Z3 check)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import z3

__all__ = ["LAYOUT_SECONDS", "TEMPLATE_RATE", "Budget", "check"]

TEMPLATE_RATE = 100_000  # instances a template lays out per second of time limit, at most
LAYOUT_SECONDS = 6e-7    # per instance: ranking a pool and laying out one completion (here)


class Budget:
    """A deadline shared by everything under one solve, and Z3 units that may be sliced for a
    sub-task (`slice`): what a slice spends is charged to its parents too."""

    def __init__(self, seconds: float | None = None, *, z3_units: int | None = None,
                 _deadline: float | None = None, _parent: Budget | None = None) -> None:
        self.seconds = seconds
        self.deadline = (_deadline if _parent is not None else
                         None if seconds is None else time.monotonic() + seconds)
        self.z3_units = z3_units
        self._parent = _parent

    def slice(self, z3_units: int) -> Budget:
        """The same deadline with at most `z3_units` of what is left of this budget's units."""
        units = z3_units if self.z3_units is None else min(z3_units, max(0, self.z3_units))
        return Budget(self.seconds, z3_units=units, _deadline=self.deadline, _parent=self)

    def reserving(self, seconds: float) -> Budget:
        """This budget with its deadline `seconds` earlier: what a stage may use when a later
        stage needs that long (Z3 units are shared, not reserved)."""
        deadline = None if self.deadline is None else self.deadline - seconds
        return Budget(self.seconds, _deadline=deadline, _parent=self)

    # -- wall time

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def remaining(self) -> float:
        """Seconds left for the core (0.0 means no limit there, so never exactly 0)."""
        if self.deadline is None:
            return 0.0
        return max(1e-3, self.deadline - time.monotonic())

    def remaining_ms(self) -> int | None:
        """Milliseconds left for a Z3 timeout, or None without a deadline."""
        if self.deadline is None:
            return None
        return max(1, int((self.deadline - time.monotonic()) * 1000))

    def allows_template(self, instances: int) -> bool:
        """Whether a template of this many instances fits the time limit (decided by size, not
        by the clock, so that the same plan gets the same templates on any machine)."""
        return self.seconds is None or instances <= TEMPLATE_RATE * max(1.0, self.seconds)

    # -- Z3 units

    @property
    def spent(self) -> bool:
        """No Z3 units left (here or in a parent)."""
        budget: Budget | None = self
        while budget is not None:
            if budget.z3_units is not None and budget.z3_units <= 0:
                return True
            budget = budget._parent
        return False

    def _charge(self, units: int) -> None:
        """Spend `units` here; a parent is charged at most what this slice had."""
        before = self.z3_units
        if before is not None:
            self.z3_units -= units
        if self._parent is not None:
            self._parent._charge(units if before is None else min(units, max(0, before)))

    def check(self, solver: z3.Solver, *assumptions) -> z3.CheckSatResult:
        """solver.check within the deadline and the units left, charging what it used."""
        ms = self.remaining_ms()
        if ms is not None:
            solver.set("timeout", ms)
        left = self.units_left()
        if left is None:
            return check(solver, *assumptions)
        before = _rlimit_count(solver)
        solver.set("rlimit", max(1, left))
        try:
            return check(solver, *assumptions)
        finally:
            self._charge(_rlimit_count(solver) - before)

    def units_left(self) -> int | None:
        """Z3 units this budget may still spend (None: unlimited)."""
        lefts = []
        budget: Budget | None = self
        while budget is not None:
            if budget.z3_units is not None:
                lefts.append(budget.z3_units)
            budget = budget._parent
        return min(lefts) if lefts else None


def check(solver, *assumptions):
    """solver.check, except that Ctrl-C stays an interrupt: Z3 catches SIGINT during a check
    and answers "unknown" ("interrupted from keyboard"; limits say "canceled")."""
    import z3

    outcome = solver.check(*assumptions)
    if outcome == z3.unknown and "interrupted" in solver.reason_unknown():
        raise KeyboardInterrupt
    return outcome


def _rlimit_count(solver) -> int:
    stats = solver.statistics()
    return int(stats.get_key_value("rlimit count")) if "rlimit count" in stats.keys() else 0
