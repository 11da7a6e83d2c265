"""`solve`: search a schedule for a problem (Tessel repetend + completion) and compare it with
the hand-written templates on the same placement."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from pyplan.errors import InfeasibleError
from pyplan.problem import Problem
from pyplan.problem.schedule import Schedule, build_schedule
from pyplan.solver.bounds import check_fits, min_memory
from pyplan.solver.budget import LAYOUT_SECONDS, Budget, Clock, Effort
from pyplan.solver.complete import (COMPLETION_COST, WINDOW_LIMIT, cheap_completion, climb,
                                    climb_step_work, complete, complete_whole, exact_applies,
                                    improve_in_windows, search_whole, whole_applies)
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
WINDOWS_EFFORT = 20_000_000     # and for reordering windows of a small one (<= 160 instances)
RECOMPUTE_LADDER = 16           # recomputation sets scored with the templates
RECOMPUTE_SOLVED = 2            # and of those, solved in full besides none and all
RECOMPUTE_WORK = 200_000_000    # effort units for all of those solves together (x effort)
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
    """Lower bound of a repetend period: the busiest device's load per micro-batch, and on each
    device a micro-batch's least memory-time over the capacity."""
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
    phase_seconds: dict[str, float] = field(default_factory=dict)
    """Wall seconds by phase: templates, search (the repetend), completion, proof (Z3 on the
    period, the core's exhaustive search and Z3 on windows of the schedule or the whole
    problem). For reports: no decision of the search depends on time, only on counted work."""

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
    """The whole solve's budget: the plan's time limit and its effort."""
    limit = problem.search.time_limit
    return Budget(DEFAULT_TIME_LIMIT if limit is None else limit,
                  effort=Effort(problem.search.effort))


def recompute_ladder(problem: Problem, budget: Budget) -> list[tuple[int, ...]]:
    """Sets of `auto` blocks to recompute, from none to all, each adding one block: first on
    the devices that the fastest template, run without a memory limit, overfills most, and
    there the block that saves the most memory per unit of time it adds."""
    blocks = problem.blocks
    free = dataclasses.replace(problem, memory_capacity=None, device_memory=())
    fastest = min((b for b in baselines(free, budget).values() if b.applicable),
                  key=lambda b: b.makespan, default=None)
    over = [0] * problem.num_devices
    if fastest is not None and problem.limited:
        over = [0 if c is None else max(0, peak - c)
                for peak, c in zip(fastest.peak_memory, problem.capacities)]
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
    # Each choice its own effort, and a share of RECOMPUTE_WORK as its cap: however large the
    # plan, the work is bounded and the same on every machine (the time limit stays a cap
    # too, shared out the same way).
    left = int(RECOMPUTE_WORK * problem.search.effort)
    for k, rung in enumerate(chosen):
        if results:
            best = min((s.schedule.makespan, len(r)) for s, r in results)
            if (problem.with_recompute(rung).makespan_bound(), len(rung)) >= best:
                continue
        effort = Effort(problem.search.effort, cap=max(1, left // (len(chosen) - k)))
        share = Budget(max(0.0, budget.remaining()) / (len(chosen) - k), effort=effort)
        try:
            results.append((_solve(problem.with_recompute(rung), share, progress), rung))
        except InfeasibleError as exc:
            failure = exc if failure is None or rung == ladder[-1] else failure
            continue
        finally:
            left -= effort.work
        if results[-1][0].schedule.makespan <= bound:
            break  # no choice does better
    if not results:
        raise failure
    best, rung = min(results, key=lambda item: (item[0].schedule.makespan, len(item[1])))
    notes = [f"recompute: {len(rung)} of {len(ladder[-1])} auto blocks chosen"
             + "".join(f"; {len(r)} recomputed: makespan {s.schedule.makespan}"
                       for s, r in results if r != rung)]
    # A proof of the chosen choice's search holds for that choice of blocks only.
    best.stats.notes[:] = [n.replace("no shorter schedule exists", "no shorter schedule exists "
                                     "with these blocks recomputed")
                           for n in best.stats.notes]
    best.stats.notes.extend(notes)
    proven = best.schedule.makespan <= bound
    timed_out = budget.timed_out() or any(s.status == "time_limit" for s, _ in results)
    return dataclasses.replace(
        best, status="optimal" if proven else "time_limit" if timed_out else "feasible",
        lower_bound=bound, search_seconds=time.monotonic() - started)


def _solve(problem: Problem, budget: Budget, progress: Progress | None) -> Solution:
    started = time.monotonic()
    clock = Clock()
    check_fits(problem)
    lower_bound = problem.makespan_bound()
    with clock("templates"):
        templates = baselines(problem, budget)
        held = incumbents(problem, templates)
    incumbent = min(held.items(), key=lambda item: _held(item[1]), default=None)
    # A template that meets the lower bound is optimal: then look only for a repetend as good
    # (the fast path and its cheap completion, without Z3): it extends to any N, may hold less
    # memory, and written as a repetend it stays small (100,000 micro-batches of a template's
    # orders are a resolved plan too large to read).
    settled = incumbent is not None and incumbent[1].makespan <= lower_bound
    exact = problem.search.exact and not settled
    instances = len(problem.blocks) * problem.num_micro_batches
    # A tiny problem is searched whole right after the cheap completions: usually that proves
    # the best of them optimal. Up to WINDOW_LIMIT instances, Z3 reorders windows of the whole
    # schedule instead of solving its warmup and cooldown (the phases seldom pay there, and
    # their allowance is what the NN-shape's search spent most of its time on).
    tiny = exact and whole_applies(problem)
    stats = SearchStats()
    found = None
    # The search leaves time for laying out the completion, which is linear in the instances.
    search = budget.reserving(min(budget.seconds / 2, instances * LAYOUT_SECONDS))
    completion = _Completion(problem, budget, search, stats,
                             exact=exact and instances > WINDOW_LIMIT, target=lower_bound,
                             progress=progress, clock=clock,
                             incumbent=incumbent[1].makespan if incumbent else None)
    early = None  # the fast path's repetend completed, before a search for a shorter period

    def fast(result: RepetendSearch) -> bool:
        """Complete the fast path's repetend; True when that meets the lower bound (then no
        shorter period can give a shorter schedule: the search ends at once)."""
        nonlocal early
        early = completion.run(result, first_step=True)
        return early[0] is not None and early[0].makespan <= lower_bound

    budget.progress()  # the templates are the first incumbents
    try:
        with clock("search"):
            found = search_repetend(problem, budget=search, exact=exact, stats=stats,
                                    progress=progress, thorough=not settled, fast=fast,
                                    clock=clock)
    except InfeasibleError:
        if incumbent is None:
            raise explain(problem, budget) from None
    schedule, notes, origin = _best(found, completion, early, incumbent, first_step=settled)
    proven = schedule.makespan <= lower_bound
    if tiny and not proven:
        with clock("proof"):
            searched, proven = search_whole(problem, schedule, budget=budget, notes=notes)
        if searched is not schedule:
            schedule, origin = searched, "search"
    if problem.search.exact and not proven:
        with clock("proof"):
            shorter = improve_in_windows(problem, schedule, budget=budget.slice(
                budget.units(WINDOWS_EFFORT), fixed=True), target=lower_bound, notes=notes)
        if shorter is not schedule:
            schedule, origin = shorter, "search"
            proven = schedule.makespan <= lower_bound
    if problem.search.exact and not proven:
        with clock("proof"):
            schedule, origin, proven = _whole(problem, budget, schedule, origin, notes)
    timed_out = budget.timed_out() or (found is not None and found.timed_out)
    if found is not None and found.stalled and schedule.repetend is not None:
        notes.append(f"search: no shorter period after {_work(found.stalled)} units of work "
                     f"without progress (effort {budget.effort.scale:g})")
    stats.notes.extend(notes)
    stats.work = budget.effort.work if budget.effort is not None else 0
    status = "optimal" if proven else "time_limit" if timed_out else "feasible"
    period_status = None
    if schedule.repetend is not None and found is not None:
        # (a longer period completed first may have won: its period is not the proven one)
        minimal = found.proven_optimal and schedule.repetend.period <= found.repetend.period
        period_status = ("optimal" if minimal else
                         "time_limit" if found.timed_out else "feasible")
    return Solution(schedule, status, lower_bound, problem.period_bound(),
                    time.monotonic() - started, templates, stats, origin, period_status,
                    clock.seconds)


def _best(found: RepetendSearch | None, completion: _Completion, early, incumbent, *,
          first_step: bool) -> tuple[Schedule, list[str], str]:
    """The best of the search's completion (its first step only, or all of it), the fast
    path's completion and the best template that fits: its schedule, notes and origin. At
    the same makespan the one that holds less memory wins (the search, on a tie)."""
    schedule, notes = None, []
    if found is not None:
        schedule, notes = completion.run(found, first_step=first_step)
        # A longer period completed first stays only if it is strictly shorter.
        if early is not None and early[0] is not None and \
                early[0].makespan < schedule.makespan:
            schedule, notes = early
    origin = "search"
    if incumbent is not None and (schedule is None or _held(incumbent[1]) < _held(schedule)):
        origin, schedule = incumbent
        notes = [f"completion: the {origin} template; no searched schedule is shorter "
                 "(or as short in less memory)"]
    return schedule, notes, origin


def _whole(problem: Problem, budget: Budget, schedule: Schedule, origin: str,
           notes: list[str]) -> tuple[Schedule, str, bool]:
    """The whole problem with Z3 (tiny problems): a shorter schedule, or a proof that there is
    none; the schedule, its origin and whether it is proven optimal."""
    whole, proven = complete_whole(problem, schedule, budget=budget.slice(
        budget.units(WHOLE_EFFORT), fixed=True), notes=notes)
    if whole is not schedule:
        return whole, "search", proven
    return schedule, origin, proven or schedule.makespan <= problem.makespan_bound()


def _work(units: int) -> str:
    """Effort units for a note: 12.3M."""
    return f"{units / 1e6:.1f}M" if units >= 100_000 else f"{units:,}"


class _Completion:
    """Completion of the best repetends, across the searches of one solve: the fast path's
    repetend first (an incumbent while a shorter period is searched), then the final one.
    Completions, ranks and local-search starts are remembered, so that a repetend completed
    for the first is not completed again."""

    def __init__(self, problem: Problem, budget: Budget, search: Budget, stats: SearchStats,
                 *, exact: bool, target: int, progress: Progress | None, clock: Clock,
                 incumbent: int | None) -> None:
        self.problem, self.budget, self.search, self.stats = problem, budget, search, stats
        self.clock = clock
        self.exact, self.target, self.progress = exact, target, progress
        self.shortest = incumbent  # the shortest makespan seen in this solve (progress)
        self.slice = budget.slice(budget.units(COMPLETION_EFFORT), fixed=True)
        self.done: dict = {}  # (repetend, with Z3) -> (schedule, notes): each completion once
        self.cheap: dict = {}  # repetend -> its cheap completion (Z3's starting point)
        self.climbed: set = set()  # repetends the local search started from
        self.climbing = budget.units(CLIMB_WORK)  # instance evaluations left for it
        self.k, self.n = len(problem.blocks), problem.num_micro_batches

    def completed(self, rep, with_z3: bool, bound: int):
        key = (repetend_key(rep), with_z3)
        if key not in self.done:
            if self.progress is not None:
                self.progress.update(phase="completion", n_r=rep.num_micro_batches,
                                     candidates=self.stats.candidates, best=rep.period,
                                     bound=bound)
            notes: list[str] = []
            if key[0] not in self.cheap:
                self.cheap[key[0]] = cheap_completion(self.problem, rep, self.target)
                self.budget.charge(COMPLETION_COST * self.k * self.n)
            candidate, _ = complete(self.problem, rep, exact=with_z3, budget=self.slice,
                                    notes=notes, target=self.target, cheap=self.cheap[key[0]])
            self.done[key] = candidate, notes
            if self.shortest is None or candidate.makespan < self.shortest:
                self.shortest = candidate.makespan
                self.budget.progress()
        return self.done[key]

    def run(self, found: RepetendSearch, *, first_step: bool) -> tuple[Schedule, list[str]]:
        """The best completion of repetends with `found`'s period. The pool grows in steps
        (ranked within the search budget) while no completion meets the lower bound and the
        effort allows: the modulo schedules of each N_R, then Tessel's best candidates of
        each N_R for more and more work. Every candidate gets its cheap completion (periodic
        order, phases list-scheduled); after each step a local search starts from the best
        candidates not searched from yet (each with a share of CLIMB_WORK); from the step with
        POOL_WORK // 3 on, the best of all candidates seen so far also get Z3's warmup and
        cooldown, which cost more than ranking that many candidates. `first_step`: the first
        step only."""
        with self.clock("completion"):
            return self._run(found, first_step=first_step)

    def _run(self, found: RepetendSearch, *, first_step: bool) -> tuple[Schedule, list[str]]:
        problem, budget = self.problem, self.budget
        seen: dict = {}  # repetend -> (its rank by cheap completion, the repetend)
        schedule, best_notes = None, []

        def finished() -> bool:
            return schedule is not None and (schedule.makespan <= self.target or
                                             budget.expired())

        def consider(rep, with_z3: bool = False) -> None:
            nonlocal schedule, best_notes
            candidate, notes = self.completed(rep, with_z3, found.lower_bound)
            if not with_z3:
                seen.setdefault(repetend_key(rep), (_rank(candidate), rep))
            if schedule is None or _rank(candidate) < _rank(schedule):
                schedule, best_notes = candidate, notes

        # What one local search may spend: a share of CLIMB_WORK (times the effort), or where
        # two steps cost more (large plans), two steps of what is left: the best candidates
        # are searched from first.
        share = max(budget.units(CLIMB_WORK // POOL_SIZE),
                    2 * climb_step_work(problem, max_repetend_micro_batches(problem)))
        steps = pool_steps(problem)
        for work in steps[:1] if first_step else steps:
            pool = candidate_pool(problem, found.repetend, budget=self.search, stats=self.stats,
                                  work=budget.units(work) if work else 0,
                                  modulo=work == steps[0])  # (the same at every step)
            # Laying out a completion is linear in the instances: where the time limit does not
            # allow one per candidate, the best-ranked (shortest periodic schedule) alone.
            if not budget.allows_template(self.k * self.n * len(pool)):
                pool = pool[:1]
            z3_due = work >= POOL_WORK // 3 or work == steps[-1]
            rounds = (False, True) if self.exact and z3_due else (False,)
            for with_z3 in rounds:
                if with_z3:  # the best candidates of every step so far
                    pool = [rep for _, rep in sorted(seen.values(), key=lambda x: x[0])]
                    pool = pool[:POOL_SIZE]
                for rep in pool:
                    if finished() and schedule is not None:
                        break
                    if with_z3 and not exact_applies(problem, rep, self.slice):
                        continue  # it would give the cheap completion again
                    consider(rep, with_z3)
            # Local search from the best candidates so far, before ranking more of them.
            for _, rep in sorted(seen.values(), key=lambda x: x[0])[:POOL_SIZE]:
                key = repetend_key(rep)
                work = min(share, self.climbing)
                if finished() or work < climb_step_work(problem, max_repetend_micro_batches(
                        problem)) or self.cheap[key] is None or key in self.climbed:
                    continue
                self.climbed.add(key)
                self.climbing -= work
                for step, completion_of_step in climb(
                        problem, rep, self.cheap[key], target=self.target, budget=budget,
                        max_micro_batches=max_repetend_micro_batches(problem), work=work):
                    self.cheap[repetend_key(step)] = completion_of_step
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
