"""What `show`, `export` and `import` read: a resolved plan as written (a stale one with a
warning), a plan solved in memory with progress on the terminal, or a template's schedule."""

from __future__ import annotations

import sys
from pathlib import Path

from pyplan.cli._progress import live_progress
from pyplan.errors import PlanError
from pyplan.problem import Problem, load_problem
from pyplan.resolved import ResolvedPlan, is_resolved, load_resolved
from pyplan.problem.schedule import Schedule
from pyplan.solver import solve
from pyplan.solver.templates import template_schedule

__all__ = ["load_plan", "load_schedule", "pick_schedule"]


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
