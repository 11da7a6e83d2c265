"""What a solve may spend, passed down every stage: wall time (the plan's time limit), Z3
resource units (a deterministic allowance: the same answer on every run, unlike a timeout),
template work (instances laid out in Python), the effort (work counted in units, which ends
the search once more work stops paying) and cancellation (Ctrl-C during a Z3 check)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import z3

__all__ = ["EFFORT_FLOOR", "EFFORT_STRETCH", "LAYOUT_SECONDS", "TEMPLATE_RATE", "Budget",
           "Clock", "Effort", "check"]

TEMPLATE_RATE = 100_000  # instances a template lays out per second of time limit, at most
LAYOUT_SECONDS = 6e-7    # per instance: ranking a pool and laying out one completion (here)
# The effort's unit is one instance evaluation of the core (about 50 ns here; a Z3 resource
# unit costs about as much). A search that made progress (a shorter schedule, a shorter
# period, a bound that moved) at work W may go on without progress for
# effort x (EFFORT_FLOOR + EFFORT_STRETCH x W) more units.
EFFORT_FLOOR = 10_000_000    # about 0.5 s here
EFFORT_STRETCH = 1.0


class Effort:
    """Work done by one solve, in deterministic units (counts, never the clock), and when it
    last made progress. `scale` (the plan's search.effort, --effort) multiplies how long the
    search may go on without progress, and the fixed allowances of its stages (`units`).
    `cap`: units the whole solve may spend at most, whatever progress it makes (a search made
    of many solves, such as the choice of blocks to recompute, stays bounded that way)."""

    def __init__(self, scale: float = 1.0, cap: int | None = None) -> None:
        self.scale = scale
        self.cap = cap
        self.work = 0
        self.mark = 0

    @property
    def capped(self) -> bool:
        """The cap is spent: every stage winds down as at the time limit."""
        return self.cap is not None and self.work >= self.cap

    def charge(self, units: float) -> None:
        self.work += max(0, int(units))

    def progress(self) -> None:
        """The incumbent improved or a bound moved: the stretch restarts from here."""
        self.mark = self.work

    def left(self) -> int:
        """Units the search may still spend without progress (<= 0: it has stalled)."""
        stretch = self.scale * (EFFORT_FLOOR + EFFORT_STRETCH * self.mark)
        left = int(stretch) - (self.work - self.mark)
        return left if self.cap is None else min(left, self.cap - self.work)

    @property
    def stalled(self) -> bool:
        return self.left() <= 0

    def units(self, base: int) -> int:
        """A stage's fixed allowance at this effort."""
        return max(1, int(base * self.scale))


class Budget:
    """A deadline shared by everything under one solve, and Z3 units that may be sliced for a
    sub-task (`slice`): what a slice spends is charged to its parents too."""

    def __init__(self, seconds: float | None = None, *, z3_units: int | None = None,
                 effort: Effort | None = None, fixed: bool = False,
                 _deadline: float | None = None, _parent: Budget | None = None) -> None:
        self.seconds = seconds
        self.deadline = (_deadline if _parent is not None else
                         None if seconds is None else time.monotonic() + seconds)
        self.z3_units = z3_units
        self._parent = _parent
        self.effort = effort if _parent is None else _parent.effort
        """Shared by the whole solve (None: no effort limit, for exact subproblems alone)."""
        self.fixed = fixed or (_parent is not None and _parent.fixed)
        """A fixed allowance (a stage bounded by its own units): its work counts, but it is
        not cut when the search stalls."""

    def slice(self, z3_units: int, *, fixed: bool = False) -> Budget:
        """The same deadline with at most `z3_units` of what is left of this budget's units;
        `fixed`: those units are the stage's allowance, whether or not the search stalls."""
        units = z3_units if self.z3_units is None else min(z3_units, max(0, self.z3_units))
        return Budget(self.seconds, z3_units=units, fixed=fixed, _deadline=self.deadline,
                      _parent=self)

    def reserving(self, seconds: float) -> Budget:
        """This budget with its deadline `seconds` earlier: what a stage may use when a later
        stage needs that long (Z3 units are shared, not reserved)."""
        deadline = None if self.deadline is None else self.deadline - seconds
        return Budget(self.seconds, _deadline=deadline, _parent=self)

    # -- effort

    def charge(self, units: float) -> None:
        """Count work done (without an effort, nothing to count)."""
        if self.effort is not None:
            self.effort.charge(units)

    def progress(self) -> None:
        if self.effort is not None:
            self.effort.progress()

    @property
    def stalled(self) -> bool:
        """The search has gone on without progress for as long as its effort allows (never
        within a fixed allowance)."""
        return self.effort is not None and not self.fixed and self.effort.stalled

    def units(self, base: int) -> int:
        """A stage's fixed allowance, scaled by the effort."""
        return base if self.effort is None else self.effort.units(base)

    # -- wall time

    def expired(self) -> bool:
        """Out of time, or out of work where the effort has a cap: stop now."""
        return self.timed_out() or (self.effort is not None and self.effort.capped)

    def timed_out(self) -> bool:
        """The time limit ran out (a status of its own: the result depends on the machine)."""
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
        """No Z3 units left (here or in a parent), the search has stalled or the effort's cap
        is spent."""
        if self.stalled or (self.effort is not None and self.effort.capped):
            return True
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

    def check(self, solver: z3.Solver, *assumptions, rate: int = 1) -> z3.CheckSatResult:
        """solver.check within the deadline, the units left and the effort left, charging what
        it used: each Z3 unit is `rate` effort units (1 for scheduling models, whose units
        take about 50 ns here; a modulo model's about four times as long)."""
        ms = self.remaining_ms()
        if ms is not None:
            solver.set("timeout", ms)
        left = self.units_left(rate)
        if left is None:
            return check(solver, *assumptions)
        before = _rlimit_count(solver)
        solver.set("rlimit", max(1, left))
        try:
            return check(solver, *assumptions)
        finally:
            used = _rlimit_count(solver) - before
            self._charge(used)
            self.charge(used * rate)

    def units_left(self, rate: int = 1) -> int | None:
        """Z3 units this budget may still spend (None: unlimited): its own and its parents',
        and no more than the effort left before the search stalls (`rate` effort units
        each)."""
        lefts = []
        budget: Budget | None = self
        while budget is not None:
            if budget.z3_units is not None:
                lefts.append(budget.z3_units)
            budget = budget._parent
        if self.effort is not None and not self.fixed:
            lefts.append(self.effort.left() // rate)
        elif self.effort is not None and self.effort.cap is not None:
            lefts.append((self.effort.cap - self.effort.work) // rate)
        return min(lefts) if lefts else None


class Clock:
    """Wall seconds spent in each phase of a solve, for reports and benchmarks (what the
    search decides depends on counted work, never on these). A phase entered inside another
    pauses it: each second counts once, in the innermost phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._open: list[list] = []  # [phase, since] from the outermost in

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        now = time.monotonic()
        if self._open:
            self._lap(now)
        self.seconds.setdefault(phase, 0.0)
        self._open.append([phase, now])
        try:
            yield
        finally:
            self._lap(time.monotonic())
            self._open.pop()

    def _lap(self, now: float) -> None:
        """Count the innermost open phase up to now."""
        current = self._open[-1]
        self.seconds[current[0]] += now - current[1]
        current[1] = now
        if len(self._open) > 1:
            self._open[-2][1] = now

    def add(self, seconds: dict[str, float]) -> None:
        """Another solve's phases counted here too (a recomputation choice's)."""
        for phase, value in seconds.items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + value


def check(solver, *assumptions):
    """solver.check, except that Ctrl-C stays an interrupt: Z3 catches SIGINT during a check
    and answers "unknown" ("interrupted from keyboard"; limits say "canceled")."""
    import z3

    outcome = solver.check(*assumptions)
    if outcome == z3.unknown and "interrupted" in solver.reason_unknown():
        raise KeyboardInterrupt
    return outcome


def _rlimit_count(solver) -> int:
    """Z3's resource count so far: one pass over the statistics through the C API (the Python
    wrapper lists every key, then looks the key up again: most of a small check's cost)."""
    import z3

    ctx, stats = solver.ctx.ref(), z3.Z3_solver_get_statistics(solver.ctx.ref(), solver.solver)
    z3.Z3_stats_inc_ref(ctx, stats)
    try:
        for i in range(z3.Z3_stats_size(ctx, stats)):
            if z3.Z3_stats_get_key(ctx, stats, i) == "rlimit count":
                return int(z3.Z3_stats_get_uint_value(ctx, stats, i)
                           if z3.Z3_stats_is_uint(ctx, stats, i)
                           else z3.Z3_stats_get_double_value(ctx, stats, i))
        return 0
    finally:
        z3.Z3_stats_dec_ref(ctx, stats)
