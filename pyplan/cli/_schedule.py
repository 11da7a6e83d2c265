"""What `show`, `export` and `import` read: a resolved plan as written, a plan solved in memory,
a hand-written template on the plan's placement, or any per-device orders evaluated as given."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from pyplan import _core
from pyplan.cli._progress import live_progress
from pyplan.errors import PlanError
from pyplan.problem import Problem, load_problem, reaches
from pyplan.resolved import ResolvedPlan, load_resolved
from pyplan.schedule import Instance, Schedule
from pyplan.solver import TEMPLATES, solve
from pyplan.solver.templates import NotApplicable, template_orders
from pyplan.spec.schema import did_you_mean

__all__ = ["Evaluated", "is_resolved", "load_plan", "load_schedule", "pick_schedule",
           "schedule_from_orders", "template_schedule"]

_RESOLVED = re.compile(rb"^pyplan_resolved:", re.MULTILINE)


def is_resolved(path: str | Path) -> bool:
    """Whether the file is a resolved plan (unreadable files are left to the plan loader)."""
    try:
        with open(path, "rb") as handle:  # the marker is near the top; never read a whole file
            return _RESOLVED.search(handle.read(4096)) is not None
    except (OSError, ValueError):
        return False


def load_plan(path: str | Path) -> tuple[Problem, ResolvedPlan | None]:
    """The problem of a plan or resolved plan, and the resolved plan when it is one."""
    if is_resolved(path):
        resolved = load_resolved(path)
        try:  # a stale plan still shows what it says; say that it is stale
            resolved.check_fresh()
        except PlanError as exc:
            print(str(exc).replace(": error: ", ": warning: ", 1), file=sys.stderr)
        return resolved.problem, resolved
    return load_problem(path), None


def load_schedule(path: str | Path, template: str | None = None) -> Schedule:
    """The resolved plan's schedule, the plan's solved in memory, or a template's."""
    return pick_schedule(*load_plan(path), template)


def pick_schedule(problem: Problem, resolved: ResolvedPlan | None,
                  template: str | None = None) -> Schedule:
    if template is not None:
        return template_schedule(problem, template)
    if resolved is not None:
        return resolved.schedule
    with live_progress(True) as shown:
        return solve(problem, progress=shown).schedule


def template_schedule(problem: Problem, name: str) -> Schedule:
    if name not in TEMPLATES:
        raise PlanError(f"unknown template '{name}'", hint=did_you_mean(name, TEMPLATES)
                        or f"choose one of {', '.join(TEMPLATES)}")
    try:
        orders = template_orders(problem, name)
    except NotApplicable as exc:
        raise PlanError(f"template {name} does not fit {problem.name}: {exc}") from None
    # A template is its own order rule, and its memory is reported rather than enforced.
    return schedule_from_orders(problem, orders, problem.num_micro_batches).schedule


@dataclass(frozen=True)
class Evaluated:
    """A schedule evaluated as given."""

    schedule: Schedule
    fits_memory: bool
    follows_rules: bool | None
    """None when the plan has no order rules."""


def _deadlock_position(problem: Problem, holds, where) -> tuple[int, int]:
    """Where a deadlock's orders break: an action placed ahead of one it depends on (a certain
    mistake), else the first action in the cycle that holds a device."""
    holders = [(tuple(h), tuple(w)) for h, w in holds if tuple(h) in where]
    for (hb, hm), (wb, wm) in holders:
        if hm == wm and reaches(problem.edges, wb, hb):
            return where[(hb, hm)]
    return where[holders[0][0]] if holders else (1, 1)


def schedule_from_orders(problem: Problem, orders, num_micro_batches: int, *,
                         file: str | None = None,
                         where: dict[Instance, tuple[int, int]] | None = None) -> Evaluated:
    """Every block as early as its inputs, devices and the given orders allow (the core's
    evaluation). PlanError when the orders cannot run, at the (line, column) `where` gives for
    the action out of place; memory beyond capacity is reported."""
    problem = problem.with_overrides(micro_batches=num_micro_batches)
    graph, n = problem.graph, num_micro_batches
    lists = [list(order) for order in orders]
    ev = _core.evaluate(graph, lists, memory_capacity=problem.capacity,
                        complete_micro_batches=n, enforce_rules=False)
    fits = ev.ok
    if not ev.ok:  # over capacity or deadlocked: which one?
        ev = _core.evaluate(graph, lists, complete_micro_batches=n, enforce_rules=False)
        if not ev.ok:
            at = _deadlock_position(problem, ev.deadlock_holds, where or {})
            raise PlanError(f"the schedule cannot run: {ev.reason}",
                            hint="each rank's actions must follow the dependencies", file=file,
                            line=at[0], column=at[1])
    follows = None
    if problem.rules:  # rules that hold leave every start time where it was
        ruled = _core.evaluate(graph, lists, complete_micro_batches=n)
        follows = ruled.ok and list(ruled.start) == list(ev.start)
    frozen = tuple(tuple(tuple(inst) for inst in order) for order in orders)
    schedule = Schedule(problem, frozen, None, tuple(() for _ in orders), frozen,
                        tuple(ev.start), ev.makespan, tuple(ev.busy), tuple(ev.peak_memory),
                        ev.bubble_rate)
    return Evaluated(schedule, fits, follows)
