"""`solve`: search a schedule for a problem (Tessel repetend + completion) and compare it with
the hand-written templates on the same placement."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from pyplan.errors import InfeasibleError
from pyplan.problem import Problem
from pyplan.schedule import Schedule, build_schedule
from pyplan.solver.bounds import check_fits, min_memory
from pyplan.solver.budget import LAYOUT_SECONDS, Budget
from pyplan.solver.complete import (cheap_completion, climb, complete, complete_whole,
                                    exact_applies)
from pyplan.solver.explain import explain
from pyplan.solver.search import (POOL_SIZE, POOL_WORK, Progress, RepetendSearch, SearchStats,
                                  candidate_pool, max_repetend_micro_batches, pool_steps,
                                  repetend_key, search_repetend)
from pyplan.solver.templates import TEMPLATES, Baseline, baselines

__all__ = ["DEFAULT_TIME_LIMIT", "TEMPLATES", "Baseline", "Solution", "incumbents", "min_memory",
           "recompute_ladder", "solve", "solve_recompute"]

DEFAULT_TIME_LIMIT = 60.0
COMPLETION_EFFORT = 30_000_000  # Z3 resource units for completing the pool (about 2 s here)
WHOLE_EFFORT = 80_000_000       # and for solving a tiny problem (<= 48 blocks) whole
RECOMPUTE_LADDER = 16           # recomputation sets scored with the templates
RECOMPUTE_SOLVED = 2            # and of those, solved in full besides none and all
CLIMB_WORK = 10_000_000         # instance evaluations for the local search (about 0.3 s)


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
    beat: none shorter, none as short in less memory (templates that fit memory and follow the
    order rules are the search's incumbents)."""
    period_status: str | None = None
    """For a schedule with a repetend: optimal (no shorter period exists among repetends of at
    most max_repetend_micro_batches), feasible or time_limit."""

    @property
    def gap(self) -> float:
        """How far the makespan may be from the optimum, relative to the lower bound."""
        return (self.schedule.makespan - self.lower_bound) / max(1, self.lower_bound)


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


def solve(problem: Problem, *, progress: Progress | None = None) -> Solution:
    """Search a schedule no longer than any template that fits. Raises InfeasibleError when
    none exists. The stages, in order: bounds, incumbents (templates), repetend, completion,
    ranking (and for tiny problems, the whole schedule with Z3). With `recompute: auto`
    blocks, which of them to recompute is decided too (see solve_recompute)."""
    if problem.recompute_choices():
        return solve_recompute(problem, progress=progress)
    return _solve(problem, _budget(problem), progress)


def _budget(problem: Problem) -> Budget:
    """The whole solve's budget: the plan's time limit."""
    limit = problem.search.time_limit
    return Budget(DEFAULT_TIME_LIMIT if limit is None else limit)


def recompute_ladder(problem: Problem, budget: Budget) -> list[tuple[int, ...]]:
    """Sets of `auto` blocks to recompute, from none to all, each adding one block: first on
    the devices that the fastest template, run without a memory limit, overfills most, and
    there the block that saves the most memory per unit of time it adds."""
    blocks = problem.blocks
    free = dataclasses.replace(problem, memory_capacity=None)
    fastest = min((b for b in baselines(free, budget).values() if b.applicable),
                  key=lambda b: b.makespan, default=None)
    over = [0] * problem.num_devices
    if fastest is not None and problem.memory_capacity is not None:
        over = [max(0, peak - problem.memory_capacity) for peak in fastest.peak_memory]
    ranked = sorted(problem.recompute_choices(),
                    key=lambda i: (-max(over[d] for d in blocks[i].devices),
                                   -(blocks[i].memory - blocks[i].recompute_memory)
                                   / blocks[i].time, i))
    sizes = range(len(ranked) + 1)
    if len(ranked) > RECOMPUTE_LADDER:  # evenly spaced rungs, none and all included
        sizes = sorted({round(k * len(ranked) / RECOMPUTE_LADDER)
                        for k in range(RECOMPUTE_LADDER + 1)})
    return [tuple(sorted(ranked[:k])) for k in sizes]


def solve_recompute(problem: Problem, *, progress: Progress | None = None) -> Solution:
    """Choose the `auto` blocks to recompute with the schedule. Every rung of the ladder is
    scored by its best fitting template (cheap); no recomputation, full recomputation and the
    best-scored rungs are solved in full, and the shortest makespan wins (ties: fewer blocks
    recomputed). So the result is never longer than `never` (when it fits) or `always`. It is
    `optimal` only when it meets a bound no choice can beat: the plan with every `auto` block's
    memory as recomputed and none of the time it costs."""
    started = time.monotonic()
    budget = _budget(problem)
    ladder = recompute_ladder(problem, budget)
    scored = []
    for rung in ladder[1:-1]:
        candidate = problem.with_recompute(rung)
        fitting = [b.makespan for b in baselines(candidate, budget).values()
                   if b.applicable and b.fits_memory]
        if fitting:
            scored.append((min(fitting), len(rung), rung))
    # The best-scored rungs first: a rung whose own lower bound cannot beat (or tie with fewer
    # blocks) what is found already is not solved (the work stays bounded, the same on any
    # machine).
    chosen = [rung for *_, rung in sorted(scored)[:RECOMPUTE_SOLVED]] + [ladder[-1], ladder[0]]
    chosen = list(dict.fromkeys(chosen))
    bound = problem.with_recompute(problem.recompute_choices(), rerun=False).makespan_bound()
    results, failure = [], None
    for k, rung in enumerate(chosen):
        if results:
            best = min((s.schedule.makespan, len(r)) for s, r in results)
            if (problem.with_recompute(rung).makespan_bound(), len(rung)) >= best:
                continue
        share = Budget(max(0.0, budget.remaining()) / (len(chosen) - k))
        try:
            results.append((_solve(problem.with_recompute(rung), share, progress), rung))
        except InfeasibleError as exc:
            failure = exc if failure is None or rung == ladder[-1] else failure
            continue
        if results[-1][0].schedule.makespan <= bound:
            break  # no choice does better
    if not results:
        raise failure
    best, rung = min(results, key=lambda item: (item[0].schedule.makespan, len(item[1])))
    notes = [f"recompute: {len(rung)} of {len(ladder[-1])} auto blocks chosen"
             + "".join(f"; {len(r)} recomputed: makespan {s.schedule.makespan}"
                       for s, r in results if r != rung)]
    best.stats.notes.extend(notes)
    proven = best.schedule.makespan <= bound
    timed_out = budget.expired() or any(s.status == "time_limit" for s, _ in results)
    return dataclasses.replace(
        best, status="optimal" if proven else "time_limit" if timed_out else "feasible",
        lower_bound=bound, search_seconds=time.monotonic() - started)


def _solve(problem: Problem, budget: Budget, progress: Progress | None) -> Solution:
    started = time.monotonic()
    check_fits(problem)
    lower_bound = problem.makespan_bound()
    templates = baselines(problem, budget)
    held = incumbents(problem, templates)
    incumbent = min(held.items(), key=lambda item: _held(item[1]), default=None)
    # A template that meets the lower bound is optimal: then look only for a repetend as good
    # (it extends to any N), without Z3.
    settled = incumbent is not None and incumbent[1].makespan <= lower_bound
    exact = problem.search.exact and not settled
    stats = SearchStats()
    found = None
    # The search leaves time for laying out the completion, which is linear in the instances.
    instances = len(problem.blocks) * problem.num_micro_batches
    search = budget.reserving(min(budget.seconds / 2, instances * LAYOUT_SECONDS))
    try:
        found = search_repetend(problem, budget=search, exact=exact, stats=stats,
                                progress=progress, thorough=not settled)
    except InfeasibleError:
        if incumbent is None:
            raise explain(problem, budget) from None
    schedule, notes = None, []
    if found is not None:
        schedule, notes = _complete_best(problem, found, budget, search, stats, exact=exact,
                                         settled=settled, target=lower_bound, progress=progress)
    origin = "search"
    # At the same makespan the one that holds less memory wins (the search, on a tie).
    if incumbent is not None and (schedule is None or _held(incumbent[1]) < _held(schedule)):
        origin, schedule = incumbent
        notes = [f"completion: the {origin} template; no searched schedule is shorter "
                 "(or as short in less memory)"]
    proven = schedule.makespan <= lower_bound
    if problem.search.exact and not proven:
        whole, proven = complete_whole(problem, schedule, budget=budget.slice(WHOLE_EFFORT),
                                       notes=notes)
        if whole is not schedule:
            schedule, origin = whole, "search"
    timed_out = budget.expired() or (found is not None and found.timed_out)
    stats.notes.extend(notes)
    status = "optimal" if proven else "time_limit" if timed_out else "feasible"
    period_status = None
    if schedule.repetend is not None and found is not None:
        period_status = ("optimal" if found.proven_optimal else
                         "time_limit" if found.timed_out else "feasible")
    return Solution(schedule, status, lower_bound, problem.graph.load_bound(),
                    time.monotonic() - started, templates, stats, origin, period_status)


def _complete_best(problem: Problem, found: RepetendSearch, budget: Budget, search: Budget,
                   stats: SearchStats, *, exact: bool, settled: bool, target: int,
                   progress: Progress | None = None) -> tuple[Schedule, list[str]]:
    """Completion of the best repetends. The pool grows in steps (ranked within the `search`
    budget) while no completion meets the lower bound: the modulo schedules of each N_R, then
    Tessel's best candidates of each N_R for more and more work. Every candidate gets its cheap
    completion (periodic order, phases list-scheduled); after each step a local search starts
    from the best candidates not searched from yet (each with a share of CLIMB_WORK); from the
    step with POOL_WORK // 3 on, the best of all candidates seen so far also get Z3's warmup
    and cooldown, which cost more than ranking that many candidates."""
    completion = budget.slice(COMPLETION_EFFORT)
    done: dict = {}  # (repetend, with Z3) -> (schedule, notes): each completion once
    cheap: dict = {}  # repetend -> its cheap completion (Z3's starting point)
    seen: dict = {}  # repetend -> (its rank by cheap completion, the repetend)
    climbed: set = set()  # repetends the local search started from
    schedule, best_notes = None, []

    def finished() -> bool:
        return schedule is not None and (schedule.makespan <= target or budget.expired())

    def completed(rep, with_z3: bool):
        key = (repetend_key(rep), with_z3)
        if key not in done:
            if progress is not None:
                progress.update(phase="completion", n_r=rep.num_micro_batches,
                                candidates=stats.candidates, best=rep.period,
                                bound=found.lower_bound)
            notes: list[str] = []
            if key[0] not in cheap:
                cheap[key[0]] = cheap_completion(problem, rep, target)
            candidate, _ = complete(problem, rep, exact=with_z3, budget=completion,
                                    notes=notes, target=target, cheap=cheap[key[0]])
            done[key] = candidate, notes
        return done[key]

    def consider(rep, with_z3: bool = False) -> None:
        nonlocal schedule, best_notes
        candidate, notes = completed(rep, with_z3)
        if not with_z3:
            seen.setdefault(repetend_key(rep), (_rank(candidate), rep))
        if schedule is None or _rank(candidate) < _rank(schedule):
            schedule, best_notes = candidate, notes

    climbing = CLIMB_WORK  # instance evaluations left for the local search
    share = CLIMB_WORK // POOL_SIZE  # what one search may spend

    steps = pool_steps(problem)
    for work in steps[:1] if settled else steps:
        pool = candidate_pool(problem, found.repetend, budget=search, stats=stats, work=work,
                              modulo=work == steps[0])  # (the same at every step)
        # Laying out a completion is linear in the instances: where the time limit does not
        # allow one per candidate, the best-ranked (shortest periodic schedule) alone.
        if not budget.allows_template(len(problem.blocks) * problem.num_micro_batches
                                      * len(pool)):
            pool = pool[:1]
        z3_due = work >= POOL_WORK // 3 or work == steps[-1]
        rounds = (False, True) if exact and z3_due else (False,)
        for with_z3 in rounds:
            if with_z3:  # the best candidates of every step so far
                pool = [rep for _, rep in sorted(seen.values(), key=lambda x: x[0])]
                pool = pool[:POOL_SIZE]
            for rep in pool:
                if finished():
                    break
                if with_z3 and not exact_applies(problem, rep, completion):
                    continue  # it would give the cheap completion again
                consider(rep, with_z3)
        # Local search from the best candidates so far, before ranking more of them.
        for _, rep in sorted(seen.values(), key=lambda x: x[0])[:POOL_SIZE]:
            key = repetend_key(rep)
            if finished() or climbing < share or cheap[key] is None or key in climbed:
                continue
            climbed.add(key)
            climbing -= share
            for step, completion_of_step in climb(
                    problem, rep, cheap[key], target=target, budget=budget,
                    max_micro_batches=max_repetend_micro_batches(problem), work=share):
                cheap[repetend_key(step)] = completion_of_step
                consider(step)
        if finished():
            break
    return schedule, best_notes


def _held(schedule: Schedule):
    """Shorter makespan, then less memory."""
    return schedule.makespan, sum(schedule.peak_memory)


def _rank(schedule: Schedule):
    """Shorter makespan, then fewer micro-batches in the repetend, then less memory."""
    nr = schedule.repetend.num_micro_batches if schedule.repetend else 0
    return schedule.makespan, nr, sum(schedule.peak_memory)
