"""`solve`: search a schedule for a problem (Tessel repetend + completion) and compare it with
the hand-written templates on the same placement."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pyplan import _core
from pyplan.errors import InfeasibleError
from pyplan.problem import Problem
from pyplan.schedule import Schedule, build_schedule
from pyplan.solver.complete import complete, complete_whole
from pyplan.solver.exact import Effort, infeasibility_core
from pyplan.solver.search import SearchStats, candidate_pool, search_repetend
from pyplan.solver.templates import TEMPLATES, Baseline, baselines
from pyplan.spec.units import count

__all__ = ["DEFAULT_TIME_LIMIT", "TEMPLATES", "Baseline", "Solution", "incumbents", "min_memory",
           "solve"]

DEFAULT_TIME_LIMIT = 60.0
COMPLETION_EFFORT = 30_000_000  # Z3 resource units for completing the pool (about 2 s here)
WHOLE_EFFORT = 80_000_000       # and for solving a tiny problem (<= 48 blocks) whole
EXPLAIN_LIMIT = 120             # instances: up to this an infeasible plan gets an unsat core


@dataclass(frozen=True)
class Solution:
    schedule: Schedule
    status: str
    """optimal (the makespan is proven minimal: it meets the lower bound, or Z3 proved it),
    feasible, or time_limit (the search stopped at the time limit)."""
    lower_bound: int
    """Makespan lower bound for the plan's micro-batches."""
    period_bound: int
    """Lower bound of a repetend period (the busiest device's load per micro-batch)."""
    search_seconds: float
    baselines: dict[str, Baseline]
    stats: SearchStats = field(default_factory=SearchStats)
    origin: str = "search"
    """Where the schedule comes from: "search", or the template that no searched schedule
    beat (templates that fit memory and follow the order rules are the search's incumbents)."""
    period_status: str | None = None
    """For a schedule with a repetend: optimal (no shorter period exists among repetends of at
    most max_repetend_micro_batches), feasible or time_limit."""

    @property
    def gap(self) -> float:
        """How far the makespan may be from the optimum, relative to the lower bound."""
        return (self.schedule.makespan - self.lower_bound) / max(1, self.lower_bound)


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


def incumbents(problem: Problem, templates: dict[str, Baseline]) -> dict[str, Schedule]:
    """The templates that fit memory and keep the plan's order rules, as schedules (rules on
    other devices may delay some blocks; they still hold)."""
    out = {}
    for name, base in templates.items():
        if not base.applicable or not base.fits_memory:
            continue
        try:
            out[name] = build_schedule(problem, base.orders, None, ())
        except RuntimeError:  # the plan's order rules deadlock it, or push it over memory
            continue
    return out


def solve(problem: Problem, *, progress=None) -> Solution:
    """Search a schedule no longer than any template that fits. Raises InfeasibleError when
    none exists."""
    started = time.monotonic()
    _check_fits(problem)
    limit = problem.search.time_limit
    limit = DEFAULT_TIME_LIMIT if limit is None else limit
    deadline = started + limit
    lower_bound = problem.makespan_bound()
    templates = baselines(problem, deadline)
    held = incumbents(problem, templates)
    incumbent = min(held.items(), key=lambda item: item[1].makespan, default=None)
    # A template that meets the lower bound is optimal: then look only for a repetend as good
    # (it extends to any N), without Z3.
    settled = incumbent is not None and incumbent[1].makespan <= lower_bound
    exact = problem.search.exact and not settled
    stats = SearchStats()
    found = None
    try:
        found = search_repetend(problem, time_limit=limit, exact=exact, stats=stats,
                                progress=progress, thorough=not settled)
    except InfeasibleError:
        if incumbent is None:
            raise _explain(problem, deadline) from None
    schedule, best_notes = None, []
    if found is not None:
        pool = candidate_pool(problem, found.repetend, time_limit=deadline - time.monotonic(),
                              stats=stats, thorough=not settled)
        effort = Effort(COMPLETION_EFFORT)
        # Periodic completions of every candidate first (cheap); Z3 only if none meets the
        # lower bound.
        for with_z3 in (False, True) if exact else (False,):
            for rep in pool:
                if schedule is not None and (schedule.makespan <= lower_bound or
                                             time.monotonic() >= deadline):
                    break
                if progress is not None:
                    progress.update(phase="completion", n_r=rep.num_micro_batches,
                                    candidates=stats.candidates, best=rep.period,
                                    bound=found.lower_bound)
                notes: list[str] = []
                candidate, _ = complete(problem, rep, exact=with_z3, deadline=deadline,
                                        effort=effort, notes=notes, target=lower_bound)
                if schedule is None or _rank(candidate) < _rank(schedule):
                    schedule, best_notes = candidate, notes
    origin = "search"
    if incumbent is not None and (schedule is None or incumbent[1].makespan < schedule.makespan):
        origin, schedule = incumbent
        best_notes = [f"completion: the {origin} template; no searched schedule is shorter"]
    proven = schedule.makespan <= lower_bound
    if problem.search.exact and not proven:
        whole, proven = complete_whole(problem, schedule, deadline=deadline,
                                       effort=Effort(WHOLE_EFFORT), notes=best_notes)
        if whole is not schedule:
            schedule, origin = whole, "search"
    timed_out = time.monotonic() >= deadline or (found is not None and found.timed_out)
    stats.notes.extend(best_notes)
    seconds = time.monotonic() - started
    status = "optimal" if proven else "time_limit" if timed_out else "feasible"
    period_status = None
    if schedule.repetend is not None and found is not None:
        period_status = ("optimal" if found.proven_optimal else
                         "time_limit" if found.timed_out else "feasible")
    return Solution(schedule, status, lower_bound, problem.graph.load_bound(), seconds,
                    templates, stats, origin, period_status)


def _explain(problem: Problem, deadline: float) -> InfeasibleError:
    """Name what makes the plan infeasible: the order rules of a minimal unsat core (each at
    its position), or the least memory that admits the rules. A schedule of N micro-batches,
    cut to its first n, is one of n (rules naming a missing micro-batch hold vacuously), so
    what rules out n micro-batches rules out N."""
    span = max((abs(r.before_shift - r.after_shift) + 1 + r.min_m for r in problem.rules),
               default=1)
    n = min(problem.num_micro_batches, max(2, span))
    small = problem.with_overrides(micro_batches=n)
    generic = InfeasibleError("no schedule satisfies the memory capacity and order rules",
                              hint="raise memory: or relax constraints:")
    if len(problem.blocks) * n > EXPLAIN_LIMIT or time.monotonic() >= deadline:
        return generic
    core = infeasibility_core(small, deadline=deadline, effort=Effort(WHOLE_EFFORT))
    if not core:
        return generic
    rules = [problem.rules[int(label.split()[1])] for label in core if label != "memory"]
    file = problem.source_path or None
    if not rules:
        need = _least_memory(small, deadline)
        return InfeasibleError(
            f"the order rules need more memory than the capacity "
            f"{problem.show_memory(problem.memory_capacity)} for {count(n, 'micro-batch')}",
            hint=(f"raise memory: to at least {problem.show_memory(need)}" if need else
                  "raise memory: or relax constraints:"))
    where = ", ".join(f"line {r.line} '{r.text}'" for r in rules)
    memory = (f" within the memory capacity {problem.show_memory(problem.memory_capacity)}"
              if "memory" in core else "")
    first = rules[0]
    return InfeasibleError(
        f"no schedule of {count(n, 'micro-batch')} keeps these order rules together"
        f"{memory}: {where}",
        hint="relax or remove one of them" + (" or raise memory:" if memory else ""),
        file=file, line=first.line or 1, column=first.column or 1)


def _least_memory(problem: Problem, deadline: float) -> int | None:
    """The least capacity with a schedule (bisection with Z3), or None if Z3 cannot tell."""
    lo = problem.memory_capacity + 1
    hi = sum(max(0, b.memory) * len(b.devices) for b in problem.blocks) * \
        problem.num_micro_batches
    found = None
    while lo <= hi:
        if time.monotonic() >= deadline:
            return None  # what is known so far is not a proof of the least capacity
        mid = (lo + hi) // 2
        core = infeasibility_core(problem.with_overrides(memory=mid), deadline=deadline,
                                  effort=Effort(WHOLE_EFFORT))
        if core is None:  # a schedule exists (or Z3 gave up: then stay on the safe side)
            found, hi = mid, mid - 1
        else:
            lo = mid + 1
    return found


def _rank(schedule: Schedule):
    """Shorter makespan, then fewer micro-batches in the repetend, then less memory."""
    nr = schedule.repetend.num_micro_batches if schedule.repetend else 0
    return schedule.makespan, nr, sum(schedule.peak_memory)
