"""`solve`: search a schedule for a problem (Tessel repetend + completion) and compare it with
the hand-written templates on the same placement."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pyplan import _core
from pyplan.errors import InfeasibleError
from pyplan.problem import Problem
from pyplan.schedule import Schedule
from pyplan.solve.complete import complete, complete_whole
from pyplan.solve.exact import Effort
from pyplan.solve.search import SearchStats, candidate_pool, search_repetend
from pyplan.solve.templates import TEMPLATES, Baseline, baselines

__all__ = ["DEFAULT_TIME_LIMIT", "TEMPLATES", "Baseline", "Solution", "min_memory", "solve"]

DEFAULT_TIME_LIMIT = 60.0
COMPLETION_EFFORT = 30_000_000  # Z3 resource units for completing the pool (about 2 s here)
WHOLE_EFFORT = 80_000_000       # and for solving a tiny problem (<= 48 blocks) whole


@dataclass(frozen=True)
class Solution:
    schedule: Schedule
    status: str
    """optimal (the repetend period is proven minimal), feasible, or time_limit."""
    lower_bound: int
    """Makespan lower bound for the plan's micro-batches."""
    period_bound: int
    """Lower bound of a repetend period (the busiest device's load per micro-batch)."""
    search_seconds: float
    baselines: dict[str, Baseline]
    stats: SearchStats = field(default_factory=SearchStats)


def min_memory(problem: Problem) -> list[int]:
    """Peak memory per device of one micro-batch run alone in dependency order."""
    order = problem.graph.topological_order()
    orders = [[(b, 0) for b in order if d in problem.blocks[b].devices]
              for d in range(problem.num_devices)]
    return list(_core.evaluate(problem.graph, orders).peak_memory)


def _check_fits(problem: Problem) -> None:
    if problem.memory_capacity is None:
        return
    need = min_memory(problem)
    worst = max(range(problem.num_devices), key=lambda d: need[d])
    if need[worst] > problem.memory_capacity:
        raise InfeasibleError(
            f"one micro-batch alone needs {problem.show_memory(need[worst])} on device {worst}, "
            f"more than the capacity {problem.show_memory(problem.memory_capacity)}",
            hint=f"the smallest memory that admits one micro-batch is "
                 f"{problem.show_memory(max(need))}; raise memory: or split blocks")


def solve(problem: Problem, *, progress=None) -> Solution:
    """Search a schedule. Raises InfeasibleError when none exists."""
    started = time.monotonic()
    _check_fits(problem)
    limit = problem.search.time_limit
    limit = DEFAULT_TIME_LIMIT if limit is None else limit
    stats = SearchStats()
    found = search_repetend(problem, time_limit=limit, exact=problem.search.exact, stats=stats,
                            progress=progress)
    deadline = started + limit
    pool = candidate_pool(problem, found.repetend, time_limit=deadline - time.monotonic(),
                          stats=stats)
    schedule, best_notes = None, []
    lower_bound = problem.graph.makespan_bound(problem.num_micro_batches)
    effort = Effort(COMPLETION_EFFORT)
    for rep in pool:
        if schedule is not None and (schedule.makespan <= lower_bound or
                                     time.monotonic() >= deadline):
            break
        if progress is not None:
            progress.update(phase="completion", n_r=rep.num_micro_batches,
                            candidates=stats.candidates, best=rep.period,
                            bound=found.lower_bound)
        notes: list[str] = []
        candidate, _ = complete(problem, rep, exact=problem.search.exact, deadline=deadline,
                                effort=effort, notes=notes)
        if schedule is None or _rank(candidate) < _rank(schedule):
            schedule, best_notes = candidate, notes
    if problem.search.exact and schedule.makespan > lower_bound:
        schedule = complete_whole(problem, schedule, deadline=deadline,
                                  effort=Effort(WHOLE_EFFORT), notes=best_notes)
    completion_cut = time.monotonic() >= deadline
    stats.notes.extend(best_notes)
    seconds = time.monotonic() - started
    if found.timed_out or completion_cut:
        status = "time_limit"
    elif found.proven_optimal:
        status = "optimal"
    else:
        status = "feasible"
    return Solution(schedule, status, lower_bound, found.lower_bound, seconds,
                    baselines(problem), stats)


def _rank(schedule: Schedule):
    """Shorter makespan, then fewer micro-batches in the repetend, then less memory."""
    nr = schedule.repetend.num_micro_batches if schedule.repetend else 0
    return schedule.makespan, nr, sum(schedule.peak_memory)
